"""Device decode on CUDA in one fused Triton kernel per block group (float32 work).

Why. The torch path in :mod:`dctchop.torch_decode` decodes a group as one dense matmul with the Kronecker
basis and then makes four more passes over the output (int to float, scatter, round, clip). On an H100 that
runs at about 150 GB/s of decoded float32: an 8³ block costs 1024 multiply-adds per value in float32, and
every pass reads and writes the whole batch again.

What. Each stored value is read from device memory once and each decoded sample written once, at its place
in the chunk. A program handles one chunk, ``BN`` blocks of the group and ``BR`` positions of the *rest* of
the block (every transformed axis after the first). For each position ``zp`` along the first axis it

1. spreads the first axis: ``spread[b, j] = sum_z C[z, zp] * step(z, j) * value(z, j)[b]`` over the kept
   bands ``z`` of the first axis, for each rest-of-block band ``j`` (the values of band ``(z, j)`` are one
   row of the group's band-major ``(bands, blocks)`` matrix, contiguous over blocks, so loads coalesce;
   a table maps ``(z, j)`` to its row, so triangle masks and edge blocks need no special case),
2. applies the rest-of-block basis with one tensor-core matmul ``spread @ basis`` (``BK`` bands a step),
3. rounds and clips integer dtypes (``floor(v + 0.5)``, like :func:`dctchop.transform.inverse`) or rounds to
   float16 for float16 data, and stores through two offset tables (one per block, one per position).

An 8³ block costs 8 + 64 multiply-adds per value instead of 1024. The first axis' work repeats the
(cached) loads once per ``zp``; holding all ``zp`` at once instead (one pass over the values) measured
slower on an H100, because of the registers it takes.

Precision. Matmuls follow torch's float32 setting: ``"highest"`` (torch's default) uses three TF32 products
(``tf32x3``; float32-level error, checked against the numba path by the tests); ``"high"`` or ``"medium"``
allow one TF32 product, faster, with inputs rounded to 10 mantissa bits.

Tile sizes were chosen by a sweep on an H100 (``benchmarks/loader.py`` measures the result).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dctchop.torch_decode import basis_row
from dctchop.transform import TransformPlan, dct_matrix

REST_PER_PROGRAM = 64  # BR: rest-of-block positions per program, at most (BN is half of it, at least 16)
BANDS_PER_STEP = 32  # BK: rest-of-block bands per matmul step, at most
WARPS, STAGES = 4, 2
GRID_Z_MAX = 65535  # CUDA's limit on the third grid dimension: chunks per launch


def _pad(n: int) -> int:
    """A tile-friendly size >= n: a power of two from 16 up to 64, then a multiple of 64."""
    return max(16, 1 << (n - 1).bit_length()) if n <= 64 else -(-n // 64) * 64


@dataclass(frozen=True)
class FusedGroup:
    """One block group's tables on the device (see module docs)."""

    start: int
    n_blocks: int
    n_first_bands: int
    first_width: int
    rows_pad: int
    rest_pad: int
    block_n: int  # tile sizes: blocks, rest-of-block bands and rest-of-block positions per program
    block_k: int
    block_r: int
    rows: torch.Tensor  # (n_first_bands, rows_pad) int32: storage row of band (z, rest slot j); -1 if not kept
    step_index: torch.Tensor  # same shape, int32: its step
    first_rows: torch.Tensor  # (n_first_bands, first_width) float32: DCT rows of the first axis
    rest_basis: torch.Tensor  # (rows_pad, rest_pad) float32: the rest-of-block basis row of each slot
    sample_off: torch.Tensor  # (first_width, rest_pad) int32: offset of each position in a block; -1 pads
    block_off: torch.Tensor  # (n_blocks,) int32: offset of each block in the chunk


