"""How kept coefficients are stored: precision, per-band steps, and the error that costs.

Every stored value is ``coefficient / step[band]`` cast to the storage precision; decoding multiplies back.

Chop (fixed-size) precisions ``float32``, ``float16``, ``bfloat16``: the paper's mode; decode is a cast and
two matmuls. float32 and bfloat16 use unit steps; float16 uses a power-of-two step per band that puts the
band's largest magnitude near 2**15, so nothing overflows (max 65504) or falls into subnormals.

Quantized precisions ``int8``, ``int16``: ``q = round(c / step[band])``, with a dead zone in bands whose step
exceeds their RMS (:func:`rounding_offsets`: ``|c| / step`` is rounded after taking 0.15 off it). The step of
each band is
``max(base_step * weight[band], maxabs[band] / qmax)``: the requested step, enlarged where needed so no value
saturates (qmax = 127 or 32767). Without a base step each band is scaled to the full integer range
(fixed-point, ``maxabs / qmax``): the fixed-size integer mode.

Error model. The DCT is orthonormal blockwise (edge blocks included), so squared error in coefficient space
equals squared error in data space. For a chunk of N values::

    N * MSE = dropped + sum over stored coefficients of (c - step * q)**2  (+ N/12 for integers)

``dropped`` is the energy of the coefficients the mask removes (= sum x**2 - sum of stored c**2, by
Parseval), q the stored level; the last term is the rounding of integer outputs. :func:`coefficient_error`
computes the exact quantization term (the PSNR search starts from the classic high-rate guess, ``step**2 /
12`` per stored coefficient: :func:`dctchop.codec._step_for_psnr`).
"""

from __future__ import annotations

import math

import numpy as np

from dctchop.errors import DctchopError
from dctchop.jit import numba
from dctchop.transform import work_dtype

FLOAT_PRECISIONS = ("float32", "float16", "bfloat16")
INT_PRECISIONS = ("int8", "int16")
PRECISIONS = FLOAT_PRECISIONS + INT_PRECISIONS
STORAGE_DTYPES = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),  # the top 16 bits of a float32
    "int8": np.dtype("i1"),
    "int16": np.dtype("<i2"),
}
QMAX = {"int8": 127, "int16": 32767}
FLOAT16_TARGET_EXPONENT = 15


# Rounding |c| / step - 0.15 to nearest (levels 1, 2, ... start at 0.65, 1.65, ... steps) costs a little more
# error per value but zeroes many small coefficients, which the bit planes and zstd store for almost nothing.
# That pays in a band whose step exceeds its RMS (most of its values lie within a step of zero) and costs in a
# finer one. benchmarks/peers.py, dctchop's PSNR at equal ratio 4 / 8 / 16 against round-to-nearest: 32x32 RGB
# +0.40 / +0.45 / +0.52 dB, 28x28 grey +0.32 / +0.27 / +0.53, photos +0.28 / +0.37 / +0.49, 2-D field +0.07 /
# +0.16 / +0.56, 3-D field 0.00 / +0.08 / +0.47. The dead zone on every band costs the 2-D field 1.1 dB at 4
# and gives the images 0.04-0.13 dB less; at RMS x 0.5 or x 2 as the threshold, within 0.1 dB of this rule
# (x 2 below it). 0.1 does as well as 0.15; 0.2 and 0.25 are 0.1-0.4 dB worse.
DEAD_ZONE = 0.15


def rounding_offsets(steps: np.ndarray, rms: np.ndarray) -> np.ndarray:
    """Per band, what the quantizer adds to ``|c| / step`` before rounding down: 0.5 (nearest) in a band whose
    step is at most its RMS ``rms``, ``0.5 - DEAD_ZONE`` in a coarser one. The decoder does not need them."""
    return np.where(steps > rms, 0.5 - DEAD_ZONE, 0.5)


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise DctchopError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


# Single-pass kernels over band-major values: run s covers values[seg_starts[s]:seg_starts[s + 1]] of band
# seg_bands[s]. Integer rounding is _level everywhere, so the error the PSNR search measures is the error the
# stored chunk has.


