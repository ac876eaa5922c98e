"""DistanceCache: exact entries, complete rows, LRU eviction by rows and by entries."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mapmatched_torch.graph import CacheInfo, DistanceCache


def longs(values, device):
    return torch.tensor(values, dtype=torch.long, device=device)


def doubles(values, device):
    return torch.tensor(values, dtype=torch.float64, device=device)


def test_lookup_answers_only_what_is_known(device) -> None:
    cache = DistanceCache(10, device=device)
    cache.insert(longs([1, 1], device), longs([2, 3], device), doubles([0.5, math.inf], device))
    values, answered = cache.lookup(longs([1, 1, 1, 2], device), longs([2, 3, 4, 1], device))
    assert answered.tolist() == [True, True, False, False]
    assert values[:2].tolist() == [0.5, math.inf] and values.device.type == device.type
    # a complete row also answers the targets it does not hold: beyond the bound
    cache.insert(longs([2], device), longs([5], device), doubles([0.25], device), complete=True)
    values, answered = cache.lookup(longs([2, 2], device), longs([5, 7], device))
    assert answered.tolist() == [True, True] and values.tolist() == [0.25, math.inf]
    assert cache.entry_count == 3


def test_counters_count_distinct_sources_per_lookup(device) -> None:
    cache = DistanceCache(10, device=device)
    cache.insert(longs([1], device), longs([2], device), torch.ones(1, dtype=torch.float64, device=device))
    cache.lookup(longs([1, 1, 3], device), longs([2, 2, 4], device))  # source 1 hit, source 3 miss
    cache.lookup(longs([1], device), longs([5], device))  # source 1 partially known: a miss
    assert cache.cache_info() == CacheInfo(hits=1, misses=2, size=1, capacity=65536)
    cache.clear()
    assert cache.cache_info() == CacheInfo(0, 0, 0, 65536) and cache.entry_count == 0


def test_rows_are_evicted_least_recently_used_first(device) -> None:
    cache = DistanceCache(10, max_rows=2, device=device)
    one = torch.ones(1, dtype=torch.float64, device=device)
    cache.insert(longs([1], device), longs([2], device), one)
    cache.insert(longs([3], device), longs([4], device), one)
    cache.lookup(longs([1], device), longs([2], device))  # 1 is now the most recently used
    cache.insert(longs([5], device), longs([6], device), one)  # evicts 3
    _, answered = cache.lookup(longs([1, 3, 5], device), longs([2, 4, 6], device))
    assert answered.tolist() == [True, False, True] and cache.cache_info().size == 2


def test_the_entry_budget_evicts_old_rows_and_skips_huge_insertions(device) -> None:
    cache = DistanceCache(100, max_entries=4, device=device)
    values = torch.ones(3, dtype=torch.float64, device=device)
    cache.insert(longs([1, 1, 1], device), longs([2, 3, 4], device), values)
    cache.insert(longs([5, 5], device), longs([6, 7], device), values[:2])  # 5 entries > 4: row 1 goes
    assert cache.entry_count == 2 and cache.lookup(longs([1], device), longs([2], device))[1].tolist() == [False]
    cache.insert(longs([9] * 5, device), longs([0, 1, 2, 3, 4], device), doubles([1.0] * 5, device))
    assert cache.entry_count == 2  # could never fit: ignored


def test_merging_keeps_the_keys_sorted_and_unique(device) -> None:
    rng = random.Random(0)
    cache = DistanceCache(50, device=device)
    truth = {}
    for _ in range(20):
        pairs = [(rng.randrange(50), rng.randrange(50)) for _ in range(rng.randint(1, 40))]
        for source, target in pairs:
            truth[source, target] = float(source * 100 + target)
        sources, targets = longs([p[0] for p in pairs], device), longs([p[1] for p in pairs], device)
        cache.insert(sources, targets, (sources * 100 + targets).double())
    sources, targets, _ = cache.entries()
    keys = sources * 50 + targets
    assert torch.all(keys[1:] > keys[:-1]) and keys.numel() == len(truth) == cache.entry_count
    keys = list(truth)
    values, answered = cache.lookup(longs([k[0] for k in keys], device), longs([k[1] for k in keys], device))
    assert answered.all() and values.tolist() == [truth[k] for k in keys]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_capacities_must_be_positive_ints(bad) -> None:
    with pytest.raises(ValueError, match="distance_cache_size"):
        DistanceCache(3, max_rows=bad)
    with pytest.raises(ValueError, match="distance_cache_entries"):
        DistanceCache(3, max_entries=bad)


@pytest.mark.parametrize("seed", range(3))
def test_compiled_lookup_equals_the_torch_lookup(seed, monkeypatch) -> None:
    # the CPU lookup searches within each source's run of the keys (numba); the torch
    # lookup searches all keys: same values and answers through inserts and evictions
    from mapmatched_torch.graph.engines import compiled as _compiled

    if not _compiled.available():
        pytest.skip("numba is not installed")
    generator = torch.Generator().manual_seed(seed)
    nodes = 50
    caches = [DistanceCache(nodes, max_rows=12, max_entries=300) for _ in range(2)]
    for round_ in range(12):
        sources = torch.randint(0, nodes, (40,), generator=generator)
        targets = torch.randint(0, nodes, (40,), generator=generator)
        values = torch.rand(40, generator=generator, dtype=torch.float64)
        values[torch.rand(40, generator=generator) < 0.2] = math.inf
        for cache in caches:
            cache.insert(sources, targets, values, complete=round_ % 4 == 0)
        # many queries (the parallel kernel) on cached and uncached rows, sources 0 and N-1 included
        query_sources = torch.cat([torch.randint(0, nodes, (70000,), generator=generator), torch.tensor([0, nodes - 1])])
        query_targets = torch.cat([torch.randint(0, nodes, (70000,), generator=generator), torch.tensor([nodes - 1, 0])])
        found = caches[0].lookup(query_sources, query_targets)
        with monkeypatch.context() as patch:
            patch.setattr(_compiled, "available", lambda: False)
            expected = caches[1].lookup(query_sources, query_targets)
        assert torch.equal(found[1], expected[1]), round_
        assert torch.equal(found[0][found[1]], expected[0][expected[1]]), round_
        small = caches[0].lookup(query_sources[:9], query_targets[:9])  # the serial kernel
        with monkeypatch.context() as patch:
            patch.setattr(_compiled, "available", lambda: False)
            caches[1].lookup(query_sources[:9], query_targets[:9])  # the same recency and counters
        assert torch.equal(small[1], found[1][:9]) and torch.equal(small[0][small[1]], found[0][:9][found[1][:9]])
        assert caches[0].cache_info() == caches[1].cache_info()


def _expanded_lookup(cache: DistanceCache, sources: torch.Tensor, targets: torch.Tensor, bound: float):
    """What lookup_grid must give, from the per-pair lookup and SPEC's rules for codes."""
    shape = (sources.shape[0], sources.shape[1], targets.shape[1])
    pair_sources, pair_targets = sources[:, :, None].expand(shape), targets[:, None, :].expand(shape)
    equal = (pair_sources == pair_targets) & (pair_sources != -1)
    need = (pair_sources >= 0) & (pair_targets >= 0) & ~equal
    values = torch.where(equal, 0.0, bound).double()
    answered = torch.ones(shape, dtype=torch.bool)
    if bool(need.any()):
        found, known = cache.lookup(pair_sources[need], pair_targets[need])
        values[need] = torch.where(known, found.clamp_max(bound), math.inf)
        answered[need] = known
    return values, answered


