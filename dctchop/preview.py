"""``dctchop preview``: a picture of what the codec did to a few samples of a store.

One row per sample: original | decoded | absolute-error heat map (with its colour bar). Titles carry the
sample's PSNR (``20 log10(peak) - 10 log10(MSE)`` over the whole sample, with the peak the store recorded:
255 for uint8, max - min of the original array for other data) and its max absolute error.

What a "sample" and its picture are follows the array's layout (:mod:`dctchop.layout`):

* images (``NHW``, ``NHWC``, ``NCHW``; and a single ``HWC`` image): sample ``i`` along axis 0, shown whole;
  3 channels as RGB, any other channel count as the first channel in grey. The error map of an RGB sample
  is the largest error over its channels.
* fields (everything else): sample ``i`` along axis 0 when axis 0 is not transformed, else the whole array
  is one sample; the picture is the plane of the last two transformed axes, taken at the middle of the
  first transformed axis when there are three, and at channel 0 of a channel axis.

The original comes from the input the store records (``attrs["dctchop"]["source"]["path"]``) or from
``source``; the decoded data through :func:`dctchop.open`, which refuses missing or damaged chunks. Both are
read one stored chunk at a time.

The PNG has a fixed size: :data:`WIDTH_PX` wide, :data:`HEADER_PX` + :data:`ROW_PX` per sample high
(:data:`DPI` dots per inch, a power of two, so the pixel size is exact). A picture at least twice its panel's
size is drawn reduced by :func:`fit_panel` (block means; block maxima for the error map); titles and colour
scales come from the full-resolution data.

Plotting needs matplotlib (the ``plot`` extra); it is imported only when a picture is drawn.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from dctchop import quantize as qz
from dctchop.errors import DctchopError
from dctchop.formats.hdf5 import keep_spans
from dctchop.location import check_output_file
from dctchop.store import discard_temporary_file, temporary_file

DPI = 128
WIDTH_PX = 1024
HEADER_PX = 72
ROW_PX = 256
DEFAULT_SAMPLES = 4
MAX_SAMPLES = 16
MAX_ELONGATION = 8  # a picture longer than this many times its width is stretched to its panel (4x1280: lines)
IMAGE_LAYOUTS = ("NHW", "NHWC", "NCHW", "HWC")
CHANNEL_AXIS = {"NHWC": 3, "NCHW": 1, "HWC": 2, "NCZYX": 1, "NZYXC": 4}
PLOT_EXTRA = "pip install 'dctchop[plot]'"


def require_matplotlib(what: str = "dctchop preview"):
    """``(Figure, FigureCanvasAgg)`` from matplotlib's object API (no pyplot, no global backend switch);
    a :class:`DctchopError` naming the extra to install when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise DctchopError(f"{what} needs matplotlib: {PLOT_EXTRA}") from None
    return Figure, FigureCanvasAgg


def check_png_path(out: str | os.PathLike) -> Path:
    """The output picture path: a ``.png`` name in an existing directory, outside any Zarr store."""
    return check_output_file(out, (".png",))


