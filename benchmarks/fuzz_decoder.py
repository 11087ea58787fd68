"""Fuzz the chunk decoder with random and mutated chunks and headers.

Every case must either decode to an array of the expected shape and dtype or raise ``CorruptChunkError``:
any other exception, a crash, or a case slower than ``--max-seconds`` is a failure. Seeds come from valid
chunks of many settings (every precision, both masks, 1-3 axes, edge blocks, both decode paths of uint8);
mutations are bit flips, byte overwrites with boundary values, truncation, extension, splices of two chunks,
header fields set to extreme values, and pure random bytes. The decoder only ever allocates what the expected
chunk shape allows.

    .venv/bin/python benchmarks/fuzz_decoder.py --cases 10000 --seed 1
"""

from __future__ import annotations

import argparse
import struct
import sys
import time
from collections import Counter

import numpy as np

from dctchop.codec import ChunkSettings, decode_chunk, encode_chunk
from dctchop.errors import CorruptChunkError

SEED_SETTINGS = [  # (shape, dtype, where the values lie, settings)
    ((6, 20, 28, 3), "uint8", 60.0, ChunkSettings((1, 2), (8, 8), (4, 4), "square", "float16")),
    ((4, 16, 13), "uint8", 60.0, ChunkSettings((1, 2), (8, 8), (6, 6), "triangle", "bfloat16")),
    ((2, 24, 24), "uint16", 60.0, ChunkSettings((1, 2), (8, 8), (8, 8), "square", "int16", step=40.0)),
    ((2, 17, 19), "int16", 60.0, ChunkSettings((1, 2), (8, 4), (8, 4), "square", "int8", target_psnr=45.0)),
    ((12, 10, 9), "float32", 60.0, ChunkSettings((0, 1, 2), (4, 4, 4), (3, 2, 4), "square", "float32")),
    ((5, 50), "float64", 60.0, ChunkSettings((1,), (16,), (9,), "square", "int16")),
    ((2, 2, 12, 12), "float16", 60.0, ChunkSettings((2, 3), (6, 6), (4, 4), "triangle", "int8", step=0.05)),
    # uint8 keeping every band: band-major decode, by byte transposes and by byte stores (edge blocks)
    ((8, 16, 16, 3), "uint8", 60.0,
     ChunkSettings((1, 2, 3), (8, 8, 3), (8, 8, 3), "square", "int16", target_psnr=40.0)),
    ((3, 20, 28), "uint8", 60.0, ChunkSettings((1, 2), (8, 8), (8, 8), "square", "int8", step=2.0)),
    # volumes keeping every band: the 8x8x8 kernel writing the output itself, an edge block of 4 over X
    ((3, 16, 16, 20), "float32", 60.0, ChunkSettings((1, 2, 3), (8, 8, 8), (8, 8, 8), "square", "int16",
                                                     target_psnr=60.0)),
    ((2, 8, 16, 16), "uint8", 60.0, ChunkSettings((1, 2, 3), (8, 8, 8), (8, 8, 8), "triangle", "int8", step=3.0)),
    # float data far from zero: stored relative to an offset (header flag bit 2)
    ((2, 16, 16), "float32", 1000.0, ChunkSettings((1, 2), (8, 8), (8, 8), "square", "int16", target_psnr=60.0)),
]
BOUNDARY = [0, 1, 2, 3, 7, 8, 63, 64, 65, 127, 128, 255]


def seeds(rng: np.random.Generator) -> list[tuple[bytes, tuple[int, ...], np.dtype]]:
    out = []
    for shape, dtype, centre, settings in SEED_SETTINGS:
        x = rng.normal(size=shape) * 20 + centre
        if np.dtype(dtype).kind in "iu":
            info = np.iinfo(dtype)
            x = x.clip(info.min, info.max)
        x = x.astype(dtype)
        out.append((encode_chunk(x, settings), shape, np.dtype(dtype)))
    return out


