"""The chunk format's specification is complete and true: a decoder written from it alone (the module
docstrings of ``dctchop.codec`` and ``dctchop.bitplanes``), slow and plain, with scipy's inverse DCT and no
dctchop code, decodes every layout as dctchop does, up to the rounding the specification allows (float32
arithmetic against float64; one unit at .5 for integers). It was first written by someone who read only
those docstrings; what they had to guess is now in them."""

from __future__ import annotations

import itertools
import math
import struct
from pathlib import Path

import numpy as np
import pytest
from scipy.fft import idctn

from dctchop.codec import ChunkSettings, decode_chunk, encode_chunk

FIXTURES = Path(__file__).parent / "fixtures" / "chunks"

# ---------------------------------------------------------------------------------------------- the decoder

DTYPES = ["uint8", "uint16", "int16", "float16", "float32", "float64"]
PRECISIONS = ["float32", "float16", "bfloat16", "int8", "int16"]
MASKS = ["square", "triangle"]
STORAGE = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "int8": "i1", "int16": "<i2"}


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = memoryview(data), 0

    def get(self, fmt: str) -> tuple:
        layout = struct.Struct("<" + fmt)
        values = layout.unpack_from(self.data, self.pos)
        self.pos += layout.size
        return values


def spec_header(data: bytes) -> dict:
    r = _Reader(data)
    magic, version, dtype, precision, mask, ndim, naxes, flags = r.get("4sBBBBBBH")
    assert magic == b"DCTC" and version == 1, (magic, version)
    h = {"dtype": np.dtype(DTYPES[dtype]), "precision": PRECISIONS[precision], "mask": MASKS[mask],
         "flags": flags, "shape": r.get("I" * ndim), "axes": r.get("B" * naxes), "block": r.get("B" * naxes),
         "keep": r.get("B" * naxes)}
    (n_steps,) = r.get("I")
    if flags & 2:  # compact table: a common step and the bands that differ
        common, differ = r.get("dI")
        steps = np.full(n_steps, common)
        for _ in range(differ):
            band, step = r.get("Id")
            steps[band] = step
    else:
        steps = np.array(r.get("d" * n_steps)) if n_steps else None
    h["steps"] = steps
    (h["n_values"],) = r.get("Q")
    h["offset"] = r.get("d")[0] if flags & 4 else 0.0
    h["payload"] = bytes(data[r.pos:])
    return h


