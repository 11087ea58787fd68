"""Stores written by zarr 3.1.x (Python 3.11) and zarr >= 3.2 (Python 3.12+) read each other.

`make test` builds `.venv312` (Python 3.12, the newest zarr) and passes its interpreter in
DCTCHOP_OTHER_PYTHON. Under CI the test fails rather than skips when that interpreter is missing.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import zarr

from dctchop.codec import DctChopCodec

OTHER = os.environ.get("DCTCHOP_OTHER_PYTHON")

WRITE = """
import sys, numpy as np, zarr
from zarr.codecs import ZstdCodec, Crc32cCodec
from dctchop.codec import DctChopCodec
path = sys.argv[1]
x = np.load(path + ".npy")
g = zarr.open_group(path, mode="w")
a = g.create_array("data", shape=x.shape, chunks=(16,) + x.shape[1:], dtype=x.dtype,
                   serializer=DctChopCodec(axes=(1, 2), block=(8, 8), keep=(8, 8), precision="int8", target_psnr=40.0),
                   compressors=[ZstdCodec(level=3), Crc32cCodec()], fill_value=0)
a[:] = x
"""

READ = """
import sys, json, numpy as np, zarr
path = sys.argv[1]
y = zarr.open(path, mode="r")["data"][:]
np.save(path + ".decoded.npy", y)
"""

VERSIONS = "import json, sys, zarr; print(json.dumps([zarr.__version__, sys.version.split()[0]]))"


def _other_python():
    if OTHER is None:
        if os.environ.get("CI"):
            pytest.fail("DCTCHOP_OTHER_PYTHON is not set: run the suite with `make test`")
        pytest.skip("DCTCHOP_OTHER_PYTHON not set (make test sets it)")
    return OTHER


def _run(python, code, *args):
    out = subprocess.run([python, "-c", code, *args], check=True, capture_output=True, text=True)
    return out.stdout


@pytest.fixture
def images():
    rng = np.random.default_rng(7)
    base = rng.normal(size=(40, 1, 1)) * 20 + 120
    ramp = np.linspace(-40, 40, 28)
    return (base + ramp[None, :, None] + ramp[None, None, :] + rng.normal(size=(40, 28, 28)) * 3).clip(0, 255) \
        .astype(np.uint8)


@pytest.mark.parametrize("writer_is_other", [True, False], ids=["newer-writes", "this-writes"])
def test_cross_version_round_trip(tmp_path, images, writer_is_other):
    other = _other_python()
    path = str(tmp_path / "store.zarr")
    np.save(path + ".npy", images)
    writer, reader = (other, sys.executable) if writer_is_other else (sys.executable, other)
    _run(writer, WRITE, path)
    _run(reader, READ, path)
    other_zarr, other_python = json.loads(_run(other, VERSIONS))
    # the two interpreters really run different zarr releases and Pythons
    assert other_zarr != zarr.__version__ and other_python != sys.version.split()[0]
    decoded_by_reader = np.load(path + ".decoded.npy")
    decoded_here = zarr.open(path, mode="r")["data"][:]
    np.testing.assert_array_equal(decoded_by_reader, decoded_here)
    mse = np.mean((decoded_here.astype(float) - images) ** 2)
    assert 10 * np.log10(255**2 / mse) >= 40.0 - 0.05
    with open(os.path.join(path, "data", "zarr.json")) as f:
        meta = json.load(f)
    assert DctChopCodec.from_dict(meta["codecs"][0]).target_psnr == 40.0


COMPRESS = "import sys; from dctchop.formats import open_source; from dctchop.store import compress; " \
           "compress(open_source(sys.argv[1]), sys.argv[2])"
READ_RECORDS = "import sys, numpy as np, dctchop; ds = dctchop.open(sys.argv[1]); " \
               "[np.save(f'{sys.argv[1]}.{n}.npy', ds[n][:]) for n in ('rec', 'blob')]"


@pytest.mark.parametrize("writer_is_other", [True, False], ids=["newer-writes", "this-writes"])
def test_records_cross_versions(tmp_path, images, writer_is_other):
    """HDF5 compound and opaque data (zarr 3.4 wrote structs that zarr 3.1 could not open) travel as bytes."""
    import h5py

    other = _other_python()
    rec = np.zeros(40, dtype=[("v", "<f4", (3,)), ("n", [("x", "u1"), ("y", "<i2")])])
    rec["v"], rec["n"]["y"] = np.arange(120).reshape(40, 3), -np.arange(40)
    blob = np.array([np.void(bytes([i] * 8)) for i in range(40)])
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["images"], f["rec"], f["blob"] = images, rec, blob
    store = str(tmp_path / "s.zarr")
    writer, reader = (other, sys.executable) if writer_is_other else (sys.executable, other)
    _run(writer, COMPRESS, str(tmp_path / "in.h5"), store)
    _run(reader, READ_RECORDS, store)
    for name, want in (("rec", rec), ("blob", blob)):
        got = np.load(f"{store}.{name}.npy")
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


READ_SHAPES = "import sys, json, dctchop; ds = dctchop.open(sys.argv[1]); " \
              "print(json.dumps({n: [list(ds[n][:].shape), str(ds[n].dtype)] for n in ('wide', 'long')}))"


@pytest.mark.parametrize("writer_is_other", [True, False], ids=["newer-writes", "this-writes"])
def test_empty_copies_cross_versions(tmp_path, images, writer_is_other):
    """Empty copies with a zero-length axis after the first: zarr >= 3.2 refuses chunks of length 0."""
    import h5py

    other = _other_python()
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["images"], f["wide"], f["long"] = images, np.zeros((5, 0), np.int32), np.zeros((0, 3), np.uint8)
    store = str(tmp_path / "s.zarr")
    writer, reader = (other, sys.executable) if writer_is_other else (sys.executable, other)
    _run(writer, COMPRESS, str(tmp_path / "in.h5"), store)
    assert json.loads(_run(reader, READ_SHAPES, store)) == {"wide": [[5, 0], "int32"], "long": [[0, 3], "uint8"]}
