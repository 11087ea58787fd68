"""Writing a store back out as plain files: ``.npy`` (one array) or ``.h5`` (all arrays, groups, attrs)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import h5py
import numpy as np

from dctchop.errors import DctchopError
from dctchop.inspect import open_store, read_rows, require_intact
from dctchop.location import Location
from dctchop.store import META_GROUP, LosslessCopy, _chunk_ranges


def _copy_rows(src, write, chunk_rows: int, where: str) -> None:
    """``src`` into ``write`` chunk by chunk; a chunk that does not decode is named (``where``: store and array)."""
    if not src.shape:  # a scalar: h5py takes no slice for it, only ...
        write(..., src[...])
        return
    for i, (s, e) in enumerate(_chunk_ranges(src.shape[0], max(chunk_rows, 1))):
        write(slice(s, e), read_rows(src, s, e, f"{where}, chunk {i}"))


def decompress(store: str | Path, output: str | Path, overwrite: bool = False) -> list[str]:
    """Decode ``store`` into ``output`` (``.npy`` or ``.h5``/``.hdf5``); returns the array names written.

    Written to a temporary sibling and renamed when complete, like :func:`dctchop.store.compress`.
    """
    group, info = open_store(store)
    require_intact(store, info)
    output = Path(output)
    names = list(info["arrays"]) + list(info.get("lossless", []))
    suffix = output.suffix.lower()
    if suffix not in (".npy", ".h5", ".hdf5"):
        raise DctchopError(f"output {output} must end in .npy or .h5")
    if suffix == ".npy" and len(names) != 1:
        raise DctchopError(f"store holds {len(names)} arrays ({', '.join(names)}); write .h5 to keep them all")
    if not output.parent.resolve().is_dir():
        raise DctchopError(f"output directory {output.parent} does not exist")
    local = Location(store).local_path  # a file:// URL names the same files as its path
    if local is not None and local.resolve() in (output.resolve(), *output.resolve().parents):
        raise DctchopError(f"output {output} must not be the store {store} or inside it")
    if output.is_dir():
        raise DctchopError(f"output {output} is a directory; name a .npy or .h5 file")
    if output.exists() and not overwrite:
        raise DctchopError(f"output {output} exists; pass overwrite=True (--overwrite) to replace it")
    tmp = output.with_name(f".{output.name}.dctchop-tmp-{os.getpid()}")
    try:
        lossless = set(info.get("lossless", []))

        def array(name: str):
            return LosslessCopy(group[name], info, name) if name in lossless else group[name]

        if suffix == ".npy":
            arr = array(names[0])
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=arr.dtype, shape=arr.shape)
            _copy_rows(arr, out.__setitem__, arr.chunks[0] if arr.shape else 1, f"{store}: array {names[0]}")
            out.flush()
            del out
        else:
            with h5py.File(tmp, "w") as h5:
                h5.attrs.update({k: _h5_attr(v) for k, v in group.attrs.items() if k != "dctchop"})
                for path, g in group.groups():
                    if path != META_GROUP:
                        _copy_group(g, h5.require_group(path))
                for name in names:
                    arr = array(name)
                    ds = h5.create_dataset(name, shape=arr.shape, dtype=arr.dtype)
                    ds.attrs.update({k: _h5_attr(v) for k, v in arr.attrs.items()})
                    _copy_rows(arr, ds.__setitem__, arr.chunks[0] if arr.shape else 1, f"{store}: array {name}")
                for path, dtypes in info.get("attr_dtypes", {}).items():  # JSON widened them: int16 -> int64
                    attrs = h5[path].attrs
                    for key, dtype in dtypes.items():
                        if key in attrs:
                            attrs[key] = np.asarray(attrs[key]).astype(dtype)
                for link in info.get("links", []):  # targets are stored objects, so they exist by now
                    target = link["target"]
                    h5[link["path"]] = h5py.SoftLink(target) if link["kind"] == "soft" else h5[target]
        os.replace(tmp, output)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise
    return names


def _copy_group(zgroup, hgroup) -> None:
    """A user group and its attributes, recursively (arrays are copied by name afterwards)."""
    hgroup.attrs.update({k: _h5_attr(v) for k, v in zgroup.attrs.items()})
    for name, child in zgroup.groups():
        _copy_group(child, hgroup.require_group(name))


def _h5_attr(value):
    """JSON attributes back to HDF5: dicts become JSON strings, lists of strings variable-length string
    arrays, other lists numpy arrays (a list mixing types becomes a JSON string)."""
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, list):
        if value and all(isinstance(v, str) for v in value):
            return np.array(value, dtype=h5py.string_dtype())
        array = np.asarray(value)
        return array if array.dtype.kind in "biuf" else json.dumps(value)
    return value
