"""Fitting the gate of the query mix (:class:`~mapmatched_torch.providers.query_mixing.QueryMixing`).

The objective is the listwise likelihood of the dense retriever scored by the mixed
query: for every training turn with a context chunk and at least one relevant passage,

    logits[p] = (q'(theta) . passages[p]) / temperature          (the whole corpus)
    loss      = logsumexp_p logits[p] - logsumexp_{p relevant} logits[p]

averaged over the turns (the softmax cross-entropy of the gold set among all passages),
plus a ridge ``l2 * (gate_bias^2 + gate_weight^2)``. ``theta = (a, g0, g1)`` with
``a = sigmoid(mix_logit)`` kept in (0, 1) and the temperature ``exp(log_temperature)``
fitted with them by default. The ranking of one query does not depend on the
temperature, but the fit does: a lower temperature weighs the top of each ranking more
(``fit_temperature=False`` holds it at the given value: on INSCIT dev with wordllama a
held 0.03 without the ridge lifted follow-up turns more than the fitted one, about 0.05;
CHANGELOG, issue 15). The scores
are the provider's inner products, so the ranking the loss rewards is the one the
search returns. The cosine standardization comes from the training turns only.
Minimized by LBFGS (strong Wolfe line search), in float64.

Why not the CRF likelihood: the mix changes which passages are candidates at all (the
mixed query is searched again), which a likelihood over fixed candidate sets cannot
see; the whole-corpus softmax scores every passage the mixed query could retrieve.
Cost per evaluation: O(N P D) for N turns, P passages (one (N, P) logit matrix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..core.checks import check_nonnegative_int, check_positive_finite, check_weight
from ..core.errors import MapMatchedTypeError, MapMatchedValueError
from ..providers.query_mixing import QueryMixing, mixed_queries

__all__ = ["QueryMixingFit", "query_mixing_loss", "cosine_statistics", "fit_query_mixing"]


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


def query_mixing_loss(
    queries: Tensor,
    contexts: Tensor,
    relevant: Tensor,
    passages: Tensor,
    parameters: Tensor,
    cosine_mean: float,
    cosine_std: float,
) -> Tensor:
    """The mean gold-set cross-entropy of the mixed queries over the whole corpus.

    Args:
        queries: ``(N, D)`` query embeddings. contexts: ``(N, D)`` embeddings of each
            turn's context chunk (the previous decoded chunk).
        relevant: ``(N, P)`` bool, the relevant passages of each turn (every row needs
            at least one).
        passages: ``(P, D)`` passage embeddings as the provider scores them (inner
            product).
        parameters: ``(4,)`` float ``[mix_logit, gate_bias, gate_weight,
            log_temperature]`` (differentiable).
        cosine_mean, cosine_std: the standardization of ``cos(q, e)``.

    Returns:
        0-dim: ``mean_n (logsumexp_p logits[n, p] - logsumexp_{p relevant} logits[n, p])``,
        ``logits = (q'_n . passages_p) / exp(log_temperature)``; >= 0.
    """
    if relevant.shape != (queries.shape[0], passages.shape[0]):
        raise MapMatchedValueError(
            f"relevant must be (N, P) = {(queries.shape[0], passages.shape[0])}, got {tuple(relevant.shape)}"
        )
    mix_logit, gate_bias, gate_weight, log_temperature = parameters.unbind()
    mixed, _, _ = mixed_queries(queries, contexts, torch.sigmoid(mix_logit), gate_bias, gate_weight, cosine_mean,
                                cosine_std)
    # shape: (N, P)
    logits = (mixed @ passages.T) / log_temperature.exp()
    gold = torch.where(relevant, logits, -math.inf).logsumexp(dim=-1)
    return (logits.logsumexp(dim=-1) - gold).mean()


def fit_query_mixing(
    queries: Tensor,
    contexts: Tensor,
    relevant: Tensor,
    passages: Tensor,
    *,
    iterations: int = 100,
    l2: float = 0.01,
    initial_mix_weight: float = 0.25,
    temperature: float = 0.05,
    fit_temperature: bool = True,
    initial: Optional[QueryMixing] = None,
) -> QueryMixingFit:
    """Fit ``(a, g0, g1)`` (and a temperature) of the query mix on training turns.

    Args:
        queries: ``(N, D)`` query embeddings of the training turns that have a context.
        contexts: ``(N, D)`` embeddings of their context chunks.
        relevant: ``(N, P)`` bool relevant passages; rows without any are dropped.
        passages: ``(P, D)`` passage embeddings (the provider's inner-product scores).
        iterations: LBFGS iterations (>= 1).
        l2: ridge on the gate's bias and weight (>= 0).
        initial_mix_weight: starting ``a`` in (0, 1). temperature: starting temperature (> 0).
        fit_temperature: fit the temperature with the gate (default); False holds it at
            ``temperature`` (a lower one weighs the top of each ranking more).
        initial: start from these gate values instead (e.g. a previous round's fit; its
            standardization is recomputed from these turns).

    Returns:
        :class:`QueryMixingFit` (standardization from ``queries`` / ``contexts``).

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
    ):
        raise MapMatchedValueError(
            f"queries and contexts must be (N, D) and passages (P, D), got {tuple(queries.shape)}, "
            f"{tuple(contexts.shape)} and {tuple(passages.shape)}"
        )
    relevant = relevant.to(device=queries.device, dtype=torch.bool)
    usable = relevant.any(dim=-1)
    if not bool(usable.any()):
        raise MapMatchedValueError("fit_query_mixing needs at least one turn with a relevant passage")
    queries, contexts = queries[usable].to(torch.float64), contexts[usable].to(device=queries.device,
                                                                              dtype=torch.float64)
    relevant, passages = relevant[usable], passages.to(device=queries.device, dtype=torch.float64)
    mean, std = cosine_statistics(queries, contexts)
    if initial is None:
        if not 0.0 < float(initial_mix_weight) < 1.0:
            raise MapMatchedValueError(f"initial_mix_weight must be in (0, 1), got {initial_mix_weight!r}")
        start = [math.log(initial_mix_weight / (1.0 - initial_mix_weight)), 0.0, 0.0]
    else:
        weight = min(max(initial.mix_weight, 1e-6), 1.0 - 1e-6)
        start = [math.log(weight / (1.0 - weight)), initial.gate_bias, initial.gate_weight]
    parameters = torch.tensor([*start, math.log(temperature)], dtype=torch.float64, device=queries.device,
                              requires_grad=True)

    def objective() -> Tensor:
        # a held temperature gets no gradient, so LBFGS never moves it
        values = parameters if fit_temperature else torch.cat([parameters[:3], parameters[3:].detach()])
        loss = query_mixing_loss(queries, contexts, relevant, passages, values, mean, std)
        return loss + l2 * parameters[1:3].square().sum()

    with torch.no_grad():
        initial_loss = float(objective())
    optimizer = torch.optim.LBFGS([parameters], lr=1.0, max_iter=iterations, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = objective()
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        loss = float(objective())
    values = parameters.detach().tolist()
    if not all(math.isfinite(v) for v in values) or not math.isfinite(loss):
        raise MapMatchedValueError(f"the query-mixing fit diverged (parameters {values}, loss {loss})")
    mixing = QueryMixing(float(torch.sigmoid(parameters.detach()[0])), values[1], values[2], mean, std)
    fitted_temperature = math.exp(values[3]) if fit_temperature else temperature
    return QueryMixingFit(mixing, fitted_temperature, loss, initial_loss, int(usable.sum()))
