"""Failure behaviour of the ``dctchop`` command line (issue #5): bad inputs, damaged stores, interrupted runs.

Every case runs the installed ``dctchop`` executable (or, where a fault has to be injected, the CLI's
``main`` in a ``python -c`` subprocess) on real files made here, and checks the documented contract:

* the exit code: 0 ok, 1 user error, 2 usage error, 3 internal error, 130 interrupted;
* stderr is exactly one non-empty line (``dctchop: error: ...``, ``dctchop: internal error: ...`` or
  ``dctchop: interrupted``) that names the problem, and holds no traceback (unless ``--debug``);
* nothing is left at the output path: neither OUTPUT nor a ``.OUTPUT.dctchop-*`` temporary sibling;
* an output that existed before is untouched (bytes and mtimes), and so is the input.


"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr

from dctchop.errors import DctchopError

DCTCHOP = Path(sys.executable).parent / "dctchop"
PSNR_TOL = 0.01


# --------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------


def run(*args, cwd=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([str(DCTCHOP), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, check=False)


def run_main(argv: list[str], prelude: str, cwd: Path) -> subprocess.CompletedProcess:
    """``dctchop.cli.main.main(argv)`` in a fresh interpreter, after ``prelude`` (fault injection) ran."""
    code = prelude + f"\nfrom dctchop.cli.main import main\nmain({[str(a) for a in argv]!r})\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=120,
                          check=False)


def _describe(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"


def ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, _describe(p)
    assert "Traceback" not in p.stderr, _describe(p)
    return p


def one_line(p: subprocess.CompletedProcess, code: int, prefix: str, *words: str) -> str:
    """Exit ``code``, exactly one non-empty stderr line starting with ``prefix`` and containing ``words``."""
    assert p.returncode == code, _describe(p)
    assert "Traceback" not in p.stderr, _describe(p)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, _describe(p)
    assert lines[0].startswith(prefix), _describe(p)
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"
    return lines[0]


def user_error(p: subprocess.CompletedProcess, *words: str) -> str:
    return one_line(p, 1, "dctchop: error: ", *words)


def siblings(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.dctchop-*"))


def assert_no_output(out: Path) -> None:
    assert not os.path.lexists(out), f"{out} was left behind"
    assert siblings(out) == [], f"temporaries left behind: {siblings(out)}"


def snapshot(path: Path) -> dict:
    """Bytes and mtime of a file, or of every file (and the set of directories) under a directory."""
    path = Path(path)
    if path.is_file():
        return {".": (path.read_bytes(), path.stat().st_mtime_ns)}
    snap = {str(f.relative_to(path)): (f.read_bytes(), f.stat().st_mtime_ns) for f in path.rglob("*")
            if f.is_file()}
    snap["<dirs>"] = sorted(str(d.relative_to(path)) for d in path.rglob("*") if d.is_dir())
    return snap


def psnr(original: np.ndarray, decoded: np.ndarray) -> float:
    """The documented PSNR: peak = the dtype's range for integers, max - min of the original for floats."""
    x = original.astype(np.float64)
    y = np.asarray(decoded).astype(np.float64)
    if original.dtype.kind in "iu":
        info = np.iinfo(original.dtype)
        peak = float(info.max) - float(info.min)
    else:
        peak = float(x.max() - x.min())
    mse = float(np.mean((x - y) ** 2))
    return math.inf if mse == 0 else 20 * math.log10(peak) - 10 * math.log10(mse)


def read_store(store: Path, name: str = "data") -> np.ndarray:
    return np.asarray(zarr.open_group(str(store), mode="r")[name][...])


