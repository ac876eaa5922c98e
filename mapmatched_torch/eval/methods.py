"""Evaluation methods: every one ranks each turn's retrieval candidates.

Every method turns a batch of B conversations into a ``(B, T, M)`` long *order*: a
permutation of each turn's candidate slots, best first, padding slots last. The
ranked passage list of a turn (what the metrics score) is the candidates' passage
indices in that order (:func:`gather_passages`). The first entry is the method's
answer for the turn (the decoded chunk); the rest are the turn's other candidates by
the method's own score, ties broken by candidate (provider) order everywhere (so the
first entry is always the decoder's first-maximum choice; a session's
``candidate_ranking`` breaks exact score ties by chunk ID instead, and lists only the
candidates a lock leaves reachable: here those follow, in candidate order).

The methods (all rankings are *online*: turn t's ranking uses turns 0..t only, as a
streaming session would show it at turn t):

- **pointwise** (:func:`rank_slots` of the normalized scores): the retriever's own
  ranking, i.e. map-matching with beta = 0 (``pointwise_decode``'s per-turn argmax
  first).
- **map-matched** (:func:`map_matched_orders`): for each setting (lambda, beta, lag)
  of a grid, turn t's candidates are ranked by their *max-plus forward score at turn
  t* (:func:`online_forward_scores`): the score of the best path over turns 0..t that
  ends at the candidate. Why this is the session's online answer: the forward score
  ``alpha[t, i] = max_j (alpha[t-1, j] + trans[t-1, j, i]) + e[t, i]`` depends only on
  turns 0..t, so computing it on the whole conversation gives, for every t at once,
  exactly the numbers a session computes after its turn t; the session's decoded chunk
  at turn t is the first maximum of them (the end of the prefix's best path), and its
  ``candidate_ranking`` lists them sorted. With a fixed lag L the session's prefix
  decode at turn t holds the locks of turns <= t - L (turn t - L is committed at turn
  t, earlier ones before), so turn t is ranked by the forward scores of turn t - L
  under those locks (``fixed_lag_viterbi``'s locks with ``forward_scores``: the
  locked forward score of turn t - L depends only on locks <= t - L) carried L
  unlocked steps forward. beta = 0 settings are pointwise (``pointwise_decode``).
  The distances are computed once per batch and reused for every setting;
  the settings sharing a lag are decoded as one stacked batch.
- **history concatenation** (:func:`history_concatenation_scores`): on text data,
  retrieval with the query concatenated to all previous queries (its own candidates,
  ranked by the retriever). Without text (the synthetic benchmark) it is defined on
  the candidate scores: a candidate's score is the mean, over the current and all
  previous turns, of that turn's normalized score of the same passage (a turn that
  did not retrieve the passage contributes its lowest candidate score).
- **Maximal Marginal Relevance** (:func:`maximal_marginal_relevance_order`): greedy
  re-ranking of the turn's candidates by ``lambda * relevance - (1 - lambda) *
  max similarity to the passages already ranked`` (Carbonell and Goldstein's lambda:
  1 = pure relevance). Relevance is the raw score min-max scaled to [0, 1] per turn;
  similarity is the cosine of the passage embeddings when there are any, else
  ``1 - d_G / maximum_distance`` in the corpus graph.
- **resolved-query oracle**: retrieval with each turn's rewrite instead of its query
  (turns without a rewrite keep the query); only where rewrites exist.
- **geodesic bound** (:func:`geodesic_online_order`): the beta -> infinity limit
  (``geodesic_viterbi``): turn t's candidates are ranked by the least total graph
  distance of a path over turns 0..t ending at them, then by its largest total
  emission.
- **fitted**: map-matching (full decoding) with lambda and beta fitted by gradient
  descent (:func:`mapmatched_torch.fit.fit_weights`), cross-fitted: the conversations
  are split into folds and each fold is ranked with the weights fitted on the others,
  so no conversation is scored by weights fitted on its own labels.
- **gated** (not run by default; ``--methods ...,gated``): online map-matching (full
  decoding) whose beta is gated per move by
  :class:`~mapmatched_torch.kernels.transitions.GatedTransitions` on one feature
  (:func:`gate_features`: the cosine of the new query to each previous-turn
  candidate's passage, or without embeddings its score-level analogue), lambda, beta,
  the gate and optionally the distance saturation fitted by the CRF negative
  log-likelihood of the relevant candidates (LBFGS), cross-fitted over the fitted
  method's folds (:func:`cross_fitting_folds`; feature standardization from the
  training folds only).
- **mixed** and **mixed+gated** (not run by default; :func:`_prepare_mixed`): gated
  query mixing (:class:`~mapmatched_torch.providers.query_mixing.QueryMixing`: the
  passage decoded at the previous turn mixed into the query by a fitted gate), every
  turn retrieved again from the corpus embeddings with its mixed query
  (:func:`~mapmatched_torch.eval.candidates.retrieve_online`), ranked pointwise
  (``mixed``) or decoded online with a gated transition model fitted on the mixed
  candidates (``mixed+gated``; the decoded chunk is the next query's context, as in a
  session); cross-fitted over the same folds (the mixing gate by
  :func:`~mapmatched_torch.fit.query_mixing.fit_query_mixing` on the training folds).

:data:`METHODS` is the registry the runner reads: :func:`register_method` adds a
method (a :class:`MethodSpec`: a ``run`` on batches, an optional one-off ``prepare``
such as the fitted method's cross-fitting) without touching the runner.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..core.checks import check_choice, check_positive_finite
from ..core.errors import MapMatchedValueError
from ..core.settings import DecodeSettings
from ..kernels import chain, fused
from ..kernels.decode import fixed_lag_viterbi, forward_scores
from ..kernels.semiring import LEXICOGRAPHIC
from ..kernels.transitions import decode_weighted, weighted_transitions
from .candidates import Candidates, normalize_candidate_scores

__all__ = [
    "Setting",
    "settings_grid",
    "MethodOptions",
    "MethodBatch",
    "MethodOutput",
    "MethodSpec",
    "MethodUnavailable",
    "FittedState",
    "GatedState",
    "cross_fitting_folds",
    "relevant_candidates",
    "gate_features",
    "relevant_passages",
    "MixedState",
    "labelled_conversations",
    "METHODS",
    "DEFAULT_METHODS",
    "register_method",
    "rank_slots",
    "gather_passages",
    "weighted_trellis",
    "online_forward_scores",
    "map_matched_orders",
    "decode_setting",
    "history_concatenation_scores",
    "maximal_marginal_relevance_order",
    "similarity_from_embeddings",
    "similarity_from_distances",
    "geodesic_online_order",
]

_INF = float("inf")


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class Setting(DecodeSettings):
    """One map-matching setting of an evaluation: a
    :class:`~mapmatched_torch.core.settings.DecodeSettings` (validated on construction,
    frozen, hashable) with the evaluation's label and record.

    Attributes:
        emission_weight: lambda (finite, >= 0).
        transition_weight: beta (finite, >= 0); 0 is pointwise.
        fixed_lag: None (full decoding) or L >= 0.
        score_normalization: not read by the evaluation, which normalizes every method's
            candidates alike (``EvalConfig.score_normalization``).
    """

    @property
    def label(self) -> str:
        """``"lambda=1 beta=0.5 full"`` / ``"... lag=2"``."""
        lag = "full" if self.fixed_lag is None else f"lag={self.fixed_lag}"
        return f"lambda={self.emission_weight:g} beta={self.transition_weight:g} {lag}"

    def to_dict(self) -> Dict[str, Any]:
        """``{"lambda", "beta", "lag"}`` (lag None = full decoding)."""
        return {"lambda": self.emission_weight, "beta": self.transition_weight, "lag": self.fixed_lag}


def settings_grid(
    lambdas: Iterable[float], betas: Iterable[float], lags: Iterable[Optional[int]] = (None,)
) -> Tuple[Setting, ...]:
    """Every (lambda, beta, lag) combination, validated, duplicates dropped, in product order.

    Raises:
        MapMatchedValueError: an empty axis or a value the decoders reject (the
            decoders' messages: weights finite and >= 0, lag >= 0).
    """
    axes = [tuple(lambdas), tuple(betas), tuple(lags)]
    for name, axis in zip(("lambdas", "betas", "lags"), axes):
        if not axis:
            raise MapMatchedValueError(f"the grid needs at least one value in {name}")
    settings = [Setting(*values) for values in itertools.product(*axes)]
    return tuple(dict.fromkeys(settings))


# --------------------------------------------------------------------------- ranking helpers


def rank_slots(values: Tensor, mask: Tensor) -> Tensor:
    """Order each turn's candidate slots by decreasing value; ties and -inf by slot; padding last.

    Args:
        values: (..., M) float scores (-inf allowed at real candidates, e.g. locked out).
        mask: (..., M) bool real candidates.

    Returns:
        (..., M) long slot indices (a permutation per turn). Cost: two stable sorts.

    Example:
        >>> rank_slots(torch.tensor([[1.0, 3.0, 1.0, 0.0]]), torch.tensor([[True, True, True, False]])).tolist()
        [[1, 0, 2, 3]]
    """
    keyed = torch.where(mask, values.to(torch.float64), -_INF)
    order = torch.sort(keyed, dim=-1, descending=True, stable=True).indices
    # padding after every real candidate (a real -inf ties with padding above)
    padding = (~mask.gather(-1, order)).to(torch.uint8)
    return order.gather(-1, torch.sort(padding, dim=-1, stable=True).indices)


def gather_passages(index: Tensor, order: Tensor) -> Tensor:
    """(B, T, M) ranked passage indices: ``index`` (-1 padding) permuted by ``order``."""
    return index.gather(-1, order)


def weighted_trellis(
    normalized: Tensor, distances: Tensor, setting: Setting
) -> Tuple[Tensor, Tensor]:
    """Emissions ``lambda * s`` (B, T, M) and transitions ``-(beta * d)`` (B, T-1, M, M) [b, t, from, to]."""
    return setting.emission_weight * normalized, weighted_transitions(distances, setting.transition_weight)


# --------------------------------------------------------------------------- map-matched


def online_forward_scores(emissions: Tensor, transitions: Tensor, mask: Tensor, lag: Optional[int] = None) -> Tensor:
    """The forward scores a streaming session ranks turn t's candidates by, for every t at once.

    Args:
        emissions: (B, T, M) float weighted emissions.
        transitions: (B, T-1, M, M) weighted transitions ``[b, t, from, to]``.
        mask: (B, T, M) bool.
        lag: None (full decoding: :func:`~mapmatched_torch.kernels.decode.forward_scores`) or
            L >= 0 (fixed lag: the forward scores of turn t - L under the locks of
            ``fixed_lag_viterbi``, then L unlocked max-plus steps; turns t < L are
            unlocked).

    Returns:
        (B, T, M) forward scores; -inf at padding and at candidates a lock excludes.
        Bit for bit what the session computes (same recursion, same order of
        operations: predecessor plus transition, max, plus emission).

    Cost: O(B T M^2) without a lag; O(B T (L + 1) M^2) with one with the fused kernel
    (:func:`mapmatched_torch.kernels.fused.online_forward_scores`, the default on the
    CPU with numba: one pass per conversation), O(B T (2 L + 2) M^2) on the torch path.
    """
    fused_scores = fused.online_forward_scores(emissions, transitions, mask, lag)
    if fused_scores is not None:
        return fused_scores
    if lag is None:
        return forward_scores(emissions, transitions, mask)
    locks = fixed_lag_viterbi(emissions, transitions, mask, lag).locks
    # shape: (B, T, M): at turn s, the forward scores under the locks of turns <= s
    scores = forward_scores(emissions, transitions, mask, locks)
    if lag == 0 or emissions.shape[1] == 1:
        return scores
    # shape: (B, 1, M): turn 0 without a lock (the session before its first commit)
    first = torch.where(mask[:, :1], emissions[:, :1], -_INF)
    # shape: (B, T-1, M_from, 1): padding never meets its (possibly NaN) transitions
    real_from = mask[:, :-1, :, None]
    for _ in range(lag):
        # shape: (B, T-1, M_to): one unlocked step from every turn to the next (first maximum)
        moves = torch.where(real_from, scores[:, :-1, :, None] + transitions, -_INF)
        stepped = moves.max(dim=2).values + emissions[:, 1:]
        scores = torch.cat([first, torch.where(mask[:, 1:], stepped, -_INF)], dim=1)
    return scores


def map_matched_orders(
    normalized: Tensor, distances: Optional[Tensor], mask: Tensor, settings: Sequence[Setting]
) -> Tensor:
    """Online rankings of every setting (see the module docstring), distances reused.

    Args:
        normalized: (B, T, M) float64 normalized scores.
        distances: (B, T-1, M, M) float64 raw graph distances ``[b, t, from, to]``,
            computed once for all settings (None only if every beta is 0).
        mask: (B, T, M) bool.
        settings: S settings.

    Returns:
        (S, B, T, M) long slot orders, in ``settings`` order.

    Cost: the settings sharing a lag are decoded as one stacked batch of S_g * B
    conversations: O(S B T M^2) time (times 2 L + 2 with a lag), O(S_g B T M^2)
    memory for the stacked transitions.
    """
    batch, turns, width = mask.shape
    out = torch.empty((len(settings), batch, turns, width), dtype=torch.long, device=mask.device)
    groups: Dict[Optional[int], List[int]] = {}
    for position, setting in enumerate(settings):
        if not setting.mode.uses_distances:
            out[position] = pointwise_order(normalized, mask, setting)
        else:
            groups.setdefault(setting.fixed_lag, []).append(position)
    if groups and distances is None:
        raise MapMatchedValueError("map-matched settings with beta > 0 need the (B, T-1, M, M) distances")
    for lag, members in groups.items():
        count = len(members)
        # shape: (S_g, 1, 1, 1)
        lambdas = torch.tensor([settings[p].emission_weight for p in members], dtype=normalized.dtype,
                               device=normalized.device).view(count, 1, 1, 1)
        betas = lambdas.new_tensor([settings[p].transition_weight for p in members]).view(count, 1, 1, 1, 1)
        # shape: (S_g * B, T, M) and (S_g * B, T-1, M, M): the same arithmetic as weighted_trellis
        emissions = (lambdas * normalized.unsqueeze(0)).reshape(count * batch, turns, width)
        transitions = weighted_transitions(distances.unsqueeze(0), betas).reshape(
            count * batch, max(turns - 1, 0), width, width
        )
        stacked = mask.unsqueeze(0).expand(count, -1, -1, -1).reshape(count * batch, turns, width)
        scores = online_forward_scores(emissions, transitions, stacked, lag)
        out[members] = rank_slots(scores, stacked).view(count, batch, turns, width)
    return out


def pointwise_order(normalized: Tensor, mask: Tensor, setting: Optional[Setting] = None) -> Tensor:
    """The beta = 0 ranking: ``lambda * s`` decreasing, ties by slot (``pointwise_decode``'s argmax first).

    Without a setting lambda is 1 (the retriever's own order: normalization is monotone).
    """
    weight = 1.0 if setting is None else setting.emission_weight
    return rank_slots(weight * normalized, mask)


def decode_setting(normalized: Tensor, distances: Optional[Tensor], mask: Tensor, setting: Setting) -> Tensor:
    """The whole-conversation decoded path of one setting (what the session's trace ends with).

    Args:
        normalized: (B, T, M) float64 normalized scores. mask: (B, T, M) bool.
        distances: (B, T-1, M, M) raw graph distances ``[b, t, from, to]``; None only
            when the setting's beta is 0 (pointwise; MapMatchedValueError otherwise).
        setting: lambda, beta and lag, dispatched by
            :func:`~mapmatched_torch.kernels.transitions.decode_weighted`.

    Returns:
        (B, T) long candidate slots, -1 after each conversation's end.
    """
    emissions = setting.emission_weight * normalized
    return decode_weighted(emissions, distances, mask, setting.transition_weight, setting.fixed_lag).paths


# --------------------------------------------------------------------------- baselines


def history_concatenation_scores(normalized: Tensor, index: Tensor, mask: Tensor) -> Tensor:
    """Score-level history concatenation: each candidate's mean normalized score over turns 0..t.

    For turn t and candidate passage p: the mean over u = 0..t of turn u's normalized
    score of p, where a turn u that did not retrieve p contributes its lowest real
    candidate score (everything outside the top M scored at most that).

    Args:
        normalized: (B, T, M) float normalized scores. index: (B, T, M) long passage
            indices (-1 padding). mask: (B, T, M) bool.

    Returns:
        (B, T, M) float64 (0.0 at padding). Cost: O(B T^2 M^2) time and memory.
    """
    values = normalized.to(torch.float64)
    batch, turns, width = mask.shape
    # shape: (B, T): each turn's floor, +inf on padded turns (never averaged)
    floor = torch.where(mask, values, _INF).amin(dim=-1)
    # shape: (B, T_now, M_now, T_then, M_then)
    same = (index[:, :, :, None, None] == index[:, None, None, :, :]) & mask[:, None, None, :, :]
    then = torch.where(same, values[:, None, None, :, :], -_INF).amax(dim=-1)
    # shape: (B, T_now, M_now, T_then)
    then = torch.where(torch.isfinite(then), then, floor[:, None, None, :])
    steps = torch.arange(turns, device=mask.device)
    # shape: (B, T_now, 1, T_then): real earlier-or-same turns
    counted = (steps[None, :, None] >= steps[None, None, :]) & mask.any(dim=-1)[:, None, :]
    counted = counted.unsqueeze(2)
    total = torch.where(counted, then, 0.0).sum(dim=-1)
    mean = total / counted.sum(dim=-1).clamp(min=1).to(torch.float64)
    return torch.where(mask, mean, 0.0)


def similarity_from_embeddings(index: Tensor, embeddings: Tensor) -> Tensor:
    """(B, T, M, M) cosine similarity between each turn's candidates (unit or zero rows; padding 0)."""
    # shape: (B, T, M, D)
    vectors = embeddings[index.clamp(min=0)].to(torch.float64)
    vectors = torch.where((index >= 0).unsqueeze(-1), vectors, 0.0)
    return vectors @ vectors.transpose(-1, -2)


def similarity_from_distances(distances: Tensor, maximum_distance: float) -> Tensor:
    """(B, T, M, M) ``1 - d / maximum_distance`` from within-turn graph distances (in [0, 1])."""
    return 1.0 - distances.to(torch.float64) / float(maximum_distance)


def maximal_marginal_relevance_order(
    scores: Tensor, similarity: Tensor, mask: Tensor, relevance_weight: float = 0.7
) -> Tensor:
    """Greedy Maximal Marginal Relevance re-ranking of each turn's candidates.

    At each step the next passage maximizes ``lambda * relevance - (1 - lambda) *
    max similarity to the passages ranked so far`` (the first step: relevance alone);
    ties go to the earlier slot. Relevance is the raw score min-max scaled to [0, 1]
    over the turn's real candidates (all 1 when they are equal).

    Args:
        scores: (B, T, M) float raw scores.
        similarity: (B, T, M, M) float pairwise similarity of each turn's candidates.
        mask: (B, T, M) bool.
        relevance_weight: Carbonell and Goldstein's lambda in [0, 1] (default 0.7;
            1 gives the pointwise ranking).

    Returns:
        (B, T, M) long slot order. Cost: O(B T M^2).
    """
    if isinstance(relevance_weight, bool) or not 0.0 <= float(relevance_weight) <= 1.0:
        raise MapMatchedValueError(
            f"the Maximal Marginal Relevance lambda must be in [0, 1], got {relevance_weight!r}"
        )
    weight = float(relevance_weight)
    values = scores.to(torch.float64)
    low = torch.where(mask, values, _INF).amin(dim=-1, keepdim=True)
    high = torch.where(mask, values, -_INF).amax(dim=-1, keepdim=True)
    spread = high - low
    relevance = torch.where(spread > 0, (values - low) / torch.where(spread > 0, spread, 1.0), 1.0)
    relevance = torch.where(mask, relevance, 0.0)
    similarity = similarity.to(torch.float64)
    width = mask.shape[-1]
    taken = torch.zeros_like(mask)
    penalty = torch.zeros_like(relevance)
    picks: List[Tensor] = []
    for step in range(width):
        score = weight * relevance - (1.0 - weight) * penalty if step else relevance
        available = mask & ~taken
        # shape: (...,): the best available slot, else the first slot not yet taken (padding)
        best = torch.where(available, score, -_INF).argmax(dim=-1)
        fallback = (~taken).to(torch.uint8).argmax(dim=-1)
        pick = torch.where(available.any(dim=-1), best, fallback)
        picks.append(pick)
        taken = taken.scatter(-1, pick.unsqueeze(-1), True)
        # shape: (..., M): similarity of every slot to the new pick
        row = similarity.gather(-2, pick[..., None, None].expand(*pick.shape, 1, width)).squeeze(-2)
        penalty = row if step == 0 else torch.maximum(penalty, row)
    return torch.stack(picks, dim=-1)


def geodesic_online_order(emissions: Tensor, distances: Tensor, mask: Tensor) -> Tensor:
    """Online geodesic-bound ranking: least total distance to each candidate, then most emission.

    Turn t's candidates are ordered by the lexicographic max-plus forward score
    ``(-total distance, total emission)`` of the best path over turns 0..t ending at
    them (the semiring of :func:`~mapmatched_torch.kernels.decode.geodesic_viterbi`, whose
    prefix decode at turn t picks the first of this order), ties by slot.

    Args:
        emissions: (B, T, M) float weighted emissions. distances: (B, T-1, M, M)
            nonnegative raw distances ``[b, t, from, to]``. mask: (B, T, M) bool.

    Returns:
        (B, T, M) long slot order. Cost: O(B T M^2), twice the memory of Viterbi.
    """
    if bool((~torch.isfinite(distances) | (distances < 0)).any()):
        raise MapMatchedValueError("geodesic ranking needs finite nonnegative distances")
    clean = torch.where(mask, emissions, 0.0)
    # shape: (B, T, M, 2) and (B, T-1, M, M, 2)
    pair_emissions = torch.stack((torch.zeros_like(clean), clean), dim=-1)
    pair_transitions = torch.stack((-distances, torch.zeros_like(distances)), dim=-1)
    alphas = chain.forward(LEXICOGRAPHIC, pair_emissions, pair_transitions, mask).alphas
    secondary = rank_slots(alphas[..., 1], mask)
    primary = torch.where(mask, alphas[..., 0], -_INF).gather(-1, secondary)
    # a stable sort on the primary keeps the secondary order among equal distances
    order = torch.sort(primary, dim=-1, descending=True, stable=True).indices
    merged = secondary.gather(-1, order)
    padding = (~mask.gather(-1, merged)).to(torch.uint8)
    return merged.gather(-1, torch.sort(padding, dim=-1, stable=True).indices)


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class MethodOptions:
    """What the methods are run with.

    Attributes:
        settings: the map-matching grid.
        relevance_weight: the Maximal Marginal Relevance lambda.
        score_normalization: the normalization the fitted method fits with.
        seed: seeds the fitted method's folds and fits.
        fit_folds: cross-fitting folds of the fitted method (>= 2).
        extra: free-form options of registered methods (e.g. a fitting budget).
        memo: work the methods' prepare steps share, by name (e.g. the mixing fits of
            ``mixed`` and ``mixed+gated``: :func:`_mixing_folds`). :func:`evaluate`
            builds one MethodOptions per evaluation, so nothing in it outlives the run.
    """

    settings: Tuple[Setting, ...]
    relevance_weight: float = 0.7
    score_normalization: str = "zscore"
    seed: int = 0
    fit_folds: int = 2
    extra: Mapping[str, Any] = field(default_factory=dict)
    memo: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


class MethodBatch(NamedTuple):
    """What a method sees for one chunk of conversations.

    Attributes:
        rows: (B,) long, the conversations' indices in the whole evaluation.
        candidates: the query candidates (B, T, M).
        normalized: (B, T, M) float64 normalized scores.
        distances: (B, T-1, M, M) float64 graph distances, computed once per chunk.
        similarity: (B, T, M, M) within-turn passage similarity, or None when no
            method asked for it.
        alternatives: other candidate sets of the same conversations by name
            (``"history"``: history-concatenation retrieval, ``"rewrite"``: the
            resolved queries).
        state: per-method state from :attr:`MethodSpec.prepare`, by method name.
    """

    rows: Tensor
    candidates: Candidates
    normalized: Tensor
    distances: Optional[Tensor]
    similarity: Optional[Tensor]
    alternatives: Mapping[str, Candidates]
    state: Mapping[str, Any]


class MethodOutput(NamedTuple):
    """One ranking of a batch.

    Attributes:
        key: unique name in reports (e.g. ``"map-matched lambda=1 beta=0.5 full"``).
        method: the method's registry name.
        params: its parameters (JSON-friendly).
        passages: (B, T, K) long ranked passage indices, -1 padding.
    """

    key: str
    method: str
    params: Dict[str, Any]
    passages: Tensor


class MethodUnavailable(Exception):
    """Raised by :attr:`MethodSpec.prepare` when a method cannot run on these inputs (the message says why)."""


@dataclass(frozen=True)
class MethodSpec:
    """A registered method.

    Attributes:
        name: registry name (``"pointwise"``, ``"map-matched"``, ...).
        title: human-readable name for reports.
        run: ``run(batch, options) -> list of MethodOutput``.
        prepare: optional ``prepare(inputs, options) -> state`` run once before the
            batches (e.g. fitting); it raises :class:`MethodUnavailable` to skip the
            method. ``inputs`` is the runner's :class:`~mapmatched_torch.eval.runner.EvalInputs`.
        needs_distances: the runner fills :attr:`MethodBatch.distances`.
        needs_similarity: the runner computes :attr:`MethodBatch.similarity`.
    """

    name: str
    title: str
    run: Callable[[MethodBatch, MethodOptions], List[MethodOutput]]
    prepare: Optional[Callable[[Any, MethodOptions], Any]] = None
    needs_distances: bool = False
    needs_similarity: bool = False


#: The registry of methods, by name (the runner runs them in this order).
METHODS: Dict[str, MethodSpec] = {}


def register_method(spec: MethodSpec, *, replace: bool = False) -> MethodSpec:
    """Add a method to :data:`METHODS` (``replace=True`` to override one)."""
    if not isinstance(spec, MethodSpec):
        raise MapMatchedValueError(f"register_method needs a MethodSpec, got {type(spec).__name__}")
    if spec.name in METHODS and not replace:
        raise MapMatchedValueError(f"method {spec.name!r} is already registered (pass replace=True)")
    METHODS[spec.name] = spec
    return spec


def _ranked(batch: MethodBatch, order: Tensor) -> Tensor:
    return gather_passages(batch.candidates.index, order)


def _run_pointwise(batch: MethodBatch, options: MethodOptions) -> List[MethodOutput]:
    order = pointwise_order(batch.normalized, batch.candidates.mask)
    return [MethodOutput("pointwise", "pointwise", {}, _ranked(batch, order))]


def _run_map_matched(batch: MethodBatch, options: MethodOptions) -> List[MethodOutput]:
    orders = map_matched_orders(batch.normalized, batch.distances, batch.candidates.mask, options.settings)
    return [
        MethodOutput(f"map-matched {setting.label}", "map-matched", setting.to_dict(), _ranked(batch, order))
        for setting, order in zip(options.settings, orders)
    ]


def _run_history(batch: MethodBatch, options: MethodOptions) -> List[MethodOutput]:
    retrieved = batch.alternatives.get("history")
    if retrieved is not None:
        return [MethodOutput("history concatenation", "history-concatenation", {"level": "query text"}, retrieved.index)]
    cands = batch.candidates
    order = rank_slots(history_concatenation_scores(batch.normalized, cands.index, cands.mask), cands.mask)
    return [MethodOutput("history concatenation", "history-concatenation", {"level": "candidate scores"},
                         _ranked(batch, order))]


def _run_maximal_marginal_relevance(batch: MethodBatch, options: MethodOptions) -> List[MethodOutput]:
    if batch.similarity is None:
        raise MapMatchedValueError("Maximal Marginal Relevance needs the within-turn similarity")
    cands = batch.candidates
    order = maximal_marginal_relevance_order(cands.scores, batch.similarity, cands.mask, options.relevance_weight)
    key = f"Maximal Marginal Relevance lambda={options.relevance_weight:g}"
    return [MethodOutput(key, "maximal-marginal-relevance", {"lambda": options.relevance_weight},
                         _ranked(batch, order))]


def _prepare_oracle(inputs: Any, options: MethodOptions) -> None:
    if "rewrite" not in getattr(inputs, "alternatives", {}):
        raise MethodUnavailable("the dataset has no rewrites (or no embedder to retrieve with them)")


def _run_oracle(batch: MethodBatch, options: MethodOptions) -> List[MethodOutput]:
    return [MethodOutput("resolved-query oracle", "resolved-query-oracle", {}, batch.alternatives["rewrite"].index)]


def _run_geodesic(batch: MethodBatch, options: MethodOptions) -> List[MethodOutput]:
    if batch.distances is None:
        raise MapMatchedValueError("the geodesic bound needs the graph distances")
    order = geodesic_online_order(batch.normalized, batch.distances, batch.candidates.mask)
    return [MethodOutput("geodesic bound", "geodesic", {}, _ranked(batch, order))]


class FittedState(NamedTuple):
    """What the fitted method's prepare step leaves for its runs.

    Attributes:
        fold: (B,) long, the cross-fitting fold of each conversation.
        settings: one fitted :class:`Setting` per fold (fitted on the other folds).
        results: the :class:`~mapmatched_torch.fit.FitResult` of each fold.
    """

    fold: Tensor
    settings: Tuple[Setting, ...]
    results: Tuple[Any, ...]


def labelled_conversations(inputs: Any) -> List[List[Tuple[List[Any], frozenset]]]:
    """The inputs as ``fit_weights`` conversations: per turn (ScoredCandidate list, relevant IDs)."""
    from ..core.models import ScoredCandidate

    ids = inputs.passage_ids
    cands = inputs.candidates
    relevant = iter([
        frozenset(ids[i] for i, g in zip(row_ids, row_grades) if g > 0 and i >= 0)
        for row_ids, row_grades in zip(inputs.qrels.ids.tolist(), inputs.qrels.grades.tolist())
    ])
    conversations = []
    for index_rows, score_rows, mask_rows in zip(cands.index.tolist(), cands.scores.tolist(), cands.mask.tolist()):
        turns = []
        for index_row, score_row, mask_row in zip(index_rows, score_rows, mask_rows):
            if not any(mask_row):
                break
            scored = [ScoredCandidate(ids[i], s) for i, s, keep in zip(index_row, score_row, mask_row) if keep]
            turns.append((scored, next(relevant)))
        conversations.append(turns)
    return conversations


def cross_fitting_folds(conversations: int, folds: int, seed: int) -> Tensor:
    """(B,) long: the balanced cross-fitting fold of every conversation (seeded, on the CPU).

    The fitted and the gated methods share it, so both hold out the same conversations.
    """
    generator = torch.Generator().manual_seed(seed)
    fold = torch.empty(conversations, dtype=torch.long)
    fold[torch.randperm(conversations, generator=generator)] = torch.arange(conversations) % folds
    return fold


def _prepare_fitted(inputs: Any, options: MethodOptions) -> FittedState:
    """Cross-fitted weights: ``mapmatched_torch.fit.fit_weights`` on all folds but one, per fold.

    Each conversation is ranked with weights fitted without it (``options.fit_folds``
    balanced folds drawn with ``options.seed``), full decoding (no lag). A fit that
    cannot run (e.g. no training turn whose relevant passage is among its candidates)
    skips the method with fit_weights' message.
    """
    try:
        from ..fit.fitting import fit_weights
    except ImportError:
        raise MethodUnavailable("mapmatched_torch.fit.fit_weights is not available") from None
    folds = options.fit_folds
    batch = inputs.candidates.shape[0]
    if batch < folds:
        raise MethodUnavailable(f"cross-fitting with {folds} folds needs at least {folds} conversations, got {batch}")
    fold = cross_fitting_folds(batch, folds, options.seed)
    conversations = labelled_conversations(inputs)
    settings, results = [], []
    for held_out in range(folds):
        train = [c for c, f in zip(conversations, fold.tolist()) if f != held_out]
        try:
            # no validation split: two weights cannot overfit much, and the folds already hold out
            result = fit_weights(train, inputs.graph, score_normalization=options.score_normalization,
                                 validation_fraction=0.0, seed=options.seed, progress=False)
        except ValueError as error:
            raise MethodUnavailable(f"fit_weights failed on fold {held_out}: {error}") from None
        results.append(result)
        settings.append(Setting(result.emission_weight, result.transition_weight, None))
    return FittedState(fold.to(inputs.candidates.mask.device), tuple(settings), tuple(results))


def _run_fitted(batch: MethodBatch, options: MethodOptions) -> List[MethodOutput]:
    state: FittedState = batch.state["fitted"]
    # shape: (B_c,) fold of each conversation of the batch
    fold = state.fold.to(batch.rows.device)[batch.rows]
    mask = batch.candidates.mask
    order = torch.empty_like(batch.candidates.index)
    for held_out, setting in enumerate(state.settings):
        rows = (fold == held_out).nonzero().flatten()
        if rows.numel():
            distances = None if batch.distances is None else batch.distances[rows]
            order[rows] = map_matched_orders(batch.normalized[rows], distances, mask[rows], (setting,))[0]
    params = {"folds": len(state.settings), "weights": [s.to_dict() for s in state.settings]}
    return [MethodOutput(f"fitted ({len(state.settings)}-fold cross-fitted)", "fitted", params, _ranked(batch, order))]


# --------------------------------------------------------------------------- gated


def relevant_candidates(candidates: Candidates, qrels: Any) -> Tensor:
    """(B, T, M) bool: the real candidates with a qrel grade > 0 (the gold sets of the CRF likelihood).

    Args:
        candidates: (B, T, M). qrels: the flat :class:`~mapmatched_torch.kernels.ranking_metrics.SparseQrels`
            of the N real turns in (conversation, position) order.
    """
    valid = candidates.valid
    ids = qrels.ids.to(valid.device)
    positive = ids.masked_fill(qrels.grades.to(valid.device) <= 0, -1)
    # shape: (N, M, R) -> (N, M)
    hits = (candidates.index[valid].unsqueeze(-1) == positive.unsqueeze(-2)).any(dim=-1)
    relevant = torch.zeros_like(candidates.mask)
    relevant[valid] = hits & candidates.mask[valid]
    return relevant


def gate_features(
    candidates: Candidates,
    normalized: Tensor,
    query_embeddings: Optional[Tensor] = None,
    passage_embeddings: Optional[Tensor] = None,
    chunk: int = 256,
) -> Tensor:
    """The gated method's per-move feature: how well the new turn matches where the conversation was.

    With embeddings: :func:`~mapmatched_torch.kernels.transitions.query_source_cosine`,
    the cosine of turn t+1's query to the passage of candidate j of turn t. Without
    (the synthetic benchmark) its score-level analogue: turn t+1's normalized score of
    that passage when turn t+1 retrieved it, else turn t+1's lowest candidate score
    (as the score-level history concatenation treats a passage a turn missed).

    Args:
        candidates: (B, T, M). normalized: (B, T, M) float64 normalized scores.
        query_embeddings: (B, T, D) or None. passage_embeddings: (P, D) or None
            (both or neither).
        chunk: conversations per step of the cosine ((chunk, T, M, D) gathered embeddings).

    Returns:
        (B, T-1, M, 1) float64; 0.0 at moves out of padding.
    """
    index, _, mask = candidates
    if (query_embeddings is None) != (passage_embeddings is None):
        raise MapMatchedValueError("gate_features needs both the query and the passage embeddings, or neither")
    if query_embeddings is not None:
        if tuple(query_embeddings.shape[:2]) != tuple(mask.shape[:2]):
            raise MapMatchedValueError(
                f"query_embeddings must be (B, T, D) with (B, T) = {tuple(mask.shape[:2])}, "
                f"got {tuple(query_embeddings.shape)}"
            )
        from ..kernels.transitions import query_source_cosine

        queries, passages = query_embeddings.to(mask.device), passage_embeddings.to(mask.device)
        parts = [
            query_source_cosine(queries[start:start + chunk], passages[index[start:start + chunk].clamp_min(0)])
            for start in range(0, index.shape[0], chunk)
        ]
        features = torch.cat(parts).to(torch.float64) if parts else normalized.new_zeros((0, 0, 0, 1))
    else:
        following = normalized[:, 1:]
        # shape: (B, T-1, M_from, M_to): the passage of candidate j of turn t is candidate k of turn t+1
        same = (index[:, :-1, :, None] == index[:, 1:, None, :]) & mask[:, 1:, None, :]
        lowest = torch.where(mask[:, 1:], following, _INF).amin(dim=-1, keepdim=True)
        lowest = torch.where(torch.isfinite(lowest), lowest, 0.0)
        matched = torch.where(same, following.unsqueeze(2), 0.0).sum(dim=-1)
        features = torch.where(same.any(dim=-1), matched, lowest).unsqueeze(-1)
    # shape: (B, T-1, M, 1): a real source candidate with a real next turn
    sources = (mask[:, :-1] & mask[:, 1:].any(dim=-1, keepdim=True)).unsqueeze(-1)
    return torch.where(sources, features, 0.0)


class GatedState(NamedTuple):
    """What the gated method's prepare step leaves for its runs.

    Attributes:
        fold: (B,) long, the cross-fitting fold of each conversation (the fitted method's).
        features: (B, T-1, M, 1) float64 gate features of every conversation (:func:`gate_features`).
        models: one fitted :class:`~mapmatched_torch.fit.model.MapMatchedModel` per fold
            (fitted on the other folds; its feature standardization too).
        feature: the feature's name for reports.
        params: the fitted values of each fold (JSON-friendly).
    """

    fold: Tensor
    features: Tensor
    models: Tuple[Any, ...]
    feature: str
    params: Tuple[Dict[str, Any], ...]


def _gated_params(model: Any) -> Dict[str, Any]:
    """A fitted gated model's values: lambda, beta, the gate, the standardization, the cap."""
    gate = model.transition_model
    params = {
        "lambda": float(model.effective_emission_weight), "beta": float(model.effective_transition_weight),
        "gate_bias": float(gate.gate_bias), "gate_weight": float(gate.gate_weights[0]),
        "feature_mean": float(gate.feature_mean[0]), "feature_std": float(gate.feature_std[0]),
    }
    if gate.calibrate:
        params["cap"] = float(torch.nn.functional.softplus(gate.cap_parameter))
    return params


def _prepare_gated(inputs: Any, options: MethodOptions) -> GatedState:
    """Cross-fitted gated models: the CRF negative log-likelihood minimized on all folds but one.

    Per held-out fold: a :class:`~mapmatched_torch.fit.model.MapMatchedModel` with a
    one-feature :class:`~mapmatched_torch.kernels.transitions.GatedTransitions` (start:
    lambda = beta = 1, gate 1; ``options.extra["gated_calibrate"]`` (default False)
    also learns the distance saturation) has its feature standardization set from the
    training conversations' real moves, then LBFGS (``options.extra["gated_iterations"]``,
    default 100, strong Wolfe line search) minimizes the mean negative log-likelihood
    that the path meets a relevant candidate at every turn that has one, plus a ridge
    ``options.extra["gated_l2"] * (bias^2 + weight^2)`` (default 0.01) on the gate: beta
    and the gate's bias are nearly redundant (``beta * 2 sigmoid(bias)``), and without
    it the fit drifts along that ridge (beta -> 80, bias -> -5 on the synthetic
    benchmark) instead of keeping the scale in beta. Distances and features are
    computed once for all conversations ((B, T-1, M, M) float64).
    """
    from .distances import CorpusDistances

    folds = options.fit_folds
    cands = inputs.candidates
    batch = cands.shape[0]
    if batch < folds:
        raise MethodUnavailable(f"cross-fitting with {folds} folds needs at least {folds} conversations, got {batch}")
    if cands.shape[1] < 2:
        raise MethodUnavailable("the gated method needs conversations of at least 2 turns (it gates the moves)")
    fold = cross_fitting_folds(batch, folds, options.seed).to(cands.mask.device)
    normalized = normalize_candidate_scores(cands.scores, cands.mask, options.score_normalization)
    queries = getattr(inputs, "query_embeddings", None)
    passages = inputs.passage_embeddings if queries is not None else None
    features = gate_features(cands, normalized, queries, passages)
    lookup = CorpusDistances(inputs.graph, inputs.passage_ids)
    distances = lookup.consecutive(cands.index)
    relevant = relevant_candidates(cands, inputs.qrels)
    models, params = [], []
    for held_out in range(folds):
        train = (fold != held_out).nonzero().flatten()
        model = _fit_gated_model(cands.select(train), normalized[train], distances[train], relevant[train],
                                 features[train], lookup.maximum_distance, options, f"the gated fit of fold {held_out}")
        models.append(model)
        params.append(_gated_params(model))
    feature = "query-source cosine" if queries is not None else "score-level query-source match"
    return GatedState(fold, features, tuple(models), feature, tuple(params))


def _fit_gated_model(cands: Candidates, normalized: Tensor, distances: Tensor, relevant: Tensor, features: Tensor,
                     maximum_distance: float, options: MethodOptions, what: str) -> Any:
    """One gated model fitted on training conversations (the gated and mixed+gated methods' fit).

    Args:
        cands: the training conversations' candidates (B_train, T, M); normalized,
            distances (B_train, T-1, M, M), relevant (B_train, T, M) and features
            (B_train, T-1, M, 1) of the same conversations.
        maximum_distance: the graph bound (the initial saturation cap).
        options: ``extra["gated_calibrate"]``, ``["gated_iterations"]``, ``["gated_l2"]``
            as :func:`_prepare_gated` documents. what: names the fit in errors.

    Returns:
        The fitted :class:`~mapmatched_torch.fit.model.MapMatchedModel` (no gradients).
    """
    from ..fit.model import MapMatchedModel
    from ..fit.threads import one_thread
    from ..kernels.transitions import GatedTransitions

    calibrate = bool(options.extra.get("gated_calibrate", False))
    iterations = int(options.extra.get("gated_iterations", 100))
    l2 = float(options.extra.get("gated_l2", 0.01))
    mask = cands.mask
    if int(relevant.any(dim=-1).sum()) == 0:
        raise MethodUnavailable(f"{what} has no training turn with a relevant candidate")
    # shape: (B, T-1, M): the moves the standardization reads (real source, real next turn)
    sources = mask[:, :-1] & mask[:, 1:].any(dim=-1, keepdim=True)
    if not bool(sources.any()):
        raise MethodUnavailable(f"{what} has no move to learn from (every training conversation has one turn)")
    gate = GatedTransitions(1.0, num_features=1, calibrate=calibrate, cap=maximum_distance, device=mask.device)
    gate.standardize_(features, sources)
    model = MapMatchedModel(1.0, transition_model=gate, device=mask.device)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=iterations, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = model(normalized, distances, mask, relevant, features=features) + l2 * (
            gate.gate_bias.square() + gate.gate_weights.square().sum()
        )
        loss.backward()
        return loss

    with one_thread():  # the same fit bit for bit whatever the thread count (torchrun: one per process)
        optimizer.step(closure)
    model.project_()
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        raise MethodUnavailable(f"{what} diverged (a parameter is not finite)")
    model.requires_grad_(False)
    return model


#: The accepted values of ``options.extra["gated_ranking"]``.
GATED_RANKINGS = ("forward", "posterior")


def online_filtering_scores(emissions: Tensor, transitions: Tensor, mask: Tensor) -> Tensor:
    """Log-semiring forward scores: turn t's log filtering marginals up to a per-turn constant.

    ``alpha[t, i] = logsumexp_j (alpha[t-1, j] + trans[t-1, j, i]) + e[t, i]``: the log
    total weight of all paths over turns 0..t that end at candidate i, so ranking turn
    t's candidates by it ranks them by ``p(x_t = i | turns 0..t)`` (online, like
    :func:`online_forward_scores`, which takes the best path instead of the sum).

    Args:
        emissions: (B, T, M) weighted emissions. transitions: (B, T-1, M, M)
            ``[b, t, from, to]``. mask: (B, T, M) bool.

    Returns:
        (B, T, M) float; -inf at padding. Cost: O(B T M^2). The fused log-semiring
        kernel's forward pass computes them where it applies (to a few ulps of the
        torch path, :mod:`mapmatched_torch.kernels.fused`).
    """
    from ..kernels import fused
    from ..kernels.checks import prepare
    from ..kernels.semiring import LOG

    differentiable = fused.gradient_wanted(emissions, transitions)
    kept = None if differentiable else fused.log_partition_states(*fused.check_shapes(emissions, transitions, mask))
    if kept is not None:
        return torch.where(mask, kept.scores, -_INF)
    prepared = prepare(emissions, transitions, mask)
    alphas = chain.forward(LOG, prepared.emissions, prepared.pairwise, mask).alphas
    return torch.where(mask, alphas, -_INF)


def _gated_order(model: Any, normalized: Tensor, distances: Tensor, mask: Tensor, features: Tensor,
                 ranking: str = "forward") -> Tensor:
    """(B, T, M) online slot order of a fitted gated model (first entry: the decoded chunk at t).

    ``ranking``: ``"forward"`` (the max-plus forward scores, the session's answer) or
    ``"posterior"`` (:func:`online_filtering_scores`, the filtering marginals).
    """
    if model.transition_model.is_zero:
        return rank_slots(model.emissions(normalized, mask), mask)
    with torch.no_grad():
        emissions = model.emissions(normalized, mask)
        transitions = model.transitions(distances, mask, features)
    scores = (online_filtering_scores if ranking == "posterior" else online_forward_scores)(emissions, transitions, mask)
    return rank_slots(scores, mask)


def _gated_ranking(options: MethodOptions) -> str:
    """``options.extra["gated_ranking"]`` (default ``"forward"``), checked."""
    return check_choice("gated_ranking", options.extra.get("gated_ranking", "forward"), GATED_RANKINGS)


def _run_gated(batch: MethodBatch, options: MethodOptions) -> List[MethodOutput]:
    state: GatedState = batch.state["gated"]
    if batch.distances is None:
        raise MapMatchedValueError("the gated method needs the graph distances")
    rows_of_batch = batch.rows.to(state.fold.device)
    # shape: (B_c,) fold of each conversation of the batch; (B_c, T-1, M, 1) their features
    fold = state.fold[rows_of_batch].to(batch.rows.device)
    features = state.features[rows_of_batch].to(batch.normalized.device)
    mask = batch.candidates.mask
    order = torch.empty_like(batch.candidates.index)
    for held_out, model in enumerate(state.models):
        rows = (fold == held_out).nonzero().flatten()
        if rows.numel():
            order[rows] = _gated_order(model, batch.normalized[rows], batch.distances[rows], mask[rows], features[rows],
                                       _gated_ranking(options))
    params = {"folds": len(state.models), "feature": state.feature, "weights": list(state.params)}
    if _gated_ranking(options) != "forward":
        params["ranking"] = _gated_ranking(options)
    key = f"gated ({len(state.models)}-fold cross-fitted)"
    return [MethodOutput(key, "gated", params, _ranked(batch, order))]


# --------------------------------------------------------------------------- mixed


def relevant_passages(valid: Tensor, qrels: Any, num_passages: int) -> Tensor:
    """(B, T, P) bool: each real turn's passages with a qrel grade > 0 (the query-mixing fit's gold sets).

    Args:
        valid: (B, T) bool real turns. qrels: the flat
            :class:`~mapmatched_torch.kernels.ranking_metrics.SparseQrels` of those turns
            in (conversation, position) order. num_passages: P.
    """
    ids, grades = qrels.ids.to(valid.device), qrels.grades.to(valid.device)
    keep = (grades > 0) & (ids >= 0)
    # shape: (N, R) the flat turn of every qrel entry
    turn = torch.arange(ids.shape[0], device=valid.device).unsqueeze(1).expand_as(ids)
    flat = torch.zeros((ids.shape[0], num_passages), dtype=torch.bool, device=valid.device)
    flat[turn[keep], ids[keep]] = True
    out = torch.zeros((*valid.shape, num_passages), dtype=torch.bool, device=valid.device)
    out[valid] = flat
    return out


class MixedState(NamedTuple):
    """What the mixed methods' prepare step leaves for their runs.

    Attributes:
        fold: (B,) long, the cross-fitting fold of each conversation (the fitted method's).
        passages: (B, T, M) long ranked passage indices of every conversation, each
            retrieved and ranked online with the parameters fitted on the other folds.
        params: the fitted values of each fold (JSON-friendly): ``"mixing"`` (the gate,
            its temperature and training turns) and, for ``mixed+gated``,
            ``"transitions"`` (the gated model's values, as the gated method reports them).
    """

    fold: Tensor
    passages: Tensor
    params: Tuple[Dict[str, Any], ...]


class _GatedOnlineDecoder:
    """``decoded(t, prefix)`` of :func:`~mapmatched_torch.eval.candidates.retrieve_online`
    for a fitted gated model: the first passage of :func:`_gated_order` at turn t (the
    session's decoded chunk), each turn normalized, its distances and gate features
    computed once; :attr:`order` is the last call's (B, T', M) order."""

    def __init__(self, model: Any, lookup: Any, queries: Tensor, passages: Tensor, normalization: str,
                 ranking: str = "forward") -> None:
        self.model, self.lookup, self.queries, self.passages = model, lookup, queries, passages
        self.normalization, self.ranking = normalization, ranking
        self.normalized: List[Tensor] = []
        self.distances: List[Tensor] = []
        self.features: List[Tensor] = []
        self.order: Optional[Tensor] = None

    def __call__(self, turn: int, prefix: Candidates) -> Tensor:
        last = slice(turn, turn + 1)
        self.normalized.append(normalize_candidate_scores(prefix.scores[:, last], prefix.mask[:, last],
                                                          self.normalization))
        if turn:
            pair = slice(turn - 1, turn + 1)
            moves = Candidates(prefix.index[:, pair], prefix.scores[:, pair], prefix.mask[:, pair])
            self.distances.append(self.lookup.consecutive(moves.index))
            self.features.append(gate_features(moves, torch.cat(self.normalized[-2:], dim=1),
                                               self.queries[:, pair], self.passages))
        normalized = torch.cat(self.normalized, dim=1)
        if turn:
            self.order = _gated_order(self.model, normalized, torch.cat(self.distances, dim=1), prefix.mask,
                                      torch.cat(self.features, dim=1), self.ranking)
        else:
            self.order = rank_slots(self.model.emissions(normalized, prefix.mask), prefix.mask)
        return prefix.index[:, turn].gather(-1, self.order[:, turn, :1]).squeeze(-1)


def _pointwise_decoded(turn: int, prefix: Candidates) -> Tensor:
    """The pointwise decoded passage of turn t: its first candidate (provider order is by
    decreasing score and the normalization is monotone, so slot 0 is the first maximum)."""
    return prefix.index[:, turn, 0]


def _mixing_rows(queries: Tensor, passages: Tensor, decoded: Tensor, relevant: Tensor, valid: Tensor,
                 train: Tensor, with_previous_query: bool) -> Tuple[Tuple[Tensor, ...], Dict[str, Tensor]]:
    """The query-mixing fit's rows: turns t >= 1 of training conversations, with the
    passage decoded at t - 1 as context; ``((queries (N, D), contexts (N, D), relevant
    (N, P)), keywords)``, the keywords holding ``previous_queries`` (N, D), the raw
    queries of turns t - 1, when ``with_previous_query``."""
    # shape: (B, T-1)
    rows = valid[:, 1:] & valid[:, :-1] & train[:, None] & (decoded[:, :-1] >= 0)
    extra = {"previous_queries": queries[:, :-1][rows]} if with_previous_query else {}
    return (queries[:, 1:][rows], passages[decoded[:, :-1][rows]], relevant[:, 1:][rows]), extra


_MIXING_CONTEXTS = ("chunk", "chunk+query")


def _prepare_mixed(inputs: Any, options: MethodOptions, *, gated: bool = False) -> MixedState:
    """Cross-fitted gated query mixing (``mixed``), alone or with gated transitions (``mixed+gated``).

    Per held-out fold (the fitted method's folds, :func:`cross_fitting_folds`):

    1. the mixing gate (:class:`~mapmatched_torch.providers.query_mixing.QueryMixing`)
       is fitted on the training conversations by
       :func:`~mapmatched_torch.fit.query_mixing.fit_query_mixing` (the gold set's
       whole-corpus softmax cross-entropy under the mixed query) with the previous
       turn's pointwise decoded passage as context: round 0 takes it from the raw
       queries' candidates, each later round (``options.extra["mixing_rounds"]``,
       default 2 rounds in all) from the online mixed retrieval with the last round's
       gate (``options.extra["mixing_iterations"]``, default 100 LBFGS iterations;
       ``["mixing_l2"]``, default 0; ``["mixing_temperature"]``, default None: the
       softmax temperature fitted with the gate, a float: held at that value;
       ``["mixing_context"]``, default ``"chunk+query"``: the previous raw query is a
       second gated context source beside the decoded passage, ``"chunk"``: the
       passage alone);
    2. every conversation is retrieved again turn by turn
       (:func:`~mapmatched_torch.eval.candidates.retrieve_online` over the corpus
       embeddings, M candidates per turn as the raw query's), each query mixed with the
       passage the method decoded at the previous turn (and the previous query);
    3. ``mixed`` ranks each turn pointwise; ``mixed+gated`` fits a gated model
       (:func:`_fit_gated_model`, as the gated method does) on the training
       conversations' mixed candidates and decodes online with it, the decoded chunk
       of turn t being the context of turn t+1's query, as in a session.

    Only the held-out fold's conversations are kept from each fold's retrieval.

    Option (issue 15 item 3, measured in docs/experiment_log.md; off by default):
    ``options.extra["gated_ranking"] = "posterior"`` ranks ``mixed+gated`` (and the
    gated method) by the filtering marginals (:func:`online_filtering_scores`) instead
    of the max-plus forward scores. (Trajectory candidates, the previous decoded
    passage's graph neighbours added to the candidates, were measured and not kept:
    docs/experiment_log.md.)
    """
    from ..providers.dense import DenseProvider
    from .candidates import retrieve_online
    from .distances import CorpusDistances

    ranking = _gated_ranking(options)  # checked before any fit
    folds = _mixing_folds(inputs, options)
    cands = inputs.candidates
    device = cands.mask.device
    queries, passages = inputs.query_embeddings.to(device), inputs.passage_embeddings.to(device)
    lookup = CorpusDistances(inputs.graph, inputs.passage_ids) if gated else None
    provider = DenseProvider(passages, inputs.passage_ids, metric="inner_product", device=device) if gated else None
    out = torch.full_like(cands.index, -1)
    params = []
    for held_out, (fit, mixed) in enumerate(zip(folds.fits, folds.retrieved)):
        train = folds.fold != held_out
        fold_params: Dict[str, Any] = {
            "mixing": {**fit.mixing.to_dict(), "temperature": fit.temperature, "turns": fit.turns}}
        held = ~train
        normalized = normalize_candidate_scores(mixed.scores, mixed.mask, options.score_normalization)
        if not gated:
            out[held] = gather_passages(mixed.index, pointwise_order(normalized, mixed.mask))[held]
        else:
            rows = train.nonzero().flatten()
            model = _fit_gated_model(
                mixed.select(rows), normalized[rows], lookup.consecutive(mixed.index[rows]),
                relevant_candidates(mixed, inputs.qrels)[rows], gate_features(mixed, normalized, queries, passages)[rows],
                lookup.maximum_distance, options, f"the mixed+gated fit of fold {held_out}",
            )
            decoder = _GatedOnlineDecoder(model, lookup, queries, passages, options.score_normalization, ranking)
            online = retrieve_online(queries, cands.valid, provider, cands.shape[2], fit.mixing, passages, decoder)
            out[held] = gather_passages(online.index, decoder.order)[held]
            fold_params["transitions"] = _gated_params(model)
        params.append(fold_params)
    return MixedState(folds.fold, out, tuple(params))


class _MixingFolds(NamedTuple):
    """The cross-fitted mixing gates both mixed methods start from (:func:`_mixing_folds`).

    Attributes:
        fold: (B,) long, the cross-fitting fold of each conversation.
        fits: one :class:`~mapmatched_torch.fit.query_mixing.QueryMixingFit` per held-out
            fold, fitted on the other folds.
        retrieved: per held-out fold, every conversation retrieved online with that
            fold's gate, each turn's context the previous turn's pointwise top passage
            (:class:`Candidates` (B, T, M)).
    """

    fold: Tensor
    fits: Tuple[Any, ...]
    retrieved: Tuple[Candidates, ...]


def _mixing_folds(inputs: Any, options: MethodOptions) -> _MixingFolds:
    """The mixing gates of every held-out fold, fitted once per evaluation.

    ``mixed`` and ``mixed+gated`` fit the same gates on the same folds (steps 1 and 2
    of :func:`_prepare_mixed`). The first to ask keeps the result (or its failure) in
    ``options.memo`` with the inputs it was fitted on; the second, given the same
    options and inputs, gets it back, so an evaluation running both pays for the
    corpus-wide fits once.

    Raises:
        MethodUnavailable: no embeddings, too few conversations or turns, or a fit failed.
    """
    held = options.memo.get("mixing folds")
    if held is None or held[0] is not inputs:
        try:
            result: Any = _fit_mixing_folds(inputs, options)
        except MethodUnavailable as error:
            result = error
        held = options.memo["mixing folds"] = (inputs, result)
    if isinstance(held[1], MethodUnavailable):
        raise MethodUnavailable(*held[1].args)
    return held[1]


def _fit_mixing_folds(inputs: Any, options: MethodOptions) -> _MixingFolds:
    """:func:`_mixing_folds` without the cache."""
    from ..fit.query_mixing import fit_query_mixing
    from ..providers.dense import DenseProvider
    from .candidates import retrieve_online

    queries, passages = getattr(inputs, "query_embeddings", None), inputs.passage_embeddings
    if queries is None or passages is None:
        raise MethodUnavailable("query mixing needs query and passage embeddings (a dataset with an embedder)")
    cands = inputs.candidates
    batch, turns, width = cands.shape
    folds = options.fit_folds
    if batch < folds:
        raise MethodUnavailable(f"cross-fitting with {folds} folds needs at least {folds} conversations, got {batch}")
    if turns < 2:
        raise MethodUnavailable("query mixing needs conversations of at least 2 turns (it mixes in the previous one)")
    device = cands.mask.device
    rounds = max(1, int(options.extra.get("mixing_rounds", 2)))
    iterations = int(options.extra.get("mixing_iterations", 100))
    l2 = float(options.extra.get("mixing_l2", 0.0))
    context = options.extra.get("mixing_context", "chunk+query")
    if context not in _MIXING_CONTEXTS:
        raise MapMatchedValueError(f"the method option mixing_context must be one of {_MIXING_CONTEXTS}, got {context!r}")
    held_temperature = options.extra.get("mixing_temperature")
    temperature = {} if held_temperature is None else {
        "temperature": check_positive_finite(held_temperature, "the method option mixing_temperature (None: fitted)"),
        "fit_temperature": False}
    provider = DenseProvider(passages, inputs.passage_ids, metric="inner_product", device=device)
    queries, passages = queries.to(device), passages.to(device)
    valid = cands.valid
    relevant = relevant_passages(valid, inputs.qrels, len(inputs.passage_ids))
    fold = cross_fitting_folds(batch, folds, options.seed).to(device)
    fits, retrieved = [], []
    for held_out in range(folds):
        train = fold != held_out
        decoded, fit = cands.index[:, :, 0], None
        for _ in range(rounds):
            try:
                rows, extra = _mixing_rows(queries, passages, decoded, relevant, valid, train, context != "chunk")
                fit = fit_query_mixing(*rows, passages, iterations=iterations, l2=l2,
                                       initial=None if fit is None else fit.mixing, **extra, **temperature)
            except MapMatchedValueError as error:
                raise MethodUnavailable(f"the query-mixing fit of fold {held_out} failed: {error}") from None
            mixed = retrieve_online(queries, valid, provider, width, fit.mixing, passages, _pointwise_decoded)
            decoded = mixed.index[:, :, 0]
        fits.append(fit)
        retrieved.append(mixed)
    return _MixingFolds(fold, tuple(fits), tuple(retrieved))


def _mixed_runner(name: str) -> Callable[[MethodBatch, MethodOptions], List[MethodOutput]]:
    """The run of a mixed method: its prepared rankings of the batch's conversations."""

    def run(batch: MethodBatch, options: MethodOptions) -> List[MethodOutput]:
        state: MixedState = batch.state[name]
        passages = state.passages[batch.rows.to(state.passages.device)].to(batch.candidates.index.device)
        params = {"folds": len(state.params), "weights": list(state.params)}
        return [MethodOutput(f"{name} ({len(state.params)}-fold cross-fitted)", name, params, passages)]

    return run


for _spec in (
    MethodSpec("pointwise", "pointwise (beta = 0)", _run_pointwise),
    MethodSpec("map-matched", "map-matched", _run_map_matched, needs_distances=True),
    MethodSpec("history-concatenation", "history concatenation", _run_history),
    MethodSpec("maximal-marginal-relevance", "Maximal Marginal Relevance", _run_maximal_marginal_relevance,
               needs_similarity=True),
    MethodSpec("resolved-query-oracle", "resolved-query oracle", _run_oracle, prepare=_prepare_oracle),
    MethodSpec("geodesic", "geodesic bound", _run_geodesic, needs_distances=True),
    MethodSpec("fitted", "fitted weights", _run_fitted, prepare=_prepare_fitted, needs_distances=True),
):
    register_method(_spec)

# the learned methods: a model per fold (LBFGS); the mixed ones skip themselves without embeddings
register_method(MethodSpec("gated", "gated transitions (cross-fitted)", _run_gated, prepare=_prepare_gated,
                           needs_distances=True))
# a query-mixing fit per fold, then every conversation retrieved again turn by turn
register_method(MethodSpec("mixed", "gated query mixing (cross-fitted)", _mixed_runner("mixed"),
                           prepare=_prepare_mixed))
register_method(MethodSpec("mixed+gated", "gated query mixing with gated transitions (cross-fitted)",
                           _mixed_runner("mixed+gated"), prepare=functools.partial(_prepare_mixed, gated=True)))

#: Every built-in method, in report order (the learned ones included: on INSCIT dev, 86 conversations,
#: the whole default eval with wordllama takes about 50 s on 2 CPU cores, 42 s of it fitting).
DEFAULT_METHODS = tuple(METHODS)
