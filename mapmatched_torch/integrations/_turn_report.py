"""What the framework retriever adapters (LangChain, LlamaIndex) report about a turn.

:func:`context_contents` and :func:`entry_metadata` turn a
:class:`~mapmatched_torch.core.models.RetrievalResult` into what each adapter's documents
carry (the context chunks with their roles, scores and texts), so both ecosystems
report a turn identically.

No framework is imported here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..core.models import DecoderCandidate, RetrievalResult
from ..core.scoring import normalize_candidates
from ._chunk_text import _warn_unknown_text

__all__ = [
    "ContextEntry",
    "ROLES",
    "context_contents",
    "context_entries",
    "entry_metadata",
]

#: The ``role`` of a context chunk: the decoded chunk of the turn; another candidate of
#: the turn; a chunk that only the graph neighbourhood brought in.
ROLES = ("decoded", "candidate", "neighbor")


@dataclasses.dataclass(frozen=True)
class ContextEntry:
    """One chunk of a turn's context, with why it is there.

    Attributes:
        chunk_id: the chunk.
        role: ``"decoded"`` (position 0), ``"candidate"`` (another candidate of this
            turn) or ``"neighbor"`` (brought in by the graph neighbourhood only).
        context_rank: position in ``result.context_chunk_ids``.
        candidate: the turn's :class:`DecoderCandidate` for this chunk (raw and
            normalized score), None for a neighbor.
        provider_rank: the candidate's position in provider order, None for a neighbor.
        trajectory_score: the best path score ending at this candidate
            (``result.candidate_ranking``), None when not ranked.
    """

    chunk_id: str
    role: str
    context_rank: int
    candidate: Optional[DecoderCandidate]
    provider_rank: Optional[int]
    trajectory_score: Optional[float]


def context_entries(result: RetrievalResult, score_normalization: str) -> Tuple[ContextEntry, ...]:
    """The context of ``result`` in order (decoded chunk first), with roles and scores
    (``score_normalization``: the retriever's, which normalized the turn: the entries'
    candidates are the trellis states the session decoded, rebuilt from the result's
    raw candidates)."""
    normalized = normalize_candidates(result.candidates, score_normalization)
    candidates = {candidate.chunk_id: (rank, candidate) for rank, candidate in enumerate(normalized)}
    trajectory = {ranked.chunk_id: ranked.trajectory_score for ranked in result.candidate_ranking}
    entries = []
    for position, chunk_id in enumerate(result.context_chunk_ids):
        rank, candidate = candidates.get(chunk_id, (None, None))
        role = "decoded" if position == 0 else ("candidate" if candidate is not None else "neighbor")
        entries.append(ContextEntry(chunk_id, role, position, candidate, rank, trajectory.get(chunk_id)))
    return tuple(entries)


def entry_metadata(entry: ContextEntry, result: RetrievalResult, text_known: bool) -> Dict[str, Any]:
    """The per-chunk report an adapter puts under its ``metadata_key`` (plain values).

    Keys: ``chunk_id``, ``role``, ``context_rank``, ``turn_index``, ``raw_score``,
    ``normalized_score``, ``provider_rank``, ``trajectory_score`` (None for a
    neighbor), ``text_known``, ``trace_step`` (the turn's
    :class:`~mapmatched_torch.core.models.TraceStep` as a dict: scores, distance,
    transition, move, entropy, margin, cumulative score, runner-up),
    ``path_chunk_ids`` and ``revised_prior_indices`` (of the whole conversation).
    """
    step = result.trace.steps[-1]
    candidate = entry.candidate
    return {
        "chunk_id": entry.chunk_id,
        "role": entry.role,
        "context_rank": entry.context_rank,
        "turn_index": step.turn_index,
        "raw_score": None if candidate is None else candidate.raw_score,
        "normalized_score": None if candidate is None else candidate.normalized_score,
        "provider_rank": entry.provider_rank,
        "trajectory_score": entry.trajectory_score,
        "text_known": text_known,
        "trace_step": dataclasses.asdict(step),
        "path_chunk_ids": list(result.trace.path_chunk_ids),
        "revised_prior_indices": list(result.trace.revised_prior_indices),
    }


def _resolve_contents(
    chunk_ids: Sequence[str],
    lookup: Optional[Callable[[str], Any]],
    lookup_name: str,
    provider: Any,
    method: str,
    accept: Tuple[type, ...],
    feature: str,
) -> Dict[str, Any]:
    """The content known for each of ``chunk_ids`` (unknown ones are left out).

    The user's ``lookup`` is asked first, chunk by chunk; the chunks it does not give
    go in one call to the provider's ``method`` (``get_documents`` / ``get_nodes``:
    chunk IDs -> {chunk ID: content}) when the provider has one. A lookup that raises
    or gives something not in ``accept`` is a warning and counts as not found there
    (the provider is asked); a provider method that raises or gives such content is a
    warning too, and those chunks stay unknown.
    """
    names = [kind.__name__ for kind in accept]
    expected = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    found: Dict[str, Any] = {}

    def take(chunk_id: str, content: Any, origin: str) -> None:
        if content is None:
            return
        if isinstance(content, accept):
            found[chunk_id] = content
        else:
            _warn_unknown_text(feature, [chunk_id], f"{origin} gave {type(content).__name__}, not {expected}")

    if lookup is not None:
        for chunk_id in chunk_ids:
            try:
                content = lookup(chunk_id)
            except Exception as error:
                _warn_unknown_text(feature, [chunk_id], f"{lookup_name}= raised {type(error).__name__}: {error}")
                continue
            take(chunk_id, content, f"{lookup_name}=")
    rest = [chunk_id for chunk_id in chunk_ids if chunk_id not in found]
    getter = getattr(provider, method, None)
    if rest and callable(getter):
        origin = f"{type(provider).__name__}.{method}()"
        try:
            from_provider = getter(rest)
        except Exception as error:
            _warn_unknown_text(feature, rest, f"{origin} raised {type(error).__name__}: {error}")
            from_provider = {}
        for chunk_id in rest:
            if chunk_id in from_provider:
                take(chunk_id, from_provider[chunk_id], origin)
    return found


def context_contents(
    result: RetrievalResult,
    provider: Any,
    lookup: Optional[Callable[[str], Any]],
    *,
    lookup_name: str,
    method: str,
    accept: Tuple[type, ...],
    missing_text: str,
    feature: str,
    score_normalization: str,
) -> List[Tuple[ContextEntry, Any]]:
    """The context of a decoded turn, as ``(entry, content)`` pairs in context order
    (``score_normalization``: the retriever's, see :func:`context_entries`).

    ``content`` is what ``lookup`` (the user's ``lookup_name=``) or else the provider's
    ``method`` gave for the chunk -- an instance of one of ``accept`` -- or None when
    the text is unknown. Unknown chunks are left out with ``missing_text="skip"``,
    except the decoded chunk, which is always first.

    Nothing here raises for a chunk: the turn is already decoded and committed, so a
    lookup that raises, or gives something not in ``accept``, is a ``UserWarning``
    naming the chunk and the reason (see :func:`_resolve_contents`).
    """
    entries = context_entries(result, score_normalization)
    contents = _resolve_contents([e.chunk_id for e in entries], lookup, lookup_name, provider, method, accept, feature)
    return [
        (entry, contents.get(entry.chunk_id))
        for entry in entries
        if entry.chunk_id in contents or missing_text == "empty" or entry.role == "decoded"
    ]
