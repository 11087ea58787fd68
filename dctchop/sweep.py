"""``dctchop sweep``: compress a sample of one array at a grid of settings and compare rate and distortion.

Everything runs in-process on a sample of the array:

* **Sample.** When axis 0 is the sample axis (not transformed): ``sample`` samples evenly spaced over the
  array (first and last included), so sorted datasets are represented. When axis 0 is transformed (a
  ``ZYX`` field): ``sample`` contiguous planes from the middle of axis 0, since the transform needs them
  adjacent. Default :data:`DEFAULT_SAMPLE` samples, fewer when that would exceed
  :data:`DEFAULT_SAMPLE_BYTES`; all of them when the array has fewer.
* **Settings** (:func:`settings_grid`): the paper's chop, ``--keep 2,4,6,8`` x ``--mask square|triangle``
  x ``--precision float16|bfloat16`` with block 8; PSNR targets ``--psnr 30..50`` (integer data) or
  ``40..80`` (floating-point data) x ``--precision int8|int16`` with block 8; and blocks 4 and 16 at the
  middle PSNR target with int16.
* **Measurements**, per setting: the sample is cut into the chunks the store would use and each chunk is
  encoded exactly as :func:`dctchop.store.compress` does (``encode_chunk`` -> zstd -> 4-byte crc32c), so
  *ratio* = sample bytes / stored chunk bytes (the store adds about 4 KB of metadata per array, which shows in
  the ratio of arrays of a few MB or less); *PSNR* = ``20 log10(peak) - 10 log10(MSE)`` over the decoded
  sample with peak = 255 for uint8 and max - min **of the sample** for other data (the store uses the whole
  array's, which is at least as large, so the sweep is conservative); *decode
  MB/s* = sample bytes / the single-thread time to check the crc32c, undo zstd and ``decode_chunk`` (what Zarr
  does per chunk; best of up to three runs).
* **Pareto front**: the settings no other setting beats on both ratio and PSNR. A PSNR target the
  precision cannot reach on the sample (``dctchop compress`` would refuse it) is reported but never on the
  front nor recommended.
* **Recommendation** (:func:`recommend`): for a target ratio R, the best PSNR among the settings with ratio
  >= R within 5%; for a target PSNR D, the highest ratio among those with PSNR >= D; as the
  ``dctchop compress`` command line that reproduces the setting, with ``--lossless`` for the file's other
  arrays that compress would refuse to transform with it (:func:`refused_arrays`).
"""

from __future__ import annotations

import itertools
import math
import os
import shlex
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from dctchop import quantize as qz
from dctchop.codec import DTYPE_CODES, ChunkSettings, check_dtype, decode_chunk, encode_chunk
from dctchop.errors import DctchopError
from dctchop.formats import SourceArray, open_source
from dctchop.formats.hdf5 import keep_spans
from dctchop.layout import check_axes, infer_axes, parse_axes
from dctchop.store import (
    RATIO_TOLERANCE,
    CompressOptions,
    Target,
    _chunks,
    _pad_to_chunk,
    _stored_bytes,
    array_name,
    check_target,
    default_target,
    plan_array,
    unframe,
)
from dctchop.transform import forget_plans, resolve_threads

DEFAULT_SAMPLE = 256
DEFAULT_SAMPLE_BYTES = 32 << 20
KEEPS = (2, 4, 6, 8)
MASKS = ("square", "triangle")
CHOP_PRECISIONS = ("float16", "bfloat16")
INT_PRECISIONS = ("int8", "int16")
PSNR_TARGETS_INTEGER = (30.0, 35.0, 40.0, 45.0, 50.0)
PSNR_TARGETS_FLOAT = (40.0, 50.0, 60.0, 70.0, 80.0)
BLOCK = 8
BLOCK_SWEEP = (4, 16)
DECODE_REPEATS = 3
DECODE_MIN_SECONDS = 0.05


