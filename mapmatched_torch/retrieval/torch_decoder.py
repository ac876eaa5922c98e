"""`TorchDecoder`: the ``Decoder`` protocol on tensors, a drop-in for StandaloneDecoder.

``MapMatchedRetriever(graph, decoder=TorchDecoder())`` returns exactly what the
standalone decoder returns (same paths, committed turns and float64 scores), and
:meth:`TorchDecoder.decode_batch` decodes many conversations in one batched pass.

Data flow per call: validate and pack the trellises (:mod:`mapmatched_torch.retrieval.trellis`)
-> fill the (B, T-1, M, M) distances once from the graph (skipped when beta = 0) ->
weight them (emissions ``lambda * s``, transitions ``-(beta * d)`` by
:mod:`mapmatched_torch.kernels.transitions`) -> batched Viterbi / fixed-lag / pointwise
decode (:func:`~mapmatched_torch.kernels.transitions.decode_weighted`) -> one copy of the chosen
indices to the host -> the reported paths (:func:`mapmatched_torch.core.path_reports.report_path`,
shared with the standalone decoder so the numbers agree bit for bit).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, Union

import torch

from ..core.checks import check_trellis
from ..core.errors import MapMatchedValueError
from ..core.models import CandidateScore, DecodedPath, DecoderCandidate
from ..core.path_reports import rank_final_candidates, report_path
from ..core.protocols import CorpusGraph
from ..kernels.decode import forward_scores
from ..core.settings import DecodeSettings
from ..kernels.transitions import decode_weighted, weighted_transitions
from .trellis import PackedTrellis, pack_trellises, pairwise_distances

if TYPE_CHECKING:
    from .streaming import DecodingStream

__all__ = ["TorchDecoder"]

Ranked = Tuple[DecodedPath, Tuple[CandidateScore, ...]]


class TorchDecoder:
    """Batched tensor decoding with the standalone decoder's exact semantics.

    Args:
        device: where the tensors live (default: CPU). ``"cuda"`` decodes on the GPU.
        dtype: float dtype of the dynamic program (default ``torch.float64``, which is
            bit-for-bit identical to the standalone decoder). ``torch.float32`` is
            faster; paths then match whenever no two paths' scores are within float32
            rounding of each other, and the reported scores are still recomputed in
            float64 along the chosen path.

    Example:
        >>> from mapmatched_torch import DecoderCandidate, InMemoryCorpusGraph, StandaloneDecoder
        >>> graph = InMemoryCorpusGraph.from_edges([("a", "b")])
        >>> trellis = [[DecoderCandidate("a", 1.0, 1.0)], [DecoderCandidate("c", 2.0, 1.0), DecoderCandidate("b", 1.0, 0.5)]]
        >>> TorchDecoder().decode(trellis, graph) == StandaloneDecoder().decode(trellis, graph)
        True
    """

    def __init__(self, device: Optional[Union[str, torch.device]] = None, dtype: torch.dtype = torch.float64) -> None:
        if dtype not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
            raise MapMatchedValueError(f"dtype must be a floating dtype, got {dtype}")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"TorchDecoder(device={str(self.device)!r}, dtype={self.dtype})"

    def decode(
        self,
        trellis: Sequence[Sequence[DecoderCandidate]],
        graph: CorpusGraph,
        *,
        emission_weight: float = 1.0,
        transition_weight: float = 1.0,
        fixed_lag: Optional[int] = None,
        settings: Optional[DecodeSettings] = None,
    ) -> DecodedPath:
        """Decode one conversation (see :meth:`StandaloneDecoder.decode`)."""
        return self.decode_ranked(
            trellis, graph, emission_weight=emission_weight, transition_weight=transition_weight, fixed_lag=fixed_lag, settings=settings
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
    ) -> Ranked:
        """Decode one conversation and rank its final candidates (see the standalone decoder)."""
        check_trellis(trellis)
        return self.decode_batch_ranked([trellis], graph, emission_weight=emission_weight, transition_weight=transition_weight, fixed_lag=fixed_lag, settings=settings)[0]

    def stream(
        self,
        graph: CorpusGraph,
        width: int,
        *,
        emission_weight: float = 1.0,
        transition_weight: float = 1.0,
        fixed_lag: Optional[int] = None,
        settings: Optional[DecodeSettings] = None,
        transitions: Optional[object] = None,
    ) -> "DecodingStream":
        """An incremental decoder for one conversation of at most ``width`` candidates
        per turn: each new turn costs one M x M step (plus the uncommitted tail with a
        lag). Sessions use it automatically (``transitions``: a session's learned
        transition model, see :mod:`mapmatched_torch.retrieval.learned`)."""
        from .streaming import DecodingStream

        return DecodingStream(
            graph,
            width,
            emission_weight=emission_weight,
            transition_weight=transition_weight,
            fixed_lag=fixed_lag,
            settings=settings,
            dtype=self.dtype,
            device=self.device,
            transitions=transitions,
        )

    def decode_batch(
        self,
        trellises: Sequence[Sequence[Sequence[DecoderCandidate]]],
        graph: CorpusGraph,
        *,
        emission_weight: float = 1.0,
        transition_weight: float = 1.0,
        fixed_lag: Optional[int] = None,
        settings: Optional[DecodeSettings] = None,
    ) -> List[DecodedPath]:
        """Decode B conversations in one batched pass.

        Args:
            trellises: B trellises (lists of turns of :class:`DecoderCandidate`), of any
                lengths and widths; errors name the conversation.
            graph: any ``CorpusGraph``; a tensor graph fills all distances in one call.
            emission_weight, transition_weight, fixed_lag: as for :meth:`decode`.
            settings: the three options as one
                :class:`~mapmatched_torch.core.settings.DecodeSettings`.

        Returns:
            B decoded paths, each identical to the standalone decoder's for that
            conversation. Cost: one distance fill of (B, T-1, M, M) plus O(B T M^2)
            decoding on ``device``.
        """
        return [
            path
            for path, _ in self.decode_batch_ranked(
                trellises, graph, emission_weight=emission_weight, transition_weight=transition_weight, fixed_lag=fixed_lag, rank=False, settings=settings
            )
        ]

    def decode_batch_ranked(
        self,
        trellises: Sequence[Sequence[Sequence[DecoderCandidate]]],
        graph: CorpusGraph,
        *,
        emission_weight: float = 1.0,
        transition_weight: float = 1.0,
        fixed_lag: Optional[int] = None,
        rank: bool = True,
        settings: Optional[DecodeSettings] = None,
    ) -> List[Ranked]:
        """:meth:`decode_batch` plus each conversation's ranked final candidates
        (an empty ranking when ``rank=False``)."""
        settings = DecodeSettings.resolve(
            settings, emission_weight=emission_weight, transition_weight=transition_weight, fixed_lag=fixed_lag
        )
        lam, beta, lag = settings.emission_weight, settings.transition_weight, settings.fixed_lag
        packed = pack_trellises(trellises, dtype=torch.float64, device=self.device)
        # shape: (B, T-1, M, M) float64 graph distances (None when beta = 0: never needed)
        distances = pairwise_distances(packed, graph) if settings.mode.uses_distances else None
        # shape: (B, T, M)
        emissions = (lam * packed.scores).to(self.dtype)
        # shape: (B, T-1, M, M): all zero at beta = 0 (then only the ranking reads them)
        transitions = (
            weighted_transitions(distances, beta, self.dtype)
            if distances is not None
            else torch.zeros(
                (*packed.shape[:1], max(packed.shape[1] - 1, 0), packed.shape[2], packed.shape[2]),
                dtype=self.dtype,
                device=self.device,
            )
        )
        decoded = decode_weighted(emissions, distances, packed.mask, beta, lag, transitions=transitions)
        finals = _final_scores(emissions, transitions, packed, getattr(decoded, "locks", None)) if rank else None
        return _report(packed, decoded.paths, distances, finals, settings)


def _final_scores(
    emissions: torch.Tensor, transitions: torch.Tensor, packed: PackedTrellis, locks: Optional[torch.Tensor]
) -> torch.Tensor:
    """(B, M) forward scores of each conversation's last turn (-inf where locked out)."""
    # shape: (B, T, M)
    alphas = forward_scores(emissions, transitions, packed.mask, locks)
    last = (packed.lengths - 1).to(alphas.device)
    return alphas[torch.arange(alphas.shape[0], device=alphas.device), last]


