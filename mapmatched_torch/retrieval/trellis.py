"""Packing ragged Python trellises into padded tensors, and back (docs/spec.md section 10).

A batch of B conversations, each a list of turns of
:class:`~mapmatched_torch.core.models.DecoderCandidate`, becomes padded (B, T, M) tensors
with a bool mask; T and M are the batch maxima. Chunk IDs stay Python strings here
(the graph owns the ID -> node index vocabulary).

:func:`packed_rows` is the fast path for ragged rows of numbers: ``torch.tensor`` on a
nested list reads every element through the generic sequence protocol (about 3 ms for
1024 x 32 ints here); filling an ``array.array`` and sharing its buffer costs about a
tenth of that, which matters in a serving step that packs every session's turn.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch

from ..core.checks import check_sequence, check_trellis
from ..core.errors import MapMatchedValueError
from ..core.protocols import CorpusGraph, implements
from ..graph.protocols import TrellisGraph

__all__ = [
    "PackedTrellis",
    "pack_trellises",
    "pairwise_distances",
    "consecutive_distances",
    "unpack_paths",
    "packed_rows",
]


@dataclass(frozen=True)
class PackedTrellis:
    """A padded batch of trellises.

    Attributes:
        scores: (B, T, M) normalized scores, 0 at padding.
        raw_scores: (B, T, M) raw scores, 0 at padding.
        mask: (B, T, M) bool, True at real candidates; real turns come first and real
            candidates fill each turn from index 0.
        lengths: (B,) long, the number of turns of each conversation.
        chunk_ids: B tuples of T_b tuples of chunk IDs (no padding).
        trellises: the validated input, B tuples of turns of candidates.
    """

    scores: torch.Tensor
    raw_scores: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    chunk_ids: Tuple[Tuple[Tuple[str, ...], ...], ...]
    trellises: Tuple[Tuple[Tuple[Any, ...], ...], ...]

    @property
    def shape(self) -> Tuple[int, int, int]:
        """(B, T, M)."""
        return tuple(self.mask.shape)  # type: ignore[return-value]


def pack_trellises(
    trellises: Sequence[Sequence[Sequence[Any]]],
    *,
    dtype: torch.dtype = torch.float64,
    device: Optional[torch.device] = None,
) -> PackedTrellis:
    """Validate and pad B trellises into (B, T, M) tensors.

    Args:
        trellises: B >= 1 trellises, each validated like the standalone decoder's input
            (non-empty turns, unique IDs per turn, finite scores); errors name the
            conversation.
        dtype: floating dtype of the score tensors (float64 for exact parity).
        device: where the tensors live (default: CPU).

    Returns:
        A :class:`PackedTrellis`. Cost: O(B T M) Python work, one host-to-device copy.
    """
    trellises = check_sequence(trellises, "trellises", "a sequence of trellises (one per conversation)")
    if len(trellises) == 0:
        raise MapMatchedValueError("need at least one trellis to pack")
    validated = []
    for index, trellis in enumerate(trellises):
        try:
            validated.append(check_trellis(trellis))
        except MapMatchedValueError as error:  # the same class (a MapMatchedTypeError stays one)
            raise type(error)(f"conversation {index}: {error}") from None
    turns = max(len(trellis) for trellis in validated)
    width = max(len(turn) for trellis in validated for turn in trellis)
    # shape: (B, T, M)
    scores = [[[0.0] * width for _ in range(turns)] for _ in validated]
    raw = [[[0.0] * width for _ in range(turns)] for _ in validated]
    mask = [[[False] * width for _ in range(turns)] for _ in validated]
    for b, trellis in enumerate(validated):
        for t, turn in enumerate(trellis):
            for m, candidate in enumerate(turn):
                scores[b][t][m] = float(candidate.normalized_score)
                raw[b][t][m] = float(candidate.raw_score)
                mask[b][t][m] = True
    return PackedTrellis(
        scores=torch.tensor(scores, dtype=dtype, device=device),
        raw_scores=torch.tensor(raw, dtype=dtype, device=device),
        mask=torch.tensor(mask, dtype=torch.bool, device=device),
        lengths=torch.tensor([len(trellis) for trellis in validated], dtype=torch.long, device=device),
        chunk_ids=tuple(tuple(tuple(c.chunk_id for c in turn) for turn in trellis) for trellis in validated),
        trellises=tuple(validated),
    )


def pairwise_distances(packed: PackedTrellis, graph: CorpusGraph) -> torch.Tensor:
    """Distances between consecutive turns' candidates of a packed batch.

    Returns:
        (B, T-1, M, M) float64 on the packed tensors' device; see
        :func:`consecutive_distances`.
    """
    batch, turns, width = packed.shape
    return consecutive_distances(packed.chunk_ids, graph, turns=turns, width=width, device=packed.mask.device)


def consecutive_distances(
    chunk_ids: Sequence[Sequence[Sequence[str]]],
    graph: CorpusGraph,
    *,
    turns: int,
    width: int,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """Distances between consecutive turns' candidates, from any corpus graph.

    Args:
        chunk_ids: B conversations, each a list of turns of chunk IDs.
        graph: a ``CorpusGraph``. A tensor graph (a
            :class:`~mapmatched_torch.graph.TrellisGraph`: ``index_trellis`` and
            ``trellis_distances``, e.g. :class:`~mapmatched_torch.graph.TensorCorpusGraph`)
            fills the batch in one call on its device; any other graph is asked pair by
            pair, each distinct pair once.
        turns, width: T and M of the padded output (at least the batch maxima).

    Returns:
        (B, T-1, M, M) float64, indexed [b, t, from, to] =
        ``graph.distance(chunk j of turn t, chunk i of turn t+1)``; padding entries hold
        ``graph.maximum_distance`` (the decoders mask them).
    """
    maximum = float(graph.maximum_distance)
    if implements(graph, TrellisGraph):
        # shape: (B, T', M') codes -> (B, T'-1, M', M') distances, padded below to (T-1, M, M)
        found = graph.trellis_distances(graph.index_trellis(chunk_ids))
        out = torch.full((len(chunk_ids), max(turns - 1, 0), width, width), maximum, dtype=torch.float64, device=found.device)
        out[:, : found.shape[1], : found.shape[2], : found.shape[3]] = found
        return out.to(device=device)
    memo = {}
    steps = max(turns - 1, 0)
    # shape: (B, T-1, M, M)
    table: List[List[List[List[float]]]] = [
        [[[maximum] * width for _ in range(width)] for _ in range(steps)] for _ in chunk_ids
    ]
    for b, trellis in enumerate(chunk_ids):
        for t in range(1, len(trellis)):
            for j, source in enumerate(trellis[t - 1]):
                row = table[b][t - 1][j]
                for i, target in enumerate(trellis[t]):
                    key = (source, target)
                    value = memo.get(key)
                    if value is None:
                        value = memo[key] = float(graph.distance(source, target))
                    row[i] = value
    return torch.tensor(table, dtype=torch.float64, device=device).reshape(len(chunk_ids), steps, width, width)


def unpack_paths(paths: torch.Tensor, packed: PackedTrellis) -> List[Tuple[str, ...]]:
    """(B, T) candidate indices (-1 after the end) -> B tuples of chunk IDs."""
    rows = paths.tolist()
    return [
        tuple(trellis[t][index] for t, index in enumerate(row[: len(trellis)]))
        for row, trellis in zip(rows, packed.chunk_ids)
    ]


_TYPECODES = {torch.float64: "d", torch.long: "q"}


def packed_rows(rows: Sequence[Sequence[Union[int, float]]], width: int, fill: Union[int, float], dtype: torch.dtype) -> torch.Tensor:
    """``(len(rows), width)`` CPU tensor of ``rows``, each padded on the right with ``fill``.

    Args:
        rows: R sequences of at most ``width`` Python numbers (ints for int64).
        width: the row length after padding.
        fill: the padding value.
        dtype: ``torch.float64`` or ``torch.int64``.

    Returns:
        A new tensor; values are converted exactly as ``torch.tensor`` converts them
        (float64: the same doubles).
    """
    buffer = array(_TYPECODES[dtype])
    padding = array(_TYPECODES[dtype], [fill]) * width
    for row in rows:
        if len(row) > width:
            raise ValueError(f"a row of {len(row)} values does not fit in width {width}")
        buffer.extend(row)
        buffer.extend(padding[: width - len(row)])
    if not buffer:
        return torch.full((len(rows), width), fill, dtype=dtype)
    # a copy (a few microseconds) owns ordinary, resizable storage; the buffer is freed
    return torch.frombuffer(buffer, dtype=dtype).view(len(rows), width).clone()
