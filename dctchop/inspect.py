"""Reading a store's description back: per-array settings, sizes, quality, and verification against a source."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import zarr

from dctchop.codec import DctChopCodec, check_dtype
from dctchop.errors import DctchopError
from dctchop.formats import open_source
from dctchop.formats.hdf5 import keep_spans
from dctchop.location import Location
from dctchop.store import (
    META_GROUP,
    STORE_FORMAT,
    ZSTD_LEVEL,
    LosslessCopy,
    _chunk_metrics,
    _chunk_ranges,
    array_bytes,
    array_problems,
    check_array,
    group_problems,
    lossless_problems,
    open_array,
)


def open_store(path: str | Path) -> tuple[zarr.Group, dict]:
    """The store's root group and its ``dctchop`` attributes; a clear error for anything else. ``path`` is
    a local directory or an fsspec URL."""
    location = Location(path)
    if not location.exists():
        raise DctchopError(f"store {path} does not exist")
    try:
        if location.local_path is not None:
            _readable(location)
        group = location.open_group("r")
    except PermissionError as e:  # a store that is there but cannot be read is a store all the same
        raise DctchopError(f"store {path} cannot be read: permission denied ({e.filename or e})") from None
    except Exception as e:  # noqa: BLE001 - zarr raises several types for a non-store
        if type(e).__name__ == "ContainsArrayError":  # zarr's, for an array at the root
            raise DctchopError(f"{path} is a Zarr array, not a dctchop store (a group)") from None
        raise DctchopError(f"{path} is not a Zarr store ({type(e).__name__}: {e})") from None
    info = group.attrs.get("dctchop")
    if not isinstance(info, dict) or "arrays" not in info:
        raise DctchopError(f"{path} is a Zarr store but not a dctchop store (no dctchop attributes)")
    store_format = info.get("store_format", 1)
    if _int_list([store_format]) and store_format > STORE_FORMAT:  # before its fields, which may be new ones
        raise DctchopError(f"store {path} is of store format {store_format}, which this dctchop does not "
                           f"read (formats 1 to {STORE_FORMAT}); upgrade dctchop")
    damaged = _damaged_record(info)
    if damaged:
        raise DctchopError(f"store {path} is damaged: its dctchop attributes have a bad {damaged}")
    return group, info


def _readable(location: Location) -> None:
    """PermissionError when the store's zarr.json cannot be read. Zarr's reads of a store it may not read run
    concurrently, and those it did not await printed "Task exception was never retrieved" at exit."""
    try:
        location.read("zarr.json")
    except PermissionError:
        raise
    except OSError:  # none there: Zarr says what it is
        pass


# What every reader of a store takes from its record (the root's dctchop attributes) for each lossy array;
# "number": an int or float, or as JSON writes infinities ("inf", the PSNR of a lossless chunk).
RECORD_FIELDS = {"shape": list, "chunks": list, "dtype": str, "layout": str, "axes": list, "target": dict,
                 "codec": dict, "original_bytes": int,
                 **dict.fromkeys(("peak", "psnr", "psnr_min", "psnr_mean", "psnr_max", "max_abs_error"), "number")}


def _is_number(value) -> bool:
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return False
        return True
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _damaged_record(info: dict) -> str | None:
    """The first field of a store's record that readers could not use (an edited zarr.json), or None."""
    arrays, lossless = info["arrays"], info.get("lossless", [])
    if not _int_list([info.get("store_format", 1)]):  # which checks apply depends on it
        return "store_format"
    if not isinstance(arrays, dict) or not all(isinstance(a, dict) for a in arrays.values()):
        return "arrays"
    if not _str_list(lossless):
        return "lossless"
    if not _str_list(info.get("groups", [])):
        return "groups"
    if any(not n or n.split("/")[0] == META_GROUP for n in [*arrays, *lossless]):
        return "array name"
    for name, a in arrays.items():
        for key, kind in RECORD_FIELDS.items():
            value = a.get(key)
            if not (_is_number(value) if kind == "number" else isinstance(value, kind) and not isinstance(value, bool)):
                return f"{key} of array {name}"
        shape, chunks = a["shape"], a["chunks"]
        if (not shape or len(shape) != len(chunks) or not all(isinstance(n, int) and n >= 0 for n in shape)
                or not all(isinstance(n, int) and n > 0 for n in chunks)):
            return f"shape or chunks of array {name}"
        if not _readable_settings(a):
            return f"dtype, axes, target or codec of array {name}"
    checks = info.get("lossless_checks", {})
    if not isinstance(checks, dict):
        return "lossless_checks"
    for name, c in checks.items():
        if not (isinstance(c, dict) and _int_list(c.get("shape")) and _int_list(c.get("checksums"))):
            return f"lossless_checks of array {name}"
    return _damaged_source_details(info)


