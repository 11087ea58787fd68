"""A read-only, lazily decoding view of a dctchop store: :func:`open`.

``dctchop.open("images.zarr")`` gives a :class:`Dataset` that indexes like an array along the sample axis
(``ds[i]``, ``ds[i:j]``, ``ds[[3, 1, 4]]``, ``ds[mask]``) and decodes only the parts of chunks (slabs) that
hold the samples a request needs; the store's other arrays (labels, ids, a second lossy array) are reachable
by name, ``ds["labels"]``.

The view keeps what it decoded and the checked bytes of chunks it has begun, up to a memory budget
(:class:`ArrayView`): reading samples in order decodes each slab once, and a random read of a chunk already
read costs one small slab's decode. For training, :class:`dctchop.Loader` reads each chunk once per epoch in
a shuffled order, which is faster still.

Lossy chunks are read straight from their files (zstd frame + crc32c trailer, as the store writes them) and
decoded with :class:`dctchop.codec.ChunkDecoder`, whose numba kernels release the GIL, so decoding threads
run in parallel; :func:`dctchop.codec.read_stored` stops before the inverse transform and returns the stored coefficients
for decoding elsewhere (``dctchop.torch_decode`` on a torch device). Stores whose arrays use another codec
pipeline or chunk key layout are decoded through Zarr instead.
"""

from __future__ import annotations

import math
import os
import posixpath
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np
import zarr

from dctchop.codec import ChunkDecoder, StoredChunk, most_coded_bytes, read_stored
from dctchop.errors import CorruptChunkError, DctchopError, first_line
from dctchop.inspect import open_store
from dctchop.location import Location
from dctchop.store import (
    FILE_FIELDS,
    META_GROUP,
    LosslessCopy,
    chunk_file,
    chunk_metadata,
    codecs_as_written,
    element_dtype,
    element_per_file,
    every_chunk_written,
    lossless_checks,
    meta_fields,
    not_as_recorded,
    not_as_written,
    open_array,
    oversized_frame,
    unframe,
)
from dctchop.transform import channels_first_axes, resolve_threads

__all__ = ["ArrayView", "Dataset", "open"]

CACHED_CHUNKS = 2  # Zarr chunks of a lossless copy kept
# What an ArrayView keeps: chunks' checked bytes (so that a random read of one costs a small slab's decode), and
# arrays of decoded samples, counted whole (so that reads near one another decode once; more would cost page
# faults: fresh memory costs a quarter of a decode the first time it is written), and arrays of a chunk's shape
# to decode into.
CODED_CACHE_BYTES = 128 << 20
DECODED_CACHE_BYTES = 16 << 20
SPARE_ARRAYS = 2


# ---------------------------------------------------------------------------------------------- chunks


