"""The server's sessions held in tensors, and one step of many of them as tensor work.

:class:`SessionStore` keeps every open session in one
:class:`~mapmatched_torch.kernels.slot_decoder.SlotDecoder` slot table on the server's
device: the decoder's own state (forward scores, back-pointers, locks, the fixed-lag
window) plus, per slot and turn, the candidates' chunk codes (:class:`ChunkCodes`),
raw and normalized scores, and the decoded path after the latest step and before it
(for the revised turns). Opening, closing, slot reuse, growth by doubling, undo and
``state_dict`` are the table's.

:meth:`SessionStore.step` takes ``(S,)`` slots, ``(S, K)`` chunk codes and ``(S, K)`` raw
scores and returns a :class:`TensorStep`: per-row status codes (:class:`StepCode`), the
decoded chunk, the path, the revised turns, the committed index, the path's emission,
transition and distance per turn and, when asked, the contexts. Everything is tensor
operations: validation, exact normalization
(:func:`~mapmatched_torch.kernels.normalization.normalize_score_rows`), distances (one
graph call on the codes for a tensor graph), the decoding step and backtrack, gathers.
No Python object is made per session; a failed row leaves its session untouched.

At about 730 lines it is one class and the tensor helpers of its step; the slot table it
stores into is :mod:`mapmatched_torch.kernels.slot_decoder`, its chunk codes
:mod:`.codes` and its contexts :mod:`.contexts`.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ..core.errors import MapMatchedValueError
from ..core.signals import deferred_sigint
from ..core.protocols import CorpusGraph, implements
from ..core.settings import DecodeSettings
from ..graph.protocols import TensorGraph
from ..kernels import fused, fused_step, numba_runtime
from ..kernels.normalization import normalize_score_rows, normalize_score_rows_on_device
from ..kernels.slot_decoder import PayloadSpec, SlotDecoder
from ..kernels.gate_features import step_features
from ..retrieval.learned import LearnedTransitions
from ..retrieval.streaming import step_distances
from .codes import ChunkCodes
from .contexts import ContextTable

__all__ = ["StepCode", "TensorStep", "SessionStore", "context_codes", "refuse_rows"]


class StepCode(IntEnum):
    """Why a row of :meth:`SessionStore.step` failed (``OK``: it did not); in the order
    the rows are checked, the first that applies is reported."""

    OK = 0
    UNKNOWN_SLOT = 1  #: not an open slot
    REPEATED_SLOT = 2  #: the slot appears in more than one row
    OUT_OF_RANGE = 3  #: a code outside [-1, number of codes)
    GAPPED = 4  #: padding (-1) before a candidate
    NONFINITE_SCORE = 5  #: a non-finite raw score at a candidate (any column)
    DUPLICATE = 6  #: a chunk repeated among the kept candidates
    EMPTY = 7  #: no candidate
    NORMALIZATION_OVERFLOW = 8  #: the normalized scores overflow
    DECODE_OVERFLOW = 9  #: a forward score overflowed
    #: the decoded path's trace overflows (a margin or an entropy, with scores beyond
    #: 2**990 and no z-scores): a session refuses the turn (checked by the server)
    TRACE_OVERFLOW = 10
    #: a step without host reads (``synchronize=False``) could not certify the exact sum
    #: of the row's score normalization on the device (heavy cancellation at a rounding
    #: midpoint, or scores near overflow): the turn is not taken; step it again with
    #: ``synchronize=True``, which sums it on the host
    EXACT_SUM_ON_HOST = 11


#: The row checks' status codes in the order they are checked (the first that fails is reported).
_CHECK_ORDER = tuple(int(code) for code in (
    StepCode.UNKNOWN_SLOT, StepCode.REPEATED_SLOT, StepCode.OUT_OF_RANGE, StepCode.GAPPED,
    StepCode.NONFINITE_SCORE, StepCode.DUPLICATE, StepCode.EMPTY,
))

_PAYLOAD = {
    "codes": PayloadSpec(torch.long, -1),
    "raw": PayloadSpec(torch.float64, 0.0),
    "normalized": PayloadSpec(torch.float64, 0.0),
    "path": PayloadSpec(torch.long, -1, per_candidate=False),
    "previous_path": PayloadSpec(torch.long, -1, per_candidate=False),
}


class TensorStep(NamedTuple):
    """One step of S sessions, as tensors on the store's device (S rows, input order).

    A failed row (``status != 0``) has -1 codes, False masks and 0.0 values.

    Attributes:
        status: (S,) long :class:`StepCode` per row.
        chunks: (S,) long code of the decoded chunk of the new turn.
        path: (S, T) long codes of the decoded chunk of every turn, -1 past each length.
        path_index: (S, T) long candidate index of the decoded chunk of every turn.
        lengths: (S,) long turns of each session after the step.
        revised: (S, T) bool earlier turns whose decoded chunk changed in this step.
        committed_through: (S,) long ``T - L - 1`` with a fixed lag (-1: none committed,
            or no lag).
        emissions: (S, T) float64 ``lambda * normalized`` of the decoded candidates.
        transitions: (S, T) float64 ``beta * distance`` into each decoded candidate (0 at
            turn 0).
        distances: (S, T) float64 graph distance into each decoded candidate.
        final_scores: (S, M) forward scores of the new turn's candidates (-inf: padding
            or locked out): the ranking.
        candidates: (S, M) long codes of the new turn's kept candidates, -1 padded.
        contexts: (S, C) long context codes (the decoded chunk, its neighbours by
            distance, then the turn's candidates, first occurrences, cut at the
            context limit; -1 padded), or None when not asked for.
    """

    status: Tensor
    chunks: Tensor
    path: Tensor
    path_index: Tensor
    lengths: Tensor
    revised: Tensor
    committed_through: Tensor
    emissions: Tensor
    transitions: Tensor
    distances: Tensor
    final_scores: Tensor
    candidates: Tensor
    contexts: Optional[Tensor]


class SessionStore:
    """Every open session of a server in one slot table (see the module docstring).

    Args:
        graph: the corpus graph (a tensor graph's distances come from one call).
        width: M, the retriever's candidate_limit.
        settings: the :class:`~mapmatched_torch.core.settings.DecodeSettings` (lambda,
            beta, the lag and the normalization), validated by the owner.
        context_radius, context_limit: the contexts' neighbourhood radius and cut.
        capacity: initial slots. turn_capacity: initial turns per slot (both grow by
        doubling and shrink back to them). dtype, device: of the dynamic program.
        neighborhood_cache: context neighbourhoods kept as chunk IDs (an LRU).
        extra_codes: chunk codes beyond a tensor graph's nodes kept before a
            compaction is due (:mod:`.codes`).
        learned: a learned transition model with its feature inputs
            (:class:`~mapmatched_torch.retrieval.learned.LearnedTransitions`), or None for
            the fixed ``-(beta * d)``: each step then computes the gate features of the
            moves out of every slot's previous turn
            (:func:`~mapmatched_torch.kernels.gate_features.step_features`, the
            evaluation's) and the slot decoder makes the moves with the model; the
            path's ``transitions`` are the model's costs.
    """

    def __init__(
        self,
        graph: CorpusGraph,
        width: int,
        settings: DecodeSettings,
        *,
        context_radius: float,
        context_limit: Optional[int],
        capacity: int = 64,
        dtype: torch.dtype = torch.float64,
        device: Optional[torch.device] = None,
        neighborhood_cache: int = 65536,
        turn_capacity: int = 8,
        extra_codes: int = 65536,
        learned: Optional[LearnedTransitions] = None,
    ) -> None:
        self.graph = graph
        self.codes = ChunkCodes(graph, extra_codes)
        self.learned = learned
        self._queries: Optional[Tensor] = None  # the current step's (S, D) query embeddings
        # the passage embeddings on the store's device, moved once
        self._passages = None if learned is None or learned.passage_embeddings is None else \
            learned.passage_embeddings.to(device if device is not None else "cpu")
        self.decoder = SlotDecoder(
            width,
            settings=settings,
            capacity=capacity,
            turn_capacity=turn_capacity,
            dtype=dtype,
            device=device,
            payload=_PAYLOAD,
            transitions=None if learned is None else learned.model,
        )
        self.device = self.decoder.device
        self.width = width
        self.settings = settings
        self.context_limit = context_limit
        self.contexts = ContextTable(graph, self.codes, context_radius, self.device, neighborhood_cache)
        self._tensor_graph = implements(graph, TensorGraph)
        self._live = torch.zeros(self.decoder.capacity, dtype=torch.bool, device=self.device)
        if fused.kernels_on(self.device):
            numba_runtime.warm()  # numba's start paid here, not by the first step

    # ------------------------------------------------------------------ slots

    def open(self) -> int:
        """A fresh, empty slot (all or nothing: the grown live mask is prepared first)."""
        slot, capacity = self.decoder.allocation()
        live = self._live
        if capacity > live.shape[0]:
            live = torch.zeros(capacity, dtype=torch.bool, device=self.device)
            live[: self._live.shape[0]] = self._live
        with deferred_sigint():
            allocated = self.decoder.allocate()  # (all or nothing itself)
            self._live = live
            live[allocated] = True
        return allocated

    def close(self, slot: int) -> None:
        """Free a slot (its values are cleared when it is opened again; the table may
        shrink); all or nothing."""
        with deferred_sigint():
            self.decoder.release(slot)  # (all or nothing itself)
            self._live[slot] = False
            self._live = self._live[: self.decoder.capacity]

    # ------------------------------------------------------------ chunk codes

    def compact_codes(self, *, force: bool = False) -> bool:
        """Drop the chunk codes beyond the graph's nodes that no open session's stored
        turns refer to, renumbering the others (:mod:`.codes`): when
        :attr:`ChunkCodes.compaction_due` (or ``force``). All or nothing: the new codes
        table, codes tensor and context table are prepared, then installed together;
        the old objects are not edited (results handed out keep reading them).

        Returns:
            Whether a compaction ran.

        Cost: O(C T M) over the slot table (C slots, T turns, M candidates), once per
        ``bound / 2`` new codes at most.
        """
        codes = self.codes
        if not (force or codes.compaction_due) or codes.extra == 0:
            return False
        decoder = self.decoder
        stored = decoder.payload("codes", spare_slot=True)  # shape: (C + 1, T, M), the spare slot last
        capacity, turns = decoder.capacity, stored.shape[1]
        lengths = decoder.lengths(torch.arange(capacity, device=self.device))  # (free slots: 0)
        # shape: (C, T) the turns the open sessions hold
        held = torch.arange(turns, device=self.device).unsqueeze(0) < lengths.unsqueeze(1)
        referred = stored[:capacity][held]
        used = torch.zeros(len(codes), dtype=torch.bool, device=self.device)
        used[referred[referred >= codes.graph_nodes]] = True
        table, mapping = codes.compacted(used)
        mapping = mapping.to(self.device)
        # a new tensor (results handed out read the old one); every cell in range afterwards
        renumbered = torch.where(stored >= 0, mapping[stored.clamp_min(0)], -1)
        contexts = self.contexts.renumbered(table)
        with deferred_sigint():
            decoder.replace_payload("codes", renumbered)  # (all or nothing itself)
            self.codes, self.contexts = table, contexts
        return True

    def live(self) -> Tensor:
        """(C,) bool: which slots are open."""
        return self._live

    # ------------------------------------------------------------------- a step

    def step(
        self, slots: Tensor, codes: Tensor, raw: Tensor, *, contexts: bool = False, synchronize: bool = True,
        query_embeddings: Optional[Tensor] = None,
    ) -> TensorStep:
        """Decode one new turn for each of S sessions (see :class:`TensorStep`).

        Args:
            slots: (S,) long slots (one row per session).
            codes: (S, K) long chunk codes in provider order, -1 padding after each row's
                candidates; columns past the width are cut (but still checked).
            raw: (S, K) floating raw scores (padding ignored).
            contexts: also compute the contexts.
            synchronize: False: no host read from the tensors given to the result
                returned (:meth:`_step_on_device`).
            query_embeddings: (S, D) the new turns' query embeddings, for a learned
                model's cosine gate feature (else unused).

        Returns:
            A :class:`TensorStep`; rows that fail change nothing.
        """
        device, width = self.device, self.width
        slots, codes = slots.to(device), codes.to(device)
        raw = raw.to(device, torch.float64)
        count = slots.shape[0]
        self._queries = self._checked_queries(query_embeddings, count)
        if not synchronize:
            return self._step_on_device(slots, codes, raw, contexts)
        checked = fused_step.checked_rows(slots, self._live, codes, raw, len(self.codes), width, _CHECK_ORDER)
        if checked is None:  # the torch checks (any device; the reference)
            checked = self._checked_rows(slots, codes, raw)
        status, kept, kept_raw, counts = checked
        real = kept >= 0
        clean = status == 0
        normalized = normalize_score_rows(
            torch.where(real & clean.unsqueeze(1), kept_raw, 0.0), torch.where(clean, counts, 0),
            self.settings.score_normalization,
        )
        status.masked_fill_(clean & ~torch.isfinite(normalized).all(1), int(StepCode.NORMALIZATION_OVERFLOW))
        rows = (status == 0).nonzero().view(-1)
        if rows.numel() == 0:
            return _blank_step(count, width, device, status)
        written = self.decoder.steps_written
        try:  # all or nothing: anything raised once the table is written (even KeyboardInterrupt) takes it back
            return self._stepped(rows, count, status, slots, kept, kept_raw, normalized, real, contexts)
        except BaseException:
            if self.decoder.steps_written != written and self.decoder.can_undo:  # (not taken back already)
                self.decoder.undo_last()
            raise

    def _step_on_device(self, slots: Tensor, codes: Tensor, raw: Tensor, contexts: bool) -> TensorStep:
        """:meth:`step` with no host read: every row goes through the one batched step, the
        failed ones computed on the decoder's spare slot and written nowhere
        (:meth:`~mapmatched_torch.kernels.slot_decoder.SlotDecoder.advance`'s ``active``),
        and the outputs have fixed shapes: the turn capacity wide (paths), and
        :meth:`context_width` wide (contexts). Rows stepped here equal :meth:`step`'s
        (their values; the widths differ). A row whose normalization the device cannot
        certify gets :attr:`StepCode.EXACT_SUM_ON_HOST`. With contexts, the context
        table must hold every chunk's row ahead (:meth:`ContextTable.precompute`, a
        tensor graph): a row not filled yet is searched, which reads the host.
        """
        count, width, device = slots.shape[0], self.width, self.device
        if count == 0:  # (known on the host: no step)
            empty = _blank_step(0, width, device, torch.zeros(0, dtype=torch.long, device=device),
                                self.decoder.turn_capacity)
            return empty._replace(contexts=torch.zeros((0, self.context_width()), dtype=torch.long, device=device)
                                  if contexts else None)
        status, kept, kept_raw, counts = self._checked_rows(slots, codes, raw)
        real = kept >= 0
        clean = status == 0
        normalized, host = normalize_score_rows_on_device(
            torch.where(real & clean.unsqueeze(1), kept_raw, 0.0), torch.where(clean, counts, 0),
            self.settings.score_normalization,
        )
        status.masked_fill_(clean & host, int(StepCode.EXACT_SUM_ON_HOST))
        clean = status == 0
        status.masked_fill_(clean & ~torch.isfinite(normalized).all(1), int(StepCode.NORMALIZATION_OVERFLOW))
        clean = status == 0
        written = self.decoder.steps_written
        try:  # all or nothing, as in step()
            stepped = self._decode(slots, kept, kept_raw, normalized, real, active=clean)
            status.masked_fill_(clean & ~stepped.pop("ok"), int(StepCode.DECODE_OVERFLOW))
            done = status == 0
            blank = _blank_step(count, width, device, status, stepped["path"].shape[1])
            fields = {
                name: torch.where(done.view((-1,) + (1,) * (values.dim() - 1)), values, getattr(blank, name))
                for name, values in stepped.items()
            }
            out = TensorStep(status=status, contexts=None, **fields)
            if contexts:
                out = out._replace(contexts=context_codes(
                    self.contexts, self.context_limit, out.chunks, out.candidates, done, fixed=True
                ))
            return out
        except BaseException:
            if self.decoder.steps_written != written and self.decoder.can_undo:
                self.decoder.undo_last()
            raise

    def context_width(self) -> int:
        """The contexts' width in a step without host reads (with a complete context
        table): the decoded chunk, the widest neighbourhood in the table and the
        candidates, at most the limit."""
        widest = 1 + self.contexts.width + self.width
        return widest if self.context_limit is None else min(self.context_limit, widest)

    def _stepped(self, rows, count, status, slots, kept, kept_raw, normalized, real, contexts) -> TensorStep:
        """The rest of :meth:`step` for its clean ``rows``: decode them, assemble the output."""
        device, width = self.device, self.width
        if rows.shape[0] == count:  # no copies when every row is clean
            stepped = self._decode(slots, kept, kept_raw, normalized, real)
        else:
            if self._queries is not None:
                self._queries = self._queries[rows]
            stepped = self._decode(slots[rows], kept[rows], kept_raw[rows], normalized[rows], real[rows])
        ok = stepped["ok"]
        status[rows[~ok]] = int(StepCode.DECODE_OVERFLOW)
        del stepped["ok"]
        if rows.shape[0] == count and bool(ok.all()):  # the usual case: every row stepped, no copies
            out = TensorStep(status=status, contexts=None, **stepped)
        else:
            done = rows[ok]
            out = _blank_step(count, width, device, status, stepped["path"].shape[1])
            for name, values in stepped.items():
                getattr(out, name)[done] = values[ok]
        if contexts:
            out = out._replace(
                contexts=context_codes(self.contexts, self.context_limit, out.chunks, out.candidates, out.status == 0)
            )
        return out

    def _checked_rows(self, slots: Tensor, codes: Tensor, raw: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """The torch row checks of :meth:`step`: ``(status (S,), kept (S, M), kept_raw (S, M),
        counts (S,))`` (see :func:`~mapmatched_torch.kernels.fused_step.checked_rows`, their
        one-pass CPU kernel)."""
        device, width = self.device, self.width
        count = slots.shape[0]
        status = torch.zeros(count, dtype=torch.long, device=device)

        def flag(code: StepCode, bad: Tensor) -> None:
            status.masked_fill_((status == 0) & bad, int(code))

        capacity = self._live.shape[0]
        flag(StepCode.UNKNOWN_SLOT, (slots < 0) | (slots >= capacity) | ~self._live[slots.clamp(0, capacity - 1)])
        ordered, order = slots.sort(stable=True)
        repeated_sorted = torch.zeros_like(ordered, dtype=torch.bool)
        same = ordered[1:] == ordered[:-1]
        repeated_sorted[1:] |= same
        repeated_sorted[:-1] |= same
        flag(StepCode.REPEATED_SLOT, torch.zeros_like(repeated_sorted).scatter(0, order, repeated_sorted))
        listed = codes >= 0
        listed_count = listed.sum(1)
        columns = torch.arange(codes.shape[1], device=device).unsqueeze(0)
        flag(StepCode.OUT_OF_RANGE, ((codes < -1) | (codes >= len(self.codes))).any(1))
        flag(StepCode.GAPPED, (listed != (columns < listed_count.unsqueeze(1))).any(1))
        flag(StepCode.NONFINITE_SCORE, (listed & ~torch.isfinite(raw)).any(1))
        # shape: (S, M) the kept columns
        kept = torch.full((count, width), -1, dtype=torch.long, device=device)
        kept_raw = torch.zeros((count, width), dtype=torch.float64, device=device)
        cut = min(width, codes.shape[1])
        kept[:, :cut] = codes[:, :cut]
        kept_raw[:, :cut] = torch.where(codes[:, :cut] >= 0, raw[:, :cut], 0.0)
        real = kept >= 0
        sorted_codes = kept.sort(1).values
        flag(StepCode.DUPLICATE, ((sorted_codes[:, 1:] == sorted_codes[:, :-1]) & (sorted_codes[:, 1:] >= 0)).any(1))
        counts = real.sum(1)
        flag(StepCode.EMPTY, counts == 0)
        return status, kept, kept_raw, torch.where(status == 0, counts, 0)

    def _decode(
        self, slots: Tensor, codes: Tensor, raw: Tensor, normalized: Tensor, real: Tensor,
        active: Optional[Tensor] = None,
    ) -> Dict[str, Tensor]:
        """The decoding step of clean rows; returns the TensorStep fields for them (and
        ``ok``). With ``active``, every row, the others on the decoder's spare slot, and
        no host read."""
        decoder = self.decoder
        spare = active is not None
        if spare:
            decoder.reserve_turn()  # (growth first: the spare slot's index is the capacity)
            slots = torch.where(active, slots, decoder.spare_slot)
        lengths = decoder.lengths(slots)
        distances = None
        started = lengths > 0
        if decoder.mode.uses_distances and (spare or bool(started.any())):
            # a first turn has no move into it: zeros, whatever else the batch holds (so a
            # slot's saved links never depend on its batch-mates); when every slot has a
            # previous turn (the host read above said some have), the (S, M, M) copy is skipped
            distances = self._distances(slots, lengths, codes, synchronize=not spare)
            if spare or not bool(started.all()):
                distances = torch.where(started.view(-1, 1, 1), distances, 0.0)
        features = None
        if distances is not None and self.learned is not None and self.learned.needs_features:
            features = self._features(slots, lengths, codes, normalized, real, spare, active)
        previous = decoder.payload("path", spare_slot=spare)[slots].clone()
        step = decoder.step(
            slots, normalized, real, distances, payload={"codes": codes, "raw": raw, "normalized": normalized},
            active=active, features=features,
        )
        ok = step.ok
        # shape: (S, T) the path before this step (the table may have grown its turns)
        before = _widened(previous, step.paths.shape[1])
        if spare:
            targets = torch.where(ok, slots, decoder.spare_slot)
            decoder.put_rows("previous_path", targets, before)
            decoder.put_rows("path", targets, step.paths)
        else:
            decoder.put_rows("previous_path", slots[ok], before[ok])
            decoder.put_rows("path", slots[ok], step.paths[ok])
        fields = self._fields(slots, step, before, spare_slot=spare)
        fields["ok"] = ok
        return fields

    def current(self, slots: Tensor) -> TensorStep:
        """The :class:`TensorStep` of each slot's latest step, without a step (a slot with
        no turns: an all -1 row with status OK)."""
        slots = slots.to(self.device)
        decoder = self.decoder
        step = decoder.current(slots)
        before = _widened(decoder.payload("previous_path")[slots], step.paths.shape[1])
        fields = self._fields(slots, step, before)
        count = slots.shape[0]
        out = _blank_step(count, self.width, self.device, torch.zeros(count, dtype=torch.long, device=self.device),
                          step.paths.shape[1])
        return out._replace(**fields)

    def _fields(self, slots: Tensor, step, before: Tensor, *, spare_slot: bool = False) -> Dict[str, Tensor]:
        """The :class:`TensorStep` fields of slots decoded as ``step`` (a
        :class:`~mapmatched_torch.kernels.slot_decoder.SlotStep`), ``before``: their
        ``(S, T)`` paths before the step (-1 where none); ``spare_slot``: ``slots`` may
        name the decoder's spare slot."""
        decoder = self.decoder
        turns = step.paths.shape[1]
        advanced = step.paths >= 0
        codes = decoder.payload("codes", spare_slot=spare_slot)
        # shape: (S, T) the decoded candidate's code and normalized score at every turn
        stored = _along_paths(codes, slots, step.paths)
        scores = _along_paths(decoder.payload("normalized", spare_slot=spare_slot), slots, step.paths)
        path = torch.where(advanced, stored, -1)
        last = (step.lengths - 1).clamp_min(0)
        revised = advanced & (before >= 0) & (before != step.paths)
        revised &= torch.arange(turns, device=self.device).unsqueeze(0) < last.unsqueeze(1)
        lag = decoder.fixed_lag
        committed = (step.lengths - lag - 1).clamp_min(-1) if lag is not None else torch.full_like(step.lengths, -1)
        emissions = torch.where(advanced, decoder.emission_weight * scores, 0.0)
        if self.learned is not None:  # the learned model's costs along the path
            transitions = decoder.path_costs(slots, step.paths, spare_slot=spare_slot)
        else:
            transitions = torch.where(advanced, decoder.settings.transition_cost(step.path_distances), 0.0)
        newest = codes[slots, last]
        return {
            "chunks": torch.where(step.lengths > 0, path.gather(1, last.unsqueeze(1)).squeeze(1), -1),
            "path": path,
            "path_index": step.paths,
            "lengths": step.lengths,
            "revised": revised,
            "committed_through": committed,
            "emissions": emissions,
            "transitions": transitions,
            "distances": step.path_distances,
            "final_scores": step.final_scores.to(torch.float64),
            "candidates": torch.where((step.lengths > 0).unsqueeze(1), newest, -1),
        }

    def _distances(self, slots: Tensor, lengths: Tensor, codes: Tensor, *, synchronize: bool = True) -> Tensor:
        """(S, M, M) float64 distances from each slot's last turn to the new one
        (``synchronize`` False: ``slots`` may name the spare slot, and a tensor graph with
        a dense table answers without a host read)."""
        decoder = self.decoder
        previous = decoder.payload("codes", spare_slot=not synchronize)[slots, (lengths - 1).clamp_min(0)]
        previous = torch.where((lengths > 0).unsqueeze(1), previous, -1)
        if self._tensor_graph:
            # shape: (S, 2, M) the last and the new turn -> (S, M, M)
            pair = self.codes.graph_codes(torch.stack([previous, codes], 1)).to(self.graph.device)
            return self.graph.trellis_distances(pair, validate=synchronize)[:, 0].to(self.device)
        names = self.codes.names
        before = [[name for name in names(row) if name is not None] for row in previous.tolist()]
        after = [[name for name in names(row) if name is not None] for row in codes.tolist()]
        return step_distances(
            self.graph, [row if row else None for row in before], after, self.width, self.device
        )

    def _checked_queries(self, query_embeddings: Optional[Tensor], count: int) -> Optional[Tensor]:
        """The step's ``(S, D)`` query embeddings on the device, checked (None when the
        learned model does not read them)."""
        if self.learned is None or not self.learned.needs_query:
            return None
        if query_embeddings is None:
            return None  # (refused in _features, only when a slot has a previous turn)
        queries = self.learned.check_query(query_embeddings)
        if queries.dim() != 2 or queries.shape[0] != count:
            raise MapMatchedValueError(
                f"query_embeddings must be (S, D) with S = {count} rows, got {tuple(queries.shape)}"
            )
        return queries.to(self.device)

    def _features(self, slots: Tensor, lengths: Tensor, codes: Tensor, normalized: Tensor, real: Tensor,
                  spare: bool, active: Optional[Tensor] = None) -> Tensor:
        """(S, M, 1) float64 gate features of the moves out of each slot's last turn into
        the new one (:func:`~mapmatched_torch.kernels.gate_features.step_features`: chunk
        codes are the identities; with passage embeddings, the codes' rows, looked up by
        chunk ID on the host)."""
        learned = self.learned
        assert learned is not None
        previous = self.decoder.payload("codes", spare_slot=spare)[slots, (lengths - 1).clamp_min(0)]
        started = lengths > 0 if active is None else (lengths > 0) & active
        previous = torch.where(started.unsqueeze(1), previous, -1)
        previous_mask = previous >= 0
        if not learned.needs_query:
            return step_features(previous, previous_mask, codes, normalized, real)
        queries = self._queries
        if queries is None:
            queries = learned.check_query(None)  # raises: the cosine needs the query embeddings
        rows = torch.tensor(learned.embedding_rows(self.codes.names(previous.view(-1).tolist())),
                            dtype=torch.long).view(previous.shape)
        assert self._passages is not None
        return step_features(rows.to(self.device), previous_mask, codes, normalized, real, queries,
                             self._passages.to(self.device))

    # ----------------------------------------------------------- persistence

    def state_dict(self) -> Dict[str, object]:
        """The slot table (with its checksum) and the chunk codes beyond the graph's."""
        return {"decoder": self.decoder.state_dict(), "codes": self.codes.state_dict()}

    def check_payload(self, state: Dict[str, object], code_count: int) -> None:
        """The payload of a (validated) decoder state is consistent with its lengths and
        ``code_count`` chunk codes (MapMatchedValueError otherwise)."""
        tensors = state["tensors"]
        lengths = tensors["lengths"]
        turns = tensors["payload.codes"].shape[1]
        used = torch.arange(turns).unsqueeze(0) < lengths.unsqueeze(1)
        codes = tensors["payload.codes"]
        problems = {
            "chunk codes outside [-1, number of codes)": (codes < -1) | (codes >= code_count),
            "a turn without candidates": used & (codes[:, :, 0] < 0),
            "non-finite stored scores": ~torch.isfinite(tensors["payload.raw"]) | ~torch.isfinite(tensors["payload.normalized"]),
            "stored paths outside [-1, width)": (tensors["payload.path"] < -1) | (tensors["payload.path"] >= self.width),
        }
        for problem, bad in problems.items():
            if bool(bad.any()):
                raise MapMatchedValueError(f"refusing the session store state: {problem}; nothing was changed")

    def load_state_dict(self, state: Dict[str, object], also_check=None) -> None:
        """Restore :meth:`state_dict`, validated first (nothing changes if refused), every
        new object prepared before any is installed."""
        if not isinstance(state, dict) or set(state) != {"decoder", "codes"}:
            raise MapMatchedValueError("refusing the session store state: expected the keys ['codes', 'decoder']")
        codes = ChunkCodes(self.graph, self.codes.floor)
        codes.load_state_dict(state["codes"])

        def check(decoder_state: Dict[str, object]) -> None:
            self.check_payload(decoder_state, len(codes))
            if also_check is not None:
                also_check(decoder_state)

        prepared = self.decoder.prepare_load(state["decoder"], also_check=check)
        # new objects, not edits: results handed out before keep reading the old ones
        contexts = self.contexts.renumbered(codes)
        decoder_state = state["decoder"]
        live = torch.zeros(decoder_state["tensors"]["lengths"].shape[0], dtype=torch.bool, device=self.device)
        live[: decoder_state["allocated"]] = True
        live[list(decoder_state["free"])] = False
        with deferred_sigint():  # all prepared: commit
            self.decoder.commit_load(prepared)
            self.codes, self.contexts, self._live = codes, contexts, live


