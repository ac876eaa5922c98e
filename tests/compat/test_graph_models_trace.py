"""Drop-in for mapmatched 0.1.0: graph neighbourhoods and row reuse, scoring errors,
the value types, trace JSON and rendering, and the reference inputs' error messages.

Each test pins what code written against the pure-Python ``mapmatched`` relies on
(upstream's behaviour, names and message text), on the reference graph and, where
there is one, on the tensor graph too.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from mapmatched_torch import (
    DecodedPath,
    DecodedStep,
    GraphEdge,
    InMemoryCorpusGraph,
    KNNGraph,
    MapMatchedRetriever,
    RetrievalTrace,
    ScoredCandidate,
    TraceStep,
    normalize_candidates,
    render_trace,
    softmax_entropy,
)
from mapmatched_torch.core.protocols import CorpusGraph, implements
from mapmatched_torch.graph import TensorCorpusGraph, knn_graph
from mapmatched_torch.serving import MapMatchedServer

#: upstream's TraceStep.to_dict() keys, in field order
UPSTREAM_STEP_KEYS = [
    "turn_index", "chunk_id", "raw_emission_score", "normalized_emission_score", "weighted_emission_score",
    "graph_distance", "weighted_transition_cost", "cumulative_score", "emission_entropy",
    "normalized_emission_margin",
]

WEIGHTED_EDGES = [GraphEdge("a", "b", 1.0), GraphEdge("a", "c", 1.0), GraphEdge("b", "d", 1.5), GraphEdge("c", "d", 1.0)]


def weighted(kind):
    if kind == "reference":
        return InMemoryCorpusGraph(WEIGHTED_EDGES, nodes=["isolated"], maximum_distance=3.0)
    return TensorCorpusGraph.from_edges(WEIGHTED_EDGES, nodes=["isolated"], maximum_distance=3.0)


# ---------------------------------------------------------------------- neighbourhoods


@pytest.mark.parametrize("kind", ["reference", "tensor"])
def test_neighborhood_returns_chunk_ids_by_distance_then_id(kind):
    graph = weighted(kind)
    assert graph.distance("a", "d") == 2.0 and graph.distance("d", "a") == 2.0
    assert graph.distance("a", "isolated") == 3.0 and graph.distance("missing", "missing") == 0.0
    assert graph.neighborhood("a", 2.0) == ("b", "c", "d")  # inclusive, the centre excluded
    assert graph.neighborhood("a", 1.0) == ("b", "c")
    assert graph.neighborhood("a", 0.0) == () and graph.neighborhood("missing", 2.0) == ()
    assert graph.neighborhood("b", 100.0) == ("a", "d", "c")  # clipped at maximum_distance
    assert graph.neighborhood_distances("a", 2.0) == (("b", 1.0), ("c", 1.0), ("d", 2.0))


@pytest.mark.parametrize("kind", ["reference", "tensor"])
def test_a_directed_neighborhood_holds_the_out_reachable_nodes(kind):
    build = InMemoryCorpusGraph if kind == "reference" else TensorCorpusGraph.from_edges
    graph = build([("a", "b"), ("b", "c")], directed=True, maximum_distance=1.5)
    assert (graph.distance("a", "b"), graph.distance("b", "a"), graph.distance("a", "c")) == (1.0, 1.5, 1.5)
    assert graph.neighborhood("b", 1.5) == ("c",) and graph.neighborhood("c", 1.5) == ()


@pytest.mark.parametrize("kind", ["reference", "tensor"])
@pytest.mark.parametrize(
    ("chunk_id", "radius", "message"),
    [("", 1.0, "^neighborhood chunk_id must not be empty"), ("a", -1.0, "^neighborhood radius must be finite and nonnegative"),
     ("a", math.inf, "^neighborhood radius must be finite and nonnegative"),
     ("a", math.nan, "^neighborhood radius must be finite and nonnegative")],
)
def test_neighborhood_refuses_an_empty_centre_and_a_radius_that_is_not_finite(kind, chunk_id, radius, message):
    with pytest.raises(ValueError, match=message):
        weighted(kind).neighborhood(chunk_id, radius)


@pytest.mark.parametrize("kind", ["reference", "tensor"])
@pytest.mark.parametrize("ids", [("", "b"), ("a", ""), ("", "")])
def test_distance_refuses_empty_ids_before_comparing_them(kind, ids):
    with pytest.raises(ValueError, match="^distance chunk IDs must not be empty"):
        weighted(kind).distance(*ids)


class UpstreamGraph:
    """A graph written against upstream's protocol: three members, IDs from neighborhood."""

    def __init__(self, neighbours):
        self.neighbours = neighbours
        self.maximum_distance = 3.0

    def distance(self, source_chunk_id, target_chunk_id):
        return 0.0 if source_chunk_id == target_chunk_id else 1.0

    def neighborhood(self, chunk_id, radius):
        return self.neighbours.get(chunk_id, ())


