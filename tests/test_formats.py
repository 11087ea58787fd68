"""Tests for the input layer (dctchop.formats): selection rules, refusals, lazy and picklable reads."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import re
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import FrozenInstanceError

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dctchop.errors import DctchopError
from dctchop.formats import _HANDLES, Source, SourceArray, close_all, open_source
from dctchop.formats.hdf5 import keep_spans


@pytest.fixture(autouse=True)
def _close_handles():
    yield
    close_all()


def names(arrays):
    return [a.name for a in arrays]


# --------------------------------------------------------------------------------------------------------
# paths
# --------------------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    path = tmp_path / "nope.h5"
    with pytest.raises(DctchopError, match="no such file") as info:
        open_source(path)
    assert str(path) in str(info.value)


def test_directory(tmp_path):
    d = tmp_path / "dir.h5"
    d.mkdir()
    with pytest.raises(DctchopError, match="is a directory") as info:
        open_source(d)
    assert str(d) in str(info.value)


def test_unknown_extension(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("hello")
    with pytest.raises(DctchopError, match="unsupported file type '.txt'") as info:
        open_source(str(path))
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads anything")
def test_unreadable_file(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.zeros((2, 2)))
    path.chmod(0)
    try:
        with pytest.raises(DctchopError, match="permission denied"):
            open_source(path)
    finally:
        path.chmod(0o644)


def test_suffix_case_insensitive(tmp_path):
    np.save(tmp_path / "x.npy", np.ones((2, 3)))
    os.rename(tmp_path / "x.npy", tmp_path / "X.NPY")
    assert open_source(tmp_path / "X.NPY").kind == "npy"
    with h5py.File(tmp_path / "Y.HDF5", "w") as f:
        f["a"] = np.ones((2, 2))
    assert open_source(tmp_path / "Y.HDF5").kind == "hdf5"


# --------------------------------------------------------------------------------------------------------
# .npy
# --------------------------------------------------------------------------------------------------------


def test_npy_basic(tmp_path):
    data = np.arange(5 * 4 * 3, dtype=np.float32).reshape(5, 4, 3)
    path = tmp_path / "field.npy"
    np.save(path, data)
    src = open_source(str(path))
    assert isinstance(src, Source)
    assert src.kind == "npy" and src.path == str(path) and src.groups == {} and src.lossless == ()
    (arr,) = src.lossy
    assert arr.file == str(path) and os.path.isabs(arr.file)
    assert arr.name == "field" and arr.shape == (5, 4, 3) and arr.dtype == np.float32 and arr.attrs == {}
    for start, stop in [(0, 5), (1, 3), (4, 5), (2, 2)]:
        out = arr.read(start, stop)
        np.testing.assert_array_equal(out, data[start:stop])
        assert type(out) is np.ndarray and out.flags.c_contiguous and out.flags.writeable
    np.testing.assert_array_equal(arr.read(), data)
    out = arr.read(0, 1)
    out[...] = -1  # a fresh copy: writing to it never touches the file or later reads
    np.testing.assert_array_equal(arr.read(0, 1), data[:1])


def test_npy_relative_path(tmp_path, monkeypatch):
    np.save(tmp_path / "rel.npy", np.ones((2, 2)))
    monkeypatch.chdir(tmp_path)
    src = open_source("rel.npy")
    assert src.path == str(tmp_path / "rel.npy")


@pytest.mark.parametrize(
    "dtype, fortran",
    [(">f4", False), ("<f8", True), (">i2", True), (">u4", False), ("<u1", True)],
)
def test_npy_fortran_and_big_endian(tmp_path, dtype, fortran):
    data = (np.arange(6 * 5 * 4) % 250).astype(dtype).reshape(6, 5, 4)
    if fortran:
        data = np.asfortranarray(data)
    path = tmp_path / "a.npy"
    np.save(path, data)
    (arr,) = open_source(path).lossy
    assert arr.dtype == np.dtype(dtype).newbyteorder("=") and arr.dtype.isnative
    for start, stop in [(0, 6), (2, 5)]:
        out = arr.read(start, stop)
        assert out.flags.c_contiguous and out.dtype.isnative and out.dtype == arr.dtype
        np.testing.assert_array_equal(out, data[start:stop])


def test_npy_structured_big_endian(tmp_path):
    data = np.array([(1, 2.5), (3, -1.0)], dtype=[("a", ">i4"), ("b", ">f8")])
    np.save(tmp_path / "s.npy", data)
    (arr,) = open_source(tmp_path / "s.npy").lossy
    assert arr.dtype == np.dtype([("a", "=i4"), ("b", "=f8")])
    out = arr.read()
    assert out.tolist() == data.tolist() and out.dtype == arr.dtype


def test_npy_object_refused(tmp_path):
    path = tmp_path / "obj.npy"
    np.save(path, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(DctchopError, match="pickled/object arrays are not supported") as info:
        open_source(path)
    assert str(path) in str(info.value)


class _Evil:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_npy_object_never_unpickled(tmp_path):
    """A malicious object .npy is refused from its header: its pickle payload never runs."""
    path = tmp_path / "evil.npy"
    sentinel = tmp_path / "pwned"
    with open(path, "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, {"descr": "|O", "fortran_order": False, "shape": (1,)})
        fh.write(pickle.dumps(np.array([_Evil(str(sentinel))], dtype=object), protocol=2))
    with pytest.raises(DctchopError, match="pickled/object"):
        open_source(path)
    assert not sentinel.exists()


def test_npy_structured_with_object_field_refused(tmp_path):
    path = tmp_path / "so.npy"
    np.save(path, np.zeros(2, dtype=[("a", "i4"), ("b", "O")]), allow_pickle=True)
    with pytest.raises(DctchopError, match="pickled/object"):
        open_source(path)


def test_npy_truncated(tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.zeros((100, 10), np.float64))
    path.write_bytes(path.read_bytes()[:-17])
    with pytest.raises(DctchopError, match="truncated") as info:
        open_source(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("version", [1, 2])
def test_npy_with_a_padded_header_beyond_numpys_default(tmp_path, version):
    """A header padded to 20 KB (the format allows up to 64 KB in 1.0, 4 GiB in 2.0) was called damaged:
    numpy parses 10,000 bytes unless told more."""
    import struct

    a = np.arange(2048, dtype=np.float32).reshape(8, 16, 16)
    text = "{'descr': '<f4', 'fortran_order': False, 'shape': (8, 16, 16), }"
    prefix, size = (b"\x93NUMPY\x01\x00", "<H") if version == 1 else (b"\x93NUMPY\x02\x00", "<I")
    header = text + " " * (20032 - len(text) - len(prefix) - struct.calcsize(size) - 1) + "\n"
    path = tmp_path / "padded.npy"
    path.write_bytes(prefix + struct.pack(size, len(header)) + header.encode() + a.tobytes())
    (array,) = open_source(path).lossy
    np.testing.assert_array_equal(array.read(), a)


@pytest.mark.parametrize("kind", ["npy", "npy-fortran", "h5"])
@pytest.mark.parametrize("how", ["replaced", "rewritten"])
def test_an_input_changed_while_being_read_is_refused(tmp_path, how, kind):
    """The rows are read slab by slab: a file moved into the input's place during a compress gave a store
    of 18 chunks of one .npy and 7 of the other, exit 0 (an HDF5 file's handle is opened afresh for a new
    file at its path, so it too). Each read compares the file's size and mtime with those at open."""
    path = tmp_path / f"in.{kind[:3]}"
    first = np.arange(400, dtype=np.float32).reshape(40, 10)

    def write(x, to):
        if kind == "h5":
            with h5py.File(to, "w") as f:
                f["x"] = x
        else:
            np.save(to, np.asfortranarray(x) if kind == "npy-fortran" else x)

    write(first, path)
    (array,) = open_source(path).lossy
    np.testing.assert_array_equal(array.read(0, 4), first[:4])
    other = tmp_path / f"other.{kind[:3]}"
    write(3 - first, other)  # the same shape, dtype and size
    os.utime(other, ns=(10, 10))  # another modification time, whatever the clock's resolution
    if how == "replaced":
        os.replace(other, path)
    else:
        path.write_bytes(other.read_bytes())
        os.utime(path, ns=(20, 20))
    with pytest.raises(DctchopError, match=r"in.(npy|h5): changed since it was opened \(replaced, rewritten or "):
        array.read(4, 8)
    close_all(path)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x93NUM",
        os.urandom(64),
        b"\x93NUMPY\x01\x00\x10\x00{'descr': 'oops'",
        b"\x93NUMPY\x09\x00aaaaaaaa",
    ],
    ids=["empty", "short-magic", "random", "bad-header", "bad-version"],
)
def test_npy_garbage(tmp_path, payload):
    path = tmp_path / "junk.npy"
    path.write_bytes(payload)
    with pytest.raises(DctchopError) as info:
        open_source(path)
    msg = str(info.value)
    assert str(path) in msg and "\n" not in msg


