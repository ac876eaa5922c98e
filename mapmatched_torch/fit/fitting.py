"""Fitting lambda and beta by gradient descent on labelled conversations: ``fit_weights``.

The data are labelled conversations (:mod:`~mapmatched_torch.fit.packing`: turns
``(candidates, relevant)``, usable, gold-missing and unlabelled turns), the loss is the
negative log-likelihood of the labels (:mod:`~mapmatched_torch.fit.loss`), the
validation metric nDCG@3 of the decoded path (:mod:`~mapmatched_torch.fit.metric`).
This module is the optimisation around them: the split, the batches (sharded over
ranks), the optimizer's iterations, the history and early stopping.

**Objective.** ``mean NLL per usable training turn + l2 * ((lambda - c_l)^2 + (beta -
c_b)^2)``, with the prior centre ``(c_l, c_b)`` the initial weights
(``l2_center="init"``, default) or 0 (``l2_center="zero"``). lambda and beta are
projected onto >= 0 after every optimizer step. The graph and the normalization are
fixed: normalized scores, distances and relevance masks are computed once per batch
before the first iteration, so every iteration is pure tensor work.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..core.progress import progress_bar, progress_wanted
from ..core.checks import check_choice, check_finite, check_nonnegative_int, check_positive_int, check_weight
from ..core.errors import MapMatchedValueError
from ..core.protocols import CorpusGraph
from ..core.sharding import shard
from ..core.scoring import check_score_normalization
from ..core.settings import DecodeSettings
# moved to their own modules; still importable from here (not in __all__)
from .metric import NDCG_K, _decoded_first, decoded_ndcg, decoded_ndcg_per_turn  # noqa: F401
from .loss import batch_nll, set_log_likelihood  # noqa: F401
from .model import MapMatchedModel
from .packing import (  # noqa: F401
    LabelledBatch,
    TurnCounts,
    _Checked,
    _check_conversation,
    _check_dtype,
    _pack,
    pack_conversations,
)
from .threads import one_thread

__all__ = [
    "OPTIMIZERS",
    "L2_CENTERS",
    "FitStep",
    "FitResult",
    "fit_weights",
]

#: The accepted values of ``optimizer``.
OPTIMIZERS = ("lbfgs", "adam")
#: The accepted values of ``l2_center``.
L2_CENTERS = ("init", "zero")

_DEFAULT_LR = {"lbfgs": 1.0, "adam": 0.05}


# ---------------------------------------------------------------------------- fitting


class FitStep(NamedTuple):
    """One entry of :attr:`FitResult.history`: the state after ``iteration`` steps.

    Attributes:
        iteration: 0 for the initial weights, then one per LBFGS step or Adam epoch.
        train_loss: mean NLL per usable training turn (nats; without the L2 term).
        validation_loss: the same on the validation split, None without one (or
            when it has no usable turn).
        emission_weight, transition_weight: lambda and beta after the step.
    """

    iteration: int
    train_loss: float
    validation_loss: Optional[float]
    emission_weight: float
    transition_weight: float


@dataclass(frozen=True)
class FitResult:
    """What :func:`fit_weights` returns.

    Attributes:
        emission_weight, transition_weight: the fitted lambda and beta (those of the
            best validation loss when there is a validation split, else the last).
        history: :class:`FitStep` per iteration, starting with the initial weights.
        validation_ndcg_before, validation_ndcg_after: mean nDCG@3 of the decoded path
            over the labelled validation turns at the initial and the fitted weights
            (None without a validation split or labelled validation turn).
        n_conversations, n_turns, n_labelled_turns, n_gold_missing, n_unlabelled:
            counts over every conversation given (training and validation);
            ``n_labelled_turns`` includes the gold-missing turns, and
            ``n_turns = n_labelled_turns + n_unlabelled``.
        n_train_conversations, n_validation_conversations: the split.
        best_iteration: the iteration whose weights were returned.
        stopped: ``"converged"``, ``"early_stopping"`` or ``"max_iterations"``.
    """

    emission_weight: float
    transition_weight: float
    history: Tuple[FitStep, ...]
    validation_ndcg_before: Optional[float]
    validation_ndcg_after: Optional[float]
    n_conversations: int
    n_turns: int
    n_labelled_turns: int
    n_gold_missing: int
    n_unlabelled: int
    n_train_conversations: int
    n_validation_conversations: int
    best_iteration: int
    stopped: str
    options: dict = field(default_factory=dict, repr=False)

    @property
    def settings(self) -> DecodeSettings:
        """The fitted lambda and beta, with the normalization they were fitted under, as
        one :class:`~mapmatched_torch.core.settings.DecodeSettings` (full decoding): what
        ``MapMatchedRetriever(graph, settings=result.settings)`` decodes with."""
        return DecodeSettings(
            self.emission_weight,
            self.transition_weight,
            score_normalization=self.options.get("score_normalization", "zscore"),
        )

    @property
    def train_losses(self) -> List[float]:
        """The training loss of every history entry."""
        return [step.train_loss for step in self.history]

    @property
    def validation_losses(self) -> List[Optional[float]]:
        """The validation loss of every history entry (None without validation)."""
        return [step.validation_loss for step in self.history]

def _check_positive_number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise MapMatchedValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _check_fraction(value: Any) -> float:
    fraction = check_finite(value, "validation_fraction")
    if not 0.0 <= fraction < 1.0:
        raise MapMatchedValueError(f"validation_fraction must be in [0, 1), got {value!r}")
    return fraction


class _Split(NamedTuple):
    train: List[_Checked]
    validation: List[_Checked]


def _split(checked: List[_Checked], fraction: float, generator: torch.Generator) -> _Split:
    """A seeded random split; the validation part has ``round(fraction * n)`` conversations
    (at least 1 when ``fraction > 0``, leaving at least 1 for training)."""
    count = len(checked)
    size = min(max(round(fraction * count), 1 if fraction > 0 else 0), count - 1)
    order = torch.randperm(count, generator=generator).tolist()
    held = set(order[:size])
    return _Split(
        [c for i, c in enumerate(checked) if i not in held], [c for i, c in enumerate(checked) if i in held]
    )


def _groups(checked: Sequence[_Checked], size: int, keep: Any) -> List[List[_Checked]]:
    """The batches' conversations: those ``keep`` accepts, grouped by length (less padding)."""
    kept = sorted((c for c in checked if keep(c)), key=lambda c: (len(c.trellis), max(len(t) for t in c.trellis)))
    return [kept[start : start + size] for start in range(0, len(kept), size)]


