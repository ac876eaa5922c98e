"""The incremental max-plus decoder: a slot table of live conversations on one device.

:class:`SlotDecoder` keeps, for every open conversation (a *slot*), the per-turn state
of the max-plus dynamic program in preallocated tensors, so that a new turn of S
conversations costs one batched M x M step (plus, with a fixed lag L, L more steps to
recompute the uncommitted tail under the new lock) and one batched backtrack -- never
a re-run of earlier turns. The results equal re-decoding every whole trellis with the
standalone decoder (same paths, committed turns, forward scores bit for bit).

State per slot (``C`` slots, ``T`` turn capacity, ``M`` candidates, all on ``device``):

- ``alphas`` (C, T, M): forward scores of every turn, under the current locks;
- ``backpointers`` (C, T, M) long: best predecessor of every candidate;
- ``link_distances`` (C, T, M) float64: the graph distance from each candidate's
  backpointer to it, so the distances along any decoded path are one gather (a decoded
  path always follows the backpointers, also with locks);
- ``emissions`` (C, T, M), ``allowed`` (C, T, M) bool (real candidates and locks);
- ``window`` (C, L+1, M, M) (fixed lag only): the weighted transitions into the newest
  L+1 turns, for the tail recomputation, and ``window_distances`` (C, L+1, M, M)
  float64 the distances they came from, for the rewritten turns' ``link_distances``;
  ``argmax`` (C, T) long (beta = 0 only).

Two ways in: :meth:`SlotDecoder.step` takes normalized scores and raw distances and
weights them (lambda here, beta through
:func:`~mapmatched_torch.kernels.transitions.weighted_transitions`);
:meth:`SlotDecoder.step_weighted` takes emissions and transitions already weighted (any
transition model; the streaming states of :mod:`mapmatched_torch.kernels.states`).

An owner can keep its own per-turn values in the same table (``payload``: e.g. a
server's candidate node indices and raw scores): they grow, shrink, clear, undo, save
and validate with the decoder's own state, so there is one slot table, not two to
keep in step.

Steps are transactional per conversation: a conversation whose forward scores overflow
gets ``ok = False`` and its slot is left exactly as it was; the others commit.

Saving and loading the table is :mod:`.slot_persistence` (mixed in). This module stays
above the project's ~700 lines on purpose: it is one class whose storage, growth and
shrinking, step (fixed and learned transitions, full and fixed lag) and undo log share
one private state, and splitting them would spread that state's invariants over
modules; about a third of it is docstrings.
"""

from __future__ import annotations

import copy
import heapq
from typing import Any, Dict, List, NamedTuple, Optional, Union

import torch
from torch import Tensor

from ..core.checks import check_positive_int
from ..core.errors import MapMatchedValueError
from ..core.signals import deferred_sigint
from . import chain, fused_step
from .slot_persistence import SlotTablePersistence, table_views
from .semiring import MAX_PLUS
from ..core.settings import DecodeSettings, DecodingMode, HoldsSettings
from .transitions import check_learned_transitions, weighted_transitions

__all__ = ["SlotDecoder", "SlotStep", "PayloadSpec"]

_INF = float("inf")


class SlotStep(NamedTuple):
    """The decode of S slots: what :meth:`SlotDecoder.step` and :meth:`SlotDecoder.current` return.

    Attributes:
        ok: (S,) bool; False where the step's forward scores overflowed (that slot is
            unchanged, and the other fields describe it as it still is).
        paths: (S, T) long decoded candidate index per turn, -1 after the end (T is the
            longest of these slots' lengths, at least 1: a step's cost follows the
            sessions in it, not the longest session the table ever held).
        path_distances: (S, T) float64 graph distance into each turn along the path
            (0 at turn 0; 0 everywhere when beta = 0 or without distances).
        final_scores: (S, M) forward scores of the newest turn under the locks (-inf at
            padding and locked-out candidates): the ranking of the final candidates.
        lengths: (S,) long number of turns of each slot.

    With a learned transition model, :meth:`SlotDecoder.path_costs` gives the cost of
    each move along ``paths`` (the fixed model's is ``beta * path_distances``).
    """

    ok: Tensor
    paths: Tensor
    path_distances: Tensor
    final_scores: Tensor
    lengths: Tensor


_STATE_TENSORS = (
    "alphas", "backpointers", "link_distances", "emissions", "allowed", "argmax", "window", "window_distances", "lengths"
)


class PayloadSpec(NamedTuple):
    """One owner-defined per-turn tensor of a :class:`SlotDecoder` (see ``payload``).

    Attributes:
        dtype: its dtype. fill: the value of an empty cell.
        per_candidate: True: ``(C, T, M)`` (one value per candidate of each turn, written
            by :meth:`SlotDecoder.advance` at the new turn); False: ``(C, T)`` (one value
            per turn, rows written by :meth:`SlotDecoder.put_rows`).
    """

    dtype: torch.dtype
    fill: Union[int, float, bool]
    per_candidate: bool = True


def _exchange(table: Tensor, where: tuple, values: Tensor) -> Tensor:
    """Write ``values`` into ``table[where]`` and return the cells' old values (a copy).

    ``where`` is ``(slots,)`` or ``(slots, turns)`` index tensors naming distinct cells
    (``slots`` and ``turns`` broadcast together); ``values`` broadcasts to the cells, as
    in ``table[where] = values``. A contiguous table is read and written through one
    flat row index (``index_select`` / ``index_copy_`` on the table seen as rows), about
    half the cost of the advanced indexing it equals.
    """
    cells = torch.broadcast_tensors(*where)
    shape = cells[0].shape + table.shape[len(where):]
    if not table.is_contiguous():
        old = table[where].clone()
        table[where] = values
        return old
    rows = cells[0].reshape(-1) * table.shape[1] + cells[1].reshape(-1) if len(where) == 2 else cells[0].reshape(-1)
    flat = table.view(-1, *table.shape[len(where):])
    old = flat.index_select(0, rows)
    flat.index_copy_(0, rows, values.to(table.dtype).expand(shape).reshape(old.shape))
    return old.view(shape)