def test_npy_zero_d_and_empty(tmp_path):
    np.save(tmp_path / "s.npy", np.float64(2.5))
    (arr,) = open_source(tmp_path / "s.npy").lossy
    assert arr.shape == ()
    out = arr.read()
    assert out.shape == () and out == 2.5
    assert arr.read(0, 1) == 2.5
    with pytest.raises(ValueError):
        arr.read(0, 0)
    np.save(tmp_path / "e.npy", np.zeros((0, 3), np.int16))
    (arr,) = open_source(tmp_path / "e.npy").lossy
    assert arr.read().shape == (0, 3)


def test_npy_dataset_selection(tmp_path):
    np.save(tmp_path / "a.npy", np.ones((2, 2)))
    path = tmp_path / "a.npy"
    assert names(open_source(path, datasets=["a"]).lossy) == ["a"]
    assert names(open_source(path, datasets=["/a"]).lossy) == ["a"]
    src = open_source(path, lossless=["a"])
    assert src.lossy == () and names(src.lossless) == ["a"]
    # "data", its name in the store, names it too (compress reports it under that name)
    assert names(open_source(path, datasets=["data"]).lossy) == ["a"]
    assert names(open_source(path, lossless=["/data"]).lossless) == ["a"]
    with pytest.raises(DctchopError, match="no dataset 'b'; an .npy file holds one array, named 'a' .'data' in"):
        open_source(path, datasets=["b"])
    with pytest.raises(DctchopError, match="both"):
        open_source(path, datasets=["a"], lossless=["data"])


def test_read_range_checked(tmp_path):
    np.save(tmp_path / "a.npy", np.ones((4, 2)))
    (arr,) = open_source(tmp_path / "a.npy").lossy
    for start, stop in [(-1, 2), (3, 2), (0, 5)]:
        with pytest.raises(ValueError):
            arr.read(start, stop)
    for start, stop in [(1.5, 2), (True, 2)]:
        with pytest.raises(TypeError):
            arr.read(start, stop)
    np.testing.assert_array_equal(arr.read(np.int64(1), np.int32(3)), np.ones((2, 2)))


def test_dataclasses_frozen(tmp_path):
    np.save(tmp_path / "a.npy", np.ones((2, 2)))
    src = open_source(tmp_path / "a.npy")
    with pytest.raises(FrozenInstanceError):
        src.kind = "x"
    with pytest.raises(FrozenInstanceError):
        src.lossy[0].shape = (1,)
    assert len({src.lossy[0], open_source(tmp_path / "a.npy").lossy[0]}) == 1  # hashable despite attrs
    assert hash(src) == hash(open_source(tmp_path / "a.npy"))


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(0, 6), min_size=1, max_size=4).map(tuple),
    dtype=st.sampled_from(["<f4", ">f8", "<i2", ">u2", "u1", "<f2"]),
    fortran=st.booleans(),
    data=st.data(),
)
def test_npy_slices_property(shape, dtype, fortran, data):
    rng = np.random.default_rng(0)
    arr = (rng.standard_normal(shape) * 50).astype(dtype)
    if fortran:
        arr = np.asfortranarray(arr)
    start = data.draw(st.integers(0, shape[0]))
    stop = data.draw(st.integers(start, shape[0]))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "p.npy")
        np.save(path, arr)
        (src,) = open_source(path).lossy
        out = src.read(start, stop)
        assert out.dtype.isnative and out.flags.c_contiguous
        np.testing.assert_array_equal(out, arr[start:stop])
        close_all()


# --------------------------------------------------------------------------------------------------------
# HDF5
# --------------------------------------------------------------------------------------------------------


@pytest.fixture
def h5file(tmp_path):
    """A file with one of everything the default selection has to sort."""
    path = tmp_path / "data.h5"
    rng = np.random.default_rng(1)
    with h5py.File(path, "w") as f:
        f.attrs["title"] = "test"
        f.attrs["n"] = np.int64(3)
        f.create_dataset(
            "images", data=rng.integers(0, 255, (10, 4, 4, 3), dtype=np.uint8), chunks=(3, 4, 4, 3)
        )
        f["images"].attrs["layout"] = "NHWC"
        f.create_dataset("labels", data=np.arange(10, dtype=np.int64))
        f.create_dataset("scalar", data=np.float32(1.5))
        g = f.create_group("group")
        g.attrs["units"] = b"m/s"
        g.create_dataset("x", data=rng.standard_normal((6, 5)).astype(">f4"))
        g.create_group("empty")
        f.create_dataset("flags", data=np.ones((10, 2), bool))
        f.create_dataset("names", data=np.array([b"a", b"bb"]))
        f.create_dataset("cplx", data=np.ones((3, 3), np.complex64))
        f.create_dataset("rec", data=np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]))
        f.create_dataset(
            "kind", data=np.zeros((4, 4), np.uint8), dtype=h5py.enum_dtype({"A": 0, "B": 1}, basetype="u1")
        )
    return path


def test_hdf5_default_selection(h5file):
    src = open_source(h5file)
    assert src.kind == "hdf5" and src.path == str(h5file)
    assert names(src.lossy) == ["/group/x", "/images"]
    assert sorted(names(src.lossless)) == ["/cplx", "/flags", "/kind", "/labels", "/names", "/rec", "/scalar"]
    assert set(src.groups) == {"/", "/group", "/group/empty"}
    assert src.groups["/"] == {"title": "test", "n": 3}
    assert src.groups["/group"] == {"units": "m/s"}
    assert src.groups["/group/empty"] == {}
    by_name = {a.name: a for a in src.arrays}
    assert by_name["/images"].attrs == {"layout": "NHWC"}
    assert by_name["/group/x"].dtype == np.dtype("float32") and by_name["/group/x"].dtype.isnative
    assert by_name["/kind"].dtype == np.dtype("uint8") and by_name["/kind"].dtype.metadata is None
    assert by_name["/names"].dtype == np.dtype("S2")
    with h5py.File(h5file, "r") as f:
        for a in src.arrays:
            assert a.file == str(h5file)
            assert a.shape == f[a.name].shape
            out = a.read()
            assert out.dtype == a.dtype and out.flags.c_contiguous
            np.testing.assert_array_equal(out, f[a.name][()])


