"""The one linear-chain dynamic program, written once and run in any semiring.

Conventions (docs/spec.md section 10): ``B`` conversations, ``T`` turns, ``M`` candidates
per turn, ``V`` the semiring's value shape (``()`` or ``(2,)``, see
:mod:`mapmatched_torch.kernels.semiring`).

- ``emissions``: ``(B, T, M, *V)``, ``transitions``: ``(B, T-1, M, M, *V)`` indexed
  ``[b, t, from, to]`` (the move from turn t to turn t+1), ``allowed``: ``(B, T, M)``
  bool (real candidates, further restricted by locks where a caller locks turns).
- Inputs must be *clean*: finite at allowed candidates and moves between them, and
  elsewhere 0 or, in a max-plus semiring, any finite value (a finite value added to a
  -inf score stays -inf and never wins a max). The public functions in
  :mod:`mapmatched_torch.kernels.decode` validate and clean them, so that no garbage ever meets
  -inf as a NaN and no NaN can reach a value or a gradient.
- A turn where a conversation has no allowed candidate is *inactive*: the conversation
  does not advance and its forward scores are carried unchanged (``torch.where``), so
  padding after a conversation's end (batch) or a conversation without a new turn
  (streaming) costs nothing and changes nothing.

The recursion (max-plus shown; the log semiring replaces max by logsumexp)::

    alpha[0, i] = e[0, i]
    alpha[t, i] = max_j (alpha[t', j] + trans[t, j, i]) + e[t, i]

where ``t'`` is the conversation's previous active turn, evaluated in exactly this
order (predecessor plus transition, then the reduction, then the emission) so that
float64 results match the pure-Python standalone decoder bit for bit. Ties go to the
first predecessor (``torch.max``); masked candidates score ``zero`` (-inf) and never
win.

Cost: one :func:`chain_step` is O(B M^2) time and memory; :func:`forward` is O(B T M^2)
time, O(B T M) memory for the stacked scores and backpointers (plus what autograd keeps
for the log semiring), a Python loop over T with no host-device synchronization.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from .semiring import Semiring

__all__ = [
    "Step",
    "Forward",
    "TailUpdate",
    "lift",
    "chain_step",
    "forward",
    "commit_tail",
    "backtrack",
    "compact",
    "use_compiled_kernels",
    "compiled_kernels_enabled",
]


class Step(NamedTuple):
    """The result of one :func:`chain_step`.

    Attributes:
        alpha: ``(B, M, *V)`` forward scores after the step (carried where inactive).
        backpointers: ``(B, M)`` long, the best predecessor of each candidate (max-plus
            semirings only, else None; meaningless where inactive or at a first turn).
        started: ``(B,)`` bool, the conversation has at least one turn after the step.
        nonfinite: ``(B,)`` bool, a forward score at an allowed candidate is not finite.
    """

    alpha: Tensor
    backpointers: Optional[Tensor]
    started: Tensor
    nonfinite: Tensor


class Forward(NamedTuple):
    """The result of :func:`forward`.

    Attributes:
        alphas: ``(B, T, M, *V)`` forward scores; at an inactive turn, the carried scores
            of the conversation's last active turn (so ``alphas[:, -1]`` holds every
            conversation's final scores). Disallowed candidates of active turns hold
            ``zero``.
        backpointers: ``(B, T, M)`` long (max-plus semirings) or None.
        nonfinite: ``(B,)`` bool, some allowed forward score was not finite (overflow).
        locks: ``(B, T)`` long committed candidates (-1 where uncommitted), or None
            without a lag.
    """

    alphas: Tensor
    backpointers: Optional[Tensor]
    nonfinite: Tensor
    locks: Optional[Tensor]


class TailUpdate(NamedTuple):
    """The result of :func:`commit_tail` (lists indexed by window slot, oldest first).

    Attributes:
        lock: ``(B,)`` long, the committed candidate of slot 0 (-1 where not committing).
        alphas: the L+1 slots' forward scores ``(B, M)`` under the new lock.
        backpointers: the L+1 slots' backpointers ``(B, M)`` under the new lock.
        allowed: ``(B, M)`` bool, slot 0's allowed candidates with the lock applied.
        nonfinite: ``(B,)`` bool, a recomputed allowed score was not finite.
    """

    lock: Tensor
    alphas: List[Tensor]
    backpointers: List[Tensor]
    allowed: Tensor
    nonfinite: Tensor


def lift(mask: Tensor, like: Tensor) -> Tensor:
    """View ``mask`` with trailing singleton dimensions so it broadcasts against ``like``."""
    missing = like.dim() - mask.dim()
    return mask.reshape(mask.shape + (1,) * missing) if missing else mask


def chain_step(
    semiring: Semiring,
    alpha: Tensor,
    started: Tensor,
    emissions_t: Tensor,
    transitions_t: Optional[Tensor],
    allowed_t: Tensor,
) -> Step:
    """Advance every conversation by one turn (one M x M step).

    Args:
        semiring: the algebra (:data:`~mapmatched_torch.kernels.semiring.MAX_PLUS`, ...).
        alpha: ``(B, M, *V)`` forward scores of each conversation's previous turn
            (ignored where ``started`` is False; keep them finite there).
        started: ``(B,)`` bool, the conversation already has a turn.
        emissions_t: ``(B, M, *V)`` clean emissions of the new turn.
        transitions_t: ``(B, M, M, *V)`` clean transitions ``[b, from, to]`` from the
            previous turn, or None when no conversation has a previous turn.
        allowed_t: ``(B, M)`` bool allowed candidates; a row without any is inactive.

    Returns:
        A :class:`Step`. Cost: O(B M^2) time and memory.
    """
    if transitions_t is not None and semiring.has_argmax and _COMPILED["enabled"]:
        return _COMPILED["step"](semiring, alpha, started, emissions_t, transitions_t, allowed_t)
    return _step(semiring, alpha, started, emissions_t, transitions_t, allowed_t)


def _step(
    semiring: Semiring,
    alpha: Tensor,
    started: Tensor,
    emissions_t: Tensor,
    transitions_t: Optional[Tensor],
    allowed_t: Tensor,
) -> Step:
    """The body of :func:`chain_step` (compiled as a whole by :func:`use_compiled_kernels`)."""
    if transitions_t is None:
        stepped = emissions_t
        backpointers = (
            torch.zeros(allowed_t.shape, dtype=torch.long, device=allowed_t.device) if semiring.has_argmax else None
        )
    else:
        # shape: (B, M, *V), (B, M): the best predecessor of every candidate
        best, backpointers = semiring.step_sum(alpha, transitions_t)
        # shape: (B, M, *V)
        stepped = torch.where(lift(started, best), best + emissions_t, emissions_t)
    # shape: (B, M, *V)
    candidate = torch.where(lift(allowed_t, stepped), stepped, semiring.zero)
    # shape: (B,)
    active = allowed_t.any(dim=-1)
    nonfinite = (allowed_t & ~semiring.finite(candidate)).any(dim=-1)
    # shape: (B, M, *V)
    new_alpha = torch.where(lift(active, candidate), candidate, alpha)
    return Step(new_alpha, backpointers, started | active, nonfinite)


_COMPILED = {"enabled": False, "step": None}


def use_compiled_kernels(enabled: bool = True) -> None:
    """Fuse each max-plus step of the chain DP into one kernel with ``torch.compile``.

    The eager step materializes the ``(B, M, M)`` sum of predecessor scores and
    transitions, then reduces it, then runs a handful of small masking operations; the
    compiled step reads the transitions once and does the rest in registers (about
    1.5-2x end to end on a CPU core at B = 4096, M = 32; more on a GPU). Results are
    bit-identical: the step only adds, takes maxima and selects (no multiply that a
    compiler could fuse into an FMA), and the first maximum still wins ties (checked by
    the tests marked ``slow``). The log semiring (autograd) stays eager. The first call
    per shape pays the compilation (seconds), so it is off by default: enable it for
    large batches and long-running servers.
    """
    _COMPILED["enabled"] = bool(enabled)
    if enabled and _COMPILED["step"] is None:
        _COMPILED["step"] = torch.compile(_step, dynamic=None)


def compiled_kernels_enabled() -> bool:
    """Whether :func:`use_compiled_kernels` is on."""
    return _COMPILED["enabled"]


def forward(
    semiring: Semiring,
    emissions: Tensor,
    transitions: Tensor,
    allowed: Tensor,
    *,
    lag: Optional[int] = None,
) -> Forward:
    """Run the chain DP over whole trellises, optionally with fixed-lag commitment.

    With ``lag = L`` (a max-plus semiring only), after each turn t >= L every
    conversation that has turn t commits turn t-L to the candidate that the decode of
    its prefix 0..t (under the locks committed so far) chose, and the forward scores of
    turns t-L+1..t are recomputed under the new lock (:func:`commit_tail`): scores before
    the locked turn cannot change. This is docs/spec.md section 5's lock procedure in
    O(B T L M^2) instead of O(B T^2 M^2).

    Args:
        semiring: the algebra.
        emissions: ``(B, T, M, *V)`` clean emissions, T >= 1.
        transitions: ``(B, T-1, M, M, *V)`` clean transitions ``[b, t, from, to]``.
        allowed: ``(B, T, M)`` bool; active turns must come first in every row.
        lag: None, or the fixed lag L >= 0.

    Returns:
        A :class:`Forward`. Cost: O(B T M^2) time (times L+1 with a lag), O(B T M) memory
        beyond the transient M x M step.
    """
    batch, turns = allowed.shape[:2]
    emission_turns = emissions.unbind(1)
    transition_turns = transitions.unbind(1)
    allowed_turns = list(allowed.unbind(1))
    alphas: List[Tensor] = []
    backpointers: List[Optional[Tensor]] = []
    unlocked = torch.full((batch,), -1, dtype=torch.long, device=allowed.device)
    locks = [unlocked] * turns
    alpha = torch.zeros_like(emission_turns[0])
    started = torch.zeros(batch, dtype=torch.bool, device=allowed.device)
    nonfinite = torch.zeros_like(started)
    for t in range(turns):
        step = chain_step(
            semiring, alpha, started, emission_turns[t], transition_turns[t - 1] if t else None, allowed_turns[t]
        )
        alphas.append(step.alpha)
        backpointers.append(step.backpointers)
        nonfinite = nonfinite | step.nonfinite
        if lag is not None and t >= lag:
            first = t - lag
            tail = commit_tail(
                semiring,
                alphas[first:],
                backpointers[first:],  # type: ignore[arg-type]
                emission_turns[first : t + 1],
                transition_turns[first:t],
                allowed_turns[first : t + 1],
                commit=allowed_turns[t].any(dim=-1),
            )
            alphas[first:] = tail.alphas
            backpointers[first:] = tail.backpointers
            allowed_turns[first] = tail.allowed
            locks[first] = tail.lock
            nonfinite = nonfinite | tail.nonfinite
        alpha, started = alphas[-1], step.started
    return Forward(
        alphas=torch.stack(alphas, dim=1),
        backpointers=torch.stack(backpointers, dim=1) if semiring.has_argmax else None,  # type: ignore[arg-type]
        nonfinite=nonfinite,
        locks=torch.stack(locks, dim=1) if lag is not None else None,
    )


def commit_tail(
    semiring: Semiring,
    alphas: Sequence[Tensor],
    backpointers: Sequence[Tensor],
    emissions: Sequence[Tensor],
    transitions: Sequence[Tensor],
    allowed: Sequence[Tensor],
    commit: Tensor,
) -> TailUpdate:
    """Commit the oldest turn of a window of L+1 turns and recompute the rest.

    The window holds each conversation's L+1 newest turns, slot 0 oldest. For the
    conversations in ``commit``: backtrack the prefix decode from the newest slot down to
    slot 0 (first maximum at the newest slot, then the backpointers), lock slot 0 to the
    candidate reached, and recompute slots 1..L under that lock. Other conversations
    keep their slots unchanged.

    Args:
        semiring: a max-plus semiring (backpointers needed).
        alphas: L+1 tensors ``(B, M, *V)``, forward scores of the slots.
        backpointers: L+1 tensors ``(B, M)`` (slot s points into slot s-1).
        emissions: L+1 tensors ``(B, M, *V)``, clean.
        transitions: L tensors ``(B, M, M, *V)``; ``transitions[s-1]`` leads from slot
            s-1 into slot s.
        allowed: L+1 tensors ``(B, M)`` bool.
        commit: ``(B,)`` bool; committing conversations must have all L+1 slots.

    Returns:
        A :class:`TailUpdate`. Cost: O(B L M^2).
    """
    assert semiring.has_argmax, "fixed-lag commitment needs a max-plus semiring"
    lag = len(alphas) - 1
    _, chosen = semiring.sum(alphas[-1], dim=1)
    for slot in range(lag, 0, -1):
        chosen = backpointers[slot].gather(1, chosen.unsqueeze(1)).squeeze(1)
    candidates = torch.arange(allowed[0].shape[1], device=commit.device)
    # shape: (B, M)
    excluded = commit.unsqueeze(1) & (candidates != chosen.unsqueeze(1))
    alpha = torch.where(lift(excluded, alphas[0]), semiring.zero, alphas[0])
    new_alphas, new_backpointers = [alpha], [backpointers[0]]
    nonfinite = torch.zeros_like(commit)
    for slot in range(1, lag + 1):
        step = chain_step(semiring, alpha, commit, emissions[slot], transitions[slot - 1], allowed[slot])
        alpha = torch.where(lift(commit, step.alpha), step.alpha, alphas[slot])
        new_alphas.append(alpha)
        assert step.backpointers is not None
        new_backpointers.append(torch.where(commit.unsqueeze(1), step.backpointers, backpointers[slot]))
        nonfinite = nonfinite | (step.nonfinite & commit)
    return TailUpdate(
        lock=torch.where(commit, chosen, -1),
        alphas=new_alphas,
        backpointers=new_backpointers,
        allowed=allowed[0] & ~excluded,
        nonfinite=nonfinite,
    )


def backtrack(backpointers: Tensor, advanced: Tensor, last: Tensor) -> Tensor:
    """Follow backpointers from each conversation's final candidate, on the device.

    Args:
        backpointers: ``(B, S, M)`` long; ``backpointers[b, s, i]`` is the best
            candidate of the conversation's previous advanced step for candidate i.
        advanced: ``(B, S)`` bool, the conversation had a turn at step s.
        last: ``(B,)`` long, the chosen candidate of each conversation's last turn.

    Returns:
        ``(B, S)`` long candidate per step, -1 at steps where the conversation did not
        advance. Cost: O(B S).
    """
    chosen = last
    columns: List[Tensor] = []
    for step in range(advanced.shape[1] - 1, -1, -1):
        here = advanced[:, step]
        columns.append(torch.where(here, chosen, -1))
        if step:
            previous = backpointers[:, step].gather(1, chosen.unsqueeze(1)).squeeze(1)
            chosen = torch.where(here, previous, chosen)
    columns.reverse()
    return torch.stack(columns, dim=1)


def compact(per_step: Tensor, advanced: Tensor) -> Tensor:
    """Move each row's advanced entries to the front, in order (steps -> turns).

    Args:
        per_step: ``(B, S)`` values per step (-1 where not advanced).
        advanced: ``(B, S)`` bool.

    Returns:
        ``(B, S)``: row b's advanced entries first, then -1. Cost: O(B S log S).
    """
    order = torch.argsort((~advanced).to(torch.uint8), dim=1, stable=True)
    return per_step.gather(1, order)
