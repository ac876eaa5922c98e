"""The server's device step captured in a CUDA graph: a batch of a fixed size replayed
with one launch.

:meth:`MapMatchedServer.step_slots(..., synchronize=False) <mapmatched_torch.serving.MapMatchedServer.step_slots>`
reads nothing back to the host, so with a fixed number of rows S and candidate columns K
the whole step (checks, normalization, distances from the dense table, the max-plus step
and backtrack, the writes to the slot table, contexts from the precomputed context
table) can be recorded once with ``torch.cuda.graph`` and replayed: one launch of the
graph instead of some hundreds of kernel launches and their Python.

What a replay does not do (the Python that the capture ran once):

- grow the slot table: :meth:`MapMatchedServer.capture` reserves ``turns`` turns per
  session ahead; a replay that could exceed them raises before touching anything
  (capture again with more turns);
- keep an undo log: a replayed step cannot be taken back with ``undo_last`` (a row that
  fails inside the step is still left untouched, as in any step);
- open or close sessions: do that between replays, as usual (slots are inputs).

Written for CUDA and tested under the ``cuda`` marker; not yet run on a GPU when
written (no device was lent).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Tuple

import torch

from ..core.errors import MapMatchedValueError
from ..graph.protocols import TensorGraph
from ..core.protocols import implements
from .session_store import TensorStep

if TYPE_CHECKING:  # pragma: no cover
    from .server import MapMatchedServer

__all__ = ["CapturedStep", "capture_step", "cuda_graph_recorder", "Recorder"]


class CapturedStep:
    """A replayable device step of exactly ``batch_size`` rows (see the module docstring).

    Call it like :meth:`MapMatchedServer.step_slots`: ``captured(slots, codes, scores)``
    with ``(S,)`` long slots and ``(S, K)`` codes and scores, S and K as captured (rows
    to leave out: slot -1; they fail with ``UNKNOWN_SLOT`` and change nothing). It
    returns the same :class:`~mapmatched_torch.serving.session_store.TensorStep`
    tensors each time, overwritten by the next replay: copy what you keep.
    """

    def __init__(self, server: "MapMatchedServer", replay: Callable[[], None], inputs: tuple, output: TensorStep,
                 turns: int, memory: tuple) -> None:
        self._server, self._replay, self._inputs, self.output = server, replay, inputs, output
        self._turns, self._memory = turns, memory

    @property
    def batch_size(self) -> int:
        return int(self._inputs[0].shape[0])

    def __call__(self, slots: torch.Tensor, codes: torch.Tensor, scores: torch.Tensor) -> TensorStep:
        static_slots, static_codes, static_scores = self._inputs
        if slots.shape != static_slots.shape or codes.shape != static_codes.shape or scores.shape != codes.shape:
            raise MapMatchedValueError(
                f"a captured step takes ({static_slots.shape[0]},) slots and {tuple(static_codes.shape)} codes and "
                f"scores; got {tuple(slots.shape)}, {tuple(codes.shape)} and {tuple(scores.shape)}"
            )
        server = self._server
        with server._lock:
            decoder = server._store.decoder
            if any(now is not then for now, then in zip(_memory(server), self._memory)):
                raise MapMatchedValueError(
                    "the slot table, the context table or the dense table was replaced since the capture (the server "
                    "grew: more sessions than its capacity, a new chunk's context row, ...): capture again, with "
                    "capacity= and turns sized ahead"
                )
            if decoder._longest_bound + 1 > decoder.turn_capacity:
                decoder.refresh_bound()  # a host read between replays, not inside one
                if decoder._longest_bound + 1 > decoder.turn_capacity:
                    raise MapMatchedValueError(
                        f"a session has used up the {decoder.turn_capacity} turns captured (the slot table cannot "
                        f"grow inside a replay): capture again with more turns"
                    )
            static_slots.copy_(slots)
            static_codes.copy_(codes)
            static_scores.copy_(scores)
            self._replay()
            decoder._longest_bound += 1
            decoder._undo = None
        return self.output


#: records a step: ``record(step, warmup)`` runs ``step()`` ``warmup`` times, then
#: records it, and returns ``(replay, output)``: ``replay()`` runs the recorded step
#: again, writing into the same ``output`` tensors
Recorder = Callable[[Callable[[], TensorStep], int], Tuple[Callable[[], None], TensorStep]]


def cuda_graph_recorder(device: torch.device) -> Recorder:
    """A :data:`Recorder` that captures the step in a CUDA graph on ``device`` (the
    warm-up runs on a side stream, as ``torch.cuda.graph`` wants)."""

    def record(step: Callable[[], TensorStep], warmup: int) -> Tuple[Callable[[], None], TensorStep]:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                step()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = step()
        return graph.replay, output

    return record


def capture_step(server: "MapMatchedServer", batch_size: int, candidates: int, turns: int,
                 contexts: bool, warmup: int, recorder: Optional[Recorder] = None) -> CapturedStep:
    """:meth:`MapMatchedServer.capture`'s work (the server's lock held by the caller).

    ``recorder``: how the step is recorded and replayed (default: a CUDA graph, which
    needs the server on a CUDA device). The tests pass one that replays by running the
    step again into the recorded output tensors, so the bookkeeping around a graph
    (static inputs and outputs, the refusals) is proven without a GPU."""
    store = server._store
    if recorder is None:
        if server.device.type != "cuda" or not torch.cuda.is_available():
            raise MapMatchedValueError(f"capture needs a server on a CUDA device; this one is on {server.device}")
        recorder = cuda_graph_recorder(server.device)
    if not (implements(store.graph, TensorGraph) and (getattr(store.graph, "dense_table", None) is not None
                                                       or getattr(store.graph, "ball_table", None) is not None)):
        raise MapMatchedValueError(
            "capture needs a tensor graph with a dense distance table (graph.precompute_dense()) or a ball table "
            "(graph.precompute_balls()): other distance engines search on the host"
        )
    if contexts and not store.contexts.complete:
        raise MapMatchedValueError("capture with contexts needs server.precompute_contexts() first")
    settings = server.settings
    if settings.score_normalization != "zscore" and settings.emission_weight > 0:
        # large raw scores may need their traces built during the step (a host read)
        raise MapMatchedValueError("capture needs z-score normalization (other normalizations check traces on the host)")
    decoder = store.decoder
    decoder.reserve_turns(turns)
    device = server.device
    static_slots = torch.full((batch_size,), -1, dtype=torch.long, device=device)
    static_codes = torch.full((batch_size, candidates), -1, dtype=torch.long, device=device)
    static_scores = torch.zeros((batch_size, candidates), dtype=torch.float64, device=device)
    inputs = (static_slots, static_codes, static_scores)
    # every row inactive while recording (slots -1): only the spare slot is written
    replay, output = recorder(lambda: store.step(*inputs, contexts=contexts, synchronize=False), warmup)
    decoder._undo = None
    return CapturedStep(server, replay, inputs, output, turns, _memory(server))


def _memory(server: "MapMatchedServer") -> tuple:
    """The tensors a captured graph reads and writes in place: growth replaces them."""
    store = server._store
    graph = store.graph
    return (store.decoder._storage["alphas"], store.contexts._table, graph.dense_table,
            None if graph.ball_table is None else graph.ball_table.neighbors)
