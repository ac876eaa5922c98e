"""Batched decoding of conversational retrieval trellises: the functional tensor API.

Every function takes a padded batch (docs/spec.md section 10):

- ``emissions``: ``(B, T, M)`` float, already weighted (``lambda * normalized score``).
- ``transitions``: ``(B, T-1, M, M)``, same dtype and device, indexed
  ``[b, t, from, to]``: the score of moving from candidate ``from`` of turn t to
  candidate ``to`` of turn t+1, already weighted (``-(beta * distance)``).
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
- The streaming states report score -inf and an all -1 path for a conversation without
  turns, and raise an overflow at :meth:`ViterbiState.backtrack` (steps never
  synchronize beyond their input check).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from ..core.checks import check_nonnegative_int, check_positive_int
from ..core.errors import MapMatchedValueError
from . import chain
from .checks import (
    check_choices,
    check_emissions,
    check_mask,
    check_structure,
    first_problem,
    first_true_index,
    prepare,
    raise_if_nonfinite,
    require_tensor,
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
    "ViterbiState",
    "FixedLagState",
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
    committed = _committed_through(active.sum(dim=1), lag)
    turns = torch.arange(emissions.shape[1], device=emissions.device)
    locks = torch.where(turns.unsqueeze(0) <= committed.unsqueeze(1), paths, -1)
    return FixedLagDecoded(paths, score, committed, locks)


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
    prepared = prepare(emissions, transitions, mask, max_plus=True)
    allowed = mask
    if locks is not None:
        allowed = restrict(mask, check_choices(locks, mask, prepared.active, "locks", optional=True))
    forward = chain.forward(MAX_PLUS, prepared.emissions, prepared.pairwise, allowed)
    raise_if_nonfinite(forward.nonfinite)
    return torch.where(allowed, forward.alphas, -_INF)


def _log_partition(emissions: Tensor, transitions: Tensor, allowed: Tensor) -> Tensor:
    forward = chain.forward(LOG, emissions, transitions, allowed)
    raise_if_nonfinite(forward.nonfinite)
    return LOG.sum(forward.alphas[:, -1], dim=1)[0]


def log_partition(emissions: Tensor, transitions: Tensor, mask: Tensor) -> Tensor:
    """Log partition function: logsumexp over all real paths of the path score.

    The same recursion as :func:`viterbi` with logsumexp in place of max.
    Differentiable in ``emissions`` and ``transitions`` (hence in lambda and beta);
    padding gets exactly zero gradient and never produces NaN.

    Args:
        emissions, transitions, mask: as in :func:`viterbi`.

    Returns:
        ``(B,)`` log Z.

    Cost: O(B T M^2) time; autograd keeps O(B T M^2).
    """
    prepared = prepare(emissions, transitions, mask)
    return _log_partition(prepared.emissions, prepared.pairwise, mask)


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

    Cost: about twice :func:`log_partition`.
    """
    prepared = prepare(emissions, transitions, mask)
    differentiable = torch.is_grad_enabled() and (emissions.requires_grad or transitions.requires_grad)
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


# ---------------------------------------------------------------------- streaming


