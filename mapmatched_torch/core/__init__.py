"""Core: the behaviour contract's plain-Python parts (no torch).

- :mod:`.models`: the frozen dataclasses (candidates, decoded paths, traces, results);
- :mod:`.scoring`: per-turn normalization, emission entropy, margin;
- :mod:`.settings`: ``DecodeSettings`` (lambda, beta, lag, normalization) and the
  decoding mode they choose;
- :mod:`.trace`: traces from decoded paths, their JSON and text rendering;
- :mod:`.path_reports`: decoded paths and final-candidate rankings from candidate indices;
- :mod:`.protocols`: the seams (corpus graph, decoder, candidate provider);
- :mod:`.graph_types`: edges and row-cache statistics of a corpus graph;
- :mod:`.embeddings`: checks of an embedding matrix and of the kNN options;
- :mod:`.checks`: the argument checks every entry point shares;
- :mod:`.sharding`: contiguous balanced shards over the ranks of a distributed job;
- :mod:`.errors` and :mod:`.optional`: the exception types, optional-dependency probing;
- :mod:`.files`: output files written atomically (a temporary file, then a rename);
- :mod:`.progress`: the long loops' progress (a tqdm bar, or plain lines off a terminal).

Every other part of the package imports from here; this part imports nothing else.
"""