def _ranks(distributed: Optional[bool]) -> Tuple[int, int]:
    """``(rank, world_size)`` that ``fit_weights`` shards over; ``(0, 1)`` for a one-process fit."""
    if distributed is not None and not isinstance(distributed, bool):
        raise MapMatchedValueError(f"distributed must be None (auto), True or False, got {distributed!r}")
    group = torch.distributed
    active = group.is_available() and group.is_initialized()
    if distributed and not active:
        raise MapMatchedValueError(
            "distributed=True needs an initialized torch.distributed process group: launch under torchrun and "
            "call torch.distributed.init_process_group first, or pass distributed=None (auto) or False"
        )
    if active and distributed is not False:
        return group.get_rank(), group.get_world_size()
    return 0, 1


class _Sharded:
    """Batches in a fixed global order, of which this rank packs and evaluates one contiguous shard.

    :meth:`rows` runs a function on the wanted batches this rank holds and exchanges
    the results (``all_gather_object`` of Python floats, exact), so every rank sees
    every batch's values in global batch order and sums them in that order: the sums,
    hence the optimizer's steps, are the one-process ones bit for bit.
    """

    def __init__(self, groups: List[List[_Checked]], ranks: Tuple[int, int], graph: CorpusGraph,
                 dtype: torch.dtype, device: torch.device, keep_packed: bool = True) -> None:
        block = shard(len(groups), *ranks)
        self.world_size = ranks[1]
        self.first = block.start
        self.local = groups[block]
        #: pack one batch (its tensors: scores, distances, relevance masks)
        self.pack = lambda group: _pack(group, graph, dtype, device)
        #: keep every packed batch (fast) or pack each one when used (memory: one batch at a time)
        self.packed = [self.pack(group) for group in self.local] if keep_packed else None
        #: usable turns per global batch (what ``LabelledBatch.n_usable`` counts)
        self.usable = [sum(c.counts().usable for c in group) for group in groups]

    def batch(self, position: int) -> LabelledBatch:
        """This rank's ``position``-th batch, packed (again, without ``keep_packed``)."""
        return self.pack(self.local[position]) if self.packed is None else self.packed[position]

    def __len__(self) -> int:
        return len(self.usable)

    def rows(self, function: Any, indices: Sequence[int]) -> List[List[float]]:
        """``function(batch)`` (a list of floats) for every global batch index in ``indices``, in that
        order, on every rank. A collective call: every rank passes the same ``indices``."""
        held = range(self.first, self.first + len(self.local))
        mine = {i: function(self.batch(i - self.first)) for i in indices if i in held}
        if self.world_size > 1 and indices:
            parts: List[Any] = [None] * self.world_size
            torch.distributed.all_gather_object(parts, mine)
            for part in parts:
                mine.update(part)
        return [mine[i] for i in indices]


