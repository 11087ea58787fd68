"""Reading a store by index: ``ds[i]`` in order and in random order, and random batches by fancy index.

This is how a map-style torch ``Dataset`` (``__getitem__`` per sample, a shuffling sampler) or a notebook
reads a store; :class:`dctchop.Loader` is the fast way to shuffle for training (``benchmarks/loader.py``).

Data: the bundled 32x32 RGB sample grown to ``--images`` distinct images (uint8 NHWC, with its labels;
augmented copies, see ``sample_images.py``) and ``--fields`` float32 32³ volumes cut from the bundled 64³
field, each compressed with the defaults (``--psnr 40`` / ``--psnr 60``), and the images once more with
``--chunk-samples 64``. By default both are bigger decoded (200
and 270 MB) than what a view keeps decoded, and their chunks' checked bytes (110 and 45 MB) fit in what it
keeps of those (see :class:`dctchop.dataset.ArrayView`), as for CIFAR-10. For each store and path, each round
opens the store afresh (nothing kept) and reads for about ``--seconds`` seconds: samples/s is the median over
``--rounds`` rounds. Random reads draw indices with replacement from the whole array; the first read of a
chunk costs its zstd and crc32c.

Run from the repository root (the ``dctchop`` it imports is the one measured: put another checkout first on
``PYTHONPATH`` to measure that one)::

    .venv/bin/python benchmarks/random_access.py [--images 65536] [--fields 2048] [--seconds 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
from sample_images import image_stack

import dctchop
from dctchop.formats import open_source
from dctchop.store import CompressOptions, compress

ROOT = Path(__file__).resolve().parents[1]
BATCH = 256


def make_stores(tmp: Path, n_images: int, n_fields: int) -> dict[str, Path]:
    images, labels = image_stack(n_images)
    with h5py.File(tmp / "images.h5", "w") as f:
        f["images"], f["labels"] = images, labels
    field = np.load(ROOT / "sample_data/field.npy")
    shifts = np.random.default_rng(0).integers(0, 64, size=(n_fields, 3))
    fields = np.stack([np.roll(field, tuple(s), axis=(0, 1, 2))[:32, :32, :32] for s in shifts])
    np.save(tmp / "fields.npy", fields)
    stores = {}
    for name, src, options in (("images", "images.h5", CompressOptions()),
                               ("images, --chunk-samples 64", "images.h5", CompressOptions(chunk_samples=64)),
                               ("fields", "fields.npy", CompressOptions())):
        stores[name] = tmp / f"{len(stores)}.zarr"
        compress(open_source(str(tmp / src)), stores[name], options)
    return stores


def rate(store: Path, read, seconds: float) -> float:
    """Samples per second of ``read(ds, k)`` (the k-th read; returns how many samples it read) on a freshly
    opened store, reading for about ``seconds``."""
    ds = dctchop.open(store)
    n, k, start = 0, 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        n += read(ds, k)
        k += 1
    return n / elapsed


def paths(n: int) -> dict:
    order = np.random.default_rng(1).integers(0, n, size=1 << 20)

    def in_order(ds, k):
        ds[k % n]
        return 1

    def random_order(ds, k):
        ds[int(order[k % order.size])]
        return 1

    def random_batch(ds, k):
        ds[np.sort(order[(k * BATCH) % order.size :][:BATCH])]
        return BATCH

    return {"ds[i], in order": in_order, "ds[i], random order": random_order,
            f"ds[idx], random batches of {BATCH}": random_batch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=65536)
    parser.add_argument("--fields", type=int, default=2048)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dctchop-bench-"))
    try:
        stores = make_stores(tmp, args.images, args.fields)
        print(f"dctchop {dctchop.__version__} from {Path(dctchop.__file__).parent}; median of {args.rounds} rounds "
              f"of {args.seconds:g} s\n")
        print("| store | path | samples/s |")
        print("|---|---|---:|")
        for name, store in stores.items():
            n = len(dctchop.open(store))
            for path, read in paths(n).items():
                rates = [rate(store, read, args.seconds) for _ in range(args.rounds)]
                print(f"| {name} | {path} | {statistics.median(rates):,.0f} |", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
