"""The server's chunk codes: every chunk ID its sessions hold, as one int.

The session store (:mod:`.session_store`) keeps candidates as int64 codes, so a step is
tensor work whatever the graph. :class:`ChunkCodes` numbers them:

- with a tensor graph, codes ``0..N-1`` are the graph's node indices (its
  vocabulary), so a step's distances are one ``trellis_distances`` call on the codes;
- every other chunk ID (any ID of a non-tensor graph, or an ID a tensor graph does not
  know) gets the next code ``N, N+1, ...`` in order of arrival: an *extra* code.

Bound and eviction. A provider may return chunk IDs outside the graph without end (a
corpus that moved on), so the extra codes cannot be kept for the server's life. They
are held under a bound: when there are more than :attr:`ChunkCodes.bound` of them
(``max(floor, 2 x the extra codes live sessions held at the last compaction)``; the
floor is the server's ``extra_codes``, default 65,536), the next ``step()`` or
``close()`` of the server compacts them first
(:meth:`~mapmatched_torch.serving.session_store.SessionStore.compact_codes`): the codes
no open session's stored turns refer to are dropped and the others renumbered in
order, into *new* objects (this table, the slot table's codes tensor and the context
table), installed in one commit. So the extra codes are at most ``max(floor, 2 x
referenced)`` plus what one step adds, and a compaction, which reads the whole slot
table, runs once per ``bound - referenced >= bound / 2`` new codes at most.

Why a compaction into new objects, not reference counts or a free list of codes: results
are read lazily. A :class:`~mapmatched_torch.serving.step_results.StepResults` names its
codes (the step's tensors, the slot table's turns) when it is read, possibly long after
the step. A code released and given to another chunk ID would rename what such a result
reads, unless every result were told of every release (a scan of the results held, at
every close). Instead a result keeps the objects of its step (this table, the codes
tensor it read), which a compaction never edits: it replaces them. Old objects live as
long as the results that hold them, and no longer. Reference counts would also cost
every step a scatter over its candidates and every undo its inverse, for a table that
only needs trimming now and then.

What a caller sees: codes below ``N`` (a tensor graph's nodes) never change. An extra
code is valid until the server's next ``step()`` or ``close()``: number chunk IDs with
``server.store.codes`` (the current object, not one kept from before) right before
:meth:`~mapmatched_torch.serving.MapMatchedServer.step_slots`, and name a
:class:`~mapmatched_torch.serving.session_store.TensorStep`'s codes before the next
``step()`` or ``close()``. :class:`StepResults` need nothing: they name their codes
with the objects of their step.
"""

from __future__ import annotations

import threading
from typing import Dict, Iterable, List, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from ..core.errors import MapMatchedValueError
from ..core.protocols import CorpusGraph, implements
from ..graph.protocols import TensorGraph

__all__ = ["ChunkCodes"]