@dataclass(frozen=True)
class Setting:
    """One point of the grid: the chop (``keep``) or a PSNR target (``psnr``), as ``dctchop compress``
    options."""

    family: str  # "keep", "psnr" or "block"
    block: int
    precision: str
    keep: int | None = None
    mask: str = "square"
    psnr: float | None = None

    @property
    def options(self) -> list[str]:
        """The ``dctchop compress`` options that reproduce this setting."""
        if self.psnr is None:
            opts = ["--keep", str(self.keep), "--mask", self.mask, "--precision", self.precision]
            return opts + (["--block", str(self.block)] if self.block != BLOCK else [])
        return ["--psnr", f"{self.psnr:g}", "--precision", self.precision, "--block", str(self.block)]

    def compress_options(self, axes: tuple[int, ...] | None) -> CompressOptions:
        """The library options of ``dctchop compress`` with :attr:`options` (and ``--axes``)."""
        target = Target("keep", (self.keep,)) if self.psnr is None else Target("psnr", self.psnr)
        return CompressOptions(target=target, axes=axes, block=self.block, mask=self.mask,
                               precision=self.precision)


def settings_grid(dtype) -> list[Setting]:
    """The documented grid: chop, PSNR targets, block sizes (see the module docstring)."""
    grid = [Setting("keep", BLOCK, p, keep=k, mask=m) for k in KEEPS for m in MASKS for p in CHOP_PRECISIONS]
    integer = np.dtype(dtype).kind in "iu"
    targets = PSNR_TARGETS_INTEGER if integer else PSNR_TARGETS_FLOAT
    grid += [Setting("psnr", BLOCK, p, psnr=d) for d in targets for p in INT_PRECISIONS]
    middle = targets[len(targets) // 2]
    grid += [Setting("block", b, "int16", psnr=middle) for b in BLOCK_SWEEP]
    return grid


# ---------------------------------------------------------------------------------------------- sample


def pick_array(source) -> SourceArray:
    """The array to sweep: the one ``--dataset`` named (``open_source`` takes only it, through links as
    compress does; comparing names here refused a link's), else the first the file compresses."""
    if not source.lossy:  # a per-sample table may be named; an int8 array named was refused after this hint
        copied = ", ".join(f"{a.name} ({a.dtype})" for a in source.lossless[:8]) + (" ..." if len(source.lossless) > 8 else "")
        raise DctchopError(f"{source.path}: nothing to sweep (no array compress would compress lossily"
                           f"{'; it copies ' + copied if copied else ''}); name one of 2 or more dimensions and "
                           f"dtype {', '.join(map(str, DTYPE_CODES))} with --dataset")
    return source.lossy[0]


def read_sample(array: SourceArray, axes: tuple[int, ...], count: int | None) -> tuple[np.ndarray, dict]:
    """The sample (see the module docstring) and a description of it."""
    length = array.shape[0]
    sample_bytes = max(array.nbytes // max(length, 1), 1)
    if count is None:
        count = max(1, min(DEFAULT_SAMPLE, DEFAULT_SAMPLE_BYTES // sample_bytes))
    elif count < 1:
        raise DctchopError(f"--sample must be at least 1, got {count}")
    count = min(count, length)
    if 0 in axes:
        start = (length - count) // 2
        x = array.read(start, start + count)
        where = {"mode": "contiguous", "start": start, "stop": start + count}
    else:
        picks = [int(i) for i in np.unique(np.linspace(0, length - 1, count).round().astype(int))]
        with keep_spans():  # the picks in one row of HDF5 chunks decompress it once
            x = np.stack([array.read(i, i + 1)[0] for i in picks]) if len(picks) < length else array.read()
        where = {"mode": "evenly spaced" if len(picks) < length else "all", "indices": picks}
    if x.dtype.kind == "f" and not np.all(np.isfinite(x)):
        raise DctchopError(f"{array.name}: the sample holds NaN or infinite values")
    return x, {"count": int(x.shape[0]), "of": length, "bytes": int(x.nbytes), **where}


# ---------------------------------------------------------------------------------------------- measure


def chunk_settings(source, array: SourceArray, setting: Setting, axes: tuple[int, ...] | None,
                   peak: float) -> ChunkSettings:
    """The codec settings ``dctchop compress`` would use for ``setting`` (via :func:`plan_array`, so the
    sweep follows the store's own rules for axes, blocks and keep); the PSNR peak of float data is the
    sample's."""
    settings = plan_array(source, array, setting.compress_options(axes)).settings
    if settings.target_psnr is not None and array.dtype.kind == "f":
        settings = replace(settings, peak=peak)
    return settings


def measure(x: np.ndarray, setting: Setting, settings: ChunkSettings, peak: float, threads: int) -> dict:
    """Encode ``x`` chunk by chunk as the store would, decode it, time the decode; ratio and PSNR."""
    axes = settings.axes
    chunks = _chunks(x.shape, axes, settings.block, x.dtype, None)
    ranges = [(s, min(s + chunks[0], x.shape[0])) for s in range(0, x.shape[0], chunks[0])]
    started = time.perf_counter()
    stored = [_stored_bytes(encode_chunk(_pad_to_chunk(x[s:e], chunks, axes), settings, threads, valid_rows=e - s))
              for s, e in ranges]
    encode_s = time.perf_counter() - started
    decode_chunk(unframe(stored[0], None), chunks, x.dtype, 1)  # compiles the kernels on a cold cache, untimed
    best, y = math.inf, None
    for run in range(DECODE_REPEATS):
        started = time.perf_counter()
        parts = [decode_chunk(unframe(raw, None), chunks, x.dtype, 1) for raw in stored]
        best = min(best, time.perf_counter() - started)
        y = parts
        if run == 0 and best >= DECODE_MIN_SECONDS:
            break
    sse, max_err = 0.0, 0.0
    for (s, e), part in zip(ranges, y):  # as compress measures each chunk
        chunk_sse, chunk_max = qz.error_stats(x[s:e], part[: e - s])
        sse, max_err = sse + chunk_sse, max(max_err, chunk_max)
    psnr = qz.psnr(sse / x.size, peak)
    stored_bytes = sum(len(b) for b in stored)
    reachable = setting.psnr is None or psnr >= setting.psnr
    return {
        "name": " ".join(setting.options), "family": setting.family, "options": setting.options,
        "block": setting.block, "precision": setting.precision, "keep": setting.keep,
        "mask": setting.mask if setting.psnr is None else None, "target_psnr": setting.psnr,
        "stored_bytes": stored_bytes, "ratio": x.nbytes / stored_bytes, "psnr": psnr, "max_abs_error": max_err,
        "decode_mb_per_s": x.nbytes / 1e6 / best if best > 0 else math.inf, "encode_s": encode_s,
        "reachable": reachable, "pareto": False,
    }


def refused_arrays(source, swept: SourceArray, setting: Setting, axes: tuple[int, ...] | None) -> list[dict]:
    """The file's other arrays that ``dctchop compress`` with ``setting`` would refuse to transform (an axis of
    length 1, ``--axes`` that do not fit them), with the reasons: the recommended command copies them
    bit-exactly with ``--lossless``, since without it compress refuses the whole file."""
    refused = []
    for other in source.lossy:
        if other is swept:
            continue
        try:
            plan_array(source, other, setting.compress_options(axes))
        except DctchopError as e:
            name = array_name(source, other)
            refused.append({"array": name, "reason": str(e).removeprefix(f"{name}: ")})
    return refused


def pareto(points: list[dict]) -> None:
    """Mark ``pareto`` on every reachable point that no other reachable point beats on both ratio and PSNR
    (at least as good on both and better on one)."""
    live = [p for p in points if p["reachable"]]
    for p in points:
        p["pareto"] = p["reachable"] and not any(
            q["ratio"] >= p["ratio"] and q["psnr"] >= p["psnr"] and (q["ratio"] > p["ratio"] or q["psnr"] > p["psnr"])
            for q in live)


def sweep(input_path: str | os.PathLike, dataset: str | None = None, sample: int | None = None,
          axes: str | tuple[int, ...] | None = None, grid: list[Setting] | None = None,
          follow_external: bool = False) -> dict:
    """Run the grid on a sample of one array of ``input_path`` (see the module docstring).

    ``axes``: the transformed axes (a tuple, or text like ``"1,2"``); default inferred from the layout.
    ``follow_external``: follow HDF5 external links and virtual datasets, as ``compress --follow-external``.
    Returns a JSON-ready dict: the input, array, layout, sample, peak and one entry per setting (options,
    ratio, PSNR, max abs error, decode MB/s, encode seconds, reachable, pareto). Settings whose transform
    does not fit the array are listed under ``skipped``.
    """
    source = open_source(input_path, datasets=[dataset] if dataset else (), follow_external=follow_external)
    array = pick_array(source)
    check_dtype(array.dtype, array.name)
    given_axes = (None if axes is None else parse_axes(axes, array.ndim) if isinstance(axes, str)
                  else check_axes(axes, array.ndim, f"{array.name}: axes {list(axes)}"))
    if given_axes is not None:
        axes, layout = given_axes, "custom"
    else:
        axes, layout = infer_axes(array.shape, array.dtype)
    x, where = read_sample(array, axes, sample)
    peak = qz.data_peak(x)
    threads = resolve_threads(0)  # all cores
    results, skipped, used_axes = [], [], None
    for setting in grid if grid is not None else settings_grid(x.dtype):
        try:
            settings = chunk_settings(source, array, setting, given_axes, peak)
            results.append({**measure(x, setting, settings, peak, threads),
                            "refused_arrays": refused_arrays(source, array, setting, given_axes)})
            used_axes = used_axes or settings.axes
        except DctchopError as e:
            skipped.append({"name": " ".join(setting.options), "reason": str(e)})
        finally:
            forget_plans()  # the next setting plans the sample anew; keeping every setting's held ~10
    pareto(results)
    return {
        "input": str(input_path), "follow_external": follow_external, "array": array.name,
        "arrays": [a.name for a in source.lossy],
        "shape": list(array.shape), "dtype": str(array.dtype), "layout": layout,
        "axes": list(used_axes or axes),
        "sample": where, "peak": peak, "settings": results, "skipped": skipped,
    }


# ---------------------------------------------------------------------------------------------- recommend


def recommend(result: dict, target_ratio: float | None = None, target_psnr: float | None = None,
              axes_text: str | None = None, dataset: str | None = None) -> dict:
    """The setting to use for a target ratio (best PSNR with ratio >= R within 5%) or a target PSNR (highest
    ratio with PSNR >= D); default: the PSNR ``dctchop compress`` defaults to. Returns the target, the chosen
    setting's index and name (``None`` when no setting qualifies, with the reason) and the command line
    (with ``--dataset`` when the sweep was of a named ``dataset``: the settings are for that array)."""
    if target_ratio is not None and target_psnr is not None:
        raise DctchopError("give at most one of --target-ratio and --target-psnr")
    if target_ratio is not None or target_psnr is not None:
        kind, value = ("ratio", target_ratio) if target_ratio is not None else ("psnr", target_psnr)
        check_target(kind, value, f"--target-{kind}")
        value = float(value)
    else:
        target = default_target(result["dtype"])
        kind, value = target.kind, target.value
    out = {"target": {"kind": kind, "value": value, "given": target_ratio is not None or target_psnr is not None}}
    points = [(i, p) for i, p in enumerate(result["settings"]) if p["reachable"]]
    if not result["settings"] and result["skipped"]:  # every setting failed (data out of range, say)
        return {**out, "index": None, "setting": None, "command": None,
                "reason": f"no setting applies: {result['skipped'][0]['reason']}"}
    if kind == "ratio":
        ok = [(i, p) for i, p in points if p["ratio"] >= value * (1 - RATIO_TOLERANCE)]
        best = max(ok, key=lambda ip: (ip[1]["psnr"], ip[1]["ratio"]), default=None)
        top = max((p["ratio"] for _, p in points), default=0.0)
        why = f"no setting reaches ratio {value:g} (the highest is {top:.3g})"
    else:
        ok = [(i, p) for i, p in points if p["psnr"] >= value]
        best = max(ok, key=lambda ip: (ip[1]["ratio"], ip[1]["psnr"]), default=None)
        top = max((p["psnr"] for _, p in points), default=-math.inf)
        why = f"no setting reaches PSNR {value:g} dB (the highest is {top:.2f} dB)"
    if best is None:
        return {**out, "index": None, "setting": None, "command": None, "reason": why}
    i, p = best
    refused = p.get("refused_arrays", [])
    return {**out, "index": i, "setting": p["name"], "ratio": p["ratio"], "psnr": p["psnr"], "copied_bit_exactly": refused,
            "command": compress_command(result["input"], p["options"], axes_text, dataset, result["follow_external"],
                                        [r["array"] for r in refused])}


def compress_command(input_path: str, options: list[str], axes_text: str | None = None, dataset: str | None = None,
                     follow_external: bool = False, lossless: list[str] = ()) -> str:
    """``dctchop compress INPUT OUTPUT OPTIONS``, shell-quoted; OUTPUT is INPUT's stem + .zarr; ``lossless``:
    the arrays to copy bit-exactly."""
    output = Path(input_path).stem + ".zarr"
    extra = ((["--dataset", dataset] if dataset else []) + [w for name in lossless for w in ("--lossless", name)]
             + (["--axes", axes_text] if axes_text else []) + (["--follow-external"] if follow_external else []))
    paths = [f"./{p}" if p.startswith("-") else p for p in (str(input_path), output)]  # not read as options
    return shlex.join(["dctchop", "compress", *paths, *extra, *options])


# ---------------------------------------------------------------------------------------------- plot

PLOT_WIDTH_PX, PLOT_HEIGHT_PX = 1024, 768
FAMILY_STYLE = {  # (family, precision) -> colour, marker, legend label
    ("keep", "float16"): ("#1f77b4", "o", "--keep, float16"),
    ("keep", "bfloat16"): ("#17becf", "o", "--keep, bfloat16"),
    ("psnr", "int8"): ("#d62728", "D", "--psnr, int8"),
    ("psnr", "int16"): ("#ff7f0e", "D", "--psnr, int16"),
    ("block", "int16"): ("#2ca02c", "s", "--psnr, int16, block 4 / 16"),
}
RECOMMENDED_COLOUR = "#9400d3"


def _marker(p: dict) -> str:
    if p["family"] == "keep":
        return "o" if p["mask"] == "square" else "^"
    return FAMILY_STYLE.get((p["family"], p["precision"]), (None, "D"))[1]


def _point_label(p: dict) -> str:
    if p["target_psnr"] is None:
        return f"keep {p['keep']}, {p['mask']}, {p['precision']}"
    return f"{p['target_psnr']:g} dB, {p['precision']}, block {p['block']}"


def _place_labels(ax, fig, points: list[tuple[float, float, str]], fontsize: float,
                  lines: list[list[tuple[float, float]]] = (), others: list[tuple[float, float]] = ()) -> None:
    """Annotate points, trying offsets around each until the label overlaps no earlier label, no marker
    (``others`` are unlabelled ones), no drawn line (relaxed to the labelled markers when nothing else
    fits) and stays inside the axes (greedy, in pixels)."""
    to_px = ax.transData.transform
    box = ax.get_window_extent()
    size = fontsize * fig.dpi / 72
    markers = [tuple(to_px((x, y))) for x, y, _ in points]
    along = [tuple(to_px(xy)) for xy in others]
    for line in lines:
        px = [to_px(xy) for xy in line]
        for (x0, y0), (x1, y1) in itertools.pairwise(px):
            n = max(int(math.hypot(x1 - x0, y1 - y0) / 4), 1)
            along += [(x0 + (x1 - x0) * t / n, y0 + (y1 - y0) * t / n) for t in range(n + 1)]
    placed: list[tuple[float, float, float, float]] = []
    offsets = [(7, 4), (7, -4 - size), (-7, 4), (-7, -4 - size), (7, 11), (-7, 11), (7, -11 - size),
               (-7, -11 - size), (0, 12), (0, -13 - size)]

    def fits(rect, obstacles) -> bool:
        inside = (box.x0 + 2 <= rect[0] and rect[2] <= box.x1 - 2 and box.y0 + 2 <= rect[1]
                  and rect[3] <= box.y1 - 2)
        clash = any(rect[0] < r[2] and r[0] < rect[2] and rect[1] < r[3] and r[1] < rect[3] for r in placed)
        hits = any(rect[0] - 3 < mx < rect[2] + 3 and rect[1] - 3 < my < rect[3] + 3 for mx, my in obstacles)
        return inside and not clash and not hits

    for (x, y, text), (px, py) in zip(points, markers):
        w = 0.56 * size * len(text)
        choice = None
        for obstacles in (markers + along, markers):
            for dx, dy in offsets:
                x0 = px - w / 2 if dx == 0 else (px + dx if dx > 0 else px + dx - w)
                rect = (x0, py + dy, x0 + w, py + dy + size)
                if fits(rect, obstacles):
                    choice = (dx, dy, rect)
                    break
            if choice is not None:
                break
        if choice is None:
            continue  # no free spot: the legend and the printed table say what the point is
        dx, dy, rect = choice
        placed.append(rect)
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx * 72 / fig.dpi, dy * 72 / fig.dpi),
                    ha="left" if dx > 0 else ("right" if dx < 0 else "center"), va="bottom", fontsize=fontsize,
                    color="#222222", zorder=5,
                    arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "#999999", "shrinkA": 0, "shrinkB": 3},
                    bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8})


