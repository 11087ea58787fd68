"""End-to-end ``dctchop compress`` throughput and peak memory, next to ``cp`` and the kernel alone.

Makes (once) a smooth float32 image stack of ``--size-gb`` as ``.npy``, reads it once so it sits in the page
cache, then times ``cp`` of the file, ``dctchop compress`` with 1 and 2 workers (under ``/usr/bin/time -v``
for the peak resident memory), the forward transform alone on the same chunks in this process, and (with
the default settings) the codec's whole per-chunk work on chunks already in memory.
MB/s are of input bytes (1 MB = 1e6 B).

    .venv/bin/python benchmarks/compress.py --size-gb 2 [--dir /tmp/dctchop-bench] [-- extra compress options]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dctchop.codec import encode_and_measure
from dctchop.formats import open_source
from dctchop.store import CompressOptions, plan_array, scan_float
from dctchop.transform import forward, make_plan

IMAGE = (128, 256)


def make_input(path: Path, size_gb: float) -> None:
    n = int(size_gb * 1e9 / (4 * IMAGE[0] * IMAGE[1]))
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, *IMAGE))
    y, x = np.meshgrid(np.linspace(0, 6, IMAGE[0]), np.linspace(0, 6, IMAGE[1]), indexing="ij")
    rng = np.random.default_rng(0)
    for s in range(0, n, 256):
        e = min(s + 256, n)
        phase = rng.uniform(0, 6, size=(e - s, 1, 1))
        out[s:e] = np.sin(x + phase) * np.cos(y * 1.3 - phase) + 0.01 * rng.standard_normal((e - s, *IMAGE))
    out.flush()


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def timed(cmd: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of a command run under /usr/bin/time -v."""
    t = time.perf_counter()
    run = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if run.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{run.stderr[-2000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr).group(1))
    return seconds, rss_kb / 1024


def kernel_only(path: Path, chunk_samples: int, threads: int) -> float:
    """MB/s of the forward transform alone over the file's chunks (data already in memory per chunk)."""
    data = np.load(path, mmap_mode="r")
    chunk = np.array(data[:chunk_samples])
    plan = make_plan(chunk.shape, (1, 2), 8, 8)
    forward(chunk, plan, threads)
    t = time.perf_counter()
    for _ in range(5):
        forward(chunk, plan, threads)
    return 5 * chunk.nbytes / 1e6 / (time.perf_counter() - t)


def codec_only(path: Path, threads: int, n_chunks: int = 16) -> float:
    """MB/s of the codec's own work on chunks already in memory, with the settings ``dctchop compress`` picks
    by default: transform, step search, quantization, bit planes and the exact error check of each chunk
    (:func:`dctchop.codec.encode_and_measure`), chunks shared among ``threads`` like ``--workers``. What the
    end-to-end run adds on top is reading, zstd + crc32c, files and metadata."""
    source = open_source(str(path))
    plan = plan_array(source, source.lossy[0], CompressOptions())
    scan_float(plan)
    chunks = [plan.source.read(s, s + plan.chunks[0]) for s in range(0, n_chunks * plan.chunks[0], plan.chunks[0])]
    encode_and_measure(chunks[0], plan.settings)

    def encode(chunk):
        return encode_and_measure(chunk, plan.settings)

    with ThreadPoolExecutor(threads) as pool:
        t = time.perf_counter()
        list(pool.map(encode, chunks))
        seconds = time.perf_counter() - t
    return sum(c.nbytes for c in chunks) / 1e6 / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/dctchop-bench"))
    parser.add_argument("extra", nargs="*", help="extra options for dctchop compress (after --)")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    src = args.dir / f"stack-{args.size_gb:g}gb.npy"
    if not src.exists():
        make_input(src, args.size_gb)
    size = src.stat().st_size
    warm(src)
    dctchop = str(Path(sys.executable).parent / "dctchop")
    chunk_samples = max(1, (4 << 20) // (4 * IMAGE[0] * IMAGE[1]))

    rows = []
    copy = args.dir / "copy.npy"
    seconds, rss = timed(["cp", str(src), str(copy)])
    copy.unlink()
    rows.append(("cp", seconds, rss))
    for workers in (1, 2):
        out = args.dir / "out.zarr"
        shutil.rmtree(out, ignore_errors=True)
        seconds, rss = timed([dctchop, "compress", str(src), str(out), "--quiet", "--workers", str(workers),
                              *args.extra])
        stored = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        rows.append((f"dctchop compress, {workers} worker(s), ratio {size / stored:.2f}", seconds, rss))
        shutil.rmtree(out, ignore_errors=True)

    print(f"# dctchop compress end to end\n\ninput {src.name}: {size / 1e9:.2f} GB float32 {IMAGE} images, "
          f"in the page cache; options: {' '.join(args.extra) or '(defaults: --psnr 60)'}; "
          f"{os.cpu_count()} CPUs\n")
    print("| what | seconds | MB/s | peak RSS MB |\n|---|---|---|---|")
    for name, seconds, rss in rows:
        print(f"| {name} | {seconds:.2f} | {size / 1e6 / seconds:.0f} | {rss:.0f} |")
    for threads in (1, 2):
        print(f"| forward kernel only, {threads} thread(s), block 8 keep 8 | | "
              f"{kernel_only(src, chunk_samples, threads):.0f} | |")
    if not args.extra:  # the codec row uses the default settings only
        for threads in (1, 2):
            print(f"| codec encode in memory (default settings), {threads} thread(s) | | "
                  f"{codec_only(src, threads):.0f} | |")
    print(f"\nchunk = {chunk_samples} images = {chunk_samples * 4 * IMAGE[0] * IMAGE[1] / 1e6:.1f} MB of input")


if __name__ == "__main__":
    main()