class _LossyArray:
    """Chunk reader for one dctchop-coded array: chunk files -> checked bytes -> decoded samples."""

    def __init__(self, root: Location, identity, name: str, array: zarr.Array,
                 recorded: Callable[[int], dict]) -> None:
        self.name, self.array = name, array
        self.shape, self.dtype = tuple(array.shape), np.dtype(array.dtype)
        self.chunk_shape = tuple(array.chunks)
        self.chunk_len = self.chunk_shape[0]
        # its codecs are the ones written (Dataset checks them: codecs_as_written)
        self.direct = self.chunk_shape[1:] == self.shape[1:] and root.exists(name)
        self._most_bytes = most_coded_bytes(self.chunk_shape)
        self._root, self._identity = root, identity  # the store as opened (:func:`_check_same_store`)
        self._recorded = recorded  # chunk -> its file's size and checksum as written (:func:`_recorded_files`)

    def raw(self, index: int) -> bytes:
        """The dctchop-coded bytes of chunk ``index`` (zstd undone, crc32c checked; a file other than the one
        written is refused: another valid chunk copied over it would decode as wrong samples)."""
        key = chunk_file(self.name, self.array, 1, index)
        path = f"{self._root}/{key}"
        try:
            data = self._root.read(key)
        except FileNotFoundError:
            _check_same_store(self._root, self._identity)
            raise _missing_chunk(self.name, index, path) from None
        except OSError as e:
            raise DctchopError(f"array {self.name}: chunk {index} ({path}) is unreadable ({e.strerror or e})") from None
        recorded = self._recorded(index)
        _check_same_store(self._root, self._identity)  # the bytes and their record are the opened store's
        if problem := not_as_written(data, recorded):
            raise CorruptChunkError(f"array {self.name}: chunk {index} ({path}): {problem}; the store is damaged")
        try:
            return unframe(data, self._most_bytes)
        except CorruptChunkError as e:
            raise CorruptChunkError(f"array {self.name}: chunk {index} ({path}): {e}") from None

    def decode(self, index: int, out: np.ndarray | None = None, channels_first: bool = False) -> np.ndarray:
        """Samples of chunk ``index`` (the edge chunk trimmed to the array), in the array's dtype; decoded
        into ``out`` (an array of the chunk's shape and the array's dtype) when given and the chunk files
        are read directly. ``channels_first``: the last axis moved to axis 1 (see
        :meth:`dctchop.codec.ChunkDecoder.decode`); ``out`` then has that shape."""
        if not self.direct:
            x = np.asarray(self.array[slice(*_chunk_bounds(index, self.chunk_len, self.shape[0]))])
            _check_same_store(self._root, self._identity)
            return np.ascontiguousarray(x.transpose(channels_first_axes(x.ndim))) if channels_first else x
        return self._valid_samples(index, self.decoder(index), out, channels_first)

    def emit_or_decode(self, index: int, emit, rows: np.ndarray, out: np.ndarray | None = None,
                       channels_first: bool = False) -> np.ndarray | None:
        """Samples ``rows`` (sorted indices in the chunk, of samples in the array) of chunk ``index`` handed
        to ``emit`` slab by slab as :meth:`dctchop.codec.ChunkDecoder.emit_samples` does, then None; or, where
        its slabs cut samples into strips or the chunk files are not read directly, the chunk as
        :meth:`decode` gives it, to take them from."""
        if not self.direct:
            return self.decode(index, out, channels_first)
        decoder = self.decoder(index)
        if decoder.emit_samples(emit, rows, channels_first):
            return None
        return self._valid_samples(index, decoder, out, channels_first)

    def _valid_samples(self, index: int, decoder: ChunkDecoder, out: np.ndarray | None,
                       channels_first: bool) -> np.ndarray:
        """The samples of chunk ``index`` that are in the array (the edge chunk trimmed), decoded."""
        start, stop = _chunk_bounds(index, self.chunk_len, self.shape[0])
        return decoder.decode(out=out, channels_first=channels_first, rows=range(stop - start))[: stop - start]

    def decoder(self, index: int) -> ChunkDecoder:
        """Chunk ``index`` read, checked and ready to decode (see :class:`dctchop.codec.ChunkDecoder`)."""
        data = self.raw(index)
        try:
            return ChunkDecoder(data, self.chunk_shape, self.dtype)
        except CorruptChunkError as e:
            raise CorruptChunkError(f"array {self.name}: chunk {index}: {e}") from None

    def coded(self, index: int) -> StoredChunk:
        """Chunk ``index`` before the inverse transform (see :func:`dctchop.codec.read_stored`); padded to the chunk shape."""
        if not self.direct:
            raise DctchopError(f"array {self.name} is not stored as dctchop -> zstd -> crc32c chunk files; "
                               "decode it on the host (no device decode)")
        data = self.raw(index)
        try:
            return read_stored(data, self.chunk_shape, self.dtype)
        except CorruptChunkError as e:
            raise CorruptChunkError(f"array {self.name}: chunk {index}: {e}") from None


