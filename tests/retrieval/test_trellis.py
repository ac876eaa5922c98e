"""packed_rows: ragged Python rows -> one padded tensor, equal to torch.tensor's."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mapmatched_torch.retrieval.trellis import packed_rows


def test_packed_rows_equal_torch_tensor_of_the_padded_rows() -> None:
    rng = random.Random(0)
    specials = [0.0, -0.0, math.inf, -math.inf, 5e-324, 1.7976931348623157e308, 0.1]
    for width in (0, 1, 5):
        rows = [[rng.choice(specials + [rng.gauss(0, 1)]) for _ in range(rng.randint(0, width))] for _ in range(7)]
        found = packed_rows(rows, width, 0.0, torch.float64)
        expected = torch.tensor([row + [0.0] * (width - len(row)) for row in rows], dtype=torch.float64).view(7, width)
        assert found.shape == (7, width) and found.dtype == torch.float64
        # bit for bit, the sign of zero included
        assert torch.equal(found.view(torch.long), expected.view(torch.long))
        codes = [[rng.randrange(-3, 10**12) for _ in range(rng.randint(0, width))] for _ in range(5)]
        found = packed_rows(codes, width, -1, torch.long)
        assert torch.equal(found, torch.tensor([row + [-1] * (width - len(row)) for row in codes]).view(5, width))
    assert packed_rows([], 4, 0.0, torch.float64).shape == (0, 4)
    assert packed_rows([(), ()], 3, -1, torch.long).tolist() == [[-1, -1, -1], [-1, -1, -1]]


def test_packed_rows_owns_a_writable_buffer_and_refuses_long_rows() -> None:
    first = packed_rows([[1.0, 2.0]], 2, 0.0, torch.float64)
    second = packed_rows([[1.0, 2.0]], 2, 0.0, torch.float64)
    first += 1.0
    assert first.tolist() == [[2.0, 3.0]] and second.tolist() == [[1.0, 2.0]]
    assert first.resize_(3).shape == (3,)  # ordinary storage
    with pytest.raises(ValueError, match="does not fit in width 1"):
        packed_rows([[1, 2]], 1, -1, torch.long)
