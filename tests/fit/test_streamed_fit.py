"""``fit_weights(keep_packed=False)`` streams its batches: one batch's tensors at a time, the same fit bit for bit."""

from __future__ import annotations

import pytest
import torch

from mapmatched_torch.fit import fitting, fit_weights
from mapmatched_torch.fit.sampling import sample_conversations


@pytest.mark.parametrize("options", [{"max_iterations": 4, "l2": 0.01}, {"max_iterations": 2, "optimizer": "adam"}])
def test_streamed_batches_give_the_packed_fit(options, monkeypatch):
    data = sample_conversations(23, 3, 4, emission_weight=1.5, transition_weight=0.7,
                                generator=torch.Generator().manual_seed(3))
    packed = fit_weights(data.conversations, data.graph, progress=False, batch_size=4, seed=1, **options)
    packs = []
    pack = fitting._pack
    monkeypatch.setattr(fitting, "_pack", lambda *args: packs.append(len(args[0])) or pack(*args))
    streamed = fit_weights(data.conversations, data.graph, progress=False, batch_size=4, seed=1,
                           keep_packed=False, **options)
    assert streamed.history == packed.history and streamed.emission_weight == packed.emission_weight
    assert streamed.transition_weight == packed.transition_weight
    assert streamed.validation_ndcg_after == packed.validation_ndcg_after
    batches = -(-round(23 * 0.8) // 4) + -(-round(23 * 0.2) // 4)
    assert len(packs) > 2 * batches and max(packs) <= 4  # packed again on every pass, one batch at a time
