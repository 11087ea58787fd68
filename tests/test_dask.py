"""Compressing through Dask gives the same store as compressing locally."""

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr

import dctchop
from dctchop.dask_runner import task_runner
from dctchop.formats import open_source
from dctchop.store import CompressOptions, Target, compress

distributed = pytest.importorskip("distributed")


def chunk_files(root: Path) -> dict[str, bytes]:
    """Every chunk file of the store (data, metadata, lossless copies), by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != "zarr.json"}


def run_tasks(fn, items, scheduler, workers):
    with task_runner(scheduler, workers) as run:
        return list(run(fn, items))


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  dashboard_address=None) as cluster:
        yield cluster


@pytest.fixture
def source_h5(tmp_path):
    rng = np.random.default_rng(3)
    y, x = np.meshgrid(np.linspace(0, 4, 24), np.linspace(0, 4, 24), indexing="ij")
    images = (np.sin(x + rng.uniform(0, 6, (50, 1, 1))) * np.cos(y) * 90 + 128
              + rng.normal(size=(50, 24, 24)) * 2).clip(0, 255).astype(np.uint8)
    path = tmp_path / "in.h5"
    with h5py.File(path, "w") as f:
        f["images"] = images
        f["field"] = rng.normal(size=(16, 8, 8, 8)).cumsum(axis=1).astype(np.float32)
        f["labels"] = np.arange(50)
    return path


@pytest.mark.parametrize("target", [Target("psnr", 42.0), Target("ratio", 5.0)])
def test_cluster_store_equals_local_store(tmp_path, source_h5, cluster, target):
    local, remote = tmp_path / "local.zarr", tmp_path / "remote.zarr"
    options = CompressOptions(target=target, chunk_samples=8)
    local_summary = compress(open_source(str(source_h5)), local, options)
    remote_summary = compress(open_source(str(source_h5)), remote,
                              CompressOptions(target=target, chunk_samples=8, scheduler=cluster.scheduler_address))
    assert chunk_files(local) == chunk_files(remote)
    assert len(chunk_files(local)) == 7 * 7 + 2 * 7 + 1  # images, field: a data + 6 metadata files per chunk
    for name in ("images", "field", "labels"):
        np.testing.assert_array_equal(zarr.open(str(local), mode="r")[name][:],
                                      zarr.open(str(remote), mode="r")[name][:])
    for name, a in local_summary["arrays"].items():
        b = remote_summary["arrays"][name]
        for key in ("codec", "axes", "chunks", "target", "stored_bytes", "psnr", "psnr_min", "max_abs_error"):
            assert a[key] == b[key], (name, key)


def test_cluster_writes_to_a_relative_output(tmp_path, source_h5, cluster, monkeypatch):
    # the workers (whose working directory is not the client's) took a relative output as their own: the
    # compress failed, saying its temporary directory "was removed while chunks were being written"
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    compress(open_source(str(source_h5)), "rel.zarr", CompressOptions(scheduler=cluster.scheduler_address))
    assert dctchop.open(tmp_path / "here" / "rel.zarr")["images"].shape == (50, 24, 24)


def test_cluster_writes_to_an_fsspec_url(tmp_path, source_h5, cluster):
    """Workers in other processes write the chunks through fsspec (a ``file://`` URL takes the same code path
    as ``s3://``): the store equals the local one and reads back through the URL."""
    local = tmp_path / "local.zarr"
    url = f"file://{tmp_path}/via-url.zarr"
    options = CompressOptions(target=Target("psnr", 42.0), chunk_samples=8)
    compress(open_source(str(source_h5)), local, options)
    compress(open_source(str(source_h5)), url,
             CompressOptions(target=Target("psnr", 42.0), chunk_samples=8, scheduler=cluster.scheduler_address))
    assert chunk_files(local) == chunk_files(tmp_path / "via-url.zarr")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.h5", "local.zarr", "via-url.zarr"]
    np.testing.assert_array_equal(dctchop.open(url)[:], dctchop.open(local)[:])


def test_cluster_workers_keep_no_spans_after_their_tasks(tmp_path, cluster, monkeypatch):
    """A task reading rows of HDF5 chunks it does not finish left their span on the worker's cached handle,
    up to 256 MB a file, for as long as the worker lived. Each task's spans are dropped at its end."""
    from dctchop import store

    x = np.random.default_rng(5).integers(0, 255, (48, 16, 16), dtype=np.uint8)
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f.create_dataset("images", data=x, chunks=(48, 1, 16), compression="gzip")
    monkeypatch.setattr(store, "DASK_TASK_BYTES", 1)  # a task per chunk: every task but the last leaves rows
    compress(open_source(str(tmp_path / "in.h5")), tmp_path / "out.zarr",
             CompressOptions(chunk_samples=8, scheduler=cluster.scheduler_address))

    def kept() -> int:
        from dctchop.formats.hdf5 import _SPANS

        return len(_SPANS.kept)

    with distributed.Client(cluster) as client:
        assert list(client.run(kept).values()) == [0, 0]
    assert dctchop.open(tmp_path / "out.zarr")["images"].shape == x.shape


def test_workers_reuse_freed_buffers(cluster):
    """Dask's nanny starts workers with MALLOC_TRIM_THRESHOLD_ set, which stops glibc from reusing freed large
    buffers: each chunk's 4-50 MB temporaries would fault all their pages in again (the cause of a 40% slower
    cluster). Tasks run by dctchop restore the reuse."""
    def page_faults():
        import resource

        np.ones(4 << 20, np.float32)  # 16 MB, freed at once; the first time may fault in its pages
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            np.ones(4 << 20, np.float32)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, os.environ.get("MALLOC_TRIM_THRESHOLD_")

    (faults, trim), = run_tasks(page_faults, [()], cluster.scheduler_address, 1)
    if trim is None:
        pytest.skip("this Dask does not set MALLOC_TRIM_THRESHOLD_ in its workers")
    assert faults < 4096, faults  # one 16 MB buffer is 4096 pages: without the reuse, 10 of them fault in


def test_local_dask_schedulers_equal_threads(tmp_path, source_h5):
    stores = {}
    for scheduler in (None, "threads", "processes"):
        out = tmp_path / f"{scheduler}.zarr"
        compress(open_source(str(source_h5)), out, CompressOptions(chunk_samples=8, scheduler=scheduler))
        stores[scheduler] = chunk_files(out)
    assert stores[None] == stores["threads"] == stores["processes"]


def test_without_dask_the_error_names_the_extra(tmp_path, source_h5):
    code = ("import sys; sys.modules['dask'] = None; sys.modules['distributed'] = None\n"
            "from dctchop.cli.main import main\n"
            f"main(['compress', {str(source_h5)!r}, {str(tmp_path / 'o.zarr')!r}, '--scheduler', 'processes'])\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert run.returncode == 1
    assert "dctchop[dask]" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o.zarr").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["in.h5"]


def test_local_dask_schedulers_run_the_workers_asked_for(tmp_path, source_h5, monkeypatch):
    # --workers was ignored with --scheduler threads|processes: the pool always had one worker per core
    import threading

    from dctchop import store

    names = set()
    task = store.encode_chunks_task

    def recording(*args):
        names.add(threading.current_thread().name)
        return task(*args)

    monkeypatch.setattr(store, "DASK_TASK_BYTES", 1)  # a task per chunk: 7 tasks
    monkeypatch.setattr(store, "encode_chunks_task", recording)
    compress(open_source(str(source_h5)), tmp_path / "o.zarr", CompressOptions(chunk_samples=8, scheduler="threads",
                                                                              workers=1))
    assert names == {"dctchop-dask_0"}


def test_every_array_of_a_store_shares_one_process_pool(tmp_path, source_h5, monkeypatch):
    # each lossy array started a pool of its own, and paid for its workers' start (numba, zarr, h5py
    # imports): an 8-array file took 26 s against 5.9 s with one pool
    from dctchop import store

    task = store.encode_chunks_task
    pids = tmp_path / "pids"
    pids.mkdir()

    def recording(*args):  # runs in a spawned worker: it leaves its pid behind as a file
        (pids / str(os.getpid())).touch()
        return task(*args)

    monkeypatch.setattr(store, "DASK_TASK_BYTES", 1)  # a task per chunk
    monkeypatch.setattr(store, "encode_chunks_task", recording)
    compress(open_source(str(source_h5)), tmp_path / "o.zarr",
             CompressOptions(chunk_samples=8, scheduler="processes", workers=1))
    assert len(list(pids.iterdir())) == 1  # images and field: one worker for both


def test_the_processes_scheduler_gives_each_worker_its_own_tasks():
    # Dask's multiprocessing scheduler hands its pool 6 tasks per job by default: an input of up to six
    # tasks (384 MB) ran in one process, one task after another, whatever --workers said
    def pid_of_a_slow_task():
        import time

        time.sleep(3)
        return os.getpid()

    assert len(set(run_tasks(pid_of_a_slow_task, [(), ()], "processes", 2))) == 2


@pytest.mark.parametrize("reply", [None, b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n"])
def test_an_address_where_no_scheduler_answers_is_a_clear_error(monkeypatch, reply):
    # a server that accepts and stays silent (a dashboard's port, say) held the client forever; one that
    # answers like a web server made an internal error (its reply read as a 3 EiB message: MemoryError)
    import socket
    import threading
    import time

    from dctchop import dask_runner
    from dctchop.errors import DctchopError

    monkeypatch.setattr(dask_runner, "CONNECT_SECONDS", 2)
    with socket.create_server(("127.0.0.1", 0)) as server:
        def answer():
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:  # closed
                    return
                with conn:
                    conn.recv(65536)
                    conn.sendall(reply)

        if reply is not None:  # else nothing accepts: the connection waits in the backlog, unanswered
            threading.Thread(target=answer, daemon=True).start()
        address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(DctchopError, match=f"^cannot reach the Dask scheduler at {address}: "):
            run_tasks(os.getpid, [()], address, 1)
        assert time.monotonic() - started < 8


def test_processes_workers_start_with_ctrl_c_blocked():
    # Ctrl-C while a worker was still importing (before its initializer ignores SIGINT) printed the worker's
    # KeyboardInterrupt traceback above "dctchop: interrupted"
    import signal

    def blocked_and_ignored():
        return signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []), signal.getsignal(signal.SIGINT)

    assert run_tasks(blocked_and_ignored, [()], "processes", 1) == [(True, signal.SIG_IGN)]


def test_stopping_early_terminates_the_processes_workers(tmp_path):
    # the pool's shutdown forgets its workers, and they were looked up after it: none was terminated, each
    # ended its task first, and a Ctrl-C then hung the interpreter's exit in 4 of 24 tries
    import time

    def sleeper(folder, seconds):
        (Path(folder) / str(os.getpid())).touch()
        time.sleep(seconds)
        return os.getpid()

    with pytest.raises(KeyboardInterrupt), task_runner("processes", 2) as run:
        results = run(sleeper, [(str(tmp_path), 0), (str(tmp_path), 60)])
        quick = next(results)
        deadline = time.monotonic() + 30
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        (slow,) = {int(p.name) for p in tmp_path.iterdir()} - {quick}
        stopped = time.monotonic()
        raise KeyboardInterrupt
    assert time.monotonic() - stopped < 20  # not waiting for the task's minute
    with pytest.raises(ProcessLookupError):  # terminated and reaped
        os.kill(slow, 0)
