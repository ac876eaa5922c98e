"""Synthetic labelled conversations sampled from the map-matching model.

:func:`sample_conversations` builds conversations whose labels come from the model with
known weights (the relevant chunk of each turn is the state of a path drawn by
:func:`~mapmatched_torch.kernels.sampling.sample_paths`): the data that
:func:`~mapmatched_torch.fit.fit_weights` should recover the weights from.
:func:`random_graph` is a small random corpus graph for it.
"""

from __future__ import annotations

from typing import Any, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..core.checks import check_finite, check_positive_int, check_radius, check_weight
from ..core.errors import MapMatchedValueError
from ..core.graph_types import GraphEdge
from ..core.models import ScoredCandidate
from ..core.protocols import CorpusGraph
from ..kernels.sampling import sample_paths
from ..kernels.transitions import weighted_transitions
from ..standalone import InMemoryCorpusGraph
from .packing import pack_conversations

__all__ = ["sample_paths", "random_graph", "SampledConversations", "sample_conversations"]

#: A labelled turn: (candidates in provider order, relevant chunk IDs).
LabelledTurn = Tuple[Tuple[ScoredCandidate, ...], FrozenSet[str]]


def random_graph(
    num_nodes: int = 64,
    *,
    chords: Optional[int] = None,
    maximum_distance: float = 10.0,
    generator: Optional[torch.Generator] = None,
) -> InMemoryCorpusGraph:
    """A small random corpus graph: a ring with random edge lengths plus random chords.

    Nodes are ``"n000", "n001", ...``; ring edges join consecutive nodes (and the last to
    the first) with distances uniform in [0.5, 1.5); ``chords`` extra edges (default
    ``num_nodes // 8``) join random node pairs with distances uniform in [1, 3).

    Args:
        num_nodes: N >= 3.
        chords: extra random edges (>= 0), or None for ``N // 8``.
        maximum_distance: the graph's distance bound (finite, > 0).
        generator: a CPU ``torch.Generator`` (a fresh seed-0 one when None).

    Returns:
        An undirected :class:`~mapmatched_torch.standalone.InMemoryCorpusGraph`.
    """
    count = check_positive_int(num_nodes, "num_nodes")
    if count < 3:
        raise MapMatchedValueError(f"num_nodes must be at least 3, got {count}")
    extra = count // 8 if chords is None else chords
    if isinstance(extra, bool) or not isinstance(extra, int) or extra < 0:
        raise MapMatchedValueError(f"chords must be a nonnegative int, got {chords!r}")
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    names = [f"n{index:03d}" for index in range(count)]
    ring = (0.5 + torch.rand(count, generator=generator, dtype=torch.float64)).tolist()
    edges = [GraphEdge(names[i], names[(i + 1) % count], ring[i]) for i in range(count)]
    ends = torch.randint(0, count, (extra, 2), generator=generator).tolist()
    lengths = (1.0 + 2.0 * torch.rand(extra, generator=generator, dtype=torch.float64)).tolist()
    edges += [GraphEdge(names[a], names[b], d) for (a, b), d in zip(ends, lengths) if a != b]
    return InMemoryCorpusGraph(edges, nodes=names, maximum_distance=maximum_distance)


class SampledConversations(NamedTuple):
    """What :func:`sample_conversations` returns.

    Attributes:
        conversations: n conversations, each a list of T turns ``(candidates, relevant)``
            (candidates a tuple of :class:`~mapmatched_torch.core.models.ScoredCandidate` in
            provider order, relevant a frozenset of chunk IDs, empty when unlabelled):
            the input format of :func:`~mapmatched_torch.fit.fit_weights`.
        graph: the corpus graph the distances came from.
        paths: ``(n, T)`` long, the sampled state (candidate index) of every turn,
            labelled or not.
    """

    conversations: List[List[LabelledTurn]]
    graph: CorpusGraph
    paths: Tensor


def _node_list(graph: CorpusGraph) -> Tuple[str, ...]:
    nodes = tuple(getattr(graph, "nodes", ()) or ())
    if not nodes:
        raise MapMatchedValueError("sample_conversations needs a graph with a non-empty `nodes` sequence")
    return nodes


def _pick(pool: Sequence[str], count: int, generator: torch.Generator) -> List[str]:
    """``count`` distinct members of ``pool`` in random order."""
    order = torch.randperm(len(pool), generator=generator)[:count].tolist()
    return [pool[index] for index in order]


