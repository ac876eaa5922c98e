"""Issue 34 item 3, "measure, then choose": the ball table against 2-hop labels.

On a graph artifact written by ``benchmarks/scale.py --keep`` (its CSR, its ball
table, ``turns.npy``), this builds **bounded pruned landmark labels** (2-hop labels
whose searches stop at the bound: node ``u`` keeps ``(hub, d(hub, u))`` for the hubs
whose pruned search reached it; nodes are hubs in order of decreasing degree) and
compares, for the serving step's pairs (1,024 sessions x 32 x 32 candidates per turn
pair):

- size per node, build time (one thread, numba);
- lookup time: a merge of two sorted label lists per pair, or each source's labels
  scattered once by hub into an (N,) array and each target's labels read against it,
  against the ball table's grid kernel (:func:`mapmatched_torch.graph._ball_kernels.lookup_grid`, one thread);
- exactness: how many label answers differ from the ball table's (which equal the
  bounded-Dijkstra oracle's, bit for bit: ``tests/graph/test_balls.py``), and by how
  much. A label answer is ``d(h, s) + d(h, t)``: the same path's length summed in
  another order than the oracle's search from ``s``, so float64 rounding can differ.

``--long-paths`` instead checks exactness where paths within the bound have many
edges (a 3,000-node ring-like graph with uniform weights in [0.05, 1], bounds 2 and 5,
200 x 32 x 32 random pairs against the library's searches): there the sums' order
shows.

A benchmark, not a library path: the labels are not part of the package.

Usage::

    python benchmarks/distance_oracles.py --dir /tmp/scale-100k
    python benchmarks/distance_oracles.py --long-paths
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numba
import numpy as np


@numba.njit(cache=True)
def _push(keys, values, size, key, value):
    place = size
    keys[place] = key
    values[place] = value
    while place > 0:
        parent = (place - 1) >> 1
        if keys[parent] <= keys[place]:
            break
        keys[parent], keys[place] = keys[place], keys[parent]
        values[parent], values[place] = values[place], values[parent]
        place = parent
    return size + 1


@numba.njit(cache=True)
def _pop(keys, values, size):
    key, value = keys[0], values[0]
    size -= 1
    keys[0], values[0] = keys[size], values[size]
    place = 0
    while True:
        left = 2 * place + 1
        if left >= size:
            break
        child = left
        if left + 1 < size and keys[left + 1] < keys[left]:
            child = left + 1
        if keys[place] <= keys[child]:
            break
        keys[place], keys[child] = keys[child], keys[place]
        values[place], values[child] = values[child], values[place]
        place = child
    return key, value, size


@numba.njit(cache=True)
def build_labels(indptr, indices, weights, order, bound, capacity):
    """Bounded pruned landmark labels: (hubs (N, capacity) int32 hub ranks, distances
    (N, capacity) float64, counts (N,), overflowed)."""
    nodes = indptr.size - 1
    hubs = np.empty((nodes, capacity), np.int32)
    values = np.empty((nodes, capacity), np.float64)
    counts = np.zeros(nodes, np.int64)
    dist = np.full(nodes, np.inf)
    root = np.full(nodes, np.inf)  # the root's labels by hub rank
    touched = np.empty(nodes, np.int64)
    heap_keys = np.empty(indices.size + 1, np.float64)
    heap_values = np.empty(indices.size + 1, np.int64)
    overflowed = False
    for rank in range(nodes):
        start = order[rank]
        for i in range(counts[start]):
            root[hubs[start, i]] = values[start, i]
        root[rank] = 0.0
        size = _push(heap_keys, heap_values, 0, 0.0, start)
        dist[start] = 0.0
        touched_count = 1
        touched[0] = start
        while size > 0:
            d, u, size = _pop(heap_keys, heap_values, size)
            if d > dist[u]:
                continue
            pruned = False
            for i in range(counts[u]):
                if root[hubs[u, i]] + values[u, i] <= d:
                    pruned = True
                    break
            if pruned:
                continue
            if counts[u] == capacity:
                overflowed = True
                continue
            hubs[u, counts[u]] = rank
            values[u, counts[u]] = d
            counts[u] += 1
            for edge in range(indptr[u], indptr[u + 1]):
                x = indices[edge]
                reach = d + weights[edge]
                if reach <= bound and reach < dist[x]:
                    if dist[x] == np.inf:
                        touched[touched_count] = x
                        touched_count += 1
                    dist[x] = reach
                    size = _push(heap_keys, heap_values, size, reach, x)
        for i in range(touched_count):
            dist[touched[i]] = np.inf
        for i in range(counts[start]):
            root[hubs[start, i]] = np.inf
        root[rank] = np.inf
    return hubs, values, counts, overflowed


@numba.njit(cache=True)
def label_grid(sources, targets, hubs, values, counts, maximum, out):
    """out[g, a, c] = d(sources[g, a], targets[g, c]) from the labels (a merge per pair)."""
    for g in range(sources.shape[0]):
        for a in range(sources.shape[1]):
            s = sources[g, a]
            for c in range(targets.shape[1]):
                t = targets[g, c]
                if s == t:
                    out[g, a, c] = 0.0
                    continue
                best = np.inf
                i = 0
                j = 0
                while i < counts[s] and j < counts[t]:
                    if hubs[s, i] == hubs[t, j]:
                        total = values[s, i] + values[t, j]
                        if total < best:
                            best = total
                        i += 1
                        j += 1
                    elif hubs[s, i] < hubs[t, j]:
                        i += 1
                    else:
                        j += 1
                out[g, a, c] = best if best <= maximum else maximum


@numba.njit(cache=True)
def label_grid_scattered(sources, targets, hubs, values, counts, maximum, out, root):
    """:func:`label_grid` with each source's labels scattered once by hub rank into
    ``root`` ((N,) float64, all inf): a pair costs the target's labels only."""
    for g in range(sources.shape[0]):
        for a in range(sources.shape[1]):
            s = sources[g, a]
            for i in range(counts[s]):
                root[hubs[s, i]] = values[s, i]
            for c in range(targets.shape[1]):
                t = targets[g, c]
                if s == t:
                    out[g, a, c] = 0.0
                    continue
                best = np.inf
                for j in range(counts[t]):
                    total = root[hubs[t, j]] + values[t, j]
                    if total < best:
                        best = total
                out[g, a, c] = best if best <= maximum else maximum
            for i in range(counts[s]):
                root[hubs[s, i]] = np.inf


