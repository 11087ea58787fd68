"""Blockwise DCT + chop transform against an independent scipy reference (dctchop.transform)."""

from __future__ import annotations

import itertools
import math
import re
import zlib
from fractions import Fraction

import numpy as np
import pytest
import scipy.fft
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dctchop import transform
from dctchop.errors import DctchopError
from dctchop.transform import (
    compress_array,
    decompress_array,
    forward,
    gather,
    inverse,
    make_plan,
    placement,
    scatter,
    slabs,
)

DTYPES = ("uint8", "uint16", "int16", "float16", "float32", "float64")
MASKS = ("square", "triangle")
HYP = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

# (shape, axes, block, keep): 1-, 2- and 3-axis blocks, odd sizes, partial edge blocks, non-8 and
# per-axis block sizes, an axis shorter than its block, and the 2..64 extremes.
CASES = [
    ((3, 37), (1,), (8,), (3,)),
    ((2, 28, 28), (1, 2), (8, 8), (4, 4)),
    ((2, 13, 21), (1, 2), (5, 7), (2, 7)),
    ((2, 19, 10, 3), (1, 2), (6, 4), (3, 1)),
    ((9, 10, 11), (0, 1, 2), (4, 3, 5), (2, 3, 4)),
    ((2, 7, 9, 6), (1, 2, 3), (2, 4, 3), (1, 3, 2)),
    ((2, 70, 65), (1, 2), (64, 33), (17, 33)),
    ((100,), (0,), (64,), (31,)),
    ((3, 5), (1,), (16,), (10,)),
    ((11, 2, 9), (0, 2), (3, 2), (2, 1)),
    ((2, 12, 10, 3), (1, 2, 3), (8, 4, 3), (5, 3, 3)),  # NHWC with the colour axis (a fused pass)
    # blocks of 8 keeping 8 on a contiguous last axis (the unrolled row kernels), with an edge block of 5
    ((3, 37), (1,), (8,), (8,)),
    ((2, 12, 29), (1, 2), (8, 8), (8, 8)),
    ((9, 10, 24), (0, 1, 2), (8, 8, 8), (4, 8, 8)),
    # 8 kept rows of 16-sample blocks, and of the 15-sample edge block (odd: its middle sample has no mirror),
    # through the tiled kernel (inner 9) and through _inverse_3d (inner 20): the even/odd-band sums
    ((2, 31, 9), (1, 2), (16, 8), (8, 8)),
    ((2, 31, 20), (1,), (16,), (8,)),
    # NHWC in whole blocks of 8 with the colour axis: the colour + W pass runs last (_inverse_rows3x8); without
    # it, the same kernel with the identity as colour matrix
    ((2, 16, 24, 3), (1, 2, 3), (8, 8, 3), (8, 8, 3)),
    ((2, 16, 24, 3), (1, 2), (8, 8), (8, 8)),
    ((2, 16, 29, 3), (1, 2, 3), (8, 8, 3), (8, 8, 3)),  # ... with an edge block of 5
    # a 3-long axis (block 3, keep 3) after another transformed axis but not last: no colour pass, which the
    # forward once fused anyway and failed on (reshape to (n, length, 3))
    ((2, 3, 4), (0, 1), (2, 3), (2, 3)),
    ((4, 8, 3, 5), (1, 2), (8, 3), (8, 3)),
    ((4, 8, 3, 5), (1, 2, 3), (8, 3, 5), (8, 3, 5)),
]
CASE_IDS = ["x".join(map(str, c[0])) + "-ax" + "".join(map(str, c[1])) for c in CASES]


# ---------------------------------------------------------------------------------------------- reference


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def ref_blocks(shape, axes, block, keep):
    """Per transformed axis: list of (sample start, width, first coefficient row, kept count)."""
    per_axis = []
    for a, b, k in zip(axes, block, keep):
        blocks, row = [], 0
        for s in range(0, shape[a], b):
            w = min(b, shape[a] - s)
            kk = k if w == b else _ceil_div(w * k, b)
            blocks.append((s, w, row, kk))
            row += kk
        per_axis.append(blocks)
    return per_axis


def in_mask(band, keeps, mask) -> bool:
    if any(i >= k for i, k in zip(band, keeps)):
        return False
    if mask == "square":
        return True
    return sum(Fraction(i, k) for i, k in zip(band, keeps)) < 1


def full_bands(keep, mask):
    return [b for b in itertools.product(*[range(k) for k in keep]) if in_mask(b, keep, mask)]


def _block_slices(ndim, axes, blocks, which):
    """Sample-space and coefficient-space slices of one block (``which``: index per axis)."""
    xs, cs = [slice(None)] * ndim, [slice(None)] * ndim
    for d, a in enumerate(axes):
        s, w, row, kk = blocks[d][which[d]]
        xs[a] = slice(s, s + w)
        cs[a] = slice(row, row + kk)
    return tuple(xs), tuple(cs)


