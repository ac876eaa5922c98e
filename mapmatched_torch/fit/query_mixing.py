"""Fitting the gates of the query mix (:class:`~mapmatched_torch.providers.query_mixing.QueryMixing`).

The objective is the listwise likelihood of the dense retriever scored by the mixed
query: for every training turn with a context chunk and at least one relevant passage,

    logits[p] = (q'(theta) . passages[p]) / temperature          (the whole corpus)
    loss      = logsumexp_p logits[p] - logsumexp_{p relevant} logits[p]

averaged over the turns (the softmax cross-entropy of the gold set among all passages),
plus an optional ridge ``l2 * sum(gate biases^2 + gate weights^2)`` (default 0). For
each context source (the previous decoded chunk; with ``previous_queries``, also the
previous query) ``theta`` holds a mix logit, a gate bias and a gate weight; the mix
weights are ``softmax([0, logits...])[1:]`` (each in (0, 1), together below 1), and the
temperature ``exp(log_temperature)`` is fitted with them by default. The ranking of one
query does not depend on the temperature, but the fit does: a lower temperature weighs
the top of each ranking more (``fit_temperature=False`` holds it at the given value).
The scores are the provider's inner products, so the ranking the loss rewards is the
one the search returns. The cosine standardizations come from the training turns only.
Minimized by LBFGS (strong Wolfe line search), in float64.

Why the defaults (INSCIT dev, three embedders, 5 fold splits; CHANGELOG, issue 15): the
ridge of 0.01 cost follow-up lift with every embedder (dropping it: wordllama +0.028 ->
+0.036, hash +0.007 -> +0.011, MiniLM +0.005 -> +0.016), and the previous query as a
second source lifted follow-ups again (+0.038, +0.022, +0.018) and lost less on topic
switches.

Why not the CRF likelihood: the mix changes which passages are candidates at all (the
mixed query is searched again), which a likelihood over fixed candidate sets cannot
see; the whole-corpus softmax scores every passage the mixed query could retrieve.
Cost per evaluation: O(N P D) for N turns, P passages (one matrix product and one
log-sum-exp over the logits, each with its backward; the temperature scales the mixed
queries and the gold terms read only the gold columns, so nothing else passes over
them). Memory: the (N, P) logits are
made a block of turns at a time (about :data:`LOGIT_BLOCK` entries each, the gradient
accumulated block by block), so a large corpus costs time, not an (N, P) matrix and
its autograd buffers at once; with one block (INSCIT dev's size) the evaluation is the
plain one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from ..core.checks import check_nonnegative_int, check_positive_finite, check_weight
from ..core.errors import MapMatchedTypeError, MapMatchedValueError
from ..kernels.ragged import padded_rows
from ..providers.query_mixing import QueryMixing, mixed_queries
from .threads import one_thread

__all__ = ["QueryMixingFit", "query_mixing_loss", "gold_indices", "cosine_statistics", "source_weights",
           "fit_query_mixing", "LOGIT_BLOCK"]

#: Logit entries (turns x passages) per block of the fit's loss evaluation: 4M float64
#: logits, 32 MB, with their autograd buffers a few times that.
LOGIT_BLOCK = 1 << 22


@dataclass(frozen=True)
class QueryMixingFit:
    """The result of :func:`fit_query_mixing`.

    Attributes:
        mixing: the fitted :class:`~mapmatched_torch.providers.query_mixing.QueryMixing`.
        temperature: the fitted softmax temperature.
        loss: the final objective (mean cross-entropy plus ridge).
        initial_loss: the objective at the start (mix weight ``initial_mix_weight``, gate 1).
        turns: how many turns the loss averaged over.
    """

    mixing: QueryMixing
    temperature: float
    loss: float
    initial_loss: float
    turns: int


def cosine_statistics(queries: Tensor, contexts: Tensor) -> tuple:
    """``(mean, std)`` of ``cos(q, e)`` over the rows: the gate's standardization (training data only)."""
    unit = torch.nn.functional.normalize
    cosines = (unit(queries.to(torch.float64), dim=-1) * unit(contexts.to(torch.float64), dim=-1)).sum(dim=-1)
    if cosines.numel() == 0:
        raise MapMatchedValueError("the cosine standardization needs at least one (query, context) row")
    return float(cosines.mean()), max(float(cosines.std(unbiased=False)), 1e-12)


def source_weights(logits: Tensor) -> Tensor:
    """``(S,)`` mix weights of ``(S,)`` logits: ``softmax([0, logits...])[1:]`` (each in
    (0, 1), summing to less than 1; the query keeps the rest). For one source this is
    ``sigmoid(logit)``."""
    return torch.softmax(torch.cat([logits.new_zeros(1), logits]), dim=0)[1:]


