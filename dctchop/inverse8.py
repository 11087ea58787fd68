"""The inverse transform of 8x8 blocks (grey, and RGB with its colour DCT), of the 8x4, 4x8 and 4x4 edge blocks
of grey images 4 past a multiple of 8 (28x28) and of 8x8x8 blocks (volumes), sixteen blocks at a time with
AVX-512, else eight (volumes eight), as LLVM vectors: the kernels of the band-major decode of
:mod:`dctchop.transform` for those blocks.

Why. numba's loops reach SIMD only through LLVM's loop vectoriser, which must guard every loop with run-time
checks that its arrays do not overlap (numba cannot say they do not). A loop that computes all eight outputs
of a pass from its eight inputs reads and writes sixteen arrays: the checks cost more than a short loop's
work, so the numba kernels compute two outputs per loop over tiles of 256 blocks, read each input four
times and keep their tiles in L2. Here the code is written as vectors directly (a numba intrinsic that
emits LLVM IR): one lane per block, a vector of blocks a step, every pass of a block in registers (LLVM spills
what does not fit to the stack, which stays in L1), and the DCT and colour matrices as constants, which LLVM
folds into the multiplies instead of holding them in registers.

Exactness. Each output is the same expression as in the numba kernels, in the same order: an 8-point pass
sums by even and odd bands from ``0.0`` (:func:`dctchop.transform._even_odd`), a 4-point pass all bands in turn
from ``0.0`` (:func:`dctchop.transform._inverse_3d`), the colour pass left to right
(:func:`dctchop.transform._colour8_tile`), integer output rounds half up and clips (:func:`dctchop.transform._store`).
LLVM only makes exact changes to them (no fast-math flags), so the results are bit for bit those of the
coefficient image's decode; the tests check it.

Layout. Input ``(bands, stride)`` float32, band ``q`` of block ``b`` at ``[q, b]`` (bands in C order over the
block's axes), output the same shape, the block's samples in C order instead of its bands; ``n_blocks`` of the
``stride`` columns are decoded. A row stride that is a multiple of 4 KB (a slab of a multiple of 1024 blocks, as
with 32x32 grey images) would put all of a block's bands in one set of the L1 cache (measured 1.3-1.5x slower
for RGB, 2.0-2.4x for grey), so the caller pads the rows (:func:`padded_stride`).
"""

from __future__ import annotations

import contextlib

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from dctchop.jit import VECTOR_BITS, numba
from dctchop.transform import dct_matrix

# Blocks per step: one vector of float32. Two 256-bit vectors a step without AVX-512 held twice the values
# in the 16 registers AVX2 has, and spilled more: 1.1-1.25x slower than 8 (the fastest of 8 or 16, RGB and grey
# blocks straight into the output, on a Zen 3 machine).
LANES = VECTOR_BITS // 32
CUBE_LANES = 8  # for 8x8x8 blocks, whose step's stage buffer then fits in L1 (see _cube_step)
DCT8 = dct_matrix(8).astype(np.float32)  # the matrices of the passes, as the numba kernels get them
DCT4 = dct_matrix(4).astype(np.float32)
COLOUR3 = dct_matrix(3).astype(np.float32)


def padded_stride(n_blocks: int) -> int:
    """A row stride for ``n_blocks`` float32 blocks: the next one of 16 modulo 32, an odd multiple of 64 bytes,
    so rows fall on every set of the L1 cache and start on a cache line where the buffer does."""
    return n_blocks + (16 - n_blocks) % 32


def _splat(vector, x) -> ir.Constant:
    """``x`` in every lane of ``vector``."""
    return ir.Constant(vector, [float(x)] * vector.count)


