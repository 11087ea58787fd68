"""End-to-end tests of the ``dctchop`` command line (issue #3): real files, the installed executable.

Every test runs ``dctchop`` as a subprocess on inputs made here with numpy/h5py and checks the result with
plain ``zarr.open`` / ``h5py`` / ``json``, never through the library's own reporting alone: PSNR values are
recomputed from the decoded arrays with the documented definition (peak = the dtype's range for integer
data, max - min of the original for floating-point data) and the chop (``--keep``) is checked against a
reference blockwise orthonormal DCT made with ``scipy.fft``.

Each CLI call costs a second or two of start-up, so stores that several tests read are built once per
module, and related checks share one invocation.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import scipy.fft
import zarr

import dctchop

DCTCHOP = Path(sys.executable).parent / "dctchop"
META_FIELDS = ("psnr", "max_abs_error", "rmse", "stored_bytes", "step")
PSNR_TOL = 0.01


# --------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------


def run(*args, cwd=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([str(DCTCHOP), *map(str, args)], check=False, capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


def ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    assert "Traceback" not in p.stderr
    return p


def user_error(p: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 1 with exactly one line ``dctchop: error: ...`` on stderr, no traceback."""
    assert p.returncode == 1, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    lines = [line for line in p.stderr.splitlines() if line.strip() and not _is_layout_line(line)]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("dctchop: error: "), p.stderr
    assert "Traceback" not in p.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


def _is_layout_line(line: str) -> bool:
    pattern = r"^\S+: \[[0-9, ]*\] \w+, layout \w+, (transforming|transformed) axes \["
    return re.match(pattern, line) is not None


def layout_lines(p: subprocess.CompletedProcess) -> dict[str, str]:
    """The printed layout line of each lossy array, by name, normalised to "transformed axes".

    The line's stream and wording have moved (stderr "transforming axes" before compressing, now stdout
    "transformed axes" in the final summary); what it says is what is checked.
    """
    lines = (p.stdout + "\n" + p.stderr).splitlines()
    return {line.split(":")[0]: line.replace("transforming axes", "transformed axes")
            for line in lines if _is_layout_line(line)}


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def snapshot(path: Path) -> dict[str, tuple[bytes, int]]:
    return {str(f.relative_to(path)): (f.read_bytes(), f.stat().st_mtime_ns)
            for f in Path(path).rglob("*") if f.is_file()}


def leftovers(directory: Path, name: str) -> list[str]:
    return sorted(glob.glob(str(Path(directory) / f".{name}.dctchop-*")))


