"""Max-pool's CUDA kernels (lowmem/ops/pool_gpu.py) against the NumPy reference (lowmem/ops/pool.py,
its indices packed by ops/bitpack.py), on a GPU and on the CPU emulation of the same text (the
`dev` fixture): packed indices byte for byte, outputs and input gradients bit for bit, float32 and
float64, 3x3/2 pad 1, 2x2/2, 3x3/1, odd planes, ties, -0, NaN and -inf; eval writes no index."""
import numpy as np
import pytest

from lowmem.ops import bitpack, pool as ref
from lowmem.ops import pool_gpu as cuda
from lowmem.ops.conv import conv_out_size


def same(a, b):
    ints = {4: np.uint32, 8: np.uint64}[a.itemsize]
    np.testing.assert_array_equal(a.view(ints), b.view(ints))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(1, 1, 5, 5), (3, 2, 7, 9)])
@pytest.mark.parametrize("k,stride,pad", [(3, 2, 1), (2, 2, 0), (3, 1, 1)])
def test_forward_and_backward_equal_the_reference(dev, rng, dtype, shape, k, stride, pad):
    x = rng.integers(-3, 4, shape).astype(dtype)
    x.reshape(-1)[::7] = -0.0
    x.reshape(-1)[3::29] = np.nan
    x.reshape(-1)[5::31] = -np.inf
    C, N, H, W = shape
    Ho, Wo = conv_out_size(H, k, stride, pad), conv_out_size(W, k, stride, pad)
    want_out, index = np.empty((C, N, Ho, Wo), dtype), np.empty((C, N, Ho, Wo), np.uint8)
    ref.maxpool_forward(want_out, index, x, k, stride, pad)
    want_code = np.empty(bitpack.packed_nbytes(index.size, 4), np.uint8)
    bitpack.pack_codes(want_code, index, 4)
    out, code, xd = dev.put(np.full_like(want_out, 7)), dev.put(np.full_like(want_code, 0xA5)), dev.put(x)
    cuda.maxpool_forward(out, code, xd, k, stride, pad)
    same(dev.get(out), want_out)
    np.testing.assert_array_equal(dev.get(code), want_code)
    out2 = dev.put(np.full_like(want_out, 7))
    cuda.maxpool_forward(out2, None, xd, k, stride, pad)
    same(dev.get(out2), want_out)
    dout = rng.standard_normal(want_out.shape).astype(dtype)
    want_dx, dx = np.empty_like(x), dev.put(np.full_like(x, np.nan))
    ref.maxpool_backward(want_dx, dout, index, k, stride, pad)
    cuda.maxpool_backward(dx, dev.put(dout), code, k, stride, pad)
    same(dev.get(dx), want_dx)