def _block_program(builder, vector, dims, passes, load, store):
    """Emit the inverse of one step of blocks: ``load(flat)`` gives input row ``flat`` (bands in C order over
    ``dims``), ``store(flat, value)`` takes output row ``flat`` (samples in C order). ``passes``: ``(axis,
    matrix)`` in the order they run, ``matrix[band, sample]`` float32. Values are computed when an output needs
    them and stored as soon as they are final, which keeps fewer of them live. A pass of 8 sums even and odd
    bands apart, the colour pass (``COLOUR3``) sums left to right, any other from ``0.0``, as the numba kernels
    do (module docs)."""
    zero = _splat(vector, 0.0)
    memo = {}

    def value(stage, index):
        if (stage, index) in memo:
            return memo[stage, index]
        if stage == 0:
            memo[stage, index] = load(int(np.ravel_multi_index(index, dims)))
            return memo[stage, index]
        axis, matrix = passes[stage - 1]
        at = lambda i: index[:axis] + (i,) + index[axis + 1 :]
        x = [value(stage - 1, at(v)) for v in range(dims[axis])]
        if len(x) == 8:  # even and odd bands summed apart; sample j is e + o, its mirror 7 - j is e - o
            for j in range(4):
                m = [_splat(vector, matrix[v, j]) for v in range(8)]
                e, o = zero, zero
                for v in range(0, 8, 2):
                    e = builder.fadd(e, builder.fmul(m[v], x[v]))
                    o = builder.fadd(o, builder.fmul(m[v + 1], x[v + 1]))
                memo[stage, at(j)] = builder.fadd(e, o)
                memo[stage, at(7 - j)] = builder.fsub(e, o)
        else:  # the colour DCT left to right from its first term, other passes from 0.0
            for i in range(len(x)):
                total = builder.fmul(_splat(vector, matrix[0, i]), x[0])
                if matrix is not COLOUR3:
                    total = builder.fadd(zero, total)
                for v in range(1, len(x)):
                    total = builder.fadd(total, builder.fmul(_splat(vector, matrix[v, i]), x[v]))
                memo[stage, at(i)] = total
        return memo[stage, index]

    for flat, index in enumerate(np.ndindex(*dims)):
        index = tuple(int(i) for i in index)
        store(flat, value(len(passes), index))
        del memo[len(passes), index]


def _rounded_bytes(builder, module, vector, v):
    """float32 lanes to uint8 as :func:`dctchop.transform._store` rounds them: half up, clipped to 0 .. 255."""
    floor = cgutils.get_or_insert_function(module, ir.FunctionType(vector, [vector]), f"llvm.floor.v{vector.count}f32")
    half, one, lo, hi = (_splat(vector, x) for x in (0.5, 1.0, 0.0, 255.0))
    down = builder.call(floor, [v])
    up = builder.fcmp_ordered(">=", builder.fsub(v, down), half)
    down = builder.select(up, builder.fadd(down, one), down)
    down = builder.select(builder.fcmp_ordered("<", down, lo), lo,
                          builder.select(builder.fcmp_ordered(">", down, hi), hi, down))
    return builder.fptoui(down, ir.VectorType(ir.IntType(8), vector.count))


def _internal_function(module, name: str, arg_types) -> tuple[ir.Function, bool]:
    """The module's internal ``void name(arg_types)`` and whether its body is still to be written."""
    fn = cgutils.get_or_insert_function(module, ir.FunctionType(ir.VoidType(), arg_types), name)
    if not fn.is_declaration:
        return fn, False
    fn.linkage = "internal"
    return fn, True


def _step_function(module, name: str, dims, passes, out_type, lanes: int = LANES):
    """``void name(float* src, i64 src_stride, out* dst, i64 dst_stride)``: one step of ``lanes`` blocks, the first
    one's band ``q`` at ``src[q * src_stride]`` (strides in elements), defined once per LLVM module."""
    f32, i64 = ir.FloatType(), ir.IntType(64)
    vector = ir.VectorType(f32, lanes)
    fn, new = _internal_function(module, name, [f32.as_pointer(), i64, out_type.as_pointer(), i64])
    if not new:
        return fn
    builder = ir.IRBuilder(fn.append_basic_block())
    src, src_stride, dst, dst_stride = fn.args
    is_bytes = out_type == ir.IntType(8)

    def rows(data, stride):  # row pointers by repeated adds: cheaper than a multiply each
        pointers, p = [], data
        for _ in range(int(np.prod(dims))):
            pointers.append(p)
            p = builder.gep(p, [stride])
        return pointers

    src_rows, dst_rows = rows(src, src_stride), rows(dst, dst_stride)

    def load(flat):
        return builder.load(builder.bitcast(src_rows[flat], vector.as_pointer()), align=4)

    def store(flat, v):
        if is_bytes:
            v = _rounded_bytes(builder, module, vector, v)
        builder.store(v, builder.bitcast(dst_rows[flat], v.type.as_pointer()), align=1 if is_bytes else 4)

    _block_program(builder, vector, dims, passes, load, store)
    builder.ret_void()
    return fn


