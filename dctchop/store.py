"""The dctchop store: a Zarr v3 group of compressed arrays, lossless copies and per-chunk metadata.

Layout of a store made from ``images.h5`` (datasets ``/images`` and ``/labels``)::

    images.zarr/                     group; attrs: source attrs + "dctchop" (version, source, settings, totals)
      images                         original shape and dtype; codecs dctchop -> zstd -> crc32c
      labels                         lossless: bytes -> zstd -> crc32c
      dctchop_meta/images/psnr       per-chunk metadata, shaped like the chunk grid of ``images``
      dctchop_meta/images/...        max_abs_error, rmse, stored_bytes, step, checksum

A ``.npy`` input becomes one array named ``data``. Arrays are chunked along axis 0 only (whole samples; slabs
of whole blocks when axis 0 is transformed), so every chunk is written once, whole.

PSNR is ``20 log10(peak) - 10 log10(MSE)``, peak = 255 for uint8 and max - min of the original array for the
other dtypes (1 for a constant array).

Every chunk's metadata is measured on a decode of exactly the bytes written for it (before zstd and
crc32c, which are lossless and checked on read), so it describes what is on disk.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import math
import numbers
import os
import posixpath
import re
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Executor, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import google_crc32c
import numcodecs
import numpy as np
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec, ZstdCodec
from zarr.storage import MemoryStore, StorePath

from dctchop import quantize as qz
from dctchop._version import __version__
from dctchop.codec import (
    ChunkSettings,
    DctChopCodec,
    check_dtype,
    encode_and_measure,
    encode_coefficients,
    most_coded_bytes,
    read_expected_header,
    read_header,
    transform_chunk,
)
from dctchop.dask_runner import task_runner
from dctchop.errors import CorruptChunkError, DctchopError, first_line, output_exists
from dctchop.formats import Source, SourceArray
from dctchop.formats.hdf5 import keep_spans
from dctchop.formats.npy import STORED_NAME as NPY_STORED_NAME
from dctchop.layout import check_axes, colour_axis, infer_axes
from dctchop.location import Location, absolute_path, exchange, refuse_special_file, rename_new, store_holding
from dctchop.transform import check_blocks, make_plan, per_axis, resolve_threads

# 4: each chunk file's crc32c is recorded (the lossy arrays' checksum metadata, the record's checksums of the
# lossless copies), so a chunk file replaced by another of the same size (a swapped chunk, a Zarr write) is damage;
# 3: every chunk of the lossless copies is written, even one of fill values, so a missing one is damage;
# 2: chunk files of the lossy and metadata arrays named c.I.0.0 ("." separator); 1: c/I/0/0
STORE_FORMAT = 4
CHUNK_KEY_ENCODING = {"name": "default", "separator": "."}
META_GROUP = "dctchop_meta"
ZSTD_LEVEL = 1  # on bit-plane payloads as small as level 3 (images: 3% smaller), 2-2.5x faster
ZSTD_LEVELS = range(-(1 << 17), 23)  # zstd's own bounds; below 0 its fast levels
DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_PSNR_INTEGER = 40.0
DEFAULT_PSNR_FLOAT = 60.0
RATIO_TOLERANCE = 0.05
RATIO_MARGIN = 0.01  # a target the search estimates within this of the tolerance is refused up front
RATIO_SAMPLE_BYTES = 64 << 20
# The range float data must span: errors are squared in float64, whose normal numbers end near 1e-308, and
# the finest PSNR target (400 dB) asks for squared errors 1e-40 of the squared range. float32 data always
# spans more (its smallest step is 1.4e-45); float64 data at 1e-160 measured PSNR inf at 111 dB.
SMALLEST_FLOAT_PEAK = 1e-130
DASK_TASK_BYTES = 64 << 20
# checksum: the chunk file's crc32c trailer (the Crc32cCodec's, of its zstd frame), from store format 4 on
META_FIELDS = {"psnr": "f8", "max_abs_error": "f8", "rmse": "f8", "stored_bytes": "i8", "step": "f8", "checksum": "u4"}
FILE_FIELDS = ("stored_bytes", "checksum")  # what the per-chunk metadata says of the chunk file itself
FILE_SYSTEM_BLOCK = 4096  # the usual allocation unit of local file systems: every file takes whole blocks


# ---------------------------------------------------------------------------------------------- options


TARGET_KINDS = ("keep", "ratio", "psnr")


@dataclass(frozen=True)
class Target:
    """The quality target: ``keep`` (the paper's chop, k per axis), ``ratio`` or ``psnr``."""

    kind: str
    value: float | tuple[int, ...]

    def __post_init__(self) -> None:
        check_target(self.kind, self.value)
        if self.kind in ("ratio", "psnr"):  # NumPy scalars too, which the record's JSON would not take
            object.__setattr__(self, "value", float(self.value))
        else:
            keep = tuple(int(k) for k in self.value) if isinstance(self.value, (tuple, list)) else int(self.value)
            object.__setattr__(self, "value", keep)


def check_target(kind: str, value, option: str | None = None) -> None:
    """Refuse a ``ratio`` or ``psnr`` target no data can meet; the message names ``option`` (default
    ``--ratio``/``--psnr``), so that other commands' options taking a target say their own name."""
    if kind not in TARGET_KINDS:  # a store records it, and its readers refused the kind as damage
        raise DctchopError(f"the target kind must be one of {', '.join(TARGET_KINDS)}, got {kind!r}")
    number = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    if kind == "keep":
        keeps = value if isinstance(value, (tuple, list)) else [value]
        if not keeps or not all(isinstance(k, numbers.Integral) and not isinstance(k, (bool, np.bool_)) and k >= 1
                                for k in keeps):  # 4.5 was kept as 4 and recorded as 4.5
            raise DctchopError(f"{option or '--keep'} must be whole numbers of coefficients, at least 1, got {value!r}")
        return
    shown = f"{value:g}" if number else repr(value)
    if kind == "ratio" and not (number and math.isfinite(value) and value >= 1):  # NaN too
        raise DctchopError(f"{option or '--ratio'} must be a finite number, at least 1, got {shown}")
    if kind == "psnr" and not (number and 0 < value < qz.MAX_PSNR):
        raise DctchopError(f"{option or '--psnr'} must be a number of dB above 0 and below {qz.MAX_PSNR}, got {shown}")


@dataclass(frozen=True)
class CompressOptions:
    """Settings for :func:`compress`; ``None`` fields take the documented defaults per array."""

    target: Target | None = None
    axes: tuple[int, ...] | None = None
    block: tuple[int, ...] | int = 8
    mask: str = "square"
    precision: str | None = None
    chunk_samples: int | None = None
    workers: int = 0
    scheduler: str | None = None
    zstd_level: int = ZSTD_LEVEL

    def __post_init__(self) -> None:
        if self.zstd_level not in ZSTD_LEVELS:
            raise DctchopError(f"--zstd-level must be from {ZSTD_LEVELS.start} to {ZSTD_LEVELS.stop - 1}, "
                               f"got {self.zstd_level}")


@dataclass
class ArrayPlan:
    """How one source array is stored: transform settings, chunking and the codec."""

    source: SourceArray
    name: str
    axes: tuple[int, ...]
    layout: str
    chunks: tuple[int, ...]
    settings: ChunkSettings
    target: Target
    peak: float
    zstd_level: int = ZSTD_LEVEL  # of the lossless stage after the codec (decoders need not know it)
    note: str | None = None  # what the summary should tell the user about how the target was met
    at_finest_step: bool = False  # a --ratio that even the finest step exceeds: stored at it

    @property
    def codec(self) -> DctChopCodec:
        return DctChopCodec(**asdict(self.settings))


def _with_axis(axes, block, keep, axis: int, length: int):
    """Insert ``axis`` (block and keep ``length``) into sorted per-axis settings."""
    merged = sorted([*zip(axes, block, keep), (axis, length, length)])
    return tuple(tuple(v) for v in zip(*merged))


def default_target(dtype) -> Target:
    """No option given: PSNR 40 dB for integer (image) data, 60 dB for floating-point (scientific) data."""
    return Target("psnr", DEFAULT_PSNR_INTEGER if np.dtype(dtype).kind in "iu" else DEFAULT_PSNR_FLOAT)


def array_name(source: Source, array: SourceArray) -> str:
    return NPY_STORED_NAME if source.kind == "npy" else array.name.strip("/")


def _chunks(shape, axes, block, dtype, chunk_samples) -> tuple[int, ...]:
    """Chunk along axis 0 only: ``chunk_samples`` samples (default: about 4 MB of input per chunk); when
    axis 0 is transformed, a whole number of its blocks."""
    sample_bytes = max(math.prod(shape[1:]) * np.dtype(dtype).itemsize, 1)
    unit = block[0] if 0 in axes else 1
    if chunk_samples is None:
        chunk_samples = max(unit, (DEFAULT_CHUNK_BYTES // sample_bytes) // unit * unit)
    elif not isinstance(chunk_samples, numbers.Integral) or isinstance(chunk_samples, bool) or chunk_samples < 1:
        raise DctchopError(f"--chunk-samples must be a whole number, at least 1, got {chunk_samples!r}")
    elif 0 in axes and chunk_samples % unit:
        raise DctchopError(f"--chunk-samples must be a multiple of the block size {unit} along axis 0")
    return (max(1, min(chunk_samples, shape[0])), *shape[1:])


def align_chunks(plans: list[ArrayPlan]) -> None:
    """Chunk arrays of the same samples alike (images and their masks, at the smaller of their default
    chunk lengths), so that a loader reads chunk k of each together. Arrays transformed along axis 0 (a
    field's Z) keep their own."""
    stacks: dict[int, list[ArrayPlan]] = {}
    for plan in plans:
        if 0 not in plan.axes:
            stacks.setdefault(plan.source.shape[0], []).append(plan)
    for same in stacks.values():
        length = min(plan.chunks[0] for plan in same)
        for plan in same:
            plan.chunks = (length, *plan.chunks[1:])


def plan_array(source: Source, array: SourceArray, options: CompressOptions) -> ArrayPlan:
    """Check one array against the options and decide its transform, chunking and codec settings. Errors
    name the array: in an HDF5 file of several, "--keep needs one value or one per transformed axis (3)"
    left the user to guess which."""
    name = array_name(source, array)
    try:
        return _plan_array(source, array, options, name)
    except DctchopError as e:
        if str(e).startswith(f"{name}: "):
            raise
        raise DctchopError(f"{name}: {e}") from None


def _plan_array(source: Source, array: SourceArray, options: CompressOptions, name: str) -> ArrayPlan:
    way_out = f"copy it bit-exactly with --lossless {name}" if source.kind == "hdf5" else ""
    check_dtype(array.dtype, name, way_out and f"; {way_out}")
    if 0 in array.shape:
        raise DctchopError(f"{name}: array is empty (shape {list(array.shape)})")
    colour = None
    if options.axes is not None:
        axes, layout = check_axes(options.axes, array.ndim, f"{name}: axes {list(options.axes)}"), "custom"
    else:
        try:
            axes, layout = infer_axes(array.shape, array.dtype)
        except DctchopError as e:
            raise DctchopError(f"{name}: {e}{way_out and f', or {way_out}'}") from None
        colour = colour_axis(array.shape, layout)
    for a in axes:
        if array.shape[a] < 2:
            raise DctchopError(f"{name}: transformed axis {a} has length {array.shape[a]}; pick other --axes"
                               f"{way_out and f', or {way_out}'}")
    target = options.target or default_target(array.dtype)
    block = per_axis(options.block, len(axes), "--block")
    check_blocks(block)  # before the chunking divides by it
    keep = per_axis(target.value, len(axes), "--keep") if target.kind == "keep" else block
    if colour is not None:  # the channel axis joins as one block, kept whole
        axes, block, keep = _with_axis(axes, block, keep, colour, array.shape[colour])
    peak = qz.fixed_peak(array.dtype)
    if target.kind == "keep":
        precision = options.precision or "float16"
        settings = ChunkSettings(axes, block, keep, options.mask, precision)
    else:
        precision = options.precision or "int16"
        if precision not in qz.INT_PRECISIONS:
            raise DctchopError(f"--{target.kind} needs an integer precision (int8 or int16), got {precision}")
        settings = ChunkSettings(axes, block, block, options.mask, precision,
                                 target_psnr=float(target.value) if target.kind == "psnr" else None)
    chunks = _chunks(array.shape, axes, block, array.dtype, options.chunk_samples)
    make_plan(chunks, axes, block, settings.keep, settings.mask)  # validate before any work
    return ArrayPlan(array, name, axes, layout, chunks, settings, target, peak if peak is not None else 0.0,
                     options.zstd_level)


# ---------------------------------------------------------------------------------------------- scanning


def _chunk_ranges(length: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, length)) for s in range(0, length, chunk)]


def scan_values(plan: ArrayPlan, pool: Executor) -> None:
    """Refuse NaN/Inf (with their count and first index) and set the PSNR peak, the data's range
    (:func:`dctchop.quantize.range_peak`), reading the chunks on ``pool``'s threads: for every dtype but
    uint8 (:func:`dctchop.quantize.fixed_peak`)."""

    def scan(start: int, stop: int) -> tuple[float, float, int, tuple | None]:
        x = plan.source.read(start, stop)
        lo, hi = float(x.min()), float(x.max())  # a NaN or an infinity shows in one of them
        if math.isfinite(lo) and math.isfinite(hi):
            return lo, hi, 0, None
        finite = np.isfinite(x)
        first = tuple(int(i) for i in np.argwhere(~finite)[0])
        return lo, hi, int(x.size - np.count_nonzero(finite)), (first[0] + start, *first[1:])

    found = list(pool.map(lambda r: scan(*r), _chunk_ranges(plan.source.shape[0], plan.chunks[0])))
    bad = [(n, first) for _, _, n, first in found if n]
    if bad:
        raise DctchopError(f"{plan.name}: {sum(n for n, _ in bad)} NaN or infinite values, "
                           f"first at index {list(bad[0][1])}")
    plan.peak = qz.range_peak(min(lo for lo, _, _, _ in found), max(hi for _, hi, _, _ in found))
    if plan.peak < SMALLEST_FLOAT_PEAK:
        raise DctchopError(f"{plan.name}: values span only {plan.peak:.3g}, too little for the error arithmetic "
                           f"(squared errors would underflow float64; at least {SMALLEST_FLOAT_PEAK:g}): scale "
                           "the data up")
    if plan.settings.target_psnr is not None:
        plan.settings = replace(plan.settings, peak=plan.peak)


# ---------------------------------------------------------------------------------------------- ratio search


def _ratio_sample(plan: ArrayPlan,
                  stored_bytes: np.ndarray | None = None) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The chunks (ranges of axis 0) the ratio search measures, and by how much to multiply each one's bytes
    to stand for the whole array. All chunks up to :data:`RATIO_SAMPLE_BYTES` of input; else as many as
    fit, spread evenly along axis 0, each standing for the same number of samples. Given every chunk's
    ``stored_bytes`` at some step (from a first write), they are spread evenly over the chunks ordered by
    bytes per sample instead, and each stands for the chunks whose bytes per sample are nearest its own:
    chunks unlike their neighbours (noise among smooth data) are then counted, wherever they lie."""
    ranges = _chunk_ranges(plan.source.shape[0], plan.chunks[0])
    rows = np.array([stop - start for start, stop in ranges], dtype=np.float64)
    chunk_bytes = math.prod(plan.chunks) * plan.source.dtype.itemsize
    n = max(1, min(len(ranges), RATIO_SAMPLE_BYTES // max(chunk_bytes, 1)))
    per_row = None if stored_bytes is None else np.asarray(stored_bytes, dtype=np.float64) / rows
    order = np.arange(len(ranges)) if per_row is None else np.argsort(per_row, kind="stable")
    picks = np.unique(order[np.linspace(0, len(ranges) - 1, n).round().astype(int)])
    if per_row is None:  # weighed by samples, not chunks: a short last chunk's padding costs next to nothing
        return [ranges[i] for i in picks], np.full(picks.size, rows.sum() / rows[picks].sum())
    nearest = np.argmin(np.abs(per_row[:, None] - per_row[picks][None, :]), axis=1)
    represented = np.bincount(nearest, weights=rows, minlength=picks.size)
    return [ranges[i] for i in picks], represented / rows[picks]


def search_ratio_step(plan: ArrayPlan, ratio: float, threads: int, overhead: int,
                      sample: tuple[list[tuple[int, int]], np.ndarray] | None = None) -> float:
    """Quantization step that gives the array ``ratio`` (within 1%), counting ``overhead`` bytes of metadata.

    The chunk bytes are measured on ``sample`` (chunk ranges and the weight of each; default
    :func:`_ratio_sample`: every chunk for arrays up to 64 MB) and scaled to the whole array. An array that
    compresses beyond ``ratio`` at the finest step is stored at that step (best quality;
    ``plan.at_finest_step``, and ``plan.note`` says so): no step could bring its ratio down to the target.
    """
    zstd = numcodecs.Zstd(level=plan.zstd_level)
    settings = replace(plan.settings, target_psnr=None)
    ranges, weights = _ratio_sample(plan) if sample is None else sample
    scale, coefficients = plan.peak, []  # the steps tried are relative to the data's scale, however small
    for start, stop in ranges:  # each sample chunk is transformed once, quantized at every step
        x = _pad_to_chunk(plan.source.read(start, stop), plan.chunks, plan.axes)
        c = transform_chunk(x, settings, threads, valid_rows=stop - start)  # as the writer will
        scale = max(scale, float(np.abs(c.centred).max()))
        coefficients.append(c)
    original = math.prod(plan.source.shape) * plan.source.dtype.itemsize

    def achieved(step: float) -> float:
        sizes = [len(zstd.encode(encode_coefficients(c, step))) + 4 for c in coefficients]
        return original / (float(np.dot(weights, sizes)) + overhead)

    lo, hi = math.log(scale * 1e-7), math.log(scale * 64)
    finest = achieved(math.exp(lo))
    if finest > ratio * (1 + RATIO_TOLERANCE):
        plan.at_finest_step = True
        plan.note = (f"ratio {ratio:g} asked for, but the finest {plan.settings.precision} quantization already "
                     f"gives about {finest:.3g}: stored at that step")
        return math.exp(lo)
    # with a margin: the estimate counts the metadata before it is written
    if achieved(math.exp(hi)) < ratio * (1 - RATIO_TOLERANCE) * (1 + RATIO_MARGIN):
        small = ""
        if overhead * ratio >= original:  # an HDF5 file's other arrays can still be compressed without it
            advice = "" if plan.source.file.lower().endswith(".npy") else (
                f": copy it with --lossless {plan.source.name} to compress the file's other arrays")
            small = f"; at {original} bytes, its metadata alone (about {overhead} bytes) rules that out{advice}"
        raise DctchopError(f"{plan.name}: ratio {ratio:g} is unreachable (at most about "
                           f"{achieved(math.exp(hi)):.3g} with these settings, metadata included){small}")
    for _ in range(40):
        mid = (lo + hi) / 2
        r = achieved(math.exp(mid))
        if abs(r / ratio - 1) < 0.01:
            return math.exp(mid)
        lo, hi = (mid, hi) if r < ratio else (lo, mid)
    # the ratio jumps between two steps a hair apart (data of few distinct values): the nearer side, if near enough
    (off, step), _ = sorted((abs(achieved(math.exp(s)) / ratio - 1), math.exp(s)) for s in (lo, hi))
    if off > RATIO_TOLERANCE:  # refused before anything is written
        low, high = sorted(achieved(math.exp(s)) for s in (lo, hi))
        raise DctchopError(f"{plan.name}: no step gives ratio {ratio:g} within {RATIO_TOLERANCE:.0%}: between two steps "
                           f"a hair apart it jumps from {low:.4g} to {high:.4g} (data of few distinct values "
                           "compresses in jumps); ask for a ratio outside that gap")
    return step


def _pad_to_chunk(x: np.ndarray, chunks: tuple[int, ...], axes: tuple[int, ...]) -> np.ndarray:
    """Samples padded to a whole chunk along axis 0: with zeros, as Zarr pads an edge chunk, or, when axis
    0 is one of the transformed ``axes``, by repeating the last sample, so the padding adds no edge inside a
    block (readers never see the padding either way). Encode the result with ``valid_rows=len(x)``."""
    if x.shape[0] == chunks[0]:
        return x
    if 0 in axes:
        return np.concatenate([x, np.repeat(x[-1:], chunks[0] - x.shape[0], axis=0)])
    out = np.zeros(chunks, dtype=x.dtype)
    out[: x.shape[0]] = x
    return out


# ---------------------------------------------------------------------------------------------- writing


NAME_MAX = 255  # bytes in one file name (Linux, macOS and Windows file systems)
TEMPORARY_SUFFIX = re.compile(r"\.dctchop-(tmp|old)-(\d+)")  # what _temporary_sibling adds locally; its pid


def _temporary_stem(name: str) -> str:
    """``name`` as its temporaries carry it: whole, or its first 100 bytes and a hash of all of it where
    ``.NAME.dctchop-old-TAG`` would be longer than NAME_MAX (a valid 250-byte output name failed there)."""
    raw = os.fsencode(name)
    if len(raw) + len(".dctchop-old-") + 21 <= NAME_MAX:  # 1 for the dot, 20 for the longest tag (a pid)
        return name
    return os.fsdecode(raw[:100]) + "~" + hashlib.sha256(raw).hexdigest()[:16]


def _temporary_sibling(output: Location, kind: str = "tmp") -> Location:
    """The new store being written (``tmp``) or the old one an --overwrite moves aside (``old``). Local (a path
    or a ``file://`` URL): named by this process's id, so a later run can tell a killed run's leftovers from a
    live one's. Remote: a random name (writers on other hosts share the namespace, and nobody can tell whether
    they live)."""
    tag = str(os.getpid()) if output.local_path is not None else uuid.uuid4().hex[:12]
    return output.sibling(f".{_temporary_stem(output.name)}.dctchop-{kind}-{tag}")


def remove_stale_temporaries(output: Location) -> None:
    """Clean up after a killed run (SIGKILL, power loss): remove the temporaries whose process no longer
    exists, and put back an old store that an --overwrite moved aside but never replaced. A live process's
    files are never touched, nor those of another output (the name is matched as text, not as a pattern:
    ``a?.zarr`` once put back ``ab.zarr``'s old store as its own). Local outputs only: a killed run's
    temporary at a remote URL stays (its name says what it is) because a process on another host cannot be
    checked."""
    path = output.local_path
    if path is None:
        return
    stem = f".{_temporary_stem(path.name)}"
    for tmp in path.parent.glob(f"{glob.escape(stem)}.dctchop-*-*"):
        found = TEMPORARY_SUFFIX.fullmatch(tmp.name[len(stem):])
        if found is None:
            continue
        pid = int(found[2])
        if pid == os.getpid() or _process_alive(pid):
            continue
        if found[1] == "old" and not path.exists():
            with contextlib.suppress(FileNotFoundError, FileExistsError):  # another run put it back (or one) first
                rename_new(tmp, path)  # killed between the two renames of --overwrite: the old store is the output
        else:
            Location(tmp).remove()


def _missing_parents(output: Location) -> list[Path]:
    """The local directories that writing ``output`` will make, deepest first: a ``file://`` URL makes its
    parents, as object stores do (a plain path's parent must exist), and a failed run removes them again."""
    path = output.local_path
    if path is None or not output.is_url:
        return []
    return [p for p in path.resolve().parents if not p.exists()]


def temporary_file(path: Path) -> Path:
    """Where to write the file ``path`` before renaming it into place; first removes the temporaries of
    killed runs, as :func:`compress` does for stores."""
    remove_stale_temporaries(Location(path))
    return _temporary_sibling(Location(path)).path


def discard_temporary_file(tmp: Path) -> None:
    """Remove the :func:`temporary_file` ``tmp`` if it is there, quietly: a read-only directory refuses even to
    unlink what is not there, and that must not hide the error that made the write fail."""
    with contextlib.suppress(OSError):
        tmp.unlink(missing_ok=True)


def _discard_temporary(tmp: Location, made_parents: list[Path]) -> None:
    """Remove the temporary store, then the directories made for it that stayed empty. Zarr writes metadata
    from its own event-loop thread, which may finish a pending write just after an interrupt reached this
    thread, so look again a few times."""
    for _ in range(5):
        with contextlib.suppress(OSError):  # a read-only file system refuses even to unlink what is not there
            tmp.remove()
        time.sleep(0.05)
        if not tmp.exists():
            break
    for parent in made_parents:
        try:
            parent.rmdir()
        except OSError:  # something else was put there meanwhile
            break


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_output(source_path: str, output: Location, overwrite: bool) -> None:
    """Refuse an output that would replace or hold the input, lie inside a Zarr store, or replace a device,
    FIFO or socket, a directory that is not a dctchop store, or (without ``overwrite``) anything at all. A
    local URL (``file://``) names the same files as a path, so it is checked as that path."""
    local = output.local_path
    if local is not None:
        out = local.resolve()
        src = Path(source_path).resolve()
        if out == src or src in out.parents or out in src.parents or _within(src, out):
            raise DctchopError(f"output {output} must not be the input, inside it, or contain it")
        refuse_special_file(local, output)
        holder = store_holding(out)
        if holder is not None:
            raise DctchopError(f"output {output} must not be inside the Zarr store {holder}")
        if not output.is_url and not out.parent.is_dir():  # a file:// URL makes its parents, as object stores
            raise DctchopError(f"output directory {output.path.parent} does not exist")
    if output.is_dir() and not is_dctchop_store(output):  # before the advice to --overwrite, which refuses it too
        raise DctchopError(f"output {output} is a directory that is not a dctchop store; refusing to replace it")
    if output.exists() and not overwrite:
        raise output_exists(output)
    if overwrite and local is not None and local.is_dir() and not local.is_symlink():
        def unlistable(error: OSError) -> None:  # os.walk would skip it, and whatever it holds
            raise DctchopError(f"cannot --overwrite {output}: {error.filename} cannot be listed, so the old store "
                               "could not be removed")

        for directory, _, _ in os.walk(local, onerror=unlistable):
            if not os.access(directory, os.W_OK | os.X_OK):
                raise DctchopError(f"cannot --overwrite {output}: {directory} is not writable, so the old store "
                                   "could not be removed")


def _within(path: Path, directory: Path) -> bool:
    """Whether ``path`` is ``directory`` or lies below it, judged by file identity (device and inode): under a
    bind mount the same directory has another path, and an --overwrite through it deleted the input."""
    try:
        target = os.stat(directory)
    except OSError:  # nothing there yet
        return False
    for p in (path, *path.parents):
        with contextlib.suppress(OSError):
            if os.path.samestat(os.stat(p), target):
                return True
    return False


def is_dctchop_store(location: Location) -> bool:
    """A store whose root zarr.json carries dctchop attributes (what --overwrite may replace)."""
    try:
        meta = json.loads(location.read("zarr.json"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and isinstance(meta.get("attributes", {}).get("dctchop"), dict)


def _chunk_key(name: str, index: int, ndim: int) -> str:
    """Where :data:`CHUNK_KEY_ENCODING` puts chunk ``index`` of an array chunked along axis 0: every chunk file
    directly in the array's directory, so writing one creates no directory (with ``/`` each chunk would
    make two or three: 18 mkdir calls per chunk with its metadata, 13% of the whole run on ext4)."""
    return f"{name}/c." + ".".join([str(index)] + ["0"] * (ndim - 1))


def _stored_bytes(data: bytes, zstd_level: int = ZSTD_LEVEL) -> bytes:
    """What the store's zstd -> crc32c codecs make of the dctchop codec's output: the same bytes Zarr writes
    (zstd frame, then the little-endian crc32c of it), so plain ``zarr.open`` reads the chunk back."""
    compressed = numcodecs.Zstd(level=zstd_level).encode(data)
    return compressed + struct.pack("<I", google_crc32c.value(compressed))


def file_checksum(raw: bytes) -> int:
    """A chunk file's crc32c as the store records it (``checksum``): its trailer, which Zarr's crc32c codec
    checks against the file's own bytes; the record ties the file to its place, which that check cannot."""
    return int.from_bytes(raw[-4:], "little")


def meta_fields(info: dict) -> dict[str, str]:
    """The per-chunk metadata arrays of a store's lossy arrays (``info``: its record): ``checksum`` from store
    format 4 on."""
    if info.get("store_format", 1) >= 4:
        return META_FIELDS
    return {key: dtype for key, dtype in META_FIELDS.items() if key != "checksum"}


def unframe(raw: bytes, most: int | None) -> bytes:
    """Inverse of :func:`_stored_bytes`: check the crc32c trailer, undo zstd; CorruptChunkError if damaged.
    ``most``: the most bytes the chunk can hold (None: bytes this process just encoded), see :func:`oversized_frame`."""
    if len(raw) < 5:
        raise CorruptChunkError(f"chunk file is {len(raw)} bytes (truncated)")
    body, trailer = np.frombuffer(raw, np.uint8, count=len(raw) - 4), raw[-4:]  # a view, not a copy
    if struct.pack("<I", google_crc32c.value(body)) != trailer:
        raise CorruptChunkError("crc32c checksum mismatch (the chunk file is corrupted or truncated)")
    if most is not None and (problem := oversized_frame(raw, most)):
        raise CorruptChunkError(problem)
    try:
        return numcodecs.Zstd().decode(body)
    except RuntimeError as e:
        raise CorruptChunkError(f"zstd cannot decode the chunk ({e})") from None


def oversized_frame(raw: bytes, most: int) -> str | None:
    """Why chunk file ``raw``'s zstd frame cannot be a chunk of at most ``most`` bytes, or None: checked
    before zstd runs, which allocates what the frame says (a file of a few hundred bytes can say gigabytes)."""
    size = zstd_content_size(raw)
    if size is None or size > most:
        return (f"its zstd frame says it holds {'an unknown number of' if size is None else size} bytes, more "
                f"than the {most} a chunk of its array can hold")
    return None


def zstd_content_size(frame: bytes) -> int | None:
    """The content size a zstd frame's header declares (RFC 8878, 3.1.1.1), or None when it declares none
    or is no zstd frame."""
    if len(frame) < 6 or frame[:4] != b"\x28\xb5\x2f\xfd":
        return None
    descriptor = frame[4]
    single_segment = (descriptor >> 5) & 1
    field = (1 if single_segment else 0, 2, 4, 8)[descriptor >> 6]
    start = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[descriptor & 3]  # window byte, dictionary id
    if not field or len(frame) < start + field:
        return None
    return int.from_bytes(frame[start : start + field], "little") + (256 if field == 2 else 0)


LOSSY_CODECS = (DctChopCodec, ZstdCodec, Crc32cCodec)  # a lossy array's codecs, as compress writes them


def codecs_as_written(array: zarr.Array, recorded: dict) -> bool:
    """Whether a lossy array's zarr.json names the codecs compress wrote, the dctchop codec with the
    configuration of the store's record (``recorded``): an edited zarr.json would have Zarr, and readers
    that follow it, decode the chunk files as something else."""
    codecs = tuple(getattr(array.metadata, "codecs", ()))
    return tuple(map(type, codecs)) == LOSSY_CODECS and codecs[0].to_dict()["configuration"] == recorded


def array_problems(root: Location, name: str, info: dict, group: zarr.Group) -> list[dict]:
    """Everything damaged about one stored array, see :func:`check_array`."""
    return check_array(root, name, info, group)[0]


def check_array(root: Location, name: str, info: dict,
                group: zarr.Group) -> tuple[list[dict], dict[str, np.ndarray] | None]:
    """Everything damaged about one stored array (``info``: the store's record), found without decoding: its
    metadata cannot be opened (missing or broken zarr.json, a codec version this dctchop cannot read) or names
    other codecs than the ones written, a chunk file is missing, not a file, fails its crc32c or has a header
    that is undecodable or not of the array's chunks, is not the file written there (its size or crc32c is
    not the one recorded: rewritten, or another chunk's), a per-chunk metadata element is missing, or the
    quality figures disagree with one another or the step with the chunk's header (:func:`_quality_problems`). With it,
    the array's per-chunk metadata (field -> values in chunk order, as :func:`chunk_metadata` reads them), read
    once on the way; None where its arrays or an element are missing or damaged.

    Zarr would silently return the fill value for a missing chunk; a dctchop store always writes every
    chunk, so a missing one is damage. ``chunk`` is None for damage that is not one chunk's.

    ``group``: the store's root group, opened once by callers that check every array. Opening it parses the
    root zarr.json, which holds the store's record of every array: opened again for each array, checking a
    store took time growing with the square of its number of arrays (2000 arrays: minutes).
    """
    entry, fields = info["arrays"][name], meta_fields(info)
    shape, chunks = entry["shape"], entry["chunks"]
    problems = []
    keys = {}  # array path -> data chunk index -> the file holding its data or metadata element
    sizes = {}  # metadata array path -> the size of an element's file (None: several elements, compressed)
    grid = [-(-s // c) for s, c in zip(shape, chunks)]  # the metadata arrays' shape
    for field_name, path in [(None, name), *((k, f"{META_GROUP}/{name}/{k}") for k in fields)]:
        keys[path] = functools.partial(_chunk_key, path, ndim=len(shape))
        try:
            array = open_array(group, root, path)
            # a metadata array's element i is data chunk i's; the data array's grid position i is chunk i
            per_file = 1 if field_name is None else array.chunks[0]
            keys[path] = functools.partial(chunk_file, path, array, per_file)
            if field_name is not None and element_per_file(array):
                sizes[path] = element_dtype(field_name).itemsize
        except Exception as e:  # noqa: BLE001 - zarr raises many types for a damaged array; all are damage
            what = "array metadata" if field_name is None else f"metadata array {field_name}"
            problems.append({"chunk": None, "problem": f"{what} cannot be opened ({type(e).__name__}: {e})"})
            continue
        if field_name is None and (list(array.shape), list(array.chunks)) != (list(shape), list(chunks)):
            problems.append({"chunk": None, "problem": f"array metadata says shape {list(array.shape)} in chunks "
                             f"{list(array.chunks)}, the store's record {list(shape)} in {list(chunks)}"})
        if field_name is None and not codecs_as_written(array, entry["codec"]):
            problems.append({"chunk": None, "problem": "array metadata names other codecs than the dctchop -> "
                             "zstd -> crc32c ones the store's record says were written"})
        want = np.dtype(fields[field_name]) if field_name is not None else None
        if want is not None and (list(array.shape), np.dtype(array.dtype)) != (grid, want):
            problems.append({"chunk": None, "problem": f"metadata array {field_name} is {np.dtype(array.dtype)}"
                             f"{list(array.shape)}, not {want}{grid}"})
    problems += [{"chunk": None, "problem": problem}
                 for path in (META_GROUP, f"{META_GROUP}/{name}") if (problem := node_kind(root, path)[1])]
    metadata_whole = not problems
    on_disk = {}  # chunk -> (size, checksum, step in its header) of its file, for the chunks that decode
    n_chunks, most = -(-shape[0] // chunks[0]), most_coded_bytes(chunks)
    table = {k: np.zeros(n_chunks, META_FIELDS[k]) for k in fields}  # filled from the elements read below
    for i in range(n_chunks):
        try:
            raw = root.read(keys[name](i))
            steps = read_expected_header(unframe(raw, most), chunks, entry["dtype"]).steps
            on_disk[i] = len(raw), file_checksum(raw), float(np.min(steps)) if steps is not None else math.nan
        except FileNotFoundError:
            problems.append({"chunk": i, "problem": "missing (chunk file deleted)"})
        except OSError as e:
            problems.append({"chunk": i, "problem": f"unreadable ({e.strerror or e})"})
        except CorruptChunkError as e:
            problems.append({"chunk": i, "problem": str(e)})
        missing = []
        for k in fields:
            path = f"{META_GROUP}/{name}/{k}"
            element = _read_element(root, keys[path](i), sizes.get(path))
            if element is None:
                missing.append(k)
            elif path in sizes:
                table[k][i] = np.frombuffer(element, element_dtype(k))[0]
        if missing:
            metadata_whole = False
            problems.append({"chunk": i, "problem": f"per-chunk metadata missing or damaged: {', '.join(missing)}"})
    if not metadata_whole:
        return problems, None
    if len(sizes) < len(fields):  # store format 1: elements in chunks of several, compressed
        try:
            table = {k: chunk_metadata(group, name, k) for k in fields}
        except OSError as e:  # unreadable (its permissions): damage, as an unreadable chunk file is
            return problems + [{"chunk": None, "problem": f"per-chunk metadata unreadable ({e.strerror or e})"}], None
        except ValueError as e:  # a file that does not decode
            return problems + [{"chunk": None, "problem": f"per-chunk metadata damaged ({first_line(e)})"}], None
    problems += [{"chunk": i, "problem": problem} for i, (size, checksum, _) in on_disk.items()
                 if (problem := file_not_as_written(size, checksum, {k: table[k][i] for k in FILE_FIELDS if k in fields}))]
    problems += _quality_problems(entry, table, {i: step for i, (*_, step) in on_disk.items()})
    problems.sort(key=lambda p: (p["chunk"] is not None, p["chunk"] or 0))
    return problems, table


def _quality_problems(entry: dict, table: dict[str, np.ndarray], header_steps: dict[int, float]) -> list[dict]:
    """Damage to what the store says of its quality, which no checksum covers (the per-chunk metadata elements
    are bare numbers; the record is JSON): a chunk whose PSNR is not its RMSE's, whose RMSE exceeds its max
    error, or whose step is not the one in its header (``header_steps``: chunk -> that step, for the chunks
    whose file decodes), and a record whose PSNR is not the one of the chunks' RMSEs. Each was printed as fact;
    changes of the max error alone only ``--verify`` sees."""
    peak, problems = float(entry["peak"]), []
    for i, (psnr, rmse, worst) in enumerate(zip(table["psnr"], table["rmse"], table["max_abs_error"])):
        if not _same(psnr, _psnr_of_rmse(rmse, peak)) or not rmse <= worst * (1 + 1e-12):
            problems.append({"chunk": i, "problem": f"per-chunk metadata damaged: PSNR {psnr:.6g} dB, RMSE {rmse:.6g} "
                             f"and max abs error {worst:.6g} do not agree"})
    for i, step in header_steps.items():
        if not _same(table["step"][i], step):
            problems.append({"chunk": i, "problem": f"per-chunk metadata damaged: step {table['step'][i]:.6g}, "
                             f"the chunk's header {step:.6g}"})
    rows = np.array([e - s for s, e in _chunk_ranges(entry["shape"][0], entry["chunks"][0])])  # each chunk's samples
    if rows.size and math.prod(entry["shape"]) and not problems:
        largest = float(np.max(table["rmse"]))  # the squares scaled by it: RMSEs of 1e-160 square to nothing
        scaled = table["rmse"] / largest if largest > 0 else table["rmse"]
        whole = _psnr_of_rmse(largest * math.sqrt(float(np.sum(scaled**2 * rows)) / entry["shape"][0]), peak)
        if not _same(float(entry["psnr"]), whole):
            problems.append({"chunk": None, "problem": f"the store's record says PSNR {float(entry['psnr']):.6g} dB, "
                             f"its per-chunk metadata {whole:.6g} dB"})
    return problems


def _psnr_of_rmse(rmse: float, peak: float) -> float:
    """:func:`dctchop.quantize.psnr` from the RMSE, in logarithms: squared, an RMSE below 1e-154 loses its
    digits to float64's subnormal numbers (the PSNR was measured from the mean square, before its root)."""
    return qz.psnr(1.0, peak) - 20.0 * math.log10(rmse) if rmse > 0 else qz.psnr(0.0, peak)


def _same(a: float, b: float) -> bool:
    """Two float64 figures of one measure, equal but for the order of their sums (or both NaN, or both inf)."""
    return a == b or math.isclose(a, b, rel_tol=1e-9) or (math.isnan(a) and math.isnan(b))


def not_as_written(raw: bytes, recorded: dict) -> str | None:
    """What says that chunk file ``raw`` is not the one written there, or None. ``recorded``: that chunk's
    ``stored_bytes`` (lossy arrays) and ``checksum`` (from store format 4 on), where known."""
    return file_not_as_written(len(raw), file_checksum(raw), recorded)


def file_not_as_written(size: int, checksum: int, recorded: dict) -> str | None:
    """:func:`not_as_written` from the file's size and checksum."""
    if "stored_bytes" in recorded and size != recorded["stored_bytes"]:
        return (f"its file holds {size} bytes, its metadata records {recorded['stored_bytes']}: "
                "rewritten since (by a Zarr write?), so its recorded PSNR and error do not describe it")
    if "checksum" in recorded and checksum != recorded["checksum"]:
        return (f"its file's crc32c is {checksum:08x}, the store recorded {int(recorded['checksum']):08x}: "
                "rewritten since (by a Zarr write?) or another chunk's file, so its samples are not the ones written")
    return None


def element_per_file(array: zarr.Array) -> bool:
    """Whether a per-chunk metadata array holds each element in a file of its own, as plain bytes
    (:func:`element_dtype`), as stores write them now; stores of format 1 chunked and compressed them otherwise."""
    return array.chunks[0] == 1 and not array.compressors


def element_dtype(key: str) -> np.dtype:
    """The dtype of a per-chunk metadata element ``key`` (one of META_FIELDS) in its file: little-endian."""
    return np.dtype(META_FIELDS[key]).newbyteorder("<")


def open_array(group: zarr.Group, root: Location, path: str) -> zarr.Array:
    """``group[path]`` for an array of the store at ``root`` (``group``: its root group), from its zarr.json read
    as a file and parsed once per distinct document. Through Zarr each opening is a round trip through its event
    loop, about 1 ms (inspecting 1,500 arrays took 21-40 s, 7 s to open them), and the metadata arrays of a
    store share a handful of documents. What is no array's document (missing, damaged, a group's) is left to
    Zarr, which says what is wrong with it."""
    try:
        metadata = _array_metadata(root.read(f"{path}/zarr.json"))
    except Exception:  # noqa: BLE001 - Zarr opens it, or raises what is wrong
        return group[path]
    return zarr.Array(zarr.AsyncArray(metadata, store_path=group.store_path / path))


@functools.lru_cache(maxsize=64)
def _array_metadata(document: bytes):
    """An array's metadata from its zarr.json, parsed as Zarr parses it when opening the array (the store path
    only names it in Zarr's errors)."""
    return zarr.AsyncArray(json.loads(document), store_path=StorePath(MemoryStore())).metadata


def chunk_metadata(group: zarr.Group, name: str, key: str) -> np.ndarray:
    """The per-chunk metadata ``key`` (one of META_FIELDS) of lossy array ``name``, in chunk order."""
    return np.asarray(group[f"{META_GROUP}/{name}/{key}"][...]).reshape(-1)


def node_kind(root: Location, path: str) -> tuple[str | None, str | None]:
    """(``"group"`` or ``"array"``, None) for the node at ``path``, or (None, what is wrong with its
    zarr.json). Zarr opens the arrays below a group whose zarr.json is gone, but no longer lists the group
    or its attributes."""
    try:
        meta = json.loads(root.read(f"{path}/zarr.json"))
    except FileNotFoundError:
        return None, f"{path}/zarr.json is missing"
    except (OSError, ValueError) as e:
        return None, f"{path}/zarr.json is unreadable ({first_line(e)})"
    kind = meta.get("node_type") if isinstance(meta, dict) else None
    return (kind, None) if kind in ("group", "array") else (None, f"{path}/zarr.json is not Zarr metadata")


def group_problems(root: Location, info: dict) -> list[dict]:
    """The user groups whose metadata is missing or damaged (a directory below a group is a group or an
    array, each with its zarr.json; the metadata group's are each array's, :func:`array_problems`), the groups
    the store's record (``info``) lists that are gone (store format 4 on: a deleted group went unnoticed, and
    decompress failed on its attributes), and the arrays that the record leaves out: a record edited by hand,
    which readers trust."""
    recorded = set(info["arrays"]) | set(info.get("lossless", []))
    problems = [{"group": path, "problem": problem} for path in info.get("groups", [])
                if not root.exists(path) and (problem := node_kind(root, path)[1])]
    for key, directories, _ in root.walk():
        if key == META_GROUP:
            directories.clear()
            continue
        kind, problem = node_kind(root, key) if key else ("group", None)  # the root: open_store read it
        if problem is not None:
            problems.append({"group": key, "problem": problem})
        elif kind == "array":
            directories.clear()  # chunks, not nodes
            if key not in recorded:
                problems.append({"group": key, "problem": f"array {key} is not in the store's record (the dctchop "
                                                          "attributes of its root zarr.json)"})
    return problems


def _read_element(root: Location, key: str, size: int | None) -> bytes | None:
    """A metadata element's file, of ``size`` bytes when that is known; None when it is missing, unreadable or
    of another size. Of unknown size (a file of several elements, store format 1) it is only looked for, and
    found, ``b""``."""
    if size is None:
        return b"" if root.is_file(key) else None
    try:
        raw = root.read(key)
    except OSError:  # missing, a directory, unreadable
        return None
    return raw if len(raw) == size else None


def lossless_problems(root: Location, info: dict, name: str, group: zarr.Group) -> list[dict]:
    """Everything damaged about a lossless copy, as :func:`array_problems` finds it for a lossy array: its
    metadata cannot be opened or says another shape than the store's record, or a chunk file fails its
    crc32c or zstd, or is not the file written there (store format 4 on). A missing chunk file is damage in
    stores that write every chunk (store format 3 on); before, Zarr left out chunks of fill values, which
    look the same. ``group``: the store's root group, as for :func:`array_problems`."""
    try:
        copy = LosslessCopy(open_array(group, root, name), info, name)
    except Exception as e:  # noqa: BLE001 - zarr raises many types for a damaged array; all are damage
        return [{"chunk": None, "problem": f"array metadata cannot be opened ({type(e).__name__}: {e})"}]
    checks = lossless_checks(info, name)
    if mismatch := not_as_recorded(copy, checks):
        return [{"chunk": None, "problem": mismatch}]
    problems = []
    size = math.prod(copy.array.chunks) * np.dtype(copy.array.dtype).itemsize  # Zarr writes edge chunks whole
    for i in range(copy.n_chunks):
        try:
            raw = root.read(copy.chunk_file(i))
            if len(unframe(raw, size)) != size:
                problems.append({"chunk": i, "problem": f"decodes to the wrong size (not {size} bytes)"})
            elif checks is not None and (problem := not_as_written(raw, {"checksum": checks["checksums"][i]})):
                problems.append({"chunk": i, "problem": problem})
        except FileNotFoundError:
            if every_chunk_written(info):
                problems.append({"chunk": i, "problem": "missing (chunk file deleted)"})
        except OSError as e:
            problems.append({"chunk": i, "problem": f"unreadable ({e.strerror or e})"})
        except CorruptChunkError as e:
            problems.append({"chunk": i, "problem": str(e)})
    return problems


def lossless_checks(info: dict, name: str) -> dict | None:
    """What a store (its record ``info``) recorded of lossless copy ``name`` to check it against: its
    ``shape`` and each chunk file's ``checksums`` (store format 4 on; None before)."""
    return info.get("lossless_checks", {}).get(name)


def not_as_recorded(copy: LosslessCopy, checks: dict | None) -> str | None:
    """How a lossless copy's Zarr metadata differs from what the store recorded of it (``checks``, see
    :func:`lossless_checks`): resized since, say; or None."""
    if checks is None or (list(copy.shape), copy.n_chunks) == (checks["shape"], len(checks["checksums"])):
        return None
    return (f"array metadata says shape {list(copy.shape)} in {copy.n_chunks} chunk files, the store's record "
            f"{checks['shape']} in {len(checks['checksums'])}")


def every_chunk_written(info: dict) -> bool:
    """Whether a store (its record ``info``) writes every chunk of its lossless copies: format 3 on."""
    return info.get("store_format", 1) >= 3


def chunk_file(path: str, array: zarr.Array, per_file: int, index: int) -> str:
    """The file of ``array`` (at ``path``) holding item ``index`` along axis 0, ``per_file`` items to a file,
    by the array's own chunk key encoding (stores of format 1 wrote metadata arrays in other chunkings)."""
    return f"{path}/" + array.metadata.encode_chunk_key((index // per_file,) + (0,) * (array.ndim - 1))


def _chunk_metrics(x: np.ndarray, y: np.ndarray, peak: float) -> tuple[float, float, float]:
    """(PSNR, max abs error, RMSE) of a decoded chunk."""
    sse, worst = qz.error_stats(x, y)
    psnr, rmse = _psnr_rmse(sse, x.size, peak)
    return psnr, worst, rmse


def _psnr_rmse(sse: float, n: int, peak: float) -> tuple[float, float]:
    """(PSNR, RMSE) of ``n`` values with squared error ``sse``."""
    mse = sse / n if n else 0.0
    return qz.psnr(mse, peak), math.sqrt(mse)


def array_bytes(root: Location, name: str) -> int:
    """Everything on disk for lossy array ``name``: its files and its per-chunk metadata arrays' files."""
    return root.size(name) + root.size(f"{META_GROUP}/{name}")


def _metadata_bytes(root: Location, plan: ArrayPlan) -> int:
    """Bytes an array's store takes besides its chunk files: its zarr.json, the metadata arrays' zarr.json
    files, and one element file per chunk and metadata field."""
    n_chunks = len(_chunk_ranges(plan.source.shape[0], plan.chunks[0]))
    element_bytes = sum(np.dtype(d).itemsize for d in META_FIELDS.values())
    return array_bytes(root, plan.name) + n_chunks * element_bytes


def _array_document(**create: object) -> bytes:
    """The zarr.json Zarr writes for an array made with ``zarr.create_array(**create)``, made in memory: made
    in the store, each array cost a round trip through Zarr's event loop per file it looks at (3.4 ms, seven
    arrays per lossy array), where the file is one of many written together (:func:`_tree_documents`)."""
    documents: dict = {}
    zarr.create_array(MemoryStore(documents), zarr_format=3, **create)
    return documents["zarr.json"].to_bytes()


def _group_document(attributes: dict) -> bytes:
    """The zarr.json Zarr writes for a group with ``attributes``, made in memory (see :func:`_array_document`)."""
    documents: dict = {}
    zarr.open_group(MemoryStore(documents), mode="w", zarr_format=3, attributes=attributes)
    return documents["zarr.json"].to_bytes()


@functools.cache
def _empty_group_document() -> bytes:
    return _group_document({})


def _data_array_document(plan: ArrayPlan) -> bytes:
    """A lossy array's zarr.json: its chunks are written by :func:`_write_encoded`."""
    src = plan.source
    return _array_document(shape=src.shape, chunks=plan.chunks, dtype=src.dtype, serializer=plan.codec,
                           chunk_key_encoding=CHUNK_KEY_ENCODING,
                           compressors=[ZstdCodec(level=plan.zstd_level), Crc32cCodec()], fill_value=0,
                           attributes=src.attrs)


@functools.lru_cache(maxsize=64)
def _metadata_array_document(grid: tuple[int, ...], dtype: str) -> bytes:
    """A per-chunk metadata array's zarr.json: one element per data chunk stored as plain little-endian
    bytes, so each task writes its own elements. The same for every array of one chunk grid."""
    return _array_document(shape=grid, chunks=(1,) * len(grid), dtype=dtype, compressors=None,
                           chunk_key_encoding=CHUNK_KEY_ENCODING, serializer=BytesCodec(endian="little"),
                           fill_value=0)


def _tree_documents(source: Source, plans: list[ArrayPlan]) -> dict[str, bytes]:
    """The zarr.json of every group below the root and every lossy array with its metadata arrays, as Zarr
    writes them: the source's groups with their attributes, the groups that only hold nodes (those of
    :data:`META_GROUP` among them) with none. Each group is visited once however deep it lies: Zarr, creating
    a group or array, looked at every group above it (a chain of 200 nested groups took 12 s)."""
    documents = {}
    for plan in plans:
        documents[f"{plan.name}/zarr.json"] = _data_array_document(plan)
        grid = tuple(-(-s // c) for s, c in zip(plan.source.shape, plan.chunks))
        for key, dtype in META_FIELDS.items():
            documents[f"{META_GROUP}/{plan.name}/{key}/zarr.json"] = _metadata_array_document(grid, dtype)
    groups = {path.strip("/"): attrs for path, attrs in source.groups.items() if path.strip("/")}
    for node in [*groups, *(key.removesuffix("/zarr.json") for key in documents)]:
        parent = posixpath.dirname(node)
        while parent and parent not in groups:  # a group found has its parents already, or will have them
            groups[parent] = {}
            parent = posixpath.dirname(parent)
    for path, attrs in groups.items():
        documents[f"{path}/zarr.json"] = _group_document(attrs) if attrs else _empty_group_document()
    return documents


def _read_and_encode(plan: ArrayPlan, i: int, start: int, stop: int) -> tuple[bytes, dict]:
    """Encode chunk ``i`` (samples ``[start, stop)``): the codec's bytes and the chunk's metadata but its
    stored size and checksum. The metrics are measured on a decode of exactly these bytes."""
    x = plan.source.read(start, stop)
    chunk = _pad_to_chunk(x, plan.chunks, plan.axes)
    try:
        data, sse, max_err = encode_and_measure(chunk, plan.settings, valid_rows=stop - start)
    except DctchopError as e:  # the codec knows the values, not whose they are
        raise DctchopError(f"{plan.name}: chunk {i}: {e}") from None
    if not (math.isfinite(sse) and math.isfinite(max_err)):  # a chunk that would not decode: never written
        raise DctchopError(f"{plan.name}: chunk {i} does not survive the arithmetic of {plan.settings.precision} "
                           f"(its decoded error is {max_err}); try --precision float32 or scale the data")
    psnr, rmse = _psnr_rmse(sse, x.size, plan.peak)
    target = plan.settings.target_psnr
    if target is not None and psnr < target:  # the promise: every chunk at least the target
        mask = " and the triangle mask" if plan.settings.mask == "triangle" else ""
        raise DctchopError(f"{plan.name}: --psnr {target:g} is above what this data allows with "
                           f"{plan.settings.precision}{mask} (chunk {i} reaches {psnr:.2f} dB); ask for less")
    steps = read_header(data).steps
    return data, {"chunk": i, "nbytes": x.nbytes, "sse": rmse * rmse * x.size, "psnr": psnr,
                  "max_abs_error": max_err, "rmse": rmse,
                  "step": float(np.min(steps)) if steps is not None else math.nan}


def _write_encoded(root: Location, plan: ArrayPlan, data: bytes, result: dict) -> dict:
    """Write an encoded chunk (after zstd and crc32c) and its metadata elements, each file whole; return
    the chunk's metadata with its stored size and checksum."""
    stored = _stored_bytes(data, plan.zstd_level)
    result = {**result, "stored_bytes": len(stored), "checksum": file_checksum(stored)}
    i, ndim = result["chunk"], len(plan.source.shape)
    files = {_chunk_key(plan.name, i, ndim): stored}
    for key in META_FIELDS:
        element = np.asarray(result[key], dtype=element_dtype(key)).tobytes()
        files[_chunk_key(f"{META_GROUP}/{plan.name}/{key}", i, ndim)] = element
    root.write_files(files)
    return result


def encode_chunks_task(plan: ArrayPlan, root: Location, chunks: list[tuple[int, int, int]]) -> list[dict]:
    """Encode and write a run of ``(index, start, stop)`` chunks: one Dask task per ~64 MB of input, so a
    terabyte makes about 16,000 tasks rather than 250,000 (and the plan is sent once per task).
    Module-level and self-contained so it runs in any process; the spans its reads keep are dropped at its
    end in a worker process, at the compress's end on local threads."""
    with keep_spans():
        return [_write_encoded(root, plan, *_read_and_encode(plan, *chunk)) for chunk in chunks]


def _flatten(batches: Iterator[list]) -> Iterator:
    """The items of each batch as the batches arrive; closing it closes the batch source."""
    try:
        for batch in batches:
            yield from batch
    finally:
        batches.close()


def _write_lossy(root: Location, plan: ArrayPlan, workers: int, pools: tuple[Executor, Executor] | None,
                 run_tasks: Callable | None, progress: Callable[[int], None]) -> dict:
    """Encode every chunk (the arrays exist already) on local threads (``pools``, see :func:`_thread_pools`),
    or on Dask through ``run_tasks`` (:func:`dctchop.dask_runner.task_runner`), and write its files."""
    ranges = _chunk_ranges(plan.source.shape[0], plan.chunks[0])
    items = [(i, s, e) for i, (s, e) in enumerate(ranges)]
    meta = {k: np.zeros(len(ranges), dtype=v) for k, v in META_FIELDS.items()}
    sse = []  # summed exactly (math.fsum): the chunks finish in any order, and the store must not depend on it
    if run_tasks is None:
        results = _encode_and_write(root, plan, items, workers, pools)
    else:
        per_task = max(1, DASK_TASK_BYTES // (math.prod(plan.chunks) * plan.source.dtype.itemsize))
        runs = [(plan, root.absolute(), items[i : i + per_task]) for i in range(0, len(items), per_task)]
        results = _flatten(run_tasks(encode_chunks_task, runs))
    try:
        for r in results:
            for key in META_FIELDS:
                meta[key][r["chunk"]] = r[key]
            sse.append(r["sse"])
            progress(r["nbytes"])
    finally:
        results.close()  # on an error or Ctrl-C: stop the workers before the caller removes the store
    return {"sse": math.fsum(sse), "meta": meta}


@contextlib.contextmanager
def _thread_pools(workers: int) -> Iterator[tuple[ThreadPoolExecutor, ThreadPoolExecutor]]:
    """``workers`` threads that encode chunks and as many that zstd, checksum and write them
    (:func:`_encode_and_write`), for every array of a store: started for each array, their threads took a
    third of compressing 1,500 small arrays. Leaving waits for the tasks that are running."""
    with (ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dctchop-encode") as encoders,
          ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dctchop-write") as writers):
        yield encoders, writers


def _encode_and_write(root: Location, plan: ArrayPlan, items: list[tuple[int, int, int]], workers: int,
                      pools: tuple[Executor, Executor]) -> Iterator[dict]:
    """Encode the chunks on ``workers`` threads while ``workers`` other threads zstd, checksum and write the
    encoded ones (:func:`_write_encoded`; ``pools``: the two, :func:`_thread_pools`): with one worker the
    second core does that part, and file creation, a quarter of the run on some file systems, overlaps the
    encoding. Yield each chunk's metadata once its files are written. Memory stays bounded: at most
    ``3 * workers`` chunks are in flight, and of those only the ``workers`` being encoded hold their input;
    the rest hold nothing yet or their encoded bytes. On an error or when closed, the chunks not begun are
    cancelled."""
    encoders, writers = pools

    def write(encoded) -> dict:
        return _write_encoded(root, plan, *encoded.result())

    pending = {}  # write future -> its encode future

    def finished(in_flight: int) -> Iterator[dict]:
        """The metadata of finished chunks, until at most ``in_flight`` chunks are left in flight."""
        while len(pending) > in_flight:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                del pending[f]
                yield f.result()

    try:
        for item in items:
            yield from finished(3 * workers - 1)
            encoded = encoders.submit(_read_and_encode, plan, *item)
            pending[writers.submit(write, encoded)] = encoded
        yield from finished(0)
    except BaseException:
        for written, encoded in pending.items():
            encoded.cancel()
            written.cancel()
        raise


def _write_lossless(root: Location, group: zarr.Group, source: Source, array: SourceArray, zstd_level: int,
                    progress: Callable[[int], None]) -> dict:
    """A bit-exact copy in chunks of about 4 MB along axis 0, every chunk written; records (structured and
    opaque dtypes) as their bytes, see :class:`LosslessCopy`. Returns what the store records to check it
    against (:func:`lossless_checks`)."""
    name = array_name(source, array)
    sample_bytes = max(math.prod(array.shape[1:]) * array.dtype.itemsize, 1)
    chunk0 = max(1, min(array.shape[0] if array.shape else 1, DEFAULT_CHUNK_BYTES // sample_bytes))
    chunks = (chunk0, *(max(n, 1) for n in array.shape[1:])) if array.shape else ()  # zarr >= 3.2: no 0
    as_bytes = stored_as_bytes(array.dtype)
    tail = (array.dtype.itemsize,) if as_bytes else ()
    arr = group.create_array(name, shape=(*array.shape, *tail), chunks=(*chunks, *tail),
                             dtype=np.uint8 if as_bytes else array.dtype,
                             compressors=[ZstdCodec(level=zstd_level), Crc32cCodec()], fill_value=0,
                             attributes=array.attrs, config={"write_empty_chunks": True})

    def as_stored(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x).view(np.uint8).reshape(*x.shape, *tail) if as_bytes else x

    if array.shape:
        for s, e in _chunk_ranges(array.shape[0], chunk0):
            x = array.read(s, e)
            arr[s:e] = as_stored(x)
            progress(x.nbytes)
    else:
        arr[...] = as_stored(array.read(0, 1))
    copy = LosslessCopy(arr, {"stored_as_bytes": {name: np.lib.format.dtype_to_descr(array.dtype)}} if as_bytes
                        else {}, name)
    return {"shape": list(array.shape), "checksums": [file_checksum(root.read(copy.chunk_file(i)))
                                                      for i in range(copy.n_chunks)]}


def stored_as_bytes(dtype: np.dtype) -> bool:
    """Whether a lossless copy of ``dtype`` is stored as its bytes (see :class:`LosslessCopy`): records
    (structured and opaque dtypes) and extended precision (float128, complex256)."""
    return dtype.kind == "V" or (dtype.kind == "f" and dtype.itemsize > 8) or (dtype.kind == "c" and dtype.itemsize > 16)


class LosslessCopy:
    """A store's lossless copy as its source had it. Records (structured and opaque dtypes: HDF5 compound and
    opaque data) and extended-precision floats are stored as their bytes, uint8 with a trailing axis of the
    item size, their dtype in the store's record (``stored_as_bytes``): Zarr versions disagree on how to
    store structs (a zarr 3.4 store of them did not open in zarr 3.1), and Zarr has no type for opaque data,
    float128 or complex256."""

    def __init__(self, array: zarr.Array, info: dict, name: str) -> None:
        self.array, self.name = array, name
        descr = info.get("stored_as_bytes", {}).get(name)
        self.records = descr is not None
        self.dtype = np.lib.format.descr_to_dtype(descr) if self.records else np.dtype(self.array.dtype)
        cut = -1 if self.records else None
        self.shape, self.chunks = tuple(self.array.shape[:cut]), tuple(self.array.chunks[:cut])
        self.ndim, self.nbytes = len(self.shape), math.prod(self.shape) * self.dtype.itemsize
        self.attrs = self.array.attrs
        # the chunk files there are: an empty copy has none, even with an axis 0
        self.n_chunks = 0 if not self.nbytes else -(-self.shape[0] // self.chunks[0]) if self.ndim else 1

    def __getitem__(self, key) -> np.ndarray:
        """Samples ``key`` along axis 0 (a slice, or ``...``)."""
        x = np.asarray(self.array[key])
        return np.ascontiguousarray(x).view(self.dtype)[..., 0] if self.records else x

    def chunk_file(self, index: int) -> str:
        """The file of Zarr chunk ``index`` along axis 0, the only chunked axis (0 for a scalar)."""
        ndim = self.array.ndim  # one more than the copy's when stored as bytes
        return f"{self.name}/" + self.array.metadata.encode_chunk_key((index,) + (0,) * (ndim - 1) if ndim else ())


def compress(source: Source, output: str | os.PathLike, options: CompressOptions = CompressOptions(),
             overwrite: bool = False, progress: Callable[[int], None] = lambda n: None,
             plans: list[ArrayPlan] | None = None) -> dict:
    """Compress ``source`` into a new store at ``output``; return the summary (also stored in the attrs).

    The store is written to a temporary sibling and renamed into place only when complete: an error or
    interruption leaves ``output`` as it was (absent, or the old store with ``overwrite``).
    """
    if not isinstance(source, Source) or not isinstance(options, CompressOptions):  # a path, a dict: AttributeErrors
        raise DctchopError("compress takes a dctchop.formats.open_source(path) and a CompressOptions, got "
                           f"{type(source).__name__} and {type(options).__name__}")
    output = Location(output)
    _check_output(source.path, output, overwrite)
    if options.scheduler not in (None, "threads") and output.in_process:
        raise DctchopError(f"{output} is in this process's memory, out of reach of --scheduler "
                           f"{options.scheduler}'s workers; use --scheduler threads")
    for array in source.arrays:
        name = array_name(source, array)
        if name == META_GROUP or name.startswith(f"{META_GROUP}/"):
            raise DctchopError(f"{source.path}: dataset /{name} would take the place of the store's metadata group "
                               f"{META_GROUP}; name the datasets to keep with --dataset/--lossless to leave it out")
    plans = plans if plans is not None else [plan_array(source, a, options) for a in source.lossy]
    if not plans:
        why = (f"every array is copied losslessly: {', '.join(array_name(source, a) for a in source.lossless)}"
               if source.lossless else "no numeric array with 2 or more dimensions")
        how = "leave out --lossless to compress it" if source.kind == "npy" else "name one with --dataset"
        raise DctchopError(f"{source.path}: nothing to compress lossily ({why}); {how}")
    align_chunks(plans)
    workers = resolve_threads(options.workers)
    remove_stale_temporaries(output)
    made_parents = _missing_parents(output)
    tmp = _temporary_sibling(output)
    try:
        tmp.remove()
        summary = _write_store(tmp, source, plans, options, workers, progress)
        replaced = _put_in_place(tmp, output, overwrite)
    except OSError as e:
        _discard_temporary(tmp, made_parents)
        where = f" ({e.filename})" if e.filename else ""
        raise DctchopError(f"compress failed: {e.strerror or e}{where}; {output} was not written") from None
    except BaseException:
        _discard_temporary(tmp, made_parents)
        raise
    if replaced is not None:
        try:
            _remove_replaced(replaced, output)
        except BaseException as e:  # Ctrl-C, SIGTERM: the new store is in place, so say so
            if not isinstance(e, DctchopError):
                e.add_note(f"{output} was written; the store it replaced is left at {replaced}, which the next "
                           f"run writing {output.name} removes")
            raise
    return summary


def _put_in_place(tmp: Location, output: Location, overwrite: bool) -> Location | None:
    """Move the finished store from ``tmp`` to ``output``; return where the store it replaced is now (None
    when there was none). With --overwrite, a local output and the new store swap places in one atomic step
    where the system allows (Linux), so a reader never finds the output missing; elsewhere the old store is
    moved aside first, and put back if the new one cannot follow."""
    if not (overwrite and output.exists()):
        tmp.rename(output)
        return None
    if output.local_path is not None and exchange(tmp.local_path, output.local_path):
        return tmp  # which now holds the old store
    old = _temporary_sibling(output, "old")
    output.rename(old)
    try:
        tmp.rename(output)
    except BaseException:
        with contextlib.suppress(OSError):  # nothing to put back if another run has filled the place
            old.rename(output)
        raise
    return old


def _remove_replaced(old: Location, output: Location) -> None:
    """Remove the store an --overwrite replaced, or say that it stays: left unsaid, a directory in it that was
    not writable kept the whole old store hidden beside the new one."""
    try:
        old.remove(check=True)
    except OSError as e:
        raise DctchopError(f"{output} was written, but the store it replaced could not be removed from {old}: "
                           f"{e.strerror or e} ({e.filename}); remove it by hand") from None


def _write_store(tmp: Location, source: Source, plans: list[ArrayPlan], options: CompressOptions, workers: int,
                 progress: Callable[[int], None]) -> dict:
    """Write the whole store at ``tmp`` and return its summary. The local threads and a Dask pool or cluster
    connection serve every array and are let go before this returns, so no worker still writes when the
    caller moves or removes ``tmp``. The spans of HDF5 chunks the reads keep serve the whole run (a --ratio
    search's for the writing after it) and are dropped when it ends."""
    started = time.perf_counter()
    runner = task_runner(options.scheduler, workers) if options.scheduler else contextlib.nullcontext()
    with keep_spans(), runner as run_tasks, _thread_pools(workers) as pools:
        group = tmp.open_group("w", zarr_format=3)
        for plan in plans:
            if qz.fixed_peak(plan.source.dtype) is None:
                scan_values(plan, pools[0])  # the peak, which the codec configuration names
        tmp.write_files(_tree_documents(source, plans))
        overheads = {}
        for plan in plans:  # every search before any chunk is written: a target out of reach fails at once
            if plan.target.kind == "ratio":
                overheads[plan.name] = _metadata_bytes(tmp, plan)
                _set_ratio_step(tmp, plan, workers, overheads[plan.name])
        arrays = {}
        for plan in plans:
            result = _write_lossy(tmp, plan, workers, pools, run_tasks, progress)
            arrays[plan.name] = _array_summary(plan, result, tmp)
            if _resample_ratio(plan, arrays[plan.name]["ratio"]):
                missed = arrays[plan.name]["ratio"]
                by_size = _ratio_sample(plan, result["meta"]["stored_bytes"])
                plan.at_finest_step, plan.note = False, None  # the first search's verdict, on its sample
                _set_ratio_step(tmp, plan, workers, overheads[plan.name], by_size)
                result = _write_lossy(tmp, plan, workers, pools, run_tasks, lambda n: None)
                plan.note = plan.note or (f"the step searched on chunks spread along the array gave ratio "
                                          f"{missed:.4g}: searched again on chunks picked by their stored size, "
                                          "and the array written again")
                arrays[plan.name] = _array_summary(plan, result, tmp)
            _check_ratio(plan, arrays[plan.name]["ratio"])
        checks = {array_name(source, array): _write_lossless(tmp, group, source, array, options.zstd_level, progress)
                  for array in source.lossless}
        seconds = time.perf_counter() - started
        summary = _store_summary(source, arrays, checks, seconds)
        group.attrs.update({**source.groups.get("/", {}), "dctchop": json_safe(summary)})
    return summary


def _set_ratio_step(root: Location, plan: ArrayPlan, workers: int, overhead: int,
                    sample: tuple[list[tuple[int, int]], np.ndarray] | None = None) -> None:
    """Search the step for the plan's --ratio (:func:`search_ratio_step`) and name it in the codec."""
    step = search_ratio_step(plan, float(plan.target.value), workers, overhead, sample)
    plan.settings = replace(plan.settings, step=step)
    root.write_files({f"{plan.name}/zarr.json": _data_array_document(plan)})  # the codec configuration names it


def _misses_ratio(plan: ArrayPlan, achieved: float) -> bool:
    """Whether an array as written breaks its --ratio promise. A ratio above the target at the finest step
    promises nothing; one below it, when the search found the finest step too fine on a sample (zeros among
    noise the sample left out: --ratio 4 stored at 1.44), is a miss like any other."""
    if plan.target.kind != "ratio":
        return False
    off = achieved / float(plan.target.value) - 1
    return abs(off) > RATIO_TOLERANCE and not (plan.at_finest_step and off > 0)


def _resample_ratio(plan: ArrayPlan, achieved: float) -> bool:
    """Whether a --ratio array as written misses its target for want of a representative sample: the search
    measured only some chunks, and the others compress differently (noise among smooth data, say). The
    sizes of every chunk are known then, so a second search can pick chunks that represent them all."""
    n_chunks = len(_chunk_ranges(plan.source.shape[0], plan.chunks[0]))
    return _misses_ratio(plan, achieved) and len(_ratio_sample(plan)[0]) < n_chunks


def _check_ratio(plan: ArrayPlan, achieved: float) -> None:
    """The --ratio promise, checked on the store as written: the search worked on a sample and an estimate of
    the metadata, so the whole array may come out differently."""
    if _misses_ratio(plan, achieved):
        raise DctchopError(f"{plan.name}: --ratio {float(plan.target.value):g} came out at {achieved:.4g}, more "
                           f"than {RATIO_TOLERANCE:.0%} off (the data is not like the chunks the search sampled); "
                           "nothing was written")


def _array_summary(plan: ArrayPlan, result: dict, root: Location) -> dict:
    meta = result["meta"]
    src = plan.source
    original = math.prod(src.shape) * src.dtype.itemsize
    stored = array_bytes(root, plan.name)
    mse = result["sse"] / math.prod(src.shape)
    return {
        "shape": list(src.shape),
        "dtype": str(src.dtype),
        "source": src.name,
        "layout": plan.layout,
        "axes": list(plan.axes),
        "chunks": list(plan.chunks),
        "target": {"kind": plan.target.kind, "value": _jsonable(plan.target.value)},
        "codec": plan.codec.to_dict()["configuration"],
        "zstd_level": plan.zstd_level,
        "peak": plan.peak,
        "original_bytes": original,
        "stored_bytes": stored,
        "ratio": original / stored,
        "psnr": qz.psnr(mse, plan.peak),
        "psnr_min": float(np.min(meta["psnr"])),
        "psnr_mean": float(np.mean(meta["psnr"])),
        "psnr_max": float(np.max(meta["psnr"])),
        "max_abs_error": float(np.max(meta["max_abs_error"])),
        "rmse": math.sqrt(mse),
        **({"note": "; ".join(notes)} if (notes := [n for n in (plan.note, _small_files_note(plan, meta, stored)) if n])
           else {}),
    }


def _small_files_note(plan: ArrayPlan, meta: dict, stored: int) -> str | None:
    """Each chunk is a file of its own and one more per metadata field, and a file system stores each in whole
    blocks: chunks of a few samples (``--chunk-samples 1``: 7 files of 100 B or so per 32x32 image) take many
    times their bytes on disk. Said when the blocks would hold more than twice the stored bytes."""
    chunk_files = np.asarray(meta["stored_bytes"], dtype=np.int64)
    blocks = np.sum(-(-chunk_files // FILE_SYSTEM_BLOCK)) + chunk_files.size * len(META_FIELDS)
    on_disk = int(blocks) * FILE_SYSTEM_BLOCK
    if chunk_files.size < 2 or on_disk <= 2 * stored:
        return None
    n_files = chunk_files.size * (1 + len(META_FIELDS))
    return (f"{chunk_files.size:,} chunks of {plan.chunks[0]} sample{'s' if plan.chunks[0] > 1 else ''} are {n_files:,} files of {stored / n_files:,.0f} B "
            f"on average (each chunk and its {len(META_FIELDS)} metadata fields): in {FILE_SYSTEM_BLOCK // 1024} KB "
            f"file-system blocks about {on_disk / 1e6:.3g} MB on disk; a larger --chunk-samples makes fewer files "
            f"(default: about {DEFAULT_CHUNK_BYTES >> 20} MB of input per chunk)")


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value


def _store_summary(source: Source, arrays: dict, lossless_checks: dict, seconds: float) -> dict:
    lossy = sum(a["original_bytes"] for a in arrays.values())
    original = lossy + sum(math.prod(a.shape) * a.dtype.itemsize for a in source.lossless)  # as inspect counts
    records = {array_name(source, a): np.lib.format.dtype_to_descr(a.dtype) for a in source.lossless
               if stored_as_bytes(a.dtype)}  # the dtypes of copies stored as bytes (LosslessCopy)
    return {
        "store_format": STORE_FORMAT,
        "version": __version__,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "source": {"path": absolute_path(source.path), "kind": source.kind,
                   "follow_external": source.follow_external},
        "arrays": arrays,
        "lossless": [array_name(source, a) for a in source.lossless],
        **({"lossless_checks": lossless_checks} if lossless_checks else {}),
        **({"stored_as_bytes": records} if records else {}),
        **({"groups": groups} if (groups := sorted(p.strip("/") for p in source.groups if p.strip("/"))) else {}),
        **({"attr_dtypes": source.attr_dtypes} if source.attr_dtypes else {}),
        **({"enums": {name.strip("/"): labels for name, labels in source.enums.items()}} if source.enums else {}),
        **({"links": [{"path": path, "target": target, "kind": kind} for path, target, kind in source.links]}
           if source.links else {}),
        "totals": {
            "original_bytes": original,
            "lossy_original_bytes": lossy,
            "lossy_stored_bytes": sum(a["stored_bytes"] for a in arrays.values()),
            "seconds": seconds,
            "mb_per_s": original / 1e6 / seconds if seconds > 0 else math.inf,
        },
    }


def json_safe(obj):
    """Summary -> plain JSON types, non-finite floats as the strings "inf", "-inf", "nan" (JSON has no
    literal for them)."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else str(float(obj))
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    return str(obj)
