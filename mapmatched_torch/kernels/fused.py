"""Fused decode kernels behind one dispatch: the default wherever they apply.

:func:`~mapmatched_torch.kernels.decode.viterbi` and
:func:`~mapmatched_torch.kernels.decode.fixed_lag_viterbi` ask :func:`max_plus` first,
:func:`~mapmatched_torch.kernels.decode.forward_scores` asks :func:`max_plus_forward`,
and the evaluation harness's online rankings
(:func:`mapmatched_torch.eval.methods.online_forward_scores`) ask
:func:`online_forward_scores`; each returns None when no fused kernel applies, and
the caller runs the torch path (:mod:`.chain`), which stays the reference and the
fallback. A fused kernel applies when

- the kernel backend chosen for the tensors' device (:func:`~.backend.backend_for`:
  numba on CPU tensors and Triton on CUDA tensors by default, each when installed;
  :func:`~.backend.use_backend` or ``MAPMATCHED_TORCH_KERNELS`` choose) has one,
- the tensors are float32 or float64, and none requires a gradient (the
  log-semiring kernels have a backward pass: see below), and none carries a forward-mode
  tangent or is a ``torch.func`` transform's wrapper (those take the torch path).

Two backends implement every entry point here with the same outputs: the numba CPU
kernels described below, and the Triton kernels (:mod:`._triton_max_plus`,
:mod:`._triton_log`: one program per conversation, compiled on CUDA tensors, run under
Triton's interpreter on CPU tensors; max-plus bit for bit, the log semiring within the
bounds their docstrings state).

CPU kernel (:mod:`.fused_cpu_kernels`): one thread decodes one conversation at a time,
its whole trellis in one pass over its transitions, with the forward scores and
backpointers in thread-local buffers (``T x M``). That replaces the torch path's
T-step loop of (B, M, M) temporaries, masking and stacking. Checks are fused too:
the kernel flags a row that breaks a rule of
:func:`~mapmatched_torch.kernels.checks.prepare`, and only then are the torch checks run,
to raise their exact message; overflow raises the same message as the torch path.

Results equal the torch path bit for bit (paths, scores, locks; ties to the first
index; errors): the recursion is evaluated in the same order with additions,
comparisons and selects only. ``tests/kernels/test_fused.py`` checks this on
randomized and adversarial trellises.

The log semiring (:func:`log_partition`, :func:`marginals`, :func:`log_partition_states`,
:func:`log_partition_gradients`; asked by
:func:`~mapmatched_torch.kernels.decode.log_partition`,
:func:`~mapmatched_torch.kernels.decode.marginals`,
:func:`~mapmatched_torch.kernels.decode.log_likelihood` and the harness's filtering
scores) has its own kernels (:mod:`.fused_log_kernels`): the same one-pass-per-conversation
plan, with a vectorized ``exp`` and ``log`` of their own. Those results are *not* the
torch path's bit for bit (torch's ``exp`` and summation order cannot be reproduced):
they agree with the torch path and with brute-force enumeration to a few ulps (float64
log Z within 1e-15 relative on the tests' trellises), are deterministic, and depend on
each conversation's real candidates only (not on the batch, padding or threads). Their
backward pass (:func:`log_partition_gradients`: the marginals and pair marginals, one
local share per move, as reverse-mode differentiation computes them) is the gradient
of :func:`~mapmatched_torch.kernels.decode.log_partition` and ``log_likelihood`` when
one is asked for, so fitting runs on them too; a gradient that must itself be
differentiable (double backward) comes from the torch path.

Threads: ``torch.get_num_threads()`` (so ``OMP_NUM_THREADS`` and
``torch.set_num_threads`` apply), serial below 32 conversations
(:mod:`.numba_runtime`). The first call in a process with a cold numba cache compiles
the kernel for its dtype (a few seconds); numba's on-disk cache keeps it for later
processes.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional, Tuple

import numpy as np
import torch
from torch import Tensor
from torch.autograd import forward_ad

from ..core.checks import check_nonnegative_int
from ..core.errors import MapMatchedValueError
from . import backend, numba_runtime
from .checks import check_choices, check_emissions, check_mask, check_pairwise, prepare, raise_if_nonfinite

__all__ = [
    "use_fused_kernels",
    "fused_kernels_enabled",
    "applies",
    "max_plus",
    "max_plus_forward",
    "online_forward_scores",
    "log_partition",
    "marginals",
    "ForwardStates",
    "log_partition_states",
    "log_partition_gradients",
    "gradient_wanted",
    "plain",
    "check_shapes",
]

_DTYPES = (torch.float32, torch.float64)


def use_fused_kernels(enabled: bool = True) -> None:
    """Turn the fused decode kernels on (``use_backend("auto")``, the default) or off
    (``use_backend("torch")``: the torch path everywhere).

    Results are the same either way; only speed differs. :func:`~.backend.use_backend`
    is the one switch; this is its on/off form.
    """
    backend.use_backend("auto" if enabled else "torch")


def fused_kernels_enabled() -> bool:
    """Whether a kernel backend is chosen (they still apply only where :func:`applies`)."""
    return backend.current_backend() != "torch"


def kernels_on(device: torch.device) -> bool:
    """Whether the numba CPU kernels run for tensors on ``device`` (the numba backend is
    the one :func:`~.backend.backend_for` picks there): the part of :func:`applies` that
    kernels over integer tensors ask too."""
    return backend.backend_for(device) == "numba"


def which(*tensors: Tensor, gradients: bool = False) -> Optional[str]:
    """The kernel backend (``"numba"`` or ``"triton"``) that decodes these (already
    shape-checked) tensors, or None (the torch path); with ``gradients``, inputs that
    require a gradient count too (the log-semiring kernels have a backward pass)."""
    first = tensors[0]
    if first.dtype not in _DTYPES:
        return None
    chosen = backend.backend_for(first.device)
    if chosen is None:
        return None
    if _transforms_active() and not all(plain(tensor) for tensor in tensors):
        return None
    if not gradients and any(tensor.requires_grad for tensor in tensors):
        return None
    return chosen


def applies(*tensors: Tensor, gradients: bool = False) -> bool:
    """Whether a fused kernel (of any backend) can decode these tensors: see :func:`which`."""
    return which(*tensors, gradients=gradients) is not None


def gradient_wanted(*tensors: object) -> bool:
    """Whether a result computed from ``tensors`` must be differentiable: grad mode is
    on and one of them (tensors; anything else is ignored) requires a gradient."""
    return torch.is_grad_enabled() and any(getattr(tensor, "requires_grad", False) for tensor in tensors)


def plain(tensor: Tensor) -> bool:
    """Neither a forward-mode AD dual tensor nor a ``torch.func`` transform's wrapper:
    a kernel reading its values would silently drop the tangent or the transform."""
    if _is_wrapped(tensor):
        return False
    return forward_ad.unpack_dual(tensor).tangent is None


def _transforms_active() -> bool:
    """Whether a forward-mode AD level or a ``torch.func`` transform is active (only then
    can a tensor carry a tangent or be a wrapper): two cheap probes instead of one per
    tensor. Where torch lacks a probe, assume one is."""
    if getattr(forward_ad, "_current_level", 0) >= 0:
        return True
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    return peek is None or peek() is not None


def _is_wrapped(tensor: Tensor) -> bool:
    functorch = getattr(torch._C, "_functorch", None)
    probe = getattr(functorch, "is_functorch_wrapped_tensor", None)
    return bool(probe(tensor)) if probe is not None else False


def _kernels():
    from . import fused_cpu_kernels

    return fused_cpu_kernels


def _log_kernels():
    from . import fused_log_kernels

    return fused_log_kernels


def _triton_max_plus():
    from . import _triton_max_plus

    return _triton_max_plus


def _triton_log():
    from . import _triton_log

    return _triton_log


def _array(tensor: Tensor) -> np.ndarray:
    """A C-contiguous numpy view (a copy only when the tensor is not contiguous)."""
    return tensor.detach().contiguous().numpy()


def max_plus(
    emissions: Tensor, transitions: Tensor, mask: Tensor, lag: Optional[int]
) -> Optional[Tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Viterbi (``lag`` None) or fixed-lag decoding with a fused kernel, or None.

    Args:
        emissions: ``(B, T, M)`` float32/float64 weighted emissions (shape-checked).
        transitions: ``(B, T-1, M, M)`` weighted transitions ``[b, t, from, to]``, same
            dtype (shape-checked).
        mask: ``(B, T, M)`` bool real candidates.
        lag: None (full Viterbi) or the fixed lag L >= 0.

    Returns:
        None when no fused kernel applies (run the torch path), else
        ``(paths (B, T) long, scores (B,) dtype, locks (B, T) long, lengths (B,) long)``
        exactly as the torch path computes them (``locks`` all -1 without a lag).

    Raises:
        MapMatchedValueError: the torch checks' message for an invalid trellis, or the
            overflow message, as the torch path raises them.
    """
    chosen = which(emissions, transitions, mask)
    if chosen is None:
        return None
    batch, turns, _ = emissions.shape
    device = emissions.device
    paths = torch.empty((batch, turns), dtype=torch.long, device=device)
    locks = torch.empty((batch, turns), dtype=torch.long, device=device)
    scores = torch.empty((batch,), dtype=emissions.dtype, device=device)
    status = torch.empty((batch,), dtype=torch.int8, device=device)
    if chosen == "triton":
        _triton_max_plus().decode(emissions, transitions, mask, -1 if lag is None else int(lag),
                                  paths, scores, locks, status)
        return _max_plus_outcome(emissions, transitions, mask, paths, scores, locks, status)
    kernels = _kernels()
    arguments = (
        _array(emissions),
        _array(transitions),
        _array(mask),
        -1 if lag is None else int(lag),
        paths.numpy(),
        scores.numpy(),
        locks.numpy(),
        status.numpy(),
    )
    blocks = numba_runtime.blocks_for(torch.get_num_threads(), batch)
    numba_runtime.call(kernels.decode, kernels.decode_serial, arguments, blocks)
    return _max_plus_outcome(emissions, transitions, mask, paths, scores, locks, status)


