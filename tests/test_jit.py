"""dctchop's kernels are compiled with 512-bit vectors where the processor has AVX-512 (dctchop.jit)."""

import os
import subprocess
import sys

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


def _probe(**env_vars) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
    run = subprocess.run([sys.executable, "-c", PROBE], env={**env, **env_vars}, capture_output=True, text=True,
                         check=True)
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