class _StreamingState:
    """Shared bookkeeping of the incremental decoders: validation and lengths.

    Each :meth:`step` adds one turn to every conversation whose ``mask_t`` row has a
    real candidate; the others do not advance. Turn indices are per conversation.
    """

    def __init__(
        self,
        batch_size: int,
        num_candidates: int,
        *,
        dtype: torch.dtype = torch.float64,
        device: Optional[Union[str, torch.device]] = None,
    ) -> None:
        batch_size = check_nonnegative_int(batch_size, "batch_size")
        num_candidates = check_positive_int(num_candidates, "num_candidates")
        if not dtype.is_floating_point:
            raise MapMatchedValueError(f"dtype must be a floating-point dtype, got {dtype}")
        self._dtype = dtype
        # an allocation resolves "cuda" to "cuda:<current>", so device checks compare equal
        self._device = torch.empty(0, device=device).device
        self._shape = (batch_size, num_candidates)
        #: (B,) long: turns so far per conversation.
        self._lengths = torch.zeros(batch_size, dtype=torch.long, device=self._device)
        #: (B, M) bool: the real candidates of each conversation's last turn.
        self._last_mask = torch.zeros(self._shape, dtype=torch.bool, device=self._device)
        self._nonfinite = torch.zeros(batch_size, dtype=torch.bool, device=self._device)
        self._steps = 0

    @property
    def lengths(self) -> Tensor:
        """``(B,)`` long: number of turns of each conversation so far."""
        return self._lengths.clone()

    @property
    def steps(self) -> int:
        """Number of :meth:`step` calls so far (the width of the returned paths)."""
        return self._steps

    def step(self, emissions_t: Tensor, transitions_t: Optional[Tensor], mask_t: Tensor) -> None:
        """Add one turn (one M x M step per conversation).

        Args:
            emissions_t: ``(B, M)`` weighted emissions of the new turn.
            transitions_t: ``(B, M, M)`` weighted transitions ``[b, from, to]`` from each
                conversation's previous turn (ignored for a conversation's first turn),
                or None when no advancing conversation has a previous turn.
            mask_t: ``(B, M)`` bool; an all-False row means "no new turn".
        """
        emissions_t, transitions_t, advanced = self._prepare_step(emissions_t, transitions_t, mask_t)
        self._advance(emissions_t, transitions_t, mask_t, advanced)
        self._last_mask = torch.where(advanced.unsqueeze(1), mask_t, self._last_mask)
        self._lengths = self._lengths + advanced
        self._steps += 1

    def _advance(self, emissions_t: Tensor, transitions_t: Tensor, mask_t: Tensor, advanced: Tensor) -> None:
        raise NotImplementedError

    def _prepare_step(
        self, emissions_t: object, transitions_t: object, mask_t: object
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """Validate one turn (one synchronization when all values are finite); return
        clean copies and advanced (B,)."""
        emissions = require_tensor(emissions_t, "emissions_t", "(B, M)")
        mask = require_tensor(mask_t, "mask_t", "(B, M)")
        pairwise = (
            torch.zeros(self._shape + self._shape[1:], dtype=self._dtype, device=self._device)
            if transitions_t is None
            else require_tensor(transitions_t, "transitions_t", "(B, M, M)")
        )
        for name, tensor, shape, dtype in (
            ("emissions_t", emissions, self._shape, self._dtype),
            ("mask_t", mask, self._shape, torch.bool),
            ("transitions_t", pairwise, self._shape + self._shape[1:], self._dtype),
        ):
            if shape_tuple(tensor) != shape or tensor.dtype != dtype or tensor.device != self._device:
                raise MapMatchedValueError(
                    f"{name} must be {dtype} of shape {shape} on {self._device}, got {tensor.dtype} of shape "
                    f"{shape_tuple(tensor)} on {tensor.device}"
                )
        # shape: (B,)
        advanced = mask.any(dim=1)
        problems = {
            "emission": mask & ~torch.isfinite(emissions),
            "missing": (self._lengths > 0) & advanced if transitions_t is None else torch.zeros_like(advanced),
        }
        problem, (nonfinite_sum,) = first_problem(problems, ~torch.isfinite(pairwise.sum()))
        if problem is not None:
            kind, where = problem
            if kind == "emission":
                raise MapMatchedValueError(
                    f"emissions_t must be finite at real candidates: emissions_t[b={where[0]}, m={where[1]}] = "
                    f"{emissions[tuple(where)].item()} (emissions_t shape {shape_tuple(emissions)})"
                )
            raise MapMatchedValueError(
                f"transitions_t is None but conversation b={where[0]} already has a turn "
                f"(transitions_t shape must be {self._shape + self._shape[1:]})"
            )
        if nonfinite_sum:  # max-plus: only non-finite garbage needs cleaning (see prepare)
            # shape: (B, M, M)
            pairs = self._last_mask.unsqueeze(2) & mask.unsqueeze(1)
            bad = pairs & ~torch.isfinite(pairwise)
            if bad.any():
                b, j, i = first_true_index(bad)
                raise MapMatchedValueError(
                    f"transitions_t must be finite between real candidates: transitions_t[b={b}, from={j}, "
                    f"to={i}] = {pairwise[b, j, i].item()} (transitions_t shape {shape_tuple(pairwise)})"
                )
            pairwise = torch.where(pairs, pairwise, 0.0)
        return torch.where(mask, emissions, 0.0), pairwise, advanced

    def _final(self) -> Tuple[Tensor, Tensor]:
        """(scores (B,), last (B,)) of the newest forward scores; -inf without turns."""
        raise_if_nonfinite(self._nonfinite)
        best, last = MAX_PLUS.sum(self._newest_alpha(), dim=1)
        return torch.where(self._lengths > 0, best, -_INF), last

    def _newest_alpha(self) -> Tensor:
        raise NotImplementedError


class ViterbiState(_StreamingState):
    """Incremental full Viterbi over B conversations: one M x M step per new turn.

    Keeps the forward scores of each conversation's last turn and every step's
    backpointers; :meth:`backtrack` gives exactly :func:`viterbi` of the turns so far.

    Args:
        batch_size: B. num_candidates: M (every turn is padded to M).
        dtype, device: of the scores (inputs must match).

    Example:
        >>> state = ViterbiState(1, 2)
        >>> state.step(torch.tensor([[1.0, 0.0]], dtype=torch.float64), None, torch.tensor([[True, True]]))
        >>> state.backtrack().paths
        tensor([[0]])

    Cost: O(B M^2) per step; memory O(B S M) for S steps.
    """

    def __init__(
        self,
        batch_size: int,
        num_candidates: int,
        *,
        dtype: torch.dtype = torch.float64,
        device: Optional[Union[str, torch.device]] = None,
    ) -> None:
        super().__init__(batch_size, num_candidates, dtype=dtype, device=device)
        self._alpha = torch.zeros(self._shape, dtype=self._dtype, device=self._device)
        self._backpointers: List[Tensor] = []
        self._advanced: List[Tensor] = []

    def _advance(self, emissions_t: Tensor, transitions_t: Tensor, mask_t: Tensor, advanced: Tensor) -> None:
        step = chain.chain_step(MAX_PLUS, self._alpha, self._lengths > 0, emissions_t, transitions_t, mask_t)
        self._alpha = step.alpha
        self._backpointers.append(step.backpointers)  # type: ignore[arg-type]
        self._advanced.append(advanced)
        self._nonfinite = self._nonfinite | step.nonfinite

    def _newest_alpha(self) -> Tensor:
        return self._alpha

    def backtrack(self) -> Decoded:
        """The best path of every conversation so far.

        Returns:
            :class:`Decoded` with paths ``(B, steps)`` (turn t of conversation b at
            column t, -1 after its length) and scores ``(B,)`` (-inf without turns).
            Raises the nonfinite-score ValueError if a forward score overflowed.
        """
        scores, last = self._final()
        if not self._steps:
            return Decoded(torch.empty(self._shape[0], 0, dtype=torch.long, device=self._device), scores)
        advanced = torch.stack(self._advanced, dim=1)
        per_step = chain.backtrack(torch.stack(self._backpointers, dim=1), advanced, last)
        return Decoded(chain.compact(per_step, advanced), scores)


class _Window(NamedTuple):
    """Per-slot lists (oldest first) of each conversation's newest turns, right-aligned.

    ``transitions[s]`` leads into slot s; ``allowed[0]`` carries the lock of a committed
    slot 0.
    """

    alphas: List[Tensor]  # (B, M) each
    backpointers: List[Tensor]  # (B, M) long each
    emissions: List[Tensor]  # (B, M) each
    transitions: List[Tensor]  # (B, M, M) each
    allowed: List[Tensor]  # (B, M) bool each


def _shift(slots: List[Tensor], new: Tensor, advanced: Tensor, capacity: int) -> List[Tensor]:
    """Right-aligned per-conversation window: advancing rows move one slot left.

    Rows of ``advanced`` conversations drop their oldest slot (once the window is at
    ``capacity``) and take ``new`` in the newest slot; other rows keep their slots.
    A growing window gets a zero/False slot on the left.
    """
    if len(slots) < capacity:
        slots = [torch.zeros_like(new)] + slots
    extended = slots + [new]
    where = chain.lift(advanced, new)
    return [torch.where(where, extended[i + 1], extended[i]) for i in range(len(slots))]


class FixedLagState(_StreamingState):
    """Incremental fixed-lag Viterbi: identical to :func:`fixed_lag_viterbi`.

    Keeps a window of each conversation's ``lag + 1`` newest turns (forward scores
    under all current locks, backpointers, emissions, transitions) and the committed
    candidates. A step costs one M x M step for the new turn plus, when it commits a
    turn, ``lag`` M x M steps to recompute the uncommitted tail under the new lock.

    Args:
        batch_size: B. num_candidates: M. lag: L >= 0.
        dtype, device: of the scores.

    Cost: O(B (L+1) M^2) per step; memory O(B (L+1) M^2 + B S).
    """

    def __init__(
        self,
        batch_size: int,
        num_candidates: int,
        lag: int,
        *,
        dtype: torch.dtype = torch.float64,
        device: Optional[Union[str, torch.device]] = None,
    ) -> None:
        super().__init__(batch_size, num_candidates, dtype=dtype, device=device)
        self._lag = check_nonnegative_int(lag, "fixed_lag")
        self._window = _Window([], [], [], [], [])
        #: (B, steps) long: committed candidate per turn, -1 where uncommitted.
        self._locks = torch.empty(batch_size, 0, dtype=torch.long, device=self._device)

    @property
    def lag(self) -> int:
        """The fixed lag L."""
        return self._lag

    def _advance(self, emissions_t: Tensor, transitions_t: Tensor, mask_t: Tensor, advanced: Tensor) -> None:
        step = chain.chain_step(
            MAX_PLUS, self._newest_alpha(), self._lengths > 0, emissions_t, transitions_t, mask_t
        )
        self._nonfinite = self._nonfinite | step.nonfinite
        new = (step.alpha, step.backpointers, emissions_t, transitions_t, mask_t)
        self._window = _Window(
            *(_shift(slots, value, advanced, self._lag + 1) for slots, value in zip(self._window, new))
        )
        lengths = self._lengths + advanced
        self._locks = torch.cat((self._locks, torch.full_like(lengths, -1).unsqueeze(1)), dim=1)
        if len(self._window.alphas) == self._lag + 1:
            self._commit(advanced & (lengths > self._lag), lengths)

    def _commit(self, commit: Tensor, lengths: Tensor) -> None:
        window = self._window
        tail = chain.commit_tail(
            MAX_PLUS, window.alphas, window.backpointers, window.emissions, window.transitions[1:], window.allowed, commit
        )
        self._window = window._replace(
            alphas=tail.alphas, backpointers=tail.backpointers, allowed=[tail.allowed] + window.allowed[1:]
        )
        self._nonfinite = self._nonfinite | tail.nonfinite
        # shape: (B, 1)
        turn = (lengths - 1 - self._lag).clamp_min(0).unsqueeze(1)
        current = self._locks.gather(1, turn).squeeze(1)
        self._locks.scatter_(1, turn, torch.where(commit, tail.lock, current).unsqueeze(1))

    def _newest_alpha(self) -> Tensor:
        alphas = self._window.alphas
        return alphas[-1] if alphas else torch.zeros(self._shape, dtype=self._dtype, device=self._device)

    def backtrack(self) -> FixedLagDecoded:
        """The fixed-lag path of every conversation so far (committed turns never change).

        Returns:
            :class:`FixedLagDecoded` with ``(B, steps)`` paths and locks (turn t of
            conversation b at column t), scores (-inf without turns) and
            committed_through.
        """
        scores, last = self._final()
        batch, steps = self._locks.shape
        committed = _committed_through(self._lengths, self._lag)
        if not steps:
            return FixedLagDecoded(self._locks.clone(), scores, committed, self._locks.clone())
        width = len(self._window.allowed)
        # shape: (B, W)
        real = torch.stack([slot.any(dim=1) for slot in self._window.allowed], dim=1)
        tail = chain.backtrack(torch.stack(self._window.backpointers, dim=1), real, last)
        turn = self._lengths.unsqueeze(1) - width + torch.arange(width, device=self._device)
        target = torch.where(real, turn, steps)  # column `steps` is a scratch column
        paths = torch.cat((self._locks, torch.full_like(self._locks[:, :1], -1)), dim=1)
        paths = paths.scatter(1, target, tail)[:, :steps]
        return FixedLagDecoded(paths, scores, committed, self._locks.clone())