def _max_plus_outcome(
    emissions: Tensor, transitions: Tensor, mask: Tensor, paths: Tensor, scores: Tensor, locks: Tensor, status: Tensor
) -> Optional[Tuple[Tensor, Tensor, Tensor, Tensor]]:
    """:func:`max_plus`'s result from a kernel's outputs, or its error (or None: the
    torch path decides)."""
    if bool((status == backend.INVALID).any()):
        prepare(emissions, transitions, mask, max_plus=True)  # raises the torch path's message
        return None  # unreachable unless the kernel and the checks disagree: the torch path decides
    raise_if_nonfinite(status == backend.OVERFLOW)
    lengths = (paths >= 0).sum(dim=1)
    return paths, scores, locks, lengths


def max_plus_forward(
    emissions: Tensor, transitions: Tensor, mask: Tensor, locks: Optional[Tensor] = None, lag: Optional[int] = None
) -> Optional[Tensor]:
    """Max-plus forward scores with a fused kernel, or None (run the torch path).

    Args:
        emissions: ``(B, T, M)`` float32/float64 weighted emissions (shape-checked).
        transitions: ``(B, T-1, M, M)`` weighted transitions ``[b, t, from, to]``, same
            dtype (shape-checked).
        mask: ``(B, T, M)`` bool real candidates.
        locks: optional ``(B, T)`` integer locks (-1 unlocked), as
            :func:`~mapmatched_torch.kernels.decode.forward_scores` takes them; a
            tensor of another dtype, shape or device is left to the torch path (which
            raises its message).
        lag: None, or L >= 0 (without ``locks``): the *online* forward scores of
            fixed-lag decoding, i.e. at every turn t the scores as the fixed-lag
            decode holds them after turn t: turn t - L committed (for t >= L, the
            earlier turns before) and turns t - L + 1..t recomputed unlocked. For
            L = 0 that is ``forward_scores`` under the fixed-lag locks; for L >= 1
            it equals those locked scores of turn t - L carried L unlocked max-plus
            steps forward (what :func:`online_forward_scores` returns).

    Returns:
        None when no fused kernel applies, else ``(B, T, M)`` forward scores of the
        emissions' dtype: -inf at masked, locked-out and padding positions, bit for
        bit what the torch path computes.

    Raises:
        MapMatchedValueError: the torch checks' message for an invalid trellis or
            lock, or the overflow message, as the torch path raises them.

    Cost: O(B T M^2) time (times L + 1 with a lag), O(threads T M) workspace.
    """
    if locks is not None and lag is not None:
        raise MapMatchedValueError("max_plus_forward takes locks or a lag, not both")
    chosen = which(emissions, transitions, mask)
    if chosen is None:
        return None
    if locks is not None:
        if not isinstance(locks, Tensor):
            return None  # the torch path raises the message
        integer = not (locks.dtype == torch.bool or locks.is_floating_point() or locks.is_complex())
        if not integer or tuple(locks.shape) != tuple(mask.shape[:2]) or locks.device != mask.device:
            return None  # the torch path raises the message
    batch = emissions.shape[0]
    # shape: (B, T, M)
    out = torch.empty(emissions.shape, dtype=emissions.dtype, device=emissions.device)
    status = torch.empty((batch,), dtype=torch.int8, device=emissions.device)
    lag_code = -1 if lag is None else int(lag)
    if chosen == "triton":
        _triton_max_plus().forward_scores(emissions, transitions, mask, None if locks is None else locks.long(),
                                          lag_code, out, status)
    else:
        kernels = _kernels()
        given = _array(locks.long()) if locks is not None else np.empty((0, 0), dtype=np.int64)
        arguments = (_array(emissions), _array(transitions), _array(mask), given, lag_code, out.numpy(), status.numpy())
        blocks = numba_runtime.blocks_for(torch.get_num_threads(), batch)
        numba_runtime.call(kernels.forward_scores, kernels.forward_scores_serial, arguments, blocks)
    if bool((status == backend.INVALID).any()):
        prepared = prepare(emissions, transitions, mask, max_plus=True)  # raises the torch path's message
        if locks is not None:
            check_choices(locks, mask, prepared.active, "locks", optional=True)
        return None  # unreachable unless the kernel and the checks disagree: the torch path decides
    raise_if_nonfinite(status == backend.OVERFLOW)
    return out


