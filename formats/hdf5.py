"""HDF5 input: walk the file once for metadata, read datasets lazily slab by slab.

Why the walk is link by link rather than ``visititems``: ``visititems`` silently skips external links, and
an external link (or a virtual dataset or external raw storage pointing at other files) makes the result
depend on files the user never named, which may be missing on a worker, change independently, or, for a
virtual dataset whose source is missing, read back as fill values without any error. So anything that
leaves the file is refused unless ``follow_external=True``. Soft links stay inside the file and are fine;
in the default scan an object is taken once, under its first hard-link path in name order. Soft links and
extra hard links to it are not copied again: they become :attr:`Source.links` (alias, object's path, kind),
which the store records so that readers resolve the alias and ``decompress`` recreates the link.

Why variable-length data is refused: h5py reads it as numpy object arrays, which have no fixed-width
representation to copy bit-exactly into a Zarr chunk. Fixed-width strings, bool, complex, enum, compound
and opaque datasets are fixed-width numpy dtypes and are copied losslessly.

Datasets are reported with their effective numpy shape and dtype as h5py reads them: an HDF5 array
datatype ``(n,) x f4[3]`` is a ``(n, 3)`` float32 array.
"""

from __future__ import annotations

import contextlib
import math
import os
import posixpath
import threading
from collections.abc import Iterator
from functools import cache
from typing import NamedTuple

import numpy as np

from dctchop.codec import DTYPE_CODES
from dctchop.errors import DctchopError, first_line
from dctchop.formats import (
    _DROP,
    Source,
    SourceArray,
    cached_handle,
    close_all,
    json_attrs,
    native_dtype,
)
from dctchop.location import absolute_path

__all__ = ["READ_BUDGET", "keep_spans", "open_hdf5", "read_hdf5", "span_length"]

_MAX_LISTED = 20  # datasets listed in a message
DCT_BLOCK = 8  # the default block: a per-sample table narrower than this has no image in it
META_GROUP = "dctchop_meta"  # dctchop.store.META_GROUP (the store imports this package, not the reverse)
STORE_ATTR = "dctchop"  # the root attribute a store keeps its own record under
_LEAVE_OUT = "name the datasets to compress with datasets= (--dataset) to leave {} out"
_MAX_LINK_DEPTH = 40  # soft links followed while resolving one name
# what h5py raises for damaged files, unsupported types and unresolvable links
_H5_ERRORS = (OSError, KeyError, RuntimeError, ValueError, TypeError)


def _listed(items: list[str], separator: str) -> str:
    """The first ``_MAX_LISTED`` of ``items``, joined, and how many more there are."""
    more = f" (and {len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return separator.join(items[:_MAX_LISTED]) + more


def _h5py():
    try:
        import h5py
    except ImportError as exc:  # pragma: no cover - h5py is a dependency
        raise DctchopError(f"reading HDF5 needs h5py ({exc})") from None
    return h5py


def _norm(name: str) -> str:
    """``"a//b/"`` -> ``"/a/b"``: leading slash optional, empty components ignored."""
    return "/" + "/".join(p for p in name.split("/") if p)


def _open_file(file: str):
    h5py = _h5py()
    try:
        return h5py.File(file, "r")
    except OSError as exc:
        msg = first_line(exc)
        if "signature not found" in msg:
            raise DctchopError(f"{file}: not an HDF5 file (file signature not found)") from None
        if isinstance(exc, PermissionError) or "ermission denied" in msg:
            raise DctchopError(f"{file}: permission denied") from None
        raise DctchopError(f"{file}: cannot open as HDF5 ({msg})") from None


def _attr_items(obj):
    """(name, value) of an h5py object's attributes; ``_DROP`` for one h5py cannot read."""
    try:
        names = list(obj.attrs.keys())
    except _H5_ERRORS:  # pragma: no cover - damaged attribute table
        return
    for key in names:
        try:
            value = obj.attrs[key]
        except _H5_ERRORS:  # unsupported attribute type (e.g. some vlen/compound mixes)
            value = _DROP
        yield key, value


class _Attributes(NamedTuple):
    """An h5py object's attributes as the store keeps them: ``values``, the JSON-serialisable ones converted;
    ``dtypes``, the numpy dtypes of numeric ones that JSON would widen (int16 -> int64, float32 -> float64:
    what CF's scale_factor and add_offset must keep), so that decompress can restore them; ``dropped``, the
    names of those JSON cannot hold or h5py cannot read."""

    values: dict
    dtypes: dict[str, str]
    dropped: list[str]


