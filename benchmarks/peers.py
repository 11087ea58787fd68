"""Rate-distortion of dctchop against peer lossy compressors at fixed ratios (issue #4, "Benchmark first").

For every dataset and every target ratio R (ratio = original bytes / compressed bytes) each method's one knob
is searched (bisection) until the achieved ratio is within 0.5% of R where the knob allows it; a result within
2% counts as reaching R, one further off says so, and so does a method that cannot reach R at all. Then the
data is compressed and decompressed once more (median of a few timed runs) and measured on the decoded values:

    dctchop             the codec itself (ChunkSettings + encode_chunk/decode_chunk, store's zstd on top, +4
                        bytes per chunk for the store's crc32c) with the store's default axes (RGB: the
                        channel axis too, as one block of 3): keep = block, base step searched; int8 and int16
                        storage x square and triangle masks (x with and without the colour axis for RGB);
                        the variant with the best PSNR at R is repeated as "dctchop" (all are in the "All
                        variants" tables)
    dctchop chop        the paper's fixed-size mode: keep k x k (x k) of each block (a colour axis whole) in
                        float32, float16 or bfloat16 (zstd on top as in the store); its ratios are fixed by k
                        and the precision, so the row shows the best setting whose ratio is at least R
    zfp fixed-rate      zfpy, bits/value searched (never below ZFP's 9 bits per block: smaller rates crash it)
    zfp fixed-accuracy  zfpy, absolute tolerance searched (the ratio moves in power-of-two tolerance steps)
    sz3                 pysz (SZ3), absolute error bound searched, for each predictor (INTERP_LORENZO,
                        SZ3's default, INTERP, LORENZO_REG) in the dataset's layout and, where that is
                        3-D, with its planes stacked into one 2-D array of rows; the best variant at R is
                        repeated as "sz3"
    jpeg                simplejpeg (libjpeg-turbo), quality searched, 4:4:4 and 4:2:0; every image is its own
                        JFIF file, sizes summed; grey data as single-channel JPEG, float data min-max
                        scaled to 8 bits and coded per 2-D plane
    jpeg (abbrev.)      the same streams with the tables counted once per set (JPEG's "abbreviated"
                        format: SOI, frame and scan headers stay with each image), for stacks of equal-size
                        images where the 623-byte header dominates
    zstd                lossless zstd at the store's level (one row: its fixed ratio)

Datasets (nothing is downloaded):

    cifar_like  sample_data/images.h5 "images": uint8 (1280, 32, 32, 3), synthetic CIFAR-like scenes
    gray28      luminance (BT.601) of cifar_like, centre crop 28x28: uint8 (1280, 28, 28)
    photos      scikit-image's bundled photos (PNGs inside the wheel): astronaut, chelsea, coffee,
                motorcycle_left (stereo_motorcycle); uint8 RGB, each photo coded on its own
    field2d     a generated 2-D Kolmogorov-like Gaussian random field, float32 (1024, 1024)
    field3d     sample_data/field.npy: float32 (64, 64, 64) turbulence-like velocity component

PSNR is ``20 log10(peak) - 10 log10(MSE)`` over the whole dataset, peak = 255 for uint8 and max - min of the
original for float data (as ``dctchop inspect``). MB/s are MB (1e6 bytes) of original data per second, one
thread, including the dtype conversions a codec needs (uint8 -> float32 for ZFP/SZ3, rounding back).

Run it from the repository root (about 3 minutes on 2 cores; all data sets are small enough to use whole)::

    .venv/bin/pip install zfpy==1.0.1 pysz simplejpeg matplotlib scikit-image
    .venv/bin/python benchmarks/peers.py                     # all datasets, ratios 4,8,16, writes docs/
    .venv/bin/python benchmarks/peers.py --datasets field3d --ratios 8 --curve-ratios "" --out /tmp/rd

It prints one Markdown table per dataset, writes ``OUT/rd_<dataset>.png`` (PSNR against achieved ratio, one
line per method) and ``OUT/rate_distortion.md`` (tables, figures, the command). A block between
``<!-- findings -->`` and ``<!-- /findings -->`` in an existing ``rate_distortion.md`` is kept.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # single-threaded codecs; set before the libraries load

import argparse
import math
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import numcodecs
import numpy as np

from dctchop import quantize as qz
from dctchop.codec import ChunkSettings, decode_chunk, encode_chunk
from dctchop.layout import colour_axis, infer_axes
from dctchop.store import ZSTD_LEVEL

ROOT = Path(__file__).resolve().parent.parent
RATIO_TOL = 0.02          # a result within 2% of the target ratio counts as reaching it
SEARCH_TOL = 0.005        # searches go on to 0.5% where the parameter allows, so variants compare fairly
CRC_BYTES = 4             # the store's crc32c per chunk
CHUNK_BYTES = 4 << 20     # as the store: about 4 MB of input per chunk, along axis 0
BLOCK = 8
ZFP_MIN_BLOCK_BITS = 9    # zfp fixed-rate needs >= 9 bits per 4^d block for float32 (below: crash or garbage)
DEFAULT_DATASETS = ("cifar_like", "gray28", "photos", "field2d", "field3d")
MAIN_METHODS = ("dctchop", "dctchop chop", "zfp fixed-rate", "zfp fixed-accuracy", "sz3", "jpeg",
                "jpeg (abbrev.)", "zstd")


# ---------------------------------------------------------------------------------------------- records


@dataclass
class Dataset:
    """Items are coded independently by every method (a stack is one item; photos of different sizes are
    several); all measures are totals over the items."""

    name: str
    title: str
    source: str
    items: list[np.ndarray]
    to_peer: Callable[[np.ndarray], np.ndarray]    # item -> float32 array handed to ZFP / SZ3
    from_peer: Callable[[np.ndarray, np.ndarray], np.ndarray]  # (decoded, original) -> original's layout
    peer_layout: str
    jpeg_images: Callable[[np.ndarray], list[np.ndarray]]  # uint8 item -> (H, W, C) images, one JPEG each
    peak: float = 0.0
    timed_targets: frozenset[float] = frozenset()  # the ratios whose rows are timed (the tables' targets)

    @property
    def dtype(self) -> np.dtype:
        return self.items[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.items)


@dataclass
class Result:
    """One measured (or unreachable) point: a method's variant at one target ratio."""

    dataset: str
    method: str
    variant: str
    target: float | None
    setting: str = ""
    ratio: float = math.nan
    psnr: float = math.nan
    max_abs_error: float = math.nan
    compress_mbs: float = math.nan
    decompress_mbs: float = math.nan
    reached: bool = True
    note: str = ""


