"""First-run time of the command line: what a new install pays while numba compiles the kernels it needs.

numba compiles each kernel on its first use and caches it next to the package (or in ``NUMBA_CACHE_DIR``), so
the first ``dctchop compress`` after installing, and the first of each kind of data, takes seconds longer
than the ones after. For each case this runs ``dctchop compress`` and then ``dctchop decompress`` of the
store in fresh processes: with an empty ``NUMBA_CACHE_DIR`` (cold: everything compiled), and again with that
directory (warm: loaded from it). Each dtype takes kernels of its own, so the cases are:

* ``images``: ``sample_data/images.h5`` (uint8 32x32 RGB and labels);
* ``field float32``: ``sample_data/field.npy`` (64³);
* ``field uint16``, ``field float64``: the same field scaled to 1000-61000 and cast, and cast.

Figures are wall seconds of the whole command (interpreter start, imports, the work), the median of
``--repeats`` rounds; the input is tiny, so what is left warm is start-up.

Run from the repository root::

    .venv/bin/python benchmarks/first_run.py [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DCTCHOP = Path(sys.executable).parent / "dctchop"


def make_inputs(folder: Path) -> dict[str, Path]:
    field = np.load(ROOT / "sample_data/field.npy")
    scaled = (field - field.min()) / (field.max() - field.min()) * 60000 + 1000
    np.save(folder / "field_uint16.npy", np.round(scaled).astype(np.uint16))
    np.save(folder / "field_float64.npy", field.astype(np.float64))
    return {"images": ROOT / "sample_data/images.h5", "field float32": ROOT / "sample_data/field.npy",
            "field uint16": folder / "field_uint16.npy", "field float64": folder / "field_float64.npy"}


def timed(args: list, cache_dir: str) -> float:
    """Seconds of ``dctchop ARGS`` in a new process with ``NUMBA_CACHE_DIR=cache_dir``."""
    start = time.perf_counter()
    subprocess.run([str(DCTCHOP), *map(str, args)], env={**os.environ, "NUMBA_CACHE_DIR": cache_dir},
                   check=True, capture_output=True)
    return time.perf_counter() - start


def measure(source: Path, folder: Path) -> dict[str, float]:
    """Compress and decompress ``source``: cold, then warm."""
    store, restored = folder / "store.zarr", folder / f"restored{source.suffix}"
    with tempfile.TemporaryDirectory(prefix="dctchop-numba-") as compress_cache, \
            tempfile.TemporaryDirectory(prefix="dctchop-numba-") as decompress_cache:
        times = {"compress cold": timed(["compress", source, store, "--overwrite", "--quiet"], compress_cache),
                 "compress warm": timed(["compress", source, store, "--overwrite", "--quiet"], compress_cache)}
        # the decode's kernels alone: a cache the compress did not fill
        for kind in ("cold", "warm"):
            times[f"decompress {kind}"] = timed(["decompress", store, restored, "--overwrite"], decompress_cache)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="rounds per case (median)")
    args = parser.parse_args()
    print(f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"median of {args.repeats} round(s), wall seconds\n")
    with tempfile.TemporaryDirectory(prefix="dctchop-first-run-") as tmp:
        folder = Path(tmp)
        sources = make_inputs(folder)
        rounds: dict[str, list[dict[str, float]]] = {case: [] for case in sources}
        for _ in range(args.repeats):
            for case, source in sources.items():  # the cases in turns, round by round
                rounds[case].append(measure(source, folder))
    columns = ("compress cold", "compress warm", "decompress cold", "decompress warm")
    print("| case | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for case, results in rounds.items():
        cells = [f"{statistics.median(r[c] for r in results):.1f}" for c in columns]
        print(f"| {case} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
