"""Bit-plane layout of quantized values: exact round trips and strict size checks."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dctchop.bitplanes import check_planes, to_planes
from dctchop.errors import CorruptChunkError


def runs(n: int, cuts: list[int]) -> np.ndarray:
    return np.unique(np.array([0, *[c % (n + 1) for c in cuts], n], dtype=np.int64))


@settings(max_examples=80, deadline=None, derandomize=True)
@given(dtype=st.sampled_from([np.int8, np.int16]), data=st.data())
def test_round_trip_is_exact(dtype, data):
    info = np.iinfo(dtype)
    q = data.draw(arrays(dtype, st.integers(0, 300), elements=st.integers(info.min, info.max)))
    cuts = data.draw(st.lists(st.integers(0, 400), max_size=6))
    seg = runs(q.size, cuts)
    payload = to_planes(q, seg)
    np.testing.assert_array_equal(check_planes(payload, seg, dtype).unpack(), q)


def reference_planes(q: np.ndarray, seg: np.ndarray) -> bytes:
    """The layout the module docstring describes, written plainly with numpy (the format, pinned)."""
    bits = 8 * q.itemsize
    v = q.astype(np.int64)
    z = ((v << 1) ^ (v >> (bits - 1))) & ((1 << bits) - 1)
    masks, planes = [], []
    for s, e in itertools.pairwise(seg):
        m = int(np.bitwise_or.reduce(z[s:e])) if e > s else 0
        masks.append(m)
        padded = np.zeros(-(-(e - s) // 8) * 8, dtype=np.int64)
        padded[: e - s] = z[s:e]
        for p in range(bits - 1, -1, -1):
            if m >> p & 1:
                planes.append(np.packbits((padded >> p & 1).astype(np.uint8), bitorder="little").tobytes())
    return np.array(masks, dtype=f"<u{q.itemsize}").tobytes() + b"".join(planes)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(dtype=st.sampled_from([np.int8, np.int16]), data=st.data())
def test_planes_match_the_documented_layout(dtype, data):
    info = np.iinfo(dtype)
    q = data.draw(arrays(dtype, st.integers(0, 300), elements=st.integers(info.min, info.max)))
    seg = runs(q.size, data.draw(st.lists(st.integers(0, 400), max_size=6)))
    assert to_planes(q, seg) == reference_planes(q, seg)


def test_zero_runs_store_only_their_masks():
    q = np.zeros(1000, dtype=np.int8)
    q[:8] = [1, -1, 2, -2, 3, -3, 0, 0]
    seg = np.array([0, 8, 1000], dtype=np.int64)
    payload = to_planes(q, seg)
    # two one-byte masks, then the 3 planes zigzag values up to 6 need, one byte each for the first run
    assert len(payload) == 2 + 3
    np.testing.assert_array_equal(check_planes(payload, seg, np.int8).unpack(), q)


def test_extremes_and_int16_high_byte():
    q = np.array([-32768, 32767, 0, -1, 1, 255, -256, 4096], dtype=np.int16)
    seg = np.array([0, 3, 8], dtype=np.int64)
    np.testing.assert_array_equal(check_planes(to_planes(q, seg), seg, np.int16).unpack(), q)


@pytest.mark.parametrize("cut", [0, 1, 3, -1])
def test_wrong_size_is_corrupt(cut):
    q = np.arange(-50, 50, dtype=np.int8)
    seg = np.array([0, 40, 100], dtype=np.int64)
    payload = to_planes(q, seg)
    damaged = payload[:cut] if cut >= 0 else payload + b"\0"
    with pytest.raises(CorruptChunkError):
        check_planes(damaged, seg, np.int8).unpack()


def test_decoding_takes_no_lock_shared_by_every_chunk():
    """Every chunk decode reads ``Planes.largest_levels``. As a functools.cached_property it took one lock held
    by all instances while computing (before Python 3.12): decode threads queued on it, and a process forked
    meanwhile (a DataLoader worker beside a loader's threads) inherited it held and hung at its first decode.
    It is worked out with the plane offsets, when the payload is checked."""
    import dataclasses

    from dctchop.bitplanes import Planes

    assert "largest_levels" in {f.name for f in dataclasses.fields(Planes)}
    planes = check_planes(to_planes(np.array([0, 5, -3, 0, 0, 0, 0, 0, 1], np.int16), np.array([0, 3, 9])),
                          np.array([0, 3, 9]), np.int16)
    np.testing.assert_array_equal(planes.largest_levels, [8.0, 2.0])  # zigzag 10 -> plane 3; 2 -> plane 1
    empty = check_planes(to_planes(np.zeros(9, np.int8), np.array([0, 9])), np.array([0, 9]), np.int8)
    np.testing.assert_array_equal(empty.largest_levels, [0.0])


def test_plane_layout_counts_each_masks_planes():
    """Every int16 mask: its run's planes take one row of its groups of 8 per set bit, and its bound is 2^p for
    its top set plane p (0 without one), as the masks' definition says."""
    from dctchop.bitplanes import _plane_layout

    masks = np.arange(1 << 16, dtype=np.uint64)
    seg_starts = np.arange(masks.size + 1) * 13  # runs of 13 values: 2 groups
    offsets, largest = np.empty(masks.size + 1, np.int64), np.empty(masks.size)
    _plane_layout(masks, seg_starts, offsets, largest)
    set_bits = np.array([int(m).bit_count() for m in masks])
    np.testing.assert_array_equal(np.diff(offsets), 2 * set_bits)
    assert offsets[0] == 0
    np.testing.assert_array_equal(largest, [2.0 ** (int(m).bit_length() - 1) if m else 0.0 for m in masks])