def _attributes(obj) -> _Attributes:
    """``obj``'s attributes, each read from the file once. Besides the numeric dtypes JSON widens,
    ``dtypes`` keeps the dtype of every empty array (``"str"`` for strings): JSON's ``[]`` has none; of
    a numeric one with more axes, its shape, as a numpy subarray dtype (``"(0,3)<i4"``); and of fixed-length
    bytes (``"|S3"``), which JSON holds as text and would come back as variable-length strings."""
    items = list(_attr_items(obj))
    dropped: list[str] = []
    values = json_attrs(items, dropped)
    dtypes = {}
    for key, value in items:
        if not isinstance(key, str) or key not in values or not isinstance(value, (np.ndarray, np.generic)):
            continue
        if value.dtype.kind in "OSU" and value.size == 0:
            dtypes[key] = "str"
        elif value.dtype.kind == "S":  # fixed-length bytes, which JSON holds as text
            dtypes[key] = value.dtype.str
        elif value.dtype.kind in "biuf" and (value.size == 0 or value.dtype not in (np.bool_, np.int64, np.float64)):
            shape = f"({','.join(map(str, value.shape))})" if value.size == 0 and value.ndim > 1 else ""
            dtypes[key] = shape + native_dtype(value.dtype).str
    return _Attributes(values, dtypes, dropped)


def _effective(ds) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of what ``ds[...]`` returns (HDF5 array datatypes become trailing axes)."""
    dtype = ds.dtype
    shape = tuple(int(n) for n in ds.shape)
    if dtype.subdtype is not None:
        base, sub = dtype.subdtype
        return shape + tuple(int(n) for n in sub), base
    return shape, dtype


def _describe(dtype: np.dtype) -> str:
    """A short human name for an h5py dtype, for error messages."""
    h5py = _h5py()
    string = h5py.check_string_dtype(dtype)
    if string is not None and string.length is None:
        return f"variable-length {string.encoding} string"
    vlen = h5py.check_vlen_dtype(dtype)
    if vlen is not None:
        return f"variable-length sequence of {np.dtype(vlen)}"
    if h5py.check_ref_dtype(dtype) is not None:
        return "object reference"
    if dtype.hasobject:
        return "compound with variable-length fields" if dtype.fields else "object"
    if h5py.check_enum_dtype(dtype) is not None:
        return f"enum of {native_dtype(dtype)}"
    nd = native_dtype(dtype)
    if dtype.fields is not None:
        return f"compound {nd}"
    label = {"b": "bool", "c": "complex", "S": "fixed-width string", "U": "string", "V": "opaque"}.get(
        dtype.kind
    )
    return f"{label} ({nd})" if label else str(nd)


def _unsupported(ds) -> str | None:
    """Why ``ds`` cannot be copied at all (``None`` if it can)."""
    if ds.shape is None:
        return "has a null dataspace (no data to copy)"
    dtype = ds.dtype
    if dtype.hasobject or (dtype.subdtype is not None and dtype.subdtype[0].hasobject):
        return (
            f"has dtype {_describe(dtype)}, which h5py reads as Python objects and cannot be copied "
            "bit-exactly"
        )
    return None


def _lossy_refusal(ds) -> str | None:
    """Why ``ds`` cannot be compressed lossily (``None`` if it is numeric)."""
    reason = _unsupported(ds)
    if reason:
        return reason
    shape, dtype = _effective(ds)
    if _h5py().check_enum_dtype(ds.dtype) is not None:
        return f"has dtype {_describe(ds.dtype)}: enum labels cannot be compressed lossily"
    if dtype.kind not in "uif":
        return f"has dtype {_describe(dtype)}: only integer and float data can be compressed lossily"
    if 0 in shape:
        return f"is empty (shape {list(shape)}): there is nothing to compress; copy it with --lossless"
    return None


class _Samples:
    """The shapes of a file's datasets, to tell per-sample tables and per-pixel maps from images."""

    def __init__(self, datasets) -> None:
        shapes = [_effective(ds)[0] for _, ds in datasets if ds.shape is not None]
        self.stacks = {s[0] for s in shapes if len(s) >= 3}  # image or field stacks: N samples
        self.lengths = [s[0] for s in shapes if s]
        self.pixels: set[tuple[int, ...]] = set()  # (N, H, W) of the colour image stacks, NHWC or NCHW
        for s in shapes:
            if len(s) == 4 and 2 <= s[3] <= 4:
                self.pixels.add(s[:3])
            if len(s) == 4 and 2 <= s[1] <= 4:
                self.pixels.add((s[0], *s[2:]))

    def per_sample(self, shape: tuple[int, ...]) -> bool:
        """Whether a 2-D dataset (N, F) holds F values per sample (boxes, one-hot labels, features) rather
        than one image or field: an image or field stack in the file has N samples too, or F is narrower
        than a DCT block and another dataset has N entries (labels). A DCT across samples would mix
        unrelated samples, so such a table is copied bit-exactly, like 1-D labels."""
        n, f = shape
        return n in self.stacks or (f < DCT_BLOCK and self.lengths.count(n) > 1)

    def per_pixel(self, shape: tuple[int, ...], dtype: np.dtype) -> bool:
        """Whether an integer dataset holds one value per pixel of a colour image stack in the file, shaped
        (N, H, W), (N, H, W, 1) or (N, 1, H, W): segmentation masks, class or instance ids, which a lossy
        codec would turn into other classes, so they are copied bit-exactly. (Beside a grey (N, H, W)
        stack a mask has the same shape as the images: name it with --lossless.)"""
        if dtype.kind not in "iu":
            return False
        if len(shape) == 4 and shape[3] == 1:
            shape = shape[:3]
        elif len(shape) == 4 and shape[1] == 1:
            shape = (shape[0], *shape[2:])
        return tuple(shape) in self.pixels


