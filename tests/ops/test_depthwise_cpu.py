"""ops/depthwise_cpu.py (numba's direct depthwise loops) against ops/conv_groups.py's reference
paths on the same inputs: the forward and the input gradient bit for bit for one output channel
a group (the slice additions' order), the weight gradient to tolerance (a reduction); channel
multipliers against the reference's per-group GEMMs to tolerance. Float64 finite differences of
the same kernels are in tests/ops/test_ops_graph.py (COLUMNS)."""
import numpy as np
import pytest

from lowmem.ops import conv_groups, depthwise_cpu
from lowmem.ops.conv import NUMBA, SLICES, conv_out_size

pytestmark = pytest.mark.skipif(not depthwise_cpu.AVAILABLE, reason="numba not installed")

# (C, m, N, H, W, k, stride, pad): MobileNetV2's 3x3 at strides 1 and 2, odd and non-square
# planes, N = 1, 5x5 kernels, no padding, padding wider than the window needs
CASES = [(6, 1, 3, 8, 8, 3, 1, 1), (5, 1, 2, 9, 7, 3, 2, 1), (4, 1, 1, 7, 7, 3, 2, 1), (3, 1, 2, 6, 5, 5, 1, 2),
         (3, 1, 2, 11, 9, 5, 2, 2), (4, 1, 3, 5, 6, 3, 1, 0), (2, 1, 1, 3, 3, 3, 2, 2), (3, 1, 2, 1, 1, 3, 1, 1),
         (3, 1, 1, 20, 33, 3, 2, 1)]
MULTIPLIER_CASES = [(3, 2, 2, 7, 6, 3, 1, 1), (2, 3, 3, 9, 7, 3, 2, 1), (4, 2, 1, 5, 5, 5, 2, 2)]


def setup(rng, C, m, N, H, W, k, stride, pad, dtype):
    Ho, Wo = conv_out_size(H, k, stride, pad), conv_out_size(W, k, stride, pad)
    x = rng.standard_normal((C, N, H, W)).astype(dtype)
    w = rng.standard_normal((C * m, 1, k, k)).astype(dtype)
    g = rng.standard_normal((C * m, N, Ho, Wo)).astype(dtype)
    ws = np.empty(max(1, conv_groups.workspace_per_sample(C, k, k, Ho, Wo, C, C * m)) * N, dtype)
    return x, w, g, ws


def run(columns, x, w, g, ws, stride, pad, base):
    C = x.shape[0]
    out = np.full(g.shape, np.nan, x.dtype)
    dx, acc, dw = np.full_like(x, np.nan), base.copy(), np.full_like(w, 0.25)
    conv_groups.grouped_conv2d_forward(out, x, w, stride, pad, C, ws, columns=columns)
    conv_groups.grouped_conv2d_backward_input(dx, g, w, stride, pad, C, ws, columns=columns)
    conv_groups.grouped_conv2d_backward_input(acc, g, w, stride, pad, C, ws, accumulate=True, columns=columns)
    conv_groups.grouped_conv2d_backward_weight(dw, x, g, stride, pad, C, ws, columns=columns)
    return out, dx, acc, dw


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_direct_loops_are_the_slice_additions(rng, case, dtype):
    """m = 1: forward and input gradient (overwritten and accumulated) bit for bit the reference's,
    the weight gradient (accumulated onto 0.25) to rounding."""
    C, m, N, H, W, k, stride, pad = case
    x, w, g, ws = setup(rng, *case, dtype)
    base = rng.standard_normal(x.shape).astype(dtype)
    calls = []
    fast = NUMBA._replace(depthwise=Counting(depthwise_cpu, calls))
    got, want = run(fast, x, w, g, ws, stride, pad, base), run(SLICES, x, w, g, ws, stride, pad, base)
    assert calls == ["forward", "backward_input", "backward_input", "backward_weight"]
    for a, b in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(a, b)
    tol = 2e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(got[3], want[3], rtol=tol, atol=tol * np.abs(want[3]).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", MULTIPLIER_CASES)
def test_channel_multipliers_match_the_per_group_gemms(rng, case, dtype):
    """m > 1 (output channel o reads input channel o // m): the reference runs a GEMM per group,
    which sums in another order, so all three to rounding."""
    C, m, N, H, W, k, stride, pad = case
    x, w, g, ws = setup(rng, *case, dtype)
    base = rng.standard_normal(x.shape).astype(dtype)
    calls = []
    fast = NUMBA._replace(depthwise=Counting(depthwise_cpu, calls))
    got, want = run(fast, x, w, g, ws, stride, pad, base), run(SLICES, x, w, g, ws, stride, pad, base)
    assert len(calls) == 4
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max())


def test_views_the_loops_cannot_index_take_the_reference(rng):
    """A strided x (not C-contiguous) is not the loops' to index flat: the reference runs, and
    gives the reference's output."""
    x, w, g, ws = setup(rng, 4, 1, 2, 6, 6, 3, 1, 1, np.float32)
    wide = np.zeros((4, 2, 6, 12), np.float32)
    wide[..., ::2] = x
    view = wide[..., ::2]
    assert not depthwise_cpu.applies(view, g, w)
    calls = []
    fast = NUMBA._replace(depthwise=Counting(depthwise_cpu, calls))
    out, want = np.empty_like(g), np.empty_like(g)
    conv_groups.grouped_conv2d_forward(out, view, w, 1, 1, 4, ws, columns=fast)
    conv_groups.grouped_conv2d_forward(want, x, w, 1, 1, 4, ws, columns=SLICES)
    assert calls == []
    np.testing.assert_array_equal(out, want)