class _LosslessArray:
    """Chunk reader for a losslessly copied array (labels, ids), in the chunks of the lossy arrays.

    The copy has Zarr chunks of its own, of about 4 MB: all the labels of most datasets in one. A slice
    through Zarr decodes each Zarr chunk it touches, so the last few are kept (decoding the one labels chunk
    of 16384 images for each of their 12 data chunks was 1.8 ms of a 9 ms image chunk).
    """

    def __init__(self, root: Location, identity, name: str, array: LosslessCopy, chunk_len: int, complete: bool,
                 checksums: list[int] | None) -> None:
        self.name, self.array = name, array
        self._identity = identity  # the store as opened (:func:`_check_same_store`)
        self._root, self._complete = root, complete  # complete: every chunk file written (store format 3 on)
        self._checksums = checksums  # each chunk file's crc32c as written (store format 4 on)
        self.shape, self.dtype = tuple(array.shape), np.dtype(array.dtype)
        self.chunk_len = chunk_len
        self.direct = False
        self._zarr_len = array.chunks[0] if array.ndim else 1
        self._zarr_chunk_bytes = math.prod(array.array.chunks) * array.array.dtype.itemsize  # edge chunks whole
        self._zarr_chunk = lru_cache(maxsize=CACHED_CHUNKS)(self._read_zarr_chunk)

    def _read_zarr_chunk(self, k: int) -> np.ndarray:
        """Zarr chunk ``k``: a missing file is damage (Zarr would return fill values), so is a bad crc32c or
        a file other than the one written there (read twice then: here, and by Zarr, which decodes it)."""
        key = self.array.chunk_file(k)
        where = f"array {self.name}: chunk {k} ({self._root}/{key})"
        try:
            # a copy with no values (shape (5, 0) too) has no files
            if self.array.n_chunks and self._checksums is not None:
                raw = self._root.read(key)
                # Zarr checks the crc32c; the frame's size is checked before Zarr allocates what it says
                problem = (not_as_written(raw, {"checksum": self._checksums[k]})
                           or oversized_frame(raw, self._zarr_chunk_bytes))
                if problem:
                    _check_same_store(self._root, self._identity)
                    raise CorruptChunkError(f"{where}: {problem}; the store is damaged")
            elif self._complete and self.array.n_chunks and not self._root.exists(key):
                raise FileNotFoundError(key)
            values = np.asarray(self.array[k * self._zarr_len : (k + 1) * self._zarr_len] if self.shape
                                else self.array[...])
        except FileNotFoundError:
            _check_same_store(self._root, self._identity)
            raise _missing_chunk(self.name, k, f"{self._root}/{key}") from None
        except ValueError as e:  # zarr's crc32c codec on a corrupted file
            _check_same_store(self._root, self._identity)
            raise CorruptChunkError(f"{where}: {first_line(e)}") from None
        except OSError as e:
            raise DctchopError(f"{where} is unreadable ({e.strerror or e})") from None
        _check_same_store(self._root, self._identity)
        return values

    def scalar(self) -> np.ndarray:
        """A scalar copy's value, checked as any chunk is (a new array)."""
        return np.array(self._zarr_chunk(0))

    def decode(self, index: int) -> np.ndarray:
        """Samples of data chunk ``index``: a new array (the kept Zarr chunks are never handed out)."""
        start, stop = _chunk_bounds(index, self.chunk_len, self.shape[0])
        first, last = start // self._zarr_len, (stop - 1) // self._zarr_len
        parts = [self._zarr_chunk(k)[max(start - k * self._zarr_len, 0) : stop - k * self._zarr_len]
                 for k in range(first, last + 1)]
        return np.concatenate(parts)


def _recorded_files(root: Location, group: zarr.Group, info: dict, name: str) -> Callable[[int], dict]:
    """chunk -> what the store recorded of its file: ``stored_bytes`` and, from store format 4 on, ``checksum``
    (the fields it does not know left out: a missing or damaged table, which ``dctchop inspect`` reports, and
    reading the samples does not need). Each chunk's values are read from their own element files when it is
    read: reading whole tables at open cost 0.19 ms per chunk and table (0.75 s for 2000 chunks, paid again by
    every DataLoader worker). Stores of format 1, whose tables are chunked otherwise, are read whole."""
    fields = [key for key in FILE_FIELDS if key in meta_fields(info)]
    try:
        arrays = {key: open_array(group, root, f"{META_GROUP}/{name}/{key}") for key in fields}
    except (KeyError, ValueError, OSError):
        return lambda index: {}
    if not all(element_per_file(a) for a in arrays.values()):
        try:
            tables = {key: chunk_metadata(group, name, key) for key in fields}
        except (ValueError, OSError):
            return lambda index: {}
        return lambda index: _known({key: table[index] for key, table in tables.items()})

    def recorded(index: int) -> dict:
        values = {}
        for key, array in arrays.items():
            try:
                raw = root.read(chunk_file(f"{META_GROUP}/{name}/{key}", array, 1, index))
            except OSError:
                continue
            if len(raw) == element_dtype(key).itemsize:
                values[key] = int(np.frombuffer(raw, element_dtype(key))[0])
        return _known(values)
    return recorded


def _known(recorded: dict) -> dict:
    """``recorded`` without a size of 0, which Zarr reads for a missing element (its fill value): nothing known."""
    return recorded if recorded.get("stored_bytes", 1) else {}


def _check_same_store(root: Location, identity) -> None:
    """Refuse to go on reading a store put in the place of the one opened (``compress --overwrite`` renames a
    new one in): its chunks pass their checks, being its own, and would be paired with what was read of the
    old one (its labels, cached). ``identity``: :meth:`Location.identity` at open (None: not checked)."""
    if identity is not None and root.identity() != identity:
        raise DctchopError(f"{root} was replaced, removed or changed since it was opened; open it again")