def _blank_step(count: int, width: int, device: torch.device, status: Tensor, turns: int = 1) -> TensorStep:
    """A :class:`TensorStep` of S failed rows (``status`` kept), T turns wide."""

    def full(shape, fill, dtype=torch.long):
        return torch.full(shape, fill, dtype=dtype, device=device)

    return TensorStep(
        status=status,
        chunks=full((count,), -1),
        path=full((count, turns), -1),
        path_index=full((count, turns), -1),
        lengths=full((count,), 0),
        revised=full((count, turns), False, torch.bool),
        committed_through=full((count,), -1),
        emissions=full((count, turns), 0.0, torch.float64),
        transitions=full((count, turns), 0.0, torch.float64),
        distances=full((count, turns), 0.0, torch.float64),
        final_scores=full((count, width), -float("inf"), torch.float64),
        candidates=full((count, width), -1),
        contexts=None,
    )


def _along_paths(table: Tensor, slots: Tensor, paths: Tensor) -> Tensor:
    """``(S, T)``: ``table[slots[s], t, paths[s, t]]`` of a ``(C, T_cap, M)`` payload (any
    value where ``paths`` is -1), one flat gather of S x T cells."""
    _, turns, width = table.shape
    columns = torch.arange(paths.shape[1], device=paths.device).unsqueeze(0)
    flat = (slots.unsqueeze(1) * turns + columns) * width + paths.clamp_min(0)
    return table.reshape(-1).take(flat)


