"""The seams of the library (docs/spec.md sections 4-6), as runtime-checkable Protocols.

Any object with these methods plugs in; tests pass plain fixture classes.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, Tuple, runtime_checkable

from .models import CandidateScore, DecodedPath, DecoderCandidate, ScoredCandidate

__all__ = ["CorpusGraph", "Decoder", "CandidateProvider", "Trellis"]

#: One non-empty candidate list per turn, in turn order.
Trellis = Sequence[Sequence[DecoderCandidate]]


@runtime_checkable
class CorpusGraph(Protocol):
    """A corpus graph with bounded shortest-path distances (docs/spec.md section 4)."""

    @property
    def maximum_distance(self) -> float:
        """The bound: unreachable, too-far and unknown pairs get this distance."""
        ...

    def distance(self, source_chunk_id: str, target_chunk_id: str) -> float:
        """Bounded shortest-path distance; 0.0 when the IDs are equal."""
        ...

    def neighborhood(self, chunk_id: str, radius: float) -> Tuple[Tuple[str, float], ...]:
        """``(chunk_id, distance)`` of every other node within ``min(radius, maximum_distance)``,
        ordered by (distance, chunk ID)."""
        ...


@runtime_checkable
class Decoder(Protocol):
    """Decodes a trellis into the best path (docs/spec.md section 5)."""

    def decode(
        self,
        trellis: Trellis,
        graph: CorpusGraph,
        *,
        emission_weight: float = 1.0,
        transition_weight: float = 1.0,
        fixed_lag: Optional[int] = None,
    ) -> DecodedPath:
        ...

    def decode_ranked(
        self,
        trellis: Trellis,
        graph: CorpusGraph,
        *,
        emission_weight: float = 1.0,
        transition_weight: float = 1.0,
        fixed_lag: Optional[int] = None,
    ) -> Tuple[DecodedPath, Tuple[CandidateScore, ...]]:
        ...


@runtime_checkable
class CandidateProvider(Protocol):
    """Any retriever: returns up to ``limit`` scored candidates for a query, best first."""

    def retrieve(self, query: str, limit: int) -> Sequence[ScoredCandidate]:
        ...