def query_mixing_loss(
    queries: Tensor,
    contexts: Tensor,
    relevant: Tensor,
    passages: Tensor,
    parameters: Tensor,
    cosine_mean: Any,
    cosine_std: Any,
    present: Optional[Tensor] = None,
) -> Tensor:
    """The mean gold-set cross-entropy of the mixed queries over the whole corpus.

    Args:
        queries: ``(N, D)`` query embeddings. contexts: ``(N, D)`` embeddings of each
            turn's context chunk (the previous decoded chunk), or ``(N, S, D)`` for S
            context sources (the chunk, then the previous query).
        relevant: ``(N, P)`` bool, the relevant passages of each turn (every row needs
            at least one).
        passages: ``(P, D)`` passage embeddings as the provider scores them (inner
            product).
        parameters: ``(3 S + 1,)`` float (differentiable): for each source
            ``[mix_logit, gate_bias, gate_weight]``, then ``log_temperature``; the mix
            weights are :func:`source_weights` of the S mix logits.
        cosine_mean, cosine_std: the standardization of each source's ``cos(q, c)``
            (floats for one source, length-S sequences for S).
        present: ``(N, S)`` bool, the sources each turn has (default all).

    Returns:
        0-dim: ``mean_n (logsumexp_p logits[n, p] - logsumexp_{p relevant} logits[n, p])``,
        ``logits = (q'_n . passages_p) / exp(log_temperature)``; >= 0.
    """
    if relevant.shape != (queries.shape[0], passages.shape[0]):
        raise MapMatchedValueError(
            f"relevant must be (N, P) = {(queries.shape[0], passages.shape[0])}, got {tuple(relevant.shape)}"
        )
    sources = contexts.unsqueeze(1) if contexts.dim() == 2 else contexts
    count = sources.shape[1]
    if parameters.shape != (3 * count + 1,):
        raise MapMatchedValueError(f"parameters must be (3 S + 1,) = ({3 * count + 1},) for {count} context "
                                   f"source(s), got {tuple(parameters.shape)}")
    return _loss_of_block(queries, sources, gold_indices(relevant), passages, parameters, cosine_mean, cosine_std,
                         present)


def gold_indices(relevant: Tensor) -> Tuple[Tensor, Tensor]:
    """The relevant passages of each turn as padded indices (the loss reads only these columns).

    Args:
        relevant: ``(N, P)`` bool.

    Returns:
        ``(index, real)``: ``(N, G)`` long passage indices (G the largest gold set; 0 at
        padding) and ``(N, G)`` bool, True at real entries; each row's indices ascending.
    """
    counts = relevant.sum(dim=-1)
    width = max(1, int(counts.max())) if relevant.shape[0] else 1
    _, columns = relevant.nonzero(as_tuple=True)  # row-major: each row's columns, ascending
    index = padded_rows(columns, counts, width, fill=-1)
    return index.clamp_min(0), index >= 0


def _loss_of_block(queries: Tensor, sources: Tensor, gold: Tuple[Tensor, Tensor], passages: Tensor,
                  parameters: Tensor, cosine_mean: Any, cosine_std: Any, present: Optional[Tensor]) -> Tensor:
    """:func:`query_mixing_loss` of ``(N, S, D)`` sources and :func:`gold_indices` (no checks).

    The temperature scales the ``(N, D)`` mixed queries, not the ``(N, P)`` logits, and
    the gold log-sum-exp reads the ``(N, G)`` gold columns only: each evaluation makes
    two passes fewer over the logits, and its backward pass none for the temperature
    (a 10-iteration fit on 2800 turns x 20k passages: 49.3 s -> 27.7 s, CHANGELOG).
    """
    count = sources.shape[1]
    # shape: (S, 3) per source [mix_logit, gate_bias, gate_weight]
    gates = parameters[:-1].reshape(count, 3)
    weights = source_weights(gates[:, 0])
    statistics = [torch.as_tensor(value, dtype=queries.dtype, device=queries.device).reshape(-1)
                  for value in (cosine_mean, cosine_std)]
    mixed, _, _ = mixed_queries(queries, sources, weights, gates[:, 1], gates[:, 2], *statistics, present)
    # shape: (N, P)
    logits = (mixed * torch.exp(-parameters[-1])) @ passages.T
    index, real = gold
    gold_logits = torch.where(real, logits.gather(1, index), -math.inf).logsumexp(dim=-1)
    return (logits.logsumexp(dim=-1) - gold_logits).mean()


