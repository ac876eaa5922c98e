"""Batched decoding of conversational retrieval trellises: the functional tensor API.

Every function takes a padded batch (docs/spec.md section 10):

- ``emissions``: ``(B, T, M)`` float, already weighted (``lambda * normalized score``).
- ``transitions``: ``(B, T-1, M, M)``, same dtype and device, indexed
  ``[b, t, from, to]``: the score of moving from candidate ``from`` of turn t to
  candidate ``to`` of turn t+1, already weighted (``-(beta * distance)``, made by
  :mod:`mapmatched_torch.kernels.transitions`, which also chooses among these decoders).
- ``mask``: ``(B, T, M)`` bool, True at real candidates.

A conversation's length is its number of turns with at least one real candidate, and
real turns come first. Holes inside a turn are allowed. Padding is never trusted:
values at masked candidates (even NaN) and transitions touching them are ignored.
Paths are ``(B, T)`` long candidate indices with -1 after a conversation's end.

Semantics are those of the pure-Python standalone decoder, bit for bit in float64:
``alpha[t, i] = max_j (alpha[t-1, j] + trans[t-1, j, i]) + e[t, i]`` in this order,
ties to the first predecessor and the first final candidate, the score is the best
final forward score, and an overflowing forward score at an allowed candidate raises
``ValueError("decoder accumulation produced a nonfinite score ...")``.

Invalid input raises :class:`~mapmatched_torch.core.errors.MapMatchedValueError` (a
``ValueError``) before any work, naming the offending ``(b, t, m)`` and the shapes.
Outputs live on the inputs' device; inputs are never modified. The checks cost one
host-device synchronization per call (plus one for the overflow check); the dynamic
programs themselves never synchronize (loops over T only, backtracking on the device).

Choices made where docs/spec.md is silent:

- Index tensors (``paths``, ``locks``, ``gold``) are checked at real turns only; their
  entries after a conversation's end are ignored.
- The log-semiring functions raise the same nonfinite-score ValueError on overflow.
- An empty batch (B = 0) is valid and gives empty results.
- :func:`pointwise_decode` (beta = 0) raises on overflow exactly when the standalone
  decoder does: when any real candidate's forward score ``e + cumulative`` overflows.

The streaming states, one turn at a time, are
:class:`~mapmatched_torch.kernels.states.ViterbiState` and
:class:`~mapmatched_torch.kernels.states.FixedLagState` (:mod:`.states`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from ..core.checks import check_nonnegative_int
from ..core.errors import MapMatchedValueError
from . import chain, fused
from .checks import (
    check_choices,
    check_emissions,
    check_mask,
    check_structure,
    prepare,
    raise_if_nonfinite,
    restrict,
    shape_tuple,
)
from .semiring import LEXICOGRAPHIC, LOG, MAX_PLUS, Semiring

__all__ = [
    "Decoded",
    "FixedLagDecoded",
    "GeodesicDecoded",
    "viterbi",
    "fixed_lag_viterbi",
    "pointwise_decode",
    "geodesic_viterbi",
    "forward_scores",
    "log_partition",
    "marginals",
    "log_likelihood",
    "path_score",
]

_INF = float("inf")


class Decoded(NamedTuple):
    """A batch of decoded paths.

    Attributes:
        paths: ``(B, T)`` long candidate index per turn, -1 after the end.
        scores: ``(B,)`` the best path's score (the standalone decoder's total_score).
    """

    paths: Tensor
    scores: Tensor


class FixedLagDecoded(NamedTuple):
    """A batch of fixed-lag decoded paths.

    Attributes:
        paths: ``(B, T)`` long, -1 after the end.
        scores: ``(B,)`` score of each path.
        committed_through: ``(B,)`` long, the last committed turn ``length - lag - 1``,
            or -1 when nothing is committed.
        locks: ``(B, T)`` long, the committed candidate of each committed turn, -1
            elsewhere (equal to ``paths`` on committed turns). Pass it to
            :func:`forward_scores` to rank final candidates under the same locks.
    """

    paths: Tensor
    scores: Tensor
    committed_through: Tensor
    locks: Tensor


class GeodesicDecoded(NamedTuple):
    """A batch of geodesic-mode paths (:func:`geodesic_viterbi`).

    Attributes:
        paths: ``(B, T)`` long, -1 after the end.
        distances: ``(B,)`` total raw distance of each path (the minimum).
        emission_scores: ``(B,)`` total emission of each path (the maximum among
            minimum-distance paths).
    """

    paths: Tensor
    distances: Tensor
    emission_scores: Tensor


def _best_paths(semiring: Semiring, forward: chain.Forward, active: Tensor) -> Tuple[Tensor, Tensor]:
    """Final first-maximum and device backtrack. Returns (paths (B, T), best (B, *V))."""
    raise_if_nonfinite(forward.nonfinite)
    best, last = semiring.sum(forward.alphas[:, -1], dim=1)
    return chain.backtrack(forward.backpointers, active, last), best


def _committed_through(lengths: Tensor, lag: int) -> Tensor:
    """``(B,)`` long: ``length - lag - 1`` when >= 0, else -1."""
    return (lengths - lag - 1).clamp_min(-1)


def _locked_to_path(paths: Tensor, scores: Tensor, lengths: Tensor, lag: int) -> FixedLagDecoded:
    """A fixed-lag result whose committed turns are read off its own path.

    Right wherever the path passes through every committed candidate: the beta = 0
    decode (locks never change its path) and a decoder that keeps its locks in the path
    (the streaming states).

    Args:
        paths: ``(B, T)`` long, -1 after the end. scores: ``(B,)``.
        lengths: ``(B,)`` long turns per conversation. lag: L >= 0.

    Returns:
        :class:`FixedLagDecoded` with ``committed_through = length - L - 1`` (or -1) and
        ``locks`` equal to ``paths`` on committed turns, -1 elsewhere.
    """
    committed = _committed_through(lengths, lag)
    turns = torch.arange(paths.shape[1], device=paths.device)
    locks = torch.where(turns.unsqueeze(0) <= committed.unsqueeze(1), paths, -1)
    return FixedLagDecoded(paths, scores, committed, locks)


def _fused_max_plus(
    emissions: object, transitions: object, mask: object, lag: Optional[int]
) -> Optional[Tuple[Tensor, Tensor, Tensor, Tensor]]:
    """The fused kernel's (paths, scores, locks, lengths), or None where none applies
    (:mod:`.fused`); the shapes are checked first, with the torch path's messages."""
    return fused.max_plus(*fused.check_shapes(emissions, transitions, mask), lag)


