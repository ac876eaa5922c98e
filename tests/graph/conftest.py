"""Random corpus graphs for the graph-engine tests (the ``device`` fixture is in tests/conftest.py)."""

from __future__ import annotations

import random
from typing import Callable, List, Tuple

import pytest

from mapmatched_torch.standalone.graph import InMemoryCorpusGraph

#: Edge-weight families: float (rounding matters), unit, dyadic (exact sums, ties, paths at the bound).
WEIGHTS = ("float", "unit", "dyadic")


def random_reference(
    seed: int, weights: str, directed: bool, *, nodes: int = 0, maximum_distance: float = 0.0
) -> InMemoryCorpusGraph:
    """A random standalone graph: declared isolated nodes, parallel edges, self-loops,
    several components; ``nodes``/``maximum_distance`` default to random values."""
    rng = random.Random(seed)
    count = nodes or rng.randint(2, 24)
    ids = [f"n{index:02d}" for index in range(count)]
    rng.shuffle(ids)  # node order != ID order, so (distance, ID) ordering is exercised
    components = rng.randint(1, 3)
    edges: List[Tuple[str, str, float]] = []
    for _ in range(rng.randint(0, 3 * count)):
        a = rng.randrange(count)
        b = rng.randrange(count) if rng.random() < 0.1 else (a + rng.randint(0, count // components)) % count
        if weights == "unit":
            weight = 1.0
        elif weights == "dyadic":
            weight = rng.choice([0.25, 0.5, 0.75, 1.0])
        else:
            weight = rng.uniform(0.05, 1.5)
        edges.append((ids[a], ids[b], weight))
        if rng.random() < 0.1:  # a parallel edge with another distance
            edges.append((ids[a], ids[b], weight * rng.choice([0.5, 2.0])))
    bound = maximum_distance or rng.choice([1.0, 2.0, 3.5])
    return InMemoryCorpusGraph(edges, nodes=ids[: rng.randint(0, count)], directed=directed, maximum_distance=bound)


@pytest.fixture
def reference_graph() -> Callable[..., InMemoryCorpusGraph]:
    """The :func:`random_reference` factory."""
    return random_reference
