"""Where a dctchop chunk's bytes and decode time go at the peers' target ratios, and what three changes that look
like easy decode wins would give: a pruned inverse, shorter mask runs, a faster zstd level.

For each dataset of ``peers.py`` and each target ratio, dctchop int16 with the square mask (the best variant
at nearly every point there) is searched for the ratio, and the first chunk is measured:

* ``bands``: bands holding any non-zero level, of all bands. A decode that skipped bands zero in the whole
  chunk (a pruned inverse transform) could only gain where this is well below all;
* ``chunk B`` / ``zstd B``: bytes of the encoded chunk (header and bit-plane payload) before and after the
  store's zstd, and ``dense``: the share of the payload's plane bytes in planes at least 30% ones
  (near-random bytes, which zstd codes as Huffman literals);
* ``zstd ms``, ``unpack ms`` (the bit-plane unpack to int16, the part of the decode that a shorter mask run
  shortens), ``decode ms`` (:func:`dctchop.codec.decode_chunk`, one thread, without zstd): medians of
  interleaved calls;
* ``runs of L``: each band's run split into runs of at most L values, each with its own plane mask, so that
  a run of small levels stores fewer planes: the payload's bytes (``raw``), its zstd bytes and its unpack time
  against today's layout (one run per band and block group);
* a second table: the zstd frame at other levels, its bytes against the store's level and its decode ms
  (zstd's negative levels leave literals uncompressed: the near-random bytes of dense planes then cost a copy).

Run from the repository root (``pip install -e '.[bench]'`` for the photos)::

    .venv/bin/python benchmarks/payload.py [--datasets cifar_like field2d] [--targets 4 8 16] [--repeats 25]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

for _var in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one thread, as peers.py; set before the libraries load

import numcodecs
import numpy as np
import peers

from dctchop import codec
from dctchop.bitplanes import Planes, check_planes, to_planes
from dctchop.codec import ChunkSettings, decode_chunk, encode_chunk
from dctchop.store import ZSTD_LEVEL

RUN_LENGTHS = (1024, 256)
ZSTD_OTHER_LEVELS = (3, 6, -1)
DENSE = 0.3  # a plane this share of ones or more counts as dense


def settings(x: np.ndarray, step: float) -> ChunkSettings:
    """The variant measured: int16, square mask, ``compress``'s default axes and blocks, quantization ``step``."""
    axes, block, _ = peers.dctchop_axes(x)
    return ChunkSettings(axes, block, block, "square", "int16", step=float(step))


def step_for(ds: peers.Dataset, target: float) -> tuple[float, float]:
    """(step, achieved ratio) of :func:`settings` at ``target``, searched as ``peers.py`` does."""
    def make(step: float) -> peers.Codec:
        return peers.dctchop_codec(ds, lambda x: settings(x, step))

    peak = max(float(x.max()) - float(x.min()) for x in ds.items)
    found = peers.search(lambda s: peers.achieved_ratio(ds, make(s)), target, peak * 1e-6, peak * 64)
    return found.param, found.ratio


def first_chunk(ds: peers.Dataset, step: float) -> tuple[np.ndarray, bytes, np.ndarray, Planes]:
    """The first chunk of the first item, as the store would cut it: (samples, encoded bytes, each run's band,
    its checked bit planes)."""
    x = ds.items[0]
    chunk_settings = settings(x, step)
    x = x[peers.dctchop_chunks(x, chunk_settings.axes)[0]]
    data = encode_chunk(x, chunk_settings)
    header, plan, steps, payload = codec._checked(data, x.shape, x.dtype)
    return x, data, plan.runs.seg_bands, codec._checked_planes(header, plan, steps, payload)


def plane_rows(planes: Planes):
    """The bytes of every stored plane."""
    for s, mask in enumerate(planes.masks.tolist()):
        groups = (int(planes.seg_starts[s + 1] - planes.seg_starts[s]) + 7) // 8
        for j in range(mask.bit_count()):
            start = int(planes.offsets[s]) + j * groups
            yield planes.data[start : start + groups]


def split_runs(seg_starts: np.ndarray, length: int) -> np.ndarray:
    """Run starts with every run cut into runs of at most ``length`` values."""
    starts = [0]
    for a, b in zip(seg_starts[:-1].tolist(), seg_starts[1:].tolist()):
        starts.extend(range(a + length, b, length))
        starts.append(b)
    return np.array(starts, np.int64)


