"""The training loader: a dctchop store -> shuffled, decoded, model-ready batches.

Order (SOLAR-style, Sun et al.). Random access per sample would decode a whole chunk per sample, so every
epoch reads each chunk once: the chunk order is shuffled (seeded by ``seed`` and the epoch), the samples of
that order are split into contiguous shares, one per rank, then one part per DataLoader worker, and each
part is shuffled within windows of ``window`` consecutive chunks. Every rank's share has the same size, so
every rank yields the same number of batches, as with torch's ``DistributedSampler`` (a rank that stopped
early would hang the others at their next collective op). When ``world_size`` does not divide the ``n``
samples, ``drop_last`` leaves out the last ``n % world_size`` samples of the epoch's order (the end of its
last chunk, a different chunk each epoch when shuffled); without it the shares are split as evenly as
possible and each share one sample short repeats a sample of its own last chunk, which it decodes anyway.
Shares are disjoint and cover the data when ``world_size`` divides it. A chunk is decoded at most once per
share, by the shares that hold samples of it: at most two when shares are a chunk or longer (with fewer
samples than ranks, a share with none of its own takes the one after it in the order). Within a batch,
samples are grouped by chunk so each group is one contiguous copy.

Pipeline. ``threads`` background threads read, check and decode chunks (numba kernels that release the GIL)
and gather the samples of each batch into a contiguous array, converting them to the output layout, dtype
and normalisation in the same pass (float32 output; other conversions are made on the whole chunk when it is
decoded). Chunks and batches share one first-in first-out queue: a batch is queued after the chunks it reads,
so it never waits for a chunk no thread has taken, and at the end of an epoch, with nothing left to decode,
every thread gathers (a thread of its own for the batches left one core idle there: 7% fewer images/s on 2
cores). Channels-last arrays yielded channels-first are decoded channels-first (``decode_chunk(...,
channels_first=True)``): the gather then reads contiguous colour planes, where deinterleaving NHWC samples
cost it about 8x more. ``prefetch`` batches are built ahead while the training step runs, decoding runs up to
``window`` chunks ahead of the batches, and a decoded chunk is dropped after the last batch that uses it. Decoded chunks and batches go into arrays handed out before and no longer referenced anywhere
(:class:`_RecycledArrays`) when there are some, else new ones. Arrays of big samples (32³ float32 fields; at
least :data:`SCATTER_SAMPLE_BYTES`) skip the decoded chunk: each slab of a chunk decodes into a scratch array
and its samples are copied into the batches that take them while it is in cache (:class:`_Filling`); a batch
is then ready once its chunks are.

Device decode. With ``device=`` set, only the stored coefficients of each chunk cross to the device, where
:mod:`dctchop.torch_decode` runs the inverse transform; batches are gathered there. The worker threads
read the chunks and stage their coefficients in pinned memory; one batch thread of its own launches the copies
and device work, in batch order.
"""

from __future__ import annotations

import math
import posixpath
import sys
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from dctchop.dataset import Dataset
from dctchop.errors import DctchopError
from dctchop.jit import numba
from dctchop.layout import infer_axes
from dctchop.store import stored_as_bytes
from dctchop.transform import channels_first_axes, channels_first_shape, resolve_threads

__all__ = ["Loader", "epoch_order", "share_size"]

OUTPUT_DTYPES = ("float32", "float16", "bfloat16", "uint8")
LAYOUTS = ("channels_first", "channels_last", "stored")
CHANNELS_LAST = ("NHWC", "NZYXC")  # store layouts whose last axis is the channel axis
CHANNELS_FIRST = ("NCHW", "NCZYX")  # ... whose axis 1 is
DEFAULT_MAX_THREADS = 4
# Arrays whose samples decode to at least this many bytes go from each decoded slab straight into their
# batches (:class:`_Filling`). Measured on float32 fields, 1 / 2 threads, against decoding chunks whole and
# gathering: 128 KB samples 1.16x / 1.11x, 64 KB 1.16x / 1.02x, 16 KB 1.00x / 1.08x, 8 KB 0.98x / 0.93x; 3 KB
# images 0.66x / 0.51x (a copy call per batch per slab, and slabs of 85 images go to ~20 batches).
SCATTER_SAMPLE_BYTES = 32 << 10


def require_torch():
    """Import torch or raise a :class:`DctchopError` saying how to get it."""
    try:
        import torch
    except ImportError:
        raise DctchopError("torch is not installed but torch output or a device was asked for; install it "
                           "with pip install 'dctchop[torch]'") from None
    return torch


# ---------------------------------------------------------------------------------------------- order


def share_size(n: int, world_size: int, drop_last: bool) -> int:
    """Samples in each rank's share of an epoch of ``n``: the same on every rank, so that every rank runs
    the same number of steps (a rank that finished early would hang the others' next collective op)."""
    return n // world_size if drop_last else -(-n // world_size)