def psnr(x: np.ndarray, y: np.ndarray, peak: float) -> float:
    mse = float(np.mean((y.astype(np.float64) - x.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 20 * math.log10(peak) - 10 * math.log10(mse)


def peak_of(x: np.ndarray) -> float:
    if x.dtype.kind in "iu":
        info = np.iinfo(x.dtype)
        return float(info.max) - float(info.min)
    return float(x.max()) - float(x.min())


def chunk_psnrs(x: np.ndarray, y: np.ndarray, chunk: int) -> list[float]:
    peak = peak_of(x)
    return [psnr(x[s:s + chunk], y[s:s + chunk], peak) for s in range(0, x.shape[0], chunk)]


def open_store(path: Path) -> zarr.Group:
    return zarr.open_group(str(path), mode="r")


def info_of(path: Path) -> dict:
    return open_store(path).attrs["dctchop"]


def decoded(path: Path, name: str) -> np.ndarray:
    return zarr.open(str(path), mode="r")[name][:]


def reference_chop(x: np.ndarray, axes, block, keep, mask="square") -> np.ndarray:
    """Blockwise orthonormal DCT-II along ``axes`` (lengths multiples of ``block``), keep the low
    frequencies (square: i_d < k_d; triangle: sum i_d / k_d < 1), inverse; float64."""
    shape, split = [], []
    for a, n in enumerate(x.shape):
        if a in axes:
            b = block[axes.index(a)]
            assert n % b == 0
            shape += [n // b, b]
            split.append(len(shape) - 1)
        else:
            shape.append(n)
    c = scipy.fft.dctn(x.astype(np.float64).reshape(shape), axes=split, norm="ortho")
    grids = np.meshgrid(*[np.arange(block[i]) for i in range(len(axes))], indexing="ij")
    if mask == "square":
        keep_mask = np.logical_and.reduce([g < k for g, k in zip(grids, keep)])
    else:
        keep_mask = sum(g / k for g, k in zip(grids, keep)) < 1
    full = [1] * len(shape)
    for i, s in enumerate(split):
        full[s] = block[i]
    m = keep_mask.reshape(full)  # split positions increase: only size-1 axes are inserted
    y = scipy.fft.idctn(c * m, axes=split, norm="ortho")
    return y.reshape(x.shape)


def as_dtype(y: np.ndarray, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.clip(np.rint(y), info.min, info.max).astype(dtype)
    return y.astype(dtype)


def smooth_images(n: int, h: int = 32, w: int = 32, c: int = 3, seed: int = 0) -> np.ndarray:
    """uint8 (n, h, w, c): per-image random low-frequency patterns plus a little noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    f = rng.uniform(0.1, 0.6, (n, c, 2))
    ph = rng.uniform(0, 6, (n, c))
    img = 127 + 100 * np.sin(x[None, None] * f[:, :, 0, None, None] + ph[:, :, None, None]) \
        * np.cos(y[None, None] * f[:, :, 1, None, None])
    img = img.transpose(0, 2, 3, 1) + rng.normal(0, 3, (n, h, w, c))
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def smooth_field(shape, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    grids = np.meshgrid(*[np.linspace(0, 1, n) for n in shape], indexing="ij")
    f = np.zeros(shape)
    for k in range(4):
        freq = rng.uniform(1, 6, len(shape))
        f += np.sin(sum(fr * g for fr, g in zip(freq, grids)) * 2 + rng.uniform(0, 6)) / (k + 1)
    return (f + 0.01 * rng.standard_normal(shape)).astype(np.float32)


# --------------------------------------------------------------------------------------------------------
# inputs and shared stores (built once)
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> SimpleNamespace:
    d = tmp_path_factory.mktemp("inputs")
    images = smooth_images(64)
    labels = np.random.default_rng(5).integers(0, 10, 64)
    ids = np.arange(1000, 1064, dtype=np.int32)
    times = np.linspace(0.0, 1.0, 64) ** 2
    # a 2-D field, not a per-sample table: its first axis is not the 64 samples of images (4 chunks of 16)
    aux = smooth_field((60, 16), seed=7)
    with h5py.File(d / "images.h5", "w") as f:
        f.attrs["title"] = "synthetic scenes"
        f.attrs["n_classes"] = np.int64(10)
        f.attrs["mean"] = np.array([0.5, 0.25, 0.125])
        f.attrs["flag"] = True
        f.attrs["complex"] = 1 + 2j  # not JSON-serialisable: dropped
        ds = f.create_dataset("images", data=images)
        ds.attrs["unit"] = "px"
        ds.attrs["scale"] = 2.5
        f.create_dataset("labels", data=labels).attrs["classes"] = np.int64(10)
        g = f.create_group("extra")
        g.attrs["k"] = 1.5
        g.attrs["tags"] = np.array([1, 2, 3])
        g.create_dataset("ids", data=ids)
        g.create_dataset("aux", data=aux).attrs["kind"] = "aux field"
        s = g.create_group("sub")
        s.attrs["note"] = "nested"
        s.create_dataset("t", data=times)
        f.create_group("empty").attrs["why"] = "kept anyway"
    np.save(d / "imgs.npy", images)
    field = smooth_field((32, 32, 32))
    np.save(d / "field.npy", field)
    multi = SimpleNamespace(
        nchw=np.ascontiguousarray(smooth_images(16, seed=2).transpose(0, 3, 1, 2)),
        nzyx=smooth_field((4, 16, 16, 16), seed=3),
        nhw=smooth_images(16, seed=4)[:, :24, :28, 0].copy(),  # the colour stack's size would make it a mask
    )
    with h5py.File(d / "multi.h5", "w") as f:
        f.create_dataset("nchw", data=multi.nchw)
        f.create_dataset("nzyx", data=multi.nzyx)
        f.create_dataset("nhw", data=multi.nhw)
    big = smooth_images(512, seed=9)
    np.save(d / "big.npy", big)
    return SimpleNamespace(dir=d, h5=d / "images.h5", npy=d / "imgs.npy", field_npy=d / "field.npy",
                           multi_h5=d / "multi.h5", big_npy=d / "big.npy", images=images, labels=labels,
                           ids=ids, times=times, aux=aux, field=field, multi=multi, big=big)


@pytest.fixture(scope="module")
def base(data, tmp_path_factory) -> SimpleNamespace:
    """images.h5 with default settings (no quality option), 4 chunks, JSON summary."""
    out = tmp_path_factory.mktemp("base") / "images.zarr"
    p = ok(run("compress", data.h5, out, "--chunk-samples", "16", "--json"))
    return SimpleNamespace(store=out, proc=p, summary=json.loads(p.stdout))


@pytest.fixture(scope="module")
def field_store(data, tmp_path_factory) -> SimpleNamespace:
    """field.npy (float32 3-D) with default settings, 4 chunks of 8 planes."""
    out = tmp_path_factory.mktemp("field") / "field.zarr"
    p = ok(run("compress", data.field_npy, out, "--chunk-samples", "8"))
    return SimpleNamespace(store=out, proc=p)


@pytest.fixture(scope="module")
def psnr45(data, tmp_path_factory) -> SimpleNamespace:
    """imgs.npy with --psnr 45, 4 chunks, 2 workers, --precision int16 (the default, named)."""
    out = tmp_path_factory.mktemp("psnr45") / "imgs.zarr"
    p = ok(run("compress", data.npy, out, "--psnr", "45", "--chunk-samples", "16", "--workers", "2",
               "--precision", "int16"))
    return SimpleNamespace(store=out, proc=p)


# --------------------------------------------------------------------------------------------------------
# version and help
# --------------------------------------------------------------------------------------------------------


def test_version():
    from dctchop._version import __version__

    p = ok(run("--version"))
    assert p.stdout.strip() == f"dctchop, version {__version__}"


def test_console_script_prints_a_message_exit():
    """``run`` leaves with os._exit; a ``sys.exit("message")`` must still print its message and exit 1."""
    code = "import sys; from dctchop.cli import main as m; m.main = lambda: sys.exit('no such thing'); m.run()"
    p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.strip() == "no such thing"


def test_group_help_lists_commands():
    p = ok(run("-h"))
    assert p.stdout.startswith("Usage: dctchop")
    for command in ("compress", "inspect", "decompress"):
        assert command in p.stdout
    assert "--version" in p.stdout and "--debug" in p.stdout


@pytest.mark.parametrize("command, options", [
    ("compress", ["--dataset", "--lossless", "--axes", "--keep", "--ratio", "--psnr", "--block", "--mask",
                  "--precision", "--chunk-samples", "--workers", "--overwrite", "--quiet", "--json",
                  "--progress"]),
    ("inspect", ["--json", "--chunks", "--verify"]),
    ("decompress", ["--overwrite", "--array"]),
])
def test_command_help(command, options):
    p = ok(run(command, "-h"))
    text = " ".join(p.stdout.split())  # undo click's line wrapping
    assert text.startswith(f"Usage: dctchop {command}")
    for option in options:
        assert option in text, option
    if command in ("compress", "inspect"):
        assert "PSNR = 20 log10(peak) - 10 log10(MSE)" in text
        assert "255 for uint8" in text and "max - min" in text


# --------------------------------------------------------------------------------------------------------
# compress: inputs, layouts, selection, store contents
# --------------------------------------------------------------------------------------------------------


def test_compress_h5_defaults_store_layout_and_summary(data, base):
    store, summary = base.store, base.summary
    # the inferred layout and axes (--json: in the summary; the printed line is checked on human output)
    for name, (layout, axes, chunks) in {"images": ("NHWC", [1, 2, 3], [16, 32, 32, 3]),
                                         "extra/aux": ("HW", [0, 1], [16, 16])}.items():
        a = summary["arrays"][name]
        assert (a["layout"], a["axes"], a["chunks"]) == (layout, axes, chunks), name
    assert set(layout_lines(base.proc)) <= {"images", "extra/aux"}
    assert "%|" not in base.proc.stderr  # no progress bar without a TTY

    # --json: valid JSON on stdout only, with ratio/psnr per array and totals
    assert set(summary["arrays"]) == {"images", "extra/aux"}
    assert sorted(summary["lossless"]) == ["extra/ids", "extra/sub/t", "labels"]
    for name, a in summary["arrays"].items():
        for key in ("ratio", "psnr", "psnr_min", "psnr_mean", "max_abs_error", "original_bytes",
                    "stored_bytes"):
            assert key in a, key
        # achieved ratio = original bytes / stored bytes of the array, metadata included
        on_disk = tree_bytes(store / name) + tree_bytes(store / "dctchop_meta" / name)
        assert a["stored_bytes"] == on_disk
        assert a["ratio"] == pytest.approx(a["original_bytes"] / on_disk)
    assert summary["totals"]["lossy_original_bytes"] == data.images.nbytes + data.aux.nbytes
    lossless = data.labels.nbytes + data.ids.nbytes + data.times.nbytes
    assert summary["totals"]["original_bytes"] == data.images.nbytes + data.aux.nbytes + lossless  # as inspect

    # default targets: 40 dB for integer data, 60 dB for floating point
    images, aux = summary["arrays"]["images"], summary["arrays"]["extra/aux"]
    assert images["target"] == {"kind": "psnr", "value": 40.0}
    assert aux["target"] == {"kind": "psnr", "value": 60.0}
    assert images["codec"]["precision"] == "int16"
    for name, x, target in (("images", data.images, 40.0), ("extra/aux", data.aux, 60.0)):
        y = decoded(store, name)
        assert y.shape == x.shape and y.dtype == x.dtype
        per_chunk = chunk_psnrs(x, y, 16)
        assert min(per_chunk) >= target - PSNR_TOL
        assert summary["arrays"][name]["psnr"] == pytest.approx(psnr(x, y, peak_of(x)), abs=1e-6)
        assert summary["arrays"][name]["max_abs_error"] == pytest.approx(
            float(np.max(np.abs(y.astype(np.float64) - x))), abs=1e-9)

    g = open_store(store)
    # lossless copies (1-D datasets): bit-exact, same dtype
    for name, x in (("labels", data.labels), ("extra/ids", data.ids), ("extra/sub/t", data.times)):
        y = g[name][:]
        assert y.dtype == x.dtype and y.tobytes() == x.tobytes(), name

    # groups and JSON-serialisable attributes are kept; the complex attribute is dropped
    root = dict(g.attrs)
    assert root["title"] == "synthetic scenes" and root["n_classes"] == 10
    assert root["mean"] == [0.5, 0.25, 0.125] and root["flag"] is True
    assert "complex" not in root
    assert dict(g["extra"].attrs) == {"k": 1.5, "tags": [1, 2, 3]}
    assert dict(g["extra/sub"].attrs) == {"note": "nested"}
    assert dict(g["empty"].attrs) == {"why": "kept anyway"}
    assert dict(g["images"].attrs) == {"unit": "px", "scale": 2.5}
    assert dict(g["labels"].attrs) == {"classes": 10}
    assert dict(g["extra/aux"].attrs) == {"kind": "aux field"}

    # per-chunk metadata arrays, shaped like the chunk grid
    for name, grid in (("images", (4, 1, 1, 1)), ("extra/aux", (4, 1))):
        for key in META_FIELDS:
            m = g[f"dctchop_meta/{name}/{key}"]
            assert m.shape == grid, (name, key)
        x = data.images if name == "images" else data.aux
        y = decoded(store, name)
        stored_psnr = g[f"dctchop_meta/{name}/psnr"][:].ravel()
        np.testing.assert_allclose(stored_psnr, chunk_psnrs(x, y, 16), rtol=0, atol=1e-6)
        rmse = g[f"dctchop_meta/{name}/rmse"][:].ravel()
        np.testing.assert_allclose(rmse, [math.sqrt(np.mean((y[s:s + 16].astype(float) - x[s:s + 16]) ** 2))
                                          for s in range(0, 64, 16)], rtol=1e-9)
        chunk_files = sorted((store / name).glob("c.*"))
        sizes = [f.stat().st_size for f in chunk_files if f.is_file()]
        assert sorted(g[f"dctchop_meta/{name}/stored_bytes"][:].ravel().tolist()) == sorted(sizes)
        assert np.all(g[f"dctchop_meta/{name}/step"][:] > 0)

    # group attrs: version, source path and dataset, settings, totals
    from dctchop._version import __version__

    info = root["dctchop"]
    assert info["version"] == __version__
    assert info["source"] == {"path": str(data.h5), "kind": "hdf5", "follow_external": False}
    assert info["arrays"]["images"]["source"] == "/images"
    assert info["arrays"]["extra/aux"]["source"] == "/extra/aux"
    assert info["arrays"]["images"]["codec"]["block"] == [8, 8, 3]  # RGB: the channel axis is one block
    assert info["arrays"]["images"]["codec"]["mask"] == "square"
    assert info["arrays"]["images"]["target"] == {"kind": "psnr", "value": 40.0}
    assert info["totals"]["original_bytes"] == summary["totals"]["original_bytes"]
    assert info["totals"]["lossy_stored_bytes"] == summary["totals"]["lossy_stored_bytes"]


def test_compress_npy_float_field_defaults(data, field_store):
    store, p = field_store.store, field_store.proc
    line = layout_lines(p)["data"]
    assert "[32, 32, 32] float32, layout ZYX, transformed axes [0, 1, 2], chunks of 8" in line
    # human summary on stdout
    assert "data: " in p.stdout and "ratio " in p.stdout and "PSNR " in p.stdout
    assert f"-> {store}" in p.stdout
    info = info_of(store)
    a = info["arrays"]["data"]
    assert info["source"] == {"path": str(data.field_npy), "kind": "npy", "follow_external": False}
    assert a["axes"] == [0, 1, 2] and a["layout"] == "ZYX" and a["chunks"] == [8, 32, 32]
    assert a["target"] == {"kind": "psnr", "value": 60.0}
    x, y = data.field, decoded(store, "data")
    assert y.dtype == np.float32
    peak = float(x.max()) - float(x.min())
    assert a["peak"] == pytest.approx(peak)
    per_chunk = chunk_psnrs(x, y, 8)
    assert min(per_chunk) >= 60 - PSNR_TOL
    np.testing.assert_allclose(open_store(store)["dctchop_meta/data/psnr"][:].ravel(), per_chunk, atol=1e-6)
    assert open_store(store)["dctchop_meta/data/psnr"].shape == (4, 1, 1)


def test_compress_layouts_nchw_nzyx_nhw(data, tmp_path):
    out = tmp_path / "multi.zarr"
    p = ok(run("compress", data.multi_h5, out))
    lines = layout_lines(p)
    assert "[16, 3, 32, 32] uint8, layout NCHW, transformed axes [1, 2, 3]" in lines["nchw"]
    assert "[4, 16, 16, 16] float32, layout NZYX, transformed axes [1, 2, 3]" in lines["nzyx"]
    assert "[16, 24, 28] uint8, layout NHW, transformed axes [1, 2]" in lines["nhw"]
    info = info_of(out)
    expect = {"nchw": ([1, 2, 3], "NCHW", 40.0), "nzyx": ([1, 2, 3], "NZYX", 60.0), "nhw": ([1, 2], "NHW", 40.0)}
    for name, (axes, layout, target) in expect.items():
        a = info["arrays"][name]
        assert (a["axes"], a["layout"], a["target"]["value"]) == (axes, layout, target)
        x = getattr(data.multi, name)
        y = decoded(out, name)
        assert psnr(x, y, peak_of(x)) >= target - PSNR_TOL


def test_axes_override_block_and_chop_float32(data, tmp_path):
    out = tmp_path / "axes.zarr"
    p = ok(run("compress", data.field_npy, out, "--axes", "1,2", "--block", "4", "--keep", "2",
               "--precision", "float32"))
    assert "layout custom, transformed axes [1, 2]" in layout_lines(p)["data"]
    a = open_store(out).attrs["dctchop"]["arrays"]["data"]
    assert a["axes"] == [1, 2] and a["layout"] == "custom"
    assert a["codec"]["block"] == [4, 4] and a["codec"]["keep"] == [2, 2]
    assert a["codec"]["precision"] == "float32" and a["target"] == {"kind": "keep", "value": [2]}
    ref = reference_chop(data.field, (1, 2), (4, 4), (2, 2))
    y = decoded(out, "data")
    span = float(data.field.max() - data.field.min())
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * span)


def test_dataset_repeatable_selects_the_lossy_ones_and_the_1d_ones_are_still_copied(data, tmp_path):
    # --dataset used to keep only the named datasets: labels and ids were dropped without a word
    out = tmp_path / "sel.zarr"
    p = ok(run("compress", data.h5, out, "--dataset", "images", "--dataset", "/extra/aux", "--json"))
    summary = json.loads(p.stdout)
    assert set(summary["arrays"]) == {"images", "extra/aux"}
    assert sorted(summary["lossless"]) == ["extra/ids", "extra/sub/t", "labels"]
    assert summary["left_out"] == []
    g = open_store(out)
    for name, x in (("labels", data.labels), ("extra/ids", data.ids), ("extra/sub/t", data.times)):
        assert g[name][:].tobytes() == x.tobytes(), name
    assert decoded(out, "extra/aux").shape == data.aux.shape

    # an unnamed dataset that would be compressed is left out, and the summary says so
    out = tmp_path / "images_only.zarr"
    p = ok(run("compress", data.h5, out, "--dataset", "images"))
    assert "left out (--dataset names the datasets to compress): /extra/aux" in p.stdout
    g = open_store(out)
    assert "aux" not in g["extra"] and g["labels"][:].tobytes() == data.labels.tobytes()
    p = ok(run("compress", data.h5, out, "--dataset", "images", "--json", "--overwrite"))
    assert json.loads(p.stdout)["left_out"] == ["/extra/aux"]


def test_lossless_option_copies_bit_exactly(data, tmp_path):
    out = tmp_path / "ll.zarr"
    p = ok(run("compress", data.h5, out, "--lossless", "extra/aux", "--json"))
    assert set(layout_lines(p)) <= {"images"}
    summary = json.loads(p.stdout)
    assert set(summary["arrays"]) == {"images"}
    assert sorted(summary["lossless"]) == ["extra/aux", "extra/ids", "extra/sub/t", "labels"]
    g = open_store(out)
    y = g["extra/aux"][:]
    assert y.dtype == np.float32 and y.tobytes() == data.aux.tobytes()
    assert not (out / "dctchop_meta" / "extra" / "aux").exists()
    assert dict(g["extra/aux"].attrs) == {"kind": "aux field"}


# --------------------------------------------------------------------------------------------------------
# quality targets and transform options
# --------------------------------------------------------------------------------------------------------


def test_keep_4_is_the_chop_default_float16(data, tmp_path):
    out = tmp_path / "k4.zarr"
    p = ok(run("compress", data.npy, out, "--keep", "4", "--json"))
    a = json.loads(p.stdout)["arrays"]["data"]
    assert a["target"] == {"kind": "keep", "value": [4]}
    assert a["codec"]["keep"] == [4, 4, 3] and a["codec"]["block"] == [8, 8, 3]
    assert a["codec"]["precision"] == "float16" and a["codec"]["mask"] == "square"
    y = decoded(out, "data")
    expected = as_dtype(reference_chop(data.images, (1, 2), (8, 8), (4, 4)), np.uint8)
    diff = np.abs(y.astype(int) - expected)
    assert diff.max() <= 1 and np.mean(diff != 0) < 0.05  # float16 coefficients
    assert a["psnr"] == pytest.approx(psnr(data.images, y, 255.0), abs=1e-6)


def test_keep_4_2_triangle_mask(data, tmp_path):
    out = tmp_path / "k42.zarr"
    p = ok(run("compress", data.npy, out, "--keep", "4,2", "--mask", "triangle", "--precision", "float16",
               "--json"))
    a = json.loads(p.stdout)["arrays"]["data"]
    assert a["codec"]["keep"] == [4, 2, 3] and a["codec"]["mask"] == "triangle"
    assert a["target"] == {"kind": "keep", "value": [4, 2]}
    y = decoded(out, "data")
    # the triangle spans the colour axis too: colour-difference channels keep fewer frequencies than luma
    expected = as_dtype(reference_chop(data.images, (1, 2, 3), (8, 8, 3), (4, 2, 3), "triangle"), np.uint8)
    diff = np.abs(y.astype(int) - expected)
    assert diff.max() <= 1 and np.mean(diff != 0) < 0.05  # float16 coefficients
    # square 4x2 keeps a superset of triangle 4,2: the triangle can only be worse
    square = as_dtype(reference_chop(data.images, (1, 2), (8, 8), (4, 2)), np.uint8)
    assert psnr(data.images, y, 255) < psnr(data.images, square, 255)


# float32 is named in test_axes_override_block_and_chop_float32, float16 in test_keep_4_2_triangle_mask and
# int16 in the psnr45 store; the other two here
@pytest.mark.parametrize("precision, max_diff", [("bfloat16", 4), ("int8", 8)])
def test_keep_with_each_precision(data, tmp_path, precision, max_diff):
    out = tmp_path / f"{precision}.zarr"
    p = ok(run("compress", data.npy, out, "--keep", "4", "--precision", precision, "--json", "--quiet"))
    assert p.stderr == ""
    a = json.loads(p.stdout)["arrays"]["data"]
    assert a["codec"]["precision"] == precision and a["codec"]["keep"] == [4, 4, 3]
    y = decoded(out, "data")
    ref = as_dtype(reference_chop(data.images, (1, 2), (8, 8), (4, 4)), np.uint8)
    assert np.abs(y.astype(int) - ref).max() <= max_diff
    assert psnr(data.images, y, 255) == pytest.approx(psnr(data.images, ref, 255), abs=1.0)
    assert a["psnr"] == pytest.approx(psnr(data.images, y, 255), abs=1e-6)
    # bytes per kept coefficient: float32 4, float16/bfloat16/int16 2, int8 1 (before zstd)
    kept_values = data.images.size // 4
    bound = {"float32": 4, "bfloat16": 2, "int16": 2, "int8": 1}[precision] * kept_values
    assert a["stored_bytes"] < bound * 1.1 + 8192


def test_ratio_8_within_5_percent(data, tmp_path):
    out = tmp_path / "r8.zarr"
    p = ok(run("compress", data.big_npy, out, "--ratio", "8", "--json"))
    a = json.loads(p.stdout)["arrays"]["data"]
    assert a["target"] == {"kind": "ratio", "value": 8.0}
    on_disk = tree_bytes(out / "data") + tree_bytes(out / "dctchop_meta" / "data")
    assert a["stored_bytes"] == on_disk
    assert data.big.nbytes / on_disk == pytest.approx(8, rel=0.05)
    # the search aims at 1% of the sample's ratio, so that the whole array's lands well within 5%
    assert data.big.nbytes / on_disk == pytest.approx(8, rel=0.02)
    y = decoded(out, "data")
    assert a["psnr"] == pytest.approx(psnr(data.big, y, 255.0), abs=1e-6)


def test_ratio_8_small_array_within_5_percent(data, tmp_path):
    out = tmp_path / "r8s.zarr"
    p = ok(run("compress", data.npy, out, "--ratio", "8", "--json", "--quiet"))
    a = json.loads(p.stdout)["arrays"]["data"]
    assert a["ratio"] == pytest.approx(8, rel=0.05)


@pytest.mark.parametrize("target", [("--ratio", "8"), ("--psnr", "60")])
def test_tiny_float_values_compress_like_the_same_data_at_scale_one(data, tmp_path, target):
    # 1e-36: floors at 1e-30 in the step searches made --psnr miss by 40 dB and --ratio start too coarse
    tiny = tmp_path / "tiny.npy"
    np.save(tiny, (data.field.astype(np.float64) * 1e-36).astype(np.float32))
    results = [json.loads(ok(run("compress", src, tmp_path / f"{k}.zarr", *target, "--json", "-q")).stdout)
               ["arrays"]["data"] for k, src in enumerate((data.field_npy, tiny))]
    assert results[1]["ratio"] == pytest.approx(results[0]["ratio"], rel=0.02)
    assert float(results[1]["psnr"]) == pytest.approx(float(results[0]["psnr"]), abs=0.1)
    if target[0] == "--psnr":
        assert float(results[1]["psnr_min"]) >= 60


def test_psnr_45_every_chunk_in_inspect(data, psnr45):
    line = layout_lines(psnr45.proc)["data"]
    assert "layout NHWC, transformed axes [1, 2, 3], chunks of 16" in line
    p = ok(run("inspect", psnr45.store, "--json", "--chunks"))
    report = json.loads(p.stdout)
    a = report["arrays"]["data"]
    assert a["target"] == {"kind": "psnr", "value": 45.0} and a["codec"]["precision"] == "int16"
    table = a["chunk_table"]
    assert len(table["psnr"]) == 4  # --chunk-samples 16 of 64
    assert set(table) >= set(META_FIELDS)
    assert min(table["psnr"]) >= 45 - PSNR_TOL
    y = decoded(psnr45.store, "data")
    mine = chunk_psnrs(data.images, y, 16)
    np.testing.assert_allclose(table["psnr"], mine, atol=1e-6)
    assert a["psnr_min"] == pytest.approx(min(mine), abs=1e-6)
    assert a["psnr_mean"] == pytest.approx(np.mean(mine), abs=1e-6)
    assert a["psnr_max"] == pytest.approx(max(mine), abs=1e-6)
    assert a["psnr"] == pytest.approx(psnr(data.images, y, 255.0), abs=1e-6)
    errs = [float(np.abs(y[s:s + 16].astype(int) - data.images[s:s + 16]).max()) for s in range(0, 64, 16)]
    assert table["max_abs_error"] == errs and a["max_abs_error"] == max(errs)


def test_workers_1_and_2_identical_and_quiet(data, psnr45, tmp_path):
    out = tmp_path / "w1.zarr"
    p = ok(run("compress", data.npy, out, "--psnr", "45", "--chunk-samples", "16", "--workers", "1",
               "--precision", "int16", "--quiet"))
    assert p.stdout == "" and p.stderr == ""
    assert np.array_equal(decoded(out, "data"), decoded(psnr45.store, "data"))
    g1, g2 = open_store(out), open_store(psnr45.store)
    for key in META_FIELDS:
        assert np.array_equal(g1[f"dctchop_meta/data/{key}"][:], g2[f"dctchop_meta/data/{key}"][:]), key
    a1, a2 = g1.attrs["dctchop"]["arrays"]["data"], g2.attrs["dctchop"]["arrays"]["data"]
    assert {k: v for k, v in a1.items()} == {k: v for k, v in a2.items()}
    for f in (out / "data").glob("c.*"):
        if f.is_file():
            assert f.read_bytes() == (psnr45.store / f.relative_to(out)).read_bytes()


def test_two_targets_is_a_usage_error(data, tmp_path):
    out = tmp_path / "x.zarr"
    p = run("compress", data.npy, out, "--ratio", "8", "--psnr", "40")
    assert p.returncode == 2, p.stderr
    assert "at most one of --keep, --ratio, --psnr" in p.stderr and "Traceback" not in p.stderr
    assert not out.exists() and not leftovers(tmp_path, out.name)


def test_ratio_with_float_precision_is_a_user_error(data, tmp_path):
    out = tmp_path / "x.zarr"
    user_error(run("compress", data.npy, out, "--ratio", "8", "--precision", "float16"),
               "integer precision")
    assert not out.exists() and not leftovers(tmp_path, out.name)


def test_chunk_samples_must_be_whole_blocks_along_transformed_axis_0(data, tmp_path):
    out = tmp_path / "x.zarr"
    user_error(run("compress", data.field_npy, out, "--chunk-samples", "5"), "--chunk-samples", "multiple")
    assert not out.exists()


def test_zstd_level_sets_the_lossless_stage_of_every_array(data, tmp_path):
    out = tmp_path / "fast.zarr"
    ok(run("compress", data.h5, out, "--zstd-level", "-3", "--quiet"))
    group = open_store(out)
    assert {group[name].compressors[0].level for name in ("images", "labels")} == {-3}
    assert "mask square, precision int16, zstd level -3" in ok(run("inspect", out)).stdout


@pytest.mark.parametrize("level", ["23", "-131073"])
def test_zstd_level_out_of_range_is_a_user_error(data, tmp_path, level):
    out = tmp_path / "x.zarr"
    user_error(run("compress", data.npy, out, "--zstd-level", level), "--zstd-level must be from -131072 to 22")
    assert not out.exists() and not leftovers(tmp_path, out.name)


# --------------------------------------------------------------------------------------------------------
# output handling: overwrite, progress, atomicity
# --------------------------------------------------------------------------------------------------------


def test_overwrite_refused_then_replaced_with_progress(data, psnr45, tmp_path):
    out = tmp_path / "ow.zarr"
    shutil.copytree(psnr45.store, out)
    before = snapshot(out)
    user_error(run("compress", data.npy, out, "--keep", "2"), "exists", "--overwrite")
    assert snapshot(out) == before
    p = ok(run("compress", data.npy, out, "--keep", "2", "--overwrite", "--progress"))
    assert info_of(out)["arrays"]["data"]["target"] == {"kind": "keep", "value": [2]}
    assert "compress: 100%|" in p.stderr and "197k/197k" in p.stderr  # the tqdm bar over input bytes
    assert not leftovers(tmp_path, out.name)
    assert sorted(os.listdir(tmp_path)) == ["ow.zarr"]


def test_overwrite_regular_file_leaves_nothing_behind(data, tmp_path):
    out = tmp_path / "ow.zarr"
    out.write_text("not a store")
    ok(run("compress", data.npy, out, "--keep", "4", "--overwrite", "--quiet"))
    assert out.is_dir()
    assert sorted(os.listdir(tmp_path)) == ["ow.zarr"]


def test_a_directory_that_is_not_a_store_is_refused_without_advice_to_overwrite(data, tmp_path):
    """An empty directory as OUTPUT was told "exists; pass ... --overwrite", which then refused it."""
    out = tmp_path / "empty"
    out.mkdir()
    for overwrite in ((), ("--overwrite",)):
        err = user_error(run("compress", data.npy, out, *overwrite), f"output {out} is a directory that is not a "
                         "dctchop store; refusing to replace it")
        assert "pass" not in err
    assert sorted(os.listdir(tmp_path)) == ["empty"] and os.listdir(out) == []


def test_overwrite_never_replaces_a_fifo_or_device(data, psnr45, tmp_path):
    """Run as root, `--overwrite` once made /dev/null a directory. A FIFO stands in for a device (making one
    needs no privileges); /dev/null itself only without --overwrite, which cannot harm it if this regresses."""
    fifo = tmp_path / "pipe.npy"
    os.mkfifo(fifo)
    for args in [("compress", data.npy, fifo, "--overwrite"), ("compress", data.npy, f"file://{fifo}", "--overwrite"),
                 ("compress", data.npy, fifo), ("decompress", psnr45.store, fifo, "--overwrite")]:
        user_error(run(*args), f"{fifo} is a device, FIFO or socket, not a file; refusing to replace it")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(os.listdir(tmp_path)) == ["pipe.npy"]
    user_error(run("compress", data.npy, "/dev/null"), "/dev/null is a device")
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)


def test_an_output_that_is_a_link_to_nothing_exists(data, psnr45, tmp_path):
    """compress failed after all its work with 'Not a directory' on a dangling link; decompress replaced it
    without --overwrite. Both now treat it as an existing output, and --overwrite replaces the link only."""
    for out, args in ((tmp_path / "dl.zarr", ("compress", data.npy)),
                      (tmp_path / "dl.npy", ("decompress", psnr45.store))):
        out.symlink_to(tmp_path / "nowhere")
        user_error(run(*args, out), f"output {out} exists")
        assert out.is_symlink()
        ok(run(*args, out, "--overwrite"))
        assert not out.is_symlink() and out.exists() and not (tmp_path / "nowhere").exists()


def test_decompress_refuses_a_url_output(psnr45, tmp_path):
    user_error(run("decompress", psnr45.store, f"file://{tmp_path}/x.h5"), "is a URL; name a local file ending in .npy, .h5 or .hdf5")
    assert os.listdir(tmp_path) == []


def test_compress_refuses_an_output_inside_a_store_and_says_why_nothing_is_lossy(data, tmp_path):
    store = tmp_path / "a.zarr"
    ok(run("compress", data.field_npy, store, "--quiet"))
    before = snapshot(store)
    user_error(run("compress", data.field_npy, store / "inner.zarr"), "must not be inside the Zarr store")
    assert snapshot(store) == before
    user_error(run("compress", data.field_npy, tmp_path / "b.zarr", "--lossless", "field"),
               "nothing to compress lossily (every array is copied losslessly: data); leave out --lossless")
    user_error(run("compress", data.field_npy, tmp_path / "c.zarr", "--mask", "triangle", "--psnr", "90"),
               "above what this data allows with int16 and the triangle mask")


def test_an_error_quoting_a_name_with_a_line_break_is_still_one_line(tmp_path):
    """HDF5 names may hold a line break; the list of names in "no dataset ..." printed it as it is."""
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["two\nlines"] = np.zeros((4, 16, 16), np.uint8)
        f["and\u2028more"] = np.zeros((4, 16, 16), np.uint8)  # a break for str.splitlines too
    user_error(run("compress", tmp_path / "in.h5", tmp_path / "o.zarr", "--dataset", "nope"), "two\\nlines",
               "and\\u2028more")


def test_failed_compress_unreachable_ratio_leaves_nothing(data, tmp_path):
    out = tmp_path / "fail.zarr"
    user_error(run("compress", data.npy, out, "--ratio", "1e9"), "unreachable")
    assert not out.exists() and not leftovers(tmp_path, out.name)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_coefficients_beyond_the_precision_are_one_line_naming_the_chunk(tmp_path, precision):
    # float64 near 1e138 compared with float32's smallest normal number raised numpy's overflow warning,
    # printed as a line of its own before the error, which named no array
    src = tmp_path / "huge.npy"
    np.save(src, np.random.default_rng(0).random((16, 16, 16)) * 1e138)
    out = tmp_path / "fail.zarr"
    user_error(run("compress", src, out, "--keep", "4", "--precision", precision),
               f"data: chunk 0: coefficients overflow {precision}")
    assert not out.exists() and not leftovers(tmp_path, out.name)


def test_failed_compress_unsupported_dtype_leaves_nothing(tmp_path):
    src = tmp_path / "ints.npy"
    np.save(src, np.arange(8 * 16 * 16, dtype=np.int32).reshape(8, 16, 16))
    out = tmp_path / "fail.zarr"
    user_error(run("compress", src, out), "unsupported dtype int32")
    assert not out.exists() and not leftovers(tmp_path, out.name)
    h5 = tmp_path / "ints.h5"
    with h5py.File(h5, "w") as f:
        f["images"] = np.zeros((8, 16, 16), np.uint8)
        f["ids"] = np.load(src)
    user_error(run("compress", h5, out, "--dataset", "ids"), "unsupported dtype int32 for lossy compression",
               "copy it bit-exactly with --lossless ids")
    assert not out.exists() and not leftovers(tmp_path, out.name)


@pytest.mark.parametrize("dtype, value", [("float32", 1e38), ("float64", 1e300)])
def test_failed_compress_values_too_large_leaves_nothing(tmp_path, dtype, value):
    # float32: the transform overflowed and the store decoded to NaN; float64: an internal OverflowError
    src = tmp_path / "big.npy"
    np.save(src, np.linspace(-value, value, 8 * 16 * 16).astype(dtype).reshape(8, 16, 16))
    out = tmp_path / "fail.zarr"
    user_error(run("compress", src, out), f"values up to {value:.3g} are too large for the {dtype} transform")
    assert not out.exists() and not leftovers(tmp_path, out.name)


def test_constant_float_array_compresses_with_peak_one(tmp_path):
    # its max - min is 0, which made every PSNR -inf and the default --psnr 60 impossible
    src, out = tmp_path / "const.npy", tmp_path / "const.zarr"
    np.save(src, np.full((8, 16, 16), 3.25, np.float32))
    ok(run("compress", "-q", src, out))
    info = json.loads(ok(run("inspect", out, "--json")).stdout)
    array = info["arrays"]["data"]
    assert array["peak"] == 1.0 and float(array["psnr"]) >= 60.0  # JSON writes an exact decode's inf as "inf"
    assert np.all(decoded(out, "data") == 3.25)  # stored relative to its offset, 3.25: all zeros, exact


@pytest.mark.parametrize("dtype, offset", [("uint16", 0), ("int16", -2048)])
def test_16_bit_samples_are_measured_against_their_own_range(tmp_path, dtype, offset):
    """12-bit images in a 16-bit dtype (microscopy, CT): against the dtype's 65535 the default 40 dB let RMS
    errors reach 655, a sixth of their range. Measured against their own range, 40 dB is an RMS error of 1%
    of it, and inspect --verify agrees with what the store recorded."""
    y, x = np.mgrid[0:64, 0:64]
    images = [2047 + 1500 * np.sin(x / (5 + k) + y / 7) + 500 * np.cos(y / (3 + k)) for k in range(16)]
    data = (np.clip(np.round(images), 0, 4095) + offset).astype(dtype)
    src, out = tmp_path / "x.npy", tmp_path / "x.zarr"
    np.save(src, data)
    ok(run("compress", "-q", src, out))
    array = json.loads(ok(run("inspect", out, "--json", "--verify", src)).stdout)["arrays"]["data"]
    peak = float(data.max()) - float(data.min())
    assert array["peak"] == peak > 3000
    mse = np.mean((decoded(out, "data").astype(np.float64) - data) ** 2)
    assert 40 <= 20 * np.log10(peak) - 10 * np.log10(mse) == pytest.approx(float(array["psnr"]))
    assert np.sqrt(mse) <= peak / 100


def test_failed_overwrite_keeps_old_store(data, psnr45, tmp_path):
    src = tmp_path / "nan.npy"
    x = data.field.copy()
    x[20, 3, 4] = np.nan
    np.save(src, x)
    out = tmp_path / "old.zarr"
    shutil.copytree(psnr45.store, out)
    before = snapshot(out)
    user_error(run("compress", src, out, "--overwrite"), "NaN", "[20, 3, 4]")
    assert snapshot(out) == before
    assert not leftovers(tmp_path, out.name)


def test_interrupt_leaves_no_output(data, tmp_path, signals_by_default):
    out = tmp_path / "sig.zarr"
    proc = subprocess.Popen([*signals_by_default, str(DCTCHOP), "compress", str(data.big_npy), str(out),
                             "--psnr", "60", "--workers", "1", "--chunk-samples", "8",
                             "--zstd-level", "19"],  # slow on any machine
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # interrupt while chunks are being written into the temporary sibling
    deadline = time.monotonic() + 60
    while (not glob.glob(str(tmp_path / f".{out.name}.dctchop-tmp-*" / "data" / "c.*"))
           and proc.poll() is None and time.monotonic() < deadline):
        time.sleep(0.002)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("compress finished before the interrupt arrived")
    assert proc.returncode == 130, err
    assert "dctchop: interrupted" in err and "Traceback" not in err
    assert not out.exists() and not leftovers(tmp_path, out.name)


# --------------------------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------------------------


def test_inspect_human_with_chunks_and_verify(data, base):
    p = ok(run("inspect", base.store, "--chunks", "--verify", data.h5))
    out = p.stdout
    assert out.startswith(f"store {base.store} (dctchop ")
    assert f"from {data.h5})" in out.splitlines()[0]
    assert "images: [64, 32, 32, 3] uint8, layout NHWC, axes [1, 2, 3], chunks [16, 32, 32, 3]" in out
    assert "extra/aux: [60, 16] float32, layout HW, axes [0, 1], chunks [16, 16]" in out
    assert "target psnr 40.0; block [8, 8, 3], keep [8, 8, 3], mask square, precision int16, zstd level 1" in out
    a = base.summary["arrays"]["images"]
    assert f"ratio {a['ratio']:.2f}" in out
    assert f"PSNR {a['psnr']:.2f} dB (chunks min {a['psnr_min']:.2f}" in out
    # the --chunks table: a header and one row per chunk, for each lossy array
    assert out.count("chunk     psnr") == 2
    rows = [line.split() for line in out.splitlines()
            if line.strip()[:1].isdigit() and len(line.split()) == 6]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"] * 2
    g = open_store(base.store)
    order = [name for name in base.summary["arrays"]]  # arrays are reported in store order
    assert out.index(f"\n{order[0]}: ") < out.index(f"\n{order[1]}: ")
    for k, name in enumerate(order):
        table = g[f"dctchop_meta/{name}/psnr"][:].ravel()
        assert [float(r[1]) for r in rows[4 * k:4 * k + 4]] == pytest.approx(table.tolist(), abs=0.006)
        errors = g[f"dctchop_meta/{name}/max_abs_error"][:].ravel()
        assert [float(r[2]) for r in rows[4 * k:4 * k + 4]] == pytest.approx(errors.tolist(), rel=1e-3)
        sizes = g[f"dctchop_meta/{name}/stored_bytes"][:].ravel()
        assert [int(r[4]) for r in rows[4 * k:4 * k + 4]] == sizes.tolist()
    for name in ("labels", "extra/ids", "extra/sub/t"):
        assert f"\n{name}: " in out and "lossless" in out
    assert "total: " in out
    assert "verify images: 4 chunk(s) checked, ok" in out
    assert "verify extra/aux: 4 chunk(s) checked, ok" in out
    assert "verify labels: lossless copy, ok" in out  # the copies are checked too, and said so


def test_inspect_json_matches_recomputation(data, base):
    p = ok(run("inspect", base.store, "--json", "--chunks"))
    report = json.loads(p.stdout)
    assert report["store"] == str(base.store)
    assert report["source"] == {"path": str(data.h5), "kind": "hdf5", "follow_external": False}
    for name, x in (("images", data.images), ("extra/aux", data.aux)):
        a = report["arrays"][name]
        y = decoded(base.store, name)
        assert a["shape"] == list(x.shape) and a["dtype"] == str(x.dtype)
        assert a["axes"] == ([1, 2, 3] if name == "images" else [0, 1])
        assert a["target"]["kind"] == "psnr" and set(a["codec"]) >= {"block", "keep", "mask", "precision"}
        on_disk = tree_bytes(base.store / name) + tree_bytes(base.store / "dctchop_meta" / name)
        assert a["original_bytes"] == x.nbytes
        assert a["stored_bytes"] == on_disk == base.summary["arrays"][name]["stored_bytes"]
        assert a["ratio"] == pytest.approx(x.nbytes / on_disk)
        mine = chunk_psnrs(x, y, 16)
        assert a["psnr"] == pytest.approx(psnr(x, y, peak_of(x)), abs=1e-6)
        assert a["psnr_min"] == pytest.approx(min(mine), abs=1e-6)
        assert a["psnr_mean"] == pytest.approx(float(np.mean(mine)), abs=1e-6)
        assert a["psnr_max"] == pytest.approx(max(mine), abs=1e-6)
        assert a["max_abs_error"] == pytest.approx(float(np.abs(y.astype(np.float64) - x).max()), abs=1e-9)
        assert a["chunk_table"]["psnr"] == pytest.approx(mine, abs=1e-6)
        assert len(a["chunk_table"]["stored_bytes"]) == 4
    assert set(report["lossless"]) == {"labels", "extra/ids", "extra/sub/t"}
    assert report["lossless"]["labels"] == {"shape": [64], "dtype": "int64", "original_bytes": 512,
                                            "stored_bytes": tree_bytes(base.store / "labels"), "damaged_chunks": []}
    t = report["totals"]
    original = data.images.nbytes + data.aux.nbytes + data.labels.nbytes + data.ids.nbytes + data.times.nbytes
    assert t["original_bytes"] == original
    assert t["stored_bytes"] == tree_bytes(base.store)
    assert t["ratio"] == pytest.approx(original / tree_bytes(base.store))


def test_inspect_verify_float_json(data, field_store):
    p = ok(run("inspect", field_store.store, "--json", "--verify", data.field_npy))
    report = json.loads(p.stdout)
    assert report["verify"] == {"data": {"chunks": 4, "mismatches": []}}
    a = report["arrays"]["data"]
    y = decoded(field_store.store, "data")
    peak = float(data.field.max()) - float(data.field.min())  # float: max - min of the original
    assert a["psnr"] == pytest.approx(psnr(data.field, y, peak), abs=1e-6)
    assert a["psnr_min"] == pytest.approx(min(chunk_psnrs(data.field, y, 8)), abs=1e-6)
    assert a["psnr_min"] >= 60 - PSNR_TOL


def test_inspect_verify_against_another_array_says_what_it_holds(data, field_store, tmp_path):
    """It said 'other.npy has no array field of shape ...': the stem of the file the store was made from."""
    other = tmp_path / "other.npy"
    np.save(other, np.zeros((3, 3), np.float32))
    shape = list(data.field.shape)
    user_error(run("inspect", field_store.store, "--verify", other),
               f"{other}: other is float32[3, 3], not the float32{shape} the store was made from: cannot verify data")


def test_inspect_with_verify_checks_the_chunk_files_once(data, field_store, monkeypatch):
    """The damage check that inspect makes is the one verification relies on: not a second pass."""
    import dctchop.inspect as inspect_module

    checked = []
    check_array = inspect_module.check_array
    monkeypatch.setattr(inspect_module, "check_array", lambda *args: checked.append(args[1]) or check_array(*args))
    report = inspect_module.inspect_store(field_store.store, verify=data.field_npy)
    assert report["verify"] == {"data": {"chunks": 4, "mismatches": []}}
    assert checked == ["data"]


def test_inspect_verify_fails_against_modified_source(data, base, tmp_path):
    modified = tmp_path / "images.h5"
    shutil.copy(data.h5, modified)
    with h5py.File(modified, "r+") as f:
        x = f["images"][20:22]
        f["images"][20:22] = 255 - x  # chunk 1 only
    p = run("inspect", base.store, "--verify", modified)
    user_error(p, "verification failed")
    assert "verify images: 4 chunk(s) checked, 1 mismatching chunk(s)" in p.stdout
    assert "verify extra/aux: 4 chunk(s) checked, ok" in p.stdout


def test_inspect_verify_fails_when_only_a_stored_max_error_is_wrong(data, base, tmp_path):
    """--verify compares both figures of each chunk: a max error recorded 1 too high, PSNR left as it was."""
    store = tmp_path / "s.zarr"
    shutil.copytree(base.store, store)
    element = store / "dctchop_meta" / "images" / "max_abs_error" / "c.1.0.0.0"
    value = np.frombuffer(element.read_bytes(), "<f8")
    element.write_bytes((value + 1).astype("<f8").tobytes())
    p = run("inspect", store, "--verify", data.h5)
    user_error(p, "verification failed")
    assert "verify images: 4 chunk(s) checked, 1 mismatching chunk(s)" in p.stdout


def test_inspect_verify_finds_one_value_changed_by_one(data, base, tmp_path):
    """A relative tolerance of 1e-6 on PSNR let a uint8 pixel changed by 1 through (it moves PSNR by 2e-8)."""
    modified = tmp_path / "images.h5"
    shutil.copy(data.h5, modified)
    with h5py.File(modified, "r+") as f:
        f["images"][0, 0, 0, 0] = f["images"][0, 0, 0, 0] ^ 1
    p = run("inspect", base.store, "--verify", modified)
    user_error(p, "verification failed")
    assert "verify images: 4 chunk(s) checked, 1 mismatching chunk(s)" in p.stdout


def test_inspect_verify_detects_a_lossless_array_of_another_dtype(data, base, tmp_path):
    modified = tmp_path / "images.h5"
    shutil.copy(data.h5, modified)
    with h5py.File(modified, "r+") as f:
        labels = f["labels"][...]
        del f["labels"]
        f["labels"] = labels.astype(np.int32 if labels.dtype != np.int32 else np.int64)  # the same values
    p = run("inspect", base.store, "--verify", modified)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "verify labels: lossless copy, differs from the source" in p.stdout


def test_inspect_verify_detects_changed_lossless_array(data, base, tmp_path):
    modified = tmp_path / "images.h5"
    shutil.copy(data.h5, modified)
    with h5py.File(modified, "r+") as f:
        f["labels"][0] = f["labels"][0] + 1
    p = run("inspect", base.store, "--verify", modified)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "verification failed: labels differ" in p.stderr


def test_inspect_verify_against_renamed_identical_npy(data, psnr45, tmp_path):
    copy = tmp_path / "copy.npy"
    shutil.copy(data.npy, copy)
    p = run("inspect", psnr45.store, "--verify", copy)
    assert p.returncode == 0, p.stderr
    assert "verify data: 4 chunk(s) checked, ok" in p.stdout


def test_inspect_human_with_exact_reconstruction(data, tmp_path):
    out = tmp_path / "exact.zarr"
    # uint8 data, all 64 coefficients kept in float32: decodes exactly (PSNR inf)
    ok(run("compress", data.npy, out, "--keep", "8", "--precision", "float32", "--quiet"))
    assert np.array_equal(decoded(out, "data"), data.images)
    p = run("inspect", out)
    assert p.returncode == 0, p.stderr
    assert "PSNR inf dB" in p.stdout


# --------------------------------------------------------------------------------------------------------
# decompress
# --------------------------------------------------------------------------------------------------------


def test_decompress_single_array_store_to_npy(psnr45, tmp_path):
    out = tmp_path / "restored.npy"
    p = ok(run("decompress", psnr45.store, out))
    assert f"wrote data -> {out}" in p.stderr
    y = np.load(out)
    expected = decoded(psnr45.store, "data")
    assert y.dtype == expected.dtype and np.array_equal(y, expected)
    assert sorted(os.listdir(tmp_path)) == ["restored.npy"]


def test_decompress_removes_the_temporaries_of_killed_runs(psnr45, tmp_path, dead_pid):
    """A decompress killed with SIGKILL leaves its hidden temporary (as large as the output); the next run
    removes it, as compress does for stores. A live process's is left alone."""
    killed = tmp_path / f".out.npy.dctchop-tmp-{dead_pid}"
    live = tmp_path / f".out.npy.dctchop-tmp-{os.getpid()}"
    killed.write_bytes(b"x" * 1000)
    live.write_bytes(b"y")
    ok(run("decompress", psnr45.store, tmp_path / "out.npy"))
    assert sorted(os.listdir(tmp_path)) == [live.name, "out.npy"]


def test_decompress_to_npy_lists_what_it_leaves_out(tmp_path):
    src = tmp_path / "a.h5"
    with h5py.File(src, "w") as f:
        f["g/x"] = np.zeros((4, 16, 16), np.uint8)
        f["g/x"].attrs.update({"units": "K", "scale": 2.0})
        f.attrs["title"] = "t"
        f["alias"] = h5py.SoftLink("/g/x")
    ok(run("compress", src, tmp_path / "a.zarr", "--quiet"))
    p = ok(run("decompress", tmp_path / "a.zarr", tmp_path / "a.npy"))
    assert p.stderr.splitlines()[1] == ("left out (.npy holds one array; write .h5 to keep them): the root's attributes "
                                        "title; g/x's attributes scale, units; groups g; links /alias")
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.zeros((4, 16, 16), np.uint8))
    ok(run("compress", tmp_path / "a.npy", tmp_path / "b.zarr", "--quiet"))  # nothing to leave out: no such line
    assert len(ok(run("decompress", tmp_path / "b.zarr", tmp_path / "b.npy")).stderr.splitlines()) == 1


def test_decompress_into_the_store_is_refused(psnr45, tmp_path):
    store = tmp_path / "s.zarr"
    shutil.copytree(psnr45.store, store)
    before = snapshot(store)
    user_error(run("decompress", store, store / "data" / "x.npy"), "must not be the store", "or inside it")
    user_error(run("decompress", f"file://{store}", store / "x.npy"), "must not be the store")  # a URL too
    named_h5 = tmp_path / "s.h5"  # a store named like the output it is asked for
    shutil.copytree(psnr45.store, named_h5)
    user_error(run("decompress", named_h5, named_h5, "--overwrite"), "must not be the store")
    user_error(run("decompress", store, named_h5, "--overwrite"), "is a directory")
    other = tmp_path / "other.zarr"  # inside another store it would become part of that one
    shutil.copytree(psnr45.store, other)
    user_error(run("decompress", store, other / "x.npy"), f"must not be inside the Zarr store {other}")
    user_error(run("decompress", store, f"{tmp_path}/new.npy/"), "names a directory")  # not a file new.npy
    user_error(run("decompress", store, tmp_path / "new.txt"), "must end in .npy, .h5 or .hdf5")
    assert snapshot(store) == before and not (tmp_path / "new.npy").exists()
    assert not (other / "x.npy").exists()


def test_decompress_to_h5_restores_arrays_groups_attrs(data, base, tmp_path):
    out = tmp_path / "restored.h5"
    p = ok(run("decompress", base.store, out))
    assert "wrote " in p.stderr and f"-> {out}" in p.stderr
    with h5py.File(out, "r") as f, h5py.File(data.h5, "r") as src:
        # lossy arrays: what zarr decodes; lossless ones: bit-exact copies of the source
        for name in ("images", "extra/aux"):
            assert f[name].dtype == src[name].dtype
            assert np.array_equal(f[name][:], decoded(base.store, name))
        for name in ("labels", "extra/ids", "extra/sub/t"):
            assert f[name].dtype == src[name].dtype and f[name][:].tobytes() == src[name][:].tobytes()
        assert "dctchop_meta" not in f and "dctchop" not in f.attrs

        def objects(h):
            found = {}
            h.visititems(lambda n, o: found.__setitem__(n, type(o).__name__))
            return found

        assert objects(f) == objects(src)
        for path in ["/", *objects(src)]:
            want = {k: v for k, v in src[path].attrs.items() if k != "complex"}
            got = dict(f[path].attrs)
            assert set(got) == set(want), path
            for k, value in want.items():
                assert np.array_equal(np.asarray(got[k]), np.asarray(value)), (path, k)


def test_hdf5_links_are_recorded_read_and_restored(tmp_path):
    """Soft and extra hard links are stored once, under the object's own path; the store records them, so
    names through them read their target, ``inspect`` lists them and ``decompress`` recreates them."""
    src = tmp_path / "links.h5"
    images = np.random.default_rng(3).integers(0, 256, (40, 16, 16), dtype=np.uint8)
    with h5py.File(src, "w") as f:
        f["data/images"] = images
        f["data/labels"] = np.arange(40)
        f["train"] = h5py.SoftLink("/data")  # a group alias
        f["data/imgs"] = h5py.SoftLink("images")  # relative
        f["labels_too"] = f["data/labels"]  # a second hard link
        f["dangling"] = h5py.SoftLink("/nowhere")
    store, out = tmp_path / "s.zarr", tmp_path / "out.h5"
    said = ok(run("compress", src, store)).stdout
    assert "soft links not kept (they name nothing in the file): /dangling -> /nowhere" in said
    report = json.loads(ok(run("inspect", store, "--json")).stdout)
    assert sorted(report["arrays"]) == ["data/images"] and report["lossless"].keys() == {"data/labels"}
    assert report["links"] == [{"path": "/data/imgs", "target": "/data/images", "kind": "soft"},
                               {"path": "/labels_too", "target": "/data/labels", "kind": "hard"},
                               {"path": "/train", "target": "/data", "kind": "soft"}]
    assert "/train -> /data (soft)" in ok(run("inspect", store)).stdout
    ds = dctchop.open(store)
    for name in ("train/imgs", "/data/imgs", "train/images"):
        assert name in ds and ds[name].name == "data/images"
    assert np.array_equal(ds["labels_too"][:], np.arange(40)) and "train/nowhere" not in ds
    assert dctchop.open(store, main="train/images").main.name == "data/images"

    ok(run("decompress", store, out))
    with h5py.File(out, "r") as f:
        assert f.get("train", getlink=True).path == "/data"
        assert f.get("data/imgs", getlink=True).path == "/data/images"
        assert isinstance(f.get("labels_too", getlink=True), h5py.HardLink) and f["labels_too"] == f["data/labels"]
        assert np.array_equal(f["train/imgs"][:], decoded(store, "data/images")) and "dangling" not in f


def test_records_are_copied_as_bytes_and_read_back_as_records(tmp_path):
    """HDF5 compound (nested, with a sub-array field) and opaque datasets: plain Zarr sees their bytes, dctchop
    reads and decompresses them with their dtype; a scalar compound too."""
    import dctchop

    wide = np.arange(24, dtype=np.longdouble).reshape(12, 2) / 3  # float128 where the platform has it
    rec = np.zeros(12, dtype=[("v", "<f4", (3,)), ("n", [("x", "u1"), ("y", "<i2")])])
    rec["v"], rec["n"]["x"] = np.arange(36).reshape(12, 3), np.arange(12)
    blob = np.array([np.void(bytes([i, 255 - i, 7])) for i in range(12)])
    one = np.array((1.5, 2), dtype=[("a", "<f8"), ("b", "<i4")])
    src, store, out = tmp_path / "rec.h5", tmp_path / "rec.zarr", tmp_path / "out.h5"
    with h5py.File(src, "w") as f:
        f["images"] = np.random.default_rng(1).integers(0, 256, (12, 16, 16), dtype=np.uint8)
        f["rec"], f["blob"], f["one"], f["wide"] = rec, blob, one, wide
    ok(run("compress", src, store, "--quiet"))
    assert zarr.open(str(store), mode="r")["rec"].dtype == np.uint8  # the bytes, for plain Zarr
    report = json.loads(ok(run("inspect", store, "--json")).stdout)
    assert report["lossless"]["rec"]["dtype"] == str(rec.dtype) and report["lossless"]["rec"]["shape"] == [12]
    ds = dctchop.open(store)
    assert ds["one"][()].tobytes() == one.tobytes() and ds["one"]["a"] == 1.5  # numpy's keys on a scalar
    for name, want in (("rec", rec), ("blob", blob), ("one", one), ("wide", wide)):
        got = ds[name][...]
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), name
    assert ds["rec"][3:5].tobytes() == rec[3:5].tobytes()
    ok(run("inspect", store, "--verify", src))
    ok(run("decompress", store, out))
    with h5py.File(out, "r") as f:
        for name, want in (("rec", rec), ("blob", blob), ("one", one), ("wide", wide)):
            assert f[name].dtype == want.dtype and f[name][()].tobytes() == want.tobytes(), name


def test_decompress_restores_numeric_attribute_dtypes(tmp_path):
    """Attributes travel as JSON, which widens int16 to int64 and float32 to float64; CF readers take the
    dtype of scale_factor/add_offset for the decoded data, so decompress gives them back as they were."""
    src, store, out = tmp_path / "cf.h5", tmp_path / "cf.zarr", tmp_path / "out.h5"
    with h5py.File(src, "w") as f:
        f["t"] = np.random.default_rng(5).normal(size=(8, 16, 16)).astype(np.float32)
        f["t"].attrs.update({"scale_factor": np.float32(0.01), "add_offset": np.float32(273.15),
                             "valid_range": np.array([-300, 300], np.int16), "count": np.int64(3), "units": "K"})
        f.attrs["version"] = np.uint8(2)
        f.create_group("g").attrs["levels"] = np.array([1.5, 2.5], np.float16)
        # JSON's [] has no dtype: empty arrays came back float64 (strings too); nested strings as JSON text
        # and an empty array of more axes came back 1-D: (0, 3) as (0,)
        f["g"].attrs.update({"none": np.array([], np.int64), "no_flags": np.array([], bool),
                             "no_rows": np.zeros((0, 3), np.int32), "no_cols": np.zeros((2, 0, 4), np.float32),
                             "no_names": np.array([], h5py.string_dtype()),
                             "grid": np.array([["a", "b"], ["c", "d"]], h5py.string_dtype())})
    ok(run("compress", src, store, "--quiet"))
    ok(run("decompress", store, out))
    assert_same_attributes(src, out, ("/", "/t", "/g"))


def assert_same_attributes(src, out, paths) -> None:
    """The attributes of ``paths`` in HDF5 files ``src`` and ``out`` are equal, of the same types and dtypes."""
    with h5py.File(src, "r") as a, h5py.File(out, "r") as b:
        for path in paths:
            assert set(a[path].attrs) == set(b[path].attrs), path
            for key, want in a[path].attrs.items():
                got = b[path].attrs[key]
                assert type(got) is type(want) and np.asarray(got).dtype == np.asarray(want).dtype, (path, key)
                assert np.array_equal(got, want) and np.shape(got) == np.shape(want), (path, key)


def test_decompress_restores_fixed_length_bytes_attributes_nul_included(tmp_path):
    """JSON holds fixed-length bytes as text: they came back as variable-length strings, and one holding a NUL
    (which those cannot hold) failed decompress with an internal error."""
    src, store, out = tmp_path / "b.h5", tmp_path / "b.zarr", tmp_path / "out.h5"
    with h5py.File(src, "w") as f:
        f["x"] = np.zeros((4, 16, 16), np.uint8)
        f["x"].attrs.update({"nul": np.bytes_(b"a\x00b"), "nuls": np.array([b"a\x00b", b"c"]),
                             "fixed": np.bytes_(b"abc"), "pairs": np.array([[b"ab", b"cd"]]),
                             "utf8": np.bytes_("é".encode()), "text": "vlen"})
        f.attrs["lead"] = np.bytes_(b"\x00z")
        f["labels"] = np.arange(4)
        f["labels"].attrs["tail"] = np.array([b"x\x00"], "S3")
    ok(run("compress", src, store, "--quiet"))
    ok(run("decompress", store, out))
    assert_same_attributes(src, out, ("/", "/x", "/labels"))


def test_compress_names_the_attributes_it_cannot_keep(tmp_path):
    """Attributes JSON cannot hold (complex, references, binary bytes, float128: compress failed on it with
    "maximum recursion depth exceeded") are not stored: compress says which, in its report and in --json,
    and the others arrive."""
    src, store = tmp_path / "a.h5", tmp_path / "a.zarr"
    with h5py.File(src, "w") as f:
        f["t"] = np.random.default_rng(6).normal(size=(8, 16, 16)).astype(np.float32)
        f["t"].attrs.update({"impedance": np.complex64(1 + 2j), "units": "K", "long": np.longdouble(1.5),
                             "longs": np.array([1.5, 2.5], np.longdouble)})
        f.attrs["blob"] = np.void(b"\xff\x00")
    out = ok(run("compress", src, store)).stdout
    assert "attributes not kept (JSON cannot hold their values): /@blob, /t@impedance, /t@long, /t@longs" in out
    report = json.loads(ok(run("compress", src, store, "--json", "--overwrite")).stdout)
    assert report["dropped_attributes"] == ["/@blob", "/t@impedance", "/t@long", "/t@longs"]
    ok(run("decompress", store, tmp_path / "out.h5"))
    with h5py.File(tmp_path / "out.h5", "r") as f:
        assert dict(f["t"].attrs) == {"units": "K"} and "blob" not in f.attrs


def test_datasets_named_through_links_are_stored_under_their_own_paths(tmp_path):
    """A dataset named by a path through a linked group is stored under its own path and the link recorded,
    so the file's structure comes back (it was stored under the name given, and decompress made the linked
    group a plain group without its attributes); a link named for a lossless copy holds that copy."""
    import dctchop

    src, store, out = tmp_path / "l.h5", tmp_path / "l.zarr", tmp_path / "out.h5"
    images = np.random.default_rng(4).integers(0, 256, (20, 16, 16), dtype=np.uint8)
    with h5py.File(src, "w") as f:
        f["a/images"] = images
        f["a"].attrs["units"] = "K"
        f["b/to_a"] = h5py.SoftLink("/a")
        f["c/img_alias"] = h5py.SoftLink("/a/images")
        f["a/up"] = h5py.SoftLink("..")  # HDF5 has no "..": a link to nothing
    ok(run("compress", src, store, "--dataset", "/b/to_a/images", "--quiet"))
    ds = dctchop.open(store)
    assert ds.arrays == ("a/images",) and ds["b/to_a/images"].shape == (20, 16, 16)
    assert {(link["path"], link["target"]) for link in ds.info["links"]} == {("/b/to_a", "/a"),
                                                                              ("/c/img_alias", "/a/images")}
    assert ds["c/img_alias"].name == "a/images" and len(dctchop.Loader(store, batch_size=4)) == 5
    ok(run("decompress", store, out))
    with h5py.File(out, "r") as f:
        assert np.array_equal(f["c/img_alias"][:], f["a/images"][:]) and "a/up" not in f
        assert f.get("b/to_a", getlink=True).path == "/a" and f["b/to_a"].attrs["units"] == "K"
    store2 = tmp_path / "l2.zarr"
    ok(run("compress", src, store2, "--dataset", "/a/images", "--lossless", "/c/img_alias", "--quiet"))
    ds = dctchop.open(store2)
    assert not ds["c/img_alias"].lossy and np.array_equal(ds["c/img_alias"][:], images)  # the copy, not the alias
    ok(run("decompress", store2, tmp_path / "out2.h5"))


def test_decompress_multi_array_store_to_npy_is_an_error(base, tmp_path):
    out = tmp_path / "x.npy"
    user_error(run("decompress", base.store, out), "store holds 5 arrays", "pick one with --array", ".h5")
    assert os.listdir(tmp_path) == []


def test_decompress_one_array_of_many_to_npy(data, base, tmp_path):
    """--array picks the array of a .npy (by the store's name, or HDF5's with its slash): a lossy one decodes
    as zarr does, a lossless one comes back exact, and the other arrays are listed as left out."""
    p = ok(run("decompress", base.store, tmp_path / "images.npy", "--array", "images"))
    assert np.array_equal(np.load(tmp_path / "images.npy"), decoded(base.store, "images"))
    left_out = p.stderr.splitlines()[1].split(": ", 1)[1].split("; ")
    assert set(left_out[0].removeprefix("arrays ").split(", ")) == {"labels", "extra/ids", "extra/aux", "extra/sub/t"}
    ok(run("decompress", base.store, tmp_path / "ids.npy", "--array", "/extra/ids"))
    with h5py.File(data.h5) as f:
        np.testing.assert_array_equal(np.load(tmp_path / "ids.npy"), f["extra/ids"][()])
    user_error(run("decompress", base.store, tmp_path / "x.npy", "--array", "nope"),
               "has no array 'nope'; it has: ", "images", "extra/sub/t")
    user_error(run("decompress", base.store, tmp_path / "x.h5", "--array", "images"),
               "--array picks the one array of a .npy output; .h5 gets every array")
    assert sorted(os.listdir(tmp_path)) == ["ids.npy", "images.npy"]


def test_library_warnings_are_one_line_each(data, tmp_path):
    # zarr warns that fixed-width bytes have no Zarr v3 specification: five lines of Python's warning format
    src = tmp_path / "names.h5"
    with h5py.File(src, "w") as f:
        f["images"] = data.images[:16]
        f["names"] = np.array([b"img%03d" % i for i in range(16)], dtype="S8")
    for p in (ok(run("compress", src, tmp_path / "names.zarr", "--quiet")),
              ok(run("decompress", tmp_path / "names.zarr", tmp_path / "back.h5"))):
        assert all(line.startswith(("dctchop: ", "wrote ")) for line in p.stderr.splitlines()), p.stderr
        assert "UnstableSpecificationWarning" not in p.stderr
    with h5py.File(tmp_path / "back.h5") as f:
        assert f["names"][3] == b"img003"


def test_decompress_h5_with_string_list_attribute(data, tmp_path):
    src = tmp_path / "classes.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("images", data=data.images[:16])
        f.create_dataset("labels", data=data.labels[:16]).attrs["class_names"] = ["cat", "dog", "emu"]
    store = tmp_path / "classes.zarr"
    ok(run("compress", src, store, "--keep", "4", "--quiet"))
    out = tmp_path / "back.h5"
    p = run("decompress", store, out)
    assert p.returncode == 0, p.stderr
    with h5py.File(out, "r") as f:
        assert [s.decode() if isinstance(s, bytes) else s for s in f["labels"].attrs["class_names"]] == \
            ["cat", "dog", "emu"]


def test_dataset_named_like_the_metadata_group_is_refused(data, tmp_path):
    # it made compress fail with zarr's ContainsGroupError (an internal error)
    src = tmp_path / "meta.h5"
    with h5py.File(src, "w") as f:
        f["images"], f["dctchop_meta"] = data.images[:16], data.images[:16]
    out = tmp_path / "m.zarr"
    user_error(run("compress", src, out), "/dctchop_meta", "metadata group", "--dataset")
    assert not out.exists() and not leftovers(tmp_path, out.name)
    ok(run("compress", src, out, "--dataset", "images", "--quiet"))
    assert zarr.open_group(out, mode="r")["images"].shape == (16, 32, 32, 3)


def test_dataset_named_zarr_json_is_refused_up_front(data, tmp_path):
    # it failed with "compress failed: File exists" after work had started
    src = tmp_path / "zj.h5"
    with h5py.File(src, "w") as f:
        f["images"], f["zarr.json"] = data.images[:16], np.arange(16)
    out = tmp_path / "zj.zarr"
    user_error(run("compress", src, out), "dataset /zarr.json", "Zarr metadata file", "--dataset")
    assert not out.exists() and not leftovers(tmp_path, out.name)
    p = ok(run("compress", src, out, "--dataset", "images"))
    assert "left out (--dataset names the datasets to compress): /zarr.json" in p.stdout
    assert zarr.open_group(out, mode="r")["images"].shape == (16, 32, 32, 3)


def test_root_attribute_named_dctchop_is_refused(data, tmp_path):
    # the store's own "dctchop" record replaced the user's attribute without a word
    src = tmp_path / "attr.h5"
    with h5py.File(src, "w") as f:
        f["images"] = data.images[:16]
        f.attrs["dctchop"] = "my pipeline v2"
    out = tmp_path / "attr.zarr"
    user_error(run("compress", src, out), "attribute named 'dctchop'", "rename")
    assert not out.exists() and not leftovers(tmp_path, out.name)


def test_empty_dataset_is_copied_losslessly(data, tmp_path):
    # one empty dataset failed the whole file: "emptyds: array is empty"
    src = tmp_path / "with_empty.h5"
    with h5py.File(src, "w") as f:
        f["images"] = data.images[:16]
        f.create_dataset("emptyds", shape=(0, 8, 8), dtype="f4")
        f.create_dataset("nothing_wide", shape=(4, 0, 8), dtype="u2")
    store, back = tmp_path / "e.zarr", tmp_path / "back.h5"
    info = json.loads(ok(run("compress", src, store, "--json")).stdout)
    assert set(info["arrays"]) == {"images"} and sorted(info["lossless"]) == ["emptyds", "nothing_wide"]
    g = open_store(store)
    assert g["emptyds"].shape == (0, 8, 8) and g["emptyds"].dtype == np.float32
    assert g["nothing_wide"].shape == (4, 0, 8) and g["nothing_wide"].dtype == np.uint16
    ok(run("inspect", store, "--verify", src))
    ok(run("decompress", store, back))
    with h5py.File(back, "r") as f:
        assert f["emptyds"].shape == (0, 8, 8) and f["nothing_wide"].shape == (4, 0, 8)
    # the library read (4, 0, 8) as a missing chunk: a copy with no values has no chunk files
    ds = dctchop.open(store)
    assert ds["nothing_wide"][1:3].shape == (2, 0, 8) and ds["emptyds"][:].shape == (0, 8, 8)
    # named for lossy compression, it is refused with the way out
    user_error(run("compress", src, tmp_path / "x.zarr", "--dataset", "emptyds"), "/emptyds", "empty",
               "--lossless")


def test_per_sample_tables_beside_images_are_stored_bit_exactly(tmp_path):
    # boxes (200, 4) were compressed as one "HW" image across samples; one-hot 1.0 came back as 0.9994
    rng = np.random.default_rng(0)
    src = tmp_path / "bbox.h5"
    with h5py.File(src, "w") as f:
        f["images"] = (rng.random((200, 32, 32, 3)) * 255).astype(np.uint8)
        f["boxes"] = (rng.random((200, 4)) * 32).astype(np.float32)
        f["labels"] = rng.integers(0, 5, 200)
        f["onehot"] = np.eye(10, dtype=np.float32)[rng.integers(0, 10, 200)]
    store = tmp_path / "bbox.zarr"
    p = ok(run("compress", src, store))
    assert set(layout_lines(p)) == {"images"}
    g = open_store(store)
    assert sorted(g.attrs["dctchop"]["lossless"]) == ["boxes", "labels", "onehot"]
    with h5py.File(src, "r") as f:
        for name in ("boxes", "labels", "onehot"):
            assert g[name].dtype == f[name].dtype and g[name][:].tobytes() == f[name][:].tobytes(), name
    # named with --dataset, a table is compressed as asked
    info = json.loads(ok(run("compress", src, tmp_path / "named.zarr", "--dataset", "images", "--dataset",
                             "boxes", "--json")).stdout)
    assert set(info["arrays"]) == {"images", "boxes"} and sorted(info["lossless"]) == ["labels", "onehot"]


@pytest.mark.parametrize("axes", ["", ",", "1,x", "a", "1,", "1,,2"])
def test_malformed_axes_is_a_usage_error_like_keep(data, tmp_path, axes):
    # --axes "" was ignored, and --axes 1,x exited 1 where --keep 4,x exits 2
    out = tmp_path / "a.zarr"
    for command in (["compress", data.npy, out], ["sweep", data.npy]):
        p = run(*command, "--axes", axes)
        assert p.returncode == 2 and "Invalid value for --axes" in p.stderr, (command, p.stderr)
        assert "Traceback" not in p.stderr
    assert not out.exists() and not leftovers(tmp_path, out.name)
    assert run("compress", data.npy, out, "--keep", "4,x").returncode == 2


def test_trailing_comma_in_block_is_a_usage_error(data, tmp_path):
    p = run("compress", data.npy, tmp_path / "a.zarr", "--block", "8,")  # was taken as 8
    assert p.returncode == 2 and "Invalid value for --block" in p.stderr, p.stderr


def test_empty_paths_are_usage_errors_naming_the_argument(data, tmp_path):
    # "" read as the current directory: compress said the output must not contain the input
    store = tmp_path / "a.zarr"
    ok(run("compress", data.npy, store))
    for command, name in ((["compress", "", tmp_path / "b.zarr"], "INPUT"), (["compress", data.npy, ""], "OUTPUT"),
                          (["inspect", ""], "STORE"), (["decompress", store, ""], "OUTPUT"),
                          (["preview", store, "--out", ""], "--out"), (["sweep", data.npy, "--plot", ""], "--plot")):
        p = run(*command)
        assert p.returncode == 2 and f"Invalid value for '{name}': empty path" in p.stderr, (command, p.stderr)


def test_negative_workers_is_a_usage_error_naming_the_option(data, tmp_path):
    p = run("compress", data.npy, tmp_path / "a.zarr", "--workers", "-1")  # said "threads must be >= 0"
    assert p.returncode == 2 and "Invalid value for '--workers'" in p.stderr, p.stderr


def test_axes_out_of_range_is_a_user_error(data, tmp_path):
    user_error(run("compress", data.npy, tmp_path / "a.zarr", "--axes", "1,7"), "--axes 1,7", "out of range")


@pytest.mark.parametrize("option, value, words", [
    ("--target-ratio", "0.5", "--target-ratio must be a finite number, at least 1, got 0.5"),
    ("--target-ratio", "nan", "--target-ratio must be a finite number, at least 1"),
    ("--target-ratio", "inf", "--target-ratio must be a finite number, at least 1, got inf"),
    ("--axes", "1,1", "--axes 1,1 names an axis twice"),  # refused after the whole grid, like inf
    ("--target-psnr", "-1", "--target-psnr must be a number of dB above 0 and below 400, got -1"),
    ("--target-psnr", "400", "--target-psnr must be a number of dB above 0 and below 400"),
])
def test_sweep_target_out_of_range_is_a_user_error(data, option, value, words):
    # accepted: the sweep ran, then recommended against a meaningless target
    user_error(run("sweep", data.npy, option, value), words)


def test_scalar_hdf5_dataset_round_trips(data, tmp_path):
    # a scalar (version, timestamp) beside the images: compress asked zarr for chunks=None (internal error on
    # zarr 3.1 and 3.2+), and decompress to .h5 indexed it with a slice
    src = tmp_path / "with_scalar.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("images", data=data.images[:16])
        f.create_dataset("version", data=np.float32(2.5))
    store, out = tmp_path / "s.zarr", tmp_path / "back.h5"
    ok(run("compress", src, store, "--quiet"))
    assert zarr.open_group(store, mode="r")["version"][...] == np.float32(2.5)
    ok(run("decompress", store, out))
    with h5py.File(out, "r") as f:
        assert f["version"].shape == () and f["version"][()] == np.float32(2.5)


def test_enums_array_scalars_and_records_in_attributes(data, tmp_path):
    """An enum dataset comes back an enum; a scalar of an HDF5 array datatype (its array is what is copied)
    no longer refuses the file; a record attribute is reported as not kept, not turned into a float array."""
    src, store, out = tmp_path / "types.h5", tmp_path / "s.zarr", tmp_path / "back.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("images", data=data.images[:16])
        f.create_dataset("split", data=np.arange(16) % 2, dtype=h5py.enum_dtype({"train": 0, "test": 1}, "u1"))
        f.create_dataset("origin", shape=(), dtype=np.dtype(("f4", (3,))))[()] = [1.0, 2.0, 3.0]
        f.attrs["calibration"] = np.array((1, 2.5), dtype=[("id", "i4"), ("gain", "f8")])
    report = json.loads(ok(run("compress", src, store, "--json")).stdout)
    assert report["dropped_attributes"] == ["/@calibration"] and report["dropped_links"] == []
    ok(run("decompress", store, out))
    with h5py.File(out, "r") as f:
        assert h5py.check_enum_dtype(f["split"].dtype) == {"train": 0, "test": 1}
        assert f["split"][:].tolist() == (np.arange(16) % 2).tolist()
        assert f["origin"][:].tolist() == [1.0, 2.0, 3.0] and "calibration" not in f.attrs


# --------------------------------------------------------------------------------------------------------
# further bugs found on the way
# --------------------------------------------------------------------------------------------------------


def test_compress_with_an_all_black_chunk(data, tmp_path):
    """A chunk equal to the fill value (blank frames) is still written and described (PSNR inf)."""
    src = tmp_path / "black.npy"
    x = data.images.copy()
    x[:16] = 0
    np.save(src, x)
    out = tmp_path / "black.zarr"
    p = ok(run("compress", src, out, "--chunk-samples", "16", "--json", "--quiet"))
    a = json.loads(p.stdout)["arrays"]["data"]
    assert a["psnr_max"] == "inf"  # JSON has no infinity: written as a string
    y = decoded(out, "data")
    assert np.array_equal(y[:16], x[:16])
    g = open_store(out)
    assert g["dctchop_meta/data/psnr"][0, 0, 0, 0] == np.inf
    assert g["dctchop_meta/data/max_abs_error"][0, 0, 0, 0] == 0
    assert (out / "data" / "c.0.0.0.0").is_file()
    assert min(g["dctchop_meta/data/psnr"][:].ravel()) >= 40 - PSNR_TOL


def test_default_psnr_target_met_on_flat_images(tmp_path):
    """Rounding to integers does not average out on flat data (a constant gray frame): the target must
    still hold for every chunk."""
    src = tmp_path / "gray.npy"
    np.save(src, np.full((8, 16, 16), 7, dtype=np.uint8))
    out = tmp_path / "gray.zarr"
    p = ok(run("compress", src, out, "--json", "--quiet"))
    a = json.loads(p.stdout)["arrays"]["data"]
    assert a["target"] == {"kind": "psnr", "value": 40.0}
    assert a["psnr_min"] >= 40 - PSNR_TOL
    assert psnr(np.load(src), decoded(out, "data"), 255.0) >= 40 - PSNR_TOL


def test_compress_input_path_containing_nan(data, tmp_path):
    d = tmp_path / "NaN_runs"
    d.mkdir()
    src = d / "field.npy"
    shutil.copy(data.field_npy, src)
    out = tmp_path / "f.zarr"
    p = run("compress", src, out, "--keep", "4", "--quiet")
    assert p.returncode == 0, p.stderr
    assert info_of(out)["source"]["path"] == str(src)


def test_a_0d_npy_is_refused_without_a_hint_that_leads_nowhere(tmp_path):
    # said "pass --axes", and --axes 0 then said axis 0 is out of range
    src = tmp_path / "z.npy"
    np.save(src, np.float32(3.5))
    user_error(run("compress", src, tmp_path / "z.zarr"), "0-d array", "no axis to transform")
    assert not (tmp_path / "z.zarr").exists()


# --------------------------------------------------------------------------------------------------------
# environment problems: a full disk, permissions, file names that are not UTF-8 (one line, exit 1)
# --------------------------------------------------------------------------------------------------------


def run_unprivileged(prefix: list[str], *args) -> subprocess.CompletedProcess:
    """``dctchop ARGS`` bound by file permissions (``prefix``: the ``unprivileged`` fixture)."""
    return subprocess.run([*prefix, str(DCTCHOP), *map(str, args)], check=False, capture_output=True,
                          text=True, timeout=120)


def test_decompress_h5_disk_full_as_the_file_closes_is_a_user_error(base, tmp_path, monkeypatch, capsys):
    """HDF5 that meets a full disk while it flushes the file on close raises RuntimeError through h5py, not
    OSError: it was an internal error (exit 3). Reproduced on a small tmpfs; here the close fails so."""
    from dctchop import export
    from dctchop.cli.main import main

    message = ("Disable slist on flush dest failure failed (file write failed: time = Fri Nov 27 23:42:06 2026\n"
               ", filename = 'small/.full.h5.dctchop-tmp-19328', file descriptor = 6, errno = 28, error message = "
               "'No space left on device', buf = 0x55ad99482180, total write size = 52136, bytes this sub-write "
               "= 52136, offset = 262144)")
    failure = [RuntimeError(message)]

    class FailingClose(h5py.File):
        def close(self):
            super().close()
            raise failure[0]

    monkeypatch.setattr(export.h5py, "File", FailingClose)
    out = tmp_path / "full.h5"
    with pytest.raises(SystemExit) as exited:
        main(["decompress", str(base.store), str(out)])
    assert exited.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err == f"dctchop: error: decompress failed: No space left on device; {out} was not written", err
    assert not out.exists() and leftovers(tmp_path, "full.h5") == []
    # only the messages of a failed write are the output's problem; another RuntimeError stays an internal one
    failure[0] = RuntimeError("something else went wrong")
    with pytest.raises(RuntimeError, match="something else"):
        export.decompress(base.store, out)
    assert not out.exists() and leftovers(tmp_path, "full.h5") == []


def test_unreadable_per_chunk_metadata_is_a_damaged_store(data, tmp_path, unprivileged):
    """An unreadable metadata element file, or the whole metadata directory, was an internal error
    (PermissionError, exit 3) in inspect; unreadable data chunks were already a damaged store (exit 1)."""
    store = tmp_path / "u.zarr"
    ok(run("compress", data.h5, store, "--chunk-samples", "16", "--quiet"))
    element = store / "dctchop_meta" / "images" / "psnr" / "c.1.0.0.0"
    assert element.is_file()
    element.chmod(0)
    try:
        for extra in ([], ["--chunks"], ["--json"]):
            user_error(run_unprivileged(unprivileged, "inspect", store, *extra), "damaged store", "array images, chunk 1")
    finally:
        element.chmod(0o644)
    meta = store / "dctchop_meta"
    meta.chmod(0)
    try:
        for extra in ([], ["--chunks"]):
            user_error(run_unprivileged(unprivileged, "inspect", store, *extra), "damaged store", "metadata array psnr cannot be")
    finally:
        meta.chmod(0o755)
    ok(run("inspect", store))


def test_source_name_not_utf8_is_drawn_with_escapes(data, tmp_path):
    """A source file name that is not valid UTF-8 reached matplotlib with a surrogate escape in preview's
    and sweep's titles: TypeError, exit 3."""
    name = os.fsdecode(b"bad\xffname.h5")
    src = tmp_path / name
    try:
        shutil.copy(data.h5, src)
    except (OSError, UnicodeError):
        pytest.skip("this filesystem takes only UTF-8 names")
    store = tmp_path / "s.zarr"

    def run_any(*args) -> subprocess.CompletedProcess:  # what is printed may hold the raw byte
        return subprocess.run([str(DCTCHOP), *map(str, args)], check=False, capture_output=True,
                              encoding="utf-8", errors="backslashreplace", timeout=120)

    ok(run_any("compress", src, store, "--chunk-samples", "16", "--quiet"))
    drawn = [run_any("preview", store, "--out", tmp_path / "p.png", "--index", "0"),
             run_any("sweep", src, "--sample", "8", "--plot", tmp_path / "rd.png")]
    for p in drawn:
        ok(p)
    for png in ("p.png", "rd.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from dctchop.preview import drawable

    assert drawable("bad\udcffname.h5") == "bad\\xffname.h5"
    assert drawable("caf\u00e9 \ud800") == "caf\u00e9 \\ud800"  # a surrogate that stands for no byte


def test_unreadable_input_is_a_one_line_user_error(data, base, tmp_path, unprivileged):
    """click's Path checked that inputs are readable: an unreadable one was a usage error, three lines and
    exit 2, where a problem with the input is one line and exit 1."""
    h5, npy = tmp_path / "in.h5", tmp_path / "in.npy"
    shutil.copy(data.h5, h5)
    shutil.copy(data.npy, npy)
    h5.chmod(0)
    npy.chmod(0)
    try:
        for args in (["compress", h5, tmp_path / "a.zarr"], ["compress", npy, tmp_path / "b.zarr"],
                     ["inspect", base.store, "--verify", h5], ["inspect", base.store, "--verify", npy],
                     ["preview", base.store, "--out", tmp_path / "p.png", "--source", h5],
                     ["sweep", h5], ["sweep", npy, "--plot", tmp_path / "rd.png"]):
            user_error(run_unprivileged(unprivileged, *args), "permission denied")
    finally:
        h5.chmod(0o644)
        npy.chmod(0o644)
    assert not any(tmp_path.glob("*.zarr")) and not any(tmp_path.glob("*.png"))
    store = tmp_path / "s.zarr"
    shutil.copytree(base.store, store)
    store.chmod(0)
    try:
        for args in (["inspect", store], ["decompress", store, tmp_path / "o.h5"],
                     ["preview", store, "--out", tmp_path / "p.png"]):
            user_error(run_unprivileged(unprivileged, *args), "permission denied")
    finally:
        store.chmod(0o755)