@dataclass
class Codec:
    """One method at one parameter value.

    ``compress(item)`` gives a list of byte strings (what would be stored); ``decompress(parts, item)`` the
    decoded item (the original is passed only for its shape and dtype); ``extra_bytes_per_part`` and
    ``overhead`` (once per dataset) adjust the stored size.
    """

    compress: Callable[[np.ndarray], list[bytes]]
    decompress: Callable[[list[bytes], np.ndarray], np.ndarray]
    extra_bytes_per_part: int = 0
    overhead: Callable[[list[list[bytes]]], int] = field(default=lambda parts: 0)

    def stored(self, parts: list[list[bytes]]) -> int:
        n = sum(len(p) + self.extra_bytes_per_part for item in parts for p in item)
        return n + self.overhead(parts)


# ---------------------------------------------------------------------------------------------- datasets


def _rgb_stack_layout():
    """(N, H, W, C) -> (N*C, H, W) planes: the best of the layouts tried for ZFP and SZ3 on cifar_like (also
    NHWC, NCHW and CNHW as 4-D), since their 4^3 blocks / predictors then run across an image's channels."""
    def to_peer(x):
        n, h, w, c = x.shape
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2).reshape(n * c, h, w), dtype=np.float32)

    def from_peer(y, like):
        n, h, w, c = like.shape
        return y.reshape(n, c, h, w).transpose(0, 2, 3, 1)
    return to_peer, from_peer


def load_dataset(name: str) -> Dataset:
    import h5py

    if name in ("cifar_like", "gray28"):
        with h5py.File(ROOT / "sample_data" / "images.h5", "r") as f:
            rgb = f["images"][:]
        if name == "cifar_like":
            to_peer, from_peer = _rgb_stack_layout()
            return Dataset(name, "cifar_like: uint8 (1280, 32, 32, 3) synthetic scenes",
                           "sample_data/images.h5 `images` (procedural, see sample_data/README.md)",
                           [rgb], to_peer, from_peer, "(N*C, H, W) float32", lambda x: list(x))
        luma = rgb.astype(np.float64) @ np.array([0.299, 0.587, 0.114])
        grey = np.clip(np.rint(luma), 0, 255).astype(np.uint8)[:, 2:30, 2:30].copy()
        return Dataset(name, "gray28: uint8 (1280, 28, 28) grey images",
                       "derived: BT.601 luma of cifar_like, rounded, centre crop 28x28",
                       [grey], lambda x: x.astype(np.float32), lambda y, like: y, "(N, H, W) float32",
                       lambda x: list(x[..., None]))
    if name == "photos":
        try:
            import skimage.data as sk
        except ImportError:
            raise SystemExit("photos needs scikit-image (its wheel bundles the photos): "
                             ".venv/bin/pip install scikit-image") from None
        photos = [sk.astronaut(), sk.chelsea(), sk.coffee(), sk.stereo_motorcycle()[0]]
        return Dataset(name, "photos: 4 uint8 RGB photos, 512x512 to 500x741",
                       "scikit-image 0.26 wheel, bundled PNGs: astronaut, chelsea, coffee, motorcycle_left "
                       "(real photographs; some were JPEG-compressed before they became PNGs)",
                       [np.ascontiguousarray(p) for p in photos],
                       lambda x: np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32),
                       lambda y, like: y.transpose(1, 2, 0), "(C, H, W) float32 per photo", lambda x: [x])
    if name == "field2d":
        f2 = kolmogorov_2d(1024)
        return Dataset(name, "field2d: float32 (1024, 1024) 2-D Kolmogorov-like field",
                       "generated here: Gaussian random field, P(k) ~ k^(-8/3) exp(-(k eta)^2), seed 7",
                       [f2], lambda x: x, lambda y, like: y, "(Y, X) float32", float_planes)
    if name == "field3d":
        f3 = np.load(ROOT / "sample_data" / "field.npy", allow_pickle=False)
        return Dataset(name, "field3d: float32 (64, 64, 64) turbulence-like field",
                       "sample_data/field.npy (procedural, see sample_data/README.md)",
                       [f3], lambda x: x, lambda y, like: y, "(Z, Y, X) float32", float_planes)
    raise SystemExit(f"unknown dataset {name!r}; choose from {', '.join(DEFAULT_DATASETS)}")


def kolmogorov_2d(n: int, seed: int = 7) -> np.ndarray:
    """2-D analogue of sample_data's field: white noise filtered to P(k) ~ k^(-8/3) (energy spectrum
    E(k) ~ k^(-5/3)) with a Gaussian dissipation roll-off at k_max * eta = 1.5, zero mean, rms 1.5."""
    rng = np.random.default_rng(seed)
    k1 = 2 * np.pi * np.fft.fftfreq(n, d=1.0 / n)
    k1r = 2 * np.pi * np.fft.rfftfreq(n, d=1.0 / n)
    ky, kx = np.meshgrid(k1, k1r, indexing="ij")
    k = np.hypot(kx, ky)
    k[0, 0] = 1.0
    eta = 1.5 / (np.pi * n)
    amp = k ** (-4.0 / 3.0) * np.exp(-0.5 * (k * eta) ** 2)
    amp[0, 0] = 0.0
    u = np.fft.irfft2(np.fft.rfft2(rng.normal(size=(n, n))) * amp, s=(n, n))
    return (u * (1.5 / u.std())).astype(np.float32)


