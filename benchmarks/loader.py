"""Training-loader throughput: dctchop.Loader against a memory-mapped .npy and per-sample JPEG decoding.

What it measures, for the same samples in the same order (the dctchop loader's shuffled order for the
epoch) and the same output (contiguous float32 batches, channels-first and normalised for images):

* ``dctchop``: :class:`dctchop.Loader` over a store compressed with the defaults (``--psnr 40`` for uint8,
  ``--psnr 60`` for float; the axes the compressor picks), with 1 and 2 threads (each decodes chunks and
  gathers batches); for images also a store transformed over H and W only (``--axes 1,2``: no transform
  across the colour channels), for fields also one with ``--zstd-level -1`` (zstd's fast level);
* ``npy mmap``: the uncompressed array as a memory-mapped ``.npy`` (already in the page cache), each
  batch read by fancy indexing and converted, built on 1 and 2 threads;
* ``jpeg``: images only, every sample a separate JPEG (simplejpeg, 4:4:4) at the lowest quality whose PSNR
  over the set reaches the dctchop store's, decoded per sample and converted, on 1 and 2 threads (simplejpeg
  releases the GIL while it decodes, but every 32x32 image is a call that takes it: 1.1-1.4x on 2 threads,
  against 2.0x for 1024² images; samples/CPU-s is the per-core comparison);
* ``host stage of device decode``: only what device decode leaves to the CPU (read, crc32c, zstd, header
  and payload checks, and with torch the copy into pinned memory) for every chunk, on 1 and 2 threads: the
  ceiling of the loader with a GPU;
* with CUDA: the loader with ``device="cuda"`` (only coefficients cross; the inverse runs there), and the
  device decoder alone on coefficients already on the GPU (``decoder`` rows, for each store above): the
  fused Triton kernels at torch's default float32 precision and with TF32 allowed, and the matmul path; the
  matmul decoder on CPU torch is always shown for reference.

Data: the bundled 32x32 RGB sample grown to ``--images`` distinct images (uint8 NHWC; augmented copies, see
``sample_images.py``), and ``--fields`` float32
(32, 32, 32) volumes cut from the bundled 64³ field at shifted offsets. Epochs of 64 and 16 batches by
default. The image epoch is 13 chunks (4 shuffle windows), short next to a training epoch: at its start the
first window decodes before any batch. ``--images 65536`` (49 chunks, about CIFAR-10's size) measured 250,300
and 228,242 images/s on 2 threads, the default 234,374 and 227,455, alternating (the JPEG rows do not depend on
it). ``GB/s out`` counts the bytes of the batches handed out (float32); ``GB/s data`` counts the decoded
samples in their stored dtype (uint8 for images). Each figure is the best of ``--repeats`` epochs after one
warm-up epoch, the CPU paths taking turns epoch by epoch: the machine may be shared, and the same code ran
at 40k and at 85k JPEG images/s on one core minutes apart (the best run is the least disturbed one; in turns,
each path sees the same disturbances). The dctchop / JPEG line also gives the ratio round by round.

Run from the repository root (needs the ``bench`` extra for simplejpeg; torch for the device rows)::

    .venv/bin/python benchmarks/loader.py [--images 16384] [--fields 4096] [--batch-size 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import h5py
import numpy as np
from sample_images import image_stack

import dctchop
from dctchop import quantize as qz
from dctchop.formats import open_source
from dctchop.jit import numba
from dctchop.location import Location
from dctchop.store import CompressOptions, compress
from dctchop.transform import resolve_threads

ROOT = Path(__file__).resolve().parents[1]
IMAGE_MEAN, IMAGE_STD = (120.0, 118.0, 110.0), (60.0, 58.0, 62.0)


# ---------------------------------------------------------------------------------------------- data


def make_data(tmp: Path, n_images: int, n_fields: int) -> dict:
    images, labels = image_stack(n_images)
    with h5py.File(tmp / "images.h5", "w") as f:
        f["images"], f["labels"] = images, labels
    np.save(tmp / "images.npy", images)
    field = np.load(ROOT / "sample_data/field.npy")
    rng = np.random.default_rng(0)
    shifts = rng.integers(0, 64, size=(n_fields, 3))
    fields = np.lib.format.open_memmap(tmp / "fields.npy", mode="w+", dtype=np.float32, shape=(n_fields, 32, 32, 32))
    for k, (a, b, c) in enumerate(shifts):
        fields[k] = np.roll(field, (a, b, c), axis=(0, 1, 2))[:32, :32, :32]
    fields.flush()
    del fields
    out = {}
    for name, src, options in (("images", tmp / "images.h5", CompressOptions()),
                               ("images_hw", tmp / "images.h5", CompressOptions(axes=(1, 2))),
                               ("fields", tmp / "fields.npy", CompressOptions()),
                               ("fields_fast", tmp / "fields.npy", CompressOptions(zstd_level=-1))):
        summary = compress(open_source(str(src)), tmp / f"{name}.zarr", options)
        info = next(iter(summary["arrays"].values()))
        out[name] = {"store": tmp / f"{name}.zarr", "npy": src.with_suffix(".npy"), "psnr": info["psnr"],
                     "ratio": info["original_bytes"] / Location(tmp / f"{name}.zarr").size(), "axes": info["axes"]}
    out["images"]["variants"] = {"dctchop, axes 1,2": out.pop("images_hw")}
    out["fields"]["variants"] = {"dctchop, zstd level -1": out.pop("fields_fast")}
    return out


# ---------------------------------------------------------------------------------------------- the machine


@numba.njit(nogil=True)
def _vector_work(a, rounds):  # pragma: no cover - compiled
    for _ in range(rounds):
        for i in range(a.size):
            a[i] = a[i] * np.float32(0.9999) + np.float32(0.5)


def vector_scaling(threads: int, seconds: float = 0.5) -> float:
    """How much faster ``threads`` threads run a vectorised float32 loop (in L1, no memory traffic) than one:
    ``threads`` on separate cores, less where logical CPUs share a core's vector units (hyperthreads). The
    decoder's kernels are such loops, so this bounds what more threads can give the loader here."""
    arrays = [np.ones(4096, np.float32) for _ in range(threads)]
    _vector_work(arrays[0], 1)
    t = time.perf_counter()
    _vector_work(arrays[0], 1000)
    rounds = max(1, int(1000 * seconds / (time.perf_counter() - t)))
    one = math.inf
    for _ in range(3):
        t = time.perf_counter()
        _vector_work(arrays[0], rounds)
        one = min(one, time.perf_counter() - t)
    with ThreadPoolExecutor(threads) as pool:
        t = time.perf_counter()
        list(pool.map(lambda a: _vector_work(a, rounds), arrays))
        many = time.perf_counter() - t
    return threads * one / many


