"""numba kernels of the compiled engine (imported only when numba is installed).

See :mod:`.compiled` for the algorithm and why its values are exact. Every kernel
takes the CSR as ``(indptr, indices, weights)`` int64/int64/float64 numpy arrays and
works on per-thread workspaces, so nothing here costs O(N) per source.
"""

from __future__ import annotations

import numba
import numpy as np

_INF = np.inf


@numba.njit(cache=True, nogil=True)
def _push(heap_key, heap_node, size, key, node):
    """Insert (key, node) into the binary min-heap of ``size`` entries; the new size."""
    position = size
    while position > 0:
        parent = (position - 1) >> 1
        if heap_key[parent] <= key:
            break
        heap_key[position] = heap_key[parent]
        heap_node[position] = heap_node[parent]
        position = parent
    heap_key[position] = key
    heap_node[position] = node
    return size + 1


@numba.njit(cache=True, nogil=True)
def _pop(heap_key, heap_node, size):
    """Remove the root (the caller has read it); the new size."""
    size -= 1
    key = heap_key[size]
    node = heap_node[size]
    position = 0
    while True:
        child = 2 * position + 1
        if child >= size:
            break
        if child + 1 < size and heap_key[child + 1] < heap_key[child]:
            child += 1
        if heap_key[child] >= key:
            break
        heap_key[position] = heap_key[child]
        heap_node[position] = heap_node[child]
        position = child
    if size > 0:
        heap_key[position] = key
        heap_node[position] = node
    return size


@numba.njit(cache=True, nogil=True)
def workspace(nodes, arcs):
    """Per-thread buffers: dist, settled stamps, wanted stamps, touched list, heuristic,
    settle order, heap."""
    return (
        np.full(nodes, _INF),
        np.zeros(nodes, np.int64),
        np.zeros(nodes, np.int64),
        np.empty(nodes, np.int64),
        np.full(nodes, _INF),
        np.empty(nodes, np.int64),
        np.empty(arcs + nodes + 1, np.float64),
        np.empty(arcs + nodes + 1, np.int64),
    )


@numba.njit(cache=True, nogil=True)
def search(indptr, indices, weights, starts, targets, guided, floor, scale, bound, settle_limit, work, stamp,
           values, found):
    """One search from ``starts`` (all at 0.0); see :mod:`.compiled`.

    Settles nodes by key ``g`` (unguided) or ``g + scale * min(h[v], floor)`` (guided,
    ``h`` = the workspace's heuristic array). Stops when every target is settled, the
    heap is empty, or ``settle_limit`` nodes are settled (0: no limit). Writes
    ``values[i]``/``found[i]`` for ``targets[i]`` (found: exact; not found only when
    the limit stopped the search first). Leaves ``dist`` filled for the caller, who
    resets it, and the settled nodes in settle order (nondecreasing distance) in the
    workspace's ``order``. Returns (touched count, settled count, distance of the last
    settled node when the limit stopped the search, else inf).
    """
    dist, settled, wanted, touched, heuristic, order, heap_key, heap_node = work
    remaining = 0
    for target in targets:
        if wanted[target] != stamp:
            wanted[target] = stamp
            remaining += 1
    full = targets.shape[0] == 0
    count = 0
    size = 0
    for start in starts:
        if dist[start] != 0.0:
            dist[start] = 0.0
            touched[count] = start
            count += 1
            size = _push(heap_key, heap_node, size, 0.0, start)
    settled_count = 0
    limited = False
    last = _INF
    while size > 0 and (full or remaining > 0):
        node = heap_node[0]
        size = _pop(heap_key, heap_node, size)
        if settled[node] == stamp:
            continue  # a stale entry: the node was settled by a smaller key
        settled[node] = stamp
        order[settled_count] = node
        settled_count += 1
        if wanted[node] == stamp:
            remaining -= 1
            if remaining == 0:
                break
        if settle_limit > 0 and settled_count >= settle_limit:
            limited = True
            last = dist[node]
            break
        distance = dist[node]
        for arc in range(indptr[node], indptr[node + 1]):
            neighbour = indices[arc]
            candidate = distance + weights[arc]
            if candidate <= bound and candidate < dist[neighbour]:
                key = candidate
                if guided:
                    key = candidate + scale * min(heuristic[neighbour], floor)
                    if not key <= bound:
                        continue  # no target within the bound is reachable through it
                if dist[neighbour] == _INF:
                    touched[count] = neighbour
                    count += 1
                dist[neighbour] = candidate
                size = _push(heap_key, heap_node, size, key, neighbour)
    for index in range(targets.shape[0]):
        target = targets[index]
        if settled[target] == stamp:
            values[index] = dist[target]
            found[index] = True
        else:
            values[index] = _INF
            found[index] = not limited
    return count, settled_count, last