def _candidate_sets(
    graph: CorpusGraph, nodes: Tuple[str, ...], count: int, turns: int, width: int, radius: float,
    generator: torch.Generator,
) -> List[List[List[str]]]:
    """Chunk IDs ``[conversation][turn][candidate]`` with graph locality.

    Each turn's candidates are ``width`` distinct nodes drawn from the ball of
    ``radius`` around a centre (topped up with random nodes when the ball is too
    small); the next centre is a random candidate of the turn. Consecutive candidate
    sets are therefore near each other, so distances vary and beta is identifiable.
    """
    index = {node: position for position, node in enumerate(nodes)}
    conversations = []
    for _ in range(count):
        centre = nodes[int(torch.randint(0, len(nodes), (1,), generator=generator))]
        turns_ids = []
        for _ in range(turns):
            ball = [centre, *graph.neighborhood(centre, min(radius, graph.maximum_distance))]
            chosen = _pick(ball, width, generator)
            if len(chosen) < width:
                taken = set(chosen)
                rest = [node for node in nodes if node not in taken]
                chosen += _pick(rest, width - len(chosen), generator)
            turns_ids.append(sorted(chosen, key=index.__getitem__))
            centre = chosen[int(torch.randint(0, width, (1,), generator=generator))]
        conversations.append(turns_ids)
    return conversations


def sample_conversations(
    n: int,
    turns: int,
    candidates: int,
    graph: Optional[Any] = None,
    *,
    emission_weight: float = 1.0,
    transition_weight: float = 1.0,
    score_normalization: str = "zscore",
    radius: float = 3.0,
    label_probability: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> SampledConversations:
    """Synthetic labelled conversations drawn from the model with known weights.

    For each conversation: candidate sets with graph locality (see the note below),
    raw scores i.i.d. standard normal, normalized with ``score_normalization`` exactly
    as :func:`~mapmatched_torch.fit.fit_weights` will; then one exact path sample
    from ``p(path) ∝ exp(lambda * sum_t s_t(x_t) - beta * sum_t d(x_{t-1}, x_t))``.
    A turn is labelled (relevant = ``{its sampled chunk}``) with probability
    ``label_probability``, else unlabelled (relevant = empty); the path is sampled
    from the joint model either way, so unlabelled turns are exactly the ones the
    fitting loss marginalizes out.

    Candidate sets: turn t's ``candidates`` distinct nodes are drawn from the ball of
    ``radius`` around a centre (random nodes top it up if it is too small), and the
    next turn's centre is one of them, so consecutive turns share neighbourhoods and
    the distances between their candidates vary (with constant distances beta would
    cancel out of the likelihood). Within a turn, candidates are in node order.

    Args:
        n: number of conversations (>= 1).
        turns: T >= 1 turns each. candidates: M >= 1 candidates per turn (at most the
            number of nodes).
        graph: a corpus graph with a ``nodes`` sequence, or None for
            ``random_graph(64, generator=generator)``.
        emission_weight, transition_weight: the true lambda and beta (>= 0).
        score_normalization: ``"zscore"``, ``"center"`` or ``"none"``.
        radius: the candidate ball's radius (>= 0).
        label_probability: chance that a turn is labelled, in [0, 1].
        generator: a CPU ``torch.Generator`` (a fresh seed-0 one when None); the same
            seed gives the same conversations.

    Returns:
        :class:`SampledConversations`.

    Cost: O(n T (M + ball)) Python work, plus the distances of
    :func:`~mapmatched_torch.fit.pack_conversations` and one :func:`sample_paths`.
    """
    count = check_positive_int(n, "n")
    turns = check_positive_int(turns, "turns")
    width = check_positive_int(candidates, "candidates")
    lam = check_weight(emission_weight, "emission_weight")
    beta = check_weight(transition_weight, "transition_weight")
    radius = check_radius(radius)
    probability = check_finite(label_probability, "label_probability")
    if not 0.0 <= probability <= 1.0:
        raise MapMatchedValueError(f"label_probability must be in [0, 1], got {probability!r}")
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    graph = graph if graph is not None else random_graph(64, generator=generator)
    nodes = _node_list(graph)
    if width > len(nodes):
        raise MapMatchedValueError(f"candidates ({width}) must not exceed the graph's {len(nodes)} nodes")
    ids = _candidate_sets(graph, nodes, count, turns, width, radius, generator)
    scores = torch.randn((count, turns, width), generator=generator, dtype=torch.float64).tolist()
    unlabelled = [[(tuple(ScoredCandidate(c, s) for c, s in zip(ids_t, scores_t)), frozenset())
                   for ids_t, scores_t in zip(ids_b, scores_b)] for ids_b, scores_b in zip(ids, scores)]
    batch = pack_conversations(unlabelled, graph, score_normalization=score_normalization)
    emissions = lam * batch.scores
    transitions = weighted_transitions(batch.distances, beta)
    paths = sample_paths(emissions, transitions, batch.mask, 1, generator)[0]
    keep = (torch.rand((count, turns), generator=generator) < probability).tolist()
    conversations = [
        [(turn[0], frozenset({turn_ids[state]}) if labelled else frozenset())
         for turn, turn_ids, state, labelled in zip(turns_b, ids_b, path_b, keep_b)]
        for turns_b, ids_b, path_b, keep_b in zip(unlabelled, ids, paths.tolist(), keep)
    ]
    return SampledConversations(conversations, graph, paths)
