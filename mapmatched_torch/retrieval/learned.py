"""A learned transition model in sessions and the server: ``transitions=`` checked once, and its features.

``MapMatchedRetriever(..., transitions=model)`` and ``MapMatchedServer(...,
transitions=model)`` take a :class:`~mapmatched_torch.kernels.transitions.GatedTransitions`
(or any model with its contract, see
:func:`~mapmatched_torch.kernels.transitions.check_learned_transitions`) and decode with
``model(distances, features)`` in place of ``-(beta * d)``. :class:`LearnedTransitions`
holds it with what its gate feature needs, and the gate feature is the evaluation's
``gated`` method's (:mod:`mapmatched_torch.kernels.gate_features`):

- without ``passage_embeddings``: the score-level feature (the new turn's normalized
  score of each previous candidate's passage, else its lowest score), from the two
  turns' candidates and scores alone;
- with ``passage_embeddings`` ``(N, D)`` (rows aligned with ``passage_ids``, by default
  a tensor graph's node IDs): the cosine of the new turn's query embedding to each
  previous candidate's passage. Each turn after the first then needs its query
  embedding (``query_embedding=`` on a session's turn, ``query_embeddings=`` on the
  server's tensor step; a session's :meth:`retrieve` falls back to the provider's
  ``embed_query``), and every previous candidate needs an embedding: a clear
  :class:`~mapmatched_torch.core.errors.MapMatchedValueError` otherwise.

The model's beta becomes the settings' ``transition_weight`` (so the decoding mode,
``retriever.transition_weight`` and saved options say what is decoded); lambda, the lag
and the normalization stay the caller's.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from ..core.errors import MapMatchedValueError
from ..core.settings import DecodeSettings
from ..kernels.gate_features import GATE_FEATURE_NAMES, step_features
from ..kernels.transitions import check_learned_transitions, transitions_fingerprint

__all__ = ["LearnedTransitions"]


class LearnedTransitions:
    """A learned transition model and the embeddings its gate feature reads (see the module).

    Args:
        model: the transition model (checked: type, K in {0, 1}, beta >= 0). A module is
            held as a frozen copy (no gradients), so what decodes, what a saved state's
            fingerprint names and what the reference is given stay one model even if the
            caller keeps training theirs.
        graph: the corpus graph (its node IDs are the default ``passage_ids``).
        passage_embeddings: ``(N, D)`` floating, or None for the score-level feature.
        passage_ids: the N chunk IDs of its rows (default: the graph's
            ``vocabulary.chunk_ids``, a tensor graph's nodes in index order).

    Raises:
        MapMatchedValueError: a bad model, embeddings that are not a finite ``(N, D)``
            floating tensor, or IDs that are missing, repeated or of another count.
    """

    def __init__(
        self,
        model: Any,
        graph: Any,
        passage_embeddings: Optional[Tensor] = None,
        passage_ids: Optional[Sequence[str]] = None,
    ) -> None:
        model = check_learned_transitions(model)
        if isinstance(model, torch.nn.Module):
            model = copy.deepcopy(model).requires_grad_(False)
        self.model = model
        self.passage_embeddings: Optional[Tensor] = None
        self.rows: Dict[str, int] = {}
        if passage_embeddings is None:
            if passage_ids is not None:
                raise MapMatchedValueError("passage_ids= goes with passage_embeddings=")
            return
        if not isinstance(passage_embeddings, Tensor) or passage_embeddings.dim() != 2 \
                or not passage_embeddings.is_floating_point() or passage_embeddings.shape[0] == 0:
            shape = tuple(passage_embeddings.shape) if isinstance(passage_embeddings, Tensor) else \
                type(passage_embeddings).__name__
            raise MapMatchedValueError(f"passage_embeddings must be a floating (N, D) tensor, got {shape}")
        if not bool(torch.isfinite(passage_embeddings).all()):
            raise MapMatchedValueError("passage_embeddings must be finite")
        if passage_ids is None:
            vocabulary = getattr(graph, "vocabulary", None)
            if vocabulary is None:
                raise MapMatchedValueError(
                    "passage_embeddings needs passage_ids= (the chunk ID of each row) unless the graph is a tensor "
                    "graph, whose node IDs are the default"
                )
            passage_ids = vocabulary.chunk_ids
        ids = list(passage_ids)
        if len(ids) != passage_embeddings.shape[0]:
            raise MapMatchedValueError(
                f"passage_embeddings has {passage_embeddings.shape[0]} rows but there are {len(ids)} passage IDs"
            )
        self.rows = {chunk_id: row for row, chunk_id in enumerate(ids)}
        if len(self.rows) != len(ids):
            raise MapMatchedValueError("passage_ids must be unique")
        self.passage_embeddings = passage_embeddings

    @property
    def needs_features(self) -> bool:
        """The model gates on a feature (K = 1)."""
        return self.model.num_features > 0

    @property
    def needs_query(self) -> bool:
        """Each turn after the first needs its query embedding (the cosine feature)."""
        return self.needs_features and self.passage_embeddings is not None

    @property
    def feature(self) -> Optional[str]:
        """The gate feature's name (as the evaluation's reports say it), or None (K = 0)."""
        if not self.needs_features:
            return None
        return GATE_FEATURE_NAMES[0] if self.passage_embeddings is not None else GATE_FEATURE_NAMES[1]

    def settings(self, settings: DecodeSettings) -> DecodeSettings:
        """``settings`` with the model's beta as ``transition_weight``."""
        beta = float(self.model.effective_transition_weight.detach())
        return dataclasses.replace(settings, transition_weight=beta)

    def fingerprint(self) -> Dict[str, Any]:
        """What a saved state records of the model (and which feature it reads)."""
        return {**transitions_fingerprint(self.model), "feature": self.feature}

    def embedding_rows(self, chunk_ids: Sequence[Optional[str]]) -> List[int]:
        """The rows of ``passage_embeddings`` of chunk IDs (None: padding, row -1).

        Raises:
            MapMatchedValueError: a chunk without an embedding.
        """
        rows = []
        for chunk_id in chunk_ids:
            if chunk_id is None:
                rows.append(-1)
                continue
            row = self.rows.get(chunk_id)
            if row is None:
                raise MapMatchedValueError(
                    f"chunk {chunk_id!r} has no passage embedding, but the transition model gates on the query-source "
                    "cosine of the previous turn's candidates"
                )
            rows.append(row)
        return rows

    def check_query(self, query_embedding: Optional[Any], dtype: Optional[torch.dtype] = None) -> Tensor:
        """A query embedding ``(D,)`` (or ``(S, D)``) as a tensor of the passages' dtype, checked."""
        if query_embedding is None:
            raise MapMatchedValueError(
                "the transition model gates on the query-source cosine (passage_embeddings were given): pass the "
                "turn's query embedding (query_embedding= on a session turn, query_embeddings= on the server's step)"
            )
        passages = self.passage_embeddings
        assert passages is not None
        query = torch.as_tensor(query_embedding, dtype=dtype or passages.dtype)
        if query.shape[-1:] != passages.shape[1:] or not bool(torch.isfinite(query).all()):
            raise MapMatchedValueError(
                f"query embeddings must be finite with D = {passages.shape[1]}, got shape {tuple(query.shape)}"
            )
        return query

    def turn_features(
        self,
        previous_ids: Sequence[str],
        chunk_ids: Sequence[str],
        normalized: Sequence[float],
        width: int,
        query_embedding: Optional[Any] = None,
    ) -> Optional[Tensor]:
        """``(width, 1)`` float64 gate features of the moves out of a session's previous
        turn into its new one (None when the model has no feature)."""
        if not self.needs_features:
            return None

        def padded(values: Sequence[Any], fill: Any, dtype: torch.dtype) -> Tensor:
            return torch.tensor([list(values) + [fill] * (width - len(values))], dtype=dtype)

        previous_mask = padded([True] * len(previous_ids), False, torch.bool)
        mask = padded([True] * len(chunk_ids), False, torch.bool)
        scores = padded(normalized, 0.0, torch.float64)
        if self.needs_query:
            query = self.check_query(query_embedding).reshape(1, -1)
            previous = padded(self.embedding_rows(previous_ids), -1, torch.long)
            return step_features(previous, previous_mask, torch.zeros_like(previous), scores, mask, query,
                                 self.passage_embeddings)[0]
        numbers: Dict[str, int] = {}
        previous = padded([numbers.setdefault(c, len(numbers)) for c in previous_ids], -1, torch.long)
        index = padded([numbers.setdefault(c, len(numbers)) for c in chunk_ids], -1, torch.long)
        return step_features(previous, previous_mask, index, scores, mask)[0]

    def cost_tables(self, features: Sequence[Optional[Tensor]]) -> Any:
        """The standalone decoder's ``transition_costs`` function for a session whose turn
        t >= 1 has gate features ``features[t]`` (``(width, 1)``; None at turn 0): the
        negated ``model(distances, features)`` as float tables."""

        def costs(turn: int, distances: List[List[float]]) -> List[List[float]]:
            table = torch.tensor(distances, dtype=torch.float64)
            gate = features[turn]
            gate = None if gate is None else gate[: table.shape[0]]
            with torch.no_grad():
                moves = self.model(table, gate, torch.float64)
            return (-moves).tolist()

        return costs