def epoch_order(n: int, chunk_len: int, *, shuffle: bool = True, seed: int = 0, epoch: int = 0,
                window: int = 4, rank: int = 0, world_size: int = 1, drop_last: bool = False, worker: int = 0,
                num_workers: int = 1) -> np.ndarray:
    """Sample indices of one epoch for ``worker`` of ``num_workers`` in ``rank`` of ``world_size``, in the
    order they are yielded.

    The same ``(seed, epoch)`` gives the same chunk order on every rank; its samples are split into
    contiguous shares of :func:`share_size` samples, one per rank. When ``world_size`` does not divide
    ``n``, ``drop_last`` leaves out the last ``n % world_size`` samples of that order. Without it the shares
    are split as evenly as possible and each share one sample short repeats one sample of its last chunk
    (chosen by ``(seed, epoch, rank)``; without ``shuffle``, its last sample), so no share decodes a chunk
    more for the padding; a share with no sample, when there are fewer samples than ranks, takes the sample
    after it in the order. Each rank's share is then split into contiguous parts, one per worker (together
    they are the share); each part is shuffled within windows of ``window`` chunks with a generator seeded
    by ``(seed, epoch)`` and the part. Without ``shuffle`` the parts are in storage order.
    """
    n_chunks = -(-n // chunk_len)
    chunks = np.random.default_rng([seed, epoch]).permutation(n_chunks) if shuffle else np.arange(n_chunks)
    sizes = np.minimum(chunk_len, n - chunks * chunk_len)
    ends = np.cumsum(sizes)
    begins = ends - sizes
    offset = chunks * chunk_len - begins  # sample index minus position in the order, per chunk of the order

    def pieces_at(lo: int, hi: int) -> list[np.ndarray]:
        """The samples at positions ``lo..hi-1`` of the epoch's order, one array per chunk."""
        if lo >= hi:
            return []
        first, last = int(np.searchsorted(ends, lo, "right")), int(np.searchsorted(begins, hi, "left"))
        return [offset[p] + np.arange(max(lo, begins[p]), min(hi, ends[p]), dtype=np.int64)
                for p in range(first, last)]

    size = share_size(n, world_size, drop_last)
    if drop_last:
        lo, hi = rank * size, (rank + 1) * size
    else:
        lo, hi = n * rank // world_size, n * (rank + 1) // world_size
    # this worker's part: positions a..b-1 of the share, whose last one is the repeated sample if any
    a, b = size * worker // num_workers, size * (worker + 1) // num_workers
    pieces = pieces_at(lo + a, min(lo + b, hi))
    if hi - lo < size and b == size:
        if hi == lo:  # fewer samples than ranks: the sample after the share
            at = lo % n
        else:  # a sample of the share's last chunk, which it decodes anyway: the last one, or a random one
            start = max(lo, int(begins[np.searchsorted(ends, hi - 1, "right")]))
            rng = np.random.default_rng([seed, epoch, 2, rank, world_size])
            at = int(rng.integers(start, hi)) if shuffle else hi - 1
        pad = pieces_at(at, at + 1)[0]
        if pieces and pieces[-1][0] // chunk_len == pad[0] // chunk_len:
            pieces[-1] = np.concatenate([pieces[-1], pad])
        else:
            pieces.append(pad)
    if not pieces:
        return np.zeros(0, dtype=np.int64)
    if not shuffle:
        return np.concatenate(pieces)
    part, parts = rank * num_workers + worker, world_size * num_workers
    rng = np.random.default_rng([seed, epoch, 1, part, parts])
    return np.concatenate([rng.permutation(np.concatenate(pieces[w : w + window]))
                           for w in range(0, len(pieces), window)])


# ---------------------------------------------------------------------------------------------- output specs


@dataclass(frozen=True)
class OutputSpec:
    """How one array's decoded samples become batch items: axis order, dtype and normalisation."""

    name: str
    lossy: bool
    perm: tuple[int, ...]  # of (sample, *item axes) as stored -> as yielded
    dtype: str | np.dtype  # output dtype name ("float32", ..., or the stored one); a lossless array's dtype
    item_shape: tuple[int, ...]
    channel_axis: int | None = None  # in the yielded layout (batch axis = 0)
    mean: np.ndarray | None = field(default=None, repr=False)  # (x - mean) * scale, in work, shaped to broadcast
    scale: np.ndarray | None = field(default=None, repr=False)
    work: str = "float32"  # the dtype the normalisation computes in (see _normalisation)

    @property
    def identity(self) -> bool:
        return self.perm == tuple(range(len(self.perm))) and self.scale is None

    @cached_property
    def channel_mean_scale(self) -> tuple[np.ndarray, np.ndarray]:
        """Per channel (one value without a channel axis), contiguous, in the work dtype: what
        :func:`_gather_convert` subtracts and multiplies by; zeros and ones without normalisation. Made once:
        building them was 5 of the 8 us a gather cost over its samples."""
        channels = 1 if self.channel_axis is None else self.item_shape[self.channel_axis - 1]
        mean = np.zeros(channels, self.work) if self.mean is None else np.broadcast_to(self.mean.ravel(), channels)
        scale = np.ones(channels, self.work) if self.scale is None else np.broadcast_to(self.scale.ravel(), channels)
        return np.ascontiguousarray(mean), np.ascontiguousarray(scale)

    @property
    def host_dtype(self) -> np.dtype:
        """What prepared chunks hold on the host: bfloat16 stays float32 until the batch is gathered."""
        return np.dtype("float32" if self.dtype == "bfloat16" else self.dtype)


def _layout_perm(layout: str | None, ndim: int, target: str) -> tuple[tuple[int, ...], int | None]:
    """(axis permutation, channel axis of the output) for a stored layout and the requested one."""
    same = tuple(range(ndim))
    if layout in CHANNELS_LAST:
        if target == "channels_first":
            return (0, ndim - 1, *range(1, ndim - 1)), 1
        return same, ndim - 1
    if layout in CHANNELS_FIRST:
        if target == "channels_last":
            return (0, *range(2, ndim), 1), ndim - 1
        return same, 1
    return same, None


def _data_layout(view) -> str | None:
    """The array's axis layout: as the compressor inferred it, or, for stores made with explicit ``--axes``
    (layout "custom"), inferred from the shape the same way (the axes transformed do not change it)."""
    if view.layout not in (None, "custom"):
        return view.layout
    try:
        return infer_axes(view.shape, view.dtype)[1]
    except DctchopError:
        return None


def _normalisation(mean, std, item_shape: tuple[int, ...], channel_axis: int | None, name: str):
    """(mean, 1 / std) as float64 arrays shaped to broadcast over a batch; None without mean/std.

    Applied as ``(x - mean) * (1 / std)``, subtracting first: float data far from zero (a pressure of 1e5 Pa
    with a std of 1) would otherwise lose its deviations in the rounding of ``x / std - mean / std``. The
    loader computes it in float64 for float32/float64 data, in float32 for integers and float16, whose
    values and differences float32 holds."""
    if mean is None and std is None:
        return None, None
    try:
        m = np.atleast_1d(np.asarray(0.0 if mean is None else mean, dtype=np.float64))
        s = np.atleast_1d(np.asarray(1.0 if std is None else std, dtype=np.float64))
    except (TypeError, ValueError):  # not numbers
        m = s = None
    if m is None or m.ndim != 1 or s.ndim != 1 or not m.size or not s.size:
        raise DctchopError("mean and std must be numbers or non-empty 1-D sequences (one value per channel)")
    count = max(m.size, s.size)
    if count > 1:
        if channel_axis is None:
            raise DctchopError(f"array {name} has no channel axis (layout without C): give a scalar mean/std")
        channels = item_shape[channel_axis - 1]
        if any(v.size not in (1, channels) for v in (m, s)):
            raise DctchopError(f"mean/std need 1 or {channels} values (the channels of {name}), got "
                               f"{m.size} and {s.size}")
    if not np.all(np.isfinite(s) & (s != 0)) or not np.all(np.isfinite(m)):
        raise DctchopError("std must be finite and non-zero, mean finite")
    shape = [1] * (len(item_shape) + 1)
    if count > 1:
        shape[channel_axis] = -1
    return np.broadcast_to(m, (count,)).reshape(shape), np.broadcast_to(1.0 / s, (count,)).reshape(shape)


STREAM_BYTES = 64  # what one streaming store writes: a cache line


@intrinsic
def _stream_line(typingctx, dst, d_at, src, s_at):
    """``dst[d_at : d_at + 64] = src[s_at : ...]`` (uint8 arrays; ``dst + d_at`` aligned to 64 bytes) by a
    non-temporal store: the line goes to memory without being read into the cache first, as an ordinary
    store's would (a batch array is far bigger than the cache: its lines are not there)."""
    def codegen(context, builder, signature, args):
        dst_t, _, src_t, _ = signature.args
        line = ir.VectorType(ir.IntType(8), STREAM_BYTES).as_pointer()
        d = builder.gep(context.make_array(dst_t)(context, builder, args[0]).data, [args[1]])
        s = builder.gep(context.make_array(src_t)(context, builder, args[2]).data, [args[3]])
        store = builder.store(builder.load(builder.bitcast(s, line), align=1), builder.bitcast(d, line),
                              align=STREAM_BYTES)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.IntType(32)(1)]))
        return context.get_dummy_value()

    return types.void(dst, d_at, src, s_at), codegen


