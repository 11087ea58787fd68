"""The dctchop chunk format and its Zarr v3 array-to-bytes codec.

An encoded chunk decodes on its own: a small little-endian header, then the stored coefficients band-major
(order below). This docstring and :mod:`dctchop.bitplanes` are the whole format: ``tests/test_spec.py`` holds a
decoder written from them alone (scipy's inverse DCT, no dctchop code) and checks it against this one on
every kind of layout and on the format fixtures.

======  ==========  =========================================================================
offset  type        field
======  ==========  =========================================================================
0       4 bytes     magic ``DCTC``
4       u8          format version (:data:`FORMAT_VERSION`)
5       u8          data dtype: 0 uint8, 1 uint16, 2 int16, 3 float16, 4 float32, 5 float64
6       u8          precision: 0 float32, 1 float16, 2 bfloat16, 3 int8, 4 int16
7       u8          mask code (0 square, 1 triangle)
8       u8          ndim of the chunk (1..32)
9       u8          number of transformed axes (1..3)
10      u16         flags: bit 0 = payload in bit planes (:mod:`dctchop.bitplanes`); bit 1 = compact
                    step table (below); bit 2 = an offset follows the value count; other bits 0
12      u32 x ndim  chunk shape
..      u8 x naxes  axes, then block sizes, then keep counts
..      u32         number of steps n: 0 (all steps are 1) or the number of bands of a full block
..      f64 x n     per-band steps, in :attr:`TransformPlan.bands` order; with flag bit 1, in place of
                    these n values only: f64 common step, u32 count k, then k x (u32 band, f64 step) for
                    the bands that differ
..      u64         number of stored values
..      f64         with flag bit 2: the offset, added to every decoded value (:func:`chunk_offset`)
..      payload     stored values in the precision's storage dtype, little-endian (flag 0 clear; bfloat16
                    as the top 16 bits of a float32), or their bit planes (flag 0 set, integer
                    precisions; int8/int16 chunks may also have it clear)
======  ==========  =========================================================================

This number is the chunk format's version; the store format (the ``store_format`` of a store's attributes)
is counted apart.

Which values are stored, and in what order (:mod:`dctchop.transform` says more):

- Each transformed axis of length L is cut into blocks of ``block``; a last block of r = L mod block samples
  has a DCT of its own length r and keeps ceil(r * keep / block) coefficients. Masks: ``square`` keeps
  band (i_1, .., i_n) when every i_d < k_d; ``triangle`` when sum_d i_d / k_d < 1, compared exactly, as
  sum_d i_d * prod_{e != d} k_e < prod_d k_d in integers (floating-point sums pick other bands), with an edge
  block's own keep counts as its k_d.
- Blocks fall in groups by shape: group g = sum_d 2^d * (the block is an edge block along transformed axis d),
  d counting the transformed axes from 0 (the first is the least significant bit): for 2-D blocks, the
  full blocks, then the edge row (short along the first axis), the edge column, the corner.
- Storage order: group by group; within a group, band by band in the full block's band order (C order of the
  band tuples, the triangle's left out), each band a run of the group's blocks in the C order of the array
  (untransformed axes included); a band an edge block does not keep has no run in that group. So a chunk
  without edge blocks is all blocks' band (0, 0), then (0, 1), and so on.
- Steps: a stored value is its level times its band's step, an edge block's band (i_1, .., i_n) taking the
  step of the full block's band with the same indices (there is one even where an axis has no full block).
- Output: the inverse DCT of each block (its kept coefficients, the rest zero), computed in float32 (float64
  for float64 data), converted to the data's dtype (integers round half up, floor(v + 0.5), and clip to the
  dtype's range; float16 rounds to nearest), then the offset added in that dtype. A decoder with other
  arithmetic may differ by one unit where a value lies within rounding of .5, and in the last bits of float
  output.
- A 3-long colour axis (RGB) is no special case: it is a transformed axis with block 3 and keep 3, whose DCT
  is the colour transform.

Every field is checked before anything is allocated from it; the chunk shape must equal the shape the
caller expects (Zarr's chunk spec), so a damaged header can neither crash the decoder nor make it allocate
more than one chunk.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import struct
import threading
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
from zarr.abc.codec import ArrayBytesCodec
from zarr.core.common import parse_named_configuration

from dctchop import quantize as qz
from dctchop.bitplanes import Planes, check_planes, to_planes
from dctchop.errors import CorruptChunkError, DctchopError
from dctchop.transform import (
    MASKS,
    Slab,
    TransformPlan,
    _pool,
    band_major,
    channels_first_shape,
    forward,
    gather,
    inverse,
    inverse_band_major,
    make_plan,
    place,
    slab_bounds,
    slabs,
    work_dtype,
)

if TYPE_CHECKING:
    from typing import Self

    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer, NDBuffer

CODEC_NAME = "dctchop"
MAGIC = b"DCTC"
FORMAT_VERSION = 1
DTYPE_CODES = {np.dtype(t): i for i, t in enumerate(("uint8", "uint16", "int16", "float16", "float32", "float64"))}
PRECISION_CODES = {p: i for i, p in enumerate(qz.PRECISIONS)}
MAX_NDIM = 32
MAX_STEPS = 64**3  # a step per band of the largest block
PSNR_RETRIES = 8
PSNR_RETRY_FACTOR = 0.97
SEARCH_SAMPLE = 1 << 16  # coefficients the PSNR step search runs on before its exact check
SEARCH_SLACK = 0.02  # a step whose error is within 2% under the budget is accepted
# Largest coefficient a float chunk may transform to, per arithmetic dtype: float32 keeps room for the inverse's
# partial sums; float64 keeps a chunk's squared errors (and peak**2 times its size) finite.
MAX_COEFFICIENT = {np.dtype(np.float32): float(np.finfo(np.float32).max) / 4, np.dtype(np.float64): 1e140}
_FIXED = struct.Struct("<4sBBBBBBH")
FLAG_BITPLANES = 1
FLAG_STEP_TABLE = 2
FLAG_OFFSET = 4
FLAGS = FLAG_BITPLANES | FLAG_STEP_TABLE | FLAG_OFFSET


def most_coded_bytes(shape: tuple[int, ...]) -> int:
    """An upper bound on the bytes of a chunk of ``shape``: its header with a full step table (12 bytes a
    step, with its band), and at most 18 bytes a value: float32 takes 4, int16 bit planes a 2-byte mask per
    run and up to 16 planes of a byte per 8 values or fewer (a run of one value: 18 bytes)."""
    return 4096 + 4 * MAX_NDIM + 12 * MAX_STEPS + 18 * math.prod(shape)


@dataclass(frozen=True)
class ChunkSettings:
    """What the encoder needs to know besides the data. ``step`` and ``target_psnr`` apply to the integer
    precisions (at most one of them; with neither, each band is scaled to the full integer range);
    ``peak`` is the PSNR peak for ``target_psnr`` on data other than uint8 (default: each chunk's own range)."""

    axes: tuple[int, ...]
    block: tuple[int, ...]
    keep: tuple[int, ...]
    mask: str = "square"
    precision: str = "float32"
    step: float | None = None
    target_psnr: float | None = None
    peak: float | None = None
    weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("step", "target_psnr", "peak"):
            object.__setattr__(self, name, _real(getattr(self, name), name))
        if self.weights is not None:
            object.__setattr__(self, "weights", tuple(_real(w, "weights") for w in self.weights))
        qz.check_precision(self.precision)
        if self.mask not in MASKS:
            raise DctchopError(f"mask must be one of {', '.join(MASKS)}, got {self.mask!r}")
        quantized = self.precision in qz.INT_PRECISIONS
        if self.step is not None and self.target_psnr is not None:
            raise DctchopError("give step or target_psnr, not both")
        if not quantized and (self.step is not None or self.target_psnr is not None):
            raise DctchopError(f"step and target_psnr apply to int8/int16, not {self.precision}")
        if self.step is not None and not (math.isfinite(self.step) and self.step > 0):
            raise DctchopError(f"step must be a positive number, got {self.step}")
        if self.target_psnr is not None and not 0 < self.target_psnr < qz.MAX_PSNR:
            raise DctchopError(f"target_psnr must be a number of dB above 0 and below {qz.MAX_PSNR}, got {self.target_psnr}")
        if self.peak is not None and not (math.isfinite(self.peak) and self.peak > 0):
            raise DctchopError(f"peak must be a positive number, got {self.peak}")
        bad = [w for w in self.weights or () if not (math.isfinite(w) and w > 0)]
        if bad:
            raise DctchopError(f"weights must be positive numbers; {len(bad)} are not, the first {bad[0]}")


def _real(value, name: str) -> float | None:
    """A number setting as a float (NumPy scalars included, which JSON would not take); None stays None."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise DctchopError(f"{name} must be a number, got {value!r}")
    return float(value)


# ---------------------------------------------------------------------------------------------- encode


def encode_chunk(x: np.ndarray, settings: ChunkSettings, threads: int = 1, valid_rows: int | None = None) -> bytes:
    """Compress one chunk into a self-describing byte string. ``valid_rows``: as in :func:`encode_and_measure`."""
    return _encode(x, settings, threads, measure=False, valid_rows=valid_rows)[0]


def encode_and_measure(x: np.ndarray, settings: ChunkSettings, valid_rows: int | None = None
                       ) -> tuple[bytes, float, float]:
    """:func:`encode_chunk`, plus (sum of squared error, max abs error) of what those bytes decode to
    against ``x``: a PSNR target measures that anyway. ``valid_rows``: only the first rows along axis 0
    are data (the rest pads a partial chunk), so the target and the measurement count those."""
    data, stats = _encode(x, settings, 1, measure=True, valid_rows=valid_rows)
    return data, *stats


@dataclass(frozen=True)
class Coefficients:
    """A chunk after the transform, before quantization: what every step tried on the chunk shares."""

    shape: tuple[int, ...]
    dtype: np.dtype
    settings: ChunkSettings
    plan: TransformPlan
    values: np.ndarray = field(repr=False)
    maxabs: np.ndarray = field(repr=False)
    offset: float = 0.0  # subtracted from the data before the transform (:func:`chunk_offset`)
    centred: np.ndarray | None = field(default=None, repr=False)  # what was transformed: data - offset

    @cached_property
    def rms(self) -> np.ndarray:
        """Each band's RMS, which decides where the integer precisions' dead zone goes
        (:func:`dctchop.quantize.rounding_offsets`); worked out on first use, as the chop precisions never
        need it."""
        seg_starts, seg_bands = self.plan.runs.seg_starts, self.plan.runs.seg_bands
        return qz.band_rms(self.values, seg_starts, seg_bands, len(self.plan.bands))

    @cached_property
    def dropped(self) -> float:
        """The squared error the mask alone makes, which no step removes: by Parseval, the energy of what was
        transformed less that of the kept coefficients (zero when every coefficient is kept)."""
        if self.values.size == self.centred.size:
            return 0.0
        return max(qz.energy(self.centred) - qz.energy(self.values), 0.0)


def chunk_offset(x: np.ndarray, valid_rows: int | None = None) -> float:
    """What a float32/float64 chunk is stored relative to: the midrange of its values (of its first
    ``valid_rows`` samples, the rest being padding) when they all lie farther from zero than their range
    (pressures in Pa, temperatures in K), else 0. Without it each block's DC coefficient carries the
    offset, and its int16 levels cap the PSNR: data at 101325 +- 250 Pa reached 55 dB at most; relative to
    its midrange, 107. In the data's dtype, so ``x - offset`` is exact for every such value (Sterbenz).
    Written through plain Zarr, a partial edge chunk comes padded with zeros that cannot be told from data:
    they count, so far-from-zero data gets no offset there and that chunk may fall short of ``target_psnr``
    (``dctchop compress`` passes the valid rows; :class:`DctChopCodec` cannot know them)."""
    if x.dtype not in (np.float32, np.float64) or x.size == 0:
        return 0.0
    data = x if valid_rows is None else x[:valid_rows]
    lo, hi = float(data.min()), float(data.max())
    mid = float(x.dtype.type((lo + hi) / 2))
    return mid if math.isfinite(mid) and abs(mid) > hi - lo else 0.0


def transform_chunk(x: np.ndarray, settings: ChunkSettings, threads: int = 1,
                    valid_rows: int | None = None) -> Coefficients:
    """The transform half of :func:`encode_chunk`: band-major coefficients of the chunk relative to its
    :func:`chunk_offset` (padding samples past ``valid_rows`` set to the offset), each band's largest
    magnitude."""
    x = _native(x)
    plan = make_plan(x.shape, settings.axes, settings.block, settings.keep, settings.mask)
    _weights(settings, plan)
    offset = chunk_offset(x, valid_rows)
    centred = x
    if offset:
        centred = x - x.dtype.type(offset)
        if valid_rows is not None:
            centred[valid_rows:] = 0  # padding: zeros cost nothing to store
    seg_starts, seg_bands = plan.runs.seg_starts, plan.runs.seg_bands
    values = gather(forward(centred, plan, threads), plan)
    maxabs = qz.band_maxabs(values, seg_starts, seg_bands, len(plan.bands))
    if x.dtype.kind == "f":
        _check_range(x, values, maxabs, plan, offset)
    return Coefficients(x.shape, x.dtype, settings, plan, values, maxabs, offset, centred)


def _check_range(x: np.ndarray, values: np.ndarray, maxabs: np.ndarray, plan: TransformPlan,
                 offset: float) -> None:
    """Refuse float data the arithmetic cannot carry: NaN or infinities, or values so large that the
    coefficients (up to sqrt(block volume) times the values) pass :data:`MAX_COEFFICIENT`, where the
    transform would overflow or the errors could not be measured. (``maxabs`` shows an infinity, not a NaN.)
    An ``offset`` is held to the same bound as the values: the decoded values are added to it, and data near
    float32's largest value would come back infinite."""
    work = work_dtype(x.dtype)
    limit = MAX_COEFFICIENT[work]
    largest = limit / math.sqrt(math.prod(plan.block))
    if float(np.max(maxabs, initial=0.0)) <= limit and abs(offset) <= largest and np.isfinite(values).all():
        return
    if not np.all(np.isfinite(x)):
        raise DctchopError("data holds NaN or infinite values")
    hint = ", or store it as float64" if work == np.float32 else ""
    raise DctchopError(f"values up to {float(np.max(np.abs(x))):.3g} are too large for the {work.name} transform "
                       f"(about {largest:.3g} at most with blocks of {math.prod(plan.block)}); scale the data "
                       f"down{hint}")


def encode_coefficients(c: Coefficients, step: float | None) -> bytes:
    """The rest of :func:`encode_chunk` with base step ``step`` (settings without a PSNR target): a search
    over steps transforms each chunk once."""
    settings = replace(c.settings, step=step)
    steps = qz.choose_steps(c.maxabs, settings.precision, step, _weights(settings, c.plan))
    return _serialize(c, settings, steps, _quantize(c, steps, settings.precision))


def _quantize(c: Coefficients, steps: np.ndarray, precision: str) -> np.ndarray:
    """The chunk's stored values at ``steps``; integer precisions with the dead zone in the bands it pays in
    (:func:`dctchop.quantize.rounding_offsets`)."""
    seg_starts, seg_bands = c.plan.runs.seg_starts, c.plan.runs.seg_bands
    offsets = qz.rounding_offsets(steps, c.rms) if precision in qz.INT_PRECISIONS else None
    return qz.quantize(c.values, steps, seg_starts, seg_bands, precision, offsets)


def check_dtype(dtype, what: str, hint: str = "") -> np.dtype:
    """``dtype`` in native byte order, when the codec takes it; else a DctchopError that starts with ``what``
    and ends with ``hint``."""
    native = np.dtype(dtype).newbyteorder("=")
    if native not in DTYPE_CODES:
        raise DctchopError(f"{what}: unsupported dtype {dtype} for lossy compression; supported: "
                           f"{', '.join(map(str, DTYPE_CODES))}{hint}")
    return native


def _native(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=check_dtype(x.dtype, "dctchop codec"))


def _weights(settings: ChunkSettings, plan: TransformPlan) -> np.ndarray | None:
    weights = None if settings.weights is None else np.asarray(settings.weights, dtype=np.float64)
    if weights is not None and weights.size != len(plan.bands):
        raise DctchopError(f"weights need one value per band ({len(plan.bands)}), got {weights.size}")
    return weights


def _serialize(c: Coefficients, settings: ChunkSettings, steps: np.ndarray, stored: np.ndarray) -> bytes:
    """Header and payload of a chunk's stored values."""
    unit = settings.precision in ("float32", "bfloat16")
    largest = float(np.max(c.maxabs, initial=0.0))
    tiny = float(np.finfo(np.float32).tiny)  # a Python float: compared with a float32, 1e139 warned of overflow
    if unit and 0 < largest < tiny:  # bfloat16 has float32's exponent range
        raise DctchopError(f"coefficients underflow {settings.precision}, which stores them unscaled: the largest "
                           f"is {largest:.3g}, below its smallest normal number {tiny:.3g}; "
                           "scale the data up or use float16/int16 (scaled per band)")
    if settings.precision in qz.INT_PRECISIONS:
        payload, flags = to_planes(stored, c.plan.runs.seg_starts), FLAG_BITPLANES
    elif _finite(stored, settings.precision):
        payload, flags = stored.tobytes(), 0
    else:  # what the decoder refuses is never written (float64 data far below 1 in float16 steps)
        raise DctchopError(f"coefficients overflow {settings.precision}; scale the data or use another precision")
    return _header(c.dtype, settings, c.plan, None if unit else steps, stored.size, flags, c.offset) + payload


def _encode(x: np.ndarray, settings: ChunkSettings, threads: int, measure: bool,
            valid_rows: int | None = None):
    x = _native(x)
    c = transform_chunk(x, settings, threads, valid_rows)
    plan, maxabs = c.plan, c.maxabs
    weights = _weights(settings, plan)
    rows = _counted_rows(x, plan.axes, valid_rows) if measure or settings.target_psnr is not None else None
    step, stored, stats = settings.step, None, None
    if settings.target_psnr is not None:
        step, target_sse, stored = _step_for_psnr(c, settings, weights, rows)
    coarse_output = x.dtype.kind in "iu" or x.dtype == np.float16  # rounding the output absorbs small errors
    if settings.target_psnr is not None and coarse_output:
        steps, stored, stats = _step_for_rounded_output(x, c, weights, rows, threads, step, target_sse, stored)
    else:
        steps = qz.choose_steps(maxabs, settings.precision, step, weights)
        if stored is None:
            stored = _quantize(c, steps, settings.precision)
    if settings.target_psnr is not None and not coarse_output:
        # The error model is exact in coefficient space; float rounding makes the real error differ slightly.
        # Check the reconstruction itself and tighten the step until the target holds.
        # The last try is the finest steps: in subnormal data the arithmetic errs far beyond the model, and
        # float32 data at 1e-40 was refused --psnr 92 ("reaches 91.98 dB") that its finest steps meet (96.3).
        finest = qz.choose_steps(maxabs, settings.precision)
        for attempt in range(PSNR_RETRIES + 1):
            y = _reconstruct(stored, steps, plan, settings.precision, x.dtype, threads, offset=c.offset)
            stats = qz.error_stats(x, y, rows)
            if stats[0] <= target_sse or np.all(steps <= finest) or attempt == PSNR_RETRIES:
                break
            step *= PSNR_RETRY_FACTOR
            steps = finest if attempt == PSNR_RETRIES - 1 else qz.choose_steps(maxabs, settings.precision, step,
                                                                                weights)
            stored = _quantize(c, steps, settings.precision)
    if measure and stats is None:
        y = _reconstruct(stored, steps, plan, settings.precision, x.dtype, threads, offset=c.offset)
        stats = qz.error_stats(x, y, rows)
    return _serialize(c, settings, steps, stored), stats


def _step_for_rounded_output(x: np.ndarray, c: Coefficients, weights, rows, threads: int, step: float,
                             target_sse: float, stored: np.ndarray | None):
    """(steps, stored values, error stats) at the largest base step whose reconstruction, rounded to the
    output dtype (integers, clipped; float16) meets ``target_sse``, searched from the model's ``step`` both
    ways on that reconstruction (``stored``: the values at ``step`` when the model's search made them, not made
    again).

    Rounding to integers absorbs coefficient errors well under half a unit, which the error model counts at
    its worst (n/12 on top of them): near that floor it asks for far finer steps than needed. uint8 images at
    --psnr 58 came out at 83 dB and ratio 1.35, at --psnr 60 (beyond the floor) at the finest step and ratio
    0.57, larger than the data. float16 rounds likewise, to 11 significant bits: data on a few float16 values
    (1000 +- 1 in steps of 0.5) at --psnr 45 and 60 came out lossless at ratios 2.13 and 1.01, where 3.98 and
    2.99 met them. Elsewhere the model's step is within the search's slack and one reconstruction confirms
    it, as before."""
    precision = c.settings.precision
    finest, coarsest = _step_bounds(c, weights)
    known = {step: stored} if stored is not None else {}
    made = {}
    floor = 0.0  # subtracted from each error, so the search's slack applies to what the step changes

    def measured(s: float) -> float:
        steps = qz.choose_steps(c.maxabs, precision, s, weights)
        values = known[s] if s in known else _quantize(c, steps, precision)
        stats = qz.error_stats(x, _reconstruct(values, steps, c.plan, precision, x.dtype, threads), rows)
        made[s] = steps, values, stats
        return math.log(max(stats[0] - floor, 1e-300))

    if step <= finest:  # the model gave up (a target beyond its floor): start where rounding begins to show
        step = min(max(math.sqrt(12 * target_sse / max(c.values.size, 1)), finest), coarsest)
    if c.dropped > target_sse / 2:
        # Near the mask's ceiling, search on the error above the finest step's, as _step_for_psnr does on the
        # error above the dropped energy (rounding moves the real floor off that, either way): a slack on the
        # whole budget accepted steps far finer than needed (--psnr 34.9 stored more than 34.93 on the
        # sample images with block 16 triangle).
        measured(finest)
        floor = made[finest][2][0]
        if floor >= target_sse:
            return made[finest]
    goal = math.log(max(target_sse - floor, 1e-300))
    return made[_search(measured, step, finest, coarsest, goal, SEARCH_SLACK, 1.25)]


def _psnr_peak(x: np.ndarray, settings: ChunkSettings) -> float:
    """The peak a chunk's ``target_psnr`` counts with: uint8's 255, else ``settings.peak`` (the whole array's
    range, which ``dctchop compress`` passes), else the chunk's own range."""
    return qz.fixed_peak(x.dtype) or settings.peak or qz.data_peak(x)


def _step_bounds(c: Coefficients, weights) -> tuple[float, float]:
    """(finest, coarsest) base step worth trying: below ``finest`` every band sits at its no-saturation limit
    maxabs / qmax; above ``coarsest`` every level is zero."""
    limits = c.maxabs / qz.QMAX[c.settings.precision] / (1.0 if weights is None else weights)
    finest = float(np.min(limits[c.maxabs > 0])) if np.any(c.maxabs > 0) else 1.0
    return finest, max(float(np.max(c.maxabs)) * 4, finest)


def _step_for_psnr(c: Coefficients, settings: ChunkSettings, weights, rows):
    """(step, target SSE, stored values or None): the largest base step whose modelled error meets the
    chunk's PSNR target, the squared-error budget the reconstruction must stay within, and the quantized
    values at that step when its exact evaluation made them.

    The step is found on a subsample of the coefficients (cheap), then confirmed and refined on all of them,
    usually with one or two exact evaluations. When the mask alone already misses the target, the finest
    step the precision allows is returned and the chunk falls short; the store records the PSNR reached.
    """
    plan, values, maxabs, x = c.plan, c.values, c.maxabs, c.centred
    peak = _psnr_peak(x, settings)
    n = int(np.count_nonzero(rows)) * (x.size // max(x.shape[0], 1))
    integer = x.dtype.kind in "iu"
    target_sse = n * peak * peak / 10 ** (settings.target_psnr / 10)
    model_sse = target_sse - (n / 12 if integer else 0.0)  # leave room for rounding to integers
    seg_starts, seg_bands = plan.runs.seg_starts, plan.runs.seg_bands
    dropped = c.dropped

    precision = settings.precision
    last = {"step": None, "stored": None}

    # The search works on the quantization error alone, against what the mask leaves of the budget: near the
    # mask's ceiling the dropped energy is nearly all of it, and a slack on the whole budget accepted steps
    # far finer than needed (--psnr 38.0 stored more than 38.05 on the 64³ field with block 16 triangle).
    def exact(step: float) -> float:  # keeps the quantized values: the last evaluation is usually the answer
        steps = qz.choose_steps(maxabs, precision, step, weights)
        stored, error = qz.quantize_with_error(values, steps, seg_starts, seg_bands, precision,
                                               qz.rounding_offsets(steps, c.rms))
        last.update(step=step, stored=stored)
        return math.log(max(error, 1e-300))

    finest, coarsest = _step_bounds(c, weights)
    goal = math.log(max(model_sse - dropped, 1e-300))
    # the high-rate guess: error step**2 / 12 per stored value
    guess = math.sqrt(12 * max(model_sse - dropped, 0.0) / max(values.size, 1))
    step = min(max(guess, finest), coarsest)
    factor = 2.0
    if values.size > 2 * SEARCH_SAMPLE:
        sub, sub_starts = _search_sample(values, seg_starts)
        scale = values.size / sub.size

        def estimate(step: float) -> float:
            steps = qz.choose_steps(maxabs, precision, step, weights)
            offsets = qz.rounding_offsets(steps, c.rms)
            error = qz.coefficient_error(sub, steps, sub_starts, seg_bands, precision, offsets)
            return math.log(max(scale * error, 1e-300))

        # aim at the middle of the accepted window, so the exact check below usually accepts at once
        step = _search(estimate, step, finest, coarsest, goal + math.log(1 - SEARCH_SLACK / 2),
                       SEARCH_SLACK / 4, 2.0)
        factor = 1.005
    step = _search(exact, step, finest, coarsest, goal, SEARCH_SLACK, factor)
    return step, target_sse, last["stored"] if last["step"] == step else None


def _search_sample(values: np.ndarray, seg_starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SEARCH_SAMPLE of the band-major values, and where each band run starts among them."""
    index = _sample_index(values.size)
    return values[index], np.searchsorted(index, seg_starts).astype(np.int64)


@lru_cache(maxsize=16)
def _sample_index(n: int) -> np.ndarray:
    """One position from each of SEARCH_SAMPLE equal stretches of ``n``, at a quasi-random offset (a plain
    stride would alias with the block grid)."""
    i = np.arange(SEARCH_SAMPLE)
    index = ((i + (i * 0.6180339887498949) % 1.0) * (n / SEARCH_SAMPLE)).astype(np.int64)
    index.setflags(write=False)
    return index


def _search(log_sse, step: float, finest: float, coarsest: float, goal: float, slack: float,
            factor: float) -> float:
    """The largest step in [finest, coarsest] with ``log_sse(step) <= goal``, to within ``slack`` of the
    budget (or a 1% bracket). From ``step``, widen by ``factor`` (growing up to 2x) to a bracket [lo, hi]
    with sse(lo) <= budget < sse(hi), then refine by false position on (log step, log sse), where the
    curve is nearly a line of slope 2, alternating with bisection so the bracket always shrinks."""
    window = goal + math.log(1 - slack)
    f = log_sse(step)
    lo = hi = None
    if f <= goal:
        lo, f_lo = step, f
        while hi is None:
            if f_lo >= window or lo >= coarsest:
                return lo
            step = min(lo * factor, coarsest)
            factor = min(factor * factor, 2.0)
            f = log_sse(step)
            if f <= goal:
                lo, f_lo = step, f
            else:
                hi, f_hi = step, f
    else:
        hi, f_hi = step, f
        while lo is None:
            if hi <= finest:
                return finest
            step = max(hi / factor, finest)
            factor = min(factor * factor, 2.0)
            f = log_sse(step)
            if f > goal:
                hi, f_hi = step, f
            else:
                lo, f_lo = step, f
    for i in range(40):
        if hi / lo <= 1.01 or f_lo >= window:
            break
        if i % 2 == 0 and f_hi > f_lo:
            t = (goal - f_lo) / (f_hi - f_lo)
            step = math.exp(math.log(lo) + t * (math.log(hi) - math.log(lo)))
            step = min(max(step, lo * 1.002), hi / 1.002)
        else:
            step = math.sqrt(lo * hi)
        f = log_sse(step)
        if f <= goal:
            lo, f_lo = step, f
        else:
            hi, f_hi = step, f
    return lo


def _counted_rows(x: np.ndarray, axes: tuple[int, ...], valid_rows: int | None = None) -> np.ndarray:
    """Samples (along axis 0) a chunk's PSNR target is measured over: the first ``valid_rows`` when the
    caller knows them. Otherwise (a plain Zarr write) Zarr pads edge chunks with zeros; an all-zero sample
    along an untransformed axis 0 decodes exactly, so leaving such samples out is conservative and keeps
    the target true for the real samples of a partial chunk."""
    if valid_rows is not None:
        return np.arange(x.shape[0]) < valid_rows
    if 0 in axes or x.shape[0] == 0:
        return np.ones(x.shape[0], dtype=bool)
    rows = np.any(x.reshape(x.shape[0], -1) != 0, axis=1)
    return rows if rows.any() else np.ones(x.shape[0], dtype=bool)


def _reconstruct(stored, steps, plan, precision: str, dtype, threads: int, offset: float = 0.0) -> np.ndarray:
    """Stored values -> data: dequantize into the coefficient image, inverse transform, add ``offset``."""
    return _decode_slabs(plan, dtype, threads,
                         _values_fill(qz.numeric(stored, precision), qz.decode_steps(steps, dtype)), offset=offset)


def _values_fill(values: np.ndarray, steps: np.ndarray):
    """The ``fill`` of :func:`_decode_slabs` for stored values already as :func:`dctchop.quantize.numeric` gives
    them, and ``steps`` as :func:`dctchop.quantize.decode_steps` gives them."""
    return lambda *args: qz.dequantize_into(values, steps, *args)


# Coefficients per slab. 256K decodes 32x32 RGB chunks 1.1-1.15x faster than 128K (the per-run work of the
# unpack and the move spread over runs twice as long) and 32³ fields as fast; 512K is slower on fields.
SLAB_VALUES = 1 << 18

# A slab's work arrays up to this size are kept by each thread for its next slabs: fresh ones were fresh pages
# wherever glibc had handed the freed ones back to the kernel (reading a store of 32³ float32 fields whole,
# `ds[:]`: 37K → 34K page faults, 0.56-0.61 → 0.62-0.63 GB/s; some loader processes faulted 33K pages an epoch).
SCRATCH_KEPT_BYTES = 4 << 20
_kept_scratch = threading.local()


def _scratch(role: str, shape, dtype) -> np.ndarray:
    """An array of ``shape`` and ``dtype`` with undefined contents for ``role`` in this thread's decode of a
    slab: a view of the one the thread used for that role before where it fits (the caller overwrites what it
    reads and lets go of it before its next slab)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > SCRATCH_KEPT_BYTES:
        return np.empty(shape, dtype)
    kept = _kept_scratch.__dict__.setdefault("arrays", {})
    if role not in kept or kept[role].size < nbytes:
        kept[role] = np.empty(nbytes, np.uint8)
    return kept[role][:nbytes].view(dtype).reshape(shape)


def _decode_slabs(plan: TransformPlan, dtype, threads: int, fill, out: np.ndarray | None = None,
                  channels_first: bool = False, offset: float = 0.0, parts: list[Slab] | None = None,
                  emit=None) -> np.ndarray | None:
    """Coefficients -> data one slab (:func:`dctchop.transform.slabs`) at a time, slabs shared among threads:
    a slab's values stay in cache from ``fill(first, seg_starts, seg_bands, values, to)`` (dequantized, run ``s``
    to ``values[to[s]:]``) through :func:`dctchop.transform.place` and the inverse passes, where the whole chunk's coefficients
    would stream through memory once per step. Slabs that allow it skip the placement and decode band-major
    (:func:`dctchop.transform.band_major`; single-threaded slabs only). ``channels_first``: see
    :func:`dctchop.transform.inverse`. A chunk's ``offset`` is added to each slab's output (in its dtype)
    while it is in cache. ``parts``: the slabs to decode (:func:`_needed_slabs`; default all); the rest of
    ``out`` is left as it is. ``emit``: each slab (of whole samples) decodes into a scratch array instead,
    handed to ``emit(first sample, samples)`` while in cache (and used again after it returns); returns None."""
    dtype = np.dtype(dtype)
    if out is None and emit is None:
        shape = plan.shape
        out = np.empty(channels_first_shape(shape) if channels_first else shape, dtype)
    parts = _needed_slabs(plan) if parts is None else parts
    inner_threads = threads if len(parts) == 1 else 1
    seg_bands = plan.runs.seg_bands

    def run(part_list) -> None:
        work = work_dtype(dtype)
        for part in part_list:
            p = part.plan
            bands = band_major(p, dtype, channels_first) if inner_threads == 1 else None
            target = out[part.region(channels_first)] if emit is None else _scratch(
                "samples", channels_first_shape(p.shape) if channels_first else p.shape, dtype)
            if bands is not None and target.flags.c_contiguous:
                values = _scratch("values", (bands.n_values,), work)  # padded; a triangle mask's as a square one's
                if bands.zeroed:
                    values[:] = 0
                fill(part.first, part.seg_starts, seg_bands, values, bands.run_places(p, part.seg_starts))
                inverse_band_major(values, _scratch("passes", (bands.n_values,), work),
                                   _scratch("result", (bands.n_values,), dtype), bands, target)
            else:
                values, image = _scratch("values", (p.n_values,), work), _scratch("image", p.coefficient_shape, work)
                if p.n_values != image.size:  # positions the mask drops are zeros; place writes the others
                    image[...] = 0
                fill(part.first, part.seg_starts, seg_bands, values, part.seg_starts)
                place(values, p, image.reshape(-1))
                if target.flags.c_contiguous:
                    inverse(image, p, dtype, inner_threads, out=target, channels_first=channels_first)
                else:  # a strip of a channels-first sample
                    target[...] = inverse(image, p, dtype, inner_threads, channels_first=channels_first)
            if offset:
                target += dtype.type(offset)
            if emit is not None:
                emit(part.start, target)

    n_jobs = min(threads, len(parts))
    if n_jobs <= 1:
        run(parts)
    else:
        for future in [_pool(n_jobs).submit(run, parts[k::n_jobs]) for k in range(n_jobs)]:
            future.result()
    return out if emit is None else None


# A read of a few samples (rows) decodes slabs this many times smaller: a random read of one 32x32 RGB image
# decodes 10 images instead of 85 (140 against 410 µs, the chunk's bytes in memory; a 32³ field: 150 against
# 480 µs), while whole chunks decode faster in the big slabs (32x32 RGB: 5.4 against 7.8 ms a chunk).
FEW_ROWS_SLAB_DIVISOR = 8


def _needed_slabs(plan: TransformPlan, rows=None) -> list[Slab]:
    """The slabs of the chunk that hold any of the samples ``rows`` (sorted indices along axis 0; None: all):
    of the small slabs when ``rows`` fill less than half of the big ones that hold them."""
    if rows is None:
        return list(slabs(plan, SLAB_VALUES))
    rows = np.asarray(rows)
    held = _slabs_holding(plan, SLAB_VALUES, rows)
    if 2 * rows.size < sum(p.stop - p.start for p in held if p.rows is None or p.rows[0] == 0):
        held = _slabs_holding(plan, SLAB_VALUES // FEW_ROWS_SLAB_DIVISOR, rows)
    return held


def _slabs_holding(plan: TransformPlan, n_values: int, rows: np.ndarray) -> list[Slab]:
    parts = slabs(plan, n_values)
    starts, stops = slab_bounds(plan, n_values)
    after = np.searchsorted(rows, starts)  # the first needed sample at or after each slab's start
    held = (after < rows.size) & (rows[np.minimum(after, rows.size - 1)] < stops)
    return [parts[k] for k in np.flatnonzero(held)]


def _step_table(steps: np.ndarray) -> tuple[bytes, int]:
    """The per-band steps as stored, and the header flag that says how: the full f64 table, or (usually far
    smaller: with flat weights all bands but a few clamped ones share one step) the common step plus the
    bands that differ. 512 bands of an 8x8x8 block cost 4 KB per chunk as a full table."""
    values, counts = np.unique(steps, return_counts=True)
    common = values[np.argmax(counts)]
    differ = np.flatnonzero(steps != common)
    if 12 + 12 * differ.size >= 8 * steps.size:
        return np.asarray(steps, dtype="<f8").tobytes(), 0
    pairs = np.zeros(differ.size, dtype=[("band", "<u4"), ("step", "<f8")])
    pairs["band"], pairs["step"] = differ, steps[differ]
    return struct.pack("<dI", common, differ.size) + pairs.tobytes(), FLAG_STEP_TABLE


def _header(dtype, settings: ChunkSettings, plan: TransformPlan, steps, n_values: int, flags: int,
            offset: float) -> bytes:
    """The chunk's header; axes, block and keep as the plan has them (axes counted from 0, one block and keep
    per axis), whatever the settings said (``axes=(-2, -1)``, ``block=(8,)``)."""
    shape, naxes = plan.shape, len(plan.axes)
    table = b""
    if steps is not None:
        table, table_flag = _step_table(np.asarray(steps, dtype=np.float64))
        flags |= table_flag
    if offset:
        flags |= FLAG_OFFSET
    parts = [
        _FIXED.pack(MAGIC, FORMAT_VERSION, DTYPE_CODES[np.dtype(dtype).newbyteorder("=")],
                    PRECISION_CODES[settings.precision], MASKS.index(settings.mask), len(shape), naxes, flags),
        struct.pack(f"<{len(shape)}I", *shape),
        struct.pack(f"<{3 * naxes}B", *plan.axes, *plan.block, *plan.keep),
        struct.pack("<I", 0 if steps is None else len(steps)),
        table,
        struct.pack("<Q", n_values),
        struct.pack("<d", offset) if offset else b"",
    ]
    return b"".join(parts)


# ---------------------------------------------------------------------------------------------- decode


@dataclass(frozen=True)
class ChunkHeader:
    """The decoded header of one chunk; ``payload_offset`` is where the stored values begin."""

    dtype: np.dtype
    precision: str
    mask: str
    shape: tuple[int, ...]
    axes: tuple[int, ...]
    block: tuple[int, ...]
    keep: tuple[int, ...]
    steps: np.ndarray | None = field(repr=False)
    n_values: int
    payload_offset: int
    bitplanes: bool
    offset: float = 0.0


def _read_step_table(data, pos: int, n_steps: int, compact: bool) -> tuple[np.ndarray | None, int]:
    """(steps or None, position after them); CorruptChunkError for a truncated or inconsistent table."""
    if not compact:
        if len(data) < pos + 8 * n_steps:
            raise CorruptChunkError("chunk header is truncated in its step table")
        steps = np.frombuffer(data, dtype="<f8", count=n_steps, offset=pos).astype(np.float64) if n_steps else None
        return steps, pos + 8 * n_steps
    if n_steps == 0 or len(data) < pos + 12:
        raise CorruptChunkError("chunk header has a compact step table but no steps")
    common, n_differ = struct.unpack_from("<dI", data, pos)
    pos += 12
    if n_differ >= n_steps or len(data) < pos + 12 * n_differ:
        raise CorruptChunkError(f"chunk step table is truncated or lists too many bands ({n_differ})")
    pairs = np.frombuffer(data, dtype=[("band", "<u4"), ("step", "<f8")], count=n_differ, offset=pos)
    if np.any(pairs["band"] >= n_steps):
        raise CorruptChunkError("chunk step table names a band that does not exist")
    steps = np.full(n_steps, common)
    steps[pairs["band"]] = pairs["step"]
    return steps, pos + 12 * n_differ


def read_header(data: bytes | memoryview) -> ChunkHeader:
    """Parse and check a chunk header; raise :class:`CorruptChunkError` naming the bad field."""
    data = memoryview(data).cast("B")
    if len(data) < _FIXED.size:
        raise CorruptChunkError(f"chunk is {len(data)} bytes, shorter than the {_FIXED.size}-byte header")
    magic, version, dtype_code, prec_code, mask_code, ndim, naxes, flags = _FIXED.unpack_from(data, 0)
    if magic != MAGIC:
        raise CorruptChunkError(f"not a dctchop chunk (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise CorruptChunkError(
            f"chunk format version {version} is not supported by this dctchop (reads version {FORMAT_VERSION})"
            + ("; upgrade dctchop" if version > FORMAT_VERSION else "")
        )
    dtypes = list(DTYPE_CODES)
    if dtype_code >= len(dtypes) or prec_code >= len(qz.PRECISIONS) or mask_code >= len(MASKS):
        raise CorruptChunkError(f"bad code in chunk header (dtype {dtype_code}, precision {prec_code}, "
                                f"mask {mask_code})")
    if not 1 <= ndim <= MAX_NDIM or not 1 <= naxes <= 3:
        raise CorruptChunkError(f"bad chunk header (ndim {ndim}, axes {naxes})")
    if flags & ~FLAGS:
        raise CorruptChunkError(f"chunk header uses features this dctchop does not read (flags {flags:#x}); "
                                "upgrade dctchop")
    if flags & FLAG_BITPLANES and qz.PRECISIONS[prec_code] not in qz.INT_PRECISIONS:
        raise CorruptChunkError("bit-plane flag on a floating-point chunk")
    pos = _FIXED.size
    need = pos + 4 * ndim + 3 * naxes + 4
    if len(data) < need:
        raise CorruptChunkError("chunk header is truncated")
    shape = struct.unpack_from(f"<{ndim}I", data, pos)
    pos += 4 * ndim
    fields = struct.unpack_from(f"<{3 * naxes}B", data, pos)
    pos += 3 * naxes
    (n_steps,) = struct.unpack_from("<I", data, pos)
    pos += 4
    if n_steps > MAX_STEPS:
        raise CorruptChunkError(f"chunk header has a bad step count ({n_steps})")
    steps, pos = _read_step_table(data, pos, n_steps, bool(flags & FLAG_STEP_TABLE))
    if len(data) < pos + 8:
        raise CorruptChunkError("chunk header is truncated")
    (n_values,) = struct.unpack_from("<Q", data, pos)
    pos += 8
    offset = 0.0
    if flags & FLAG_OFFSET:
        if len(data) < pos + 8:
            raise CorruptChunkError("chunk header is truncated before its offset")
        (offset,) = struct.unpack_from("<d", data, pos)
        pos += 8
        if not math.isfinite(offset) or offset == 0 or dtypes[dtype_code] not in (np.float32, np.float64):
            raise CorruptChunkError(f"bad offset {offset} in a {dtypes[dtype_code]} chunk header")
    return ChunkHeader(
        bitplanes=bool(flags & FLAG_BITPLANES),
        dtype=dtypes[dtype_code],
        precision=qz.PRECISIONS[prec_code],
        mask=MASKS[mask_code],
        shape=tuple(shape),
        axes=tuple(fields[:naxes]),
        block=tuple(fields[naxes : 2 * naxes]),
        keep=tuple(fields[2 * naxes :]),
        steps=steps,
        n_values=n_values,
        payload_offset=pos,
        offset=offset,
    )


@dataclass(frozen=True)
class StoredChunk:
    """One checked chunk after the lossless stage, before dequantization and the inverse transform.

    ``stored`` holds the stored values band-major in the precision's storage dtype (bfloat16 as its uint16
    bits); ``steps`` the per-band steps (ones for float32/bfloat16); ``offset`` what the decoded data is
    relative to; ``level_bound`` a bound on the stored values' magnitudes where the bit planes give one for
    free (inf otherwise). Everything a decoder on another device needs besides the (cached) plan.
    """

    plan: TransformPlan
    dtype: np.dtype
    precision: str
    stored: np.ndarray = field(repr=False)
    steps: np.ndarray = field(repr=False)
    offset: float = 0.0
    level_bound: float = math.inf


def read_expected_header(data: bytes | memoryview, shape: tuple[int, ...], dtype) -> ChunkHeader:
    """:func:`read_header` of a chunk that must hold an array of ``shape`` and ``dtype``."""
    header = read_header(data)
    if header.shape != tuple(int(s) for s in shape) or header.dtype != np.dtype(dtype).newbyteorder("="):
        raise CorruptChunkError(f"chunk holds {header.dtype}{list(header.shape)}, expected "
                                f"{np.dtype(dtype)}{list(shape)}")
    return header


@lru_cache(maxsize=64)
def _header_plan(shape, axes, block, keep, mask) -> TransformPlan:
    """:func:`dctchop.transform.make_plan` of a header's settings (tuples of ints), checked once per setting:
    readers check every chunk of an array, which share a few."""
    return make_plan(shape, axes, block, keep, mask)


def _checked(data: bytes | memoryview, shape: tuple[int, ...], dtype) -> tuple[ChunkHeader, TransformPlan,
                                                                          np.ndarray, memoryview]:
    """(header, plan, steps, payload) of a chunk that must hold an array of ``shape`` and ``dtype``."""
    header = read_expected_header(data, shape, dtype)
    try:
        plan = _header_plan(header.shape, header.axes, header.block, header.keep, header.mask)
    except DctchopError as e:
        raise CorruptChunkError(f"bad transform settings in chunk header: {e}") from None
    if header.axes != plan.axes:
        raise CorruptChunkError(f"bad axes in chunk header: {list(header.axes)}")
    if header.n_values != plan.n_values:
        raise CorruptChunkError(f"chunk says {header.n_values} values, its settings give {plan.n_values}")
    steps = header.steps
    if header.precision in ("float32", "bfloat16"):
        if steps is not None:
            raise CorruptChunkError(f"{header.precision} chunk must not carry steps")
        steps = np.ones(len(plan.bands))
    elif steps is None or steps.size != len(plan.bands) or not np.all(np.isfinite(steps) & (steps > 0)):
        raise CorruptChunkError("chunk steps are missing, of the wrong count, or not positive and finite")
    if header.precision == "float16":  # stored values up to float16's largest (bit planes: _checked_planes)
        _refuse_overflow(steps * float(np.finfo(np.float16).max), header.dtype)
    if abs(header.offset) > MAX_COEFFICIENT[work_dtype(header.dtype)] / math.sqrt(math.prod(plan.block)):
        raise CorruptChunkError(f"offset {header.offset:g} is beyond what a {header.dtype} chunk holds")
    return header, plan, steps, memoryview(data).cast("B")[header.payload_offset :]


def _plain_values(header: ChunkHeader, payload: memoryview) -> np.ndarray:
    """The stored values of a chunk without bit planes, checked."""
    storage = qz.STORAGE_DTYPES[header.precision]
    if len(payload) != header.n_values * storage.itemsize:
        raise CorruptChunkError(f"chunk payload is {len(payload)} bytes, expected "
                                f"{header.n_values * storage.itemsize}")
    stored = np.frombuffer(payload, dtype=storage)
    if not _finite(stored, header.precision):
        raise CorruptChunkError("chunk holds non-finite coefficients")
    return stored


def _finite(stored: np.ndarray, precision: str) -> bool:
    """Whether stored values of ``precision`` are all finite (bfloat16 is stored as its bits: an exponent of
    all ones is an infinity or a NaN)."""
    if precision == "bfloat16":
        return not np.any((stored & 0x7F80) == 0x7F80)
    return stored.dtype.kind != "f" or bool(np.all(np.isfinite(stored)))


def read_stored(data: bytes | memoryview, shape: tuple[int, ...], dtype) -> StoredChunk:
    """Check a chunk that must hold an array of ``shape`` and ``dtype`` and return its stored values.

    Raises :class:`CorruptChunkError` for anything that is not a valid chunk of that shape and dtype.
    """
    header, plan, steps, payload = _checked(data, shape, dtype)
    if header.bitplanes:
        planes = _checked_planes(header, plan, steps, payload)
        stored, bound = planes.unpack(), float(planes.largest_levels.max(initial=0.0))
    else:
        stored, bound = _plain_values(header, payload), math.inf
    return StoredChunk(plan, header.dtype, header.precision, stored, steps, header.offset, bound)


def _checked_planes(header: ChunkHeader, plan: TransformPlan, steps: np.ndarray, payload: memoryview) -> Planes:
    """The bit planes of a chunk, refused when a run's levels could dequantize past the work dtype's range."""
    planes = check_planes(payload, plan.runs.seg_starts, qz.STORAGE_DTYPES[header.precision])
    _refuse_overflow(planes.largest_levels * steps[plan.runs.seg_bands], header.dtype)
    return planes


def _refuse_overflow(largest: np.ndarray, dtype) -> None:
    """CorruptChunkError when a bound on the dequantized values (``largest``: levels times steps) passes the
    range of ``dtype``'s work dtype: a step of 1e300 would decode to infinities. Written chunks stay far
    inside: their levels times steps are at most about twice their largest coefficient, within a quarter
    of that range."""
    if largest.size and float(largest.max()) > float(np.finfo(work_dtype(dtype)).max):
        raise CorruptChunkError("chunk steps are too large for its dtype")


class ChunkDecoder:
    """A chunk checked and ready to decode any of its samples: a reader that decodes a chunk's samples a few
    at a time (random reads) checks its header and payload once.

    Raises :class:`CorruptChunkError` for anything that is not a valid chunk of ``shape`` and ``dtype``.
    """

    def __init__(self, data: bytes | memoryview, shape: tuple[int, ...], dtype) -> None:
        header, self.plan, steps, payload = _checked(data, shape, dtype)
        self.dtype, self.offset = header.dtype, header.offset
        self.nbytes = len(data)  # what keeping it holds
        kernel_steps = qz.decode_steps(steps, self.dtype)
        if header.bitplanes:
            planes = _checked_planes(header, self.plan, steps, payload)
            self._fill = lambda *args: planes.dequantize_into(kernel_steps, *args)
        else:
            stored = _plain_values(header, payload)
            values = qz.numeric(stored, header.precision)
            self.nbytes += values.nbytes if values is not stored else 0
            self._fill = _values_fill(values, kernel_steps)

    def decode(self, threads: int = 1, out: np.ndarray | None = None, channels_first: bool = False,
               rows=None) -> np.ndarray:
        """The chunk's samples, into ``out`` when given (a C-contiguous array of the chunk's shape and dtype: a
        loader reuses its chunk buffers, where fresh pages would cost the kernel's zeroing of them).
        ``channels_first``: the last axis comes out as axis 1, NHWC as NCHW (``out`` then has that shape), as
        a loader yielding channels-first batches wants it. ``rows``: the samples (sorted indices along axis 0)
        that are needed, as the valid samples of an array's edge chunk: only the slabs that hold them are
        decoded; the other samples of ``out`` are left as they are."""
        return self._decode(_needed_slabs(self.plan, rows), threads, out, channels_first)

    def decode_rows(self, out: np.ndarray, rows) -> list[tuple[int, int]]:
        """:meth:`decode` of ``rows`` into ``out`` (as a random read wants them); returns the samples decoded, as
        ``(start, stop)`` ranges of axis 0: whole slabs, so more than ``rows`` (a reader keeps the others)."""
        parts = _needed_slabs(self.plan, rows)
        self._decode(parts, 1, out, False)
        return sorted({(p.start, p.stop) for p in parts})

    def emit_samples(self, emit, rows, channels_first: bool = False) -> bool:
        """Decode the slabs that hold ``rows`` (sorted samples) one at a time, each into a scratch array the
        size of a slab, and call ``emit(start, samples)`` with its samples (``start`` onwards) while they are in
        cache: a loader copies them into its batches, where decoding the whole chunk first would write it to
        memory and read it back. False, decoding nothing, where the slabs cut samples into strips (samples
        of more than a slab's values)."""
        parts = _needed_slabs(self.plan, rows)
        if any(p.rows is not None for p in parts):
            return False
        _decode_slabs(self.plan, self.dtype, 1, self._fill, None, channels_first, self.offset, parts, emit)
        return True

    def _decode(self, parts: list[Slab], threads: int, out: np.ndarray | None, channels_first: bool) -> np.ndarray:
        out_shape = channels_first_shape(self.plan.shape) if channels_first else self.plan.shape
        if out is not None and (out.shape != out_shape or out.dtype != self.dtype or not out.flags.c_contiguous):
            raise ValueError(f"out must be a C-contiguous {self.dtype}{list(out_shape)} array, got "
                             f"{out.dtype}{list(out.shape)}")
        return _decode_slabs(self.plan, self.dtype, threads, self._fill, out, channels_first, self.offset, parts)


def decode_chunk(data: bytes | memoryview, shape: tuple[int, ...], dtype, threads: int = 1,
                 out: np.ndarray | None = None, channels_first: bool = False) -> np.ndarray:
    """Decode one chunk that must hold an array of ``shape`` and ``dtype``: :meth:`ChunkDecoder.decode`.

    Raises :class:`CorruptChunkError` for anything that is not a valid chunk of that shape and dtype.
    Bit planes are unpacked straight into each slab's coefficients (no int array in between).
    """
    return ChunkDecoder(data, shape, dtype).decode(threads, out, channels_first)


# ---------------------------------------------------------------------------------------------- zarr codec


def _native_dtype(dtype: Any) -> np.dtype:
    """zarr >= 3.1 passes a ZDType wrapper; older code paths a numpy dtype."""
    return np.dtype(dtype.to_native_dtype() if hasattr(dtype, "to_native_dtype") else dtype)


def _int_tuple(value, name: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
        raise DctchopError(f"dctchop codec: {name} must be a non-empty list of integers, got {value!r}")
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class DctChopCodec(ArrayBytesCodec):
    """Zarr v3 array-to-bytes codec: blockwise DCT, keep mask, per-band quantization (see module docs).

    The configuration names every field, defaults included, so ``zarr.json`` fully describes the encoder.
    """

    is_fixed_size = False

    axes: tuple[int, ...]
    block: tuple[int, ...]
    keep: tuple[int, ...]
    mask: str = "square"
    precision: str = "float32"
    step: float | None = None
    target_psnr: float | None = None
    peak: float | None = None
    weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("axes", "block", "keep"):
            object.__setattr__(self, name, _int_tuple(getattr(self, name), name))
        settings = self.settings  # validated, its numbers as floats
        for name in ("step", "target_psnr", "peak", "weights"):
            object.__setattr__(self, name, getattr(settings, name))

    @property
    def settings(self) -> ChunkSettings:
        """The encoder settings this configuration names (the same fields, matched by name)."""
        return ChunkSettings(**{name: getattr(self, name) for name in ChunkSettings.__dataclass_fields__})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        _, config = parse_named_configuration(data, CODEC_NAME)
        config = dict(config or {})
        version = config.pop("format_version", FORMAT_VERSION)
        if type(version) is not int or version != FORMAT_VERSION:
            raise DctchopError(f"dctchop codec format_version {version!r} is not supported by this dctchop "
                               f"(reads version {FORMAT_VERSION})")
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(config) - known
        if unknown:
            raise DctchopError(f"dctchop codec: unknown configuration fields {sorted(unknown)}")
        return cls(**config)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": CODEC_NAME,
            "configuration": {
                "format_version": FORMAT_VERSION,
                "axes": list(self.axes),
                "block": list(self.block),
                "keep": list(self.keep),
                "mask": self.mask,
                "precision": self.precision,
                "step": self.step,
                "target_psnr": self.target_psnr,
                "peak": self.peak,
                "weights": None if self.weights is None else list(self.weights),
            },
        }

    def validate(self, *, shape, dtype, chunk_grid) -> None:
        check_dtype(_native_dtype(dtype), "dctchop codec")
        chunk_shape = getattr(chunk_grid, "chunk_shape", shape)
        _weights(self.settings, make_plan(chunk_shape, self.axes, self.block, self.keep, self.mask))

    def _encode_sync(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        x = np.asarray(chunk_array.as_numpy_array())
        fill = chunk_spec.fill_value
        if x.dtype.kind == "f" and not np.isfinite(fill) and not np.isfinite(x).all():
            raise DctchopError(f"dctchop codec: the chunk holds NaN or infinite values, which it cannot store; "
                               f"zarr fills what a write leaves out of a chunk (and an edge chunk past the "
                               f"array's end) with the fill_value, here {fill}: create the array with a finite "
                               "fill_value")
        settings = self.settings
        if settings.target_psnr is None:
            return chunk_spec.prototype.buffer.from_bytes(encode_chunk(x, settings))
        data, sse, _ = encode_and_measure(x, settings)  # a PSNR target measures the chunk anyway
        reached = qz.psnr(sse / max(x.size, 1), _psnr_peak(x, settings))
        if reached < settings.target_psnr:  # dctchop compress refuses it so; here it was stored silently
            raise DctchopError(f"dctchop codec: the chunk reaches {reached:.2f} dB, below its target_psnr "
                               f"{settings.target_psnr:g}, at the finest step {settings.precision} allows with the "
                               f"{settings.mask} mask; ask for less")
        return chunk_spec.prototype.buffer.from_bytes(data)

    def _decode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        dtype = _native_dtype(chunk_spec.dtype)
        out = decode_chunk(chunk_bytes.as_numpy_array(), chunk_spec.shape, dtype)
        return chunk_spec.prototype.nd_buffer.from_numpy_array(out.astype(dtype, copy=False))

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        return await asyncio.to_thread(self._encode_sync, chunk_array, chunk_spec)

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        return await asyncio.to_thread(self._decode_sync, chunk_bytes, chunk_spec)

    def compute_encoded_size(self, input_byte_length: int, chunk_spec: ArraySpec) -> int:
        raise NotImplementedError
