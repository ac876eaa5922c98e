"""SlotDecoder, the one incremental decoder: slots (allocate, release, reuse, growth),
steps of slots at different lengths equal to the batch decoders on every prefix and to
the standalone decoder, exact ties, integer distances, one candidate, padding, overflow,
persistence; and the streaming states as its views."""

from __future__ import annotations

import math
import random

import pytest
import torch

import mapmatched_torch
from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.core.models import DecoderCandidate
from mapmatched_torch.kernels import decode, states
from mapmatched_torch.kernels.decode import fixed_lag_viterbi, forward_scores, pointwise_decode, viterbi
from mapmatched_torch.kernels.slot_decoder import SlotDecoder
from mapmatched_torch.kernels.states import FixedLagState, ViterbiState
from mapmatched_torch.standalone.decoder import StandaloneDecoder
from mapmatched_torch.testing import random_trellis

NONFINITE = "decoder accumulation produced a nonfinite score"


# ----------------------------------------------------------------------- helpers


def lengths_of(mask):
    return mask.any(dim=-1).sum(dim=1).tolist()


def trials(seed, count, *, integer, batch=4, max_turns=5, max_candidates=3):
    """Random padded batches (NaN padding, exact ties) of raw scores and distances."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        turns = int(torch.randint(1, max_turns + 1, (1,), generator=generator))
        candidates = int(torch.randint(1, max_candidates + 1, (1,), generator=generator))
        yield random_trellis(batch, turns, candidates, generator=generator, integer=integer)


def scrambled_slots(decoder, count):
    """``count`` distinct slots that are not 0..count-1: some fresh, some released and reused,
    with other allocated slots left idle between them."""
    first = [decoder.allocate() for _ in range(count + 2)]
    for slot in first[::2]:
        decoder.release(slot)
    return [decoder.allocate() for _ in range(count)]


def schedule(lengths, rng):
    """Conversation b takes its turn t at round ``start[b] + t``: slots at different lengths step together."""
    starts = [rng.randint(0, 2) for _ in lengths]
    rounds = max(start + length for start, length in zip(starts, lengths))
    return [[(b, r - starts[b]) for b in range(len(lengths)) if 0 <= r - starts[b] < lengths[b]] for r in range(rounds)]


def feed(decoder, slots, scores, distances, mask, plan, check=None):
    """Run ``plan`` (rounds of (conversation, turn)); ``check(rows, turns, out)`` after each step."""
    width = mask.shape[2]
    for entries in plan:
        if not entries:  # a round where no conversation has a turn
            continue
        rows = [b for b, _ in entries]
        turns = [t for _, t in entries]
        index, at = torch.tensor(rows), torch.tensor(turns)
        # shape: (S, M, M): distances into each row's turn (NaN for a first turn: never read)
        into = torch.full((len(rows), width, width), math.nan, dtype=torch.float64)
        for s, (b, t) in enumerate(entries):
            if t:
                into[s] = distances[b, t - 1]
        started = any(turns)
        out = decoder.step(
            torch.tensor([slots[b] for b in rows]), scores[index, at], mask[index, at], into if started else None
        )
        if check is not None:
            check(rows, turns, out)


def batch_decode(emissions, transitions, mask, beta, lag):
    if beta == 0.0:
        return pointwise_decode(emissions, mask, fixed_lag=lag)
    if lag is None:
        return viterbi(emissions, transitions, mask)
    return fixed_lag_viterbi(emissions, transitions, mask, lag)


def prefix_results(emissions, transitions, mask, beta, lag):
    """For every prefix length n: (decoded, forward scores under its locks) of the batch."""
    results = []
    for n in range(1, mask.shape[1] + 1):
        e, tr, m = emissions[:, :n], transitions[:, : n - 1], mask[:, :n]
        decoded = batch_decode(e, tr, m, beta, lag)
        results.append((decoded, forward_scores(e, tr, m, getattr(decoded, "locks", None))))
    return results


# ---------------------------------------------------------------------- slots


def test_allocate_release_reuse_and_growth():
    decoder = SlotDecoder(2, capacity=1, turn_capacity=1)
    slots = [decoder.allocate() for _ in range(3)]
    assert slots == [0, 1, 2] and decoder.capacity == 4
    scores = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    for _ in range(3):  # grows the turn capacity 1 -> 2 -> 4
        decoder.step(torch.tensor([1]), scores, mask, torch.zeros(1, 2, 2, dtype=torch.float64))
    assert decoder.length(1) == 3 and decoder.turn_capacity == 4
    assert decoder.lengths(torch.tensor([0, 1, 2])).tolist() == [0, 3, 0]
    decoder.release(1)
    with pytest.raises(MapMatchedValueError, match="slot 1 is not allocated"):
        decoder.release(1)
    with pytest.raises(MapMatchedValueError, match="slot 7 is not allocated"):
        decoder.release(7)
    assert decoder.allocate() == 1  # reused, and cleared
    fresh = decoder.current(torch.tensor([1]))
    assert decoder.length(1) == 0 and (fresh.paths == -1).all() and (fresh.final_scores == -math.inf).all()
    empty = decoder.current(torch.empty(0, dtype=torch.long))
    assert empty.paths.shape == (0, 1) and empty.final_scores.shape == (0, 2)  # columns: the longest slot


def test_step_refuses_no_slots_and_rows_without_candidates():
    decoder = SlotDecoder(2)
    slot = torch.tensor([decoder.allocate()])
    with pytest.raises(MapMatchedValueError, match="at least one slot"):
        decoder.step(slot[:0], torch.zeros(0, 2, dtype=torch.float64), torch.zeros(0, 2, dtype=torch.bool))
    with pytest.raises(MapMatchedValueError, match="at least one candidate"):
        decoder.step(slot, torch.zeros(1, 2, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.bool))


# --------------------------------------------------------------------- parity


@pytest.mark.parametrize("integer", [True, False], ids=["integer", "float"])
def test_every_step_equals_the_batch_decoders_on_the_prefix(integer):
    rng = random.Random(7 + integer)
    for scores, distances, mask in trials(31 + integer, 6, integer=integer):
        lengths = lengths_of(mask)
        plan = schedule(lengths, rng)
        for lam, beta in ((1.0, 1.0), (0.5, 0.75), (2.0, 0.0)):
            emissions = torch.where(mask, lam * scores, 0.0)
            transitions = -(beta * distances)
            for lag in (None, 0, 1, 2, 5):
                expected = prefix_results(emissions, transitions, mask, beta, lag)
                decoder = SlotDecoder(
                    mask.shape[2], emission_weight=lam, transition_weight=beta, fixed_lag=lag, capacity=1, turn_capacity=1
                )
                slots = scrambled_slots(decoder, len(lengths))

                def check(rows, turns, out):
                    assert out.ok.all()
                    for s, (b, t) in enumerate(zip(rows, turns)):
                        decoded, alphas = expected[t]
                        path = decoded.paths[b, : t + 1]
                        assert torch.equal(out.paths[s, : t + 1], path) and (out.paths[s, t + 1 :] == -1).all()
                        assert out.lengths[s].item() == t + 1
                        assert torch.equal(out.final_scores[s], alphas[b, t])
                        along = [0.0] + [
                            distances[b, u - 1, path[u - 1], path[u]].item() if beta else 0.0 for u in range(1, t + 1)
                        ]
                        assert out.path_distances[s, : t + 1].tolist() == along

                feed(decoder, slots, scores, distances, mask, plan, check)
                final = decoder.current(torch.tensor(slots))
                full = expected[-1][0]
                for b, length in enumerate(lengths):
                    assert torch.equal(final.paths[b, :length], full.paths[b, :length])
                    assert (final.paths[b, length:] == -1).all()


class _TableGraph:
    """One conversation's (T-1, M, M) distances as a corpus graph over chunks 't{t}m{m}'."""

    maximum_distance = 100.0

    def __init__(self, distances):
        self.table = distances.tolist()

    def distance(self, a, b):
        (ta, ma), (tb, mb) = (tuple(int(x) for x in c[1:].split("m")) for c in (a, b))
        assert tb == ta + 1
        return self.table[ta][ma][mb]

    def neighborhood(self, chunk_id, radius):
        return ()