@numba.njit(inline="always")
def longest_run(seg_starts):  # pragma: no cover - compiled
    """The most values any run holds: the size of a kernel's per-run buffer."""
    longest = 0
    for s in range(seg_starts.size - 1):
        longest = max(longest, seg_starts[s + 1] - seg_starts[s])
    return longest


# Kernels reach a run through a slice, never as values[start + i]: numba checks a signed index that it cannot
# prove non-negative for wraparound on every access, which stops LLVM vectorising the loop (quantize 5x,
# bit-plane pack and unpack 3-5x slower).
@numba.njit(nogil=True, cache=True)
def _band_maxabs(values, seg_starts, seg_bands, out):  # pragma: no cover - compiled
    for s in range(seg_bands.size):
        m = out[seg_bands[s]]
        for v in values[seg_starts[s] : seg_starts[s + 1]]:
            m = max(m, abs(v))
        out[seg_bands[s]] = m


@numba.njit(inline="always")
def _level(value, inv, qmax, offset):  # pragma: no cover - compiled
    """The quantization level of ``value`` (``inv`` = 1 / step): ``floor(|value| * inv + offset)`` with its
    sign, at most qmax (offset 0.5: nearest, halves away from zero; less: a dead zone)."""
    m = min(np.floor(abs(value) * inv + offset), qmax)
    return m if value >= 0 else -m


@numba.njit(nogil=True, cache=True)
def _quantize_int(values, seg_starts, seg_bands, steps, qmax, offsets, out):  # pragma: no cover - compiled
    for s in range(seg_bands.size):
        inv, offset = 1.0 / steps[seg_bands[s]], offsets[seg_bands[s]]
        src, dst = values[seg_starts[s] : seg_starts[s + 1]], out[seg_starts[s] : seg_starts[s + 1]]
        for i in range(src.size):
            dst[i] = _level(src[i], inv, qmax, offset)