def reference_forward(x, axes, block, keep, mask):
    """Loop over blocks: scipy dctn(norm="ortho") of each block, keep the first kk coefficients per axis.

    Returns the square-kept coefficient image (float64), a boolean image of the masked (stored) set, and
    per coefficient: a tuple of edge flags (which axes sit in an edge block) and the band tuple.
    """
    x = np.asarray(x, dtype=np.float64)
    blocks = ref_blocks(x.shape, axes, block, keep)
    cshape = list(x.shape)
    for d, a in enumerate(axes):
        cshape[a] = sum(b[3] for b in blocks[d])
    coef = np.zeros(cshape)
    kept = np.zeros(cshape, dtype=bool)
    edge = np.zeros((*cshape, len(axes)), dtype=bool)
    band = np.zeros((*cshape, len(axes)), dtype=np.int64)
    for which in itertools.product(*[range(len(b)) for b in blocks]):
        xs, cs = _block_slices(x.ndim, axes, blocks, which)
        c = scipy.fft.dctn(x[xs], axes=axes, norm="ortho")
        kks = [blocks[d][which[d]][3] for d in range(len(axes))]
        trunc = [slice(None)] * x.ndim
        for d, a in enumerate(axes):
            trunc[a] = slice(0, kks[d])
        coef[cs] = c[tuple(trunc)]
        sub_kept = kept[cs]
        sub_edge = edge[cs]
        sub_band = band[cs]
        for bnd in itertools.product(*[range(k) for k in kks]):
            sel = [slice(None)] * x.ndim
            for d, a in enumerate(axes):
                sel[a] = bnd[d]
            sel = tuple(sel)
            sub_kept[sel] = in_mask(bnd, kks, mask)
            sub_edge[sel] = [blocks[d][which[d]][1] != block[d] for d in range(len(axes))]
            sub_band[sel] = bnd
    return coef, kept, edge, band


def reference_inverse(coef, shape, axes, block, keep, mask):
    """Zero-pad each block's (masked) kept coefficients to the block width, then scipy idctn(norm="ortho")."""
    blocks = ref_blocks(shape, axes, block, keep)
    out = np.zeros(shape)
    for which in itertools.product(*[range(len(b)) for b in blocks]):
        xs, cs = _block_slices(len(shape), axes, blocks, which)
        kks = [blocks[d][which[d]][3] for d in range(len(axes))]
        padded_shape = list(out[xs].shape)
        padded = np.zeros(padded_shape)
        sub = coef[cs].copy()
        for bnd in itertools.product(*[range(k) for k in kks]):
            if not in_mask(bnd, kks, mask):
                sel = [slice(None)] * len(shape)
                for d, a in enumerate(axes):
                    sel[a] = bnd[d]
                sub[tuple(sel)] = 0.0
        tgt = [slice(None)] * len(shape)
        for d, a in enumerate(axes):
            tgt[a] = slice(0, kks[d])
        padded[tuple(tgt)] = sub
        out[xs] = scipy.fft.idctn(padded, axes=axes, norm="ortho")
    return out


def random_data(rng, shape, dtype, scale=100.0):
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, int(info.max) + 1, size=shape, dtype=np.int64).astype(dtype)
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _tolerance(x, block, dtype):
    eps = 2.0**-52 if np.dtype(dtype) == np.float64 else 2.0**-23
    scale = float(np.max(np.abs(x.astype(np.float64)))) if x.size else 1.0
    return 16 * eps * max(scale, 1.0) * math.sqrt(math.prod(block)) * len(block)


# ---------------------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_forward_matches_scipy_reference(case, mask, dtype):
    shape, axes, block, keep = case
    rng = np.random.default_rng(zlib.crc32(repr((shape, mask, dtype)).encode()))
    x = random_data(rng, shape, dtype)
    plan = make_plan(shape, axes, block, keep, mask)
    ref, kept, edge, band = reference_forward(x, axes, block, keep, mask)

    assert plan.coefficient_shape == ref.shape
    assert list(plan.bands) == full_bands(keep, mask)

    coef = forward(x, plan)
    assert coef.dtype == (np.float64 if np.dtype(dtype) == np.float64 else np.float32)
    tol = _tolerance(x, block, dtype)
    np.testing.assert_allclose(coef.astype(np.float64), ref, rtol=0, atol=tol)

    # gather picks exactly the masked set, in the order plan.index gives
    index, seg_starts, seg_bands = plan.index, plan.runs.seg_starts, plan.runs.seg_bands
    assert index.size == plan.n_values == int(kept.sum())
    assert np.array_equal(np.sort(index), np.flatnonzero(kept))
    stored = gather(coef, plan)
    np.testing.assert_allclose(stored.astype(np.float64), ref.reshape(-1)[index], rtol=0, atol=tol)
    np.testing.assert_array_equal(compress_array(x, plan), stored)

    # band-major order: full blocks first; each kind of edge block contiguous; inside a kind, bands in
    # plan.bands order; inside one (kind, band) run, C order of the coefficient image.
    band_index = {b: i for i, b in enumerate(full_bands(keep, mask))}
    flat_edge = edge.reshape(-1, len(axes))[index]
    flat_band = band.reshape(-1, len(axes))[index]
    groups = [tuple(e) for e in flat_edge]
    bands = np.array([band_index[tuple(b)] for b in flat_band], dtype=np.int64)
    n_full = sum(1 for g in groups if not any(g))
    assert all(not any(g) for g in groups[:n_full])
    seen, runs = set(), []
    for i, g in enumerate(groups):
        if i == 0 or g != groups[i - 1]:
            assert g not in seen, "blocks of one kind must be contiguous in storage"
            seen.add(g)
            runs.append(i)
    runs.append(len(groups))
    expected_starts = []
    for r0, r1 in itertools.pairwise(runs):
        assert np.all(np.diff(bands[r0:r1]) >= 0), "bands must be in plan.bands order within a block kind"
        for i in range(r0, r1):
            if i == r0 or bands[i] != bands[i - 1]:
                expected_starts.append(i)
            else:
                assert index[i] > index[i - 1], "C order within a band run"
    assert list(seg_starts) == expected_starts + [index.size]
    assert list(seg_bands) == [int(bands[s]) for s in expected_starts]