def kept_bands(keep: tuple[int, ...], mask: str) -> list[tuple[int, ...]]:
    """A block's kept bands in C order; the triangle compared exactly."""
    every = itertools.product(*(range(k) for k in keep))
    if mask == "square":
        return list(every)
    return [b for b in every if sum(i * math.prod(keep) // k for i, k in zip(b, keep)) < math.prod(keep)]


def block_groups(h: dict) -> list[dict]:
    """The groups of blocks sharing a shape, in storage order (group number sum_d 2^d * edge_d)."""
    kinds = []  # per transformed axis: (full blocks, or None), (the edge block, or None)
    for axis, b, k in zip(h["axes"], h["block"], h["keep"]):
        length = h["shape"][axis]
        full = (length // b, b, k, 0) if length // b else None
        edge = (1, length % b, math.ceil(length % b * k / b), length // b * b) if length % b else None
        kinds.append((full, edge))
    groups = []
    for number in range(1 << len(kinds)):
        parts = [kinds[d][number >> d & 1] for d in range(len(kinds))]
        if any(p is None for p in parts):
            continue
        by_axis = dict(zip(h["axes"], parts))  # (blocks, width, keep, first sample) along each transformed axis
        grid = tuple(by_axis[a][0] if a in by_axis else n for a, n in enumerate(h["shape"]))
        groups.append({"by_axis": by_axis, "widths": tuple(p[1] for p in parts), "grid": grid,
                       "bands": kept_bands(tuple(p[2] for p in parts), h["mask"])})
    return groups


def unpack_planes(payload: bytes, lengths: list[int], itemsize: int) -> np.ndarray:
    masks = np.frombuffer(payload, dtype=f"<u{itemsize}", count=len(lengths)).astype(np.uint64)
    pos, runs = len(lengths) * itemsize, []
    for n, mask in zip(lengths, masks):
        size = (n + 7) // 8
        zigzag = np.zeros(size * 8, dtype=np.uint64)
        for plane in range(8 * itemsize - 1, -1, -1):
            if int(mask) >> plane & 1:
                bits = np.unpackbits(np.frombuffer(payload, np.uint8, size, pos), bitorder="little")
                zigzag |= bits.astype(np.uint64) << np.uint64(plane)
                pos += size
        z = zigzag[:n].astype(np.int64)
        runs.append((z >> 1) ^ -(z & 1))
    assert pos == len(payload), (pos, len(payload))
    return np.concatenate(runs) if runs else np.zeros(0, np.int64)


def spec_decode(data: bytes) -> np.ndarray:
    """The array one chunk's bytes (the codec's, zstd and crc32c undone) hold."""
    h = spec_header(data)
    groups = block_groups(h)
    step_of = {band: i for i, band in enumerate(kept_bands(h["keep"], h["mask"]))}
    runs = [(g, band) for g, group in enumerate(groups) for band in group["bands"]]
    lengths = [math.prod(groups[g]["grid"]) for g, _ in runs]
    assert sum(lengths) == h["n_values"], (sum(lengths), h["n_values"])
    if h["flags"] & 1:
        values = unpack_planes(h["payload"], lengths, {"int8": 1, "int16": 2}[h["precision"]]).astype(np.float64)
    else:
        stored = np.frombuffer(h["payload"], dtype=STORAGE[h["precision"]])
        if h["precision"] == "bfloat16":
            stored = (stored.astype(np.uint32) << 16).view(np.float32)
        values = stored.astype(np.float64)
    coefficients = [np.zeros(group["grid"] + group["widths"]) for group in groups]
    pos = 0
    for (g, band), n in zip(runs, lengths):
        step = 1.0 if h["steps"] is None else h["steps"][step_of[band]]
        coefficients[g][(Ellipsis, *band)] = (values[pos:pos + n] * step).reshape(groups[g]["grid"])
        pos += n
    out = np.zeros(h["shape"])
    ndim, axes = len(h["shape"]), h["axes"]
    for group, c in zip(groups, coefficients):
        x = idctn(c, type=2, axes=tuple(range(ndim, ndim + len(axes))), norm="ortho")
        order = [i for a in range(ndim) for i in ((a, ndim + axes.index(a)) if a in axes else (a,))]
        region = tuple(slice(p[3], p[3] + p[0] * p[1]) if (p := group["by_axis"].get(a)) else slice(None)
                       for a in range(ndim))
        out[region] = x.transpose(order).reshape(out[region].shape)
    dtype = h["dtype"]
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.clip(np.floor(out + 0.5), info.min, info.max).astype(dtype)
    return out.astype(dtype) + dtype.type(h["offset"])


# ---------------------------------------------------------------------------------------------- the tests


def smooth(shape, dtype, seed=0, lo=0.0, hi=255.0):
    """A smooth field with some texture, scaled to [lo, hi] in ``dtype``."""
    rng = np.random.default_rng(seed)
    grids = np.meshgrid(*(np.linspace(0, 3, n) for n in shape), indexing="ij")
    x = sum(np.sin(g * (1.3 + d) + d) for d, g in enumerate(grids)) + 0.3 * rng.standard_normal(shape)
    x = lo + (hi - lo) * (x - x.min()) / (x.max() - x.min())
    return np.rint(x).astype(dtype) if np.dtype(dtype).kind in "iu" else x.astype(dtype)


CASES = {
    # name: (data, axes, block, keep, mask, precision, step or target_psnr)
    "rgb colour axis, edge blocks": (smooth((3, 13, 21, 3), np.uint8), (1, 2, 3), (8, 8, 3), (8, 8, 3),
                                     "square", "int16", {"target_psnr": 40.0}),
    "rgb triangle int8": (smooth((2, 30, 30, 3), np.uint8), (1, 2, 3), (8, 8, 3), (6, 6, 3), "triangle", "int8",
                          {"target_psnr": 32.0}),
    "grey edge blocks block 4": (smooth((4, 29, 27), np.uint8), (1, 2), (4, 4), (4, 4), "square", "int16",
                                 {"step": 3.0}),
    "grey no full block on one axis": (smooth((2, 6, 19), np.uint8), (1, 2), (8, 8), (7, 5), "triangle",
                                       "float32", {}),
    "grey block 16 triangle": (smooth((2, 40, 37), np.uint8), (1, 2), (16, 16), (12, 12), "triangle", "int16",
                               {"target_psnr": 38.0}),
    "uint16 keep float16": (smooth((3, 20, 20), np.uint16, hi=60000), (1, 2), (4, 4), (3, 3), "square",
                            "float16", {}),
    "int16 data int8 levels": (smooth((3, 17, 24), np.int16, lo=-3000, hi=3000), (1, 2), (8, 8), (8, 8), "square",
                               "int8", {"target_psnr": 35.0}),
    "float32 field, edge blocks in 3-d": (smooth((37, 21, 19), np.float32), (0, 1, 2), (8, 8, 4), (5, 8, 3),
                                          "square", "int16", {"target_psnr": 60.0}),
    "float32 field triangle bfloat16": (smooth((20, 20, 20), np.float32), (0, 1, 2), (8, 8, 8), (5, 5, 5),
                                        "triangle", "bfloat16", {}),
    "float32 far from zero (offset)": (smooth((2, 32, 32), np.float32, lo=101075, hi=101575), (1, 2), (8, 8),
                                       (8, 8), "square", "int16", {"target_psnr": 60.0}),
    "float64": (smooth((3, 24, 20), np.float64, lo=-1e-3, hi=1e-3), (1, 2), (8, 8), (8, 8), "square", "int16",
                {"target_psnr": 90.0}),
    "float16 data": (smooth((3, 16, 24), np.float16, lo=-2, hi=2), (1, 2), (8, 8), (6, 6), "square", "int16",
                     {"target_psnr": 50.0}),
    "4-d stack, blocks per axis": (smooth((2, 9, 14, 16), np.float32), (1, 2, 3), (8, 6, 8), (5, 3, 4), "square",
                                   "float32", {}),
    "transform along axis 0 only": (smooth((30, 5), np.float32), (0,), (16,), (9,), "square", "int16",
                                    {"step": 0.01}),
}


def assert_same_decode(ours: np.ndarray, spec: np.ndarray) -> None:
    assert ours.shape == spec.shape and ours.dtype == spec.dtype
    if ours.dtype.kind in "iu":  # one unit where a value lies within rounding of .5
        differ = ours.astype(np.int64) - spec.astype(np.int64)
        assert np.abs(differ).max(initial=0) <= 1 and np.count_nonzero(differ) <= max(2, ours.size // 1000)
    else:
        scale = float(np.abs(spec.astype(np.float64)).max()) or 1.0
        rtol = {np.float16: 2e-3, np.float32: 4e-6, np.float64: 1e-13}[ours.dtype.type]
        assert np.abs(ours.astype(np.float64) - spec.astype(np.float64)).max() <= rtol * scale


@pytest.mark.parametrize("name", list(CASES))
def test_a_decoder_written_from_the_specification_decodes_like_dctchop(name):
    x, axes, block, keep, mask, precision, target = CASES[name]
    data = encode_chunk(x, ChunkSettings(axes, block, keep, mask, precision, **target))
    assert_same_decode(decode_chunk(data, x.shape, x.dtype), spec_decode(data))


def test_the_cases_cover_every_header_flag_and_precision():
    headers = [spec_header(encode_chunk(x, ChunkSettings(axes, block, keep, mask, precision, **target)))
               for x, axes, block, keep, mask, precision, target in CASES.values()]
    assert {bit for h in headers for bit in (1, 2, 4) if h["flags"] & bit} == {1, 2, 4}
    assert {h["precision"] for h in headers} == set(PRECISIONS)
    assert {h["dtype"] for h in headers} == {np.dtype(t) for t in DTYPES}
    assert {h["mask"] for h in headers} == set(MASKS)


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.chunk")), ids=lambda p: p.stem)
def test_the_specification_decodes_the_format_fixtures(path):
    data = path.read_bytes()
    h = spec_header(data)
    assert_same_decode(decode_chunk(data, h["shape"], h["dtype"]), spec_decode(data))