# ------------------------------------------------------------------------ decoders


def viterbi(emissions: Tensor, transitions: Tensor, mask: Tensor) -> Decoded:
    """Full Viterbi decoding (max-plus) of a batch of trellises.

    Args:
        emissions: ``(B, T, M)`` float, weighted emissions.
        transitions: ``(B, T-1, M, M)`` weighted transitions ``[b, t, from, to]``.
        mask: ``(B, T, M)`` bool, real candidates.

    Returns:
        :class:`Decoded`: paths ``(B, T)`` long (-1 after the end), scores ``(B,)``.
        Ties go to the first predecessor and the first final candidate.

    Cost: O(B T M^2) time; memory O(B T M) plus one O(B M^2) step, plus a cleaned
    copy of the transitions only when non-finite padding garbage makes one necessary.

    Example:
        >>> e = torch.tensor([[[2.0, 0.0], [0.0, 1.0]]])
        >>> tr = torch.tensor([[[[0.0, -3.0], [-3.0, 0.0]]]])
        >>> viterbi(e, tr, torch.ones(1, 2, 2, dtype=torch.bool))
        Decoded(paths=tensor([[0, 0]]), scores=tensor([2.]))
    """
    fused_result = _fused_max_plus(emissions, transitions, mask, None)
    if fused_result is not None:
        return Decoded(fused_result[0], fused_result[1])
    prepared = prepare(emissions, transitions, mask, max_plus=True)
    forward = chain.forward(MAX_PLUS, prepared.emissions, prepared.pairwise, mask)
    return Decoded(*_best_paths(MAX_PLUS, forward, prepared.active))