def test_sessions_and_the_server_use_a_graph_with_only_upstreams_three_members():
    graph = UpstreamGraph({"ab": ("nb1", "nb2")})
    assert implements(graph, CorpusGraph)
    session = MapMatchedRetriever(graph).session()
    # a neighbourhood of IDs: "ab"'s context is its neighbours, never their characters
    result = session.retrieve_candidates([ScoredCandidate("ab", 1.0), ScoredCandidate("x", 0.0)])
    assert result.context_chunk_ids == ("ab", "nb1", "nb2", "x")
    server = MapMatchedServer(graph)
    server.open("p")
    results, errors = server.step({"p": [("ab", 1.0), ("x", 0.0)]})
    assert errors == {} and results["p"].context_chunk_ids == result.context_chunk_ids


def test_contexts_are_unchanged_on_our_graphs():
    edges = [("0", "1"), ("1", "2"), ("2", "3")]
    turns = [[("0", 3.0), ("2", 1.0)], [("1", 2.0), ("3", 1.5)]]
    contexts = []
    for graph in (InMemoryCorpusGraph.from_edges(edges), TensorCorpusGraph.from_edges(edges)):
        session = MapMatchedRetriever(graph, context_radius=1.0).session()
        contexts.append([session.retrieve_candidates([ScoredCandidate(*c) for c in t]).context_chunk_ids for t in turns])
    assert contexts[0] == contexts[1] == [("0", "1", "2"), ("1", "0", "2", "3")]


# ---------------------------------------------------------------------- cached rows


class CountingGraph(InMemoryCorpusGraph):
    """Counts the searches through upstream's hook name."""

    def __init__(self, *args, **kwargs):
        self.searches = 0
        super().__init__(*args, **kwargs)

    def _bounded_distances(self, source, cutoff):
        self.searches += 1
        return super()._bounded_distances(source, cutoff)


def test_an_undirected_reverse_distance_reuses_the_cached_row():
    graph = CountingGraph.from_edges([("a", "b"), ("b", "c")])
    forward = (graph.distance("a", "b"), graph.distance("a", "c"))
    assert graph.distance("c", "a") == forward[1] == 2.0  # from a's row: identical, no search
    assert graph.searches == 1


def test_the_row_cache_evicts_the_least_recently_used_source():
    graph = CountingGraph.from_edges([("a", "b"), ("b", "c"), ("c", "d")], directed=True, distance_cache_size=2)
    for source in "abca":
        graph.distance(source, "d")
    assert graph.searches == 4  # a was evicted by c


def test_reverse_reuse_never_changes_a_value():
    # 0.1 + 0.2 + 0.3 rounds differently from each end: each source's own row answers
    graph = CountingGraph([("a", "b", 0.1), ("b", "c", 0.2), ("c", "d", 0.3)])
    assert graph.distance("a", "d") == (0.1 + 0.2) + 0.3
    assert graph.distance("d", "a") == (0.3 + 0.2) + 0.1
    assert graph.searches == 2
    tensor = TensorCorpusGraph.from_graph(graph)
    assert (tensor.distance("a", "d"), tensor.distance("d", "a")) == (graph.distance("a", "d"), graph.distance("d", "a"))


# ---------------------------------------------------------------------- scoring


@pytest.mark.parametrize(
    ("candidates", "message"),
    [([], "^candidate set must not be empty$"),
     ([ScoredCandidate("a", 1.0), ScoredCandidate("a", 2.0)], "^candidate chunk_ids must be unique within a turn")],
)
def test_normalize_candidates_rejects_an_empty_turn_and_repeated_ids(candidates, message):
    for method in ("zscore", "none", "minmax"):  # checked before the method, as upstream
        with pytest.raises(ValueError, match=message):
            normalize_candidates(candidates, method)


def test_normalize_candidates_names_the_turn_after_upstreams_text():
    with pytest.raises(ValueError, match=r"^candidate set must not be empty \(turn 3\)$"):
        normalize_candidates([], turn_index=3)


def test_softmax_entropy_takes_scores_and_refuses_empty_or_nonfinite_ones():
    assert softmax_entropy(scores=[5.0]) == 0.0
    assert softmax_entropy(scores=[1.0, 1.0]) == pytest.approx(math.log(2.0))
    with pytest.raises(ValueError, match="^entropy requires at least one score$"):
        softmax_entropy([])
    for bad in ([1.0, math.nan], [1.0, math.inf]):
        with pytest.raises(ValueError, match="^entropy scores must be finite"):
            softmax_entropy(bad)