def float_planes(x: np.ndarray) -> list[np.ndarray]:
    """The 2-D planes (last two axes) JPEG sees of a float array, once :func:`jpeg_codec` has min-max scaled
    it to uint8."""
    return list(x.reshape(-1, *x.shape[-2:])[..., None])


def dctchop_chunks(x: np.ndarray, axes: tuple[int, ...]) -> list[slice]:
    """Slices along axis 0 of about CHUNK_BYTES each (whole blocks when axis 0 is transformed), as the
    store chunks."""
    sample = max(x[0].nbytes, 1)
    unit = BLOCK if 0 in axes else 1
    n = max(unit, CHUNK_BYTES // sample // unit * unit)
    return [slice(s, min(s + n, x.shape[0])) for s in range(0, x.shape[0], n)]


# ---------------------------------------------------------------------------------------------- measuring


def to_dtype(y: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        return np.clip(np.rint(y), info.min, info.max).astype(dtype)
    return y.astype(dtype, copy=False)


def achieved_ratio(ds: Dataset, codec: Codec) -> float:
    return ds.nbytes / codec.stored([codec.compress(x) for x in ds.items])


MIN_SAMPLE_SECONDS = 0.1  # every timed sample runs the call this long at least, however fast the call


def _timed(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Median seconds per call of ``fn`` over up to ``repeats`` samples (fewer once they add up to a
    second; NaN, untimed, with 0 repeats), after one untimed call: the first call of a variant loads its
    numba kernels from the cache and sets up per-shape state, which once made up most of the median (int8 on field3d: 27 MB/s against 781 for
    int16). Each sample repeats the call for MIN_SAMPLE_SECONDS at least, so a 2 ms decode and a 20 ms one
    are exposed alike to a busy machine (single short calls dodged its interruptions, and the margins over
    the slower peers grew with the load)."""
    t = time.perf_counter()
    out = fn()
    calls = max(1, math.ceil(MIN_SAMPLE_SECONDS / max(time.perf_counter() - t, 1e-9)))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            out = fn()
        times.append((time.perf_counter() - t) / calls)
        if sum(times) * calls > 1.0:
            break
    return statistics.median(times) if times else math.nan, out


def measure(ds: Dataset, codec: Codec, result: Result, repeats: int) -> Result:
    """Ratio and errors of one setting, and its speeds: timed only at the tables' target ratios (the extra
    ratios of the figures need none)."""
    if result.target is not None and result.target not in ds.timed_targets:
        repeats = 0
    t_c, parts = _timed(lambda: [codec.compress(x) for x in ds.items], repeats)
    t_d, decoded = _timed(lambda: [codec.decompress(p, x) for p, x in zip(parts, ds.items)], repeats)
    sse, err = 0.0, 0.0
    for x, y in zip(ds.items, decoded):
        assert y.shape == x.shape and y.dtype == x.dtype, (result.method, y.shape, y.dtype)
        item_sse, item_err = qz.error_stats(x, y)
        sse, err = sse + item_sse, max(err, item_err)
    mse = sse / sum(x.size for x in ds.items)
    result.ratio = ds.nbytes / codec.stored(parts)
    result.psnr = qz.psnr(mse, ds.peak)
    result.max_abs_error = err
    result.compress_mbs = ds.nbytes / 1e6 / t_c
    result.decompress_mbs = ds.nbytes / 1e6 / t_d
    return result


# ---------------------------------------------------------------------------------------------- search


@dataclass
class Found:
    param: float
    ratio: float
    hit: bool      # within RATIO_TOL of the target
    inside: bool   # the target lies within the parameter's reachable range


def search(ratio_at: Callable[[float], float], target: float, lo: float, hi: float, *,
           increasing: bool = True, integer: bool = False, max_probes: int = 30) -> Found:
    """Find the parameter in [lo, hi] whose ratio is within SEARCH_TOL of ``target``.

    Bisection of the bracket (in log(parameter) for real parameters), alternating with probes placed by
    interpolating log(ratio) linearly in the parameter, which usually land within tolerance in a few
    probes. ``increasing``: whether the ratio grows with the parameter. Returns the closest probe; ``hit``
    says whether it is within RATIO_TOL (it is not when the parameter is too coarse: integer JPEG quality,
    ZFP's power-of-two tolerances), ``inside`` whether the target is within the reachable range at all.
    """
    probes: dict[float, float] = {}

    def probe(p: float) -> float:
        if p not in probes:
            probes[p] = ratio_at(p)
        return probes[p]

    def closest() -> Found:
        p, r = min(probes.items(), key=lambda kv: abs(math.log(kv[1] / target)))
        return Found(p, r, abs(r / target - 1) <= RATIO_TOL, inside)

    def done() -> bool:
        return abs(closest().ratio / target - 1) <= SEARCH_TOL

    small, large = (lo, hi) if increasing else (hi, lo)  # the ends giving the smaller / larger ratio
    inside = probe(small) <= target * (1 + RATIO_TOL) and probe(large) >= target * (1 - RATIO_TOL)
    if not inside or done():
        return closest()
    key = (lambda p: p) if integer else math.log
    while len(probes) < max_probes:
        ks, kl = key(small), key(large)
        ls, ll = math.log(probe(small)), math.log(probe(large))
        frac = 0.5 if ll == ls or len(probes) % 2 else (math.log(target) - ls) / (ll - ls)
        k = ks + min(max(frac, 0.1), 0.9) * (kl - ks)  # every other probe bisects: the bracket halves
        if integer:
            p = round(k)
            if abs(large - small) <= 1:
                break
            p = min(max(p, min(small, large) + 1), max(small, large) - 1)
        else:
            if abs(kl - ks) < 1e-6:
                break
            p = math.exp(k)
        if probe(p) < target:
            small = p
        else:
            large = p
        if done():
            break
    return closest()


def searched(ds: Dataset, method: str, variant: str, target: float, make: Callable[[float], Codec],
             lo: float, hi: float, fmt: Callable[[float], str], repeats: int, **kw) -> Result:
    """Search ``make(param)`` for the target ratio and measure the result (a note when it misses)."""
    found = search(lambda p: achieved_ratio(ds, make(p)), target, lo, hi, **kw)
    result = Result(ds.name, method, variant, target, setting=fmt(found.param), reached=found.inside)
    if not found.inside:
        edge = "at least" if found.ratio > target else "at most"
        result.ratio, result.setting = found.ratio, ""
        result.note = f"cannot reach {target:g}: {edge} {found.ratio:.3g} ({fmt(found.param)})"
        return result
    measure(ds, make(found.param), result, repeats)
    if not found.hit:
        result.note = f"parameter too coarse: closest ratio is {result.ratio / target - 1:+.1%} off"
    return result


# ---------------------------------------------------------------------------------------------- dctchop


def dctchop_codec(ds: Dataset, settings_for: Callable[[np.ndarray], ChunkSettings]) -> Codec:
    zstd = numcodecs.Zstd(level=ZSTD_LEVEL)

    def compress(x):
        s = settings_for(x)
        return [zstd.encode(encode_chunk(x[c], s, 1)) for c in dctchop_chunks(x, s.axes)]

    def decompress(parts, like):  # each chunk decoded where it belongs: no copy (JPEG's images alike)
        s = settings_for(like)
        chunks = dctchop_chunks(like, s.axes)
        if len(chunks) == 1:
            return decode_chunk(zstd.decode(parts[0]), like.shape, like.dtype, 1)
        out = np.empty_like(like)
        for part, c in zip(parts, chunks):
            decode_chunk(zstd.decode(part), like[c].shape, like.dtype, 1, out=out[c])
        return out
    return Codec(compress, decompress, extra_bytes_per_part=CRC_BYTES)


def dctchop_axes(x: np.ndarray, colour: bool = True) -> tuple[tuple[int, ...], tuple[int, ...], int | None]:
    """(axes, block, colour axis) as ``dctchop compress`` picks them by default: the layout's spatial axes in
    BLOCK-point blocks, plus, for 3-channel images, the channel axis as one block of 3 (an orthonormal
    luma / colour-difference transform) unless ``colour`` is off (``--axes`` in the CLI)."""
    axes, layout = infer_axes(x.shape, x.dtype)
    c = colour_axis(x.shape, layout) if colour else None
    per_axis = sorted([(a, BLOCK) for a in axes] + ([(c, x.shape[c])] if c is not None else []))
    return tuple(a for a, _ in per_axis), tuple(b for _, b in per_axis), c


def run_dctchop(ds: Dataset, targets: Sequence[float], repeats: int) -> list[Result]:
    """Quantized dctchop (keep = block, base step searched): int8/int16 x square/triangle mask, and for RGB
    also without the colour transform; the variant with the best PSNR at each target is repeated as
    method "dctchop"."""
    results = []
    has_colour = dctchop_axes(ds.items[0])[2] is not None
    for colour in (True, False) if has_colour else (True,):
        for precision in ("int8", "int16"):
            for mask in ("square", "triangle"):
                def make(step, precision=precision, mask=mask, colour=colour):
                    def settings(x):
                        axes, block, _ = dctchop_axes(x, colour)
                        return ChunkSettings(axes, block, block, mask, precision, step=float(step))
                    return dctchop_codec(ds, settings)
                variant = f"{precision} {mask}" + ("" if colour or not has_colour else ", no colour axis")
                for t in targets:
                    results.append(searched(ds, "dctchop variant", variant, t, make, ds.peak * 1e-6,
                                            ds.peak * 64, lambda s: f"step {s:.4g}", repeats))
    return results + pick_best(results, "dctchop", targets)


def pick_best(results: list[Result], family: str, targets: Sequence[float]) -> list[Result]:
    """Per target, the variant row with the highest PSNR interpolated at exactly the target (so a variant
    whose coarse parameter landed a little off is judged fairly), repeated under the family's name."""
    rows = []
    for t in targets:
        at_t = [r for r in results if r.method == f"{family} variant" and r.target == t]
        ok = [r for r in at_t if r.reached]
        if not ok:
            best = min(at_t, key=lambda r: abs(math.log(r.ratio / t)))
            rows.append(Result(**{**best.__dict__, "method": family}))
            continue
        score = {r.variant: interpolate(curve(results, f"{family} variant", r.variant), t) for r in ok}
        ranked = [r for r in ok if math.isfinite(score[r.variant])]
        best = (max(ranked, key=lambda r: score[r.variant]) if ranked else
                max([r for r in ok if abs(r.ratio / t - 1) <= RATIO_TOL] or ok, key=lambda r: r.psnr))
        rows.append(Result(**{**best.__dict__, "method": family}))
    return rows


def run_chop(ds: Dataset, targets: Sequence[float], repeats: int) -> list[Result]:
    """The paper's chop: keep k per axis (square mask) in a float precision, zstd on top. Every (k, precision)
    is measured once (variant rows, with the payload-only "native" ratio); each target gets the best PSNR
    among settings whose ratio is at least the target (within tolerance)."""
    variants = []
    for precision, nbytes in {"float32": 4, "float16": 2, "bfloat16": 2}.items():
        for k in range(1, BLOCK + 1):
            def settings(x, k=k, precision=precision):
                axes, block, c = dctchop_axes(x)
                keep = tuple(b if a == c else k for a, b in zip(axes, block))  # colour axis kept whole
                return ChunkSettings(axes, block, keep, "square", precision)
            codec = dctchop_codec(ds, settings)
            d = len(infer_axes(ds.items[0].shape, ds.dtype)[0])
            native = BLOCK**d * ds.dtype.itemsize / (k**d * nbytes)
            r = Result(ds.name, "dctchop chop variant", f"keep {k}^{d} {precision}", None,
                       setting=f"native ratio {native:.3g}")
            if not 1.5 <= native <= 64:
                continue
            variants.append(measure(ds, codec, r, repeats))
    results = list(variants)
    for t in targets:
        ok = [v for v in variants if v.ratio >= t * (1 - RATIO_TOL)]
        if ok:
            best = max(ok, key=lambda v: v.psnr)
            results.append(Result(**{**best.__dict__, "method": "dctchop chop", "target": t,
                                     "setting": f"{best.variant}, {best.setting}",
                                     "note": "" if best.ratio <= t * (1 + RATIO_TOL) else
                                     f"fixed ratios: lands at {best.ratio:.3g}"}))
        else:
            results.append(Result(ds.name, "dctchop chop", "", t, reached=False,
                                  note="no setting reaches it"))
    return results


# ---------------------------------------------------------------------------------------------- ZFP, SZ3


def run_zfp(ds: Dataset, targets: Sequence[float], repeats: int) -> list[Result]:
    import zfpy

    def make(**kw) -> Codec:
        def compress(x):
            return [zfpy.compress_numpy(ds.to_peer(x), **kw)]

        def decompress(parts, like):
            return to_dtype(ds.from_peer(zfpy.decompress_numpy(parts[0]), like), like.dtype)
        return Codec(compress, decompress)

    ndim = ds.to_peer(ds.items[0]).ndim
    min_rate = ZFP_MIN_BLOCK_BITS / 4**ndim  # 0.5625 bits/value in 2-D, 0.140625 in 3-D: never go below
    results = []
    for t in targets:
        results.append(searched(ds, "zfp fixed-rate", "", t, lambda r: make(rate=r), min_rate, 32.0,
                                lambda r: f"rate {r:.4g} bit/value", repeats, increasing=False))
        results.append(searched(ds, "zfp fixed-accuracy", "", t, lambda tol: make(tolerance=tol),
                                ds.peak * 1e-7, ds.peak * 64, lambda tol: f"tolerance {tol:.3g}", repeats))
    return results


SZ3_ALGORITHMS = ("INTERP_LORENZO", "INTERP", "LORENZO_REG")  # INTERP_LORENZO is SZ3's default


def run_sz3(ds: Dataset, targets: Sequence[float], repeats: int) -> list[Result]:
    """Absolute error bound searched, for each of SZ3's predictors and two layouts: the dataset's peer layout
    and, for 3-D layouts, its planes stacked into one 2-D array of rows (the predictor then runs along an
    image's rows, not across unrelated images); the best variant per target is repeated as "sz3"."""
    from pysz import sz, szAlgorithm, szConfig, szErrorBoundMode

    layouts = {ds.peer_layout: (ds.to_peer, ds.from_peer)}
    if ds.to_peer(ds.items[0]).ndim >= 3:
        layouts["rows (2-D)"] = (lambda x: ds.to_peer(x).reshape(-1, ds.to_peer(x).shape[-1]),
                                 lambda y, like: ds.from_peer(y.reshape(ds.to_peer(like).shape), like))

    def make(bound: float, algorithm: str, to_peer, from_peer) -> Codec:
        shapes = {id(x): to_peer(x).shape for x in ds.items}

        def compress(x):
            conf = szConfig()
            conf.errorBoundMode = szErrorBoundMode.ABS
            conf.absErrorBound = bound
            conf.cmprAlgo = getattr(szAlgorithm, algorithm)
            conf.openmp = False
            return [sz.compress(np.ascontiguousarray(to_peer(x)), conf)[0].tobytes()]

        def decompress(parts, like):
            y, _ = sz.decompress(np.frombuffer(parts[0], dtype=np.uint8), np.float32, shapes[id(like)])
            return to_dtype(from_peer(y, like), like.dtype)
        return Codec(compress, decompress)

    results = []
    for layout, (to_peer, from_peer) in layouts.items():
        for algorithm in SZ3_ALGORITHMS:
            for t in targets:
                results.append(searched(ds, "sz3 variant", f"{algorithm}, {layout}", t,
                                        lambda b, a=algorithm, f=to_peer, g=from_peer: make(b, a, f, g),
                                        ds.peak * 1e-7, ds.peak, lambda b: f"abs bound {b:.3g}", repeats))
    return results + pick_best(results, "sz3", targets)


# ---------------------------------------------------------------------------------------------- JPEG


def jpeg_shared_segments(stream: bytes) -> bytes:
    """The segments before the scan that JPEG's abbreviated format (T.81 B.5) lets a set of images share: the
    quantization and Huffman tables, and the APPn / COM markers an abbreviated stream can do without. SOI,
    the frame header, DRI and the scan header stay with each image (35 bytes for RGB, 25 for grey)."""
    shared, pos = [], 2  # after SOI
    while stream[pos : pos + 2] != b"\xff\xda":
        marker, length = stream[pos + 1], int.from_bytes(stream[pos + 2 : pos + 4], "big")
        if marker in (0xDB, 0xC4, 0xFE) or 0xE0 <= marker <= 0xEF:
            shared.append(stream[pos : pos + 2 + length])
        pos += 2 + length
    return b"".join(shared)


def shared_header_overhead(parts: list[list[bytes]]) -> int:
    """Minus the shared segments (:func:`jpeg_shared_segments`) of all but the first stream when every stream
    has the same ones (the JPEG abbreviated format: tables once per set); 0 when they differ."""
    streams = [s for item in parts for s in item if len(s) > 8]
    shared = jpeg_shared_segments(streams[0])
    if any(jpeg_shared_segments(s) != shared for s in streams):
        return 0
    return -len(shared) * (len(streams) - 1)


def jpeg_codec(ds: Dataset, quality: int, subsampling: str, abbreviated: bool) -> Codec:
    import simplejpeg

    grey = ds.jpeg_images(ds.items[0])[0].shape[-1] == 1
    space = "GRAY" if grey else "RGB"
    sub = "Gray" if grey else subsampling
    is_float = ds.dtype.kind == "f"
    images = {id(x): ds.jpeg_images(x) for x in ds.items}
    layouts = {key: (len(ims), ims[0].shape) for key, ims in images.items()}  # an item's images share a shape
    assert all(im.shape == ims[0].shape for ims in images.values() for im in ims)

    def compress(x):
        if is_float:  # min-max scale to 8 bits; the two float32 bounds are stored (8 bytes)
            lo, hi = float(x.min()), float(x.max())
            x = np.rint((x - lo) * (255.0 / (hi - lo))).astype(np.uint8)
            head = [np.array([lo, hi], dtype=np.float32).tobytes()]
        else:
            head = []
        return head + [simplejpeg.encode_jpeg(np.ascontiguousarray(im), quality=int(quality),
                                              colorspace=space, colorsubsampling=sub, fastdct=False)
                       for im in ds.jpeg_images(x)]

    def decompress(parts, like):
        if is_float:
            lo, hi = np.frombuffer(parts[0], dtype=np.float32)
            parts = parts[1:]
        n, shape = layouts[id(like)]
        y = np.empty((n, *shape), np.uint8)
        for p, image in zip(parts, y):  # into the output, as dctchop decodes its chunks
            simplejpeg.decode_jpeg(p, colorspace=space, fastdct=False, fastupsample=False, buffer=image)
        y = y.reshape(like.shape)
        if is_float:  # lo + y * scale in float32, as one pass and one add
            x = np.multiply(y, np.float32((hi - lo) / 255.0), dtype=np.float32)
            x += lo
            return x
        return y
    return Codec(compress, decompress, overhead=shared_header_overhead if abbreviated else (lambda p: 0))


def run_jpeg(ds: Dataset, targets: Sequence[float], repeats: int) -> list[Result]:
    """Quality 1..100 searched, 4:4:4 and 4:2:0 for colour; per-image files, and the abbreviated accounting
    when all headers are equal. The best subsampling per target is repeated as "jpeg" / "jpeg (abbrev.)"."""
    grey = ds.jpeg_images(ds.items[0])[0].shape[-1] == 1
    subs = ("Gray",) if grey else ("444", "420")
    shared = len(ds.jpeg_images(ds.items[0])) > 1 and len(ds.items) == 1
    label = "8-bit min-max, " if ds.dtype.kind == "f" else ""
    results = []
    for abbreviated in (False, True) if shared else (False,):
        method = "jpeg (abbrev.)" if abbreviated else "jpeg"
        for sub in subs:
            for t in targets:
                r = searched(ds, f"{method} variant", sub, t,
                             lambda q, sub=sub, ab=abbreviated: jpeg_codec(ds, int(q), sub, ab), 1, 100,
                             lambda q, sub=sub: f"{label}{sub}, quality {int(q)}", repeats, increasing=False,
                             integer=True)
                results.append(r)
        results += pick_best(results, method, targets)
    return results


def run_zstd(ds: Dataset, repeats: int) -> list[Result]:
    zstd = numcodecs.Zstd(level=ZSTD_LEVEL)
    codec = Codec(lambda x: [zstd.encode(x)],
                  lambda parts, like: np.frombuffer(zstd.decode(parts[0]), like.dtype).reshape(like.shape))
    result = Result(ds.name, "zstd", f"level {ZSTD_LEVEL}", None, setting="lossless")
    return [measure(ds, codec, result, repeats)]


# ---------------------------------------------------------------------------------------------- report


def psnr_at(results: list[Result], method: str, ratio: float) -> float:
    """PSNR of ``method`` at exactly ``ratio``: the best of its variants' curves (chop: the envelope of its
    fixed settings), each interpolated by :func:`interpolate`."""
    variants = {r.variant for r in results if r.method == f"{method} variant"}
    if method == "dctchop chop" or not variants:
        return interpolate(curve(results, method), ratio)
    values = [interpolate(curve(results, f"{method} variant", v), ratio) for v in variants]
    return max((v for v in values if math.isfinite(v)), default=math.nan)


def interpolate(pts: list[tuple[float, float]], ratio: float) -> float:
    """PSNR at exactly ``ratio`` on a (ratio, PSNR) curve: linear in log(ratio) between its points, no
    extrapolation beyond RATIO_TOL (NaN)."""
    if not pts:
        return math.nan
    xs = np.log([p[0] for p in pts])
    x = math.log(ratio)
    if not xs[0] - 1e-9 <= x <= xs[-1] + 1e-9:
        if abs(math.exp(xs[0]) / ratio - 1) <= RATIO_TOL:  # a single point within tolerance
            return pts[0][1]
        if abs(math.exp(xs[-1]) / ratio - 1) <= RATIO_TOL:
            return pts[-1][1]
        return math.nan
    return float(np.interp(x, xs, [p[1] for p in pts]))


def curve(results: list[Result], method: str, variant: str | None = None) -> list[tuple[float, float]]:
    """(ratio, PSNR) points of a method (of one variant), sorted by ratio; for chop the upper envelope of
    its fixed settings."""
    if method == "dctchop chop":
        pts = [(r.ratio, r.psnr) for r in results if r.method == "dctchop chop variant"]
        return sorted(p for p in pts if not any(q[0] >= p[0] and q[1] > p[1] for q in pts if q != p))
    return sorted({(r.ratio, r.psnr) for r in results if r.method == method and r.reached
                   and (variant is None or r.variant == variant)
                   and math.isfinite(r.ratio) and math.isfinite(r.psnr)})


def _f(v: float, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float) and math.isinf(v):
        return "∞"
    return f"{v:.{digits}f}"


def _mbs(v: float) -> str:
    return "—" if math.isnan(v) else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def results_table(rows: list[Result], with_variant: bool) -> str:
    head = ["method"] + (["variant"] if with_variant else []) + [
        "target", "ratio", "PSNR dB", "max abs err", "comp MB/s", "decomp MB/s", "setting", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.method] + ([r.variant] if with_variant else []) + [
            "—" if r.target is None else f"{r.target:g}", _f(r.ratio), _f(r.psnr), _f(r.max_abs_error, 3),
            _mbs(r.compress_mbs), _mbs(r.decompress_mbs), r.setting, r.note]
        if not r.reached:
            cells[-7:-2] = ["—"] * 5
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gap_table(results: list[Result], targets: Sequence[float]) -> str:
    """dctchop PSNR minus each method's, both interpolated at exactly the target ratio."""
    methods = [m for m in MAIN_METHODS[1:-1] if any(r.method == m for r in results)]
    head = ["target"] + ["dctchop dB"] + [f"vs {m}" for m in methods]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in targets:
        ours = psnr_at(results, "dctchop", t)
        cells = [f"{t:g}", _f(ours)] + [_f(ours - psnr_at(results, m, t), 1) for m in methods]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


PEERS = ("zfp fixed-rate", "zfp fixed-accuracy", "sz3", "jpeg", "jpeg (abbrev.)")


def speed_table(results: list[Result], targets: Sequence[float]) -> str:
    """dctchop's decode speed at each target against the fastest peer configuration searched for that target
    that reaches it (a ratio at least the target, less RATIO_TOL), whatever its PSNR: every variant counts
    (JPEG 4:2:0 as well as 4:4:4, every SZ3 predictor), and so does one that overshoots because its parameter
    is coarse (JPEG quality 99 at ratio 8.3 for 8)."""
    head = ["target", "dctchop decomp MB/s", "fastest peer", "its PSNR dB", "its decomp MB/s", "dctchop / peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in targets:
        ours = next((r for r in results if r.method == "dctchop" and r.target == t and r.reached), None)
        peers = [r for r in results if r.method.removesuffix(" variant") in PEERS and r.target == t and r.reached
                 and r.ratio >= t * (1 - RATIO_TOL)]
        if ours is None or not peers:
            continue
        fastest = max(peers, key=lambda r: r.decompress_mbs)
        name = fastest.method.removesuffix(" variant") + (f" {fastest.variant}" if fastest.variant else "")
        lines.append("| " + " | ".join([f"{t:g}", _mbs(ours.decompress_mbs), name, _f(fastest.psnr),
                                         _mbs(fastest.decompress_mbs),
                                         f"{ours.decompress_mbs / fastest.decompress_mbs:.2f}x"]) + " |")
    return "\n".join(lines)


def plot(ds: Dataset, results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    styles = {"dctchop": ("C0", "o", "-", 2.5), "dctchop chop": ("C0", "s", "--", 1.5),
              "zfp fixed-rate": ("C1", "v", "-", 1.5), "zfp fixed-accuracy": ("C1", "^", ":", 1.5),
              "sz3": ("C2", "D", "-", 1.5), "jpeg": ("C3", "P", "-", 1.5),
              "jpeg (abbrev.)": ("C3", "X", "--", 1.5)}
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for method, (color, marker, ls, lw) in styles.items():
        pts = curve(results, method)
        if pts:
            name = "jpeg (8-bit)" if method == "jpeg" and ds.dtype.kind == "f" else method
            ax.plot(*zip(*pts), color=color, marker=marker, ls=ls, lw=lw, label=name)
    for r in results:
        if r.method == "zstd":
            ax.axvline(r.ratio, color="0.5", ls=":", lw=1)
            ax.text(r.ratio, 0.02, f" zstd-{ZSTD_LEVEL} lossless {r.ratio:.2f}", rotation=90, color="0.4",
                    transform=ax.get_xaxis_transform(), va="bottom", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("compression ratio (original bytes / compressed bytes)")
    ax.set_ylabel("PSNR (dB)")
    ax.set_title(ds.title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_markdown(path: Path, command: str, sections: list[str], seconds: float) -> None:
    findings = ""
    if path.exists():
        m = re.search(r"<!-- findings -->.*?<!-- /findings -->", path.read_text(), re.DOTALL)
        findings = m.group(0) if m else ""
    versions = ", ".join(f"{p} {_version(p)}" for p in ("numpy", "numba", "numcodecs", "zfpy", "pysz",
                                                          "simplejpeg", "scikit-image"))
    text = [
        "# Rate-distortion: dctchop against its peers",
        "",
        "Generated by `benchmarks/peers.py` (see its docstring for the methods and datasets). Command:",
        "",
        "```bash",
        command,
        "```",
        "",
        (f"Run {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {platform.machine()}, {os.cpu_count()} cores, "
         f"Python {platform.python_version()}; {versions}; total {seconds:.0f} s."),
        f"Measured: {codec_state()}.",
        "",
        (f"- ratio = original bytes / compressed bytes (dctchop: zstd-{ZSTD_LEVEL} frames + 4 bytes crc32c per "
         "chunk, as stored; no Zarr metadata for anyone)."),
        ("- PSNR = 20 log10(peak) - 10 log10(MSE) over the whole dataset; peak 255 for uint8, max - min "
         "for float."),
        ("- MB/s: MB (1e6 B) of original data per second, one thread, dtype conversions included; median of "
         f"up to 5 samples (fewer when slow), each sample repeating the call for {MIN_SAMPLE_SECONDS:g} s at "
         "least, so fast and slow codecs see a busy machine alike. The machine is shared: read MB/s as ±50%."),
        (f"- Searches aim at {SEARCH_TOL:.1%} of the target ratio; rows more than {RATIO_TOL:.0%} off say "
         "so. "
         "The gap table interpolates each method's PSNR at exactly the target ratio (linear in log ratio "
         "between its measured points, best variant, no extrapolation) and shows dctchop minus the method: "
         "negative = dctchop is behind."),
        "",
    ]
    if findings:
        text += [findings, ""]
    path.write_text("\n".join(text + sections) + "\n")


def codec_state() -> str:
    """The dctchop being measured: version, commit, and whether its files differ from the commit (other work
    in progress changes the numbers)."""
    from dctchop import __version__

    def git(*args: str) -> str:
        try:
            run = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10,
                                 check=False)
            return run.stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = git("rev-parse", "--short", "HEAD") or "unknown commit"
    dirty = [line[3:] for line in git("status", "--porcelain", "--", "dctchop").splitlines()]
    state = f"dctchop {__version__} at commit {commit.strip()}"
    return state + (f", with uncommitted or new files: {', '.join(dirty)}" if dirty else "")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


# ---------------------------------------------------------------------------------------------- main


def run_dataset(name: str, targets: list[float], curve: list[float], repeats: int, out: Path) -> str:
    t0 = time.perf_counter()
    ds = load_dataset(name)
    ds.peak = 255.0 if ds.dtype == np.uint8 else float(max(x.max() for x in ds.items) -
                                                          min(x.min() for x in ds.items))
    ratios = sorted(set(targets) | set(curve))
    ds.timed_targets = frozenset(targets)
    results: list[Result] = []
    for step in (lambda: run_dctchop(ds, ratios, repeats), lambda: run_chop(ds, targets, repeats),
                 lambda: run_zfp(ds, ratios, repeats), lambda: run_sz3(ds, ratios, repeats),
                 lambda: run_jpeg(ds, ratios, repeats), lambda: run_zstd(ds, repeats)):
        results += step()
    png = out / f"rd_{name}.png"
    plot(ds, results, png)

    in_table = lambda r: r.target is None or r.target in targets
    order = {m: i for i, m in enumerate(MAIN_METHODS)}
    main = sorted((r for r in results if r.method in order and in_table(r)),
                  key=lambda r: (r.target or math.inf, order[r.method]))
    variants = [r for r in results if r.method.endswith("variant") and in_table(r)]
    items = ", ".join("x".join(map(str, x.shape)) for x in ds.items)
    section = "\n".join([
        f"## {name}",
        "",
        (f"{ds.title}. Source: {ds.source}. Items coded separately: {items} ({ds.nbytes / 1e6:.2f} MB). "
         f"dctchop axes {dctchop_axes(ds.items[0])[0]}, blocks {dctchop_axes(ds.items[0])[1]}, chunks of "
         f"about {CHUNK_BYTES >> 20} MB; "
         f"ZFP/SZ3 get {ds.peer_layout}. ({time.perf_counter() - t0:.0f} s)"),
        "",
        f"![rate-distortion {name}]({png.name})",
        "",
        results_table(main, with_variant=False),
        "",
        "Gap, dB (dctchop minus method at exactly the target ratio; negative = dctchop behind):",
        "",
        gap_table(results, targets),
        "",
        "Decode speed against the fastest peer configuration at the target ratio (one thread):",
        "",
        speed_table(results, targets),
        "",
        "<details><summary>All variants</summary>",
        "",
        results_table(variants, with_variant=True),
        "",
        "</details>",
        "",
    ])
    print(section, flush=True)
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default=",".join(DEFAULT_DATASETS),
                        help=f"comma-separated, from {', '.join(DEFAULT_DATASETS)}")
    parser.add_argument("--ratios", default="4,8,16", help="target ratios for the tables (default 4,8,16)")
    parser.add_argument("--curve-ratios", default="2.83,5.66,11.3,22.6",
                        help="extra ratios measured only for the figures and the gap interpolation "
                             "(empty string for none)")
    parser.add_argument("--repeats", type=int, default=5, help="timed samples per measurement (median)")
    parser.add_argument("--out", type=Path, default=Path("docs"), help="folder for the PNGs and the markdown")
    args = parser.parse_args()
    numbers = lambda s: [float(v) for v in s.split(",") if v.strip()]
    targets, curve = numbers(args.ratios), numbers(args.curve_ratios)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    sections = [run_dataset(name.strip(), targets, curve, args.repeats, args.out)
                for name in args.datasets.split(",") if name.strip()]
    command = shlex.join([".venv/bin/python", "benchmarks/peers.py", *sys.argv[1:]])
    write_markdown(args.out / "rate_distortion.md", command, sections, time.perf_counter() - start)
    print(f"wrote {args.out / 'rate_distortion.md'} and {len(sections)} figure(s) in "
          f"{time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