@numba.njit(cache=True, nogil=True)
def _reset(dist, touched, count):
    for index in range(count):
        dist[touched[index]] = _INF


@numba.njit(cache=True, nogil=True)
def _pairs_block(indptr, indices, weights, unit_source, unit_ptr, pair_target, unit_group_ptr, unit_groups,
                 ball_start, ball_end, ball_nodes, ball_values, ball_radius, scale, bound, settle_limit, out, found, block,
                 blocks):
    """The units ``block, block + blocks, ...`` of :func:`pairs` (round robin: costs vary by unit)."""
    units = unit_source.shape[0]
    nodes = indptr.shape[0] - 1
    work = workspace(nodes, indices.shape[0])
    heuristic = work[4]
    for unit in range(block, units, blocks):
        lo, hi = unit_ptr[unit], unit_ptr[unit + 1]
        if lo == hi:
            continue  # no pairs left (e.g. every target in another component)
        first_group, last_group = unit_group_ptr[unit], unit_group_ptr[unit + 1]
        floor = _INF
        for index in range(first_group, last_group):
            floor = min(floor, ball_radius[unit_groups[index]])
        for index in range(first_group, last_group):
            group = unit_groups[index]
            # a ball lists its nodes by distance: past the floor they add nothing
            for entry in range(ball_start[group], ball_end[group]):
                if ball_values[entry] >= floor:
                    break
                node = ball_nodes[entry]
                heuristic[node] = min(heuristic[node], ball_values[entry])
        count, _, _ = search(indptr, indices, weights, unit_source[unit:unit + 1], pair_target[lo:hi],
                             last_group > first_group, floor, scale, bound, settle_limit, work, unit + 1,
                             out[lo:hi], found[lo:hi])
        _reset(work[0], work[3], count)
        for index in range(first_group, last_group):
            group = unit_groups[index]
            for entry in range(ball_start[group], ball_end[group]):
                if ball_values[entry] >= floor:
                    break
                heuristic[ball_nodes[entry]] = _INF


@numba.njit(cache=True, nogil=True)
def _balls_block(indptr, indices, weights, group_ptr, group_nodes, bound, settle_limit, ball_nodes, ball_values,
                 ball_count, ball_radius, block, blocks):
    """The groups ``block, block + blocks, ...`` of :func:`balls`."""
    groups = group_ptr.shape[0] - 1
    nodes = indptr.shape[0] - 1
    no_targets = np.empty(0, np.int64)
    no_values = np.empty(0, np.float64)
    no_found = np.empty(0, np.bool_)
    work = workspace(nodes, indices.shape[0])
    dist, touched, order = work[0], work[3], work[5]
    for group in range(block, groups, blocks):
        stamp = group + 1
        count, stored, last = search(indptr, indices, weights, group_nodes[group_ptr[group]:group_ptr[group + 1]],
                             no_targets, False, _INF, 1.0, bound, settle_limit, work, stamp, no_values, no_found)
        for index in range(stored):
            ball_nodes[group, index] = order[index]
            ball_values[group, index] = dist[order[index]]
        ball_count[group] = stored
        ball_radius[group] = last
        _reset(dist, touched, count)


@numba.njit(cache=True, parallel=True)
def pairs(indptr, indices, weights, unit_source, unit_ptr, pair_target, unit_group_ptr, unit_groups,
          ball_start, ball_end, ball_nodes, ball_values, ball_radius, scale, bound, settle_limit, out, found, blocks):
    """Every unit's search, on ``blocks`` threads: unit ``u`` starts at ``unit_source[u]``
    and wants the targets ``pair_target[unit_ptr[u]:unit_ptr[u + 1]]``. A unit with
    groups (``unit_groups[unit_group_ptr[u]:unit_group_ptr[u + 1]]``) is guided by
    ``h(v) = min(min radius, min over its groups' balls holding v of the ball's value)``;
    group ``g``'s ball is ``ball_nodes/ball_values[ball_start[g]:ball_end[g]]``."""
    for block in numba.prange(blocks):
        _pairs_block(indptr, indices, weights, unit_source, unit_ptr, pair_target, unit_group_ptr, unit_groups,
                     ball_start, ball_end, ball_nodes, ball_values, ball_radius, scale, bound, settle_limit, out, found, block,
                     blocks)


@numba.njit(cache=True, nogil=True)
def pairs_serial(indptr, indices, weights, unit_source, unit_ptr, pair_target, unit_group_ptr, unit_groups,
                 ball_start, ball_end, ball_nodes, ball_values, ball_radius, scale, bound, settle_limit, out, found):
    """:func:`pairs` on the calling thread (small batches: no parallel region to start)."""
    _pairs_block(indptr, indices, weights, unit_source, unit_ptr, pair_target, unit_group_ptr, unit_groups,
                 ball_start, ball_end, ball_nodes, ball_values, ball_radius, scale, bound, settle_limit, out, found, 0, 1)