def _has_usable(conversation: _Checked) -> bool:
    return conversation.counts().usable > 0


def _has_labelled(conversation: _Checked) -> bool:
    return conversation.counts().labelled > 0


class _Objective:
    """The training objective over fixed batches: mean NLL per usable turn (+ L2)."""

    def __init__(self, model: MapMatchedModel, l2: float, center: Tuple[float, float]) -> None:
        self.model = model
        self.l2 = l2
        self.center = center

    def penalty(self) -> Tensor:
        weights = torch.stack((self.model.emission_weight, self.model.transition_weight))
        center = torch.tensor(self.center, dtype=weights.dtype, device=weights.device)
        return self.l2 * ((weights - center) ** 2).sum()

    @torch.no_grad()
    def mean_nll(self, batches: _Sharded) -> Optional[float]:
        """Mean NLL per usable turn, or None when there is none (batch sums added in batch order)."""
        usable = sum(batches.usable)
        if not usable:
            return None
        rows = batches.rows(lambda b: [float(batch_nll(self.model, b).sum())], range(len(batches)))
        return sum(row[0] for row in rows) / usable

    def backward(self, batches: _Sharded, indices: Sequence[int]) -> float:
        """Set the weights' ``.grad`` to the gradient of the objective over the batches
        ``indices`` (one batch's graph in memory at a time); returns the objective's value.

        Each batch's loss and gradient are computed where the batch lives and added in
        the order of ``indices``, then the L2 term: the order ``loss.backward()`` per
        batch would accumulate them in, so sharded and one-process values are equal.
        """
        usable = sum(batches.usable[i] for i in indices)
        weights = (self.model.emission_weight, self.model.transition_weight)

        def value_and_grad(batch: LabelledBatch) -> List[float]:
            with torch.enable_grad():
                loss = batch_nll(self.model, batch).sum() / usable
                grads = torch.autograd.grad(loss, weights, allow_unused=True)
            return [float(loss.detach()), *(0.0 if g is None else float(g) for g in grads)]

        total, sums = 0.0, [None, None]
        for loss, *grads in batches.rows(value_and_grad, indices):
            total += loss
            for k, value in enumerate(grads):
                grad = torch.tensor(value, dtype=weights[k].dtype, device=weights[k].device)
                sums[k] = grad if sums[k] is None else sums[k] + grad
        with torch.enable_grad():
            penalty = self.penalty()
            if self.l2:
                sums = [s + g for s, g in zip(sums, torch.autograd.grad(penalty, weights))]
        for weight, grad in zip(weights, sums):
            weight.grad = grad
        return total + float(penalty.detach())


def _lbfgs_iteration(objective: _Objective, optimizer: torch.optim.Optimizer, batches: _Sharded,
                     generator: torch.Generator) -> None:
    """One LBFGS step (a direction and a strong-Wolfe line search) over the full batch."""

    def closure() -> Tensor:
        optimizer.zero_grad()
        return torch.tensor(objective.backward(batches, range(len(batches))))

    optimizer.step(closure)
    objective.model.project_()


def _adam_iteration(objective: _Objective, optimizer: torch.optim.Optimizer, batches: _Sharded,
                    generator: torch.Generator) -> None:
    """One Adam epoch: every batch once, in a seeded random order, one step each (sharded,
    each step waits for the rank holding its batch)."""
    for index in torch.randperm(len(batches), generator=generator).tolist():
        optimizer.zero_grad()
        objective.backward(batches, [index])
        optimizer.step()
        objective.model.project_()


_ITERATIONS = {"lbfgs": _lbfgs_iteration, "adam": _adam_iteration}


