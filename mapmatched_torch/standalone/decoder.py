"""The pure-Python reference decoder: docs/spec.md section 5, literally.

:class:`StandaloneDecoder` is the oracle every tensor path is tested against. It is
written for clarity, not speed: a full decode costs O(T M^2) Python operations and
``T - 1`` tables of ``M x M`` graph distances; a fixed-lag decode runs the lock
procedure literally (T prefix decodes, O(T^2 M^2)).
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple, Union

from ..core.checks import check_trellis
from ..core.errors import MapMatchedValueError
from ..core.models import CandidateScore, DecodedPath, DecoderCandidate
from ..core.path_reports import NONFINITE_MESSAGE, rank_final_candidates, report_path
from ..core.protocols import CorpusGraph
from ..core.settings import DecodeSettings

__all__ = ["StandaloneDecoder", "TransitionCosts"]

Table = List[List[float]]

#: A learned transition model as the reference takes it (docs/spec.md section 11): the
#: T-1 tables of weighted transition costs ``costs[t-1][j][i]`` (what the decoder
#: subtracts for the move from candidate j of turn t-1 to candidate i of turn t; the
#: fixed model's is ``beta * d``), or a function ``costs(t, distances)`` giving that table
#: for turn t >= 1 from the raw distance table ``distances[j][i]`` into it.
TransitionCosts = Union[Sequence[Sequence[Sequence[float]]], Callable[[int, Table], Sequence[Sequence[float]]]]


def _distance_tables(turns: Sequence[Sequence[DecoderCandidate]], graph: CorpusGraph) -> List[Table]:
    """``tables[t-1][j][i]`` = d(candidate j of turn t-1, candidate i of turn t)."""
    return [
        [[graph.distance(source.chunk_id, target.chunk_id) for target in turns[t]] for source in turns[t - 1]]
        for t in range(1, len(turns))
    ]


def _learned_costs(
    transition_costs: TransitionCosts, tables: List[Table], turns: Sequence[Sequence[DecoderCandidate]]
) -> List[Table]:
    """The T-1 cost tables of a learned model (a function is called once per turn),
    checked: one ``len(turns[t-1]) x len(turns[t])`` table of finite floats per move."""
    if callable(transition_costs):
        given = [transition_costs(t, tables[t - 1]) for t in range(1, len(turns))]
    else:
        given = list(transition_costs)
    if len(given) < len(turns) - 1:
        raise MapMatchedValueError(
            f"transition_costs must give {len(turns) - 1} tables (one per move between turns), got {len(given)}"
        )
    costs: List[Table] = []
    for t in range(1, len(turns)):
        table = [[float(value) for value in row] for row in given[t - 1]]
        rows, columns = len(turns[t - 1]), len(turns[t])
        if len(table) < rows or any(len(row) < columns for row in table[:rows]):
            raise MapMatchedValueError(
                f"transition_costs table {t - 1} (into turn {t}) must be at least {rows} x {columns}"
            )
        table = [row[:columns] for row in table[:rows]]
        if not all(math.isfinite(value) for row in table for value in row):
            raise MapMatchedValueError(f"transition_costs table {t - 1} (into turn {t}) must be finite")
        costs.append(table)
    return costs


def _forward(
    emissions: Sequence[Sequence[float]],
    costs: Optional[Sequence[Table]],
    locks: Sequence[Optional[int]],
) -> Tuple[List[List[Optional[float]]], List[List[int]]]:
    """Max-plus forward pass over ``len(emissions)`` turns.

    ``costs[t-1][j][i]`` is the weighted transition cost beta * d (None: all zero).
    A locked turn allows only its locked candidate (others get None). Returns the
    forward scores and backpointers; raises ValueError on a non-finite score.
    """
    scores: List[List[Optional[float]]] = []
    backpointers: List[List[int]] = []
    for t, turn_emissions in enumerate(emissions):
        row: List[Optional[float]] = []
        pointers: List[int] = []
        for i, emission in enumerate(turn_emissions):
            if locks[t] is not None and locks[t] != i:
                row.append(None)
                pointers.append(-1)
                continue
            if t == 0:
                score, best_j = emission, -1
            else:
                best: Optional[float] = None
                best_j = -1
                for j, previous in enumerate(scores[t - 1]):
                    if previous is None:
                        continue
                    value = previous - (costs[t - 1][j][i] if costs is not None else 0.0)
                    if best is None or value > best:
                        best, best_j = value, j
                score = emission + best
            if not math.isfinite(score):
                raise MapMatchedValueError(f"{NONFINITE_MESSAGE} at turn {t}")
            row.append(score)
            pointers.append(best_j)
        scores.append(row)
        backpointers.append(pointers)
    return scores, backpointers


def _first_argmax(values: Sequence[Optional[float]]) -> int:
    best = -1
    for index, value in enumerate(values):
        if value is not None and (best < 0 or value > values[best]):
            best = index
    return best


def _backtrack(scores: List[List[Optional[float]]], backpointers: List[List[int]]) -> List[int]:
    path = [_first_argmax(scores[-1])]
    for t in range(len(scores) - 1, 0, -1):
        path.append(backpointers[t][path[-1]])
    path.reverse()
    return path


class StandaloneDecoder:
    """Reference implementation of the ``Decoder`` protocol (docs/spec.md section 5).

    Stateless; weights and the lag are passed per call (as keywords, or as one
    ``settings=`` :class:`~mapmatched_torch.core.settings.DecodeSettings`), so one
    decoder serves any number of retrievers.

    Example:
        >>> from mapmatched_torch import DecoderCandidate, InMemoryCorpusGraph, StandaloneDecoder
        >>> graph = InMemoryCorpusGraph.from_edges([("a", "b")])
        >>> trellis = [[DecoderCandidate("a", 1.0, 1.0)], [DecoderCandidate("c", 2.0, 1.0), DecoderCandidate("b", 1.0, 0.5)]]
        >>> StandaloneDecoder().decode(trellis, graph).chunk_ids
        ('a', 'b')
    """

    def decode(
        self,
        trellis: Sequence[Sequence[DecoderCandidate]],
        graph: CorpusGraph,
        *,
        emission_weight: float = 1.0,
        transition_weight: float = 1.0,
        fixed_lag: Optional[int] = None,
        settings: Optional[DecodeSettings] = None,
        transition_costs: Optional[TransitionCosts] = None,
    ) -> DecodedPath:
        """Decode the best path (full Viterbi, or fixed-lag with ``fixed_lag``).

        Args:
            trellis: T >= 1 turns, each a non-empty list of :class:`DecoderCandidate`
                (unique chunk IDs within a turn; order breaks ties).
            graph: gives ``distance(a, b)`` (not consulted when transition_weight == 0).
            emission_weight: lambda >= 0. transition_weight: beta >= 0.
            fixed_lag: None for full decoding, or L >= 0.
            settings: the three options above as one
                :class:`~mapmatched_torch.core.settings.DecodeSettings` (then leave them
                at their defaults).
            transition_costs: a learned transition model's costs (:data:`TransitionCosts`:
                T-1 tables ``[t-1][j][i]``, or a function of the turn and its distance
                table) in place of ``beta * d``; the settings' beta is then not used.
                The path reports the graph distances and these costs.

        Returns:
            The :class:`DecodedPath` (one step per turn).
        """
        return self.decode_ranked(
            trellis, graph, emission_weight=emission_weight, transition_weight=transition_weight, fixed_lag=fixed_lag,
            settings=settings, transition_costs=transition_costs,
        )[0]

    def decode_ranked(
        self,
        trellis: Sequence[Sequence[DecoderCandidate]],
        graph: CorpusGraph,
        *,
        emission_weight: float = 1.0,
        transition_weight: float = 1.0,
        fixed_lag: Optional[int] = None,
        settings: Optional[DecodeSettings] = None,
        transition_costs: Optional[TransitionCosts] = None,
    ) -> Tuple[DecodedPath, Tuple[CandidateScore, ...]]:
        """Like :meth:`decode`, plus the final turn's candidates ranked by trajectory score.

        The ranking uses the same committed-turn locks as the decode (so with a lag its
        top is the decoded chunk, up to chunk-ID order among exact ties).
        """
        turns = check_trellis(trellis)
        settings = DecodeSettings.resolve(
            settings, emission_weight=emission_weight, transition_weight=transition_weight, fixed_lag=fixed_lag
        )
        lam, lag = settings.emission_weight, settings.fixed_lag
        emissions = [[lam * candidate.normalized_score for candidate in turn] for turn in turns]
        learned = transition_costs is not None
        tables = _distance_tables(turns, graph) if settings.mode.uses_distances or learned else None
        if learned:
            costs = _learned_costs(transition_costs, tables, turns)
        else:
            cost = settings.transition_cost
            costs = None if tables is None else [[[cost(d) for d in row] for row in table] for table in tables]

        locks: List[Optional[int]] = [None] * len(turns)
        if lag is not None:
            for t in range(len(turns)):
                scores, backpointers = _forward(emissions[: t + 1], costs, locks)
                if t >= lag:
                    locks[t - lag] = (
                        _backtrack(scores, backpointers)[t - lag] if costs is not None else _first_argmax(emissions[t - lag])
                    )
        scores, backpointers = _forward(emissions, costs, locks)
        if costs is None:
            # beta = 0: the exact per-turn argmax (the max-plus backtrack could see
            # rounding ties that the emissions themselves do not have).
            chosen = [_first_argmax(turn) for turn in emissions]
        else:
            chosen = _backtrack(scores, backpointers)
        path = report_path(
            turns,
            chosen,
            lambda t: tables[t - 1][chosen[t - 1]][chosen[t]],
            settings,
            step_cost=(lambda t: costs[t - 1][chosen[t - 1]][chosen[t]]) if learned else None,
        )
        return path, rank_final_candidates(turns[-1], scores[-1])
