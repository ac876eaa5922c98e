"""Kernels: the dynamic programs on tensors (tensors in, tensors out).

No graph, session or chunk ID lives here:

- :mod:`.semiring` and :mod:`.chain`: the one dynamic program, run in the max-plus or
  the log semiring (and its compiled variant);
- :mod:`.checks`: the checks that prepare a padded trellis;
- :mod:`.decode`: the functional API (``viterbi``, ``fixed_lag_viterbi``,
  ``log_partition``, ``marginals``, ...) and the streaming states;
- :mod:`.slot_decoder`: the incremental slot decoder behind sessions and the server;
- :mod:`.normalization`: exact batched score normalization;
- :mod:`.sampling`: exact path sampling (forward filtering, backward sampling);
- :mod:`.ranking_metrics`: nDCG, recall and reciprocal rank on tensors.
"""