def _make_optimizer(name: str, model: MapMatchedModel, lr: float) -> torch.optim.Optimizer:
    if name == "lbfgs":
        return torch.optim.LBFGS(model.parameters(), lr=lr, max_iter=1, line_search_fn="strong_wolfe")
    return torch.optim.Adam(model.parameters(), lr=lr)


def _progress_bar(progress: Optional[bool], total: int, unit: str, rank: int) -> Any:
    return progress_bar(total=total, desc="fit_weights", unit=unit, show=progress_wanted(progress, rank == 0),
                        leave=False)


def _mean_ndcg(model: MapMatchedModel, batches: _Sharded) -> Optional[float]:
    sums = batches.rows(lambda b: list(decoded_ndcg(model, b)), range(len(batches)))
    count = sum(int(n) for _, n in sums)
    return sum(s for s, _ in sums) / count if count else None


def _snapshot(model: MapMatchedModel) -> Tuple[float, float]:
    return float(model.emission_weight.detach()), float(model.transition_weight.detach())


def _improved(loss: Optional[float], best: Optional[float], tolerance: float) -> bool:
    return loss is not None and (best is None or loss < best - tolerance * (1.0 + abs(best)))


def _converged(previous: FitStep, current: FitStep, tolerance: float) -> bool:
    """The loss and both weights stopped moving (relative to ``tolerance``)."""
    loss_change = abs(current.train_loss - previous.train_loss)
    weight_change = max(abs(current.emission_weight - previous.emission_weight),
                        abs(current.transition_weight - previous.transition_weight))
    return loss_change <= tolerance * (1.0 + abs(previous.train_loss)) and weight_change <= math.sqrt(tolerance)