def fused_group(plan: TransformPlan, group, device: torch.device) -> FusedGroup:
    """The device tables of one :class:`dctchop.torch_decode.BlockGroup`."""
    bands = np.asarray(plan.bands, dtype=np.int64)[group.band_index]  # (n_bands, n_axes)
    widths = group.widths
    rest_width = math.prod(widths[1:])
    n_first = int(bands[:, 0].max()) + 1
    rest_bands = sorted({tuple(b[1:]) for b in bands.tolist()})  # one slot per rest-of-block band
    slot = {rb: j for j, rb in enumerate(rest_bands)}
    rows_pad, rest_pad = _pad(len(rest_bands)), _pad(rest_width)
    block_r = min(REST_PER_PROGRAM, rest_pad)

    rows = np.full((n_first, rows_pad), -1, np.int32)
    step_index = np.zeros((n_first, rows_pad), np.int32)
    for k, b in enumerate(bands.tolist()):
        rows[b[0], slot[tuple(b[1:])]] = k
        step_index[b[0], slot[tuple(b[1:])]] = group.band_index[k]
    matrices = [dct_matrix(w) for w in widths]
    rest_basis = np.zeros((rows_pad, rest_pad), np.float32)
    for j, rb in enumerate(rest_bands):
        rest_basis[j, :rest_width] = basis_row(matrices[1:], rb)
    first_rows = matrices[0][:n_first].astype(np.float32)

    strides = np.cumprod((1, *plan.shape[::-1]))[-2::-1]  # C-order element strides of the chunk
    sample_off = np.full((widths[0], rest_pad), -1, np.int64)
    inside = np.indices(widths).reshape(len(widths), -1).T @ np.asarray([int(strides[a]) for a in plan.axes])
    sample_off[:, :rest_width] = inside.reshape(widths[0], rest_width)
    steps_per_grid = [int(strides[i]) * (widths[plan.axes.index(i)] if i in plan.axes else 1)
                      for i in range(len(plan.shape))]
    origin = sum(int(strides[i]) * (s.start or 0) for i, s in enumerate(group.region))
    block_off = np.indices(group.grid).reshape(len(group.grid), -1).T @ np.asarray(steps_per_grid) + origin

    as_device = lambda a, dtype: torch.as_tensor(np.ascontiguousarray(a), dtype=dtype, device=device)
    return FusedGroup(
        start=group.start, n_blocks=group.n_blocks, n_first_bands=n_first, first_width=widths[0],
        rows_pad=rows_pad, rest_pad=rest_pad, block_n=max(16, block_r // 2), block_k=min(BANDS_PER_STEP, rows_pad),
        block_r=block_r,
        rows=as_device(rows, torch.int32), step_index=as_device(step_index, torch.int32),
        first_rows=as_device(first_rows, torch.float32), rest_basis=as_device(rest_basis, torch.float32),
        sample_off=as_device(sample_off, torch.int32), block_off=as_device(block_off, torch.int32))


def matmul_precision() -> str:
    """Triton's dot precision for torch's current float32 matmul setting."""
    return "tf32x3" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def decode_groups(groups: list[FusedGroup], stored: torch.Tensor, steps: torch.Tensor, shape: tuple[int, ...],
                  clip: tuple[float, float] | None, half: bool) -> torch.Tensor:
    """Decode ``(n, n_values)`` stored values with ``(n, n_bands)`` float32 steps into ``(n, *shape)`` float32."""
    from dctchop.cuda_kernel import decode_group

    n = stored.shape[0]
    out = torch.empty((n, *shape), dtype=torch.float32, device=stored.device)
    chunk_size = math.prod(shape)
    lo, hi = clip if clip is not None else (0.0, 0.0)
    precision = matmul_precision()
    steps = steps.contiguous()
    for first in range(0, n, GRID_Z_MAX):
        part = slice(first, min(n, first + GRID_Z_MAX))
        src, stp, dst = stored[part], steps[part], out[part]
        for g in groups:
            grid = (-(-g.n_blocks // g.block_n), g.rest_pad // g.block_r, src.shape[0])
            decode_group[grid](
                src, stp, g.rows, g.step_index, g.first_rows, g.rest_basis, g.sample_off, g.block_off, dst,
                stored.shape[1], steps.shape[1], chunk_size, g.start, g.n_blocks, g.n_first_bands, g.first_width,
                g.rows_pad, g.rest_pad, lo, hi, BN=g.block_n, BK=g.block_k, BR=g.block_r, ROUND=clip is not None, HALF=half,
                PRECISION=precision, num_warps=WARPS, num_stages=STAGES)
    return out
