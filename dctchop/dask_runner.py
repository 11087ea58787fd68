"""Running chunk tasks on Dask: the local ``threads``/``processes`` schedulers or a ``dask.distributed``
scheduler at an address such as ``tcp://scheduler-host:8786``.

Each task is :func:`dctchop.store.encode_chunks_task`: it reopens the input by path (h5py objects do not
pickle), encodes a run of consecutive chunks (about 64 MB of input) and writes those chunks' files and
metadata elements whole, so tasks never share a file. The kernels run single-threaded inside a task and never use numba's parallel threading layer, so tasks
neither oversubscribe the cores nor hang after ``fork``. Results (small dicts) come back as tasks finish.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import multiprocessing
import os
import queue
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import resource_tracker

from dctchop.errors import DctchopError, first_line

LOCAL_SCHEDULERS = ("threads", "processes")
CONNECT_SECONDS = 10  # to reach a dask.distributed scheduler and hear from it


def _require_dask(scheduler: str):
    try:
        import dask
    except ImportError:
        raise DctchopError(f"--scheduler {scheduler} needs Dask: pip install 'dctchop[dask]'") from None
    return dask


@contextlib.contextmanager
def task_runner(scheduler: str, workers: int) -> Iterator[Callable[[Callable, list[tuple]], Iterator]]:
    """A function ``run(fn, items)`` that yields ``fn(*item)`` for every item as the tasks finish (in
    completion order). A local scheduler runs ``workers`` threads or processes (a cluster has its own). The
    pool or the cluster connection lasts the whole ``with``, so every array of a store shares it: a process
    pool per array cost each array the start of its workers (an 8-array file: 26 s against 5.9 s)."""
    dask = _require_dask(scheduler)
    if scheduler in LOCAL_SCHEDULERS:
        pool = _local_pool(scheduler, workers)
        try:
            yield functools.partial(_run_local, dask, pool, scheduler)
        except BaseException:
            _stop_pool(pool)
            raise
        pool.shutdown(wait=True)
    else:
        try:
            from distributed import Client
        except ImportError:
            raise DctchopError(f"--scheduler {scheduler} needs dask.distributed: pip install 'dctchop[dask]'") from None
        with _connect(Client, scheduler) as client:
            yield functools.partial(_run_distributed, client)


def _local_pool(scheduler: str, workers: int) -> Executor:
    if scheduler == "threads":
        return ThreadPoolExecutor(workers, thread_name_prefix="dctchop-dask")
    # spawn, as Dask's own: numba's threading layer dies after fork
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_ignore_interrupts)


def _run_local(dask, pool: Executor, scheduler: str, fn: Callable, items: list[tuple]) -> Iterator:
    """dask.compute in a background thread, on the given pool; each finished task's result is handed over
    through a queue. Stopped early (Ctrl-C, an error), the pool's processes are terminated and the thread
    joined: left to Dask's own pool, the interpreter's exit waited forever on a worker whose shutdown
    message its closed queue never delivered."""
    from dask.callbacks import Callback

    tasks = [dask.delayed(fn, pure=False)(*item) for item in items]
    keys = {task.key for task in tasks}
    finished: queue.Queue = queue.Queue()
    done = object()

    class Collect(Callback):  # _posttask runs in the scheduling thread as each task ends
        def _posttask(self, key, result, dsk, state, worker_id):
            if key in keys:  # not dask's own bookkeeping tasks
                finished.put((result,))

    def compute():
        if scheduler == "processes":  # the pool starts its workers from this thread: they inherit the block
            resource_tracker.ensure_running()  # first: starting it unblocks SIGINT in the thread that does
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            with Collect():
                dask.compute(*tasks, scheduler=scheduler, pool=pool, chunksize=1)  # Dask's processes default: 6
        except BaseException as e:  # noqa: BLE001 - handed to the consuming thread and re-raised there
            finished.put(e)
        finished.put(done)

    thread = threading.Thread(target=compute, name="dctchop-dask", daemon=True)
    thread.start()
    try:
        while (item := finished.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item[0]
    except BaseException:  # an error, Ctrl-C, or the consumer closing this generator: stop the workers
        _stop_pool(pool)
        raise
    finally:
        thread.join()


def _stop_pool(pool: Executor) -> None:
    """Cancel the tasks not started and terminate a process pool's workers, which ignore Ctrl-C: left to end
    their tasks, the interpreter's exit waited forever on some of them (4 Ctrl-Cs in 24). The workers are
    looked up before the shutdown, which forgets them (it sets ``_processes`` to None: terminating them after
    it, as before, terminated none); the same dict also gets any worker started meanwhile."""
    processes = getattr(pool, "_processes", None) or {}  # a ProcessPoolExecutor's, by pid
    pool.shutdown(wait=False, cancel_futures=True)
    workers = list(processes.values())
    for process in workers:
        process.terminate()
    for process in workers:
        process.join(timeout=5)


def _ignore_interrupts() -> None:
    """In a worker process: Ctrl-C reaches the whole process group, and the parent stops the workers itself
    (a worker's own KeyboardInterrupt printed a traceback). Workers start with SIGINT blocked, so a Ctrl-C
    while they import (before this runs) waits; ignoring SIGINT discards it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_distributed(client, fn: Callable, items: list[tuple]) -> Iterator:
    from distributed import as_completed

    futures = [client.submit(_in_worker, fn, *item, pure=False) for item in items]
    try:
        for future in as_completed(futures, loop=client.loop):
            yield future.result()
    finally:
        client.cancel(futures)


def _connect(Client, address: str):
    """A client of the scheduler at ``address``, or a DctchopError within about CONNECT_SECONDS. Dask's own
    timeout bounds the connection, not the first answer: a server that accepts and stays silent held the
    Client forever, and one that answers but is no scheduler (an HTTP server) failed with whatever its
    bytes read as (a message of 3 EiB: MemoryError)."""
    made: queue.Queue = queue.Queue()

    def connect():
        try:
            made.put(Client(address, timeout=f"{CONNECT_SECONDS}s", set_as_default=False))
        except Exception as e:  # noqa: BLE001 - any failure here means there is no scheduler to use
            made.put(e)

    threading.Thread(target=connect, name="dctchop-dask-connect", daemon=True).start()
    try:
        client = made.get(timeout=CONNECT_SECONDS + 2)
    except queue.Empty:
        raise DctchopError(f"cannot reach the Dask scheduler at {address}: no answer in {CONNECT_SECONDS} s "
                           "(is that a scheduler's address?)") from None
    if isinstance(client, Exception):
        raise DctchopError(f"cannot reach the Dask scheduler at {address}: "
                           f"{type(client).__name__}: {first_line(client)}") from None
    return client


def _in_worker(fn: Callable, *args):
    """``fn(*args)`` in a ``dask.distributed`` worker, once :func:`_keep_freed_buffers` has run there."""
    _keep_freed_buffers()
    return fn(*args)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


@functools.cache
def _keep_freed_buffers() -> None:
    """Undo the effect of one Dask worker default on dctchop's tasks.

    The nanny starts workers with ``MALLOC_TRIM_THRESHOLD_`` set, and glibc then stops adapting its mmap
    threshold: every large temporary of a chunk (4-50 MB) becomes a fresh mmap whose pages fault in again,
    chunk after chunk. Measured on 24 chunks of 4 MB: 140,000 page faults and 55% more CPU time than the
    same tasks in a plain process (the whole 2-process cluster ran 42-46% behind local threads). Setting
    the limits glibc's adaptive rule itself reaches (32 MB mmap threshold, twice that before trimming) keeps
    freed buffers for the next chunk: a worker holds at most ~64 MB more. Nothing changes elsewhere.
    """
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its allocator has no such switch
        return
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 64 << 20)
