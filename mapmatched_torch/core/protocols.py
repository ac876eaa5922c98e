"""The seams of the library (docs/spec.md sections 4-6), as runtime-checkable Protocols.

Any object with these methods plugs in; tests pass plain fixture classes.
"""

from __future__ import annotations

import functools
from typing import Optional, Protocol, Sequence, Tuple, Type, TypeGuard, TypeVar, runtime_checkable

from .models import CandidateScore, DecodedPath, DecoderCandidate, ScoredCandidate

__all__ = ["CorpusGraph", "Decoder", "CandidateProvider", "Trellis", "implements", "missing_members"]

_Protocol = TypeVar("_Protocol")

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


def implements(graph: object, protocol: Type[_Protocol]) -> TypeGuard[_Protocol]:
    """``isinstance(graph, protocol)`` for a runtime-checkable Protocol: whether
    ``graph`` has every member of it (attributes looked up as ``hasattr`` does, so a
    proxy's ``__getattr__`` counts).

    Args:
        graph: any object.
        protocol: a Protocol class, e.g. :class:`CorpusGraph` or
            :class:`~mapmatched_torch.graph.TensorGraph`.

    Cost: one ``hasattr`` per member (the names are listed once per protocol), where
    ``isinstance`` on Python < 3.12 lists them again on every call (~50 microseconds).

    Example:
        >>> from mapmatched_torch.standalone.graph import InMemoryCorpusGraph
        >>> implements(InMemoryCorpusGraph.from_edges([("a", "b")]), CorpusGraph)
        True
        >>> implements(object(), CorpusGraph)
        False
    """
    return not missing_members(graph, protocol)


def missing_members(graph: object, protocol: type) -> Tuple[str, ...]:
    """The members of ``protocol`` that ``graph`` lacks, sorted (empty: it implements
    it); for error messages that say what is missing.

    Example:
        >>> missing_members(object(), CorpusGraph)
        ('distance', 'maximum_distance', 'neighborhood')
    """
    return tuple(name for name in _members(protocol) if not hasattr(graph, name))


@functools.lru_cache(maxsize=None)
def _members(protocol: type) -> Tuple[str, ...]:
    """The public member names of a Protocol and the Protocols it extends (each of
    which names ``Protocol`` among its bases, PEP 544)."""
    names = set()
    for cls in protocol.__mro__:
        if Protocol not in cls.__bases__:
            continue
        names.update(name for name in (*vars(cls), *getattr(cls, "__annotations__", {})) if not name.startswith("_"))
    return tuple(sorted(names))