def _is_default_lossy(ds, samples: _Samples) -> bool:
    """Of a dtype the codec takes (other integers, bool, complex, ... are copied as they are), 2 or more
    dimensions, not empty (an empty array costs nothing to copy), and neither a per-sample table nor a
    per-pixel integer map."""
    shape, dtype = _effective(ds)
    if native_dtype(dtype) not in DTYPE_CODES or len(shape) < 2 or _h5py().check_enum_dtype(ds.dtype) is not None:
        return False
    return 0 not in shape and not (len(shape) == 2 and samples.per_sample(shape)) and not samples.per_pixel(shape, dtype)


def _store_name_problem(path: str) -> str | None:
    """Why a store cannot hold a dataset or group at ``path``: Zarr keeps each group's metadata in a file
    named zarr.json beside its children, dctchop its per-chunk metadata in the root group dctchop_meta
    (``dctchop.store.META_GROUP``), '.' or '..' name no Zarr node, and Zarr reads a backslash in a key as '/'
    (its metadata then lands elsewhere than the chunks)."""
    parts = [p for p in path.split("/") if p]
    if parts and parts[0] == META_GROUP:
        return f"would take the place of the store's metadata group {META_GROUP}"
    if "zarr.json" in parts:
        return "would take the place of a Zarr metadata file (zarr.json, in every group of the store)"
    if "." in parts or ".." in parts:
        return "has a name a Zarr store cannot hold ('.' or '..')"
    if "\\" in path:
        return "has a backslash in its name, which Zarr reads as '/'; a Zarr store cannot hold it"
    return None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return absolute_path(a) == absolute_path(b)


def _leaves_file(ds, file: str, follow_external: bool) -> str | None:
    """Why reading ``ds`` would touch other files (``None`` if it would not, or that is allowed).

    With ``follow_external`` the outside files are still checked to exist: a virtual dataset reads missing
    sources as fill values without any error, which must never pass for data.
    """
    here = os.path.dirname(ds.file.filename)
    outside: list[str] = []
    missing: list[str] = []
    if ds.is_virtual:
        absent = []  # source datasets that are not there: read as fill values too
        holds = cache(_holds)  # a source file serves many mappings
        # where HDF5 looks for a relative source file: HDF5_VDS_PREFIX, the virtual dataset's directory, the
        # working directory
        prefixes = [p for p in (os.environ.get("HDF5_VDS_PREFIX"), here, os.getcwd()) if p]
        for vmap in ds.virtual_sources():
            name, dataset = vmap.file_name, vmap.dset_name
            if name == "." or _same_file(os.path.join(here, name), ds.file.filename):
                if "%" not in dataset and dataset not in ds.file:
                    absent.append(dataset)
                continue
            outside.append(name)
            if "%" in name:  # a printf-style pattern of file names: HDF5 reads what it finds
                continue
            path = next((p for p in (os.path.join(d, name) for d in prefixes) if os.path.isfile(p)), None)
            if path is None:
                missing.append(name)
            elif follow_external and "%" not in dataset and not holds(path, dataset):
                absent.append(f"{name}:{dataset}")
        if absent:
            return f"is a virtual dataset whose sources are missing ({', '.join(sorted(set(absent)))})"
        kind = "virtual dataset with sources in"
    else:
        ext = ds.external or ()
        for name, _offset, _size in ext:
            outside.append(name)
            prefix = os.environ.get("HDF5_EXTFILE_PREFIX", "")
            if not any(os.path.isfile(p) for p in (name, os.path.join(prefix, name))):
                missing.append(name)
        kind = "dataset with external raw storage in"
    if not outside:
        return None
    files = ", ".join(sorted(set(outside)))
    if not follow_external:
        return f"is a {kind} other files ({files}); pass follow_external=True (--follow-external) to follow"
    if missing:
        return f"is a {kind} missing files ({', '.join(sorted(set(missing)))})"
    return None