@intrinsic
def _store_fence(typingctx):
    """Orders the streaming stores before whatever follows (they are weakly ordered): before a batch is
    handed on."""
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@numba.njit(nogil=True, cache=True)
def _gather_convert(src, rows, out, dest, mean, scale, transpose, channel_in_a):  # pragma: no cover - compiled
    """``out[dest[i]] = (src[rows[i]] - mean[channel]) * scale[channel]`` over ``src`` viewed as (n, a, b),
    written as (n, b, a) when ``transpose``: gather, cast, channel move and normalisation in one pass. The
    arithmetic is in ``mean``'s dtype (numba's promotion: uint8/int16 with float32 stays float32). Plain stores:
    converting each sample in a buffer in cache and streaming it out (as :func:`_copy_rows` does) was slower on
    32x32 images (1.69 against 1.94 GB/s on 2 threads; the same on 1), whose batches of 3 MB stay in the cache."""
    _, a_len, b_len = src.shape
    for i in range(rows.size):
        s, d = rows[i], dest[i]
        if transpose:
            for b in range(b_len):
                for a in range(a_len):
                    c = a if channel_in_a else b
                    out[d, b, a] = (src[s, a, b] - mean[c]) * scale[c]
        else:
            for a in range(a_len):
                for b in range(b_len):
                    c = a if channel_in_a else b
                    out[d, a, b] = (src[s, a, b] - mean[c]) * scale[c]


