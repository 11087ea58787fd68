"""``dctchop preview`` and ``dctchop sweep`` (issue #7): pictures of a store, rate-distortion sweep.

The commands run as subprocesses of the installed ``dctchop`` on the bundled sample data. PNGs are checked
with the standard library only: signature, every chunk's CRC, the IHDR size against the documented figure
size, and the decompressed IDAT length. PSNR values printed by ``preview`` are recomputed from the source
and a plain ``zarr`` decode with the documented definition (peak = the dtype's range for integer data,
max - min of the original array for floating-point data). The recommended ``dctchop compress`` line is run
and the store it makes is checked against the target.

Drawing needs matplotlib (the ``plot`` extra): those tests are skipped without it; the message users get
without it is tested in every environment by hiding matplotlib in a subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shlex
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr

from dctchop.errors import DctchopError
from dctchop.preview import DEFAULT_SAMPLES, HEADER_PX, ROW_PX, WIDTH_PX, check_indices, fit_panel, make_view
from dctchop.sweep import PLOT_HEIGHT_PX, PLOT_WIDTH_PX, Setting, compress_command, pareto, recommend

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "sample_data" / "images.h5"
FIELD = ROOT / "sample_data" / "field.npy"
DCTCHOP = Path(sys.executable).parent / "dctchop"
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
needs_mpl = pytest.mark.skipif(not HAVE_MPL, reason="matplotlib (the plot extra) is not installed")


def run(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([str(DCTCHOP), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          check=False)


def ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p


def fails(p: subprocess.CompletedProcess, code: int, *words: str) -> str:
    assert p.returncode == code, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    err = p.stderr.strip()
    assert "Traceback" not in p.stderr
    for w in words:
        assert w in err, f"{w!r} not in {err!r}"
    return err


def in_process(capsys, *args) -> subprocess.CompletedProcess:
    """The CLI run in this process (``main`` as the executable calls it): for the error cases, which need
    no fresh interpreter; returns what a subprocess run would."""
    from dctchop.cli.main import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
        sys.exit(0)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, e.value.code or 0, out, err)


def png_info(path: Path) -> tuple[int, int]:
    """(width, height) of a well-formed 8-bit RGB/RGBA PNG: signature, chunk CRCs, IHDR, IDAT size, IEND."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind!r}"
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert depth == 8 and colour in (2, 6) and interlace == 0
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    assert len(raw) == height * (1 + width * (3 if colour == 2 else 4))
    return width, height


def preview_psnr(source: np.ndarray, decoded: np.ndarray, peak: float) -> float:
    d = decoded.astype(np.float64) - source.astype(np.float64)
    return 20 * math.log10(peak) - 10 * math.log10(float(np.mean(d * d)))


def printed_psnr(stdout: str) -> dict[int, float]:
    """``images[12]: PSNR 39.94 dB, ...`` lines -> {12: 39.94}."""
    out = {}
    for line in stdout.splitlines():
        if ": PSNR " in line:
            head, rest = line.split(": PSNR ", 1)
            out[int(head.split("[")[1].rstrip("]"))] = float(rest.split()[0])
    return out


def linked_images(d: Path, link: str) -> Path:
    """An HDF5 file of 24 16x16 images at /a/img, also reached as /alias through a ``hard`` or ``soft`` link."""
    src = d / "links.h5"
    with h5py.File(src, "w") as f:
        f["a/img"] = np.random.default_rng(5).integers(0, 256, (24, 16, 16), dtype=np.uint8)
        f["alias"] = f["a/img"] if link == "hard" else h5py.SoftLink("/a/img")
    return src


# --------------------------------------------------------------------------------------------------------
# stores shared by the tests (each CLI call costs a second or two of start-up)
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    d = tmp_path_factory.mktemp("pictures")
    shutil.copy(IMAGES, d / "copy.h5")
    ok(run("compress", d / "copy.h5", d / "images.zarr", "--ratio", "10", "--chunk-samples", "320", "-q"))
    (d / "copy.h5").unlink()  # the recorded source is gone: preview needs --source
    ok(run("compress", FIELD, d / "field.zarr", "-q"))
    return d


# --------------------------------------------------------------------------------------------------------
# preview
# --------------------------------------------------------------------------------------------------------


@needs_mpl
def test_preview_images_source_override_default_indices(stores, tmp_path):
    out = tmp_path / "images.png"
    err = fails(run("preview", stores / "images.zarr", "--out", out), 1, "copy.h5", "does not exist",
                "--source")
    assert not out.exists(), err
    p = ok(run("preview", stores / "images.zarr", "--out", out, "--source", IMAGES))
    assert png_info(out) == (WIDTH_PX, HEADER_PX + ROW_PX * DEFAULT_SAMPLES) == (1024, 72 + 4 * 256)
    psnr = printed_psnr(p.stdout)
    assert list(psnr) == [0, 426, 853, 1279]
    x = h5py.File(IMAGES)["images"]
    y = zarr.open(str(stores / "images.zarr"), mode="r")["images"]
    for i, value in psnr.items():
        assert value == pytest.approx(preview_psnr(x[i], y[i], 255.0), abs=0.006)
    assert f"wrote {out} (1024x1096 px)" in p.stdout