def _missing_chunk(name: str, index: int, path: str) -> DctchopError:
    return DctchopError(f"array {name}: chunk {index} is missing ({path}); the store is damaged or incomplete")


def _chunk_bounds(index: int, chunk_len: int, length: int) -> tuple[int, int]:
    start = index * chunk_len
    return start, min(start + chunk_len, length)


# ---------------------------------------------------------------------------------------------- views


def main_array(arrays: dict) -> str:
    """A store's main compressed array, from its record's ``arrays`` (name -> summary with its ``shape``): the
    one with the most values per sample (the images of a store that also compresses their boxes, whichever
    name sorts first), then the most samples (a train split rather than its test split), then the first."""
    return max(arrays, key=lambda name: (math.prod(arrays[name]["shape"][1:]), arrays[name]["shape"][0]))


def recorded_links(info: dict) -> dict[str, str]:
    """The links of a store's source, alias -> target (absolute paths), from its record ``info``."""
    return {link["path"]: link["target"] for link in info.get("links", [])}


def stored_name(name: str, links: dict[str, str], names) -> str:
    """A store's name for an array: HDF5's absolute ``/train/images`` is ``train/images`` there (the
    compressor strips the slash), and a name through a link of the source file (``links``: alias -> target,
    absolute paths, as the store records them) that is none of the store's ``names`` is its target's name."""
    if not isinstance(name, str):
        return name
    key = name.lstrip("/")
    if key in names:
        return key
    path = "/" + key
    for _ in range(len(links)):  # each step replaces one alias, and targets are real paths
        alias = next((a for a in links if path == a or path.startswith(a.rstrip("/") + "/")), None)
        if alias is None:
            break
        path = posixpath.join(links[alias], path[len(alias):].lstrip("/"))
    return path.strip("/")


def array_named(store, name: str, links: dict[str, str], names, kind: str = "array") -> str:
    """:func:`stored_name` of ``name``, which must be one of the store's ``names`` (a :class:`DctchopError`
    listing them when it is not; ``kind`` says what they are: "compressed array" where only those will do)."""
    key = stored_name(name, links, names)
    if key not in names:
        raise DctchopError(f"{store} has no {kind} {name!r}; it has: {', '.join(names)}")
    return key


def _sample_index(key, n: int) -> tuple[np.ndarray, bool]:
    """(sample indices, whether axis 0 is kept) for an index along axis 0; IndexError when out of range."""
    if isinstance(key, (int, np.integer)):
        i = int(key)
        if not -n <= i < n:
            raise IndexError(f"index {i} is out of range for {n} samples")
        return np.array([i % n]), False
    if isinstance(key, slice):
        return np.arange(*key.indices(n)), True
    if isinstance(key, list) and not key:  # numpy reads [] as an empty integer index; asarray makes it float
        return np.zeros(0, dtype=np.int64), True
    idx = np.asarray(key)
    if idx.ndim == 0 and idx.dtype.kind in "iu":  # np.int64(3) came above; np.array(3), torch.tensor(3)
        return _sample_index(int(idx), n)
    if idx.dtype == bool:
        if idx.shape != (n,) and idx.size:  # an empty mask numpy reads as an empty integer index
            raise IndexError(f"boolean index of shape {idx.shape} does not match {n} samples")
        return np.flatnonzero(idx), True
    if idx.dtype.kind not in "iu" or idx.ndim != 1:
        raise IndexError(f"index samples with an int, a slice, or a 1-D integer or boolean array, got {key!r}")
    idx = idx.astype(np.int64)
    bad = (idx < -n) | (idx >= n)
    if bad.any():
        raise IndexError(f"index {int(idx[bad][0])} is out of range for {n} samples")
    return idx % n, True


def _is_rare_index(key) -> bool:
    """A key numpy reads in ways the sample lookup does not: a bool, also as a 0-d array (which adds an axis),
    an index array of more than one dimension (which shapes the result)."""
    if isinstance(key, (bool, np.bool_)):
        return True
    if isinstance(key, (list, np.ndarray)) or hasattr(key, "__array__"):
        return np.ndim(key) > 1 or np.ndim(key) == 0 and np.asarray(key).dtype == bool
    return False


def _is_field_name(key) -> bool:
    """A record array's field name, or a list of them (numpy selects those fields of every sample)."""
    return isinstance(key, str) or isinstance(key, list) and bool(key) and all(isinstance(k, str) for k in key)


