"""Storage precisions, per-band steps and the error model (dctchop.quantize)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dctchop import quantize as qz
from dctchop.codec import ChunkSettings, decode_chunk, encode_chunk, read_header
from dctchop.errors import DctchopError
from dctchop.transform import compress_array, decompress_array, make_plan

HYP = settings(max_examples=100, deadline=None, derandomize=True)
BF16_MAX = (2.0 - 2.0**-7) * 2.0**127


# ---------------------------------------------------------------------------------------------- bfloat16


def bfloat16_reference(x32: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (8 significant bits, float32's exponent range, subnormals included)
    to nearest, ties to even, in float64 arithmetic. Returns float64."""
    x = np.asarray(x32, dtype=np.float32).astype(np.float64)
    out = x.copy()
    finite = np.isfinite(x)
    _, e = np.frexp(x[finite])  # |x| = m * 2**e, 0.5 <= m < 1
    quantum = np.ldexp(1.0, np.maximum(e, -125) - 8)  # below 2**-126 the quantum stays 2**-133
    r = np.round(x[finite] / quantum) * quantum  # np.round: half to even; both steps exact in float64
    r = np.where(np.abs(r) > BF16_MAX, np.copysign(np.inf, r), r)
    out[finite] = r
    return out


def _bf16_round_trip(x32):
    bits = qz.float32_to_bfloat16_bits(x32)
    assert bits.dtype == np.uint16
    return qz.bfloat16_bits_to_float32(bits).astype(np.float64)


def _check_bf16(x32):
    got = _bf16_round_trip(x32)
    ref = bfloat16_reference(x32)
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(ref))


def test_bfloat16_random_bit_patterns():
    bits = np.random.default_rng(0).integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    _check_bf16(x[np.isfinite(x)])


def test_bfloat16_ties_round_to_even():
    rng = np.random.default_rng(1)
    upper = rng.integers(0, 0x7F7F, size=5000, dtype=np.uint32)  # finite, below the largest bfloat16
    upper = np.concatenate([upper, np.arange(0, 8, dtype=np.uint32), [0x7F7E, 0x7F7F - 1]]).astype(np.uint32)
    sign = rng.integers(0, 2, size=upper.size, dtype=np.uint32) << np.uint32(31)
    for low in (0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF):
        x = ((upper << np.uint32(16)) | np.uint32(low) | sign).view(np.float32)
        _check_bf16(x)
    # a tie sits exactly halfway: even upper halves stay, odd ones round away from zero
    tie = ((upper << np.uint32(16)) | np.uint32(0x8000)).view(np.float32)
    expected = np.where(upper % 2 == 0, upper, upper + 1).astype(np.uint16)
    np.testing.assert_array_equal(qz.float32_to_bfloat16_bits(tie), expected)


def test_bfloat16_special_values():
    x = np.array([0.0, -0.0, 1.0, -1.0, 1.5, 3.0e38, -3.0e38, np.finfo(np.float32).max, np.inf, -np.inf,
                  1e-45, -1e-45, 1.1754942e-38, 2.0**-133, 2.0**-134, 3 * 2.0**-134], dtype=np.float32)
    _check_bf16(x)
    assert np.isposinf(_bf16_round_trip(np.array([np.finfo(np.float32).max], np.float32)))[0]


@HYP
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=50))
def test_bfloat16_property(values):
    _check_bf16(np.array(values, dtype=np.float32))


# ---------------------------------------------------------------------------------------------- float16 steps


def test_float16_steps_put_band_max_near_2_pow_15():
    maxabs = np.array([5.2e5, 65504.0, 3.0, 1.0, 1e-8, 0.0, 2.0**20])
    steps = qz.choose_steps(maxabs, "float16")
    scaled = maxabs / steps
    assert np.all(scaled[maxabs > 0] <= 2.0**15) and np.all(scaled[maxabs > 0] > 2.0**14)
    assert np.all(np.log2(steps) == np.round(np.log2(steps)))  # powers of two: exact scaling
    assert steps[5] > 0 and np.isfinite(steps[5])