def test_an_engine_on_the_fast_kernels_runs_its_depthwise_convs_directly(monkeypatch):
    """An engine with fused kernels hands its depthwise convs to the numba loops (the columns it
    chose carry them); one on the reference kernels never does. (The two forwards agree to rounding:
    their batch-norm statistics are summed in other orders.)"""
    import lowmem
    from lowmem import nn
    g = nn.Graph("dw", input_shape=(3, 8, 8), num_classes=4)
    h = g.conv(g.bn_relu(g.conv(g.input, 8, 3)), 8, 3, stride=2, groups=8)
    net = g.head(g.bn_relu(h))
    calls = []
    for name in ("forward", "backward_input", "backward_weight"):
        monkeypatch.setattr(depthwise_cpu, name, counted(getattr(depthwise_cpu, name), calls, name))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 3, 8, 8)).astype(np.float32), rng.integers(0, 4, 8)
    logits = {}
    for fast in (False, True):
        calls.clear()
        eng = lowmem.Engine(net, 8, (3, 8, 8), mode="approx", bits=4, use_fast=fast)
        logits[fast] = eng.forward(x, y)[1].copy()
        eng.backward()
        assert sorted(calls) == (["backward_input", "backward_weight", "forward"] if fast else []), calls
    np.testing.assert_allclose(logits[True], logits[False], rtol=1e-4, atol=1e-6)


class Counting:
    """A depthwise kernel module whose three kernels note their calls."""

    def __init__(self, module, calls):
        self.applies = module.applies
        for name in ("forward", "backward_input", "backward_weight"):
            setattr(self, name, counted(getattr(module, name), calls, name))


def counted(fn, calls, name):
    def call(*a, **k):
        calls.append(name)
        return fn(*a, **k)
    return call


def test_no_result_reads_uninitialised_scratch(rng):
    """The junk columns and rows of the padded scratch are computed but never kept; in the weight
    gradient they meet dout's zeros, and 0 * NaN is NaN, so every scratch element a loop reads must
    be written first. Poisoned heap: the allocator hands the kernels memory a NaN array just freed
    (sizes swept to meet the scratch's size class), and every gradient stays the reference's."""
    from numba import njit

    @njit
    def poison(n):
        return np.full(n, np.nan, np.float32).sum()

    for C, N, H, s in [(6, 3, 4, 1), (6, 3, 8, 1), (5, 2, 7, 2), (4, 3, 6, 2)]:
        x, w, g, ws = setup(rng, C, 1, N, H, H, 3, s, 1, np.float32)
        want = np.zeros_like(w)
        conv_groups.grouped_conv2d_backward_weight(want, x, g, s, 1, C, ws, columns=SLICES)
        for n in range(16, 4000, 7):
            poison(n)
            dw = np.zeros_like(w)
            depthwise_cpu.backward_weight(dw, x, g, s, 1)
            np.testing.assert_allclose(dw, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


# the coded weight gradient: planes whose block spans start inside a byte (odd planes at 4 and 2
# bits) and inside a group, blocks of several samples, a plane larger than a block, multipliers
CODED_CASES = [(6, 1, 3, 8, 8, 3, 1, 1), (5, 1, 3, 7, 7, 3, 2, 1), (4, 1, 5, 5, 3, 3, 1, 1), (3, 2, 2, 7, 6, 3, 1, 1),
               (2, 1, 2, 70, 66, 3, 2, 1), (3, 1, 2, 11, 9, 5, 2, 2)]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CODED_CASES)
def test_weight_gradient_from_the_range_code_is_the_decoded_inputs(rng, case, dtype, bits):
    """backward_weight_coded (each block of planes decoded into the kernel's scratch) equals
    range_decode into a buffer, then backward_weight, bit for bit, accumulating onto 0.25."""
    from lowmem.units import rangecode, rangecode_cpu
    C, m, N, H, W, k, stride, pad = case
    x, w, g, _ = setup(rng, *case, dtype)
    x = np.maximum(x, 0) * 3                        # a ReLU's output: zeros and a range
    packed = np.zeros(-(-x.size * bits // 8), np.uint8)
    scale, zero = np.zeros(rangecode.groups(x.size), np.float32), np.zeros(rangecode.groups(x.size), np.uint8)
    rangecode_cpu.range_encode(packed, scale, zero, x.reshape(-1), bits)
    xd = np.empty_like(x)
    rangecode_cpu.range_decode(xd.reshape(-1), packed, scale, zero, bits)
    want, got = np.full_like(w, 0.25), np.full_like(w, 0.25)
    depthwise_cpu.backward_weight(want, xd, g, stride, pad)
    code = rangecode.RangeCode(packed, scale, zero, bits)
    assert depthwise_cpu.applies_coded(g, w, code)
    depthwise_cpu.backward_weight_coded(got, code, x.shape, g, stride, pad, rangecode.GROUP)
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(want, np.full_like(w, 0.25))