@pytest.mark.parametrize("integer", [True, False], ids=["integer", "float"])
def test_final_results_equal_the_standalone_decoder(integer):
    reference = StandaloneDecoder()
    rng = random.Random(3)
    for scores, distances, mask in trials(41 + integer, 6, integer=integer, max_candidates=4):
        lengths = lengths_of(mask)
        plan = schedule(lengths, rng)
        for lam, beta in ((1.0, 1.0), (1.3, 0.7), (2.0, 0.0)):
            for lag in (None, 0, 1, 3):
                decoder = SlotDecoder(mask.shape[2], emission_weight=lam, transition_weight=beta, fixed_lag=lag)
                slots = scrambled_slots(decoder, len(lengths))
                last = {}
                feed(decoder, slots, scores, distances, mask, plan, lambda rows, turns, out: last.update(
                    {b: (out.paths[s], out.path_distances[s], out.final_scores[s]) for s, b in enumerate(rows)}
                ))
                for b, length in enumerate(lengths):
                    trellis = [
                        [
                            DecoderCandidate(f"t{t}m{m}", 0.0, scores[b, t, m].item())
                            for m in range(mask.shape[2])
                            if mask[b, t, m]
                        ]
                        for t in range(length)
                    ]
                    # the candidates' tensor slots (holes inside a turn are allowed)
                    columns = [[m for m in range(mask.shape[2]) if mask[b, t, m]] for t in range(length)]
                    path, ranking = reference.decode_ranked(
                        trellis, _TableGraph(distances[b]), emission_weight=lam, transition_weight=beta, fixed_lag=lag
                    )
                    paths, along, finals = last[b]
                    assert path.chunk_ids == tuple(f"t{t}m{paths[t].item()}" for t in range(length))
                    assert [step.graph_distance for step in path.steps] == along[:length].tolist()
                    ours = sorted(
                        ((f"t{length - 1}m{m}", finals[m].item()) for m in columns[-1] if finals[m] > -math.inf),
                        key=lambda item: (-item[1], item[0]),
                    )
                    assert ours == [(item.chunk_id, item.trajectory_score) for item in ranking]
                    assert max(score for _, score in ours) == path.total_score