def _copy_columns(builder, n_rows: int, count, source, target) -> None:
    """``target[r, c0 + k] = source[r, s0 + k]`` for ``r < n_rows``, ``k < count``; ``source`` and ``target`` as
    ``(pointer, row stride, first column)``, in elements."""
    (src, src_stride, s0), (dst, dst_stride, d0) = source, target
    with cgutils.for_range(builder, ir.IntType(64)(n_rows)) as row, cgutils.for_range(builder, count) as k:
        at = lambda stride, c0: builder.add(builder.mul(row.index, stride), builder.add(c0, k.index))
        builder.store(builder.load(builder.gep(src, [at(src_stride, s0)])), builder.gep(dst, [at(dst_stride, d0)]))


def _blocks_kernel(n_bands: int, emit_step, scratch_vectors: int = 0, lanes: int = LANES):
    """An intrinsic ``kernel(src, dst, n_blocks)`` that decodes blocks ``0 .. n_blocks`` of 2-D ``src`` (``n_bands``
    rows) into ``dst`` (uint8 or float32): whole steps of ``lanes`` blocks in place, the last few blocks through
    zero-padded copies on the stack. ``emit_step(builder, out_type, src, src_stride, dst, dst_stride, scratch)``
    emits one step (``scratch``: ``scratch_vectors`` vectors on the stack, or None)."""

    @intrinsic
    def kernel(typingctx, src, dst, n_blocks):
        if not (_is_band_major(src, dst) and dst.ndim == 2):
            return None

        def codegen(context, builder, signature, args):
            src_t, dst_t, n_t = signature.args
            f32, i64 = ir.FloatType(), ir.IntType(64)
            out_type = context.get_data_type(dst_t.dtype)
            src_a, src_stride, whole, rest = _steps(context, builder, src_t, args[0], n_t, args[2], lanes)
            dst_a = context.make_array(dst_t)(context, builder, args[1])
            dst_stride = builder.sdiv(builder.extract_value(dst_a.strides, 0), i64(dst_t.dtype.bitwidth // 8))
            scratch = cgutils.alloca_once(builder, f32, size=scratch_vectors * lanes) if scratch_vectors else None
            with cgutils.for_range_slice(builder, i64(0), whole, i64(lanes)) as (b, _):
                emit_step(builder, out_type, builder.gep(src_a.data, [b]), src_stride, builder.gep(dst_a.data, [b]),
                          dst_stride, scratch)
            with builder.if_then(builder.icmp_signed(">", rest, i64(0))):
                pad_in = _padded_rest(builder, n_bands, src_a, src_stride, whole, rest, lanes)
                pad_out = cgutils.alloca_once(builder, out_type, size=n_bands * lanes)
                emit_step(builder, out_type, pad_in, i64(lanes), pad_out, i64(lanes), scratch)
                _copy_columns(builder, n_bands, rest, (pad_out, i64(lanes), i64(0)), (dst_a.data, dst_stride, whole))
            return context.get_dummy_value()

        return types.void(src, dst, n_blocks), codegen

    return kernel


def _program_into_bands(name: str, dims, passes):
    """``emit_step`` for :func:`_blocks_kernel` of the pass program ``(dims, passes)`` of :func:`_block_program`."""

    def emit_step(builder, out_type, src, src_stride, dst, dst_stride, scratch) -> None:
        step = _step_function(builder.module, f"dctchop_inverse8_{name}_{out_type}", dims, passes, out_type)
        builder.call(step, [src, src_stride, dst, dst_stride])

    return emit_step


# Blocks of 8x8x8 (volumes). A whole block's 512 values do not fit in registers (a program of the whole block,
# as above, ran 1.1-1.4x slower than the numba kernel it was meant to replace, spilling), so a step of CUBE_LANES
# blocks goes through two buffers on the stack: the passes over X and Y plane by plane (the grey program) into
# ``stage`` (512 vectors: 16 KB of 8 lanes; with LANES' 16 it took 32 KB of a Sapphire Rapids core's 48 KB L1
# beside the lines streaming in and out, and a 32³ float32 field chunk decoded 1.13x slower), then the pass over
# Z column by column, one row of Y at a time, into ``rows`` (64 vectors), which goes out either as band-major
# rows (:func:`inverse_cube8`) or, where each block's samples are rows of 8 in the output, transposed straight
# into the output (:func:`inverse_cube8_rows`), with no band-major result to transpose after. 512-block slabs of
# 32³ float32 fields, with 16 lanes: 0.93-1.1 ns a value for that (0.79-1.0 with 8)
# against 1.8-2.2 for the numba kernel and :func:`dctchop.transform._bands_to_rows`; uint8 0.6 against 1.3-1.9.
# Grey and RGB blocks go straight into the output the same way (:func:`inverse_grey8_rows`, :func:`inverse_rgb8_rows`
# and the others: the whole program of a step into ``rows``, then out by rows of 8, or of 4 for grey blocks 4
# wide): 1.2-1.4x faster than :func:`inverse_grey8` and the transposes after it, 1.13x for RGB (uint8).
CUBE_BANDS = 512


def _cube_step(builder, src, src_stride, stage, rows, put_rows) -> None:
    """Emit one step of CUBE_LANES 8x8x8 blocks (band ``q`` of the step's first block at ``src[q * src_stride]``):
    X and Y, then Z a row of Y at a time, ``put_rows(y)`` emitting what becomes of ``rows`` (vectors ``(z, x)``)
    for row ``y``."""
    f32, i64, lanes = ir.FloatType(), ir.IntType(64), CUBE_LANES
    module = builder.module
    plane = _step_function(module, "dctchop_inverse8_cube_plane", (8, 8), ((1, DCT8), (0, DCT8)), f32, lanes)
    column = _step_function(module, "dctchop_inverse8_cube_column", (8,), ((0, DCT8),), f32, lanes)
    plane_stride = builder.mul(src_stride, i64(64))
    with cgutils.for_range(builder, i64(8)) as z:
        builder.call(plane, [builder.gep(src, [builder.mul(z.index, plane_stride)]), src_stride,
                             builder.gep(stage, [builder.mul(z.index, i64(64 * lanes))]), i64(lanes)])
    with cgutils.for_range(builder, i64(8)) as y:
        for x in range(8):
            builder.call(column, [builder.gep(stage, [builder.add(builder.mul(y.index, i64(8 * lanes)), i64(x * lanes))]),
                                  i64(64 * lanes), builder.gep(rows, [i64(x * lanes)]), i64(8 * lanes)])
        put_rows(y.index)


def _program_into_rows(name: str, dims, passes):
    """``emit_step`` for :func:`_into_output_kernel` of blocks whose whole program (:func:`_block_program`) runs
    in one go: all a step's values into ``rows`` (vectors in band order), then ``put_rows(0)``."""

    def emit_step(builder, src, src_stride, stage, rows, put_rows) -> None:
        f32, i64 = ir.FloatType(), ir.IntType(64)
        step = _step_function(builder.module, f"dctchop_inverse8_{name}_rows", dims, passes, f32)
        builder.call(step, [src, src_stride, rows, i64(LANES)])
        put_rows(i64(0))

    return emit_step


def _band_rows_function(module, out_type) -> ir.Function:
    """``void f(float* rows, out* dst, i64 dst_stride, i64 y)``: ``rows`` (z, x) of row ``y`` of a step of cubes as
    bands ``(z, y, x)`` of ``dst`` (band ``q`` at ``dst[q * dst_stride]``), rounded to bytes for uint8."""
    f32, i64 = ir.FloatType(), ir.IntType(64)
    fn, new = _internal_function(module, f"dctchop_inverse8_cube_bands_{out_type}",
                                 [f32.as_pointer(), out_type.as_pointer(), i64, i64])
    if not new:
        return fn
    builder = ir.IRBuilder(fn.append_basic_block())
    rows, dst, dst_stride, y = fn.args
    vector, is_bytes = ir.VectorType(f32, CUBE_LANES), out_type == ir.IntType(8)
    for z in range(8):
        for x in range(8):
            v = builder.load(builder.bitcast(builder.gep(rows, [i64((8 * z + x) * CUBE_LANES)]), vector.as_pointer()),
                             align=4)
            if is_bytes:
                v = _rounded_bytes(builder, module, vector, v)
            band = builder.add(builder.mul(y, i64(8)), i64(64 * z + x))
            builder.store(v, builder.bitcast(builder.gep(dst, [builder.mul(band, dst_stride)]), v.type.as_pointer()),
                          align=1 if is_bytes else 4)
    builder.ret_void()
    return fn


def _output_rows_function(module, out_type, partial: bool, layout: str, row_vectors, offset_step: int,
                          lanes: int) -> ir.Function:
    """``void f(float* rows, out* image, i64* origins, i64* offsets[, i64 count])``: row ``r`` of each of ``lanes``
    blocks, the vectors ``row_vectors[r]`` of ``rows`` (8 or 4), stored at ``image[origins[b] + offsets[offset_step
    * r]]``; ``partial``: only blocks ``b < count``. Each row's vectors are transposed (``lanes`` rows of 8 or 4)
    with one shuffle. ``layout`` names the ``row_vectors`` in the function's name."""
    f32, i64, i32 = ir.FloatType(), ir.IntType(64), ir.IntType(32)
    name = f"dctchop_inverse8_rows_out_{layout}_{out_type}_{lanes}_{'partial' if partial else 'whole'}"
    fn, new = _internal_function(module, name, [f32.as_pointer(), out_type.as_pointer(), i64.as_pointer(),
                                                i64.as_pointer()] + [i64] * partial)
    if not new:
        return fn
    builder = ir.IRBuilder(fn.append_basic_block())
    rows, image, origins, offsets, *count = fn.args
    vector, is_bytes = ir.VectorType(f32, lanes), out_type == ir.IntType(8)
    for r, vectors in enumerate(row_vectors):
        length = len(vectors)
        to_blocks = ir.Constant(ir.VectorType(i32, length * lanes),
                                [lanes * (p % length) + p // length for p in range(length * lanes)])
        parts = []
        for q in vectors:
            v = builder.load(builder.bitcast(builder.gep(rows, [i64(int(q) * lanes)]), vector.as_pointer()), align=4)
            parts.append(_rounded_bytes(builder, module, vector, v) if is_bytes else v)
        while len(parts) > 1:  # concatenated in the row's order
            n = parts[0].type.count
            parts = [builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, 2 * n), list(range(2 * n))))
                     for a, b in zip(parts[::2], parts[1::2])]
        by_block = builder.shuffle_vector(parts[0], parts[0], to_blocks)
        offset = builder.load(builder.gep(offsets, [i64(offset_step * r)]))
        for b in range(lanes):
            held = builder.if_then(builder.icmp_signed("<", i64(b), count[0])) if partial else contextlib.nullcontext()
            with held:
                row = builder.shuffle_vector(by_block, by_block, ir.Constant(ir.VectorType(i32, length),
                                                                             list(range(length * b, length * (b + 1)))))
                at = builder.add(builder.load(builder.gep(origins, [i64(b)])), offset)
                builder.store(row, builder.bitcast(builder.gep(image, [at]), row.type.as_pointer()),
                              align=1 if is_bytes else 4)
    builder.ret_void()
    return fn


def _steps(context, builder, src_t, src, n_t, n, lanes: int):
    """(the ``src`` array, its row stride in elements, the blocks in whole steps of ``lanes``, the rest)."""
    i64 = ir.IntType(64)
    src_a = context.make_array(src_t)(context, builder, src)
    src_stride = builder.sdiv(builder.extract_value(src_a.strides, 0), i64(4))
    n = context.cast(builder, n, n_t, types.int64)
    whole = builder.sub(n, builder.srem(n, i64(lanes)))
    return src_a, src_stride, whole, builder.sub(n, whole)


def _padded_rest(builder, n_bands: int, src_a, src_stride, whole, rest, lanes: int):
    """The bands of the ``rest`` blocks from ``whole`` on, copied to a zero-padded step of ``lanes`` on the stack."""
    f32, i64 = ir.FloatType(), ir.IntType(64)
    pad_in = cgutils.alloca_once(builder, f32, size=n_bands * lanes)
    cgutils.memset(builder, pad_in, i64(4 * n_bands * lanes), 0)
    _copy_columns(builder, n_bands, rest, (src_a.data, src_stride, whole), (pad_in, i64(lanes), i64(0)))
    return pad_in


def _is_band_major(src, dst) -> bool:
    return (isinstance(src, types.Array) and src.ndim == 2 and src.dtype == types.float32
            and isinstance(dst, types.Array) and dst.dtype in (types.float32, types.uint8))


def _cube_into_bands(builder, out_type, src, src_stride, dst, dst_stride, scratch) -> None:
    """``emit_step`` for :func:`_blocks_kernel` of 8x8x8 blocks (:func:`_cube_step`, its ``stage`` and ``rows``
    in ``scratch``), each row of Y's ``rows`` out as bands (:func:`_band_rows_function`)."""
    bands = _band_rows_function(builder.module, out_type)
    rows = builder.gep(scratch, [ir.IntType(64)(CUBE_BANDS * CUBE_LANES)])
    _cube_step(builder, src, src_stride, scratch, rows, lambda y: builder.call(bands, [rows, dst, dst_stride, y]))


def _into_output_kernel(layout: str, n_bands: int, stage_bands: int, emit_step, row_vectors, offset_step: int = 1,
                        lanes: int = LANES):
    """An intrinsic ``kernel(src, image, n_blocks, origins, offsets)`` that decodes blocks ``0 .. n_blocks`` of
    band-major ``src`` (``lanes`` a step) straight into the flat ``image``: a block's row ``r`` of 8 (or 4)
    values at ``image[origins[b] + offsets[r]]``. ``emit_step(builder, src, src_stride, stage, rows, put_rows)`` emits a step's passes
    (``stage``: a buffer of ``stage_bands`` vectors), calling ``put_rows(k)`` each time it leaves rows in
    ``rows``: the vectors ``row_vectors[j]`` for row ``k + offset_step * j``. The last few blocks go through a
    zero-padded copy."""
    n_vectors = max(int(q) for vectors in row_vectors for q in vectors) + 1

    @intrinsic
    def kernel(typingctx, src, image, n_blocks, origins, offsets):
        if not (_is_band_major(src, image) and image.ndim == 1 and image.layout == "C"
                and all(isinstance(a, types.Array) and a.dtype == types.int64 and a.layout == "C"
                        for a in (origins, offsets))):
            return None

        def codegen(context, builder, signature, args):
            src_t, image_t, n_t, origins_t, offsets_t = signature.args
            f32, i64 = ir.FloatType(), ir.IntType(64)
            out_type = context.get_data_type(image_t.dtype)
            whole_out, partial_out = (_output_rows_function(builder.module, out_type, partial, layout, row_vectors,
                                                            offset_step, lanes) for partial in (False, True))
            src_a, src_stride, whole, rest = _steps(context, builder, src_t, args[0], n_t, args[2], lanes)
            stage = cgutils.alloca_once(builder, f32, size=stage_bands * lanes) if stage_bands else None
            rows = cgutils.alloca_once(builder, f32, size=n_vectors * lanes)
            image = context.make_array(image_t)(context, builder, args[1]).data
            origins = context.make_array(origins_t)(context, builder, args[3]).data
            offsets = context.make_array(offsets_t)(context, builder, args[4]).data
            with cgutils.for_range_slice(builder, i64(0), whole, i64(lanes)) as (b, _):
                origins_b = builder.gep(origins, [b])
                emit_step(builder, builder.gep(src_a.data, [b]), src_stride, stage, rows,
                          lambda k: builder.call(whole_out, [rows, image, origins_b, builder.gep(offsets, [k])]))
            with builder.if_then(builder.icmp_signed(">", rest, i64(0))):
                pad_in = _padded_rest(builder, n_bands, src_a, src_stride, whole, rest, lanes)
                origins_rest = builder.gep(origins, [whole])
                emit_step(builder, pad_in, i64(lanes), stage, rows,
                          lambda k: builder.call(partial_out, [rows, image, origins_rest, builder.gep(offsets, [k]),
                                                               rest]))
            return context.get_dummy_value()

        return types.void(src, image, n_blocks, origins, offsets), codegen

    return kernel


# RGB: bands (H, W, colour); the pass over H, then the colour DCT, then the pass over W (the order of the numba
# kernels). Grey: bands (H, W); the pass over W, then over H.
RGB8_PASSES = ((0, DCT8), (2, COLOUR3), (1, DCT8))
GREY_PASSES = {(8, 8): ((1, DCT8), (0, DCT8)), (8, 4): ((1, DCT4), (0, DCT8)), (4, 8): ((1, DCT8), (0, DCT4)),
               (4, 4): ((1, DCT4), (0, DCT4))}
_rgb8 = _blocks_kernel(192, _program_into_bands("rgb8", (8, 8, 3), RGB8_PASSES))
_grey8, _grey84, _grey48, _grey44 = (_blocks_kernel(h * w, _program_into_bands(f"grey{h}{w}", (h, w), GREY_PASSES[h, w]))
                                     for h, w in ((8, 8), (8, 4), (4, 8), (4, 4)))
_cube8 = _blocks_kernel(CUBE_BANDS, _cube_into_bands, CUBE_BANDS + 64, CUBE_LANES)  # stage and rows of _cube_step

# Which bands each straight-into-the-output kernel's row r of a block holds, in the row's order (the order of the
# output): volumes and grey blocks in band order (rows over X or W); RGB interleaved (rows of 8 of the 24 bytes of
# each row of pixels) or as planes (rows r = 3 h + c over W).
CUBE_ROWS = np.arange(CUBE_BANDS).reshape(-1, 8)
GREY_ROWS_OF = {w: np.arange(w[0] * w[1]).reshape(w) for w in GREY_PASSES}
RGB_ROWS = np.arange(192).reshape(-1, 8)
RGB_PLANE_ROWS = np.array([[24 * h + 3 * w + c for w in range(8)] for h in range(8) for c in range(3)])
_cube8_rows = _into_output_kernel("cube", CUBE_BANDS, CUBE_BANDS, _cube_step, CUBE_ROWS[:8], 8,  # a row of Y a time
                                  CUBE_LANES)
_grey8_rows, _grey84_rows, _grey48_rows, _grey44_rows = (
    _into_output_kernel(f"grey{h}{w}", h * w, 0, _program_into_rows(f"grey{h}{w}", (h, w), GREY_PASSES[h, w]),
                        GREY_ROWS_OF[h, w]) for h, w in ((8, 8), (8, 4), (4, 8), (4, 4)))
_rgb8_rows, _rgb8_plane_rows = (_into_output_kernel(layout, 192, 0, _program_into_rows("rgb8", (8, 8, 3), RGB8_PASSES), rows)
                                for layout, rows in (("rgb", RGB_ROWS), ("rgb_planes", RGB_PLANE_ROWS)))


@numba.njit(nogil=True, cache=True)
def inverse_rgb8(src, dst, n_blocks):  # pragma: no cover - compiled
    """Blocks of 8x8 RGB pixels, ``(192, stride)`` band-major to ``(192, stride)`` samples (see module docs)."""
    _rgb8(src, dst, n_blocks)


@numba.njit(nogil=True, cache=True)
def inverse_grey8(src, dst, n_blocks):  # pragma: no cover - compiled
    """Blocks of 8x8 samples, ``(64, stride)`` band-major to ``(64, stride)`` samples (see module docs)."""
    _grey8(src, dst, n_blocks)


@numba.njit(nogil=True, cache=True)
def inverse_grey84(src, dst, n_blocks):  # pragma: no cover - compiled
    """Blocks of 8x4 samples (8 rows of 4), ``(32, stride)`` band-major to samples (see module docs)."""
    _grey84(src, dst, n_blocks)


@numba.njit(nogil=True, cache=True)
def inverse_grey48(src, dst, n_blocks):  # pragma: no cover - compiled
    """Blocks of 4x8 samples, ``(32, stride)`` band-major to samples (see module docs)."""
    _grey48(src, dst, n_blocks)


@numba.njit(nogil=True, cache=True)
def inverse_grey44(src, dst, n_blocks):  # pragma: no cover - compiled
    """Blocks of 4x4 samples, ``(16, stride)`` band-major to samples (see module docs)."""
    _grey44(src, dst, n_blocks)


@numba.njit(nogil=True, cache=True)
def inverse_cube8(src, dst, n_blocks):  # pragma: no cover - compiled
    """Blocks of 8x8x8 samples, ``(512, stride)`` band-major to ``(512, stride)`` samples: X, then Y, then Z, the
    passes of the numba kernels (see module docs and above)."""
    _cube8(src, dst, n_blocks)


@numba.njit(nogil=True, cache=True)
def inverse_cube8_rows(src, image, n_blocks, origins, offsets):  # pragma: no cover - compiled
    """Blocks of 8x8x8 samples, ``(512, stride)`` band-major, straight into the flat ``image``: sample ``(z, y, x)``
    of block ``b`` to ``image[origins[b] + offsets[8 z + y] + x]``."""
    _cube8_rows(src, image, n_blocks, origins, offsets)


@numba.njit(nogil=True, cache=True)
def inverse_grey8_rows(src, image, n_blocks, origins, offsets):  # pragma: no cover - compiled
    """Blocks of 8x8 samples, ``(64, stride)`` band-major, straight into the flat ``image``: sample ``(h, w)`` of
    block ``b`` to ``image[origins[b] + offsets[h] + w]``."""
    _grey8_rows(src, image, n_blocks, origins, offsets)


@numba.njit(nogil=True, cache=True)
def inverse_grey84_rows(src, image, n_blocks, origins, offsets):  # pragma: no cover - compiled
    """:func:`inverse_grey8_rows` of blocks of 8x4 samples (8 rows of 4)."""
    _grey84_rows(src, image, n_blocks, origins, offsets)


@numba.njit(nogil=True, cache=True)
def inverse_grey48_rows(src, image, n_blocks, origins, offsets):  # pragma: no cover - compiled
    """:func:`inverse_grey8_rows` of blocks of 4x8 samples."""
    _grey48_rows(src, image, n_blocks, origins, offsets)


@numba.njit(nogil=True, cache=True)
def inverse_grey44_rows(src, image, n_blocks, origins, offsets):  # pragma: no cover - compiled
    """:func:`inverse_grey8_rows` of blocks of 4x4 samples."""
    _grey44_rows(src, image, n_blocks, origins, offsets)


@numba.njit(nogil=True, cache=True)
def inverse_rgb8_rows(src, image, n_blocks, origins, offsets):  # pragma: no cover - compiled
    """Blocks of 8x8 RGB pixels, ``(192, stride)`` band-major, straight into the flat ``image``: values ``8 r ..
    8 r + 7`` of block ``b`` in band order (pixels interleaved) to ``image[origins[b] + offsets[r]]``."""
    _rgb8_rows(src, image, n_blocks, origins, offsets)


@numba.njit(nogil=True, cache=True)
def inverse_rgb8_plane_rows(src, image, n_blocks, origins, offsets):  # pragma: no cover - compiled
    """Blocks of 8x8 RGB pixels, ``(192, stride)`` band-major, straight into the flat ``image`` as planes: pixel
    row ``h`` of colour ``c`` of block ``b`` to ``image[origins[b] + offsets[3 h + c]]``."""
    _rgb8_plane_rows(src, image, n_blocks, origins, offsets)


GREY_KERNELS = {(8, 8): inverse_grey8, (8, 4): inverse_grey84, (4, 8): inverse_grey48, (4, 4): inverse_grey44}
# the kernels that write blocks whose rows of 8 (or 4) are rows of the output there, with the bands of each row
INTO_OUTPUT = {inverse_cube8: [(inverse_cube8_rows, CUBE_ROWS)],
               inverse_rgb8: [(inverse_rgb8_rows, RGB_ROWS), (inverse_rgb8_plane_rows, RGB_PLANE_ROWS)],
               **{GREY_KERNELS[w]: [(kernel, GREY_ROWS_OF[w])] for w, kernel in (
                   ((8, 8), inverse_grey8_rows), ((8, 4), inverse_grey84_rows), ((4, 8), inverse_grey48_rows),
                   ((4, 4), inverse_grey44_rows))}}
