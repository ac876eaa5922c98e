"""The device step (``step_slots(synchronize=False)``): no host read from the tensors
given to the TensorStep returned, every tensor on the server's device, values equal to
the synchronizing step's; and its CUDA-graph capture (serving/capture.py), which needs it.

The no-host-read test intercepts every operation of the step (record_host_reads: a
TorchFunctionMode and a TorchDispatchMode) on the dense-table path, with and without the
precomputed context table. On the CPU it runs on the torch path (what a GPU without
Triton runs; numba and Triton's interpreter read host memory by design); on CUDA, with
the default kernels.
"""

from __future__ import annotations

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.graph import TensorCorpusGraph
from mapmatched_torch.kernels import use_backend
from mapmatched_torch.serving import MapMatchedServer
from mapmatched_torch.serving.session_store import StepCode
from mapmatched_torch.testing import record_host_reads

NODES = 30


def graph_on(device, distances="dense"):
    """A 30-node graph on ``device`` whose distances come from a dense table or a ball table."""
    names = [f"n{i}" for i in range(NODES)]
    edges = [(names[i], names[(i + 1) % NODES]) for i in range(NODES)]
    edges += [(names[i], names[(i + 7) % NODES], 0.5 + (i % 3) * 0.5) for i in range(NODES)]
    graph = TensorCorpusGraph.from_edges(edges, maximum_distance=2.5).to(device)
    graph.precompute_dense() if distances == "dense" else graph.precompute_balls()
    return graph


def servers(device, lag, contexts, sessions=5, distances="dense", **options):
    made = []
    for _ in range(2):
        server = MapMatchedServer(graph_on(device, distances), candidate_limit=5, fixed_lag=lag, turn_capacity=16,
                                  device=device, **options)
        for index in range(sessions):
            server.open(f"s{index}")
        if contexts:
            server.precompute_contexts()
        made.append(server)
    return made


BAD = [StepCode.NONFINITE_SCORE, StepCode.EMPTY, StepCode.UNKNOWN_SLOT]


def turn(generator, device, sessions, slots):
    """One turn of every session, the last two's bad (a non-finite score, no candidate),
    and a row whose slot is not open."""
    codes = torch.stack([torch.randperm(NODES, generator=generator)[:5] for _ in range(sessions + 1)])
    scores = torch.randn(sessions + 1, 5, generator=generator, dtype=torch.float64)
    scores[sessions - 2, 1] = float("nan")
    codes[sessions - 1] = -1
    rows = torch.cat([slots, torch.tensor([1000])])
    return rows.to(device), codes.to(device), scores.to(device)


def kernels_for(device):
    return use_backend("torch") if device.type == "cpu" else use_backend("auto")


@pytest.mark.parametrize("lag", [None, 0, 2])
@pytest.mark.parametrize("contexts", [False, True])
@pytest.mark.parametrize("distances", ["dense", "balls"])
def test_the_device_step_reads_nothing_back_and_equals_the_synchronizing_step(device, lag, contexts, distances):
    """Distances from the dense table, or from the ball table (every node's bounded
    ball: the table whose size does not grow with N squared)."""
    sessions = 5
    fast, reference = servers(device, lag, contexts, sessions, distances)
    slots = fast.slots([f"s{index}" for index in range(sessions)])
    generator = torch.Generator().manual_seed(3 + (lag or 0))
    with kernels_for(device):
        for _ in range(6):
            rows, codes, scores = turn(generator, device, sessions, slots.cpu())
            with record_host_reads() as reads:
                step = fast.step_slots(rows, codes, scores, contexts=contexts, synchronize=False)
            assert not reads, str(reads)
            assert reads.devices == {fast.device}
            expected = reference.step_slots(rows, codes, scores, contexts=contexts)
            assert torch.equal(step.status, expected.status)
            assert expected.status.tolist()[sessions - 2:] == BAD
            for name in expected._fields:
                got, want = getattr(step, name), getattr(expected, name)
                if want is None:
                    assert got is None
                    continue
                assert got.dtype == want.dtype and got.shape[0] == want.shape[0]
                if got.dim() == 2:  # fixed widths: the same values, then the blank ones
                    assert got.shape[1] >= want.shape[1]
                    blank = {torch.bool: False, torch.long: -1}.get(got.dtype, 0.0)
                    assert bool((got[:, want.shape[1]:] == blank).all()), name
                    got = got[:, : want.shape[1]]
                assert torch.equal(got, want), name
    saved, expected_state = fast.state_dict(), reference.state_dict()
    tensors = saved["store"]["decoder"]["tensors"] if "store" in saved else None
    if tensors is not None:
        for name, value in expected_state["store"]["decoder"]["tensors"].items():
            assert torch.equal(tensors[name], value), name
    for index in range(sessions):
        assert fast.path(f"s{index}") == reference.path(f"s{index}")