def _smooth(rng, shape, scale, offset=0.0):
    """A smooth random field: a few low-frequency sinusoids plus a little noise."""
    grids = np.meshgrid(*[np.linspace(0, 1, s) for s in shape], indexing="ij")
    out = np.full(shape, offset, dtype=np.float64)
    for _ in range(4):
        f = rng.uniform(0.5, 2.5, len(shape))
        phase = sum(2 * np.pi * fi * g for fi, g in zip(f, grids)) + rng.uniform(0, 6)
        out += rng.uniform(0.3, 1.0) * np.sin(phase)
    out += 0.01 * rng.standard_normal(shape)
    return out * scale


def test_float16_large_values_do_not_overflow():
    rng = np.random.default_rng(2)
    x = np.clip(_smooth(rng, (2, 32, 32), 2000.0, offset=0.0) + 62000, 0, 65535).astype(np.uint16)
    s = ChunkSettings((1, 2), (8, 8), (8, 8), precision="float16")
    chunk = encode_chunk(x, s)
    header = read_header(chunk)
    plan = make_plan(x.shape, (1, 2), 8, 8)
    assert float(np.max(np.abs(compress_array(x, plan)))) > 4.5e5  # DC ~ 8 * 62000 far above 65504
    payload = np.frombuffer(chunk, dtype="<f2", offset=header.payload_offset)
    assert np.all(np.isfinite(payload))
    y = decode_chunk(chunk, x.shape, x.dtype)
    rel = np.sqrt(np.mean((y.astype(np.float64) - x) ** 2)) / np.sqrt(np.mean(x.astype(np.float64) ** 2))
    assert rel < 1e-3


def test_float16_tiny_values_avoid_subnormals():
    rng = np.random.default_rng(3)
    x = (_smooth(rng, (2, 24, 40), 1.0) * 1e-8).astype(np.float32)
    s = ChunkSettings((1, 2), (8, 8), (8, 8), precision="float16")
    y = decode_chunk(encode_chunk(x, s), x.shape, x.dtype)
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    assert np.max(err) / np.max(np.abs(x)) < 2e-3
    assert np.sqrt(np.mean(err**2)) / np.sqrt(np.mean(x.astype(np.float64) ** 2)) < 2e-3
    # without per-band steps the same coefficients would be subnormal or zero in float16
    plan = make_plan(x.shape, (1, 2), 8, 8)
    v = compress_array(x, plan)
    naive = v.astype(np.float16).astype(np.float64)
    assert np.max(np.abs(naive - v)) / np.max(np.abs(v)) > 0.05


# ---------------------------------------------------------------------------------------------- int steps


def _band_major(rng, shape=(3, 40, 36), block=8, keep=5, mask="square"):
    x = _smooth(rng, shape, 100.0) + rng.standard_normal(shape) * 3
    plan = make_plan(shape, (1, 2), block, keep, mask)
    values = compress_array(x, plan)
    seg_starts, seg_bands = plan.runs.seg_starts, plan.runs.seg_bands
    return x, plan, values, seg_starts, seg_bands


def _steps_per_value(steps, seg_starts, seg_bands, n):
    out = np.empty(n)
    for s, e, b in zip(seg_starts[:-1], seg_starts[1:], seg_bands):
        out[s:e] = steps[b]
    return out