@pytest.mark.parametrize("seed", range(4))
def test_grid_lookup_equals_the_pair_lookup(seed) -> None:
    # lookup_grid (one compiled pass over (G, M) x (G, M') codes, sorted targets merged
    # with each source's row) against lookup of the expanded node pairs: values, answers,
    # counters and recency, with padding, unknown IDs, equal codes, repeated targets,
    # complete and partial rows, evictions, and both kernels (serial and parallel)
    from mapmatched_torch.graph.engines import compiled as _compiled

    if not _compiled.available():
        pytest.skip("numba is not installed")
    generator = torch.Generator().manual_seed(seed)
    nodes, bound = 40, 2.5
    caches = [DistanceCache(nodes, max_rows=15, max_entries=400) for _ in range(2)]
    for round_ in range(10):
        sources = torch.randint(0, nodes, (60,), generator=generator)
        targets = torch.randint(0, nodes, (60,), generator=generator)
        values = 2.5 * torch.rand(60, generator=generator, dtype=torch.float64)
        values[torch.rand(60, generator=generator) < 0.2] = math.inf
        for cache in caches:
            cache.insert(sources, targets, values, complete=round_ % 3 == 0)
        groups = 3000 if round_ % 2 else 5  # >= 65536 pairs: the parallel kernel
        width, columns = int(torch.randint(1, 6, (1,), generator=generator)), int(torch.randint(1, 6, (1,), generator=generator))
        codes = torch.randint(-3, nodes, (groups, width + columns), generator=generator)
        grid_sources, grid_targets = codes[:, :width], codes[:, width:]
        grid_targets[:, -1] = grid_sources[:, 0]  # equal codes (unknown IDs and padding among them)
        if groups == 3000:
            grid_sources, grid_targets = grid_sources.repeat(1, 5), grid_targets.repeat(1, 5)  # repeated targets
        found = caches[0].lookup_grid(grid_sources, grid_targets, bound)
        expected = _expanded_lookup(caches[1], grid_sources, grid_targets, bound)
        assert torch.equal(found[1], expected[1]), round_
        assert torch.equal(found[0][found[1]], expected[0][expected[1]]), round_
        assert bool(torch.isinf(found[0][~found[1]]).all())
        assert caches[0].cache_info() == caches[1].cache_info(), round_
        assert torch.equal(caches[0]._stamp, caches[1]._stamp), round_