def test_a_row_the_device_cannot_certify_is_refused_and_changes_nothing():
    """Scores near overflow (centred, not z-scores, whose squares would overflow): the
    synchronizing step sums them exactly on the host; the device step refuses the row
    (EXACT_SUM_ON_HOST), and stepping it again with synchronize=True gives the
    synchronizing server's answer."""
    fast, reference = servers(torch.device("cpu"), None, False, 2, score_normalization="center")
    slots = fast.slots(["s0", "s1"])
    codes = torch.tensor([[1, 2, 3, -1, -1], [4, 5, 6, 7, -1]])
    scores = torch.tensor([[1e307, 1.0000000000000002e307, 1e307, 0, 0], [0.1, 0.2, 0.3, 0.4, 0]], dtype=torch.float64)
    with use_backend("torch"):
        step = fast.step_slots(slots, codes, scores, synchronize=False)
        assert step.status.tolist() == [StepCode.EXACT_SUM_ON_HOST, 0]
        assert fast.turn_count("s0") == 0 and fast.turn_count("s1") == 1
        again = fast.step_slots(slots[:1], codes[:1], scores[:1])
    expected = reference.step_slots(slots, codes, scores)
    assert int(again.status[0]) == int(expected.status[0]) == 0
    assert fast.path("s0") == reference.path("s0") and fast.path("s1") == reference.path("s1")


def test_capture_needs_a_cuda_server_a_dense_table_and_precomputed_contexts():
    server = MapMatchedServer(graph_on("cpu"), candidate_limit=5)
    with pytest.raises(MapMatchedValueError, match="capture needs a server on a CUDA device"):
        server.capture(8)


@pytest.mark.cuda
def test_a_captured_step_replays_the_device_step():
    if not torch.cuda.is_available():
        pytest.skip("cuda is not available on this machine")
    device = torch.device("cuda")
    sessions = 5
    fast, reference = servers(device, 2, True, sessions)
    captured = fast.capture(sessions + 1, turns=16)
    slots = fast.slots([f"s{index}" for index in range(sessions)])
    generator = torch.Generator().manual_seed(5)
    for _ in range(6):
        rows, codes, scores = turn(generator, device, sessions, slots.cpu())
        step = captured(rows, codes, scores)
        expected = reference.step_slots(rows, codes, scores)
        assert torch.equal(step.status, expected.status)
        assert torch.equal(step.chunks, expected.chunks)
        assert torch.equal(step.path[:, : expected.path.shape[1]], expected.path)
    for index in range(sessions):
        assert fast.path(f"s{index}") == reference.path(f"s{index}")
    fast.open("one-more")  # fits the capacity: the capture stays valid
    with pytest.raises(MapMatchedValueError, match="capture again"):
        for index in range(64):  # past the capacity: the slot table grows
            fast.open(f"new-{index}")
        captured(rows, codes, scores)


def rerunning_recorder(step, warmup):
    """A Recorder without a GPU: it runs the step once to get the output tensors, and a
    replay runs it again and copies the result into them, as a graph replay overwrites
    its static outputs."""
    for _ in range(warmup):
        step()
    output = step()

    def replay():
        again = step()
        for mine, new in zip(output, again):
            if mine is not None:
                mine.copy_(new)

    return replay, output


def test_a_captured_step_keeps_its_static_tensors_and_refuses_a_replaced_table():
    """The bookkeeping around a graph, on the CPU: static inputs copied in, the same
    output tensors each time, the sessions' answers those of a synchronizing server;
    a replay refused once the slot table was replaced."""
    from mapmatched_torch.serving.capture import capture_step

    device = torch.device("cpu")
    sessions = 5
    fast, reference = servers(device, 2, True, sessions)
    with use_backend("torch"), fast._lock:
        captured = capture_step(fast, sessions + 1, 5, 16, True, 2, recorder=rerunning_recorder)
    assert captured.batch_size == sessions + 1
    slots = fast.slots([f"s{index}" for index in range(sessions)])
    generator = torch.Generator().manual_seed(5)
    first = None
    with use_backend("torch"):
        for _ in range(6):
            rows, codes, scores = turn(generator, device, sessions, slots)
            step = captured(rows, codes, scores)
            first = first or step
            assert step.path is first.path  # the same tensors, overwritten
            expected = reference.step_slots(rows, codes, scores)
            assert torch.equal(step.status, expected.status)
            assert torch.equal(step.chunks, expected.chunks)
            assert torch.equal(step.path[:, : expected.path.shape[1]], expected.path)
    for index in range(sessions):
        assert fast.path(f"s{index}") == reference.path(f"s{index}")
    with pytest.raises(MapMatchedValueError, match="takes"):
        captured(rows[:2], codes, scores)
    for index in range(64):  # past the slot capacity: the table grows, its tensors are replaced
        fast.open(f"new-{index}")
    with pytest.raises(MapMatchedValueError, match="capture again"):
        captured(rows, codes, scores)


def test_a_captured_step_refuses_a_turn_past_the_turns_captured():
    from mapmatched_torch.serving.capture import capture_step

    device = torch.device("cpu")
    fast, _ = servers(device, None, False, 2)
    slots = fast.slots(["s0", "s1"])
    with use_backend("torch"), fast._lock:
        captured = capture_step(fast, 2, 5, 16, False, 0, recorder=rerunning_recorder)
    codes = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    scores = torch.zeros(2, 5, dtype=torch.float64)
    with use_backend("torch"):
        for _ in range(fast._store.decoder.turn_capacity):
            assert captured(slots, codes, scores).status.tolist() == [0, 0]
        with pytest.raises(MapMatchedValueError, match="used up"):
            captured(slots, codes, scores)
    assert fast.turn_count("s0") == fast._store.decoder.turn_capacity
