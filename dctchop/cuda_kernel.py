"""The Triton kernel of :mod:`dctchop.cuda_decode` (imported only there, when a CUDA device decodes).

Kept apart so that the tables and their tests need no Triton: CPU-only torch builds do not ship it.
"""

import triton
import triton.language as tl


@triton.jit
def decode_group(stored, steps, rows, step_index, first_rows, rest_basis, sample_off, block_off, out,
                 n_values, n_steps, chunk_size, start, n_blocks, n_first_bands, first_width, rows_pad, rest_pad,
                 lo, hi, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
                 ROUND: tl.constexpr, HALF: tl.constexpr, PRECISION: tl.constexpr):
    """Decode one block group of a batch of chunks: program (block tile, rest tile, chunk)."""
    n = tl.program_id(2).to(tl.int64)
    r = tl.program_id(1) * BR + tl.arange(0, BR)
    b = tl.program_id(0) * BN + tl.arange(0, BN)
    in_group = b < n_blocks
    values = stored + n * n_values + start
    there = tl.load(block_off + b, mask=in_group, other=0)
    for zp in range(first_width):  # each output position along the first axis
        res = tl.zeros((BN, BR), dtype=tl.float32)
        for k0 in range(0, rows_pad, BK):  # a tile of rest-of-block bands
            k = k0 + tl.arange(0, BK)
            spread = tl.zeros((BN, BK), dtype=tl.float32)
            for z in range(n_first_bands):  # every kept band of the first axis, weighted by its DCT row
                row = tl.load(rows + z * rows_pad + k)  # row of the group's (bands, blocks) matrix; -1: not kept
                scale = tl.load(steps + n * n_steps + tl.load(step_index + z * rows_pad + k))
                scale *= tl.load(first_rows + z * first_width + zp)
                v = tl.load(values + row.to(tl.int64)[None, :] * n_blocks + b[:, None],
                            mask=in_group[:, None] & (row >= 0)[None, :], other=0)
                spread += v.to(tl.float32) * scale[None, :]
            basis = tl.load(rest_basis + k[:, None] * rest_pad + r[None, :])
            res = tl.dot(spread, basis, res, input_precision=PRECISION)
        if ROUND:
            res = tl.minimum(tl.maximum(tl.floor(res + 0.5), lo), hi)
        if HALF:  # clipped first, as on the host: ringing near the limit is not inf
            res = tl.minimum(tl.maximum(res, -65504.0), 65504.0).to(tl.float16).to(tl.float32)
        where = tl.load(sample_off + zp * rest_pad + r)  # -1 pads
        tl.store(out + n * chunk_size + (there[:, None] + where[None, :]), res,
                 mask=in_group[:, None] & (where >= 0)[None, :])
