"""Host-side streaming: turns of chunk IDs into the slot decoder, and one conversation decoded incrementally.

:class:`~mapmatched_torch.kernels.slot_decoder.SlotDecoder` holds the dynamic program's
state; this module packs new turns into its tensors (:func:`turn_tensors`), fills the
distances a step needs from the corpus graph (:func:`step_distances`), turns a step's
rows back into the standalone decoder's path report (:func:`report_step`), and wraps
one slot as :class:`DecodingStream`, the incremental decoder a session uses with
:class:`~mapmatched_torch.retrieval.torch_decoder.TorchDecoder`.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..core.errors import MapMatchedValueError
from ..core.models import CandidateScore, DecodedPath, DecodedStep, DecoderCandidate
from ..core.path_reports import NONFINITE_MESSAGE, rank_final_candidates, report_path
from ..core.protocols import CorpusGraph
from ..core.settings import DecodeSettings
from ..kernels.slot_decoder import SlotDecoder, SlotStep
from .trellis import consecutive_distances, packed_rows

__all__ = ["SlotDecoder", "SlotStep", "DecodingStream", "turn_tensors", "report_step"]



# ------------------------------------------------------------ host-side glue


def turn_tensors(
    turns: Sequence[Sequence[float]], width: int, device: Optional[torch.device] = None
) -> Tuple[Tensor, Tensor]:
    """S new turns' normalized scores -> (scores (S, M) float64 zero-padded, mask (S, M) bool)."""
    for turn in turns:
        if len(turn) > width:
            raise MapMatchedValueError(f"a turn has {len(turn)} candidates but the decoder's width is {width}")
    lengths = torch.tensor([len(turn) for turn in turns], dtype=torch.long)
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    scores = packed_rows(turns, width, 0.0, torch.float64)
    return scores.to(device), mask.to(device)


def step_distances(
    graph: CorpusGraph,
    previous: Sequence[Optional[Sequence[str]]],
    new: Sequence[Sequence[str]],
    width: int,
    device: Optional[torch.device] = None,
) -> Tensor:
    """(S, M, M) float64 distances from each conversation's previous turn to its new one
    (maximum_distance rows for a conversation without a previous turn; masked anyway)."""
    pairs = [(tuple(before) if before is not None else (), tuple(after)) for before, after in zip(previous, new)]
    return consecutive_distances(pairs, graph, turns=2, width=width, device=device)[:, 0]


def report_step(
    trellis: Sequence[Sequence[DecoderCandidate]],
    path_row: Sequence[int],
    distance_row: Sequence[float],
    final_row: Sequence[float],
    *,
    emission_weight: float = 1.0,
    transition_weight: float = 1.0,
    fixed_lag: Optional[int] = None,
    reuse: Sequence[DecodedStep] = (),
    settings: Optional[DecodeSettings] = None,
    cost_row: Optional[Sequence[float]] = None,
) -> Tuple[DecodedPath, Tuple[CandidateScore, ...]]:
    """One conversation's :class:`SlotStep` row (as Python lists) -> path and ranking
    (decoded with ``settings``, or with the three loose options; ``cost_row``: a learned
    model's :meth:`SlotDecoder.path_costs` row)."""
    settings = DecodeSettings.resolve(
        settings, emission_weight=emission_weight, transition_weight=transition_weight, fixed_lag=fixed_lag
    )
    path = report_path(trellis, path_row[: len(trellis)], lambda t: distance_row[t], settings, reuse=reuse,
                       step_cost=None if cost_row is None else (lambda t: cost_row[t]))
    return path, rank_final_candidates(trellis[-1], final_row[: len(trellis[-1])])