def fixed_lag_viterbi(emissions: Tensor, transitions: Tensor, mask: Tensor, lag: int) -> FixedLagDecoded:
    """Fixed-lag decoding (docs/spec.md section 5) of a batch of trellises.

    For each turn t: decode the prefix 0..t with every committed turn locked to its
    committed candidate; if t >= lag, commit turn t-lag to what that decode chose.
    Finally decode the whole trellis under all locks. Each conversation uses its own
    length. ``lag = 0`` is causal filtering; ``lag >= T-1`` equals :func:`viterbi`.

    Args:
        emissions, transitions, mask: as in :func:`viterbi`.
        lag: L >= 0.

    Returns:
        :class:`FixedLagDecoded` (paths, scores, committed_through, locks).

    Cost: O(B T (L+1) M^2) time: after a commit only the L uncommitted turns are
    recomputed (forward scores before the locked turn cannot change).
    """
    lag = check_nonnegative_int(lag, "fixed_lag")
    fused_result = _fused_max_plus(emissions, transitions, mask, lag)
    if fused_result is not None:
        paths, scores, locks, lengths = fused_result
        return FixedLagDecoded(paths, scores, _committed_through(lengths, lag), locks)
    prepared = prepare(emissions, transitions, mask, max_plus=True)
    forward = chain.forward(MAX_PLUS, prepared.emissions, prepared.pairwise, mask, lag=lag)
    paths, scores = _best_paths(MAX_PLUS, forward, prepared.active)
    committed = _committed_through(prepared.active.sum(dim=1), lag)
    assert forward.locks is not None
    return FixedLagDecoded(paths, scores, committed, forward.locks)


def pointwise_decode(
    emissions: Tensor, mask: Tensor, *, fixed_lag: Optional[int] = None
) -> Union[Decoded, FixedLagDecoded]:
    """The beta = 0 decode: each turn's first best real candidate, exactly.

    With zero transitions the max-plus recursion can create rounding ties that the
    emissions themselves do not have, so the standalone decoder (and this function)
    take the per-turn argmax instead. The score is the running sum
    ``(cumulative - 0.0) + e`` along the path. Like the standalone decoder, it raises
    the nonfinite-score ValueError if any real candidate's forward score
    ``e[t, i] + cumulative[t-1]`` overflows.

    Args:
        emissions: ``(B, T, M)`` float. mask: ``(B, T, M)`` bool.
        fixed_lag: None, or L >= 0: the path does not depend on the lag; the result then
            also reports the committed turns (locked to the path).

    Returns:
        :class:`Decoded`, or :class:`FixedLagDecoded` when ``fixed_lag`` is given.

    Cost: O(B T M).
    """
    lag = None if fixed_lag is None else check_nonnegative_int(fixed_lag, "fixed_lag")
    emissions = check_emissions(emissions)
    mask = check_mask(mask, emissions)
    active, _ = check_structure(emissions, mask)
    # shape: (B, T, M)
    masked = torch.where(mask, emissions, -_INF)
    # shape: (B, T)
    best, paths = masked.max(dim=-1)
    paths = torch.where(active, paths, -1)
    score = best[:, 0]
    nonfinite = torch.zeros_like(active[:, 0])
    for t in range(1, emissions.shape[1]):
        previous = score - 0.0
        # shape: (B, M): the forward scores the standalone decoder checks
        candidates = masked[:, t] + previous.unsqueeze(1)
        nonfinite = nonfinite | (mask[:, t] & ~torch.isfinite(candidates)).any(dim=-1)
        score = torch.where(active[:, t], previous + best[:, t], score)
    raise_if_nonfinite(nonfinite)
    if lag is None:
        return Decoded(paths, score)
    return _locked_to_path(paths, score, active.sum(dim=1), lag)


