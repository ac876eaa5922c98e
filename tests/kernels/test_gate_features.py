"""The gate features: one computation for eval, sessions and the server, the same bits whatever the batch."""

from __future__ import annotations

import torch

from mapmatched_torch.kernels.gate_features import gate_features, score_match_features, step_features
from mapmatched_torch.kernels.transitions import GatedTransitions, query_source_cosine


def _trellis(seed: int, batch: int = 5, turns: int = 4, width: int = 6, pool: int = 8):
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.stack([torch.randperm(pool, generator=generator)[:width] for _ in range(turns)])
                         for _ in range(batch)])
    lengths = torch.randint(1, width + 1, (batch, turns), generator=generator)
    mask = torch.arange(width).view(1, 1, -1) < lengths.unsqueeze(-1)
    normalized = torch.randn(batch, turns, width, dtype=torch.float64, generator=generator)
    return index, normalized, mask


def test_the_score_feature_is_the_next_turns_score_of_the_same_passage_else_its_lowest():
    index = torch.tensor([[[3, 5, 7], [5, 9, -1]]])
    mask = torch.tensor([[[True, True, True], [True, True, False]]])
    normalized = torch.tensor([[[0.0, 0.0, 0.0], [0.25, -1.5, 0.0]]], dtype=torch.float64)
    features = score_match_features(index, normalized, mask)
    # chunk 3 missed: the lowest score; chunk 5 retrieved at 0.25; chunk 7 missed
    assert features.view(-1).tolist() == [-1.5, 0.25, -1.5]


def test_a_step_gets_the_features_of_the_whole_trellis_bit_for_bit_whatever_its_width():
    index, normalized, mask = _trellis(0)
    whole = gate_features(index, normalized, mask)
    for t in range(index.shape[1] - 1):
        for extra in (0, 3):  # a wider step (more padding) changes nothing
            pad = lambda x, fill: torch.cat([x, torch.full(x.shape[:-1] + (extra,), fill, dtype=x.dtype)], -1)
            step = step_features(pad(index[:, t], -1), pad(mask[:, t], False), pad(index[:, t + 1], -1),
                                 pad(normalized[:, t + 1], 0.0), pad(mask[:, t + 1], False))
            assert torch.equal(step[:, : index.shape[2]], whole[:, t])
            assert not bool(step[:, index.shape[2]:].any())


def test_the_cosine_feature_per_step_equals_the_whole_trellis():
    index, normalized, mask = _trellis(1)
    generator = torch.Generator().manual_seed(2)
    passages = torch.randn(8, 5, generator=generator)  # float32 embeddings: the cosine in float32, then float64
    queries = torch.randn(index.shape[0], index.shape[1], 5, generator=generator)
    whole = gate_features(index, normalized, mask, queries, passages, chunk=2)
    expected = query_source_cosine(queries, passages[index]).double()
    sources = (mask[:, :-1] & mask[:, 1:].any(-1, keepdim=True)).unsqueeze(-1)
    assert torch.equal(whole, torch.where(sources, expected, 0.0))
    for t in range(index.shape[1] - 1):
        step = step_features(index[:, t], mask[:, t], index[:, t + 1], normalized[:, t + 1], mask[:, t + 1],
                             queries[:, t + 1], passages)
        assert torch.equal(step, whole[:, t])


def test_the_gate_is_the_same_bits_in_any_batch_position():
    model = GatedTransitions(1.0, num_features=1)
    with torch.no_grad():
        model.gate_bias.fill_(0.3)
        model.gate_weights.fill_(-1.7)
    features = torch.randn(1000, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    whole = model.gate(features)
    one_by_one = torch.cat([model.gate(features[i:i + 1]) for i in range(1000)])
    assert torch.equal(whole, one_by_one)
    assert torch.allclose(whole, 2 * torch.sigmoid(0.3 - 1.7 * features.view(-1)), rtol=1e-15, atol=0)