def _readable_settings(a: dict) -> bool:
    """Whether a lossy array's record holds a dtype the codec takes, axes of its shape, a target and the
    codec's configuration, as compress writes them (readers index, decode and print with them)."""
    try:
        check_dtype(a["dtype"], "")
        DctChopCodec.from_dict({"name": "dctchop", "configuration": a["codec"]})
    except (DctchopError, TypeError, ValueError):
        return False
    target = a["target"]
    return (a["original_bytes"] > 0 and _int_list(a["axes"]) and all(n < len(a["shape"]) for n in a["axes"])
            and target.get("kind") in ("keep", "ratio", "psnr") and "value" in target)


def _damaged_source_details(info: dict) -> str | None:
    """The first of the record's notes on its source that decompress and the readers could not use: the
    source itself, its links, enum labels, attribute dtypes and the dtypes of copies stored as bytes."""
    source, names = info.get("source"), {"", *info["arrays"], *info.get("lossless", []), *info.get("groups", [])}
    if not (isinstance(source, dict) and isinstance(source.get("path"), str) and source.get("kind") in ("npy", "hdf5")):
        return "source"
    links = info.get("links", [])
    if not isinstance(links, list) or not all(
            isinstance(link, dict) and isinstance(link.get("path"), str) and link.get("kind") in ("hard", "soft")
            and isinstance(link.get("target"), str)
            # groups are listed from store format 4 on: a link's target is one of the stored names
            and (info.get("store_format", 1) < 4 or link["target"].strip("/") in names)
            for link in links):
        return "links"
    enums = info.get("enums", {})
    if not isinstance(enums, dict) or not all(
            name in info.get("lossless", []) and isinstance(labels, dict)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in labels.values())
            for name, labels in enums.items()):
        return "enums"
    attr_dtypes = info.get("attr_dtypes", {})
    if not isinstance(attr_dtypes, dict) or not all(
            isinstance(dtypes, dict) and all(_attr_dtype(d) for d in dtypes.values()) for dtypes in attr_dtypes.values()):
        return "attr_dtypes"
    as_bytes = info.get("stored_as_bytes", {})
    if not isinstance(as_bytes, dict) or not all(name in info.get("lossless", []) and _descr(d)
                                                  for name, d in as_bytes.items()):
        return "stored_as_bytes"
    return None


def _attr_dtype(text) -> bool:
    """An attribute's recorded dtype: "str", a dtype, or the subarray dtype of an empty array (a 0 in its shape)."""
    if text == "str":
        return True
    try:
        dtype = np.dtype(text)
    except (TypeError, ValueError):
        return False
    return dtype.subdtype is None or 0 in dtype.subdtype[1]


def _descr(descr) -> bool:
    """A dtype as ``np.lib.format`` writes it, of items with bytes (the dtype of a copy stored as bytes)."""
    try:
        return np.lib.format.descr_to_dtype(descr).itemsize > 0
    except (TypeError, ValueError, KeyError, IndexError):
        return False


def _str_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(n, str) for n in value)


def _int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)


QUALITY_KEYS = ("psnr_min", "psnr_mean", "psnr_max", "max_abs_error")


def _quality(table: dict[str, np.ndarray]) -> dict[str, float]:
    return {"psnr_min": float(table["psnr"].min()), "psnr_mean": float(table["psnr"].mean()),
            "psnr_max": float(table["psnr"].max()), "max_abs_error": float(table["max_abs_error"].max())}


