"""Device decode on CUDA in fused Triton kernels, one launch per block group (float32 work).

Why. The torch path in :mod:`dctchop.torch_decode` decodes a group as one dense matmul with the Kronecker
basis and then makes four more passes over the output (int to float, scatter, round, clip). On an H100 that
runs at about 150 GB/s of decoded float32: an 8³ block costs 1024 multiply-adds per value in float32, and
every pass reads and writes the whole batch again.

What. Each decoded sample is written once, at its place in the chunk. The block's axes split into a *first*
axis, applied on CUDA cores, and the *rest*, applied with tensor-core matmuls against the rest-of-block basis
(at most 64 positions: one 8x8 plane). Blocks of at most 64 values have no first axis (one matmul); larger
ones take their narrowest axis first (the colour axis of an 8x8x3 block, any axis of an 8³ block). The
values of band ``(z, j)`` (first-axis band ``z``, rest band ``j``) are one row of the group's band-major
``(bands, blocks)`` matrix, contiguous over blocks, so loads coalesce; a table maps ``(z, j)`` to its row, so
triangle masks and edge blocks need no special case. A program handles one chunk, ``BN`` blocks and ``BR``
rest positions; integer dtypes are rounded and clipped (``floor(v + 0.5)``, like
:func:`dctchop.transform.inverse`) and float16 data rounded to float16, then stored through two offset tables
(one per block, one per position). Three kernels, by the first axis' width (GB/s of float32 output on an
H100 at torch's default precision, ``decoder_rate`` of ``benchmarks/loader.py``; docs/performance.md has the
runs):

* :func:`~dctchop.cuda_kernel.decode_flat` (no first axis): a program loads its chunk's basis once and makes
  one matmul per tile of 32 blocks, for four tiles. 8x8 blocks: 956-1060 GB/s (``decode_first_last``, which
  reloaded the basis for every tile: 820-909).
* :func:`~dctchop.cuda_kernel.decode_first_last` (width 2 to 4): every value is read once; per first-axis
  band, one matmul, whose result every first-axis position accumulates. 8x8x3 colour blocks: 688-754 GB/s
  (with the 4 warps and 64 bands per step taken before: 605-672).
* :func:`~dctchop.cuda_kernel.decode_first_inside` (wider): per first-axis position, the first axis is summed
  into the matmul's input, so one accumulator is live and the (cached) values are reloaded per position.
  8³ blocks: 503-531 GB/s (``decode_first_last``: 386-407, eight accumulators of 32 x 64).

An 8³ block costs 8 + 64 multiply-adds per value instead of 1024.

Precision. ``decode_flat`` and ``decode_first_last`` multiply the stored values as they are by the rest basis with
each chunk's steps folded in (:func:`scaled_basis`, made before each launch: 16 KB per chunk and first-axis band),
and follow torch's float32 matmul setting. At ``"highest"`` (torch's default) the scaled basis is split into its
TF32 part and the float32 rest (:func:`split_tf32`), which gives float32-level error (checked against the numba path
by the tests) in two TF32 products where the stored values are exact in TF32 (:func:`values_exact_in_tf32`: int8,
float16 and bfloat16 values, and integers up to 2**11, which the bit-plane masks bound for free), and in three where
they are not (the values split in the kernel, as in Triton's tf32x3, which also splits the basis in every program).
``"high"`` or ``"medium"`` allow one TF32 product, the basis rounded to 10 mantissa bits: 8x8 blocks 1125-1172 GB/s,
colour blocks 743-819. Folding the steps into the basis instead of multiplying every value took 8x8 blocks from
739-773 to 810-833 GB/s and colour blocks from 568-574 to 607-648 at ``"highest"`` (runs alternating on one H100,
before ``decode_flat`` and the present tiles). ``decode_first_inside`` sums over the first axis before its matmul,
so the steps cannot move into its basis; it always takes three products: one measured slower on an H100 (433-442
against 530-541 GB/s, three runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dctchop.torch_decode import basis_row
from dctchop.transform import TransformPlan, dct_matrix

REST_PER_PROGRAM = 64  # BR: rest-of-block positions per program, at most
GRID_Z_MAX = 65535  # CUDA's limit on the third grid dimension: chunks per launch
FIRST_LAST_UP_TO = 4  # widest first axis for decode_first_last (its FW accumulators live in registers)
FLAT_TILES = 4  # tiles of 32 blocks per decode_flat program, which loads the chunk's basis once for them


def _pad(n: int) -> int:
    """A tile-friendly size >= n: a power of two from 16 up to 64, then a multiple of 64."""
    return max(16, 1 << (n - 1).bit_length()) if n <= 64 else -(-n // 64) * 64


def first_axis(widths: tuple[int, ...]) -> int | None:
    """The block axis the kernels apply on CUDA cores (see module docs): None when the whole block is one
    matmul's worth (at most 64 values), else the narrowest axis."""
    return None if math.prod(widths) <= REST_PER_PROGRAM else int(np.argmin(widths))


