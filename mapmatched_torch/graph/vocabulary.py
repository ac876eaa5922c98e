"""The chunk-ID vocabulary of a tensor graph: string IDs <-> int64 node indices.

Chunk IDs are strings at the edges of the system and int64 node indices inside it
(docs/design.md, "Data flow"). A :class:`ChunkVocabulary` numbers N unique, non-empty IDs
0..N-1 in their given order.

Index codes used throughout :mod:`mapmatched_torch.graph`:

- ``0 <= i < N``: the node with that index.
- ``-1``: padding, or an unknown ID when distinct codes were not asked for.
- ``<= -2`` (only with ``distinct_unknown=True``): an ID the graph does not know.
  Equal unknown IDs share one code (``-2`` for the first one met, ``-3`` for the next,
  ...), so distance code can honour docs/spec.md's ``d(a, a) = 0`` for unknown IDs while
  keeping two *different* unknown IDs apart (they are ``maximum_distance`` apart).
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ..core.checks import check_chunk_id
from ..core.errors import MapMatchedValueError

__all__ = ["ChunkVocabulary", "PADDING_INDEX"]

#: The index of padding entries (and of unknown IDs without distinct codes).
PADDING_INDEX = -1


class ChunkVocabulary:
    """A bijection between N chunk IDs and the node indices 0..N-1.

    Args:
        chunk_ids: unique, non-empty string IDs; index ``i`` is the ``i``-th one.

    Raises:
        ValueError: an empty or non-string ID, or a duplicate (the message names it).

    Cost: O(N) time and memory to build; each lookup is a dict access.

    Example:
        >>> vocabulary = ChunkVocabulary(["a", "b", "c"])
        >>> vocabulary.index(["c", "zzz", "a"]).tolist()
        [2, -1, 0]
        >>> vocabulary.index(["x", "c", "y", "x"], distinct_unknown=True).tolist()
        [-2, 2, -3, -2]
        >>> vocabulary.ids(torch.tensor([1, 0]))
        ['b', 'a']
    """

    __slots__ = ("_ids", "_positions", "_rank")

    def __init__(self, chunk_ids: Iterable[str]) -> None:
        if isinstance(chunk_ids, (str, bytes)):
            raise MapMatchedValueError(f"chunk_ids must be an iterable of IDs, not a string: {chunk_ids!r}")
        ids = tuple(chunk_ids)
        positions: Dict[str, int] = {}
        for position, chunk_id in enumerate(ids):
            check_chunk_id(chunk_id, f"chunk ID {position}")
            if positions.setdefault(chunk_id, position) != position:
                raise MapMatchedValueError(
                    f"duplicate chunk ID {chunk_id!r} at positions {positions[chunk_id]} and {position}"
                )
        self._ids: Tuple[str, ...] = ids
        self._positions = positions
        self._rank: Optional[torch.Tensor] = None

    @property
    def chunk_ids(self) -> Tuple[str, ...]:
        """Every ID, in index order."""
        return self._ids

    def __len__(self) -> int:
        """N, the number of IDs."""
        return len(self._ids)

    def __contains__(self, chunk_id: object) -> bool:
        """Whether ``chunk_id`` is in the vocabulary. O(1)."""
        return chunk_id in self._positions

    def __iter__(self) -> Iterator[str]:
        """The IDs in index order."""
        return iter(self._ids)

    def __getitem__(self, index: int) -> str:
        """The ID of node ``index`` (Python indexing rules)."""
        return self._ids[index]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChunkVocabulary) and other._ids == self._ids

    def __hash__(self) -> int:
        return hash(self._ids)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={len(self._ids)})"

    def index_of(self, chunk_id: str) -> int:
        """The index of one ID, or ``-1`` when it is unknown."""
        return self._positions.get(chunk_id, PADDING_INDEX)

    def indices_of(self, chunk_ids: Iterable[str]) -> List[int]:
        """The index of each ID (``-1`` where unknown), as a plain list: no tensor, for
        callers that keep per-ID Python state anyway."""
        if isinstance(chunk_ids, (str, bytes)):
            raise MapMatchedValueError(f"chunk_ids must be an iterable of IDs, not a string: {chunk_ids!r}")
        found = list(map(self._positions.get, chunk_ids))
        if None in found:
            found = [PADDING_INDEX if index is None else index for index in found]
        return found

    def index(
        self,
        chunk_ids: Iterable[str],
        *,
        distinct_unknown: bool = False,
        device: Union[torch.device, str, None] = None,
    ) -> torch.Tensor:
        """The node indices of a sequence of IDs.

        Args:
            chunk_ids: the IDs to look up (unknown ones allowed).
            distinct_unknown: if False (default) every unknown ID becomes ``-1``; if
                True the unknown IDs get the codes ``-2, -3, ...`` in order of first
                appearance, equal IDs sharing one code (see the module docstring).
                The codes are numbered per call: look up every ID that will be
                compared in one call.
            device: where the result goes (default: CPU).

        Returns:
            ``(len(chunk_ids),)`` int64 tensor.

        Cost: O(n) dict lookups.
        """
        if isinstance(chunk_ids, (str, bytes)):
            raise MapMatchedValueError(f"chunk_ids must be an iterable of IDs, not a string: {chunk_ids!r}")
        codes: Dict[str, int] = {}
        result: List[int] = []
        for chunk_id in chunk_ids:
            position = self._positions.get(chunk_id)
            if position is None:
                position = codes.setdefault(chunk_id, -2 - len(codes)) if distinct_unknown else PADDING_INDEX
            result.append(position)
        return torch.tensor(result, dtype=torch.long, device=device)

    def ids(self, indices: Union[torch.Tensor, Sequence[int]]) -> List[str]:
        """The IDs of node indices.

        Args:
            indices: a 1-D integer tensor or a sequence of ints, each in ``[0, N)``.

        Returns:
            A list of IDs, in the order of ``indices``.

        Raises:
            ValueError: an index outside ``[0, N)`` (padding and unknown codes have no ID).
        """
        values = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
        size = len(self._ids)
        for position, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
                raise MapMatchedValueError(
                    f"node index {value!r} at position {position} is not in [0, {size})"
                )
        return [self._ids[value] for value in values]

    def rank(self, device: Union[torch.device, str, None] = None) -> torch.Tensor:
        """Each node's position in the sorted order of the IDs.

        Sorting by ``rank`` equals sorting by chunk ID (Python ``str`` order), which is
        the tie-break of :meth:`~mapmatched_torch.graph.TensorCorpusGraph.neighborhood`.

        Returns:
            ``(N,)`` int64 tensor on ``device`` (computed once, O(N log N)).
        """
        if self._rank is None:
            order = sorted(range(len(self._ids)), key=self._ids.__getitem__)
            rank = torch.empty(len(order), dtype=torch.long)
            rank[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
            self._rank = rank
        return self._rank.to(device) if device is not None else self._rank