def inspect_store(path: str | Path, chunks: bool = False, verify: str | Path | None = None) -> dict:
    """Per array: shape, dtype, axes, settings, original and stored bytes (everything on disk for the array,
    its metadata included), ratio, PSNR over chunks, max abs error; plus totals. With ``verify`` (a source
    path) and no chunk damaged, also ``verify``: per array, the chunks decoded and compared with the source
    (PSNR and max error recomputed against the stored metadata) and the mismatches found; every chunk file
    is checked once."""
    group, info = open_store(path)
    location = Location(path)
    arrays, tables = {}, {}
    for name, a in info["arrays"].items():
        # with unreadable metadata arrays or elements the per-chunk table is unknown: fall back to the summary
        # written with the store
        problems, table = check_array(location, name, info, group)
        tables[name] = table
        stored = array_bytes(location, name)
        entry = {
            "shape": a["shape"], "dtype": a["dtype"], "layout": a["layout"], "axes": a["axes"],
            "chunks": a["chunks"], "target": a["target"], "codec": a["codec"],
            "zstd_level": a.get("zstd_level", ZSTD_LEVEL), "peak": a["peak"],  # before it was an option: 1
            "original_bytes": a["original_bytes"], "stored_bytes": stored,
            "ratio": a["original_bytes"] / stored if stored else math.inf,  # its files are gone: damage, below
            "psnr": float(a["psnr"]),
            **(_quality(table) if table is not None else {k: float(a[k]) for k in QUALITY_KEYS}),
            "damaged_chunks": problems,
        }
        if chunks and table is not None:
            entry["chunk_table"] = {k: v.tolist() for k, v in table.items()}
        arrays[name] = entry
    lossless = {}
    for name in info.get("lossless", []):
        problems = lossless_problems(location, info, name, group)
        if any(p["chunk"] is None for p in problems):  # its metadata cannot be opened
            described = {"shape": None, "dtype": None, "original_bytes": 0}
        else:
            arr = LosslessCopy(open_array(group, location, name), info, name)
            described = {"shape": list(arr.shape), "dtype": str(arr.dtype), "original_bytes": int(arr.nbytes)}
        lossless[name] = {**described, "stored_bytes": location.size(name), "damaged_chunks": problems}
    original = sum(a["original_bytes"] for a in arrays.values()) + sum(a["original_bytes"] for a in lossless.values())
    stored = location.size()
    report = {
        "store": str(path), "version": info.get("version"), "created": info.get("created"),
        "source": info.get("source"), "arrays": arrays, "lossless": lossless, "links": info.get("links", []),
        "totals": {"original_bytes": original, "stored_bytes": stored, "ratio": original / stored},
        "damaged_groups": group_problems(location, info),
    }
    if verify is not None and not report["damaged_groups"] and not any(
            a["damaged_chunks"] for a in (*arrays.values(), *lossless.values())):
        with keep_spans():  # the source is read chunk by chunk: each row of its HDF5 chunks decompressed once
            report["verify"] = _verify(group, info, verify, tables)
    return report


def read_rows(array, start: int, stop: int, where: str) -> np.ndarray:
    """``array[start:stop]`` through Zarr; a chunk that does not decode is named by ``where`` (the codec's own
    message knows the bytes, not where they are)."""
    try:
        return array[start:stop]
    except DctchopError as exc:
        raise type(exc)(f"{where}: {exc}") from None


def require_intact(path: str | Path, info: dict, group: zarr.Group) -> None:
    """Raise naming the array and chunk when any chunk of the store is missing or damaged. ``group``: the
    store's root group, as :func:`open_store` returns it (see :func:`dctchop.store.array_problems`)."""
    location = Location(path)
    for name in info["arrays"]:
        problems = array_problems(location, name, info, group)
        if problems:
            raise DctchopError(describe_damage(path, {name: problems}))
    for name in info.get("lossless", []):
        problems = lossless_problems(location, info, name, group)
        if problems:
            raise DctchopError(describe_damage(path, {name: problems}))
    groups = group_problems(location, info)
    if groups:
        raise DctchopError(describe_damage(path, {}, groups))