def _links(distances: Tensor, backpointers: Tensor) -> Tensor:
    """(S, M) float64: ``distances[s, backpointers[s, i], i]``, the distance into each candidate."""
    return distances.gather(1, backpointers.unsqueeze(1)).squeeze(1)


class SlotDecoder(HoldsSettings, SlotTablePersistence):
    """A slot table of incremental max-plus decoders (full or fixed-lag).

    Args:
        width: M, the most candidates per turn (e.g. the retriever's candidate_limit).
        emission_weight, transition_weight: lambda and beta (fixed for the table).
        fixed_lag: None (full decoding) or L >= 0.
        settings: a :class:`~mapmatched_torch.core.settings.DecodeSettings` in place of
            the three options above (its normalization is not used here).
        capacity: initial number of slots (grows by doubling).
        turn_capacity: initial turns per slot (grows by doubling).
        dtype: of the scores (float64 for exact parity). device: where the table lives.
        payload: the owner's own per-turn tensors, name -> :class:`PayloadSpec`; read
            them with :meth:`payload`, write them with :meth:`advance`'s ``payload`` and
            :meth:`put_rows`. Part of the configuration a saved state must match.
        transitions: a learned transition model
            (:func:`~mapmatched_torch.kernels.transitions.check_learned_transitions`), or
            None for the fixed ``-(beta * d)``. With one, :meth:`step` makes the moves
            ``transitions(distances, features)`` (the settings' beta is not used for
            them; give the settings the model's beta so the mode matches), the table
            keeps the transition into each candidate (``link_transitions``, for
            :attr:`SlotStep.path_costs`), and a saved state carries the model's
            fingerprint.

    Attributes:
        settings: the :class:`~mapmatched_torch.core.settings.DecodeSettings` of the table.
        mode: the :class:`~mapmatched_torch.kernels.transitions.DecodingMode` of
            (beta, lag); ``mode.uses_distances`` is False at beta = 0 (pointwise: callers
            need not compute distances).

    Cost: a step of S conversations is O(S (L+1) M^2) time and one host-device round
    trip; memory O(C T M) plus O(C (L+1) M^2) with a lag.
    """

    def __init__(
        self,
        width: int,
        *,
        emission_weight: float = 1.0,
        transition_weight: float = 1.0,
        fixed_lag: Optional[int] = None,
        capacity: int = 16,
        turn_capacity: int = 8,
        dtype: torch.dtype = torch.float64,
        device: Optional[Union[str, torch.device]] = None,
        payload: Optional[Dict[str, PayloadSpec]] = None,
        settings: Optional[DecodeSettings] = None,
        transitions: Optional[Any] = None,
    ) -> None:
        self.width = check_positive_int(width, "width")
        self._payload = {f"payload.{name}": PayloadSpec(*spec) for name, spec in (payload or {}).items()}
        self.transitions = None if transitions is None else check_learned_transitions(transitions)
        # the table's device too (a copy: the caller's module stays where it is)
        self.transitions = _on_device(self.transitions, torch.empty(0, device=device).device)
        learned = ("link_transitions",) if self.transitions is not None else ()
        self._names = _STATE_TENSORS + learned + tuple(self._payload)
        self.settings = DecodeSettings.resolve(
            settings, emission_weight=emission_weight, transition_weight=transition_weight, fixed_lag=fixed_lag
        )
        self.mode: DecodingMode = self.settings.mode
        self.dtype = dtype
        # an allocation resolves "cuda" to "cuda:<current>", so device checks compare equal
        self.device = torch.empty(0, device=device).device
        self._free: List[int] = []
        self._allocated = 0
        self._tensors: Dict[str, Tensor] = {}
        #: every state tensor with one spare slot after the table's (index ``capacity``):
        #: a step without host reads (``active=``) sends the writes of its inactive rows
        #: there instead of selecting the active rows; ``_tensors`` are views of the rest
        self._storage: Dict[str, Tensor] = {}
        #: an upper bound on every slot's length, kept on the host, so that a step without
        #: host reads can decide growth without reading the lengths (see :meth:`reserve_turn`)
        self._longest_bound = 0
        self._undo: Optional[tuple] = None
        #: steps written so far (each can be undone by :meth:`undo_last` until the next);
        #: an owner compares it before and after its own work to know whether to undo
        self.steps_written = 0
        #: the turn capacity a table starts with and never shrinks below
        self.initial_turn_capacity = check_positive_int(turn_capacity, "turn_capacity")
        #: the slot capacity a table starts with and never shrinks below
        self.initial_capacity = check_positive_int(capacity, "capacity")
        self._resize(self.initial_capacity, self.initial_turn_capacity)

    # ------------------------------------------------------------------ storage

    @property
    def capacity(self) -> int:
        return int(self._tensors["lengths"].shape[0])

    @property
    def turn_capacity(self) -> int:
        return int(self._tensors["alphas"].shape[1])

    def _blank(self, name: str, capacity: int, turns: int) -> Tensor:
        shape, dtype, fill = self._blank_spec(name, capacity, turns)
        return torch.full(shape, fill, dtype=dtype, device=self.device)

    def _blank_spec(self, name: str, capacity: int, turns: int) -> tuple:
        """(shape, dtype, fill) of the state tensor ``name`` at this capacity."""
        if name in self._payload:
            spec = self._payload[name]
            return ((capacity, turns, self.width) if spec.per_candidate else (capacity, turns)), spec.dtype, spec.fill
        width, window = self.width, (self.fixed_lag if self.fixed_lag is not None else -1) + 1
        shapes = {
            "alphas": ((capacity, turns, width), self.dtype, -_INF),
            "backpointers": ((capacity, turns, width), torch.long, 0),
            "link_distances": ((capacity, turns, width), torch.float64, 0.0),
            "link_transitions": ((capacity, turns, width), self.dtype, 0.0),
            "emissions": ((capacity, turns, width), self.dtype, 0.0),
            "allowed": ((capacity, turns, width), torch.bool, False),
            "argmax": ((capacity, turns), torch.long, -1),
            "window": ((capacity, window, width, width), self.dtype, 0.0),
            "window_distances": ((capacity, window, width, width), torch.float64, 0.0),
            "lengths": ((capacity,), torch.long, 0),
        }
        return shapes[name]

    def _resize(self, capacity: int, turns: int) -> None:
        # prepare every new tensor first, then install them all: a failure (out of memory)
        # part-way leaves the table as it was
        self._install(self._grown(capacity, turns))

    def _grown(self, capacity: int, turns: int, source: Optional[Dict[str, Tensor]] = None) -> Dict[str, Tensor]:
        """New storage (``capacity`` slots and the spare, ``turns`` turns) holding the
        table's values (or ``source``'s) where the shapes overlap; nothing is installed."""
        source = self._tensors if source is None else source
        grown = {}
        for name in self._names:
            new = self._blank(name, capacity + 1, turns)
            old = source.get(name)
            if old is not None:
                region = tuple(slice(0, min(a, b)) for a, b in zip(old.shape, new.shape))
                new[region] = old[region]
            grown[name] = new
        return grown

    def _install(self, storage: Dict[str, Tensor]) -> None:
        """Make ``storage`` (every tensor with the spare slot after the table's) the table
        (the views made first, then one assignment: a failure leaves the old table)."""
        views = table_views(storage)
        self._storage, self._tensors = storage, views

    @property
    def spare_slot(self) -> int:
        """The index of the spare slot (``capacity``): never allocated, the target of a
        host-read-free step's inactive rows, its values meaningless."""
        return self.capacity

    def reserve_turn(self) -> None:
        """Make sure every slot can take one more turn, reading the lengths back only when
        the host-side bound says the table may be full: once every (turn capacity -
        longest length) steps at most, never when the table was sized ahead
        (``turn_capacity``). A step without host reads calls it first."""
        self.reserve_turns(self._longest_bound + 1)

    def reserve_turns(self, turns: int) -> None:
        """Grow the turn capacity (doubling) until it holds ``turns`` turns and every
        slot's next turn, reading the lengths back only when the host-side bound says
        the table may be too small."""
        if max(turns, self._longest_bound + 1) <= self.turn_capacity:
            return
        self.refresh_bound()
        capacity = self.turn_capacity
        while capacity < max(turns, self._longest_bound + 1):
            capacity *= 2
        if capacity != self.turn_capacity:
            self._resize(self.capacity, capacity)

    def refresh_bound(self) -> None:
        """Set the host-side bound on the lengths to the longest slot's length (one host read)."""
        self._longest_bound = int(self._tensors["lengths"].max()) if self.capacity else 0

    def allocation(self) -> tuple:
        """``(slot, capacity)``: the slot the next :meth:`allocate` returns (the lowest free
        one, so live slots pack at the bottom and the table can shrink) and the capacity
        after it (for an owner preparing its own per-slot state first)."""
        if self._free:
            return self._free[0], self.capacity  # (a min-heap)
        return self._allocated, 2 * self.capacity if self._allocated == self.capacity else self.capacity

    def allocate(self) -> int:
        """A fresh, empty slot (grows the table when full). All or nothing: the grown
        table and the cleared rows are prepared, then committed with SIGINT held back."""
        slot, capacity = self.allocation()
        storage = self._grown(capacity, self.turn_capacity) if capacity != self.capacity else None
        views = table_views(storage) if storage is not None else self._tensors
        # shape: each state tensor's row of one empty slot
        rows = {name: self._blank(name, 1, self.turn_capacity)[0] for name in self._names}
        with deferred_sigint():
            if storage is not None:
                self._storage, self._tensors = storage, views
            for name, row in rows.items():
                views[name][slot] = row
            self._undo = None  # a reused slot must never get an older step's values back
            if self._free:
                heapq.heappop(self._free)
            else:
                self._allocated += 1
        return slot

    def release(self, slot: int) -> None:
        """Give a slot back: it has no turns from now on (so a shrunk turn capacity and a
        saved state stay consistent); its other cells are cleared on the next
        :meth:`allocate`. The table shrinks when it can (:meth:`_shrunk`)."""
        if not 0 <= slot < self._allocated or slot in self._free:
            raise MapMatchedValueError(f"slot {slot} is not allocated")
        # all or nothing: the shrunk table (if any) and the new bookkeeping are prepared, then committed
        allocated, free = self._allocated, self._free + [slot]
        if slot == allocated - 1:  # the top slot: the free slots right below it leave the table too
            freed = set(free)
            while allocated and allocated - 1 in freed:
                allocated -= 1
            free = [kept for kept in free if kept < allocated]
            heapq.heapify(free)
        else:
            heapq.heappush(free, free.pop())  # (a min-heap again)
        storage, longest = self._shrunk(slot, allocated, free)
        views = table_views(storage) if storage is not None else None
        with deferred_sigint():
            if storage is not None:
                self._storage, self._tensors, self._undo = storage, views, None
            else:
                self._tensors["lengths"][slot] = 0
            self._free, self._allocated = free, allocated
            if longest is not None:
                self._longest_bound = longest

    def _shrunk(self, slot: int, allocated: int, free: List[int]) -> tuple:
        """``(storage, longest)`` after ``slot`` is released, leaving ``allocated`` slots of
        which ``free`` are free: the table halved in slots while every allocated slot
        fits in a quarter of it, and in turns while every live slot's length fits in a
        quarter of the turn capacity (never below the initial capacities), when memory
        can be given back, else None; and the longest live length (None when not
        read). Nothing is installed.

        Bound: the slots are at most 4 x (the highest live slot + 1) (live slots are
        reused lowest first, so they pack at the bottom), and the turns at most 4 x the
        longest live session, or the initial capacities."""
        capacity, turns = self.capacity, self.turn_capacity
        target_capacity = capacity
        while target_capacity // 2 >= self.initial_capacity and allocated <= target_capacity // 4:
            target_capacity //= 2
        longest = None
        target_turns = turns
        if turns > self.initial_turn_capacity:
            live = torch.zeros(capacity, dtype=torch.bool, device=self.device)
            live[:allocated] = True
            live[free] = False
            lengths = self._tensors["lengths"]
            longest = int(lengths[live].max()) if bool(live.any()) else 0
            while target_turns // 2 >= self.initial_turn_capacity and longest <= target_turns // 4:
                target_turns //= 2
        if target_capacity == capacity and target_turns == turns:
            return None, longest
        storage = self._grown(target_capacity, target_turns)
        if slot < target_capacity:
            storage["lengths"][slot] = 0
        return storage, longest

    def snapshot(self, slot: int) -> Dict[str, Tensor]:
        """A copy of one slot's state (for :meth:`restore`)."""
        return {name: tensor[slot].clone() for name, tensor in self._tensors.items()}

    def restore(self, slot: int, snapshot: Dict[str, Tensor]) -> None:
        """Put back a :meth:`snapshot` (the table may have grown since)."""
        for name, saved in snapshot.items():
            row = self._blank(name, 1, self.turn_capacity)[0]
            row[tuple(slice(0, size) for size in saved.shape)] = saved
            self._tensors[name][slot] = row
        self._longest_bound = max(self._longest_bound, int(snapshot["lengths"]))

    def payload(self, name: str, *, spare_slot: bool = False) -> Tensor:
        """The live ``(C, T, M)`` or ``(C, T)`` payload tensor ``name`` (read it, do not write
        it: writes go through :meth:`advance` and :meth:`put_rows`, which can be undone).
        Growth and shrinking replace the tensor, so a reference taken now keeps the values
        it had, except in slots released and allocated again. With ``spare_slot``, C + 1
        rows: the :attr:`spare_slot` too (for reads indexed by a host-read-free step's slots)."""
        return (self._storage if spare_slot else self._tensors)[f"payload.{name}"]

    def replace_payload(self, name: str, values: Tensor) -> None:
        """Install ``values`` as the per-turn payload ``name``, whole: a ``(C + 1, T, M)``
        or ``(C + 1, T)`` tensor of its dtype, the spare slot last (the owner's
        renumbering of its values). The old tensor is not edited (a reader holding it
        keeps its values); the last step can no longer be undone. All or nothing."""
        key = f"payload.{name}"
        old = self._storage[key]
        if values.shape != old.shape or values.dtype != old.dtype or values.device != old.device:
            raise MapMatchedValueError(
                f"payload {name!r} must stay {old.dtype} {tuple(old.shape)} on {old.device}, got {values.dtype} "
                f"{tuple(values.shape)} on {values.device}"
            )
        storage = dict(self._storage, **{key: values})
        views = table_views(storage)
        with deferred_sigint():
            self._storage, self._tensors, self._undo = storage, views, None

    def put_rows(self, name: str, slots: Tensor, values: Tensor) -> None:
        """Write ``(S, T')`` values into the leading turns of a per-turn payload for S
        distinct slots (T' at most the turn capacity; the :attr:`spare_slot` may repeat);
        part of the last step for :meth:`undo_last` (call it after the step)."""
        key = f"payload.{name}"
        where = (slots.to(self.device).unsqueeze(1), torch.arange(values.shape[1], device=self.device).unsqueeze(0))
        old = _exchange(self._storage[key], where, values.to(self.device))
        if self._undo is not None:
            self._undo[0].append((key, where, old))

    def length(self, slot: int) -> int:
        """Number of turns decoded in ``slot``."""
        return int(self._tensors["lengths"][slot])

    def lengths(self, slots: Tensor) -> Tensor:
        """(S,) long: number of turns decoded in each of ``slots`` (no synchronization)."""
        return self._storage["lengths"][slots.to(self.device)].clone()

    # ------------------------------------------------------------------- a step

    def step(
        self,
        slots: Tensor,
        emissions: Tensor,
        mask: Tensor,
        distances: Optional[Tensor] = None,
        payload: Optional[Dict[str, Tensor]] = None,
        active: Optional[Tensor] = None,
        features: Optional[Tensor] = None,
    ) -> SlotStep:
        """Add one turn to each of S distinct slots, weighting it with lambda and beta.

        Args:
            slots: (S,) long distinct allocated slots.
            emissions: (S, M) normalized scores of the new turn (lambda is applied here).
            mask: (S, M) bool real candidates; every row needs at least one.
            distances: (S, M, M) float64 graph distances ``[s, from, to]`` from the
                slot's previous turn to the new one (None when beta = 0 or when no slot
                has a previous turn); beta is applied by
                :func:`~mapmatched_torch.kernels.transitions.weighted_transitions`.
            payload, active: as for :meth:`advance` (with ``active``, no host read; the
                outputs are the turn capacity wide, and the rows not active are
                meaningless).
            features: (S, M, K) the learned model's gate features of the moves out of
                each slot's previous turn (:mod:`~mapmatched_torch.kernels.gate_features`;
                any finite values for a slot without one); needed when the table has a
                learned model with K > 0.

        Returns:
            A :class:`SlotStep`. Slots whose scores overflowed are left unchanged.
        """
        # shape: (S, M)
        weighted = torch.where(mask, self.emission_weight * emissions.to(self.device, torch.float64), 0.0).to(self.dtype)
        if distances is None or not self.mode.uses_distances:
            distances = None
        moves = factors = None
        if self.transitions is not None and distances is not None:
            distances = distances.to(self.device, torch.float64)
            features = None if features is None else features.to(self.device)
            with torch.no_grad():
                if self.fixed_lag is None and hasattr(self.transitions, "move_factors"):
                    # shape: (S, M) -(beta * gate) per source and (S, M, M) the distances they weigh:
                    # the fused step makes the moves in its kernel
                    per_source = self.transitions.move_factors(features)
                    factors = (per_source.to(torch.float64).expand(distances.shape[:-1]),
                               self.transitions.calibrated(distances).to(torch.float64))
                else:  # shape: (S, M, M) the learned model's moves (a lag's window keeps them)
                    moves = self.transitions(distances, features, self.dtype)
        ok = self.advance(
            slots, weighted, mask, moves, distances, payload=payload,
            weigh=distances is not None and moves is None and factors is None, active=active, factors=factors,
        )
        try:  # all or nothing: the decode after the write failing (even KeyboardInterrupt) takes the write back
            if active is not None:
                read = torch.where(active.to(self.device), slots.to(self.device), self.spare_slot)
                return self.current(read, synchronize=False)._replace(ok=ok)
            return self.current(slots)._replace(ok=ok)
        except BaseException:
            self.undo_last()
            raise

    def advance(
        self,
        slots: Tensor,
        emissions: Tensor,
        mask: Tensor,
        transitions: Optional[Tensor] = None,
        distances: Optional[Tensor] = None,
        *,
        transactional: bool = True,
        payload: Optional[Dict[str, Tensor]] = None,
        weigh: bool = False,
        active: Optional[Tensor] = None,
        factors: Optional[tuple] = None,
    ) -> Tensor:
        """Add one turn to each of S distinct slots, from inputs already weighted.

        The table's lambda and beta are not applied; its mode still is (a table with
        beta = 0 decodes pointwise and ignores ``transitions``). Nothing is decoded:
        read the paths with :meth:`current` when needed.

        Args:
            slots: (S,) long distinct allocated slots.
            emissions: (S, M) weighted emissions of the new turn (finite at ``mask``;
                cast to the table's dtype).
            mask: (S, M) bool real candidates; every row needs at least one.
            transitions: (S, M, M) weighted transitions ``[s, from, to]`` from each
                slot's previous turn, finite between real candidates (others are
                ignored); None means all zero (e.g. no slot has a previous turn).
            distances: (S, M, M) float64 distances the transitions came from, reported
                along the paths (``SlotStep.path_distances``); None reports zeros.
            transactional: True (default): a slot whose scores overflow is left
                unchanged. False: it is written anyway (``ok`` still reports it), for a
                caller that raises the overflow later.
            payload: name -> ``(S, M)`` values of each per-candidate payload at the new
                turn (written with the turn; a payload not given keeps its fill).
            weigh: the transitions are :func:`~mapmatched_torch.kernels.transitions.weighted_transitions`
                of ``distances`` with the table's beta (``transitions`` must be None);
                with full decoding the fused step weighs them itself, without an
                (S, M, M) temporary.
            active: (S,) bool, or None. Given, the step makes no host read: rows not
                active are computed on the :attr:`spare_slot` and written nowhere (their
                slots may be anything, their masks empty), overflowing rows likewise,
                and growth is decided by :meth:`reserve_turn` (no read unless the table
                may be full). ``ok`` is then False for inactive rows too.
            factors: ``((S, M) per-source factors, (S, M, M) float64 distances)`` of a
                learned model (:meth:`step` makes them; ``transitions`` None, no lag):
                the moves are ``distances[s, j, i] * factors[s, j]`` in the table's
                dtype, made by the fused step in its kernel where it applies.

        Returns:
            ``ok``: (S,) bool, False where a forward score overflowed.

        Cost: O(S (L+1) M^2) time; a few host-device synchronizations (input checks,
        table growth, the rows written), none with ``active``.
        """
        count = slots.shape[0]
        if count == 0:
            raise MapMatchedValueError("step needs at least one slot")
        if active is not None:
            self.reserve_turn()
            state = self._storage
            spare = self.spare_slot
            state["lengths"][spare] = 0  # the spare slot's rows are always a first turn
            active = active.to(self.device)
            slots = torch.where(active, slots.to(self.device), spare)
        else:
            state = self._tensors
            slots = slots.to(self.device)
            if not bool(mask.any(dim=1).all()):
                raise MapMatchedValueError("every stepping conversation needs at least one candidate")
        lengths = state["lengths"][slots]
        if active is None:
            longest = int(lengths.max())
            self._longest_bound = max(self._longest_bound, longest + 1)
            if longest + 1 > self.turn_capacity:
                self._resize(self.capacity, 2 * self.turn_capacity)
                state = self._tensors
        # shape: (S, M)
        weighted = torch.where(mask, emissions.to(self.device, self.dtype), 0.0)
        started = lengths > 0
        pairwise = (count, self.width, self.width)
        weigh = weigh and distances is not None and self.mode is not DecodingMode.POINTWISE
        if distances is None:
            distances = torch.zeros(pairwise, dtype=torch.float64, device=self.device)
        distances = distances.to(self.device, torch.float64)
        previous_turn = (lengths - 1).clamp_min(0)
        previous_allowed = state["allowed"][slots, previous_turn]
        previous_scores = state["alphas"][slots, previous_turn]
        step = None
        if factors is not None and self.mode is not DecodingMode.POINTWISE:
            # a learned model's per-move factors, weighed in the fused kernel: no (S, M, M) transitions
            per_source, weighed = factors[0].to(self.device), factors[1].to(self.device)
            step = fused_step.max_plus_step(
                previous_scores, previous_allowed, started, weighted, mask, weighed, distances, None, per_source
            )
            if step is None:  # the torch path: the same product, as a tensor
                transitions = (weighed * per_source.unsqueeze(-1)).to(self.dtype)
            factors = (per_source, weighed)
        elif factors is not None:
            factors = None
        if weigh and self.fixed_lag is None:  # the fused step weighs the distances itself: no (S, M, M) temporary
            step = fused_step.max_plus_step(
                previous_scores, previous_allowed, started, weighted, mask, None, distances, self.transition_weight
            )
        if step is None:
            if weigh:  # (a lag's window keeps the transitions themselves)
                transitions = weighted_transitions(distances, self.transition_weight, self.dtype)
            # shape: (S, M, M)
            if transitions is None or self.mode is DecodingMode.POINTWISE:
                transitions = torch.zeros(pairwise, dtype=self.dtype, device=self.device)
            transitions = transitions.to(self.device, self.dtype)
            step = fused_step.max_plus_step(
                previous_scores, previous_allowed, started, weighted, mask, transitions, distances
            )
        if step is None:  # the torch path (the reference)
            pairs = previous_allowed.unsqueeze(2) & mask.unsqueeze(1)
            # shape: (S, M): -inf at the previous turn's disallowed candidates, 0 before a first turn
            previous_alpha = torch.where(
                started.unsqueeze(1), torch.where(previous_allowed, previous_scores, -_INF), 0.0
            )
            chained = chain.chain_step(
                MAX_PLUS, previous_alpha, started, weighted, torch.where(pairs, transitions, 0.0), mask
            )
            step = fused_step.FusedStep(
                chained.alpha, chained.backpointers, _links(distances, chained.backpointers), chained.nonfinite
            )
        new = {
            "alpha": step.alpha,
            "backpointers": step.backpointers,
            "links": step.links,
            "allowed": mask,
            "emissions": weighted,
        }
        if self.transitions is not None:  # shape: (S, M) the move into each candidate
            if transitions is None and factors is not None:  # (made in the kernel: the same product)
                new["link_transitions"] = (
                    _links(factors[1], step.backpointers) * factors[0].gather(1, step.backpointers)
                ).to(self.dtype)
            else:
                new["link_transitions"] = _links(transitions, step.backpointers)
        nonfinite = step.nonfinite
        updates = {}  # (name, turn index tensor) -> (S, M) values, written for ok rows
        argmax = None
        if self.mode is DecodingMode.POINTWISE:
            # beta = 0: the exact per-turn argmax; locks never change a value.
            argmax = torch.where(mask, weighted, -_INF).max(dim=1).indices
            if self.fixed_lag == 0:
                keep = torch.arange(self.width, device=self.device).unsqueeze(0) == argmax.unsqueeze(1)
                new["alpha"] = torch.where(keep, new["alpha"], -_INF)
                new["allowed"] = mask & keep
        elif self.fixed_lag is not None:
            nonfinite = nonfinite | self._commit(slots, lengths, weighted, transitions, distances, new, updates, state)
        ok = ~nonfinite
        new["payload"] = dict(payload or {})
        if active is not None:  # every row written: the inactive and overflowing ones to the spare slot
            ok = ok & active
            written = ok if transactional else active
            window = (transitions, distances) if self.fixed_lag else None
            self._write(torch.where(written, slots, self.spare_slot), lengths, new, updates, None, window, argmax)
            self._longest_bound += 1
            return ok
        written = ok if transactional else torch.ones_like(ok)
        window = (transitions[written], distances[written]) if self.fixed_lag else None
        self._write(slots[written], lengths[written], new, updates, written, window, argmax)
        return ok

    def current(self, slots: Tensor, *, synchronize: bool = True) -> SlotStep:
        """The decode of each slot's turns so far, without a step.

        Args:
            slots: (S,) long allocated slots (S may be 0; a slot may have no turns).
            synchronize: False: no host read; the outputs are the table's turn capacity
                wide, and ``slots`` may name the :attr:`spare_slot` (its row meaningless).

        Returns:
            A :class:`SlotStep` (``ok`` all True); a slot without turns has an all -1
            path and -inf final scores.
        """
        state = self._tensors if synchronize else self._storage
        slots = slots.to(self.device)
        lengths = state["lengths"][slots]
        last = (lengths - 1).clamp_min(0)
        # shape: (S, M): a cleared slot allows nothing, so -inf without turns
        final = torch.where(state["allowed"][slots, last], state["alphas"][slots, last], -_INF)
        # the columns the slots use, not the table's turn capacity: a step's cost must
        # not depend on the longest session the table ever held (one synchronization)
        if not synchronize:
            turns = self.turn_capacity
        else:
            turns = max(1, int(lengths.max())) if lengths.numel() else 1
        # shape: (S, T)
        advanced = torch.arange(turns, device=self.device).unsqueeze(0) < lengths.unsqueeze(1)
        if self.mode is DecodingMode.POINTWISE:
            paths = torch.where(advanced, state["argmax"][slots, :turns], -1)
            distances = torch.zeros(paths.shape, dtype=torch.float64, device=self.device)
        else:
            last_choice = MAX_PLUS.sum(final, dim=1)[1]
            fused_paths = fused_step.backtrack_slots(
                state["backpointers"], state["link_distances"], slots, lengths, last_choice, turns
            )
            if fused_paths is not None:
                paths, distances = fused_paths
            else:  # the torch path (the reference)
                paths = chain.backtrack(state["backpointers"][slots, :turns], advanced, last_choice)
                links = state["link_distances"][slots, :turns].gather(2, paths.clamp_min(0).unsqueeze(2)).squeeze(2)
                distances = torch.where(advanced, links, 0.0)
                distances[:, 0] = 0.0
        return SlotStep(torch.ones_like(advanced[:, 0]), paths, distances, final, lengths)

    def path_costs(self, slots: Tensor, paths: Tensor, *, spare_slot: bool = False) -> Tensor:
        """``(S, T)`` the learned transition model's cost of the move into each turn along
        ``paths`` (a :class:`SlotStep`'s, of these ``slots``): the negated transition the
        decoder added, 0 at turn 0, after the end and when decoding pointwise. (The
        fixed model's costs are ``settings.transition_cost(path_distances)``: without a
        learned model this raises.)

        ``spare_slot``: ``slots`` may name the spare slot (a host-read-free step's)."""
        if self.transitions is None:
            raise MapMatchedValueError("path_costs needs a learned transition model (transitions=)")
        table = (self._storage if spare_slot else self._tensors)["link_transitions"]
        turns = paths.shape[1]
        slots = slots.to(self.device)
        # shape: (S, T) the move into each turn along the path
        moves = table[slots, :turns].gather(2, paths.clamp_min(0).unsqueeze(2)).squeeze(2).to(torch.float64)
        first = torch.arange(turns, device=self.device).unsqueeze(0) == 0
        costs = torch.where((paths >= 0) & ~first, -moves, 0.0)
        return torch.zeros_like(costs) if self.mode is DecodingMode.POINTWISE else costs

    def _commit(self, slots, lengths, weighted, transitions, distances, new, updates, state) -> Tensor:
        """Fixed lag: commit turn ``n - L`` and recompute turns ``n-L+1..n`` under the lock."""
        lag = self.fixed_lag
        assert lag is not None
        commit = lengths >= lag  # the new turn n = lengths has index >= lag
        window_turns = [(lengths - lag + s).clamp_min(0) for s in range(lag + 1)]
        alphas = [torch.where(state["allowed"][slots, t], state["alphas"][slots, t], -_INF) for t in window_turns[:-1]]
        alphas.append(new["alpha"])
        backpointers = [state["backpointers"][slots, t] for t in window_turns[:-1]] + [new["backpointers"]]
        emissions = [state["emissions"][slots, t] for t in window_turns[:-1]] + [weighted]
        allowed = [state["allowed"][slots, t] for t in window_turns[:-1]] + [new["allowed"]]
        # shape: (S, L+1, M, M)
        ring, ring_distances = state["window"][slots], state["window_distances"][slots]
        rows = torch.arange(slots.shape[0], device=self.device)
        # window_*[s] lead from window slot s into slot s + 1; the last ones are the new turn's
        window_transitions = [
            transitions if s == lag - 1 else ring[rows, t % (lag + 1)] for s, t in enumerate(window_turns[1:])
        ]
        window_distances = [
            distances if s == lag - 1 else ring_distances[rows, t % (lag + 1)] for s, t in enumerate(window_turns[1:])
        ]
        tail = chain.commit_tail(
            MAX_PLUS,
            alphas,
            backpointers,
            [torch.where(a, e, 0.0) for a, e in zip(allowed, emissions)],
            [
                torch.where(allowed[s].unsqueeze(2) & allowed[s + 1].unsqueeze(1), moves, 0.0)
                for s, moves in enumerate(window_transitions)
            ],
            allowed,
            commit,
        )
        learned = self.transitions is not None
        for s in range(lag):  # window slots that are older turns: rewrite them
            links = _links(window_distances[s - 1], tail.backpointers[s]) if s else None
            moves = _links(window_transitions[s - 1], tail.backpointers[s]) if s and learned else None
            updates[s] = (window_turns[s], tail.alphas[s], tail.backpointers[s], links, tail.allowed if s == 0 else None,
                          moves)
        updates["rows"] = commit
        new["alpha"] = tail.alphas[-1]
        new["backpointers"] = tail.backpointers[-1]
        new["links"] = _links(distances, tail.backpointers[-1])
        if learned:
            new["link_transitions"] = _links(transitions, tail.backpointers[-1])
        if lag == 0:
            new["allowed"] = tail.allowed
        return tail.nonfinite

    def _write(self, slots, turn, new, updates, ok, window, argmax) -> None:
        """Write one step's cells, all or none: an exception (even a BaseException such
        as KeyboardInterrupt) part-way puts back the cells written so far."""
        undo: List[tuple] = []  # (name, index, the values it held), replayed backwards by undo_last
        try:
            self._write_cells(undo, slots, turn, new, updates, ok, window, argmax)
        except BaseException:
            self._replay(undo)
            raise
        self._undo = (undo, self.turn_capacity)
        self.steps_written += 1

    def _replay(self, undo: List[tuple]) -> None:
        """Put back the old values of an undo log, newest first."""
        state = self._storage  # (a host-read-free step's undo log names the spare slot too)
        for name, where, values in reversed(undo):
            state[name][where] = values

    def _write_cells(self, undo, slots, turn, new, updates, ok, window, argmax) -> None:
        """``ok`` None: every row is written (a host-read-free step has sent the rows not
        to be written to the spare slot)."""
        state = self._storage

        def put(name: str, where: tuple, values: Tensor) -> None:
            undo.append((name, where, _exchange(state[name], where, values)))

        every = ok is None or bool(ok.all())  # the usual case: no (S, ...) copies of the written rows

        def written(values: Tensor) -> Tensor:
            return values if every else values[ok]

        put("alphas", (slots, turn), written(new["alpha"]))
        put("backpointers", (slots, turn), written(new["backpointers"]))
        put("link_distances", (slots, turn), written(new["links"]))
        put("allowed", (slots, turn), written(new["allowed"]))
        put("emissions", (slots, turn), written(new["emissions"]))
        if "link_transitions" in new:
            put("link_transitions", (slots, turn), written(new["link_transitions"]))
        if argmax is not None:
            put("argmax", (slots, turn), written(argmax))
        for name, values in new["payload"].items():
            put(f"payload.{name}", (slots, turn), written(values.to(self.device)))
        committing = updates.pop("rows", None)
        if ok is None and committing is not None:  # the others' older turns go to the spare slot
            targets = torch.where(committing, slots, self.spare_slot)
            for turns, alpha, backpointers, links, allowed, moves in updates.values():
                put("alphas", (targets, turns), alpha)
                put("backpointers", (targets, turns), backpointers)
                if links is not None:
                    put("link_distances", (targets, turns), links)
                if moves is not None:
                    put("link_transitions", (targets, turns), moves)
                if allowed is not None:
                    put("allowed", (targets, turns), allowed)
            updates = {}
        # only conversations that committed rewrite older turns (others gathered clamped copies)
        rows = committing[ok] if committing is not None and ok is not None else None
        for turns, alpha, backpointers, links, allowed, moves in updates.values():
            where = (slots[rows], turns[ok][rows])
            put("alphas", where, alpha[ok][rows])
            put("backpointers", where, backpointers[ok][rows])
            if links is not None:
                put("link_distances", where, links[ok][rows])
            if moves is not None:
                put("link_transitions", where, moves[ok][rows])
            if allowed is not None:
                put("allowed", where, allowed[ok][rows])
        if window is not None:
            position = turn % (self.fixed_lag + 1)
            put("window", (slots, position), window[0])
            put("window_distances", (slots, position), window[1])
        put("lengths", (slots,), turn + 1)

    @property
    def can_undo(self) -> bool:
        """Whether :meth:`undo_last` has a step to take back."""
        return self._undo is not None

    def undo_last(self) -> None:
        """Take back the last :meth:`advance` / :meth:`step` entirely (one level): every
        cell it wrote gets its old value back. For a caller whose own bookkeeping failed
        after the step (an exception, KeyboardInterrupt, out of memory), so that the
        table and the caller agree again.

        Raises:
            MapMatchedValueError: nothing to undo (no step since the last undo), or the
                table was resized since (allocate/release) and the step cannot be undone.
        """
        if self._undo is None:
            raise MapMatchedValueError("nothing to undo: no step since the last undo")
        undo, turns = self._undo
        if turns != self.turn_capacity:
            raise MapMatchedValueError("cannot undo the last step: the table was resized since")
        self._replay(undo)
        self._undo = None

    def undo_slots(self, slots: Tensor) -> None:
        """Take back the last step for some of its slots only (the others keep it): for
        an owner that refuses a few sessions' turns after the step (their results
        failed to build). :meth:`undo_last` may still follow, for the rest.

        Raises:
            MapMatchedValueError: as :meth:`undo_last`.
        """
        if self._undo is None:
            raise MapMatchedValueError("nothing to undo: no step since the last undo")
        undo, turns = self._undo
        if turns != self.turn_capacity:
            raise MapMatchedValueError("cannot undo the last step: the table was resized since")
        state, targets = self._storage, slots.to(self.device).view(-1)
        for name, where, values in reversed(undo):
            rows = torch.isin(where[0].reshape(-1), targets)
            if bool(rows.any()):
                picked = tuple(index[rows] if index.shape[0] == rows.shape[0] else index for index in where)
                state[name][picked] = values[rows]


def _on_device(model: Any, device: torch.device) -> Any:
    """A learned model (an ``nn.Module``) whose parameters are on ``device``: itself when
    they are, else a copy moved there; anything else unchanged."""
    if not isinstance(model, torch.nn.Module):
        return model
    if all(tensor.device == device for tensor in (*model.parameters(), *model.buffers())):
        return model
    return copy.deepcopy(model).to(device)
