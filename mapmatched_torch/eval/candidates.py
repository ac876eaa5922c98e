"""Retrieval candidates of every turn as padded tensors, and their normalization.

A :class:`Candidates` batch holds, for B conversations of up to T turns, each turn's
M best passages (corpus indices) and raw scores in provider order (decreasing
score). It comes either from the synthetic benchmark's precomputed tensors
(:func:`candidates_from_synthetic`) or from an embedder and an exact dense top-M over
the corpus (:func:`retrieve_candidates`, with the query texts of
:func:`query_texts`: the raw queries, the rewrites, or the history concatenation).

Layout (docs/spec.md section 10): real turns come first in every conversation; real
candidates fill each turn from slot 0; ``index`` holds -1 and ``scores`` 0.0 at
padding. Flattening the real turns of a ``(B, T)`` tensor in row-major order gives the
flat turn order of :meth:`Dataset.iter_turns <mapmatched_torch.eval.data.Dataset.iter_turns>`.

Example:
    >>> import torch
    >>> c = Candidates(torch.tensor([[[4, 2], [1, -1]]]), torch.tensor([[[2.0, 1.0], [3.0, 0.0]]], dtype=torch.float64),
    ...                torch.tensor([[[True, True], [True, False]]]))
    >>> c.shape, c.lengths.tolist()
    ((1, 2, 2), [2])
    >>> normalize_candidate_scores(c.scores, c.mask).tolist()
    [[[1.0, -1.0], [0.0, 0.0]]]
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from ..core.checks import check_choice, check_positive_int
from ..core.errors import MapMatchedValueError
from ..core.protocols import as_scored_candidates, provider_answer
from ..core.scoring import check_score_normalization
from ..kernels.normalization import normalize_score_rows
from .data import Dataset

__all__ = [
    "QUERY_MODES",
    "Candidates",
    "passage_embedding_text",
    "candidates_from_synthetic",
    "query_texts",
    "retrieve_candidates",
    "retrieve_online",
    "embed_turns",
    "normalize_candidate_scores",
    "flatten_turns",
]

#: The accepted values of ``mode`` in :func:`query_texts`.
QUERY_MODES = ("query", "rewrite", "history")

Device = Union[str, torch.device, None]


class Candidates(NamedTuple):
    """Each turn's retrieval candidates, padded to (B, T, M).

    Attributes:
        index: (B, T, M) long, corpus passage indices in provider order; -1 at padding.
        scores: (B, T, M) float64 raw retriever scores; 0.0 at padding.
        mask: (B, T, M) bool, True at real candidates.
    """

    index: Tensor
    scores: Tensor
    mask: Tensor

    @property
    def shape(self) -> tuple:
        """(B, T, M)."""
        return tuple(self.mask.shape)

    @property
    def valid(self) -> Tensor:
        """(B, T) bool, the real turns (at least one candidate)."""
        return self.mask.any(dim=-1)

    @property
    def lengths(self) -> Tensor:
        """(B,) long, the number of real turns of each conversation."""
        return self.valid.sum(dim=-1)

    def to(self, device: Device) -> "Candidates":
        """All three tensors on ``device``."""
        return Candidates(self.index.to(device), self.scores.to(device), self.mask.to(device))

    def select(self, rows: Union[slice, Tensor]) -> "Candidates":
        """The candidates of some conversations (a slice or an index tensor over B)."""
        return Candidates(self.index[rows], self.scores[rows], self.mask[rows])

    def check(self, num_passages: Optional[int] = None) -> "Candidates":
        """Validate shapes, dtypes and the padding layout; returns ``self``.

        Raises:
            MapMatchedValueError: naming the first problem.
        """
        index, scores, mask = self
        if not all(isinstance(t, Tensor) and t.dim() == 3 for t in self):
            raise MapMatchedValueError("candidates index, scores and mask must be (B, T, M) tensors")
        if index.shape != mask.shape or scores.shape != mask.shape:
            raise MapMatchedValueError(
                f"candidates index {tuple(index.shape)}, scores {tuple(scores.shape)} and mask {tuple(mask.shape)} "
                "must have the same (B, T, M) shape"
            )
        if index.dtype != torch.long or mask.dtype != torch.bool or not scores.is_floating_point():
            raise MapMatchedValueError(
                f"candidates need a long index, float scores and a bool mask, got {index.dtype}, {scores.dtype}, "
                f"{mask.dtype}"
            )
        if mask.shape[0] and not bool(mask[:, 0].any(dim=-1).all()):
            b = int((~mask[:, 0].any(dim=-1)).nonzero()[0])
            raise MapMatchedValueError(f"conversation b={b} has no candidate at its first turn")
        if bool((mask & (index < 0)).any()):
            raise MapMatchedValueError("a real candidate has a negative passage index")
        if num_passages is not None and bool((index >= num_passages).any()):
            raise MapMatchedValueError(f"a candidate passage index is >= the corpus size {num_passages}")
        if bool((mask & ~torch.isfinite(scores)).any()):
            raise MapMatchedValueError("candidate scores must be finite at real candidates")
        return self


def candidates_from_synthetic(bench: Any) -> Candidates:
    """The :class:`Candidates` of a :class:`~mapmatched_torch.eval.synthetic.SyntheticBenchmark` (every slot real)."""
    index = bench.candidate_index.long()
    return Candidates(index, bench.candidate_scores.to(torch.float64), torch.ones_like(index, dtype=torch.bool))


def passage_embedding_text(passage: Any) -> str:
    """The text a passage is embedded with: its section path (else its title), ``". "``, then its text.

    The headings carry the topic that a passage's body often leaves implicit (on
    ``shared/data/inscit_dev`` the raw-query MRR@10 of wordllama rises from 0.595 with
    the body alone to 0.648, the figure the data's README reports).
    """
    heading = " ".join(passage.section_path) or (passage.title or "")
    return f"{heading}. {passage.text}" if heading else passage.text


def query_texts(dataset: Dataset, mode: str = "query") -> List[List[str]]:
    """The text each turn is retrieved with, ``[conversation][turn]``.

    Args:
        dataset: the conversations.
        mode: ``"query"`` (the raw query), ``"rewrite"`` (the turn's rewrite, or its
            query when it has none: the resolved-query oracle), or ``"history"`` (all
            queries of the conversation up to and including this one, joined by
            spaces, oldest first: the history-concatenation baseline).

    Raises:
        MapMatchedValueError: an unknown mode.
    """
    check_choice("query mode", mode, QUERY_MODES)
    texts: List[List[str]] = []
    for conversation in dataset.conversations:
        if mode == "query":
            texts.append([turn.query for turn in conversation.turns])
        elif mode == "rewrite":
            texts.append([turn.rewrite if turn.rewrite is not None else turn.query for turn in conversation.turns])
        else:
            queries = [turn.query for turn in conversation.turns]
            texts.append([" ".join(queries[: position + 1]) for position in range(len(queries))])
    return texts


def retrieve_candidates(
    texts: Sequence[Sequence[str]],
    embedder: Any,
    provider: Any,
    limit: int,
    *,
    device: Device = None,
    passage_ids: Optional[Sequence[str]] = None,
) -> Candidates:
    """Embed every turn's text and take the exact top-``limit`` passages of ``provider``.

    Args:
        texts: ``[conversation][turn]`` query texts (e.g. from :func:`query_texts`);
            every conversation needs at least one turn.
        embedder: an :class:`~mapmatched_torch.eval.embedders.Embedder` (all texts are
            encoded in one call).
        provider: a :class:`~mapmatched_torch.providers.dense.DenseProvider` over the
            corpus, rows in corpus order (its ``search_tensors`` ranks by
            (-score, row)); or any other ``CandidateProvider`` (e.g. mapmatched 0.1.0's,
            with only ``candidates(query, limit)``), asked one text at a time as
            :func:`~mapmatched_torch.core.protocols.provider_answer` says, with
            ``passage_ids``; ``embedder`` is then not used (the provider embeds).
        limit: M, candidates per turn (at most the corpus size are returned).
        device: where the returned tensors live (default: the provider's device, or
            the CPU for a provider without one).
        passage_ids: the corpus' chunk IDs by passage index (``dataset.passage_ids``),
            needed for a provider without ``search_tensors``: its chunk IDs become
            passage indices.

    Returns:
        :class:`Candidates` of shape (B, T, min(limit, N)), scores as float64 (with a
        provider asked by text: (B, T, the most candidates a turn got), each turn in
        the provider's order, cut at ``limit``).

    Raises:
        MapMatchedValueError: a bad ``limit``, no turns; a provider without
            ``search_tensors`` and no ``passage_ids``, or whose answer is empty, repeats
            a chunk or names one that is not a passage.
    """
    limit = check_positive_int(limit, "candidates")
    if not texts or any(len(turns) == 0 for turns in texts):
        raise MapMatchedValueError("every conversation needs at least one turn to retrieve for")
    if not callable(getattr(provider, "search_tensors", None)):
        return _asked_candidates(texts, provider, passage_ids, limit, device)
    flat = [text for turns in texts for text in turns]
    # shape: (N, D)
    queries = embedder.encode(flat)
    # shape: (N, M) each
    scores, rows = provider.search_tensors(queries, limit)
    device = provider.device if device is None else torch.device(device)
    lengths = torch.tensor([len(turns) for turns in texts], dtype=torch.long, device=device)
    batch, turns, width = len(texts), int(lengths.max()), rows.shape[1]
    # shape: (B, T) the real turns, row-major = flat order
    valid = torch.arange(turns, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    index = torch.full((batch, turns, width), -1, dtype=torch.long, device=device)
    values = torch.zeros((batch, turns, width), dtype=torch.float64, device=device)
    index[valid] = rows.to(device=device, dtype=torch.long)
    values[valid] = scores.to(device=device, dtype=torch.float64)
    return Candidates(index, values, valid.unsqueeze(2).expand(-1, -1, width).clone())


def retrieve_online(
    query_embeddings: Tensor,
    valid: Tensor,
    provider: Any,
    limit: int,
    mixing: Any,
    passage_embeddings: Tensor,
    decoded: Callable[[int, Candidates], Tensor],
    searched: Optional[Tensor] = None,
) -> Candidates:
    """Retrieve turn by turn with queries mixed with the previous turn's decoded passage.

    Turn t's query is ``mixing.apply(q_t, passage_embeddings[decoded at t-1], ...,
    s_{t-1})`` (the second source when the mix has one: the previous raw query
    ``s_{t-1} = q_{t-1}``, or with ``mixing.recurrent`` the vector turn t-1 searched;
    turn 0 and conversations whose previous turn decoded nothing keep the raw query), searched
    with ``provider.search_tensors``; then ``decoded(t, candidates of turns 0..t)``
    says which passage the method decoded at turn t, as a session would, before turn
    t+1 is retrieved. With a zero mix every query is the raw one and the result equals
    :func:`retrieve_candidates` of the raw queries over the same provider.

    Args:
        query_embeddings: (B, T, D) raw query embeddings (:func:`embed_turns`).
        valid: (B, T) bool real turns (real turns first).
        provider: a :class:`~mapmatched_torch.providers.dense.DenseProvider` over the
            corpus, rows in corpus order.
        limit: M, candidates per turn.
        mixing: a :class:`~mapmatched_torch.providers.query_mixing.QueryMixing`.
        passage_embeddings: (P, D) the provider's rows (the context vectors).
        decoded: ``decoded(t, prefix) -> (B,) long`` passage index decoded at turn t
            (-1 where turn t is not real); ``prefix``: Candidates (B, t+1, M).
        searched: None, or a (B, T, D) float tensor that receives the vector each real
            turn searched (the fit's previous-source rows of a recurrent mix).

    Returns:
        :class:`Candidates` (B, T, min(limit, P)) on the provider's device.

    Cost: T searches of at most B queries each, plus T calls of ``decoded``.
    """
    limit = check_positive_int(limit, "candidates")
    device = provider.device
    batch, turns = valid.shape
    width = min(limit, len(provider.chunk_ids))
    index = torch.full((batch, turns, width), -1, dtype=torch.long, device=device)
    values = torch.zeros((batch, turns, width), dtype=torch.float64, device=device)
    valid = valid.to(device)
    mask = valid.unsqueeze(2).expand(-1, -1, width).clone()
    queries, passages = query_embeddings.to(device), passage_embeddings.to(device)
    previous = torch.full((batch,), -1, dtype=torch.long, device=device)
    recurrent = bool(getattr(mixing, "recurrent", False))
    # shape: (B, D) the vector each conversation searched at its latest turn (a recurrent mix's state)
    state = queries[:, 0].clone()
    for turn in range(turns):
        rows = valid[:, turn]
        # shape: (B_t, D)
        vectors = queries[rows, turn]
        context = previous[rows]
        # the previous turn's raw (or searched) query: read only by a mix with a previous-query source
        earlier = state[rows] if recurrent else queries[rows, max(turn - 1, 0)]
        vectors = mixing.apply(vectors, passages[context.clamp_min(0)].to(vectors.dtype), context >= 0, earlier)
        state[rows] = vectors.to(state.dtype)
        if searched is not None:
            searched[rows, turn] = vectors.to(device=searched.device, dtype=searched.dtype)
        scores, found = provider.search_tensors(vectors, width)
        index[rows, turn] = found.to(device=device, dtype=torch.long)
        values[rows, turn] = scores.to(device=device, dtype=torch.float64)
        prefix = Candidates(index[:, : turn + 1], values[:, : turn + 1], mask[:, : turn + 1])
        previous = torch.where(rows, decoded(turn, prefix).to(device), -1)
    return Candidates(index, values, mask)


def embed_turns(texts: Sequence[Sequence[str]], embedder: Any, *, device: Device = None) -> Tensor:
    """Every turn's text embedded, padded to ``(B, T, D)``.

    Args:
        texts: ``[conversation][turn]`` texts (e.g. :func:`query_texts`), every
            conversation with at least one turn.
        embedder: an :class:`~mapmatched_torch.eval.embedders.Embedder` (one ``encode``
            call for all texts).
        device: where the result lives (default: where the embedder puts it).

    Returns:
        ``(B, T, D)`` float embeddings, real turns first (the layout of
        :class:`Candidates`), 0.0 after each conversation's end.

    Raises:
        MapMatchedValueError: a conversation without turns.
    """
    if not texts or any(len(turns) == 0 for turns in texts):
        raise MapMatchedValueError("every conversation needs at least one turn to embed")
    # shape: (N, D) in flat (conversation, position) order
    flat = embedder.encode([text for turns in texts for text in turns])
    device = flat.device if device is None else torch.device(device)
    lengths = torch.tensor([len(turns) for turns in texts], device=device)
    valid = torch.arange(int(lengths.max()), device=device).unsqueeze(0) < lengths.unsqueeze(1)
    out = torch.zeros((len(texts), valid.shape[1], flat.shape[1]), dtype=flat.dtype, device=device)
    out[valid] = flat.to(device)
    return out


def _asked_candidates(
    texts: Sequence[Sequence[str]], provider: Any, passage_ids: Optional[Sequence[str]], limit: int, device: Device
) -> Candidates:
    """:func:`retrieve_candidates` for a provider asked one text at a time."""
    if passage_ids is None:
        raise MapMatchedValueError(
            f"{type(provider).__name__} has no search_tensors: pass passage_ids= (the corpus' chunk IDs by passage "
            "index) so its candidates' chunk IDs can be mapped to passages"
        )
    row_of = {chunk_id: row for row, chunk_id in enumerate(passage_ids)}
    name, answer = provider_answer(provider)
    what = f"candidates from {type(provider).__name__}.{name}(query, limit)"
    turns: List[List[tuple]] = []
    for conversation, conversation_texts in enumerate(texts):
        for turn, text in enumerate(conversation_texts):
            where = f"conversation {conversation} turn {turn}"
            found = as_scored_candidates(answer(text, limit), f"{what} ({where})")[:limit]
            rows = [row_of.get(candidate.chunk_id) for candidate in found]
            if not found or None in rows or len(set(rows)) != len(rows):
                problem = (
                    "no candidates" if not found
                    else f"chunk {found[rows.index(None)].chunk_id!r}, not a passage" if None in rows
                    else "a chunk twice"
                )
                raise MapMatchedValueError(f"{what} gave {problem} for {where}")
            turns.append([(row, candidate.score) for row, candidate in zip(rows, found)])
    device = torch.device("cpu") if device is None else torch.device(device)
    lengths = [len(conversation_texts) for conversation_texts in texts]
    width = max(len(turn) for turn in turns)
    # shape: (B, T, M) padded with -1 / 0.0 / False
    index = torch.full((len(texts), max(lengths), width), -1, dtype=torch.long)
    values = torch.zeros(index.shape, dtype=torch.float64)
    turn_rows = iter(turns)
    for conversation, count in enumerate(lengths):
        for turn in range(count):
            pairs = next(turn_rows)
            index[conversation, turn, : len(pairs)] = torch.tensor([row for row, _ in pairs], dtype=torch.long)
            values[conversation, turn, : len(pairs)] = torch.tensor([score for _, score in pairs], dtype=torch.float64)
    return Candidates(index.to(device), values.to(device), (index >= 0).to(device))


def normalize_candidate_scores(
    scores: Tensor, mask: Tensor, method: str = "zscore", *, exact: bool = True
) -> Tensor:
    """Normalize every turn's raw scores over its real candidates (docs/spec.md section 2).

    Args:
        scores: (B, T, M) float raw scores.
        mask: (B, T, M) bool real candidates.
        method: ``"zscore"`` (default), ``"center"`` or ``"none"``.
        exact: True (default) normalizes as
            :func:`mapmatched_torch.core.scoring.normalize_scores` does, bit for bit (the
            session's normalized scores), through
            :func:`~mapmatched_torch.kernels.normalization.normalize_score_rows`: two
            ``math.fsum`` per turn, the rest in tensors; False uses tensor sums (the
            same up to the last bits of rounding, no Python per turn).

    Returns:
        (B, T, M) float64 on the scores' device, 0.0 at padding.
    """
    method = check_score_normalization(method)
    if scores.shape != mask.shape:
        raise MapMatchedValueError(f"scores {tuple(scores.shape)} and mask {tuple(mask.shape)} differ in shape")
    values = scores.to(torch.float64)
    if method == "none":
        return torch.where(mask, values, 0.0)
    if exact:
        width = mask.shape[-1]
        rows, keep = values.reshape(-1, width).cpu(), mask.reshape(-1, width).cpu()
        # each turn's real candidates first, in slot order (a stable sort of the mask),
        # normalized by the batched exact normalization, then put back in their slots
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
        normalized = normalize_score_rows(rows.gather(1, order), keep.sum(1).tolist(), method)
        if bool(torch.isnan(normalized).any()):
            raise MapMatchedValueError("a turn's normalized scores overflow (the exact sum of its raw scores does)")
        out = torch.zeros_like(rows).scatter(1, order, normalized)
        return out.view(values.shape).to(values.device)
    count = mask.sum(dim=-1, keepdim=True).clamp(min=1).to(torch.float64)
    mean = torch.where(mask, values, 0.0).sum(dim=-1, keepdim=True) / count
    centered = torch.where(mask, values - mean, 0.0)
    if method == "center":
        return centered
    std = torch.sqrt((centered * centered).sum(dim=-1, keepdim=True) / count)
    return torch.where(std > 0, centered / torch.where(std > 0, std, 1.0), 0.0)


def flatten_turns(values: Tensor, valid: Tensor) -> Tensor:
    """(B, T, ...) -> (N, ...): the real turns in flat (conversation, position) order."""
    if values.shape[:2] != valid.shape:
        raise MapMatchedValueError(f"values {tuple(values.shape)} do not start with the (B, T) shape {tuple(valid.shape)}")
    return values[valid]