def _report(
    packed: PackedTrellis,
    paths: torch.Tensor,
    distances: Optional[torch.Tensor],
    finals: Optional[torch.Tensor],
    settings: DecodeSettings,
) -> List[Ranked]:
    """Host-side reporting: one copy of the paths (and chosen distances) to the CPU."""
    rows = paths.tolist()
    chosen_distances: Optional[List[List[float]]] = None
    if distances is not None and paths.shape[1] > 1:
        # shape: (B, T-1): d(x_{t-1}, x_t) along every path (padding clamped to index 0)
        safe = paths.clamp_min(0)
        chosen_distances = (
            distances.gather(2, safe[:, :-1, None, None].expand(-1, -1, 1, distances.shape[3]))
            .squeeze(2)
            .gather(2, safe[:, 1:, None])
            .squeeze(2)
            .tolist()
        )
    final_rows = finals.double().tolist() if finals is not None else None
    results: List[Ranked] = []
    for b, trellis in enumerate(packed.trellises):
        chosen = rows[b][: len(trellis)]
        step_distances = chosen_distances[b] if chosen_distances is not None else None
        path = report_path(trellis, chosen, lambda t, row=step_distances: row[t - 1], settings)
        ranking: Tuple[CandidateScore, ...] = ()
        if final_rows is not None:
            ranking = rank_final_candidates(trellis[-1], final_rows[b][: len(trellis[-1])])
        results.append((path, ranking))
    return results