def online_forward_scores(emissions: object, transitions: object, mask: object, lag: Optional[int]) -> Optional[Tensor]:
    """The evaluation harness's online forward scores with a fused kernel, or None.

    Validates like the torch path (the lag first, then the shapes, with its
    messages), then runs :func:`max_plus_forward` (``lag`` None: plain forward
    scores; L >= 0: the fixed-lag online scores). One pass per conversation replaces
    the torch path's fixed-lag decode, locked forward pass and L unlocked steps.

    Args:
        emissions: ``(B, T, M)`` weighted emissions. transitions: ``(B, T-1, M, M)``
            ``[b, t, from, to]``. mask: ``(B, T, M)`` bool. lag: None or L >= 0.

    Returns:
        ``(B, T, M)`` scores as :func:`mapmatched_torch.eval.methods.online_forward_scores`
        defines them, or None when no fused kernel applies.
    """
    if lag is not None:
        lag = check_nonnegative_int(lag, "fixed_lag")
    return max_plus_forward(*check_shapes(emissions, transitions, mask), lag=lag)


class ForwardStates(NamedTuple):
    """A log-semiring forward pass kept for its backward pass (:func:`log_partition_states`).

    Attributes:
        log_z: ``(B,)``. scores: ``(B, T, M)`` forward scores. sums: ``(B, T, M)`` each
            turn's sums before the emission. (Both unspecified after a row's end and at
            masked candidates: for the kernels only.)
    """

    log_z: Tensor
    scores: Tensor
    sums: Tensor


