"""Saving and loading a slot table: its state dict, its checksum and its validation.

:class:`SlotTablePersistence` is the half of
:class:`~mapmatched_torch.kernels.slot_decoder.SlotDecoder` that turns the table into a
saved state and back; the other half (the table's storage and its step) lives in
:mod:`.slot_decoder`, which mixes this class in. A saved state is every tensor of the
table (CPU copies), the slot bookkeeping (free list, allocated count), the
configuration it must be loaded under and a SHA-256 checksum over all of it, so a torn
or edited file is refused before anything changes. Loading is two halves
(:meth:`~SlotTablePersistence.prepare_load` builds the new table and changes nothing;
:meth:`~SlotTablePersistence.commit_load` installs it with assignments only, SIGINT
held back), so an owner can prepare its own state between them and commit all or
nothing.

The mixin reads the table's attributes (``width``, ``emission_weight``,
``transition_weight``, ``fixed_lag``, ``dtype``, ``device``, ``initial_turn_capacity``,
``transitions`` (a learned model or None), ``_payload``, ``_names``, ``_tensors``, ``_free``, ``_allocated``) and its
``_grown`` / ``_blank_spec`` methods; it has no state of its own.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from typing import Any, Callable, Dict, Optional

import torch
from torch import Tensor

from ..core.errors import MapMatchedValueError
from ..core.signals import deferred_sigint
from .checks import first_true_index
from .transitions import transitions_fingerprint

__all__ = ["SlotTablePersistence", "state_checksum", "table_views"]

_INF = float("inf")

#: The layout of :meth:`SlotTablePersistence.state_dict` (2: the window holds transitions and distances).
_STATE_FORMAT = 3  # 3: a checksum over the tensors and the bookkeeping


class SlotTablePersistence:
    """The state dict, validation and two-phase load of a slot table (see the module docstring)."""


    def state_dict(self) -> Dict[str, object]:
        """Every tensor of the table (copies on the CPU: later steps do not change them),
        the slot bookkeeping and a SHA-256 checksum over all of it (so that a torn or
        bit-flipped file is refused by :meth:`load_state_dict`, not decoded from)."""
        tensors = {name: tensor.detach().to("cpu", copy=True) for name, tensor in self._tensors.items()}
        state: Dict[str, object] = {
            "tensors": tensors,
            "free": list(self._free),
            "allocated": self._allocated,
            "config": self._config(),
        }
        state["checksum"] = _checksum(state)
        return state

    def _config(self) -> Dict[str, object]:
        """The configuration a saved state must match."""
        return {
            "width": self.width,
            "emission_weight": self.emission_weight,
            "transition_weight": self.transition_weight,
            "fixed_lag": self.fixed_lag,
            "dtype": str(self.dtype).replace("torch.", ""),
            "format": _STATE_FORMAT,
            "payload": {name: [str(spec.dtype).replace("torch.", ""), spec.per_candidate] for name, spec in sorted(self._payload.items())},
            # a learned transition model's fingerprint (only with one: fixed-beta states are unchanged)
            **({"transitions": transitions_fingerprint(self.transitions)} if self.transitions is not None else {}),
        }

    def check_state(self, state: object, *, max_bytes: Optional[int] = None) -> None:
        """Validate a :meth:`state_dict` completely, touching nothing.

        Checks the configuration, the checksum, every tensor's name, dtype, shape
        (consistent with one capacity and one turn capacity), density (an expanded
        zero-stride tensor would be materialized at full size) and values (lengths,
        indices, finiteness), and the bookkeeping (``allocated`` within the capacity,
        the free list distinct allocated slots).

        Args:
            state: what :meth:`state_dict` returned (after ``torch.load``).
            max_bytes: refuse a state whose tensors would take more memory than this
                (None: no limit).

        Raises:
            MapMatchedValueError: naming the first problem.
        """
        _check_state(self, state, max_bytes)

    def load_state_dict(
        self,
        state: Dict[str, object],
        *,
        max_bytes: Optional[int] = None,
        also_check: Optional[Callable[[Dict[str, object]], None]] = None,
    ) -> None:
        """Restore :meth:`state_dict`: validated first (:meth:`check_state`), so a bad state
        leaves this decoder exactly as it was.

        Args:
            state: what :meth:`state_dict` returned.
            max_bytes: as for :meth:`check_state`.
            also_check: the owner's own checks of the validated state (e.g. the server's
                sessions against the free list), run before anything is replaced; what it
                raises propagates and nothing changes.
        """
        self.commit_load(self.prepare_load(state, max_bytes=max_bytes, also_check=also_check))

    def prepare_load(
        self,
        state: Dict[str, object],
        *,
        max_bytes: Optional[int] = None,
        also_check: Optional[Callable[[Dict[str, object]], None]] = None,
    ) -> tuple:
        """The first half of :meth:`load_state_dict`: validate ``state`` and build the new
        table from it, changing nothing; :meth:`commit_load` installs what it returns
        (for an owner that prepares its own state between the two)."""
        _check_state(self, state, max_bytes)
        if also_check is not None:
            also_check(state)
        saved = state["tensors"]
        # this table's turn capacities are its initial one times powers of two (what it grows
        # and shrinks through): a state saved by a table of another initial capacity moves to
        # the smallest of them that holds it, so growth and shrinking behave as if built here
        turns = self.initial_turn_capacity
        while turns < int(saved["alphas"].shape[1]):
            turns *= 2
        capacity = int(saved["lengths"].shape[0])
        # copies: two decoders loaded from one state must not write into each other
        storage = self._grown(capacity, turns, {name: tensor.to(self.device) for name, tensor in saved.items()})
        lengths = saved["lengths"]
        longest = int(lengths.max()) if lengths.numel() else 0
        free = list(state["free"])
        heapq.heapify(free)  # (the lowest free slot is reused first; an older state's list was a stack)
        return storage, table_views(storage), longest, free, int(state["allocated"])

    def commit_load(self, prepared: tuple) -> None:
        """Install what :meth:`prepare_load` returned (assignments only, SIGINT held back)."""
        storage, views, longest, free, allocated = prepared
        with deferred_sigint():
            self._storage, self._tensors = storage, views
            self._longest_bound, self._free, self._allocated, self._undo = longest, free, allocated, None


def table_views(storage: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """The table's tensors: every storage tensor without its last row (the spare slot)."""
    return {name: tensor[: tensor.shape[0] - 1] for name, tensor in storage.items()}