def plot(result: dict, recommendation: dict | None, out: str | os.PathLike) -> tuple[int, int]:
    """Rate-distortion picture (ratio on a log axis, PSNR), the Pareto front as a line, the recommended
    setting starred; :data:`PLOT_WIDTH_PX` x :data:`PLOT_HEIGHT_PX` pixels. Returns (width, height)."""
    from dctchop.preview import DPI, check_png_path, require_matplotlib, save_png

    out = check_png_path(out)
    Figure, Canvas = require_matplotlib("dctchop sweep --plot")
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    pts = result["settings"]
    finite = [p["psnr"] for p in pts if math.isfinite(p["psnr"])]
    cap = (max(finite) if finite else 60.0) + 4.0  # exact reconstructions (inf dB) are drawn on this line

    def y(p):
        return min(p["psnr"], cap)

    fig = Figure(figsize=(PLOT_WIDTH_PX / DPI, PLOT_HEIGHT_PX / DPI), dpi=DPI, facecolor="white")
    Canvas(fig)
    ax = fig.add_axes([0.07, 0.09, 0.65, 0.8])
    for (family, precision), (colour, _, _) in FAMILY_STYLE.items():
        group = [p for p in pts if p["family"] == family and p["precision"] == precision]
        lines = []
        if family == "psnr":
            lines = [sorted(group, key=lambda p: p["target_psnr"])]
        elif family == "keep":
            lines = [sorted((p for p in group if p["mask"] == m), key=lambda p: p["keep"]) for m in MASKS]
        for line in lines:
            dotted = bool(line) and line[0]["mask"] == "triangle"
            ax.plot([p["ratio"] for p in line], [y(p) for p in line], color=colour, lw=1, alpha=0.55,
                    ls=":" if dotted else "-", zorder=2)
        for p in sorted(group, key=lambda p: p["pareto"]):
            ax.scatter([p["ratio"]], [y(p)], s=48 if p["pareto"] else 30, marker=_marker(p),
                       facecolors=colour if p["reachable"] else "none",
                       edgecolors="black" if p["pareto"] else colour, linewidths=1.1 if p["pareto"] else 0.9,
                       zorder=4.5 if p["pareto"] else 4)
    front = sorted((p for p in pts if p["pareto"]), key=lambda p: p["ratio"])
    ax.plot([p["ratio"] for p in front], [y(p) for p in front], color="black", lw=1.3, ls="--", zorder=3)
    target = (recommendation or {}).get("target")
    if target and target.get("given"):
        if target["kind"] == "ratio":
            ax.axvline(target["value"], color="#555555", lw=0.9, ls=":", zorder=1)
        else:
            ax.axhline(target["value"], color="#555555", lw=0.9, ls=":", zorder=1)
    chosen = None
    if recommendation and recommendation.get("index") is not None:
        chosen = pts[recommendation["index"]]
        ax.scatter([chosen["ratio"]], [y(chosen)], s=340, marker="*", facecolors="none",
                   edgecolors=RECOMMENDED_COLOUR, linewidths=1.6, zorder=6)
    if any(not math.isfinite(p["psnr"]) for p in pts):
        ax.axhline(cap, color="#bbbbbb", lw=0.6, zorder=1)
        ax.text(0.995, cap, "exact (inf dB) ", transform=ax.get_yaxis_transform(), fontsize=6.5, va="bottom",
                ha="right", color="#666666")
    ax.set_xscale("log")
    ratios = [p["ratio"] for p in pts] or [1.0]
    ax.set_xlim(min(ratios) / 1.25, max(ratios) * 1.25)
    ax.set_xlabel("compression ratio (sample bytes / stored bytes, log scale)", fontsize=8.5)
    ax.set_ylabel("PSNR (dB)", fontsize=8.5)
    ax.tick_params(labelsize=7.5)
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_minor_locator(LogLocator(base=10, subs=tuple(range(1, 10))))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which="major", color="#dddddd", lw=0.6)
    ax.grid(True, which="minor", axis="x", color="#f2f2f2", lw=0.4)
    ax.set_axisbelow(True)
    labelled = [p for p in pts if p["pareto"] or p["family"] == "block" or p is chosen]
    labelled.sort(key=lambda p: (p is not chosen, not p["pareto"]))
    _place_labels(ax, fig, [(p["ratio"], y(p), _point_label(p)) for p in labelled], 6.5,
                  lines=[[(p["ratio"], y(p)) for p in front]], others=[(p["ratio"], y(p)) for p in pts])
    s = result["sample"]
    fig.text(0.5, 0.965, f"Rate-distortion sweep: {Path(result['input']).name} {result['array']}", ha="center",
             fontsize=10.5, weight="bold")
    shape = "x".join(map(str, result["shape"]))
    fig.text(0.5, 0.93, f"{shape} {result['dtype']} ({result['layout']}), {s['count']} of {s['of']} samples "
             f"({s['mode']}); PSNR peak {result['peak']:.4g}", ha="center", fontsize=8, color="#333333")
    handles = [Line2D([], [], color=c, marker=m, ls="", label=label) for c, m, label in FAMILY_STYLE.values()]
    handles += [
        Line2D([], [], color="grey", marker="o", ls="-", lw=1, label="--mask square"),
        Line2D([], [], color="grey", marker="^", ls=":", lw=1, label="--mask triangle"),
        Line2D([], [], color="black", ls="--", marker="o", mfc="white", mec="black", label="Pareto front"),
    ]
    if any(not p["reachable"] for p in pts):
        handles.append(Line2D([], [], color="grey", marker="D", mfc="none", ls="", label="PSNR target missed"))
    if chosen is not None:
        t = recommendation["target"]
        goal = f"ratio >= {t['value']:g}" if t["kind"] == "ratio" else f"PSNR >= {t['value']:g} dB"
        handles.append(Line2D([], [], color=RECOMMENDED_COLOUR, marker="*", mfc="none", ms=13, ls="",
                              label=f"recommended for\n{goal}"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.025, 1.0),
                       borderaxespad=0, frameon=False, labelspacing=0.9)
    if chosen is not None:
        note = "\n".join(["recommended:", *_option_lines(chosen["options"]),
                          f"ratio {chosen['ratio']:.2f}, PSNR {_db_text(chosen['psnr'])} dB"])
        fig.text(0.745, 0.09, note, fontsize=7, va="bottom", ha="left", color=RECOMMENDED_COLOUR)
    return save_png(fig, Canvas, out)


def _db_text(v: float) -> str:
    return "inf" if v == math.inf else f"{v:.2f}"


def _option_lines(options: list[str]) -> list[str]:
    """``["--psnr", "40", "--block", "8"]`` -> ``["--psnr 40", "--block 8"]``."""
    lines: list[str] = []
    for word in options:
        if word.startswith("--") or not lines:
            lines.append(word)
        else:
            lines[-1] += f" {word}"
    return lines
