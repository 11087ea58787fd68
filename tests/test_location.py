"""Stores at fsspec URLs (issue #6: a cluster's workers write to a place they can all reach).

``memory://`` is fsspec's in-process filesystem: nothing of it is a local path, so it proves every store
operation (zarr metadata, chunk files, sizes, the final move, --overwrite, clean-up) goes through fsspec.
``file://`` URLs take the same code path and are visible to other processes (the CLI, Dask workers).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import dctchop
from dctchop.errors import DctchopError
from dctchop.formats import open_source
from dctchop.inspect import inspect_store
from dctchop.location import Location
from dctchop.store import CompressOptions, Target, compress

fsspec = pytest.importorskip("fsspec")
DCTCHOP = Path(sys.executable).parent / "dctchop"


@pytest.fixture
def source_h5(tmp_path):
    rng = np.random.default_rng(5)
    y, x = np.meshgrid(np.linspace(0, 3, 16), np.linspace(0, 3, 16), indexing="ij")
    images = (np.sin(x * rng.uniform(1, 2, (40, 1, 1))) * np.cos(y) * 90 + 128).clip(0, 255).astype(np.uint8)
    path = tmp_path / "in.h5"
    with h5py.File(path, "w") as f:
        f["images"] = images
        f["labels"] = np.arange(40)
    return path


@pytest.fixture
def memory_root():
    """A fresh prefix of the in-process memory filesystem, removed afterwards."""
    fs = fsspec.filesystem("memory")
    root = f"/dctchop-test-{np.random.default_rng().integers(1 << 30)}"
    fs.makedirs(root, exist_ok=True)
    yield fs, root
    fs.rm(root, recursive=True)


def store_files(location: Location) -> dict[str, bytes]:
    """Every chunk file of a store (data and metadata) by key, through the Location itself."""
    fs, root = fsspec.core.url_to_fs(location.target) if location.is_url else (fsspec.filesystem("file"), location.target)
    return {p[len(root.rstrip("/")) + 1:]: fs.cat_file(p) for p in fs.find(root) if p.rsplit("/", 1)[-1].startswith("c.")}


@pytest.mark.parametrize("scheduler", [None, pytest.param("threads", marks=pytest.mark.skipif(
    importlib.util.find_spec("dask") is None, reason="Dask's threads scheduler needs the dask extra"))])
def test_memory_url_store_equals_local_store(tmp_path, source_h5, memory_root, scheduler):
    fs, root = memory_root
    url = f"memory://{root}/out.zarr"
    options = CompressOptions(target=Target("psnr", 38.0), chunk_samples=8, scheduler=scheduler)
    local = compress(open_source(str(source_h5)), tmp_path / "local.zarr", options)
    remote = compress(open_source(str(source_h5)), url, options)
    assert not Path("memory:").exists()  # nothing went to a local path named like the URL
    assert store_files(Location(url)) == store_files(Location(tmp_path / "local.zarr"))
    assert fs.ls(root, detail=False) == [f"{root}/out.zarr"]  # no temporary left beside it
    for key in ("stored_bytes", "psnr_min", "max_abs_error", "codec"):
        assert remote["arrays"]["images"][key] == local["arrays"]["images"][key]

    info = inspect_store(url, chunks=True)
    assert info["arrays"]["images"]["stored_bytes"] == local["arrays"]["images"]["stored_bytes"]
    assert info["arrays"]["images"]["damaged_chunks"] == []
    assert inspect_store(url, verify=source_h5)["verify"]["images"]["mismatches"] == []
    ds, ds_local = dctchop.open(url), dctchop.open(tmp_path / "local.zarr")
    np.testing.assert_array_equal(ds[:], ds_local[:])
    np.testing.assert_array_equal(ds["labels"][:], np.arange(40))


def test_memory_url_overwrite_and_refusals(tmp_path, source_h5, memory_root):
    fs, root = memory_root
    url = f"memory://{root}/out.zarr"
    compress(open_source(str(source_h5)), url, CompressOptions(target=Target("psnr", 30.0)))
    with pytest.raises(DctchopError, match="exists; pass overwrite=True \\(--overwrite\\)"):
        compress(open_source(str(source_h5)), url, CompressOptions())
    second = compress(open_source(str(source_h5)), url, CompressOptions(target=Target("psnr", 45.0)), overwrite=True)
    assert inspect_store(url)["arrays"]["images"]["psnr_min"] == second["arrays"]["images"]["psnr_min"] >= 45.0
    assert fs.ls(root, detail=False) == [f"{root}/out.zarr"]

    fs.pipe_file(f"{root}/plain/file.txt", b"not a store")
    with pytest.raises(DctchopError, match="not a dctchop store; refusing"):
        compress(open_source(str(source_h5)), f"memory://{root}/plain", CompressOptions(), overwrite=True)
    assert fs.cat_file(f"{root}/plain/file.txt") == b"not a store"

    # a target the data cannot reach fails after chunks were written: nothing may stay behind
    with pytest.raises(DctchopError, match="ask for less"):
        compress(open_source(str(source_h5)), f"memory://{root}/bad.zarr",
                 CompressOptions(target=Target("psnr", 200.0), precision="int8"))
    assert sorted(fs.ls(root, detail=False)) == [f"{root}/out.zarr", f"{root}/plain"]

    # Dask's worker processes cannot see this process's memory: they failed with "... was removed while
    # chunks were being written"
    with pytest.raises(DctchopError, match="in this process's memory, out of reach of --scheduler processes"):
        compress(open_source(str(source_h5)), f"memory://{root}/far.zarr", CompressOptions(scheduler="processes"))
    assert sorted(fs.ls(root, detail=False)) == [f"{root}/out.zarr", f"{root}/plain"]


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(DCTCHOP), *map(str, args)], check=False, capture_output=True, text=True, timeout=120)


def test_cli_compress_inspect_decompress_at_a_file_url(tmp_path, source_h5):
    url = f"file://{tmp_path}/nested/out.zarr"  # parent directories are made, as on an object store
    p = run("compress", source_h5, url, "--quiet", "--json")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "nested/out.zarr/zarr.json").is_file()
    assert [q.name for q in (tmp_path / "nested").iterdir()] == ["out.zarr"]
    p = run("inspect", url, "--verify", source_h5)
    assert p.returncode == 0, p.stderr
    p = run("decompress", url, tmp_path / "back.h5")
    assert p.returncode == 0, p.stderr
    with h5py.File(tmp_path / "back.h5") as f, h5py.File(source_h5) as g:
        np.testing.assert_array_equal(f["labels"][:], g["labels"][:])
        assert f["images"].shape == g["images"].shape


def test_a_failed_compress_to_a_file_url_removes_the_directories_it_made(tmp_path, source_h5):
    (tmp_path / "kept").mkdir()
    p = run("compress", source_h5, f"file://{tmp_path}/kept/new/deeper/out.zarr", "--psnr", "200",
            "--precision", "int8", "--quiet")  # fails after chunks were written
    assert p.returncode == 1 and "ask for less" in p.stderr, p.stderr
    assert sorted(q.name for q in tmp_path.iterdir()) == ["in.h5", "kept"] and not any((tmp_path / "kept").iterdir())


def test_cli_url_errors_are_one_line(tmp_path, source_h5):
    p = run("inspect", f"file://{tmp_path}/absent.zarr")
    assert p.returncode == 1 and p.stderr.strip().count("\n") == 0 and "does not exist" in p.stderr
    p = run("compress", source_h5, "nosuchprotocol://bucket/out.zarr")
    assert p.returncode == 1 and p.stderr.strip().count("\n") == 0 and "nosuchprotocol" in p.stderr, p.stderr
    code = ("import sys; sys.modules['fsspec'] = None\n"
            "from dctchop.cli.main import main\n"
            f"main(['compress', {str(source_h5)!r}, 's3://bucket/out.zarr'])\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert p.returncode == 1 and "dctchop[dask]" in p.stderr and p.stderr.strip().count("\n") == 0, p.stderr


def test_local_path_of_urls(tmp_path):
    assert Location(tmp_path / "a.zarr").local_path == tmp_path / "a.zarr"
    assert Location(f"file://{tmp_path}/a.zarr").local_path == tmp_path / "a.zarr"
    assert Location(f"local://{tmp_path}/a.zarr").local_path == tmp_path / "a.zarr"
    assert Location("memory://bucket/a.zarr").local_path is None


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in path.rglob("*") if f.is_file()}


@pytest.mark.parametrize("how", ["is the input", "is the input, local://", "contains the input",
                                 "inside the input"])
def test_cli_file_url_output_that_is_or_holds_the_input_is_refused(tmp_path, how):
    # a file:// URL got past the check that a plain path gets: --overwrite replaced the input by a store
    victim = tmp_path / "victim.npy"
    np.save(victim, np.random.default_rng(0).integers(0, 255, (20, 32, 32, 3), dtype=np.uint8))
    before = victim.read_bytes()
    if how.startswith("is the input"):
        url = f"{'local' if 'local' in how else 'file'}://{victim}"
    elif how == "contains the input":  # the input inside an existing store directory: rmtree would delete it
        store = tmp_path / "st.zarr"
        (store / "images").mkdir(parents=True)
        meta = {"zarr_format": 3, "node_type": "group", "attributes": {"dctchop": {}}}  # a dctchop store
        (store / "zarr.json").write_text(json.dumps(meta))
        victim = store / "inner.npy"
        np.save(victim, np.zeros((20, 8, 8), np.uint8))
        before = victim.read_bytes()
        url = f"file://{store}"
    else:
        url = f"file://{victim}/sub.zarr"
    p = run("compress", victim, url, "--overwrite")
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip().count("\n") == 0 and "must not be the input, inside it, or contain it" in p.stderr
    assert victim.is_file() and victim.read_bytes() == before
    assert sorted(q.name for q in victim.parent.iterdir() if q.name.startswith(".")) == []


def test_library_file_url_output_is_the_input_is_refused(tmp_path, source_h5):
    before = snapshot(tmp_path)
    with pytest.raises(DctchopError, match="must not be the input"):
        compress(open_source(str(source_h5)), f"file://{source_h5}", CompressOptions(), overwrite=True)
    assert snapshot(tmp_path) == before


def test_an_output_in_a_parent_reached_through_a_missing_folder_is_refused(tmp_path, monkeypatch):
    """The system resolves "sub/../x.npy" through sub, which Path.resolve() skips: the check passed and the
    write failed as an internal error."""
    from dctchop.errors import DctchopError
    from dctchop.location import check_output_file

    monkeypatch.chdir(tmp_path)
    with pytest.raises(DctchopError, match=r"output directory nosub/\.\. does not exist"):
        check_output_file("nosub/../x.npy", (".npy",))
    (tmp_path / "sub").mkdir()
    assert check_output_file("sub/../x.npy", (".npy",)) == Path("sub/../x.npy")