@intrinsic
def _bytes_at(typingctx, address):
    """The integer ``address`` as a pointer to bytes, for ``numba.carray``."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return types.CPointer(types.uint8)(types.int64), codegen


@numba.njit(nogil=True, cache=True)
def _copy_rows(src, rows, to):  # pragma: no cover - compiled
    """Row ``rows[i]`` of ``src`` (rows of bytes) to the bytes at address ``to[i]`` (:func:`_row_addresses`):
    the gather of samples already as yielded, into one batch or, from a slab, into the several its samples go
    to in one call. In streaming stores (:func:`_stream_line`) between each row's first and last cache-line
    boundary: copying 128 KB rows into a 512 MB array they are 2.6x faster than plain stores (17.6-18.8
    against 6.6-7.1 GB/s); the loader on 32³ fields 1.13x on 1 and on 2 threads with batches of 256 (32 MB),
    1.12x with batches of 32 (4 MB). (The loop over bytes is written out: numba's ``out[d, :] = src[s, :]``
    copied at a quarter of ``np.take``'s speed.)"""
    n = src.shape[1]
    for i in range(rows.size):
        s, d = src[rows[i]], numba.carray(_bytes_at(to[i]), n)
        head = min(n, -to[i] % STREAM_BYTES)
        for k in range(head):
            d[k] = s[k]
        k = head
        while k + STREAM_BYTES <= n:
            _stream_line(d, k, s, k)
            k += STREAM_BYTES
        for j in range(k, n):
            d[j] = s[j]
    _store_fence()


def _byte_rows(x: np.ndarray) -> np.ndarray:
    """``x`` (C-contiguous) as one row of bytes per sample."""
    return x.reshape(x.shape[0], -1).view(np.uint8)


def _row_addresses(out: np.ndarray, dest: np.ndarray) -> np.ndarray:
    """Where samples ``dest`` (indices along axis 0, each within ``out``) of C-contiguous ``out`` begin."""
    return out.ctypes.data + np.asarray(dest, np.int64) * (out.nbytes // max(out.shape[0], 1))


def _fused(spec: OutputSpec, dtype: np.dtype) -> bool:
    """Whether batches are gathered straight from the decoded chunk by :func:`_gather_convert` (float32 out of
    any stored dtype numba reads): a chunk then stays in its stored dtype, and the float32 copy of it that a
    separate conversion would write and the gather read again is never made."""
    return spec.host_dtype == np.float32 and dtype != np.float16 and not (spec.identity and dtype == np.float32)


def _gather_into(x: np.ndarray, rows: np.ndarray, out: np.ndarray, dest: np.ndarray, spec: OutputSpec,
                 fused: bool) -> None:
    """``out[dest[i]] =`` sample ``rows[i]`` of the decoded samples ``x`` in the spec's layout, dtype and
    normalisation: converted on the way when ``fused``, else ``x`` holds them so already (:func:`_prepare_host`)."""
    if not fused:
        if x.dtype.hasobject:
            out[dest] = x[rows]
        else:
            _copy_rows(_byte_rows(np.ascontiguousarray(x)), rows, _row_addresses(out, dest))
        return
    n = x.shape[0]
    transpose = spec.perm != tuple(range(x.ndim))
    channels_first_stored = spec.perm[-1] == 1 if transpose else spec.channel_axis == 1
    if spec.channel_axis is None:
        src = x.reshape(n, -1, 1)
    elif channels_first_stored:
        src = x.reshape(n, x.shape[1], -1)
    else:
        src = x.reshape(n, -1, x.shape[-1])
    m = out.shape[0]
    dst = out.reshape(m, src.shape[2], src.shape[1]) if transpose else out.reshape(m, *src.shape[1:])
    _gather_convert(src, rows, dst, dest, *spec.channel_mean_scale, transpose, channels_first_stored)


def _prepare_host(x: np.ndarray, spec: OutputSpec) -> np.ndarray:
    """Decoded samples (stored layout and dtype) -> the spec's layout, dtype and normalisation, when
    :func:`_fused` does not convert them while gathering."""
    if spec.identity and x.dtype == spec.host_dtype:
        return x
    out = np.empty((x.shape[0], *spec.item_shape), dtype=spec.host_dtype)
    work = np.dtype(spec.work) if spec.scale is not None else out.dtype
    tmp = out if work == out.dtype else np.empty(out.shape, dtype=work)
    np.copyto(tmp, x.transpose(spec.perm), casting="unsafe")
    if spec.scale is not None:
        tmp -= spec.mean
        tmp *= spec.scale
    if tmp is not out:
        out[...] = tmp
    return out


# ---------------------------------------------------------------------------------------------- loader


class _RecycledArrays:
    """Arrays handed out earlier (batches; decoded chunks), given out again once nothing but this pool
    refers to them.

    A fresh array of a batch's or a chunk's size comes from the kernel as untouched pages, and faulting them
    in costs about a quarter of decoding them (measured: 0.8 ms per 4 MB of float32 fields). A view, a torch
    tensor made with ``torch.from_numpy``, or any other reference to an array keeps it out of the pool.
    """

    def __init__(self, size: int) -> None:
        self.size = size  # arrays of one shape and dtype kept; each kind has its own (batches of labels
        self._arrays: dict[tuple, deque[np.ndarray]] = {}  # and images must not push each other out)
        self._lock = threading.Lock()  # iterations running at once share the pool
        self._probe = [np.empty(0)]  # referred to like a free pooled array: by a container and one local

    def get(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        with self._lock:
            arrays = self._arrays.setdefault((shape, dtype), deque(maxlen=self.size))
            probe = self._probe[0]
            free = sys.getrefcount(probe)  # what the interpreter counts for an array nobody else holds
            for k in range(len(arrays)):
                array = arrays[k]
                if sys.getrefcount(array) == free:
                    del arrays[k]
                    arrays.append(array)
                    return array
            array = np.empty(shape, dtype=dtype)
            arrays.append(array)
            return array


@dataclass
class _Batch:
    samples: np.ndarray  # sample indices, grouped by chunk
    groups: list[tuple[int, int, int]]  # (chunk, lo, hi): samples[lo:hi] come from chunk


class _Filling:
    """An epoch's batches being filled slab by slab as chunks decode (the arrays :data:`SCATTER_SAMPLE_BYTES`
    picks): where each chunk's samples go, and the batch arrays that have some of them. A decoded slab is
    copied into its batches while in cache, where decoding the whole chunk first writes it to memory and
    the gather reads it back (the loader on 32³ float32 fields: 1.16x on 1 thread, 1.11x on 2)."""

    def __init__(self, batches: list[_Batch], batch_size: int, chunk_len: int, new_array) -> None:
        samples = np.concatenate([b.samples for b in batches])
        chunk, row = np.divmod(samples, chunk_len)
        order = np.lexsort((row, chunk))
        starts = np.flatnonzero(np.diff(chunk[order], prepend=-1))
        where = zip(chunk[order][starts].tolist(), np.split(order, starts[1:]))
        # chunk -> its rows in the epoch (sorted), the batch of each and the place in that batch
        self._places = {c: (row[o], o // batch_size, o % batch_size) for c, o in where}
        self._sizes = [b.samples.size for b in batches]
        self._new_array = new_array  # (shape, dtype) -> (array, tensor or None)
        self._arrays: dict[tuple[int, str], tuple] = {}
        self._starts: dict[str, np.ndarray] = {}  # per array, where each batch's begins (0: none made yet)
        self._lock = threading.Lock()  # chunks of one batch fill it from several threads

    def rows(self, c: int) -> np.ndarray:
        return self._places[c][0]

    def emit(self, c: int, spec: OutputSpec, fused: bool):
        """What :meth:`dctchop.codec.ChunkDecoder.emit_samples` calls with chunk ``c``'s slabs of ``spec``'s array."""
        rows, batch, place = self._places[c]
        # Samples copied as they are go in one call per slab, each to its address in its batch: a call per batch
        # (a slab's samples go to several) took 0.77 ms of each 32³ field chunk's ~4.3 on 1 thread, now 0.56.
        starts = self._starts.setdefault(spec.name, np.zeros(len(self._sizes), np.int64))  # where batches begin
        sample_bytes = math.prod(spec.item_shape) * np.dtype(spec.host_dtype).itemsize

        def into_batches(start: int, samples: np.ndarray) -> None:
            lo, hi = np.searchsorted(rows, (start, start + samples.shape[0]))
            if not fused:
                batches = batch[lo:hi]
                new = batches[starts[batches] == 0]  # batches that have no array yet
                for b in np.unique(new).tolist() if new.size else ():
                    starts[b] = self._array(b, spec)[0].ctypes.data
                x = _byte_rows(np.ascontiguousarray(_prepare_host(samples, spec)))
                _copy_rows(x, rows[lo:hi] - start, starts[batches] + place[lo:hi] * sample_bytes)
                return
            for b in np.unique(batch[lo:hi]).tolist():
                take = lo + np.flatnonzero(batch[lo:hi] == b)
                _gather_into(samples, rows[take] - start, self._array(b, spec)[0], place[take], spec, fused)
        return into_batches

    def take(self, b: int, spec: OutputSpec) -> tuple:
        """Batch ``b``'s array of ``spec`` (new when no slab went into it), no longer held here."""
        pair = self._array(b, spec)
        with self._lock:
            del self._arrays[b, spec.name]
        return pair

    def _array(self, b: int, spec: OutputSpec) -> tuple:
        with self._lock:
            if (b, spec.name) not in self._arrays:
                shape = (self._sizes[b], *spec.item_shape)
                self._arrays[b, spec.name] = self._new_array(shape, spec.host_dtype)
            return self._arrays[b, spec.name]


class Loader:
    """Shuffled, decoded batches from a dctchop store, built in background threads.

    Iterating yields ``(x, y)`` (the store's main array and ``labels``), just ``x`` when the store has no
    labels, or one item per name in ``arrays``. Each batch is a fresh contiguous array (numpy by default,
    torch tensors with ``output="torch"`` or a ``device``). Call :meth:`set_epoch` before each epoch.

    Parameters
    ----------
    path : str, path-like or Dataset
        The store.
    batch_size : int
        Samples per batch (the last one may be short unless ``drop_last``).
    shuffle : bool
        Shuffle the chunk order and the samples within windows of chunks; False reads in storage order.
    seed : int
        With the epoch, fixes the order: the same on every run and every rank.
    drop_last : bool
        Drop this share's last, short batch; with ``world_size`` that does not divide the samples, first
        leave out the last ``n % world_size`` samples of the epoch's order so that the shares are equal.
        Without it such shares are made equal by repeating a sample in each short one (see the module
        docstring). Either way every rank yields ``len(loader)`` batches, the same on every rank.
    arrays : sequence of str, optional
        Arrays to yield, in order; default the store's main array (the compressed one with the most values
        per sample, see :func:`dctchop.open`) plus ``labels`` when the store has it. A leading ``/`` is
        ignored.
    dtype : {"float32", "float16", "bfloat16", "uint8"} or None
        Dtype of lossy arrays in the batches (None: as stored). ``bfloat16`` needs torch output; ``uint8``
        needs uint8 data and no normalisation. ``float16`` holds magnitudes up to 65504: values beyond it
        (after normalising) become inf, as in any cast; normalise fields with large values first. Lossless
        arrays (labels) keep their dtype.
    layout : {"channels_first", "channels_last", "stored"}
        Axis order of image/volume arrays with channels (stored as NHWC, NCHW, NZYXC or NCZYX); arrays
        without a channel axis are yielded as stored.
    mean, std : float or sequence of float, optional
        Normalise the first lossy array: ``(x - mean) / std`` per channel (or one value for all), in the
        data's units (0..255 for uint8 images).
    window : int
        Chunks shuffled together. More mixes better and holds more decoded chunks in memory.
    prefetch : int
        Batches built ahead of the one being consumed.
    threads : int, optional
        Threads that decode chunks and gather batches; default (None or 0) one per core, at most 4.
    rank, world_size : int
        This process's share in distributed training: shares of all ranks have the same size; they are
        disjoint and cover the data when ``world_size`` divides it, else padded or trimmed (``drop_last``).
    output : {"numpy", "torch"}
        Array type of the batches. A ``device`` implies torch.
    device : str or torch.device, optional
        Where batches go. With ``device_decode`` (default) only the stored coefficients are copied there
        and decoded on the device (fused Triton kernels, one launch per block group, where Triton is
        installed, else batched matmuls); otherwise batches are decoded on the host into pinned memory (for
        CUDA) and copied.
    worker, num_workers : int
        Sub-shares of this rank's share, each of its samples in one (:class:`dctchop.TorchDataset` sets
        these in DataLoader workers; their batch counts may differ, the DataLoader merges them).

    Raises
    ------
    DctchopError
        For a path that is not a dctchop store, unknown arrays, bad sizes or options, a device that does not
        exist, or torch output without torch installed.
    """

    def __init__(self, path, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False, *,
                 arrays: Sequence[str] | None = None, dtype: str | None = "float32", layout: str = "channels_first",
                 mean=None, std=None, window: int = 4, prefetch: int = 2, threads: int | None = None,
                 rank: int = 0, world_size: int = 1, output: str = "numpy", device=None,
                 device_decode: bool = True, worker: int = 0, num_workers: int = 1) -> None:
        self.batch_size = _integer(batch_size, "batch_size", least=1)
        self.window = _integer(window, "window", least=1)
        self.prefetch = _integer(prefetch, "prefetch", least=1)
        self.threads = (min(resolve_threads(None), DEFAULT_MAX_THREADS) if threads is None or threads == 0
                        else _integer(threads, "threads", least=1))
        self.world_size = _integer(world_size, "world_size", least=1)
        self.num_workers = _integer(num_workers, "num_workers", least=1)
        for value, limit, what, total in ((rank, world_size, "rank", "world_size"),
                                          (worker, num_workers, "worker", "num_workers")):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < limit:
                raise DctchopError(f"{what} must be in 0..{limit - 1} for {total}={limit}, got {value!r}")
        self.rank, self.worker = int(rank), int(worker)
        self.seed = _integer(seed, "seed", least=0)
        self.shuffle, self.drop_last = _boolean(shuffle, "shuffle"), _boolean(drop_last, "drop_last")
        if output not in ("numpy", "torch"):
            raise DctchopError(f"output must be 'numpy' or 'torch', got {output!r}")
        self.torch = output == "torch" or device is not None
        self.device = None
        if self.torch:
            require_torch()
            if device is not None:
                from dctchop.torch_decode import resolve_device

                self.device = resolve_device(device)
        self.device_decode = _boolean(device_decode, "device_decode") and self.device is not None
        if layout not in LAYOUTS:
            raise DctchopError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if dtype is not None:
            if isinstance(dtype, type) and issubclass(dtype, np.generic):  # np.float32, as numpy takes it
                dtype = np.dtype(dtype)
            dtype = str(dtype).removeprefix("torch.")
            if dtype not in OUTPUT_DTYPES:
                raise DctchopError(f"dtype must be one of {', '.join(OUTPUT_DTYPES)} or None, got {dtype!r}")
            if dtype == "bfloat16" and not self.torch:
                raise DctchopError("dtype bfloat16 needs output='torch' (numpy has no bfloat16)")
        self.dataset = path if isinstance(path, Dataset) else Dataset(path, threads=1)
        self.names = self._choose_arrays(arrays)
        first = next((n for n in self.names if self.dataset.array(n).lossy), None)
        if first is None and (mean is not None or std is not None):
            raise DctchopError(f"mean/std normalise a compressed array, and arrays={self.names!r} names only "
                               "lossless copies, which the loader yields as stored")
        if first is not None and first != self.dataset.main.name:  # samples and chunks are counted on it
            self.dataset = Dataset(self.dataset.path, threads=1, main=first)
        self.specs = [self._spec(name, name == first, dtype, layout, mean, std) for name in self.names]
        if self.torch:
            self._check_torch_dtypes()
        self._views = [self.dataset.array(name) for name in self.names]
        # channels-last arrays yielded channels-first are decoded that way (planar kernels; a cheap gather)
        self._decode_channels_first = [s.lossy and not self.device_decode and len(s.perm) > 2
                                       and s.perm == channels_first_axes(len(s.perm)) for s in self.specs]
        self._chunk_specs = [replace(s, perm=tuple(range(len(s.perm)))) if cf else s
                             for s, cf in zip(self.specs, self._decode_channels_first)]
        self._fused = [s.lossy and _fused(s, v.dtype) for s, v in zip(self._chunk_specs, self._views)]
        self._scatter = [s.lossy and not self.device_decode and v._reader.direct
                         and math.prod(v.shape[1:]) * v.dtype.itemsize >= SCATTER_SAMPLE_BYTES
                         for s, v in zip(self.specs, self._views)]
        if self.device_decode and not all(v._reader.direct for v, s in zip(self._views, self.specs) if s.lossy):
            raise DctchopError("device decode needs arrays stored as dctchop chunk files; pass device_decode=False")
        self.epoch = 0
        # batches alive at once: those queued and being consumed, and, where slabs go straight into batches,
        # those that the slabs of chunks decoded ahead went into
        ahead = max(self.window, self.threads) + self.window
        filled_ahead = -(-ahead * self.dataset.chunk_len // self.batch_size) if any(self._scatter) else 0
        self._recycled = _RecycledArrays(self.prefetch + 4 + filled_ahead)
        # decoded chunks alive at once: the window ahead, those being decoded, those the queued batches need
        self._chunk_buffers = _RecycledArrays(max(self.window, self.threads) + self.threads + self.prefetch + 2)

    # setup ---------------------------------------------------------------------------------------------
    def _choose_arrays(self, arrays) -> list[str]:
        """The arrays to yield, checked: as many samples as the first compressed one among them (the
        dataset's main array when there is none), and compressed ones in chunks of the same length."""
        ds = self.dataset
        if arrays is None:
            names = [ds.main.name, *self._labels()[:1]]
        else:
            names = [arrays] if isinstance(arrays, str) else _names(arrays)
            if not names or not all(isinstance(name, str) for name in names):
                raise DctchopError(f"arrays must be a name or a sequence of names of the store's arrays, got "
                                   f"{arrays!r}")
            names = [ds.array(name).name for name in names]  # raises naming the store's arrays; "/x" is "x"
        first = next((ds.array(n) for n in names if ds.array(n).lossy), ds.main)
        n = first.shape[0]
        for name in names:
            view = ds.array(name)
            if not view.shape or view.shape[0] != n:
                raise DctchopError(f"array {name} has shape {list(view.shape)}; the loader needs {n} samples along "
                                   f"axis 0 like {first.name}")
            if view.lossy and view.chunk_len != first.chunk_len:
                raise DctchopError(f"array {name} is chunked by {view.chunk_len} samples, {first.name} by "
                                   f"{first.chunk_len}; the loader needs them aligned: compress them with "
                                   f"--chunk-samples {_common_chunk_len(first, view)}")
        return names

    def _labels(self) -> list[str]:
        """The labels yielded by default: a lossless ``labels`` beside the main array (``train/labels`` for
        ``train/images``), else at the root, with as many entries as the main array has samples."""
        ds = self.dataset
        candidates = dict.fromkeys([posixpath.join(posixpath.dirname(ds.main.name), "labels"), "labels"])
        found = [ds.array(n) for n in candidates if n in ds]  # through links the source file had
        return list(dict.fromkeys(v.name for v in found if not v.lossy and v.shape[:1] == ds.shape[:1]))

    def _spec(self, name: str, first: bool, dtype, layout: str, mean, std) -> OutputSpec:
        view = self.dataset.array(name)
        ndim = len(view.shape)
        if not view.lossy:
            # the dtype itself: the name of a compound one ("[('a', '<i4'), ...]") does not parse back
            return OutputSpec(name, False, tuple(range(ndim)), view.dtype, view.shape[1:])
        perm, channel_axis = _layout_perm(_data_layout(view), ndim, layout)
        item_shape = tuple(view.shape[p] for p in perm[1:])
        mean, scale = _normalisation(mean, std, item_shape, channel_axis, name) if first else (None, None)
        out = str(view.dtype) if dtype is None else dtype
        if scale is not None and np.dtype(out if out != "bfloat16" else "float32").kind != "f":
            hint = ""
            if dtype is None:
                hint = f" ({name} is stored as {out}, which dtype=None keeps; pass dtype='float32')"
            raise DctchopError(f"mean/std need a floating-point output dtype, got {out}{hint}")
        if out == "uint8" and view.dtype != np.uint8:
            raise DctchopError(f"dtype uint8 needs uint8 data ({name} is {view.dtype})")
        work = "float64" if view.dtype.kind == "f" and view.dtype.itemsize >= 4 else "float32"
        if scale is not None:
            mean, scale = mean.astype(work), scale.astype(work)
        return OutputSpec(name, True, perm, out, item_shape, channel_axis, mean, scale, work)

    def _check_torch_dtypes(self) -> None:
        """Refuse arrays torch has no tensor dtype for (bytes, strings, objects, compound records, extended
        precision: float128, complex256) here, not with torch's TypeError in the middle of an epoch
        (compressed arrays are always numbers); the hint leaves out every such array at once."""
        dtypes = {name: self.dataset.array(name).dtype for name in self.names}
        refused = [name for name, d in dtypes.items() if d.kind not in "biufc" or stored_as_bytes(d)]
        if refused:
            others = [n for n in self.names if n not in refused]
            hint = f"arrays={others!r} to leave them out" if others else "arrays= to yield others"
            held = "; ".join(f"array {name} holds {dtypes[name]} values" for name in refused)
            raise DctchopError(f"{held}, which torch tensors cannot hold; pass {hint}, or output='numpy'")

    # order ---------------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from now on (call it before each epoch, like ``DistributedSampler``)."""
        self.epoch = epoch_number(epoch)

    def indices(self, epoch: int | None = None) -> np.ndarray:
        """Sample indices of this loader's share of ``epoch`` (default: the current one), in order (within a
        batch the loader then groups them by chunk); with ``drop_last`` it yields all but the last
        ``len(indices) % batch_size`` of them, a partial batch."""
        return epoch_order(len(self.dataset), self.dataset.chunk_len, shuffle=self.shuffle, seed=self.seed,
                           epoch=self.epoch if epoch is None else epoch_number(epoch), window=self.window,
                           rank=self.rank, world_size=self.world_size, drop_last=self.drop_last, worker=self.worker,
                           num_workers=self.num_workers)

    @property
    def n_samples(self) -> int:
        """Samples in this loader's share of an epoch (this worker's part of it): the same on every rank."""
        size = share_size(len(self.dataset), self.world_size, self.drop_last)
        return size * (self.worker + 1) // self.num_workers - size * self.worker // self.num_workers

    def __len__(self) -> int:
        m = self.n_samples
        return m // self.batch_size if self.drop_last else -(-m // self.batch_size)

    # iteration -----------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator:
        return self._run(self.epoch)

    def _batches(self, order: np.ndarray) -> list[_Batch]:
        """The epoch's batches, each with its samples grouped by chunk (in their order within a chunk); one
        stable sort over the epoch by batch, then chunk."""
        order = order[: len(self) * self.batch_size]
        batch = np.arange(order.size) // self.batch_size
        by_chunk = np.lexsort((order // self.dataset.chunk_len, batch))
        samples = order[by_chunk]
        chunks = samples // self.dataset.chunk_len
        starts = np.flatnonzero(np.diff(chunks, prepend=-1) | np.diff(batch, prepend=-1))
        ends = [*starts[1:].tolist(), order.size]
        groups = zip(batch[starts].tolist(), chunks[starts].tolist(), starts.tolist(), ends)
        out = [_Batch(samples[b * self.batch_size : (b + 1) * self.batch_size], []) for b in range(len(self))]
        for b, c, lo, hi in groups:
            out[b].groups.append((c, lo - b * self.batch_size, hi - b * self.batch_size))
        return out

    def _run(self, epoch: int) -> Iterator:
        batches = self._batches(self.indices(epoch))
        if not batches:
            return
        schedule = list(dict.fromkeys(c for b in batches for c, _, _ in b.groups))
        position = {c: i for i, c in enumerate(schedule)}
        last_use = {c: i for i, b in enumerate(batches) for c, _, _ in b.groups}
        release: list[list[int]] = [[] for _ in batches]
        for c, i in last_use.items():
            release[i].append(c)
        ahead = max(self.window, self.threads)
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="dctchop-loader")
        batch_pool = (ThreadPoolExecutor(1, thread_name_prefix="dctchop-batch") if self.device_decode
                      else pool)
        device_stage = self._device_stage() if self.device_decode else None
        filling = (_Filling(batches, self.batch_size, self.dataset.chunk_len, self._host_buffer)
                   if any(self._scatter) else None)
        chunk_futures: dict[int, Future] = {}
        pending: deque[Future] = deque()
        next_chunk = submitted = 0
        try:
            for k in range(len(batches)):
                while submitted < len(batches) and submitted <= k + self.prefetch:
                    batch = batches[submitted]
                    until = min(len(schedule), max(position[c] for c, _, _ in batch.groups) + 1 + ahead)
                    while next_chunk < until:
                        c = schedule[next_chunk]
                        chunk_futures[c] = pool.submit(self._load_chunk, c, filling)
                        next_chunk += 1
                    needed = {c: chunk_futures[c] for c, _, _ in batch.groups}
                    pending.append(batch_pool.submit(self._assemble, submitted, batch, needed, release[submitted],
                                                     device_stage, filling))
                    submitted += 1
                result = pending.popleft().result()
                for c in release[k]:
                    chunk_futures.pop(c, None)
                yield result
        finally:
            for f in (*pending, *chunk_futures.values()):
                f.cancel()
            pool.shutdown(wait=False, cancel_futures=True)
            batch_pool.shutdown(wait=False, cancel_futures=True)

    def _load_chunk(self, c: int, filling: _Filling | None) -> dict:
        """Runs in a worker thread: chunk ``c`` of every array, prepared for gathering (or staged for
        device decode); None for an array whose slabs went into their batches as they decoded."""
        loaded = {}
        for spec, view, fused, cf, scatter in zip(self._chunk_specs, self._views, self._fused,
                                                  self._decode_channels_first, self._scatter):
            if spec.lossy and self.device_decode:
                from dctchop.torch_decode import stage

                loaded[spec.name] = stage(view._reader.coded(c), self.device)
            elif spec.lossy:
                reader = view._reader
                shape = channels_first_shape(reader.chunk_shape) if cf else reader.chunk_shape
                buffer = self._chunk_buffers.get(shape, reader.dtype) if reader.direct else None
                if scatter:
                    x = reader.emit_or_decode(c, filling.emit(c, spec, fused), filling.rows(c), buffer, cf)
                else:
                    x = reader.decode(c, out=buffer, channels_first=cf)
                loaded[spec.name] = x if fused or x is None else _prepare_host(x, spec)
            else:
                loaded[spec.name] = view._reader.decode(c)
        return loaded

    def _assemble(self, b: int, batch: _Batch, futures: dict[int, Future], release: list[int], device_stage,
                  filling: _Filling | None):
        """Runs in a worker thread: gather batch ``b`` from its (prepared) chunks into arrays nobody else holds,
        or take the one its chunks' slabs went into."""
        chunks = {c: f.result() for c, f in futures.items()}
        chunk_len = self.dataset.chunk_len
        if device_stage is not None:
            device_stage.prepare(chunks)
        out = []
        for spec, fused, scatter in zip(self._chunk_specs, self._fused, self._scatter):
            if device_stage is not None and spec.lossy:
                out.append(device_stage.gather(spec, batch, chunk_len))
                continue
            shape = (batch.samples.size, *spec.item_shape)
            buffer, tensor = filling.take(b, spec) if scatter else self._host_buffer(shape, spec.host_dtype)
            for c, lo, hi in batch.groups:
                if (x := chunks[c][spec.name]) is not None:
                    _gather_into(x, batch.samples[lo:hi] - c * chunk_len, buffer, np.arange(lo, hi), spec, fused)
            out.append(self._to_output(buffer, tensor, spec))
        if device_stage is not None:
            device_stage.release(release)
        return tuple(out) if len(out) > 1 else out[0]

    # torch ---------------------------------------------------------------------------------------------
    def _host_buffer(self, shape, dtype: np.dtype):
        """A numpy array to gather into; backed by pinned torch memory when batches go to a CUDA device."""
        if self.device is not None and self.device.type == "cuda":
            torch = require_torch()
            from dctchop.torch_decode import torch_dtype

            tensor = torch.empty(shape, dtype=torch_dtype(np.dtype(dtype).name), pin_memory=True)
            return tensor.numpy(), tensor
        return self._recycled.get(tuple(shape), np.dtype(dtype)), None

    def _to_output(self, buffer: np.ndarray, tensor, spec: OutputSpec):
        if not self.torch:
            return buffer
        torch = require_torch()
        tensor = torch.from_numpy(buffer) if tensor is None else tensor
        if spec.dtype == "bfloat16":
            tensor = tensor.to(torch.bfloat16)
        if self.device is not None and tensor.device != self.device:
            tensor = tensor.to(self.device, non_blocking=True)
        return tensor

    def _device_stage(self):
        from dctchop.torch_decode import DeviceStage

        return DeviceStage(self.device, [s for s in self.specs if s.lossy], len(self.dataset), self.dataset.chunk_len)

    # misc ----------------------------------------------------------------------------------------------
    def __repr__(self) -> str:
        part, parts = self.rank * self.num_workers + self.worker, self.world_size * self.num_workers
        return (f"<dctchop.Loader {str(self.dataset.path)!r} arrays={self.names} batch_size={self.batch_size} "
                f"epoch={self.epoch} share {part + 1}/{parts}: {self.n_samples} samples, {len(self)} batches>")


def epoch_number(epoch) -> int:
    """``epoch`` as an int; a :class:`DctchopError` unless it is a non-negative integer."""
    return _integer(epoch, "epoch", least=0)


def _names(arrays) -> list | None:
    """The items of ``arrays`` (a list, tuple, numpy array or dict keys of names); None for bytes, which
    iterate as ints, and for what does not iterate."""
    if isinstance(arrays, (bytes, bytearray)):
        return None
    try:
        return list(arrays)
    except TypeError:
        return None


def _common_chunk_len(*views) -> int:
    """A chunk length that ``--chunk-samples`` takes for every one of the arrays ``views``: the first one's,
    rounded up to a whole number of blocks of each array transformed along axis 0 (compress aligns only
    arrays not transformed along it; a field in blocks of 8 refused the 34 of an image stack)."""
    codecs = [v.info["codec"] for v in views]
    unit = math.lcm(1, *(c["block"][c["axes"].index(0)] for c in codecs if 0 in c["axes"]))
    return -(-views[0].chunk_len // unit) * unit


def _integer(value, name: str, least: int) -> int:
    """``value`` as an int; a :class:`DctchopError` unless it is an integer (a bool is not one) of at least
    ``least``, 0 or 1, and below 2**63 (the loader counts in int64)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise DctchopError(f"{name} must be a {'positive' if least else 'non-negative'} integer, got {value!r}")
    if value >= 2**63:
        raise DctchopError(f"{name} must be below 2**63, got {value!r}")
    return int(value)


def _boolean(value, name: str) -> bool:
    """``value`` as a bool; a :class:`DctchopError` unless it is one (numpy's too): ``shuffle="False"`` from a
    config file or command line is true, and would be taken as such."""
    if not isinstance(value, (bool, np.bool_)):
        raise DctchopError(f"{name} must be True or False, got {value!r}")
    return bool(value)
