"""Writing a store back out as plain files: ``.npy`` (one array) or ``.h5`` (all arrays, groups, attrs)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import NamedTuple

import h5py
import numpy as np

from dctchop.dataset import array_named, recorded_links
from dctchop.errors import DctchopError, first_line, output_exists
from dctchop.formats import HDF5_SUFFIXES, NPY_SUFFIXES
from dctchop.inspect import open_store, read_rows, require_intact
from dctchop.location import Location, check_output_file, rename_new
from dctchop.store import META_GROUP, LosslessCopy, _chunk_ranges, discard_temporary_file, temporary_file


def _copy_rows(src, write, chunk_rows: int, where: str) -> None:
    """``src`` into ``write`` chunk by chunk; a chunk that does not decode is named (``where``: store and array)."""
    if not src.shape:  # a scalar: h5py takes no slice for it, only ...
        write(..., src[...])
        return
    for i, (s, e) in enumerate(_chunk_ranges(src.shape[0], max(chunk_rows, 1))):
        write(slice(s, e), read_rows(src, s, e, f"{where}, chunk {i}"))


class Written(NamedTuple):
    """What :func:`decompress` wrote: the arrays, and what the output could not hold (``.npy``: one array,
    without attributes, groups or links), as phrases for the user."""

    arrays: list[str]
    left_out: list[str]


def decompress(store: str | Path, output: str | Path, overwrite: bool = False, array: str | None = None) -> Written:
    """Decode ``store`` into ``output`` (``.npy`` or ``.h5``/``.hdf5``). ``array``: the one array a ``.npy``
    holds (default: the store's only array).

    Written to a temporary sibling and renamed when complete, like :func:`dctchop.store.compress`.
    """
    group, info = open_store(store)
    require_intact(store, info, group)
    local = Location(store).local_path  # a file:// URL names the same files as its path
    if local is not None and local.resolve() in (Path(output).resolve(), *Path(output).resolve().parents):
        raise DctchopError(f"output {output} must not be the store {store} or inside it")
    output = check_output_file(output, NPY_SUFFIXES + HDF5_SUFFIXES)
    held = list(info["arrays"]) + list(info.get("lossless", []))
    suffix = output.suffix.lower()
    names = _written_arrays(store, info, held, suffix, array)
    if os.path.lexists(output) and not overwrite:  # a link to nothing too
        raise output_exists(output)
    lossless = set(info.get("lossless", []))
    arrays = {n: LosslessCopy(group[n], info, n) if n in lossless else group[n] for n in names}
    _check_space(output, sum(math.prod(a.shape) * a.dtype.itemsize for a in arrays.values()) + (64 << 10))
    tmp = temporary_file(output)
    try:
        if suffix == ".npy":
            arr = arrays[names[0]]
            with open(tmp, "wb") as fh:  # in order: a memory map dies of SIGBUS when the disk fills
                _write_npy_header(fh, arr.dtype, arr.shape)
                _copy_rows(arr, lambda _, rows: fh.write(np.ascontiguousarray(rows).tobytes()),
                           arr.chunks[0] if arr.shape else 1, f"{store}: array {names[0]}")
        else:
            with h5py.File(tmp, "w") as h5:
                h5.attrs.update({k: _h5_attr(v) for k, v in group.attrs.items() if k != "dctchop"})
                for path, g in group.groups():
                    if path != META_GROUP:
                        _copy_group(g, h5.require_group(path))
                enums = info.get("enums", {})
                for name in names:
                    arr = arrays[name]
                    dtype = h5py.enum_dtype(enums[name], basetype=arr.dtype) if name in enums else arr.dtype
                    ds = h5.create_dataset(name, shape=arr.shape, dtype=dtype)
                    ds.attrs.update({k: _h5_attr(v) for k, v in arr.attrs.items()})
                    _copy_rows(arr, ds.__setitem__, arr.chunks[0] if arr.shape else 1, f"{store}: array {name}")
                for path, dtypes in info.get("attr_dtypes", {}).items():
                    if path not in h5:  # a group deleted from a store that does not list its groups (before 4)
                        raise DctchopError(f"damaged store: {store}: {path.strip('/')}, whose attributes it "
                                           "records, is missing")
                    attrs = h5[path].attrs
                    for key, dtype in dtypes.items():
                        if key in attrs:
                            _restore_dtype(attrs, key, dtype)
                for link in info.get("links", []):  # targets are stored objects, so they exist by now
                    target = link["target"]
                    if target not in h5:  # a store before format 4, which does not list its groups
                        raise DctchopError(f"damaged store: {store}: its link {link['path']} names {target}, "
                                           "which it does not hold")
                    h5[link["path"]] = h5py.SoftLink(target) if link["kind"] == "soft" else h5[target]
        if overwrite:
            os.replace(tmp, output)
        else:  # never over a file another run put there meanwhile
            rename_new(tmp, output)
    except BaseException as e:
        discard_temporary_file(tmp)
        reason = _write_failure(e)
        if reason is not None:
            raise DctchopError(f"decompress failed: {reason}; {output} was not written") from None
        raise
    return Written(names, _left_out_of_npy(group, info, names[0], held) if suffix == ".npy" else [])


def _written_arrays(store, info: dict, held: list[str], suffix: str, array: str | None) -> list[str]:
    """The arrays an output of ``suffix`` gets from a store holding ``held``: all for ``.h5``; for ``.npy``
    ``array`` (as :meth:`dctchop.dataset.Dataset.array` finds it: ``/name`` or through a link too) or the
    store's only one."""
    if array is not None and suffix != ".npy":
        raise DctchopError(f"--array picks the one array of a .npy output; {suffix} gets every array")
    if array is None:
        if suffix == ".npy" and len(held) != 1:
            raise DctchopError(f"store holds {len(held)} arrays ({', '.join(held)}): pick one with --array, or "
                               "write .h5 to keep them all")
        return held
    return [array_named(store, array, recorded_links(info), held)]


def _left_out_of_npy(group, info: dict, name: str, held: list[str]) -> list[str]:
    """What a ``.npy`` of array ``name`` leaves out of the store: other arrays, attributes, groups, links."""
    attributes = [("arrays", [n for n in held if n != name]),
                  ("the root's attributes", [k for k in group.attrs if k != "dctchop"]),
                  (f"{name}'s attributes", list(group[name].attrs)),
                  ("groups", info.get("groups", [])), ("links", [link["path"] for link in info.get("links", [])])]
    return [f"{what} {', '.join(items)}" for what, items in attributes if items]


# HDF5's own report of a failed write(2), as h5py passes it on: "... (file write failed: time = ..., filename
# = '...', file descriptor = 6, errno = 28, error message = 'No space left on device', ...)"
_HDF5_WRITE_FAILED = re.compile(r"file write failed|unable to extend file", re.IGNORECASE)
_HDF5_ERRNO = re.compile(r"errno = (\d+)")


def _write_failure(e: BaseException) -> str | None:
    """Why writing the output failed, for the user (a full disk, a read-only directory), or None when ``e``
    is not a failed write. Besides OSError, h5py raises RuntimeError when HDF5 fails to write while it
    flushes or closes a file (a disk that fills as the file is closed); only the messages of a failed write
    count, not every RuntimeError."""
    if isinstance(e, OSError):  # h5py's messages run over lines
        return os.strerror(e.errno) if e.errno else first_line(e)
    if isinstance(e, RuntimeError) and _HDF5_WRITE_FAILED.search(str(e)):
        found = _HDF5_ERRNO.search(str(e))
        return os.strerror(int(found[1])) if found and int(found[1]) else "file write failed"
    return None


def _check_space(output: Path, needed: int) -> None:
    """Refuse before decoding anything when the output cannot fit (``needed``: its data plus room for headers).
    Besides saving the time, HDF5 that meets a full disk while it closes a file leaves ids that crash the
    interpreter at exit (h5py 3.x). Filesystems that report no size at all are not checked."""
    usage = shutil.disk_usage(output.parent)
    if usage.total and usage.free < needed:
        raise DctchopError(f"output {output} needs about {needed / 1e6:.2f} MB, and {output.parent} has "
                           f"{usage.free / 1e6:.2f} MB free")


def _write_npy_header(fh, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": tuple(shape)}
    try:
        np.lib.format.write_array_header_1_0(fh, header)
    except ValueError:  # a header over 64 KiB (records of many fields) needs format 2.0
        np.lib.format.write_array_header_2_0(fh, header)


def _copy_group(zgroup, hgroup) -> None:
    """A user group and its attributes, recursively (arrays are copied by name afterwards)."""
    hgroup.attrs.update({k: _h5_attr(v) for k, v in zgroup.attrs.items()})
    for name, child in zgroup.groups():
        _copy_group(child, hgroup.require_group(name))


def _h5_attr(value):
    """JSON attributes back to HDF5: dicts become JSON strings, (nested) lists of strings variable-length
    string arrays, other lists numpy arrays (a list mixing types, or ragged, becomes a JSON string). Strings
    holding a NUL become fixed-length bytes (UTF-8): HDF5's variable-length strings end at the first NUL."""
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, str) and "\0" in value:
        return np.bytes_(value.encode())
    if isinstance(value, list):
        try:
            if value and _strings_only(value):
                return np.char.encode(np.array(value, dtype=str)) if _holds_nul(value) else np.array(
                    value, dtype=h5py.string_dtype())
            array = np.asarray(value)
        except ValueError:  # ragged
            return json.dumps(value)
        return array if array.dtype.kind in "biuf" else json.dumps(value)
    return value


def _strings_only(value: list) -> bool:
    return all(_strings_only(v) if isinstance(v, list) else isinstance(v, str) for v in value)


def _holds_nul(value: list) -> bool:
    return any(_holds_nul(v) if isinstance(v, list) else "\0" in v for v in value)


def _restore_dtype(attrs, key: str, dtype: str) -> None:
    """Give an attribute back the dtype JSON lost: its width (int16 written as int64), or the dtype of an
    empty array (``[]`` reads back as float64) and, as a subarray dtype (``"(0,3)<i4"``), the shape of one
    with more axes; ``"str"``: an array of strings; ``"|S3"``: fixed-length bytes."""
    if dtype == "str":
        attrs[key] = np.asarray(attrs[key]).astype(h5py.string_dtype())
        return
    dtype = np.dtype(dtype)
    if dtype.kind == "S":  # written as text (as bytes where it holds a NUL): UTF-8 again
        value = np.asarray(attrs[key])
        attrs[key] = (value if value.dtype.kind == "S" else np.char.encode(value.astype(str))).astype(dtype)
        return
    if dtype.subdtype is not None:
        attrs[key] = np.zeros(dtype.subdtype[1], dtype.subdtype[0])
    else:
        attrs[key] = np.asarray(attrs[key]).astype(dtype)
