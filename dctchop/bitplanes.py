"""Bit-plane layout of quantized coefficients: what the lossless stage compresses best.

Quantized DCT coefficients are mostly zero or small. Stored as plain int8/int16, zstd sees bytes that mix
sign and magnitude bits. Here each band's run is zigzag-mapped (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...) and
split into bit planes (all values' bit 7, then bit 6, ...; for int16 the high byte's planes first). High
planes are long runs of zeros; planes that are entirely zero (whole high-frequency bands often are) are not
stored at all. zstd then compresses the result smaller and faster than plain int8 (measured on the bundled
images at 40 dB: ratio 4.35 -> 5.25 before zero-plane skipping). Planes are made eight values at a time
with an 8x8 bit-matrix transpose of one 64-bit word, its own inverse.

Layout for runs of n_s values (values padded with zeros to a multiple of 8):

- first the masks, one per run, ``itemsize`` bytes little-endian: bit p set when plane p (0 = least
  significant bit of the zigzag value) holds a one;
- then, run by run, from the most significant plane down, each set plane as ``ceil(n_s / 8)`` bytes, value
  ``8 m + j`` of the run in bit ``j`` (least significant first) of byte ``m``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dctchop.errors import CorruptChunkError
from dctchop.jit import numba
from dctchop.quantize import longest_run


@numba.njit(inline="always")
def _transpose8(x):  # pragma: no cover - compiled
    t = (x ^ (x >> np.uint64(7))) & np.uint64(0x00AA00AA00AA00AA)
    x = x ^ t ^ (t << np.uint64(7))
    t = (x ^ (x >> np.uint64(14))) & np.uint64(0x0000CCCC0000CCCC)
    x = x ^ t ^ (t << np.uint64(14))
    t = (x ^ (x >> np.uint64(28))) & np.uint64(0x00000000F0F0F0F0)
    return x ^ t ^ (t << np.uint64(28))


@numba.njit(inline="always")
def _set_planes(byte_mask, planes_out):  # pragma: no cover - compiled
    """Indices of the set bits of one mask byte, most significant first; returns how many."""
    n = 0
    for b in range(7, -1, -1):
        if (byte_mask >> np.uint64(b)) & np.uint64(1):
            planes_out[n] = b
            n += 1
    return n


# Runs and plane rows are reached through slices (see the note on indexing in dctchop.quantize).
@numba.njit(inline="always")
def _scatter_planes(words, groups, n, planes_of, block, out):  # pragma: no cover - compiled
    """Inverse of :func:`_gather_planes`: the ``n`` set planes ``planes_of`` of a run's transposed words, each
    as ``groups`` bytes, from ``block`` on in ``out``."""
    for j in range(n):
        shift = np.uint64(8 * planes_of[j])
        row = out[block + j * groups : block + (j + 1) * groups]
        for g in range(groups):
            row[g] = np.uint8((words[g] >> shift) & np.uint64(0xFF))


@numba.njit(inline="always")
def _even_bytes(w):  # pragma: no cover - compiled
    """The bytes at even positions of ``w`` packed into its low 32 bits."""
    w &= np.uint64(0x00FF00FF00FF00FF)
    w = (w | (w >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
    return (w | (w >> np.uint64(16))) & np.uint64(0x00000000FFFFFFFF)


@numba.njit(nogil=True, cache=True)
def _pack(q, seg_starts, masks, out):  # pragma: no cover - compiled
    """Masks and planes run by run; returns the bytes written. A run is zigzagged once into a buffer (taking
    its mask on the way), which read as 64-bit words gives each group of 8 values' low and high bytes with a
    few shifts (numba's targets are all little-endian); the words are transposed and the set planes written
    out, each step a loop over the run's groups that the compiler vectorises."""
    bits = 8 * q.itemsize
    longest = longest_run(seg_starts)
    zigzag = np.zeros((longest + 7) // 8 * 8, dtype=q.dtype)
    words = zigzag.view(np.uint64)
    lo_words = np.empty((longest + 7) // 8, dtype=np.uint64)
    hi_words = np.empty((longest + 7) // 8, dtype=np.uint64)
    lo_planes = np.empty(8, dtype=np.int64)
    hi_planes = np.empty(8, dtype=np.int64)
    pos = 0
    for s in range(seg_starts.size - 1):
        start, n = seg_starts[s], seg_starts[s + 1] - seg_starts[s]
        groups = (n + 7) // 8
        m = 0
        run = q[start : start + n]
        for i in range(n):
            v = np.int64(run[i])
            z = (v << 1) ^ (v >> (bits - 1))
            zigzag[i] = z
            m |= z
        zigzag[n : groups * 8] = 0
        m = np.uint64(m) & np.uint64((1 << bits) - 1)
        masks[s] = m
        if m == 0:
            continue
        n_hi = _set_planes((m >> np.uint64(8)) & np.uint64(0xFF), hi_planes)  # 0 for int8
        n_lo = _set_planes(m & np.uint64(0xFF), lo_planes)
        if bits == 8:
            for g in range(groups):
                lo_words[g] = _transpose8(words[g])
        else:
            for g in range(groups):  # values 8g..8g+3 and 8g+4..8g+7
                w0, w1 = words[2 * g], words[2 * g + 1]
                lo_words[g] = _transpose8(_even_bytes(w0) | (_even_bytes(w1) << np.uint64(32)))
            if n_hi:
                for g in range(groups):
                    w0, w1 = words[2 * g] >> np.uint64(8), words[2 * g + 1] >> np.uint64(8)
                    hi_words[g] = _transpose8(_even_bytes(w0) | (_even_bytes(w1) << np.uint64(32)))
        _scatter_planes(hi_words, groups, n_hi, hi_planes, pos, out)  # the high byte's planes come first
        _scatter_planes(lo_words, groups, n_lo, lo_planes, pos + n_hi * groups, out)
        pos += (n_hi + n_lo) * groups
    return pos


# Unpacking works a run (or a slab's piece of one) at a time, in loops over its groups that the compiler
# vectorises: each set plane's bytes are ORed into one 64-bit word per group at that plane's byte, the words
# are transposed (byte k = value k), the zigzag is undone, and the values are read off the words' bytes.
# About 1.5x faster than decoding group by group with the values extracted one by one.
@numba.njit(inline="always")
def _gather_planes(planes, block, groups, g0, n_groups, n, planes_of, words):  # pragma: no cover - compiled
    """``words[g]``: byte ``k`` holds value ``k``'s bits in the ``n`` set planes ``planes_of`` of group ``g0 + g``,
    the planes' bytes being those of a run of ``groups`` groups whose planes start at ``block``."""
    for g in range(n_groups):
        words[g] = 0
    for j in range(n):
        shift = np.uint64(8 * planes_of[j])
        row = planes[block + j * groups + g0 : block + j * groups + g0 + n_groups]
        for g in range(n_groups):
            words[g] |= np.uint64(row[g]) << shift
    for g in range(n_groups):
        words[g] = _transpose8(words[g])


@numba.njit(inline="always")
def _decode_run(planes, block, groups, g0, n_groups, mask, n_bytes, set_planes, lo_words,
                hi_words):  # pragma: no cover - compiled
    """Groups ``g0 ..`` of a run with ``mask`` whose planes start at ``block``, into ``lo_words`` and ``hi_words``.
    Returns whether there is a high byte (the values: :func:`_high_value`; without one the zigzag is undone on
    the low words already, whose bytes are then the values as int8) and the run's number of planes."""
    n_hi = 0
    if n_bytes == 2:
        n_hi = _set_planes((mask >> np.uint64(8)) & np.uint64(0xFF), set_planes[1])
    n_lo = _set_planes(mask & np.uint64(0xFF), set_planes[0])
    _gather_planes(planes, block + n_hi * groups, groups, g0, n_groups, n_lo, set_planes[0], lo_words)
    if n_hi:
        _gather_planes(planes, block, groups, g0, n_groups, n_hi, set_planes[1], hi_words)
        return True, n_lo + n_hi
    for g in range(n_groups):
        lo_words[g] = _unzigzag_bytes(lo_words[g])
    return False, n_lo


@numba.njit(inline="always")
def _unzigzag_bytes(lo):  # pragma: no cover - compiled
    """Eight zigzagged bytes undone at once; value ``k`` is then byte ``k`` read as an int8."""
    half = (lo >> np.uint64(1)) & np.uint64(0x7F7F7F7F7F7F7F7F)
    return half ^ ((lo & np.uint64(0x0101010101010101)) * np.uint64(0xFF))


# Reading the values off the words: a loop per case (a high byte or not), through slices of the words from the
# run's first value, and in int32, which AVX2 converts to float64 in vectors (int64 only with AVX-512). With the
# case tested per value and the words indexed from a skipped start, the dequantizing loop ran scalar: 1.5-3.9x
# slower on a Zen 3 machine (:func:`_unpack_dequantize` alone on 32x32 RGB chunks, alternating processes).
@numba.njit(inline="always")
def _high_value(lo_bytes, hi_bytes, i):  # pragma: no cover - compiled
    """Value ``i`` of a run with a high byte decoded by :func:`_decode_run` (``lo_bytes``, ``hi_bytes``: its
    words as uint8)."""
    u = np.int32(lo_bytes[i]) | (np.int32(hi_bytes[i]) << np.int32(8))
    return (u >> np.int32(1)) ^ -(u & np.int32(1))


@numba.njit(inline="always")
def _run_buffers(seg_starts):  # pragma: no cover - compiled
    """Words for the longest run (and a piece of one starting up to 7 values into a group), and their int8 /
    uint8 views."""
    longest = longest_run(seg_starts)
    lo_words = np.zeros((longest + 14) // 8, dtype=np.uint64)
    hi_words = np.zeros((longest + 14) // 8, dtype=np.uint64)
    return lo_words, hi_words, lo_words.view(np.int8), lo_words.view(np.uint8), hi_words.view(np.uint8)


@numba.njit(nogil=True, cache=True)
def _unpack(planes, seg_starts, masks, q):  # pragma: no cover - compiled
    set_planes = np.empty((2, 8), dtype=np.int64)
    lo_words, hi_words, signed, lo_bytes, hi_bytes = _run_buffers(seg_starts)
    pos = 0
    for s in range(seg_starts.size - 1):
        start, n = seg_starts[s], seg_starts[s + 1] - seg_starts[s]
        groups = (n + 7) // 8
        high, n_planes = _decode_run(planes, pos, groups, 0, groups, masks[s], q.itemsize, set_planes, lo_words,
                                     hi_words)
        run = q[start : start + n]
        if high:
            for i in range(n):
                run[i] = _high_value(lo_bytes, hi_bytes, i)
        else:
            for i in range(n):
                run[i] = signed[i]
        pos += groups * n_planes


def to_planes(q: np.ndarray, seg_starts: np.ndarray) -> bytes:
    """int8/int16 band-major values -> masks + bit planes."""
    n_runs = seg_starts.size - 1
    masks = np.empty(n_runs, dtype=np.uint64)
    head = n_runs * q.itemsize
    out = np.empty(head + q.itemsize * 8 * int(np.sum((np.diff(seg_starts) + 7) // 8)), dtype=np.uint8)
    n = _pack(q, seg_starts, masks, out[head:])
    out[:head] = masks.astype(f"<u{q.itemsize}").view(np.uint8)
    return out[: head + n].tobytes()


@numba.njit(nogil=True, cache=True)
def _unpack_dequantize(planes, offsets, run_starts, masks, n_bytes, first, seg_starts, seg_bands, steps,
                       out, to):  # pragma: no cover - compiled
    """``out[to[s] + i] = value * step`` for a piece of every run ``s``: the int values are never
    stored. The piece holds the values from storage position ``first[s]`` of the chunk's run ``s``, which starts
    at ``run_starts[s]`` (8 values to a group) and whose planes start at ``offsets[s]``; a piece starting inside
    a group decodes the whole group and skips the values before it."""
    set_planes = np.empty((2, 8), dtype=np.int64)
    lo_words, hi_words, signed, lo_bytes, hi_bytes = _run_buffers(seg_starts)
    for s in range(seg_bands.size):
        n = seg_starts[s + 1] - seg_starts[s]
        if n == 0:  # a run with no block in the slab
            continue
        groups = (run_starts[s + 1] - run_starts[s] + 7) // 8
        g0, skip = divmod(first[s] - run_starts[s], 8)
        high, _ = _decode_run(planes, offsets[s], groups, g0, (skip + n + 7) // 8, masks[s], n_bytes, set_planes,
                              lo_words, hi_words)
        step, dst = steps[seg_bands[s]], out[to[s] : to[s] + n]
        if high:
            lo, hi = lo_bytes[skip : skip + n], hi_bytes[skip : skip + n]
            for i in range(n):
                dst[i] = np.float32(_high_value(lo, hi, i)) * step
        else:
            low = signed[skip : skip + n]
            for i in range(n):
                dst[i] = np.float32(low[i]) * step


@dataclass(frozen=True)
class Planes:
    """A checked bit-plane payload: the planes, each run's mask, where its planes start, the run starts, and
    per run a bound on its values' magnitudes from its mask (``largest_levels``: zigzag values below
    2^(p + 1), p the top set plane, are at most 2^p in magnitude; 0 for a run of zeros)."""

    data: np.ndarray
    masks: np.ndarray
    offsets: np.ndarray
    seg_starts: np.ndarray
    itemsize: int
    largest_levels: np.ndarray

    def unpack(self) -> np.ndarray:
        """The int values, band-major."""
        q = np.empty(int(self.seg_starts[-1]), dtype=f"i{self.itemsize}")
        _unpack(self.data, self.seg_starts, self.masks, q)
        return q

    def dequantize_into(self, steps, first, seg_starts, seg_bands, out, to) -> None:
        """:func:`dctchop.quantize.dequantize_into` straight from the planes."""
        _unpack_dequantize(self.data, self.offsets, self.seg_starts, self.masks, self.itemsize, first, seg_starts,
                           seg_bands, steps, out, to)


@numba.njit(nogil=True, cache=True)
def _plane_layout(masks, seg_starts, offsets, largest):  # pragma: no cover - compiled
    """Per run ``s`` with mask ``masks[s]``: where its planes start (``offsets[s]``; ``offsets[-1]``: where the
    last run's end), a byte row per set plane of its groups of 8, and ``largest[s]`` (see :class:`Planes`).
    One pass: with numpy's ufuncs over a chunk's 2048 runs it took a 32³ field chunk 0.1 ms in the loader."""
    pos = 0
    for s in range(masks.size):
        offsets[s] = pos
        n_set, top = 0, -1
        for b in range(16):  # masks of int8 and int16 runs
            if (masks[s] >> np.uint64(b)) & np.uint64(1):
                n_set += 1
                top = b
        pos += (seg_starts[s + 1] - seg_starts[s] + 7) // 8 * n_set
        largest[s] = 0.0 if top < 0 else 2.0**top
    offsets[masks.size] = pos


def check_planes(data: memoryview | bytes, seg_starts: np.ndarray, dtype) -> Planes:
    """Split a payload into masks and planes; CorruptChunkError when its size does not match the masks."""
    dtype = np.dtype(dtype)
    n_runs = seg_starts.size - 1
    head = n_runs * dtype.itemsize
    if len(data) < head:
        raise CorruptChunkError("bit-plane payload is shorter than its run masks")
    masks = np.frombuffer(data, dtype=f"<u{dtype.itemsize}", count=n_runs).astype(np.uint64)
    offsets, largest = np.empty(n_runs + 1, np.int64), np.empty(n_runs)
    _plane_layout(masks, seg_starts, offsets, largest)
    expected = head + int(offsets[-1])
    if len(data) != expected:
        raise CorruptChunkError(f"bit-plane payload is {len(data)} bytes, its masks say {expected}")
    return Planes(np.frombuffer(data, dtype=np.uint8, offset=head), masks, offsets[:-1], seg_starts, dtype.itemsize,
                  largest)