def drawable(text: str) -> str:
    """``text`` as matplotlib can draw it. A file name that is not valid UTF-8 reaches Python with its
    undecodable bytes as lone surrogates (PEP 383), which matplotlib's font code refuses (TypeError); they are
    drawn as backslash escapes (``bad\\xffname.h5``), as Python prints such bytes."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that stands for no byte
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def save_png(fig, canvas_class, out: Path) -> tuple[int, int]:
    """Write ``fig`` as PNG (to a temporary sibling, then renamed); return its (width, height) in pixels.
    Every text of the figure (titles, labels, legend) is made :func:`drawable` first."""
    from matplotlib.text import Text

    for artist in fig.findobj(Text):
        text = artist.get_text()
        if (drawn := drawable(text)) != text:
            artist.set_text(drawn)
    canvas = canvas_class(fig)
    tmp = temporary_file(out)
    try:
        fig.savefig(tmp, format="png", dpi=DPI, metadata={"Software": None})
        os.replace(tmp, out)
    except OSError as e:
        raise DctchopError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        discard_temporary_file(tmp)
    width, height = canvas.get_width_height()
    return int(width), int(height)


def preview_size(rows: int) -> tuple[int, int]:
    """(width, height) in pixels of a preview with ``rows`` samples."""
    return WIDTH_PX, HEADER_PX + ROW_PX * rows


# ---------------------------------------------------------------------------------------------- selection


@dataclass(frozen=True)
class View:
    """How samples of an array become pictures (all axes in the array's own numbering)."""

    kind: str  # "image" or "field"
    sample_axis: int | None  # 0, or None when the whole array is one sample
    picture: tuple[int, ...]  # the axes shown as rows and columns (one axis: a 1-pixel-high strip)
    rgb_axis: int | None  # a 3-channel axis shown as RGB
    fixed: dict[int, int] = field(default_factory=dict)  # every other axis, at this index

    def n_samples(self, shape) -> int:
        return shape[0] if self.sample_axis == 0 else 1


def make_view(shape, axes, layout: str) -> View:
    """The :class:`View` of an array of ``shape`` with transformed ``axes`` and ``layout``.

    A layout's channel axis (``NHWC``, ``NCHW``, ``HWC``, ``NCZYX``, ``NZYXC``) is never a picture axis,
    whether or not it is transformed (the store may transform 3 colour channels as one block).
    """
    shape, axes = tuple(shape), tuple(sorted(axes))
    ndim = len(shape)
    sample_axis = None if 0 in axes else 0
    kind = "image" if layout in IMAGE_LAYOUTS else "field"
    channel = CHANNEL_AXIS.get(layout)
    rgb = channel if kind == "image" and channel is not None and shape[channel] == 3 else None
    spatial = tuple(a for a in axes if a != channel)
    if len(spatial) >= 2:
        picture = spatial[-2:]
    else:
        others = [a for a in range(ndim) if a not in (sample_axis, channel, *spatial)]
        if not spatial:
            picture = tuple(sorted(others, key=lambda a: (shape[a], a))[-2:])
        elif others:
            picture = tuple(sorted((max(others, key=lambda a: (shape[a], a)), spatial[0])))
        else:
            picture = spatial
    fixed = {}
    for a in range(ndim):
        if a not in (sample_axis, rgb, *picture):
            fixed[a] = shape[a] // 2 if a in spatial else 0
    return View(kind, sample_axis, tuple(sorted(picture)), rgb, fixed)


def default_indices(n: int) -> list[int]:
    """:data:`DEFAULT_SAMPLES` indices spread evenly over ``range(n)``, first and last included."""
    return sorted({int(i) for i in np.linspace(0, n - 1, min(DEFAULT_SAMPLES, n)).round()})


def check_indices(indices, n: int, name: str) -> list[int]:
    """Indices in ``-n <= i < n`` (negative ones count from the end), at most :data:`MAX_SAMPLES`."""
    if not indices:
        return default_indices(n)
    out = []
    for i in indices:
        if not -n <= int(i) < n:
            what = "1 sample (index 0)" if n == 1 else f"{n} samples (indices 0..{n - 1})"
            raise DctchopError(f"--index {i} is out of range: {name} has {what}")
        out.append(int(i) % n)
    if len(out) > MAX_SAMPLES:
        raise DctchopError(f"at most {MAX_SAMPLES} samples fit in one preview, got {len(out)} --index values")
    return out


def _picture(block: np.ndarray, view: View, axis0) -> np.ndarray:
    """The picture of ``block`` (a slab along axis 0 of the whole array, or one sample with the sample axis
    removed when ``axis0`` is None): rows x cols [x 3]."""
    offset = 0 if axis0 is not None else 1  # a sample has lost axis 0
    index = []
    kept = []
    for a in range(offset, offset + block.ndim):
        if a == 0 and axis0 is not None:
            index.append(axis0)
            if not isinstance(axis0, int):
                kept.append(a)
        elif a in view.fixed:
            index.append(view.fixed[a])
        else:
            index.append(slice(None))
            kept.append(a)
    out = block[tuple(index)]
    order = [kept.index(a) for a in (*view.picture, *((view.rgb_axis,) if view.rgb_axis is not None else ()))]
    out = np.transpose(out, order)
    if len(view.picture) == 1:
        out = out[None]
    return out


SLAB = 1 << 20  # values per step of the error sums: 8 MB of float64 differences, whatever the sample's size


def _errors(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(sum of squared errors, max absolute error) of ``y`` against ``x`` (:func:`dctchop.quantize.error_stats`,
    exact in int64 for integers), a slab of :data:`SLAB` values at a time: whole-sample float64 temporaries
    added 0.4 GB to a 6000x6000 preview. A NaN in ``x`` (a --source file with one) makes both NaN."""
    x, y = x.reshape(1, -1), y.reshape(1, -1)
    sse, max_err = 0.0, 0.0
    for s in range(0, x.size, SLAB):
        slab_sse, slab_max = qz.error_stats(x[:, s : s + SLAB], y[:, s : s + SLAB])
        sse, max_err = sse + slab_sse, _max(max_err, slab_max)
    return sse, max_err


def _max(a: float, b: float) -> float:
    """The larger of two errors, NaN if either is: max() keeps its first argument against a NaN, and the title
    said "sample max 0" beside PSNR nan."""
    return float(np.maximum(a, b))


@dataclass
class Row:
    index: int
    psnr: float
    max_abs_error: float
    original: np.ndarray
    decoded: np.ndarray


def _read_rows(src, arr, entry: dict, view: View, indices: list[int]) -> list[Row]:
    """Original and decoded pictures and whole-sample PSNR / max error, reading one stored chunk at a time."""
    shape, chunk = tuple(entry["shape"]), int(entry["chunks"][0])
    peak = float(entry["peak"])
    ranges = [(s, min(s + chunk, shape[0])) for s in range(0, shape[0], chunk)]
    if view.sample_axis == 0:
        rows = {}
        for s, e in ranges:
            wanted = sorted({i for i in indices if s <= i < e})
            if not wanted:
                continue
            y = arr[s:e]  # the whole chunk is decoded anyway
            for i in wanted:
                xs, ys = src.read(i, i + 1)[0], y[i - s]
                sse, max_err = _errors(xs, ys)
                rows[i] = Row(i, qz.psnr(sse / xs.size, peak), max_err,
                              _picture(xs, view, None), _picture(ys, view, None))
        return [rows[i] for i in indices]
    # the whole array is one sample: accumulate its error over all chunks, assemble the picture's pieces
    sse, max_err, xs, ys = 0.0, 0.0, [], []
    for s, e in ranges:
        x, y = src.read(s, e), arr[s:e]
        chunk_sse, chunk_max = _errors(x, y)
        sse, max_err = sse + chunk_sse, _max(max_err, chunk_max)
        if 0 in view.fixed:
            if s <= view.fixed[0] < e:
                xs.append(_picture(x, view, view.fixed[0] - s))
                ys.append(_picture(y, view, view.fixed[0] - s))
        else:
            xs.append(_picture(x, view, slice(None)))
            ys.append(_picture(y, view, slice(None)))
    psnr = qz.psnr(sse / math.prod(shape), peak)
    cat = (lambda p: np.concatenate(p, axis=view.picture.index(0))) if 0 in view.picture else (lambda p: p[0])
    return [Row(0, psnr, max_err, cat(xs), cat(ys))]


# ---------------------------------------------------------------------------------------------- sources


def open_original(source_path: str, entry: dict, recorded: bool, follow_external: bool = False):
    """The :class:`~dctchop.formats.SourceArray` a store array was made from, checked for shape and dtype
    (``follow_external``: the store was made following the source's external links)."""
    from dctchop.formats import open_source
    from dctchop.inspect import source_mismatch

    if recorded and not os.path.exists(source_path):
        raise DctchopError(f"the store's source {source_path} does not exist; pass --source INPUT")
    if Path(source_path).suffix.lower() == ".npy":
        source = open_source(source_path)
    else:
        source = open_source(source_path, datasets=[entry["source"]], follow_external=follow_external)
    candidates = [a for a in source.arrays if a.name == entry["source"] or source.kind == "npy"]
    src = candidates[0] if candidates else None
    why = source_mismatch(source_path, src, entry)
    if why:
        raise DctchopError(f"{why}; pass the input the store was made from with --source")
    return src


# ---------------------------------------------------------------------------------------------- drawing


def _finite_range(x: np.ndarray) -> tuple[float, float]:
    """(min, max) of the finite values of ``x``, (0, 0) when it has none: a NaN or an infinity (from a --source
    file with them) made the colour scales NaN, which drew the pictures to another scale or none."""
    lo, hi = float(x.min()), float(x.max())
    if math.isfinite(lo) and math.isfinite(hi):
        return lo, hi
    finite = np.isfinite(x)
    if not finite.any():
        return 0.0, 0.0
    return float(np.min(x, where=finite, initial=np.inf)), float(np.max(x, where=finite, initial=-np.inf))


def _display_range(x: np.ndarray, dtype: np.dtype, kind: str) -> tuple[float, float, str]:
    """(vmin, vmax, colormap) shared by the original and decoded pictures."""
    if kind == "image":
        if dtype == np.uint8:
            return 0.0, 255.0, "gray"
        lo, hi = _finite_range(x)
        return lo, hi if hi > lo else lo + 1, "gray"
    lo, hi = _finite_range(x)
    if lo < 0 < hi:
        m = max(-lo, hi)
        return -m, m, "RdBu_r"
    return lo, hi if hi > lo else lo + 1, "viridis"


def _rgb(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    return np.clip((x.astype(np.float64) - lo) / (hi - lo), 0, 1)


def _fmt(v: float) -> str:
    return "inf" if v == math.inf else f"{v:.2f}"


def _num(v: float) -> str:
    return f"{v:.3g}" if not math.isfinite(v) or v != int(v) or abs(v) >= 1e4 else f"{int(v)}"


def _px(fig_h: int, x: float, y_top: float, w: float, h: float) -> list[float]:
    """Figure-fraction rectangle of a box given in pixels from the top-left corner."""
    return [x / WIDTH_PX, 1 - (y_top + h) / fig_h, w / WIDTH_PX, h / fig_h]


# panel columns, in pixels from the left: original, decoded, error; with a colour bar beside the decoded
# picture (fields, grey images other than uint8) or without one
PANEL_W, PANEL_H, TITLE_H = 264, 200, 40
COLUMNS = {True: (24, 304, 648), False: (44, 358, 672)}
CBAR_W, CBAR_GAP = 12, 8


def fit_panel(pic: np.ndarray, aspect: str, how: str = "mean") -> np.ndarray:
    """``pic`` (rows x cols [x 3]) reduced by whole blocks of pixels to no fewer than its panel shows
    (:data:`PANEL_W` x :data:`PANEL_H`, square pixels unless ``aspect`` is ``"auto"``): each block's mean, or
    with ``how="max"`` its max, so that one bad pixel of an error map stays visible. matplotlib colour-maps
    every pixel it is given before resampling to the panel, which made a big picture's preview slow and
    gigabytes large. A picture that fits its panel is returned as it is; a last block may be partial."""
    rows, cols = pic.shape[:2]
    if aspect == "auto":
        factors = (max(1, rows // PANEL_H), max(1, cols // PANEL_W))
    else:
        factors = (max(1, rows // PANEL_H, cols // PANEL_W),) * 2
    reduce = np.max if how == "max" else partial(np.mean, dtype=np.float64)
    for axis, f in enumerate(factors):
        if f == 1:
            continue
        n = pic.shape[axis]
        # whole blocks by a reshape (numpy's reduceat is ten times slower along the rows), then the rest
        head, tail = np.split(pic, [n // f * f], axis=axis)
        parts = [reduce(head.reshape(pic.shape[:axis] + (n // f, f) + pic.shape[axis + 1 :]), axis=axis + 1)]
        if tail.shape[axis]:
            parts.append(reduce(tail, axis=axis, keepdims=True))
        pic = np.concatenate(parts, axis=axis)
    return pic


def _colorbar(fig, ax, mappable, fig_h: int, fontsize: float):
    """A colour bar hugging the right edge of ``ax``'s image, exactly as tall as it."""
    ax.apply_aspect()
    pos = ax.get_position()
    cax = fig.add_axes([pos.x1 + CBAR_GAP / WIDTH_PX, pos.y0, CBAR_W / WIDTH_PX, pos.height])
    cb = fig.colorbar(mappable, cax=cax)
    cb.ax.tick_params(labelsize=fontsize, length=2, pad=2)
    cb.outline.set_linewidth(0.5)
    return cb


def draw(rows: list[Row], view: View, dtype: np.dtype, header: tuple[str, str], out: Path) -> tuple[int, int]:
    """Draw the preview of ``rows`` and write it to ``out``; return the PNG's (width, height)."""
    Figure, Canvas = require_matplotlib()
    width, height = preview_size(len(rows))
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, facecolor="white")
    fig.text(0.5, 1 - 22 / height, header[0], ha="center", va="center", fontsize=10.5, weight="bold")
    fig.text(0.5, 1 - 50 / height, header[1], ha="center", va="center", fontsize=8, color="#333333")
    small, title = 6.5, 8
    data_bar = view.kind == "field" or (view.rgb_axis is None and dtype != np.uint8)
    for r, row in enumerate(rows):
        top = HEADER_PX + r * ROW_PX + TITLE_H - 14
        # colour scales, the error and the drawing's choices from the full-resolution pictures
        lo, hi, cmap = _display_range(row.original, dtype, view.kind)
        err = np.subtract(row.decoded, row.original, dtype=np.result_type(dtype, np.float32))
        np.abs(err, out=err)
        if view.rgb_axis is not None:
            err = err.max(axis=-1)
        err_max = _finite_range(err)[1] or 1.0
        interp = "nearest" if max(row.original.shape[:2]) <= PANEL_H else "antialiased"
        h, w = row.original.shape[:2]  # square pixels, unless the picture would thin to a line
        aspect = "auto" if max(h, w) > MAX_ELONGATION * min(h, w) else "equal"
        pictures = (fit_panel(row.original, aspect), fit_panel(row.decoded, aspect),
                    fit_panel(err, aspect, "max"))
        label = f"sample {row.index}" if view.sample_axis == 0 else "whole array"
        titles = (f"{label}: original", f"decoded: PSNR {_fmt(row.psnr)} dB",
                  f"|error| (sample max {_num(row.max_abs_error)})")
        images = []
        for c, (x0, pic) in enumerate(zip(COLUMNS[data_bar], pictures)):
            ax = fig.add_axes(_px(height, x0, top, PANEL_W, PANEL_H))
            if c < 2 and view.rgb_axis is not None:
                im = ax.imshow(_rgb(pic, lo, hi), interpolation=interp, aspect=aspect)
            elif c < 2:
                im = ax.imshow(pic, cmap=cmap, vmin=lo, vmax=hi, interpolation=interp, aspect=aspect)
            else:
                im = ax.imshow(pic, cmap="inferno", vmin=0, vmax=err_max, interpolation=interp, aspect=aspect)
            ax.set_xticks([])
            ax.set_yticks([])
            for spine in ax.spines.values():
                spine.set_linewidth(0.5)
            ax.set_title(titles[c], fontsize=title, pad=4)
            images.append((ax, im))
        if data_bar:
            _colorbar(fig, *images[1], height, small)
        cb = _colorbar(fig, *images[2], height, small)
        if dtype.kind in "iu":  # integer data: integer errors
            from matplotlib.ticker import MaxNLocator

            cb.locator = MaxNLocator(nbins=6, integer=True)
            cb.update_ticks()
    return save_png(fig, Canvas, out)


# ---------------------------------------------------------------------------------------------- entry point


def preview(store: str | os.PathLike, out: str | os.PathLike, source: str | os.PathLike | None = None,
            indices: list[int] | None = None, array: str | None = None) -> dict:
    """Draw original | decoded | |error| for a few samples of one array of ``store`` into the PNG ``out``.

    ``source``: the input the store was made from (default: the path recorded in the store). ``indices``:
    samples to show (default :data:`DEFAULT_SAMPLES` spread over the array). ``array``: which array of the
    store (default: its main one, :func:`dctchop.dataset.main_array`). Returns what was drawn: array, layout, kind, size and per-sample PSNR.
    """
    from dctchop.dataset import Dataset, array_named, main_array, recorded_links
    from dctchop.inspect import open_store

    out = check_png_path(out)
    require_matplotlib()
    _, info = open_store(store)
    names = list(info["arrays"])
    if not names:
        raise DctchopError(f"{store} holds no compressed array")
    # HDF5's /name, or a name through a link of the source, as dctchop.open takes them
    name = (array_named(store, array, recorded_links(info), names, "compressed array") if array is not None
            else main_array(info["arrays"]))
    entry = info["arrays"][name]
    recorded = source is None
    source_path = str(source) if source is not None else str((info.get("source") or {}).get("path", ""))
    if not source_path:
        raise DctchopError(f"{store} records no source path; pass --source INPUT")
    src = open_original(source_path, entry, recorded, (info.get("source") or {}).get("follow_external", False))
    view = make_view(entry["shape"], entry["axes"], entry["layout"])
    chosen = check_indices(indices, view.n_samples(entry["shape"]), name)
    arr = Dataset(store, threads=1).array(name)  # decodes as readers do: a missing or damaged chunk is an error
    with keep_spans():  # samples in one row of HDF5 chunks decompress it once
        rows = _read_rows(src, arr, entry, view, chosen)
    header = _header(Path(store).name, name, entry, view, source_path)
    width, height = draw(rows, view, np.dtype(entry["dtype"]), header, out)
    return {
        "out": str(out), "width": width, "height": height, "array": name, "layout": entry["layout"],
        "kind": view.kind, "source": source_path, "whole_array": view.sample_axis is None,
        "samples": [{"index": r.index, "psnr": r.psnr, "max_abs_error": r.max_abs_error} for r in rows],
    }


def _header(store_name: str, name: str, entry: dict, view: View, source_path: str) -> tuple[str, str]:
    codec, target = entry["codec"], entry["target"]
    shape = "x".join(str(s) for s in entry["shape"])
    line1 = f"{store_name} / {name}: {shape} {entry['dtype']} ({entry['layout']}), ratio {entry['ratio']:.2f}"
    kind, value = target["kind"], target["value"]
    if kind == "psnr":
        goal = f"target PSNR {value:g} dB per chunk"
    elif kind == "ratio":
        goal = f"target ratio {value:g}"
    else:
        goal = f"{kind} {','.join(map(str, value)) if isinstance(value, list) else value}"
    parts = [goal, f"block {'x'.join(map(str, codec['block']))}", codec["precision"]]
    if target["kind"] == "keep":
        parts.insert(2, f"{codec['mask']} mask")
    where = []
    for a, i in sorted(view.fixed.items()):
        in_axes = a in entry["axes"]
        where.append(f"axis {a} at {i} ({'middle' if in_axes else 'first'} of {entry['shape'][a]})")
    line2 = " · ".join(parts) + f" · source {Path(source_path).name}"
    if where:
        line2 += " · slice: " + ", ".join(where)
    return line1, line2
