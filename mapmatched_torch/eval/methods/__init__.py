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

Modules: :mod:`.registry` (the registry, :class:`Setting` and the types a method is run
with), :mod:`.map_matched` (pointwise and map-matched), :mod:`.baselines` (history
concatenation, Maximal Marginal Relevance, the resolved-query oracle, the geodesic
bound), :mod:`.fitted`, :mod:`.gated` and :mod:`.mixed`; the online dynamic programs
they rank by are :mod:`mapmatched_torch.kernels.online` (also importable here).
"""

from __future__ import annotations

import functools

# their home is kernels.online (not in __all__); importable here as before the split
from ...kernels.online import geodesic_online_order, online_filtering_scores, online_forward_scores, rank_slots
from .baselines import (
    _prepare_oracle,
    _run_geodesic,
    _run_history,
    _run_maximal_marginal_relevance,
    _run_oracle,
    history_concatenation_scores,
    maximal_marginal_relevance_order,
    similarity_from_distances,
    similarity_from_embeddings,
)
from .fitted import FittedState, _prepare_fitted, _run_fitted, cross_fitting_folds, labelled_conversations
from .gated import GATED_RANKINGS, GatedState, _prepare_gated, _run_gated, gate_features, relevant_candidates
from .map_matched import (
    _run_map_matched,
    _run_pointwise,
    decode_setting,
    map_matched_orders,
    pointwise_order,
    weighted_trellis,
)
from .mixed import MixedState, _mixed_runner, _prepare_mixed, relevant_passages
from .registry import (
    METHODS,
    MethodBatch,
    MethodOptions,
    MethodOutput,
    MethodSpec,
    MethodUnavailable,
    Setting,
    gather_passages,
    register_method,
    settings_grid,
)

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
    "gather_passages",
    "weighted_trellis",
    "map_matched_orders",
    "decode_setting",
    "history_concatenation_scores",
    "maximal_marginal_relevance_order",
    "similarity_from_embeddings",
    "similarity_from_distances",
]


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