def split_tf32(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``a`` as its top 11 significant bits (a TF32 value) and the exact float32 rest."""
    hi = (a.view(torch.int32) & -8192).view(torch.float32)
    return hi, a - hi


def values_exact_in_tf32(stored: torch.Tensor, level_bound: float) -> bool:
    """Whether every stored value converts to float32 and then to TF32 (11 significant bits) exactly: int8,
    float16 and bfloat16 always, whole numbers up to 2**11 in magnitude."""
    return stored.dtype in (torch.int8, torch.float16, torch.bfloat16) or level_bound <= 2.0**11


def scaled_basis(group: FusedGroup, steps: torch.Tensor) -> torch.Tensor:
    """``(n, n_first_bands, rows_pad, rest_pad)``: the rest basis per chunk and first-axis band, each row times
    its band's step, which :func:`~dctchop.cuda_kernel.decode_flat` and
    :func:`~dctchop.cuda_kernel.decode_first_last` then multiply by the stored values as they are."""
    return (steps[:, group.step_index.long()].unsqueeze(-1) * group.basis).contiguous()


@dataclass(frozen=True)
class FusedGroup:
    """One block group's tables on the device (see module docs)."""

    start: int
    n_blocks: int
    n_first_bands: int
    first_width: int  # 1: no first axis
    first_pad: int  # FW: first_width as a power of two
    rows_pad: int
    rest_pad: int
    rows: torch.Tensor  # (n_first_bands, rows_pad) int32: storage row of band (z, rest slot j); -1 if not kept
    step_index: torch.Tensor  # same shape, int32: its step
    first_rows: torch.Tensor  # (n_first_bands, first_pad) float32: DCT rows of the first axis, zero-padded
    basis: torch.Tensor  # (rows_pad, rest_pad) float32: the rest-of-block basis row of each slot
    sample_off: torch.Tensor  # (first_pad, rest_pad) int32: offset of each position in a block; -1 pads
    block_off: torch.Tensor  # (n_blocks,) int32: offset of each block in the chunk

    @property
    def kernel(self) -> str:
        """Which kernel decodes this group: ``"flat"`` (no first axis), ``"first_last"`` (a first axis up to
        FIRST_LAST_UP_TO wide) or ``"first_inside"`` (wider)."""
        if self.first_width == 1:
            return "flat"
        return "first_last" if self.first_width <= FIRST_LAST_UP_TO else "first_inside"


def fused_group(plan: TransformPlan, group, device: torch.device) -> FusedGroup:
    """The device tables of one :class:`dctchop.torch_decode.BlockGroup`."""
    bands = np.asarray(plan.bands, dtype=np.int64)[group.band_index]  # (n_bands, n_axes)
    widths = tuple(group.widths)
    first = first_axis(widths)
    rest_axes = [d for d in range(len(widths)) if d != first]
    order = rest_axes if first is None else [first, *rest_axes]  # the block's axes as the tables order them
    first_width = 1 if first is None else widths[first]
    first_pad = 1 << (first_width - 1).bit_length()
    rest_width = math.prod(widths[d] for d in rest_axes)
    first_band = bands[:, first] if first is not None else np.zeros(len(bands), np.int64)
    rest_of = [tuple(b) for b in bands[:, rest_axes].tolist()]
    rest_bands = sorted(set(rest_of))  # one slot per rest-of-block band
    slot = {rb: j for j, rb in enumerate(rest_bands)}
    n_first = int(first_band.max()) + 1
    rows_pad, rest_pad = _pad(len(rest_bands)), _pad(rest_width)

    rows = np.full((n_first, rows_pad), -1, np.int32)
    step_index = np.zeros((n_first, rows_pad), np.int32)
    for k, (z, rb) in enumerate(zip(first_band.tolist(), rest_of, strict=True)):
        rows[z, slot[rb]] = k
        step_index[z, slot[rb]] = group.band_index[k]
    matrices = [dct_matrix(w) for w in widths]
    basis = np.zeros((rows_pad, rest_pad), np.float32)
    for j, rb in enumerate(rest_bands):
        basis[j, :rest_width] = basis_row([matrices[d] for d in rest_axes], rb)
    first_rows = np.zeros((n_first, first_pad), np.float32)
    first_rows[:, :first_width] = 1.0 if first is None else matrices[first][:n_first]

    strides = np.cumprod((1, *plan.shape[::-1]))[-2::-1]  # C-order element strides of the chunk
    axis_strides = np.asarray([int(strides[a]) for a in plan.axes])[order]
    sample_off = np.full((first_pad, rest_pad), -1, np.int64)
    inside = np.indices([widths[d] for d in order]).reshape(len(order), -1).T @ axis_strides
    sample_off[:first_width, :rest_width] = inside.reshape(first_width, rest_width)
    steps_per_grid = [int(strides[i]) * (widths[plan.axes.index(i)] if i in plan.axes else 1)
                      for i in range(len(plan.shape))]
    origin = sum(int(strides[i]) * (s.start or 0) for i, s in enumerate(group.region))
    block_off = np.indices(group.grid).reshape(len(group.grid), -1).T @ np.asarray(steps_per_grid) + origin

    as_device = lambda a, dtype: torch.as_tensor(np.ascontiguousarray(a), dtype=dtype, device=device)
    return FusedGroup(
        start=group.start, n_blocks=group.n_blocks, n_first_bands=n_first, first_width=first_width,
        first_pad=first_pad, rows_pad=rows_pad, rest_pad=rest_pad,
        rows=as_device(rows, torch.int32), step_index=as_device(step_index, torch.int32),
        first_rows=as_device(first_rows, torch.float32), basis=as_device(basis, torch.float32),
        sample_off=as_device(sample_off, torch.int32), block_off=as_device(block_off, torch.int32))


def matmul_precision() -> str:
    """Triton's dot precision for torch's current float32 matmul setting."""
    return "tf32x3" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def decode_groups(groups: list[FusedGroup], stored: torch.Tensor, steps: torch.Tensor, shape: tuple[int, ...],
                  clip: tuple[float, float] | None, half: bool, level_bound: float = math.inf) -> torch.Tensor:
    """Decode ``(n, n_values)`` stored values with ``(n, n_bands)`` float32 steps into ``(n, *shape)`` float32;
    ``level_bound`` bounds the stored values' magnitudes."""
    from dctchop.cuda_kernel import decode_first_inside, decode_first_last, decode_flat

    n = stored.shape[0]
    out = torch.empty((n, *shape), dtype=torch.float32, device=stored.device)
    chunk_size = math.prod(shape)
    lo, hi = clip if clip is not None else (0.0, 0.0)
    precision = matmul_precision()
    split = precision == "tf32x3"
    split_values = split and not values_exact_in_tf32(stored, level_bound)
    finish = {"ROUND": clip is not None, "HALF": half}
    products = {"SPLIT_A": split_values, "SPLIT": split, "PRECISION": precision}
    steps = steps.contiguous()
    for first in range(0, n, GRID_Z_MAX):
        part = slice(first, min(n, first + GRID_Z_MAX))
        src, stp, dst = stored[part], steps[part], out[part]
        for g in groups:  # tile sizes from sweeps on an H100 (docs/performance.md)
            block_r = min(REST_PER_PROGRAM, g.rest_pad)
            if g.kernel != "first_inside":
                basis = scaled_basis(g, stp)
                basis = split_tf32(basis) if split else (basis, basis)  # one TF32 product: no rest
            if g.kernel == "flat":
                grid = (-(-g.n_blocks // (32 * FLAT_TILES)), 1, src.shape[0])
                decode_flat[grid](
                    src, g.rows, *basis, g.sample_off, g.block_off, dst, stored.shape[1], chunk_size, g.start,
                    g.n_blocks, g.rows_pad, g.rest_pad, lo, hi, BN=32, BK=g.rows_pad, BR=g.rest_pad,
                    TILES=FLAT_TILES, **finish, **products, num_warps=2, num_stages=2)
            elif g.kernel == "first_last":
                grid = (-(-g.n_blocks // 32), g.rest_pad // block_r, src.shape[0])
                decode_first_last[grid](
                    src, g.rows, g.first_rows, *basis, g.sample_off, g.block_off, dst, stored.shape[1],
                    chunk_size, g.start, g.n_blocks, g.n_first_bands, g.rows_pad, g.rest_pad, lo, hi, BN=32,
                    BK=min(32, g.rows_pad), BR=block_r, FW=g.first_pad, **finish, **products, num_warps=2,
                    num_stages=2)
            else:
                block_n = max(16, block_r // 2)
                grid = (-(-g.n_blocks // block_n), g.rest_pad // block_r, src.shape[0])
                decode_first_inside[grid](
                    src, stp, g.rows, g.step_index, g.first_rows, g.basis, g.sample_off, g.block_off, dst,
                    stored.shape[1], steps.shape[1], chunk_size, g.start, g.n_blocks, g.n_first_bands,
                    g.first_width, g.rows_pad, g.rest_pad, lo, hi, BN=block_n, BK=min(32, g.rows_pad), BR=block_r,
                    FW=g.first_pad, **finish,
                    PRECISION="tf32x3",  # faster than one TF32 product
                    num_warps=4, num_stages=2)
    return out