@pytest.mark.parametrize("start, stop", [(0, 10), (0, 1), (2, 7), (9, 10), (5, 5)])
def test_hdf5_slices(h5file, start, stop):
    src = open_source(h5file)
    with h5py.File(h5file, "r") as f:
        for a in src.lossy:
            n = a.shape[0]
            s0, s1 = min(start, n), min(stop, n)
            out = a.read(s0, s1)
            assert out.flags.c_contiguous and out.dtype.isnative
            np.testing.assert_array_equal(out, f[a.name][s0:s1])


def test_hdf5_handle_cached_per_process(h5file):
    (images,) = [a for a in open_source(h5file).lossy if a.name == "/images"]
    images.read(0, 2)
    keys = set(_HANDLES)
    for i in range(5):
        images.read(i, i + 1)
    assert set(_HANDLES) == keys and len([k for k in keys if k[1] == str(h5file)]) == 1


def test_hdf5_reopen_after_rewrite(tmp_path):
    path = tmp_path / "r.h5"
    with h5py.File(path, "w") as f:
        f["a"] = np.zeros((3, 3))
    open_source(path).lossy[0].read()
    close_all(path)  # release this process's handle before rewriting the file
    with h5py.File(path, "w") as f:
        f["a"] = np.ones((4, 3))
    (a,) = open_source(path).lossy
    np.testing.assert_array_equal(a.read(), np.ones((4, 3)))


@pytest.mark.parametrize("kind", ["h5", "npy", "npy-fortran"])
def test_a_file_rewritten_at_the_same_path_is_read_afresh(tmp_path, kind):
    # a long-lived Dask worker keeps its handles from one compress to the next (open_source runs in the
    # client, not there), and compressed the file it had first read: wrong data, exit 0
    path = tmp_path / ("x.h5" if kind == "h5" else "x.npy")

    def write(value, to):
        x = np.full((4, 8, 8), value, np.float32)
        if kind == "h5":
            with h5py.File(to, "w") as f:
                f["a"] = x
        else:
            np.save(to, np.asfortranarray(x) if kind == "npy-fortran" else x)

    write(1, path)
    (a,) = open_source(path).lossy
    np.testing.assert_array_equal(a.read(0, 2), 1)
    write(2, tmp_path / "new")
    os.replace(tmp_path / ("new.npy" if kind != "h5" else "new"), path)
    (b,) = open_source(path).lossy  # the next compress
    np.testing.assert_array_equal(b.read(0, 2), 2)
    with pytest.raises(DctchopError, match="changed since it was opened"):  # the first one, not yet done
        a.read(2, 4)
    close_all(path)


def test_hdf5_attrs_converted(tmp_path):
    path = tmp_path / "attrs.h5"
    with h5py.File(path, "w") as f:
        d = f.create_dataset("d", data=np.zeros((2, 2)))
        d.attrs["i"] = np.int32(-4)
        d.attrs["u"] = np.uint64(2**63)
        d.attrs["f"] = np.float32(0.5)
        d.attrs["nan"] = np.nan
        d.attrs["b"] = np.bool_(True)
        d.attrs["s"] = "héllo"
        d.attrs["bytes"] = b"raw"
        d.attrs["bad_bytes"] = np.void(b"\xff\xfe")
        d.attrs["arr"] = np.arange(6).reshape(2, 3)
        d.attrs["farr"] = np.array([1.5, 2.5], ">f8")
        d.attrs["strs"] = ["a", "bc"]
        d.attrs["fixed"] = np.array([b"x", b"yz"])
        d.attrs["cplx"] = np.complex64(1 + 2j)
        d.attrs["ref"] = f.ref
        d.attrs["rec"] = np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")])
        f.attrs["root_cplx"] = np.array([1j])
    source = open_source(path)
    (arr,) = source.lossy
    a = arr.attrs
    assert a["i"] == -4 and type(a["i"]) is int
    assert a["u"] == 2**63 and a["f"] == 0.5 and type(a["f"]) is float
    assert np.isnan(a["nan"]) and a["b"] is True
    assert a["s"] == "héllo" and a["bytes"] == "raw"
    assert a["arr"] == [[0, 1, 2], [3, 4, 5]] and a["farr"] == [1.5, 2.5]
    assert a["strs"] == ["a", "bc"] and a["fixed"] == ["x", "yz"]
    for dropped in ("cplx", "ref", "bad_bytes", "rec"):  # a record as a list would lose its fields' names
        assert dropped not in a
    json.dumps(a)  # serialisable as is
    assert source.dropped_attrs == ("/@root_cplx", "/d@bad_bytes", "/d@cplx", "/d@rec", "/d@ref")


def test_hdf5_explicit_datasets(h5file):
    src = open_source(h5file, datasets=["images", "/group//x/"], lossless=["labels"])
    assert names(src.lossy) == ["/images", "/group/x"]
    # the datasets lossless by default are still copied, each once (labels is also named --lossless)
    assert sorted(names(src.lossless)) == ["/cplx", "/flags", "/kind", "/labels", "/names", "/rec", "/scalar"]
    assert set(src.groups) == {"/", "/group", "/group/empty"}
    assert src.left_out == ()
    # a dataset that would be lossy but is not named is left out, and listed
    src = open_source(h5file, datasets=["images"])
    assert names(src.lossy) == ["/images"] and src.left_out == ("/group/x",)
    assert "/labels" in names(src.lossless)
    # duplicates collapse
    assert names(open_source(h5file, datasets=["images", "/images"]).lossy) == ["/images"]


def test_hdf5_missing_dataset_lists_available(h5file):
    with pytest.raises(DctchopError, match="no dataset /nope") as info:
        open_source(h5file, datasets=["nope"])
    msg = str(info.value)
    assert str(h5file) in msg and "/images" in msg and "/group/x" in msg and "\n" not in msg
    with pytest.raises(DctchopError, match="no dataset /images/deeper"):
        open_source(h5file, datasets=["images/deeper"])
    with pytest.raises(DctchopError, match="no dataset /missing"):
        open_source(h5file, lossless=["missing"])


def test_hdf5_group_is_not_a_dataset(h5file):
    with pytest.raises(DctchopError, match="/group is a group"):
        open_source(h5file, datasets=["group"])


@pytest.mark.parametrize(
    "name, what",
    [("cplx", "complex"), ("flags", "bool"), ("names", "string"), ("rec", "compound"), ("kind", "enum")],
)
def test_hdf5_non_numeric_refused_as_lossy(h5file, name, what):
    with pytest.raises(DctchopError, match=what) as info:
        open_source(h5file, datasets=[name])
    assert f"/{name}" in str(info.value)
    # ...but each copies losslessly when asked to
    assert names(open_source(h5file, datasets=["images"], lossless=[name]).lossless).count(f"/{name}") == 1


def test_hdf5_lossless_override(h5file):
    src = open_source(h5file, lossless=["images"])
    assert names(src.lossy) == ["/group/x"]
    assert "/images" in names(src.lossless)
    with pytest.raises(DctchopError, match="both"):
        open_source(h5file, datasets=["images"], lossless=["/images"])