def _is_bool_index(key) -> bool:
    return isinstance(key, np.ndarray) and key.dtype == bool or (
        isinstance(key, list) and bool(key) and all(isinstance(k, (bool, np.bool_)) for k in key))


class _CachedChunk:
    """A chunk as far as it is decoded: its samples (None until some are decoded; those not decoded hold
    anything), which of its valid samples are decoded, and its decoder (None for chunks decoded whole on
    creation: those read through Zarr, lossless copies)."""

    def __init__(self, samples: np.ndarray | None, done: np.ndarray, decoder: ChunkDecoder | None,
                 sample_nbytes: int) -> None:
        self.samples, self.done, self.decoder = samples, done, decoder
        self.sample_nbytes = sample_nbytes
        self.lock = threading.Lock()  # decodes and copies one at a time: a slab's values are written more than once
        self.shared = False  # whether the samples array was handed out (ArrayView.chunk): never reused then
        self.counted = (0, 0)  # its bytes in the view's totals

    @property
    def nbytes(self) -> tuple[int, int]:
        """(coded, decoded) bytes it holds: decoded, its samples array whole, however few samples are decoded
        (counting only those let random reads keep hundreds of chunk-sized arrays: 0.5-1 GB for 16 MB)."""
        decoded = self.samples.nbytes if self.samples is not None else 0
        return self.decoder.nbytes if self.decoder is not None else 0, decoded