def describe_damage(path: str | Path, problems: dict[str, list[dict]], groups: list[dict] = ()) -> str:
    """One line naming the first damaged array and chunk (or group), and how many more problems there are."""
    found = [f"array {name}" + (f", chunk {p['chunk']}" if p["chunk"] is not None else "") + f": {p['problem']}"
             for name, ps in problems.items() for p in ps] + [g["problem"] for g in groups]
    more = f" (and {len(found) - 1} more problem(s))" if len(found) > 1 else ""
    return f"{path}: {found[0]}{more}"


def source_mismatch(source_path, src, entry: dict) -> str | None:
    """Why the input array ``src`` (None: the file has none of the recorded name) cannot be what the stored
    array ``entry`` was made from; None when it can."""
    if src is None:
        return f"{source_path} has no array {entry['source']}"
    if list(src.shape) != list(entry["shape"]) or str(src.dtype) != entry["dtype"]:
        return (f"{source_path}: {src.name} is {src.dtype}{list(src.shape)}, not the "
                f"{entry['dtype']}{list(entry['shape'])} the store was made from")
    return None


def _verify(group: zarr.Group, info: dict, source_path: str | Path, tables: dict[str, dict[str, np.ndarray]]) -> dict:
    """Decode every chunk of a store whose chunk files are known to be intact, recompute PSNR and max error
    against ``source_path`` and compare with the stored metadata (``tables``: each array's, as
    :func:`dctchop.store.check_array` read it): per array, the chunks checked and the mismatches found."""
    if info["source"]["kind"] == "npy" or str(source_path).lower().endswith(".npy"):
        source = open_source(str(source_path))  # one array: its name is the file's, whatever it is called now
        by_name = {a["source"]: source.lossy[0] for a in info["arrays"].values()} if source.lossy else {}
    else:
        source = open_source(str(source_path), datasets=[a["source"] for a in info["arrays"].values()],
                             lossless=info.get("lossless", []),
                             follow_external=info["source"].get("follow_external", False))
        by_name = {a.name: a for a in source.lossy}
    report = {}
    for name, a in info["arrays"].items():
        src = by_name.get(a["source"])
        why = source_mismatch(source_path, src, a)
        if why:
            raise DctchopError(f"{why}: cannot verify {name} against it")
        arr = group[name]
        table = tables[name]
        mismatches = []
        for i, (s, e) in enumerate(_chunk_ranges(a["shape"][0], a["chunks"][0])):
            x = src.read(s, e)
            psnr, max_err, _ = _chunk_metrics(x, read_rows(arr, s, e, f"array {name}, chunk {i}"), a["peak"])
            stored_psnr, stored_err = float(table["psnr"][i]), float(table["max_abs_error"][i])
            # the same measure of the same decode: equal up to the order of float64 sums (one value of a
            # uint8 chunk changed by 1 moves its PSNR by about 2e-8 of itself; 1e-6 let that through)
            same_psnr = (psnr == stored_psnr) or math.isclose(psnr, stored_psnr, rel_tol=1e-12)
            if not (same_psnr and max_err == stored_err):
                mismatches.append({"chunk": i, "psnr": psnr, "stored_psnr": stored_psnr,
                                   "max_abs_error": max_err, "stored_max_abs_error": stored_err})
        report[name] = {"chunks": len(table["psnr"]), "mismatches": mismatches}
    for name in info.get("lossless", []):
        src = next((a for a in source.lossless if a.name.strip("/") == name), None)
        if src is None:
            raise DctchopError(f"{source_path} has no array {name} to verify the lossless copy {name} against")
        x = src.read(0, src.shape[0]) if src.shape else src.read(0, 1)
        kept = LosslessCopy(group[name], info, name)[...]
        same = x.dtype == kept.dtype and np.array_equal(x, kept, equal_nan=x.dtype.kind in "fc")
        report[name] = {"lossless": True, "mismatches": [] if same else [{"lossless": "differs from source"}]}
    return report