def test_a_long_axis_with_a_short_inner_extent_skips_the_tile_buffers(monkeypatch):
    # the tiled kernels gather TILE values per sample of the axis: a (2M, 2) chunk's axis 0 took 1 GB; such
    # axes go through the untiled kernels, and their plans are built per kind of block (7 s in a loop)
    shape, axes, block, keep = (transform.TILED_LENGTH + 13, 2), (0, 1), (8, 8), (4, 8)
    rng = np.random.default_rng(8)
    x = rng.standard_normal(shape).cumsum(axis=0)
    tiled = []
    for name in ("_forward_tiled", "_inverse_tiled"):
        kernel = getattr(transform, name)
        monkeypatch.setattr(transform, name, lambda src, dst, *args, k=kernel: (tiled.append(src.shape), k(src, dst, *args)))
    plan = make_plan(shape, axes, block, keep, "square")
    ref = reference_forward(x, axes, block, keep, "square")[0]
    coef = forward(x, plan)
    np.testing.assert_allclose(coef, ref, rtol=0, atol=1e-9 * np.abs(ref).max())
    back = inverse(coef, plan, np.float64)
    np.testing.assert_allclose(back, reference_inverse(ref, shape, axes, block, keep, "square"), rtol=0, atol=1e-9)
    assert tiled and all(s[1] <= transform.TILED_LENGTH for s in tiled)  # only the short axis 1
    (full, rest), b, k = divmod(shape[0], block[0]), block[0], keep[0]
    assert transform.axis_plan(shape[0], b, k).edge == (full * k, -(-rest * k // b), full * b, rest)


def test_band_zero_of_all_full_blocks_comes_first():
    x = np.arange(16 * 16, dtype=np.float64).reshape(16, 16)
    plan = make_plan(x.shape, (0, 1), 4, 2)
    stored = compress_array(x, plan)
    ref, *_ = reference_forward(x, (0, 1), (4, 4), (2, 2), "square")
    # band (0,0) of the 16 blocks, in block C order, then band (0,1), ...
    np.testing.assert_allclose(stored[:16], ref[0::2, 0::2].reshape(-1), atol=1e-9)
    np.testing.assert_allclose(stored[16:32], ref[0::2, 1::2].reshape(-1), atol=1e-9)
    np.testing.assert_allclose(stored[32:48], ref[1::2, 0::2].reshape(-1), atol=1e-9)
    np.testing.assert_allclose(stored[48:], ref[1::2, 1::2].reshape(-1), atol=1e-9)


# ---------------------------------------------------------------------------------------------- inverse


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_inverse_matches_zero_pad_idctn(case, mask):
    shape, axes, block, keep = case
    rng = np.random.default_rng(len(shape) * 1000 + sum(shape))
    plan = make_plan(shape, axes, block, keep, mask)
    values = rng.standard_normal(plan.n_values) * 10
    coef = scatter(values, plan, np.float64)
    ref = reference_inverse(coef, shape, axes, block, keep, mask)

    got64 = inverse(coef, plan, np.float64)
    assert got64.dtype == np.float64 and got64.shape == shape
    np.testing.assert_allclose(got64, ref, rtol=0, atol=1e-10 * max(1.0, np.abs(ref).max()))
    np.testing.assert_allclose(decompress_array(values, plan, np.float64), ref, rtol=0, atol=1e-10 * 100)

    got32 = inverse(coef, plan, np.float32)
    assert got32.dtype == np.float32
    np.testing.assert_allclose(got32, ref, rtol=0, atol=_tolerance(ref, block, np.float32) * 4)


# ---------------------------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_keep_equal_block_is_lossless(case, dtype):
    shape, axes, block, _ = case
    rng = np.random.default_rng(7)
    x = random_data(rng, shape, dtype)
    plan = make_plan(shape, axes, block, block, "square")
    assert plan.n_values == x.size
    y = decompress_array(compress_array(x, plan), plan, x.dtype)
    assert y.dtype == x.dtype and y.shape == x.shape
    if np.dtype(dtype).kind in "iu":
        np.testing.assert_array_equal(y, x)
    else:
        # float32 rounding of the transform (float16 output then rounds to its own half ulp)
        rtol = 2.0**-11 if dtype == "float16" else 0
        np.testing.assert_allclose(y.astype(np.float64), x.astype(np.float64), rtol=rtol,
                                   atol=_tolerance(x, block, dtype) * 4)


# ---------------------------------------------------------------------------------------------- ratio


def test_ratio_28x28_block8_keep4():
    plan = make_plan((28, 28), (0, 1), 8, 4)
    assert plan.n_values == 784 // 4 == 196
    assert plan.coefficient_shape == (14, 14)
    x = np.random.default_rng(0).integers(0, 256, (28, 28)).astype(np.uint8)
    assert compress_array(x, plan).size == 196
    stack = make_plan((5, 28, 28), (1, 2), 8, 4)
    assert stack.n_values == 5 * 196


@HYP
@given(length=st.integers(0, 200), block=st.integers(2, 64), data=st.data())
def test_axis_plan_rows_match_a_block_by_block_listing(length, block, data):
    """The axis plan's two kinds of block describe every block: listed one by one, each block's rows, bands,
    widths and keep are the plan's."""
    keep = data.draw(st.integers(1, block))
    p = transform.axis_plan(length, block, keep)
    listing = []  # (row, band, block's first sample, width, keep) for every kept row
    for first in range(0, length, block):
        w = min(block, length - first)
        k = keep if w == block else _ceil_div(w * keep, block)
        listing += [(len(listing) + band, band, first, w, k) for band in range(k)]
    assert p.kept == len(listing) == _ceil_div(length * keep, block)
    rows = np.arange(p.kept)
    assert p.row_widths(rows).tolist() == [w for *_, w, _ in listing]
    for edge, band in itertools.product((False, True), range(block)):
        expected = [r for r, b, _, w, _ in listing if b == band and (w != block) == edge]
        got, k = p.band_rows(edge, band)
        assert got.tolist() == expected
        assert k == (next(k for _, _, _, w, k in listing if (w != block) == edge) if expected else 0)
    whole = [row for row in listing if row[3] == block]
    assert p.edge == next(((r, k, s, w) for r, _, s, w, k in listing if w != block), None)
    for r, band, first, w, _ in listing:  # the DCT row each kernel takes for the row: kind's first row + band
        m0 = p.kinds[0 if whole and r < len(whole) else -1, 5]
        np.testing.assert_allclose(p.matrix[m0 + band], np.pad(scipy_dct_rows(w)[band], (0, block - w)), atol=1e-12)


def scipy_dct_rows(n: int) -> np.ndarray:
    return scipy.fft.dct(np.eye(n), axis=0, norm="ortho")


def test_a_long_axis_plans_in_constant_space():
    """A plan is sized by its kinds of block, not by the axis: with the DCT rows of every block, a (1, 4, 10M)
    field took 2.4 GB just to open its store."""
    plan = make_plan((1, 4, 10_000_003), (1, 2), 8, 8)
    p = plan.axis_plans[1]
    assert p.kept == 10_000_003 and p.edge == (10_000_000, 3, 10_000_000, 3)
    assert p.matrix.nbytes + p.kinds.nbytes < 1000


@HYP
@given(
    shape=st.lists(st.integers(1, 150), min_size=1, max_size=3),
    data=st.data(),
)
def test_n_values_is_product_of_ceil(shape, data):
    axes = tuple(range(len(shape)))
    block = [data.draw(st.integers(2, 64)) for _ in axes]
    keep = [data.draw(st.integers(1, b)) for b in block]
    plan = make_plan(tuple(shape), axes, block, keep, "square")
    expected = math.prod(_ceil_div(L * k, b) for L, b, k in zip(shape, block, keep))
    assert plan.n_values == expected
    assert math.prod(plan.coefficient_shape) == expected


# ---------------------------------------------------------------------------------------------- output dtype


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int16", "int32"])  # int32: bounds beyond float32
def test_decode_rounds_and_clips_integers(dtype):
    info = np.iinfo(dtype)
    # hard edges at both ends of the range: the chopped reconstruction overshoots (Gibbs) past the range
    x = np.full((4, 24, 24), info.min, dtype=dtype)
    x[:, :, 4:12] = info.max
    x[:, 16:20, :] = info.max
    plan = make_plan(x.shape, (1, 2), 8, 3)
    values = compress_array(x, plan)
    y = decompress_array(values, plan, dtype)
    assert y.dtype == np.dtype(dtype) and y.shape == x.shape
    real = decompress_array(values, plan, np.float32)  # same kernels, no rounding
    assert real.max() > info.max and real.min() < info.min  # the test really exercises clipping
    expected = np.clip(np.floor(real.astype(np.float64) + 0.5), info.min, info.max).astype(dtype)
    np.testing.assert_array_equal(y, expected)
    assert y.max() == info.max and y.min() == info.min


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_decode_returns_float_dtype(dtype):
    x = np.random.default_rng(3).standard_normal((3, 10, 12)).astype(dtype)
    plan = make_plan(x.shape, (1, 2), (4, 5), (2, 3), "triangle")
    y = decompress_array(compress_array(x, plan), plan, x.dtype)
    assert y.dtype == np.dtype(dtype) and y.shape == x.shape
    setting = ((1, 2), (4, 5), (2, 3), "triangle")
    ref = reference_inverse(reference_forward(x, *setting)[0], x.shape, *setting)
    tol = {"float16": 2e-3, "float32": 1e-5, "float64": 1e-12}[dtype] * max(1.0, np.abs(ref).max())
    np.testing.assert_allclose(y.astype(np.float64), ref, rtol=0, atol=tol)


# ---------------------------------------------------------------------------------------------- properties


@st.composite
def transform_settings(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 23), min_size=ndim, max_size=ndim)))
    if math.prod(shape) > 3000:
        shape = tuple(min(s, 6) for s in shape)
    n_axes = draw(st.integers(1, min(3, ndim)))
    axes = draw(st.lists(st.integers(0, ndim - 1), min_size=n_axes, max_size=n_axes, unique=True))
    axes = tuple(sorted(axes))
    block = tuple(draw(st.one_of(st.integers(2, 12), st.integers(13, 64))) for _ in axes)
    keep = tuple(draw(st.integers(1, b)) for b in block)
    mask = draw(st.sampled_from(MASKS))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**32 - 1))
    return shape, axes, block, keep, mask, dtype, seed


