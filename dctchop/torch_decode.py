"""The torch side of the loader: decoding on a device, and the ``torch.utils.data`` adapter.

Imported only when torch output or a device is asked for (``import dctchop`` never imports torch).

Device decode. Only the stored values of a chunk (int8/int16/float16/bfloat16/float32, band-major, as they
come out of zstd) and its per-band steps cross to the device. The inverse transform then runs there as one
batched matmul per *block group*: the chunk's blocks that share a shape (all full blocks; the edge blocks of
each axis; ...). The storage order makes each group's values a contiguous ``(bands, blocks)`` matrix, so the
group decodes as ``basisᵀ @ (steps * values)``, where row ``u`` of ``basis`` is the outer product of the
per-axis DCT rows of band ``u`` (the edge blocks' own shorter DCTs included); the triangle mask simply has
fewer rows. The result is scattered into the chunk with one strided copy per group, then rounded and
clipped for integer dtypes exactly like :func:`dctchop.transform.inverse` (floor(v + 0.5), clip to range).
Steps below float32's normal range (float data of magnitude below about 1e-29) travel multiplied by a power of
two that the output is divided by again (:func:`stage`), as far as the chunk's largest values leave room: on a
device that flushes subnormals to zero (CUDA code built with fast math does; so does the CPU after
``torch.set_flush_denormal(True)``) such data would otherwise decode to noise. A chunk's offset
(:func:`dctchop.codec.chunk_offset`) is added last, as on the host.
It equals the numba path up to float32 summation order (tests check this on CPU torch). Matmuls follow
torch's float32 matmul precision: with TF32 enabled (``torch.set_float32_matmul_precision("high")``) decoded
values carry TF32 rounding (about 1e-3 relative).

On a CUDA device with Triton (CUDA builds of torch on Linux ship it), float32 work runs instead in fused
kernels, one launch per group (:mod:`dctchop.cuda_decode`): the same result, 3.5-3.7x faster on an H100,
since the dense matmul and the four passes over the output go. float64 data and other devices use the
matmul path.
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.context
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch
import torch.utils.data

from dctchop import quantize as qz
from dctchop.codec import StoredChunk
from dctchop.dataset import Dataset
from dctchop.errors import DctchopError, first_line
from dctchop.loader import Loader, epoch_number
from dctchop.location import Location
from dctchop.transform import TransformPlan, dct_matrix, in_triangle, make_plan, work_dtype

__all__ = ["BlockGroup", "DeviceDecoder", "DeviceStage", "StagedChunk", "TorchDataset", "block_groups",
           "decode_on_device", "resolve_device", "stage"]

_STORAGE_TORCH = {"int8": torch.int8, "int16": torch.int16, "float16": torch.float16, "float32": torch.float32,
                  "bfloat16": torch.int16}  # bfloat16 bits travel as int16 and are reinterpreted on the device


def resolve_device(device) -> torch.device:
    """A torch device that exists here; :class:`DctchopError` naming the problem otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        if isinstance(device, int) and not isinstance(device, bool) and isinstance(e, RuntimeError):
            raise DctchopError(f"device {device!r} does not exist: an integer names an accelerator (as cuda:N), "
                               f"and this torch sees none (torch {torch.__version__})") from None
        raise DctchopError(f"device {device!r} is not a torch device ({first_line(e)})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise DctchopError(f"device {device!r} does not exist: {why} (torch {torch.__version__})")
        count = torch.cuda.device_count()
        if (dev.index or 0) >= count:
            raise DctchopError(f"device {device!r} does not exist: {count} CUDA device(s) visible")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise DctchopError(f"device {device!r} does not exist: MPS is not available")
    elif dev.type == "meta":
        raise DctchopError(f"device {device!r} holds no data: name the device that decodes the batches")
    elif dev.type != "cpu":
        try:
            torch.empty(1, device=dev)
        except Exception as e:  # noqa: BLE001 - each backend raises its own type
            why = first_line(e).split(". ")[0]  # torch's dispatcher goes on to list every backend it has
            raise DctchopError(f"device {device!r} is not usable ({type(e).__name__}: {why})") from None
    return dev


# ---------------------------------------------------------------------------------------------- block groups


@dataclass(frozen=True)
class BlockGroup:
    """The blocks of a chunk that share one shape, and where their values and samples are.

    Stored values ``[start, start + n_bands * n_blocks)`` form a ``(n_bands, n_blocks)`` matrix (band-major;
    blocks in C order over ``grid``, which is the chunk shape with each transformed axis replaced by its
    number of blocks in this group). ``region`` selects the samples the group covers.
    """

    start: int
    n_blocks: int
    band_index: np.ndarray = field(repr=False)  # (n_bands,) index into plan.bands, i.e. into the steps
    basis: np.ndarray = field(repr=False)  # (n_bands, prod(widths)) float64
    grid: tuple[int, ...]
    widths: tuple[int, ...]
    region: tuple[slice, ...]

    @property
    def n_bands(self) -> int:
        return int(self.band_index.size)


def basis_row(matrices, band) -> np.ndarray:
    """Where band ``band`` of a block puts its coefficient: the outer product of row ``band[d]`` of each
    axis' DCT matrix ``matrices[d]``, flattened in C order over the block."""
    outer = np.ones(())
    for matrix, b in zip(matrices, band, strict=True):
        outer = np.multiply.outer(outer, matrix[b])
    return outer.ravel()


@lru_cache(maxsize=32)
def _block_groups(shape, axes, block, keep, mask) -> tuple[BlockGroup, ...]:
    plan = make_plan(shape, axes, block, keep, mask)
    groups, pos = [], 0
    for g in range(1 << len(axes)):  # the same group order as the storage order (bit d: edge block on axis d)
        widths, keeps, counts, offsets = [], [], [], []
        for d, p in enumerate(plan.axis_plans):
            full = p.length // p.block
            if (g >> d) & 1:  # the edge block, as the plan cut it: (first row, kept rows, first sample, width)
                _, kept, start, width = p.edge or (0,) * 4
                widths.append(width), keeps.append(kept), counts.append(1 if width else 0), offsets.append(start)
            else:
                widths.append(p.block), keeps.append(p.keep), counts.append(full), offsets.append(0)
        if not all(counts):
            continue
        bands = [u for u, b in enumerate(plan.bands)
                 if all(b[d] < keeps[d] for d in range(len(axes))) and (mask != "triangle" or in_triangle(b, keeps))]
        rows = [dct_matrix(w) for w in widths]
        basis = np.array([basis_row(rows, plan.bands[u]) for u in bands]).reshape(len(bands), math.prod(widths))
        grid = list(shape)
        region = [slice(None)] * len(shape)
        for d, a in enumerate(axes):
            grid[a] = counts[d]
            region[a] = slice(offsets[d], offsets[d] + counts[d] * widths[d])
        n_blocks = math.prod(grid)
        groups.append(BlockGroup(pos, n_blocks, np.asarray(bands, dtype=np.int64), basis, tuple(grid),
                                 tuple(widths), tuple(region)))
        pos += len(bands) * n_blocks
    # the storage order is defined in dctchop.transform; refuse to decode if this reading of it disagrees
    seg_starts, seg_bands = plan.runs.seg_starts, plan.runs.seg_bands
    bands = np.concatenate([grp.band_index for grp in groups]) if groups else np.zeros(0, np.int64)
    starts = [grp.start + i * grp.n_blocks for grp in groups for i in range(grp.n_bands)] + [pos]
    if pos != plan.n_values or not np.array_equal(bands, seg_bands) or not np.array_equal(starts, seg_starts):
        raise DctchopError(f"internal error: block groups disagree with the storage order for {plan}")
    return tuple(groups)


def block_groups(plan: TransformPlan) -> tuple[BlockGroup, ...]:
    """The block groups of ``plan`` in storage order (cached per setting)."""
    return _block_groups(plan.shape, plan.axes, plan.block, plan.keep, plan.mask)


# ---------------------------------------------------------------------------------------------- decoder


@dataclass(frozen=True)
class StagedChunk:
    """A coded chunk whose stored values and steps sit in host tensors, pinned when bound for a GPU: crossing
    is then one asynchronous copy each. The loader stages chunks in its worker threads, which keeps the
    copy into pinned memory (milliseconds for a chunk of a few MB) off the thread that assembles batches."""

    plan: TransformPlan
    dtype: np.dtype
    precision: str
    stored: torch.Tensor = field(repr=False)  # (n_values,) in the storage dtype (bfloat16 bits as int16)
    steps: torch.Tensor = field(repr=False)  # (n_bands,) in the work dtype, times 2**shift
    shift: int = 0  # the decoded chunk is divided by 2**shift
    offset: float = 0.0  # and added to the chunk's offset
    level_bound: float = math.inf  # bound on the stored values' magnitudes (StoredChunk.level_bound)


# float32 steps are kept at or above this: with basis entries down to about 2**-10 (8x8x8 blocks), every
# product of the decode stays a normal float32
SMALLEST_STEP = 2.0**-96
# ... as far as the largest dequantized value, times 2**shift, stays below this: a sum of up to 2**18 such
# values (64³ blocks) times basis entries of at most 1 stays below float32's largest number, 2**128
LARGEST_SHIFTED = 2.0**100
# bounds on the stored magnitudes (float32 and bfloat16 store with steps of 1: none needed)
LARGEST_LEVEL = {**qz.QMAX, "float16": float(np.finfo(np.float16).max)}


def step_shift(steps: np.ndarray, dtype: np.dtype, largest_level: float) -> int:
    """The power of two that brings the ``steps`` (float64) of float32 data to at least :data:`SMALLEST_STEP`,
    0 where they are (all but bands of data below about 1e-29; other dtypes: float64 works in float64, and
    float16 and integer data never get steps that small); at most what keeps the largest dequantized value
    (its step times ``largest_level``, a bound on the stored magnitudes) below :data:`LARGEST_SHIFTED`. A
    chunk with bands near float32's top and others near its bottom (blocks at 1e36 beside detail at 1e-30)
    overflowed to inf when shifted by the bottom alone; its tiny bands now keep steps below SMALLEST_STEP,
    which a device that flushes subnormals decodes as zeros, 1e-60 or less of the chunk's range."""
    positive = steps[steps > 0]
    if dtype != np.float32 or positive.size == 0 or positive.min() >= SMALLEST_STEP:
        return 0
    wanted = math.ceil(math.log2(SMALLEST_STEP / positive.min()))
    room = math.floor(math.log2(LARGEST_SHIFTED / (positive.max() * largest_level)))
    return max(0, min(wanted, room))


def _work_dtype(dtype) -> torch.dtype:
    """Decoding works in float64 for float64 data, else float32 (like the numba path)."""
    return torch.float64 if work_dtype(np.dtype(dtype)) == np.float64 else torch.float32


def stage(chunk: StoredChunk, device: torch.device) -> StagedChunk:
    """``chunk``'s stored values and steps copied into host tensors for ``device`` (see :class:`StagedChunk`)."""
    pin = torch.device(device).type == "cuda"
    stored = torch.empty(chunk.stored.size, dtype=_STORAGE_TORCH[chunk.precision], pin_memory=pin)
    host = stored.numpy()
    host[:] = chunk.stored.view(host.dtype)
    shift = step_shift(chunk.steps, chunk.dtype, min(chunk.level_bound, LARGEST_LEVEL.get(chunk.precision, 1.0)))
    steps = torch.tensor(np.ldexp(chunk.steps, shift), dtype=_work_dtype(chunk.dtype))
    return StagedChunk(chunk.plan, chunk.dtype, chunk.precision, stored, steps.pin_memory() if pin else steps, shift,
                       chunk.offset, chunk.level_bound)


class DeviceDecoder:
    """Inverse transform of stacked chunks of one plan on a torch device (see module docs).

    Parameters
    ----------
    plan : TransformPlan
        The chunks' plan (every chunk of an array has the same one).
    dtype : numpy dtype
        The array's dtype; decoding works in float64 for float64 data, else float32 (like the numba path),
        and returns that work dtype with integer dtypes already rounded and clipped.
    device : torch.device
    """

    def __init__(self, plan: TransformPlan, dtype, device: torch.device) -> None:
        self.plan, self.dtype, self.device = plan, np.dtype(dtype), torch.device(device)
        self.work = _work_dtype(self.dtype)
        self.groups = block_groups(plan)
        self._basis = [torch.as_tensor(g.basis, dtype=self.work, device=self.device) for g in self.groups]
        self._bands = [torch.as_tensor(g.band_index, device=self.device) for g in self.groups]
        self._perms, self._unflatten = [], []
        ndim, n_axes = len(plan.shape), len(plan.axes)
        for g in self.groups:
            # Y: (chunks, *widths, *grid) -> region view: (chunks, per axis: grid_i [, width_d])
            perm = [0]
            for i in range(ndim):
                perm.append(1 + n_axes + i)
                if i in plan.axes:
                    perm.append(1 + plan.axes.index(i))
            self._perms.append(perm)
            self._unflatten.append([(1 + a, (g.grid[a], g.widths[d])) for d, a in reversed(list(enumerate(plan.axes)))])
        if self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            self._clip = (float(info.min), float(info.max))
        else:
            self._clip = None
        self._fused = _fused_groups(plan, self.groups, self.device) if self.work == torch.float32 else None

    def upload(self, chunks: list[StagedChunk]) -> tuple[torch.Tensor, torch.Tensor, tuple | None, float]:
        """Stored values ``(n, n_values)``, steps ``(n, n_bands)``, what is done to each decoded chunk last
        (``(offsets, scales)``: the offset times ``2**shift``, and ``2**-shift``, per chunk, see
        :class:`StagedChunk`; None when there is nothing to do) and the largest level bound of ``chunks`` on the
        device: only the tensors cross, one asynchronous copy each from pinned memory when the device is a GPU."""
        precision = chunks[0].precision
        if any(c.precision != precision or plan_key(c.plan) != plan_key(self.plan) for c in chunks):
            raise DctchopError("chunks decoded together must share one plan and precision")
        stored = torch.empty((len(chunks), self.plan.n_values), dtype=_STORAGE_TORCH[precision], device=self.device)
        steps = torch.empty((len(chunks), len(self.plan.bands)), dtype=self.work, device=self.device)
        for i, c in enumerate(chunks):
            stored[i].copy_(c.stored, non_blocking=True)
            steps[i].copy_(c.steps, non_blocking=True)
        if precision == "bfloat16":
            stored = stored.view(torch.bfloat16)
        last = None
        if any(c.shift or c.offset for c in chunks):
            shape = (-1, *[1] * len(self.plan.shape))
            offsets = [math.ldexp(c.offset, c.shift) for c in chunks]  # at the decode's scale
            scales = [2.0 ** -c.shift for c in chunks]  # powers of two: exact, and normal float32s
            last = tuple(torch.tensor(v, dtype=self.work).view(shape).to(self.device) for v in (offsets, scales))
        return stored, steps, last, max(c.level_bound for c in chunks)

    def __call__(self, stored: torch.Tensor, steps: torch.Tensor, last: tuple | None = None,
                 level_bound: float = math.inf) -> torch.Tensor:
        """Decode ``(n, n_values)`` stored values with ``(n, n_bands)`` steps into ``(n, *chunk_shape)``, then offset
        and scale each chunk as ``last`` (from :meth:`upload`) says. Only float32/float64 data has offsets or
        scales, whose output is neither rounded nor clipped: they apply last, on either path. The offset is
        added at the scale of the decode, whose values may be subnormal only once scaled back: the sum is
        rounded as on the host (a power of two changes no rounding) and is never flushed to zero.
        ``level_bound`` (from :meth:`upload`) bounds the stored values' magnitudes: the fused kernels take
        fewer products when they are whole numbers exact in TF32."""
        out = self._decode(stored, steps, level_bound)
        if last is not None:
            offsets, scales = last
            out.add_(offsets).mul_(scales)
        return out

    def _decode(self, stored: torch.Tensor, steps: torch.Tensor, level_bound: float) -> torch.Tensor:
        if self._fused is not None:
            from dctchop.cuda_decode import decode_groups

            return decode_groups(self._fused, stored, steps, self.plan.shape, self._clip, self.dtype == np.float16,
                                 level_bound)
        n = stored.shape[0]
        values = stored.to(self.work)
        out = torch.empty((n, *self.plan.shape), dtype=self.work, device=self.device)
        for g, basis, bands, perm, unflatten in zip(self.groups, self._basis, self._bands, self._perms,
                                                    self._unflatten):
            block_values = values[:, g.start : g.start + g.n_bands * g.n_blocks].view(n, g.n_bands, g.n_blocks)
            scaled = steps[:, bands, None] * basis  # (n, bands, volume): dequantization folded into the basis
            y = torch.matmul(scaled.transpose(1, 2), block_values)  # (n, volume, blocks)
            y = y.view(n, *g.widths, *g.grid).permute(perm)
            target = out[(slice(None), *g.region)]
            for dim, sizes in unflatten:
                target = target.unflatten(dim, sizes)
            target.copy_(y)
        if self._clip is not None:
            out.add_(0.5).floor_().clamp_(*self._clip)
        elif self.dtype == np.float16:  # clipped first, as on the host: ringing near the limit is not inf
            limit = float(np.finfo(np.float16).max)
            out = out.clamp_(-limit, limit).to(torch.float16).to(self.work)
        return out

    def decode(self, chunks: list[StagedChunk]) -> torch.Tensor:
        """Upload and decode ``chunks`` (one plan): ``(len(chunks), *chunk_shape)`` on the device."""
        return self(*self.upload(chunks))


def _fused_groups(plan: TransformPlan, groups, device: torch.device):
    """The fused kernels' tables on a CUDA device where Triton is installed (it comes with CUDA builds of
    torch); None elsewhere, where the matmul path decodes."""
    if device.type != "cuda" or math.prod(plan.shape) >= 2**31:  # the kernel's offsets are int32
        return None
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from dctchop.cuda_decode import fused_group

    return [fused_group(plan, g, device) for g in groups]


def plan_key(plan: TransformPlan) -> tuple:
    """What identifies a plan (plans are cached, but compare by value, not identity)."""
    return plan.shape, plan.axes, plan.block, plan.keep, plan.mask


@lru_cache(maxsize=16)
def _decoder(key, dtype: str, device: str) -> DeviceDecoder:
    return DeviceDecoder(make_plan(*key), dtype, torch.device(device))


def decoder_for(plan: TransformPlan, dtype, device) -> DeviceDecoder:
    """A cached :class:`DeviceDecoder` (its basis matrices live on the device)."""
    return _decoder(plan_key(plan), str(np.dtype(dtype)), str(device))


def decode_on_device(chunks: list[StagedChunk], device) -> torch.Tensor:
    """Decode staged chunks on ``device``: ``(len(chunks), *chunk_shape)``; chunks that share a plan and a
    precision (normally all of them) are decoded in one batched call."""
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(chunks):
        groups.setdefault((plan_key(c.plan), c.precision, str(c.dtype)), []).append(i)
    decoded = {}
    for members in groups.values():
        first = chunks[members[0]]
        out = decoder_for(first.plan, first.dtype, device).decode([chunks[i] for i in members])
        if len(groups) == 1:
            return out
        decoded.update({i: out[j] for j, i in enumerate(members)})
    return torch.stack([decoded[i] for i in range(len(chunks))])


# ---------------------------------------------------------------------------------------------- loader stage


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a numpy dtype name, or bfloat16."""
    return torch.bfloat16 if name == "bfloat16" else torch.from_numpy(np.empty(0, np.dtype(name))).dtype


class DeviceStage:
    """The device half of the loader's batch thread: decode coded chunks on the device, bring them to the
    output layout, dtype and normalisation once per chunk, and gather batches there.

    Owned by one thread; everything runs on that device's current stream, so batches handed to the training
    loop are ordered before whatever it launches next on the same stream.
    """

    def __init__(self, device: torch.device, specs, n_samples: int, chunk_len: int) -> None:
        self.device, self.specs = device, specs
        self.n_samples, self.chunk_len = n_samples, chunk_len
        self.chunks: dict[int, dict[str, torch.Tensor]] = {}
        self._norm = {s.name: tuple(torch.as_tensor(v, device=device) for v in (s.mean, s.scale))
                      for s in specs if s.scale is not None}

    def prepare(self, loaded: dict[int, dict]) -> None:
        """Decode the chunks of ``loaded`` that are not on the device yet (one batched call per array)."""
        new = [c for c in loaded if c not in self.chunks]
        if not new:
            return
        for spec in self.specs:
            decoded = decode_on_device([loaded[c][spec.name] for c in new], self.device)
            for i, c in enumerate(new):
                n = min(self.chunk_len, self.n_samples - c * self.chunk_len)
                x = decoded[i, :n].permute(spec.perm)
                if spec.name in self._norm:
                    mean, scale = self._norm[spec.name]  # as on the host: subtract first, in spec.work
                    x = (x.to(mean.dtype) - mean) * scale
                self.chunks.setdefault(c, {})[spec.name] = x.to(torch_dtype(spec.dtype)).contiguous()

    def gather(self, spec, batch, chunk_len: int) -> torch.Tensor:
        """One contiguous batch of ``spec``'s array from the decoded chunks."""
        local = np.concatenate([batch.samples[lo:hi] - c * chunk_len for c, lo, hi in batch.groups])
        index = torch.from_numpy(local)
        if self.device.type == "cuda":
            index = index.pin_memory()
        index = index.to(self.device, non_blocking=True)
        out = torch.empty((local.size, *spec.item_shape), dtype=torch_dtype(spec.dtype), device=self.device)
        for c, lo, hi in batch.groups:
            torch.index_select(self.chunks[c][spec.name], 0, index[lo:hi], out=out[lo:hi])
        return out

    def release(self, chunks) -> None:
        """Forget chunks no later batch needs."""
        for c in chunks:
            self.chunks.pop(c, None)


# ---------------------------------------------------------------------------------------------- DataLoader adapter


class TorchDataset(torch.utils.data.IterableDataset):
    """A :class:`dctchop.Loader` as a torch ``IterableDataset`` of whole batches.

    Use it with ``DataLoader(ds, batch_size=None, num_workers=k)``: each worker process iterates its own
    disjoint part of this rank's share of the epoch (the parts together are the share, every sample
    once), decoding on its own threads, and yields torch tensors. Batches are formed inside each worker,
    so each worker's last batch may be short (or dropped with ``drop_last``).

    Call :meth:`set_epoch` before each epoch. The epoch lives in shared memory, so workers kept alive
    across epochs (``persistent_workers=True``) see it too. There is no ``len()``: the batch count depends
    on how many workers split the share (each one's last batch may be short); with ``k`` workers it is
    ``sum(len(ds.loader(w, k)) for w in range(k))``. Decoding happens on the host in the workers; let the
    DataLoader pin (``pin_memory=True``) and move batches to the GPU, or use :class:`dctchop.Loader` with
    ``device=`` in the main process for device decode.

    Parameters
    ----------
    path, batch_size, shuffle, seed, drop_last
        As for :class:`dctchop.Loader` (``path`` may be a :class:`dctchop.Dataset`).
    **options
        Any other :class:`dctchop.Loader` option except ``device``, ``output``, ``worker`` and
        ``num_workers``; ``threads`` defaults to 1 per worker.
    """

    def __init__(self, path, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 **options) -> None:
        super().__init__()
        for name in ("device", "output", "worker", "num_workers"):
            if name in options:
                raise DctchopError(f"TorchDataset does not take {name}= (workers decode on the host and "
                                   "yield torch tensors)")
        options.setdefault("threads", 1)
        # a Dataset pickles by its path, made absolute: the workers find the same store after an os.chdir
        path = path if isinstance(path, Dataset) else Location(path).absolute().target
        self._args = dict(path=path, batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                          output="torch", **options)
        Loader(**self._args)  # check every setting here, not in the workers
        self._epoch = multiprocessing.RawValue("q", 0)  # shared with the DataLoader's workers

    @property
    def epoch(self) -> int:
        return self._epoch.value

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration uses (as with ``DistributedSampler``), in this
        process and in the DataLoader's workers, persistent ones included."""
        epoch = epoch_number(epoch)
        if epoch >= 2**63:
            raise DctchopError(f"epoch must be below 2**63, got {epoch}")
        self._epoch.value = epoch

    def __getstate__(self) -> dict:
        """Shared memory travels only to a process being started (a DataLoader worker); any other copy
        (``copy.deepcopy``, ``pickle``) gets an epoch of its own, starting at this one."""
        state = dict(self.__dict__)
        if multiprocessing.context.get_spawning_popen() is None:
            state["_epoch"] = self.epoch
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state["_epoch"], int):
            state["_epoch"] = multiprocessing.RawValue("q", state["_epoch"])
        self.__dict__.update(state)

    def loader(self, worker: int = 0, num_workers: int = 1):
        """The :class:`dctchop.Loader` of one worker's part."""
        loader = Loader(**self._args, worker=worker, num_workers=num_workers)
        loader.set_epoch(self.epoch)
        return loader

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(self.loader(worker, num_workers))
