"""Chunks encoded by an earlier dctchop (committed bytes) still decode to the committed arrays."""

import math
from pathlib import Path

import numpy as np
import pytest

from dctchop.codec import FORMAT_VERSION, decode_chunk, read_header

CHUNKS = Path(__file__).parent / "fixtures" / "chunks"
NAMES = sorted(p.stem for p in CHUNKS.glob("*.chunk"))


def test_fixtures_present():
    assert len(NAMES) >= 7
    assert int((CHUNKS / "VERSION").read_text()) <= FORMAT_VERSION


def _rounding_flips_allowed(expected: np.ndarray) -> int:
    """How many integer samples may differ by one from the committed decode.

    Samples are rounded from a float32 reconstruction whose last bits depend on the order of its sums (which
    decoders may change: the 8-band kernels sum even and odd bands apart), so a sample within a few float32
    ulps of .5 may round either way. Allowed: the share of samples within 4 ulps of .5 at the largest
    magnitude (up to 3% of 16-bit samples, 0.01% of 8-bit ones), at least one, and at least 0.1% of them.
    """
    ulp = float(np.spacing(np.float32(np.abs(expected.astype(np.float64)).max())))
    return max(1, expected.size // 1000, math.ceil(expected.size * 8 * ulp))


@pytest.mark.parametrize("name", NAMES)
def test_committed_chunk_decodes_as_before(name):
    data = (CHUNKS / f"{name}.chunk").read_bytes()
    expected = np.load(CHUNKS / f"{name}.npy", allow_pickle=False)
    header = read_header(data)
    assert header.shape == expected.shape and header.dtype == expected.dtype
    decoded = decode_chunk(data, expected.shape, expected.dtype)
    assert decoded.dtype == expected.dtype
    if expected.dtype.kind in "iu":
        diff = np.abs(decoded.astype(np.int64) - expected.astype(np.int64))
        assert diff.max() <= 1 and np.count_nonzero(diff) <= _rounding_flips_allowed(expected)
    else:
        np.testing.assert_allclose(decoded, expected, rtol=1e-3 if expected.dtype == np.float16 else 1e-5,
                                   atol=1e-6 * float(np.abs(expected).max()))


@pytest.mark.parametrize("name", ["store_v1", "store_v2", "store_v3", "store_v4"])
def test_committed_store_reads_as_before(name):
    import zarr

    import dctchop
    from dctchop.inspect import inspect_store

    store = CHUNKS.parent / name
    expected = np.load(CHUNKS.parent / f"{name}.npy", allow_pickle=False)
    decoded = zarr.open(str(store), mode="r")["images"][:]
    diff = np.abs(decoded.astype(np.int64) - expected.astype(np.int64))
    assert diff.max() <= 1 and np.count_nonzero(diff) <= max(1, expected.size // 1000)
    np.testing.assert_array_equal(zarr.open(str(store), mode="r")["labels"][:], np.arange(10) % 3)
    report = inspect_store(store, chunks=True)
    images = report["arrays"]["images"]
    assert images["codec"]["format_version"] == 1 and images["target"] == {"kind": "psnr", "value": 35.0}
    assert min(images["chunk_table"]["psnr"]) >= 35.0 - 0.05
    assert zarr.open_group(str(store), mode="r").attrs["note"] == "dctchop store fixture"
    assert zarr.open_group(str(store), mode="r").attrs["dctchop"]["store_format"] == int(name.rsplit("v", 1)[1])
    assert images["damaged_chunks"] == []
    np.testing.assert_array_equal(dctchop.open(store)[:], decoded)  # the loader's own chunk-file reads