def geodesic_viterbi(emissions: Tensor, distances: Tensor, mask: Tensor) -> GeodesicDecoded:
    """Geodesic mode (the beta -> infinity limit): least total distance first.

    Minimizes the total raw distance (left-fold float sums), breaks ties by the larger
    total emission (left-fold sums), then by candidate order (first predecessor, first
    final candidate). Runs the chain DP in the lexicographic max-plus semiring on pairs
    ``(-distance, emission)``.

    Args:
        emissions: ``(B, T, M)`` float weighted emissions.
        distances: ``(B, T-1, M, M)`` raw distances ``[b, t, from, to]``, finite and
            nonnegative between real candidates.
        mask: ``(B, T, M)`` bool.

    Returns:
        :class:`GeodesicDecoded` (paths, distances, emission_scores).

    Cost: O(B T M^2) time, twice the memory of :func:`viterbi`.
    """
    prepared = prepare(emissions, distances, mask, name="distances", nonnegative=True, max_plus=True)
    # shape: (B, T, M, 2)
    pair_emissions = torch.stack((torch.zeros_like(prepared.emissions), prepared.emissions), dim=-1)
    # shape: (B, T-1, M, M, 2)
    pair_transitions = torch.stack((-prepared.pairwise, torch.zeros_like(prepared.pairwise)), dim=-1)
    forward = chain.forward(LEXICOGRAPHIC, pair_emissions, pair_transitions, mask)
    paths, best = _best_paths(LEXICOGRAPHIC, forward, prepared.active)
    return GeodesicDecoded(paths, 0.0 - best[:, 0], best[:, 1])


def forward_scores(emissions: Tensor, transitions: Tensor, mask: Tensor, locks: Optional[Tensor] = None) -> Tensor:
    """Max-plus forward scores: the best score of a path ending at each candidate.

    Args:
        emissions, transitions, mask: as in :func:`viterbi`.
        locks: optional ``(B, T)`` long: at each real turn -1 (unlocked) or a real
            candidate, the only one that turn then allows (e.g.
            :attr:`FixedLagDecoded.locks`). Entries after a conversation's end are
            ignored.

    Returns:
        ``(B, T, M)``: forward scores, -inf at masked, locked-out and padding positions.
        ``forward_scores(...)[b, length - 1]`` ranks the final candidates (docs/spec.md
        "decode_ranked"), under the locks if given.

    Cost: O(B T M^2).
    """
    fused_scores = fused.max_plus_forward(*fused.check_shapes(emissions, transitions, mask), locks)
    if fused_scores is not None:
        return fused_scores
    prepared = prepare(emissions, transitions, mask, max_plus=True)
    allowed = mask
    if locks is not None:
        allowed = restrict(mask, check_choices(locks, mask, prepared.active, "locks", optional=True))
    forward = chain.forward(MAX_PLUS, prepared.emissions, prepared.pairwise, allowed)
    raise_if_nonfinite(forward.nonfinite)
    return torch.where(allowed, forward.alphas, -_INF)


def _log_partition(emissions: Tensor, transitions: Tensor, allowed: Tensor) -> Tensor:
    """log Z of a clean trellis (:func:`~mapmatched_torch.kernels.checks.prepare`'s output):
    the fused kernels where they apply, with their backward pass when a gradient is
    asked for (:class:`_FusedLogPartition`), else the torch path."""
    if fused.gradient_wanted(emissions, transitions):
        # one turn: log Z does not depend on the (empty) transitions; the torch path's graph says so
        if emissions.shape[1] > 1 and fused.applies(emissions, transitions, allowed, gradients=True):
            try:
                return _FusedLogPartition.apply(emissions, transitions, allowed)
            except _TorchPathDecides:
                pass
        return _torch_log_partition(emissions, transitions, allowed)
    fused_log_z = fused.log_partition(*_without_gradient(emissions, transitions, allowed))
    if fused_log_z is not None:
        return fused_log_z
    return _torch_log_partition(emissions, transitions, allowed)


def _torch_log_partition(emissions: Tensor, transitions: Tensor, allowed: Tensor) -> Tensor:
    forward = chain.forward(LOG, emissions, transitions, allowed)
    raise_if_nonfinite(forward.nonfinite)
    return LOG.sum(forward.alphas[:, -1], dim=1)[0]


class _TorchPathDecides(Exception):
    """The fused kernel flagged a row that the torch checks accept (not expected: the
    torch path then decides)."""