def test_grid_lookup_of_empty_grids_and_an_empty_cache() -> None:
    from mapmatched_torch.graph.engines import compiled as _compiled

    if not _compiled.available():
        pytest.skip("numba is not installed")
    cache = DistanceCache(5)
    values, answered = cache.lookup_grid(longs([[0, 1, -1]], "cpu"), longs([[1, 1, -2]], "cpu"), 3.0)
    assert answered.tolist() == [[[False, False, True], [True, True, True], [True, True, True]]]
    assert values.tolist()[0][1] == [0.0, 0.0, 3.0] and values.tolist()[0][2] == [3.0, 3.0, 3.0]
    assert cache.cache_info() == CacheInfo(hits=0, misses=1, size=0, capacity=65536)
    empty = cache.lookup_grid(torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 3, dtype=torch.long), 3.0)
    assert empty[0].shape == (0, 4, 3) and empty[1].shape == (0, 4, 3)
    none = cache.lookup_grid(longs([[1, 2]], "cpu"), torch.zeros(1, 0, dtype=torch.long), 3.0)
    assert none[0].shape == (1, 2, 0) and cache.cache_info().misses == 1


def test_grid_lookup_says_where_it_cannot_run(monkeypatch) -> None:
    from mapmatched_torch.graph.engines import compiled as _compiled

    monkeypatch.setattr(_compiled, "available", lambda: False)
    cache = DistanceCache(5)
    assert not cache.grid_lookup
    with pytest.raises(RuntimeError, match="needs a CPU cache and numba"):
        cache.lookup_grid(longs([[0]], "cpu"), longs([[1]], "cpu"), 1.0)


def test_lookups_refuse_indices_outside_the_graph() -> None:
    # the compiled kernels index rows without bounds checks: a bad index is a ValueError
    from mapmatched_torch.graph.engines import compiled as _compiled

    cache = DistanceCache(3)
    cache.insert(longs([0], "cpu"), longs([1], "cpu"), doubles([0.5], "cpu"))
    with pytest.raises(ValueError, match=r"node indices must lie in \[0, N\) \(N = 3\), got values from 0 to 7"):
        cache.lookup(longs([0, 7], "cpu"), longs([1, 1], "cpu"))
    with pytest.raises(ValueError, match="node indices must lie in"):
        cache.lookup(longs([-1], "cpu"), longs([1], "cpu"))
    if _compiled.available():
        with pytest.raises(ValueError, match=r"index codes must be < N \(N = 3\)"):
            cache.lookup_grid(longs([[0, -1]], "cpu"), longs([[10**8]], "cpu"), 1.0)
        assert cache.lookup_grid(longs([[0, -5]], "cpu"), longs([[1]], "cpu"), 1.0)[1].all()


def _ring_graph(nodes: int, seed: int, **options):
    """A TensorCorpusGraph of points on a noisy circle, each linked to its 3 nearest."""
    from mapmatched_torch.graph import TensorCorpusGraph

    generator = torch.Generator().manual_seed(seed)
    angle = torch.rand(nodes, generator=generator, dtype=torch.float64) * 2 * math.pi
    points = torch.stack([angle.cos(), angle.sin()], 1)
    distance = torch.cdist(points, points)
    distance.fill_diagonal_(math.inf)
    weight, neighbour = distance.topk(3, dim=1, largest=False)
    edge_index = torch.stack([torch.arange(nodes).repeat_interleave(3), neighbour.reshape(-1)])
    return TensorCorpusGraph.from_edge_index(
        edge_index, 20 * weight.reshape(-1), chunk_ids=[f"n{i}" for i in range(nodes)], maximum_distance=4.0,
        **options,
    )