def test_one_candidate_exact_ties_and_padding_garbage():
    # one candidate per turn: the only path; all-equal scores: candidate 0 everywhere
    for width, value in ((1, 0.5), (3, 0.0)):
        decoder = SlotDecoder(width, fixed_lag=1)
        slot = torch.tensor([decoder.allocate()])
        mask = torch.ones(1, width, dtype=torch.bool)
        for t in range(4):
            distances = torch.zeros(1, width, width, dtype=torch.float64) if t else None
            out = decoder.step(slot, torch.full((1, width), value, dtype=torch.float64), mask, distances)
        assert out.paths[0, :4].tolist() == [0, 0, 0, 0]
    # NaN scores and distances at padding change nothing
    clean, dirty = SlotDecoder(3), SlotDecoder(3)
    slots = torch.tensor([clean.allocate()]), torch.tensor([dirty.allocate()])
    mask = torch.tensor([[True, False, True]])
    scores = torch.tensor([[0.5, 0.0, 0.25]], dtype=torch.float64)
    distances = torch.tensor([[[1.0, 0.0, 2.0], [0.0, 0.0, 0.0], [0.5, 0.0, 1.0]]], dtype=torch.float64)
    garbage_scores, garbage_distances = scores.clone(), distances.clone()
    garbage_scores[0, 1] = math.nan
    garbage_distances[0, 1, :] = math.nan
    garbage_distances[0, :, 1] = math.inf
    for t in range(3):
        a = clean.step(slots[0], scores, mask, distances if t else None)
        b = dirty.step(slots[1], garbage_scores, mask, garbage_distances if t else None)
        for x, y in zip(a, b):
            assert torch.equal(x, y)


# -------------------------------------------------------------------- overflow


