"""units/norm_cpu.py (numba, a batch norm with no ReLU after it) and the kernel sets of
units/norm.py against ops/batchnorm.py's array ops on the same inputs: x-hat and out bit for bit,
the backward's sums and dx to tolerance, with float64 finite differences of the fused backward;
an engine's standalone batch norms run on the set it chose."""
import numpy as np
import pytest

from reference import check_grad

from lowmem.ops import batchnorm as ref
from lowmem.units import norm, norm_cpu, rangecode

pytestmark = pytest.mark.skipif(not norm_cpu.AVAILABLE, reason="numba not installed")
EPS = 1e-5


def case(rng, dtype, C=7, M=5003):
    """x with a large offset and varied scales, gamma of both signs and one 0, beta."""
    x = (rng.standard_normal((C, M)) * rng.uniform(0.1, 5, (C, 1)) + rng.uniform(-50, 50, (C, 1))).astype(dtype)
    g, b = rng.standard_normal(C).astype(dtype), rng.standard_normal(C).astype(dtype)
    g[2] = 0
    mean, var, rstd = (np.empty(C, dtype) for _ in range(3))
    ref.bn_stats(mean, var, rstd, x, EPS)
    return x, g, b, mean, var, rstd


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("inplace", [False, True])
def test_forward_is_the_reference_bit_for_bit(rng, dtype, inplace):
    """x-hat and out of one pass (and of normalize, then apply) equal bn_normalize's and
    bn_apply_forward's for the same statistics; out may be x itself."""
    x, g, b, mean, _, rstd = case(rng, dtype)
    want_h, want = np.empty_like(x), np.empty_like(x)
    ref.bn_normalize(want_h, x, mean, rstd)
    ref.bn_apply_forward(want, want_h, g, b)
    out = x.copy() if inplace else np.full_like(x, np.nan)
    xhat = np.full_like(x, np.nan)
    norm_cpu.forward(out, xhat, out if inplace else x, mean, rstd, g, b)
    np.testing.assert_array_equal(xhat, want_h)
    np.testing.assert_array_equal(out, want)
    two = x.copy() if inplace else np.full_like(x, np.nan)
    norm_cpu.normalize(two, two if inplace else x, mean, rstd)
    np.testing.assert_array_equal(two, want_h)
    norm_cpu.apply(two, g, b)
    np.testing.assert_array_equal(two, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode", ["overwrite", "in place", "accumulate"])
def test_backward_matches_the_reference(rng, dtype, mode):
    """dgamma, dbeta (accumulated onto what they held) and dx (written, written over dy, or added)
    as ops.bn_backward's, to rounding; dy is read only unless dx is dy."""
    x, g, b, mean, _, rstd = case(rng, dtype)
    xhat = np.empty_like(x)
    ref.bn_normalize(xhat, x, mean, rstd)
    dy = rng.standard_normal(x.shape).astype(dtype)
    base = rng.standard_normal(x.shape).astype(dtype)
    C = x.shape[0]
    want = [base.copy() if mode == "accumulate" else np.empty_like(x), np.full(C, 0.5, dtype), np.full(C, -1, dtype)]
    ref.bn_backward(want[0], want[1], want[2], dy, xhat, g, rstd, mode == "accumulate")
    got_dy = dy.copy()
    dx = got_dy if mode == "in place" else (base.copy() if mode == "accumulate" else np.full_like(x, np.nan))
    dg, db = np.full(C, 0.5, dtype), np.full(C, -1, dtype)
    norm_cpu.backward(dx, dg, db, got_dy, xhat, g, rstd, mode == "accumulate")
    tol = 2e-5 if dtype == np.float32 else 1e-12
    for a, w in zip((dx, dg, db), want):
        np.testing.assert_allclose(a, w, rtol=tol, atol=tol * np.abs(w).max())
    if mode != "in place":
        np.testing.assert_array_equal(got_dy, dy)


@pytest.mark.parametrize("eps", (1e-2, 1e-4, 1e-6))
def test_fused_backward_finite_differences(rng, eps):
    """float64: the loss sum(out * G) through normalize-with-batch-statistics and the fused forward;
    the fused backward's dx, dgamma and dbeta against central differences."""
    _, g, b, _, _, _ = case(rng, np.float64, C=3, M=40)
    x = rng.standard_normal((3, 40)) * 2 + 1             # unit scale: central differences stay O(eps^2)
    G = rng.standard_normal(x.shape)

    def loss():
        mean, var, rstd = (np.empty(3) for _ in range(3))
        ref.bn_stats(mean, var, rstd, x, EPS)
        out, xhat = np.empty_like(x), np.empty_like(x)
        norm_cpu.forward(out, xhat, x, mean, rstd, g, b)
        return float(np.sum(out * G))

    mean, var, rstd = (np.empty(3) for _ in range(3))
    ref.bn_stats(mean, var, rstd, x, EPS)
    xhat = np.empty_like(x)
    norm_cpu.normalize(xhat, x, mean, rstd)
    dx, dg, db = np.empty_like(x), np.zeros(3), np.zeros(3)
    norm_cpu.backward(dx, dg, db, G, xhat, g, rstd)
    check_grad(loss, x, dx, rng, eps=eps, rtol=1e-6 + 20 * eps ** 2)   # BN is not linear in x: O(eps^2)
    check_grad(loss, g, dg, rng, eps=eps)
    check_grad(loss, b, db, rng, eps=eps)


@pytest.mark.parametrize("bits", [None, 4, 2])
def test_the_sets_agree(rng, bits):
    """FusedNormKernels and NormKernels with either keeper (float slot, range code): the same
    slots and out, bit for bit, for the same statistics; backward to rounding."""
    x, g, b, mean, _, rstd = case(rng, np.float32, M=4096 + 200)    # groups crossing channel rows
    keeper = rangecode.keeper(bits)
    C, M = x.shape
    results = []
    for kernels in (norm.NormKernels(keeper), norm.select_norms(np, True, keeper)):
        slots = [np.zeros(shape, dtype) for _, _, shape, dtype in keeper.entries("bn.xhat", C * M, np.float32)]
        out = x.copy()
        kernels.forward(out, slots, out, mean, rstd, g, b)           # in place, as the engine runs it
        dy = np.random.default_rng(5).standard_normal(x.shape).astype(np.float32)
        dx, dg, db = dy.copy(), np.zeros(C, np.float32), np.zeros(C, np.float32)
        scratch = np.empty_like(x) if keeper.decodes else None
        kernels.backward(dx, dg, db, dx, slots, rstd, g, False, scratch)
        results.append((out, slots, dx, dg, db))
    (o1, s1, *g1), (o2, s2, *g2) = results
    np.testing.assert_array_equal(o1, o2)
    for a, w in zip(s1, s2):
        np.testing.assert_array_equal(a, w)
    for a, w in zip(g1, g2):
        np.testing.assert_allclose(a, w, rtol=2e-5, atol=2e-5 * np.abs(w).max())


def test_an_engine_runs_its_batch_norms_on_the_set_it_chose():
    """The fused set when the engine's units are fused, the reference otherwise; both engines give
    the same loss to rounding (their statistics are summed in other orders)."""
    import lowmem
    from lowmem import nn
    g = nn.Graph("bn", input_shape=(3, 8, 8), num_classes=4)
    h = g.bn(g.conv(g.input, 8, 3))
    net = g.head(g.bn_relu(g.add(h, g.conv(g.input, 8, 1))))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 3, 8, 8)).astype(np.float32), rng.integers(0, 4, 8)
    losses = {}
    for fast in (False, True):
        eng = lowmem.Engine(net, 8, (3, 8, 8), mode="approx", bits=4, use_fast=fast)
        assert eng.run.norms.fused == fast
        losses[fast] = eng.forward(x, y)[0]
        eng.backward()
    assert abs(losses[True] - losses[False]) <= 1e-5 * abs(losses[False])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("C,M", [(3, 5), (4, 4096 + 13), (7, 64)])   # a partial last mask byte; several blocks
