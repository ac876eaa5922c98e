"""Contiguous balanced shards of ``range(n)`` over the ranks of a distributed job.

Both :mod:`mapmatched_torch.eval.distributed` (conversations) and
:func:`mapmatched_torch.fit.fit_weights` (batches) split work this way, so that
concatenating per-rank results in rank order restores the one-process order.

Example:
    >>> shard(10, rank=1, world_size=3)
    slice(3, 6, None)
    >>> [shard(2, rank=r, world_size=3) for r in range(3)]
    [slice(0, 0, None), slice(0, 1, None), slice(1, 2, None)]
"""

from __future__ import annotations

from .errors import MapMatchedValueError

__all__ = ["shard"]


def shard(batch: int, rank: int, world_size: int) -> slice:
    """The contiguous block of ``range(batch)`` that ``rank`` of ``world_size`` handles.

    Blocks are balanced (sizes differ by at most one; the later ranks get the extra
    ones) and cover ``range(batch)`` in rank order; a rank may get an empty block
    when ``world_size > batch``.

    Raises:
        MapMatchedValueError: ``batch < 0``, ``world_size < 1`` or ``rank`` outside
            ``[0, world_size)``.
    """
    if batch < 0 or world_size < 1 or not 0 <= rank < world_size:
        raise MapMatchedValueError(f"shard needs batch >= 0, world_size >= 1 and 0 <= rank < world_size, got "
                                   f"batch={batch}, rank={rank}, world_size={world_size}")
    return slice(rank * batch // world_size, (rank + 1) * batch // world_size)
