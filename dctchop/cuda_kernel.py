"""The Triton kernels of :mod:`dctchop.cuda_decode` (imported only there, when a CUDA device decodes).

Kept apart so that the tables and their tests need no Triton: CPU-only torch builds do not ship it.
"""

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, b_lo, acc, SPLIT_A: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a @ b``. With ``SPLIT``, TF32 products to float32 accuracy, ``b`` split before the launch into its
    TF32 part ``b`` and the float32 rest ``b_lo`` (Triton's tf32x3 splits both operands in every program). ``a``
    holds stored values, exact in TF32 unless ``SPLIT_A``: then it is cut exactly into its top 11 significant
    bits and the rest, and only the rest times ``b_lo`` (2**-22 relative) is left out, as in tf32x3. Two
    products, or three with ``SPLIT_A``."""
    if SPLIT:
        if SPLIT_A:
            a_hi = (a.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
            acc = tl.dot(a - a_hi, b, acc, input_precision="tf32")
            a = a_hi
        acc = tl.dot(a, b_lo, acc, input_precision="tf32")
        return tl.dot(a, b, acc, input_precision="tf32")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _finish(res, lo, hi, ROUND: tl.constexpr, HALF: tl.constexpr):
    """Decoded values as the host writes them: integer dtypes rounded half up and clipped to ``lo .. hi``;
    float16 data clipped first (as on the host: ringing near the limit is not inf), then rounded to float16."""
    if ROUND:
        res = tl.minimum(tl.maximum(tl.floor(res + 0.5), lo), hi)
    if HALF:
        res = tl.minimum(tl.maximum(res, -65504.0), 65504.0).to(tl.float16).to(tl.float32)
    return res


@triton.jit
def decode_flat(stored, rows, basis_hi, basis_lo, sample_off, block_off, out, n_values, chunk_size, start, n_blocks,
                rows_pad, rest_pad, lo, hi, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, TILES: tl.constexpr,
                ROUND: tl.constexpr, HALF: tl.constexpr, SPLIT_A: tl.constexpr, SPLIT: tl.constexpr,
                PRECISION: tl.constexpr):
    """Decode one block group of blocks without a first axis (at most 64 values: ``BK == rows_pad``,
    ``BR == rest_pad``), program (block tiles, 1, chunk): the chunk's scaled basis is loaded once, then each of
    ``TILES`` tiles of ``BN`` blocks is one matmul ``values @ basis``, finished and stored."""
    n = tl.program_id(2).to(tl.int64)
    r = tl.arange(0, BR)
    k = tl.arange(0, BK)
    row = tl.load(rows + k)  # row of the group's (bands, blocks) matrix; -1: not kept
    at = n * rows_pad * rest_pad + k[:, None] * rest_pad + r[None, :]
    basis = tl.load(basis_hi + at)
    rest = tl.load(basis_lo + at) if SPLIT else basis
    where = tl.load(sample_off + r)  # -1 pads
    values = stored + n * n_values + start
    for tile in range(TILES):
        b = (tl.program_id(0) * TILES + tile) * BN + tl.arange(0, BN)
        in_group = b < n_blocks
        v = tl.load(values + row.to(tl.int64)[None, :] * n_blocks + b[:, None],
                    mask=in_group[:, None] & (row >= 0)[None, :], other=0)
        res = _dot(v.to(tl.float32), basis, rest, tl.zeros((BN, BR), dtype=tl.float32), SPLIT_A, SPLIT, PRECISION)
        res = _finish(res, lo, hi, ROUND, HALF)
        there = tl.load(block_off + b, mask=in_group, other=0)
        tl.store(out + n * chunk_size + (there[:, None] + where[None, :]), res,
                 mask=in_group[:, None] & (where >= 0)[None, :])


@triton.jit
def decode_first_last(stored, rows, first_rows, basis_hi, basis_lo, sample_off, block_off, out, n_values,
                      chunk_size, start, n_blocks, n_first_bands, rows_pad, rest_pad, lo, hi, BN: tl.constexpr,
                      BK: tl.constexpr, BR: tl.constexpr, FW: tl.constexpr, ROUND: tl.constexpr,
                      HALF: tl.constexpr, SPLIT_A: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    """Decode one block group, program (block tile, rest tile, chunk), reading every stored value once: for
    each kept band ``z`` of the first axis, ``t = values(z) @ B(z)`` on tensor cores, ``B(z)`` the rest basis
    with the chunk's steps of band ``z`` folded in, then every output position ``f`` along the first axis
    gains ``C[z, f] * t``, in ``FW`` accumulators."""
    n = tl.program_id(2).to(tl.int64)
    r = tl.program_id(1) * BR + tl.arange(0, BR)
    b = tl.program_id(0) * BN + tl.arange(0, BN)
    f = tl.arange(0, FW)
    in_group = b < n_blocks
    values = stored + n * n_values + start
    chunk_basis = n * n_first_bands * rows_pad * rest_pad
    res = tl.zeros((FW, BN, BR), dtype=tl.float32)
    for z in range(n_first_bands):
        t = tl.zeros((BN, BR), dtype=tl.float32)
        for k0 in range(0, rows_pad, BK):  # a tile of rest-of-block bands
            k = k0 + tl.arange(0, BK)
            row = tl.load(rows + z * rows_pad + k)  # row of the group's (bands, blocks) matrix; -1: not kept
            v = tl.load(values + row.to(tl.int64)[None, :] * n_blocks + b[:, None],
                        mask=in_group[:, None] & (row >= 0)[None, :], other=0)
            at = chunk_basis + (z * rows_pad + k)[:, None] * rest_pad + r[None, :]
            basis = tl.load(basis_hi + at)
            rest = tl.load(basis_lo + at) if SPLIT else basis
            t = _dot(v.to(tl.float32), basis, rest, t, SPLIT_A, SPLIT, PRECISION)
        res += tl.load(first_rows + z * FW + f)[:, None, None] * t[None, :, :]
    res = _finish(res, lo, hi, ROUND, HALF)
    there = tl.load(block_off + b, mask=in_group, other=0)
    where = tl.load(sample_off + f[:, None] * rest_pad + r[None, :])  # -1 pads
    tl.store(out + n * chunk_size + (there[None, :, None] + where[:, None, :]), res,
             mask=in_group[None, :, None] & (where >= 0)[:, None, :])


@triton.jit
def decode_first_inside(stored, steps, rows, step_index, first_rows, basis, sample_off, block_off, out,
                        n_values, n_steps, chunk_size, start, n_blocks, n_first_bands, first_width, rows_pad,
                        rest_pad, lo, hi, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
                        FW: tl.constexpr, ROUND: tl.constexpr, HALF: tl.constexpr, PRECISION: tl.constexpr):
    """Decode one block group, program (block tile, rest tile, chunk), one output position ``zp`` along the
    first axis at a time: ``(sum_z C[z, zp] * values(z)) @ rest basis``, so only one accumulator is live, and
    the (cached) values are loaded once per ``zp``."""
    n = tl.program_id(2).to(tl.int64)
    r = tl.program_id(1) * BR + tl.arange(0, BR)
    b = tl.program_id(0) * BN + tl.arange(0, BN)
    in_group = b < n_blocks
    values = stored + n * n_values + start
    there = tl.load(block_off + b, mask=in_group, other=0)
    for zp in range(first_width):
        res = tl.zeros((BN, BR), dtype=tl.float32)
        for k0 in range(0, rows_pad, BK):
            k = k0 + tl.arange(0, BK)
            spread = tl.zeros((BN, BK), dtype=tl.float32)
            for z in range(n_first_bands):  # every kept band of the first axis, weighted by its DCT row
                row = tl.load(rows + z * rows_pad + k)
                scale = tl.load(steps + n * n_steps + tl.load(step_index + z * rows_pad + k))
                scale *= tl.load(first_rows + z * FW + zp)
                v = tl.load(values + row.to(tl.int64)[None, :] * n_blocks + b[:, None],
                            mask=in_group[:, None] & (row >= 0)[None, :], other=0)
                spread += v.to(tl.float32) * scale[None, :]
            rest = tl.load(basis + k[:, None] * rest_pad + r[None, :])
            res = tl.dot(spread, rest, res, input_precision=PRECISION)
        res = _finish(res, lo, hi, ROUND, HALF)
        where = tl.load(sample_off + zp * rest_pad + r)  # -1 pads
        tl.store(out + n * chunk_size + (there[:, None] + where[None, :]), res,
                 mask=in_group[:, None] & (where >= 0)[None, :])
