"""Input layer: lazy, picklable views of the arrays in an ``.npy`` or HDF5 file.

The compressor works chunk by chunk, possibly in worker processes, on inputs larger than memory. So
:func:`open_source` only reads metadata; it returns plain dataclasses (:class:`Source`,
:class:`SourceArray`) that carry no open file objects, and the data is read later, one slab along axis 0
at a time, by :meth:`SourceArray.read`. ``read`` opens the file lazily and caches the handle per process
(h5py handles neither pickle nor survive ``fork``), so a ``SourceArray`` pickled into a ``spawn`` worker
reads just as well as in the parent.

Every problem with the input (missing, unreadable or damaged file, unsupported dtype, unknown dataset,
link leaving the file) is raised as :class:`dctchop.errors.DctchopError` with a one-line message naming
the file and, where there is one, the dataset.

HDF5 selection rules (see :func:`open_source`):

* Default: every dataset in the file is accounted for. Datasets with ``ndim >= 2`` of a dtype the codec
  takes (uint8, uint16, int16, float16, float32, float64) are lossy, except empty ones, per-sample tables
  and per-pixel integer maps; datasets with ``ndim <= 1``, empty ones, other integers (int8, int32, int64,
  uint32, uint64), enums, bool, complex, fixed-width strings and compound/opaque types that h5py reads as a
  fixed-width numpy dtype are lossless (copied bit-exactly); datasets named in ``lossless`` are lossless
  whatever their shape. A per-sample table is a 2-D numeric (N, F) dataset in a file where an image or
  field stack (3 or more dimensions) has N samples too, or where F < 8 and another dataset has N entries:
  boxes, one-hot labels, features, which a DCT across samples would mix. A per-pixel integer map is an
  integer (N, H, W), (N, H, W, 1) or (N, 1, H, W) dataset beside a colour image stack (N, H, W, C) or
  (N, C, H, W) with 2 to 4 channels: masks and class ids, which lossy coding would turn into other
  classes. A dataset h5py can only
  read as an object array (variable-length strings or sequences, references) or with a null dataspace
  cannot be copied bit-exactly, and a dataset or group named like a file of the store (``zarr.json``,
  ``dctchop_meta`` at the root) or with a backslash in its name (Zarr reads it as '/') cannot be stored:
  both are refused, naming them; name the lossy datasets to leave them out. A root attribute named
  ``dctchop`` (the store's own record) is refused.
* Named: when ``datasets`` is given, the named datasets are the lossy ones (only numeric, non-enum,
  non-empty dtypes may be named). The datasets that are lossless by default are still copied; the other
  datasets (numeric ones with ``ndim >= 2`` not named, and those that cannot be stored) are left out and
  listed in :attr:`Source.left_out`.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import operator
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dctchop.errors import DctchopError
from dctchop.location import absolute_path

__all__ = ["HDF5_SUFFIXES", "NPY_SUFFIXES", "Source", "SourceArray", "close_all", "open_source"]

NPY_SUFFIXES = (".npy",)
HDF5_SUFFIXES = (".h5", ".hdf5")


@dataclass(frozen=True)
class SourceArray:
    """One input array: plain metadata plus a lazy reader.

    Only plain fields, so it pickles into worker processes; :meth:`read` picks the reader from the file's
    suffix (as :func:`open_source` did) and opens the file on first use in each process.

    Attributes
    ----------
    file : str
        Absolute path of the input file.
    name : str
        Dataset path inside the file (``"/images"``, ``"/group/x"``); for ``.npy`` the file stem.
    shape : tuple of int
    dtype : numpy.dtype
        Native byte order (big-endian inputs are reported as the native equivalent), no h5py metadata.
    attrs : dict
        JSON-serialisable attributes (numpy values converted, unconvertible ones dropped).
    stamp : tuple of int, optional
        The file's size and modification time when :func:`open_source` opened it: every read compares them,
        so a file replaced or rewritten meanwhile is refused, not read in part (a store of two files' rows).
    """

    file: str
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    attrs: dict = field(default_factory=dict)
    stamp: tuple[int, ...] | None = None

    def __hash__(self) -> int:  # attrs is a dict: hash the identifying fields only
        return hash((self.file, self.name, self.shape, self.dtype))

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Size of the whole array in bytes, as :meth:`read` would return it."""
        return math.prod(self.shape) * self.dtype.itemsize

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Samples ``[start, stop)`` along axis 0 as a C-contiguous native-byte-order array.

        ``stop=None`` means the end of axis 0, so ``read()`` returns the whole array. A 0-d array has no
        axis 0: ``read()`` (or ``read(0, 1)``) returns it whole, as a 0-d array. The result is always a
        fresh in-memory ``numpy.ndarray`` of dtype :attr:`dtype`, never a view of a memory map.

        Raises
        ------
        ValueError
            ``start``/``stop`` out of ``0 <= start <= stop <= shape[0]`` (a caller bug, not bad input).
        TypeError
            ``start``/``stop`` not integers (numpy integers are fine).
        DctchopError
            The file vanished, changed or cannot be read any more.
        """
        start, stop = _check_range(self.shape, start, stop)
        if _suffix(self.file) in NPY_SUFFIXES:
            from dctchop.formats import npy

            out = npy.read_npy(self.file, self.dtype, self.shape, start, stop)
        else:
            from dctchop.formats import hdf5

            out = hdf5.read_hdf5(self.file, self.name, self.dtype, self.shape, start, stop)
        if self.stamp is not None and _stamp(self.file) != tuple(self.stamp):  # after: what was read is the file's
            raise DctchopError(f"{self.file}: changed since it was opened (replaced, rewritten or removed); "
                               "run again")
        return out


@dataclass(frozen=True)
class Source:
    """Everything the compressor needs to know about one input file.

    Attributes
    ----------
    path : str
        Absolute path of the file.
    kind : str
        ``"npy"`` or ``"hdf5"``.
    lossy : tuple of SourceArray
        Arrays to compress lossily.
    lossless : tuple of SourceArray
        Arrays to copy bit-exactly (labels, ids, timestamps, ...).
    groups : dict
        HDF5 group path -> JSON-serialisable attrs, root ``"/"`` included; ``{}`` for ``.npy``.
    follow_external : bool
        Opened with ``follow_external``: a store made from it says so, and checks against it follow links too.
    left_out : tuple of str
        HDF5 datasets and groups of the file that are in neither ``lossy`` nor ``lossless`` (only when
        datasets were named), so that a caller can say what the store will lack.
    links : tuple of (str, str, str)
        HDF5 aliases of what is stored: (path, the path of the group or dataset it names, ``"soft"`` or
        ``"hard"``), absolute paths, sorted; the object itself is stored once, under its own path.
    attr_dtypes : dict
        HDF5 path (of a stored group or dataset) -> attribute -> numpy dtype string, for numeric attributes
        that JSON would widen (int16, float32, ...).
    enums : dict
        HDF5 path of a copied enum dataset -> its labels (name -> value); the array holds the values.
    dropped_attrs : tuple of str
        ``path@name`` of every attribute of a stored group or dataset that the store cannot keep, because
        JSON cannot hold its value (complex numbers, references, bytes that are not UTF-8, opaque data, ...)
        or h5py cannot read it, sorted, so that a caller can say what the store will lack.
    dropped_links : tuple of str
        ``path -> target`` of every HDF5 soft link that names nothing in the file (a dangling link), sorted:
        the store records only links to what it holds.
    """

    path: str
    kind: str
    lossy: tuple[SourceArray, ...]
    lossless: tuple[SourceArray, ...]
    groups: dict[str, dict] = field(default_factory=dict)
    follow_external: bool = False
    left_out: tuple[str, ...] = ()
    links: tuple[tuple[str, str, str], ...] = ()
    attr_dtypes: dict[str, dict[str, str]] = field(default_factory=dict)
    enums: dict[str, dict[str, int]] = field(default_factory=dict)
    dropped_attrs: tuple[str, ...] = ()
    dropped_links: tuple[str, ...] = ()

    def __hash__(self) -> int:  # groups is a dict: hash the identifying fields only
        return hash((self.path, self.kind, self.lossy, self.lossless))

    @property
    def arrays(self) -> tuple[SourceArray, ...]:
        """Lossy then lossless arrays."""
        return self.lossy + self.lossless


def open_source(
    path: str | os.PathLike,
    datasets: Sequence[str] = (),
    lossless: Sequence[str] = (),
    follow_external: bool = False,
) -> Source:
    """Inspect an input file without reading its data.

    Parameters
    ----------
    path : str or path-like
        An ``.npy``, ``.h5`` or ``.hdf5`` file (suffix compared case-insensitively).
    datasets : sequence of str
        The datasets to compress lossily (leading ``"/"`` optional). Empty: every numeric dataset with
        ``ndim >= 2`` but per-sample tables (see the module docstring). Given: only these are lossy; the
        datasets lossless by default are still copied, the rest is left out (:attr:`Source.left_out`).
        An ``.npy`` file holds one array named after the file stem: naming it is allowed (and changes
        nothing), naming anything else is an error.
    lossless : sequence of str
        Datasets to copy bit-exactly even if they would be lossy by default (for ``.npy``: the stem, which
        moves the one array to ``lossless``).
    follow_external : bool
        HDF5 only: follow external links, virtual datasets whose sources lie in other files and datasets
        with external raw storage. Off by default: such datasets are refused, naming them.

    Returns
    -------
    Source

    Raises
    ------
    DctchopError
        Missing/unreadable/damaged file, unknown suffix, pickled ``.npy``, unknown or unsupported dataset.
    """
    file = _check_file(path)
    suffix = _suffix(file)
    datasets = _as_names(datasets, "datasets")
    lossless = _as_names(lossless, "lossless")
    stamp = _stamp(file)  # before: a change while it is opened shows at the first read
    if suffix in NPY_SUFFIXES:
        from dctchop.formats import npy

        return _stamped(npy.open_npy(file, datasets, lossless), stamp)
    if suffix in HDF5_SUFFIXES:
        from dctchop.formats import hdf5

        return _stamped(hdf5.open_hdf5(file, datasets, lossless, follow_external), stamp)
    raise DctchopError(
        f"{file}: unsupported file type {suffix or '(no suffix)'!r}; expected one of "
        + ", ".join(NPY_SUFFIXES + HDF5_SUFFIXES)
    )


# --------------------------------------------------------------------------------------------------------
# per-process cache of open handles, shared by the readers
# --------------------------------------------------------------------------------------------------------

_HANDLES: dict[tuple[int, str], tuple[tuple | None, Any]] = {}  # (pid, path) -> (file identity, handle)
_HANDLES_LOCK = threading.RLock()


def _stamp(path: str) -> tuple[int, int] | None:
    """What tells a file from another put in its place, or from itself rewritten, the same on every machine of
    a Dask cluster (whose file systems may number inodes otherwise): its size and modification time; None
    when it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def _stamped(source: Source, stamp: tuple[int, int] | None) -> Source:
    """``source`` with ``stamp`` on each of its arrays."""
    return replace(source, lossy=tuple(replace(a, stamp=stamp) for a in source.lossy),
                   lossless=tuple(replace(a, stamp=stamp) for a in source.lossless))


def _identity(path: str) -> tuple | None:
    """What tells a file from another one later written at the same path: device, inode, modification time
    and size; None when the path cannot be looked up (a file deleted since: its open handle still reads it)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def cached_handle(path: str, opener):
    """Return this process's cached handle for ``path``, opening it with ``opener(path)`` on a miss.

    Keyed by ``(os.getpid(), path)`` so a forked child never reuses its parent's handle, and checked
    against the file's identity: a file rewritten at the same path is opened afresh (the old handle
    closed). A long-lived Dask worker keeps its handles from one compress to the next, and read the file
    it had first opened there.
    """
    key, identity = (os.getpid(), path), _identity(path)
    entry = _HANDLES.get(key)
    if entry is None or identity not in (None, entry[0]):
        with _HANDLES_LOCK:
            entry = _HANDLES.get(key)
            if entry is None or identity not in (None, entry[0]):
                if entry is not None:
                    _close(entry[1])
                entry = (identity, opener(path))
                _HANDLES[key] = entry
    return entry[1]


def _close(handle) -> None:
    close = getattr(handle, "close", None)
    if close is not None:
        with contextlib.suppress(Exception):  # closing (at exit too) must never raise
            close()


def close_all(path: str | os.PathLike | None = None) -> None:
    """Close this process's cached read handles (all of them, or those of one file).

    Handles reopen lazily on the next :meth:`SourceArray.read`. :func:`open_source` calls this for its
    file, so re-opening a file that was rewritten never reads through a stale handle.
    """
    pid = os.getpid()
    target = None if path is None else absolute_path(path)
    with _HANDLES_LOCK:
        for key in list(_HANDLES):
            if key[0] == pid and (target is None or key[1] == target):
                _close(_HANDLES.pop(key)[1])
        # entries of other pids were inherited through fork: drop them without touching the parent's handles
        for key in [k for k in _HANDLES if k[0] != pid]:
            del _HANDLES[key]


atexit.register(close_all)


# --------------------------------------------------------------------------------------------------------
# helpers shared by npy.py and hdf5.py
# --------------------------------------------------------------------------------------------------------


def _suffix(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def _check_file(path) -> str:
    """Absolute path of an existing, readable regular file, else DctchopError naming it."""
    try:
        raw = os.fspath(path)
    except TypeError:
        raise DctchopError(f"input path must be a string or path-like, not {type(path).__name__}") from None
    if isinstance(raw, bytes):
        raw = os.fsdecode(raw)
    file = absolute_path(raw)
    if not os.path.exists(file) and "://" in raw:  # read as a relative path, it named cwd/file:/...
        raise DctchopError(f"input {raw} is a URL; inputs are local .npy or HDF5 files")
    if not os.path.exists(file):
        raise DctchopError(f"{file}: no such file")
    if os.path.isdir(file):
        raise DctchopError(f"{file}: is a directory, expected an .npy or HDF5 file")
    if not os.path.isfile(file):
        raise DctchopError(f"{file}: not a regular file")
    if not os.access(file, os.R_OK):
        raise DctchopError(f"{file}: permission denied")
    return file


def _as_names(names, what: str) -> tuple[str, ...]:
    if isinstance(names, (str, bytes)):
        names = (names,)
    out = []
    for n in names:
        if not isinstance(n, str) or not n.strip("/ "):
            raise DctchopError(f"{what}: invalid dataset name {n!r}")
        out.append(n)
    return tuple(out)


def _check_range(shape: tuple[int, ...], start, stop) -> tuple[int, int]:
    n = shape[0] if shape else 1
    if stop is None:
        stop = n
    if isinstance(start, (bool, np.bool_)) or isinstance(stop, (bool, np.bool_)):
        raise TypeError("read(start, stop): bounds must be integers, not bool")
    try:
        start, stop = operator.index(start), operator.index(stop)
    except TypeError:
        raise TypeError(f"read(start, stop): bounds must be integers, got {start!r}, {stop!r}") from None
    if not 0 <= start <= stop <= n:
        raise ValueError(f"read({start}, {stop}) out of range for axis 0 of length {n}")
    if not shape and (start, stop) != (0, 1):
        raise ValueError("a 0-d array can only be read whole: read() or read(0, 1)")
    return start, stop


def native_dtype(dtype: np.dtype) -> np.dtype:
    """``dtype`` in native byte order (fields too), without h5py metadata (string/enum info), which numpy
    would warn about wherever the dtype is written down."""
    dtype = _without_metadata(np.dtype(dtype))
    if not _all_native(dtype):
        dtype = dtype.newbyteorder("=")
    return dtype


def _without_metadata(dtype: np.dtype) -> np.dtype:
    if dtype.fields is not None:
        fields = [dtype.fields[n] for n in dtype.names]
        return np.dtype({"names": dtype.names, "formats": [_without_metadata(f[0]) for f in fields],
                         "offsets": [f[1] for f in fields], "itemsize": dtype.itemsize})
    if dtype.subdtype is not None:
        return np.dtype((_without_metadata(dtype.subdtype[0]), dtype.subdtype[1]))
    return np.dtype(dtype.str)


def _all_native(dtype: np.dtype) -> bool:
    if dtype.fields is not None:
        return all(_all_native(f[0]) for f in dtype.fields.values())
    if dtype.subdtype is not None:
        return _all_native(dtype.subdtype[0])
    return dtype.isnative


_DROP = object()


def _jsonable(value: Any) -> Any:
    """A JSON-serialisable equivalent of ``value``, or ``_DROP``.

    numpy scalars become Python scalars, arrays become (nested) lists, bytes are decoded as UTF-8, tuples
    become lists. NaN and infinities stay floats (Python's json and Zarr write them). Anything else
    (complex, references, undecodable bytes, records: as lists their fields would come back as one
    widened array, without names) is dropped.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return _DROP
    if isinstance(value, np.generic):
        item = value.item()  # float128 stays a NumPy scalar: it has no Python type to become, nor JSON
        return _DROP if isinstance(item, np.generic) or value.dtype.kind not in "biufUS" else _jsonable(item)
    if isinstance(value, np.ndarray):  # object arrays: h5py's variable-length strings
        return _jsonable(value.tolist()) if value.dtype.kind in "biufUSO" else _DROP
    if isinstance(value, (list, tuple)):
        out = [_jsonable(v) for v in value]
        return _DROP if any(v is _DROP for v in out) else out
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                return _DROP
            v = _jsonable(v)
            if v is _DROP:
                return _DROP
            out[k] = v
        return out
    return _DROP


def json_attrs(items, dropped: list | None = None) -> dict:
    """Convert ``(name, value)`` pairs into a JSON-serialisable dict, dropping what cannot be converted (its
    name appended to ``dropped`` when given).

    ``items`` may yield a value of ``_DROP`` for attributes that could not even be read.
    """
    out = {}
    for key, value in items:
        if not isinstance(key, str):
            continue
        value = _jsonable(value)
        if value is not _DROP:
            out[key] = value
        elif dropped is not None:
            dropped.append(key)
    return out