def _holds(path: str, name: str) -> bool:
    """Whether the HDF5 file ``path`` has a dataset ``name`` (False when it cannot be read as HDF5)."""
    h5py = _h5py()
    try:
        with h5py.File(path, "r") as f:
            return isinstance(f.get(name), h5py.Dataset)
    except OSError:
        return False


class _NotFound(DctchopError):
    """A name that resolves to nothing (re-worded by the caller)."""


class _Walk:
    """Every group and dataset reachable from the root, each object once."""

    def __init__(self, f, follow_external: bool):
        self.groups: dict[str, _Attributes] = {}
        self.datasets: list[tuple[str, object]] = []  # (path, h5py.Dataset)
        self.problems: list[tuple[str, str]] = []  # (path, reason) for links that could not be taken
        self.soft_links: list[tuple[str, str]] = []  # (path, absolute target path as written in the link)
        self.unnamed: list[str] = []  # "path -> target" of soft links with "." or "..", which HDF5 never resolves
        self._paths: dict = {f["/"].id: "/"}  # object id -> the path it is taken under (its first hard link)
        self._hard: dict = {}  # object id -> its other hard-link paths
        self._follow = follow_external
        self.groups["/"] = _attributes(f)
        self._walk(f, "/")

    def _walk(self, grp, prefix: str) -> None:
        h5py = _h5py()
        for key in grp:
            path = posixpath.join(prefix, key)
            try:
                link = grp.get(key, getlink=True)
            except _H5_ERRORS as exc:  # pragma: no cover - damaged link table
                self.problems.append((path, f"cannot be read ({first_line(exc)})"))
                continue
            if isinstance(link, h5py.SoftLink):  # in-file alias: its target is taken at its own hard-link path
                target = _soft_target(prefix, link.path)
                if target is not None:
                    self.soft_links.append((path, target))
                else:
                    self.unnamed.append(f"{path} -> {link.path}")
                continue
            if isinstance(link, h5py.ExternalLink) and not self._follow:
                reason = (
                    f"is an external link to {link.filename}:{link.path}; pass follow_external=True "
                    "(--follow-external) to follow it"
                )
                self.problems.append((path, reason))
                continue
            try:
                obj = grp[key]
            except _H5_ERRORS as exc:
                what = (
                    f"is an external link to {link.filename}:{link.path} that cannot be followed"
                    if isinstance(link, h5py.ExternalLink)
                    else "cannot be opened"
                )
                self.problems.append((path, f"{what} ({first_line(exc)})"))
                continue
            if obj.id in self._paths:
                self._hard.setdefault(obj.id, []).append(path)
                continue
            self._paths[obj.id] = path
            if isinstance(obj, h5py.Group):
                self.groups[path] = _attributes(obj)
                self._walk(obj, path)
            elif isinstance(obj, h5py.Dataset):
                self.datasets.append((path, obj))
            # committed datatypes carry no data

    def soft_targets(self, f, file: str) -> list[tuple[str, str, object]]:
        """(path, target as written, the id of the object it leads to) of every soft link, each looked up
        once; the id is None for a link that names nothing (its target does not exist, or lies behind an
        external link that is not followed)."""
        found = []
        for path, written in self.soft_links:
            try:
                oid = _lookup(f, written, self._follow, file, self).id
            except DctchopError:
                oid = None
            found.append((path, written, oid))
        return found

    def links(self, stored_names: list, soft_targets: list) -> list[tuple[str, str, str]]:
        """(path, the name it is stored under, "soft" or "hard") for every other name of a stored group or
        dataset (``stored_names``: (object id, the name it is stored under), the first name of an object
        stored twice counting; ``soft_targets``: :meth:`soft_targets`). Soft links that dangle or lead out of
        the file (unless followed) name nothing; a name that is, or leads to, a stored name is no alias."""
        stored: dict = {}
        for oid, name in stored_names:
            stored.setdefault(oid, name)
        found = []
        for oid, name in stored.items():
            found += [(path, name, "hard") for path in [self._paths.get(oid), *self._hard.get(oid, [])]
                      if path not in (None, name)]
        found += [(path, stored[oid], "soft") for path, _, oid in soft_targets
                  if oid is not None and oid in stored and stored[oid] != path]
        names = {name for _, name in stored_names}
        return sorted(link for link in found if not any(n == link[0] or n.startswith(link[0] + "/") for n in names))

    def dangling(self, soft_targets: list) -> list[str]:
        """``path -> target`` of every soft link that names nothing in the file (``soft_targets``:
        :meth:`soft_targets`), sorted: the store cannot keep them."""
        return sorted([*self.unnamed, *(f"{path} -> {written}" for path, written, oid in soft_targets if oid is None)])

    def own_paths(self, forced: list, chosen: list) -> tuple[list, list]:
        """The names the datasets named ``--lossless`` (``forced``) and ``--dataset`` (``chosen``), as
        (name given, dataset), are stored under: their own paths, the names the walk takes them under, so
        that a name given through a soft link or another hard link stays an alias of the object. An object
        named both ways is stored twice: the exact copy keeps the name given, the lossy one takes its own
        path unless that is the copy's name. A name given twice for one object counts once."""
        lossy_ids = {ds.id for _, ds in chosen}
        forced = [(n if ds.id in lossy_ids else self._paths.get(ds.id, n), ds) for n, ds in forced]
        copies = {n for n, _ in forced}
        chosen = [(own if (own := self._paths.get(ds.id, n)) not in copies else n, ds) for n, ds in chosen]
        unique = lambda pairs: list({n: ds for n, ds in pairs}.items())
        return unique(forced), unique(chosen)

    def ids(self):
        """(object id, the path it is taken under) of every group and dataset of the walk."""
        return self._paths.items()

    def available(self) -> str:
        names = sorted([p for p, _ in self.datasets] + [p for p, _ in self.problems])
        if not names:
            return "the file holds no datasets"
        return f"available datasets: {_listed(names, ', ')}"


