"""ReLU's and ReLU6's CUDA kernels (lowmem/ops/relu_gpu.py) against the NumPy reference
(lowmem/ops/relu.py), on a GPU and on the CPU emulation of the same text (the `dev` fixture):
outputs, gradients and packed codes bit for bit, float32 and float64, partial bytes, signed
zeros, NaN, infinities, values on the bounds, in place and apart, accumulating."""
import numpy as np
import pytest

from lowmem.ops import bitpack, relu as ref
from lowmem.ops import relu_gpu as cuda

pytestmark = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")     # 0 * inf in the reference

CASES = {"relu": (1, ref.relu_forward, ref.relu_backward, cuda.relu_forward, cuda.relu_backward),
         "relu6": (2, ref.relu6_forward, ref.relu6_backward, cuda.relu6_forward, cuda.relu6_backward)}


def data(rng, n, dtype):
    x = (rng.standard_normal(n) * 4).astype(dtype)
    specials = np.array([0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 6.0, -6.0, 1e-45], dtype)
    x[::11] = specials[np.arange(x[::11].size) % specials.size]
    return x


def same(a, b):
    ints = {4: np.uint32, 8: np.uint64}[a.itemsize]
    np.testing.assert_array_equal(a.view(ints), b.view(ints))


@pytest.mark.parametrize("op", sorted(CASES))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", [1, 7, 9, 301])
def test_forward_and_backward_equal_the_reference(dev, rng, op, dtype, n):
    bits, ref_fwd, ref_bwd, fwd, bwd = CASES[op]
    x = data(rng, n, dtype)
    want_out, want_code = np.empty_like(x), np.empty(bitpack.packed_nbytes(n, bits), np.uint8)
    ref_fwd(want_out, want_code, x)
    out, code, xd = dev.put(np.full_like(x, 7)), dev.put(np.full_like(want_code, 0xA5)), dev.put(x)
    fwd(out, code, xd)
    same(dev.get(out), want_out)
    np.testing.assert_array_equal(dev.get(code), want_code)
    fwd(xd, code, xd)                                   # in place
    same(dev.get(xd), want_out)
    g = data(rng, n, dtype)
    for accumulate in (False, True):
        want = data(rng, n, dtype)
        got = dev.put(want)
        ref_bwd(want, g, want_code, accumulate)
        bwd(got, dev.put(g), dev.put(want_code), accumulate)
        same(dev.get(got), want)
    want, got = g.copy(), dev.put(g)
    ref_bwd(want, want, want_code)
    bwd(got, got, dev.put(want_code))
    same(dev.get(got), want)