class ArrayView:
    """One array of a store, indexed along the sample axis (axis 0) and decoded on demand.

    Decodes only the slabs that hold the samples a request needs: a few samples in small slabs (10 images of
    32x32 RGB, one 32³ field), more in the big ones (about 1 MB of coefficients). Keeps the checked bytes of
    the chunks it read, up to :data:`CODED_CACHE_BYTES`, and what it decoded, up to
    :data:`DECODED_CACHE_BYTES` (least recently used first out): reading in order decodes each chunk once, and
    a random read of a chunk whose bytes are kept costs a small slab's decode, not the chunk's zstd and
    decode. A request that spans several chunks decodes them on ``threads`` threads. :class:`dctchop.Loader`
    is still the fast way to shuffle for training.
    """

    def __init__(self, reader, info: dict | None, threads: int, path) -> None:
        self._reader = reader
        self._path = path  # its store's, which it pickles as with its name (no reference to the Dataset: a cycle)
        self.info = info or {}
        self._threads = threads
        self._cache: OrderedDict[int, _CachedChunk] = OrderedDict()  # least recently used first
        self._bytes = (0, 0)  # what the cached chunks hold: coded, decoded
        self._decoded: OrderedDict[int, _CachedChunk] = OrderedDict()  # those whose samples may be dropped
        self._spare: list[np.ndarray] = []  # samples arrays of the chunk shape dropped, to decode into again
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self._reader.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self._reader.shape

    @property
    def dtype(self) -> np.dtype:
        return self._reader.dtype

    @property
    def lossy(self) -> bool:
        """Whether the array is dctchop-coded (False for lossless copies such as labels)."""
        return isinstance(self._reader, _LossyArray)

    @property
    def layout(self) -> str | None:
        """Layout the compressor inferred (``"NHWC"``, ``"NZYX"``, ...; ``"custom"`` for explicit axes)."""
        return self.info.get("layout")

    @property
    def chunk_len(self) -> int:
        """Samples per chunk along axis 0."""
        return self._reader.chunk_len

    @property
    def n_chunks(self) -> int:
        return -(-self.shape[0] // self.chunk_len) if self.shape else 1

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError(f"array {self.name} is a scalar")
        return self.shape[0]

    def chunk(self, index: int) -> np.ndarray:
        """All samples of chunk ``index`` (negative: from the end; read-only, shared with the cache)."""
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"chunk index must be an int, got {index!r}")
        if not -self.n_chunks <= index < self.n_chunks:
            raise IndexError(f"chunk {index} is out of range for {self.n_chunks} chunks of array {self.name}")
        index = int(index) % self.n_chunks  # the cache's key for it
        entry = self._entry(index)
        with entry.lock:
            self._decode_missing(index, entry, np.arange(entry.done.size))
            entry.shared = True
            out = entry.samples[: entry.done.size]
        out.flags.writeable = False  # every sample is decoded and the array is never reused: nothing writes to it
        return out

    def _read(self, index: int, rows: np.ndarray, out: np.ndarray) -> None:
        """Samples ``rows`` of chunk ``index`` (indices within it) into ``out``, decoding what is missing first."""
        entry = self._entry(index)
        with entry.lock:  # the copy waits for a decode: big slabs may decode samples that small ones did
            self._decode_missing(index, entry, rows)
            np.take(entry.samples, rows, axis=0, out=out, mode="clip")  # rows are in range; "raise" would buffer

    def _decode_missing(self, index: int, entry: _CachedChunk, rows: np.ndarray) -> None:
        """Decode the samples of ``rows`` that ``entry`` (chunk ``index``) lacks, with the rest of their slabs. A
        read that goes on from decoded samples (the one before its first is decoded) decodes the rest of the
        chunk: reading in order then decodes chunks in their big slabs. Called with ``entry.lock`` held."""
        missing = np.unique(rows[~entry.done[rows]])
        if not missing.size:
            return
        if missing[0] > 0 and entry.done[missing[0] - 1]:
            missing = missing[0] + np.flatnonzero(~entry.done[missing[0]:])
        if entry.samples is None:
            with self._lock:
                entry.samples = self._spare.pop() if self._spare else None
            if entry.samples is None:
                entry.samples = np.empty(self._reader.chunk_shape, self.dtype)
        for a, b in entry.decoder.decode_rows(entry.samples, missing):
            entry.done[a:b] = True
        self._count(index, entry)

    def _count(self, index: int, entry: _CachedChunk) -> None:
        """Bring the bytes of chunk ``index`` (``entry``, unless dropped meanwhile) up to date in the totals, then
        keep them within :data:`CODED_CACHE_BYTES` and :data:`DECODED_CACHE_BYTES`, least recently decoded or
        read first: first dropping chunks' decoded samples (their arrays are decoded into again: fresh pages
        would cost a quarter of the decode), then whole chunks (never the most recent)."""
        with self._lock:
            cached = self._cache.get(index) is entry
            if cached:
                self._add(entry)
            self._decoded.pop(index, None)  # this one's samples are kept: they are being read
            while self._bytes[1] > DECODED_CACHE_BYTES and self._decoded:
                _, old = self._decoded.popitem(last=False)
                if old.lock.acquire(blocking=False):  # one another thread is reading is left alone
                    try:
                        if not old.shared and len(self._spare) < SPARE_ARRAYS:
                            self._spare.append(old.samples)
                        old.samples, old.shared, old.done[:] = None, False, False
                        self._add(old)
                    finally:
                        old.lock.release()
            if cached and entry.decoder is not None and entry.samples is not None:
                self._decoded[index] = entry
            while len(self._cache) > 1 and (self._bytes[0] > CODED_CACHE_BYTES
                                            or self._bytes[1] > DECODED_CACHE_BYTES):
                oldest, dropped = self._cache.popitem(last=False)
                self._decoded.pop(oldest, None)
                self._bytes = tuple(t - c for t, c in zip(self._bytes, dropped.counted))

    def _add(self, entry: _CachedChunk) -> None:
        """Update the totals for what a cached ``entry`` holds now; with ``self._lock`` held."""
        now = entry.nbytes
        self._bytes = tuple(t + n - c for t, n, c in zip(self._bytes, now, entry.counted))
        entry.counted = now

    def _entry(self, index: int) -> _CachedChunk:
        with self._lock:
            if index in self._cache:
                self._cache.move_to_end(index)
                return self._cache[index]
        sample_nbytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        if self._reader.direct:
            start, stop = _chunk_bounds(index, self.chunk_len, self.shape[0])
            entry = _CachedChunk(None, np.zeros(stop - start, bool), self._reader.decoder(index), sample_nbytes)
        else:
            samples = self._reader.decode(index)
            entry = _CachedChunk(samples, np.ones(len(samples), bool), None, sample_nbytes)
        with self._lock:  # another thread may have made one meanwhile
            entry = self._cache.setdefault(index, entry)
            self._cache.move_to_end(index)
        self._count(index, entry)
        return entry

    def __getitem__(self, key) -> np.ndarray:
        """numpy's indexing: the samples the key selects along axis 0 are decoded, then the whole key is
        applied to them with that part renumbered."""
        if not self.shape:  # a lossless copy: compressed arrays have samples
            return self._reader.scalar()[key]
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):  # ds[i], the usual read: no key parsing
            return self._samples(_sample_index(key, self.shape[0])[0])[0]
        if _is_field_name(key):
            return self._samples(np.arange(self.shape[0]))[key]
        key = key if isinstance(key, tuple) else (key,)
        at = self._sample_axis_at(key)
        if at is None:
            return self._samples(np.arange(self.shape[0]))[key]
        idx, keep_axis = _sample_index(key[at], self.shape[0])
        local = (slice(None) if isinstance(key[at], slice) else np.arange(idx.size)) if keep_axis else 0
        return self._samples(idx)[(*key[:at], local, *key[at + 1:])]

    def _sample_axis_at(self, key: tuple) -> int | None:
        """Where in ``key`` the index of axis 0 is; None where numpy's own rules must see every sample: a rare
        index, an ellipsis that spans axis 0, no index at all (``()``, ``(None,)``)."""
        if any(_is_rare_index(k) for k in key):
            return None
        at = next((i for i, k in enumerate(key) if k is not None), len(key))
        if at < len(key) and key[at] is Ellipsis:
            consumed = sum(np.ndim(k) if _is_bool_index(k) else 1 for k in key if k is not None and k is not Ellipsis)
            if consumed < len(self.shape):
                return None
            at = next((i for i in range(at + 1, len(key)) if key[i] is not None), len(key))
        return at if at < len(key) else None

    def _samples(self, idx: np.ndarray) -> np.ndarray:
        """Samples ``idx`` (in that order), each chunk decoded once."""
        # zeros: the padding bytes of records stay defined (np.empty would leave whatever memory held)
        out = (np.zeros if self.dtype.kind == "V" else np.empty)((idx.size, *self.shape[1:]), dtype=self.dtype)
        chunk_of = idx // self.chunk_len
        needed = np.unique(chunk_of).tolist()
        if len(needed) <= 1:
            if not needed:
                return out
            self._read(needed[0], idx - needed[0] * self.chunk_len, out)
            return out
        where = {c: np.flatnonzero(chunk_of == c) for c in needed}

        def read(c: int) -> None:
            part = np.empty((where[c].size, *out.shape[1:]), out.dtype)
            self._read(c, idx[where[c]] - c * self.chunk_len, part)
            out[where[c]] = part

        if self._threads > 1:
            with ThreadPoolExecutor(min(self._threads, len(needed)), thread_name_prefix="dctchop-read") as pool:
                list(pool.map(read, needed))
        else:
            for c in needed:
                read(c)
        return out

    def __array__(self, dtype=None, copy=None):
        out = self[...]
        return out if dtype is None else out.astype(dtype)

    def __reduce__(self):
        """Pickles as its dataset (by path) and its name, so a map-style torch Dataset holding views works in
        DataLoader workers started by spawn (a new view, with nothing decoded yet)."""
        return _array_of, (self._path, self._threads, self.name)

    def __repr__(self) -> str:
        kind = "lossy" if self.lossy else "lossless"
        return f"<dctchop array {self.name!r} {kind} {self.dtype}{list(self.shape)}>"


