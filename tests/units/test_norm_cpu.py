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


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bits", [4, 2, 8])
@pytest.mark.parametrize("C,M", [(3, 5), (5, 4096 + 200), (7, 300)])     # groups crossing rows; blocks
@pytest.mark.parametrize("n_threads", [1, 2])
def test_coded_passes_are_the_separate_passes(rng, monkeypatch, dtype, bits, C, M, n_threads):
    """With x-hat kept as its range code, the passes that make the code where x-hat is made
    (forward_coded, forward_add_relu_coded) and read it where it is used (backward_coded: a row
    decoded once into a row's scratch, or, rows too long for that, in each pass) leave what normalize, rangecode_cpu.range_encode and apply (or forward_add_relu), and backward
    on range_decode's x-hat leave: the code's bytes, out, the mask and the gradients, bit for bit."""
    from lowmem.system import threads
    from lowmem.units import rangecode_cpu
    x, g, b, mean, _, rstd = case(rng, dtype, C, M)
    other = rng.standard_normal((C, M)).astype(dtype)
    n = C * M

    def fresh():
        return rangecode.RangeCode(np.full(rangecode.packing.packed_nbytes(n, bits), 0xAA, np.uint8),
                                   np.full(rangecode.groups(n), np.nan, np.float32),
                                   np.full(rangecode.groups(n), 7, np.uint8), bits)

    def same(c1, c2):
        for a, w in zip(c1[:3], c2[:3]):
            np.testing.assert_array_equal(a, w)

    before = threads.threads()
    threads.configure(n_threads)
    try:
        h, want_code = np.empty_like(x), fresh()                   # the separate passes
        norm_cpu.normalize(h, x, mean, rstd)
        rangecode_cpu.range_encode(*want_code[:3], h.reshape(-1), bits)
        want = h.copy()
        norm_cpu.apply(want, g, b)
        out, code = x.copy(), fresh()
        norm_cpu.forward_coded(out, code, out, mean, rstd, g, b)  # in place, as the engine runs it
        np.testing.assert_array_equal(out, want)
        same(code, want_code)

        want_out, want_mask = np.empty_like(x), np.zeros((n + 7) // 8, np.uint8)
        norm_cpu.forward_add_relu(want_out, want_mask, None, h, other, mean, rstd, g, b)
        out, mask, code = other.copy(), np.full_like(want_mask, 0x55), fresh()
        norm_cpu.forward_add_relu_coded(out, mask, code, x, out, mean, rstd, g, b)   # over the identity
        np.testing.assert_array_equal(out, want_out)
        np.testing.assert_array_equal(mask, want_mask)
        same(code, want_code)

        xhat = np.empty_like(x)
        rangecode_cpu.range_decode(xhat.reshape(-1), *want_code[:3], bits)
        dy = rng.standard_normal((C, M)).astype(dtype)
        for accumulate, inplace in ((False, False), (False, True), (True, False)):
            got = []
            for kernel in ("separate", "coded", "coded, rows too long"):
                dx = dy.copy() if inplace else rng.standard_normal((C, M)).astype(dtype) * 0 + 1
                dg, db = np.ones(C, dtype), np.ones(C, dtype)
                src = dx if inplace else dy
                monkeypatch.setattr(norm_cpu, "ROW_BYTES", 0 if "too long" in kernel else 1 << 19)
                if kernel == "separate":
                    norm_cpu.backward(dx, dg, db, src, xhat, g, rstd, accumulate)
                else:
                    norm_cpu.backward_coded(dx, dg, db, src, want_code, g, rstd, accumulate)
                got.append((dx, dg, db))
            for other_got in got[1:]:
                for a, w in zip(other_got, got[0]):
                    np.testing.assert_array_equal(a, w)
    finally:
        threads.configure(before)


@pytest.mark.parametrize("bits", [4, 2])
def test_the_numba_range_code_takes_the_coded_passes(rng, monkeypatch, bits):
    """FusedNormKernels with the engine's numba range code runs the coded passes (no separate
    normalize, keep or restore) and leaves the reference set's slots and out, bit for bit, its
    gradients to rounding."""
    from lowmem.units import rangecode_cpu
    x, g, b, mean, _, rstd = case(rng, np.float32, M=4096 + 200)
    C, M = x.shape
    other = rng.standard_normal((C, M)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    results = []
    for fused in (False, True):
        keeper = rangecode.keeper(bits, rangecode_cpu if fused else None)
        kernels = norm.select_norms(np, True, keeper) if fused else norm.NormKernels(keeper)
        if fused:
            for name in ("normalize", "apply", "forward_add_relu"):
                monkeypatch.setattr(norm_cpu, name, None)          # a call would fail: not taken
            monkeypatch.setattr(keeper, "keep", None)
            monkeypatch.setattr(keeper, "restore", None)
        entries = keeper.entries("bn.xhat", C * M, np.float32)
        slots = [np.zeros(shape, dtype) for _, _, shape, dtype in entries]
        out = x.copy()
        kernels.forward(out, slots, out, mean, rstd, g, b)
        dx, dg, db = dy.copy(), np.zeros(C, np.float32), np.zeros(C, np.float32)
        kernels.backward(dx, dg, db, dx, slots, rstd, g, False, np.empty_like(x))
        slots2 = [np.zeros(shape, dtype) for _, _, shape, dtype in entries]
        out2, mask = other.copy(), np.zeros((C * M + 7) // 8, np.uint8)
        if fused:
            kernels.forward_add_relu(out2, mask, slots2, x, out2, mean, rstd, g, b, np.empty_like(x))
        else:                                                        # the reference: the three ops
            from lowmem.ops import add_forward, relu_forward
            h = np.empty_like(x)
            kernels.forward(h, slots2, x, mean, rstd, g, b)
            add_forward(out2, h)
            relu_forward(out2, mask, out2)
        results.append((out, slots, out2, slots2, mask, (dx, dg, db)))
    (o1, s1, p1, t1, m1, g1), (o2, s2, p2, t2, m2, g2) = results
    for a, w in [(o1, o2), (p1, p2), (m1, m2)] + list(zip(s1, s2)) + list(zip(t1, t2)):
        np.testing.assert_array_equal(a, w)
    for a, w in zip(g1, g2):
        np.testing.assert_allclose(a, w, rtol=2e-5, atol=2e-5 * np.abs(w).max())
