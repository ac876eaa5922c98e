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
- :mod:`.ranking_metrics`: nDCG, recall and reciprocal rank on tensors;
- :mod:`.backend`: the one switch that picks the kernels (``use_backend("torch" |
  "numba" | "triton")``, ``MAPMATCHED_TORCH_KERNELS``), with :mod:`.fused` dispatching
  to the numba (:mod:`.fused_cpu_kernels`, :mod:`.fused_log_kernels`) or Triton
  (:mod:`._triton_max_plus`, :mod:`._triton_log`, :mod:`.triton_runtime`) kernels.
"""

from .backend import BACKENDS, backend_for, current_backend, use_backend

__all__ = ["BACKENDS", "use_backend", "current_backend", "backend_for"]
