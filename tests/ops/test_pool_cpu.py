"""Max-pool's numba kernels (lowmem/ops/pool_cpu.py) against the NumPy reference
(lowmem/ops/pool.py, its uint8 indices packed by ops/bitpack.py): the packed 4-bit indices byte
for byte, the output and the input gradient bit for bit, float32 and float64, the ImageNet stem's
3x3/2 pad 1, 2x2/2, 3x3/1, 3x3/2 pad 0, 4x4/3 pad 2, odd planes (indices crossing bytes between planes), N = 1, one
channel, ties, -0, NaN and -inf windows, over 1 or 2 threads; in eval no index is written."""
import numpy as np
import pytest

from lowmem.ops import bitpack, bitpack_cpu, pool as ref
from lowmem.ops import pool_cpu as fast
from lowmem.ops.conv import conv_out_size
from lowmem.system import threads

pytestmark = pytest.mark.skipif(not fast.AVAILABLE, reason="numba not installed")

SHAPES = [(1, 1, 5, 5), (3, 2, 7, 9), (2, 1, 8, 8), (4, 3, 13, 11), (2, 3, 9, 9)]
WINDOWS = [(3, 2, 1), (2, 2, 0), (3, 1, 1), (3, 2, 0), (4, 3, 2)]   # the last two: other phases of a row


def data(rng, shape, dtype):
    x = rng.integers(-3, 4, shape).astype(dtype)        # small integers: ties in most windows
    flat = x.reshape(-1)
    flat[::7] = -0.0
    flat[3::29] = np.nan
    flat[5::31] = -np.inf
    return x


def same(a, b):
    ints = {4: np.uint32, 8: np.uint64}[a.itemsize]
    np.testing.assert_array_equal(a.view(ints), b.view(ints))


def reference(x, k, stride, pad):
    C, N, H, W = x.shape
    Ho, Wo = conv_out_size(H, k, stride, pad), conv_out_size(W, k, stride, pad)
    out, index = np.empty((C, N, Ho, Wo), x.dtype), np.empty((C, N, Ho, Wo), np.uint8)
    ref.maxpool_forward(out, index, x, k, stride, pad)
    packed = np.empty(bitpack.packed_nbytes(index.size, 4), np.uint8)
    bitpack.pack_codes(packed, index, 4)
    return out, index, packed


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k,stride,pad", WINDOWS)
def test_forward_and_backward_equal_the_reference(rng, dtype, shape, k, stride, pad):
    x = data(rng, shape, dtype)
    want_out, index, want_code = reference(x, k, stride, pad)
    out, code = np.full_like(want_out, 7), np.full_like(want_code, 0xA5)
    fast.maxpool_forward(out, code, x, k, stride, pad)
    same(out, want_out)
    np.testing.assert_array_equal(code, want_code)
    eval_out = np.empty_like(out)
    fast.maxpool_forward(eval_out, None, x, k, stride, pad)
    same(eval_out, want_out)
    dout = rng.standard_normal(out.shape).astype(dtype)
    dout.reshape(-1)[::5] = -0.0
    want_dx, dx = np.empty_like(x), np.full_like(x, np.nan)
    ref.maxpool_backward(want_dx, dout, index, k, stride, pad)
    fast.maxpool_backward(dx, dout, code, k, stride, pad)
    same(dx, want_dx)


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("shape", [(3, 5, 17, 15), (3, 5, 17, 17)], ids=["even planes", "odd planes"])
def test_across_threads(rng, monkeypatch, count, shape):
    before = threads.threads()
    threads.configure(count)
    monkeypatch.setattr(fast, "GRAIN", 1)
    try:
        x = data(rng, shape, np.float32)
        want_out, index, want_code = reference(x, 3, 2, 1)
        out, code = np.empty_like(want_out), np.empty_like(want_code)
        fast.maxpool_forward(out, code, x, 3, 2, 1)
        same(out, want_out)
        np.testing.assert_array_equal(code, want_code)
        dout = rng.standard_normal(out.shape).astype(np.float32)
        want_dx, dx = np.empty_like(x), np.empty_like(x)
        ref.maxpool_backward(want_dx, dout, index, 3, 2, 1)
        fast.maxpool_backward(dx, dout, code, 3, 2, 1)
        same(dx, want_dx)
    finally:
        threads.configure(before)