@needs_mpl
def test_preview_index_and_field(stores, tmp_path):
    out = tmp_path / "two.png"
    p = ok(run("preview", stores / "images.zarr", "--out", out, "--source", IMAGES, "--index", "5",
               "--index", "-1"))
    assert list(printed_psnr(p.stdout)) == [5, 1279]
    assert png_info(out) == (1024, 72 + 2 * 256)

    out = tmp_path / "field.png"
    p = ok(run("preview", stores / "field.zarr", "--out", out))  # source recorded in the store
    assert png_info(out) == (1024, 72 + 256)
    assert p.stdout.startswith("data (whole array): PSNR ")  # not data[0], which dctchop.open reads as one plane
    value = float(p.stdout.split(": PSNR ")[1].split()[0])
    x = np.load(FIELD)
    y = zarr.open(str(stores / "field.zarr"), mode="r")["data"][...]
    assert value == pytest.approx(preview_psnr(x, y, float(x.max() - x.min())), abs=0.006)


@needs_mpl
def test_preview_stretches_a_sample_that_would_thin_to_a_line(tmp_path):
    # 8x1280 samples drawn with square pixels were lines 2 px high, their colour bars lost
    from matplotlib.image import imread

    np.save(tmp_path / "wide.npy", np.random.default_rng(0).integers(0, 255, (4, 8, 1280), dtype=np.uint8))
    ok(run("compress", tmp_path / "wide.npy", tmp_path / "wide.zarr", "-q"))
    ok(run("preview", tmp_path / "wide.zarr", "--out", tmp_path / "wide.png", "--index", "0"))
    panel = imread(tmp_path / "wide.png")[HEADER_PX : HEADER_PX + ROW_PX, 150, :3]  # down the first panel
    assert np.count_nonzero(panel.min(axis=1) < 0.9) > ROW_PX // 2


@needs_mpl
def test_preview_draws_a_large_field_reduced_with_full_resolution_figures(tmp_path, monkeypatch):
    """A 6000x6000 field's preview took 10 s and 3.3 GB: matplotlib colour-mapped every pixel for a panel of
    264x200. The pictures drawn are now block means (the error map: block maxima) of about the panel's size;
    the titles and colour scales still come from the full-resolution data."""
    import dctchop.preview as pv
    from dctchop.formats import open_source
    from dctchop.store import CompressOptions, compress

    y, x = np.mgrid[0:1000, 0:1400].astype(np.float32) / 100
    field = np.sin(x) * np.cos(y)
    field[321, 654] += 3
    np.save(tmp_path / "f.npy", field[None])
    compress(open_source(str(tmp_path / "f.npy")), tmp_path / "f.zarr", CompressOptions(axes=(1, 2)))
    figures, save_png = [], pv.save_png
    monkeypatch.setattr(pv, "save_png", lambda fig, *args: figures.append(fig) or save_png(fig, *args))
    result = pv.preview(tmp_path / "f.zarr", tmp_path / "f.png")
    assert png_info(tmp_path / "f.png") == (result["width"], result["height"]) == (1024, HEADER_PX + ROW_PX)

    decoded = zarr.open(str(tmp_path / "f.zarr"), mode="r")["data"][0]
    err = np.abs(decoded.astype(np.float64) - field)
    psnr = preview_psnr(field, decoded, float(field.max()) - float(field.min()))
    (sample,) = result["samples"]
    assert sample["psnr"] == pytest.approx(psnr, abs=1e-9) and sample["max_abs_error"] == err.max()
    (fig,) = figures
    panels = [ax for ax in fig.axes if ax.get_images()]  # not the colour bars
    titles = ["sample 0: original", f"decoded: PSNR {psnr:.2f} dB", f"|error| (sample max {err.max():.3g})"]
    assert [ax.get_title() for ax in panels] == titles
    original, _, error = (ax.get_images()[0] for ax in panels)
    assert all(ax.get_images()[0].get_array().shape == (200, 280) for ax in panels)  # 5x5 blocks
    m = float(np.abs(field).max())
    assert original.get_clim() == (-m, m)  # not the block means' narrower range
    assert error.get_clim()[1] == pytest.approx(err.max(), rel=1e-6) == error.get_array().max()


