"""system/prefetch.py: a cache hint inside numba kernels, with no effect on any value."""
import platform

import numpy as np
import pytest

numba = pytest.importorskip("numba")


def test_prefetch_compiles_and_changes_nothing():
    from lowmem.system.prefetch import prefetch

    @numba.njit(nogil=True)
    def walk(a, ahead):
        total = 0.0
        for i in range(a.size):
            if i % 16 == 0:
                prefetch(a, min(i + ahead, a.size - 1))       # up to the last element, never past it
            total += a[i]
        return total

    for dtype in (np.float32, np.float64, np.int32, np.uint8):
        a = np.arange(1000).astype(dtype)
        before = a.copy()
        assert walk(a, 256) == float(before.astype(np.float64).sum())
        np.testing.assert_array_equal(a, before)
    asm = next(iter(walk.inspect_asm().values()))
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert "prefetcht1" in asm                               # the hint is in the compiled code, into L2
