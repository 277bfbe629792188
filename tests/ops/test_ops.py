"""Every op in lowmem/ops against an independent float64 reference.

Forward: naive loops / plain NumPy formulas written out here.
Backward: central finite differences of a scalar loss sum(out * G) (G random)
along random directions and along a few sampled coordinates, on tiny shapes.
Piecewise-linear ops (ReLU, max-pool) are sampled away from their kinks, so
the difference quotient sees one linear piece.
Also: the gradient semantics of lowmem/ops/__init__.py (activation gradients
overwrite, or add with accumulate=True; parameter gradients add), the
aliasing the docstrings allow, and row-block/chunk boundaries.
"""
import tracemalloc

import numpy as np
import pytest

from reference import check_grad, conv_ref, maxpool_backward_ref, maxpool_ref, relu_mask

from lowmem.ops import batchnorm as bn
from lowmem.ops import pool
from lowmem.ops import (conv2d_forward, conv2d_backward, conv2d_backward_input, conv2d_backward_weight, conv_out_size,
                        bn_stats, bn_normalize, bn_relu_apply_forward, bn_eval_relu_forward,
                        bn_relu_backward, update_running_stats,
                        maxpool_forward, maxpool_backward, avgpool_forward, avgpool_backward,
                        linear_forward, linear_backward, softmax_xent_forward, softmax_xent_backward)

EPS_BN = 1e-5


# ------------------------------------------------------------------- conv

# (k, stride, pad, H, W)
CONV_CASES = [
    (1, 1, 0, 5, 5), (1, 2, 0, 5, 6), (1, 1, 1, 4, 4),
    (3, 1, 1, 6, 5), (3, 2, 1, 7, 7), (3, 2, 1, 6, 6), (3, 1, 0, 5, 5), (3, 2, 0, 6, 7),
    (7, 2, 3, 9, 8), (7, 1, 3, 7, 7), (7, 1, 0, 8, 7), (7, 2, 3, 4, 4),
]


def ws_for(Cin, k, Ho, Wo, samples):
    return np.full(Cin * k * k * Ho * Wo * samples, np.nan)     # garbage: the op must not read it


def conv_setup(rng, k, stride, pad, H, W, Cin=3, Cout=4, N=3):
    Ho, Wo = conv_out_size(H, k, stride, pad), conv_out_size(W, k, stride, pad)
    x = rng.standard_normal((Cin, N, H, W))
    w = rng.standard_normal((Cout, Cin, k, k))
    return x, w, Ho, Wo