def test_hdf5_variable_length_refused(tmp_path):
    path = tmp_path / "vlen.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.ones((3, 3))
        f.create_dataset("names", data=["a", "bcd"], dtype=h5py.string_dtype())
    with pytest.raises(DctchopError, match="/names has dtype variable-length utf-8 string"):
        open_source(path)
    with pytest.raises(DctchopError, match="variable-length"):
        open_source(path, datasets=["x"], lossless=["names"])
    # explicit selection leaves it out, and says so
    src = open_source(path, datasets=["x"])
    assert names(src.lossy) == ["/x"] and src.lossless == () and src.left_out == ("/names",)


def test_hdf5_per_sample_tables_are_copied_bit_exactly(tmp_path):
    # boxes and one-hot labels beside images were compressed as one "HW" image across samples
    rng = np.random.default_rng(0)
    path = tmp_path / "bbox.h5"
    with h5py.File(path, "w") as f:
        f["images"] = (rng.random((200, 32, 32, 3)) * 255).astype(np.uint8)
        f["boxes"] = (rng.random((200, 4)) * 32).astype(np.float32)
        f["onehot"] = np.eye(10, dtype=np.float32)[rng.integers(0, 10, 200)]
        f["labels"] = rng.integers(0, 5, 200)
        f["mean_image"] = rng.random((32, 32)).astype(np.float32)  # not 200 of anything: an image
    src = open_source(path)
    assert names(src.lossy) == ["/images", "/mean_image"]
    assert sorted(names(src.lossless)) == ["/boxes", "/labels", "/onehot"]
    # named, a table is compressed lossily as asked
    assert names(open_source(path, datasets=["images", "boxes"]).lossy) == ["/images", "/boxes"]


def test_hdf5_narrow_table_beside_labels_is_per_sample_but_a_lone_field_is_not(tmp_path):
    path = tmp_path / "tables.h5"
    with h5py.File(path, "w") as f:
        f["points"] = np.random.default_rng(1).random((500, 3)).astype(np.float32)  # xyz of each sample
        f["features"] = np.random.default_rng(2).random((500, 7)).astype(np.float32)  # narrower than a block
        f["labels"] = np.arange(500) % 4
        f["field"] = np.ones((64, 64), np.float32)  # a 2-D field with its coordinates
        f["wide"] = np.ones((500, 8), np.float32)  # a block wide, and no stack of 500 samples: a 2-D field
        f["x"] = np.arange(64.0)
    src = open_source(path)
    assert names(src.lossy) == ["/field", "/wide"]
    assert sorted(names(src.lossless)) == ["/features", "/labels", "/points", "/x"]


def test_hdf5_empty_dataset_is_copied_not_compressed(tmp_path):
    path = tmp_path / "empty.h5"
    with h5py.File(path, "w") as f:
        f["images"] = np.ones((4, 8, 8), np.uint8)
        f.create_dataset("emptyds", shape=(0, 8, 8), dtype="f4")
    src = open_source(path)
    assert names(src.lossy) == ["/images"] and names(src.lossless) == ["/emptyds"]
    with pytest.raises(DctchopError, match=r"/emptyds is empty \(shape \[0, 8, 8\]\).*--lossless"):
        open_source(path, datasets=["emptyds"])


@pytest.mark.parametrize("bad", ["zarr.json", "g/zarr.json", "zarr.json/x", "dctchop_meta", "dctchop_meta/x"])
def test_hdf5_names_the_store_keeps_for_itself(tmp_path, bad):
    # a dataset named zarr.json failed compress with "File exists"
    path = tmp_path / "names.h5"
    with h5py.File(path, "w") as f:
        f["images"] = np.ones((4, 8, 8), np.uint8)
        f[bad] = np.arange(4)
    what = "group" if bad.endswith("/x") else "dataset"
    top = "/" + bad.split("/x")[0]
    with pytest.raises(DctchopError, match=f"{what} {top} would take the place of .*--dataset") as info:
        open_source(path)
    assert "zarr.json" in str(info.value) or "metadata group dctchop_meta" in str(info.value)
    src = open_source(path, datasets=["images"])  # naming the datasets leaves it out
    assert names(src.lossy) == ["/images"] and src.lossless == ()
    assert f"/{bad}" in src.left_out
    with pytest.raises(DctchopError, match="would take the place of"):
        open_source(path, datasets=["images"], lossless=[bad])


@pytest.mark.parametrize("bad", ["back\\slash", "g\\h/x", "labels\\1"])
def test_hdf5_names_with_a_backslash_are_refused(tmp_path, bad):
    # Zarr reads a backslash in a key as "/": the array's metadata went to back/slash/zarr.json, its chunks to
    # back\slash/c.0.0.0, and compress reported success on a store that inspect called damaged
    path = tmp_path / "names.h5"
    with h5py.File(path, "w") as f:
        f["images"] = np.ones((4, 8, 8), np.uint8)
        f[bad] = np.ones((4, 8, 8), np.float32) if bad != "labels\\1" else np.arange(4)
    what = "group" if bad.endswith("/x") else "dataset"
    top = "/" + bad.split("/x")[0]
    with pytest.raises(DctchopError, match=f"{what} {re.escape(top)} has a backslash in its name.*--dataset"):
        open_source(path)
    src = open_source(path, datasets=["images"])
    assert names(src.lossy) == ["/images"] and f"/{bad}" in src.left_out


def test_hdf5_utf8_strings_and_bitfields_are_copied(tmp_path):
    # HDF5 has no conversion from a fixed-length UTF-8 string or a bitfield to a plain numpy dtype: reading
    # them straight into such a buffer failed, with --lossless too
    path = tmp_path / "types.h5"
    utf8 = h5py.string_dtype("utf-8", 4)
    with h5py.File(path, "w") as f:
        f["images"] = np.ones((4, 8, 8), np.float32)
        f["names"] = np.array(["\u00e4".encode(), b"b"], dtype=utf8)
        f["rec"] = np.array([(1, "\u00e4".encode())], dtype=[("a", "<i4"), ("s", utf8)])
        bits = h5py.h5d.create(f.id, b"bits", h5py.h5t.STD_B16BE, h5py.h5s.create_simple((8,)))
        bits.write(h5py.h5s.ALL, h5py.h5s.ALL, np.arange(8, dtype=">u2"), mtype=h5py.h5t.STD_B16BE)
    src = open_source(path)
    got = {a.name: a.read() for a in src.lossless}
    assert got["/names"].tolist() == [b"\xc3\xa4", b"b"] and got["/rec"].tolist() == [(1, b"\xc3\xa4")]
    assert got["/bits"].tolist() == list(range(8)) and got["/bits"].dtype == np.uint16


def test_store_names_known_to_the_input_layer_are_the_stores():
    from dctchop.formats import hdf5
    from dctchop.store import META_GROUP

    assert hdf5.META_GROUP == META_GROUP


def test_hdf5_root_attribute_named_like_the_store_record_is_refused(tmp_path):
    # the store's own "dctchop" attribute replaced it silently
    path = tmp_path / "attr.h5"
    with h5py.File(path, "w") as f:
        f["images"] = np.ones((4, 8, 8), np.uint8)
        f.attrs["dctchop"] = "my pipeline v2"
        f["images"].attrs["dctchop"] = "fine on a dataset"
    with pytest.raises(DctchopError, match="root group has an attribute named 'dctchop'.*rename"):
        open_source(path)