def mutate(data: bytes, other: bytes, rng: np.random.Generator) -> tuple[str, bytes]:
    b = bytearray(data)
    kind = rng.integers(9)
    if kind == 0:
        for _ in range(rng.integers(1, 8)):
            i = rng.integers(len(b))
            b[i] ^= 1 << rng.integers(8)
        return "bitflip", bytes(b)
    if kind == 1:
        i = rng.integers(min(len(b), 64))  # the header
        b[i] = BOUNDARY[rng.integers(len(BOUNDARY))]
        return "header-byte", bytes(b)
    if kind == 2:
        return "truncate", bytes(b[: rng.integers(len(b))])
    if kind == 3:
        return "extend", bytes(b) + rng.bytes(int(rng.integers(1, 64)))
    if kind == 4:
        cut = rng.integers(len(b))
        return "splice", bytes(b[:cut]) + other[cut:]
    if kind == 5:
        i = rng.integers(12, max(13, min(len(b) - 4, 80)))  # shape / counts region
        value = [0, 1, 0xFFFFFFFF, 0x7FFFFFFF, 1 << 20][rng.integers(5)]
        b[i : i + 4] = struct.pack("<I", value)
        return "header-u32", bytes(b[: len(data)])
    if kind == 6:
        return "random", rng.bytes(int(rng.integers(0, 256)))
    if kind == 7:
        return "random-with-magic", b"DCTC" + rng.bytes(int(rng.integers(0, 256)))
    i = rng.integers(len(b) - 8) if len(b) > 8 else 0
    b[i : i + 8] = struct.pack("<d", [np.nan, np.inf, -1.0, 0.0, 1e308][rng.integers(5)])
    return "float-field", bytes(b[: len(data)])


def run(cases: int, seed: int, max_seconds: float) -> dict:
    rng = np.random.default_rng(seed)
    pool = seeds(rng)
    for data, shape, dtype in pool:  # numba compiles on first use: the time limit is for decoding, not that
        decode_chunk(data, shape, dtype)
    outcomes: Counter = Counter()
    failures = []
    slowest = 0.0
    for case in range(cases):
        data, shape, dtype = pool[rng.integers(len(pool))]
        other = pool[rng.integers(len(pool))][0]
        kind, mutated = mutate(data, other, rng)
        t = time.perf_counter()
        try:
            y = decode_chunk(mutated, shape, dtype)
            if y.shape != shape or y.dtype != dtype:
                failures.append((case, kind, f"decoded to {y.dtype}{y.shape}"))
            outcomes[f"{kind}: decoded"] += 1
        except CorruptChunkError:
            outcomes[f"{kind}: CorruptChunkError"] += 1
        except Exception as e:  # noqa: BLE001 - any other exception is exactly what the fuzzer looks for
            failures.append((case, kind, f"{type(e).__name__}: {e}"))
        elapsed = time.perf_counter() - t
        slowest = max(slowest, elapsed)
        if elapsed > max_seconds:
            failures.append((case, kind, f"took {elapsed:.2f} s"))
    return {"cases": cases, "outcomes": outcomes, "failures": failures, "slowest_s": slowest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-seconds", type=float, default=1.0)
    args = parser.parse_args()
    t = time.perf_counter()
    result = run(args.cases, args.seed, args.max_seconds)
    print(f"# decoder fuzz: {result['cases']} cases, seed {args.seed}, {time.perf_counter() - t:.1f} s, "
          f"slowest case {result['slowest_s'] * 1e3:.1f} ms\n")
    print("| mutation: outcome | cases |\n|---|---|")
    for key, n in sorted(result["outcomes"].items()):
        print(f"| {key} | {n} |")
    print(f"\nfailures: {len(result['failures'])}")
    for case, kind, what in result["failures"][:20]:
        print(f"- case {case} ({kind}): {what}")
    sys.exit(1 if result["failures"] else 0)


if __name__ == "__main__":
    main()