def _hyp_data(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    if dtype == "float16":
        return (rng.standard_normal(shape) * 300).astype(np.float16)
    return random_data(rng, shape, dtype, scale=50.0)


@HYP
@given(transform_settings())
def test_round_trip_properties(params):
    shape, axes, block, keep, mask, dtype, seed = params
    x = _hyp_data(shape, dtype, seed)
    plan = make_plan(shape, axes, block, keep, mask)
    values = compress_array(x, plan)
    assert values.shape == (plan.n_values,)
    y = decompress_array(values, plan, x.dtype)
    assert y.shape == x.shape and y.dtype == x.dtype

    x64 = x.astype(np.float64)
    energy = float(np.sum(x64**2))
    dropped = energy - float(np.sum(values.astype(np.float64) ** 2))
    err = float(np.sum((x64 - y.astype(np.float64)) ** 2))
    if dtype == "float64":
        # Parseval: the error is exactly the energy of the dropped coefficients
        assert err == pytest.approx(dropped, rel=1e-9, abs=1e-9 * energy + 1e-12)
    else:
        slack = 1e-5 * energy + 1e-6
        bound = math.sqrt(max(dropped, 0.0) + slack)
        if dtype == "float16":
            bound += 2.0**-11 * math.sqrt(float(np.sum(y.astype(np.float64) ** 2)))
        elif np.dtype(dtype).kind in "iu":
            bound += 0.5 * math.sqrt(x.size)
        assert math.sqrt(err) <= bound
    if keep == block and mask == "square" and dtype == "float64":
        np.testing.assert_allclose(y, x, atol=1e-9 * max(1.0, np.abs(x64).max()))


@settings(HYP, max_examples=150)  # small slabs: about 1 in 4 plans is cut, 1 in 7 into strips
@given(transform_settings(), st.integers(1, 60))
def test_slabs_cover_the_chunk_once_and_invert_like_it(params, n_values):
    """Slabs (samples, blocks of axis 0, strips of axis 1, edge blocks in the last) cover every sample and every
    stored value once, each piece inside its own run; inverting every slab's pieces on its own gives, bit for
    bit, the inverse of the whole chunk."""
    shape, axes, block, keep, mask, dtype, seed = params
    x = _hyp_data(shape, dtype, seed)
    plan = make_plan(shape, axes, block, keep, mask)
    values = compress_array(x, plan)
    seg_starts = plan.runs.seg_starts
    covered, stored = np.zeros(shape, np.int64), np.zeros(plan.n_values, np.int64)
    out = np.empty(shape, x.dtype)
    for part in slabs(plan, n_values):
        covered[part.region()] += 1
        lengths = np.diff(part.seg_starts)
        assert np.all(part.first >= seg_starts[:-1]) and np.all(part.first + lengths <= seg_starts[1:])
        for first, n in zip(part.first, lengths):
            stored[first : first + n] += 1
        pieces = np.concatenate([values[f : f + n] for f, n in zip(part.first, lengths)])
        out[part.region()] = decompress_array(pieces, part.plan, x.dtype)
    assert np.all(covered == 1) and np.all(stored == 1)
    np.testing.assert_array_equal(out, decompress_array(values, plan, x.dtype))


@HYP
@given(transform_settings())
def test_forward_reference_property(params):
    shape, axes, block, keep, mask, dtype, seed = params
    x = _hyp_data(shape, dtype, seed)
    plan = make_plan(shape, axes, block, keep, mask)
    ref, kept, _, _ = reference_forward(x, axes, block, keep, mask)
    coef = forward(x, plan)
    np.testing.assert_allclose(coef.astype(np.float64), ref, rtol=0, atol=_tolerance(x, block, dtype))
    assert np.array_equal(np.sort(plan.index), np.flatnonzero(kept))


@HYP
@given(transform_settings())
def test_gather_and_scatter_equal_fancy_indexing(params):
    """gather and scatter move values block by block through the placement; the storage order (``index``)
    says where each value belongs. Edge blocks make several block groups, the triangle mask short runs."""
    shape, axes, block, keep, mask, dtype, seed = params
    x = _hyp_data(shape, dtype, seed)
    plan = make_plan(shape, axes, block, keep, mask)
    coef = forward(x, plan)
    index = plan.index
    values = gather(coef, plan)
    np.testing.assert_array_equal(values, coef.reshape(-1)[index])
    image = scatter(values, plan, coef.dtype)
    expected = np.zeros(coef.size, coef.dtype)
    expected[index] = values
    np.testing.assert_array_equal(image.reshape(-1), expected)


@pytest.mark.parametrize("shape, axes, block, keep, mask, groups", [
    ((40, 32, 32, 3), (1, 2, 3), (8, 8, 3), (8, 8, 3), "square", 1),
    ((5, 30, 29), (1, 2), 8, 5, "triangle", 4),  # edge blocks on both axes: full, W edge, H edge, corner
    ((20, 13), (0,), 8, 8, "square", 2),
])
def test_placement_factors_the_storage_order(shape, axes, block, keep, mask, groups):
    plan = make_plan(shape, axes, block, keep, mask)
    index, seg_starts = plan.index, plan.runs.seg_starts
    p = placement(plan)
    assert p.group_runs.size - 1 == groups and p.group_runs[-1] == seg_starts.size - 1
    for g in range(groups):
        offsets = p.blocks[p.block_starts[g] : p.block_starts[g + 1]]
        for s in range(p.group_runs[g], p.group_runs[g + 1]):
            np.testing.assert_array_equal(index[seg_starts[s] : seg_starts[s + 1]], p.base[s] + offsets)


# ---------------------------------------------------------------------------------------------- threads


@pytest.mark.parametrize(
    "shape, axes, block, keep, mask, dtype",
    [
        ((4, 128, 128), (1, 2), 8, 5, "triangle", "float32"),  # split over the outer dimension
        ((256, 256), (0,), 8, 8, "square", "float64"),  # outer extent 1: split over the inner one
        ((300, 256), (0, 1), (8, 16), (7, 9), "square", "uint16"),
        ((3, 64, 40, 12), (1, 2, 3), (8, 8, 4), (6, 5, 3), "triangle", "int16"),
        ((8, 64, 48, 3), (1, 2, 3), (8, 8, 3), (8, 8, 3), "square", "uint8"),  # NHWC, colour axis fused
        ((1, 8192, 3), (1, 2), (8, 3), (8, 3), "square", "float32"),  # the same with a single outer row
        ((6, 64, 256), (1, 2), 8, 8, "square", "uint8"),  # the contiguous-axis row kernels, split by rows
        ((1, 65536), (1,), 8, 8, "square", "float32"),  # ... with one row: never split
    ],
)
def test_threads_give_identical_results(shape, axes, block, keep, mask, dtype):
    x = random_data(np.random.default_rng(11), shape, dtype)
    plan = make_plan(shape, axes, block, keep, mask)
    c1 = forward(x, plan, threads=1)
    c2 = forward(x, plan, threads=2)
    np.testing.assert_array_equal(c1, c2)
    v = gather(c1, plan)
    np.testing.assert_array_equal(decompress_array(v, plan, x.dtype, threads=1),
                                  decompress_array(v, plan, x.dtype, threads=2))


@pytest.mark.parametrize("dtype", DTYPES)
# lengths: one block; 3 whole blocks and an edge block of 5 (whole blocks copied to one run); 8 and an edge
# block (whole blocks in place); whole blocks only. Rows: one partial tile; two tiles and a partial one.
@pytest.mark.parametrize("rows", [5, 2 * transform.TILE + 3])
@pytest.mark.parametrize("length", [8, 29, 69, 256])
def test_row_kernels_equal_the_tiled_kernels(length, rows, dtype):
    """The unrolled kernels for a contiguous axis in blocks of 8 sum in the tiled kernels' order: bit-identical,
    rounding and clipping of integers included (values far outside the range clip)."""
    x = random_data(np.random.default_rng(length + rows), (rows, length), dtype)
    p = transform.axis_plan(length, 8, 8)
    wdt = transform.work_dtype(x.dtype)
    mat = p.matrix.astype(wdt)
    src = x.astype(wdt)
    fast, tiled = np.empty((rows, p.kept), wdt), np.empty((rows, p.kept, 1), wdt)
    transform._forward_rows8(src, fast, mat, p.kinds)
    transform._forward_tiled(src.reshape(rows, length, 1), tiled, mat, p.kinds)
    np.testing.assert_array_equal(fast, tiled[..., 0])
    coefficients = fast * 3  # pushes integer reconstructions past their range
    limits = (0.0, 0.0, False)
    if x.dtype.kind in "iu":
        limits = (float(np.iinfo(x.dtype).min), float(np.iinfo(x.dtype).max), True)
    out_dtype = x.dtype if x.dtype.kind in "iu" else wdt
    fast_out, tiled_out = np.empty((rows, length), out_dtype), np.empty((rows, length, 1), out_dtype)
    transform._inverse_rows8(coefficients, fast_out, mat, p.kinds, *limits)
    transform._inverse_tiled(coefficients.reshape(rows, p.kept, 1), tiled_out, mat, p.kinds, *limits)
    np.testing.assert_array_equal(fast_out, tiled_out[..., 0])


@pytest.mark.parametrize("width", [32, 29])  # whole blocks; an edge block of 5
@pytest.mark.parametrize("dtype", ["uint8", "int16", "float32"])
@pytest.mark.parametrize("n_outer", [5, 150])  # one tile; three, the last one partial
def test_colour_row_kernel_equals_the_tiled_kernel(n_outer, dtype, width):
    """NHWC rows in blocks of 8 keeping 8, the edge block too: the row kernels, interleaved and channels-first,
    are bit-identical to the tiled one, integers rounded and clipped (values far outside the range clip)."""
    dtype = np.dtype(dtype)
    coefficients = np.random.default_rng(n_outer).standard_normal((n_outer, width, 3)).astype(np.float32) * 300
    coefficients[0, 0] = [0.5, 1.5, -0.5]  # ties
    colour = transform.axis_plan(3, 3, 3).matrix.astype(np.float32)
    p = transform.axis_plan(width, 8, 8)
    mat = p.matrix.astype(np.float32)
    limits = (np.float32(0), np.float32(0), False)
    if dtype.kind in "iu":
        limits = (np.float32(np.iinfo(dtype).min), np.float32(np.iinfo(dtype).max), True)
    rows, tiled = np.empty((n_outer, 3 * width), dtype), np.empty((n_outer, width, 3), dtype)
    transform._inverse_rows3x8(coefficients.reshape(n_outer, -1), rows, colour, mat, p.kinds, *limits)
    transform._inverse_tiled_rows3(coefficients, tiled, colour, mat, p.kinds, *limits)
    np.testing.assert_array_equal(rows.reshape(tiled.shape), tiled)
    samples = 5 if n_outer % 5 == 0 else 1  # 150 rows: 5 samples of 30; 5 rows: 1 sample
    channels_first = np.empty((samples, 3, n_outer // samples, width), dtype)
    transform._inverse_rows3x8_planar(coefficients.reshape(samples, n_outer // samples, -1), channels_first, colour,
                                      mat, p.kinds, *limits)
    np.testing.assert_array_equal(channels_first.transpose(0, 2, 3, 1).reshape(rows.shape), rows)


@pytest.mark.parametrize(
    "width, keep, row_kernel",
    [(32, 8, True), (29, 8, True), (32, 6, False)],  # fewer bands: the tiled kernel
)
def test_colour_row_kernel_only_for_blocks_of_8_keeping_8(width, keep, row_kernel):
    plan = make_plan((4, 16, width, 3), (1, 2, 3), (8, 8, 3), (8, keep, 3))
    passes, _ = transform._inverse_passes(plan.shape, plan.axes, plan.block, plan.keep, plan.mask, "|u1", 1)
    kernels = [call[0] for call in passes]
    assert kernels == ([transform._inverse_3d, transform._inverse_rows3x8] if row_kernel  # colour + W last
                       else [transform._inverse_tiled_rows3, transform._inverse_3d])
    x = random_data(np.random.default_rng(width), plan.shape, "uint8")
    v = compress_array(x, plan)
    expected = np.clip(np.floor(decompress_array(v, plan, np.float32).astype(np.float64) + 0.5), 0, 255)
    np.testing.assert_array_equal(decompress_array(v, plan, np.uint8), expected)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "shape, axes, block, keep, dtype, in_kernels",
    [
        ((64, 32, 32, 3), (1, 2, 3), (8, 8, 3), (8, 8, 3), "uint8", True),  # split over samples with 2 threads
        ((5, 16, 24, 3), (1, 2, 3), (8, 8, 3), (8, 8, 3), "float32", True),
        ((16, 32, 3), (1, 2), (8, 3), (8, 3), "uint8", True),  # NWC: colour + W is the only pass
        ((2, 8, 8, 16, 3), (2, 3, 4), (8, 8, 3), (8, 8, 3), "uint16", True),  # NZYXC
        ((4, 32, 32, 3), (1, 2), (8, 8), (8, 8), "uint8", True),  # no colour axis: the identity as colour
        ((8, 16, 16, 3), (0, 1, 2), (8, 8, 8), (8, 8, 8), "float16", True),
        ((3, 16, 29, 3), (1, 2, 3), (8, 8, 3), (8, 8, 3), "uint8", True),  # an edge block
        ((4, 32, 29, 3), (1, 2), (8, 8), (8, 8), "uint8", True),
        ((4, 32, 32, 3), (1, 2), (8, 8), (8, 6), "uint8", False),  # 6 bands kept: moved by a copy
        ((3, 16, 5, 3), (1, 2, 3), (8, 8, 3), (8, 8, 3), "uint8", False),  # no whole block of 8
        ((4, 32, 32, 4), (1, 2), (8, 8), (8, 8), "uint8", False),  # 4 channels
    ],
)
def test_channels_first_output_is_the_output_with_its_last_axis_moved(shape, axes, block, keep, dtype, in_kernels,
                                                                       threads):
    """``inverse(..., channels_first=True)`` gives exactly the usual output with its last axis moved to axis 1,
    written by the kernels where the colour pass goes with a last pass over blocks of 8, else copied."""
    plan = make_plan(shape, axes, block, keep)
    x = random_data(np.random.default_rng(len(shape)), shape, dtype)
    coefficients = scatter(compress_array(x, plan), plan, transform.work_dtype(x.dtype))
    expected = np.moveaxis(inverse(coefficients, plan, x.dtype, threads), -1, 1)
    got = inverse(coefficients, plan, x.dtype, threads, channels_first=True)
    assert got.flags.c_contiguous
    np.testing.assert_array_equal(got, expected)
    out = np.empty(expected.shape, x.dtype)
    assert inverse(coefficients, plan, x.dtype, threads, out=out, channels_first=True) is out
    np.testing.assert_array_equal(out, expected)
    _, planar = transform._inverse_passes(plan.shape, plan.axes, plan.block, plan.keep, plan.mask, x.dtype.str,
                                          threads, True)
    assert planar == in_kernels


@pytest.mark.parametrize("dtype", ["uint16", "int16", "float16", "float64", "uint8", "float32"])
@pytest.mark.parametrize("length", [8, 20])
def test_channels_first_of_a_2d_array_is_the_array(dtype, length):
    """An (L, 3) array with blocks of 8 along L took the channels-first kernel, which assumes axis 0 holds
    samples, and failed; moving the last axis to axis 1 of a 2-D array moves nothing."""
    plan = make_plan((length, 3), (0,), (8,), (8,))
    x = random_data(np.random.default_rng(length), plan.shape, dtype)
    coefficients = scatter(compress_array(x, plan), plan, transform.work_dtype(x.dtype))
    np.testing.assert_array_equal(inverse(coefficients, plan, x.dtype, channels_first=True),
                                  inverse(coefficients, plan, x.dtype))


@pytest.mark.parametrize("bounds", [np.float32, float])  # clipped in float32 (8-, 16-bit) or float64 (wider)
def test_store_rounds_half_up(bounds):
    values = np.array([0.5, 1.5, 2.4999998, -0.5, -0.50000006, 254.5, 255.5, -3.5, 1e-30, -1e-30, 1e30, -1e30],
                      dtype=np.float32)
    src, out = np.pad(values[:, None], ((0, 0), (0, 2))), np.empty((values.size, 3), np.float64)
    transform._rows3(src, out, np.eye(3, dtype=np.float32), bounds(0), bounds(255), True)
    expected = np.clip(np.floor(values.astype(np.float64) + 0.5), 0, 255)
    np.testing.assert_array_equal(out[:, 0], expected)


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "shape, axes, block, keep, mask",
    [
        ((8, 8), (0, 1), 1, 1, "square"),
        ((8, 8), (0, 1), 65, 4, "square"),
        ((8, 8), (0, 1), (8, 1), (4, 1), "square"),
        ((8, 8), (0, 1), 8, 0, "square"),
        ((8, 8), (0, 1), 8, 9, "square"),
        ((8, 8), (0, 1), (8, 4), (4, 5), "square"),
        ((8, 8), (0, 1), 8, 4, "circle"),
        ((8, 8), (0, 1), 8, 4, "Square"),
        ((8, 8, 8), (1, 1), 8, 4, "square"),
        ((8, 8, 8), (0, 3), 8, 4, "square"),
        ((8, 8, 8), (3,), 8, 4, "square"),
        ((8, 8, 8), (1, 5), 8, 4, "square"),
        ((8, 8), (-3,), 8, 4, "square"),
        ((4, 4, 4, 4), (0, 1, 2, 3), 2, 1, "square"),
        ((8, 8), (), 8, 4, "square"),
        ((8, 8, 8), (0, 1), (8, 8, 8), 4, "square"),
        ((8, 8, 8), (0, 1), 8, (4, 4, 4), "square"),
    ],
)
def test_invalid_settings_raise(shape, axes, block, keep, mask):
    with pytest.raises(DctchopError):
        make_plan(shape, axes, block, keep, mask)


def test_shape_mismatch_raises():
    plan = make_plan((8, 8), (0, 1), 4, 2)
    with pytest.raises(DctchopError):
        forward(np.zeros((8, 9)), plan)
    with pytest.raises(DctchopError):
        inverse(np.zeros((5, 4)), plan, np.float32)


def test_block_limits_are_accepted():
    for b in (2, 64):
        plan = make_plan((3, 70), (1,), b, b)
        x = np.random.default_rng(b).standard_normal((3, 70))
        np.testing.assert_allclose(decompress_array(compress_array(x, plan), plan, x.dtype), x, atol=1e-10)


def test_stored_values_of_another_size_are_refused_not_read_past():
    """The kernels index the values by the plan: 10 of a plan's 256 values decoded garbage from beyond them
    (a segfault where the array ended a mapped page), and 2-D values a numba typing error."""
    plan = make_plan((4, 16, 16), (1, 2), 8, 4)
    values = compress_array(np.random.default_rng(0).random((4, 16, 16)).astype(np.float32), plan)
    for bad in (values[:10], values[:0], values.reshape(2, -1), np.concatenate([values, values])):
        with pytest.raises(DctchopError, match=f"stored values of shape {re.escape(str(bad.shape))} do not match the "
                                               "plan's 256 values"):
            decompress_array(bad, plan, np.float32)
    with pytest.raises(DctchopError, match="integer or float data, not complex64"):
        forward(np.zeros((4, 16, 16), np.complex64), plan)
