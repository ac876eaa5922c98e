"""The seams of the library (docs/spec.md sections 4-6), as runtime-checkable Protocols.

Any object with these methods plugs in; tests pass plain fixture classes.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence, Tuple, Type, TypeGuard, TypeVar, runtime_checkable

from .checks import check_sequence, describe
from .errors import MapMatchedTypeError, MapMatchedValueError
from .models import DecodedPath, DecoderCandidate, ScoredCandidate

__all__ = [
    "CorpusGraph",
    "Decoder",
    "CandidateProvider",
    "CandidatesMethod",
    "PROVIDER_METHODS",
    "contextual_call",
    "contextual_batch_call",
    "as_scored_candidates",
    "Trellis",
    "implements",
    "missing_members",
    "provider_answer",
]

_Protocol = TypeVar("_Protocol")

#: One non-empty candidate list per turn, in turn order.
Trellis = Sequence[Sequence[DecoderCandidate]]


@runtime_checkable
class CorpusGraph(Protocol):
    """A corpus graph with bounded shortest-path distances (docs/spec.md section 4).

    mapmatched 0.1.0's three members, and all the library calls: the decoders call
    :meth:`distance` (and read :attr:`maximum_distance`), the sessions' and the
    server's context expansion calls :meth:`neighborhood` (chunk IDs). Our graphs also
    have ``neighborhood_distances(chunk_id, radius)``, the same nodes with their
    distances, which the library never needs.
    """

    @property
    def maximum_distance(self) -> float:
        """The bound: unreachable, too-far and unknown pairs get this distance."""
        ...

    def distance(self, source_chunk_id: str, target_chunk_id: str) -> float:
        """Bounded shortest-path distance; 0.0 when the IDs are equal."""
        ...

    def neighborhood(self, chunk_id: str, radius: float) -> Tuple[str, ...]:
        """The chunk IDs of every other node within ``min(radius, maximum_distance)``
        (inclusive), ordered by (distance, chunk ID)."""
        ...


@runtime_checkable
class Decoder(Protocol):
    """Decodes a trellis into the best path (docs/spec.md section 5); upstream
    mapmatched's protocol, member for member.

    ``decode`` is called with every argument after the trellis by keyword (``graph=``
    too), so an implementation may make them keyword-only, as upstream's do. A session
    also uses, when the decoder has them:

    - ``decode_ranked(trellis, *, graph, emission_weight, transition_weight,
      fixed_lag=None) -> (DecodedPath, tuple of CandidateScore)``: the path and the
      final turn's candidates ranked by trajectory score (without it,
      ``RetrievalResult.candidate_ranking`` is ``()``, as upstream);
    - ``stream(graph, width, *, emission_weight, transition_weight, fixed_lag)``: an
      incremental decoder (:class:`~mapmatched_torch.TorchDecoder`'s).

    The session, not the decoder, says which turns are committed (``T - L - 1``), so a
    decoder returning a path without the lag fields reports like any other.
    """

    def decode(
        self,
        trellis: Trellis,
        *,
        graph: CorpusGraph,
        emission_weight: float,
        transition_weight: float,
        fixed_lag: Optional[int] = None,
    ) -> DecodedPath:
        ...


@runtime_checkable
class CandidateProvider(Protocol):
    """Any retriever: up to ``limit`` scored candidates for a query, best first.

    ``candidates(query, limit)`` is upstream mapmatched's method (called with ``limit``
    positional or as ``limit=``); every provider of this library also has it, as
    :class:`CandidatesMethod` gives it, under its own name ``retrieve(query, limit)``.
    The library asks a provider through :func:`provider_answer`: its ``retrieve`` when
    it has one, else its ``candidates``, so an object with either method plugs in (the
    ``isinstance`` check of this protocol looks for ``candidates``). The answer is a
    sequence of :class:`~mapmatched_torch.core.models.ScoredCandidate` (or
    ``(chunk_id, score)`` pairs, or objects with ``chunk_id`` and ``score``).
    """

    def candidates(self, query: str, limit: int) -> Sequence[ScoredCandidate]:
        ...


#: The provider methods :func:`provider_answer` looks for, in order of preference.
PROVIDER_METHODS = ("retrieve", "candidates")


def _asked_in_context(provider: Any, method: str, keyword: str) -> Optional[Callable[..., Any]]:
    """``ask(query or queries, limit, context chunk ID(s), previous query or queries)``
    through ``provider.<method>``, or None when it has no such method; the previous
    query goes in as ``keyword=`` only when ``provider.uses_previous_query`` is true."""
    bound = getattr(provider, method, None)
    if not callable(bound):
        return None
    if getattr(provider, "uses_previous_query", False):
        return lambda asked, limit, chunk_ids, previous: bound(asked, limit, chunk_ids, **{keyword: previous})
    return lambda asked, limit, chunk_ids, previous: bound(asked, limit, chunk_ids)


def contextual_call(provider: Any) -> Optional[Callable[..., Any]]:
    """``ask(query, limit, context_chunk_id, previous_query)`` for a provider with
    ``retrieve_in_context`` (None for any other): the previous query is passed on only
    to a provider whose ``uses_previous_query`` is true, so a three-argument
    :class:`~mapmatched_torch.providers.query_mixing.ContextualProvider` keeps working.
    Sessions and the server both ask this way."""
    return _asked_in_context(provider, "retrieve_in_context", "previous_query")


def searched_query(answer: Any, query: Optional[str]) -> Optional[str]:
    """What a session (or the server) keeps as its previous query after a turn.

    Args:
        answer: the provider's answer for the turn. query: the turn's query text (None:
            the turn came as candidates).

    Returns:
        the answer's ``searched_query`` when it has one equal to ``query`` (a recurrent
        :class:`~mapmatched_torch.providers.query_mixing.QueryMixingProvider` answers
        with the query text that also carries the vector it searched, a
        :class:`~mapmatched_torch.providers.query_mixing.SearchedQuery`, handed back to
        it at the next turn); else ``query`` itself.
    """
    found = getattr(answer, "searched_query", None)
    return found if query is not None and isinstance(found, str) and found == query else query


def contextual_batch_call(provider: Any) -> Optional[Callable[..., Any]]:
    """``ask(queries, limit, context_chunk_ids, previous_queries)`` for a provider with
    ``retrieve_batch_in_context`` (None for any other), as :func:`contextual_call`."""
    return _asked_in_context(provider, "retrieve_batch_in_context", "previous_queries")


def provider_answer(provider: object) -> Tuple[str, Callable[[str, int], Sequence[Any]]]:
    """How the library asks ``provider`` for candidates: ``(method name, bound method)``
    of its ``retrieve(query, limit)``, else its ``candidates(query, limit)`` (the
    :class:`CandidateProvider` rule; every call site -- session, server, adapters,
    fusion, the eval harness -- goes through here).

    Raises:
        MapMatchedTypeError: (a ValueError and a TypeError) the provider has neither
            method; the message names its type.

    Example:
        >>> class Upstream:
        ...     def candidates(self, query, limit):
        ...         return ()
        >>> provider_answer(Upstream())[0]
        'candidates'
    """
    for name in PROVIDER_METHODS:
        method = getattr(provider, name, None)
        if callable(method):
            return name, method
    raise MapMatchedTypeError(
        f"provider must implement the CandidateProvider protocol: a candidates(query, limit) "
        f"(or retrieve(query, limit)) method; {type(provider).__name__} has neither"
    )


class CandidatesMethod:
    """Base class of this library's providers: upstream's ``candidates(query, limit)``
    is the subclass's ``retrieve(query, limit)`` (the same answer, the same errors)."""

    __slots__ = ()

    def candidates(self, query: str, limit: int) -> Sequence[ScoredCandidate]:
        """The :class:`CandidateProvider` method: ``self.retrieve(query, limit)``."""
        return self.retrieve(query, limit)  # type: ignore[attr-defined]