class ChunkCodes:
    """Chunk ID <-> int64 code for one server (see the module docstring).

    Args:
        graph: the server's corpus graph; a tensor graph's node indices are the first codes.
        floor: the extra codes kept before a compaction is due (:attr:`bound`'s least value).

    Memory: one str and about 100 bytes of dict and list entries per extra code, plus an
    object array of every code's name once :meth:`name_rows` has read them.
    """

    def __init__(self, graph: CorpusGraph, floor: int = 65536) -> None:
        tensor_graph = implements(graph, TensorGraph)
        self._graph_names: Sequence[str] = graph.nodes if tensor_graph else ()
        self._graph_lookup = graph.vocabulary.indices_of if tensor_graph else None
        #: N: codes below it are the graph's node indices
        self.graph_nodes = len(self._graph_names)
        #: the extra codes kept at least before a compaction is due
        self.floor = floor
        #: a compaction is due when there are more extra codes than this (see the module docstring)
        self.bound = floor
        self._extra: Dict[str, int] = {}
        self._extra_names: List[str] = []
        self._name_array = np.empty(0, dtype=object)  # every code's name, filled on demand
        self._named = 0  # codes named in it so far
        # results are read from other threads while a step numbers new IDs: the array's
        # growth and fill are one step under this lock
        self._names_lock = threading.Lock()

    def __len__(self) -> int:
        return self.graph_nodes + len(self._extra_names)

    @property
    def extra(self) -> int:
        """The number of extra codes (chunk IDs numbered beyond the graph's nodes)."""
        return len(self._extra_names)

    @property
    def compaction_due(self) -> bool:
        """Whether there are more extra codes than :attr:`bound`."""
        return len(self._extra_names) > self.bound

    def compacted(self, used: Tensor) -> Tuple["ChunkCodes", Tensor]:
        """A new table of the graph's codes and the extra codes ``used`` marks, renumbered
        in their order, and the renumbering; this table is not changed.

        Args:
            used: ``(len(self),)`` bool: the codes still referred to (graph codes are
                kept whatever it says).

        Returns:
            ``(table, mapping)``: the new :class:`ChunkCodes` (its :attr:`bound`
            ``max(floor, 2 x the extra codes kept)``) and ``(len(self),)`` long, each old
            code's new code (``-1``: dropped; graph codes map to themselves).
        """
        nodes = self.graph_nodes
        kept = used[nodes:].to("cpu").nonzero().view(-1).tolist()
        table = ChunkCodes.__new__(ChunkCodes)
        table._graph_names, table._graph_lookup, table.graph_nodes = self._graph_names, self._graph_lookup, nodes
        table.floor, table.bound = self.floor, max(self.floor, 2 * len(kept))
        names = self._extra_names
        table._extra_names = [names[position] for position in kept]
        table._extra = {name: nodes + position for position, name in enumerate(table._extra_names)}
        table._name_array, table._named, table._names_lock = np.empty(0, dtype=object), 0, threading.Lock()
        mapping = torch.full((len(self),), -1, dtype=torch.long)
        mapping[:nodes] = torch.arange(nodes)
        if kept:
            mapping[nodes + torch.tensor(kept, dtype=torch.long)] = torch.arange(nodes, nodes + len(kept))
        return table, mapping

    def codes(self, chunk_ids: Iterable[str]) -> List[int]:
        """The code of each ID, new IDs numbered now."""
        ids = list(chunk_ids)
        found = self._graph_lookup(ids) if self._graph_lookup is not None else [-1] * len(ids)
        if min(found, default=0) < 0:
            extra = self._extra
            for position, (chunk_id, code) in enumerate(zip(ids, found)):
                if code < 0:
                    code = extra.get(chunk_id)
                    if code is None:
                        code = extra[chunk_id] = len(self)
                        self._extra_names.append(chunk_id)
                    found[position] = code
        return found

    def name(self, code: int) -> str:
        """The chunk ID of one code."""
        nodes = self.graph_nodes
        return self._graph_names[code] if code < nodes else self._extra_names[code - nodes]

    __getitem__ = name

    def names(self, codes: Iterable[int]) -> List[str]:
        """The chunk IDs of codes (``-1``: None)."""
        nodes, graph_names, extra_names = self.graph_nodes, self._graph_names, self._extra_names
        return [
            None if code < 0 else graph_names[code] if code < nodes else extra_names[code - nodes] for code in codes
        ]

    def name_rows(self, codes: Tensor) -> List[Tuple[str, ...]]:
        """Each row's chunk IDs, in order, of its codes ``>= 0`` (``-1``: skipped).

        Args:
            codes: (S, C) long codes, each in ``[-1, len(self))``.

        Returns:
            S tuples of chunk IDs: ``tuple(n for n in names(row) if n is not None)`` per
            row, looked up through one object array of every name (one vectorized
            gather, not a Python step per code).
        """
        values = codes.detach().to("cpu", torch.long).numpy()
        if values.ndim != 2:
            raise MapMatchedValueError(f"name_rows takes (S, C) codes, got shape {tuple(values.shape)}")
        kept = values >= 0
        if not kept.any():
            return [() for _ in range(values.shape[0])]
        named = self._names()[np.where(kept, values, 0)].tolist()
        counts = kept.sum(1)
        if bool((kept == (np.arange(values.shape[1]) < counts[:, None])).all()):  # codes first, then -1s
            return [tuple(row[:count]) for row, count in zip(named, counts.tolist())]
        return [tuple(name for name, keep in zip(row, flags) if keep) for row, flags in zip(named, kept.tolist())]

    def _names(self) -> np.ndarray:
        """The object array of every code's name (grown by doubling, new names appended).

        Safe beside a concurrent :meth:`codes` (names are only appended, so the slice up
        to the length read here is fixed) and beside other readers (the lock)."""
        with self._names_lock:
            total = len(self)
            if self._name_array.shape[0] < total:
                grown = np.empty(max(total, 2 * self._name_array.shape[0]), dtype=object)
                grown[: self._named] = self._name_array[: self._named]
                self._name_array = grown
            if self._named < total:
                if self._named < self.graph_nodes:
                    self._name_array[self._named : self.graph_nodes] = list(self._graph_names[self._named :])
                    self._named = self.graph_nodes
                nodes = self.graph_nodes
                self._name_array[self._named : total] = self._extra_names[self._named - nodes : total - nodes]
                self._named = total
            return self._name_array

    def graph_codes(self, codes: Tensor) -> Tensor:
        """``codes`` as a tensor graph's ``trellis_distances`` takes them: node indices
        kept, ``-1`` padding kept, every other chunk its own unknown code ``<= -2``."""
        return torch.where(codes >= self.graph_nodes, self.graph_nodes - 2 - codes, codes)

    # ------------------------------------------------------------ persistence

    def state_dict(self) -> List[str]:
        """The codes beyond the graph's nodes, as their chunk IDs in code order."""
        return list(self._extra_names)

    def load_state_dict(self, extra: Sequence[str]) -> None:
        """Restore :meth:`state_dict` (MapMatchedValueError, nothing changed, if malformed)."""
        if not isinstance(extra, (list, tuple)) or not all(isinstance(name, str) for name in extra):
            raise MapMatchedValueError(f"refusing the chunk codes: expected a list of chunk IDs, got {type(extra).__name__}")
        if len(set(extra)) != len(extra):
            raise MapMatchedValueError("refusing the chunk codes: a chunk ID appears twice")
        if self._graph_lookup is not None and max(self._graph_lookup(list(extra)), default=-1) >= 0:
            raise MapMatchedValueError("refusing the chunk codes: an extra chunk ID is a node of this graph")
        self._extra_names = list(extra)
        self._extra = {name: self.graph_nodes + position for position, name in enumerate(extra)}
        with self._names_lock:
            self._named = min(self._named, self.graph_nodes)  # the extra names are new