def _checksum(state: Dict[str, Any]) -> str:
    """SHA-256 over the tensors (name, dtype, shape, bytes) and the bookkeeping."""
    digest = hashlib.sha256()
    for name in sorted(state["tensors"]):
        tensor = state["tensors"][name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    bookkeeping = {"free": state["free"], "allocated": state["allocated"], "config": state["config"]}
    digest.update(json.dumps(bookkeeping, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def state_checksum(state: Dict[str, Any]) -> str:
    """The checksum :meth:`SlotTablePersistence.state_dict` records for ``state`` (its tensors and
    bookkeeping): for an owner that rewrites a saved state (a server renumbering its chunk
    codes) and seals it again."""
    return _checksum(state)


def _state_error(problem: str) -> MapMatchedValueError:
    return MapMatchedValueError(f"refusing the slot decoder state: {problem} (nothing was changed)")


def _check_state(decoder: "SlotTablePersistence", state: Any, max_bytes: Optional[int]) -> None:
    """See :meth:`SlotTablePersistence.check_state`."""
    if not isinstance(state, dict) or set(state) != {"tensors", "free", "allocated", "config", "checksum"}:
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise _state_error(
            f"expected the keys ['allocated', 'checksum', 'config', 'free', 'tensors'], got {keys} "
            f"(a state saved by an older version, or not a slot decoder state)"
        )
    mine = decoder._config()
    if state["config"] != mine:
        raise _state_error(f"configuration differs: saved {state['config']}, this decoder {mine}")
    tensors = state["tensors"]
    names = decoder._names
    if not isinstance(tensors, dict) or set(tensors) != set(names):
        got = sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__
        raise _state_error(f"expected the tensors {sorted(names)}, got {got}")
    total = 0
    for name in names:
        tensor = tensors[name]
        if not isinstance(tensor, Tensor):
            raise _state_error(f"{name} is a {type(tensor).__name__}, not a tensor")
        size = tensor.numel() * tensor.element_size()
        if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() < size:
            raise _state_error(f"{name} is not a dense tensor (strides {tensor.stride()}): saved states always are")
        total += size
    if max_bytes is not None and total > max_bytes:
        raise _state_error(f"its tensors take {total} bytes, more than max_bytes={max_bytes}")
    lengths = tensors["lengths"]
    if lengths.dim() != 1:
        raise _state_error(f"lengths must be (capacity,), got shape {tuple(lengths.shape)}")
    capacity, turns = lengths.shape[0], tensors["alphas"].shape[1] if tensors["alphas"].dim() == 3 else -1
    if capacity < 1 or turns < 1:
        raise _state_error(f"capacity {capacity} and turn capacity {turns} must be positive")
    for name in names:
        expected = decoder._blank_spec(name, capacity, turns)
        tensor = tensors[name]
        if tuple(tensor.shape) != expected[0] or tensor.dtype != expected[1]:
            raise _state_error(
                f"{name} must be {expected[1]} of shape {expected[0]} (capacity {capacity}, turn capacity {turns}), "
                f"got {tensor.dtype} of shape {tuple(tensor.shape)}"
            )
    allocated, free = state["allocated"], state["free"]
    if isinstance(allocated, bool) or not isinstance(allocated, int) or not 0 <= allocated <= capacity:
        raise _state_error(f"allocated must be an int in [0, {capacity}], got {allocated!r}")
    if not isinstance(free, list) or any(isinstance(slot, bool) or not isinstance(slot, int) for slot in free):
        raise _state_error(f"free must be a list of slot indices, got {free!r}")
    if len(set(free)) != len(free) or any(not 0 <= slot < allocated for slot in free):
        raise _state_error(f"free must list distinct allocated slots in [0, {allocated}), got {free}")
    if state["checksum"] != _checksum(state):
        raise _state_error("the checksum does not match its contents (a torn, truncated or edited file)")
    width = decoder.width
    problems = {
        "lengths outside [0, turn capacity]": (lengths < 0) | (lengths > turns),
        "lengths of never-allocated slots": lengths[allocated:] != 0,
        "backpointers outside [0, width)": (tensors["backpointers"] < 0) | (tensors["backpointers"] >= width),
        "argmax outside [-1, width)": (tensors["argmax"] < -1) | (tensors["argmax"] >= width),
        "NaN or +inf forward scores": torch.isnan(tensors["alphas"]) | (tensors["alphas"] == _INF),
        "non-finite emissions": ~torch.isfinite(tensors["emissions"]),
        **({"non-finite link transitions": ~torch.isfinite(tensors["link_transitions"])}
           if "link_transitions" in tensors else {}),
        "non-finite window transitions": ~torch.isfinite(tensors["window"]),
        "negative or non-finite distances": ~(tensors["link_distances"] >= 0) | (tensors["link_distances"] == _INF),
        "negative or non-finite window distances": ~(tensors["window_distances"] >= 0)
        | (tensors["window_distances"] == _INF),
    }
    for problem, bad in problems.items():
        if bool(bad.any()):
            raise _state_error(f"{problem} (first at index {first_true_index(bad)})")