def fit_query_mixing(
    queries: Tensor,
    contexts: Tensor,
    relevant: Tensor,
    passages: Tensor,
    *,
    previous_queries: Optional[Tensor] = None,
    has_previous_query: Optional[Tensor] = None,
    iterations: int = 100,
    l2: float = 0.0,
    initial_mix_weight: float = 0.25,
    temperature: float = 0.05,
    fit_temperature: bool = True,
    initial: Optional[QueryMixing] = None,
) -> QueryMixingFit:
    """Fit the gates of the query mix (and a temperature) on training turns.

    Args:
        queries: ``(N, D)`` query embeddings of the training turns that have a context.
        contexts: ``(N, D)`` embeddings of their context chunks.
        relevant: ``(N, P)`` bool relevant passages; rows without any are dropped.
        passages: ``(P, D)`` passage embeddings (the provider's inner-product scores).
        previous_queries: ``(N, D)`` embeddings of each turn's previous query: fits the
            second source too (``query_mix_weight`` and its gate); None (default): the
            chunk alone (``query_mix_weight = 0``).
        has_previous_query: ``(N,)`` bool, the turns whose previous query is known
            (default all).
        iterations: LBFGS iterations (>= 1).
        l2: ridge on the gates' biases and weights (>= 0; default 0: on INSCIT dev the
            ridge of 0.01 cost follow-up lift with every embedder, CHANGELOG).
        initial_mix_weight: starting weight of each source in (0, 1 / S).
        temperature: starting temperature (> 0).
        fit_temperature: fit the temperature with the gate (default); False holds it at
            ``temperature`` (a lower one weighs the top of each ranking more).
        initial: start from these gate values instead (e.g. a previous round's fit; its
            standardization is recomputed from these turns).

    Returns:
        :class:`QueryMixingFit` (standardization from these turns).

    Raises:
        MapMatchedValueError: no usable turn, mismatched shapes, or a fit that diverged.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> passages = torch.nn.functional.normalize(torch.randn(6, 4, generator=g, dtype=torch.float64), dim=1)
        >>> relevant = torch.eye(6, dtype=torch.bool)[torch.tensor([0, 1, 2, 3])]
        >>> fit = fit_query_mixing(passages[[0, 1, 2, 3]], passages[[1, 1, 0, 2]], relevant, passages, iterations=5)
        >>> 0.0 < fit.mixing.mix_weight < 1.0 and fit.loss <= fit.initial_loss
        True
    """
    iterations = check_nonnegative_int(iterations, "iterations")
    if iterations == 0:
        raise MapMatchedValueError("iterations must be >= 1")
    l2 = check_weight(l2, "l2")
    temperature = check_positive_finite(temperature, "temperature")
    if not isinstance(fit_temperature, bool):
        raise MapMatchedTypeError(f"fit_temperature must be True or False, got {fit_temperature!r}")
    if queries.dim() != 2 or contexts.shape != queries.shape or passages.dim() != 2 or (
        passages.shape[1] != queries.shape[1]
    ) or (previous_queries is not None and previous_queries.shape != queries.shape):
        raise MapMatchedValueError(
            f"queries, contexts (and previous_queries) must be (N, D) and passages (P, D), got "
            f"{tuple(queries.shape)}, {tuple(contexts.shape)}"
            f"{'' if previous_queries is None else f', {tuple(previous_queries.shape)}'} and {tuple(passages.shape)}"
        )
    device, double = queries.device, torch.float64
    relevant = relevant.to(device=device, dtype=torch.bool)
    usable = relevant.any(dim=-1)
    if not bool(usable.any()):
        raise MapMatchedValueError("fit_query_mixing needs at least one turn with a relevant passage")
    queries, contexts = queries[usable].to(double), contexts[usable].to(device=device, dtype=double)
    relevant, passages = relevant[usable], passages.to(device=device, dtype=double)
    statistics = [cosine_statistics(queries, contexts)]
    present = None
    if previous_queries is None and has_previous_query is not None:
        raise MapMatchedValueError("has_previous_query needs previous_queries")
    if has_previous_query is not None and tuple(has_previous_query.shape) != (len(usable),):
        raise MapMatchedValueError(
            f"has_previous_query must be (N,) = ({len(usable)},), got {tuple(has_previous_query.shape)}")
    if previous_queries is not None:
        previous = previous_queries[usable].to(device=device, dtype=double)
        known = (torch.ones(len(queries), dtype=torch.bool, device=device) if has_previous_query is None else
                 has_previous_query.to(device=device, dtype=torch.bool)[usable])
        if not bool(known.any()):
            raise MapMatchedValueError("fitting the previous-query source needs a turn whose previous query is known")
        statistics.append(cosine_statistics(queries[known], previous[known]))
        present = torch.stack([torch.ones_like(known), known], dim=1)
        contexts = torch.stack([contexts, previous], dim=1)
    count = len(statistics)
    means, stds = [mean for mean, _ in statistics], [std for _, std in statistics]
    if initial is None:
        if not 0.0 < float(initial_mix_weight) < 1.0 / count:
            raise MapMatchedValueError(
                f"initial_mix_weight must be in (0, {1.0 / count:g}) for {count} source(s), got {initial_mix_weight!r}")
        # softmax([0, l, ..., l])[s] = w  <=>  l = log(w / (1 - S w))
        logit = math.log(initial_mix_weight / (1.0 - count * initial_mix_weight))
        start = [logit, 0.0, 0.0] * count
    else:
        start = _initial_gates(initial, count, initial_mix_weight)
    parameters = torch.tensor([*start, math.log(temperature)], dtype=double, device=device, requires_grad=True)
    ridge = torch.tensor([0.0, 1.0, 1.0] * count + [0.0], dtype=double, device=device)
    single = count == 1
    mean_arg, std_arg = (means[0], stds[0]) if single else (means, stds)

    rows = len(queries)
    block = max(1, LOGIT_BLOCK // max(1, passages.shape[0]))
    sources = contexts.unsqueeze(1) if contexts.dim() == 2 else contexts
    golds = [gold_indices(relevant[start:start + block]) for start in range(0, rows, block)]

    def objective(backward: bool) -> Tensor:
        """The loss, block by block of turns (each block's share of the mean is
        back-propagated at once when ``backward``: no graph over all N x P logits)."""
        # a held temperature gets no gradient, so LBFGS never moves it
        values = parameters if fit_temperature else torch.cat([parameters[:-1], parameters[-1:].detach()])
        total = torch.zeros((), dtype=double, device=device)
        for start in range(0, rows, block):
            part = slice(start, start + block)
            loss = _loss_of_block(queries[part], sources[part], golds[start // block], passages, values, mean_arg,
                                 std_arg, None if present is None else present[part])
            if rows > block:  # (one block: the plain mean, bit for bit)
                loss = loss * (min(rows, start + block) - start) / rows
            if backward:
                loss.backward()
            total = total + loss.detach()
        penalty = l2 * (ridge * parameters.square()).sum()
        if backward:
            penalty.backward()
        return total + penalty.detach()

    optimizer = torch.optim.LBFGS([parameters], lr=1.0, max_iter=iterations, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimizer.zero_grad()
        return objective(backward=True)

    with one_thread():  # the same fit bit for bit whatever the thread count (torchrun: one per process)
        with torch.no_grad():
            initial_loss = float(objective(backward=False))
        optimizer.step(closure)
        with torch.no_grad():
            loss = float(objective(backward=False))
        weights = source_weights(parameters.detach()[:-1].reshape(count, 3)[:, 0]).tolist()
    values = parameters.detach().tolist()
    if not all(math.isfinite(v) for v in values) or not math.isfinite(loss):
        raise MapMatchedValueError(f"the query-mixing fit diverged (parameters {values}, loss {loss})")
    fields: Dict[str, float] = {"mix_weight": weights[0], "gate_bias": values[1], "gate_weight": values[2],
                                "cosine_mean": means[0], "cosine_std": stds[0]}
    if not single:
        # the two weights come from one softmax: their sum can round a hair above 1
        fields.update(query_mix_weight=min(weights[1], 1.0 - weights[0]), query_gate_bias=values[4],
                      query_gate_weight=values[5], query_cosine_mean=means[1], query_cosine_std=stds[1])
    fitted_temperature = math.exp(values[-1]) if fit_temperature else temperature
    return QueryMixingFit(QueryMixing(**fields), fitted_temperature, loss, initial_loss, int(usable.sum()))


def _initial_gates(initial: QueryMixing, count: int, default_weight: float) -> list:
    """Start values ``[mix_logit, gate_bias, gate_weight] * S`` from a previous fit's
    gates; a source that fit did not have (weight 0) starts at ``default_weight`` (at
    a weight of about 0 its softmax gradient vanishes and it would never be learned)."""
    if not isinstance(initial, QueryMixing):
        raise MapMatchedTypeError(f"initial must be a QueryMixing, got {type(initial).__name__}")
    weights = [initial.mix_weight, initial.query_mix_weight][:count]
    weights = [w if w > 0 else min(default_weight, 0.5 / count) for w in weights]
    weights = [min(max(w, 1e-6), 1.0 - 1e-6) for w in weights]
    if sum(weights) > 0.95:  # room for the query's own share
        weights = [w * 0.95 / sum(weights) for w in weights]
    rest = 1.0 - sum(weights)
    gates = [(initial.gate_bias, initial.gate_weight), (initial.query_gate_bias, initial.query_gate_weight)]
    return [value for w, (bias, weight) in zip(weights, gates) for value in (math.log(w / rest), bias, weight)]
