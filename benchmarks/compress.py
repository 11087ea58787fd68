"""End-to-end ``dctchop compress`` throughput and peak memory, next to ``cp`` and the kernel alone.

Makes (once) a smooth float32 image stack of ``--size-gb`` as ``.npy``, reads it once so it sits in the page
cache, then times ``cp`` of the file, ``dctchop compress`` with 1 and 2 workers in turn (under
``/usr/bin/time -v`` for the peak resident memory), the forward transform alone on one chunk in this process,
and (with the default settings) the store's whole codec pipeline on chunks already in memory. Every row
but ``cp`` is the median of ``--repeats`` runs. MB/s are of input bytes (1 MB = 1e6 B).

The codec-pipeline row is the kernel-only figure for the same settings: everything a chunk goes through on
its way to the store (the dctchop codec with its --psnr search and its measuring decode, then zstd and
crc32c), without what the end-to-end run adds: reading the input, creating the files, the metadata, and
the start-up. The start-up row times ``dctchop compress`` of a one-chunk file cut from the same stack: the
interpreter, the imports and numba loading its kernels, a cost every run pays once whatever its size.
The summary gives end to end as a share of the codec pipeline as measured, and with the start-up taken out
(the rate a long run settles at).

The stores are removed only at the end. On ext4 without a journal, as on our benchmark machines, creating
a file first skips every inode freed in the last 60 to 360 seconds, one buffer-cache lookup each: right after
removing a store of a few thousand files, each new file costs about 0.5 ms instead of about 30 us, and a
run's time shifts by a second or more. Run it again only a few minutes after the last one (or after
removing many files) to measure the steady state.

    .venv/bin/python benchmarks/compress.py --size-gb 2 [--dir /tmp/dctchop-bench] [-- extra compress options]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dctchop.codec import encode_and_measure
from dctchop.formats import open_source
from dctchop.store import CompressOptions, _stored_bytes, plan_array, scan_values
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
    run = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t
    if run.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{run.stderr[-2000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr).group(1))
    return seconds, rss_kb / 1024


def median_seconds(run, repeats: int) -> float:
    """The median of ``repeats`` timings of ``run()``."""
    seconds = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - t)
    return statistics.median(seconds)


def kernel_only(path: Path, chunk_samples: int, threads: int, repeats: int) -> float:
    """MB/s of the forward transform alone on one chunk in memory, the median of ``repeats`` timings."""
    data = np.load(path, mmap_mode="r")
    chunk = np.array(data[:chunk_samples])
    plan = make_plan(chunk.shape, (1, 2), 8, 8)
    forward(chunk, plan, threads)

    def five():
        for _ in range(5):
            forward(chunk, plan, threads)

    return 5 * chunk.nbytes / 1e6 / median_seconds(five, repeats)


def codec_only(path: Path, threads: int, repeats: int, n_chunks: int = 32) -> float:
    """MB/s of the store's whole codec pipeline on (up to ``n_chunks``) chunks already in memory, with the
    settings ``dctchop compress`` picks by default: the dctchop codec's transform, step search, quantization,
    bit planes and exact error check (:func:`dctchop.codec.encode_and_measure`), then zstd and crc32c; chunks
    shared among ``threads`` like ``--workers``; the median of ``repeats`` timings. What the end-to-end run
    adds on top is reading the input, writing files and metadata, and the start-up."""
    source = open_source(str(path))
    plan = plan_array(source, source.lossy[0], CompressOptions())
    with ThreadPoolExecutor(max_workers=1) as pool:
        scan_values(plan, pool)
    whole = range(0, plan.source.shape[0] - plan.chunks[0] + 1, plan.chunks[0])  # starts of the full chunks
    chunks = [plan.source.read(s, s + plan.chunks[0]) for s in whole[:n_chunks]]

    def encode(chunk):
        return _stored_bytes(encode_and_measure(chunk, plan.settings)[0])

    encode(chunks[0])
    with ThreadPoolExecutor(threads) as pool:
        seconds = median_seconds(lambda: list(pool.map(encode, chunks)), repeats)
    return sum(c.nbytes for c in chunks) / 1e6 / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/dctchop-bench"))
    parser.add_argument("--repeats", type=int, default=3, help="runs of each row; the tables give medians")
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

    copy = args.dir / "copy.npy"
    seconds, rss = timed(["cp", str(src), str(copy)])
    copy.unlink()
    rows = [("cp", [seconds], [rss], size)]  # (what, seconds and peak RSS of each run, bytes its MB/s are of)
    one_chunk = args.dir / "one-chunk.npy"
    np.save(one_chunk, np.load(src, mmap_mode="r")[:chunk_samples])
    one_chunk_mb = one_chunk.stat().st_size / 1e6
    jobs = {"1": (src, 1), "2": (src, 2), "start-up": (one_chunk, 1)}  # kind -> (input, workers)
    outputs = [(kind, args.dir / f"out-{k}-{kind}.zarr") for k in range(args.repeats) for kind in jobs]
    runs = {kind: ([], []) for kind in jobs}  # kind -> (seconds, peak RSS) of each run
    try:
        for _, out in outputs:
            shutil.rmtree(out, ignore_errors=True)
        for kind, out in outputs:  # 1 worker, 2 workers and the start-up alternate
            path, workers = jobs[kind]
            seconds, rss = timed([dctchop, "compress", str(path), str(out), "--quiet", "--workers", str(workers),
                                  *args.extra])
            runs[kind][0].append(seconds)
            runs[kind][1].append(rss)
        stored = sum(f.stat().st_size for f in outputs[0][1].rglob("*") if f.is_file())
    finally:  # removed only now: see the module docstring
        for _, out in outputs:
            shutil.rmtree(out, ignore_errors=True)
        one_chunk.unlink()
    for workers in (1, 2):
        rows.append((f"dctchop compress, {workers} worker(s), ratio {size / stored:.2f}", *runs[str(workers)], size))
    rows.append((f"start-up: dctchop compress of one chunk ({one_chunk_mb:.1f} MB)", *runs["start-up"], None))

    print(f"# dctchop compress end to end\n\ninput {src.name}: {size / 1e9:.2f} GB float32 {IMAGE} images, "
          f"in the page cache; options: {' '.join(args.extra) or '(defaults: --psnr 60)'}; "
          f"{os.cpu_count()} CPUs; medians of {args.repeats} runs\n")
    print("| what | seconds | MB/s | peak RSS MB |\n|---|---|---|---|")
    for name, seconds, rss, nbytes in rows:
        median = statistics.median(seconds)
        mbs = "" if nbytes is None else f"{nbytes / 1e6 / median:.0f}"
        print(f"| {name} | {median:.2f} | {mbs} | {max(rss):.0f} |")
    forward_mbs = {threads: kernel_only(src, chunk_samples, threads, args.repeats) for threads in (1, 2)}
    for threads, mbs in forward_mbs.items():
        print(f"| forward kernel only, {threads} thread(s), block 8 keep 8 | | {mbs:.0f} | |")
    codec_mbs = {}
    if not args.extra:  # the codec row uses the default settings only
        codec_mbs = {threads: codec_only(src, threads, args.repeats) for threads in (1, 2)}
        for threads, mbs in codec_mbs.items():
            print(f"| codec pipeline in memory (dctchop + zstd + crc32c, default settings), {threads} thread(s) | | "
                  f"{mbs:.0f} | |")
    print(f"\nchunk = {chunk_samples} images = {chunk_samples * 4 * IMAGE[0] * IMAGE[1] / 1e6:.1f} MB of input\n")
    start_up = statistics.median(runs["start-up"][0])
    for workers in (1, 2):
        seconds = statistics.median(runs[str(workers)][0])
        mbs, settled = size / 1e6 / seconds, size / 1e6 / (seconds - start_up)
        against = [f"{mbs / forward_mbs[workers]:.0%} of the forward kernel"]
        if codec_mbs:
            against[:0] = [f"{mbs / codec_mbs[workers]:.0%} of the codec pipeline in memory",
                           f"{settled / codec_mbs[workers]:.0%} without the {start_up:.2f} s start-up"]
        print(f"end to end, {workers} worker(s): {', '.join(against)} (on as many threads)")


if __name__ == "__main__":
    main()
