"""The tensor seams of a corpus graph, as runtime-checkable Protocols.

:class:`~mapmatched_torch.core.protocols.CorpusGraph` (plain Python, in ``core``) is
what every part needs: ``maximum_distance``, ``distance``, ``neighborhood``. The
tensor decoders, the server and the evaluation also use a graph's batched API when it
has one; these protocols name that API once, instead of ``hasattr`` probes:

- :class:`TrellisGraph`: a ``CorpusGraph`` that fills a padded trellis batch's
  distances in one call (``index_trellis`` + ``trellis_distances``), what
  :func:`~mapmatched_torch.retrieval.trellis.consecutive_distances` uses;
- :class:`NeighborhoodGraph`: a ``CorpusGraph`` that answers many neighbourhoods in one
  call (``neighborhoods``), what the server's neighbourhood cache uses;
- :class:`TensorGraph`: both, with node indices, a vocabulary and elementwise
  ``pair_distances``: what :class:`~mapmatched_torch.graph.TensorCorpusGraph` is, and
  what the server's indexed steps and the evaluation's corpus distances need.

``isinstance(graph, TensorGraph)`` checks that the members exist (not their
signatures); :func:`~mapmatched_torch.core.protocols.implements` is the same check
with the member names listed once (Python < 3.12 recomputes them on every
``isinstance``, ~50 microseconds), for the checks made on every step. They live
here, not in ``core``, because their types are torch's; the parts before ``graph`` in
the import order (core, standalone, kernels, providers) use the core protocol only.
"""

from __future__ import annotations

from typing import Iterable, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch

from ..core.protocols import CorpusGraph, implements, missing_members  # re-exported: the checks of these protocols
from .vocabulary import ChunkVocabulary

__all__ = ["TrellisGraph", "NeighborhoodGraph", "TensorGraph", "implements", "missing_members"]


@runtime_checkable
class TrellisGraph(CorpusGraph, Protocol):
    """A :class:`~mapmatched_torch.core.protocols.CorpusGraph` that answers a padded
    trellis batch at once (docs/spec.md section 4 distances)."""

    def index_trellis(self, conversations: Sequence[Sequence[Sequence[str]]]) -> torch.Tensor:
        """``(B, T, M)`` int64 index codes of B ragged trellises of chunk IDs (``-1``
        padding, ``<= -2`` unknown IDs)."""
        ...

    def trellis_distances(self, chunk_index: torch.Tensor) -> torch.Tensor:
        """``(B, T-1, M, M)`` float64 ``[b, t, from j, to i]`` distances between
        consecutive turns' candidates of ``index_trellis`` codes (padding:
        ``maximum_distance``)."""
        ...


@runtime_checkable
class NeighborhoodGraph(CorpusGraph, Protocol):
    """A :class:`~mapmatched_torch.core.protocols.CorpusGraph` that answers many
    neighbourhoods at once (e.g. one batched search for a step's contexts)."""

    def neighborhoods(self, chunk_ids: Sequence[str], radius: float) -> Tuple[Tuple[str, ...], ...]:
        """``neighborhood(chunk_id, radius)`` (chunk IDs) of every chunk ID, in input order."""
        ...


@runtime_checkable
class TensorGraph(TrellisGraph, NeighborhoodGraph, Protocol):
    """A :class:`TrellisGraph` and :class:`NeighborhoodGraph` with N indexed nodes on a
    device: the API of :class:`~mapmatched_torch.graph.TensorCorpusGraph`."""

    @property
    def nodes(self) -> Tuple[str, ...]:
        """The N chunk IDs in index order."""
        ...

    @property
    def num_nodes(self) -> int:
        """N."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the graph's tensors (and its outputs) live."""
        ...

    @property
    def vocabulary(self) -> ChunkVocabulary:
        """Chunk IDs <-> node indices."""
        ...

    def index(self, chunk_ids: Iterable[str], *, distinct_unknown: bool = False) -> torch.Tensor:
        """``(n,)`` int64 index codes of chunk IDs on the graph's device."""
        ...

    def pair_distances(
        self, sources: torch.Tensor, targets: torch.Tensor, *, groups: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Elementwise float64 distances between index-code tensors of one shape."""
        ...

    def neighborhood_indices(self, centres: torch.Tensor, radius: float) -> torch.Tensor:
        """``(C, W)`` int64 node indices of each ``(C,)`` index code's neighbourhood
        (``neighborhoods``' order, -1 padded; a negative code: an empty row)."""
        ...