# ---------------------------------------------------------------------------------------------- baselines


def _normalise(x: np.ndarray, channels_last: bool) -> np.ndarray:
    """uint8 NHWC -> float32 NCHW, (x - mean) / std, like the loader; float data: a contiguous float32 copy."""
    if not channels_last:
        return np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((x.shape[0], x.shape[3], *x.shape[1:3]), dtype=np.float32)
    np.copyto(out, x.transpose(0, 3, 1, 2), casting="unsafe")
    out *= (1 / np.asarray(IMAGE_STD, dtype=np.float32)).reshape(1, 3, 1, 1)
    out += (-np.asarray(IMAGE_MEAN) / np.asarray(IMAGE_STD)).astype(np.float32).reshape(1, 3, 1, 1)
    return out


def _run_batches(make_batch, order: np.ndarray, batch_size: int, threads: int) -> int:
    """Build every batch of ``order`` on ``threads`` threads (in order, a few ahead); bytes handed out."""
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    total = 0
    with ThreadPoolExecutor(threads) as pool:
        for out in pool.map(make_batch, batches):
            total += out.nbytes
    return total


def npy_batches(path: Path, channels_last: bool):
    mm = np.load(path, mmap_mode="r")
    return lambda idx: _normalise(mm[np.sort(idx)], channels_last)