class _FusedLogPartition(torch.autograd.Function):
    """log Z by the fused kernel; its gradient (marginals, pair marginals) by the same
    kernels' backward pass (:func:`mapmatched_torch.kernels.fused.log_partition_gradients`).

    A gradient that must itself be differentiable (``create_graph=True``: double
    backward) is computed by the torch path's autograd instead, from the same inputs.
    """

    @staticmethod
    def forward(ctx, emissions: Tensor, transitions: Tensor, allowed: Tensor) -> Tensor:  # type: ignore[override]
        states = fused.log_partition_states(emissions.detach(), transitions.detach(), allowed)
        if states is None:
            raise _TorchPathDecides()
        ctx.save_for_backward(emissions, transitions, allowed, *states)
        return states.log_z.clone()  # the kept log Z stays the backward pass's input

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        emissions, transitions, allowed, *kept = ctx.saved_tensors
        wanted = ctx.needs_input_grad[:2]
        if torch.is_grad_enabled():  # create_graph: the torch path's differentiable gradient
            inputs = [tensor for tensor, needed in zip((emissions, transitions), wanted) if needed]
            found = iter(torch.autograd.grad(_torch_log_partition(emissions, transitions, allowed), inputs, grad,
                                             create_graph=True, allow_unused=True))
            return tuple(next(found) if needed else None for needed in wanted) + (None,)
        result = fused.log_partition_gradients(emissions.detach(), transitions.detach(), allowed, pairs=wanted[1],
                                               states=fused.ForwardStates(*kept))
        assert result is not None, "the fused kernel applied in the forward pass"
        _, marginal, pair = result
        # shape: (B, T, M), (B, T-1, M, M)
        grad_emissions = grad[:, None, None] * marginal if wanted[0] else None
        grad_transitions = grad[:, None, None, None] * pair if wanted[1] else None
        return grad_emissions, grad_transitions, None


def log_partition(emissions: Tensor, transitions: Tensor, mask: Tensor) -> Tensor:
    """Log partition function: logsumexp over all real paths of the path score.

    The same recursion as :func:`viterbi` with logsumexp in place of max.
    Differentiable in ``emissions`` and ``transitions`` (hence in lambda and beta);
    padding gets exactly zero gradient and never produces NaN.

    Args:
        emissions, transitions, mask: as in :func:`viterbi`.

    Returns:
        ``(B,)`` log Z.

    The fused CPU kernel computes it where it applies, and its gradient with its own
    backward pass (:mod:`mapmatched_torch.kernels.fused`; equal to this recursion to a
    few ulps, not bit for bit); a double backward runs the torch path's autograd.

    Cost: O(B T M^2) time; autograd keeps O(B T M^2).
    """
    fused_log_z = fused.log_partition(*_without_gradient(*fused.check_shapes(emissions, transitions, mask)))
    if fused_log_z is not None:
        return fused_log_z
    prepared = prepare(emissions, transitions, mask)
    return _log_partition(prepared.emissions, prepared.pairwise, mask)


