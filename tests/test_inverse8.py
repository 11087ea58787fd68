"""The vector kernels of whole blocks of 8 (dctchop.inverse8): scipy's inverse DCT, and bit for bit the numba passes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.fft

from dctchop import transform
from dctchop.inverse8 import (
    COLOUR3,
    CUBE_LANES,
    CUBE_ROWS,
    DCT4,
    DCT8,
    GREY_KERNELS,
    GREY_ROWS_OF,
    LANES,
    RGB_PLANE_ROWS,
    RGB_ROWS,
    inverse_cube8,
    inverse_cube8_rows,
    inverse_grey8_rows,
    inverse_grey44_rows,
    inverse_grey48_rows,
    inverse_grey84_rows,
    inverse_rgb8,
    inverse_rgb8_plane_rows,
    inverse_rgb8_rows,
    padded_stride,
)

F32 = np.float32
# a short tail only (of the cubes' steps too), whole steps, both; 1040: 4 KB rows
BLOCK_COUNTS = [1, CUBE_LANES - 1, LANES - 1, LANES, 2 * LANES + 5, 1040]


def _band_major(n_bands: int, n_blocks: int, seed: int) -> np.ndarray:
    """Coefficients of ``n_blocks`` smooth-ish blocks, band-major ``(n_bands, n_blocks)``, in padded rows."""
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((n_bands, n_blocks)) * 300 / (1 + np.arange(n_bands)[:, None] / 8)).astype(F32)
    values[0] += 128 * np.sqrt(n_bands)  # mid-grey blocks with a wide spread: both clips of uint8 output are used
    padded = np.full((n_bands, padded_stride(n_blocks)), np.nan, F32)  # the padding is never read
    padded[:, :n_blocks] = values
    return padded


def _run(kernel, src: np.ndarray, n_blocks: int, dtype) -> np.ndarray:
    dst = np.zeros(src.shape, dtype)
    kernel(src, dst, n_blocks)
    assert not np.any(dst[:, n_blocks:]), "wrote past its blocks"
    return dst[:, :n_blocks]


def test_the_constants_are_the_plans_matrices():
    assert np.array_equal(DCT8, transform.axis_plan(8, 8, 8).matrix.astype(F32))
    assert np.array_equal(COLOUR3, transform.axis_plan(3, 3, 3).matrix.astype(F32))
    edge = transform.axis_plan(28, 8, 8)  # 28 = 3 blocks of 8 and an edge block of 4
    assert np.array_equal(DCT4, transform._axis_block(edge, 4)[0][:, :4].astype(F32))  # rows padded to 8
    assert np.array_equal(DCT8, transform._axis_block(edge, 8)[0].astype(F32))


@pytest.mark.parametrize("n", range(1, 200))
def test_padded_rows_start_on_lines_and_spread_over_sets(n):
    stride = padded_stride(n)
    assert n <= stride < n + 32 and stride % 32 == 16  # 4 bytes a value: an odd multiple of 64 bytes


@pytest.mark.parametrize("n_blocks", BLOCK_COUNTS)
def test_rgb8_is_the_inverse_dct_and_colour_dct(n_blocks):
    src = _band_major(192, n_blocks, n_blocks)
    out = _run(inverse_rgb8, src, n_blocks, F32)
    blocks = src[:, :n_blocks].astype(np.float64).reshape(8, 8, 3, n_blocks)
    expected = scipy.fft.idctn(blocks, axes=(0, 1, 2), norm="ortho").reshape(192, n_blocks)
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-3)


@pytest.mark.parametrize("n_blocks", BLOCK_COUNTS)
@pytest.mark.parametrize("widths", list(GREY_KERNELS), ids=lambda w: f"{w[0]}x{w[1]}")
def test_grey_is_the_inverse_dct(widths, n_blocks):
    n_bands = widths[0] * widths[1]
    src = _band_major(n_bands, n_blocks, n_blocks)
    out = _run(GREY_KERNELS[widths], src, n_blocks, F32)
    blocks = src[:, :n_blocks].astype(np.float64).reshape(*widths, n_blocks)
    expected = scipy.fft.idctn(blocks, axes=(0, 1), norm="ortho").reshape(n_bands, n_blocks)
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-3)


def _numba_rgb8(src: np.ndarray, n_blocks: int, dtype) -> np.ndarray:
    """The numba passes the band-major decode ran before: over H, then colour + W."""
    x = np.ascontiguousarray(src[:, :n_blocks]).reshape(8, 24 * n_blocks)
    by_h = np.empty_like(x)
    zero = F32(0)
    transform._inverse_3d(x.reshape(1, 8, -1), by_h.reshape(1, 8, -1), DCT8, np.array([[0, 8, 0, 8, 1, 0]]), zero, zero,
                          False)
    out = np.empty((8, 8, 3, n_blocks), dtype)
    hi = F32(255 if dtype == np.uint8 else 0)
    transform._inverse_colour8_bands(by_h.reshape(8, 8, 3, n_blocks), out, COLOUR3, DCT8, zero, hi, dtype == np.uint8)
    return out.reshape(192, n_blocks)


def _numba_grey(widths):
    """The numba passes over blocks of ``widths``: over W, then over H."""
    (h, w), matrix = widths, {8: DCT8, 4: DCT4}

    def passes(src: np.ndarray, n_blocks: int, dtype) -> np.ndarray:
        x = np.ascontiguousarray(src[:, :n_blocks]).reshape(h, w, n_blocks)
        by_w = np.empty_like(x)
        zero = F32(0)
        transform._inverse_3d(x, by_w, matrix[w], np.array([[0, w, 0, w, 1, 0]]), zero, zero, False)
        out = np.empty((h, w, n_blocks), dtype)
        hi = F32(255 if dtype == np.uint8 else 0)
        transform._inverse_3d(by_w.reshape(1, h, -1), out.reshape(1, h, -1), matrix[h], np.array([[0, h, 0, h, 1, 0]]),
                              zero, hi, dtype == np.uint8)
        return out.reshape(h * w, n_blocks)

    return passes


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
@pytest.mark.parametrize("n_blocks", BLOCK_COUNTS)
@pytest.mark.parametrize("kernel, reference, n_bands",
                         [(inverse_rgb8, _numba_rgb8, 192)]
                         + [(kernel, _numba_grey(w), w[0] * w[1]) for w, kernel in GREY_KERNELS.items()],
                         ids=["rgb8", *(f"grey{w[0]}x{w[1]}" for w in GREY_KERNELS)])
def test_bit_for_bit_the_numba_passes(kernel, reference, n_bands, n_blocks, dtype):
    src = _band_major(n_bands, n_blocks, 7 * n_blocks)
    out, expected = _run(kernel, src, n_blocks, dtype), reference(src, n_blocks, dtype)
    if dtype == np.uint8 and n_blocks >= LANES:
        assert 0 < np.mean(expected == 0) < 0.5 and 0 < np.mean(expected == 255) < 0.5  # both clips are used
    np.testing.assert_array_equal(out.view(np.uint8), expected.view(np.uint8))  # float32: -0.0 is not 0.0 here


def _numba_cube(src: np.ndarray, n_blocks: int, dtype) -> np.ndarray:
    """The numba passes over blocks of 8x8x8: X, then Y, then Z."""
    x = np.ascontiguousarray(src[:, :n_blocks]).reshape(8, 8, 8, n_blocks)
    zero, rows = F32(0), np.array([[0, 8, 0, 8, 1, 0]])
    by_x, by_y = np.empty_like(x), np.empty_like(x)
    transform._inverse_3d(x.reshape(64, 8, -1), by_x.reshape(64, 8, -1), DCT8, rows, zero, zero, False)
    transform._inverse_3d(by_x.reshape(8, 8, -1), by_y.reshape(8, 8, -1), DCT8, rows, zero, zero, False)
    out = np.empty((8, 8, 8, n_blocks), dtype)
    hi = F32(255 if dtype == np.uint8 else 0)
    transform._inverse_3d(by_y.reshape(1, 8, -1), out.reshape(1, 8, -1), DCT8, rows, zero, hi, dtype == np.uint8)
    return out.reshape(512, n_blocks)


def _cube_band_major(n_blocks: int, seed: int) -> np.ndarray:
    """:func:`_band_major` for blocks of 8x8x8, with the wider spread that reaches both clips of uint8 there."""
    src = _band_major(512, n_blocks, seed)
    src[1:] *= 3
    return src


@pytest.mark.parametrize("n_blocks", BLOCK_COUNTS)
def test_cube8_is_the_inverse_dct(n_blocks):
    src = _cube_band_major(n_blocks, n_blocks)
    out = _run(inverse_cube8, src, n_blocks, F32)
    blocks = src[:, :n_blocks].astype(np.float64).reshape(8, 8, 8, n_blocks)
    expected = scipy.fft.idctn(blocks, axes=(0, 1, 2), norm="ortho").reshape(512, n_blocks)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-2)


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
@pytest.mark.parametrize("n_blocks", BLOCK_COUNTS)
def test_cube8_bit_for_bit_the_numba_passes(n_blocks, dtype):
    src = _cube_band_major(n_blocks, 5 * n_blocks)
    out, expected = _run(inverse_cube8, src, n_blocks, dtype), _numba_cube(src, n_blocks, dtype)
    if dtype == np.uint8 and n_blocks >= LANES:
        assert 0 < np.mean(expected == 0) < 0.5 and 0 < np.mean(expected == 255) < 0.5  # both clips are used
    np.testing.assert_array_equal(out.view(np.uint8), expected.view(np.uint8))


INTO_OUTPUT_CASES = [  # kernel, reference, block (bands in C order), row_bands, sample axes as block axes, blocks along them
    (inverse_cube8_rows, _numba_cube, (8, 8, 8), CUBE_ROWS, (0, 1, 2), (2, 2, 3)),
    (inverse_grey8_rows, _numba_grey((8, 8)), (8, 8), GREY_ROWS_OF[8, 8], (0, 1), (2, 3)),
    (inverse_grey84_rows, _numba_grey((8, 4)), (8, 4), GREY_ROWS_OF[8, 4], (0, 1), (2, 3)),  # rows of 4
    (inverse_grey48_rows, _numba_grey((4, 8)), (4, 8), GREY_ROWS_OF[4, 8], (0, 1), (2, 3)),
    (inverse_grey44_rows, _numba_grey((4, 4)), (4, 4), GREY_ROWS_OF[4, 4], (0, 1), (3, 2)),
    (inverse_rgb8_rows, _numba_rgb8, (8, 8, 3), RGB_ROWS, (0, 1, 2), (2, 3, 1)),  # HWC
    (inverse_rgb8_plane_rows, _numba_rgb8, (8, 8, 3), RGB_PLANE_ROWS, (2, 0, 1), (1, 2, 3)),  # CHW
]


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
@pytest.mark.parametrize("n_blocks", BLOCK_COUNTS)
@pytest.mark.parametrize("kernel, reference, block, row_bands, axes, counts", INTO_OUTPUT_CASES,
                         ids=["cube8", "grey8", "grey8x4", "grey4x8", "grey4x4", "rgb8", "rgb8-planes"])
def test_into_output_writes_each_blocks_rows_where_told_and_nothing_else(kernel, reference, block, row_bands, axes,
                                                                         counts, n_blocks, dtype):
    """Blocks in samples of a few blocks along each axis (2 values between samples): a block's row ``r`` (its
    bands ``row_bands[r]``) at its origin + ``offsets[r]``, the blocks in a shuffled order (the origins need not
    grow), nothing written between them."""
    n_bands = math.prod(block)
    src = _cube_band_major(n_blocks, 3 * n_blocks) if n_bands == 512 else _band_major(n_bands, n_blocks, 3 * n_blocks)
    widths = [block[a] for a in axes]
    sample = tuple(w * c for w, c in zip(widths, counts))
    grid = np.unravel_index(np.arange(math.prod(counts)), counts)
    block_origins = np.ravel_multi_index([g * w for g, w in zip(grid, widths)], sample)
    n_samples, size = -(-n_blocks // block_origins.size), math.prod(sample) + 2
    everywhere = (np.arange(n_samples)[:, None] * size + block_origins).reshape(-1)
    origins = np.random.default_rng(n_blocks).permutation(everywhere)[:n_blocks].astype(np.int64)
    band_index = np.unravel_index(np.arange(n_bands), block)
    places = np.ravel_multi_index([band_index[a] for a in axes], sample)  # of a block at 0, by band
    assert np.array_equal(places[row_bands], places[row_bands[:, :1]] + np.arange(row_bands.shape[1])), "rows"
    image = np.zeros(n_samples * size, dtype)
    kernel(src, image, n_blocks, origins, places[row_bands[:, 0]].astype(np.int64))
    expected = np.zeros_like(image)
    expected[origins + places[:, None]] = reference(src, n_blocks, dtype)
    np.testing.assert_array_equal(image.view(np.uint8), expected.view(np.uint8))