def test_hdf5_masks_and_other_integers_are_copied_by_default(tmp_path):
    """Integer maps with one value per pixel of a colour image stack (masks, class ids) and dtypes the codec
    does not take (int32, int64, int8, ...) are copied bit-exactly by default; a grey stack beside colour
    images of another size, and float maps, stay lossy."""
    path = tmp_path / "seg.h5"
    rng = np.random.default_rng(2)
    with h5py.File(path, "w") as f:
        f["rgb"] = rng.integers(0, 256, (6, 16, 20, 3), dtype=np.uint8)
        f["nchw"] = rng.integers(0, 256, (6, 4, 12, 10), dtype=np.uint8)
        f["masks"] = rng.integers(0, 5, (6, 16, 20), dtype=np.uint8)
        f["ids"] = rng.integers(0, 5, (6, 1, 12, 10), dtype=np.uint16)
        f["classes"] = rng.integers(0, 5, (6, 16, 20, 1), dtype=np.int16)
        f["depth"] = rng.random((6, 16, 20), dtype=np.float32)  # continuous: lossy
        f["grey"] = rng.integers(0, 256, (6, 16, 16), dtype=np.uint8)  # another size: an image stack
        for dtype in ("int8", "int32", "int64", "uint32", "uint64"):
            f[dtype] = np.arange(6 * 64, dtype=dtype).reshape(6, 8, 8)
    src = open_source(path)
    assert names(src.lossy) == ["/depth", "/grey", "/nchw", "/rgb"]
    assert sorted(names(src.lossless)) == ["/classes", "/ids", "/int32", "/int64", "/int8", "/masks", "/uint32",
                                           "/uint64"]
    (named,) = open_source(path, datasets=["masks"]).lossy  # naming one still compresses it
    assert named.name == "/masks"
    with h5py.File(tmp_path / "flow.h5", "w") as f:  # two channels are a "colour" stack too (flow, dual-pol)
        f["flow"] = rng.integers(0, 256, (6, 16, 20, 2), dtype=np.uint8)
        f["valid"] = rng.integers(0, 2, (6, 16, 20), dtype=np.uint8)
    src = open_source(tmp_path / "flow.h5")
    assert names(src.lossy) == ["/flow"] and names(src.lossless) == ["/valid"]


def test_hdf5_big_endian_and_zero_d(tmp_path):
    path = tmp_path / "be.h5"
    data = np.arange(24, dtype=">i4").reshape(4, 6)
    with h5py.File(path, "w") as f:
        f["be"] = data
        f["s"] = np.array(7.0, ">f8")
        f.create_dataset("z", shape=(0, 5), dtype="<f4")
    src = open_source(path)
    by = {a.name: a for a in src.arrays}
    assert by["/be"].dtype == np.dtype("int32") and by["/be"].dtype.isnative
    np.testing.assert_array_equal(by["/be"].read(1, 3), data[1:3])
    out = by["/s"].read()
    assert out.shape == () and out == 7.0 and out.dtype.isnative
    assert by["/z"].shape == (0, 5) and by["/z"].read().shape == (0, 5)


def test_hdf5_array_datatype_expands(tmp_path):
    path = tmp_path / "arrtype.h5"
    with h5py.File(path, "w") as f:
        tid = h5py.h5t.array_create(h5py.h5t.py_create(np.dtype(">f4")), (3,))
        h5py.h5d.create(f.id, b"v", tid, h5py.h5s.create_simple((4,)))
        f["v"][...] = np.arange(12, dtype=">f4").reshape(4, 3)
    (a,) = open_source(path).lossy
    assert a.shape == (4, 3) and a.dtype == np.float32
    np.testing.assert_array_equal(a.read(1, 3), np.arange(3, 9, dtype=np.float32).reshape(2, 3))