def fit_weights(
    conversations: Sequence[Any],
    graph: CorpusGraph,
    *,
    score_normalization: str = "zscore",
    init_emission_weight: float = 1.0,
    init_transition_weight: float = 1.0,
    optimizer: str = "lbfgs",
    lr: Optional[float] = None,
    max_iterations: int = 100,
    l2: float = 0.0,
    l2_center: str = "init",
    batch_size: int = 1024,
    validation_fraction: float = 0.2,
    validation: Optional[Sequence[Any]] = None,
    patience: int = 5,
    tolerance: float = 1e-9,
    seed: int = 0,
    device: Optional[Union[str, torch.device]] = None,
    dtype: torch.dtype = torch.float64,
    progress: Optional[bool] = None,
    distributed: Optional[bool] = None,
    keep_packed: bool = True,
) -> FitResult:
    """Fit lambda (emission weight) and beta (transition weight) to labelled conversations.

    Minimizes the mean NLL per usable training turn (plus the L2 prior) of the module
    docstring over lambda, beta >= 0, with the graph and the score normalization fixed.
    Every batch's tensors (normalized scores, distances, relevance masks) are built once
    up front; iterations are tensor work only (``keep_packed=False`` streams them
    instead: memory flat in the number of conversations).

    - ``optimizer="lbfgs"`` (default): full-batch LBFGS with a strong-Wolfe line search;
      one iteration = one LBFGS step, whose closure sums the gradient over all batches
      (one batch's autograd graph in memory at a time).
    - ``optimizer="adam"``: mini-batch Adam; one iteration = one epoch over the batches
      in a seeded random order. Batches are fixed groups of ``batch_size``
      conversations of similar length (only their order is reshuffled).

    After every step lambda and beta are clamped to >= 0
    (:meth:`MapMatchedModel.project_`). History entry i holds the exact training and
    validation losses at the weights after i iterations (entry 0: the initial weights;
    each costs one gradient-free pass over the data). Fitting stops when the loss and
    the weights stop moving (``tolerance``), when the validation loss has not improved
    for ``patience`` iterations (then the best weights are restored), or after
    ``max_iterations``.

    Args:
        conversations: the training conversations (with ``validation_fraction`` also
            the source of the validation split): lists of turns ``(candidates,
            relevant)``, candidates a sequence of ScoredCandidate, relevant a collection
            of chunk IDs (empty = unlabelled).
        graph: the corpus graph (``CorpusGraph``).
        score_normalization: ``"zscore"`` (default), ``"center"`` or ``"none"``.
        init_emission_weight, init_transition_weight: starting lambda and beta (>= 0).
        optimizer: ``"lbfgs"`` or ``"adam"``.
        lr: learning rate; None for 1.0 (LBFGS) or 0.05 (Adam).
        max_iterations: LBFGS steps or Adam epochs (>= 1).
        l2: strength of the L2 prior (>= 0; 0 = none).
        l2_center: ``"init"`` (default): pull toward the initial weights;
            ``"zero"``: toward 0 (weight decay).
        batch_size: conversations per batch (memory: O(batch_size T M^2) per batch).
        validation_fraction: share of ``conversations`` held out at random (seeded) for
            validation, in [0, 1); ignored when ``validation`` is given; 0 disables
            validation (no early stopping, no nDCG).
        validation: explicit validation conversations (then all of ``conversations``
            train).
        patience: iterations without a validation-loss improvement before stopping.
        tolerance: relative convergence tolerance of the loss (the weights use its
            square root); also the minimum relative improvement that counts.
        seed: seeds the split and the batch order: the same inputs and seed give the
            same result.
        device: where the tensors and weights live (default CPU).
        dtype: floating dtype of the computation (float64 default).
        progress: show progress (None: on rank 0): a tqdm bar on a terminal, else a
            plain line every 10 s (``mapmatched_torch.core.progress``).
        distributed: shard over the ``torch.distributed`` process group (None: when
            one is initialized; True: require one; False: a one-process fit on every
            rank). Every rank passes the same arguments; the batches (groups of
            ``batch_size``) are split into contiguous blocks over the ranks (see
            :func:`~mapmatched_torch.core.sharding.shard`), each rank packs and
            evaluates its own, and the per-batch losses and gradients are exchanged
            exactly and summed in batch order, so every rank returns the one-process
            result bit for bit. Use a ``batch_size`` that gives at least W batches.
        keep_packed: keep every batch's tensors for the whole fit (default: packed
            once). False streams them: each batch is packed (scores, graph distances,
            relevance masks) when a pass uses it and dropped after, so the memory of
            the tensors stays at one batch whatever the number of conversations, for
            the cost of re-packing every pass. The result is the same bit for bit.

    Returns:
        A :class:`FitResult`.

    Raises:
        MapMatchedValueError: bad options; an empty, malformed or non-finite
            conversation or turn (naming it); no labelled turn at all, or no training
            turn whose relevant chunk is among its candidates.

    Cost: per iteration O(N T M^2) for N training conversations (LBFGS: times the
    line-search evaluations, usually 1-2), plus a gradient-free pass for the history.
    Sharded over W ranks, LBFGS and the history passes cost about 1/W of that per rank
    when there are at least W batches (Adam's steps wait for one rank each).

    Example:
        >>> from mapmatched_torch.fit.sampling import sample_conversations
        >>> data = sample_conversations(200, 3, 3, emission_weight=2.0, transition_weight=0.5,
        ...                             generator=torch.Generator().manual_seed(1))
        >>> result = fit_weights(data.conversations, data.graph, progress=False)
        >>> result.n_conversations, result.n_labelled_turns, result.stopped
        (200, 600, 'converged')
    """
    method = check_score_normalization(score_normalization)
    init = (check_weight(init_emission_weight, "init_emission_weight"),
            check_weight(init_transition_weight, "init_transition_weight"))
    optimizer = check_choice("optimizer", optimizer, OPTIMIZERS)
    lr = _DEFAULT_LR[optimizer] if lr is None else _check_positive_number(lr, "lr")
    max_iterations = check_positive_int(max_iterations, "max_iterations")
    l2 = check_weight(l2, "l2")
    center = init if check_choice("l2_center", l2_center, L2_CENTERS) == "init" else (0.0, 0.0)
    batch_size = check_positive_int(batch_size, "batch_size")
    fraction = _check_fraction(validation_fraction)
    patience = check_positive_int(patience, "patience")
    tolerance = check_weight(tolerance, "tolerance")
    seed = check_nonnegative_int(seed, "seed")
    dtype = _check_dtype(dtype)
    device = torch.device(device or "cpu")
    ranks = _ranks(distributed)

    given = [_check_conversation(c, i, method) for i, c in enumerate(_as_list(conversations, "conversations"))]
    if not given:
        raise MapMatchedValueError("fit_weights needs at least one conversation")
    generator = torch.Generator().manual_seed(seed)
    if validation is not None:
        held = [_check_conversation(c, i, method) for i, c in enumerate(_as_list(validation, "validation"))]
        split = _Split(given, held)
    else:
        split = _split(given, fraction, generator) if len(given) > 1 else _Split(given, [])
    counts = sum((c.counts() for c in split.train + split.validation), TurnCounts())
    _check_labels(counts, sum((c.counts() for c in split.train), TurnCounts()))

    with one_thread():  # sums independent of the thread count (see .threads)
        train = _Sharded(_groups(split.train, batch_size, _has_usable), ranks, graph, dtype, device, keep_packed)
        held_out = _Sharded(_groups(split.validation, batch_size, _has_labelled), ranks, graph, dtype, device,
                            keep_packed)
        model = MapMatchedModel(*init, dtype=dtype, device=device)
        objective = _Objective(model, l2, center)
        ndcg_before = _mean_ndcg(model, held_out)
        history, stopped, best = _optimize(
            objective, _make_optimizer(optimizer, model, lr), _ITERATIONS[optimizer], train, held_out,
            max_iterations, patience, tolerance, generator,
            _progress_bar(progress, max_iterations, "step" if optimizer == "lbfgs" else "epoch", ranks[0]),
        )
        with torch.no_grad():
            model.emission_weight.fill_(best.emission_weight)
            model.transition_weight.fill_(best.transition_weight)
        return FitResult(
            emission_weight=best.emission_weight,
            transition_weight=best.transition_weight,
            history=tuple(history),
            validation_ndcg_before=ndcg_before,
            validation_ndcg_after=_mean_ndcg(model, held_out),
            n_conversations=counts.conversations,
            n_turns=counts.turns,
            n_labelled_turns=counts.labelled,
            n_gold_missing=counts.gold_missing,
            n_unlabelled=counts.unlabelled,
            n_train_conversations=len(split.train),
            n_validation_conversations=len(split.validation),
            best_iteration=best.iteration,
            stopped=stopped,
            options={"optimizer": optimizer, "lr": lr, "l2": l2, "l2_center": l2_center, "batch_size": batch_size,
                     "score_normalization": method, "seed": seed, "dtype": str(dtype), "device": str(device)},
        )