@pytest.mark.parametrize("precision", ["int8", "int16"])
@pytest.mark.parametrize("base_step", [None, 1e-6, 0.01, 1.0, 50.0])
def test_int_precisions_never_saturate(precision, base_step):
    rng = np.random.default_rng(4)
    _, plan, values, seg_starts, seg_bands = _band_major(rng)
    n_bands = len(plan.bands)
    maxabs = qz.band_maxabs(values, seg_starts, seg_bands, n_bands)
    weights = rng.uniform(0.5, 3.0, n_bands)
    steps = qz.choose_steps(maxabs, precision, base_step, weights)
    full_range = maxabs / qz.QMAX[precision]
    expected = full_range if base_step is None else np.maximum(base_step * weights, full_range)
    expected = np.where(expected > 0, expected, 1.0)
    # rounded up to float32 (decode_steps): at most one float32 ulp more
    assert np.all(steps >= expected) and np.all(steps.astype(np.float32) == steps)
    np.testing.assert_allclose(steps, expected, rtol=2.0**-23)
    q = qz.quantize(values, steps, seg_starts, seg_bands, precision)
    assert q.dtype == qz.STORAGE_DTYPES[precision]
    assert np.max(np.abs(q.astype(np.int64))) <= qz.QMAX[precision]
    restored = qz.dequantize(q, steps, seg_starts, seg_bands, precision, np.float64)
    per_value = _steps_per_value(steps, seg_starts, seg_bands, values.size)
    # no value is clipped: every error stays within half a step (plus the float32 rounding of c / step,
    # up to 2**-24 * qmax steps); a saturated value would be off by a whole step or more
    slack = 2.0**-23 * qz.QMAX[precision]
    ratio = np.abs(values - restored) / per_value
    assert np.max(ratio) <= 0.5 + slack


@pytest.mark.parametrize("precision", ["int8", "int16"])
def test_dead_zone_in_bands_coarser_than_their_rms(precision):
    rng = np.random.default_rng(7)
    _, plan, values, seg_starts, seg_bands = _band_major(rng)
    n_bands = len(plan.bands)
    maxabs = qz.band_maxabs(values, seg_starts, seg_bands, n_bands)
    rms = qz.band_rms(values, seg_starts, seg_bands, n_bands)
    per_band = [np.concatenate([values[a:b] for a, b, k in zip(seg_starts[:-1], seg_starts[1:], seg_bands)
                                if k == band]).astype(np.float64) for band in range(n_bands)]
    np.testing.assert_allclose(rms, [np.sqrt(np.mean(v**2)) for v in per_band], rtol=1e-12)
    steps = qz.choose_steps(maxabs, precision, float(np.median(rms)))
    offsets = qz.rounding_offsets(steps, rms)
    assert set(offsets) == {0.5, 0.5 - qz.DEAD_ZONE}  # this data has bands of both kinds
    assert np.array_equal(offsets == 0.5, steps <= rms)
    q = qz.quantize(values, steps, seg_starts, seg_bands, precision, offsets).astype(np.int64)
    per_value = _steps_per_value(steps, seg_starts, seg_bands, values.size)
    scaled = values.astype(np.float64) / per_value
    offset = _steps_per_value(offsets, seg_starts, seg_bands, values.size)
    expected = np.sign(scaled) * np.minimum(np.floor(np.abs(scaled) + offset), qz.QMAX[precision])
    differ = q != expected  # only where |c| / step sits within float rounding of a threshold
    assert np.count_nonzero(differ) <= 2 and np.all(np.abs(q - expected) <= 1)
    nearest = qz.quantize(values, steps, seg_starts, seg_bands, precision)
    assert np.count_nonzero(q) < np.count_nonzero(nearest)
    # the error the PSNR search measures is the error of these levels
    direct = float(np.sum((values.astype(np.float64) - q * per_value) ** 2))
    q2, error = qz.quantize_with_error(values, steps, seg_starts, seg_bands, precision, offsets)
    np.testing.assert_array_equal(q2, q)
    assert error == pytest.approx(direct, rel=1e-9)
    assert qz.coefficient_error(values, steps, seg_starts, seg_bands, precision, offsets) == error


