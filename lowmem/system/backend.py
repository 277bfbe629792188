"""Backend selection: NumPy (always) or CuPy (optional, NVIDIA GPUs).

Every op and the engine take their array module from here (`xp`), never
`numpy.` directly on activation data, so one code base runs on both.

    LOWMEM_BACKEND=numpy|cupy|auto   (environment, read at import)
    lowmem.set_backend("numpy"|"cupy"|"auto")

"auto" picks CuPy only when it imports *and* sees at least one GPU. The CPU's fast
kernels are numba's, used where `numba_available()` (LOWMEM_FAST=0 turns them off).
"""
import os

import numpy

_BACKENDS = ("numpy", "cupy", "auto")
xp = numpy          # the active array module
name = "numpy"      # its name


def _cupy_usable():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:   # not installed, no driver, no device: all mean "no"
        return False


def set_backend(choice="auto"):
    """Select the array module; returns its name ("numpy" or "cupy")."""
    global xp, name
    if choice not in _BACKENDS:
        raise ValueError(f"unknown backend {choice!r}; expected one of {_BACKENDS}")
    if choice == "cupy" and not _cupy_usable():
        raise ValueError("backend 'cupy' requested but CuPy is not installed or sees no GPU "
                         "(install lowmem[gpu] on a machine with an NVIDIA GPU, or use 'numpy')")
    if choice == "cupy" or (choice == "auto" and _cupy_usable()):
        import cupy
        xp, name = cupy, "cupy"
    else:
        xp, name = numpy, "numpy"
    return name


def get_backend():
    """The active array module (numpy or cupy)."""
    return xp


def array_module(a):
    """numpy or cupy, whichever owns array `a` (Chainer's get_array_module): decided by the
    array's own type, whatever backend is active."""
    if type(a).__module__.split(".", 1)[0] == "cupy":
        import cupy
        return cupy
    return numpy


def numba_allowed():
    """Whether the numba kernels may be used: LOWMEM_FAST=0 (or false, no) turns them off."""
    return os.environ.get("LOWMEM_FAST", "1").strip() not in ("0", "false", "no")


_numba = None       # numba_available()'s answer, once asked


def numba_available():
    """Whether the numba kernels run: numba imports (lowmem[fast]) and LOWMEM_FAST allows it.
    The one check every numba module asks (units/cpu_base.py, ops/columns_cpu.py,
    ops/winograd.py), decided at its first call, so they all agree for the process's life; that
    call also keys numba's cache of every kernel on the whole package (system/kernel_cache.py)."""
    global _numba
    if _numba is None:
        try:
            import numba  # noqa: F401
        except ImportError:                                    # pragma: no cover - optional
            _numba = False
        else:
            from .kernel_cache import install
            install()                       # before any kernel is decorated: system/kernel_cache.py
            _numba = numba_allowed()
    return _numba


def to_numpy(a):
    """A host NumPy array for `a` (a no-op on the NumPy backend)."""
    return a.get() if hasattr(a, "get") else numpy.asarray(a)


set_backend(os.environ.get("LOWMEM_BACKEND", "auto").strip().lower() or "auto")