def as_scored_candidates(candidates: Iterable[Any], what: str = "candidates") -> Tuple[ScoredCandidate, ...]:
    """A provider's answer as :class:`ScoredCandidate` objects.

    Args:
        candidates: one turn's candidates, in provider order: ScoredCandidate objects,
            ``(chunk_id, score)`` pairs, or any objects with ``chunk_id`` and ``score``
            attributes (upstream mapmatched reads only those two).
        what: names them in error messages (``"candidates"``, or
            ``"candidates from P.candidates(query, limit)"``).

    Returns:
        The candidates as a tuple of :class:`ScoredCandidate`, in input order (a
        ScoredCandidate is kept as it is).

    Raises:
        MapMatchedTypeError: (a ValueError and a TypeError) ``candidates`` is not a
            sequence (None, a number, a string), or an entry is none of the three; the
            message names ``what`` and the position.
        MapMatchedValueError: a bad chunk ID or score (naming the position).
    """
    if isinstance(candidates, (list, tuple)) and set(map(type, candidates)) == {ScoredCandidate}:
        return tuple(candidates)  # the common case, checked in C
    result = []
    expected = "a sequence of ScoredCandidate, (chunk_id, score) pairs or objects with chunk_id and score"
    for position, candidate in enumerate(check_sequence(candidates, what, expected)):
        if isinstance(candidate, ScoredCandidate):
            result.append(candidate)
            continue
        if isinstance(candidate, tuple) and len(candidate) == 2:
            fields = candidate
        elif hasattr(candidate, "chunk_id") and hasattr(candidate, "score"):
            fields = (candidate.chunk_id, candidate.score)
        else:
            raise MapMatchedTypeError(
                f"{what}: candidate {position} must be a ScoredCandidate, a (chunk_id, score) pair or an object "
                f"with chunk_id and score, got {describe(candidate)}"
            )
        try:
            result.append(ScoredCandidate(*fields))
        except MapMatchedValueError as error:
            raise type(error)(f"{what}: candidate {position}: {error}") from None
    return tuple(result)