def _without_gradient(emissions: Tensor, transitions: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """The inputs detached when no gradient can be asked of the result (grad mode off),
    so that the fused kernels apply; as given otherwise, and always for a forward-mode
    dual tensor (detaching would drop its tangent: the torch path then runs)."""
    if torch.is_grad_enabled() or not (fused.plain(emissions) and fused.plain(transitions)):
        return emissions, transitions, mask
    return emissions.detach(), transitions.detach(), mask


def marginals(emissions: Tensor, transitions: Tensor, mask: Tensor) -> Tensor:
    """Posterior marginals ``p(x_t = m)`` under the Gibbs distribution ``exp(score) / Z``.

    Computed as the gradient of :func:`log_partition` with respect to the emissions
    (torch-struct style). Works under ``torch.no_grad()`` and without inputs that
    require grad; when the inputs require grad (and grad mode is on) the result is
    itself differentiable (double backward).

    Args:
        emissions, transitions, mask: as in :func:`viterbi`.

    Returns:
        ``(B, T, M)``: each real turn sums to 1; 0 at masked candidates and padding.

    Cost: about twice :func:`log_partition`. Where the result needs no gradient, the
    fused forward-backward kernel computes it (:func:`mapmatched_torch.kernels.fused.marginals`).
    """
    differentiable = fused.gradient_wanted(emissions, transitions)
    if not differentiable:
        fused_marginals = fused.marginals(*_without_gradient(*fused.check_shapes(emissions, transitions, mask)))
        if fused_marginals is not None:
            return fused_marginals
    prepared = prepare(emissions, transitions, mask)
    with torch.enable_grad():
        # shape: (B, T, M)
        shift = torch.zeros_like(prepared.emissions, requires_grad=True)
        log_z = _log_partition(prepared.emissions + shift, prepared.pairwise, mask)
        (grad,) = torch.autograd.grad(log_z.sum(), shift, create_graph=differentiable)
    return grad


def log_likelihood(emissions: Tensor, transitions: Tensor, mask: Tensor, gold: Tensor) -> Tensor:
    """Log-probability of the gold labels: ``log Z(gold) - log Z``.

    ``Z(gold)`` sums ``exp(score)`` over the paths that agree with ``gold`` at every
    labelled turn (unlabelled turns are marginalized): the log-semiring DP run with the
    mask restricted to the gold candidates. Differentiable in ``emissions`` and
    ``transitions``; ``-log_likelihood`` is the CRF negative log-likelihood.

    Args:
        emissions, transitions, mask: as in :func:`viterbi`.
        gold: ``(B, T)`` integer: a real candidate index at labelled turns, -1 at
            unlabelled ones; entries after a conversation's end are ignored. Or
            ``(B, T, M)`` bool, the set-valued form: the relevant candidates of each
            turn; a turn with no relevant real candidate is marginalized (unlabelled,
            or its gold is not among the candidates), so ``Z(gold)`` sums the paths
            that pass through a relevant candidate at every other turn.

    Returns:
        ``(B,)`` log-likelihoods (<= 0 up to rounding; 0 when gold fixes every turn of a
        conversation with a single path).

    Cost: two :func:`log_partition` passes.
    """
    prepared = prepare(emissions, transitions, mask)
    if isinstance(gold, Tensor) and gold.dtype == torch.bool:
        if gold.shape != mask.shape:
            raise MapMatchedValueError(
                f"a bool gold must have the mask's shape {shape_tuple(mask)}, got {shape_tuple(gold)}"
            )
        hits = mask & gold.to(mask.device)
        # shape: (B, T, M): the relevant candidates where a turn has one, every real one elsewhere
        consistent = torch.where(hits.any(dim=-1, keepdim=True), hits, mask)
    else:
        consistent = restrict(mask, check_choices(gold, mask, prepared.active, "gold", optional=True))
    log_z = _log_partition(prepared.emissions, prepared.pairwise, mask)
    return _log_partition(prepared.emissions, prepared.pairwise, consistent) - log_z


def path_score(emissions: Tensor, transitions: Tensor, mask: Tensor, paths: Tensor) -> Tensor:
    """The score of given paths: ``e[0, p0]``, then ``(s + trans[t-1, p_{t-1}, p_t]) + e[t, p_t]``.

    The same left fold as the decoder's recursion, so
    ``path_score(..., viterbi(...).paths) == viterbi(...).scores`` exactly.
    Differentiable in ``emissions`` and ``transitions``.

    Args:
        emissions, transitions, mask: as in :func:`viterbi`.
        paths: ``(B, T)`` integer; a real candidate at every real turn (ValueError
            otherwise); entries after a conversation's end are ignored.

    Returns:
        ``(B,)`` path scores. Cost: O(B T M).
    """
    prepared = prepare(emissions, transitions, mask, max_plus=True)
    paths = check_choices(paths, mask, prepared.active, "paths", optional=False)
    batch, turns, candidates = prepared.emissions.shape
    # shape: (B, T)
    safe = torch.where(prepared.active, paths, 0)
    picked_emissions = prepared.emissions.gather(2, safe.unsqueeze(2)).squeeze(2)
    # shape: (B, T-1, M): the row of each move's source candidate
    rows = prepared.pairwise.gather(2, safe[:, :-1, None, None].expand(batch, turns - 1, 1, candidates)).squeeze(2)
    # shape: (B, T-1)
    picked_transitions = rows.gather(2, safe[:, 1:].unsqueeze(2)).squeeze(2)
    score = picked_emissions[:, 0]
    for t in range(1, turns):
        score = torch.where(
            prepared.active[:, t], (score + picked_transitions[:, t - 1]) + picked_emissions[:, t], score
        )
    return score
