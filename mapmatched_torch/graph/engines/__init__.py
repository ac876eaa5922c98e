"""Bounded shortest-path engines over a CSR adjacency (dispatched by
:mod:`mapmatched_torch.graph.shortest_paths`).

- :mod:`.frontier`: frontier relaxation with scatter-min in torch (any device);
- :mod:`.scipy_dijkstra`: scipy's Dijkstra (CPU; the predecessor's engine and an oracle);
- :mod:`.compiled` with :mod:`.compiled_kernels`: target-aware Dijkstra and guided A*
  compiled by numba (CPU, the ``[numba]`` extra).
"""
