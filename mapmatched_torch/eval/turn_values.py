"""Per-turn values held losslessly in a byte or two per turn, and their exact slice sums.

The harness keeps one (N,) float64 value per turn, ranking and metric until the
bootstrap (the follow-up slice is only known once every turn's entropy is: its
threshold is their median). At 1M conversations x 8 turns x 18 rankings x 7 metrics
that is 8 GB as float64. A ranking metric, though, takes few distinct values over a
whole evaluation (nDCG@3 with one gold passage: 4; the reciprocal rank over M
candidates: M + 1), so :class:`CodedValues` holds a column as its distinct values (the
*table*, compared by bit pattern: -0.0, NaN payloads and every float round-trip
exactly) and one code per turn in the narrowest integer dtype that indexes the table
(uint8 up to 256 distinct values, int16 up to 32,768, then int32 and int64): the
8 GB become 1 GB, and :meth:`CodedValues.decode` gives back the very same tensor.

Sums over a slice are exact (:meth:`CodedValues.masked_sum`): the counts of each
distinct value in the slice, times the values, added in exact rational arithmetic and
rounded once, which is ``math.fsum`` of the slice's values. So a slice mean does not
depend on the order of the turns, the shard sizes or the number of torch threads (a
float64 ``tensor.sum()`` does, in its last bits: torchrun runs one thread per process
by default, a plain run all cores), and a distributed report equals the one-process
report.

:class:`PerTurnMetrics` is the harness's ``report key -> metric -> (N,) float64``
mapping over such columns, decoding a column when it is read.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Dict, Iterator, Mapping, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ..core.errors import MapMatchedRuntimeError, MapMatchedValueError
from ..kernels.normalization import exact_row_sums

__all__ = ["CodedValues", "CodedColumnWriter", "PerTurnMetrics", "code_dtype"]

#: Tables up to this size are summed from per-value counts (exact rationals); larger
#: ones (values that are nearly all distinct) by :func:`exact_row_sums` over the values.
_COUNTED_TABLE = 1 << 16


def code_dtype(size: int) -> torch.dtype:
    """The narrowest integer dtype whose nonnegative values index a table of ``size`` entries."""
    if size <= 1 << 8:
        return torch.uint8
    if size <= 1 << 15:
        return torch.int16
    if size <= 1 << 31:
        return torch.int32
    return torch.int64


class CodedValues(NamedTuple):
    """An (N,) float64 column as its distinct values and one code per entry (lossless).

    Attributes:
        bits: (V,) int64, the bit patterns of the distinct float64 values (sorted as
            integers); :attr:`table` views them as float64.
        codes: (N,) integer codes into ``bits`` (dtype :func:`code_dtype` of V), on the
            same device.
    """

    bits: Tensor
    codes: Tensor

    @classmethod
    def encode(cls, values: Tensor) -> "CodedValues":
        """Code a 1-D float tensor (cast to float64 first; float64 values are kept bit for bit).

        Raises:
            MapMatchedValueError: ``values`` is not a 1-D floating tensor.
        """
        bits = _bits_of(values)
        writer = CodedColumnWriter(bits.numel(), bits.device)
        writer._append_bits(bits)
        return writer.finish()

    @classmethod
    def concat(cls, parts: Sequence["CodedValues"]) -> "CodedValues":
        """The columns one after another (one table for all; each part's codes translated).

        Raises:
            MapMatchedValueError: no part.
        """
        if not parts:
            raise MapMatchedValueError("CodedValues.concat needs at least one part")
        table = _distinct(torch.cat([part.bits for part in parts]))
        dtype = code_dtype(table.numel())
        codes = [torch.searchsorted(table, part.bits).index_select(0, _index(part.codes)).to(dtype) for part in parts]
        return cls(table, torch.cat(codes))

    @property
    def table(self) -> Tensor:
        """(V,) float64, the distinct values."""
        return self.bits.view(torch.float64)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """Bytes held by the table and the codes."""
        return self.bits.numel() * self.bits.element_size() + self.codes.numel() * self.codes.element_size()

    def __len__(self) -> int:
        return self.codes.numel()

    def decode(self) -> Tensor:
        """(N,) float64, the coded values, bit for bit."""
        return self.table.index_select(0, _index(self.codes))

    def to(self, device: torch.device) -> "CodedValues":
        """The column on ``device``."""
        return CodedValues(self.bits.to(device), self.codes.to(device))

    def masked_sum(self, mask: Optional[Tensor] = None) -> float:
        """``math.fsum`` of the entries where ``mask`` (every entry for None): exact, order-free.

        Args:
            mask: (N,) bool or None.

        Returns:
            The exactly rounded sum (0.0 for none); NaN where a counted value is not
            finite or the sum overflows (as
            :func:`~mapmatched_torch.kernels.normalization.exact_row_sums`).
        """
        codes = self.codes if mask is None else self.codes[_check_mask(mask, len(self))]
        if self.bits.numel() > _COUNTED_TABLE:
            values = self.table.index_select(0, _index(codes))
            return float(exact_row_sums(values.view(1, -1), torch.ones_like(values, dtype=torch.bool).view(1, -1))[0])
        counts = torch.bincount(codes.to(torch.int64), minlength=self.bits.numel()).tolist()
        total = Fraction(0)
        for value, count in zip(self.table.tolist(), counts):
            if count:
                if not math.isfinite(value):
                    return math.nan
                total += Fraction(value) * count
        try:
            rounded = float(total)
        except OverflowError:
            return math.nan
        return rounded if math.isfinite(rounded) else math.nan

    def masked_mean(self, mask: Optional[Tensor] = None) -> float:
        """:meth:`masked_sum` divided by the number of entries counted (NaN for none)."""
        count = len(self) if mask is None else int(_check_mask(mask, len(self)).sum())
        return self.masked_sum(mask) / count if count else math.nan


class CodedColumnWriter:
    """Codes a column chunk by chunk into one buffer allocated up front.

    What the harness keeps of every chunk lives for the whole run, while each chunk's
    temporaries are freed; kept as many small tensors (one per chunk and column) they
    pin the freed memory around them, and the process's resident memory grew by about
    as much again as the metrics themselves (glibc's allocator, 400k conversations).
    A writer holds one ``capacity``-entry code buffer per column instead, filled in
    place: the table grows as new values appear (existing codes never change), and
    :meth:`finish` sorts it into the canonical :class:`CodedValues`.

    Args:
        capacity: the most entries the column will hold (e.g. conversations x turns).
        device: where the codes live.

    Example:
        >>> import torch
        >>> writer = CodedColumnWriter(5, torch.device("cpu"))
        >>> writer.append(torch.tensor([0.5, 1.0], dtype=torch.float64))
        >>> writer.append(torch.tensor([0.0, 0.5], dtype=torch.float64))
        >>> column = writer.finish()
        >>> column.decode().tolist(), column.table.tolist()
        ([0.5, 1.0, 0.0, 0.5], [0.0, 0.5, 1.0])
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        self._codes = torch.empty(capacity, dtype=torch.uint8, device=device)
        self._size = 0
        # the distinct values in order of appearance, and that table sorted (with each
        # sorted entry's code) for the lookups
        self._table = torch.empty(0, dtype=torch.int64, device=device)
        self._sorted, self._order = self._table, self._table

    def append(self, values: Tensor) -> None:
        """Add a 1-D float tensor's values (cast to float64; kept bit for bit).

        Raises:
            MapMatchedValueError: not a 1-D floating tensor.
            MapMatchedRuntimeError: more entries than the capacity.
        """
        self._append_bits(_bits_of(values))

    def _append_bits(self, bits: Tensor) -> None:
        """:meth:`append` of checked (n,) int64 float64 bit patterns."""
        count = bits.numel()
        if self._size + count > self._codes.numel():
            raise MapMatchedRuntimeError(
                f"CodedColumnWriter holds {self._codes.numel()} entries; {self._size} + {count} do not fit"
            )
        codes = self._lookup(bits)
        missing = codes < 0
        if bool(missing.any()):
            self._table = torch.cat([self._table, _distinct(bits[missing])])
            self._sorted, self._order = torch.sort(self._table)
            self._widen(code_dtype(self._table.numel()))
            codes = self._lookup(bits)
        self._codes[self._size:self._size + count] = codes.to(self._codes.dtype)
        self._size += count

    def finish(self) -> CodedValues:
        """The column written so far, in :class:`CodedValues`' canonical form (sorted table)."""
        size = self._table.numel()
        # each code's place in the sorted table
        codes = _places(self._order).index_select(0, _index(self._codes[:self._size])) if size else self._order
        return CodedValues(self._sorted, codes.to(code_dtype(size)))

    def _lookup(self, bits: Tensor) -> Tensor:
        """(n,) int64 code of each value in the table, -1 where it is not."""
        if self._sorted.numel() == 0:
            return torch.full_like(bits, -1)
        at = torch.searchsorted(self._sorted, bits).clamp_max(self._sorted.numel() - 1)
        return torch.where(self._sorted[at] == bits, self._order[at], -1)

    def _widen(self, dtype: torch.dtype) -> None:
        if dtype != self._codes.dtype and torch.iinfo(dtype).max > torch.iinfo(self._codes.dtype).max:
            wider = torch.empty(self._codes.numel(), dtype=dtype, device=self._codes.device)
            wider[:self._size] = self._codes[:self._size]
            self._codes = wider


def _bits_of(values: Tensor) -> Tensor:
    """(n,) int64 bit patterns of a 1-D floating tensor's values as float64.

    Raises:
        MapMatchedValueError: ``values`` is not a 1-D floating tensor.
    """
    if not isinstance(values, Tensor) or values.dim() != 1 or not values.is_floating_point():
        raise MapMatchedValueError(
            f"per-turn values must be a 1-D floating tensor, got {getattr(values, 'shape', type(values))}"
        )
    return values.to(torch.float64).contiguous().view(torch.int64)


def _distinct(bits: Tensor) -> Tensor:
    """The sorted distinct values of a 1-D int64 tensor.

    ``torch.unique(sorted=True)`` gives the same, but its CPU path takes tens of
    milliseconds for 36k entries when the cores are shared (2 threads, one busy core);
    the hashed ``sorted=False`` path and a sort of the few distinct values do not.
    """
    return torch.sort(torch.unique(bits, sorted=False)).values


def _places(order: Tensor) -> Tensor:
    """The inverse of a permutation: ``places[order[i]] == i``."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def _index(codes: Tensor) -> Tensor:
    """Codes as an index dtype (``index_select`` takes int32 and int64)."""
    return codes if codes.dtype in (torch.int32, torch.int64) else codes.to(torch.int32)


def _check_mask(mask: Tensor, size: int) -> Tensor:
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != (size,):
        raise MapMatchedValueError(f"mask must be a ({size},) bool tensor, got {getattr(mask, 'shape', type(mask))}")
    return mask


class _Metrics(Mapping[str, Tensor]):
    """One report key's metrics: metric -> (N,) float64, decoded when read."""

    def __init__(self, columns: Dict[str, CodedValues]) -> None:
        self._columns = columns

    def __getitem__(self, metric: str) -> Tensor:
        return self._columns[metric].decode()

    def __contains__(self, metric: object) -> bool:  # without decoding
        return metric in self._columns

    def __iter__(self) -> Iterator[str]:
        return iter(self._columns)

    def __len__(self) -> int:
        return len(self._columns)


class PerTurnMetrics(Mapping[str, Mapping[str, Tensor]]):
    """``report key -> metric -> (N,) float64`` per-turn values, held as :class:`CodedValues`.

    Reading ``metrics[key][metric]`` decodes that column (a new tensor each time);
    :meth:`column` gives the coded column itself (for exact sums).

    Example:
        >>> import torch
        >>> metrics = PerTurnMetrics()
        >>> metrics.add("pointwise", {"mrr": torch.tensor([1.0, 0.5, 1.0], dtype=torch.float64)})
        >>> metrics["pointwise"]["mrr"].tolist(), metrics.column("pointwise", "mrr").codes.dtype
        ([1.0, 0.5, 1.0], torch.uint8)
    """

    def __init__(self, columns: Optional[Dict[str, Dict[str, CodedValues]]] = None) -> None:
        self._columns: Dict[str, Dict[str, CodedValues]] = dict(columns or {})

    @classmethod
    def of(cls, per_turn: Mapping[str, Mapping[str, Tensor]]) -> "PerTurnMetrics":
        """``per_turn`` itself if it is one, else its tensors coded."""
        if isinstance(per_turn, PerTurnMetrics):
            return per_turn
        metrics = cls()
        for key, values in per_turn.items():
            metrics.add(key, values)
        return metrics

    def add(self, key: str, values: Mapping[str, Tensor]) -> None:
        """Code and keep one key's (N,) metric tensors (replacing the key's columns)."""
        self._columns[key] = {metric: CodedValues.encode(tensor) for metric, tensor in values.items()}

    def put(self, key: str, columns: Dict[str, CodedValues]) -> None:
        """Keep one key's coded columns (metric -> :class:`CodedValues`, replacing the key's)."""
        self._columns[key] = dict(columns)

    def column(self, key: str, metric: str) -> CodedValues:
        """The coded column of ``key``'s ``metric``."""
        return self._columns[key][metric]

    def columns(self, key: str) -> Dict[str, CodedValues]:
        """``key``'s coded columns (metric -> :class:`CodedValues`; the dict held, not a copy)."""
        return self._columns[key]

    @property
    def nbytes(self) -> int:
        """Bytes held by every column."""
        return sum(column.nbytes for columns in self._columns.values() for column in columns.values())

    def __getitem__(self, key: str) -> Mapping[str, Tensor]:
        return _Metrics(self._columns[key])

    def __contains__(self, key: object) -> bool:
        return key in self._columns

    def __iter__(self) -> Iterator[str]:
        return iter(self._columns)

    def __len__(self) -> int:
        return len(self._columns)

    def __repr__(self) -> str:
        return f"PerTurnMetrics({len(self)} keys, {self.nbytes:,} bytes)"