def refuse_rows(step: TensorStep, rows: Tensor, code: StepCode) -> None:
    """Mark ``rows`` of ``step`` failed with ``code``, in place: their fields get a failed
    row's values (the caller has taken their turns back)."""
    blank = _blank_step(rows.shape[0], step.final_scores.shape[1], step.status.device, step.status[rows],
                        step.path.shape[1])
    for name, values in blank._asdict().items():
        tensor = getattr(step, name)
        if name != "status" and tensor is not None and values is not None:
            tensor[rows] = values
        elif name == "contexts" and tensor is not None:
            tensor[rows] = -1
    step.status[rows] = int(code)


def _widened(paths: Tensor, turns: int) -> Tensor:
    """``(S, turns)``: ``paths`` cut or padded with -1 to ``turns`` columns."""
    out = torch.full((paths.shape[0], turns), -1, dtype=paths.dtype, device=paths.device)
    shared = min(turns, paths.shape[1])
    out[:, :shared] = paths[:, :shared]
    return out


def context_codes(
    table: ContextTable, limit: Optional[int], chunks: Tensor, candidates: Tensor, rows: Tensor,
    fixed: bool = False,
) -> Tensor:
    """``(S, C)`` long context codes of S decoded chunks (``(S,)`` codes) and their turns'
    ``(S, M)`` candidate codes, for the ``(S,)`` bool ``rows`` (others: all -1): the
    chunk, its neighbourhood (``table``), then the candidates, first occurrences in that
    order, cut at ``limit`` (None: none), -1 padded. ``fixed``: C is 1 + the table's
    width + M (at most ``limit``) and nothing is read back to the host (with a
    :attr:`~ContextTable.complete` table), else C is the widest row's."""
    if fixed:
        # shape: (S, 1 + W + M) everything in order, -1 for nothing and for the rows not wanted
        listed = torch.cat([chunks.unsqueeze(1), table.rows(chunks.clamp_min(0), synchronize=False), candidates], 1)
        listed = torch.where(rows.unsqueeze(1), listed, -1)
        width = listed.shape[1] if limit is None else min(limit, listed.shape[1])
        return _first_occurrences_in(listed, width)
    count = chunks.shape[0]
    picked = rows.nonzero().view(-1)
    if picked.numel() == 0:
        return torch.full((count, 0), -1, dtype=torch.long, device=chunks.device)
    found = _first_occurrences(chunks[picked], table.rows(chunks[picked]), candidates[picked], limit)
    block = torch.full((count, found.shape[1]), -1, dtype=torch.long, device=chunks.device)
    block[picked] = found
    return block