# ---------------------------------------------------------------------- value types


def step(turn_index=0, chunk_id="a"):
    return DecodedStep(turn_index, chunk_id, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0)


def test_decoded_path_has_upstreams_fields_and_checks_its_chunk_ids():
    steps = (step(), step(1, "b"))
    path = DecodedPath(steps=steps, chunk_ids=("a", "b"), total_score=2.0)
    assert path == DecodedPath(steps, ("a", "b"), 2.0) and path.chunk_ids == ("a", "b")
    assert path.fixed_lag is None and path.committed_through_index is None
    for bad, message in (
        (lambda: DecodedPath((), (), 0.0), "^decoded path must contain at least one step$"),
        (lambda: DecodedPath(steps, ("a", "c"), 2.0), "^decoded path chunk_ids must match its steps"),
        (lambda: DecodedPath(steps, ("a", "b"), math.nan), "^decoded path total score must be finite"),
    ):
        with pytest.raises(ValueError, match=message):
            bad()


def hand_trace():
    """Upstream test_trace_render's scenario: a-b-c, 'none', beta 2."""
    graph = InMemoryCorpusGraph.from_edges([("a", "b"), ("b", "c")], maximum_distance=3.0)
    session = MapMatchedRetriever(graph, score_normalization="none", transition_weight=2.0).session()
    session.retrieve_candidates([ScoredCandidate("a", 5.0), ScoredCandidate("c", 0.0)])
    return session.retrieve_candidates([ScoredCandidate("b", 0.0), ScoredCandidate("c", 2.0)]).trace


def test_trace_dicts_have_upstreams_keys_and_the_json_keeps_the_detail():
    trace = hand_trace()
    assert [list(s.to_dict()) for s in trace.steps] == [UPSTREAM_STEP_KEYS] * 2
    data = trace.to_dict()
    assert sorted(data) == ["committed_through_index", "fixed_lag", "path_chunk_ids", "revised_prior_indices", "steps"]
    assert data["steps"] == [s.to_dict() for s in trace.steps] and data["path_chunk_ids"] == ["a", "b"]
    assert json.loads(trace.to_json(extended=False)) == data  # upstream's JSON exactly
    rich = json.loads(trace.to_json(indent=2))
    assert [(s["runner_up_chunk_id"], s["move"]) for s in rich["steps"]] == [("c", "start"), ("c", "drill")]
    with pytest.raises(TypeError):
        trace.to_json(2)  # indent is keyword-only, as upstream
    assert isinstance(trace.steps[0], TraceStep)


def test_render_is_upstreams_table_and_detail_adds_runner_up_and_move():
    trace = hand_trace()
    assert trace.render() == render_trace(trace) == (
        "path: a -> b\nmode: full\nrevised prior turns: none\ncommitted through turn: none\n\n"
        "turn  chunk  raw  normalized  emission  distance  transition  entropy    margin  cumulative\n"
        "----  -----  ---  ----------  --------  --------  ----------  ---------  ------  ----------\n"
        "   0  a        5           5         5         0           0  0.0401796       5           5\n"
        "   1  b        0           0         0         1           2   0.365334      -2           3"
    )
    detail = trace.render(detail=True).splitlines()
    assert detail[5].split()[-2:] == ["runner-up", "move"] and detail[-1].split()[-2:] == ["c", "drill"]


def test_render_of_a_fixed_lag_trace_matches_upstream():
    graph = InMemoryCorpusGraph.from_edges([("0", "1"), ("1", "2")], maximum_distance=3.0)
    session = MapMatchedRetriever(graph, fixed_lag=1).session()
    for turn in ([("0", 5), ("1", 0), ("2", 0)], [("0", 3), ("1", 0), ("2", 6)], [("0", 8), ("1", 0), ("2", 0)]):
        trace = session.retrieve_candidates([ScoredCandidate(*c) for c in turn]).trace
    assert trace.render() == (
        "path: 0 -> 0 -> 0\nmode: fixed-lag 1\nrevised prior turns: none\ncommitted through turn: 1\n\n"
        "turn  chunk  raw  normalized  emission  distance  transition  entropy   margin    cumulative\n"
        "----  -----  ---  ----------  --------  --------  ----------  --------  --------  ----------\n"
        "   0  0        5     1.41421   1.41421         0           0  0.625135   2.12132     1.41421\n"
        "   1  0        3           0         0         0           0   0.73618  -1.22474     1.41421\n"
        "   2  0        8     1.41421   1.41421         0           0  0.625135   2.12132     2.82843"
    )