def _soft_target(group: str, written: str) -> str | None:
    """The path a soft link ``written`` in ``group`` leads to as HDF5 resolves it: a "." component names the
    group it is in (``./imgs``, ``/g/./imgs``: such links were dropped as naming nothing); None for a ".."
    one, which HDF5 looks up as a name, and no group has."""
    parts = posixpath.join(group, written).split("/")
    if ".." in parts:
        return None
    return "/" + "/".join(p for p in parts if p not in ("", "."))


def _lookup(f, path: str, follow_external: bool, file: str, walk: _Walk, depth: int = 0):
    """The object at ``path``, resolving soft links ourselves so external links are caught on the way."""
    h5py = _h5py()
    if depth > _MAX_LINK_DEPTH:
        raise DctchopError(f"{file}: {path}: too many levels of soft links")
    obj = f["/"]
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        here = "/" + "/".join(parts[: i + 1])
        if not isinstance(obj, h5py.Group):
            raise _NotFound(f"{file}: no dataset {path} ({obj.name} is not a group); {walk.available()}")
        try:
            link = obj.get(part, getlink=True)
        except _H5_ERRORS:  # pragma: no cover
            link = None
        if link is None:
            raise _NotFound(f"{file}: no dataset {path}; {walk.available()}")
        if isinstance(link, h5py.SoftLink):
            target = _soft_target(obj.name, link.path)
            try:
                if target is None:
                    raise _NotFound(link.path)
                nxt = _lookup(obj.file, target, follow_external, file, walk, depth + 1)
            except _NotFound:
                raise _NotFound(
                    f"{file}: {here} is a soft link to {link.path}, which does not exist; {walk.available()}"
                ) from None
        elif isinstance(link, h5py.ExternalLink):
            if not follow_external:
                via = "" if here == path else f"{path}: "
                raise DctchopError(
                    f"{file}: {via}{here} is an external link to {link.filename}:{link.path}; "
                    "pass follow_external=True (--follow-external) to follow it"
                )
            try:
                nxt = obj[part]
            except _H5_ERRORS as exc:
                raise DctchopError(
                    f"{file}: {path}: external link {here} to {link.filename}:{link.path} cannot be followed "
                    f"({first_line(exc)})"
                ) from None
        else:
            try:
                nxt = obj[part]
            except _H5_ERRORS as exc:
                raise DctchopError(f"{file}: {path}: cannot open {here} ({first_line(exc)})") from None
        obj = nxt
    return obj


def _source_array(file: str, name: str, ds, attrs: dict) -> SourceArray:
    shape, dtype = _effective(ds)
    return SourceArray(file=file, name=name, shape=shape, dtype=native_dtype(dtype), attrs=attrs)


def _dedupe(names) -> list[str]:
    out: list[str] = []
    for n in names:
        n = _norm(n)
        if n not in out:
            out.append(n)
    return out


