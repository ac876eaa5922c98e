"""Saving and loading a server: its state dict, file, fingerprints, checks and migration.

:class:`ServerPersistence` is the half of
:class:`~mapmatched_torch.serving.server.MapMatchedServer` that turns its sessions into a
saved state and back (docs/serving-guarantees.md): ``state_dict`` / ``save`` write the
session table, the previous queries, the slot table and the chunk codes with the
fingerprints of the graph, the settings and a learned model, and one checksum over the
whole content; ``load_state_dict`` / ``load`` verify all of it before anything changes,
refuse a state made over another graph, settings or model (``migrate=True`` renumbers a
state whose graph has the same IDs in another order; ``legacy=True`` reads an older
format), and commit all or nothing. The other half (sessions and steps) lives in
:mod:`.server`, which mixes this class in; the mixin reads the server's attributes
(``graph``, ``settings``, ``learned``, ``_store``, ``_sessions``, ``_previous_queries``,
``_built``, ``_lock``, ...) and has no state of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable, Dict, List, Mapping, Tuple, Union

import torch

from ..core.errors import MapMatchedResourceError, MapMatchedValueError, out_of_memory
from ..core.files import atomic_path
from ..core.signals import deferred_sigint
from ..kernels.slot_persistence import state_checksum as decoder_checksum
from ..providers.query_mixing import previous_query_entry, previous_query_of_entry
from ._state import STATE_FORMAT, content_digest, fingerprint_differences, graph_fingerprint, same_but_order
from .locking import serialized
from .session_ids import SessionId, plain_id, restored_id
from .step_results import BuiltPaths

__all__ = ["ServerPersistence"]

_STATE_KEYS = frozenset({"version", "options", "graph", "store", "sessions", "previous_queries", "graph_codes"})


class ServerPersistence:
    """The state dict, file, verification and all-or-nothing load of a server (see the module)."""

    @serialized
    def state_dict(self) -> Dict[str, Any]:
        """The session store (every session's turns and decoder state), the session IDs by
        slot, the previous queries, the options and the graph's fingerprint, sealed by one
        SHA-256 ``checksum`` over all of it (format 3, see
        ``docs/serving-guarantees.md``): plain tensors and Python values, loadable with
        ``torch.load(..., weights_only=True)``."""
        sessions = [[plain_id(session_id), slot] for session_id, slot in self._sessions.items()]
        previous_queries = [[slot, *previous_query_entry(text)] for slot in sorted(self._previous_queries)
                            for text in [self._previous_query(slot)] if text is not None]
        store = self._store.state_dict()
        state: Dict[str, Any] = {
            "version": STATE_FORMAT,
            "options": self._options(),
            "graph": self._graph_fingerprint(),
            "store": store,
            "sessions": sessions,
            "previous_queries": previous_queries,
            "graph_codes": self._graph_codes_used(store["decoder"]["tensors"]["payload.codes"]),
        }
        state["checksum"] = content_digest(state)
        return state

    def _graph_fingerprint(self) -> Dict[str, Any]:
        """The graph's :func:`~mapmatched_torch.serving._state.graph_fingerprint` (made once:
        the graph is immutable)."""
        if self._fingerprint is None:
            self._fingerprint = graph_fingerprint(self.graph)
        return dict(self._fingerprint)

    def _graph_codes_used(self, codes: torch.Tensor) -> List[List[Any]]:
        """``[[code, node ID], ...]`` of every graph node code in the saved ``(C, T, M)``
        codes (O(C T M)): what ``migrate=True`` renumbers by."""
        nodes = self._store.codes.graph_nodes
        if nodes == 0:
            return []
        present = torch.zeros(nodes, dtype=torch.bool)
        present[codes[(codes >= 0) & (codes < nodes)]] = True
        used = present.nonzero().view(-1).tolist()
        return [[code, name] for code, name in zip(used, self._store.codes.names(used))]

    def _options(self) -> Dict[str, Any]:
        """The options a saved state must match (what :meth:`state_dict` records)."""
        settings = self.settings
        return {
            "candidate_limit": self.candidate_limit,
            "emission_weight": settings.emission_weight,
            "transition_weight": settings.transition_weight,
            "score_normalization": settings.score_normalization,
            "fixed_lag": settings.fixed_lag,
            "context_radius": self.context_radius,
            "context_limit": self.context_limit,
            # a learned transition model's fingerprint (only with one: fixed-beta states are unchanged)
            **({"transitions": self.learned.fingerprint()} if self.learned is not None else {}),
        }

    @serialized
    def load_state_dict(self, state: Mapping[str, Any], *, migrate: bool = False, legacy: bool = False) -> None:
        """Restore :meth:`state_dict` into a server built with the same options over the same graph.

        Everything is verified before anything changes: the checksum over the whole state,
        the graph's fingerprint (node IDs in order, maximum distance, directedness,
        edges), the options (candidate limit, lambda, beta, normalization, lag, context
        options), the store's tensors and chunk codes, and that every session owns a
        distinct live slot. A refused state raises
        :class:`~mapmatched_torch.core.errors.MapMatchedValueError` naming what differs
        or is damaged, and leaves the running server exactly as it was.

        Args:
            state: what :meth:`state_dict` returned (after ``torch.load``).
            migrate: also load a state saved over a tensor graph with the same node IDs
                (and edges and distance settings) in another order: its chunk codes are
                renumbered to this graph's node indices. Nothing else is migrated.
            legacy: also load a state without the whole-state checksum (saved before
                format 3, or with the checksum removed): only its parts' own checks run,
                so an edit of its session IDs or options may go unseen. Off by default.
        """
        if not isinstance(state, Mapping):
            raise MapMatchedValueError(f"refusing the server state: expected a mapping, got {type(state).__name__}; "
                                       "nothing was changed")
        version = state.get("version")
        if version == 1:
            raise MapMatchedValueError(
                "refusing the server state: it was saved by an older version of the server (state version 1); "
                "nothing was changed"
            )
        if version == 2 or (version == STATE_FORMAT and "checksum" not in state):
            if not legacy:
                raise MapMatchedValueError(
                    "refusing the server state: it has no whole-state checksum (saved before state format 3, or the "
                    "checksum was removed), so a damaged or edited state could not be told apart; "
                    "load_state_dict(state, legacy=True) loads it with only its parts' own checks; nothing was changed")
            if version == 2:
                return self._load_legacy(state)
        elif version != STATE_FORMAT:
            raise MapMatchedValueError(f"refusing the server state: unknown state version {version!r} (this server "
                                       f"reads {STATE_FORMAT}); nothing was changed")
        if set(state) - {"checksum"} != _STATE_KEYS:
            raise MapMatchedValueError(
                f"refusing the server state: expected the entries {sorted(_STATE_KEYS | {'checksum'})}, got "
                f"{sorted(map(str, state))}; nothing was changed")
        if "checksum" in state:
            content = {key: value for key, value in state.items() if key != "checksum"}
            if state["checksum"] != content_digest(content):
                raise MapMatchedValueError(
                    "refusing the server state: its content does not match its checksum (a damaged or edited "
                    "state); nothing was changed")
        mine = self._graph_fingerprint()
        differing = fingerprint_differences(state["graph"], mine)
        store = state["store"]
        if differing:
            movable = isinstance(state["graph"], dict) and same_but_order(state["graph"], mine)
            if not (migrate and movable):
                hint = (" It holds the same node IDs in another order: load_state_dict(state, migrate=True) (or "
                        "load(path, migrate=True)) renumbers its chunk codes." if movable else "")
                raise MapMatchedValueError(
                    "refusing the server state: it was saved over another graph (its chunk codes and distances "
                    f"belong to that graph): {'; '.join(differing)}; nothing was changed.{hint}")
            store = self._renumbered(store, state["graph_codes"])
        options = self._options()
        if state["options"] != options:
            saved = state["options"] if isinstance(state["options"], dict) else {}
            keys = [*options, *(key for key in saved if key not in options)]  # (a learned model's, saved or here)
            named = [f"{key} (saved {saved.get(key, 'absent')!r}, this {options.get(key, 'absent')!r})" for key in keys
                     if saved.get(key, "absent") != options.get(key, "absent")] or [f"saved {state['options']!r}"]
            raise MapMatchedValueError("refusing the server state: it was saved with other options: "
                                       f"{'; '.join(named)}; nothing was changed")
        self._restore(lambda: (state["sessions"], state["previous_queries"], store))

    def _load_legacy(self, state: Mapping[str, Any]) -> None:
        """A format-2 state (``legacy=True``): its options, its entries checksum where it
        has one, and its parts' own checks."""
        options = self._options()
        if state.get("options") != options:
            raise MapMatchedValueError(f"server state does not match this server: saved options {state.get('options')}, "
                                       f"these {options}")
        try:
            if "entries_checksum" in state and state["entries_checksum"] != _entries_checksum(
                    state["sessions"], state.get("previous_queries", [])):
                raise MapMatchedValueError(
                    "refusing the server state: the session IDs or previous queries do not match their checksum "
                    "(a damaged file?); nothing was changed")
        except MapMatchedValueError:
            raise
        except Exception as error:
            raise MapMatchedValueError(f"refusing the server state: malformed sessions ({error!r}); nothing was "
                                       "changed") from error
        self._restore(lambda: (state["sessions"], state.get("previous_queries", []), state["store"]))

    def _renumbered(self, store: Any, graph_codes: Any) -> Dict[str, Any]:
        """``store`` (a saved store state) with its graph node codes renumbered to this
        graph's node indices by ``graph_codes`` (``[[saved code, node ID], ...]``), its
        decoder checksum renewed; MapMatchedValueError when they do not cover the codes."""
        nodes = self._store.codes.graph_nodes
        try:
            decoder = dict(store["decoder"])
            tensors = dict(decoder["tensors"])
            codes = tensors["payload.codes"]
            old = [int(code) for code, _ in graph_codes]
            new = self.graph.vocabulary.indices_of([str(name) for _, name in graph_codes])
            mapping = torch.full((nodes,), -1, dtype=torch.long)
            if old:
                if len(set(old)) != len(old) or min(old) < 0 or max(old) >= nodes or min(new) < 0:
                    raise MapMatchedValueError("graph_codes must name distinct saved codes of this graph's node IDs")
                mapping[torch.tensor(old)] = torch.tensor(new, dtype=torch.long)
            graph = (codes >= 0) & (codes < nodes)
            moved = torch.where(graph, mapping[codes.clamp(0, max(nodes - 1, 0))] if nodes else codes, codes)
            if bool((graph & (moved < 0)).any()):
                raise MapMatchedValueError("a saved code is missing from graph_codes")
        except MapMatchedValueError as error:
            raise MapMatchedValueError(f"refusing to migrate the server state: {error}; nothing was changed") from error
        except Exception as error:
            raise MapMatchedValueError(f"refusing to migrate the server state: malformed ({error!r}); nothing was "
                                       "changed") from error
        tensors["payload.codes"] = moved
        decoder["tensors"] = tensors
        decoder["checksum"] = decoder_checksum(decoder)
        return dict(store, decoder=decoder)

    def _restore(self, parts: Callable[[], Tuple[Any, Any, Any]]) -> None:
        """Check the sessions and previous queries, load the store (checked), then commit
        (``parts``: the saved sessions, previous queries and store)."""
        try:
            saved_sessions, saved_previous, store = parts()
            sessions = _parsed_sessions(saved_sessions)
            previous_queries = _parsed_previous_queries(saved_previous, sessions)
        except MapMatchedValueError:
            raise
        except Exception as error:  # a malformed entry: say so, change nothing
            if out_of_memory(error):
                raise MapMatchedResourceError(f"out of memory while restoring the server state ({error!r}): a "
                                              "resource failure, not a malformed state; nothing was changed") from error
            raise MapMatchedValueError(f"refusing the server state: malformed sessions ({error!r}); nothing was changed") from error
        restored: Dict[int, Tuple[str, int]] = {}

        def check(checked: Mapping[str, Any]) -> None:
            _check_slots(sessions, checked)
            lengths = checked["tensors"]["lengths"]
            restored.update((slot, (text, int(lengths[slot]))) for slot, text in previous_queries.items())

        built = BuiltPaths()  # results handed out before keep their own tensors, codes and built paths
        with deferred_sigint():  # the store's load is all or nothing; then assignments
            self._store.load_state_dict(store, also_check=check)
            self._sessions, self._previous_queries, self._built, self._live_results = sessions, restored, built, []

    @serialized
    def save(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """Write :meth:`state_dict` to ``path`` atomically: into a temporary file beside it,
        flushed to disk, then renamed over ``path``, so a crash leaves the old file or the
        new one, never a torn one."""
        with atomic_path(path) as temporary:  # mapmatched_torch.core.files
            torch.save(self.state_dict(), temporary)

    @serialized
    def load(self, path: Union[str, "os.PathLike[str]"], *, migrate: bool = False, legacy: bool = False) -> None:
        """Restore a file written by :meth:`save` (``torch.load(weights_only=True)``, then
        :meth:`load_state_dict`). A torn, truncated or edited file is refused with a
        MapMatchedValueError naming it, and the running server is untouched. Running out
        of memory while reading it raises MapMatchedResourceError (a ``MemoryError``),
        not the malformed-file error; the server is untouched then too. ``migrate`` and
        ``legacy``: as for :meth:`load_state_dict`."""
        try:
            state = torch.load(os.fspath(path), weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as error:
            if out_of_memory(error):
                raise MapMatchedResourceError(
                    f"out of memory while reading the server state file {os.fspath(path)!r} "
                    f"({os.path.getsize(path)} bytes): {error.__class__.__name__}: {error}; a resource failure, not a "
                    "damaged file: free memory and load it again; nothing was changed"
                ) from error
            raise MapMatchedValueError(
                f"cannot read the server state file {os.fspath(path)!r}: {error.__class__.__name__}: {error} "
                "(a torn, truncated or foreign file?); nothing was changed"
            ) from error
        try:
            self.load_state_dict(state, migrate=migrate, legacy=legacy)
        except MapMatchedValueError as error:
            raise MapMatchedValueError(f"{os.fspath(path)!r}: {error}") from error


def _check_slots(sessions: Dict[SessionId, int], decoder_state: Mapping[str, Any]) -> None:
    """Every session owns a distinct live slot of a (validated) decoder state, and every
    live slot has a session; else MapMatchedValueError."""
    free, allocated = set(decoder_state["free"]), decoder_state["allocated"]
    seen: Dict[int, SessionId] = {}
    for session_id, slot in sessions.items():
        if not 0 <= slot < allocated or slot in free:
            raise MapMatchedValueError(
                f"refusing the server state: session {session_id!r} holds slot {slot}, which the decoder "
                f"state does not have live (allocated {allocated}, free {sorted(free)}); nothing was changed"
            )
        if slot in seen:
            raise MapMatchedValueError(
                f"refusing the server state: sessions {seen[slot]!r} and {session_id!r} share slot {slot}; "
                "nothing was changed"
            )
        seen[slot] = session_id
    if len(seen) != allocated - len(free):
        raise MapMatchedValueError(
            f"refusing the server state: {allocated - len(free)} live slots but {len(seen)} sessions; nothing was changed"
        )


def _parsed_sessions(entries: Any) -> Dict[SessionId, int]:
    """The saved ``[session ID, slot]`` pairs as a dict (lists back to tuples)."""
    sessions: Dict[SessionId, int] = {}
    for session_id, slot in entries:
        session_id = restored_id(session_id)
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise MapMatchedValueError(f"refusing the server state: session {session_id!r} has slot {slot!r}")
        if session_id in sessions:
            raise MapMatchedValueError(f"refusing the server state: session {session_id!r} appears twice")
        sessions[session_id] = slot
    return sessions


#: The entries of a format-3 state besides its checksum.


def _entries_checksum(sessions: Any, previous_queries: Any) -> str:
    """SHA-256 of the saved session IDs by slot and previous queries of a format-2 state
    (``legacy=True``; format 3 has one checksum over everything)."""
    text = json.dumps([sessions, previous_queries], sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _parsed_previous_queries(entries: Any, sessions: Dict[SessionId, int]) -> Dict[int, str]:
    """The saved ``[[slot, query text], ...]`` (absent in states saved before it existed):
    each slot a live session's, once, each text a non-empty string."""
    live = set(sessions.values())
    if not isinstance(entries, (list, tuple)):
        raise MapMatchedValueError(f"refusing the server state: previous_queries must be a list, got "
                                   f"{type(entries).__name__}; nothing was changed")
    parsed: Dict[int, str] = {}
    for entry in entries:
        previous = previous_query_of_entry(entry[1:]) if isinstance(entry, (list, tuple)) else None
        if not (previous is not None and type(entry[0]) is int and entry[0] in live and entry[0] not in parsed):
            raise MapMatchedValueError(f"refusing the server state: bad previous_queries entry {entry!r} (a live "
                                       f"session's slot, once, its query text and the vector searched for it, if "
                                       f"any); nothing was changed")
        parsed[entry[0]] = previous
    return parsed


#: What a session ID may be, for error messages.
