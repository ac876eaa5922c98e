"""Coded per-turn values: lossless round trips, the narrowest code dtype, joins, exact slice sums."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedRuntimeError, MapMatchedValueError
from mapmatched_torch.eval.turn_values import CodedColumnWriter, CodedValues, PerTurnMetrics, code_dtype


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int64)


def test_decode_is_bit_exact_for_every_kind_of_float():
    odd = [0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, -5e-324, 1.7976931348623157e308, 1 / 3, 2 / 3]
    values = torch.tensor(odd * 3, dtype=torch.float64)
    coded = CodedValues.encode(values)
    assert coded.bits.numel() == len(odd)  # -0.0 and 0.0 stay two values
    assert torch.equal(_bits(coded.decode()), _bits(values))


@pytest.mark.parametrize("distinct, dtype", [(1, torch.uint8), (256, torch.uint8), (257, torch.int16),
                                             (1 << 15, torch.int16), ((1 << 15) + 1, torch.int32)])
def test_codes_take_the_narrowest_dtype(distinct, dtype):
    values = torch.arange(distinct, dtype=torch.float64).repeat(2) / 7.0
    coded = CodedValues.encode(values)
    assert coded.codes.dtype == dtype == code_dtype(distinct)
    assert torch.equal(coded.decode(), values)


def test_float32_input_is_kept_as_its_float64_value():
    values = torch.tensor([0.1, 0.2, 0.1], dtype=torch.float32)
    assert torch.equal(CodedValues.encode(values).decode(), values.to(torch.float64))


def test_concat_equals_coding_the_joined_column():
    generator = torch.Generator().manual_seed(0)
    parts = [torch.randint(0, 3, (50,), generator=generator).to(torch.float64) / 3.0,
             torch.arange(300, dtype=torch.float64).flip(0) / 3.0,
             torch.randint(0, 5, (50,), generator=generator).to(torch.float64) / 3.0]
    joined = CodedValues.concat([CodedValues.encode(part) for part in parts])
    whole = CodedValues.encode(torch.cat(parts))
    assert torch.equal(joined.bits, whole.bits) and torch.equal(joined.codes, whole.codes)
    assert joined.codes.dtype == torch.int16  # the joined table has more than 256 values


def test_concat_of_nothing_and_bad_input_are_refused():
    with pytest.raises(MapMatchedValueError, match="at least one part"):
        CodedValues.concat([])
    with pytest.raises(MapMatchedValueError, match="1-D floating"):
        CodedValues.encode(torch.arange(3))
    with pytest.raises(MapMatchedValueError, match="bool tensor"):
        CodedValues.encode(torch.zeros(3, dtype=torch.float64)).masked_sum(torch.ones(2, dtype=torch.bool))


@pytest.mark.parametrize("distinct", [7, 70_000])  # counted table; table too large to count (exact tree sums)
def test_masked_sum_is_math_fsum(distinct):
    rng = random.Random(distinct)
    table = [rng.uniform(-1, 1) * 10.0 ** rng.randint(-8, 8) for _ in range(distinct)]
    column = [rng.choice(table) for _ in range(80_000)]
    mask = [rng.random() < 0.7 for _ in column]
    coded = CodedValues.encode(torch.tensor(column, dtype=torch.float64))
    chosen = [value for value, keep in zip(column, mask) if keep]
    assert coded.masked_sum(torch.tensor(mask)) == math.fsum(chosen)
    assert coded.masked_mean(torch.tensor(mask)) == math.fsum(chosen) / len(chosen)
    assert coded.masked_sum() == math.fsum(column)


def test_masked_sum_cancels_exactly_where_float_sums_do_not():
    column = torch.tensor([1e16, 1.0, -1e16, 1.0] * 1000, dtype=torch.float64)
    assert CodedValues.encode(column).masked_sum() == 2000.0


def test_masked_sum_edges():
    coded = CodedValues.encode(torch.tensor([1.0, math.nan, 2.0], dtype=torch.float64))
    assert coded.masked_sum(torch.tensor([True, False, True])) == 3.0  # the NaN is not counted
    assert math.isnan(coded.masked_sum())
    assert coded.masked_sum(torch.zeros(3, dtype=torch.bool)) == 0.0
    assert math.isnan(coded.masked_mean(torch.zeros(3, dtype=torch.bool)))


def test_per_turn_metrics_is_a_mapping_of_decoded_tensors():
    values = {"ndcg@3": torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64),
              "mrr": torch.tensor([1.0, 0.25, 0.0], dtype=torch.float64)}
    metrics = PerTurnMetrics.of({"pointwise": values})
    assert PerTurnMetrics.of(metrics) is metrics
    assert list(metrics) == ["pointwise"] and "pointwise" in metrics and "other" not in metrics
    row = metrics["pointwise"]
    assert list(row) == ["ndcg@3", "mrr"] and "mrr" in row and len(row) == 2
    assert all(torch.equal(row[name], tensor) for name, tensor in values.items())
    assert metrics.column("pointwise", "mrr").codes.dtype == torch.uint8
    assert metrics.nbytes == sum(column.nbytes for column in metrics.columns("pointwise").values())
    metrics.put("copy", metrics.columns("pointwise"))
    assert torch.equal(metrics["copy"]["mrr"], values["mrr"])


def test_writer_equals_coding_the_whole_column_and_widens_as_values_appear():
    generator = torch.Generator().manual_seed(1)
    parts = [torch.tensor([0.5, -0.0, 0.0, math.nan], dtype=torch.float64), torch.zeros(0, dtype=torch.float64),
             torch.randint(0, 5, (40,), generator=generator).to(torch.float64) / 3.0,
             torch.arange(400, dtype=torch.float64).flip(0) / 7.0,  # past 256 values: the codes widen
             torch.tensor([0.5, 1e300], dtype=torch.float32)]
    writer = CodedColumnWriter(sum(part.numel() for part in parts) + 3, torch.device("cpu"))
    for part in parts:
        writer.append(part)
    written = writer.finish()
    whole = CodedValues.encode(torch.cat([part.to(torch.float64) for part in parts]))
    assert torch.equal(written.bits, whole.bits) and torch.equal(written.codes, whole.codes)
    assert written.codes.dtype == torch.int16
    assert torch.equal(whole.bits, torch.unique(_bits(torch.cat([part.to(torch.float64) for part in parts]))))


def test_writer_refuses_overflow_and_bad_input_and_finishes_empty():
    writer = CodedColumnWriter(2, torch.device("cpu"))
    assert len(writer.finish()) == 0
    writer.append(torch.tensor([1.0, 2.0], dtype=torch.float64))
    with pytest.raises(MapMatchedRuntimeError, match="do not fit"):
        writer.append(torch.tensor([3.0], dtype=torch.float64))
    with pytest.raises(MapMatchedValueError, match="1-D floating"):
        writer.append(torch.tensor([1, 2]))
    assert writer.finish().decode().tolist() == [1.0, 2.0]  # nothing lost