def _array_of(path, threads: int, name: str) -> ArrayView:
    return Dataset(path, threads).array(name)


class Dataset:
    """Read-only view of a dctchop store; see :func:`open`.

    ``len``, ``shape``, ``dtype`` and integer/slice/fancy indexing refer to the main array (the store's lossy
    array; of several, the one with the most values per sample, the data rather than, say, its boxes, unless
    ``main`` names another); ``ds[name]`` is any array of the store as an :class:`ArrayView`. Names may start
    with a ``/`` as in HDF5. The lossless copies are read in the main array's chunks. Pickles by path, so it
    can be handed to worker processes.
    """

    def __init__(self, path: str | bytes | os.PathLike, threads: int | None = None, main: str | None = None) -> None:
        root = Location(path).absolute()  # a relative path would name another store after os.chdir
        self.path = root.target if root.is_url else root.path
        self._threads = resolve_threads(threads)
        identity = root.identity()
        group, info = open_store(self.path)
        self.info = info
        self.lossy_names = tuple(info["arrays"])
        self.lossless_names = tuple(n for n in info.get("lossless", []) if n not in info["arrays"])
        self._links = recorded_links(info)
        if not self.lossy_names:
            raise DctchopError(f"{self.path}: the store lists no compressed array")
        self._views: dict[str, ArrayView] = {}
        for name in self.lossy_names:
            array = self._zarr_array(group, root, name)
            if list(array.shape) != list(info["arrays"][name]["shape"]):
                raise DctchopError(f"{self.path}: array {name}'s metadata says shape {list(array.shape)}, the "
                                   f"store's record {info['arrays'][name]['shape']}; the store is damaged")
            if not codecs_as_written(array, info["arrays"][name]["codec"]):
                raise DctchopError(f"{self.path}: array {name}'s metadata names other codecs than the ones the "
                                   "store's record says were written; the store is damaged")
            self._views[name] = ArrayView(_LossyArray(root, identity, name, array,
                                                      _recorded_files(root, group, info, name)),
                                          info["arrays"][name], self._threads, self.path)
        main = main_array(info["arrays"]) if main is None else stored_name(main, self._links, self.lossy_names)
        if main not in self.lossy_names:
            raise DctchopError(f"{self.path} has no compressed array {main!r} to be the main one; it has: "
                               f"{', '.join(self.lossy_names)}")
        self.main = self._views[main]
        for name in self.lossless_names:
            copy = LosslessCopy(self._zarr_array(group, root, name), info, name)
            checks = lossless_checks(info, name)
            if mismatch := not_as_recorded(copy, checks):
                raise DctchopError(f"{self.path}: array {name}: {mismatch}; the store is damaged")
            reader = _LosslessArray(root, identity, name, copy, self.main.chunk_len, every_chunk_written(info),
                                    None if checks is None else checks["checksums"])
            self._views[name] = ArrayView(reader, None, self._threads, self.path)
        _check_same_store(root, identity)  # what was read of it at open is the opened store's

    def _zarr_array(self, group: zarr.Group, root: Location, name: str) -> zarr.Array:
        try:
            array = open_array(group, root, name)
        except KeyError:
            raise DctchopError(f"{self.path}: array {name} is listed in the store's attributes but missing; "
                               "the store is damaged") from None
        except Exception as e:  # noqa: BLE001 - zarr raises many types for a damaged array; all are damage
            raise DctchopError(f"{self.path}: array {name}: its metadata cannot be opened, the store is damaged "
                               f"({type(e).__name__}: {first_line(e)})") from None
        if not isinstance(array, zarr.Array):
            raise DctchopError(f"{self.path}: {name} is a group, not an array")
        return array

    # the main array ------------------------------------------------------------------------------------
    @property
    def arrays(self) -> tuple[str, ...]:
        """Names of every array: the lossy ones first, then the lossless copies."""
        return self.lossy_names + self.lossless_names

    @property
    def shape(self) -> tuple[int, ...]:
        return self.main.shape

    @property
    def dtype(self) -> np.dtype:
        return self.main.dtype

    @property
    def layout(self) -> str | None:
        return self.main.layout

    @property
    def chunk_len(self) -> int:
        return self.main.chunk_len

    @property
    def n_chunks(self) -> int:
        return self.main.n_chunks

    def __len__(self) -> int:
        return self.shape[0]

    def array(self, name: str) -> ArrayView:
        """The array ``name`` (``/name`` too, as HDF5 writes it, or a name through a soft or hard link the
        source file had); a :class:`DctchopError` listing the store's arrays when there is none."""
        return self._views[array_named(self.path, name, self._links, self.arrays)]

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.array(key)
        return self.main[key]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and stored_name(name, self._links, self._views) in self._views

    def __array__(self, dtype=None, copy=None):
        return self.main.__array__(dtype)

    def __getstate__(self) -> dict:
        return {"path": str(self.path), "threads": self._threads, "main": self.main.name}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["threads"], state["main"])

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}: {self._views[n].dtype}{list(self._views[n].shape)}" for n in self.arrays)
        return f"<dctchop.Dataset {str(self.path)!r} ({parts})>"


def open(path: str | bytes | os.PathLike, threads: int | None = None,
         main: str | None = None) -> Dataset:  # dctchop.open, like builtins.open for files
    """Open a dctchop store read-only as a lazily decoding :class:`Dataset`.

    Parameters
    ----------
    path : str or path-like
        The store directory (made by ``dctchop compress``), or its fsspec URL (``s3://bucket/x.zarr``).
    threads : int, optional
        Threads for requests that span several chunks; default one per core.
    main : str, optional
        The compressed array that ``len``, ``shape`` and indexing refer to (default: the one with the most
        values per sample, the first name on a tie), say ``test/images`` of a store that holds a train and a
        test split of different lengths. A leading ``/`` (HDF5's absolute names) is ignored.

    Raises
    ------
    DctchopError
        When ``path`` does not exist, is not a Zarr store, or is not a dctchop store.
    """
    return Dataset(path, threads, main)