def smooth(shape, dtype="float32", offset=0.0) -> np.ndarray:
    """A smooth field (compresses well, reaches high PSNR), cast to ``dtype``."""
    grids = np.meshgrid(*[np.linspace(0, 3, n) for n in shape], indexing="ij")
    x = offset + np.sin(sum(g * (i + 1) for i, g in enumerate(grids))) + 0.3 * np.cos(grids[-1] * 2)
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        x = (x - x.min()) / (x.max() - x.min()) * (min(info.max, 60000) - 10) + 5
    return x.astype(dtype)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Small input files shared by the input tests (made once; tests never write into this directory)."""
    d = tmp_path_factory.mktemp("inputs")
    rng = np.random.default_rng(5)
    np.save(d / "images.npy", smooth((64, 16, 16), "uint8"))
    np.save(d / "field.npy", smooth((16, 24, 24), "float32"))
    images = rng.integers(0, 256, (16, 16, 16), dtype=np.uint8)
    with h5py.File(d / "other.h5", "w") as f:
        f["images"] = images
    with h5py.File(d / "ext.h5", "w") as f:
        f["images"] = h5py.ExternalLink("other.h5", "/images")
    with h5py.File(d / "vds.h5", "w") as f:
        layout = h5py.VirtualLayout(shape=images.shape, dtype=images.dtype)
        layout[:] = h5py.VirtualSource("other.h5", "images", shape=images.shape)
        f.create_virtual_dataset("images", layout)
    with h5py.File(d / "types.h5", "w") as f:
        f["images"] = images
        f["strings"] = np.array([[b"ab", b"cd"]] * 4)
        f.create_dataset("vlen", data=np.array([["a", "bb"]] * 4, dtype=object), dtype=h5py.string_dtype())
        f["complex"] = np.zeros((4, 8, 8), np.complex64)
        f["flags"] = np.zeros((4, 8, 8), bool)
    return d


# --------------------------------------------------------------------------------------------------------
# inputs and outputs
# --------------------------------------------------------------------------------------------------------


def test_missing_input(tmp_path):
    out = tmp_path / "out.zarr"
    user_error(run("compress", tmp_path / "missing.npy", out), "missing.npy", "no such file")
    assert_no_output(out)


def test_directory_as_input(tmp_path):
    (tmp_path / "indir").mkdir()
    out = tmp_path / "out.zarr"
    user_error(run("compress", tmp_path / "indir", out), "indir", "directory")
    assert_no_output(out)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_input(tmp_path, inputs):
    src = tmp_path / "secret.npy"
    shutil.copy(inputs / "images.npy", src)
    src.chmod(0)
    out = tmp_path / "out.zarr"
    user_error(run("compress", src, out), "secret.npy", "permission denied")
    assert_no_output(out)


@pytest.mark.parametrize("how", ["same path", "same path --overwrite", "symlink --overwrite", "inside input"])
def test_output_is_the_input_or_inside_it(tmp_path, inputs, how):
    src = tmp_path / "in.npy"
    shutil.copy(inputs / "images.npy", src)
    before = snapshot(src)
    extra = ["--overwrite"] if "--overwrite" in how else []
    if how.startswith("same path"):
        out = src
    elif how.startswith("symlink"):
        out = tmp_path / "alias.npy"
        out.symlink_to(src)
    else:
        out = src / "sub.zarr"
    user_error(run("compress", src, out, *extra), "must not be the input")
    assert snapshot(src) == before
    assert siblings(out) == [] and siblings(src) == []


def test_output_containing_the_input_is_refused(tmp_path, inputs):
    work = tmp_path / "work"
    work.mkdir()
    src = work / "in.npy"
    shutil.copy(inputs / "images.npy", src)
    before = snapshot(work)
    p = run("compress", src, work, "--overwrite")
    assert src.exists(), "the input file was deleted"
    user_error(p, "input")
    assert snapshot(work) == before
    assert siblings(work) == []


def test_overwrite_refuses_to_replace_something_that_is_not_a_store(tmp_path, inputs):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "precious.txt").write_text("not a store")
    before = snapshot(out)
    p = run("compress", inputs / "images.npy", out, "--overwrite")
    assert (out / "precious.txt").exists(), "an unrelated directory was deleted by --overwrite"
    user_error(p, "notes")
    assert snapshot(out) == before


def test_temporaries_are_matched_by_the_output_name_as_text(tmp_path, inputs, dead_pid):
    # the clean-up of killed runs globbed ".NAME.dctchop-*-*" unescaped: for "a?.zarr" it put back
    # ab.zarr's old store (left by an --overwrite killed between its two renames) as a?.zarr's, and the run
    # failed; for "a[1].zarr" it never found its own killed run's temporary
    pid = dead_pid
    ok(run("compress", inputs / "images.npy", tmp_path / "ab.zarr", "--quiet"))
    others = tmp_path / f".ab.zarr.dctchop-old-{pid}"
    (tmp_path / "ab.zarr").rename(others)
    before = snapshot(others)
    ok(run("compress", inputs / "field.npy", tmp_path / "a?.zarr", "--quiet"))
    assert snapshot(others) == before
    assert read_store(tmp_path / "a?.zarr").shape == (16, 24, 24)
    killed = tmp_path / f".a[1].zarr.dctchop-tmp-{pid}"
    killed.mkdir()
    ok(run("compress", inputs / "field.npy", tmp_path / "a[1].zarr", "--quiet"))
    assert not killed.exists()


def test_an_output_name_of_250_bytes_takes_temporaries_that_fit(tmp_path, inputs):
    # ".NAME.dctchop-tmp-PID" was over the 255-byte limit of a file name: internal error
    out = tmp_path / ("x" * 245 + ".zarr")
    ok(run("compress", inputs / "images.npy", out, "--quiet"))
    ok(run("compress", inputs / "images.npy", out, "--quiet", "--overwrite"))
    assert read_store(out).shape == (64, 16, 16)
    npy = tmp_path / ("y" * 246 + ".npy")
    ok(run("decompress", out, npy))
    assert np.load(npy).shape == (64, 16, 16)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, npy.name])
    too_long = "z" * 252
    for args in (["compress", inputs / "images.npy", tmp_path / f"{too_long}.zarr"],
                 ["decompress", out, tmp_path / f"{too_long}.npy"],
                 ["preview", out, "--out", tmp_path / f"{too_long}.png"]):
        user_error(run(*args), "File name too long")  # was an internal error
    assert list(tmp_path.glob(".z*")) == []


def test_a_path_through_a_symbolic_link_and_dotdot_is_resolved_as_the_system_does(tmp_path, inputs, monkeypatch):
    # "L/../in.npy", L a link to deep/sub, names deep/in.npy; os.path.abspath made it ./in.npy by its text
    (tmp_path / "deep" / "sub").mkdir(parents=True)
    (tmp_path / "L").symlink_to(tmp_path / "deep" / "sub")
    shutil.copy(inputs / "images.npy", tmp_path / "deep" / "in.npy")
    np.save(tmp_path / "in.npy", np.zeros((8, 16, 16), np.uint8))  # not this one
    ok(run("compress", "L/../in.npy", "L/../out.zarr", "--quiet", cwd=tmp_path))
    assert read_store(tmp_path / "deep" / "out.zarr").shape == (64, 16, 16)
    assert not (tmp_path / "out.zarr").exists()


def test_overwrite_swaps_the_new_store_in_without_a_moment_of_absence(tmp_path, inputs, monkeypatch):
    # the old store was renamed aside and then the new one into place: a reader in between found no store,
    # and a second writer in between left the old store behind
    from dctchop import store
    from dctchop.formats import open_source
    from dctchop.location import exchange

    (tmp_path / "a").mkdir()
    (tmp_path / "b").write_text("b")
    if not exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("this system or file system cannot swap two paths in one step")
    out = tmp_path / "out.zarr"
    store.compress(open_source(str(inputs / "images.npy")), out)
    renamed = []
    rename = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: (renamed.append(Path(a)), rename(a, b)))
    store.compress(open_source(str(inputs / "field.npy")), out, overwrite=True)
    assert out not in renamed
    assert read_store(out).shape == (16, 24, 24)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_an_overwrite_whose_new_store_cannot_move_in_puts_the_old_one_back(tmp_path, inputs, monkeypatch):
    # where the system cannot swap: the old store was moved aside and, the second rename failing, stayed
    # aside, hidden, with no output left
    from dctchop import store
    from dctchop.errors import DctchopError
    from dctchop.formats import open_source
    from dctchop.location import Location

    out = tmp_path / "out.zarr"
    store.compress(open_source(str(inputs / "images.npy")), out)
    before = snapshot(out)
    monkeypatch.setattr(store, "exchange", lambda a, b: False)
    rename = Location.rename

    def failing(self, to):
        if ".dctchop-tmp-" in self.target:
            raise OSError(28, "No space left on device", self.target)
        rename(self, to)

    monkeypatch.setattr(Location, "rename", failing)
    with pytest.raises(DctchopError, match="No space left on device"):
        store.compress(open_source(str(inputs / "field.npy")), out, overwrite=True)
    assert snapshot(out) == before
    assert siblings(out) == []


@pytest.mark.parametrize("mode, problem", [(0o555, "is not writable"), (0o300, "cannot be listed")])
def test_overwrite_of_a_store_that_cannot_be_removed_is_refused(tmp_path, inputs, unprivileged, mode, problem):
    # exit 0, and the whole old store stayed beside the new one as a hidden temporary for good; a directory
    # that could not be listed was skipped by the look before the work: exit 1 after it, the old store hidden
    out = tmp_path / "out.zarr"
    ok(run("compress", inputs / "images.npy", out, "--quiet"))
    (out / "data").chmod(mode)
    try:
        before = snapshot(out)
        p = subprocess.run([*unprivileged, str(DCTCHOP), "compress", str(inputs / "field.npy"), str(out),
                            "--overwrite"], capture_output=True, text=True, timeout=120, check=False)
        user_error(p, f"data {problem}")
        assert snapshot(out) == before
        assert siblings(out) == []
    finally:
        (out / "data").chmod(0o755)


def test_an_old_store_that_cannot_be_removed_after_an_overwrite_is_reported(tmp_path, inputs, monkeypatch):
    from dctchop import store
    from dctchop.errors import DctchopError
    from dctchop.formats import open_source
    from dctchop.location import Location

    out = tmp_path / "out.zarr"
    store.compress(open_source(str(inputs / "images.npy")), out)
    remove = Location.remove

    def refusing(self, check=False):
        if check:
            raise PermissionError(13, "Permission denied", self.target)
        remove(self)

    monkeypatch.setattr(Location, "remove", refusing)
    with pytest.raises(DctchopError, match="was written, but the store it replaced could not be removed"):
        store.compress(open_source(str(inputs / "field.npy")), out, overwrite=True)
    assert read_store(out).shape == (16, 24, 24)


def test_two_runs_putting_back_a_killed_overwrites_old_store(tmp_path, inputs, monkeypatch, dead_pid):
    # both saw the old store left by an --overwrite killed between its renames; the one that lost the race to
    # put it back failed with an internal error (FileNotFoundError)
    from dctchop import store
    from dctchop.location import Location

    out = tmp_path / "out.zarr"
    ok(run("compress", inputs / "images.npy", out, "--quiet"))
    old = tmp_path / f".out.zarr.dctchop-old-{dead_pid}"
    out.rename(old)
    rename = os.rename

    def beaten(a, b):  # the other run puts it back first
        rename(a, b)
        rename(a, b)

    monkeypatch.setattr(store.os, "rename", beaten)
    store.remove_stale_temporaries(Location(out))
    assert read_store(out).shape == (64, 16, 16)
    assert siblings(out) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to bind-mount")
def test_output_containing_the_input_through_a_bind_mount_is_refused(tmp_path, inputs):
    # the input sat inside the output under another path: --overwrite deleted it with the old store
    real, alias = tmp_path / "real", tmp_path / "alias"
    real.mkdir()
    alias.mkdir()
    ok(run("compress", inputs / "images.npy", real / "o.zarr", "--quiet"))
    shutil.copy(inputs / "images.npy", real / "o.zarr" / "in.npy")
    if subprocess.run(["mount", "--bind", str(real), str(alias)], capture_output=True, check=False).returncode:
        pytest.skip("bind mounts are not allowed here")
    try:
        user_error(run("compress", real / "o.zarr" / "in.npy", alias / "o.zarr", "--overwrite"), "must not be")
        assert (real / "o.zarr" / "in.npy").exists()
    finally:
        subprocess.run(["umount", str(alias)], check=False)


@pytest.mark.parametrize("kind", ["store directory", "file"])
def test_existing_output_without_overwrite_is_untouched(tmp_path, inputs, kind):
    out = tmp_path / "out.zarr"
    if kind == "file":
        out.write_bytes(b"keep me")
    else:
        out.mkdir()
        (out / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
        (out / "data").mkdir()
        (out / "data" / "chunk").write_bytes(b"\x00\x01\x02")
    before = snapshot(out)
    if kind == "file":
        user_error(run("compress", inputs / "images.npy", out), "out.zarr", "exists", "--overwrite")
    else:  # a Zarr store, not dctchop's, which --overwrite would refuse too: not advised
        user_error(run("compress", inputs / "images.npy", out), "out.zarr is a directory that is not a dctchop store")
    assert snapshot(out) == before
    assert siblings(out) == []


@pytest.mark.parametrize("as_url", [False, True])
def test_a_store_another_run_put_there_meanwhile_is_kept(tmp_path, inputs, monkeypatch, as_url):
    """The output is looked for before the work and the store moved in after it; a run that finished first
    in between keeps its store. Given as a file:// URL, fsspec's mv moved the second store inside the first
    one (both runs exited 0, the first store's inspect said damaged)."""
    from dctchop import store
    from dctchop.formats import open_source

    out = tmp_path / "out.zarr"
    write = store._write_store

    def write_then_another_run_finishes(tmp, *args, **kwargs):
        result = write(tmp, *args, **kwargs)
        shutil.copytree(tmp.local_path, out)  # the other run's store, in place first
        return result

    monkeypatch.setattr(store, "_write_store", write_then_another_run_finishes)
    with pytest.raises(DctchopError, match=r"^compress failed: File exists \(.*out.zarr\); .* was not written"):
        store.compress(open_source(str(inputs / "images.npy")), f"file://{out}" if as_url else out)
    assert sorted(p.name for p in out.iterdir()) == ["data", "dctchop_meta", "zarr.json"]
    assert siblings(out) == []


def test_decompress_never_replaces_a_file_put_there_meanwhile(tmp_path, inputs, monkeypatch):
    """Two decompresses to one file both wrote and exited 0 without --overwrite: the file was looked for at
    the start, then replaced at the end. Now the end's rename refuses a name that is taken."""
    from dctchop import export

    ok(run("compress", inputs / "images.npy", tmp_path / "s.zarr", "--quiet"))
    out = tmp_path / "out.npy"
    check_space = export._check_space

    def check_then_another_run_finishes(output, nbytes):
        check_space(output, nbytes)
        out.write_bytes(b"the other run's")

    monkeypatch.setattr(export, "_check_space", check_then_another_run_finishes)
    with pytest.raises(DctchopError, match=r"^decompress failed: File exists; .*out.npy was not written"):
        export.decompress(tmp_path / "s.zarr", out)
    assert out.read_bytes() == b"the other run's"
    assert siblings(out) == []


def test_output_parent_missing(tmp_path, inputs):
    out = tmp_path / "nowhere" / "out.zarr"
    user_error(run("compress", inputs / "images.npy", out), "nowhere", "does not exist")
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("suffix", [".npy", ".h5"])
def test_random_bytes(tmp_path, suffix):
    src = tmp_path / f"noise{suffix}"
    src.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    out = tmp_path / "out.zarr"
    line = user_error(run("compress", src, out), f"noise{suffix}")
    assert ("npy" if suffix == ".npy" else "HDF5") in line
    assert_no_output(out)


@pytest.mark.parametrize("what", ["npy data", "npy header", "h5"])
def test_truncated_input(tmp_path, inputs, what):
    if what == "h5":
        full = tmp_path / "full.h5"
        with h5py.File(full, "w") as f:
            f["x"] = np.random.default_rng(0).random((32, 64, 64)).astype("f4")
        data = full.read_bytes()
        src = tmp_path / "cut.h5"
        src.write_bytes(data[: len(data) // 2])
    else:
        data = (inputs / "images.npy").read_bytes()
        src = tmp_path / "cut.npy"
        src.write_bytes(data[: 500 if what == "npy data" else 30])
    out = tmp_path / "out.zarr"
    line = user_error(run("compress", src, out), src.name)
    if what == "npy data":
        assert "truncated" in line
    elif what == "npy header":
        assert "header" in line
    else:
        assert "truncated" in line or "HDF5" in line
    assert_no_output(out)


class _Payload:
    """Unpickling this runs ``touch MARKER`` (pickle's ``__reduce__``): a malicious object array."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("dtype", ["object", "record with an object field"])
def test_pickled_npy_is_refused_and_never_unpickled(tmp_path, dtype):
    marker = tmp_path / "PWNED"
    if dtype == "object":
        arr = np.empty((4, 4), dtype=object)
        arr[...] = 0
        arr[0, 0] = _Payload(marker)
    else:
        arr = np.zeros((4, 4), dtype=[("x", "f4"), ("o", "O")])
        arr["o"] = 0
        arr[0, 0] = (1.0, _Payload(marker))
    src = tmp_path / "evil.npy"
    np.save(src, arr, allow_pickle=True)
    assert not marker.exists()
    out = tmp_path / "out.zarr"
    user_error(run("compress", src, out), "evil.npy", "pickle")
    assert not marker.exists(), "dctchop unpickled the file"
    assert_no_output(out)
    # control: the payload is live; np.load(allow_pickle=True) runs it (a harmless ``touch`` in tmp_path)
    np.load(src, allow_pickle=True)
    assert marker.exists()


def test_hdf5_dataset_missing(tmp_path, inputs):
    out = tmp_path / "out.zarr"
    line = user_error(run("compress", inputs / "types.h5", out, "--dataset", "nope"), "types.h5", "nope")
    assert "/images" in line  # the available datasets are listed
    assert_no_output(out)


@pytest.mark.parametrize("name", ["ext.h5", "vds.h5"])
def test_hdf5_outside_the_file_refused_without_follow_external(tmp_path, inputs, name):
    out = tmp_path / "out.zarr"
    user_error(run("compress", inputs / name, out), name, "/images", "other.h5", "--follow-external")
    assert_no_output(out)


@pytest.mark.parametrize("name", ["ext.h5", "vds.h5"])
def test_hdf5_outside_the_file_accepted_with_follow_external(tmp_path, inputs, name):
    out = tmp_path / "out.zarr"
    ok(run("compress", inputs / name, out, "--follow-external", "--quiet"))
    with h5py.File(inputs / "other.h5", "r") as f:
        original = f["images"][...]
    decoded = read_store(out, "images")
    assert decoded.shape == original.shape and decoded.dtype == original.dtype
    assert psnr(original, decoded) >= 40 - PSNR_TOL
    assert siblings(out) == []
    # the store says it followed them, so checks against the source follow them too (they refused it before)
    assert "verify images: 1 chunk(s) checked, ok" in ok(run("inspect", out, "--verify", inputs / name)).stdout
    if importlib.util.find_spec("matplotlib"):
        ok(run("preview", out, "--out", tmp_path / "p.png"))


@pytest.mark.parametrize(("dataset", "words"), [
    ("strings", ["string"]),
    ("vlen", ["variable-length", "string"]),
    ("complex", ["complex"]),
    ("flags", ["bool"]),
])
def test_hdf5_non_numeric_dataset_named(tmp_path, inputs, dataset, words):
    out = tmp_path / "out.zarr"
    p = run("compress", inputs / "types.h5", out, "--dataset", dataset)
    user_error(p, "types.h5", f"/{dataset}", *words)
    assert_no_output(out)


@pytest.mark.parametrize("dtype", ["complex64", "bool"])
def test_npy_unsupported_dtype(tmp_path, dtype):
    src = tmp_path / "x.npy"
    np.save(src, np.zeros((4, 8, 8), dtype=dtype))
    out = tmp_path / "out.zarr"
    user_error(run("compress", src, out), dtype)
    assert_no_output(out)


@pytest.mark.parametrize("case", ["npy mixed", "npy -inf in later chunks", "h5 nan"])
def test_nan_and_inf_refused(tmp_path, case):
    x = smooth((40, 16, 16), "float32")
    args = []
    if case == "npy mixed":
        x[3, 4, 5], x[7, 0, 0], x[8, 1, 1] = np.nan, np.inf, -np.inf
        count, first = 3, "[3, 4, 5]"
    elif case == "npy -inf in later chunks":
        x[9, 2, 3] = x[13, 0, 0] = -np.inf
        count, first = 2, "[9, 2, 3]"
        args = ["--chunk-samples", "4"]
    else:
        x = x.astype(np.float64)
        x[20, 15, 1] = x[30, 0, 0] = x[31, 0, 0] = x[39, 15, 15] = np.nan
        count, first = 4, "[20, 15, 1]"
    if case.startswith("h5"):
        src = tmp_path / "field.h5"
        with h5py.File(src, "w") as f:
            f["velocity"] = x
    else:
        src = tmp_path / "field.npy"
        np.save(src, x)
    out = tmp_path / "out.zarr"
    line = user_error(run("compress", src, out, *args), f"{count} NaN", first)
    if case.startswith("h5"):
        assert "velocity" in line
    assert_no_output(out)


@pytest.mark.parametrize("case", ["npy (0, 8, 8)", "npy (4, 0, 8)", "h5 (0, 8, 8)"])
def test_zero_size_array(tmp_path, case):
    shape = (0, 8, 8) if "(0, 8, 8)" in case else (4, 0, 8)
    if case.startswith("h5"):
        src = tmp_path / "empty.h5"
        with h5py.File(src, "w") as f:
            f.create_dataset("nothing", shape=shape, dtype="f4")
        args = ["--dataset", "nothing"]
    else:
        src = tmp_path / "empty.npy"
        np.save(src, np.zeros(shape, np.float32))
        args = []
    out = tmp_path / "out.zarr"
    line = user_error(run("compress", src, out, *args), "empty")
    if case.startswith("h5"):
        assert "nothing" in line
    assert_no_output(out)


def test_arrays_smaller_than_one_block_use_edge_blocks(tmp_path):
    images = np.random.default_rng(2).integers(0, 256, (10, 5, 6), dtype=np.uint8)
    field = smooth((3, 5, 6), "float32")
    np.save(tmp_path / "images.npy", images)
    np.save(tmp_path / "field.npy", field)
    ok(run("compress", tmp_path / "images.npy", tmp_path / "images.zarr", "--block", "8", "--quiet"))
    ok(run("compress", tmp_path / "field.npy", tmp_path / "field.zarr", "--block", "8", "--quiet"))
    assert psnr(images, read_store(tmp_path / "images.zarr")) >= 40 - PSNR_TOL
    assert psnr(field, read_store(tmp_path / "field.zarr")) >= 60 - PSNR_TOL
    ok(run("decompress", tmp_path / "images.zarr", tmp_path / "back.npy"))
    back = np.load(tmp_path / "back.npy")
    assert back.shape == images.shape and back.dtype == images.dtype
    np.testing.assert_array_equal(back, read_store(tmp_path / "images.zarr"))


def test_one_dimensional_npy(tmp_path):
    x = np.sin(np.linspace(0, 20, 1000)).astype(np.float64)
    src = tmp_path / "signal.npy"
    np.save(src, x)
    out = tmp_path / "out.zarr"
    user_error(run("compress", src, out), "[1000]", "--axes")
    assert_no_output(out)
    ok(run("compress", src, out, "--axes", "0", "--quiet"))
    decoded = read_store(out)
    assert decoded.shape == x.shape and decoded.dtype == x.dtype
    assert psnr(x, decoded) >= 60 - PSNR_TOL


@pytest.mark.parametrize("axes", [None, "1,2"])
def test_transformed_axis_of_length_one(tmp_path, axes):
    src = tmp_path / "thin.npy"
    np.save(src, np.random.default_rng(3).integers(0, 256, (4, 1, 16), dtype=np.uint8))
    out = tmp_path / "out.zarr"
    user_error(run("compress", src, out, *(["--axes", axes] if axes else [])), "axis 1", "length 1")
    assert_no_output(out)


@pytest.mark.parametrize("case", ["npy >f4 C", "npy <f4 Fortran", "npy >u2 Fortran", "h5 >f4"])
def test_big_endian_and_fortran_inputs(tmp_path, case):
    kind, dtype, order = (case.split() + ["C"])[:3]
    native = smooth((20, 24, 40), np.dtype(dtype).newbyteorder("="))
    x = native.astype(dtype)
    if order == "Fortran":
        x = np.asfortranarray(x)
    if kind == "h5":
        src = tmp_path / "in.h5"
        with h5py.File(src, "w") as f:
            f.create_dataset("data", data=x, dtype=dtype)
    else:
        src = tmp_path / "in.npy"
        np.save(src, x)
        header = src.read_bytes()[:128]
        assert (b"'fortran_order': True" in header) == (order == "Fortran")
        assert f"'descr': '{np.dtype(dtype).str}'".encode() in header
    out = tmp_path / "out.zarr"
    ok(run("compress", src, out, "--quiet"))
    decoded = read_store(out)
    assert decoded.shape == native.shape
    assert decoded.dtype == native.dtype and decoded.dtype.isnative
    target = 40 if native.dtype.kind in "iu" else 60
    assert psnr(native, decoded) >= target - PSNR_TOL


def test_ratio_below_one(tmp_path, inputs):
    out = tmp_path / "out.zarr"
    user_error(run("compress", inputs / "images.npy", out, "--ratio", "0.5"), "--ratio", "at least 1")
    assert_no_output(out)


def test_ratio_unreachable(tmp_path, inputs):
    out = tmp_path / "out.zarr"
    user_error(run("compress", inputs / "images.npy", out, "--ratio", "1e9"), "unreachable")
    assert_no_output(out)


def test_psnr_above_what_the_data_allows(tmp_path, inputs):
    out = tmp_path / "out.zarr"
    user_error(run("compress", inputs / "field.npy", out, "--psnr", "300"), "300", "above")
    assert_no_output(out)


def test_psnr_target_met_on_a_partial_chunk_along_a_transformed_axis_0(tmp_path):
    x = smooth((20, 32, 32), "float32")  # ZYX: axes 0, 1, 2 transformed; chunks of 16 -> last chunk 4 samples
    src = tmp_path / "zyx.npy"
    np.save(src, x)
    out = tmp_path / "out.zarr"
    ok(run("compress", src, out, "--chunk-samples", "16", "--quiet"))
    assert psnr(x, read_store(out)) >= 60 - PSNR_TOL


# --------------------------------------------------------------------------------------------------------
# damaged stores
# --------------------------------------------------------------------------------------------------------


N_CHUNKS = 8


@pytest.fixture(scope="module")
def good_store(tmp_path_factory) -> Path:
    """A store of 8 chunks (64 uint8 16x16 images, 8 per chunk)."""
    d = tmp_path_factory.mktemp("store")
    np.save(d / "images.npy", smooth((64, 16, 16), "uint8"))
    ok(run("compress", d / "images.npy", d / "good.zarr", "--chunk-samples", "8", "--quiet"))
    files = sorted((d / "good.zarr" / "data").glob("c.*"), key=lambda p: int(p.name.split(".")[1]))
    assert [p.name for p in files] == [f"c.{i}.0.0" for i in range(N_CHUNKS)]
    return d / "good.zarr"


def chunk_path(store: Path, i: int) -> Path:
    return store / "data" / f"c.{i}.0.0"


def copy_store(good_store: Path, tmp_path: Path) -> Path:
    store = tmp_path / "s.zarr"
    shutil.copytree(good_store, store)
    return store


@pytest.mark.parametrize("damage", ["truncate", "flip one bit", "delete"])
def test_damaged_chunks(tmp_path, good_store, damage):
    store = copy_store(good_store, tmp_path)
    for i in (2, 5):
        path = chunk_path(store, i)
        data = bytearray(path.read_bytes())
        if damage == "truncate":
            path.write_bytes(bytes(data[: len(data) // 2]))
        elif damage == "flip one bit":
            data[len(data) // 3] ^= 0x08
            path.write_bytes(bytes(data))
        else:
            path.unlink()
    before = snapshot(store)

    p = run("inspect", store, "--json")
    user_error(p, "damaged")
    report = json.loads(p.stdout)
    damaged = report["arrays"]["data"]["damaged_chunks"]
    assert [d["chunk"] for d in damaged] == [2, 5], damaged
    assert all(d["problem"] for d in damaged)

    out = tmp_path / "restored.npy"
    user_error(run("decompress", store, out), "data", "chunk 2")
    assert_no_output(out)
    assert snapshot(store) == before


def test_inspect_text_lists_every_damaged_chunk(tmp_path, good_store):
    store = copy_store(good_store, tmp_path)
    chunk_path(store, 1).unlink()
    chunk_path(store, 6).write_bytes(b"")
    p = run("inspect", store)
    user_error(p, "damaged")
    damaged_lines = [line for line in p.stdout.splitlines() if "DAMAGED" in line.upper()]
    assert len(damaged_lines) == 2 and "1" in damaged_lines[0] and "6" in damaged_lines[1], p.stdout


STORE_DAMAGE = {
    "chunk file replaced by a directory": ("data", "chunk 2"),
    "array zarr.json deleted": ("data",),
    "array zarr.json not JSON": ("data",),
    "metadata array deleted": ("psnr",),
    "metadata chunk deleted": ("psnr",),
    "metadata chunk of 2 bytes": ("chunk 3", "per-chunk metadata missing or damaged: psnr"),
    "metadata chunk empty": ("chunk 3", "per-chunk metadata missing or damaged: psnr"),
    "metadata chunk a byte too long": ("chunk 3", "per-chunk metadata missing or damaged: psnr"),
    "metadata array of another shape": ("metadata array psnr is float64[3, 1, 1], not float64[8, 1, 1]",),
    "array and its metadata deleted": ("array data", "cannot be opened"),
    "store record without a field": ("its dctchop attributes have a bad peak of array data",),
    # zarr 3.1 still opened the metadata arrays below it, then inspect failed with KeyError
    "metadata group zarr.json deleted": ("array data", "dctchop_meta/data/zarr.json is missing"),
    # rewritten with the codec of the array's zarr.json: it decodes, but the metadata describes the old chunk
    "chunk rewritten through zarr": ("array data, chunk 0", "metadata records"),
    # another valid chunk of the size recorded (sizes coincide in chop mode, at fast zstd levels): read as
    # chunk 3 until stores recorded each file's crc32c (store format 4)
    "chunk file swapped for one of the recorded size": ("array data, chunk 3", "crc32c", "another chunk's file"),
    "metadata element checksum deleted": ("chunk 3", "per-chunk metadata missing or damaged: checksum"),
    # numbers no checksum covers, each printed as fact until their agreement was checked
    "metadata psnr edited": ("chunk 3", "PSNR 99 dB", "do not agree"),
    "metadata rmse edited": ("chunk 3", "RMSE 0.001", "do not agree"),
    "metadata max_abs_error edited": ("chunk 3", "max abs error 0.001 do not agree"),
    "metadata step edited": ("chunk 3", "step 99, the chunk's header"),
    "store record psnr edited": ("array data", "the store's record says PSNR 77.7 dB, its per-chunk metadata"),
}


@pytest.mark.parametrize("damage", list(STORE_DAMAGE))
def test_damaged_store_structure(tmp_path, good_store, damage):
    store = copy_store(good_store, tmp_path)
    if damage == "chunk file replaced by a directory":
        chunk_path(store, 2).unlink()
        chunk_path(store, 2).mkdir()
    elif damage == "array zarr.json deleted":
        (store / "data" / "zarr.json").unlink()
    elif damage == "array zarr.json not JSON":
        (store / "data" / "zarr.json").write_text("garbage")
    elif damage == "metadata array deleted":
        shutil.rmtree(store / "dctchop_meta" / "data" / "psnr")
    elif damage == "metadata chunk deleted":
        (store / "dctchop_meta" / "data" / "psnr" / "c.3.0.0").unlink()
    elif damage == "metadata chunk a byte too long":
        element = store / "dctchop_meta" / "data" / "psnr" / "c.3.0.0"
        element.write_bytes(element.read_bytes() + b"x")
    elif damage.startswith("metadata chunk"):  # inspect failed on these as an internal error
        (store / "dctchop_meta" / "data" / "psnr" / "c.3.0.0").write_bytes(b"xx" if "2 bytes" in damage else b"")
    elif damage == "metadata array of another shape":
        meta = store / "dctchop_meta" / "data" / "psnr" / "zarr.json"
        meta.write_text(meta.read_text().replace('"shape": [\n    8,', '"shape": [\n    3,'))
        assert '"shape": [\n    3,' in meta.read_text()
    elif damage == "array and its metadata deleted":
        shutil.rmtree(store / "data")
        shutil.rmtree(store / "dctchop_meta" / "data")
    elif damage == "metadata group zarr.json deleted":
        (store / "dctchop_meta" / "data" / "zarr.json").unlink()
    elif damage == "chunk rewritten through zarr":
        array = zarr.open_group(str(store), mode="r+")["data"]
        array[0] = 255 - array[0]
    elif damage == "chunk file swapped for one of the recorded size":
        shutil.copy(chunk_path(store, 4), chunk_path(store, 3))
        size = np.int64(chunk_path(store, 4).stat().st_size)
        (store / "dctchop_meta" / "data" / "stored_bytes" / "c.3.0.0").write_bytes(size.tobytes())
    elif damage == "metadata element checksum deleted":
        (store / "dctchop_meta" / "data" / "checksum" / "c.3.0.0").unlink()
    elif damage.startswith("metadata") and damage.endswith(" edited"):
        field = damage.split()[1]
        value = 0.001 if field in ("rmse", "max_abs_error") else 99.0
        (store / "dctchop_meta" / "data" / field / "c.3.0.0").write_bytes(np.array(value, "<f8").tobytes())
    elif damage == "store record psnr edited":
        record = json.loads((store / "zarr.json").read_text())
        record["attributes"]["dctchop"]["arrays"]["data"]["psnr"] = 77.7
        (store / "zarr.json").write_text(json.dumps(record))
    else:
        record = json.loads((store / "zarr.json").read_text())
        del record["attributes"]["dctchop"]["arrays"]["data"]["peak"]
        (store / "zarr.json").write_text(json.dumps(record))
    words = STORE_DAMAGE[damage]
    user_error(run("inspect", store), *words)
    user_error(run("inspect", store, "--verify", good_store.parent / "images.npy"), *words)
    if not damage.startswith("metadata"):  # decompress needs no per-chunk metadata
        out = tmp_path / "restored.npy"
        user_error(run("decompress", store, out), *words)
        assert_no_output(out)


@pytest.mark.parametrize("damage", ["chunk file of another store", "resized through zarr"])
def test_a_lossless_copy_unlike_the_one_written_is_damage(tmp_path, damage):
    """The labels' chunk file of another store (valid, of the same size) was read as this store's labels, and a
    copy shrunk through Zarr loaded without its labels, both silently, until the store recorded the copies'
    shapes and each chunk file's crc32c (store format 4)."""
    import dctchop
    from dctchop.errors import DctchopError

    for seed, name in enumerate("ab"):  # ids zstd cannot shrink: the two files are of one size
        with h5py.File(tmp_path / f"{name}.h5", "w") as f:
            f["images"] = smooth((16, 16, 16), "uint8")
            f["labels"] = np.random.default_rng(seed).integers(0, 1 << 62, 16)
        ok(run("compress", tmp_path / f"{name}.h5", tmp_path / f"{name}.zarr", "--quiet"))
    store, labels_file = tmp_path / "a.zarr", Path("labels") / "c" / "0"
    if damage == "chunk file of another store":
        other = (tmp_path / "b.zarr" / labels_file).read_bytes()
        assert len(other) == (store / labels_file).stat().st_size and other != (store / labels_file).read_bytes()
        (store / labels_file).write_bytes(other)
        words = ("array labels, chunk 0", "crc32c", "another chunk's file")
    else:
        zarr.open_group(str(store), mode="r+")["labels"].resize((10,))
        words = ("array labels", "says shape [10] in 1 chunk files, the store's record [16] in 1")
    user_error(run("inspect", store), *words)
    user_error(run("decompress", store, tmp_path / "out.h5"), *words)
    assert_no_output(tmp_path / "out.h5")
    with pytest.raises(DctchopError, match=words[-1].replace("[", r"\[").replace("]", r"\]")):
        dctchop.open(store)["labels"][:]


@pytest.mark.parametrize("content", ["{}", "garbage"])
def test_open_and_preview_name_damaged_array_metadata(tmp_path, good_store, content):
    """zarr's MetadataValidationError (no node_type) reached preview as an internal error (exit 3)."""
    import dctchop
    from dctchop.errors import DctchopError

    store = copy_store(good_store, tmp_path)
    (store / "data" / "zarr.json").write_text(content)
    with pytest.raises(DctchopError, match="array data: its metadata cannot be opened, the store is damaged"):
        dctchop.open(store)
    if importlib.util.find_spec("matplotlib") is not None:
        out = tmp_path / "p.png"
        user_error(run("preview", store, "--out", out, "--source", good_store.parent / "images.npy"),
                   "array data: its metadata cannot be opened")
        assert not out.exists()


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_damaged_group_metadata_is_found(tmp_path, damage):
    """A group whose zarr.json was deleted dropped out of decompress with its attributes (exit 0); a
    truncated one was an internal error there, and inspect said nothing of either."""
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["images"] = smooth((16, 16, 16), "uint8")
        f.create_group("grp/sub").attrs["x"] = 3
    store = tmp_path / "s.zarr"
    ok(run("compress", tmp_path / "in.h5", store, "--quiet"))
    meta = store / "grp" / "sub" / "zarr.json"
    meta.unlink() if damage == "deleted" else meta.write_text(meta.read_text()[:10])
    words = ("grp/sub/zarr.json", "is missing" if damage == "deleted" else "is unreadable")
    p = run("inspect", store)
    user_error(p, "damaged store", *words)
    assert "DAMAGED grp/sub: " in p.stdout
    out = tmp_path / "restored.h5"
    user_error(run("decompress", store, out), *words)
    assert_no_output(out)


@pytest.mark.parametrize("damage", ["another copy's chunk file", "deleted"])
def test_a_scalar_lossless_copy_is_read_with_its_checks(tmp_path, damage):
    """dctchop.open read a scalar copy straight through Zarr: another scalar's chunk file in its place read as
    its value, a deleted one as 0 (inspect reported both)."""
    import dctchop
    from dctchop.errors import DctchopError

    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["images"] = smooth((16, 16, 16), "uint8")
        f["epoch"], f["seed"] = np.int64(7), np.int64(12345)
    store = tmp_path / "s.zarr"
    ok(run("compress", tmp_path / "in.h5", store, "--quiet"))
    assert dctchop.open(store)["epoch"][()] == 7
    if damage == "deleted":
        (store / "epoch" / "c").unlink()
    else:
        shutil.copy(store / "seed" / "c", store / "epoch" / "c")
    with pytest.raises(DctchopError, match="array epoch: chunk 0 .*(crc32c|is missing)"):
        dctchop.open(store)["epoch"][()]


def test_a_store_format_of_the_wrong_type_is_a_damaged_record(tmp_path, good_store):
    # "store_format": "4" made inspect and decompress an internal error (TypeError comparing it with 4)
    store = copy_store(good_store, tmp_path)
    record = json.loads((store / "zarr.json").read_text())
    record["attributes"]["dctchop"]["store_format"] = "4"
    (store / "zarr.json").write_text(json.dumps(record))
    user_error(run("inspect", store), "its dctchop attributes have a bad store_format")
    user_error(run("decompress", store, tmp_path / "out.npy"), "its dctchop attributes have a bad store_format")


@pytest.mark.parametrize("listed", [True, False])
def test_a_deleted_group_directory_is_damage(tmp_path, listed):
    """A group deleted whole (directory and all) went unnoticed by inspect, and decompress failed on its
    float32 attribute as an internal error (KeyError); the store's record now lists its groups (format 4).
    A store that does not (``listed`` False, as before) still gets one line from decompress."""
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["images"] = smooth((16, 16, 16), "uint8")
        f.create_group("meta").attrs["scale"] = np.float32(0.5)
    store = tmp_path / "s.zarr"
    ok(run("compress", tmp_path / "in.h5", store, "--quiet"))
    shutil.rmtree(store / "meta")
    if not listed:
        record = json.loads((store / "zarr.json").read_text())
        del record["attributes"]["dctchop"]["groups"]
        (store / "zarr.json").write_text(json.dumps(record))
    out = tmp_path / "restored.h5"
    if listed:
        user_error(run("inspect", store), "damaged store", "meta/zarr.json is missing")
        user_error(run("decompress", store, out), "meta/zarr.json is missing")
    else:
        user_error(run("decompress", store, out), "damaged store", "meta, whose attributes it records, is missing")
    assert_no_output(out)


@pytest.mark.parametrize("dropped", ["a_images", "labels"])
def test_an_array_left_out_of_the_stores_record_is_damage(tmp_path, dropped):
    """The root record lists the arrays readers show; with one deleted from it by hand, inspect, --verify and
    decompress said nothing and decompress wrote the others only."""
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["a_images"], f["b_images"] = smooth((16, 16, 16), "uint8"), smooth((16, 16, 16), "uint8", 0.5)
        f["labels"] = np.arange(16)
    store = tmp_path / "s.zarr"
    ok(run("compress", tmp_path / "in.h5", store, "--quiet"))
    record = json.loads((store / "zarr.json").read_text())
    info = record["attributes"]["dctchop"]
    if dropped in info["arrays"]:
        del info["arrays"][dropped]
    else:
        info["lossless"].remove(dropped)
    (store / "zarr.json").write_text(json.dumps(record))
    words = (f"array {dropped} is not in the store's record",)
    p = run("inspect", store)
    user_error(p, "damaged store", *words)
    user_error(run("inspect", store, "--verify", tmp_path / "in.h5"), *words)
    out = tmp_path / "restored.h5"
    user_error(run("decompress", store, out), *words)
    assert_no_output(out)


@pytest.fixture(scope="module")
def labelled_store(tmp_path_factory) -> Path:
    """Images in 4 chunks beside labels and ids copied losslessly in 2 Zarr chunks each; the ids' first chunk
    is all zeros, which Zarr would leave out unless told to write every chunk."""
    d = tmp_path_factory.mktemp("labelled")
    rng = np.random.default_rng(8)
    with h5py.File(d / "in.h5", "w") as f:
        f["images"] = smooth((32, 16, 16), "uint8")
        f["labels"] = rng.integers(0, 10, (32, 40000)).astype(np.int32)  # 2 Zarr chunks of about 4 MB
        f["ids"] = np.r_[np.zeros((26, 20000), np.int64), np.ones((6, 20000), np.int64)]  # Zarr chunks 26 + 6
    ok(run("compress", d / "in.h5", d / "s.zarr", "--chunk-samples", "8", "--lossless", "labels", "--quiet"))
    return d / "s.zarr"


LOSSLESS_DAMAGE = {
    "chunk deleted": ("labels", "chunk 1", "missing"),
    "one bit flipped": ("labels", "chunk 0", "crc32c"),
    "zarr.json deleted": ("labels", "array metadata cannot be opened"),
    "chunk of another size": ("labels", "chunk 0", "wrong size"),  # a stale file: checksum right, length not
}


@pytest.mark.parametrize("damage", list(LOSSLESS_DAMAGE))
def test_damaged_lossless_copies_are_found(tmp_path, labelled_store, damage):
    """Zarr reads a missing chunk as fill values and raises a bare ValueError on a bad crc32c: inspect,
    decompress and the reader name the damage instead of handing out zeros or failing as an internal error."""
    import dctchop
    from dctchop.errors import DctchopError

    assert run("inspect", labelled_store).returncode == 0
    assert sorted(os.listdir(labelled_store / "ids" / "c")) == ["0", "1"]  # the all-zero chunk 0 is written
    store = copy_store(labelled_store, tmp_path)
    if damage == "chunk deleted":
        (store / "labels" / "c" / "1" / "0").unlink()
    elif damage == "one bit flipped":
        path = store / "labels" / "c" / "0" / "0"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    elif damage == "chunk of another size":
        from dctchop.store import _stored_bytes, unframe

        path = store / "labels" / "c" / "0" / "0"
        path.write_bytes(_stored_bytes(unframe(path.read_bytes(), None)[:-8]))
    else:
        (store / "labels" / "zarr.json").unlink()
    words = LOSSLESS_DAMAGE[damage]
    p = run("inspect", store)
    user_error(p, "damaged store", *words)
    assert any("DAMAGED" in line for line in p.stdout.splitlines())
    out = tmp_path / "restored.h5"
    user_error(run("decompress", store, out), *words)
    assert_no_output(out)
    if damage != "zarr.json deleted":
        with pytest.raises(DctchopError, match=" ".join(words[:2]).replace("labels ", "labels: ")):
            dctchop.open(store)["labels"][:]


def test_a_chunk_that_passes_its_checksum_but_does_not_decode_is_named(tmp_path, good_store):
    from dctchop.store import _stored_bytes, unframe

    store = copy_store(good_store, tmp_path)
    path = chunk_path(store, 2)
    path.write_bytes(_stored_bytes(unframe(path.read_bytes(), None)[:-40]))  # payload cut short, crc32c recomputed
    out = tmp_path / "restored.npy"
    user_error(run("decompress", store, out), "s.zarr: array data, chunk 2:")
    assert_no_output(out)
    user_error(run("inspect", store, "--verify", good_store.parent / "images.npy"), "array data, chunk 2:")


def test_array_metadata_that_disagrees_with_the_record_is_damage(tmp_path, good_store):
    """A shape in an array's zarr.json that is not the one the store recorded (decompress had written the
    extra rows as zeros)."""
    store = copy_store(good_store, tmp_path)
    meta = store / "data" / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["shape"][0] += 5
    meta.write_text(json.dumps(doc))
    user_error(run("inspect", store), "data", "array metadata says shape [69, 16, 16]", "record [64, 16, 16]")
    out = tmp_path / "restored.npy"
    user_error(run("decompress", store, out), "array metadata says shape")
    assert_no_output(out)
    import dctchop
    from dctchop.errors import DctchopError

    with pytest.raises(DctchopError, match="metadata says shape .69, 16, 16., the store's record .64, 16, 16."):
        dctchop.open(store)  # the reader checks it too, instead of serving 69 samples


def _future_codec_version(store: Path) -> None:
    meta = store / "data" / "zarr.json"
    doc = json.loads(meta.read_text())
    (codec,) = [c for c in doc["codecs"] if c["name"] == "dctchop"]
    assert codec["configuration"]["format_version"] == 1
    codec["configuration"]["format_version"] = 99
    meta.write_text(json.dumps(doc, indent=2))


def test_inspect_codec_format_version_from_the_future(tmp_path, good_store):
    store = copy_store(good_store, tmp_path)
    _future_codec_version(store)
    user_error(run("inspect", store), "99")


def test_decompress_codec_format_version_from_the_future(tmp_path, good_store):
    store = copy_store(good_store, tmp_path)
    _future_codec_version(store)
    out = tmp_path / "restored.npy"
    user_error(run("decompress", store, out), "format_version 99", "version 1")
    assert_no_output(out)


def test_chunk_header_format_version_from_the_future(tmp_path, good_store):
    from dctchop.store import _stored_bytes, unframe

    store = copy_store(good_store, tmp_path)
    path = chunk_path(store, 3)
    raw = bytearray(unframe(path.read_bytes(), None))
    assert raw[:4] == b"DCTC" and raw[4] == 1
    raw[4] = 2
    path.write_bytes(_stored_bytes(bytes(raw)))

    p = run("inspect", store, "--json")
    user_error(p, "damaged")
    damaged = json.loads(p.stdout)["arrays"]["data"]["damaged_chunks"]
    assert [d["chunk"] for d in damaged] == [3] and "version 2" in damaged[0]["problem"]

    out = tmp_path / "restored.h5"
    user_error(run("decompress", store, out), "data", "chunk 3", "version 2", "version 1")
    assert_no_output(out)


# --------------------------------------------------------------------------------------------------------
# interrupted and failing runs
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_npy(tmp_path_factory) -> Path:
    """200 MB of float32 (800 images of 250x250, a smooth pattern plus noise): about 1 s of compress on two
    idle cores at the default zstd level, 4 s at level 19. The smooth pattern alone (ratio 120) compressed in
    0.85 s, and a signal sent on the first chunk file arrived after the end."""
    path = tmp_path_factory.mktemp("big") / "big.npy"
    m = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(800, 250, 250))
    yy, xx = np.mgrid[0:250, 0:250].astype(np.float32) / 25
    base = np.sin(yy) * np.cos(xx)
    rng = np.random.default_rng(0)
    for s in range(0, 800, 100):
        m[s:s + 100] = base + rng.standard_normal((100, 250, 250), dtype=np.float32) * np.float32(0.05)
    m.flush()
    del m
    return path


def start_and_wait_for_chunks(prefix: list[str], args, out: Path) -> tuple[subprocess.Popen, Path]:
    """Start ``dctchop compress`` after ``prefix`` (the ``signals_by_default`` fixture), at zstd level 19, so it
    runs for seconds, even on idle cores; return once its temporary holds chunk files (mid-way through
    writing)."""
    proc = subprocess.Popen([*prefix, str(DCTCHOP), *map(str, args), "--zstd-level", "19"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        tmps = [t for t in siblings(out) if "-tmp-" in t.name]
        try:
            if tmps and any((tmps[0] / "data").glob("c.*")):
                return proc, tmps[0]
        except FileNotFoundError:  # not there yet
            pass
        if proc.poll() is not None:
            _, stderr = proc.communicate()
            pytest.fail(f"compress ended (exit {proc.returncode}) before it was interrupted:\n{stderr}")
        time.sleep(0.01)
    proc.kill()
    pytest.fail("no temporary with chunk files appeared")


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_sigint_during_compress(tmp_path, big_npy, signals_by_default):
    out = tmp_path / "big.zarr"
    proc, _ = start_and_wait_for_chunks(signals_by_default, ["compress", big_npy, out], out)
    proc.send_signal(signal.SIGINT)
    one_line(finish(proc), 130, "dctchop: interrupted")
    assert_no_output(out)
    ok(run("compress", big_npy, out, "--quiet"))
    assert (out / "zarr.json").is_file() and siblings(out) == []


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the worker processes through /proc")
def test_sigint_while_dask_worker_processes_run(tmp_path, signals_by_default):
    """The interpreter's exit waited forever on a worker of Dask's own process pool, whose shutdown message
    its closed queue never delivered: every run interrupted while a task was in flight hung."""
    out = tmp_path / "out.zarr"
    proc = subprocess.Popen([*signals_by_default, str(DCTCHOP), "compress",
                             Path(__file__).parents[1] / "sample_data/images.h5", out, "--scheduler", "processes"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while not _children(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # the workers started, the task sent to one
    proc.send_signal(signal.SIGINT)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the workers too: they hold the pipes
        proc.communicate()
        pytest.fail("compress --scheduler processes hung after SIGINT")
    one_line(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), 130, "dctchop: interrupted")
    assert_no_output(out)


@pytest.mark.parametrize("as_url", [False, True], ids=["path", "file-url"])
def test_sigkill_during_compress_then_rerun(tmp_path, big_npy, as_url, signals_by_default):
    """A file:// URL names local files too: its killed run's temporary is the rerun's to remove (it was named
    at random, as for a remote store, and left for good)."""
    out = tmp_path / "big.zarr"
    target = f"file://{out}" if as_url else out
    proc, tmp = start_and_wait_for_chunks(signals_by_default, ["compress", big_npy, target], out)
    proc.send_signal(signal.SIGKILL)
    assert finish(proc).returncode == -signal.SIGKILL
    assert not os.path.lexists(out)
    assert tmp.exists()  # a killed process cannot clean up: the stray temporary is there
    ok(run("compress", big_npy, target, "--quiet"))
    assert (out / "zarr.json").is_file()
    assert not tmp.exists() and siblings(out) == [], "the stale temporary of a dead process was not removed"


@pytest.mark.parametrize("sig, code, message", [(signal.SIGINT, 130, "dctchop: interrupted"),
                                                 (signal.SIGTERM, 143, "dctchop: interrupted by SIGTERM")])
def test_a_signal_during_overwrite_keeps_the_old_store(tmp_path, big_npy, inputs, sig, code, message,
                                                      signals_by_default):
    out = tmp_path / "big.zarr"
    ok(run("compress", inputs / "images.npy", out, "--quiet"))
    before = snapshot(out)
    proc, _ = start_and_wait_for_chunks(signals_by_default, ["compress", big_npy, out, "--overwrite"], out)
    proc.send_signal(sig)
    one_line(finish(proc), code, message)
    assert snapshot(out) == before
    assert siblings(out) == []
    np.testing.assert_array_equal(read_store(out).shape, (64, 16, 16))


def test_an_interrupt_while_the_replaced_store_is_removed_says_the_new_one_is_in_place(tmp_path, inputs):
    """Past the swap, Ctrl-C said only "interrupted" (as if nothing had changed) while the new store was the
    output and the old one lay half removed beside it."""
    out = tmp_path / "o.zarr"
    ok(run("compress", inputs / "images.npy", out, "--quiet"))
    prelude = textwrap.dedent("""
        from dctchop.location import Location
        remove = Location.remove
        def interrupted(self, check=False):
            if check:  # only the removal of the store an --overwrite replaced checks
                raise KeyboardInterrupt
            remove(self, check)
        Location.remove = interrupted
    """)
    p = run_main(["compress", inputs / "field.npy", out, "--overwrite", "--quiet"], prelude, tmp_path)
    line = one_line(p, 130, "dctchop: interrupted; ")
    assert f"{out} was written; the store it replaced is left at " in line
    assert line.endswith("which the next run writing o.zarr removes") and len(siblings(out)) == 1
    assert read_store(out).shape == (16, 24, 24)
    ok(run("compress", inputs / "field.npy", out, "--overwrite", "--quiet"))
    assert siblings(out) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_during_compress_clean_up_like_ctrl_c(tmp_path, big_npy, sig, signals_by_default):
    # timeout, SLURM and kill send SIGTERM, a closed terminal SIGHUP: the process died with -15 and left
    # its hidden temporary behind
    out = tmp_path / "big.zarr"
    proc, _ = start_and_wait_for_chunks(signals_by_default, ["compress", big_npy, out], out)
    proc.send_signal(sig)
    one_line(finish(proc), 128 + sig, f"dctchop: interrupted by {sig.name}")
    assert_no_output(out)


def test_sigterm_during_decompress_leaves_no_temporary(tmp_path, big_npy):
    store = tmp_path / "big.zarr"
    ok(run("compress", big_npy, store, "--quiet"))
    out = tmp_path / "back.npy"
    proc = subprocess.Popen([str(DCTCHOP), "decompress", str(store), str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not siblings(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGTERM)
    p = finish(proc)
    if p.returncode == 0:
        pytest.skip("decompress finished before the signal arrived")
    one_line(p, 143, "dctchop: interrupted by SIGTERM")
    assert_no_output(out)


IGNORED_SIGHUP = """
import signal
signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup leaves it
import dctchop.cli.main
_call = dctchop.cli.main._Progress.__call__
def progress(self, n):  # a hang-up in the middle of the work
    signal.raise_signal(signal.SIGHUP)
    _call(self, n)
dctchop.cli.main._Progress.__call__ = progress
"""


def test_sighup_stays_ignored_under_nohup(tmp_path, inputs):
    out = tmp_path / "out.zarr"
    ok(run_main(["compress", inputs / "images.npy", out, "--chunk-samples", "16", "--quiet"], IGNORED_SIGHUP,
                tmp_path))
    assert (out / "zarr.json").is_file() and siblings(out) == []


CTRL_C_BETWEEN_CHUNKS = """
import time
import dctchop.cli.main
import dctchop.formats
_read = dctchop.formats.SourceArray.read
def slow_read(self, *args, **kwargs):  # chunks take a while, so other workers are busy when Ctrl-C lands
    time.sleep(0.3)
    return _read(self, *args, **kwargs)
dctchop.formats.SourceArray.read = slow_read
_calls = [0]
def progress(self, n):  # Ctrl-C landing while the main thread is between two finished chunks
    _calls[0] += 1
    if _calls[0] == 2:
        raise KeyboardInterrupt
dctchop.cli.main._Progress.__call__ = progress
"""


def test_ctrl_c_between_chunks_leaves_no_temporary(tmp_path):
    src = tmp_path / "images.npy"
    np.save(src, smooth((160, 64, 64), "uint8"))
    out = tmp_path / "out.zarr"
    argv = ["compress", src, out, "--chunk-samples", "8", "--workers", "2"]
    p = run_main(argv, CTRL_C_BETWEEN_CHUNKS, tmp_path)
    one_line(p, 130, "dctchop: interrupted")
    assert_no_output(out)


def test_disk_full_on_tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        src = tmp_path / "noise.npy"  # ~10 MB that does not compress: the store cannot fit in 2 MB
        np.save(src, np.random.default_rng(4).integers(0, 256, (40, 512, 512), dtype=np.uint8))
        out = mnt / "out.zarr"
        # float32 coefficients of noise: about 4x the input, so the disk fills within the first chunks
        user_error(run("compress", src, out, "--keep", "8", "--precision", "float32"), "No space left")
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


DISK_LOOKS_EMPTY = """
import collections, shutil
shutil.disk_usage = lambda path: collections.namedtuple("usage", "total used free")(1 << 40, 0, 1 << 40)
"""


def test_decompress_onto_a_full_or_read_only_disk(tmp_path, good_store):
    """Refused before decoding when the output cannot fit. A .npy was written through a memory map of a sparse
    file, which a full disk killed with SIGBUS (reached here by hiding how full the disk is), leaving its
    temporary; a read-only directory gave an internal error."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for options in ("size=16k", "ro"):
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)],
                                 capture_output=True, text=True, check=False)
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
        try:
            for name in ("out.npy", "out.h5"):
                if options == "ro":
                    user_error(run("decompress", good_store, mnt / name), "Read-only file system", name)
                else:
                    user_error(run("decompress", good_store, mnt / name), f"{name} needs about 0.08 MB", "free")
                assert os.listdir(mnt) == []
            if options != "ro":
                p = run_main(["decompress", good_store, mnt / "out.npy"], DISK_LOOKS_EMPTY, tmp_path)
                user_error(p, "decompress failed: No space left on device", "out.npy was not written")
                assert os.listdir(mnt) == []
        finally:
            subprocess.run(["umount", str(mnt)], check=False)


H5_WRITE_FAILS = """
import h5py
def write(self, *args):  # h5py's messages run over several lines
    raise OSError(28, "Can't synchronously write data (file write failed: time = now\\n, errno = 28)")
h5py.Dataset.__setitem__ = write
"""


def test_decompress_write_error_is_one_line(tmp_path, good_store):
    out = tmp_path / "out.h5"
    user_error(run_main(["decompress", good_store, out], H5_WRITE_FAILS, tmp_path),
               "decompress failed: No space left on device", "out.h5 was not written")
    assert_no_output(out)


WRITE_FAILS = """
import pathlib
_write_bytes, _calls = pathlib.Path.write_bytes, [0]
def write_bytes(self, data):
    _calls[0] += 1
    if _calls[0] > {after}:
        raise OSError(28, "No space left on device")
    return _write_bytes(self, data)
pathlib.Path.write_bytes = write_bytes
"""


def test_write_error_mid_way(tmp_path, inputs):
    out = tmp_path / "out.zarr"
    p = run_main(["compress", inputs / "images.npy", out, "--chunk-samples", "8"],
                 WRITE_FAILS.format(after=3), tmp_path)
    user_error(p, "No space left", "out.zarr")
    assert_no_output(out)


INTERNAL_ERROR = """
import dctchop.formats
def read(self, *args, **kwargs):
    raise RuntimeError("injected failure xyzzy\\nand a second line of detail")
dctchop.formats.SourceArray.read = read
"""


@pytest.mark.parametrize("debug", [False, True])
def test_internal_error(tmp_path, inputs, debug):
    out = tmp_path / "out.zarr"
    argv = (["--debug"] if debug else []) + ["compress", inputs / "images.npy", out, "--chunk-samples", "8"]
    p = run_main(argv, INTERNAL_ERROR, tmp_path)
    assert p.returncode == 3, _describe(p)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines[-1] == "dctchop: internal error: RuntimeError: injected failure xyzzy", _describe(p)
    if debug:
        assert "Traceback" in p.stderr and "injected failure xyzzy" in "\n".join(lines[:-1])
    else:
        one_line(p, 3, "dctchop: internal error: ", "RuntimeError", "xyzzy")
    assert_no_output(out)


@pytest.fixture(scope="module")
def described_store(tmp_path_factory) -> Path:
    """A store whose record notes links, enum labels, attribute dtypes and a copy stored as bytes."""
    d = tmp_path_factory.mktemp("described")
    with h5py.File(d / "in.h5", "w") as f:
        f["images"] = smooth((16, 16, 16), "uint8")
        f["images"].attrs["scale"] = np.float32(0.5)
        f.create_dataset("labels", data=np.arange(16, dtype=np.uint8) % 3,
                         dtype=h5py.enum_dtype({"a": 0, "b": 1, "c": 2}, basetype="u1"))
        f["boxes"] = np.zeros(16, dtype=[("x", "<f4"), ("y", "<i2")])
        f["alias"] = h5py.SoftLink("/images")
    ok(run("compress", d / "in.h5", d / "s.zarr", "--quiet"))
    return d / "s.zarr"


def _edit_array(key, value):
    return lambda record: record["arrays"]["images"].__setitem__(key, value)


# crafted records that readers used unchecked: internal errors (KeyError, TypeError), raw exceptions from
# dctchop.open, an 80 GB attribute, or figures printed as if valid
RECORD_DAMAGE = {
    "unknown dtype": (_edit_array("dtype", "foo"), "dtype, axes, target or codec of array images"),
    "codec emptied": (_edit_array("codec", {}), "dtype, axes, target or codec of array images"),
    "target of no kind": (_edit_array("target", {"kind": "x"}), "dtype, axes, target or codec of array images"),
    "axis beyond the shape": (_edit_array("axes", [7]), "dtype, axes, target or codec of array images"),
    "no original bytes": (_edit_array("original_bytes", 0), "dtype, axes, target or codec of array images"),
    "array named as the metadata group": (
        lambda record: record["arrays"].__setitem__("dctchop_meta", record["arrays"].pop("images")), "array name"),
    "source not described": (lambda record: record.__setitem__("source", "x"), "source"),
    "link to nothing": (lambda record: record.__setitem__("links", [{"path": "/x", "target": "/nope", "kind": "hard"}]),
                        "links"),
    "links not a list": (lambda record: record.__setitem__("links", "x"), "links"),
    "enum labels not a mapping": (lambda record: record.__setitem__("enums", {"labels": "x"}), "enums"),
    "attribute dtype of 80 GB": (lambda record: record.__setitem__("attr_dtypes", {"/": {"s": "(100000,100000)<f8"}}),
                                 "attr_dtypes"),
    "bytes of no dtype": (lambda record: record.__setitem__("stored_as_bytes", {"boxes": "foo"}), "stored_as_bytes"),
}


@pytest.mark.parametrize("damage", [*RECORD_DAMAGE, "store format of a newer dctchop"])
def test_a_record_readers_could_not_use_is_damage(tmp_path, described_store, damage):
    import dctchop
    from dctchop.errors import DctchopError

    store = copy_store(described_store, tmp_path)
    root = json.loads((store / "zarr.json").read_text())
    record = root["attributes"]["dctchop"]
    assert {"links", "enums", "attr_dtypes", "stored_as_bytes"} <= set(record)
    if damage == "store format of a newer dctchop":  # its fields may be new ones: not damage
        record["store_format"] = 99
        record["arrays"]["images"]["codec"]["entropy"] = "rans"
        words = ("store format 99", "formats 1 to 4", "upgrade dctchop")
    else:
        edit, field = RECORD_DAMAGE[damage]
        edit(record)
        words = ("is damaged: its dctchop attributes have a bad", field)
    (store / "zarr.json").write_text(json.dumps(root))
    user_error(run("inspect", store), *words)
    out = tmp_path / "out.h5"
    user_error(run("decompress", store, out), *words)
    assert_no_output(out)
    with pytest.raises(DctchopError, match=words[-1]):
        dctchop.open(store)


def _edit_json(path: Path, edit) -> None:
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))


def test_an_array_whose_zarr_json_names_other_codecs_is_damage(tmp_path, good_store):
    """With plain bytes for codecs inspect called the store intact, and decompress and dctchop.open failed
    with ValueError (Zarr reshaping the chunk files' bytes)."""
    import dctchop
    from dctchop.errors import DctchopError

    store = copy_store(good_store, tmp_path)
    _edit_json(store / "data" / "zarr.json", lambda meta: meta.__setitem__("codecs", [{"name": "bytes"}]))
    user_error(run("inspect", store), "array data", "names other codecs")
    user_error(run("decompress", store, tmp_path / "out.npy"), "array data", "names other codecs")
    with pytest.raises(DctchopError, match="names other codecs"):
        dctchop.open(store)


def test_a_chunk_of_another_shape_than_its_arrays_chunks_is_damage(tmp_path):
    """A store whose record and zarr.json agree on a chunk shape its chunk files do not hold: inspect
    parsed each header without comparing, and called the store intact."""
    np.save(tmp_path / "x.npy", smooth((64, 16, 16), "uint8"))
    store = tmp_path / "x.zarr"
    ok(run("compress", tmp_path / "x.npy", store, "--quiet"))  # one chunk of 64
    _edit_json(store / "zarr.json", lambda root: root["attributes"]["dctchop"]["arrays"]["data"].update(
        shape=[65, 16, 16], chunks=[65, 16, 16]))
    _edit_json(store / "data" / "zarr.json", lambda meta: (meta.__setitem__("shape", [65, 16, 16]),
                                                           meta["chunk_grid"]["configuration"].__setitem__(
                                                               "chunk_shape", [65, 16, 16])))
    user_error(run("inspect", store), "chunk 0", "chunk holds uint8[64, 16, 16], expected uint8[65, 16, 16]")


def test_decompress_refuses_a_link_to_nothing_in_a_store_that_lists_no_groups(tmp_path, described_store):
    """Before store format 4 the record does not list groups, so a link's target is checked where it is made."""
    store = copy_store(described_store, tmp_path)
    _edit_json(store / "zarr.json", lambda root: root["attributes"]["dctchop"].update(
        store_format=3, links=[{"path": "/x", "target": "/nope", "kind": "hard"}]))
    out = tmp_path / "out.h5"
    user_error(run("decompress", store, out), "link /x names /nope, which it does not hold")
    assert_no_output(out)


def _zstd_frame_claiming(size: int) -> bytes:
    """A chunk file (zstd frame + crc32c trailer) whose frame header says it holds ``size`` bytes."""
    import google_crc32c

    body = b"\x28\xb5\x2f\xfd\xe0" + size.to_bytes(8, "little") + b"\x01\x00\x00"  # one empty last block
    return body + google_crc32c.value(body).to_bytes(4, "little")


@pytest.mark.parametrize("array", ["images", "labels"])
def test_a_chunk_file_that_says_it_holds_a_terabyte_is_refused_before_anything_is_allocated(
        tmp_path, described_store, array):
    """zstd allocates what a frame's header says: a crafted file of 316 bytes, its size and checksum recorded
    as a store's own, took 6.4 GB to be found damaged (a terabyte: MemoryError, an internal error)."""
    import dctchop
    from dctchop.errors import DctchopError

    store = copy_store(described_store, tmp_path)
    raw = _zstd_frame_claiming(1 << 40)
    checksum = int.from_bytes(raw[-4:], "little")
    if array == "images":
        (store / "images" / "c.0.0.0").write_bytes(raw)
        for key, value in (("stored_bytes", np.array(len(raw), "<i8")), ("checksum", np.array(checksum, "<u4"))):
            (store / "dctchop_meta" / "images" / key / "c.0.0.0").write_bytes(value.tobytes())
    else:
        (store / "labels" / "c" / "0").write_bytes(raw)
        _edit_json(store / "zarr.json", lambda root: root["attributes"]["dctchop"]["lossless_checks"]["labels"]
                   .__setitem__("checksums", [checksum]))
    words = (f"array {array}", "chunk 0", "its zstd frame says it holds 1099511627776 bytes")
    user_error(run("inspect", store), *words)
    user_error(run("decompress", store, tmp_path / "out.h5"), *words)
    with pytest.raises(DctchopError, match=words[-1]):
        dctchop.open(store)[array][:]