def medians_ms(calls: dict, repeats: int) -> dict:
    """Median ms of each call, the calls interleaved so that a busy machine slows them alike."""
    times = {name: [] for name in calls}
    for fn in calls.values():
        fn()
    for _ in range(repeats):
        for name, fn in calls.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) * 1e3 for name, v in times.items()}


def measure(ds: peers.Dataset, target: float, repeats: int) -> tuple[str, str]:
    """The two tables' rows for ``target``."""
    zstd = numcodecs.Zstd(level=ZSTD_LEVEL)
    step, ratio = step_for(ds, target)
    x, data, seg_bands, planes = first_chunk(ds, step)
    quantized = planes.unpack()
    live = np.zeros(int(seg_bands.max()) + 1, bool)
    np.logical_or.at(live, seg_bands, planes.masks != 0)
    rows = list(plane_rows(planes))
    dense = sum(r.size for r in rows if np.unpackbits(r).mean() >= DENSE) / max(sum(r.size for r in rows), 1)
    framed = zstd.encode(data)
    other_levels = {level: numcodecs.Zstd(level=level).encode(data) for level in ZSTD_OTHER_LEVELS}
    payload_start = len(data) - planes.data.size - planes.masks.size * planes.itemsize
    assert to_planes(quantized, planes.seg_starts) == data[payload_start:], "to_planes does not rebuild the payload"
    layouts = {"now": planes.seg_starts, **{n: split_runs(planes.seg_starts, n) for n in RUN_LENGTHS}}
    payloads = {k: to_planes(quantized, starts) for k, starts in layouts.items()}
    variants = {k: check_planes(payloads[k], layouts[k], quantized.dtype) for k in layouts}
    calls = {"zstd": lambda: zstd.decode(framed), "decode": lambda: decode_chunk(data, x.shape, x.dtype, 1),
             **{f"unpack {k}": p.unpack for k, p in variants.items()},
             **{f"zstd {level}": (lambda f=f: zstd.decode(f)) for level, f in other_levels.items()}}
    ms = medians_ms(calls, repeats)
    line = (f"| {target:g} | {ratio:.2f} | {x.shape} | {int(live.sum())}/{live.size} | {len(data):,} | "
            f"{len(framed):,} | {dense:.0%} | {ms['zstd']:.2f} | {ms['unpack now']:.2f} | {ms['decode']:.2f} |")
    z_now = len(zstd.encode(payloads["now"]))
    for n in RUN_LENGTHS:
        line += (f" {len(payloads[n]) / len(payloads['now']):.2f} / {len(zstd.encode(payloads[n])) / z_now:.3f} / "
                 f"{ms[f'unpack {n}'] / ms['unpack now']:.2f}x |")
    levels_line = f"| {target:g} | {ms['zstd']:.2f} |" + "".join(
        f" {len(f) / len(framed):.3f} / {ms[f'zstd {level}']:.2f} |" for level, f in other_levels.items())
    return line, levels_line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", default=list(peers.DEFAULT_DATASETS))
    parser.add_argument("--targets", nargs="+", type=float, default=[4.0, 8.0, 16.0])
    parser.add_argument("--repeats", type=int, default=25)
    args = parser.parse_args()
    runs = " | ".join(f"runs of {n}: raw / zstd / unpack" for n in RUN_LENGTHS)
    for name in args.datasets:
        ds = peers.load_dataset(name)
        rows = [measure(ds, target, args.repeats) for target in args.targets]
        print(f"\n{ds.title}\n")
        print(f"| target | ratio | chunk | bands | chunk B | zstd B | dense | zstd ms | unpack ms | decode ms | {runs} |")
        print("|" + "---:|" * (10 + len(RUN_LENGTHS)))
        print("\n".join(layout for layout, _ in rows))
        print(f"\n| target | zstd-{ZSTD_LEVEL} ms | " + " | ".join(f"zstd {level}: bytes / ms" for level in ZSTD_OTHER_LEVELS)
              + " |\n|" + "---:|" * (2 + len(ZSTD_OTHER_LEVELS)))
        print("\n".join(levels for _, levels in rows), flush=True)


if __name__ == "__main__":
    main()
