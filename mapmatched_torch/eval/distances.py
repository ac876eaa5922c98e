"""Corpus graphs for evaluation, and the graph distances the methods need.

:func:`build_corpus_graph` makes the graph of a corpus (kNN over passage embeddings,
or the section graph of the document structure) as a
:class:`~mapmatched_torch.graph.TensorCorpusGraph` whose node order is the corpus
order. :class:`CorpusDistances` answers, for candidate tensors of corpus passage
indices, the two distance tensors of an evaluation batch:

- :meth:`CorpusDistances.consecutive`: (B, T-1, M, M) between consecutive turns'
  candidates (the decoders' transitions), computed ONCE per batch and shared by every
  setting of a grid;
- :meth:`CorpusDistances.within_turn`: (B, T, M, M) between the candidates of one
  turn (the Maximal Marginal Relevance similarity when there are no embeddings).

Any ``CorpusGraph`` works: a :class:`~mapmatched_torch.graph.TensorGraph` (with
``index`` and ``pair_distances``) is queried in one batched call on its device; any other graph (e.g.
:class:`~mapmatched_torch.standalone.graph.InMemoryCorpusGraph`) through
:func:`~mapmatched_torch.retrieval.trellis.consecutive_distances` and ``distance``, pair by pair.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..core.checks import check_choice
from ..core.errors import MapMatchedValueError
from ..core.protocols import CorpusGraph, implements
from ..graph.protocols import TensorGraph
from ..retrieval.trellis import consecutive_distances

__all__ = ["GRAPH_KINDS", "build_corpus_graph", "synthetic_graph", "CorpusDistances", "kernels_need_compiling"]

#: The accepted values of ``kind`` in :func:`build_corpus_graph`.
GRAPH_KINDS = ("knn", "section")

Device = Union[str, torch.device, None]


def build_corpus_graph(
    kind: str,
    passages: Sequence[Any],
    embeddings: Optional[Tensor] = None,
    *,
    k: int = 10,
    maximum_distance: Union[float, str] = 10.0,
    device: Device = None,
    progress: Optional[bool] = None,
) -> Any:
    """The corpus graph of a passage collection, nodes in corpus order.

    Args:
        kind: ``"knn"`` (:func:`~mapmatched_torch.graph.knn_graph` over
            ``embeddings``, ``k`` neighbours, cosine distances) or ``"section"``
            (:func:`~mapmatched_torch.graph.section_graph`: document adjacency, same
            section and section hierarchy; needs ``doc_id`` and ``position``).
        passages: the corpus :class:`~mapmatched_torch.eval.data.Passage` objects.
        embeddings: (P, D) passage embeddings (``"knn"`` only).
        k: kNN neighbours per passage.
        maximum_distance: the graph's distance bound, or ``"auto"``: calibrated by
            :func:`~mapmatched_torch.graph.calibrate_bound` (a typical ball of 64 passages).
        device: where the graph lives.
        progress: kNN progress bar (None: automatic for large corpora).

    Raises:
        MapMatchedValueError: an unknown kind, missing embeddings, or a corpus the
            builder rejects (its message).
    """
    from ..graph import knn_graph, section_graph

    check_choice("graph", kind, GRAPH_KINDS)
    ids = [passage.id for passage in passages]
    if kind == "knn":
        if embeddings is None:
            raise MapMatchedValueError("a kNN graph needs passage embeddings (choose an embedder)")
        return knn_graph(embeddings, ids, k, maximum_distance=maximum_distance, device=device, progress=progress)
    if maximum_distance != "auto":
        return section_graph(passages, maximum_distance=maximum_distance, device=device)
    from ..graph import TensorCorpusGraph, calibrate_bound

    graph = section_graph(passages, device=device)
    return TensorCorpusGraph(graph.adjacency, graph.vocabulary, maximum_distance=calibrate_bound(graph.adjacency))


def synthetic_graph(bench: Any, *, maximum_distance: float = 10.0, device: Device = None, dense: bool = True) -> Any:
    """The synthetic benchmark's topic graph as a tensor graph (nodes in corpus order).

    With ``dense`` (default) the (N, N) distance table is precomputed when it fits the
    default budget, so every batch of distances is a gather.
    """
    from ..graph import TensorCorpusGraph

    edge_index, edge_weight = bench.edge_tensors()
    ids = bench.dataset.passage_ids
    graph = TensorCorpusGraph.from_edge_index(
        edge_index.to(device), edge_weight.to(device), chunk_ids=ids, num_nodes=len(ids), directed=False,
        maximum_distance=maximum_distance,
    )
    if dense:
        try:
            graph.precompute_dense()
        except ValueError:
            pass  # too large for the default budget: the cached searches answer instead
    return graph


class CorpusDistances:
    """Graph distances between candidate passages given as corpus indices.

    Args:
        graph: any ``CorpusGraph``.
        passage_ids: the corpus IDs in corpus order (candidate index i is
            ``passage_ids[i]``).

    Example:
        >>> from mapmatched_torch import InMemoryCorpusGraph
        >>> graph = InMemoryCorpusGraph.from_edges([("a", "b"), ("b", "c")])
        >>> lookup = CorpusDistances(graph, ["a", "b", "c"])
        >>> index = torch.tensor([[[0, 2], [1, -1]]])  # B=1, T=2, M=2
        >>> lookup.consecutive(index)[0, 0].tolist()   # [from, to]
        [[1.0, 10.0], [1.0, 10.0]]
    """

    def __init__(self, graph: CorpusGraph, passage_ids: Sequence[str]) -> None:
        self.graph = graph
        self.passage_ids = tuple(passage_ids)
        self.maximum_distance = float(graph.maximum_distance)
        self._tensor = implements(graph, TensorGraph)
        # shape: (P,) graph codes of the corpus passages (distinct codes <= -2 for unknown IDs)
        self._codes = graph.index(self.passage_ids, distinct_unknown=True) if self._tensor else None
        self.calls = 0  # consecutive() calls, for tests and progress reports

    def _graph_codes(self, index: Tensor) -> Tensor:
        assert self._codes is not None
        codes = self._codes.to(index.device)[index.clamp(min=0)]
        return torch.where(index >= 0, codes, -1)

    def _ids(self, index: Tensor) -> List[List[List[str]]]:
        ids = self.passage_ids
        return [[[ids[i] for i in turn if i >= 0] for turn in conversation] for conversation in index.tolist()]

    def consecutive(self, index: Tensor) -> Tensor:
        """(B, T-1, M, M) float64 ``[b, t, from, to]`` distances (padding: maximum_distance).

        Args:
            index: (B, T, M) long corpus indices, -1 padding (real candidates first).
        """
        self.calls += 1
        batch, turns, width = index.shape
        if self._tensor:
            codes = self._graph_codes(index).to(self.graph.device)
            return self.graph.trellis_distances(codes).to(device=index.device, dtype=torch.float64)
        return consecutive_distances(self._ids(index), self.graph, turns=turns, width=width, device=index.device)

    def within_turn(self, index: Tensor) -> Tensor:
        """(B, T, M, M) float64 distances between the candidates of each turn (0 on the diagonal)."""
        batch, turns, width = index.shape
        if self._tensor:
            codes = self._graph_codes(index).to(self.graph.device)
            sources = codes.unsqueeze(-1).expand(batch, turns, width, width)
            targets = codes.unsqueeze(-2).expand(batch, turns, width, width)
            return self.graph.pair_distances(sources, targets).to(device=index.device, dtype=torch.float64)
        memo: Dict[Tuple[str, str], float] = {}
        out = torch.full((batch, turns, width, width), self.maximum_distance, dtype=torch.float64)
        for b, conversation in enumerate(self._ids(index)):
            for t, turn in enumerate(conversation):
                for j, source in enumerate(turn):
                    for i, target in enumerate(turn):
                        key = (source, target)
                        if key not in memo:
                            memo[key] = float(self.graph.distance(source, target))
                        out[b, t, j, i] = memo[key]
        return out.to(index.device)


def kernels_need_compiling(device: Device = None) -> bool:
    """Whether the next CPU graph search of this process will compile the numba kernels.

    True when the compiled engine serves ``device`` (the CPU with numba installed),
    none of its kernels is loaded in this process yet, and numba's disk cache holds no
    index of them that is newer than their source (a first run, or the source changed).
    For progress messages only: a wrong guess costs a line, never a result.
    """
    from ..graph.shortest_paths import resolve_engine

    if resolve_engine("auto", torch.device(device if device is not None else "cpu")) != "compiled":
        return False
    try:
        from numba.core.caching import FunctionCache

        from ..graph.engines import compiled_kernels
    except ImportError:  # pragma: no cover - resolve_engine said numba imports
        return False
    kernels = [value for value in vars(compiled_kernels).values() if hasattr(value, "py_func")]
    if any(getattr(kernel, "signatures", None) for kernel in kernels):
        return False  # loaded (compiled or read from the cache) earlier in this process
    source = Path(compiled_kernels.__file__)
    try:
        folder = Path(FunctionCache(kernels[0].py_func).cache_path)
        indexes = list(folder.glob(f"{source.stem}.*.nbi"))
        return not any(index.stat().st_mtime >= source.stat().st_mtime for index in indexes)
    except (IndexError, OSError, AttributeError, RuntimeError):
        return True
