"""Kernels: the dynamic programs on tensors (tensors in, tensors out).

No graph, session or chunk ID lives here:

- :mod:`.semiring` and :mod:`.chain`: the one dynamic program, run in the max-plus or
  the log semiring (and its compiled variant);
- :mod:`.checks`: the checks that prepare a padded trellis;
- :mod:`.decode`: the functional API (``viterbi``, ``fixed_lag_viterbi``,
  ``log_partition``, ``marginals``, ...);
- :mod:`.transitions`: the only place where distances and weights become transitions
  (``weighted_transitions``), and the one choice of decoder (``decoding_mode``,
  ``decode_weighted``: beta = 0 -> pointwise, a lag -> fixed lag);
- :mod:`.slot_decoder`: the one incremental decoder, behind sessions and the server;
- :mod:`.states`: the streaming states ``ViterbiState`` / ``FixedLagState``, views of it;
- :mod:`.normalization`: exact batched score normalization;
- :mod:`.sampling`: exact path sampling (forward filtering, backward sampling);
- :mod:`.ranking_metrics`: nDCG, recall and reciprocal rank on tensors.
"""