def test_an_overflowing_slot_is_left_unchanged_and_the_others_advance():
    decoder = SlotDecoder(1, fixed_lag=1)
    slots = torch.tensor([decoder.allocate(), decoder.allocate()])
    mask = torch.ones(2, 1, dtype=torch.bool)
    scores = torch.tensor([[1.0], [1e308]], dtype=torch.float64)
    zero = torch.zeros(2, 1, 1, dtype=torch.float64)
    decoder.step(slots, scores, mask)
    before = decoder.snapshot(1)
    out = decoder.step(slots, scores, mask, zero)
    assert out.ok.tolist() == [True, False] and decoder.lengths(slots).tolist() == [2, 1]
    assert all(torch.equal(before[name], value) for name, value in decoder.snapshot(1).items())
    # not transactional: the overflowing slot is written too (for a caller that raises later)
    ok = decoder.advance(slots, scores, mask, zero, transactional=False)
    assert ok.tolist() == [True, False] and decoder.lengths(slots).tolist() == [3, 2]


# ----------------------------------------------------------------- persistence


def test_state_dict_round_trip_continues_identically():
    rng = random.Random(9)
    scores, distances, mask = next(trials(51, 1, integer=False, max_turns=5))
    plan = schedule(lengths_of(mask), rng)
    half = len(plan) // 2
    for lag in (None, 0, 2):
        original = SlotDecoder(mask.shape[2], transition_weight=0.5, fixed_lag=lag, capacity=2, turn_capacity=2)
        slots = scrambled_slots(original, mask.shape[0])
        feed(original, slots, scores, distances, mask, plan[:half])
        restored = SlotDecoder(mask.shape[2], transition_weight=0.5, fixed_lag=lag)
        restored.load_state_dict(original.state_dict())
        outs = {"original": [], "restored": []}
        for name, decoder in (("original", original), ("restored", restored)):
            feed(decoder, slots, scores, distances, mask, plan[half:], lambda rows, turns, out, n=name: outs[n].append(out))
        for a, b in zip(outs["original"], outs["restored"]):
            for x, y in zip(a, b):
                assert torch.equal(x, y)
        assert restored.allocate() == original.allocate()  # the free list travelled too
        with pytest.raises(MapMatchedValueError, match="configuration differs"):
            SlotDecoder(mask.shape[2], transition_weight=0.5, fixed_lag=3).load_state_dict(original.state_dict())
        old = original.state_dict()
        del old["config"]["format"]  # a state saved before the window held transitions
        with pytest.raises(MapMatchedValueError, match="configuration differs"):
            restored.load_state_dict(old)


# ----------------------------------------------------------------------- devices


def test_device_results_equal_cpu_results(device):
    rng = random.Random(13)
    for scores, distances, mask in trials(61, 3, integer=False, batch=5, max_candidates=4):
        plan = schedule(lengths_of(mask), rng)
        for lag in (None, 0, 2):
            outs = {}
            for where in (torch.device("cpu"), device):
                decoder = SlotDecoder(mask.shape[2], transition_weight=0.75, fixed_lag=lag, turn_capacity=2, device=where)
                slots = scrambled_slots(decoder, mask.shape[0])
                moved = [tensor.to(where) for tensor in (scores, distances, mask)]
                outs[where.type] = seen = []
                feed(decoder, slots, *moved, plan, lambda rows, turns, out, seen=seen: seen.append(out))
                seen.append(decoder.current(torch.tensor(slots, device=where)))
                assert all(tensor.device.type == where.type for out in seen for tensor in out)
            for a, b in zip(outs["cpu"], outs[device.type]):
                for x, y in zip(a, b):
                    assert torch.equal(x, y.cpu())


# ------------------------------------------------------- the states are views


def test_the_streaming_states_are_slot_decoder_views_with_one_public_path():
    assert states.ViterbiState is mapmatched_torch.ViterbiState
    assert states.FixedLagState is mapmatched_torch.FixedLagState
    # decode.py no longer answers them (it imported states back: a circle)
    assert not hasattr(decode, "ViterbiState") and not hasattr(decode, "FixedLagState")
    assert isinstance(ViterbiState(2, 3)._decoder, SlotDecoder)


def test_a_state_counts_an_overflowing_turn_and_raises_at_backtrack():
    state = FixedLagState(2, 1, 1)
    mask = torch.ones(2, 1, dtype=torch.bool)
    emissions = torch.tensor([[1.0], [1e308]], dtype=torch.float64)
    state.step(emissions, None, mask)
    state.step(emissions, torch.zeros(2, 1, 1, dtype=torch.float64), mask)
    assert state.lengths.tolist() == [2, 2] and state.steps == 2
    with pytest.raises(ValueError, match=f"{NONFINITE}.*b=\\[1\\]"):
        state.backtrack()


