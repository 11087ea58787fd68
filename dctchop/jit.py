"""numba as dctchop's kernels are compiled: with 512-bit vectors where the processor has AVX-512.

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

import numba
from numba.core import codegen, config

__all__ = ["numba"]


def _prefer_512_bit_vectors() -> None:
    if config.CPU_NAME is not None or config.CPU_FEATURES is not None:
        return
    features = codegen.get_host_cpu_features()  # what numba would use (honours NUMBA_ENABLE_AVX)
    if "+avx512f" in features.split(","):
        config.CPU_FEATURES = features + ",-prefer-256-bit"


_prefer_512_bit_vectors()
