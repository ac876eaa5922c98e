"""The checks that prepare a padded trellis for the dynamic programs (SPEC section 10).

Shapes and dtypes (``emissions`` (B, T, M) float, ``mask`` (B, T, M) bool, pairwise
tensors (B, T-1, M, M) indexed ``[b, t, from, to]``, choices (B, T) long), turn
structure (real turns first, none empty), finiteness, and the cleaning of padding
(:func:`prepare`). Every message names the offending ``(b, t, m)`` and the shapes. A
check costs at most one host-device synchronization; none modifies its inputs.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ..core.errors import MapMatchedValueError
from ..core.path_reports import NONFINITE_MESSAGE

__all__ = [
    "shape_tuple",
    "require_tensor",
    "first_true_index",
    "first_problem",
    "check_emissions",
    "check_mask",
    "check_pairwise",
    "pair_mask",
    "check_structure",
    "check_pairwise_values",
    "check_choices",
    "restrict",
    "Prepared",
    "prepare",
    "raise_if_nonfinite",
]


def shape_tuple(tensor: Tensor) -> Tuple[int, ...]:
    return tuple(tensor.shape)


def require_tensor(value: object, name: str, layout: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise MapMatchedValueError(f"{name} must be a torch.Tensor {layout}, got {type(value).__name__}")
    if value.dim() != layout.count(",") + 1:
        raise MapMatchedValueError(f"{name} must have shape {layout}, got shape {shape_tuple(value)}")
    return value


def check_emissions(emissions: object, name: str = "emissions") -> Tensor:
    emissions = require_tensor(emissions, name, "(B, T, M)")
    if not emissions.is_floating_point():
        raise MapMatchedValueError(f"{name} must be a floating-point tensor, got dtype {emissions.dtype}")
    if emissions.shape[1] == 0:
        raise MapMatchedValueError(f"trellis must contain at least one turn ({name} shape {shape_tuple(emissions)})")
    return emissions


def check_mask(mask: object, emissions: Tensor, name: str = "emissions") -> Tensor:
    mask = require_tensor(mask, "mask", "(B, T, M)")
    if mask.dtype != torch.bool:
        raise MapMatchedValueError(f"mask must be a bool tensor, got dtype {mask.dtype}")
    if mask.shape != emissions.shape:
        raise MapMatchedValueError(
            f"mask shape {shape_tuple(mask)} does not match {name} shape {shape_tuple(emissions)} (both (B, T, M))"
        )
    if mask.device != emissions.device:
        raise MapMatchedValueError(f"mask is on {mask.device} but {name} are on {emissions.device}")
    return mask


def check_pairwise(pairwise: object, emissions: Tensor, name: str, emissions_name: str = "emissions") -> Tensor:
    pairwise = require_tensor(pairwise, name, "(B, T-1, M, M)")
    batch, turns, candidates = emissions.shape
    expected = (batch, turns - 1, candidates, candidates)
    if shape_tuple(pairwise) != expected:
        raise MapMatchedValueError(
            f"{name} must have shape (B, T-1, M, M) = {expected} for {emissions_name} shape "
            f"{shape_tuple(emissions)}, got {shape_tuple(pairwise)}"
        )
    if pairwise.dtype != emissions.dtype:
        raise MapMatchedValueError(
            f"{name} dtype {pairwise.dtype} does not match {emissions_name} dtype {emissions.dtype}"
        )
    if pairwise.device != emissions.device:
        raise MapMatchedValueError(f"{name} is on {pairwise.device} but {emissions_name} are on {emissions.device}")
    return pairwise


def first_true_index(bad: Tensor) -> List[int]:
    """Index of the first True entry (error path only: synchronizes)."""
    return bad.nonzero()[0].tolist()


def first_problem(
    problems: Dict[str, Tensor], *summaries: Tensor
) -> Tuple[Optional[Tuple[str, List[int]]], List[bool]]:
    """One synchronization: the first ``(kind, index)`` with a True entry (or None), and
    the values of the extra 0-dim bool ``summaries``."""
    flags = torch.stack([bad.any() for bad in problems.values()] + list(summaries)).tolist()
    for (kind, bad), flag in zip(problems.items(), flags):
        if flag:
            return (kind, first_true_index(bad)), flags[len(problems) :]
    return None, flags[len(problems) :]


def pair_mask(mask: Tensor) -> Tensor:
    """``(B, T-1, M, M)``: True where both ends of a move are real candidates."""
    return mask[:, :-1, :, None] & mask[:, 1:, None, :]


def check_structure(emissions: Tensor, mask: Tensor, *summaries: Tensor) -> Tuple[Tensor, List[bool]]:
    """Turn structure and emission finiteness, plus the values of extra 0-dim bool
    ``summaries``, in one synchronization. Returns ``(active (B, T), summary values)``."""
    # shape: (B, T)
    active = mask.any(dim=-1)
    problems = {
        "empty": ~active[:, 0],
        "gap": active[:, 1:] & ~active[:, :-1],
        "emission": mask & ~torch.isfinite(emissions),
    }
    problem, values = first_problem(problems, *summaries)
    if problem is not None:
        raise MapMatchedValueError(_describe(*problem, emissions, mask))
    return active, values


def _describe(kind: str, where: List[int], emissions: Tensor, mask: Tensor) -> str:
    if kind == "empty":
        return (
            f"conversation b={where[0]} has no candidates: mask[{where[0]}, 0] is all False "
            f"(mask shape {shape_tuple(mask)})"
        )
    if kind == "gap":
        b, t = where
        return (
            f"conversation b={b} has candidates at turn t={t + 1} after the empty turn t={t}: real turns must "
            f"come first (mask shape {shape_tuple(mask)})"
        )
    b, t, m = where
    return (
        f"emissions must be finite at real candidates: emissions[b={b}, t={t}, m={m}] = "
        f"{emissions[b, t, m].item()} (emissions shape {shape_tuple(emissions)})"
    )


def check_pairwise_values(
    pairwise: Tensor, pairs: Optional[Tensor], emissions: Tensor, name: str, nonnegative: bool
) -> None:
    """Exact entry check between real candidates (``pairs`` None: all real); one sync."""
    invalid = ~torch.isfinite(pairwise)
    if nonnegative:
        invalid = invalid | (pairwise < 0)
    bad = invalid if pairs is None else pairs & invalid
    if bad.any():
        b, t, j, i = first_true_index(bad)
        rule = "finite and nonnegative" if nonnegative else "finite"
        raise MapMatchedValueError(
            f"{name} must be {rule} between real candidates: {name}[b={b}, t={t}, from={j}, to={i}] = "
            f"{pairwise[b, t, j, i].item()} (the move from turn {t} to turn {t + 1}; {name} shape "
            f"{shape_tuple(pairwise)}, emissions shape {shape_tuple(emissions)})"
        )


def check_choices(choices: object, mask: Tensor, active: Tensor, name: str, *, optional: bool) -> Tensor:
    """``(B, T)`` candidate indices: at every real turn a real candidate (or -1 if optional).

    Entries after a conversation's end are ignored. One synchronization.
    """
    choices = require_tensor(choices, name, "(B, T)")
    if choices.dtype == torch.bool or choices.is_floating_point() or choices.is_complex():
        raise MapMatchedValueError(f"{name} must be an integer tensor, got dtype {choices.dtype}")
    if shape_tuple(choices) != shape_tuple(mask)[:2]:
        raise MapMatchedValueError(f"{name} must have shape (B, T) = {shape_tuple(mask)[:2]}, got {shape_tuple(choices)}")
    if choices.device != mask.device:
        raise MapMatchedValueError(f"{name} is on {choices.device} but emissions are on {mask.device}")
    choices = choices.long()
    candidates = mask.shape[2]
    # shape: (B, T)
    in_range = (choices >= 0) & (choices < candidates)
    real = mask.gather(2, choices.clamp(0, candidates - 1).unsqueeze(2)).squeeze(2) & in_range
    ok = real | (choices == -1) if optional else real
    bad = active & ~ok
    if bad.any():
        b, t = first_true_index(bad)
        allowed = "a real candidate index or -1" if optional else "a real candidate index"
        raise MapMatchedValueError(
            f"{name}[b={b}, t={t}] = {choices[b, t].item()} must be {allowed} at a real turn "
            f"({name} shape {shape_tuple(choices)}, mask shape {shape_tuple(mask)})"
        )
    return choices


def restrict(mask: Tensor, choices: Tensor) -> Tensor:
    """``(B, T, M)``: ``mask`` with each turn that has a choice >= 0 reduced to that candidate."""
    candidates = torch.arange(mask.shape[2], device=mask.device)
    return mask & ((choices.unsqueeze(2) < 0) | (choices.unsqueeze(2) == candidates))


class Prepared(NamedTuple):
    emissions: Tensor  # (B, T, M), 0 at masked candidates
    pairwise: Tensor  # (B, T-1, M, M), 0 where a move touches a masked candidate (see prepare)
    active: Tensor  # (B, T) bool, the turn is real


def prepare(
    emissions: object,
    pairwise: object,
    mask: object,
    *,
    name: str = "transitions",
    nonnegative: bool = False,
    max_plus: bool = False,
) -> Prepared:
    """Validate a trellis; return it cleaned where needed (inputs are never modified).

    Moves touching a masked candidate are set to 0 unless there are none (full mask)
    or, for max-plus callers, every entry is finite: finite garbage next to a -inf
    (masked) score can never win a max, while non-finite garbage could make a NaN, and
    in the log semiring even finite garbage could overflow into a NaN gradient.

    The common case costs one pass over ``pairwise`` (its sum is finite iff every
    entry is, barring overflow) and one synchronization; the exact entry check runs only
    when that sum is not finite (or for ``nonnegative``).
    """
    emissions = check_emissions(emissions)
    mask = check_mask(mask, emissions)
    pairwise = check_pairwise(pairwise, emissions, name)
    active, (nonfinite_sum, full) = check_structure(
        emissions, mask, ~torch.isfinite(pairwise.sum()), mask.all()
    )
    pairs = None if full else pair_mask(mask)
    if nonfinite_sum or nonnegative:
        check_pairwise_values(pairwise, pairs, emissions, name, nonnegative)
    if pairs is not None and (nonfinite_sum or not max_plus):
        pairwise = torch.where(pairs, pairwise, 0.0)
    return Prepared(torch.where(mask, emissions, 0.0), pairwise, active)


def raise_if_nonfinite(nonfinite: Tensor) -> None:
    """One synchronization: raise if any conversation overflowed."""
    if nonfinite.any():
        conversations = nonfinite.nonzero().flatten().tolist()
        raise MapMatchedValueError(
            f"{NONFINITE_MESSAGE} in conversation(s) b={conversations} (a forward score overflowed)"
        )
