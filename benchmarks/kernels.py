"""Throughput of the dctchop transform kernels, against a plain scipy.fft reference and memcpy.

What it measures, on an image stack ``(N, 32, 32)`` transformed over axes (1, 2) with 8x8 blocks and the
square mask, for float32 and uint8 data (same element count; the float32 stack is ``--size-mb`` MB):

* ``forward`` (image -> coefficient image) and ``inverse`` (coefficient image -> image of the original
  dtype) throughput with 1 and 2 threads, for keep 2, 4 and 8;
* the same transform done with ``scipy.fft.dctn`` / ``idctn`` (norm="ortho") on the array reshaped to
  ``(N, H/8, 8, W/8, 8)``, with ``workers`` equal to the thread count: forward casts to float32, transforms
  axes (2, 4) and keeps the top-left k x k; inverse zero-pads to 8 x 8, transforms back, reshapes and casts
  (round and clip for uint8);
* ``np.copyto`` of the same array, as a memory-bandwidth ceiling;
* the first forward and inverse call in a new Python process, where numba compiles the kernels or loads
  them from its on-disk cache: with the cache as found, with an empty ``NUMBA_CACHE_DIR`` (cold compile)
  and with that directory again once populated (warm cache).

Throughput is MB/s of ORIGINAL data (1 MB = 1e6 bytes) for both directions: the size of the image, not of
the coefficients. Each figure is the median of ``--repeats`` timed runs after one warm-up run; the four
implementations are timed in interleaved rounds so that load changes on a shared machine hit them alike.
Before any number is reported, every case checks that dctchop and scipy agree (coefficients and
reconstruction) and aborts if they do not.

Run from the repository root::

    .venv/bin/python benchmarks/kernels.py [--size-mb 64] [--repeats 5] [--threads 1 2] [--keep 2 4 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial

import numba
import numpy as np
import scipy
import scipy.fft

from dctchop import transform
from dctchop.transform import forward, inverse, make_plan

BLOCK = 8
IMAGE = (32, 32)
AXES = (1, 2)
DTYPES = ("float32", "uint8")
KERNELS = ("_forward_3d", "_forward_tiled", "_forward_rows8", "_inverse_3d", "_inverse_tiled", "_inverse_rows8")
FIRST_CALL_IMAGES = 8  # a tiny stack: the first call's time is then all compiling or cache loading
# both work in float32 and differ by its rounding (~3e-7 relative); a wrong transform is off by far more
COEFFICIENT_RTOL = 1e-5
FLOAT_RECONSTRUCTION_RTOL = 1e-5
INTEGER_RECONSTRUCTION_ATOL = 1  # round-half-up (dctchop) vs half-to-even (numpy) on float32 values


# ---------------------------------------------------------------------------------------------- reference


def scipy_forward(x: np.ndarray, keep: int, workers: int) -> np.ndarray:
    n, h, w = x.shape
    blocks = x.astype(np.float32, copy=False).reshape(n, h // BLOCK, BLOCK, w // BLOCK, BLOCK)
    coefficients = scipy.fft.dctn(blocks, axes=(2, 4), norm="ortho", workers=workers)
    return coefficients[:, :, :keep, :, :keep].reshape(n, h // BLOCK * keep, w // BLOCK * keep)


def scipy_inverse(coefficients: np.ndarray, keep: int, dtype: np.dtype, workers: int) -> np.ndarray:
    n, hk, wk = coefficients.shape
    hb, wb = hk // keep, wk // keep
    padded = np.zeros((n, hb, BLOCK, wb, BLOCK), dtype=np.float32)
    padded[:, :, :keep, :, :keep] = coefficients.reshape(n, hb, keep, wb, keep)
    image = scipy.fft.idctn(padded, axes=(2, 4), norm="ortho", workers=workers).reshape(
        n, hb * BLOCK, wb * BLOCK
    )
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.clip(np.rint(image), info.min, info.max).astype(dtype)
    return image.astype(dtype, copy=False)


# ---------------------------------------------------------------------------------------------- checks


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def check_case(label: str, x, ours_c, ref_c, ours_x, ref_x) -> None:
    """Abort the benchmark when dctchop and the scipy reference disagree."""
    failures = []
    if ours_c.shape != ref_c.shape:
        failures.append(f"coefficient shapes {ours_c.shape} vs {ref_c.shape}")
    else:
        diff, tol = max_abs_diff(ours_c, ref_c), COEFFICIENT_RTOL * float(np.max(np.abs(ref_c)))
        if not diff <= tol:
            failures.append(f"coefficients differ by {diff:.3g} > {tol:.3g}")
    if ours_x.dtype != x.dtype or ours_x.shape != x.shape:
        failures.append(f"reconstruction is {ours_x.dtype}{ours_x.shape}, expected {x.dtype}{x.shape}")
    else:
        if x.dtype.kind in "iu":
            tol = INTEGER_RECONSTRUCTION_ATOL
        else:
            tol = FLOAT_RECONSTRUCTION_RTOL * float(np.max(np.abs(x)))
        diff = max_abs_diff(ours_x, ref_x)
        if not diff <= tol:
            failures.append(f"reconstructions differ by {diff:.3g} > {tol:.3g}")
    if failures:
        raise SystemExit(
            f"CORRECTNESS CHECK FAILED for {label}: " + "; ".join(failures) + " - no numbers reported"
        )


# ---------------------------------------------------------------------------------------------- timing


def make_input(dtype: str, n_images: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    shape = (n_images, *IMAGE)
    if dtype == "uint8":
        return rng.integers(0, 256, size=shape, dtype=np.uint8)
    return rng.standard_normal(shape, dtype=np.float32)


def median_seconds(functions: dict, repeats: int) -> tuple[dict, dict]:
    """Warm-up outputs and median seconds of each function, timed in interleaved rounds."""
    outputs = {name: f() for name, f in functions.items()}
    times = {name: [] for name in functions}
    for _ in range(repeats):
        for name, f in functions.items():
            start = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - start)
    return outputs, {name: statistics.median(t) for name, t in times.items()}


def throughput_rows(args, n_images: int) -> list[tuple]:
    rows = []
    for dtype in DTYPES:
        x = make_input(dtype, n_images)
        mb = x.nbytes / 1e6
        for keep in args.keep:
            plan = make_plan(x.shape, AXES, block=BLOCK, keep=keep, mask="square")
            coefficients = forward(x, plan)
            reference = scipy_forward(x, keep, workers=1)
            for threads in args.threads:
                outputs, seconds = median_seconds(
                    {
                        "fwd": partial(forward, x, plan, threads=threads),
                        "inv": partial(inverse, coefficients, plan, x.dtype, threads=threads),
                        "scipy fwd": partial(scipy_forward, x, keep, workers=threads),
                        "scipy inv": partial(scipy_inverse, reference, keep, x.dtype, workers=threads),
                    },
                    args.repeats,
                )
                label = f"{dtype} keep {keep} threads {threads}"
                check_case(
                    label, x, outputs["fwd"], outputs["scipy fwd"], outputs["inv"], outputs["scipy inv"]
                )
                rows.append((dtype, keep, threads, *(mb / seconds[name] for name in outputs)))
                print(f"  measured {label}", file=sys.stderr, flush=True)
    return rows


def memcpy_rows(args, n_images: int) -> list[tuple]:
    rows = []
    for dtype in DTYPES:
        x = make_input(dtype, n_images)
        destination = np.empty_like(x)
        _, seconds = median_seconds({"copy": partial(np.copyto, destination, x)}, args.repeats)
        rows.append((dtype, x.nbytes / 1e6, x.nbytes / 1e6 / seconds["copy"]))
    return rows


# ---------------------------------------------------------------------------------------------- first call


def first_call(dtype: str) -> dict:
    """Run in a new process: time the first forward and inverse call and count numba cache hits/misses."""
    x = make_input(dtype, FIRST_CALL_IMAGES)
    plan = make_plan(x.shape, AXES, block=BLOCK, keep=4, mask="square")
    start = time.perf_counter()
    coefficients = forward(x, plan)
    forward_s = time.perf_counter() - start
    start = time.perf_counter()
    inverse(coefficients, plan, x.dtype)
    inverse_s = time.perf_counter() - start
    stats = [getattr(transform, name).stats for name in KERNELS]
    return {
        "forward_s": forward_s,
        "inverse_s": inverse_s,
        "hits": sum(sum(s.cache_hits.values()) for s in stats),
        "misses": sum(sum(s.cache_misses.values()) for s in stats),
    }


def first_call_in_new_process(dtype: str, cache_dir: str | None) -> dict:
    env = dict(os.environ)
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    done = subprocess.run(
        [sys.executable, __file__, "--first-call", dtype], env=env, check=True, capture_output=True, text=True
    )
    return json.loads(done.stdout)


def first_call_rows() -> list[tuple]:
    """As found (the cache a user has now), then cold and warm in a fresh NUMBA_CACHE_DIR."""
    rows = []
    for dtype in DTYPES:
        rows.append((dtype, "default cache, as found", first_call_in_new_process(dtype, None)))
        with tempfile.TemporaryDirectory(prefix="dctchop-numba-") as cache_dir:
            rows.append((dtype, "empty NUMBA_CACHE_DIR (cold)", first_call_in_new_process(dtype, cache_dir)))
            rows.append((dtype, "same dir again (warm)", first_call_in_new_process(dtype, cache_dir)))
    return rows


# ---------------------------------------------------------------------------------------------- output


def table(header: tuple[str, ...], rows: list[tuple]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def cache_state(result: dict) -> str:
    hits, misses = result["hits"], result["misses"]
    state = "warm" if misses == 0 else ("cold" if hits == 0 else "partly warm")
    return f"{state} ({hits} loaded, {misses} compiled)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=64.0, help="float32 stack size in MB (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (default 5)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts (default 1 2)")
    parser.add_argument("--keep", type=int, nargs="+", default=[2, 4, 8], help="kept coefficients per axis")
    parser.add_argument("--first-call", choices=DTYPES, help=argparse.SUPPRESS)  # the subprocess' entry point
    args = parser.parse_args()
    if args.first_call:
        print(json.dumps(first_call(args.first_call)))
        return

    # first: the default cache must be measured as found, before this process fills it
    first_rows = first_call_rows()
    n_images = max(1, round(args.size_mb * 1e6 / (4 * IMAGE[0] * IMAGE[1])))  # float32 is 4 bytes
    rows = throughput_rows(args, n_images)
    copies = memcpy_rows(args, n_images)

    print("# dctchop kernel throughput\n")
    print(
        f"python {platform.python_version()}, numpy {np.__version__}, scipy {scipy.__version__}, "
        f"numba {numba.__version__}, {os.cpu_count()} CPUs ({platform.machine()})  \n"
        f"stack ({n_images}, {IMAGE[0]}, {IMAGE[1]}), axes {AXES}, block {BLOCK}, square mask; "
        f"median of {args.repeats} runs after 1 warm-up; MB/s of original data (1 MB = 1e6 B)  \n"
        "scipy: dctn/idctn norm='ortho' on (N, H/8, 8, W/8, 8) blocks, workers = threads\n"
    )
    print("## Throughput\n")
    print(
        table(
            ("dtype", "keep", "threads", "forward MB/s", "inverse MB/s", "scipy fwd MB/s", "scipy inv MB/s"),
            [(d, k, t, *(f"{v:.0f}" for v in values)) for d, k, t, *values in rows],
        )
    )
    print("\nAll cases checked against scipy: coefficients and reconstructions agree within tolerance.\n")
    print("## memcpy reference (np.copyto, 1 thread)\n")
    print(table(("dtype", "MB", "MB/s"), [(d, f"{mb:.1f}", f"{v:.0f}") for d, mb, v in copies]))
    print(f"\n## First call in a new process (keep 4, ({FIRST_CALL_IMAGES}, {IMAGE[0]}, {IMAGE[1]}) stack)\n")
    print(
        table(
            ("dtype", "numba cache", "forward s", "inverse s", "kernels"),
            [
                (d, where, f"{r['forward_s']:.3f}", f"{r['inverse_s']:.3f}", cache_state(r))
                for d, where, r in first_rows
            ],
        )
    )


if __name__ == "__main__":
    main()