@numba.njit(cache=True, parallel=True)
def balls(indptr, indices, weights, group_ptr, group_nodes, bound, settle_limit, ball_nodes, ball_values,
          ball_count, ball_radius, blocks):
    """Group ``g``'s ball, on ``blocks`` threads: a search from its nodes
    (``group_nodes[group_ptr[g]:group_ptr[g + 1]]``) settling at most ``settle_limit``
    nodes, stored in row ``g`` of ``ball_nodes`` / ``ball_values`` (``ball_count[g]``
    entries, by nondecreasing distance). ``ball_radius[g]`` is the distance the search
    reached when the limit stopped it (every node nearer is in the ball), or inf when
    it completed (every node within the bound is in the ball)."""
    for block in numba.prange(blocks):
        _balls_block(indptr, indices, weights, group_ptr, group_nodes, bound, settle_limit, ball_nodes, ball_values,
                     ball_count, ball_radius, block, blocks)


@numba.njit(cache=True, nogil=True)
def balls_serial(indptr, indices, weights, group_ptr, group_nodes, bound, settle_limit, ball_nodes, ball_values,
                 ball_count, ball_radius):
    """:func:`balls` on the calling thread."""
    _balls_block(indptr, indices, weights, group_ptr, group_nodes, bound, settle_limit, ball_nodes, ball_values,
                 ball_count, ball_radius, 0, 1)


@numba.njit(cache=True, nogil=True)
def _lookup_block(keys, values, row_start, row_stop, sources, targets, nodes, out, found, block, blocks):
    """The queries ``block, block + blocks, ...`` of :func:`lookup` (contiguous chunks:
    consecutive queries often share a source row)."""
    count = sources.shape[0]
    size = (count + blocks - 1) // blocks
    for query in range(block * size, min(count, (block + 1) * size)):
        source = sources[query]
        key = source * nodes + targets[query]
        low, high = row_start[source], row_stop[source]
        # lower bound of key in keys[low:high], branch-free halving
        length = high - low
        while length > 0:
            half = length >> 1
            probe = low + half
            less = keys[probe] < key
            low = probe + 1 if less else low
            length = length - half - 1 if less else half
        if low < high and keys[low] == key:
            out[query] = values[low]
            found[query] = True
        else:
            out[query] = _INF
            found[query] = False


@numba.njit(cache=True, parallel=True)
def lookup(keys, values, row_start, row_stop, sources, targets, nodes, out, found, blocks):
    """Cached distance of every query ``(sources[q], targets[q])``: a binary search for
    ``source * nodes + target`` within the source's run ``keys[row_start[source]:
    row_stop[source]]`` (sorted; a few cache lines, not the whole array), on ``blocks``
    threads; ``found[q]`` says whether the key is cached."""
    for block in numba.prange(blocks):
        _lookup_block(keys, values, row_start, row_stop, sources, targets, nodes, out, found, block, blocks)


@numba.njit(cache=True, nogil=True)
def lookup_serial(keys, values, row_start, row_stop, sources, targets, nodes, out, found):
    """:func:`lookup` on the calling thread."""
    _lookup_block(keys, values, row_start, row_stop, sources, targets, nodes, out, found, 0, 1)