@pytest.mark.parametrize("where", ["apart", "over other", "from x-hat"])
def test_forward_add_relu_is_the_three_ops(rng, dtype, C, M, where):
    """One pass for a batch norm, an add and a ReLU: x-hat, the output and the ReLU's 1-bit mask
    bit for bit bn_normalize + bn_apply_forward, add_forward and relu_forward (NaN, inf and -0 in
    the identity included); written over the identity, or from x-hat (nothing kept)."""
    from lowmem.ops import add_forward, relu_forward
    x = rng.standard_normal((C, M)).astype(dtype)
    other = rng.standard_normal((C, M)).astype(dtype)
    other[0, :3] = [-0.0, np.nan, np.inf]
    g, b = rng.standard_normal(C).astype(dtype), rng.standard_normal(C).astype(dtype)
    g[-1] = 0
    mean, var, rstd = (np.empty(C, dtype) for _ in range(3))
    ref.bn_stats(mean, var, rstd, x, EPS)
    h, y = np.empty_like(x), np.empty_like(x)
    ref.bn_normalize(h, x, mean, rstd)
    ref.bn_apply_forward(y, h, g, b)
    want = other.copy()
    add_forward(want, y)
    want_mask = np.zeros((C * M + 7) // 8, np.uint8)
    relu_forward(want, want_mask, want)
    mask = np.full_like(want_mask, 0xAA)
    if where == "apart":
        out, xhat = np.full_like(x, np.nan), np.full_like(x, np.nan)
        norm_cpu.forward_add_relu(out, mask, xhat, x, other, mean, rstd, g, b)
        np.testing.assert_array_equal(xhat, h)
    elif where == "over other":
        out = other.copy()
        norm_cpu.forward_add_relu(out, mask, np.empty_like(x), x, out, mean, rstd, g, b)
    else:
        out = h.copy()
        norm_cpu.forward_add_relu(out, mask, None, out, other, mean, rstd, g, b)
    np.testing.assert_array_equal(out, want)
    assert np.array_equal(np.signbit(out), np.signbit(want))
    np.testing.assert_array_equal(mask, want_mask)
