"""ReLU's and ReLU6 / clip's numba kernels (lowmem/ops/relu_cpu.py) against the NumPy reference
(lowmem/ops/relu.py): outputs, gradients and packed codes bit for bit, float32 and float64,
sizes that are not multiples of 8 or of a block, zeros of both signs, NaN, infinities, values on
the clip bounds, in place and apart, accumulating, over 1 or 2 threads."""
import numpy as np
import pytest

from lowmem.ops import bitpack, bitpack_cpu, relu as ref
from lowmem.ops import relu_cpu as fast
from lowmem.system import threads

pytestmark = [pytest.mark.skipif(not fast.AVAILABLE, reason="numba not installed"),
              pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")]   # 0 * inf in the reference

SIZES = [1, 7, 8, 9, 61, 4095, 4097, 3 * 4096 + 5]


def data(rng, n, dtype):
    x = (rng.standard_normal(n) * 4).astype(dtype)
    specials = np.array([0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 6.0, -6.0, 1e-45], dtype)
    x[::11] = specials[np.arange(x[::11].size) % specials.size]
    return x


def bits_of(a):
    return a.view({4: np.uint32, 8: np.uint64}[a.itemsize])


def same(a, b):
    np.testing.assert_array_equal(bits_of(a), bits_of(b))


CASES = {"relu": (1, ref.relu_forward, ref.relu_backward, fast.relu_forward, fast.relu_backward),
         "relu6": (2, ref.relu6_forward, ref.relu6_backward, fast.relu6_forward, fast.relu6_backward)}


@pytest.mark.parametrize("op", sorted(CASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", SIZES)
def test_forward_and_backward_equal_the_reference(rng, op, dtype, n):
    bits, ref_fwd, ref_bwd, fwd, bwd = CASES[op]
    x = data(rng, n, dtype)
    want_out, want_code = np.empty_like(x), np.full(bitpack.packed_nbytes(n, bits), 0xFF, np.uint8)
    ref_fwd(want_out, want_code, x)
    out, code = np.full_like(x, 7), np.full_like(want_code, 0xA5)
    fwd(out, code, x)
    same(out, want_out)
    np.testing.assert_array_equal(code, want_code)
    inplace, code2 = x.copy(), np.zeros_like(want_code)
    fwd(inplace, code2, inplace)
    same(inplace, want_out)
    np.testing.assert_array_equal(code2, want_code)
    g = data(rng, n, dtype)
    for accumulate in (False, True):
        want = data(rng, n, dtype)
        got = want.copy()
        ref_bwd(want, g, want_code, accumulate)
        bwd(got, g, want_code, accumulate)
        same(got, want)
    want, got = g.copy(), g.copy()                  # dx is dout
    ref_bwd(want, want, want_code)
    bwd(got, got, want_code)
    same(got, want)


@pytest.mark.parametrize("lo,hi", [(-1.0, 1.0), (0.1, 0.7), (-3.0, 0.0)])
def test_clip_at_other_bounds(rng, lo, hi):
    for dtype in (np.float32, np.float64):
        x = data(rng, 1000, dtype)
        x[::7] = lo
        x[3::7] = hi
        want_out, want_code = np.empty_like(x), np.empty(250, np.uint8)
        ref.clip_forward(want_out, want_code, x, lo, hi)
        out, code = np.empty_like(x), np.empty(250, np.uint8)
        fast.clip_forward(out, code, x, lo, hi)
        same(out, want_out)
        np.testing.assert_array_equal(code, want_code)


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def split(request, monkeypatch):
    before = threads.threads()
    threads.configure(request.param)
    monkeypatch.setattr(bitpack_cpu, "GRAIN", bitpack_cpu.BLOCK)
    yield
    threads.configure(before)


def test_across_threads(rng, split):
    x = data(rng, 5 * 4096 + 3, np.float32)
    for op in CASES:
        bits, ref_fwd, _, fwd, _ = CASES[op]
        want_out, want_code = np.empty_like(x), np.empty(bitpack.packed_nbytes(x.size, bits), np.uint8)
        ref_fwd(want_out, want_code, x)
        out, code = np.empty_like(x), np.empty_like(want_code)
        fwd(out, code, x)
        same(out, want_out)
        np.testing.assert_array_equal(code, want_code)


def test_partial_overlap_and_other_arrays(rng):
    x = rng.standard_normal(64)
    with pytest.raises(ValueError, match="overlaps"):
        fast.relu_forward(x[1:33], np.empty(4, np.uint8), x[:32])
    with pytest.raises(ValueError, match=r"mask must be uint8 of shape \(8,\)"):
        fast.relu_forward(np.empty_like(x), np.empty(3, np.uint8), x)
    h = x.astype(np.float16)                       # not the kernels': the reference runs
    out, mask = np.empty_like(h), np.empty(8, np.uint8)
    fast.relu_forward(out, mask, h)
    np.testing.assert_array_equal(out, np.maximum(h, 0))
