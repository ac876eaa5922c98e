"""The mixed methods: gated query mixing, ranked pointwise (``mixed``) or decoded
online with gated transitions (``mixed+gated``), cross-fitted."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ...core.checks import check_positive_finite
from ...core.errors import MapMatchedValueError
from ...kernels.online import rank_slots
from ..candidates import Candidates, normalize_candidate_scores
from .fitted import cross_fitting_folds
from .gated import _fit_gated_model, _gated_order, _gated_params, _gated_ranking, gate_features, relevant_candidates
from .map_matched import pointwise_order
from .registry import MethodBatch, MethodOptions, MethodOutput, MethodUnavailable, gather_passages

__all__ = ["relevant_passages", "MixedState", "fit_mixing_rows"]


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
                 train: Tensor, previous: Optional[Tensor]) -> Tuple[Tuple[Tensor, ...], Dict[str, Tensor]]:
    """The query-mixing fit's rows: turns t >= 1 of training conversations, with the
    passage decoded at t - 1 as context; ``((queries (N, D), contexts (N, D), relevant
    (N, P)), keywords)``, the keywords holding ``previous_queries`` (N, D), the rows of
    turns t - 1 of ``previous`` ((B, T, D): the raw queries, or the vectors the turns
    searched), unless ``previous`` is None (the chunk alone)."""
    # shape: (B, T-1)
    rows = valid[:, 1:] & valid[:, :-1] & train[:, None] & (decoded[:, :-1] >= 0)
    extra = {} if previous is None else {"previous_queries": previous[:, :-1][rows]}
    return (queries[:, 1:][rows], passages[decoded[:, :-1][rows]], relevant[:, 1:][rows]), extra


#: ``mixing_context`` values: the chunk alone, the chunk and the previous raw query, the
#: chunk and the vector the previous turn searched (a recurrent state, ``QueryMixing.recurrent``).
_MIXING_CONTEXTS = ("chunk", "chunk+query", "chunk+searched")


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
       ``["mixing_context"]``, default ``"chunk+searched"``: the vector the previous
       turn searched is a second gated context source beside the decoded passage (a
       recurrent state, ``QueryMixing.recurrent``; each later round fits on the last
       round's searched vectors, round 0 on the raw queries, which nothing mixed yet),
       ``"chunk+query"``: the previous raw query is, ``"chunk"``: the passage alone);
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
    from ...providers.dense import DenseProvider
    from ..candidates import retrieve_online
    from ..distances import CorpusDistances

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
    queries, passages = getattr(inputs, "query_embeddings", None), inputs.passage_embeddings
    if queries is None or passages is None:
        raise MethodUnavailable("query mixing needs query and passage embeddings (a dataset with an embedder)")
    cands = inputs.candidates
    batch, turns, _ = cands.shape
    folds = options.fit_folds
    if batch < folds:
        raise MethodUnavailable(f"cross-fitting with {folds} folds needs at least {folds} conversations, got {batch}")
    if turns < 2:
        raise MethodUnavailable("query mixing needs conversations of at least 2 turns (it mixes in the previous one)")
    device = cands.mask.device
    fold = cross_fitting_folds(batch, folds, options.seed).to(device)
    fits, retrieved = [], []
    for held_out in range(folds):
        fit, mixed = fit_mixing_rows(inputs, options, fold != held_out, f"the query-mixing fit of fold {held_out}")
        fits.append(fit)
        retrieved.append(mixed)
    return _MixingFolds(fold, tuple(fits), tuple(retrieved))


def fit_mixing_rows(inputs: Any, options: MethodOptions, train: Tensor, what: str) -> Tuple[Any, Candidates]:
    """The query-mixing gate fitted on the conversations ``train`` ((B,) bool) in rounds (steps 1
    and 2 of :func:`_prepare_mixed`), and every conversation retrieved online with it.

    Returns:
        ``(QueryMixingFit, Candidates (B, T, M))``: the last round's fit and retrieval
        (each turn's context: the previous turn's pointwise top passage).

    Raises:
        MethodUnavailable: the fit failed (``what`` names it).
    """
    from ...fit.query_mixing import fit_query_mixing
    from ...providers.dense import DenseProvider
    from ..candidates import retrieve_online

    cands = inputs.candidates
    device = cands.mask.device
    rounds = max(1, int(options.extra.get("mixing_rounds", 2)))
    iterations = int(options.extra.get("mixing_iterations", 100))
    l2 = float(options.extra.get("mixing_l2", 0.0))
    context = options.extra.get("mixing_context", "chunk+searched")
    if context not in _MIXING_CONTEXTS:
        raise MapMatchedValueError(f"the method option mixing_context must be one of {_MIXING_CONTEXTS}, got {context!r}")
    held_temperature = options.extra.get("mixing_temperature")
    temperature = {} if held_temperature is None else {
        "temperature": check_positive_finite(held_temperature, "the method option mixing_temperature (None: fitted)"),
        "fit_temperature": False}
    provider = DenseProvider(inputs.passage_embeddings, inputs.passage_ids, metric="inner_product", device=device)
    queries, passages = inputs.query_embeddings.to(device), inputs.passage_embeddings.to(device)
    valid = cands.valid
    relevant = relevant_passages(valid, inputs.qrels, len(inputs.passage_ids))
    width = cands.shape[2]
    recurrent = context == "chunk+searched"
    # round 0's contexts come from the raw queries' candidates, and nothing was mixed:
    # the vectors its turns searched are the raw queries
    decoded, fit, previous = cands.index[:, :, 0], None, None if context == "chunk" else queries
    for _ in range(rounds):
        try:
            rows, extra = _mixing_rows(queries, passages, decoded, relevant, valid, train, previous)
            fit = fit_query_mixing(*rows, passages, iterations=iterations, l2=l2,
                                   initial=None if fit is None else fit.mixing, **extra, **temperature)
        except MapMatchedValueError as error:
            raise MethodUnavailable(f"{what} failed: {error}") from None
        searched = torch.zeros_like(queries) if recurrent else None
        if recurrent:
            fit = dataclasses.replace(fit, mixing=dataclasses.replace(fit.mixing, recurrent=True))
        mixed = retrieve_online(queries, valid, provider, width, fit.mixing, passages, _pointwise_decoded, searched)
        decoded, previous = mixed.index[:, :, 0], searched if recurrent else previous
    return fit, mixed


def _mixed_runner(name: str) -> Callable[[MethodBatch, MethodOptions], List[MethodOutput]]:
    """The run of a mixed method: its prepared rankings of the batch's conversations."""

    def run(batch: MethodBatch, options: MethodOptions) -> List[MethodOutput]:
        state: MixedState = batch.state[name]
        passages = state.passages[batch.rows.to(state.passages.device)].to(batch.candidates.index.device)
        params = {"folds": len(state.params), "weights": list(state.params)}
        return [MethodOutput(f"{name} ({len(state.params)}-fold cross-fitted)", name, params, passages)]

    return run
