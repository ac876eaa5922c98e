"""padded_rows: ragged rows (values one row after another, plus lengths) as one padded tensor."""

from __future__ import annotations

import random

import torch

from mapmatched_torch.kernels.ragged import padded_rows


def test_padded_rows_equal_padding_each_row(device) -> None:
    rng = random.Random(0)
    for _ in range(20):
        rows = [[rng.randint(-5, 50) for _ in range(rng.randint(0, 6))] for _ in range(rng.randint(0, 7))]
        width = max(map(len, rows), default=0) + rng.randint(0, 2)
        flat = torch.tensor([value for row in rows for value in row], dtype=torch.int32, device=device)
        lengths = torch.tensor([len(row) for row in rows], dtype=torch.long)
        found = padded_rows(flat, lengths, width, fill=-9)
        assert found.dtype == torch.int32 and found.device == flat.device and found.shape == (len(rows), width)
        assert found.cpu().tolist() == [row + [-9] * (width - len(row)) for row in rows]


def test_padded_rows_keep_the_values_dtype() -> None:
    found = padded_rows(torch.tensor([0.5, 1.5, 2.5], dtype=torch.float64), torch.tensor([2, 0, 1]), 3, fill=0)
    assert found.dtype == torch.float64 and found.tolist() == [[0.5, 1.5, 0.0], [0.0, 0.0, 0.0], [2.5, 0.0, 0.0]]