def _first_occurrences(chunks: Tensor, neighbours: Tensor, candidates: Tensor, limit: Optional[int]) -> Tensor:
    """(S, C) the decoded chunk, its neighbours, then the candidates: first occurrences,
    in that order, -1 padded, cut at ``limit`` (None: every one)."""
    # shape: (S, L) everything in order, -1 for nothing
    listed = torch.cat([chunks.unsqueeze(1), neighbours, candidates], 1)
    fused = fused_step.first_occurrences(listed, limit)  # one pass on the CPU
    if fused is not None:
        return fused
    count = listed.shape[0]
    width = int(_kept(listed).sum(1).max()) if count else 0
    if limit is not None:
        width = min(width, limit)
    return _first_occurrences_in(listed, width)


def _kept(listed: Tensor) -> Tensor:
    """(S, L) bool: each code's first occurrence in its row (not -1)."""
    # a stable sort by code puts each code's first occurrence first among its copies
    by_code, order = listed.sort(dim=1, stable=True)
    repeat = torch.zeros_like(by_code, dtype=torch.bool)
    repeat[:, 1:] = by_code[:, 1:] == by_code[:, :-1]
    duplicate = torch.zeros_like(repeat).scatter(1, order, repeat)
    return (listed >= 0) & ~duplicate


def _first_occurrences_in(listed: Tensor, width: int) -> Tensor:
    """(S, width): each row's first occurrences of its codes (:func:`_kept`), in order, -1 padded."""
    count, length = listed.shape
    positions = torch.arange(length, device=listed.device).expand(count, length)
    # shape: (S, L) the kept entries first, in their order
    moved = torch.where(_kept(listed), positions, length).sort(1).values
    if width > length:  # (a fixed width beyond every entry: padding)
        moved = torch.cat([moved, moved.new_full((count, width - length), length)], 1)
    moved = moved[:, :width]
    return torch.where(moved < length, listed.gather(1, moved.clamp_max(length - 1)), -1)
