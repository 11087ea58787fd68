"""``.npy`` input: one array, read slab by slab, never unpickled.

``np.load`` of an object-dtype file runs pickle, i.e. arbitrary code from the file. So the header is parsed
on its own first (``read_magic`` + ``read_array_header_*``) and anything holding Python objects is refused
before ``np.load`` ever sees it; ``allow_pickle=False`` is a second fence. The header also tells how many
data bytes the file must hold, which turns a truncated file into a clear error instead of a failed (or,
later, faulting) memory map.

Only the slabs asked for are read (:func:`read_npy`): C-ordered files with positioned reads straight into
the result, Fortran-ordered ones through ``np.load(..., mmap_mode="r")``; both come back as C-ordered
arrays in native byte order.
"""

from __future__ import annotations

import math
import os

import numpy as np

from dctchop.errors import DctchopError, first_line
from dctchop.formats import Source, SourceArray, cached_handle, close_all, native_dtype

__all__ = ["open_npy", "read_header", "read_npy"]

STORED_NAME = "data"  # the array's name in a store made from an .npy file, whatever the file is called
# numpy parses headers up to 10,000 bytes unless told otherwise (a guard for np.load of untrusted files); format
# 2.0 and 3.0 allow 4 GiB, and a writer that pads its header to a size of its own is within the format
MAX_HEADER_BYTES = 1 << 20


def read_header(file: str) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """Parse the ``.npy`` header of ``file`` without loading data.

    Returns
    -------
    shape, fortran_order, dtype, data_offset

    Raises
    ------
    DctchopError
        Not an ``.npy`` file, damaged header, unknown format version, object dtype, truncated data.
    """
    fmt = np.lib.format
    try:
        with open(file, "rb") as fh:
            try:
                version = fmt.read_magic(fh)
            except ValueError as exc:
                raise DctchopError(f"{file}: not a valid .npy file ({first_line(exc)})") from None
            try:
                if version == (1, 0):
                    shape, fortran, dtype = fmt.read_array_header_1_0(fh, max_header_size=MAX_HEADER_BYTES)
                elif version == (2, 0):
                    shape, fortran, dtype = fmt.read_array_header_2_0(fh, max_header_size=MAX_HEADER_BYTES)
                elif version == (3, 0):
                    shape, fortran, dtype = _read_header_3_0(fh, file)
                else:
                    raise DctchopError(f"{file}: unsupported .npy format version {version[0]}.{version[1]}")
            except DctchopError:
                raise
            except Exception as exc:  # noqa: BLE001 - numpy's header parser on untrusted bytes raises
                # ValueError, SyntaxError, tokenize.TokenError, TypeError, ... : all mean a damaged header
                raise DctchopError(f"{file}: damaged .npy header ({first_line(exc)})") from None
            offset = fh.tell()
            size = os.fstat(fh.fileno()).st_size
    except OSError as exc:
        raise DctchopError(f"{file}: cannot read ({exc.strerror or first_line(exc)})") from None
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise DctchopError(
            f"{file}: pickled/object arrays are not supported (dtype {dtype}); "
            "save numeric data, or fixed-width strings, instead"
        )
    shape = tuple(int(n) for n in shape)
    if any(not 0 <= n <= np.iinfo(np.intp).max for n in shape):
        raise DctchopError(f"{file}: damaged .npy header (shape {shape})")
    need = math.prod(shape) * dtype.itemsize
    have = size - offset
    if have < need:
        raise DctchopError(
            f"{file}: truncated .npy file: header promises {need} data bytes for shape {shape} "
            f"{dtype}, file holds {have}"
        )
    return shape, bool(fortran), dtype, offset


def _read_header_3_0(fh, file):
    # Format 3.0 (utf-8 field names) has no public reader; numpy's private one is stable across 1.x/2.x.
    reader = getattr(np.lib.format, "_read_array_header", None)
    if reader is None:
        try:
            from numpy.lib import _format_impl

            reader = _format_impl._read_array_header
        except (ImportError, AttributeError):
            raise DctchopError(f"{file}: .npy format version 3.0 is not supported by this numpy") from None
    return reader(fh, (3, 0), max_header_size=MAX_HEADER_BYTES)


def open_npy(file: str, datasets=(), lossless=()) -> Source:
    """Open ``file`` (absolute path of an existing ``.npy``) as a :class:`Source` with one array.

    The array is named after the file stem and is lossy, unless ``lossless`` names it. ``datasets`` and
    ``lossless`` may name it by that stem or by :data:`STORED_NAME`, its name in a store (leading ``"/"``
    optional).
    """
    name = os.path.splitext(os.path.basename(file))[0]
    for n in (*datasets, *lossless):
        if n.strip("/") not in (name, STORED_NAME):
            raise DctchopError(f"{file}: no dataset {n!r}; an .npy file holds one array, named {name!r} "
                               f"({STORED_NAME!r} in the store)")
    if datasets and lossless:
        raise DctchopError(f"{file}: {name} named both lossy (--dataset) and --lossless")
    shape, _fortran, dtype, _offset = read_header(file)
    close_all(file)  # a rewritten file must not be read through an old map
    arr = _load(file)
    if arr.shape != shape or arr.dtype != dtype:  # pragma: no cover - header and np.load disagree
        raise DctchopError(f"{file}: .npy header and data disagree")
    src = SourceArray(file=file, name=name, shape=shape, dtype=native_dtype(dtype), attrs={})
    if lossless:
        return Source(path=file, kind="npy", lossy=(), lossless=(src,), groups={})
    return Source(path=file, kind="npy", lossy=(src,), lossless=(), groups={})


def _open_map(file: str) -> np.ndarray:
    return np.load(file, mmap_mode="r", allow_pickle=False, max_header_size=MAX_HEADER_BYTES)


def _load(file: str) -> np.ndarray:
    try:
        return cached_handle(file, _open_map)
    except DctchopError:
        raise
    except (OSError, ValueError, OverflowError) as exc:
        raise DctchopError(f"{file}: cannot map .npy data ({first_line(exc)})") from None


def read_npy(file: str, dtype: np.dtype, shape: tuple[int, ...], start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of the ``.npy`` file as a fresh C-contiguous array of ``dtype``.

    ``dtype``/``shape`` are what :func:`open_npy` reported; a file that no longer matches is an error.
    C-ordered files are read with positioned reads straight into the result, so the process never holds
    more of the input than the rows asked for (a memory map would keep every page it touched resident);
    Fortran-ordered files, whose rows are not contiguous, go through the map.
    """
    file_shape, fortran, file_dtype, offset = read_header(file)
    if file_shape != tuple(shape) or native_dtype(file_dtype) != dtype:
        raise DctchopError(f"{file}: changed since it was opened (now shape {file_shape}, dtype {file_dtype})")
    if fortran:
        arr = _load(file)
        part = arr[start:stop] if arr.ndim else arr
        # np.array(..., subok=False) always copies into a plain ndarray: never hand out a view of the map.
        return np.array(part, dtype=dtype, order="C", copy=True)
    rows = (stop - start) if shape else 1
    row_items = math.prod(shape[1:]) if shape else 1
    out = np.empty((rows, *shape[1:]) if shape else (), dtype=file_dtype)
    with open(file, "rb", buffering=0) as fh:
        fh.seek(offset + start * row_items * file_dtype.itemsize)
        view = memoryview(out.reshape(-1).view(np.uint8))
        got = 0
        while got < len(view):
            n = fh.readinto(view[got:])
            if not n:
                raise DctchopError(f"{file}: data ends early (truncated while reading rows {start}..{stop})")
            got += n
    return out if file_dtype == dtype else out.astype(dtype)
