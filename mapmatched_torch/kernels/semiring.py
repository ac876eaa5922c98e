"""The semirings the one chain dynamic program (:mod:`mapmatched_torch.kernels.chain`) runs in.

A semiring here is the algebra ``(plus, times, zero, one)`` of a path problem, where
``times`` combines scores along a path and ``plus`` combines alternative paths:

============================  ==============  =====  ====  ==============================
semiring                      plus            times  zero  the chain DP computes
============================  ==============  =====  ====  ==============================
:data:`MAX_PLUS`              max (+ argmax)  +      -inf  best path score, backpointers
:data:`LOG`                   logsumexp       +      -inf  log partition function
:data:`LEXICOGRAPHIC`         lexicographic   +      -inf  (-distance, emission) optimum
                              max on pairs
============================  ==============  =====  ====  ==============================

``times`` is ordinary addition in all three, so the DP can write it as ``+``. Every
semiring supplies :meth:`Semiring.sum` (``plus`` reduced over one dimension; the
max-plus semirings also return the index of the first maximum, which is the decoder's
tie rule: candidate order wins) and :attr:`Semiring.zero` (the score of "no path",
given to masked candidates).

Scores carry a trailing *value shape*: ``()`` for the scalar semirings and ``(2,)``
for :data:`LEXICOGRAPHIC`, whose scores are pairs ``(primary, secondary)`` compared
lexicographically. A score tensor of ``B`` conversations and ``M`` candidates is
``(B, M, *value_shape)``.

On the -inf zero and gradients: the chain DP never feeds a reduction a row made only of
zeros whose result survives, and never adds garbage to -inf (inputs are cleaned with
``torch.where`` first), so ``logsumexp`` sees at least one finite entry wherever its
result is used; a -inf entry then gets gradient ``exp(-inf) = 0`` exactly, and no NaN
appears in values or gradients (first or second order).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = [
    "Semiring",
    "MaxPlusSemiring",
    "LogSemiring",
    "LexicographicSemiring",
    "MAX_PLUS",
    "LOG",
    "LEXICOGRAPHIC",
]


class Semiring:
    """Base class: ``times`` is ``+``, ``zero`` is -inf, ``one`` is 0.

    Subclasses implement :meth:`sum`. Instances are stateless; use the module-level
    singletons.
    """

    #: The score of "no path" (masked or locked-out candidates).
    zero: float = float("-inf")
    #: The score of the empty path.
    one: float = 0.0
    #: Trailing dimensions of one score.
    value_shape: Tuple[int, ...] = ()
    #: Whether :meth:`sum` returns backpointers (argmax indices).
    has_argmax: bool = False

    def sum(self, scores: Tensor, dim: int) -> Tuple[Tensor, Optional[Tensor]]:
        """``plus``-reduce ``scores`` over ``dim`` (a dimension left of the value shape).

        Returns:
            ``(values, indices)``: ``values`` has ``dim`` removed; ``indices`` (long, the
            same shape without the value shape) is the first maximizing position for
            max-plus semirings and None otherwise.
        """
        raise NotImplementedError

    def step_sum(self, alpha: Tensor, transitions: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        """``plus`` over predecessors of ``alpha[b, j] + transitions[b, j, i]``.

        Args:
            alpha: ``(B, M_from, *V)``. transitions: ``(B, M_from, M_to, *V)``.

        Returns:
            ``(values (B, M_to, *V), indices (B, M_to) or None)``; the chain DP's inner
            step, O(B M^2).
        """
        return self.sum(alpha.unsqueeze(2) + transitions, dim=1)

    def finite(self, scores: Tensor) -> Tensor:
        """Bool mask over ``scores.shape`` minus the value shape: every component finite."""
        finite = torch.isfinite(scores)
        for _ in self.value_shape:
            finite = finite.all(dim=-1)
        return finite

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class MaxPlusSemiring(Semiring):
    """``(max, +, -inf, 0)``: Viterbi. Ties go to the first index (``torch.max``)."""

    has_argmax = True

    def sum(self, scores: Tensor, dim: int) -> Tuple[Tensor, Optional[Tensor]]:
        values, indices = torch.max(scores, dim=dim)
        return values, indices


class LogSemiring(Semiring):
    """``(logsumexp, +, -inf, 0)``: partition functions; differentiable."""

    def sum(self, scores: Tensor, dim: int) -> Tuple[Tensor, Optional[Tensor]]:
        return torch.logsumexp(scores, dim=dim), None


class LexicographicSemiring(Semiring):
    """Max-plus on pairs ``(primary, secondary)``, compared lexicographically.

    ``(p, s) + (p', s') = (p + p', s + s')``; the larger pair is the one with the larger
    primary, then the larger secondary; among equal pairs the first index wins. With
    ``primary = -distance`` and ``secondary = emission`` it finds the path of least total
    distance, then greatest total emission, then earliest candidates (geodesic mode).
    """

    value_shape = (2,)
    has_argmax = True

    def sum(self, scores: Tensor, dim: int) -> Tuple[Tensor, Optional[Tensor]]:
        primary, secondary = scores[..., 0], scores[..., 1]
        best_primary = primary.amax(dim=dim, keepdim=True)
        # Only entries tied on the primary compete on the secondary.
        contenders = torch.where(primary == best_primary, secondary, self.zero)
        best_secondary, indices = torch.max(contenders, dim=dim)
        return torch.stack((best_primary.squeeze(dim), best_secondary), dim=-1), indices


MAX_PLUS = MaxPlusSemiring()
LOG = LogSemiring()
LEXICOGRAPHIC = LexicographicSemiring()