@needs_mpl
def test_preview_of_a_source_with_a_nan_says_nan_and_keeps_finite_colour_scales(tmp_path, monkeypatch):
    """A NaN in a --source file: the title said "sample max 0" beside PSNR nan (max() keeps its first argument
    against a NaN), and the colour scales of all three pictures were NaN."""
    import dctchop.preview as pv
    from dctchop.formats import open_source
    from dctchop.store import CompressOptions, compress

    y, x = np.mgrid[0:32, 0:32].astype(np.float32) / 5
    field = np.stack([np.sin(x + k) * np.cos(y) for k in range(4)]).astype(np.float32)
    np.save(tmp_path / "f.npy", field)
    compress(open_source(str(tmp_path / "f.npy")), tmp_path / "f.zarr", CompressOptions(axes=(1, 2)))
    field[1, 5, 7] = np.nan
    np.save(tmp_path / "nan.npy", field)
    figures, save_png = [], pv.save_png
    monkeypatch.setattr(pv, "save_png", lambda fig, *args: figures.append(fig) or save_png(fig, *args))
    result = pv.preview(tmp_path / "f.zarr", tmp_path / "f.png", source=tmp_path / "nan.npy", indices=[1])
    (sample,) = result["samples"]
    assert math.isnan(sample["psnr"]) and math.isnan(sample["max_abs_error"])
    (fig,) = figures
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert [ax.get_title() for ax in panels] == ["sample 1: original", "decoded: PSNR nan dB",
                                                 "|error| (sample max nan)"]
    m = float(np.nanmax(np.abs(field[1])))
    decoded = zarr.open(str(tmp_path / "f.zarr"), mode="r")["data"][1]
    err = np.abs(decoded - field[1])
    assert [ax.get_images()[0].get_clim() for ax in panels] == [(-m, m), (-m, m), (0, np.nanmax(err))]


@needs_mpl
def test_preview_reads_a_row_of_hdf5_chunks_once_and_keeps_nothing(tmp_path, hdf5_reads, spans_kept):
    """Two samples of one row of chunks: the row is read once, and dropped when the preview ends (kept on the
    file's handle, it stayed until the process ended: 256 MB per store previewed, in a notebook)."""
    from dctchop.formats import open_source
    from dctchop.preview import preview
    from dctchop.store import CompressOptions, compress

    x = np.random.default_rng(0).integers(0, 255, (40, 16, 16), dtype=np.uint8)
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f.create_dataset("images", data=x, chunks=(40, 1, 16), compression="gzip")
    compress(open_source(str(tmp_path / "in.h5")), tmp_path / "in.zarr", CompressOptions(chunk_samples=8))
    hdf5_reads.clear()
    result = preview(tmp_path / "in.zarr", tmp_path / "p.png", indices=[3, 30])
    assert [s["index"] for s in result["samples"]] == [3, 30]
    assert hdf5_reads == [(0, 40)] and spans_kept() == []


@needs_mpl
@pytest.mark.parametrize("link", ["hard", "soft"])
def test_preview_takes_an_array_by_a_link_name_as_open_does(tmp_path, link):
    # "--array alias" was refused ("has no compressed array 'alias'") where dctchop.open reads through it
    ok(run("compress", linked_images(tmp_path, link), tmp_path / "links.zarr", "-q"))
    p = ok(run("preview", tmp_path / "links.zarr", "--out", tmp_path / "p.png", "--array", "alias", "--index", "0"))
    assert list(printed_psnr(p.stdout)) == [0]


