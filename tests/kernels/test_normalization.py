"""The batched normalization equals normalize_scores bit for bit (sign of zero included)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from mapmatched_torch.core.scoring import normalize_scores
from mapmatched_torch.kernels.normalization import normalize_score_rows


@pytest.fixture(autouse=True, params=["compiled", "tensor"])
def normalization_path(request):
    """Every test twice: the numba pass (where numba is installed) and the tensor path."""
    from mapmatched_torch.kernels.backend import use_backend

    with use_backend("auto" if request.param == "compiled" else "torch"):
        yield request.param


def random_row(rng: random.Random, width: int):
    kind = rng.randrange(8)
    count = rng.randint(1, width)
    if kind == 0:
        return [rng.choice([1.0, -0.0, 0.0])] * count  # constant: std exactly 0
    if kind == 1:
        return [rng.choice([1e300, -1e300, 3.0]) for _ in range(count)]  # squares overflow to inf
    if kind == 2:
        return [rng.choice([5e-324, -5e-324, 1e-310, 0.0]) for _ in range(count)]  # subnormals
    if kind == 3:
        return [float(rng.randint(-3, 3)) for _ in range(count)]  # exact ties
    if kind == 4:
        return [rng.uniform(-1, 1) * 10 ** rng.randint(-8, 8) for _ in range(count)]  # mixed magnitudes
    return [rng.gauss(0, 1) for _ in range(count)]


def bits(values):
    return torch.tensor(values, dtype=torch.float64).view(torch.int64).tolist()


@pytest.mark.parametrize("method", ["zscore", "center", "none"])
def test_rows_equal_normalize_scores_bit_for_bit(method):
    rng = random.Random(method)
    width = 9
    rows = [random_row(rng, width) for _ in range(400)] + [[2.5], [-0.0]]
    padded = torch.tensor([row + [rng.choice([0.0, 7.0])] * (width - len(row)) for row in rows], dtype=torch.float64)
    out = normalize_score_rows(padded, [len(row) for row in rows], method)
    refused = 0
    for row, got in zip(rows, out.tolist()):
        try:
            expected = normalize_scores(row, method)
        except ValueError:  # an overflowing sum (squares of 1e300 included): the batch marks the row NaN
            refused += 1
            assert all(math.isnan(value) for value in got[: len(row)]), row
        else:
            assert bits(got[: len(row)]) == bits(expected), row
        assert got[len(row):] == [0.0] * (width - len(row))
    assert (refused > 0) == (method == "zscore")  # only z-scores square the deviations


def test_empty_rows_and_overflowing_sums():
    raw = torch.tensor([[1e308, 1e308, 0.0], [1.0, 2.0, 3.0], [4.0, 4.0, 4.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match="exact sum overflows"):
        normalize_scores([1e308, 1e308], "zscore")  # the reference raises; the batch marks the row NaN
    out = normalize_score_rows(raw, [2, 0, 3])
    assert all(math.isnan(value) for value in out[0, :2].tolist()) and out[0, 2] == 0.0
    assert out[1].tolist() == [0.0, 0.0, 0.0] and out[2].tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="unsupported score normalization"):
        normalize_score_rows(raw, [1, 1, 1], "minmax")


@pytest.mark.parametrize(
    "row",
    [
        [1e200, -1e200, 0.0],  # each square overflows to inf (it used to give all zeros)
        [1e154, -1e154],  # finite squares whose exact sum overflows
        [1e300, 3.0],  # one large deviation
        [1.7e308, -1.7e308, -1.7e308],  # r - mean overflows
        [1e308, 1e308],  # the exact sum of the scores overflows
    ],
)
def test_every_overflow_is_the_same_error_and_a_nan_row_in_the_batch(row):
    with pytest.raises(ValueError, match="^scores too large to normalize: .* overflows the float range"):
        normalize_scores(row, "zscore")
    out = normalize_score_rows(torch.tensor([row, [1.0] * len(row)], dtype=torch.float64), [len(row), len(row)])
    assert all(math.isnan(value) for value in out[0].tolist()) and out[1].tolist() == [0.0] * len(row)


def test_large_scores_below_the_overflow_still_normalize_bit_for_bit():
    row = [9e153, -9e153, 0.0]  # squares 8.1e307: finite, and so is their exact sum
    expected = normalize_scores(row, "zscore")
    assert expected[2] == 0.0 and expected[0] == -expected[1] > 1.0
    assert bits(normalize_score_rows(torch.tensor([row], dtype=torch.float64), [3])[0].tolist()) == bits(expected)


@pytest.mark.parametrize("method", ["zscore", "center", "none"])
def test_exact_candidate_normalization_keeps_every_candidate_in_its_slot(method):
    # the evaluation's (B, T, M) normalization packs each turn's real candidates (holes
    # allowed), normalizes them exactly and puts them back: == normalize_scores per turn
    from mapmatched_torch.eval.candidates import normalize_candidate_scores

    rng = random.Random(method + "slots")
    generator = torch.Generator().manual_seed(5)
    scores = torch.randn(4, 3, 7, generator=generator, dtype=torch.float64) * 10 ** rng.randint(-3, 3)
    mask = torch.rand(4, 3, 7, generator=generator) < 0.6
    mask[0, 0] = False  # a turn without candidates
    scores[~mask] = math.nan  # padding values are never read
    out = normalize_candidate_scores(scores, mask, method)
    for b in range(4):
        for t in range(3):
            slots = mask[b, t].nonzero().flatten().tolist()
            expected = normalize_scores([scores[b, t, m].item() for m in slots], method)
            assert bits([out[b, t, m].item() for m in slots]) == bits(expected)
            assert all(out[b, t, m].item() == 0.0 for m in range(7) if m not in slots)
    with pytest.raises(ValueError, match="overflow"):
        normalize_candidate_scores(torch.tensor([[[1e308, 1e308]]], dtype=torch.float64), torch.ones(1, 1, 2, dtype=torch.bool))


# ----------------------------------------------------------- exact sums and roots on the device


def adversarial_rows(rng: random.Random, width: int):
    """Rows that break naive and compensated sums: cancellation, midpoints, wide exponents."""
    rows = []
    for _ in range(300):
        kind = rng.randrange(7)
        count = rng.randint(1, width)
        if kind == 0:  # 1 + tiny + -1: naive sums lose the tiny term
            big = 2.0 ** rng.randint(-20, 60)
            rows.append([big, 2.0 ** rng.randint(-80, -30) * rng.choice([1, 3, 5]), -big][:count] + [0.0] * 0)
        elif kind == 1:  # an exact sum on a rounding midpoint, a hair off it
            base = 2.0 ** rng.randint(0, 40)
            ulp = math.ulp(base)
            rows.append([base, ulp / 2, rng.choice([0.0, ulp * 2.0**-60, -ulp * 2.0**-60])])
        elif kind == 2:  # exponents across the whole range
            rows.append([rng.uniform(-1, 1) * 2.0 ** rng.randint(-1074, 1010) for _ in range(count)])
        elif kind == 3:  # huge values: the host path
            rows.append([rng.choice([1.5e308, -1.5e308, 9e307]) for _ in range(count)])
        elif kind == 4:  # subnormals
            rows.append([rng.randint(-5, 5) * 5e-324 for _ in range(count)])
        elif kind == 5:  # heavy cancellation of random values
            values = [rng.gauss(0, 1) * 10 ** rng.randint(0, 15) for _ in range(count)]
            rows.append(values + [-value for value in values[: count // 2]])
        else:
            rows.append([rng.gauss(0, 1) for _ in range(count)])
    return [row[:width] for row in rows]


def fsum_or_nan(row):
    try:
        total = math.fsum(row)
    except OverflowError:
        return math.nan
    return total if math.isfinite(total) else math.nan


def test_exact_row_sums_equal_fsum_bit_for_bit(device):
    from mapmatched_torch.kernels.normalization import exact_row_sums

    rng = random.Random(11)
    width = 12
    rows = adversarial_rows(rng, width) + [[], [0.0], [-0.0], [-0.0, -0.0], [math.inf, 1.0]]
    values = torch.tensor([row + [math.nan] * (width - len(row)) for row in rows], dtype=torch.float64)
    real = torch.tensor([[i < len(row) for i in range(width)] for row in rows])
    got = exact_row_sums(values.to(device), real.to(device)).cpu().tolist()
    expected = [fsum_or_nan(row) for row in rows]
    assert [math.isnan(value) for value in got] == [math.isnan(value) for value in expected]
    assert bits([0.0 if math.isnan(v) else v for v in got]) == bits([0.0 if math.isnan(v) else v for v in expected])


def test_exact_row_sums_certify_typical_rows_without_the_host(monkeypatch):
    # the host fsum is for the rare rows the bound cannot certify, not for ordinary data
    from mapmatched_torch.kernels import normalization

    calls = []
    monkeypatch.setattr(normalization, "_fsum_or_nan", lambda row: calls.append(row) or math.fsum(row))
    generator = torch.Generator().manual_seed(3)
    values = torch.rand(2048, 20, generator=generator, dtype=torch.float64) * 0.6 + 0.2  # cosine-like scores
    real = torch.rand(2048, 20, generator=generator) < 0.9
    got = normalization.exact_row_sums(values, real)
    assert got.tolist() == [math.fsum(v for v, r in zip(row, keep) if r) for row, keep in zip(values.tolist(), real.tolist())]
    assert len(calls) == 0
    normalization.exact_row_sums(torch.tensor([[1.0, 2.0**-53, 2.0**-106]], dtype=torch.float64), torch.ones(1, 3, dtype=torch.bool))
    assert len(calls) == 1  # a sum a hair above a rounding midpoint takes the host


def test_exact_sqrt_is_math_sqrt_bit_for_bit(device):
    from mapmatched_torch.kernels.normalization import exact_sqrt

    rng = random.Random(4)
    values = [rng.uniform(0, 1) * 2.0 ** rng.randint(-1074, 1023) for _ in range(20000)]
    values += [0.0, -0.0, math.inf, 4.0, 2.0**-1074, 2.0**-900, 2.0**-901 * 1.7, 1.7976931348623157e308]
    got = exact_sqrt(torch.tensor(values, dtype=torch.float64, device=device)).cpu().tolist()
    assert bits(got) == bits([math.sqrt(value) for value in values])
    assert math.isnan(exact_sqrt(torch.tensor([-1.0], dtype=torch.float64, device=device)).item())


def test_rows_normalize_on_the_device_as_on_the_host(device):
    rng = random.Random(9)
    width = 10
    rows = [random_row(rng, width) for _ in range(300)] + [row for row in adversarial_rows(rng, width) if row]
    padded = torch.tensor([row + [0.0] * (width - len(row)) for row in rows], dtype=torch.float64)
    counts = torch.tensor([len(row) for row in rows])
    out = normalize_score_rows(padded.to(device), counts.to(device), "zscore")
    assert out.device.type == device.type
    for row, got in zip(rows, out.cpu().tolist()):
        try:
            expected = normalize_scores(row, "zscore")
        except ValueError:
            assert all(math.isnan(value) for value in got[: len(row)]), row
        else:
            assert bits(got[: len(row)]) == bits(expected), row


def test_the_compiled_certified_sum_is_fsum_wherever_it_is_certain():
    # the numba pass certifies a compensated sum before it pays fsum's exact algorithm: a
    # certified sum that is not fsum's would change normalized scores in their last bit
    kernels = pytest.importorskip("mapmatched_torch.kernels.normalization_kernels")
    rng = random.Random(12)
    rows = adversarial_rows(rng, 12) + [random_row(rng, 12) for _ in range(300)]
    rows += [[1.0, 2.0**-53, 2.0**-106], [1.0, 2.0**-53], [2.0, -2.0**-53, -2.0**-106], [-0.0, -0.0], [5e-324] * 3]
    rows += [[1e308, 1e308, -1e308], [2.0**1019, 2.0**1019]]  # fsum's intermediate overflow and the range's end
    # cancellation: the errors' own rounding errors decide the last bit (found by a random search)
    rows += [
        [9.926167350636332e-24, 3221225472.0, 1.6689300537109375e-06, 1.3234889800848443e-23, 4.76837158203125e-07,
         -1.6689300537109375e-06, -3221225472.0, -1.2705494208814505e-21, -2.086162567138672e-07, -2.384185791015625e-07],
        [-1572864.0, -3.4924596548080444e-10, -9.693522803355793e-27, -2.481541837659083e-24, -4.1359030627651384e-25,
         2.5849394142282115e-26, -7.754818242684634e-26, -1.1641532182693481e-10, 4.656612873077393e-10, 1572864.0],
    ]
    uncertain = 0
    partials = np.empty(16)
    for row in rows:
        if not all(math.isfinite(value) for value in row):
            continue
        values = np.array(row + [0.0], dtype=np.float64)
        total, certain = kernels.certified_sum(values, len(row))
        expected = fsum_or_nan(row)
        if certain:
            assert bits([total]) == bits([expected]), row
        else:
            uncertain += 1
        exact = kernels._row_sum(values, len(row), partials)
        assert (math.isnan(exact) and math.isnan(expected)) or bits([exact]) == bits([expected]), row
    assert 0 < uncertain < len(rows) // 4  # the adversarial rows reach the exact path; most rows never do
    generator = torch.Generator().manual_seed(5)
    typical = (torch.randn(2000, 32, generator=generator, dtype=torch.float64) * 0.1 + 0.5).numpy()
    assert all(kernels.certified_sum(row, 32)[1] for row in typical)  # scores as providers return them


@pytest.mark.parametrize("method", ["zscore", "center", "none"])
def test_the_device_normalization_equals_the_exact_one_where_it_certifies(method, normalization_path):
    """normalize_score_rows_on_device (no host read) on the adversarial rows: every row it
    does not flag for the host is normalize_score_rows' bit for bit (NaN rows included);
    it flags only rows near overflow, and none of the ordinary ones."""
    from mapmatched_torch.kernels.normalization import normalize_score_rows_on_device
    from mapmatched_torch.testing import record_host_reads

    rng = random.Random(method + "device")
    width = 9
    rows = [random_row(rng, width) for _ in range(400)] + [[2.5], [-0.0], []]
    padded = torch.tensor([row + [rng.choice([0.0, 7.0])] * (width - len(row)) for row in rows], dtype=torch.float64)
    counts = torch.tensor([len(row) for row in rows])
    expected = normalize_score_rows(padded, counts, method)
    with record_host_reads() as reads:
        got, host = normalize_score_rows_on_device(padded, counts, method)
    assert not reads, str(reads)
    same = (got.view(torch.int64) == expected.view(torch.int64)).all(1)
    assert bool((same | host).all())
    magnitude = padded.abs().amax(1) * width
    assert bool((~host | (magnitude >= 2.0**1020) | (magnitude * magnitude >= 2.0**1020)).all())
    ordinary = torch.randn(200, width, dtype=torch.float64)
    assert not bool(normalize_score_rows_on_device(ordinary, torch.full((200,), width), method)[1].any())