def test_hdf5_garbage(tmp_path):
    path = tmp_path / "junk.h5"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(DctchopError, match="not an HDF5 file") as info:
        open_source(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_hdf5_soft_and_hard_links(tmp_path):
    path = tmp_path / "links.h5"
    with h5py.File(path, "w") as f:
        f["data/x"] = np.arange(12.0).reshape(4, 3)
        f["alias"] = h5py.SoftLink("/data/x")
        f["data/rel"] = h5py.SoftLink("x")
        f["hard"] = f["data/x"]  # a second hard link to the same object
        f["dangling"] = h5py.SoftLink("/nowhere")
        f["data/up"] = h5py.SoftLink("../data/x")  # HDF5 has no "..": it names nothing either
        f["data/here"], f["dot"] = h5py.SoftLink("./x"), h5py.SoftLink("/data/./x")  # "." is the group it is in
    assert h5py.File(path)["data/here"].shape == h5py.File(path)["dot"].shape == (4, 3)
    src = open_source(path)
    assert names(src.lossy) == ["/data/x"]  # each object once, aliases not duplicated
    assert src.dropped_links == ("/dangling -> /nowhere", "/data/up -> ../data/x")  # said, not silently lost
    # the aliases of what is stored, resolved to the object's own path; the dangling link names nothing
    assert src.links == (("/alias", "/data/x", "soft"), ("/data/here", "/data/x", "soft"),
                         ("/data/rel", "/data/x", "soft"), ("/dot", "/data/x", "soft"), ("/hard", "/data/x", "hard"))
    # named through an alias, stored under its own path all the same: the file's structure comes back
    # (it was stored as /alias, and decompress made /alias a hard link)
    for alias in ("alias", "data/rel", "hard", "/alias", "data/x", "dot", "data/here"):
        named = open_source(path, datasets=[alias])
        assert names(named.lossy) == ["/data/x"] and named.links == src.links
        np.testing.assert_array_equal(named.lossy[0].read(1, 3), np.arange(3.0, 9.0).reshape(2, 3))
    assert names(open_source(path, datasets=["alias", "hard"]).lossy) == ["/data/x"]  # one object, once
    # named both ways: the exact copy keeps the name given, the lossy one its own path unless that is taken
    both = open_source(path, datasets=["alias"], lossless=["hard"])
    assert (names(both.lossy), names(both.lossless)) == (["/data/x"], ["/hard"])
    both = open_source(path, datasets=["alias"], lossless=["data/x"])
    assert (names(both.lossy), names(both.lossless)) == (["/alias"], ["/data/x"])
    with pytest.raises(DctchopError, match="soft link to /nowhere"):
        open_source(path, datasets=["dangling"])


@pytest.fixture
def external(tmp_path):
    """main.h5 with an external link to a dataset and to a group in sub/other.h5."""
    (tmp_path / "sub").mkdir()
    other = tmp_path / "sub" / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.arange(20.0).reshape(4, 5)
        f["g/y"] = np.arange(6, dtype=np.int16).reshape(3, 2)
        f["g"].attrs["where"] = "other"
    main = tmp_path / "main.h5"
    with h5py.File(main, "w") as f:
        f["local"] = np.ones((2, 2))
        f["ext"] = h5py.ExternalLink("sub/other.h5", "/x")
        f["extg"] = h5py.ExternalLink("sub/other.h5", "/g")
    return main


def test_external_link_refused_by_default(external):
    with pytest.raises(DctchopError, match="/ext is an external link.*follow_external=True") as info:
        open_source(external)
    assert "--follow-external" in str(info.value)
    with pytest.raises(DctchopError, match="/ext is an external link"):
        open_source(external, datasets=["ext"])
    with pytest.raises(DctchopError, match="/extg is an external link"):
        open_source(external, datasets=["extg/y"])
    # not selected: not followed, not refused
    assert names(open_source(external, datasets=["local"]).lossy) == ["/local"]


def test_external_link_followed(external, monkeypatch):
    monkeypatch.chdir("/")  # relative link targets resolve against the linking file, not the cwd
    src = open_source(external, follow_external=True)
    assert src.follow_external and not open_source(external, datasets=["local"]).follow_external
    assert names(src.lossy) == ["/ext", "/extg/y", "/local"]
    assert src.groups["/extg"] == {"where": "other"}
    by = {a.name: a for a in src.lossy}
    assert all(a.file == str(external) for a in src.lossy)
    np.testing.assert_array_equal(by["/ext"].read(1, 3), np.arange(5.0, 15.0).reshape(2, 5))
    np.testing.assert_array_equal(by["/extg/y"].read(), np.arange(6, dtype=np.int16).reshape(3, 2))
    (a,) = open_source(external, datasets=["extg/y"], follow_external=True).lossy
    assert a.shape == (3, 2)


def test_external_link_target_missing(external):
    os.remove(external.parent / "sub" / "other.h5")
    with pytest.raises(DctchopError, match="cannot be followed"):
        open_source(external, datasets=["ext"], follow_external=True)


def test_an_object_whose_header_is_damaged_is_named_in_a_sentence(tmp_path):
    with h5py.File(tmp_path / "x.h5", "w", libver="latest") as f:  # object headers then begin "OHDR"
        f["a"], f["x"] = np.zeros((4, 8, 8), np.uint8), np.ones((4, 8, 8), np.uint8)
    data = bytearray((tmp_path / "x.h5").read_bytes())
    last = data.rfind(b"OHDR")  # x's, written last
    data[last : last + 4] = b"XXXX"
    (tmp_path / "x.h5").write_bytes(bytes(data))
    with pytest.raises(DctchopError, match=r"x.h5: /x cannot be opened \(.*object header"):  # was "/x is an cannot"
        open_source(tmp_path / "x.h5")


def test_virtual_dataset(tmp_path):
    src_file = tmp_path / "part.h5"
    with h5py.File(src_file, "w") as f:
        f["p"] = np.arange(12.0).reshape(3, 4)
    path = tmp_path / "vds.h5"
    with h5py.File(path, "w") as f:
        f["local"] = np.arange(8.0).reshape(2, 4)
        layout = h5py.VirtualLayout(shape=(3, 4), dtype="f8")
        layout[:] = h5py.VirtualSource("part.h5", "p", shape=(3, 4))
        f.create_virtual_dataset("v", layout)
        inner = h5py.VirtualLayout(shape=(2, 4), dtype="f8")
        inner[:] = h5py.VirtualSource(".", "local", shape=(2, 4))
        f.create_virtual_dataset("same", inner)
    with pytest.raises(DctchopError, match="/v is a virtual dataset.*part.h5.*follow_external=True"):
        open_source(path)
    (same,) = open_source(path, datasets=["same"]).lossy  # sources inside the file are fine
    np.testing.assert_array_equal(same.read(), np.arange(8.0).reshape(2, 4))
    src = open_source(path, follow_external=True)
    by = {a.name: a for a in src.lossy}
    np.testing.assert_array_equal(by["/v"].read(1, 3), np.arange(4.0, 12.0).reshape(2, 4))
    close_all()
    os.remove(src_file)  # a VDS reads missing sources as fill values: must be an error, not zeros
    with pytest.raises(DctchopError, match="missing files"):
        open_source(path, datasets=["v"], follow_external=True)


def test_virtual_dataset_whose_source_dataset_is_missing(tmp_path):
    """A source dataset that is not there reads as fill values as silently as a missing source file: a
    store of zeros, 'PSNR inf', and inspect --verify agreeing (the VDS reads zeros too)."""
    with h5py.File(tmp_path / "part.h5", "w") as f:
        f["p"] = np.arange(12.0).reshape(3, 4)
    path = tmp_path / "vds.h5"
    with h5py.File(path, "w") as f:
        f["local"] = np.arange(8.0).reshape(2, 4)
        for name, source in (("typo", h5py.VirtualSource(".", "locall", shape=(2, 4))),
                             ("other", h5py.VirtualSource("part.h5", "q", shape=(3, 4)))):
            layout = h5py.VirtualLayout(shape=source.shape, dtype="f8")
            layout[:] = source
            f.create_virtual_dataset(name, layout)
    with pytest.raises(DctchopError, match=r"/typo is a virtual dataset whose sources are missing \(locall\)"):
        open_source(path, datasets=["typo"])
    with pytest.raises(DctchopError, match=r"/other is a virtual dataset whose sources are missing \(part.h5:q\)"):
        open_source(path, datasets=["other"], follow_external=True)



def test_virtual_dataset_source_found_where_hdf5_looks_first(tmp_path, monkeypatch):
    """A relative source file is looked for beside the virtual dataset before the working directory, as HDF5
    does: an unrelated file of that name in the working directory made a readable dataset 'missing'."""
    (tmp_path / "d").mkdir()
    with h5py.File(tmp_path / "d" / "src.h5", "w") as f:
        f["x"] = np.arange(12.0).reshape(3, 4)
    with h5py.File(tmp_path / "src.h5", "w") as f:
        f["unrelated"] = np.zeros(3)
    with h5py.File(tmp_path / "d" / "vds.h5", "w") as f:
        layout = h5py.VirtualLayout(shape=(3, 4), dtype="f8")
        layout[:] = h5py.VirtualSource("src.h5", "x", shape=(3, 4))
        f.create_virtual_dataset("v", layout)
    monkeypatch.chdir(tmp_path)
    (v,) = open_source(tmp_path / "d" / "vds.h5", follow_external=True).lossy
    np.testing.assert_array_equal(v.read(), np.arange(12.0).reshape(3, 4))
    close_all()


# --------------------------------------------------------------------------------------------------------
# HDF5 chunks that slabs cut: each row of chunks read once, for the length of one operation
# --------------------------------------------------------------------------------------------------------


def _chunked(path, x, chunks, compression=None):
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x, chunks=chunks, compression=compression)
    return open_source(path, lossless=["x"] if x.dtype.names else ()).arrays[0]


def test_hdf5_span_length():
    from dctchop.formats.hdf5 import READ_BUDGET, span_length

    assert span_length((400000, 32, 32), None, 1) is None  # contiguous: nothing decompressed twice
    assert span_length((400000, 32, 32), (25000, 2, 2), 1) == 25000  # h5py's chunks=True: one row of 25 MB
    assert span_length((100000, 32, 32), (100000, 1, 32), 1) == 100000  # every sample in one 100 MB row
    # a 400 MB row is more than the budget: spans of 256 MB, each decompressing the row once
    assert READ_BUDGET == 256 << 20
    assert span_length((400000, 32, 32), (400000, 1, 32), 1) == 262144
    assert span_length((3, 1 << 15, 1 << 15), (3, 64, 64), 4) == 1  # one sample beyond the budget