@needs_mpl
def test_pictures_into_a_read_only_directory_fail_as_one_line(stores, tmp_path):
    """The removal of the PNG's temporary raised EROFS (even for a file that is not there) over the one-line
    error: preview and sweep --plot exited 3 with "internal error"."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(mnt)], capture_output=True, text=True,
                             check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        fails(run("preview", stores / "field.zarr", "--out", mnt / "p.png"), 1, f"cannot write {mnt / 'p.png'}",
              "Read-only file system")
        fails(run("sweep", FIELD, "--sample", "1", "--plot", mnt / "rd.png"), 1, f"cannot write {mnt / 'rd.png'}",
              "Read-only file system")
        assert sorted(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@needs_mpl
def test_preview_errors(stores, tmp_path, capsys):
    def cli(*args):
        return in_process(capsys, "preview", *args)

    plain = tmp_path / "plain.zarr"
    zarr.open_group(str(plain), mode="w").create_array("a", shape=(4, 4), dtype="f4")
    fails(cli(plain, "--out", tmp_path / "a.png"), 1, "not a dctchop store")
    fails(cli(tmp_path / "missing.zarr", "--out", tmp_path / "a.png"), 1, "does not exist")
    fails(cli(stores / "field.zarr", "--out", tmp_path / "a.png", "--index", "1"), 1,
          "--index 1 is out of range", "1 sample")
    fails(cli(stores / "images.zarr", "--out", tmp_path / "a.png", "--source", IMAGES, "--index", "1280"), 1,
          "--index 1280 is out of range", "1280 samples (indices 0..1279)")
    fails(cli(stores / "images.zarr", "--out", tmp_path / "a.png", "--source", FIELD), 1,
          "field is float32[64, 64, 64], not the uint8[1280, 32, 32, 3] the store was made from", "--source")
    for name in ("labels", "/labels"):  # HDF5's leading slash is the same name, named as the user wrote it
        fails(cli(stores / "images.zarr", "--out", tmp_path / "a.png", "--array", name), 1,
              f"no compressed array {name!r}; it has: images")
    fails(cli(stores / "field.zarr", "--out", tmp_path / "a.jpg"), 1, "a.jpg must end in .png")
    fails(cli(stores / "field.zarr", "--out", tmp_path / "no" / "a.png"), 1, "does not exist")
    fails(cli(stores / "field.zarr"), 2, "--out")
    fails(cli(stores / "field.zarr", "--out", stores / "field.zarr" / "a.png"), 1, "must not be inside the Zarr store")
    fails(cli(stores / "field.zarr", "--out", f"{tmp_path}/b.png/"), 1, "names a directory")
    for url in (f"file://{tmp_path}/u.png", "s3://bucket/u.png"):  # said "output directory s3:/bucket does not exist"
        fails(cli(stores / "field.zarr", "--out", url), 1, f"output {url} is a URL; name a local file ending in .png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.zarr"]
    assert not (stores / "field.zarr" / "a.png").exists()


@needs_mpl
@pytest.mark.parametrize("damage, message", [("delete", "chunk 1 is missing"), ("truncate", "chunk 1 (")])
def test_preview_refuses_a_damaged_chunk(stores, tmp_path, damage, message):
    """preview read through plain zarr: a deleted chunk came out as zeros (a 3.9 dB sample, exit 0), a truncated
    one as an internal error."""
    store = tmp_path / "images.zarr"
    shutil.copytree(stores / "images.zarr", store)
    chunk = store / "images" / "c.1.0.0.0"
    chunk.unlink() if damage == "delete" else chunk.write_bytes(chunk.read_bytes()[:5])
    fails(run("preview", store, "--out", tmp_path / "p.png", "--source", IMAGES, "--index", "400"), 1, message)
    assert not (tmp_path / "p.png").exists()


# --------------------------------------------------------------------------------------------------------
# sweep
# --------------------------------------------------------------------------------------------------------


def check_pareto(settings: list[dict]) -> None:
    live = [p for p in settings if p["reachable"]]
    for p in settings:
        beaten = any(q["ratio"] >= p["ratio"] and q["psnr"] >= p["psnr"]
                     and (q["ratio"] > p["ratio"] or q["psnr"] > p["psnr"]) for q in live)
        assert p["pareto"] == (p["reachable"] and not beaten), p["name"]


def as_float(v) -> float:
    return float(v) if not isinstance(v, str) else float(v.replace("inf", "Infinity"))


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib (the plot extra) is not installed")
def test_sweep_json_target_ratio_and_plot(tmp_path):
    plot = tmp_path / "rd.png"
    p = ok(run("sweep", IMAGES, "--sample", "64", "--json", "--target-ratio", "6", "--plot", plot))
    r = json.loads(p.stdout)
    assert r["array"] == "/images" and r["layout"] == "NHWC" and r["axes"][:2] == [1, 2]
    assert r["sample"]["count"] == 64 and r["sample"]["mode"] == "evenly spaced"
    assert r["sample"]["indices"][0] == 0 and r["sample"]["indices"][-1] == 1279
    settings = r["settings"]
    for s in settings:
        s["psnr"] = as_float(s["psnr"])
    assert len(settings) == 4 * 2 * 2 + 5 * 2 + 2 and not r["skipped"]
    names = {s["name"] for s in settings}
    assert "--keep 4 --mask triangle --precision float16" in names
    assert "--psnr 40 --precision int8 --block 8" in names and "--psnr 40 --precision int16 --block 16" in names
    for s in settings:
        assert s["ratio"] > 0 and s["decode_mb_per_s"] > 0 and s["stored_bytes"] > 0
        assert s["ratio"] == pytest.approx(r["sample"]["bytes"] / s["stored_bytes"])
        if s["target_psnr"] is not None and s["reachable"]:
            assert s["psnr"] >= s["target_psnr"] - 0.01
    check_pareto(settings)
    assert any(s["pareto"] for s in settings)
    rec = r["recommendation"]
    assert rec["target"] == {"kind": "ratio", "value": 6.0, "given": True}
    qualifying = [s for s in settings if s["reachable"] and s["ratio"] >= 6 * 0.95]
    chosen = settings[rec["index"]]
    assert chosen["psnr"] == max(s["psnr"] for s in qualifying)
    assert rec["command"] == f"dctchop compress {IMAGES} images.zarr {chosen['name']}"
    assert png_info(plot) == (PLOT_WIDTH_PX, PLOT_HEIGHT_PX) == (1024, 768)
    assert r["plot"] == {"path": str(plot), "width": 1024, "height": 768}


def test_sweep_text_target_psnr_runs_the_recommendation(tmp_path):
    p = ok(run("sweep", FIELD, "--target-psnr", "55"))
    lines = p.stdout.splitlines()
    assert "field: 64x64x64 float32, layout ZYX, transformed axes [0, 1, 2]" in lines[0]
    assert "64 of 64 (planes 0..63)" in lines[1]
    rows = [ln for ln in lines if ln.startswith("  --")]
    assert len(rows) == 28 and any(ln.endswith(" *") for ln in rows)
    assert any("--psnr 80 --precision int16 --block 8" in ln for ln in rows)
    i = lines.index(next(ln for ln in lines if ln.startswith("recommended for PSNR >= 55 dB")))
    ratio = float(lines[i].split("ratio ")[1].split(",")[0])
    command = shlex.split(lines[i + 1])
    assert command[:4] == ["dctchop", "compress", str(FIELD), "field.zarr"]
    store = tmp_path / "rec.zarr"
    s = json.loads(ok(run(command[1], command[2], store, *command[4:], "--json")).stdout)["arrays"]["data"]
    assert as_float(s["psnr_min"]) >= 55
    assert s["ratio"] == pytest.approx(ratio, rel=0.05)  # the whole array (plus metadata) vs its sweep


def test_sweep_unreachable_target_and_usage(capsys):
    def cli(*args):
        return in_process(capsys, "sweep", *args)

    p = cli(IMAGES, "--sample", "16", "--target-ratio", "1000", "--json")
    fails(p, 1, "no setting reaches ratio 1000")
    r = json.loads(p.stdout)  # the sweep is still printed
    assert r["sample"]["count"] == 16 and len(r["settings"]) == 28
    assert r["recommendation"]["command"] is None and r["recommendation"]["index"] is None
    fails(cli(IMAGES, "--target-ratio", "5", "--target-psnr", "40"), 2, "at most one")
    fails(cli(IMAGES, "--dataset", "/nope"), 1, "/nope")
    fails(cli(IMAGES, "--sample", "0"), 1, "--sample must be at least 1")
    fails(cli(IMAGES, "--plot", "rd.svg"), 1, ".png")


def test_sweep_of_a_file_with_nothing_to_compress_says_what_it_holds(tmp_path, capsys):
    # it said "name one with --dataset", and naming the file's one array (int8) was then refused
    with h5py.File(tmp_path / "i8.h5", "w") as f:
        f["x"], f["t"] = np.zeros((4, 16, 16), np.int8), np.zeros((4, 3), np.float32)
    fails(in_process(capsys, "sweep", tmp_path / "i8.h5"), 1, "nothing to sweep", "it copies /t (float32), /x (int8)",
          "dtype uint8, uint16, int16, float16, float32, float64 with --dataset")


def test_without_matplotlib_the_commands_name_the_extra(stores, tmp_path):
    """matplotlib hidden (``sys.modules['matplotlib'] = None``): preview and sweep --plot say which extra to
    install and exit 1; sweep without --plot still works."""
    script = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from dctchop.cli.main import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit as e:\n"
        "    sys.exit(e.code)\n"
    )
    message = "needs matplotlib: pip install 'dctchop[plot]'"

    def hidden(*args):
        return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                              timeout=120, check=False)

    err = fails(hidden("preview", stores / "field.zarr", "--out", tmp_path / "p.png"), 1, message)
    assert err == f"dctchop: error: dctchop preview {message}"
    fails(hidden("sweep", FIELD, "--sample", "8", "--plot", tmp_path / "rd.png"), 1, message)
    assert not list(tmp_path.iterdir())
    p = hidden("sweep", FIELD, "--sample", "8", "--json")
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["settings"]) == 28


def test_the_command_module_imports_on_its_own():
    """cli/main.py imports cli/pictures.py at its end; importing pictures first must work too."""
    p = subprocess.run([sys.executable, "-c", "import dctchop.cli.pictures as p; print(p.sweep.name)"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0 and p.stdout.strip() == "sweep", p.stderr


# --------------------------------------------------------------------------------------------------------
# library pieces
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,axes,layout,kind,sample,picture,rgb,fixed", [
    ((10, 32, 32, 3), (1, 2), "NHWC", "image", 0, (1, 2), 3, {}),
    ((10, 3, 32, 32), (2, 3), "NCHW", "image", 0, (2, 3), 1, {}),
    ((10, 32, 32, 3), (1, 2, 3), "NHWC", "image", 0, (1, 2), 3, {}),  # colour transformed as one block
    ((10, 3, 32, 32), (1, 2, 3), "NCHW", "image", 0, (2, 3), 1, {}),
    ((32, 32, 3), (0, 1, 2), "HWC", "image", None, (0, 1), 2, {}),
    ((10, 1, 32, 32), (2, 3), "NCHW", "image", 0, (2, 3), None, {1: 0}),
    ((10, 32, 32), (1, 2), "NHW", "image", 0, (1, 2), None, {}),
    ((64, 64, 64), (0, 1, 2), "ZYX", "field", None, (1, 2), None, {0: 32}),
    ((4, 16, 20, 24), (1, 2, 3), "NZYX", "field", 0, (2, 3), None, {1: 8}),
    ((4, 3, 16, 20, 24), (2, 3, 4), "NCZYX", "field", 0, (3, 4), None, {1: 0, 2: 8}),
    ((4, 16, 20, 24, 3), (1, 2, 3), "NZYXC", "field", 0, (2, 3), None, {1: 8, 4: 0}),
    ((40, 50), (0, 1), "HW", "field", None, (0, 1), None, {}),
    ((64, 64, 5), (1,), "custom", "field", 0, (1, 2), None, {}),
])
def test_views(shape, axes, layout, kind, sample, picture, rgb, fixed):
    v = make_view(shape, axes, layout)
    assert (v.kind, v.sample_axis, v.picture, v.rgb_axis, v.fixed) == (kind, sample, picture, rgb, fixed)


def blocks(pic: np.ndarray, rows: int, cols: int, reduce) -> np.ndarray:
    """numpy reference: ``pic`` padded with NaN to whole ``rows`` x ``cols`` blocks, ``reduce`` of each."""
    h, w = -(-pic.shape[0] // rows) * rows, -(-pic.shape[1] // cols) * cols
    padded = np.full((h, w, *pic.shape[2:]), np.nan)
    padded[: pic.shape[0], : pic.shape[1]] = pic
    return reduce(padded.reshape(h // rows, rows, w // cols, cols, *pic.shape[2:]), axis=(1, 3))


@pytest.mark.parametrize("shape, dtype, aspect, factors", [
    ((1001, 1333), np.float32, "equal", (5, 5)),  # 1001 // 200, 1333 // 264: partial last blocks
    ((450, 700, 3), np.uint8, "equal", (2, 2)),  # an RGB photo
    ((8, 2000), np.float32, "auto", (1, 7)),  # stretched to its panel: each axis on its own
    ((2000, 12), np.float64, "auto", (10, 1)),
])
def test_fit_panel_means_blocks_as_numpy_does(shape, dtype, aspect, factors):
    pic = np.random.default_rng(2).uniform(0, 255, shape).astype(dtype)
    np.testing.assert_allclose(fit_panel(pic, aspect), blocks(pic, *factors, np.nanmean), rtol=1e-12)


def test_fit_panel_block_max_keeps_a_single_outlier():
    for where in [(1234, 2345), (1999, 2999)]:  # inside, and in the partial last block of both axes
        err = np.zeros((2000, 3000), np.float32)
        err[where] = 7.5
        small = fit_panel(err, "equal", "max")  # 11x11 blocks
        assert small.shape == (182, 273) and small.max() == 7.5 == small[where[0] // 11, where[1] // 11]
        np.testing.assert_array_equal(small, blocks(err, 11, 11, np.nanmax))
        assert fit_panel(err, "equal").max() < 7.5 / 50  # what a mean of 72 to 121 pixels makes of it


@pytest.mark.parametrize("shape, aspect", [
    ((32, 32, 3), "equal"), ((200, 264), "equal"), ((8, 500), "auto"),  # no larger than the panel
    ((399, 527), "equal"),  # under twice its size: left to matplotlib, as before
])
def test_fit_panel_leaves_a_small_picture_as_it_is(shape, aspect):
    pic = np.ones(shape, np.uint8)
    assert fit_panel(pic, aspect) is pic and fit_panel(pic, aspect, "max") is pic


def test_error_sums_go_by_slabs_to_the_whole_sample_s(monkeypatch):
    import dctchop.preview as pv

    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (7, 333, 3), dtype=np.uint8)
    y = rng.integers(0, 256, (7, 333, 3), dtype=np.uint8)
    d = y.astype(np.float64) - x
    monkeypatch.setattr(pv, "SLAB", 1000)  # 7 slabs, the last partial
    sse, max_err = pv._errors(x, y)
    assert sse == pytest.approx(float(np.sum(d * d)), rel=1e-12) and max_err == np.abs(d).max()
    x = x.astype(np.float32)
    x[0, 0, 0] = np.nan  # in the first slab, the others larger: max() kept 0 against it, then theirs
    sse, max_err = pv._errors(x, y)
    assert math.isnan(sse) and math.isnan(max_err)


def test_indices():
    assert check_indices([], 1280, "a") == [0, 426, 853, 1279]
    assert check_indices(None, 2, "a") == [0, 1]
    assert check_indices([3, -1], 10, "a") == [3, 9]


def _point(name, ratio, psnr, reachable=True):
    return {"name": name, "options": name.split(), "ratio": ratio, "psnr": psnr, "reachable": reachable}


def test_pareto_and_recommend():
    pts = [_point("--a 1", 2.0, 40.0), _point("--b 1", 4.0, 35.0), _point("--c 1", 3.0, 34.0),
           _point("--d 1", 9.0, 50.0, reachable=False), _point("--e 1", 2.0, 40.0), _point("--f 1", 5.8, 30.0)]
    pareto(pts)
    assert [p["pareto"] for p in pts] == [True, True, False, False, True, True]
    result = {"input": "in put.h5", "follow_external": False, "dtype": "uint8", "settings": pts}
    r = recommend(result, target_ratio=6)  # 5.8 is within 5% of 6
    assert (r["index"], r["command"]) == (5, "dctchop compress 'in put.h5' 'in put.zarr' --f 1")
    assert recommend(result, target_ratio=3.5)["index"] == 1
    assert recommend(result, target_psnr=36)["index"] == 0  # ties on ratio: the first
    assert recommend(result)["target"] == {"kind": "psnr", "value": 40.0, "given": False}
    none = recommend(result, target_psnr=45)
    assert none["command"] is None and "no setting reaches PSNR 45 dB" in none["reason"]
    skipped = [{"name": "--keep 4", "reason": "values up to 1e+300 are too large"}]
    none = recommend({"input": "x.npy", "follow_external": False, "dtype": "float64", "settings": [],
                      "skipped": skipped})
    assert none["command"] is None and none["reason"] == "no setting applies: values up to 1e+300 are too large"
    # NumPy scalars are numbers too (a70cfc9 refused them)
    assert recommend(result, target_ratio=np.int64(6))["index"] == 5
    assert recommend(result, target_psnr=np.float32(36))["index"] == 0
    # library callers got targets that compress refuses: a ratio below 1, a negative PSNR
    for bad, message in (({"target_ratio": 0.5}, "--target-ratio must be a finite number, at least 1, got 0.5"),
                         ({"target_psnr": -3}, "--target-psnr must be a number of dB above 0 and below 400")):
        with pytest.raises(DctchopError, match=re.escape(message)):
            recommend(result, **bad)
    assert compress_command("x.npy", ["--keep", "4"], axes_text="1,2") == "dctchop compress x.npy x.zarr --axes 1,2 --keep 4"
    # a stem starting with "-" made an OUTPUT that compress took for an option ("No such option '-g'")
    assert compress_command("./-g.npy", ["--keep", "4"]) == "dctchop compress ./-g.npy ./-g.zarr --keep 4"


def test_a_sweep_of_a_named_dataset_recommends_compressing_that_one(tmp_path):
    """Per-sample features beside images are copied losslessly unless named: the recommended line names them
    (without it the line copied them and applied their settings to the images)."""
    src = tmp_path / "tables.h5"
    rng = np.random.default_rng(3)
    with h5py.File(src, "w") as f:
        f["images"] = rng.integers(0, 256, (40, 16, 16, 3), dtype=np.uint8)
        f["features"] = np.cumsum(rng.standard_normal((40, 64)), axis=1).astype(np.float32)
    rec = json.loads(ok(run("sweep", src, "--dataset", "features", "--target-psnr", "50", "--json")).stdout)
    command = shlex.split(rec["recommendation"]["command"])
    assert command[:5] == ["dctchop", "compress", str(src), "tables.zarr", "--dataset"] and command[5] == "features"
    summary = json.loads(ok(run("compress", src, tmp_path / "out.zarr", *command[4:], "--json")).stdout)
    assert list(summary["arrays"]) == ["features"] and summary["arrays"]["features"]["psnr"] >= 50


def test_a_sweep_recommends_a_line_compress_accepts_for_the_whole_file(tmp_path):
    """A second array compress cannot transform (an axis of length 1) made compress refuse the recommended
    line; the line now copies that array bit-exactly and says why."""
    src = tmp_path / "mixed.h5"
    rng = np.random.default_rng(6)
    with h5py.File(src, "w") as f:
        f["images"] = rng.integers(0, 256, (40, 16, 16, 3), dtype=np.uint8)
        f["thin"] = rng.random((40, 1, 24), dtype=np.float32)
    text = ok(run("sweep", src, "--target-psnr", "40")).stdout
    assert "(copies thin bit-exactly; compress cannot transform it: transformed axis 1 has length 1" in text
    rec = json.loads(ok(run("sweep", src, "--target-psnr", "40", "--json")).stdout)["recommendation"]
    assert [r["array"] for r in rec["copied_bit_exactly"]] == ["thin"]
    command = shlex.split(rec["command"])
    assert command[4:6] == ["--lossless", "thin"]
    summary = json.loads(ok(run("compress", src, tmp_path / "out.zarr", *command[4:], "--json")).stdout)
    assert list(summary["arrays"]) == ["images"] and summary["arrays"]["images"]["psnr"] >= 40
    assert list(summary["lossless"]) == ["thin"]


@pytest.mark.parametrize("link", ["hard", "soft"])
def test_a_sweep_takes_a_dataset_by_a_link_name_as_compress_does(tmp_path, link):
    # compress --dataset alias read through the link; sweep compared names and said "no array alias to sweep"
    rec = json.loads(ok(run("sweep", linked_images(tmp_path, link), "--dataset", "alias", "--json")).stdout)
    assert rec["recommendation"]["command"] is not None


def test_a_sweep_follows_external_links_when_asked_and_so_does_its_command(tmp_path):
    rng = np.random.default_rng(4)
    with h5py.File(tmp_path / "part.h5", "w") as f:
        f["x"] = rng.integers(0, 256, (24, 16, 16), dtype=np.uint8)
    with h5py.File(tmp_path / "main.h5", "w") as f:
        f["images"] = h5py.ExternalLink("part.h5", "/x")
    fails(run("sweep", tmp_path / "main.h5"), 1, "external link", "--follow-external")
    rec = json.loads(ok(run("sweep", tmp_path / "main.h5", "--follow-external", "--json")).stdout)
    command = shlex.split(rec["recommendation"]["command"])
    assert "--follow-external" in command
    summary = json.loads(ok(run("compress", tmp_path / "main.h5", tmp_path / "out.zarr", *command[4:], "--json")).stdout)
    assert list(summary["arrays"]) == ["images"]


def test_setting_options():
    assert Setting("keep", 8, "float16", keep=4, mask="triangle").options == [
        "--keep", "4", "--mask", "triangle", "--precision", "float16"]
    assert Setting("psnr", 16, "int8", psnr=40.0).options == ["--psnr", "40", "--precision", "int8", "--block", "16"]


@pytest.mark.parametrize("case", ["partial field chunk", "blank frames"])
def test_sweep_rows_are_what_compress_stores(tmp_path, case):
    """Each sweep row equals a real compress with its options, byte for byte. A partial last chunk of a
    field (axis 0 transformed) was padded with zeros and counted in the PSNR target (--keep 8 read 36 dB
    where compress stores 93; --psnr 60 "missed" at 58.6), and all-zero frames of a full chunk were left
    out of the target as if padding (43 dB where compress stores 40.03, at 0.8 of its ratio)."""
    from dctchop.formats import open_source
    from dctchop.store import compress
    from dctchop.sweep import sweep

    rng = np.random.default_rng(5)
    if case == "blank frames":
        x = np.clip(rng.standard_normal((100, 32, 32)).cumsum(1).cumsum(2) * 4 + 128, 0, 255).astype(np.uint8)
        x[::2] = 0
        grid = [Setting("psnr", 8, "int16", psnr=40.0)]
    else:  # 30 planes of 192²: chunks of 24 planes, the last holding 6
        x = (rng.standard_normal((30, 192, 192)).cumsum(0).cumsum(1).cumsum(2) * 0.05 + 101325).astype(np.float32)
        grid = [Setting("keep", 8, "float16", keep=8), Setting("psnr", 8, "int16", psnr=60.0)]
    np.save(tmp_path / "x.npy", x)
    result = sweep(tmp_path / "x.npy", grid=grid)
    for setting, row in zip(grid, result["settings"], strict=True):
        store = tmp_path / f"{setting.family}.zarr"
        summary = compress(open_source(str(tmp_path / "x.npy")), store,
                           setting.compress_options(tuple(result["axes"])))
        (info,) = summary["arrays"].values()
        if case != "blank frames":
            assert info["chunks"][0] == 24
        chunk_bytes = sum(f.stat().st_size for f in (store / "data").iterdir() if f.name.startswith("c"))
        assert row["ratio"] == pytest.approx(x.nbytes / chunk_bytes, rel=1e-12)
        assert row["psnr"] == pytest.approx(info["psnr"], abs=1e-9) and row["reachable"]
        assert row["max_abs_error"] == pytest.approx(info["max_abs_error"], rel=1e-6)


def test_sweep_keeps_no_setting_s_plans(tmp_path):
    """A plan holds a few hundred bytes per position of a long transformed axis, cached per setting: a sweep
    of a (1, 4, 2.5M) float32 sample (40 MB) peaked at 2.8 GB, 1.3 GB when each setting's plans go before
    the next setting's."""
    from dctchop import transform
    from dctchop.sweep import sweep

    np.save(tmp_path / "x.npy", np.random.default_rng(1).standard_normal((1, 4, 4096)).cumsum(2).astype(np.float32))
    result = sweep(tmp_path / "x.npy", axes=(1, 2), grid=[Setting("keep", 8, "float16", keep=k) for k in (2, 4)])
    assert len(result["settings"]) == 2
    assert transform._plan.cache_info().currsize == transform.axis_plan.cache_info().currsize == 0


@pytest.mark.parametrize("axes, message", [((0, 5), "axes [0, 5]: axis 5 is out of range for a 3-d array"),
                                           ((1, -2), "axes [1, -2] names an axis twice"),
                                           ((1.5, 2), "axes [1.5, 2]: axes must be integers")])
def test_library_axes_are_checked_as_the_cli_checks_them(tmp_path, axes, message):
    """sweep(axes=(0, 5)) ran on axes (0, 2) (taken modulo the rank) and compress with those options failed
    with an IndexError: both refuse them as --axes does, naming the array."""
    from dctchop.formats import open_source
    from dctchop.store import CompressOptions, compress
    from dctchop.sweep import sweep

    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(8, 16, 16)).astype(np.float32))
    with pytest.raises(DctchopError, match=re.escape(f"x: {message}")):
        sweep(tmp_path / "x.npy", axes=axes)
    with pytest.raises(DctchopError, match=re.escape(f"data: {message}")):
        compress(open_source(str(tmp_path / "x.npy")), tmp_path / "x.zarr", CompressOptions(axes=axes))
    assert not (tmp_path / "x.zarr").exists()
