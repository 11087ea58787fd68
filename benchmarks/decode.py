"""Single-chunk decode speed, stage by stage, optionally A/B against another revision in the same run.

Chunks (encoded once, by this checkout; the format is the same for every revision compared):

* ``image``: the bundled 32x32 RGB sample grown to 3840 distinct images (``sample_images.py``), uint8 NHWC,
  int16 at PSNR 40 over axes (1, 2, 3) with blocks (8, 8, 3) (what ``dctchop compress`` picks for it);
* ``field``: eight (32, 64, 64) cuts of the bundled 64³ float32 field, rolled by different offsets, side by
  side as (32, 128, 256), int16 at PSNR 60, blocks 8³ (tiles of one cut repeated blocks that zstd found).

Stages: ``zstd`` (undo zstd at the store's default level, as the store frames chunks), ``read_stored`` (header checks and the
bit-plane unpack: what device decode leaves to the host), ``inverse`` (:func:`dctchop.transform.inverse` of
the whole coefficient image), ``decode`` (:func:`dctchop.codec.decode_chunk`, 1 and 2 threads). Each figure
is the median of ``--repeats`` timings; MB/s counts the decoded array in its own dtype. With ``--baseline
REV`` the same measurements run on ``git archive REV`` in alternating child processes, so the machine's
load (it may be shared) affects both alike; compare the ratio.

Run from the repository root::

    .venv/bin/python benchmarks/decode.py [--baseline main] [--repeats 15] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("zstd", "read_stored", "inverse", "decode t1", "decode t2")


def make_chunks(out: Path) -> None:
    """Encode the two benchmark chunks into ``out`` (raw dctchop bytes, zstd frames, and their shapes)."""
    import numcodecs
    from sample_images import image_stack

    from dctchop.codec import ChunkSettings, encode_chunk
    from dctchop.store import ZSTD_LEVEL

    images = image_stack(3840)[0]
    field = np.load(ROOT / "sample_data/field.npy").astype(np.float32)
    shifts = np.random.default_rng(0).integers(1, 64, size=(8, 3))  # tiles of different content
    tiles = [np.roll(field, tuple(s), axis=(0, 1, 2))[:32] for s in shifts]
    field = np.block([tiles[:4], tiles[4:]])  # (32, 128, 256)
    cases = {"image": (images, ChunkSettings((1, 2, 3), (8, 8, 3), (8, 8, 3), precision="int16", target_psnr=40.0)),
             "field": (field, ChunkSettings((0, 1, 2), (8, 8, 8), (8, 8, 8), precision="int16", target_psnr=60.0))}
    meta = {}
    for name, (x, settings) in cases.items():
        data = encode_chunk(x, settings)
        (out / f"{name}.dctchop").write_bytes(data)
        (out / f"{name}.zst").write_bytes(numcodecs.Zstd(level=ZSTD_LEVEL).encode(data))
        meta[name] = {"shape": list(x.shape), "dtype": str(x.dtype), "bytes": len(data)}
    (out / "chunks.json").write_text(json.dumps(meta))


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def measure(chunk_dir: Path, repeats: int) -> dict:
    """Median ms of every stage for every chunk, with the dctchop on ``sys.path``."""
    import numcodecs

    from dctchop.codec import decode_chunk, read_stored
    from dctchop.transform import inverse, scatter, work_dtype

    def stages(name: str, shape: tuple[int, ...], dtype: np.dtype) -> dict:
        data = (chunk_dir / f"{name}.dctchop").read_bytes()
        framed = (chunk_dir / f"{name}.zst").read_bytes()
        chunk = read_stored(data, shape, dtype)
        coefficients = scatter(chunk.stored.astype(work_dtype(dtype)), chunk.plan, work_dtype(dtype))
        return {
            "zstd": _median_ms(lambda: numcodecs.Zstd().decode(framed), repeats),
            "read_stored": _median_ms(lambda: read_stored(data, shape, dtype), repeats),
            "inverse": _median_ms(lambda: inverse(coefficients, chunk.plan, dtype, 1), repeats),
            "decode t1": _median_ms(lambda: decode_chunk(data, shape, dtype, 1), repeats),
            "decode t2": _median_ms(lambda: decode_chunk(data, shape, dtype, 2), repeats),
            "mb": int(np.prod(shape)) * dtype.itemsize / 1e6,
        }

    meta = json.loads((chunk_dir / "chunks.json").read_text())
    return {name: stages(name, tuple(m["shape"]), np.dtype(m["dtype"])) for name, m in meta.items()}


def _child(source: Path, chunk_dir: Path, repeats: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(source))
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from decode import measure; from pathlib import Path; "
            "print(json.dumps(measure(Path(sys.argv[2]), int(sys.argv[3]))))")
    run = subprocess.run([sys.executable, "-c", code, str(ROOT / "benchmarks"), str(chunk_dir), str(repeats)],
                         env=env, cwd=chunk_dir, check=True, capture_output=True, text=True)
    return json.loads(run.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="git revision to compare against (e.g. main)")
    parser.add_argument("--repeats", type=int, default=15, help="timings per stage and process")
    parser.add_argument("--rounds", type=int, default=3, help="alternating child processes per revision")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dctchop-decode-") as tmp:
        tmp = Path(tmp)
        chunk_dir = tmp / "chunks"
        chunk_dir.mkdir()
        make_chunks(chunk_dir)
        sources = {"this": ROOT}
        if args.baseline:
            base = tmp / "baseline"
            base.mkdir()
            archive = subprocess.run(["git", "archive", args.baseline, "dctchop"], cwd=ROOT, check=True,
                                     capture_output=True).stdout
            (tmp / "baseline.tar").write_bytes(archive)
            with tarfile.open(tmp / "baseline.tar") as tar:
                tar.extractall(base, filter="data")
            sources = {args.baseline: base, **sources}
        runs = {label: [] for label in sources}
        for _ in range(args.rounds):
            for label, source in sources.items():
                runs[label].append(_child(source, chunk_dir, args.repeats))
        meta = json.loads((chunk_dir / "chunks.json").read_text())
    for name, m in meta.items():
        print(f"\n{name}: {m['dtype']}{m['shape']}, {m['bytes'] / 1e6:.2f} MB coded\n")
        head = ["stage", *(h for label in runs for h in (f"{label} ms", f"{label} MB/s"))]
        head += ["ratio"] if len(runs) == 2 else []
        print("| " + " | ".join(head) + " |\n|" + "---|" + "---:|" * (len(head) - 1))
        for stage in STAGES:
            ms = {label: float(np.median([r[name][stage] for r in rs])) for label, rs in runs.items()}
            cells = [stage, *(c for v in ms.values() for c in (f"{v:.2f}", f"{meta_mb(runs, name) / v * 1e3:.0f}"))]
            if len(runs) == 2:
                a, b = ms.values()
                cells.append(f"{a / b:.2f}x")
            print("| " + " | ".join(cells) + " |")


def meta_mb(runs: dict, name: str) -> float:
    return next(iter(runs.values()))[0][name]["mb"]


if __name__ == "__main__":
    main()