@pytest.mark.parametrize("detail", [False, True])
def test_an_empty_trace_renders_without_a_table(detail):
    trace = RetrievalTrace(steps=(), path_chunk_ids=(), revised_prior_indices=(1, 3), fixed_lag=None,
                           committed_through_index=None)
    expected = "path: (empty)\nmode: full\nrevised prior turns: 1, 3\ncommitted through turn: none"
    assert trace.render(detail=detail) == expected and render_trace(trace) == expected


# ---------------------------------------------------------------------- signatures and messages


def test_graph_constructors_take_upstreams_keywords():
    graph = InMemoryCorpusGraph.from_edges(edges=[("a", "b")], nodes=["z"], directed=False, maximum_distance=2.0,
                                           distance_cache_size=8)
    assert graph.nodes == ("z", "a", "b") and graph.distance_cache_size == 8
    knn = KNNGraph([GraphEdge("a", "b", 0.5)], nodes=["a", "b"], directed=False, maximum_distance=2.0,
                   distance_cache_size=4)
    assert knn.distance("b", "a") == 0.5 and not knn.directed


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: GraphEdge("", "b"), "^graph edge chunk IDs must not be empty"),
        (lambda: GraphEdge("a", "b", -1.0), "^graph edge distance must be finite and greater than zero"),
        (lambda: GraphEdge("a", "b", 0.0), "^graph edge distance must be finite and greater than zero"),
        (lambda: GraphEdge("a", "b", math.inf), "^graph edge distance must be finite and greater than zero"),
        (lambda: InMemoryCorpusGraph(maximum_distance=0), "^maximum_distance must be finite and greater than zero"),
        (lambda: InMemoryCorpusGraph(distance_cache_size=0), "^distance_cache_size must be greater than zero"),
        (lambda: InMemoryCorpusGraph(nodes=[""]), "^graph node IDs must not be empty$"),
    ],
)
def test_graph_inputs_fail_with_upstreams_messages(build, message):
    with pytest.raises(ValueError, match=message):
        build()


KNN_BUILDERS = {
    "reference": lambda ids, embeddings, **options: KNNGraph.from_embeddings(ids, embeddings, **options),
    "tensor": lambda ids, embeddings, **options: knn_graph(
        embeddings, ids, k=options.pop("neighbor_count", 10), **options
    ),
}


@pytest.mark.parametrize("kind", ["reference", "tensor"])
@pytest.mark.parametrize(
    ("ids", "embeddings", "options", "message"),
    [
        ([], [], {}, "^chunk_ids must contain at least one ID$"),
        (["a", ""], [[1.0], [1.0]], {}, "^chunk IDs must not be empty"),
        (["a", "a"], [[1.0], [1.0]], {}, "^chunk IDs must be unique"),
        (["a"], [], {}, "^embeddings must be a two-dimensional matrix"),
        (["a", "b"], [[1.0]], {}, "^received 1 embeddings for 2 chunk IDs$"),
        (["a"], [[]], {}, "^embedding dimension must be greater than zero"),
        (["a", "b"], [[1.0], [math.nan]], {}, "^embedding values must be finite"),
        (["a", "b"], [[1.0], [0.0]], {}, "^embedding vectors must have nonzero magnitude"),
        (["a"], [[1.0]], {"maximum_distance": 0.0}, "^maximum_distance must be finite and greater than zero"),
        (["a"], [[1.0]], {"minimum_edge_distance": 0.0},
         "^minimum_edge_distance must be finite, greater than zero, and no greater than maximum_distance"),
        (["a"], [[1.0]], {"minimum_edge_distance": 20.0},
         "^minimum_edge_distance must be finite, greater than zero, and no greater than maximum_distance"),
    ],
)
def test_knn_inputs_fail_with_upstreams_messages(kind, ids, embeddings, options, message):
    with pytest.raises(ValueError, match=message):
        KNN_BUILDERS[kind](ids, embeddings, **options)


def test_knn_neighbor_count_fails_with_upstreams_message():
    with pytest.raises(ValueError, match="^neighbor_count must be greater than zero"):
        KNNGraph.from_embeddings(["a"], [[1.0]], neighbor_count=0)


def test_synthetic_conversations_still_take_an_unbounded_radius():
    # neighborhood refuses inf now; the sampler clips its radius at the graph's bound
    from mapmatched_torch.fit.sampling import sample_conversations

    graph = InMemoryCorpusGraph.from_edges([(str(i), str(i + 1)) for i in range(8)], maximum_distance=3.0)
    draws = [
        sample_conversations(3, 2, 2, graph, radius=radius, generator=torch.Generator().manual_seed(0))
        for radius in (math.inf, 3.0)
    ]
    assert draws[0].conversations == draws[1].conversations