def _log_semiring(
    emissions: Tensor, transitions: Tensor, mask: Tensor, posteriors: bool, pairs: bool = False,
    gradients: bool = False, keep: bool = False, states: Optional[ForwardStates] = None,
) -> Optional[Tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[ForwardStates]]]:
    """``(log Z (B,), marginals (B, T, M) or None, pair marginals (B, T-1, M, M) or None,
    the kept forward pass or None)`` from the log-semiring kernels, or None.

    ``gradients``: see :func:`applies`. ``keep``: keep the forward pass. ``states``: a
    kept forward pass of these inputs; only the backward pass runs.
    """
    chosen = which(emissions, transitions, mask, gradients=gradients)
    if chosen is None:
        return None
    batch = emissions.shape[0]
    dtype = emissions.dtype
    device = emissions.device
    status = torch.zeros((batch,), dtype=torch.int8, device=device)  # OK: the given forward pass succeeded
    if states is not None:
        log_z, scores, sums = states
    else:
        log_z = torch.empty((batch,), dtype=dtype, device=device)
        scores = torch.empty(emissions.shape if keep else (0, 0, 0), dtype=dtype, device=device)
        sums = torch.empty(emissions.shape if keep else (0, 0, 0), dtype=dtype, device=device)
    marginal = pair = None
    if posteriors or pairs:
        # shape: (B, T, M), (B, T-1, M, M)
        marginal = torch.empty(emissions.shape, dtype=dtype, device=device)
        pair = torch.empty(transitions.shape if pairs else (0, 0, 0, 0), dtype=dtype, device=device)
    if chosen == "triton":
        kernels = _triton_log()
        if marginal is not None:
            kernels.marginals(emissions, transitions, mask, log_z, status, marginal, pair, scores, sums,
                              states is not None)
        else:
            kernels.log_partition(emissions, transitions, mask, log_z, status, scores, sums)
    else:
        kernels = _log_kernels()
        arguments = (_array(emissions), _array(transitions), _array(mask), log_z.numpy(), status.numpy())
        kept = (scores.numpy(), sums.numpy())
        blocks = numba_runtime.blocks_for(torch.get_num_threads(), batch)
        if marginal is not None:
            numba_runtime.call(
                kernels.marginals, kernels.marginals_serial,
                arguments + (marginal.numpy(), pair.numpy()) + kept + (states is not None,), blocks,
            )
        else:
            numba_runtime.call(kernels.log_partition, kernels.log_partition_serial, arguments + kept, blocks)
    if bool((status == backend.INVALID).any()):
        prepare(emissions.detach(), transitions.detach(), mask)  # raises the torch path's message
        return None  # unreachable unless the kernel and the checks disagree: the torch path decides
    raise_if_nonfinite(status == backend.OVERFLOW)
    return log_z, marginal, pair if pairs else None, ForwardStates(log_z, scores, sums) if keep else None