# ------------------------------------------------------------ state files (issue 14 faults)


def _used_decoder():
    decoder = SlotDecoder(3, transition_weight=0.5, fixed_lag=1, capacity=2)
    slots = torch.tensor([decoder.allocate(), decoder.allocate()])
    decoder.allocate(), decoder.allocate()  # slot 3 stays open: slot 2's release leaves it free (not trimmed)
    for turn in range(3):
        decoder.step(slots, torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.2, 0.1]]), torch.ones(2, 3, dtype=torch.bool),
                     None if turn == 0 else torch.tensor([[[0.0, 1.0, 2.0]] * 3] * 2, dtype=torch.float64))
    decoder.release(2)
    return decoder, slots


def _resealed(state):
    """An edited state with a valid checksum (as a deliberate forgery would have)."""
    from mapmatched_torch.kernels.slot_persistence import _checksum

    state["checksum"] = _checksum(state)
    return state


def _edits():
    def tensor_edit(name, change):
        def edit(state):
            state["tensors"][name] = change(state["tensors"][name].clone())
            return _resealed(state)

        return edit

    def assign(index, value):
        def change(tensor):
            tensor[index] = value
            return tensor

        return change

    return {
        "missing checksum": lambda state: {key: value for key, value in state.items() if key != "checksum"},
        "repeated free slot": lambda state: _resealed({**state, "free": state["free"] * 2}),
        "allocated beyond the capacity": lambda state: _resealed({**state, "allocated": 99}),
        "allocated below a free slot": lambda state: _resealed({**state, "allocated": 1}),
        "allocated a bool": lambda state: _resealed({**state, "allocated": True}),
        "wrong dtype": tensor_edit("alphas", lambda tensor: tensor.float()),
        "wrong shape": tensor_edit("backpointers", lambda tensor: tensor[:, :1]),
        "backpointer out of range": tensor_edit("backpointers", assign((0, 1, 0), 7)),
        "argmax out of range": tensor_edit("argmax", assign((0, 0), 5)),
        "NaN forward score": tensor_edit("alphas", assign((1, 0, 0), math.nan)),
        "length beyond the turn capacity": tensor_edit("lengths", assign(0, 1000)),
        "negative distance": tensor_edit("link_distances", assign((0, 1, 1), -1.0)),
        "expanded zero tensor": tensor_edit(
            "emissions", lambda tensor: torch.zeros(1, dtype=tensor.dtype).expand(tensor.shape)
        ),
        "unknown key": lambda state: {**state, "extra": 1},
        "other configuration": lambda state: _resealed({**state, "config": {**state["config"], "width": 4}}),
    }


@pytest.mark.parametrize("edit", sorted(_edits()))
def test_a_crafted_state_is_refused_and_the_decoder_is_untouched(edit):
    source, _ = _used_decoder()
    target, _ = _used_decoder()
    target.allocate()  # differs from source: a partial load would show
    before = target.state_dict()
    with pytest.raises(MapMatchedValueError, match="refusing the slot decoder state"):
        target.load_state_dict(_edits()[edit](source.state_dict()))
    after = target.state_dict()
    assert after["checksum"] == before["checksum"] and after["free"] == before["free"]


def test_every_single_bit_flip_of_a_saved_state_is_refused(tmp_path):
    source, _ = _used_decoder()
    path = tmp_path / "state.pt"
    torch.save(source.state_dict(), path)
    data = path.read_bytes()
    generator = random.Random(0)
    refused = 0
    for position in generator.sample(range(len(data)), 60):
        flipped = bytearray(data)
        flipped[position] ^= 1 << generator.randrange(8)
        (tmp_path / "flip.pt").write_bytes(bytes(flipped))
        target, _ = _used_decoder()
        try:
            state = torch.load(tmp_path / "flip.pt", weights_only=True)
            target.load_state_dict(state)
        except Exception:  # torch.load's own errors, or ours
            refused += 1
            continue
        # accepted only if the flip hit bytes that carry no content (zip padding, names)
        assert target.state_dict()["checksum"] == source.state_dict()["checksum"]
    assert refused > 0