@pytest.mark.parametrize(
    "shape, chunks, compression, dtype",
    [
        ((40, 6, 8), (40, 1, 8), "gzip", "u1"),  # chunks across all samples
        ((40, 6, 8), (7, 3, 5), None, ">f4"),  # rows that slabs of 5 cut, big-endian
        ((40, 4, 6, 3), (16, 2, 2, 3), "gzip", "<i2"),  # a 4-D stack
        ((40, 3), (40, 3), "gzip", [("a", "<i4"), ("b", ">f8")]),  # records, read through h5py's getitem
    ],
)
def test_hdf5_slabs_in_order_read_chunk_rows_once(tmp_path, hdf5_reads, spans_kept, shape, chunks, compression,
                                                  dtype):
    """HDF5 decompresses a chunk whole for any part of it: slabs of 5 samples through chunks of 40 along axis 0
    decompressed each chunk 8 times, once per slab (a compress of 400000 such samples took 27 s, not 3)."""
    x = np.random.default_rng(0).integers(0, 100, shape).astype(dtype)
    a = _chunked(tmp_path / "c.h5", x, chunks, compression)
    with keep_spans():
        got = np.concatenate([a.read(s, s + 5) for s in range(0, 40, 5)])
        assert spans_kept() == []  # each span was dropped once a read took its last row
    np.testing.assert_array_equal(got, x)
    c0 = chunks[0]
    for row in range(-(-40 // c0)):
        touching = [(lo, hi) for lo, hi in hdf5_reads if lo < (row + 1) * c0 and hi > row * c0]
        assert len(touching) == 1, (row, hdf5_reads)


def test_hdf5_slabs_read_in_turns_from_two_stretches_read_each_row_once(tmp_path, hdf5_reads, spans_kept,
                                                                         monkeypatch):
    """Dask's threads each encode a stretch of consecutive chunks, so one process reads slabs from several
    places in turns: the spans of each are kept (up to READ_BUDGET in all), not read again for the other's."""
    from dctchop.formats import hdf5

    x = np.random.default_rng(4).integers(0, 255, (40, 6, 8), dtype=np.uint8)
    a = _chunked(tmp_path / "t.h5", x, (10, 6, 8), "gzip")
    turns = [(s, s + 4) for s in range(0, 20, 4)]
    turns = [r for pair in zip(turns, [(s + 20, e + 20) for s, e in turns]) for r in pair]
    with keep_spans():
        for start, stop in turns:
            np.testing.assert_array_equal(a.read(start, stop), x[start:stop])
    assert sorted(hdf5_reads) == [(0, 10), (10, 20), (20, 30), (30, 40)]
    hdf5_reads.clear()
    monkeypatch.setattr(hdf5, "READ_BUDGET", 10 * 48)  # room for one span: the oldest is dropped
    with keep_spans():
        for start, stop in [(1, 3), (21, 23), (3, 5)]:
            np.testing.assert_array_equal(a.read(start, stop), x[start:stop])
        assert spans_kept() == [("t.h5", "/x", 0)]
    assert hdf5_reads == [(0, 10), (20, 30), (0, 10)]


@pytest.mark.parametrize("chunks", [None, (5, 6, 8), (1, 6, 8)])
def test_hdf5_slabs_of_whole_rows_are_read_directly(tmp_path, hdf5_reads, spans_kept, chunks):
    """Contiguous data, and slabs made of whole rows of chunks, are read straight into the result."""
    x = np.arange(40 * 48, dtype=np.uint16).reshape(40, 6, 8)
    a = _chunked(tmp_path / "d.h5", x, chunks)
    with keep_spans():
        for s in range(0, 40, 10):
            np.testing.assert_array_equal(a.read(s, s + 10), x[s : s + 10])
        assert spans_kept() == []
    assert hdf5_reads == [(s, s + 10) for s in range(0, 40, 10)]


def test_hdf5_a_row_beyond_the_budget_is_read_in_spans_of_the_budget(tmp_path, hdf5_reads, spans_kept,
                                                                      monkeypatch):
    """Memory stays bounded when one row of chunks is larger than READ_BUDGET: spans of READ_BUDGET bytes,
    each read once, each decompressing the row again."""
    from dctchop.formats import hdf5

    monkeypatch.setattr(hdf5, "READ_BUDGET", 10 * 48)  # 10 samples of 6 x 8 bytes
    x = np.random.default_rng(1).integers(0, 255, (40, 6, 8), dtype=np.uint8)
    a = _chunked(tmp_path / "b.h5", x, (40, 1, 8), "gzip")
    with keep_spans():
        got = [a.read(s, s + 4) for s in range(0, 40, 4)]
        assert spans_kept() == []
    np.testing.assert_array_equal(np.concatenate(got), x)
    assert hdf5_reads == [(0, 10), (10, 20), (20, 30), (30, 40)]


@pytest.mark.parametrize("chunks", [(40, 1, 8), (7, 3, 5), (16, 6, 8)])
def test_hdf5_slabs_in_any_order_and_from_threads_read_right(tmp_path, chunks):
    x = np.random.default_rng(2).standard_normal((40, 6, 8)).astype(np.float32)
    a = _chunked(tmp_path / "r.h5", x, chunks, "gzip")
    rng = np.random.default_rng(3)
    with keep_spans():
        for _ in range(60):
            start = int(rng.integers(0, 40))
            stop = int(rng.integers(start, 41))
            np.testing.assert_array_equal(a.read(start, stop), x[start:stop])
        slabs = [(s, min(s + 3, 40)) for s in range(0, 40, 3)]
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda r: a.read(*r), slabs * 3))
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate([x] * 3))


def test_hdf5_a_change_is_caught_when_the_rows_come_from_a_kept_span(tmp_path, spans_kept):
    path = tmp_path / "s.h5"
    x = np.arange(40 * 48, dtype=np.float32).reshape(40, 6, 8)
    a = _chunked(path, x, (40, 1, 8))
    with keep_spans():
        np.testing.assert_array_equal(a.read(0, 4), x[:4])
        assert spans_kept() == [("s.h5", "/x", 0)]  # rows 4:40 are held for the next slabs
        _chunked(tmp_path / "other.h5", -x, (40, 1, 8))
        os.utime(tmp_path / "other.h5", ns=(10, 10))
        os.replace(tmp_path / "other.h5", path)
        with pytest.raises(DctchopError, match="changed since it was opened"):
            a.read(4, 8)
    close_all(path)


def test_hdf5_reads_outside_an_operation_keep_nothing(tmp_path, hdf5_reads, spans_kept):
    """Spans were kept on the file's cached handle until the process ended, unless a read took their last
    row: a preview of samples 3 and 1000 of each of two stores of 300000 images in chunks of (300000, 1, 32)
    left 512 MB behind in a notebook. Reads outside :func:`keep_spans` read what they are asked for."""
    x = np.random.default_rng(5).integers(0, 255, (40, 6, 8), dtype=np.uint8)
    a = _chunked(tmp_path / "o.h5", x, (40, 1, 8), "gzip")
    for start, stop in [(3, 4), (30, 31), (0, 5)]:
        np.testing.assert_array_equal(a.read(start, stop), x[start:stop])
    assert spans_kept() == [] and hdf5_reads == [(3, 4), (30, 31), (0, 5)]


def test_hdf5_spans_last_as_long_as_the_outermost_operation(tmp_path, hdf5_reads, spans_kept):
    """Spans are dropped when the last keep_spans block running ends, on an error too; blocks nest (a
    compress's Dask tasks on local threads run inside the compress's), so the inner ones keep them."""
    x = np.random.default_rng(6).integers(0, 255, (40, 6, 8), dtype=np.uint8)
    a = _chunked(tmp_path / "n.h5", x, (40, 1, 8), "gzip")
    with keep_spans():
        with keep_spans():
            a.read(3, 4)
        assert spans_kept() == [("n.h5", "/x", 0)]
        a.read(30, 31)
    assert spans_kept() == [] and hdf5_reads == [(0, 40)]
    with pytest.raises(KeyboardInterrupt), keep_spans():
        a.read(3, 4)
        raise KeyboardInterrupt
    assert spans_kept() == []