@pytest.mark.parametrize("dtype", ["uint8", "int16", "float16", "float32", "float64"])
def test_energy_is_the_float64_sum_of_squares(dtype):
    x = (np.random.default_rng(3).standard_normal((5, 7, 9)) * 40).astype(dtype)
    assert qz.energy(x) == pytest.approx(float(np.sum(x.astype(np.float64) ** 2)), rel=1e-12)


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int16", "float16", "float32", "float64"])
def test_error_stats_over_counted_rows(dtype):
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((6, 5, 7)) * 300 + 30000).clip(-32768, 65535).astype(dtype)
    y = (x.astype(np.float64) + rng.standard_normal(x.shape) * 200).clip(-32768, 65535).astype(dtype)
    rows = np.array([True, False, True, True, False, True])
    d = (y.astype(np.float64) - x.astype(np.float64))[rows]
    sse, worst = qz.error_stats(x, y, rows)
    assert sse == pytest.approx(float(np.sum(d**2)), rel=1e-12)
    assert worst == float(np.max(np.abs(d)))


def test_steps_are_float32_where_float32_holds_them():
    """choose_steps rounds each step up to float32 where float32 has it as a normal number; decode_steps then
    hands the kernels float32 steps for float32 work, float64 ones otherwise."""
    tiny, big = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    maxabs = np.array([0.1, 1 / 3, 7.0, 1e-300, tiny / 3, big * 8, 0.0]) * qz.QMAX["int16"]
    steps = qz.choose_steps(maxabs, "int16")
    wanted = maxabs / qz.QMAX["int16"]
    held = steps[:3].astype(np.float32)  # the smallest float32 at least the step wanted
    assert np.all(held == steps[:3]) and np.all(steps[:3] >= wanted[:3])
    assert np.all(np.nextafter(held, np.float32(0)) < wanted[:3])
    assert steps[3:6].tolist() == wanted[3:6].tolist()  # below float32's normal numbers, or past its range
    assert steps[6] == 1.0
    for dtype in (np.uint8, np.int16, np.float16, np.float32):
        assert qz.decode_steps(steps[:3], dtype).dtype == np.float32
        assert qz.decode_steps(steps, dtype) is steps  # one step float32 cannot hold: all float64
    assert qz.decode_steps(steps[:3], np.float64).dtype == np.float64  # float64 work multiplies in float64