def log_partition(emissions: Tensor, transitions: Tensor, mask: Tensor) -> Optional[Tensor]:
    """The log partition function with the fused log-semiring kernel, or None.

    Args:
        emissions: ``(B, T, M)`` float32/float64 weighted emissions (shape-checked).
        transitions: ``(B, T-1, M, M)`` weighted transitions ``[b, t, from, to]``, same
            dtype (shape-checked).
        mask: ``(B, T, M)`` bool real candidates.

    Returns:
        None when no fused kernel applies (run the torch path), else ``(B,)`` log Z in
        the emissions' dtype: logsumexp over every real path of its score, computed as
        the torch path's recursion is (to a few ulps, see the module docstring).

    Raises:
        MapMatchedValueError: the torch checks' message for an invalid trellis, or the
            overflow message, as the torch path raises them.

    Cost: O(B T M^2) time, one read of the transitions; O(threads T M) workspace.
    """
    result = _log_semiring(emissions, transitions, mask, posteriors=False)
    return None if result is None else result[0]


def marginals(emissions: Tensor, transitions: Tensor, mask: Tensor) -> Optional[Tensor]:
    """Posterior marginals with the fused forward-backward kernel, or None.

    Args:
        emissions, transitions, mask: as in :func:`log_partition` (shape-checked).

    Returns:
        None when no fused kernel applies, else ``(B, T, M)`` ``p(x_t = m)`` in the
        emissions' dtype: each real turn sums to 1 (to rounding); exactly 0 at masked
        candidates and after a conversation's end.

    Raises:
        MapMatchedValueError: as :func:`log_partition`.

    Cost: about twice :func:`log_partition`; O(threads (T + M) M) workspace.
    """
    result = _log_semiring(emissions, transitions, mask, posteriors=True)
    return None if result is None else result[1]


def log_partition_states(emissions: Tensor, transitions: Tensor, mask: Tensor) -> Optional[ForwardStates]:
    """log Z with the fused kernel, its forward pass kept for :func:`log_partition_gradients`;
    or None. Inputs may require a gradient (they are read, not differentiated through).

    Args and Raises: as :func:`log_partition`. Cost: as :func:`log_partition`, plus two
    ``(B, T, M)`` tensors kept.
    """
    result = _log_semiring(emissions, transitions, mask, posteriors=False, gradients=True, keep=True)
    return None if result is None else result[3]


def log_partition_gradients(
    emissions: Tensor, transitions: Tensor, mask: Tensor, *, pairs: bool, states: Optional[ForwardStates] = None
) -> Optional[Tuple[Tensor, Tensor, Optional[Tensor]]]:
    """log Z and its gradients with the fused kernels, or None; inputs may require a
    gradient (they are read, not differentiated through).

    Args:
        emissions, transitions, mask: as in :func:`log_partition` (shape-checked).
        pairs: also compute the pair marginals (the gradient in the transitions,
            ``(B, T-1, M, M)`` floats: 4 or 8 bytes per move).
        states: :func:`log_partition_states` of these same inputs: the forward pass is
            not run again.

    Returns:
        None when no fused kernel applies, else ``(log Z (B,), marginals (B, T, M),
        pair marginals (B, T-1, M, M) or None)``: ``d log Z / d emissions`` and
        ``d log Z / d transitions``, exactly 0 at masked candidates and the moves
        touching them.

    Raises:
        MapMatchedValueError: as :func:`log_partition`.
    """
    result = _log_semiring(emissions, transitions, mask, posteriors=True, pairs=pairs, gradients=True, states=states)
    return None if result is None else result[:3]  # type: ignore[return-value]


def check_shapes(emissions: object, transitions: object, mask: object) -> Tuple[Tensor, Tensor, Tensor]:
    """``(emissions, transitions, mask)`` shape-checked with the torch path's messages, in
    its order (emissions, mask, transitions): what the fused entry points expect."""
    emissions = check_emissions(emissions)
    mask = check_mask(mask, emissions)
    return emissions, check_pairwise(transitions, emissions, "transitions"), mask