def open_hdf5(file: str, datasets=(), lossless=(), follow_external: bool = False) -> Source:
    """Open ``file`` (absolute path of an existing HDF5 file) as a :class:`Source`.

    See :func:`dctchop.formats.open_source` for the parameters and the selection rules.
    """
    h5py = _h5py()
    lossy_names = _dedupe(datasets)
    lossless_names = _dedupe(lossless)
    both = [n for n in lossy_names if n in lossless_names]
    if both:
        raise DctchopError(f"{file}: {', '.join(both)} named both lossy (--dataset) and --lossless")
    close_all(file)  # a rewritten file must not be read through an old handle
    f = _open_file(file)
    try:
        walk = _Walk(f, follow_external)

        if STORE_ATTR in walk.groups["/"].values:
            raise DctchopError(f"{file}: the root group has an attribute named {STORE_ATTR!r}, the name the "
                               "store keeps its own record under; rename or delete that attribute first")

        def named(path: str, lossy: bool):
            obj = _lookup(f, path, follow_external, file, walk)
            if not isinstance(obj, h5py.Dataset):
                kind = "a group" if isinstance(obj, h5py.Group) else "not a dataset"
                raise DctchopError(f"{file}: {path} is {kind}, not a dataset; {walk.available()}")
            reason = _lossy_refusal(obj) if lossy else _unsupported(obj)
            reason = reason or _leaves_file(obj, file, follow_external)
            if reason:
                raise DctchopError(f"{file}: dataset {path} {reason}")
            return obj

        forced, chosen = walk.own_paths([(n, named(n, lossy=False)) for n in lossless_names],
                                        [(n, named(n, lossy=True)) for n in lossy_names])
        for path, _ in forced + chosen:
            if reason := _store_name_problem(path):
                raise DctchopError(f"{file}: dataset {path} {reason}")
        # named with --dataset: the named ones are the lossy ones; what cannot be stored is left out
        left_out = [path for path, _ in walk.problems] if chosen else []
        if walk.problems and not chosen:
            path, reason = walk.problems[0]
            raise DctchopError(f"{file}: {path} {reason}")
        groups = {}
        for path, attrs in walk.groups.items():
            reason = _store_name_problem(path)
            if reason and not chosen:
                raise DctchopError(f"{file}: group {path} {reason}; {_LEAVE_OUT.format('it')}")
            if reason:
                left_out.append(path)
            else:
                groups[path] = attrs
        taken = {ds.id for _, ds in forced + chosen}
        samples = _Samples(walk.datasets)
        lossy, kept, refused = [], [], []
        for path, ds in walk.datasets:
            if ds.id in taken:
                continue
            reason = _unsupported(ds) or _store_name_problem(path) or _leaves_file(ds, file, follow_external)
            default_lossy = not reason and _is_default_lossy(ds, samples)
            if chosen and (reason or default_lossy):
                left_out.append(path)
            elif reason:
                refused.append(f"dataset {path} {reason}")
            else:
                (lossy if default_lossy else kept).append((path, ds))
        if refused:  # all of them: naming the first alone, the user met the others one run at a time
            leave = _LEAVE_OUT.format("it" if len(refused) == 1 else "them")
            raise DctchopError(f"{file}: {_listed(refused, '; ')}; {leave}")
        if chosen:
            lossy = chosen
        kept += forced
        stored = [(ds.id, name) for name, ds in lossy + kept] + [(oid, p) for oid, p in walk.ids() if p in groups]
        soft_targets = walk.soft_targets(f, file)
        links = tuple(walk.links(stored, soft_targets))
        dropped_links = tuple(walk.dangling(soft_targets))
        attributes = {**groups, **{name: _attributes(ds) for name, ds in lossy + kept}}  # of what is stored
        attr_dtypes = {path: a.dtypes for path, a in attributes.items() if a.dtypes}
        dropped_attrs = sorted(f"{path}@{key}" for path, a in attributes.items() for key in a.dropped)
        enums = {name: {k: int(v) for k, v in labels.items()} for name, ds in kept
                 if (labels := h5py.check_enum_dtype(ds.dtype)) is not None}
        groups = {path: a.values for path, a in groups.items()}
        lossy, kept = ([_source_array(file, name, ds, attributes[name].values) for name, ds in part]
                       for part in (lossy, kept))
    except DctchopError:
        f.close()
        raise
    except _H5_ERRORS as exc:  # h5py errors on a damaged file
        f.close()
        raise DctchopError(f"{file}: cannot read HDF5 structure ({first_line(exc)})") from None
    f.close()
    return Source(path=file, kind="hdf5", lossy=tuple(lossy), lossless=tuple(kept), groups=groups,
                  follow_external=follow_external, left_out=tuple(sorted(left_out)), links=links,
                  attr_dtypes=attr_dtypes, enums=enums, dropped_attrs=tuple(dropped_attrs),
                  dropped_links=dropped_links)


READ_BUDGET = 256 << 20
"""Bytes of decompressed samples a process keeps between slab reads, of all its files together
(:func:`span_length`, :func:`keep_spans`)."""