def test_dequantizing_in_float32_gives_the_float64_products():
    """Levels times float32-exact steps: the same float32 values whether the kernel multiplies in float32 or
    in float64 (the product is exact in float64 and rounded once either way)."""
    from dctchop.bitplanes import check_planes, to_planes

    rng = np.random.default_rng(11)
    for precision, top in (("int8", 127), ("int16", 32767)):
        seg_starts = np.array([0, 40, 41, 200, 333], np.int64)
        q = (rng.integers(-top, top + 1, 333) // rng.choice([1, 64, 4096], 333)).astype(qz.STORAGE_DTYPES[precision])
        steps = qz.choose_steps(rng.uniform(0.001, 300, 4) * top, precision, float(rng.uniform(1e-4, 10)))
        planes = check_planes(to_planes(q, seg_starts), seg_starts, q.dtype)
        bands, first = np.arange(4), seg_starts[:-1].copy()
        outs = []
        for kernel_steps in (steps, qz.decode_steps(steps, np.float32)):
            out = np.zeros(333, np.float32)
            planes.dequantize_into(kernel_steps, first, seg_starts, bands, out, seg_starts[:-1].copy())
            outs.append(out)
        assert outs[1].dtype == np.float32
        np.testing.assert_array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
        expected = (q.astype(np.float64) * steps[np.repeat(bands, np.diff(seg_starts))]).astype(np.float32)
        np.testing.assert_array_equal(outs[1], expected)


def test_band_maxabs_and_step_requirements():
    values = np.array([1.0, -3.0, 2.0, -0.5, 0.0])
    starts = np.array([0, 2, 3, 5])
    bands = np.array([0, 1, 0])
    np.testing.assert_array_equal(qz.band_maxabs(values, starts, bands, 3), [3.0, 2.0, 0.0])
    np.testing.assert_array_equal(qz.choose_steps(np.array([3.0, 0.0]), "float32"), [1.0, 1.0])
    np.testing.assert_array_equal(qz.choose_steps(np.array([3.0, 0.0]), "bfloat16"), [1.0, 1.0])
    assert np.all(qz.choose_steps(np.zeros(3), "int8", 0.0 + 1e-300) > 0)
    # no base step: each band scaled to the full integer range (fixed-size integer mode)
    np.testing.assert_allclose(qz.choose_steps(np.array([254.0, 0.0]), "int8"), [2.0, 1.0])
    np.testing.assert_allclose(qz.choose_steps(np.array([32767.0 * 3]), "int16", None), [3.0])
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(DctchopError):
            qz.choose_steps(np.ones(2), "int16", bad)
    with pytest.raises(DctchopError):
        qz.check_precision("int4")


# ---------------------------------------------------------------------------------------------- error model


def _direct_restore(values, per_value, precision):
    v = values.astype(np.float64)
    if precision == "float32":
        return v.astype(np.float32).astype(np.float64)
    if precision == "bfloat16":
        return bfloat16_reference(v.astype(np.float32))
    if precision == "float16":
        return (v / per_value).astype(np.float16).astype(np.float64) * per_value
    return np.round(v / per_value) * per_value


@pytest.mark.parametrize("precision", qz.PRECISIONS)
@pytest.mark.parametrize("mask", ["square", "triangle"])
def test_coefficient_error_equals_direct_error(precision, mask):
    rng = np.random.default_rng(5)
    _, plan, values, seg_starts, seg_bands = _band_major(rng, mask=mask)
    maxabs = qz.band_maxabs(values, seg_starts, seg_bands, len(plan.bands))
    steps = qz.choose_steps(maxabs, precision, 0.7 if precision in qz.INT_PRECISIONS else None)
    per_value = _steps_per_value(steps, seg_starts, seg_bands, values.size)
    direct = float(np.sum((values.astype(np.float64) - _direct_restore(values, per_value, precision)) ** 2))
    got = qz.coefficient_error(values, steps, seg_starts, seg_bands, precision)
    assert direct > 0
    assert got == pytest.approx(direct, rel=1e-4)


@pytest.mark.parametrize("precision", ["int8", "int16"])
@pytest.mark.parametrize("base_step", [0.5, 2.0, 8.0])
def test_error_decomposition_gives_the_real_mse(precision, base_step):
    rng = np.random.default_rng(6)
    x, plan, values, seg_starts, seg_bands = _band_major(rng, shape=(4, 48, 48), keep=6)
    maxabs = qz.band_maxabs(values, seg_starts, seg_bands, len(plan.bands))
    steps = qz.choose_steps(maxabs, precision, base_step)
    restored = qz.dequantize(qz.quantize(values, steps, seg_starts, seg_bands, precision), steps, seg_starts,
                             seg_bands, precision, np.float64)
    y = decompress_array(restored, plan, np.float64)
    real = float(np.mean((x - y) ** 2))
    dropped = float(np.sum(x**2) - np.sum(values**2))
    # the exact decomposition the module documents: N * MSE = dropped + quantization error
    exact = (dropped + qz.coefficient_error(values, steps, seg_starts, seg_bands, precision)) / x.size
    assert exact == pytest.approx(real, rel=1e-6)


def test_psnr_definition():
    assert qz.psnr(1.0, 255.0) == pytest.approx(20 * math.log10(255))
    assert qz.psnr(4.0, 2.0) == pytest.approx(0.0, abs=1e-12)
    assert qz.psnr(0.01, 1.0) == pytest.approx(20.0)
    assert qz.psnr(65.025, 255.0) == pytest.approx(30.0)
    for mse, peak in [(3.7, 100.0), (1e-6, 2.5)]:
        assert qz.psnr(mse, peak) == pytest.approx(10 * math.log10(peak**2 / mse))
    assert qz.psnr(0.0, 255.0) == math.inf
    assert qz.psnr(1.0, 0.0) == -math.inf
    assert qz.fixed_peak(np.uint8) == 255.0
    for dtype in (np.uint16, np.int16, np.float16, np.float32, np.float64):  # their data's range
        assert qz.fixed_peak(dtype) is None