class DecodingStream:
    """One conversation decoded incrementally (what a session uses with TorchDecoder).

    :meth:`push` adds a turn in one M x M step (plus the uncommitted tail with a lag)
    and returns exactly what the standalone decoder returns for the whole trellis;
    :meth:`rollback` undoes the last push (the session's transactional turns).

    Args:
        graph: the corpus graph. width: M (the retriever's candidate_limit).
        emission_weight, transition_weight, fixed_lag: as for the decoders.
        dtype, device: of the dynamic program.
        settings: a :class:`~mapmatched_torch.core.settings.DecodeSettings` in place of
            the three options.
        transitions: a learned transition model (see
            :class:`~mapmatched_torch.kernels.slot_decoder.SlotDecoder`); each
            :meth:`push` then takes the turn's gate features.
    """

    def __init__(
        self,
        graph: CorpusGraph,
        width: int,
        *,
        emission_weight: float = 1.0,
        transition_weight: float = 1.0,
        fixed_lag: Optional[int] = None,
        dtype: torch.dtype = torch.float64,
        device: Optional[Union[str, torch.device]] = None,
        settings: Optional[DecodeSettings] = None,
        transitions: Optional[object] = None,
    ) -> None:
        self.graph = graph
        self._decoder = SlotDecoder(
            width,
            settings=DecodeSettings.resolve(
                settings, emission_weight=emission_weight, transition_weight=transition_weight, fixed_lag=fixed_lag
            ),
            capacity=1,
            dtype=dtype,
            device=device,
            transitions=transitions,
        )
        self._slot = self._decoder.allocate()
        self._trellis: List[Tuple[DecoderCandidate, ...]] = []
        self._path: Optional[DecodedPath] = None
        self._undo: Optional[Tuple[Optional[DecodedPath]]] = None  # (the path before the last push,)

    def push(
        self, turn: Sequence[DecoderCandidate], features: Optional[Tensor] = None
    ) -> Tuple[DecodedPath, Tuple[CandidateScore, ...]]:
        """Decode the trellis extended by ``turn`` (validated by the caller); ``features``:
        ``(M, K)`` the learned model's gate features of the moves into it (None at the
        first turn or without a learned model).

        Raises the nonfinite-score ValueError (and leaves the stream unchanged) when a
        forward score overflows.
        """
        decoder, turn = self._decoder, tuple(turn)
        scores, mask = turn_tensors([[c.normalized_score for c in turn]], decoder.width, decoder.device)
        distances = None
        if self._trellis and decoder.mode.uses_distances:
            previous = [candidate.chunk_id for candidate in self._trellis[-1]]
            distances = step_distances(self.graph, [previous], [[c.chunk_id for c in turn]], decoder.width, decoder.device)
        slots = torch.tensor([self._slot], dtype=torch.long, device=decoder.device)
        out = decoder.step(slots, scores, mask, distances,
                           features=None if features is None else features.unsqueeze(0))
        try:  # all or nothing: a failure after the step (even KeyboardInterrupt) restores the slot
            if not bool(out.ok[0]):
                raise MapMatchedValueError(f"{NONFINITE_MESSAGE} at turn {len(self._trellis)}")
            trellis = self._trellis + [turn]
            path, ranking = report_step(
                trellis,
                out.paths[0].tolist(),
                out.path_distances[0].tolist(),
                out.final_scores[0].double().tolist(),
                settings=decoder.settings,
                reuse=self._path.steps if self._path is not None else (),
                cost_row=None if decoder.transitions is None else decoder.path_costs(slots, out.paths)[0].tolist(),
            )
        except BaseException:
            decoder.undo_last()  # (an overflowing step wrote nothing: nothing to take back)
            raise
        self._undo = (self._path,)
        self._trellis = trellis
        self._path = path
        return path, ranking

    def rollback(self) -> None:
        """Undo the last :meth:`push` (only one level)."""
        if self._undo is None:
            raise MapMatchedValueError("nothing to roll back")
        (path,) = self._undo
        self._decoder.undo_last()  # the stream's own table: its last step was this push
        self._trellis.pop()
        self._path = path
        self._undo = None