def span_length(shape: tuple[int, ...], chunks: tuple[int, ...] | None, itemsize: int) -> int | None:
    """The length along axis 0 of the spans that slab reads of a dataset go through, or None: read directly.

    HDF5 decompresses a chunk whole to read any part of it and keeps only 1 MB of them between reads. A slab
    that cuts through a row of chunks (those at the same place along axis 0) left the rest of the row to the
    next slabs, and each decompressed it again: with chunks of (N, 1, 32) over N = 400000 samples, the whole
    dataset once per slab, 98 times. So inside :func:`keep_spans`, the part of a slab that cuts through a row
    is taken from a span, the whole row read once and kept until each of its rows was taken
    (:meth:`_Spans.copy`); the whole rows inside a slab are read directly.

    A row of more than :data:`READ_BUDGET` bytes is not held whole: its spans are READ_BUDGET bytes of
    samples each, and reading one decompresses every chunk of the row it crosses. Memory stays bounded, and
    such a dataset costs one decompression of the row per READ_BUDGET bytes of its samples (2 for the 400 MB
    above), so its time grows with the square of its length; rechunking the file (``h5repack -l``) avoids it.
    Datasets without chunks (contiguous, compact, virtual) have no rows to cut.
    """
    if chunks is None:
        return None
    sample = math.prod(shape[1:]) * itemsize
    if chunks[0] * sample <= READ_BUDGET:
        return chunks[0]
    return max(1, READ_BUDGET // sample)


def _pieces(start: int, stop: int, length: int, span: int) -> list[tuple[int, int, int | None]]:
    """Rows ``[start, stop)`` of an axis of ``length`` cut at the spans (``[i * span, (i + 1) * span)``):
    ``(lo, hi, i)`` for a part of span ``i`` that the read does not cover whole, to take from it; ``(lo, hi,
    None)`` for the whole spans between, to read directly."""
    first, last = start // span, (stop - 1) // span
    head, tail = start % span != 0, stop != min(last * span + span, length)
    if first == last and (head or tail):
        return [(start, stop, first)]
    pieces = [(start, first * span + span, first)] if head else []
    lo, hi = first * span + span if head else start, last * span if tail else stop
    if lo < hi:
        pieces.append((lo, hi, None))
    if tail:
        pieces.append((last * span, stop, last))
    return pieces


class _Spans:
    """The spans this process keeps, of all its files: READ_BUDGET bytes in all, and only while an operation
    that reads slab after slab runs (:func:`keep_spans`). Kept on each file's cached handle until the process
    ended, they outlived the operations that read them: a preview of two samples of each of two stores left
    512 MB behind."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # one thread reads a span, the others wanting it wait for it
        # (file, dataset, span index) -> its rows and which of them no read has taken yet, oldest first
        self.kept: dict[tuple[_Handle, str, int], tuple[np.ndarray, np.ndarray]] = {}
        self.operations = 0  # keep_spans blocks running

    def copy(self, handle: _Handle, name: str, ds, index: int, span: int, shape, lo: int, hi: int,
             out: np.ndarray, asked: tuple[int, int]) -> None:
        """Copy rows ``[lo, hi)`` of dataset ``name``, which lie in its span ``index`` (rows ``[index * span,
        (index + 1) * span)``), into ``out``. The span is read on the first call and kept until every row of it
        has been taken: a compress's threads take their slabs in any order, and dropping a span once a read
        took its last row made the one before it read the span again. The oldest spans are dropped first to
        stay within :data:`READ_BUDGET`: the threads of a Dask worker each read their own stretch of slabs,
        in turns. ``asked``: the rows the caller reads, which an error names."""
        key, first = (handle, name, index), index * span
        with self.lock:
            kept = self.kept.pop(key, None)
            if kept is None:
                end = min(first + span, shape[0])
                size = (end - first) * math.prod(shape[1:]) * out.itemsize
                while self.kept and sum(rows.nbytes for rows, _ in self.kept.values()) + size > READ_BUDGET:
                    del self.kept[next(iter(self.kept))]
                rows = np.empty((end - first, *shape[1:]), dtype=out.dtype)
                _read_rows(handle.file, name, ds, first, end, rows, asked)
                kept = rows, np.ones(end - first, dtype=bool)
            rows, left = kept
            out[...] = rows[lo - first : hi - first]
            left[lo - first : hi - first] = False
            if self.operations and left.any():  # once the last operation has ended, nothing would drop it
                self.kept[key] = kept

    def forget(self, handle: _Handle) -> None:
        """Drop the spans of a file whose handle closes (rewritten, or closed by :func:`close_all`)."""
        with self.lock:
            for key in [k for k in self.kept if k[0] is handle]:
                del self.kept[key]


_SPANS = _Spans()


@contextlib.contextmanager
def keep_spans() -> Iterator[None]:
    """Within, slab reads of HDF5 datasets keep the spans they cut for the next reads (:func:`span_length`),
    so each chunk is decompressed once; when the last such block running in the process ends, every span is
    dropped. Outside, slabs are read directly and nothing outlives a read. The operations that read slab
    after slab run in one: compress, a Dask task, preview, sweep's sample, inspect's verify. Blocks nest,
    across threads too: a compress's Dask threads share its spans."""
    with _SPANS.lock:
        _SPANS.operations += 1
    try:
        yield
    finally:
        with _SPANS.lock:
            _SPANS.operations -= 1
            if not _SPANS.operations:
                _SPANS.kept.clear()


class _Handle:
    """This process's open file and the datasets already looked up in it."""

    def __init__(self, file: str):
        self.file = file
        self.h5 = _open_file(file)
        self.datasets: dict[str, object] = {}

    def dataset(self, name: str, shape, dtype):
        ds = self.datasets.get(name)
        if ds is None:
            try:
                ds = self.h5[name]
            except _H5_ERRORS as exc:
                raise DctchopError(f"{self.file}: cannot open dataset {name} ({first_line(exc)})") from None
            got_shape, got_dtype = _effective(ds)
            if got_shape != tuple(shape) or native_dtype(got_dtype) != dtype:
                raise DctchopError(
                    f"{self.file}: dataset {name} changed since it was opened "
                    f"(now shape {got_shape}, dtype {native_dtype(got_dtype)})"
                )
            self.datasets[name] = ds
        return ds

    def close(self) -> None:
        _SPANS.forget(self)
        self.datasets.clear()
        try:
            self.h5.close()
        except _H5_ERRORS:  # pragma: no cover - closing must never raise
            return


def _numeric_class(ds) -> bool:
    """Whether ``ds`` is of HDF5's integer or float class (not a string, bitfield, enum, compound, ...)."""
    h5t = _h5py().h5t
    return ds.id.get_type().get_class() in (h5t.INTEGER, h5t.FLOAT)


def _read_rows(file: str, name: str, ds, start: int, stop: int, out: np.ndarray,
               asked: tuple[int, int] | None = None) -> None:
    """Read rows ``[start, stop)`` of ``ds`` (of an array, or the elements of a scalar's array datatype) into
    ``out``. ``asked``: the rows the caller reads, when these are a part of them or a span around them; an
    error names them.

    HDF5 converts the byte order of integers and floats while reading (``read_direct`` into a native
    buffer), so big-endian numbers cost no extra copy. Other types are read as h5py types them and copied:
    HDF5 has no conversion from a UTF-8 string or a bitfield to the plain numpy dtype of ``out``.
    """
    try:
        if not ds.shape:  # a scalar; of an HDF5 array datatype, its array is the shape read here
            out[...] = ds[()][start:stop] if out.ndim else ds[()]
        elif ds.dtype.subdtype is None and _numeric_class(ds):
            ds.read_direct(out, source_sel=np.s_[start:stop])
        else:  # strings, bitfields, compounds, ...; and HDF5 array datatypes, whose shape read_direct cannot fill
            out[...] = ds[start:stop]
    except _H5_ERRORS as exc:
        rows = f"{start}:{stop}"
        if asked is not None and asked != (start, stop):
            rows = f"{asked[0]}:{asked[1]} (reading rows {rows} for them)"
        raise DctchopError(f"{file}: cannot read dataset {name} rows {rows} ({first_line(exc)})") from None


def read_hdf5(
    file: str, name: str, dtype: np.dtype, shape: tuple[int, ...], start: int, stop: int
) -> np.ndarray:
    """Rows ``[start, stop)`` of dataset ``name`` as a fresh C-contiguous array of ``dtype``.

    Inside :func:`keep_spans`, slabs read in order decompress each chunk once, however they cut its rows, as
    long as a row of chunks fits in :data:`READ_BUDGET` (see :func:`span_length`).
    """
    handle = cached_handle(file, _Handle)
    ds = handle.dataset(name, shape, dtype)
    out = np.empty((stop - start,) + tuple(shape[1:]) if shape else (), dtype=dtype)
    if out.size == 0:
        return out
    span = span_length(shape, ds.chunks, dtype.itemsize) if ds.shape and _SPANS.operations else None
    if span is None:
        _read_rows(file, name, ds, start, stop, out)
        return out
    for lo, hi, index in _pieces(start, stop, shape[0], span):
        if index is None:
            _read_rows(file, name, ds, lo, hi, out[lo - start : hi - start], (start, stop))
        else:
            _SPANS.copy(handle, name, ds, index, span, shape, lo, hi, out[lo - start : hi - start], (start, stop))
    return out