@numba.njit(cache=True, nogil=True)
def _lookup_grid_block(keys, values, row_start, row_stop, complete, filled, table, sources, targets, nodes, bound, out, answered,
                       row_needed, row_hit, block, blocks):
    """The groups ``block * size ...`` of :func:`lookup_grid` (contiguous chunks). Per
    group the node targets are sorted once; each source row is then read forward
    from the first target's lower bound (one binary search per row, then a merge),
    touching only the part of the row between the group's smallest and largest target."""
    groups, width = sources.shape
    columns = targets.shape[1]
    size = (groups + blocks - 1) // blocks
    order = np.empty(columns, dtype=np.int64)  # the group's node targets' columns, by target
    for group in range(block * size, min(groups, (block + 1) * size)):
        count = 0
        for column in range(columns):  # insertion sort of the node targets
            target = targets[group, column]
            if target < 0:
                continue
            position = count
            while position > 0 and targets[group, order[position - 1]] > target:
                order[position] = order[position - 1]
                position -= 1
            order[position] = column
            count += 1
        for row in range(width):
            source = sources[group, row]
            for column in range(columns):  # codes that need no graph, and node pairs (for now) missed
                target = targets[group, column]
                answered[group, row, column] = True
                if source == target and source != -1:  # d(a, a) = 0, unknown IDs included
                    out[group, row, column] = 0.0
                elif source < 0 or target < 0:  # padding or an unknown ID
                    out[group, row, column] = bound
                else:
                    out[group, row, column] = _INF
                    answered[group, row, column] = False
            needed = False
            hit = True
            if source >= 0 and count > 0 and filled[source]:  # a dense row: one read per target
                for rank in range(count):
                    column = order[rank]
                    target = targets[group, column]
                    if target == source:
                        continue
                    needed = True
                    value = table[source, target]
                    out[group, row, column] = bound if value > bound else value  # inf: beyond the bound
                    answered[group, row, column] = True
            elif source >= 0 and count > 0:
                base = source * nodes
                end = row_stop[source]
                whole = complete[source]
                low = row_start[source]
                length = end - low
                first = base + targets[group, order[0]]
                while length > 0:  # lower bound of the smallest target's key, branch-free halving
                    half = length >> 1
                    probe = low + half
                    less = keys[probe] < first
                    low = probe + 1 if less else low
                    length = length - half - 1 if less else half
                for rank in range(count):  # a merge with the row from there on
                    column = order[rank]
                    target = targets[group, column]
                    if target == source:
                        continue
                    needed = True
                    key = base + target
                    while low < end and keys[low] < key:
                        low += 1
                    if low < end and keys[low] == key:
                        value = values[low]
                        out[group, row, column] = bound if value == _INF else value
                        answered[group, row, column] = True
                    elif whole:  # a complete row without the target: beyond the bound
                        out[group, row, column] = bound
                        answered[group, row, column] = True
                    else:
                        hit = False
            row_needed[group, row] = needed
            row_hit[group, row] = hit


@numba.njit(cache=True, parallel=True)
def lookup_grid(keys, values, row_start, row_stop, complete, filled, table, sources, targets, nodes, bound, out, answered,
                row_needed, row_hit, blocks):
    """SPEC distances of the pairs ``(sources[g, j], targets[g, i])`` of index codes that
    need no search, written to ``out[g, j, i]`` (``answered[g, j, i]`` True): equal
    codes 0.0 (padding excepted), padding or unknown IDs ``bound``, node pairs the
    cache holds (``inf`` -> ``bound``) or whose source row is ``complete`` (``bound``);
    a source whose dense row is ``filled`` reads ``table[source, target]`` instead.
    ``row_needed[g, j]``: row ``j`` of group ``g`` has a node pair; ``row_hit[g, j]``:
    each of them was answered. On ``blocks`` threads, split by group."""
    for block in numba.prange(blocks):
        _lookup_grid_block(keys, values, row_start, row_stop, complete, filled, table, sources, targets, nodes, bound, out,
                           answered, row_needed, row_hit, block, blocks)


@numba.njit(cache=True, nogil=True)
def lookup_grid_serial(keys, values, row_start, row_stop, complete, filled, table, sources, targets, nodes, bound, out, answered,
                       row_needed, row_hit):
    """:func:`lookup_grid` on the calling thread."""
    _lookup_grid_block(keys, values, row_start, row_stop, complete, filled, table, sources, targets, nodes, bound, out, answered,
                       row_needed, row_hit, 0, 1)


@numba.njit(cache=True, nogil=True)
def _table_grid_block(table, sources, targets, bound, out, block, blocks):
    """The groups ``block, block + blocks, ...`` of :func:`table_grid`."""
    width, columns = sources.shape[1], targets.shape[1]
    for group in range(block, sources.shape[0], blocks):
        for row in range(width):
            source = sources[group, row]
            for column in range(columns):
                target = targets[group, column]
                if source == target and target != -1:
                    out[group, row, column] = 0.0  # equal codes, unknown IDs included (not padding)
                elif source < 0 or target < 0:
                    out[group, row, column] = bound
                else:
                    value = table[source, target]
                    out[group, row, column] = bound if value > bound else value


@numba.njit(cache=True, parallel=True)
def table_grid(table, sources, targets, bound, out, blocks):
    """SPEC distances of the pairs ``(sources[g, j], targets[g, i])`` of index codes from
    a dense ``(N, N)`` table, into ``out[g, j, i]``: equal codes 0.0 (padding excepted),
    padding or unknown IDs ``bound``, else the table's entry capped at ``bound``; on
    ``blocks`` threads, split by group."""
    for block in numba.prange(blocks):
        _table_grid_block(table, sources, targets, bound, out, block, blocks)


@numba.njit(cache=True, nogil=True)
def table_grid_serial(table, sources, targets, bound, out):
    """:func:`table_grid` on the calling thread."""
    _table_grid_block(table, sources, targets, bound, out, 0, 1)