def _concurrent_trial(seed: int, nodes: int = 200, threads: int = 4, rounds: int = 12, **options) -> None:
    """``threads`` threads query one graph at once; results and cache == a single thread's."""
    import threading

    generator = torch.Generator().manual_seed(seed)
    # per thread, per round: a (B, T, M) trellis batch; odd threads range over all nodes,
    # even ones over half of them (overlapping and disjoint rows)
    batches = [
        [torch.randint(0, nodes // 2 * (1 + worker % 2), (2, 3, 4), generator=generator) for _ in range(rounds)]
        for worker in range(threads)
    ]
    reference = _ring_graph(nodes, seed=3)
    expected = [[reference.trellis_distances(batch) for batch in work] for work in batches]
    graph = _ring_graph(nodes, seed=3, **options)
    found = [[None] * rounds for _ in range(threads)]
    failures = []
    start = threading.Barrier(threads)

    def work(worker: int) -> None:
        try:
            start.wait()
            for round_, batch in enumerate(batches[worker]):
                found[worker][round_] = graph.trellis_distances(batch)
                # single pairs read (and fill) complete rows of the same cache
                graph.distance(f"n{int(batch[0, 0, 0])}", f"n{int(batch[0, 1, 0])}")
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    workers = [threading.Thread(target=work, args=(worker,)) for worker in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    assert not failures, (seed, failures)
    for worker in range(threads):
        for round_ in range(rounds):
            assert torch.equal(found[worker][round_], expected[worker][round_]), (seed, worker, round_)
    # every cached entry is exact (what a fresh graph computes), the keys sorted and unique
    sources, targets, values = graph._cache.entries()
    keys = sources * nodes + targets
    assert keys.numel() and bool((keys[1:] > keys[:-1]).all()), seed
    truth = _ring_graph(nodes, seed=3).pair_distances(sources, targets, use_cache=False)
    assert torch.equal(values.clamp_max(graph.maximum_distance), truth), seed


def test_concurrent_queries_equal_a_single_threaded_run() -> None:
    # the serving issue: threads stepping disjoint sessions of one server share the
    # graph's cache; unguarded merges raised "shape mismatch" or kept wrong entries
    # (about half of the trials before the lock)
    for seed in range(6):
        _concurrent_trial(seed)  # dense rows (200 nodes fit the default budget)
        _concurrent_trial(seed, distance_cache_entries=1 << 12)  # sparse rows


def test_a_cache_pickles_and_copies_without_its_lock() -> None:
    # the lock cannot be pickled: a copy gets a new one and the same entries
    import copy
    import pickle

    cache = DistanceCache(10)
    cache.insert(longs([1, 1], "cpu"), longs([2, 3], "cpu"), doubles([0.5, math.inf], "cpu"), complete=True)
    for restored in (pickle.loads(pickle.dumps(cache)), copy.deepcopy(cache)):
        assert all(torch.equal(a, b) for a, b in zip(restored.entries(), cache.entries()))
        restored.insert(longs([4], "cpu"), longs([5], "cpu"), doubles([0.25], "cpu"))
        values, answered = restored.lookup(longs([1, 1, 4], "cpu"), longs([2, 9, 5], "cpu"))
        assert answered.all() and values.tolist() == [0.5, math.inf, 0.25]
        assert restored._lock is not cache._lock
    assert cache.entry_count == 2
    # and so does a graph with a warm cache
    graph = _ring_graph(20, seed=1)
    expected = graph.distance("n0", "n5")
    restored = pickle.loads(pickle.dumps(graph))
    assert restored.distance("n0", "n5") == expected and restored.cache_info().hits == 1


# ---------------------------------------------------------------------- dense rows


def _random_rows(nodes: int, count: int, generator: torch.Generator) -> tuple:
    """``count`` distinct sources and complete rows for them (``inf``: beyond the bound)."""
    sources = torch.randperm(nodes, generator=generator)[:count]
    rows = torch.rand(count, nodes, generator=generator, dtype=torch.float64)
    rows[torch.rand(count, nodes, generator=generator) < 0.3] = math.inf
    rows[torch.arange(count), sources] = 0.0
    return sources, rows


def test_dense_rows_are_used_only_where_every_row_fits() -> None:
    assert DistanceCache(100).dense_rows  # 8 * 100**2 bytes <= 256 MiB
    assert DistanceCache(5792).dense_rows and not DistanceCache(5793).dense_rows  # the default bound
    assert not DistanceCache(100, max_entries=4999).dense_rows  # 80,000 bytes > 16 * 4999
    assert DistanceCache(100, max_entries=5000).dense_rows
    assert not DistanceCache(100, max_rows=99).dense_rows  # the row capacity holds fewer than N rows
    assert not DistanceCache(100, device="meta").dense_rows  # CPU only


def test_dense_rows_answer_every_target_of_their_sources() -> None:
    generator = torch.Generator().manual_seed(0)
    nodes = 30
    cache = DistanceCache(nodes)
    sources, rows = _random_rows(nodes, 5, generator)
    other = min(set(range(nodes)).difference(sources.tolist()))
    cache.insert_rows(sources, rows)
    # an entry of a dense row's source is not stored again; another source's is
    cache.insert(longs([sources[0].item(), other], "cpu"), longs([1, 2], "cpu"), doubles([7.0, 0.5], "cpu"))
    query_sources = torch.cat([sources.repeat_interleave(nodes), longs([other, other], "cpu")])
    query_targets = torch.cat([torch.arange(nodes).repeat(5), longs([2, 3], "cpu")])
    values, answered = cache.lookup(query_sources, query_targets)
    assert answered.tolist() == [True] * (5 * nodes) + [True, False]
    assert torch.equal(values[:-2], rows.reshape(-1)) and values[-2].item() == 0.5
    assert cache.entry_count == 1 and cache.cache_info().size == 6
    assert cache.cache_info().hits == 5 and cache.cache_info().misses == 1
    # rows are written once: a second insertion of the same source keeps the first row
    cache.insert_rows(sources[:1], torch.zeros(1, nodes, dtype=torch.float64))
    assert torch.equal(cache.lookup(sources[:1].expand(nodes), torch.arange(nodes))[0], rows[0])
    # entries() lists the rows' entries within the bound and the sparse ones, sorted
    listed_sources, listed_targets, listed_values = cache.entries()
    keys = listed_sources * nodes + listed_targets
    assert bool((keys[1:] > keys[:-1]).all())
    assert keys.numel() == int(torch.isfinite(rows).sum()) + 1
    assert torch.equal(listed_values[listed_sources == sources[0]], rows[0][torch.isfinite(rows[0])])
    cache.clear()
    assert cache.cache_info().size == 0 and not cache.lookup(sources, sources)[1].any()


@pytest.mark.parametrize("seed", range(3))
def test_grid_lookup_reads_dense_rows_like_the_pair_lookup(seed) -> None:
    from mapmatched_torch.graph.engines import compiled as _compiled

    if not _compiled.available():
        pytest.skip("numba is not installed")
    generator = torch.Generator().manual_seed(seed)
    nodes, bound = 40, 0.75
    caches = [DistanceCache(nodes) for _ in range(2)]
    sources, rows = _random_rows(nodes, 12, generator)
    for cache in caches:
        cache.insert_rows(sources, rows)
        other = min(set(range(nodes)).difference(sources.tolist()))
        cache.insert(longs([other], "cpu"), longs([3], "cpu"), doubles([0.5], "cpu"))
    for groups in (7, 3000):  # the serial and the parallel kernel
        codes = torch.randint(-3, nodes, (groups, 9), generator=generator)
        grid_sources, grid_targets = codes[:, :4], codes[:, 4:]
        grid_targets[:, -1] = grid_sources[:, 0]
        found = caches[0].lookup_grid(grid_sources, grid_targets, bound)
        expected = _expanded_lookup(caches[1], grid_sources, grid_targets, bound)
        assert torch.equal(found[1], expected[1]) and torch.equal(found[0][found[1]], expected[0][expected[1]])
        assert caches[0].cache_info() == caches[1].cache_info()


def test_dense_rows_pickle_as_their_filled_rows_only() -> None:
    import pickle

    generator = torch.Generator().manual_seed(1)
    cache = DistanceCache(300)
    sources, rows = _random_rows(300, 3, generator)
    cache.insert_rows(sources, rows)
    data = pickle.dumps(cache)
    assert len(data) < 8 * 300 * 300 // 4  # 3 rows, not the (N, N) table
    restored = pickle.loads(data)
    query_sources, query_targets = sources.repeat_interleave(300), torch.arange(300).repeat(3)
    assert torch.equal(restored.lookup(query_sources, query_targets)[0], rows.reshape(-1))
    assert restored.lookup(longs([int(set(range(300)).difference(sources.tolist()).pop())], "cpu"),
                           longs([0], "cpu"))[1].tolist() == [False]


def test_a_sparse_cache_takes_complete_rows_as_complete_entries() -> None:
    generator = torch.Generator().manual_seed(2)
    cache = DistanceCache(50, max_entries=100)  # 8 * 50**2 > 1,600 bytes: sparse
    sources, rows = _random_rows(50, 1, generator)
    cache.insert_rows(sources, rows)
    values, answered = cache.lookup(sources.expand(50), torch.arange(50))
    assert answered.all() and torch.equal(values, rows[0])
    assert cache.entry_count == int(torch.isfinite(rows).sum())
