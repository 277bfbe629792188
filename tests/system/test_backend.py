"""lowmem.system.backend: choosing NumPy or CuPy, and the helpers every op uses (array_module, to_numpy,
numba_allowed, numba_available). CuPy itself is not needed: where it is absent, asking for it must fail clearly."""
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import lowmem
from lowmem.system import backend


@pytest.fixture
def restore_backend():
    before = backend.name
    yield
    backend.set_backend(before)


def test_numpy_is_always_available(restore_backend):
    assert backend.set_backend("numpy") == "numpy"
    assert backend.xp is np and backend.get_backend() is np and lowmem.get_backend() is np


@pytest.mark.parametrize("choice", ["torch", "NumPy", "", None, "gpu"])
def test_an_unknown_backend_is_refused(restore_backend, choice):
    with pytest.raises(ValueError, match=r"unknown backend .* expected one of \('numpy', 'cupy', 'auto'\)"):
        backend.set_backend(choice)


def test_cupy_without_a_gpu_is_refused_with_the_fix(restore_backend, monkeypatch):
    monkeypatch.setattr(backend, "_cupy_usable", lambda: False)
    with pytest.raises(ValueError, match=r"backend 'cupy' requested but CuPy is not installed or sees no GPU"):
        backend.set_backend("cupy")
    assert backend.xp is np                          # the failed request changed nothing
    assert backend.set_backend("auto") == "numpy"    # auto falls back to NumPy


def test_array_module_follows_the_array_not_the_backend(monkeypatch):
    assert backend.array_module(np.zeros(2)) is np
    assert backend.array_module(np.float32(1)) is np
    assert backend.array_module([1, 2]) is np        # anything not CuPy's is NumPy's
    fake_cupy = types.ModuleType("cupy")
    monkeypatch.setitem(__import__("sys").modules, "cupy", fake_cupy)
    FakeArray = type("ndarray", (), {"__module__": "cupy._core.core"})
    assert backend.array_module(FakeArray()) is fake_cupy


def test_to_numpy_copies_device_arrays_and_passes_host_ones():
    a = np.arange(3.0)
    assert backend.to_numpy(a) is a
    assert np.array_equal(backend.to_numpy([1, 2]), np.array([1, 2]))
    device = types.SimpleNamespace(get=lambda: np.ones(2))   # CuPy's .get() returns a host copy
    assert np.array_equal(backend.to_numpy(device), np.ones(2))


@pytest.mark.parametrize("value,allowed", [(None, True), ("1", True), ("0", False), ("false", False),
                                           ("no", False), (" 0 ", False), ("yes", True)])
def test_lowmem_fast_turns_numba_off(monkeypatch, value, allowed):
    if value is None:
        monkeypatch.delenv("LOWMEM_FAST", raising=False)
    else:
        monkeypatch.setenv("LOWMEM_FAST", value)
    assert backend.numba_allowed() is allowed


@pytest.mark.parametrize("fast", ["0", "1"])
def test_every_numba_module_asks_one_check(fast):
    """units/cpu_base.py (and the sets over it), ops/columns_cpu.py and ops/winograd.py take
    numba's presence from backend.numba_available(): LOWMEM_FAST=0 turns all of them off."""
    code = ("from lowmem.system import backend; from lowmem.units import cpu_base, window_cpu, unbiased_cpu; "
            "from lowmem.ops import columns_cpu, winograd; "
            "print(backend.numba_available(), {m.AVAILABLE for m in (cpu_base, window_cpu, unbiased_cpu, "
            "columns_cpu, winograd)})")
    env = dict(os.environ, LOWMEM_FAST=fast)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    available, modules = r.stdout.split(maxsplit=1)
    assert modules.strip() == "{" + available + "}"
    if fast == "0":
        assert available == "False"