def labels_of(indptr: np.ndarray, indices: np.ndarray, weights: np.ndarray, bound: float, capacity: int):
    """The labels of a CSR graph, hubs by decreasing degree (then index)."""
    nodes = indptr.size - 1
    order = np.lexsort((np.arange(nodes), -np.diff(indptr))).astype(np.int64)
    hubs, values, counts, overflowed = build_labels(indptr, indices, weights, order, bound, capacity)
    if overflowed:
        raise SystemExit(f"a node needed more than --capacity {capacity} label entries: raise it")
    return hubs, values, counts


def long_paths(capacity: int) -> dict:
    """Exactness of label answers where paths within the bound have many edges."""
    import torch

    from mapmatched_torch.graph import TensorCorpusGraph

    rng = np.random.default_rng(0)
    nodes = 3000
    first = rng.integers(0, nodes, 4 * nodes)
    second = (first + rng.integers(1, 30, 4 * nodes)) % nodes
    weight = rng.uniform(0.05, 1.0, 4 * nodes)
    edges = [(f"n{a}", f"n{b}", float(w)) for a, b, w in zip(first, second, weight)]
    report = {}
    for bound in (2.0, 5.0):
        graph = TensorCorpusGraph.from_edges(edges, maximum_distance=bound)
        adjacency = graph.adjacency
        hubs, values, counts = labels_of(adjacency.indptr.numpy(), adjacency.indices.numpy(),
                                         adjacency.weights.numpy(), bound, capacity)
        sources = rng.integers(0, graph.num_nodes, (200, 32))
        targets = rng.integers(0, graph.num_nodes, (200, 32))
        out = np.empty((200, 32, 32))
        label_grid(sources, targets, hubs, values, counts, bound, out)
        exact = graph.pair_distances(
            torch.from_numpy(sources)[:, :, None].expand(-1, -1, 32).contiguous(),
            torch.from_numpy(targets)[:, None, :].expand(-1, 32, -1).contiguous(), use_cache=False,
        ).numpy()
        inside = exact < bound
        unequal = out != exact
        report[f"bound {bound}"] = {
            "labels_per_node": round(float(counts.mean()), 1), "pairs": int(out.size),
            "share_within_bound": round(float(inside.mean()), 3),
            "differing": int(unequal.sum()), "share_of_those_within_differing": round(float(unequal[inside].mean()), 4),
            "largest_difference": float(np.abs(out - exact).max()),
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="a scale.py directory: graph/ (the artifact) and turns.npy")
    parser.add_argument("--long-paths", action="store_true", help="the exactness check on a long-path graph")
    parser.add_argument("--capacity", type=int, default=1024, help="label entries kept per node at most")
    args = parser.parse_args()
    if args.long_paths:
        print(json.dumps(long_paths(args.capacity), indent=2))
        return
    if not args.dir:
        parser.error("--dir or --long-paths")

    from mapmatched_torch.graph import load_graph
    from mapmatched_torch.graph._ball_kernels import lookup_grid

    folder = Path(args.dir)
    graph = load_graph(folder / "graph")
    table = graph.ball_table
    adjacency = graph.adjacency
    indptr = np.ascontiguousarray(adjacency.indptr.numpy())
    indices = np.ascontiguousarray(adjacency.indices.numpy())
    weights = np.ascontiguousarray(adjacency.weights.numpy())
    nodes = indptr.size - 1
    bound = table.bound
    maximum = graph.maximum_distance
    labels_of(np.array([0, 0], dtype=np.int64), np.zeros(0, np.int64), np.zeros(0), 1.0, 2)  # compile outside
    started = time.perf_counter()
    hubs, values, counts = labels_of(indptr, indices, weights, bound, args.capacity)
    build_s = time.perf_counter() - started
    turns = np.load(folder / "turns.npy")  # (T, S, M)
    if turns.ndim != 3 or turns.min() < 0 or turns.max() >= table.num_nodes:
        raise SystemExit(f"turns.npy must be (T, S, M) node indices below {table.num_nodes}")
    arrays = table.indptr.numpy(), table.neighbors.numpy(), table.distances.numpy()
    out = np.empty((turns.shape[1], turns.shape[2], turns.shape[2]))
    root = np.full(nodes, np.inf)
    label_grid(turns[0], turns[1], hubs, values, counts, maximum, out)  # compile and first touch
    label_grid_scattered(turns[0], turns[1], hubs, values, counts, maximum, out, root)
    lookup_grid(turns[0], turns[1], *arrays, maximum, threads=1)
    scattered_times, label_times, ball_times, differ, total, worst, crossed = [], [], [], 0, 0, 0.0, 0
    for turn in range(turns.shape[0] - 1):
        started = time.perf_counter()
        label_grid_scattered(turns[turn], turns[turn + 1], hubs, values, counts, maximum, out, root)
        scattered_times.append(time.perf_counter() - started)
        merged = out.copy()
        started = time.perf_counter()
        label_grid(turns[turn], turns[turn + 1], hubs, values, counts, maximum, out)
        label_times.append(time.perf_counter() - started)
        if not np.array_equal(merged, out):
            raise SystemExit("the two label lookups disagree")
        started = time.perf_counter()
        exact = lookup_grid(turns[turn], turns[turn + 1], *arrays, maximum, threads=1)
        ball_times.append(time.perf_counter() - started)
        unequal = out != exact
        differ += int(unequal.sum())
        crossed += int(((out < maximum) != (exact < maximum)).sum())
        total += out.size
        if unequal.any():
            worst = max(worst, float(np.abs(out - exact)[unequal].max()))
    entries = int(counts.sum())
    report = {
        "nodes": nodes, "bound": bound, "pairs_per_step": int(out.size), "steps": len(label_times),
        "labels": {
            "entries_per_node": round(entries / nodes, 1), "max_per_node": int(counts.max()),
            "bytes_per_node": round(entries * 12 / nodes + 8, 1), "build_s_one_thread": round(build_s, 1),
            "step_lookup_ms_p50_merge": round(statistics.median(label_times) * 1e3, 1),
            "step_lookup_ms_p50_scattered": round(statistics.median(scattered_times) * 1e3, 1),
            "pairs_differing_from_the_oracle": differ, "share_differing": differ / max(total, 1),
            "largest_difference": worst, "pairs_on_the_other_side_of_the_bound": crossed,
        },
        "ball_table": {
            "entries_per_node": round(table.neighbors.numel() / nodes, 1),
            "bytes_per_node": round(table.nbytes / nodes, 1),
            "step_lookup_ms_p50_one_thread": round(statistics.median(ball_times) * 1e3, 1),
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
