"""Shared test setup.

The tests build their inputs as NumPy arrays, so they run on the NumPy
backend whatever LOWMEM_BACKEND says (GPU checks live in benchmarks/ and
their own scripts). Helpers shared by several test modules are fixtures here.

BLAS runs single-threaded unless the environment says otherwise: the tests'
matrices are tiny, and on a busy 2-core machine OpenBLAS's spinning threads
made the suite 2-3x slower (timing belongs in benchmarks/, which do not set this).
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # must precede the first numpy import

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import lowmem  # noqa: E402
from lowmem.core.network import Parameter  # noqa: E402
from lowmem.system import cuda as cuda_helper  # noqa: E402
from reference import central_difference  # noqa: E402  (tests/reference.py)
import cuda_emulation  # noqa: E402  (tests/cuda_emulation.py)

lowmem.set_backend("numpy")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def fd():
    """reference.central_difference, as a fixture."""
    return central_difference


@pytest.fixture
def make_param():
    """Parameter(name, float64 data, zero grad) factory for optimizer tests."""
    def make(name, data, decay):
        data = np.array(data, dtype=np.float64)
        return Parameter(name, data, np.zeros_like(data), decay=decay)
    return make


@pytest.fixture(scope="session")
def emulator(tmp_path_factory):
    """Every registered CUDA program compiled for the CPU emulator (tests/cuda_emulation.py), once."""
    return cuda_emulation.build(tmp_path_factory)


@pytest.fixture(params=["emu", "gpu"])
def dev(request, monkeypatch):
    """Where a CUDA kernel test runs: the CPU emulation of the kernels ("emu"), or CuPy on a GPU
    ("gpu", skipped without one)."""
    cuda_helper.reset()
    if request.param == "emu":
        cuda_emulation.emulate(monkeypatch, request.getfixturevalue("emulator"))
        yield cuda_emulation.Device("emu", lambda a: np.array(a), lambda a: np.array(a), np)
    else:
        cupy = cuda_emulation.gpu()
        yield cuda_emulation.Device("gpu", cupy.asarray, cupy.asnumpy, cupy)
    cuda_helper.reset()