def test_hdf5_spans_of_all_files_share_one_budget(tmp_path, hdf5_reads, spans_kept, monkeypatch):
    """The budget was per file: a process reading two files kept twice READ_BUDGET."""
    from dctchop.formats import hdf5

    monkeypatch.setattr(hdf5, "READ_BUDGET", 40 * 48)  # one span of 40 samples of 6 x 8 bytes
    x = np.random.default_rng(7).integers(0, 255, (40, 6, 8), dtype=np.uint8)
    a, b = (_chunked(tmp_path / f"{name}.h5", x, (40, 1, 8), "gzip") for name in "ab")
    with keep_spans():
        a.read(3, 4)
        b.read(3, 4)
        assert spans_kept() == [("b.h5", "/x", 0)]
        a.read(5, 6)
        assert spans_kept() == [("a.h5", "/x", 0)]
    assert hdf5_reads == [(0, 40)] * 3


def test_hdf5_a_file_closed_while_its_span_is_read_keeps_nothing(tmp_path, spans_kept, monkeypatch):
    """close_all from another thread cleared a handle's spans without its lock: during a span's read it
    could raise "dictionary changed size during iteration", or leave the span kept for a closed file."""
    from dctchop.formats import hdf5

    x = np.random.default_rng(8).integers(0, 255, (40, 6, 8), dtype=np.uint8)
    a = _chunked(tmp_path / "c.h5", x, (40, 1, 8), "gzip")
    read_rows, closing = hdf5._read_rows, []

    def read_while_closing(*args):
        closing.append(threading.Thread(target=close_all, args=(tmp_path / "c.h5",)))
        closing[0].start()
        closing[0].join(0.2)
        assert closing[0].is_alive()  # the close waits for the span
        read_rows(*args)

    monkeypatch.setattr(hdf5, "_read_rows", read_while_closing)
    with keep_spans():
        np.testing.assert_array_equal(a.read(3, 4), x[3:4])
        closing[0].join()
        assert spans_kept() == []
        monkeypatch.setattr(hdf5, "_read_rows", read_rows)
        np.testing.assert_array_equal(a.read(4, 5), x[4:5])  # reopened


def test_hdf5_a_span_that_cannot_be_read_names_the_rows_asked_for(tmp_path, monkeypatch):
    """The message named the span's rows (rows 0:262144), which the caller never asked for."""
    x = np.random.default_rng(9).integers(0, 255, (40, 6, 8), dtype=np.uint8)
    a = _chunked(tmp_path / "e.h5", x, (40, 1, 8), "gzip")

    def broken(ds, dest, source_sel=None, dest_sel=None):
        raise OSError("Can't read data (inflate() failed)")

    monkeypatch.setattr(h5py.Dataset, "read_direct", broken)
    with keep_spans(), pytest.raises(DctchopError) as caught:
        a.read(4, 8)
    assert str(caught.value) == (f"{tmp_path / 'e.h5'}: cannot read dataset /x rows 4:8 (reading rows 0:40 for "
                                 "them) (Can't read data (inflate() failed))")
    with pytest.raises(DctchopError, match=r"rows 4:8 \(Can't read"):  # read directly: the rows asked for
        a.read(4, 8)


@pytest.mark.parametrize("scheduler, ratio", [
    (None, None),
    ("threads", None),  # Dask tasks on local threads share the compress's spans
    (None, 6.0),  # a --ratio search on one chunk (its sample held to one): its span serves the writing after it
])
def test_compress_reads_each_row_of_chunks_once_and_keeps_nothing(tmp_path, hdf5_reads, spans_kept, monkeypatch,
                                                                  scheduler, ratio):
    from dctchop import store
    from dctchop.store import CompressOptions, Target, compress

    rng = np.random.default_rng(10)
    x = (np.linspace(0, 200, 48 * 16).reshape(1, 48, 16) + rng.integers(0, 30, (64, 48, 16))).astype(np.uint8)
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f.create_dataset("images", data=x, chunks=(64, 1, 16), compression="gzip")  # one row: every sample
    monkeypatch.setattr(store, "RATIO_SAMPLE_BYTES", 8 * x[0].nbytes)
    options = CompressOptions(chunk_samples=8, workers=2, scheduler=scheduler,
                              target=Target("ratio", ratio) if ratio else None)
    compress(open_source(tmp_path / "in.h5"), tmp_path / "out.zarr", options)
    assert hdf5_reads == [(0, 64)] and spans_kept() == []


def test_inspect_verify_and_sweep_read_each_row_of_chunks_once_and_keep_nothing(tmp_path, hdf5_reads, spans_kept):
    """inspect --verify reads the source chunk by chunk, sweep its evenly spaced samples one by one: sweep left
    the spans of the rows whose last sample it did not pick kept until the process ended."""
    from dctchop.inspect import inspect_store
    from dctchop.store import CompressOptions, compress
    from dctchop.sweep import read_sample

    x = np.random.default_rng(11).integers(0, 255, (60, 24, 16), dtype=np.uint8)
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f.create_dataset("images", data=x, chunks=(20, 1, 16), compression="gzip")  # 3 rows of chunks
    (array,) = open_source(tmp_path / "in.h5").lossy
    compress(open_source(tmp_path / "in.h5"), tmp_path / "out.zarr", CompressOptions(chunk_samples=8))
    hdf5_reads.clear()
    assert inspect_store(tmp_path / "out.zarr", verify=tmp_path / "in.h5")["verify"]["images"]["mismatches"] == []
    assert hdf5_reads == [(0, 20), (20, 40), (40, 60)] and spans_kept() == []
    hdf5_reads.clear()
    sample, where = read_sample(array, (1, 2), 5)
    assert where["indices"] == [0, 15, 30, 44, 59]
    np.testing.assert_array_equal(sample, x[where["indices"]])
    assert hdf5_reads == [(0, 20), (20, 40), (40, 60)] and spans_kept() == []


# --------------------------------------------------------------------------------------------------------
# pickling and worker processes
# --------------------------------------------------------------------------------------------------------


def test_source_array_pickles(h5file, tmp_path):
    src = open_source(h5file)
    for a in src.arrays:
        b = pickle.loads(pickle.dumps(a))
        assert b == a
        close_all()  # the copy must reopen the file by itself
        np.testing.assert_array_equal(b.read(), a.read())
    np.save(tmp_path / "n.npy", np.arange(6).reshape(3, 2))
    s2 = pickle.loads(pickle.dumps(open_source(tmp_path / "n.npy")))
    close_all()
    np.testing.assert_array_equal(s2.lossy[0].read(1, 3), [[2, 3], [4, 5]])


def test_read_in_spawned_process(h5file):
    (x,) = [a for a in open_source(h5file).lossy if a.name == "/group/x"]
    x.read(0, 1)  # the parent holds an open handle; the child must open its own
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        out = pool.apply(SourceArray.read, (x, 1, 4))
    np.testing.assert_array_equal(out, x.read(1, 4))
    assert out.dtype.isnative


def test_every_dataset_that_cannot_be_copied_is_named_at_once(tmp_path):
    with h5py.File(tmp_path / "v.h5", "w") as f:
        f["images"], f["name"] = np.zeros((4, 16, 16), np.uint8), "text"
        f.create_dataset("names", data=["a", "bb"], dtype=h5py.string_dtype())
    with pytest.raises(DctchopError, match=r"dataset /name has dtype variable-length .*; dataset /names has dtype "
                                           r"variable-length .*to leave them out$"):
        open_source(tmp_path / "v.h5")
    assert [a.name for a in open_source(tmp_path / "v.h5", datasets=["images"]).lossy] == ["/images"]


def test_an_input_url_is_named_as_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # read as a relative path it was "<cwd>/file:/...: no such file"
    with pytest.raises(DctchopError, match=r"^input file:///data/x.npy is a URL; inputs are local \.npy or HDF5 files$"):
        open_source("file:///data/x.npy")
