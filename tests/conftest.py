"""Fixtures shared by several test files (they cannot import one another: --import-mode=importlib)."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def unprivileged() -> list[str]:
    """The prefix that runs a command bound by file permissions: none for a user; for root, whom they do not
    bind, ``setpriv`` without the capabilities that bypass them. Skips the test where neither works."""
    if os.geteuid() != 0:
        return []
    caps = "-dac_override,-dac_read_search,-fowner"
    prefix = [shutil.which("setpriv") or "setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]
    with tempfile.TemporaryDirectory() as d:
        probe = Path(d) / "probe"
        probe.write_text("x")
        probe.chmod(0)
        try:
            denied = subprocess.run([*prefix, "cat", str(probe)], check=False, capture_output=True).returncode != 0
        except OSError:
            denied = False
    if not denied:
        pytest.skip("root reads anything, and setpriv cannot drop the capabilities that let it")
    return prefix


@pytest.fixture(scope="session")
def signals_by_default() -> list[str]:
    """The prefix that runs a command with SIGINT and SIGHUP at their default actions, as a terminal delivers
    them, however the suite was started: an ignored signal stays ignored across exec, a shell ignores SIGINT in
    a job it starts in the background (``nohup make test &`` ignores both), and dctchop keeps an ignored SIGHUP
    ignored; a child started so could not be interrupted. exec keeps the process id, so a signal sent to the
    child reaches the command."""
    code = ("import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
            "signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])")
    return [sys.executable, "-c", code]


@pytest.fixture
def dead_pid() -> int:
    """The id of a process that has ended (a killed run's temporaries carry such an id)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def hdf5_reads(monkeypatch):
    """The rows ``(start, stop)`` of every read h5py is asked for, in order."""
    import h5py

    reads = []
    read_direct, getitem = h5py.Dataset.read_direct, h5py.Dataset.__getitem__

    def direct(ds, dest, source_sel=None, dest_sel=None):
        reads.append((source_sel.start, source_sel.stop))
        return read_direct(ds, dest, source_sel, dest_sel)

    def item(ds, args, **kwargs):
        if isinstance(args, slice):
            reads.append((args.start, args.stop))
        return getitem(ds, args, **kwargs)

    monkeypatch.setattr(h5py.Dataset, "read_direct", direct)
    monkeypatch.setattr(h5py.Dataset, "__getitem__", item)
    return reads


@pytest.fixture
def spans_kept():
    """A function listing the spans of HDF5 chunks this process keeps between reads, oldest first: (file
    name, dataset, span index) of each."""
    from dctchop.formats.hdf5 import _SPANS

    return lambda: [(os.path.basename(handle.file), name, index) for handle, name, index in _SPANS.kept]
