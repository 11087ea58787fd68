"""Compress the same >= 1 GB input with local threads and with a 2-process Dask LocalCluster.

Uses the stack made by benchmarks/compress.py (``--input``, default /tmp/dctchop-bench/stack-2gb.npy; run
that first). Reports seconds, MB/s and the cluster's overhead; the two stores are checked to hold the same
chunk bytes. On a 2-core machine expect parity.

    .venv/bin/python benchmarks/dask_cluster.py [--input PATH] [--psnr 60]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from distributed import LocalCluster

from dctchop.formats import open_source
from dctchop.store import CompressOptions, Target, compress


def timed_compress(src: Path, out: Path, options: CompressOptions) -> float:
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    compress(open_source(str(src)), out, options)
    return time.perf_counter() - t


def same_chunks(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file() and p.name.startswith("c."))
    return all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", type=Path, default=Path("/tmp/dctchop-bench/stack-2gb.npy"))
    parser.add_argument("--psnr", type=float, default=60.0)
    args = parser.parse_args()
    size = args.input.stat().st_size
    target = Target("psnr", args.psnr)
    local, remote = args.input.with_name("local.zarr"), args.input.with_name("cluster.zarr")
    rows = [("local threads (--workers 2)", timed_compress(args.input, local, CompressOptions(target, workers=2)))]
    t = time.perf_counter()
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster:
        startup = time.perf_counter() - t
        options = CompressOptions(target, scheduler=cluster.scheduler_address)
        rows.append(("Dask LocalCluster, 2 processes x 1 thread", timed_compress(args.input, remote, options)))
    identical = same_chunks(local, remote)
    shutil.rmtree(local), shutil.rmtree(remote)
    print(f"# local threads vs Dask LocalCluster\n\ninput {args.input.name}: {size / 1e9:.2f} GB, --psnr "
          f"{args.psnr:g}; cluster start-up {startup:.1f} s (not included); identical chunk files: {identical}\n")
    print("| how | seconds | MB/s |\n|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.1f} | {size / 1e6 / seconds:.0f} |")
    print(f"\ncluster overhead: {100 * (rows[1][1] / rows[0][1] - 1):+.0f}% time")


if __name__ == "__main__":
    main()