def test_a_state_larger_than_max_bytes_is_refused():
    source, _ = _used_decoder()
    state = source.state_dict()
    target, _ = _used_decoder()
    with pytest.raises(MapMatchedValueError, match="max_bytes"):
        target.load_state_dict(state, max_bytes=100)
    target.load_state_dict(state, max_bytes=10**8)
    assert target.state_dict()["checksum"] == state["checksum"]


def test_a_steps_cost_follows_its_sessions_and_a_closed_long_session_gives_memory_back():
    decoder = SlotDecoder(2, transition_weight=0.5)
    long_slot, short_slot = decoder.allocate(), decoder.allocate()
    scores, mask = torch.tensor([[1.0, 0.0]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    distances = torch.ones(1, 2, 2, dtype=torch.float64)
    for _ in range(300):
        decoder.step(torch.tensor([long_slot]), scores, mask, distances)
    grown = decoder.turn_capacity
    assert grown >= 300
    step = decoder.step(torch.tensor([short_slot]), scores, mask, None)
    assert step.paths.shape == (1, 1)  # not (1, turn capacity)
    decoder.release(long_slot)
    assert decoder.turn_capacity == 8 < grown
    again = decoder.step(torch.tensor([short_slot]), scores, mask, distances)
    assert again.paths.tolist() == [[0, 0]] and decoder.length(short_slot) == 2


def test_payload_grows_undoes_and_saves_with_the_table():
    from mapmatched_torch.kernels.slot_decoder import PayloadSpec

    payload = {"codes": PayloadSpec(torch.long, -1), "mark": PayloadSpec(torch.long, -1, per_candidate=False)}
    decoder = SlotDecoder(2, capacity=1, turn_capacity=1, payload=payload)
    slots = torch.tensor([decoder.allocate(), decoder.allocate()])  # grows the slots
    mask = torch.ones(2, 2, dtype=torch.bool)
    for turn in range(3):  # grows the turns
        values = torch.tensor([[turn, 10 + turn], [20 + turn, 30 + turn]])
        decoder.step(slots, torch.zeros(2, 2, dtype=torch.float64), mask, payload={"codes": values})
        decoder.put_rows("mark", slots, torch.full((2, turn + 1), turn))
    assert decoder.payload("codes")[0, :3].tolist() == [[0, 10], [1, 11], [2, 12]]
    assert decoder.payload("mark")[1, :3].tolist() == [2, 2, 2]
    saved = decoder.state_dict()
    decoder.step(slots, torch.zeros(2, 2, dtype=torch.float64), mask, payload={"codes": torch.full((2, 2), 9)})
    decoder.put_rows("mark", slots, torch.full((2, 4), 7))
    decoder.undo_slots(slots[:1])  # slot 0 takes its step back, slot 1 keeps it
    assert decoder.payload("codes")[0, 3].tolist() == [-1, -1] and decoder.payload("codes")[1, 3].tolist() == [9, 9]
    assert decoder.payload("mark")[0, :4].tolist() == [2, 2, 2, -1] and decoder.length(0) == 3 and decoder.length(1) == 4
    decoder.undo_last()
    assert decoder.payload("codes")[1, 3].tolist() == [-1, -1] and decoder.length(1) == 3
    again = SlotDecoder(2, payload=payload)  # its initial turn capacity, 8, is above the saved 4
    again.load_state_dict(saved)
    assert again.turn_capacity == 8 and decoder.turn_capacity == 4
    assert torch.equal(again.payload("codes")[:, :4], decoder.payload("codes"))
    assert (again.payload("codes")[:, 4:] == -1).all() and torch.equal(again.payload("mark")[:, :4], decoder.payload("mark"))
    same = SlotDecoder(2, turn_capacity=1, payload=payload)  # built as the saved table was: loaded as saved
    same.load_state_dict(saved)
    assert same.state_dict()["checksum"] == saved["checksum"]
    with pytest.raises(ValueError, match="configuration differs"):
        SlotDecoder(2).load_state_dict(saved)
    decoder.release(0)
    assert decoder.allocate() == 0 and (decoder.payload("codes")[0] == -1).all()  # a reused slot is cleared


def test_exchange_writes_and_returns_what_advanced_indexing_does():
    from mapmatched_torch.kernels.slot_decoder import _exchange

    generator = torch.Generator().manual_seed(0)
    slots, turns = torch.tensor([3, 0, 2]), torch.tensor([1, 4, 0])
    cases = [
        (torch.randn(5, 6, 4, generator=generator), (slots, turns), torch.randn(3, 4, generator=generator)),
        (torch.randn(5, 6, generator=generator), (slots.unsqueeze(1), torch.arange(3).unsqueeze(0)),
         torch.randn(3, 3, generator=generator, dtype=torch.float64)),
        (torch.zeros(5, dtype=torch.long), (slots,), turns + 1),
        (torch.zeros(5, 6, 4, dtype=torch.bool), (slots, turns), torch.tensor(True)),
        (torch.randn(6, 5, 4, generator=generator).transpose(0, 1), (slots, turns), torch.randn(3, 4, generator=generator)),
    ]
    for table, where, values in cases:
        expected = table.clone()
        expected_old = expected[where].clone()
        expected[where] = values.to(table.dtype)
        old = _exchange(table, where, values)
        assert torch.equal(old, expected_old) and old.dtype == table.dtype
        assert torch.equal(table, expected)


@pytest.mark.parametrize("lag, beta", [(None, 1.0), (0, 1.0), (2, 0.5), (None, 0.0)])
def test_a_step_with_active_rows_equals_stepping_the_active_slots_alone(lag, beta):
    """advance(active=...) (no host read): the rows not active (any slot: out of range,
    negative, or an active row's slot again; empty masks) and the rows that overflow
    write nowhere; the active ones equal a plain step of those slots alone, and the two
    tables end equal bit for bit."""
    import random

    from mapmatched_torch.kernels.backend import use_backend
    from mapmatched_torch.testing import record_host_reads

    rng, generator = random.Random(7), torch.Generator().manual_seed(7)
    width = 4
    plain = SlotDecoder(width, transition_weight=beta, fixed_lag=lag, capacity=8, turn_capacity=16)
    spared = SlotDecoder(width, transition_weight=beta, fixed_lag=lag, capacity=8, turn_capacity=16)
    table = [plain.allocate() for _ in range(6)]
    assert [spared.allocate() for _ in range(6)] == table
    with use_backend("torch"):
        for _ in range(7):
            picked = sorted(rng.sample(table, rng.randint(1, 6)))
            count = len(picked)
            scores = torch.randn(count, width, generator=generator, dtype=torch.float64)
            mask = torch.rand(count, width, generator=generator) < 0.7
            mask[:, 0] |= ~mask.any(1)
            distances = torch.randint(0, 3, (count, width, width), generator=generator).double()
            if rng.random() < 0.3:
                scores[0] = 1e308  # overflows: written nowhere in both
            expected = plain.step(torch.tensor(picked), scores, mask, distances)
            junk = [rng.choice([-3, 99, picked[0]]) for _ in range(3)]
            slots = torch.tensor(picked + junk)
            every = torch.cat([scores, torch.randn(3, width, generator=generator, dtype=torch.float64)])
            masks = torch.cat([mask, torch.zeros(3, width, dtype=torch.bool)])
            moves = torch.cat([distances, torch.rand(3, width, width, generator=generator, dtype=torch.float64)])
            active = torch.arange(count + 3) < count
            with record_host_reads() as reads:
                got = spared.step(slots, every, masks, moves, active=active)
            assert not reads, str(reads)
            assert torch.equal(got.ok[:count], expected.ok) and not bool(got.ok[count:].any())
            turns = expected.paths.shape[1]
            rows = expected.ok
            assert torch.equal(got.paths[:count][rows, :turns], expected.paths[rows])
            assert bool((got.paths[:count][rows, turns:] == -1).all())
            assert torch.equal(got.final_scores[:count][rows], expected.final_scores[rows])
    for name, value in plain.state_dict()["tensors"].items():
        assert torch.equal(spared.state_dict()["tensors"][name], value), name
