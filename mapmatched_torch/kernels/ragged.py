"""Ragged rows (values one row after another, plus each row's length) as a padded tensor."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["padded_rows"]


def padded_rows(values: Tensor, lengths: Tensor, width: int, fill: int = -1) -> Tensor:
    """``(R, width)``: row ``r`` holds its ``lengths[r]`` values, then ``fill``.

    Args:
        values: ``(sum lengths,)`` the rows' values one row after another.
        lengths: ``(R,)`` int64 row lengths, each at most ``width``.
        width: the padded width.
        fill: the padding value.

    Returns:
        A tensor of ``values``' dtype on its device, built by one scatter (no copy per row).
    """
    lengths = lengths.to(device=values.device, dtype=torch.long)
    block = torch.full((lengths.numel(), width), fill, dtype=values.dtype, device=values.device)
    # shape: (sum lengths,) each value's row, and its column (its place within the row)
    row_of = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    block[row_of, torch.arange(values.numel(), device=values.device) - starts[row_of]] = values
    return block
