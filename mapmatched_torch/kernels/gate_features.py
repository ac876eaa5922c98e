"""The gate features of a learned transition model, computed once for eval, sessions and the server.

A :class:`~mapmatched_torch.kernels.transitions.GatedTransitions` gates beta per move out
of candidate j of turn t by a feature of that move. The evaluation's ``gated`` method,
a session and the server's tensor step all compute it here, from the same tensors, so
the same turn gets the same feature bit for bit (no reduction whose order depends on the
batch: the score-level feature is a gather, the cosine reduces over D only):

- :func:`score_match_features` (no embeddings): turn t+1's normalized score of the
  passage of candidate j of turn t when turn t+1 retrieved it, else turn t+1's lowest
  candidate score (as the score-level history concatenation treats a passage a turn
  missed). It needs only the two turns' candidates and normalized scores.
- :func:`~mapmatched_torch.kernels.transitions.query_source_cosine` (with embeddings):
  the cosine of turn t+1's query to the passage of candidate j of turn t.

:func:`gate_features` picks one of them and zeroes the moves out of padding.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..core.errors import MapMatchedValueError
from .transitions import query_source_cosine

__all__ = ["score_match_features", "gate_features", "step_features", "GATE_FEATURE_NAMES"]

_INF = float("inf")

#: How reports name the two features: with embeddings, without.
GATE_FEATURE_NAMES = ("query-source cosine", "score-level query-source match")


def score_match_features(index: Tensor, normalized: Tensor, mask: Tensor) -> Tensor:
    """The score-level gate feature of every move.

    Args:
        index: ``(B, T, M)`` long candidate identities (any integers that are equal
            exactly for the same passage; padding is read only through ``mask``).
        normalized: ``(B, T, M)`` float64 normalized scores.
        mask: ``(B, T, M)`` bool real candidates.

    Returns:
        ``(B, T-1, M, 1)`` float64: for the move out of candidate j of turn t, turn
        t+1's normalized score of the same passage if it is among turn t+1's real
        candidates, else turn t+1's lowest real score (0.0 when turn t+1 has none).
        A gather, not a sum: the value does not depend on the width M or the batch.
    """
    following = normalized[:, 1:]
    # shape: (B, T-1, M_from, M_to): the passage of candidate j of turn t is candidate k of turn t+1
    same = (index[:, :-1, :, None] == index[:, 1:, None, :]) & mask[:, 1:, None, :]
    lowest = torch.where(mask[:, 1:], following, _INF).amin(dim=-1, keepdim=True)
    lowest = torch.where(torch.isfinite(lowest), lowest, 0.0)
    # shape: (B, T-1, M_from): the first (the only: IDs are unique in a turn) matching column
    column = same.to(torch.uint8).argmax(dim=-1)
    matched = following.gather(-1, column)
    return torch.where(same.any(dim=-1), matched, lowest).unsqueeze(-1).to(torch.float64)


def gate_features(
    index: Tensor,
    normalized: Tensor,
    mask: Tensor,
    query_embeddings: Optional[Tensor] = None,
    passage_embeddings: Optional[Tensor] = None,
    chunk: int = 256,
) -> Tensor:
    """The gate feature of every move: the cosine with embeddings, else the score-level one.

    Args:
        index: ``(B, T, M)`` long candidate passages: rows of ``passage_embeddings`` when
            given (padding clamped to row 0, masked out after), else any identities.
        normalized: ``(B, T, M)`` float64 normalized scores. mask: ``(B, T, M)`` bool.
        query_embeddings: ``(B, T, D)`` or None. passage_embeddings: ``(P, D)`` or None
            (both or neither).
        chunk: conversations per step of the cosine (``(chunk, T, M, D)`` gathered embeddings).

    Returns:
        ``(B, T-1, M, 1)`` float64; 0.0 at moves out of padding (or into a turn without
        candidates).

    Raises:
        MapMatchedValueError: only one of the embeddings, or query embeddings of another
            (B, T).
    """
    if (query_embeddings is None) != (passage_embeddings is None):
        raise MapMatchedValueError("gate_features needs both the query and the passage embeddings, or neither")
    if query_embeddings is not None:
        if tuple(query_embeddings.shape[:2]) != tuple(mask.shape[:2]) or query_embeddings.dim() != 3:
            raise MapMatchedValueError(
                f"query_embeddings must be (B, T, D) with (B, T) = {tuple(mask.shape[:2])}, "
                f"got {tuple(query_embeddings.shape)}"
            )
        queries, passages = query_embeddings.to(mask.device), passage_embeddings.to(mask.device)
        if passages.dim() != 2 or passages.shape[1] != queries.shape[2]:
            raise MapMatchedValueError(
                f"passage_embeddings must be (P, D) with D = {queries.shape[2]}, got {tuple(passages.shape)}"
            )
        parts = [
            query_source_cosine(queries[start:start + chunk], passages[index[start:start + chunk].clamp_min(0)])
            for start in range(0, index.shape[0], chunk)
        ]
        features = torch.cat(parts).to(torch.float64) if parts else normalized.new_zeros((0, 0, 0, 1))
    else:
        features = score_match_features(index, normalized, mask)
    # shape: (B, T-1, M, 1): a real source candidate with a real next turn
    sources = (mask[:, :-1] & mask[:, 1:].any(dim=-1, keepdim=True)).unsqueeze(-1)
    return torch.where(sources, features, 0.0)


def step_features(
    previous: Tensor,
    previous_mask: Tensor,
    index: Tensor,
    normalized: Tensor,
    mask: Tensor,
    query_embeddings: Optional[Tensor] = None,
    passage_embeddings: Optional[Tensor] = None,
) -> Tensor:
    """:func:`gate_features` of one step of S conversations (a session's turn, the server's step).

    The two turns are stacked into a ``(S, 2, M)`` trellis and handed to
    :func:`gate_features`, so a step's features are the evaluation's for the same two
    turns, bit for bit.

    Args:
        previous: ``(S, M)`` long the previous turn's candidates (rows of
            ``passage_embeddings`` with embeddings, else identities comparable with
            ``index``). previous_mask: ``(S, M)`` bool (all False: no previous turn).
        index: ``(S, M)`` long the new turn's candidates (identities; unused with embeddings).
        normalized: ``(S, M)`` float64 the new turn's normalized scores. mask: ``(S, M)`` bool.
        query_embeddings: ``(S, D)`` the new turn's query embeddings, or None.
        passage_embeddings: ``(P, D)``, or None (both or neither).

    Returns:
        ``(S, M, 1)`` float64: the feature of the move out of each previous candidate.
    """
    # shape: (S, 2, M)
    stacked_index = torch.stack([previous, index if query_embeddings is None else torch.zeros_like(index)], dim=1)
    stacked_normalized = torch.stack([torch.zeros_like(normalized), normalized], dim=1).to(torch.float64)
    stacked_mask = torch.stack([previous_mask, mask], dim=1)
    queries = None
    if query_embeddings is not None:
        # shape: (S, 2, D): the previous turn's query is not read (the cosine is the new query's)
        queries = torch.stack([torch.zeros_like(query_embeddings), query_embeddings], dim=1)
    return gate_features(stacked_index, stacked_normalized, stacked_mask, queries, passage_embeddings)[:, 0]
