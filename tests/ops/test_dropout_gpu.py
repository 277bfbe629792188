"""Dropout's CUDA kernels (lowmem/ops/dropout_gpu.py) against the NumPy reference
(lowmem/ops/dropout.py), on a GPU and on the CPU emulation of the same text (the `dev` fixture):
masks byte for byte (the same counter stream), outputs and gradients bit for bit, float32 and
float64, partial bytes, in place and apart, accumulating."""
import numpy as np
import pytest

from lowmem.ops import bitpack, dropout as ref
from lowmem.ops import dropout_gpu as cuda

pytestmark = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")     # 0 * inf in the reference


def same(a, b):
    ints = {4: np.uint32, 8: np.uint64}[a.itemsize]
    np.testing.assert_array_equal(a.view(ints), b.view(ints))


@pytest.mark.parametrize("p", [0.0, 0.3, 0.93])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", [1, 9, 301])
def test_forward_and_backward_equal_the_reference(dev, rng, p, dtype, n):
    key = ref.stream_key(3, 17, 2, 1)
    x = (rng.standard_normal(n) * 4).astype(dtype)
    x[::13] = np.array([np.inf, -0.0, np.nan], dtype)[np.arange(x[::13].size) % 3]
    want_out, want_mask = np.empty_like(x), np.empty(bitpack.packed_nbytes(n, 1), np.uint8)
    ref.dropout_forward(want_out, want_mask, x, p, key)
    out, mask, xd = dev.put(np.full_like(x, 7)), dev.put(np.full_like(want_mask, 0xA5)), dev.put(x)
    cuda.dropout_forward(out, mask, xd, p, key)
    same(dev.get(out), want_out)
    np.testing.assert_array_equal(dev.get(mask), want_mask)
    cuda.dropout_forward(xd, mask, xd, p, key)
    same(dev.get(xd), want_out)
    g = rng.standard_normal(n).astype(dtype)
    for accumulate in (False, True):
        want = rng.standard_normal(n).astype(dtype)
        got = dev.put(want)
        ref.dropout_backward(want, g, want_mask, p, accumulate)
        cuda.dropout_backward(got, dev.put(g), dev.put(want_mask), p, accumulate)
        same(dev.get(got), want)