def _as_list(conversations: Any, name: str) -> List[Any]:
    if isinstance(conversations, (str, bytes)) or not isinstance(conversations, Iterable):
        raise MapMatchedValueError(f"{name} must be a sequence of conversations")
    return list(conversations)


def _check_labels(everything: TurnCounts, train: TurnCounts) -> None:
    """Refuse data the loss cannot learn from (with the counts that explain why)."""
    if not everything.labelled:
        raise MapMatchedValueError(
            f"no labelled turns: all {everything.turns} turns of the {everything.conversations} conversations have "
            "an empty relevant set, so there is nothing to fit"
        )
    if not train.usable:
        raise MapMatchedValueError(
            f"no usable training turn: the training split has {train.labelled} labelled turns, but none has a "
            f"relevant chunk among its candidates ({train.gold_missing} gold-missing, {train.unlabelled} unlabelled)"
        )


def _optimize(objective: _Objective, optimizer: torch.optim.Optimizer, iteration: Any,
              train: _Sharded, held_out: _Sharded, max_iterations: int, patience: int,
              tolerance: float, generator: torch.Generator, bar: Any) -> Tuple[List[FitStep], str, FitStep]:
    """The loop: iterate, record, stop. Returns (history, stop reason, best step)."""

    def record(step: int) -> FitStep:
        lam, beta = _snapshot(objective.model)
        return FitStep(step, objective.mean_nll(train), objective.mean_nll(held_out), lam, beta)  # type: ignore[arg-type]

    history = [record(0)]
    best, stale, stopped = history[0], 0, "max_iterations"
    with bar:
        for step in range(1, max_iterations + 1):
            iteration(objective, optimizer, train, generator)
            current = record(step)
            history.append(current)
            bar.update(1)
            bar.set_postfix(loss=f"{current.train_loss:.5g}", lam=f"{current.emission_weight:.4g}",
                            beta=f"{current.transition_weight:.4g}")
            if current.validation_loss is None or _improved(current.validation_loss, best.validation_loss, tolerance):
                best, stale = current, 0
            else:
                stale += 1
            if _converged(history[-2], current, tolerance):
                stopped = "converged"
                break
            if stale >= patience:
                stopped = "early_stopping"
                break
    return history, stopped, best