def jpeg_encode(images: np.ndarray, target_psnr: float) -> tuple[list[bytes], int, float]:
    """Per-image JPEGs at the lowest quality whose PSNR over the set reaches ``target_psnr``."""
    import simplejpeg

    def encode(q, xs):
        return [simplejpeg.encode_jpeg(x, quality=q, colorspace="RGB", colorsubsampling="444") for x in xs]

    def psnr(q, xs):
        dec = np.stack([simplejpeg.decode_jpeg(b, colorspace="RGB") for b in encode(q, xs)])
        return qz.psnr(qz.error_stats(xs, dec)[0] / xs.size, 255.0)

    probe = images[:: max(1, len(images) // 512)]
    quality = next((q for q in range(50, 101) if psnr(q, probe) >= target_psnr), 100)
    return encode(quality, images), quality, psnr(quality, images[:2048])


def jpeg_batches(jpegs: list[bytes], shape: tuple[int, ...]):
    import simplejpeg

    def make(idx):
        x = np.empty((len(idx), *shape), dtype=np.uint8)
        for j, i in enumerate(idx):
            simplejpeg.decode_jpeg(jpegs[i], colorspace="RGB", buffer=x[j])
        return _normalise(x, True)

    return make


# ---------------------------------------------------------------------------------------------- timing


def round_robin(runs: list, repeats: int) -> list[tuple[float, int, float, list[float]]]:
    """Time every run in ``runs`` (each called with an epoch, returning the bytes it handed out) once per round,
    ``repeats`` rounds after one warm-up round: a shared machine slows down and speeds up by up to 2x for
    seconds at a time, and in turns each run sees the same mix of its states. Per run: (best wall seconds,
    bytes, best CPU seconds of this process (all threads), every round's wall seconds)."""
    for run in runs:
        run(0)
    walls = [[] for _ in runs]
    cpus = [math.inf] * len(runs)
    nbytes = [0] * len(runs)
    for r in range(repeats):
        for k, run in enumerate(runs):
            t, c = time.perf_counter(), time.process_time()
            nbytes[k] = run(r + 1)
            walls[k].append(time.perf_counter() - t)
            cpus[k] = min(cpus[k], time.process_time() - c)
    return [(min(w), b, c, w) for w, b, c in zip(walls, nbytes, cpus)]


def loader_run(store: Path, batch_size: int, threads: int, kw: dict):
    loader = dctchop.Loader(store, batch_size=batch_size, threads=threads, seed=0, **kw)

    def run(epoch):
        loader.set_epoch(epoch)
        total = 0
        for batch in loader:
            x = batch[0] if isinstance(batch, tuple) else batch
            total += x.numel() * x.element_size() if hasattr(x, "numel") else x.nbytes
        if loader.device is not None and loader.device.type == "cuda":
            import torch

            torch.cuda.synchronize()
        return total

    return run


def decoder_rate(store: Path, device: str, min_bytes: float, repeats: int, fused: bool = True,
                 precision: str = "highest") -> float:
    """GB/s of decoded float output of the device decoder alone, coefficients already on the device.

    ``fused=False`` times the matmul path on a CUDA device too; ``precision`` is torch's float32 matmul
    precision for the run.
    """
    import torch

    from dctchop.torch_decode import DeviceDecoder, stage

    ds = dctchop.open(store)
    reader = ds.main._reader
    coded = [reader.coded(c) for c in range(ds.n_chunks)]
    per_chunk = math.prod(coded[0].plan.shape) * 4
    copies = max(1, math.ceil(min_bytes / (per_chunk * len(coded))))
    coded = coded * copies
    decoder = DeviceDecoder(coded[0].plan, coded[0].dtype, torch.device(device))
    if not fused:
        decoder._fused = None  # the fused kernel's tables: without them the matmul path decodes
    stored, steps, _, bound = decoder.upload([stage(c, decoder.device) for c in coded])  # nothing to do last
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    default = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        decoder(stored, steps, None, bound)
        sync()
        best = math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            out = decoder(stored, steps, None, bound)
            sync()
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_float32_matmul_precision(default)
    return out.numel() * out.element_size() / best / 1e9


def bench_kind(kind: str, d: dict, args, torch, cuda: bool) -> list[dict]:
    """Every row for one kind of data (``images`` or ``fields``)."""
    ds = dctchop.open(d["store"])
    n, sample_bytes = len(ds), math.prod(ds.shape[1:]) * ds.dtype.itemsize
    image = kind == "images"
    kw = {"mean": IMAGE_MEAN, "std": IMAGE_STD} if image else {}
    rows = []

    def add(path, threads, seconds, out_bytes, cpu_seconds, ratio, psnr):
        rows.append({"data": kind, "path": path, "threads": threads, "samples_s": n / seconds,
                     "samples_cpu_s": n / cpu_seconds, "gbs_out": out_bytes / seconds / 1e9,
                     "gbs_data": n * sample_bytes / seconds / 1e9, "ratio": ratio, "psnr": psnr})

    order_loader = dctchop.Loader(d["store"], batch_size=args.batch_size, seed=0, **kw)
    out_bytes = n * math.prod(order_loader.specs[0].item_shape) * 4

    def batches_of(make, threads):  # a baseline epoch: the loader's order, batches built on `threads` threads
        return lambda epoch: _run_batches(make, order_loader.indices(epoch), args.batch_size, threads)

    def host_stage(threads):  # what device decode leaves to the CPU: every chunk read, checked, unpacked, staged
        def load(c):
            coded = ds.main._reader.coded(c)
            if torch is not None:
                from dctchop.torch_decode import stage

                stage(coded, "cuda" if cuda else "cpu")

        def run(epoch):
            chunks = dict.fromkeys((order_loader.indices(epoch) // ds.chunk_len).tolist())
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(load, chunks))
            return out_bytes
        return run

    paths = []  # (label, threads, epoch run, ratio, psnr), timed in turns
    for threads in args.threads:
        paths.append((f"dctchop, axes {','.join(map(str, d['axes']))} (default)", threads,
                      loader_run(d["store"], args.batch_size, threads, kw), d["ratio"], d["psnr"]))
    for label, v in d.get("variants", {}).items():
        for threads in args.threads:
            paths.append((label, threads, loader_run(v["store"], args.batch_size, threads, kw), v["ratio"], v["psnr"]))
    for threads in args.threads:
        paths.append(("host stage of device decode", threads, host_stage(threads), d["ratio"], d["psnr"]))
    make = npy_batches(d["npy"], image)
    for threads in args.threads:
        paths.append(("npy mmap", threads, batches_of(make, threads), 1.0, math.inf))
    if image:
        try:
            raw = np.load(d["npy"])
            jpegs, quality, jpeg_psnr = jpeg_encode(raw, d["psnr"])
            make = jpeg_batches(jpegs, raw.shape[1:])
            for threads in args.threads:
                paths.append((f"jpeg q{quality}", threads, batches_of(make, threads),
                               raw.nbytes / sum(map(len, jpegs)), jpeg_psnr))
        except ImportError:
            print("simplejpeg is not installed (pip install 'dctchop[bench]'): no JPEG rows")
    for (label, threads, _, ratio, psnr), (seconds, nbytes, cpu, rounds) in zip(
            paths, round_robin([p[2] for p in paths], args.repeats)):
        add(label, threads, seconds, nbytes, cpu, ratio, psnr)
        rows[-1]["rounds"] = rounds
    if cuda:
        for threads in args.threads:
            run = loader_run(d["store"], args.batch_size, threads, {**kw, "device": "cuda"})
            seconds, nbytes, cpu, _ = round_robin([run], args.repeats)[0]
            add("dctchop device=cuda", threads, seconds, nbytes, cpu, d["ratio"], d["psnr"])
        stores = {"": d["store"]} | {f", {label}": v["store"] for label, v in d.get("variants", {}).items()}
        for store_label, store in stores.items():
            for label, fused, precision in (("fused kernel", True, "highest"), ("fused kernel, TF32", True, "high"),
                                            ("matmul path", False, "highest")):
                rows.append({"data": kind, "path": f"decoder on cuda{store_label}: {label} (coefficients resident)",
                             "threads": "-", "gbs_out": decoder_rate(store, "cuda", 4e9, args.repeats, fused, precision)})
    if torch is not None:
        rows.append({"data": kind, "path": "decoder on cpu torch (reference)", "threads": torch.get_num_threads(),
                     "gbs_out": decoder_rate(d["store"], "cpu", 2e8, 2)})
    return rows


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=16384)
    parser.add_argument("--fields", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = parser.parse_args()

    try:
        import torch
    except ImportError:
        torch = None
    cuda = torch is not None and torch.cuda.is_available()
    tmp = Path(tempfile.mkdtemp(prefix="dctchop-bench-"))
    rows = []
    try:
        data = make_data(tmp, args.images, args.fields)
        for kind in ("images", "fields"):
            rows += bench_kind(kind, data[kind], args, torch, cuda)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    cpus, most = resolve_threads(None), max(args.threads)
    scaling = f"; a vectorised loop on {most} threads runs {vector_scaling(most):.2f}x one" if most > 1 else ""
    print(f"\n{platform.processor() or platform.machine()}, {cpus} cores{scaling}, Python {platform.python_version()}, "
          f"torch {getattr(torch, '__version__', 'absent')}, CUDA {'yes' if cuda else 'no (device rows unmeasured)'}")
    print(f"images: {args.images} x 32x32x3 uint8 -> float32 NCHW normalised; fields: {args.fields} x 32³ float32; "
          f"batch {args.batch_size}; best of {args.repeats} epochs, the paths timed in turns\n")
    print("| data | path | threads | samples/s | GB/s out | GB/s data | samples/CPU-s | ratio | PSNR dB |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    fmt = lambda v, f: "-" if v is None else (f.format(v) if not (isinstance(v, float) and math.isinf(v)) else "lossless")
    for r in rows:
        print(f"| {r['data']} | {r['path']} | {r['threads']} | {fmt(r.get('samples_s'), '{:,.0f}')} | "
              f"{fmt(r.get('gbs_out'), '{:.2f}')} | {fmt(r.get('gbs_data'), '{:.3f}')} | "
              f"{fmt(r.get('samples_cpu_s'), '{:,.0f}')} | {fmt(r.get('ratio'), '{:.2f}')} | "
              f"{fmt(r.get('psnr'), '{:.1f}')} |")
    for kind in ("images", "fields"):
        ours = [r for r in rows if r["data"] == kind and r["path"].endswith("(default)")]
        jpeg = [r for r in rows if r["data"] == kind and r["path"].startswith("jpeg")]
        if ours and jpeg:
            best = max(ours, key=lambda r: r["threads"])
            other = next(r for r in jpeg if r["threads"] == best["threads"])
            paired = sorted(b / a for a, b in zip(best["rounds"], other["rounds"]))
            print(f"\n{kind}: dctchop / jpeg at {best['threads']} threads: samples/s "
                  f"{best['samples_s'] / other['samples_s']:.2f}x (best against best; round by round "
                  f"{paired[0]:.2f}-{paired[-1]:.2f}x, median {statistics.median(paired):.2f}x), samples/CPU-s "
                  f"{best['samples_cpu_s'] / other['samples_cpu_s']:.2f}x")
    if args.json:
        print(json.dumps(rows, default=str, indent=1))


if __name__ == "__main__":
    main()