@numba.njit(inline="always")
def _lane_sum(t, n):  # pragma: no cover - compiled
    """``t[:n]`` summed in eight interleaved lanes, then the lanes pairwise. A fixed order, so the same on every
    machine, that the compiler vectorises; one running float64 sum is a chain of dependent additions."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
    for i in range(0, n - n % 8, 8):
        a0 += t[i]
        a1 += t[i + 1]
        a2 += t[i + 2]
        a3 += t[i + 3]
        a4 += t[i + 4]
        a5 += t[i + 5]
        a6 += t[i + 6]
        a7 += t[i + 7]
    for i in range(n - n % 8, n):
        a0 += t[i]
    return ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))


@numba.njit(nogil=True, cache=True)
def _int_error(values, seg_starts, seg_bands, steps, qmax, offsets, out):  # pragma: no cover - compiled
    """Squared quantization error; the quantized values go to ``out`` unless it is empty. Each run's squared
    errors are summed by :func:`_lane_sum` after a loop that only quantizes (3x faster than one loop)."""
    keep = out.size > 0
    squares = np.empty(longest_run(seg_starts))
    total = 0.0
    for s in range(seg_bands.size):
        step, offset = steps[seg_bands[s]], offsets[seg_bands[s]]
        inv = 1.0 / step
        src = values[seg_starts[s] : seg_starts[s + 1]]
        dst = out[seg_starts[s] : seg_starts[s + 1]] if keep else out
        for i in range(src.size):
            q = _level(src[i], inv, qmax, offset)
            if keep:
                dst[i] = q
            d = src[i] - q * step
            squares[i] = d * d
        total += _lane_sum(squares, src.size)
    return total


@numba.njit(nogil=True, cache=True)
def _dequantize(stored, first, seg_starts, seg_bands, steps, out, to):  # pragma: no cover - compiled
    for s in range(seg_bands.size):
        n = seg_starts[s + 1] - seg_starts[s]
        step = steps[seg_bands[s]]
        src, dst = stored[first[s] : first[s] + n], out[to[s] : to[s] + n]
        for i in range(n):
            dst[i] = src[i] * step


@numba.njit(nogil=True, cache=True)
def _energy(a):  # pragma: no cover - compiled
    total = 0.0
    for i in range(a.size):
        v = np.float64(a[i])
        total += v * v
    return total


def energy(a: np.ndarray) -> float:
    """Sum of squares in float64, without a float64 copy of ``a``."""
    a = np.ascontiguousarray(a if a.dtype != np.float16 else a.astype(np.float32)).reshape(-1)
    return float(_energy(a))


def band_maxabs(values: np.ndarray, seg_starts: np.ndarray, seg_bands: np.ndarray, n_bands: int) -> np.ndarray:
    """Largest magnitude of each band over all its runs (float64, zeros for empty bands)."""
    out = np.zeros(n_bands)
    _band_maxabs(values, seg_starts, seg_bands, out)
    return out


@numba.njit(nogil=True, cache=True)
def _band_energy(values, seg_starts, seg_bands, energy, count):  # pragma: no cover - compiled
    """Sum of squares and number of values of each band (squares summed as in :func:`_int_error`)."""
    squares = np.empty(longest_run(seg_starts))
    for s in range(seg_bands.size):
        run = values[seg_starts[s] : seg_starts[s + 1]]
        for i in range(run.size):
            squares[i] = np.float64(run[i]) * np.float64(run[i])
        energy[seg_bands[s]] += _lane_sum(squares, run.size)
        count[seg_bands[s]] += run.size


def band_rms(values: np.ndarray, seg_starts: np.ndarray, seg_bands: np.ndarray, n_bands: int) -> np.ndarray:
    """Root mean square of each band over all its runs (float64, zeros for empty bands)."""
    energy, count = np.zeros(n_bands), np.zeros(n_bands, np.int64)
    _band_energy(values, seg_starts, seg_bands, energy, count)
    return np.sqrt(energy / np.maximum(count, 1))


def choose_steps(
    maxabs: np.ndarray, precision: str, base_step: float | None = None, weights: np.ndarray | None = None
) -> np.ndarray:
    """Per-band steps for one chunk (float64); ``base_step`` None means full-range fixed point for integers."""
    n = maxabs.size
    if precision in ("float32", "bfloat16"):
        return np.ones(n)
    if precision == "float16":
        exps = np.where(maxabs > 0, np.ceil(np.log2(np.where(maxabs > 0, maxabs, 1.0))), 0.0)
        return np.exp2(exps - FLOAT16_TARGET_EXPONENT)
    steps = maxabs / QMAX[precision]
    if base_step is not None:
        if not (base_step > 0 and math.isfinite(base_step)):
            raise DctchopError(f"quantization step must be a positive number, got {base_step}")
        w = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
        steps = np.maximum(base_step * w, steps)
    return _float32_exact(np.where(steps > 0, steps, 1.0))


def _float32_exact(steps: np.ndarray) -> np.ndarray:
    """``steps`` rounded up to float32 where it holds them as normal numbers (the others as they are), so
    that decoding float32 work multiplies in float32 (:func:`decode_steps`). Up: a step stays at least the
    largest coefficient over ``QMAX``. It moves a step by at most one float32 ulp (2^-23 of it)."""
    with np.errstate(over="ignore"):
        up = steps.astype(np.float32)
    up = np.where(up < steps, np.nextafter(up, np.float32(np.inf)), up).astype(np.float64)
    return np.where(np.isfinite(up) & (up >= np.finfo(np.float32).tiny), up, steps)


def decode_steps(steps: np.ndarray, dtype) -> np.ndarray:
    """``steps`` (float64) as the dequantizing kernels take them for data of ``dtype``: float32 where that is
    the work dtype and it holds every step exactly (as :func:`choose_steps` makes them), else float64. A
    level (an integer, exact in float32) times a step is then a float32 product, eight to a vector with AVX2
    (float64: four), and the same value: the product is exact in float64 and rounded once to float32 either
    way. On a Zen 3 machine that took :func:`dctchop.bitplanes._unpack_dequantize` from 110 to 74 µs a slab
    of 85 32x32 RGB images."""
    if work_dtype(dtype) != np.float32:
        return steps
    with np.errstate(over="ignore"):
        as_float32 = steps.astype(np.float32)
    return as_float32 if np.array_equal(as_float32, steps) else steps


def quantize(values: np.ndarray, steps: np.ndarray, seg_starts, seg_bands, precision: str,
             offsets: np.ndarray | None = None) -> np.ndarray:
    """Stored values (storage dtype) of band-major coefficients; integer precisions round with the per-band
    ``offsets`` (:func:`rounding_offsets`; None: to nearest)."""
    if precision in INT_PRECISIONS:
        out = np.empty(values.shape, dtype=STORAGE_DTYPES[precision])
        offsets = _nearest(steps, offsets)
        _quantize_int(values, seg_starts, seg_bands, steps, float(QMAX[precision]), offsets, out)
        return out
    scaled = np.empty(values.shape, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # steps past float's range: the codec refuses the result
        for s, e, b in zip(seg_starts[:-1], seg_starts[1:], seg_bands):
            np.multiply(values[s:e], 1.0 / steps[b], out=scaled[s:e], casting="unsafe")
    if precision == "float16":
        return scaled.astype(np.float16)
    if precision == "bfloat16":
        return float32_to_bfloat16_bits(scaled)
    return scaled


def dequantize(stored: np.ndarray, steps: np.ndarray, seg_starts, seg_bands, precision: str, dtype) -> np.ndarray:
    """Band-major coefficients (``dtype``) from stored values."""
    if precision == "bfloat16":
        stored = bfloat16_bits_to_float32(stored)
    out = stored.astype(dtype)
    for s, e, b in zip(seg_starts[:-1], seg_starts[1:], seg_bands):
        if steps[b] != 1.0:
            out[s:e] *= steps[b]
    return out


def numeric(stored: np.ndarray, precision: str) -> np.ndarray:
    """Stored values as an array :func:`dequantize_into` takes (numba has no float16; bfloat16 is bits)."""
    if precision == "bfloat16":
        return bfloat16_bits_to_float32(stored)
    if precision == "float16":
        return stored.astype(np.float32)
    return stored


def dequantize_into(stored: np.ndarray, steps: np.ndarray, first, seg_starts, seg_bands, out: np.ndarray,
                    to: np.ndarray) -> None:
    """``out = dequantize(pieces of stored)`` (a slab's values): run ``s`` takes ``stored[first[s]:]``, as many
    values as ``seg_starts`` gives it, to ``out[to[s]:]`` (``to = seg_starts``: storage order, as
    :func:`dctchop.transform.place` takes them; :attr:`dctchop.transform.BandMajor.to`: band-major).
    ``stored`` from :func:`numeric`."""
    _dequantize(stored, first, seg_starts, seg_bands, steps, out, to)


def float32_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even) and return the 16 bits as uint16."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    return ((bits + rounding) >> 16).astype(np.uint16)


def bfloat16_bits_to_float32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint32) << 16).view(np.float32)


def coefficient_error(values: np.ndarray, steps: np.ndarray, seg_starts, seg_bands, precision: str,
                      offsets: np.ndarray | None = None) -> float:
    """Sum of squared quantization error over the stored coefficients (float64, exact up to its rounding)."""
    if precision in INT_PRECISIONS:
        nothing = np.empty(0, dtype=STORAGE_DTYPES[precision])
        return float(_int_error(values, seg_starts, seg_bands, steps, float(QMAX[precision]),
                                _nearest(steps, offsets), nothing))
    restored = dequantize(quantize(values, steps, seg_starts, seg_bands, precision), steps, seg_starts,
                          seg_bands, precision, np.float64)
    return float(np.sum((values.astype(np.float64) - restored) ** 2))


def quantize_with_error(values: np.ndarray, steps: np.ndarray, seg_starts, seg_bands, precision: str,
                        offsets: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """(:func:`quantize`, :func:`coefficient_error`) of an integer precision in one pass."""
    out = np.empty(values.shape, dtype=STORAGE_DTYPES[precision])
    return out, float(_int_error(values, seg_starts, seg_bands, steps, float(QMAX[precision]),
                                 _nearest(steps, offsets), out))


def _nearest(steps: np.ndarray, offsets: np.ndarray | None) -> np.ndarray:
    """``offsets``, or round-to-nearest in every band."""
    return np.full(steps.size, 0.5) if offsets is None else np.asarray(offsets, dtype=np.float64)


@numba.njit(nogil=True, cache=True)
def _error_stats_int(x, y, rows):  # pragma: no cover - compiled
    """Exact, in int64 (which also vectorises)."""
    sse = worst = np.int64(0)
    for i in range(x.shape[0]):
        if rows[i]:
            for j in range(x.shape[1]):
                d = np.int64(y[i, j]) - np.int64(x[i, j])
                sse += d * d
                worst = max(worst, abs(d))
    return sse, worst


@numba.njit(nogil=True, cache=True)
def _error_stats_float(x, y, rows):  # pragma: no cover - compiled
    """In float64, row by row: the differences, then their largest magnitude (as the integer it is bitwise:
    for finite floats the order is the same) and their squares summed by :func:`_lane_sum`. Each is a loop the
    compiler vectorises, where a running maximum of floats and a strict running sum are not (2x faster)."""
    sse = 0.0
    worst = np.int64(0)
    diff = np.empty(x.shape[1])
    bits = diff.view(np.int64)
    magnitude = np.int64(0x7FFFFFFFFFFFFFFF)
    for i in range(x.shape[0]):
        if rows[i]:
            xi, yi = x[i], y[i]
            for j in range(xi.size):
                diff[j] = np.float64(yi[j]) - np.float64(xi[j])
            for j in range(xi.size):
                worst = max(worst, bits[j] & magnitude)
            for j in range(xi.size):
                diff[j] = diff[j] * diff[j]
            sse += _lane_sum(diff, xi.size)
    return sse, np.full(1, worst).view(np.float64)[0]


def error_stats(x: np.ndarray, y: np.ndarray, rows: np.ndarray | None = None) -> tuple[float, float]:
    """(sum of squared error, max abs error) of ``y`` against ``x`` over the samples (axis 0) in ``rows``."""
    if x.dtype == np.float16:  # numba has no float16 arrays
        x, y = x.astype(np.float32), y.astype(np.float32)
    n = x.shape[0] if x.ndim else 1
    rows = np.ones(n, dtype=np.bool_) if rows is None else rows
    kernel = _error_stats_int if x.dtype.kind in "iu" and y.dtype.kind in "iu" else _error_stats_float
    sse, worst = kernel(x.reshape(n, -1), y.reshape(n, -1), rows)
    return float(sse), float(worst)


# The highest PSNR target taken (dB); float64's own rounding lies about 310 dB below the peak.
MAX_PSNR = 400


def psnr(mse: float, peak: float) -> float:
    """20 log10(peak) - 10 log10(MSE); +inf for an exact reconstruction."""
    if mse <= 0:
        return math.inf
    if peak <= 0:
        return -math.inf
    return 20.0 * math.log10(peak) - 10.0 * math.log10(mse)


def range_peak(lo: float, hi: float) -> float:
    """PSNR peak of data with values in ``[lo, hi]`` (every dtype but uint8): their range, or 1 for a constant
    array, whose range of 0 would make every PSNR -inf."""
    return hi - lo if hi > lo else 1.0


def fixed_peak(dtype) -> float | None:
    """The PSNR peak of uint8, 255, as for every 8-bit image; None for the other dtypes, whose peak is their
    data's range (:func:`range_peak`). 16-bit integers mostly hold 10- to 14-bit samples (microscopy, CT, raw
    sensors): against uint16's 65535, a 12-bit image's 40 dB allowed errors of 655, a sixth of its range."""
    return 255.0 if np.dtype(dtype) == np.uint8 else None


def data_peak(x: np.ndarray) -> float:
    """The PSNR peak of ``x`` on its own: uint8's 255, else its range (1 when it is empty or constant)."""
    peak = fixed_peak(x.dtype)
    if peak is None:
        peak = range_peak(float(x.min()), float(x.max())) if x.size else 1.0
    return peak
