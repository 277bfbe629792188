"""Dropout's numba kernels (lowmem/ops/dropout_cpu.py) against the NumPy reference
(lowmem/ops/dropout.py): the packed masks byte for byte (the same draws of the same counter
stream), outputs and gradients bit for bit, float32 and float64, p = 0 and others, sizes that
are not multiples of 8 or of a block, in place and apart, accumulating, over 1 or 2 threads."""
import numpy as np
import pytest

from lowmem.ops import bitpack, bitpack_cpu, dropout as ref
from lowmem.ops import dropout_cpu as fast
from lowmem.system import threads

pytestmark = [pytest.mark.skipif(not fast.AVAILABLE, reason="numba not installed"),
              pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")]   # 0 * inf in the reference

SIZES = [1, 7, 9, 61, 4097, 3 * 4096 + 5]


def data(rng, n, dtype):
    x = (rng.standard_normal(n) * 4).astype(dtype)
    specials = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45], dtype)
    x[::13] = specials[np.arange(x[::13].size) % specials.size]
    return x


def same(a, b):
    ints = {4: np.uint32, 8: np.uint64}[a.itemsize]
    np.testing.assert_array_equal(a.view(ints), b.view(ints))


@pytest.mark.parametrize("p", [0.0, 0.2, 0.5, 0.93])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", SIZES)
def test_forward_and_backward_equal_the_reference(rng, p, dtype, n):
    key = ref.stream_key(3, 17, 2, 1)
    x = data(rng, n, dtype)
    want_out, want_mask = np.empty_like(x), np.full(bitpack.packed_nbytes(n, 1), 0xFF, np.uint8)
    ref.dropout_forward(want_out, want_mask, x, p, key)
    out, mask = np.full_like(x, 7), np.full_like(want_mask, 0xA5)
    fast.dropout_forward(out, mask, x, p, key)
    same(out, want_out)
    np.testing.assert_array_equal(mask, want_mask)
    inplace = x.copy()
    fast.dropout_forward(inplace, mask, inplace, p, key)
    same(inplace, want_out)
    g = data(rng, n, dtype)
    for accumulate in (False, True):
        want = data(rng, n, dtype)
        got = want.copy()
        ref.dropout_backward(want, g, want_mask, p, accumulate)
        fast.dropout_backward(got, g, want_mask, p, accumulate)
        same(got, want)
    want, got = g.copy(), g.copy()
    ref.dropout_backward(want, want, want_mask, p)
    fast.dropout_backward(got, got, want_mask, p)
    same(got, want)


@pytest.mark.parametrize("count", [1, 2])
def test_across_threads(rng, monkeypatch, count):
    before = threads.threads()
    threads.configure(count)
    monkeypatch.setattr(bitpack_cpu, "GRAIN", bitpack_cpu.BLOCK)
    try:
        x = data(rng, 5 * 4096 + 3, np.float32)
        want_out, want_mask = np.empty_like(x), np.empty(bitpack.packed_nbytes(x.size, 1), np.uint8)
        ref.dropout_forward(want_out, want_mask, x, 0.3, 99)
        out, mask = np.empty_like(x), np.empty_like(want_mask)
        fast.dropout_forward(out, mask, x, 0.3, 99)
        same(out, want_out)
        np.testing.assert_array_equal(mask, want_mask)
    finally:
        threads.configure(before)
