"""dctchop's kernels are compiled with 512-bit vectors where the processor has AVX-512 (dctchop.jit)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from numba.core import codegen

HOST_HAS_AVX512 = "+avx512f" in codegen.get_host_cpu_features().split(",")

PROBE = """
import numpy as np
import dctchop.transform
from dctchop.jit import numba

@numba.njit
def double(a, b):
    for i in range(a.size):
        b[i] = a[i] * np.float32(2.0)

a = np.ones(1000, np.float32)
double(a, np.empty_like(a))
asm = next(iter(double.inspect_asm().values()))
print(numba.config.CPU_FEATURES)
print("zmm" if "%zmm" in asm else "no zmm")
"""


def _without_a_target() -> dict[str, str]:
    """This process's environment less a numba target of the caller's own."""
    return {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}


def _probe(**env_vars) -> list[str]:
    run = subprocess.run([sys.executable, "-c", PROBE], env={**_without_a_target(), **env_vars},
                         capture_output=True, text=True, check=True)
    return run.stdout.split("\n")[:2]


def test_target_set_before_the_first_kernel():
    features, vectors = _probe()
    if HOST_HAS_AVX512:
        assert features == codegen.get_host_cpu_features() + ",-prefer-256-bit"
        assert vectors == "zmm"
    else:
        assert features == "None"


@pytest.mark.skipif(not HOST_HAS_AVX512, reason="needs a processor with AVX-512")
def test_a_target_the_user_set_is_kept():
    host = codegen.get_host_cpu_features()
    features, _ = _probe(NUMBA_CPU_FEATURES=host)
    assert features == host


def _lanes(**env_vars) -> int:
    code = "from dctchop.inverse8 import LANES; print(LANES)"
    return int(subprocess.run([sys.executable, "-c", code], env={**_without_a_target(), **env_vars},
                              capture_output=True, text=True, check=True).stdout)


def test_the_llvm_kernels_step_a_vector_of_blocks_of_the_target():
    assert _lanes() == (16 if HOST_HAS_AVX512 else 8)
    assert _lanes(NUMBA_CPU_NAME="generic") == 8  # a named target without its features: 256-bit vectors


@pytest.mark.skipif(not HOST_HAS_AVX512, reason="needs a processor with AVX-512")
def test_the_llvm_kernels_hold_on_a_target_without_avx512():
    # there they step eight blocks at a time, here sixteen: their tests, run for that target in a process of
    # its own (which compiles them for it: 40 s on two Zen 3 cores)
    host = codegen.get_host_cpu_features().split(",")
    features = ",".join("-" + f[1:] if f.startswith(("+avx512", "+avx10")) else f for f in host)
    assert _lanes(NUMBA_CPU_FEATURES=features) == 8
    env = {**_without_a_target(), "NUMBA_CPU_FEATURES": features}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_inverse8.py"],
                         cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                         check=False, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_a_read_only_install_without_a_writable_home_caches_its_kernels_in_a_private_directory(tmp_path,
                                                                                             unprivileged):
    # numba found nowhere to cache (neither beside the sources nor in ~/.cache) and refused to define the
    # cached kernels: every command failed at import, as a container's user without a home runs it
    root = Path(__file__).resolve().parents[1]
    site = tmp_path / "site"
    shutil.copytree(root / "dctchop", site / "dctchop", ignore=shutil.ignore_patterns("__pycache__"))
    for sub in ("cli", "formats"):  # where the wheel puts them
        shutil.copytree(root / sub, site / "dctchop" / sub, ignore=shutil.ignore_patterns("__pycache__"))
    home, temp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    temp.mkdir()
    for path in [home, *site.rglob("*"), site]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_CACHE_DIR", "XDG_"))}
    env.update(PYTHONPATH=str(site), HOME=str(home), TMPDIR=str(temp))
    code = "import dctchop.quantize, numba; print(dctchop.quantize.__file__, numba.config.CACHE_DIR)"
    try:
        run = subprocess.run([*unprivileged, sys.executable, "-c", code], capture_output=True, text=True, env=env,
                             cwd=tmp_path, check=False, timeout=300)
    finally:
        for path in [home, site, *site.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
    assert run.returncode == 0, run.stderr
    where, cache = run.stdout.split()
    assert where.startswith(str(site)) and cache == str(temp / f"dctchop-numba-{os.getuid()}")
    assert (temp / f"dctchop-numba-{os.getuid()}").stat().st_mode & 0o777 == 0o700


def test_a_cache_directory_others_can_write_is_not_used(tmp_path):
    from dctchop.jit import _private_directory

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could plant kernels (code) there
    chosen = _private_directory(str(shared))
    assert chosen != str(shared) and os.stat(chosen).st_mode & 0o777 == 0o700
    mine = tmp_path / "mine"
    assert _private_directory(str(mine)) == str(mine)


FORK_WHILE_COMPILING = """
import os, sys, threading, time
import dctchop.jit
from numba.core.compiler_lock import global_compiler_lock

holding = threading.Event()

def compile_elsewhere():
    with global_compiler_lock:  # as numba holds it while another thread compiles or loads a kernel
        holding.set()
        time.sleep(0.5)

thread = threading.Thread(target=compile_elsewhere)
thread.start()
holding.wait()
pid = os.fork()
if pid == 0:  # the child's kernels need the lock: it must not be held by a thread the child does not have
    os._exit(0 if global_compiler_lock._lock.acquire(timeout=5) else 1)
thread.join()
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_fork_while_another_thread_compiles_leaves_the_child_numba_s_lock():
    """A DataLoader forking its workers while another thread loaded a first kernel: the workers hung forever
    in numba's compiler lock."""
    run = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-c", FORK_WHILE_COMPILING],
                         check=False, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


CACHE_CANNOT_BE_WRITTEN = """
import errno, sys
from numba.core import caching
import dctchop.jit

def full(self, name, data):
    raise OSError(errno.ENOSPC, "No space left on device")

if sys.argv[2] == "full":  # as a full disk, a quota or ulimit -f make numba's save fail
    caching.IndexDataCacheFile._save_data = full
sys.path.insert(0, sys.argv[1])
import kernel
print(kernel.plus(41))
"""


def test_a_kernel_whose_cache_cannot_be_written_still_runs(tmp_path):
    """A full disk where numba keeps its cache (beside the installed package) failed every command that
    compiled a kernel: sweep and preview with an internal error, compress and decompress blaming their
    output, which had room. And a failed save must not leave the cache naming an older kernel's file."""

    def run(add: int, disk: str) -> str:
        (tmp_path / "kernel.py").write_text("from dctchop.jit import numba\n\n\n@numba.njit(cache=True)\n"
                                            f"def plus(x):\n    return x + {add}\n")
        os.utime(tmp_path / "kernel.py", ns=(add, add))  # numba tells sources apart by size and mtime
        done = subprocess.run([sys.executable, "-c", CACHE_CANNOT_BE_WRITTEN, str(tmp_path), disk],
                              capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert run(1, "full") == "42"
    assert run(1, "room") == "42"  # cached now
    assert run(1000, "full") == "1041"  # a new source whose save fails
    assert run(1000, "room") == "1041"  # numba's index had named the old kernel's data file: 42