def implements(graph: object, protocol: Type[_Protocol]) -> TypeGuard[_Protocol]:
    """``isinstance(graph, protocol)`` for a runtime-checkable Protocol: whether
    ``graph`` has every member of it (attributes looked up as ``hasattr`` does, so a
    proxy's ``__getattr__`` counts).

    Args:
        graph: any object.
        protocol: a Protocol class, e.g. :class:`CorpusGraph` or
            :class:`~mapmatched_torch.graph.TensorGraph`.

    Cost: one ``hasattr`` per member (the names are listed once per protocol), where
    ``isinstance`` on Python < 3.12 lists them again on every call (~50 microseconds).

    Example:
        >>> from mapmatched_torch.standalone.graph import InMemoryCorpusGraph
        >>> implements(InMemoryCorpusGraph.from_edges([("a", "b")]), CorpusGraph)
        True
        >>> implements(object(), CorpusGraph)
        False
    """
    return not missing_members(graph, protocol)


def missing_members(graph: object, protocol: type) -> Tuple[str, ...]:
    """The members of ``protocol`` that ``graph`` lacks, sorted (empty: it implements
    it); for error messages that say what is missing.

    Example:
        >>> missing_members(object(), CorpusGraph)
        ('distance', 'maximum_distance', 'neighborhood')
    """
    return tuple(name for name in _members(protocol) if not hasattr(graph, name))


@functools.lru_cache(maxsize=None)
def _members(protocol: type) -> Tuple[str, ...]:
    """The public member names of a Protocol and the Protocols it extends (each of
    which names ``Protocol`` among its bases, PEP 544)."""
    names = set()
    for cls in protocol.__mro__:
        if Protocol not in cls.__bases__:
            continue
        names.update(name for name in (*vars(cls), *getattr(cls, "__annotations__", {})) if not name.startswith("_"))
    return tuple(sorted(names))
