"""numba as dctchop's kernels are compiled: with 512-bit vectors where the processor has AVX-512, and cached
where the cache can be written.

LLVM's tuning for recent Intel server and client cores ("prefer-256-bit") vectorises loops with 256-bit
registers even where AVX-512 is there, to spare older cores the clock drop of 512-bit code. On the machines
this project measures on (Sapphire Rapids class), the 512-bit kernels decode a 32x32 RGB chunk 1.15-1.2x
faster, bit for bit the same (``benchmarks/decode.py``): the kernels vectorise element-wise loops only, so the
vector width changes no sum.

numba reads its target once per process, when it first compiles or loads a kernel; every dctchop module
that defines kernels imports numba from here, so the setting is in place before that. Users who set
``NUMBA_CPU_NAME`` or ``NUMBA_CPU_FEATURES`` themselves keep their target. The setting is numba's, for the
whole process: numba code of the caller compiled after dctchop is imported gets it too.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile

import numba
from numba.core import caching, codegen, config
from numba.core.compiler_lock import global_compiler_lock

__all__ = ["VECTOR_BITS", "numba"]


def _prefer_512_bit_vectors() -> None:
    if config.CPU_NAME is not None or config.CPU_FEATURES is not None:
        return
    features = codegen.get_host_cpu_features()  # what numba would use (honours NUMBA_ENABLE_AVX)
    if "+avx512f" in features.split(","):
        config.CPU_FEATURES = features + ",-prefer-256-bit"


def _vector_bits() -> int:
    """The widest vectors of numba's target, in bits: 512 with AVX-512, else 256 (what
    :mod:`dctchop.inverse8` sizes its steps of blocks by). Read after :func:`_prefer_512_bit_vectors`, which
    names the features of a host with AVX-512; without named features (a host without it, or a target the user
    named without its features) 256."""
    return 512 if "+avx512f" in (config.CPU_FEATURES or "").split(",") else 256


def _nothing() -> None:  # pragma: no cover - never called: numba looks for its cache location on definition
    pass


def _cache_somewhere() -> None:
    """numba caches a kernel beside its source file, else in the user's cache directory, and refuses to define
    a cached kernel where it can write neither: a read-only install run by a user without a writable home (a
    container's usual case) failed at import, ``dctchop --version`` included. Then the kernels go to a
    directory of this user's own in the temporary directory (reused by later runs); a user's NUMBA_CACHE_DIR
    is left as it is."""
    if config.CACHE_DIR:
        return
    try:
        numba.njit(cache=True)(_nothing)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        config.CACHE_DIR = _private_directory(os.path.join(tempfile.gettempdir(), f"dctchop-numba-{os.getuid()}"))


def _private_directory(path: str) -> str:
    """``path``, made if missing, when it is a directory only this user can write (cached kernels are code);
    otherwise a fresh one of this process's own."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return tempfile.mkdtemp(prefix="dctchop-numba-")
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022:
        return path
    return tempfile.mkdtemp(prefix="dctchop-numba-")


def _cache_failures_cost_a_compile() -> None:
    """numba saves each kernel it compiles to its cache, and a failed save (a full disk, a quota or a file size
    limit where the package is installed) failed whatever needed the kernel: sweep and preview with an
    internal error, compress and decompress blaming their output. The kernel is compiled all the same; a
    failed save now removes the kernel's cache index, so the next run compiles it again: numba writes the
    index first, and after a change of the source it names a data file an older kernel may still be in. (It
    writes each file whole under a temporary name, so no half file is left to load.) The wrapper serves every
    numba kernel of the process, the caller's too."""
    save = caching.Cache.save_overload

    def save_overload(self, sig, data) -> None:
        try:
            save(self, sig, data)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(self._cache_file._index_path)

    caching.Cache.save_overload = save_overload


def _fork_between_compilations() -> None:
    """numba holds one lock while it compiles or loads a kernel from its cache. A fork at that moment (a
    torch DataLoader starting its workers while another thread decodes a first chunk) gave the child the lock
    held by a thread it does not have: its first kernel waited forever. A fork now waits for the lock, and
    both sides let go of it after."""
    os.register_at_fork(before=global_compiler_lock.acquire, after_in_parent=global_compiler_lock.release,
                        after_in_child=global_compiler_lock.release)


_prefer_512_bit_vectors()
VECTOR_BITS = _vector_bits()
_cache_somewhere()
_cache_failures_cost_a_compile()
_fork_between_compilations()