@pytest.mark.parametrize("k,stride,pad,H,W", CONV_CASES)
@pytest.mark.parametrize("chunk", ["whole", "one", "two"])
def test_conv_forward_matches_naive_loops(rng, k, stride, pad, H, W, chunk):
    N = 3
    x, w, Ho, Wo = conv_setup(rng, k, stride, pad, H, W, N=N)
    ws = ws_for(3, k, Ho, Wo, {"whole": N, "one": 1, "two": 2}[chunk])   # "two": chunks 2 + 1
    out = np.full((4, N, Ho, Wo), np.nan)
    conv2d_forward(out, x, w, stride, pad, ws)
    np.testing.assert_allclose(out, conv_ref(x, w, stride, pad), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k,stride,pad", [(1, 1, 0), (3, 1, 1), (3, 2, 1), (7, 2, 3)])
def test_conv_on_strided_and_transposed_views(rng, k, stride, pad):
    """x may be the caller's NCHW batch transposed to (C, N, H, W), or a strided slice."""
    N, Cin, H, W = 2, 3, 7, 7
    Ho, Wo = conv_out_size(H, k, stride, pad), conv_out_size(W, k, stride, pad)
    w = rng.standard_normal((4, Cin, k, k))
    x_nchw = rng.standard_normal((N, Cin, H, W))
    big = rng.standard_normal((Cin, N, 2 * H, 2 * W))
    G = rng.standard_normal((4, N, Ho, Wo))
    for x in (x_nchw.transpose(1, 0, 2, 3), big[:, :, ::2, 1::2]):
        assert not x.flags.c_contiguous
        xc = np.ascontiguousarray(x)
        ws = ws_for(Cin, k, Ho, Wo, 1)
        out = np.empty((4, N, Ho, Wo))
        conv2d_forward(out, x, w, stride, pad, ws)
        np.testing.assert_allclose(out, conv_ref(xc, w, stride, pad), rtol=1e-12, atol=1e-12)
        dw, dw_c = np.zeros_like(w), np.zeros_like(w)
        conv2d_backward_weight(dw, x, G, stride, pad, ws)
        conv2d_backward_weight(dw_c, xc, G, stride, pad, ws_for(Cin, k, Ho, Wo, N))
        np.testing.assert_allclose(dw, dw_c, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k,stride,pad,H,W", CONV_CASES[::2] + [(3, 2, 1, 7, 7)])
def test_conv_backward_finite_differences(rng, fd, k, stride, pad, H, W):
    x, w, Ho, Wo = conv_setup(rng, k, stride, pad, H, W)
    G = rng.standard_normal((4, 3, Ho, Wo))
    ws = ws_for(3, k, Ho, Wo, 2)            # forces chunking (N = 3)
    out = np.empty((4, 3, Ho, Wo))

    def loss():
        conv2d_forward(out, x, w, stride, pad, ws)
        return float(np.sum(out * G))

    dx = np.full_like(x, np.nan)            # overwritten, not accumulated
    conv2d_backward_input(dx, G, w, stride, pad, ws)
    w_grad0 = rng.standard_normal(w.shape)  # parameter gradients accumulate
    dw = w_grad0.copy()
    conv2d_backward_weight(dw, x, G, stride, pad, ws)
    check_grad(loss, x, dx, rng, eps=1e-3)      # conv is linear: any eps works
    check_grad(loss, w, dw - w_grad0, rng, eps=1e-3)
    # the adjoint identity <conv(x), G> = <x, dx>, to rounding
    assert np.isclose(loss(), np.sum(x * dx), rtol=1e-12)


@pytest.mark.parametrize("k,stride,pad", [(1, 1, 0), (1, 2, 0), (3, 1, 1), (3, 2, 1), (7, 2, 3)])
def test_conv_backward_input_accumulate(rng, k, stride, pad):
    x, w, Ho, Wo = conv_setup(rng, k, stride, pad, 7, 6)
    G = rng.standard_normal((4, 3, Ho, Wo))
    ws = ws_for(3, k, Ho, Wo, 1)
    dx = np.empty_like(x)
    conv2d_backward_input(dx, G, w, stride, pad, ws)
    prior = rng.standard_normal(x.shape)
    acc = prior.copy()
    conv2d_backward_input(acc, G, w, stride, pad, ws, accumulate=True)
    np.testing.assert_allclose(acc, prior + dx, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k,stride,pad", [(1, 1, 0), (1, 2, 0), (3, 1, 1), (3, 2, 1)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_conv_split_over_two_threads_matches_one(rng, monkeypatch, k, stride, pad, dtype):
    """With 2 lowmem threads (batch ranges, each with half the workspace; 1x1 GEMMs by column
    ranges) every result agrees with 1 thread to rounding: the GEMMs run on other column
    counts (BLAS may pick other kernels) and weight gradients add per-range partial sums.
    The col2im is the numba loop when numba is installed, else the reference."""
    pytest.importorskip("threadpoolctl")
    from lowmem.system import threads
    from lowmem.ops import chunks, conv
    monkeypatch.setattr(chunks, "GEMM_GRAIN", 4)
    monkeypatch.setattr(chunks, "COLS_GRAIN", 8)
    x, w, Ho, Wo = conv_setup(rng, k, stride, pad, 9, 8, Cin=3, Cout=5, N=7)
    x, w = x.astype(dtype), w.astype(dtype)
    G = rng.standard_normal((5, 7, Ho, Wo)).astype(dtype)
    ws = ws_for(3, k, Ho, Wo, 3).astype(dtype)         # ranges of 3-4 samples, chunks of 1
    before = threads.threads()
    got = {}
    try:
        for t in (1, 2):
            threads.configure(t)
            out, dx, acc, dw = (np.empty((5, 7, Ho, Wo), dtype), np.empty_like(x),
                                np.ones_like(x), np.zeros_like(w))
            conv2d_forward(out, x, w, stride, pad, ws)
            conv2d_backward_input(dx, G, w, stride, pad, ws)
            conv2d_backward_input(acc, G, w, stride, pad, ws, accumulate=True)
            conv2d_backward_weight(dw, x, G, stride, pad, ws)
            got[t] = out, dx, acc, dw
    finally:
        threads.configure(before)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for a, b in zip(got[1], got[2]):
        np.testing.assert_allclose(b, a, rtol=tol, atol=tol * np.abs(a).max())
    np.testing.assert_allclose(got[1][0], conv_ref(x.astype(np.float64), w.astype(np.float64), stride, pad),
                               rtol=1e-4 if dtype == np.float32 else 1e-12, atol=1e-4 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("k,Cin,Cout,H,N", [(3, 32, 16, 4, 8), (3, 16, 32, 2, 8), (1, 96, 64, 2, 8), (1, 96, 64, 4, 16),
                                        (3, 32, 16, 16, 16), (1, 96, 64, 8, 16)])
@pytest.mark.parametrize("x_is_dx", [False, True])
@pytest.mark.parametrize("accumulate", [False, True])
def test_both_gradients_side_by_side_are_the_two_calls(rng, monkeypatch, k, Cin, Cout, H, N, x_is_dx, accumulate):
    """conv2d_backward on two threads gives what conv2d_backward_weight then
    conv2d_backward_input give, bit for bit: where the conv is small the two run side by side
    (Winograd 3x3 on 4x4 and 2x2 planes) or split by input channels (a 1x1 on 32 columns, and on
    256, which the two calls split by columns: its weight gradient is then the one-thread
    sum's; GEMM_WORK lowered so these count as worth it), x may be dx itself (read before dx is
    written), dx assigned or accumulated; larger convs (16x16, a 1x1 on 1,024 columns, whose
    gradients split themselves) and one thread run the two calls."""
    pytest.importorskip("threadpoolctl")
    from lowmem.ops import chunks, conv, winograd
    from lowmem.system import threads
    if not winograd.AVAILABLE and k == 3:
        pytest.skip("numba not installed: no Winograd path")
    monkeypatch.setattr(conv, "GEMM_WORK", 1 << 10)
    monkeypatch.setattr(chunks, "GEMM_WORK", 1 << 10)
    F = np.float32
    x = rng.standard_normal((Cin, N, H, H)).astype(F)
    w = (rng.standard_normal((Cout, Cin, k, k)) * 0.1).astype(F)
    G = rng.standard_normal((Cout, N, H, H)).astype(F)
    prior = rng.standard_normal(x.shape).astype(F)
    ws = np.empty(1 << 20, F)
    sides = []
    for name, mod in (("conv3x3_backward_both", winograd), ("_pointwise_backward_both", conv)):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real, **kw: sides.append(real(*a, **kw)) or sides[-1])
    before = threads.threads()
    split_columns = k == 1 and H * H * N >= 2 * chunks.gemm_grain(Cin * Cout)    # the two calls' own split
    rows = k == 1 and H <= 4 and not accumulate                                  # and where rows replace it
    try:
        want = {}
        for t in (1, 2):                            # the two calls on 1 and 2 threads
            threads.configure(t)
            dw_want = np.ones_like(w)
            dx_want = prior.copy() if accumulate else np.empty_like(x)
            conv2d_backward_weight(dw_want, x, G, 1, k // 2, ws)
            conv2d_backward_input(dx_want, G, w, 1, k // 2, ws, accumulate)
            want[t] = dw_want, dx_want
        for t in (2, 1):                            # each against the two calls on as many threads
            threads.configure(t)
            dw_want, dx_want = want[1 if rows and split_columns else t][0], want[t][1]
            dw, xin = np.ones_like(w), x.copy()
            dx = xin if x_is_dx and not accumulate else (prior.copy() if accumulate else np.empty_like(x))
            conv2d_backward(dw, dx, xin, G, w, 1, k // 2, ws, accumulate)
            np.testing.assert_array_equal(dw, dw_want)
            np.testing.assert_array_equal(dx, dx_want)
    finally:
        threads.configure(before)
    small = H <= 4 and not (k == 1 and accumulate)
    assert any(sides) == small                      # side by side only on two threads, where small


def test_a_1x1_gemm_splits_by_its_work(monkeypatch):
    """A 1x1 conv's GEMM splits into column ranges of gemm_grain(Cout*Cin) columns: light
    columns (16 x 16 channels) keep GEMM_GRAIN (4,096 columns run on one thread), heavy ones
    (128 x 256) split at GEMM_WORK's worth, never below GEMM_MIN_COLUMNS."""
    from lowmem.ops import chunks
    from lowmem.system import threads
    assert chunks.gemm_grain(16 * 16) == chunks.GEMM_GRAIN
    assert chunks.gemm_grain(128 * 256) == max(chunks.GEMM_MIN_COLUMNS, chunks.GEMM_WORK // (128 * 256))
    assert chunks.gemm_grain(2048 * 2048) == chunks.GEMM_MIN_COLUMNS
    seen = []
    monkeypatch.setattr(threads, "parallel_for", lambda fn, n, grain=1: seen.append(grain))
    chunks.over_columns(4096, None, per_column=128 * 256)           # what conv2d_forward hands it
    chunks.over_columns(4096, None, per_column=16 * 16)
    assert seen == [chunks.GEMM_MIN_COLUMNS, chunks.GEMM_GRAIN]     # 128 x 256: GEMM_WORK in 32 columns, raised


@pytest.mark.parametrize("k,stride,pad,Cin,Cout", [(1, 1, 0, 12, 5), (1, 1, 0, 5, 12), (3, 2, 1, 3, 5), (3, 2, 1, 2, 40)])
def test_weight_gradient_gemm_has_its_larger_side_as_rows(rng, monkeypatch, k, stride, pad, Cin, Cout):
    """On NumPy the weight gradient's GEMM dout (Cout, M) x cols (K, M)^T of at least FLIP_COLUMNS
    columns runs with the larger of Cout and K (= Cin*k*k) as its rows, (cols @ dout^T)^T where
    K > Cout (OpenBLAS's faster side), and its float32 result is the float64 reference's to
    rounding either way round; a narrower GEMM keeps dout as its rows."""
    from lowmem.ops import conv
    monkeypatch.setattr(conv, "FLIP_COLUMNS", 1)                 # these GEMMs are narrow
    x, w, Ho, Wo = conv_setup(rng, k, stride, pad, 9, 8, Cin=Cin, Cout=Cout, N=4)
    G = rng.standard_normal((Cout, 4, Ho, Wo))
    want = np.zeros_like(w)
    conv2d_backward_weight(want, x, G, stride, pad, ws_for(Cin, k, Ho, Wo, 4))      # float64
    rows, real = [], np.matmul

    def recording(a, b, *args, **kw):
        rows.append(a.shape[0])
        return real(a, b, *args, **kw)
    monkeypatch.setattr(np, "matmul", recording)
    dw = np.zeros(w.shape, np.float32)
    conv2d_backward_weight(dw, x.astype(np.float32), G.astype(np.float32), stride, pad,
                           ws_for(Cin, k, Ho, Wo, 4).astype(np.float32), conv.SLICES)
    monkeypatch.setattr(np, "matmul", real)
    assert rows and set(rows) == {max(Cout, Cin * k * k)}
    np.testing.assert_allclose(dw, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    monkeypatch.setattr(conv, "FLIP_COLUMNS", 10 ** 9)             # narrower than the rule: not flipped
    monkeypatch.setattr(np, "matmul", recording)
    rows.clear()
    conv2d_backward_weight(np.zeros(w.shape), x, G, stride, pad, ws_for(Cin, k, Ho, Wo, 4), conv.SLICES)
    monkeypatch.setattr(np, "matmul", real)
    assert set(rows) == {Cout}


def test_conv_workspace_too_small_raises(rng):
    x, w, Ho, Wo = conv_setup(rng, 3, 1, 1, 5, 5)
    with pytest.raises(ValueError, match="workspace too small"):
        conv2d_forward(np.empty((4, 3, Ho, Wo)), x, w, 1, 1, np.empty(3 * 9 * Ho * Wo - 1))


# -------------------------------------------------------------- batchnorm

def bn_unit_case(rng, C=5, N=3, H=2, W=2, margin=1e-4):
    """x (C, M), gamma, beta with every pre-activation at least `margin` from the ReLU kink.
    gamma covers positive, negative and zero (a channel with a constant mask)."""
    M = N * H * W
    for _ in range(1000):
        x = rng.standard_normal((C, M)) * rng.uniform(0.5, 3, (C, 1)) + rng.normal(0, 2, (C, 1))
        gamma = np.array([1.3, -0.7, 0.0, 2.0, 0.4][:C])
        beta = np.array([0.2, 0.3, 0.5, -1.1, 0.0][:C])
        xhat = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + EPS_BN)
        if np.abs(xhat * gamma[:, None] + beta[:, None]).min() > margin:
            return x, gamma, beta
    raise AssertionError("could not sample away from the kinks")


def unit_forward(x, gamma, beta):
    """The pre-activation unit's forward as the engine runs it: returns r, xhat, mean, var, rstd."""
    C, M = x.shape
    xhat, mean, var, rstd = np.empty_like(x), np.empty(C), np.empty(C), np.empty(C)
    bn_stats(mean, var, rstd, x, EPS_BN)
    bn_normalize(xhat, x, mean, rstd)
    r = np.empty_like(x)
    bn_relu_apply_forward(r, xhat, gamma, beta)
    return r, xhat, mean, var, rstd


def test_bn_stats_and_normalize_match_numpy(rng):
    x, gamma, beta = bn_unit_case(rng)
    r, xhat, mean, var, rstd = unit_forward(x, gamma, beta)
    np.testing.assert_allclose(mean, x.mean(axis=1), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(var, x.var(axis=1), rtol=1e-12)          # biased, as PyTorch
    np.testing.assert_allclose(rstd, 1 / np.sqrt(x.var(axis=1) + EPS_BN), rtol=1e-12)
    ref_xhat = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + EPS_BN)
    np.testing.assert_allclose(xhat, ref_xhat, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(r, np.maximum(gamma[:, None] * ref_xhat + beta[:, None], 0), rtol=1e-12, atol=1e-12)
    # aliasing allowed by the docstrings: xhat over x, r over xhat
    xa = x.copy()
    m2, v2, s2 = np.empty(5), np.empty(5), np.empty(5)
    bn_stats(m2, v2, s2, xa, EPS_BN)
    bn_normalize(xa, xa, m2, s2)
    np.testing.assert_array_equal(xa, xhat)
    bn_relu_apply_forward(xa, xa, gamma, beta)
    np.testing.assert_array_equal(xa, r)


@pytest.mark.parametrize("variant", ["recompute_mask", "explicit_mask", "accumulate", "dx_aliases_dr"])
def test_bn_relu_unit_backward_finite_differences(rng, fd, variant):
    """Unit forward normalize -> relu-apply; loss = sum(r * G). Checks dx, dgamma, dbeta."""
    x, gamma, beta = bn_unit_case(rng)
    C, M = x.shape
    G = rng.standard_normal((C, M))

    def loss():
        return float(np.sum(unit_forward(x, gamma, beta)[0] * G))

    _, xhat, _, _, rstd = unit_forward(x, gamma, beta)
    mask = None
    if variant == "explicit_mask":
        mask = relu_mask(xhat, gamma, beta)
    dr = G.copy()
    prior = rng.standard_normal((C, M)) if variant == "accumulate" else np.full((C, M), np.nan)
    dx = dr if variant == "dx_aliases_dr" else prior.copy()
    g0, b0 = rng.standard_normal(C), rng.standard_normal(C)     # parameter gradients accumulate
    dgamma, dbeta = g0.copy(), b0.copy()
    bn_relu_backward(dx, dgamma, dbeta, dr, xhat, gamma, beta, rstd, relu_mask=mask,
                     accumulate=variant == "accumulate")
    if variant == "accumulate":
        dx = dx - prior
    check_grad(loss, x, dx, rng)
    check_grad(loss, gamma, dgamma - g0, rng)
    check_grad(loss, beta, dbeta - b0, rng)
    # the zero-gamma channel passes no gradient to x
    assert np.all(dx[2] == 0)


def test_bn_relu_backward_closed_form(rng):
    """dx against the textbook formula written independently (masked dy, population stats)."""
    x, gamma, beta = bn_unit_case(rng)
    C, M = x.shape
    G = rng.standard_normal((C, M))
    r, xhat, _, _, rstd = unit_forward(x, gamma, beta)
    dy = G * (r > 0)
    dxhat = dy * gamma[:, None]
    ref = rstd[:, None] / M * (M * dxhat - dxhat.sum(1, keepdims=True)
                               - xhat * np.sum(dxhat * xhat, 1, keepdims=True))
    dx, dg, db = np.empty((C, M)), np.zeros(C), np.zeros(C)
    bn_relu_backward(dx, dg, db, G.copy(), xhat, gamma, beta, rstd)
    np.testing.assert_allclose(dx, ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dg, np.sum(dy * xhat, 1), rtol=1e-12)
    np.testing.assert_allclose(db, np.sum(dy, 1), rtol=1e-12)


def test_the_forward_relu_passes_where_the_mask_expression_says(rng):
    """r > 0 exactly where (xhat*gamma) + beta > 0 (reference.relu_mask, multiply then add): the
    expression the quantizer and the backward recompute."""
    x, gamma, beta = bn_unit_case(rng, margin=0)
    r, xhat, *_ = unit_forward(x, gamma, beta)
    np.testing.assert_array_equal(relu_mask(xhat, gamma, beta), r > 0)


def test_update_running_stats_momentum_and_unbiased_variance(rng):
    C, M = 4, 10
    x = rng.standard_normal((C, M)) * 2 + 1
    rm, rv = rng.standard_normal(C), rng.uniform(0.5, 2, C)
    _, _, mean, var, _ = unit_forward(x, np.ones(C), np.zeros(C))
    rm_new, rv_new = rm.copy(), rv.copy()
    update_running_stats(rm_new, rv_new, mean, var, M, 0.1)
    np.testing.assert_allclose(rm_new, 0.9 * rm + 0.1 * x.mean(axis=1), rtol=1e-13)
    np.testing.assert_allclose(rv_new, 0.9 * rv + 0.1 * x.var(axis=1, ddof=1), rtol=1e-13)


def test_bn_eval_relu_forward_uses_running_stats(rng):
    C, M = 4, 12
    x = rng.standard_normal((C, M))
    rm, rv = rng.standard_normal(C), rng.uniform(0.5, 2, C)
    gamma, beta = rng.standard_normal(C), rng.standard_normal(C)
    out = np.empty((C, M))
    bn_eval_relu_forward(out, x, rm, rv, gamma, beta, EPS_BN)
    ref = np.maximum(gamma[:, None] * (x - rm[:, None]) / np.sqrt(rv[:, None] + EPS_BN) + beta[:, None], 0)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("rows_per_block", [1, 2, 3])
def test_bn_row_blocks_give_identical_results(rng, monkeypatch, rows_per_block):
    """Forcing many (and uneven) row blocks changes nothing, bit for bit."""
    C, M = 7, 12
    x, gamma, beta = rng.standard_normal((C, M)), rng.standard_normal(C), rng.standard_normal(C)
    G, prior = rng.standard_normal((C, M)), rng.standard_normal((C, M))

    def run():
        r, xhat, mean, var, rstd = unit_forward(x, gamma, beta)
        mask = relu_mask(xhat, gamma, beta)
        outs = [r, xhat, mean, var, rstd, mask]
        for m, acc in ((None, False), (mask, False), (None, True)):
            dx = prior.copy()
            dg, db = np.zeros(C), np.zeros(C)
            bn_relu_backward(dx, dg, db, G.copy(), xhat, gamma, beta, rstd, relu_mask=m, accumulate=acc)
            outs += [dx, dg, db]
        return outs

    ref = run()
    monkeypatch.setattr(bn, "ROW_BLOCK", rows_per_block * M + (rows_per_block > 1))
    assert len(list(bn.row_blocks(C, M))) == -(-C // rows_per_block)
    for a, b in zip(run(), ref):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- pooling

@pytest.mark.parametrize("H,W", [(7, 7), (8, 6), (2, 3), (1, 1)])
@pytest.mark.parametrize("ties", [False, True])
def test_maxpool_forward_backward_against_loops(rng, H, W, ties):
    C, N = 2, 3
    x = rng.integers(0, 3, (C, N, H, W)).astype(float) if ties else rng.standard_normal((C, N, H, W))
    if ties:
        x[0, 0] = 1.0                                           # one image all equal
    ref_out, ref_idx = maxpool_ref(x)
    out, idx = np.empty_like(ref_out), np.empty(ref_out.shape, np.uint8)
    maxpool_forward(out, idx, x)
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(idx, ref_idx)
    G = rng.standard_normal(out.shape)
    dx = np.full_like(x, np.nan)
    maxpool_backward(dx, G, idx)
    np.testing.assert_allclose(dx, maxpool_backward_ref(G, ref_idx, H, W), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("k,stride,pad", [(3, 2, 1), (2, 2, 0), (3, 1, 1), (4, 3, 2)])
def test_maxpool_in_blocks_against_loops(rng, k, stride, pad):
    """Every blocking of the output (samples of one channel, whole channels, all at once) gives
    the loops' max and first argmax, and the same input gradient bit for bit."""
    C, N, H, W = 3, 4, 9, 7
    x = rng.integers(0, 4, (C, N, H, W)).astype(float)          # many ties
    ref_out, ref_idx = maxpool_ref(x, k, stride, pad)
    G = rng.standard_normal(ref_out.shape)
    first = None
    for block in (1, 5, ref_out[0, 0].size * 2 + 1, ref_out[0].size * 2, 4096):
        out, idx = np.full_like(ref_out, np.nan), np.full(ref_out.shape, 99, np.uint8)
        maxpool_forward(out, idx, x, k, stride, pad, block=block)
        np.testing.assert_array_equal(out, ref_out)
        np.testing.assert_array_equal(idx, ref_idx)
        dx = np.full_like(x, np.nan)
        maxpool_backward(dx, G, idx, k, stride, pad, block=block)
        np.testing.assert_allclose(dx, maxpool_backward_ref(G, ref_idx, H, W, k, stride, pad),
                                   rtol=1e-14, atol=1e-14)
        first = dx if first is None else first
        np.testing.assert_array_equal(dx, first)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_maxpool_scratch_is_bounded_by_the_block(rng, dtype):
    """No temporary the size of the output, whatever the batch (it was a bool
    mask and a float copy of the output per window offset): at most scratch_bytes, here a
    small fraction of the output."""
    x = rng.standard_normal((16, 32, 32, 32)).astype(dtype)
    out, idx = np.empty((16, 32, 16, 16), dtype), np.empty((16, 32, 16, 16), np.uint8)
    dx = np.empty_like(x)
    G = rng.standard_normal(out.shape).astype(dtype)
    bound = pool.scratch_bytes(x.itemsize, 16 * 16)
    assert bound < out.nbytes // 4
    for run in (lambda: maxpool_forward(out, idx, x), lambda: maxpool_backward(dx, G, idx)):
        tracemalloc.start()
        try:
            run()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak <= bound, (peak, bound)


def test_maxpool_backward_finite_differences(rng, fd):
    """Distinct random values: eps is far below every gap, so each window's argmax stays put."""
    x = rng.permutation(2 * 2 * 7 * 6).reshape(2, 2, 7, 6) * 0.01
    out, idx = np.empty((2, 2, 4, 3)), np.empty((2, 2, 4, 3), np.uint8)
    G = rng.standard_normal(out.shape)

    def loss():
        maxpool_forward(out, idx, x)
        return float(np.sum(out * G))

    loss()
    dx = np.empty_like(x)
    maxpool_backward(dx, G, idx)
    check_grad(loss, x, dx, rng, eps=1e-6, n_coords=8)


def test_avgpool_forward_backward(rng, fd):
    C, N, H, W = 3, 2, 4, 5
    x = rng.standard_normal((C, N, H, W))
    out = np.empty((N, C))
    G = rng.standard_normal((N, C))

    def loss():
        avgpool_forward(out, x)
        return float(np.sum(out * G))

    loss()
    np.testing.assert_allclose(out, x.mean(axis=(2, 3)).T, rtol=1e-13)
    dx = np.full_like(x, np.nan)
    avgpool_backward(dx, G)
    check_grad(loss, x, dx, rng, eps=1e-3)


# ----------------------------------------------------------------- linear

def test_linear_forward_backward(rng, fd):
    N, C, K = 4, 6, 3
    x, w, b = rng.standard_normal((N, C)), rng.standard_normal((K, C)), rng.standard_normal(K)
    G = rng.standard_normal((N, K))
    out = np.empty((N, K))

    def loss():
        linear_forward(out, x, w, b)
        return float(np.sum(out * G))

    loss()
    np.testing.assert_allclose(out, x @ w.T + b, rtol=1e-13)
    w0, b0 = rng.standard_normal(w.shape), rng.standard_normal(K)
    dw, db, dx = w0.copy(), b0.copy(), np.full_like(x, np.nan)
    linear_backward(dx, dw, db, G, x, w)
    check_grad(loss, x, dx, rng, eps=1e-3)
    check_grad(loss, w, dw - w0, rng, eps=1e-3)
    check_grad(loss, b, db - b0, rng, eps=1e-3)
    dw2, db2 = w0.copy(), b0.copy()
    linear_backward(None, dw2, db2, G, x, w)        # dx is optional
    np.testing.assert_array_equal(dw2, dw)
    np.testing.assert_array_equal(db2, db)


# ------------------------------------------------------------------- loss

def xent_ref(logits, labels):
    m = logits.max(axis=1, keepdims=True)
    logp = logits - m - np.log(np.sum(np.exp(logits - m), axis=1, keepdims=True))
    return -np.mean(logp[np.arange(len(labels)), labels]), np.exp(logp)


def test_softmax_xent_forward_backward(rng, fd):
    N, K = 5, 4
    logits = rng.standard_normal((N, K)) * 3
    labels = np.array([0, 3, 1, 1, 2])
    probs = np.empty((N, K))

    def loss():
        return softmax_xent_forward(probs, logits, labels)

    ref_loss, ref_probs = xent_ref(logits, labels)
    assert np.isclose(loss(), ref_loss, rtol=1e-13)
    np.testing.assert_allclose(probs, ref_probs, rtol=1e-12)
    dlogits = np.full((N, K), np.nan)
    softmax_xent_backward(dlogits, probs, labels)
    check_grad(loss, logits, dlogits, rng, eps=1e-6, n_coords=6)


def test_softmax_xent_is_stable_for_large_logits():
    logits = np.array([[1000.0, 0.0, -1000.0], [-800.0, -800.0, -801.0]])
    labels = np.array([1, 2])
    probs = np.empty_like(logits)
    loss = softmax_xent_forward(probs, logits, labels)
    ref, _ = xent_ref(logits, labels)
    assert np.isfinite(loss) and np.isclose(loss, ref, rtol=1e-13)
    assert np.all(np.isfinite(probs))


# ------------------------------------------------------------------- residual add
def test_add_forward_split_over_threads_is_plain_add(rng, monkeypatch):
    """ops.add_forward: out += x, split over lowmem's threads in flat ranges: bit for bit the
    plain NumPy add, for 1 and 2 threads, ranges not a multiple of anything; strided views
    fall back to the plain add; unequal shapes raise."""
    from lowmem.system import threads
    from lowmem.ops import add, add_forward
    monkeypatch.setattr(add, "GRAIN", 7)
    base = rng.standard_normal((3, 5, 7, 9)).astype(np.float32)
    x = rng.standard_normal(base.shape).astype(np.float32)
    try:
        for t in (1, 2):
            threads.configure(t)
            out = base.copy()
            add_forward(out, x)
            np.testing.assert_array_equal(out, base + x)
            out = base.copy()
            add_forward(out[:, ::2], x[:, ::2])                # strided: the plain add
            np.testing.assert_array_equal(out[:, ::2], base[:, ::2] + x[:, ::2])
            np.testing.assert_array_equal(out[:, 1::2], base[:, 1::2])
    finally:
        threads.configure(1)
    with pytest.raises(ValueError, match="shapes differ"):
        add_forward(base.copy(), x[:, :2])
