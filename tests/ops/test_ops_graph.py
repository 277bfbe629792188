"""The ops of general graphs in lowmem/ops against independent float64 references: grouped and
depthwise convs with bias, batch norm without a ReLU, ReLU with its 1-bit mask, ReLU6 / clip
with its 2-bit region code, channel concat, dropout from its counter stream, flatten + linear.

Forward: naive loops / NumPy formulas (tests/reference.py). Backward: central finite
differences of sum(out * G) (G random) along random directions and sampled coordinates, at
several step sizes; piecewise-linear ops are sampled at least MARGIN away from their kinks,
so every step size below MARGIN sees one linear piece.
"""
import numpy as np
import pytest

from reference import (check_grad, flatten_linear_ref, grouped_conv_ref, packbits_little)

from lowmem.ops import bitpack, conv_groups, depthwise_cpu, dropout, relu
from lowmem.ops.conv import NUMBA, SLICES
from lowmem.ops import (grouped_conv2d_forward, grouped_conv2d_backward_input, grouped_conv2d_backward_weight,
                        conv_bias_backward, conv_out_size, bn_stats, bn_normalize, bn_apply_forward,
                        bn_eval_forward, bn_backward, relu_forward, relu_backward, clip_forward, clip_backward,
                        relu6_forward, concat_forward, concat_backward, concat_slices, dropout_forward,
                        dropout_backward, dropout_mask, flatten_linear_forward, flatten_linear_backward)

STEPS = (1e-2, 1e-4, 1e-6)       # finite-difference step sizes
MARGIN = 0.05                    # distance of every sample from a kink (> every step in STEPS)


# ----------------------------------------------------------- grouped / depthwise conv, bias

# (Cin, Cout, groups, k, stride, pad, H, W)
GROUP_CASES = [
    (4, 6, 2, 3, 1, 1, 5, 5), (6, 6, 3, 1, 1, 0, 4, 5), (6, 9, 3, 3, 2, 1, 7, 6),
    (5, 5, 5, 3, 1, 1, 6, 6), (4, 4, 4, 3, 2, 1, 7, 7), (3, 3, 3, 5, 1, 2, 5, 6),   # depthwise
    (3, 6, 3, 3, 1, 1, 5, 5), (2, 6, 2, 3, 2, 1, 7, 6),                             # multiplier 2, 3
    (4, 5, 1, 3, 2, 1, 6, 6),                                                       # groups = 1
]
# the reference (slices, GEMMs per group) and the fast set (numba's direct depthwise loops)
COLUMNS = [pytest.param(SLICES, id="slices"),
           pytest.param(NUMBA, id="numba", marks=pytest.mark.skipif(not depthwise_cpu.AVAILABLE,
                                                                    reason="numba not installed"))]


def group_setup(rng, Cin, Cout, groups, k, stride, pad, H, W, N=3):
    Ho, Wo = conv_out_size(H, k, stride, pad), conv_out_size(W, k, stride, pad)
    x = rng.standard_normal((Cin, N, H, W))
    w = rng.standard_normal((Cout, Cin // groups, k, k))
    b = rng.standard_normal(Cout)
    ws = np.full(max(1, conv_groups.workspace_per_sample(Cin, k, k, Ho, Wo, groups, Cout)) * 2, np.nan)
    return x, w, b, ws, (Cout, N, Ho, Wo)


@pytest.mark.parametrize("case", GROUP_CASES)
@pytest.mark.parametrize("block", [1 << 16, 7, 80])  # whole channels; 1 sample; 2 samples of a channel
@pytest.mark.parametrize("columns", COLUMNS)
def test_grouped_conv_forward_matches_naive_loops(rng, monkeypatch, case, block, columns):
    monkeypatch.setattr(conv_groups, "DEPTHWISE_BLOCK", block)
    x, w, b, ws, oshape = group_setup(rng, *case)
    out = np.full(oshape, np.nan)
    groups, stride, pad = case[2], case[4], case[5]
    grouped_conv2d_forward(out, x, w, stride, pad, groups, ws, bias=b, columns=columns)
    np.testing.assert_allclose(out, grouped_conv_ref(x, w, stride, pad, groups, b), rtol=1e-12, atol=1e-12)
    grouped_conv2d_forward(out, x, w, stride, pad, groups, ws, columns=columns)
    np.testing.assert_allclose(out, grouped_conv_ref(x, w, stride, pad, groups), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", GROUP_CASES)
@pytest.mark.parametrize("eps", STEPS)
@pytest.mark.parametrize("columns", COLUMNS)
def test_grouped_conv_backward_finite_differences(rng, case, eps, columns):
    x, w, b, ws, oshape = group_setup(rng, *case)
    groups, stride, pad = case[2], case[4], case[5]
    G = rng.standard_normal(oshape)
    out = np.empty(oshape)

    def loss():
        grouped_conv2d_forward(out, x, w, stride, pad, groups, ws, bias=b, columns=columns)
        return float(np.sum(out * G))

    dx = np.full_like(x, np.nan)                 # overwritten
    grouped_conv2d_backward_input(dx, G, w, stride, pad, groups, ws, columns=columns)
    w0, b0 = rng.standard_normal(w.shape), rng.standard_normal(b.shape)
    dw, db = w0.copy(), b0.copy()                # parameter gradients accumulate
    grouped_conv2d_backward_weight(dw, x, G, stride, pad, groups, ws, columns=columns)
    conv_bias_backward(db, G)
    check_grad(loss, x, dx, rng, eps=eps)
    check_grad(loss, w, dw - w0, rng, eps=eps)
    check_grad(loss, b, db - b0, rng, eps=eps)
    acc = rng.standard_normal(x.shape)
    dx2 = acc.copy()
    grouped_conv2d_backward_input(dx2, G, w, stride, pad, groups, ws, accumulate=True, columns=columns)
    np.testing.assert_allclose(dx2, acc + dx, rtol=1e-12, atol=1e-12)


# (Cin, Cout, groups, k, stride, pad, H, W, N): ResNeXt / RegNet shapes (several channels a
# group), 1x1 at strides 1 and 2, 5x5, odd planes, N = 1
BATCHED_CASES = [(8, 8, 4, 3, 1, 1, 6, 6, 3), (8, 12, 2, 3, 2, 1, 7, 5, 2), (12, 6, 3, 1, 1, 0, 5, 4, 3),
                 (6, 9, 3, 1, 2, 0, 7, 7, 2), (4, 8, 2, 5, 1, 2, 6, 5, 1)]


@pytest.mark.parametrize("case", BATCHED_CASES)
@pytest.mark.parametrize("tile", ["group", "groups", "all", "samples"])
@pytest.mark.parametrize("columns", [pytest.param(SLICES._replace(batched=True), id="slices-batched")] + COLUMNS[1:])
def test_batched_groups_match_the_conv_per_group(rng, case, tile, columns):
    """Columns.batched: the groups' GEMMs batched over tiles of (groups, samples) equal the
    reference's conv per group to rounding, forward, input gradient (written, accumulated) and
    weight gradient (accumulated), for workspaces of one (group, sample), two groups of one
    sample, every group of one sample and every group of two samples."""
    Cin, Cout, groups, k, stride, pad, H, W, N = case
    x, w, b, _, oshape = group_setup(rng, Cin, Cout, groups, k, stride, pad, H, W, N=N)
    per = conv_groups.workspace_per_sample(Cin, k, k, *oshape[2:], groups, Cout)
    ws = np.full(per * {"group": 1, "groups": 2, "all": groups, "samples": 2 * groups}[tile], np.nan)
    G, base = rng.standard_normal(oshape), rng.standard_normal(x.shape)

    def run(cols):
        out, dx, acc, dw = np.full(oshape, np.nan), np.full_like(x, np.nan), base.copy(), np.full_like(w, 0.5)
        grouped_conv2d_forward(out, x, w, stride, pad, groups, ws, columns=cols)
        grouped_conv2d_backward_input(dx, G, w, stride, pad, groups, ws, columns=cols)
        grouped_conv2d_backward_input(acc, G, w, stride, pad, groups, ws, accumulate=True, columns=cols)
        grouped_conv2d_backward_weight(dw, x, G, stride, pad, groups, ws, columns=cols)
        return out, dx, acc, dw

    for got, want in zip(run(columns), run(SLICES)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(run(columns)[0], grouped_conv_ref(x, w, stride, pad, groups), rtol=1e-12, atol=1e-12)


def test_batched_groups_take_no_loop_per_group(rng, monkeypatch):
    """With a workspace for every group, the batched path makes one GEMM per sample tile: the
    reference conv per group is never called."""
    from lowmem.ops import conv as conv_module
    monkeypatch.setattr(conv_groups, "conv2d_forward", lambda *a, **k: pytest.fail("a conv per group"))
    x, w, b, ws, oshape = group_setup(rng, 8, 8, 4, 3, 1, 1, 6, 6)
    out = np.empty(oshape)
    grouped_conv2d_forward(out, x, w, 1, 1, 4, np.empty(ws.size * 4), columns=conv_module.NUMBA._replace(
        winograd=False))
    np.testing.assert_allclose(out, grouped_conv_ref(x, w, 1, 1, 4), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("block", [7, 80])
def test_depthwise_backward_in_sample_blocks_matches_whole_channels(rng, monkeypatch, block):
    x, w, b, ws, oshape = group_setup(rng, 5, 5, 5, 3, 1, 1, 6, 6)
    G = rng.standard_normal(oshape)
    got = {}
    for blk in (1 << 16, block):
        monkeypatch.setattr(conv_groups, "DEPTHWISE_BLOCK", blk)
        dx, dw = np.empty_like(x), np.zeros_like(w)
        grouped_conv2d_backward_input(dx, G, w, 1, 1, 5, None, columns=SLICES)
        grouped_conv2d_backward_weight(dw, x, G, 1, 1, 5, None, columns=SLICES)
        got[blk] = dx, dw
    np.testing.assert_array_equal(got[block][0], got[1 << 16][0])     # elementwise: the same sums
    np.testing.assert_allclose(got[block][1], got[1 << 16][1], rtol=1e-13, atol=1e-13)


def test_grouped_conv_refuses_groups_that_do_not_divide(rng):
    x = rng.standard_normal((4, 1, 3, 3))
    with pytest.raises(ValueError, match="groups=3 must divide both channel counts"):
        grouped_conv2d_forward(np.empty((6, 1, 3, 3)), x, rng.standard_normal((6, 1, 3, 3)), 1, 1, 3, None)
    with pytest.raises(ValueError, match="does not fit"):
        grouped_conv2d_forward(np.empty((4, 1, 3, 3)), x, rng.standard_normal((4, 4, 3, 3)), 1, 1, 2, None)


def test_depthwise_path_needs_no_workspace(rng):
    x, w = rng.standard_normal((3, 2, 5, 5)), rng.standard_normal((3, 1, 3, 3))
    assert conv_groups.workspace_per_sample(3, 3, 3, 5, 5, 3, 3) == 0
    out = np.empty((3, 2, 5, 5))
    grouped_conv2d_forward(out, x, w, 1, 1, 3, None)
    np.testing.assert_allclose(out, grouped_conv_ref(x, w, 1, 1, 3), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------- batch norm without ReLU

def bn_case(rng, C=4, M=18):
    x = rng.standard_normal((C, M)) * 2 + 0.5
    gamma = rng.standard_normal(C)
    gamma[0] = -0.7                                    # a negative gamma
    return x, gamma, rng.standard_normal(C)


def bn_forward_ref(x, gamma, beta, eps=1e-5):
    mean, var = x.mean(axis=1, keepdims=True), x.var(axis=1, keepdims=True)
    return gamma[:, None] * (x - mean) / np.sqrt(var + eps) + beta[:, None]


@pytest.mark.parametrize("eps", STEPS)
def test_bn_without_relu_forward_backward(rng, eps):
    x, gamma, beta = bn_case(rng)
    C, M = x.shape
    G = rng.standard_normal((C, M))
    mean, var, rstd, xhat, out = tuple(np.empty(C) for _ in range(3)) + (np.empty((C, M)), np.empty((C, M)))

    def loss():
        bn_stats(mean, var, rstd, x, 1e-5)
        bn_normalize(xhat, x, mean, rstd)
        bn_apply_forward(out, xhat, gamma, beta)
        return float(np.sum(out * G))

    loss()
    np.testing.assert_allclose(out, bn_forward_ref(x, gamma, beta), rtol=1e-12, atol=1e-12)
    g0, b0 = rng.standard_normal(C), rng.standard_normal(C)
    dgamma, dbeta, dx = g0.copy(), b0.copy(), np.full_like(x, np.nan)
    dy = G.copy()
    bn_backward(dx, dgamma, dbeta, dy, xhat, gamma, rstd)
    np.testing.assert_array_equal(dy, G)               # dy is read only
    rtol = 1e-6 + 20 * eps ** 2                        # BN is not linear in x: O(eps^2) truncation
    check_grad(loss, x, dx, rng, eps=eps, rtol=rtol)
    check_grad(loss, gamma, dgamma - g0, rng, eps=eps)
    check_grad(loss, beta, dbeta - b0, rng, eps=eps)
    acc = rng.standard_normal(x.shape)
    dx2 = acc.copy()
    bn_backward(dx2, g0.copy(), b0.copy(), G, xhat, gamma, rstd, accumulate=True)
    np.testing.assert_allclose(dx2, acc + dx, rtol=1e-12, atol=1e-12)
    bn_backward(dy, g0.copy(), b0.copy(), dy, xhat, gamma, rstd)    # dx may alias dy
    np.testing.assert_allclose(dy, dx, rtol=1e-12, atol=1e-12)


def test_bn_eval_forward_uses_running_stats(rng):
    x, gamma, beta = bn_case(rng)
    rm, rv = rng.standard_normal(4), rng.uniform(0.5, 2, 4)
    out = np.empty_like(x)
    bn_eval_forward(out, x, rm, rv, gamma, beta, 1e-5)
    np.testing.assert_allclose(out, gamma[:, None] * (x - rm[:, None]) / np.sqrt(rv[:, None] + 1e-5) + beta[:, None],
                               rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------- ReLU, ReLU6 / clip

def away_from(rng, shape, kinks):
    """Normal samples (scale 3, around 2) moved at least MARGIN away from every kink."""
    x = rng.standard_normal(shape) * 3 + 2
    for k in kinks:
        near = np.abs(x - k) < MARGIN
        x[near] = k + np.where(x[near] >= k, MARGIN, -MARGIN) * 2
    return x


@pytest.mark.parametrize("n", [1, 7, 8, 9, 61])
@pytest.mark.parametrize("block", [None, 8, 16])
def test_relu_mask_is_packbits_little_and_gradient_is_exact(rng, n, block):
    x = rng.standard_normal(n)
    x[::5] = 0.0                                       # the kink: PyTorch's gradient there is 0
    out, mask = np.empty(n), np.full(bitpack.packed_nbytes(n, 1), 0xFF, np.uint8)
    relu_forward(out, mask, x, block=block)
    np.testing.assert_array_equal(out, np.maximum(x, 0))
    np.testing.assert_array_equal(mask, packbits_little(x > 0))
    assert mask.size == -(-n // 8)
    G = rng.standard_normal(n)
    dx = np.full(n, np.nan)
    relu_backward(dx, G, mask, block=block)
    np.testing.assert_array_equal(dx, G * (x > 0))


@pytest.mark.parametrize("eps", STEPS)
def test_relu_backward_finite_differences(rng, eps):
    x = away_from(rng, (3, 2, 4, 5), [2.0]) - 2        # both sides of 0, at least MARGIN away
    assert (x > 0).any() and (x < 0).any() and np.abs(x).min() >= MARGIN
    G = rng.standard_normal(x.shape)
    out, mask = np.empty_like(x), np.empty(bitpack.packed_nbytes(x.size, 1), np.uint8)

    def loss():
        relu_forward(out, mask, x)
        return float(np.sum(out * G))

    loss()
    dx = np.empty_like(x)
    relu_backward(dx, G, mask)
    check_grad(loss, x, dx, rng, eps=eps)
    acc = rng.standard_normal(x.shape)
    d2 = acc.copy()
    relu_backward(d2, G, mask, accumulate=True)
    np.testing.assert_array_equal(d2, acc + dx)


def test_relu_runs_in_place(rng):
    x = rng.standard_normal((2, 3, 4, 4))
    want, m1 = np.maximum(x, 0), np.empty(12, np.uint8)
    relu_forward(x, m1, x, block=8)
    np.testing.assert_array_equal(x, want)
    np.testing.assert_array_equal(m1, packbits_little(want > 0))


@pytest.mark.parametrize("n", [1, 3, 4, 5, 33])
@pytest.mark.parametrize("block", [None, 8])
def test_clip_region_code_and_gradient(rng, n, block):
    x = rng.standard_normal(n) * 5 + 3
    x[::4] = 0.0                                       # the kinks: gradient 0 there (hardtanh's rule)
    x[1::7] = 6.0
    out, code = np.empty(n), np.full(bitpack.packed_nbytes(n, 2), 0xFF, np.uint8)
    relu6_forward(out, code, x, block=block)
    np.testing.assert_array_equal(out, np.clip(x, 0, 6))
    region = (x > 0).astype(np.uint8) + (x >= 6)
    codes = np.zeros(-(-n // 4) * 4, np.uint8)
    codes[:n] = region
    want = (codes[0::4] | codes[1::4] << 2 | codes[2::4] << 4 | codes[3::4] << 6).astype(np.uint8)
    np.testing.assert_array_equal(code, want)
    assert code.size == -(-n // 4)
    G = rng.standard_normal(n)
    dx = np.full(n, np.nan)
    clip_backward(dx, G, code, block=block)
    np.testing.assert_array_equal(dx, G * ((x > 0) & (x < 6)))


@pytest.mark.parametrize("eps", STEPS)
@pytest.mark.parametrize("lo,hi", [(0.0, 6.0), (-1.0, 2.5)])
def test_clip_backward_finite_differences(rng, eps, lo, hi):
    x = away_from(rng, (3, 2, 4, 5), [lo, hi])
    assert (x < lo).any() and (x > hi).any() and ((x > lo) & (x < hi)).any()
    G = rng.standard_normal(x.shape)
    out, code = np.empty_like(x), np.empty(bitpack.packed_nbytes(x.size, 2), np.uint8)

    def loss():
        clip_forward(out, code, x, lo, hi)
        return float(np.sum(out * G))

    loss()
    dx = np.empty_like(x)
    clip_backward(dx, G, code)
    check_grad(loss, x, dx, rng, eps=eps)
    acc = rng.standard_normal(x.shape)
    d2 = acc.copy()
    clip_backward(d2, G, code, accumulate=True)
    np.testing.assert_array_equal(d2, acc + dx)


def test_packed_ops_refuse_wrong_buffers(rng):
    x = rng.standard_normal((4, 4))
    with pytest.raises(ValueError, match=r"mask must be uint8 of shape \(2,\)"):
        relu_forward(np.empty_like(x), np.empty(3, np.uint8), x)
    with pytest.raises(ValueError, match="C-contiguous"):
        relu_forward(np.empty((4, 2)), np.empty(1, np.uint8), x[:, ::2])
    with pytest.raises(ValueError, match="lo < hi"):
        clip_forward(np.empty_like(x), np.empty(4, np.uint8), x, 1.0, 1.0)


# ------------------------------------------------------------------------------ concat

@pytest.mark.parametrize("eps", STEPS)
def test_concat_forward_backward(rng, eps):
    xs = [rng.standard_normal((c, 2, 3, 3)) for c in (2, 3, 1)]
    out = np.full((6, 2, 3, 3), np.nan)
    concat_forward(out, xs)
    np.testing.assert_array_equal(out, np.concatenate(xs, axis=0))
    G = rng.standard_normal(out.shape)

    def loss():
        concat_forward(out, xs)
        return float(np.sum(out * G))

    dxs = [np.full_like(x, np.nan) for x in xs]
    concat_backward(dxs, G)
    for x, d in zip(xs, dxs):
        check_grad(loss, x, d, rng, eps=eps)
    accs = [rng.standard_normal(x.shape) for x in xs]
    d2 = [a.copy() for a in accs]
    concat_backward(d2, G, accumulate=[True, False, True])
    np.testing.assert_array_equal(d2[0], accs[0] + dxs[0])
    np.testing.assert_array_equal(d2[1], dxs[1])
    np.testing.assert_array_equal(d2[2], accs[2] + dxs[2])
    for s, d in zip(concat_slices([2, 3, 1]), dxs):    # the gradients are views' worth of dout
        np.testing.assert_array_equal(G[s], d)
    with pytest.raises(ValueError, match="do not stack on the channel axis"):
        concat_forward(np.empty((5, 2, 3, 3)), xs)


# ----------------------------------------------------------------------------- dropout

def test_dropout_stream_key_is_units_stream_key():
    """One key derivation for every counter stream: the units' stochastic rounding and dropout."""
    from lowmem.units import packing, stream
    for parts in [(0, 0, 0), (1, 2, 3), (2**63, 17, 5)]:       # rank 0: the units' key has no rank
        assert dropout.stream_key(*parts) == stream.stream_key(*parts)


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5])
def test_dropout_mask_is_deterministic_and_blocked_alike(p):
    """The same (key, element) draws the same bit whatever the block size; another key others."""
    n, key = 1001, dropout.stream_key(7, 3, 2)
    masks = []
    for block in (None, 8, 64):
        m = np.empty(bitpack.packed_nbytes(n, 1), np.uint8)
        dropout_mask(m, n, p, key, block=block)
        masks.append(m)
    np.testing.assert_array_equal(masks[0], masks[1])
    np.testing.assert_array_equal(masks[0], masks[2])
    keep = np.unpackbits(masks[0], bitorder="little")[:n].astype(bool)
    if p == 0:
        assert keep.all()
    else:
        other = np.empty_like(masks[0])
        dropout_mask(other, n, p, dropout.stream_key(7, 4, 2))
        assert (other != masks[0]).any()


def test_dropout_keep_rate():
    """Seed 11, 200,000 elements at p = 0.3: the kept fraction within 5 standard errors of 0.7
    (sd = sqrt(0.21 / n) = 0.001)."""
    n = 200_000
    m = np.empty(bitpack.packed_nbytes(n, 1), np.uint8)
    dropout_mask(m, n, 0.3, dropout.stream_key(11, 0, 0))
    kept = np.unpackbits(m, bitorder="little")[:n].mean()
    assert abs(kept - 0.7) < 5 * np.sqrt(0.21 / n)


@pytest.mark.parametrize("eps", STEPS)
def test_dropout_forward_backward(rng, eps):
    x = rng.standard_normal((3, 2, 4, 5))
    p, key = 0.4, dropout.stream_key(1, 2, 3)
    out, mask = np.empty_like(x), np.empty(bitpack.packed_nbytes(x.size, 1), np.uint8)
    dropout_forward(out, mask, x, p, key, block=16)
    keep = np.unpackbits(mask, bitorder="little")[:x.size].reshape(x.shape).astype(bool)
    assert keep.any() and not keep.all()
    np.testing.assert_array_equal(out, x * keep * (1 / (1 - p)))
    m2 = np.empty_like(mask)
    dropout_mask(m2, x.size, p, key)
    np.testing.assert_array_equal(m2, mask)            # the mask alone, without the forward
    G = rng.standard_normal(x.shape)

    def loss():
        dropout_forward(out, mask, x, p, key)
        return float(np.sum(out * G))

    dx = np.empty_like(x)
    dropout_backward(dx, G, mask, p)
    check_grad(loss, x, dx, rng, eps=eps)
    acc = rng.standard_normal(x.shape)
    d2 = acc.copy()
    dropout_backward(d2, G, mask, p, accumulate=True)
    np.testing.assert_allclose(d2, acc + dx, rtol=1e-15, atol=0)


def test_dropout_refuses_bad_probabilities(rng):
    x = rng.standard_normal(8)
    for p in (1.0, -0.1, True, "0.5"):
        with pytest.raises(ValueError, match=r"dropout probability must be a number in \[0, 1\)"):
            dropout_forward(np.empty(8), np.empty(1, np.uint8), x, p, 0)
    with pytest.raises(ValueError, match="layer must be an integer"):
        dropout.stream_key(0, 0, -1)


# ----------------------------------------------------------------------- flatten + linear

@pytest.mark.parametrize("C,H,W", [(3, 2, 3), (4, 1, 1)])
@pytest.mark.parametrize("eps", STEPS)
def test_flatten_linear_forward_backward(rng, C, H, W, eps):
    N, K = 3, 5
    x = rng.standard_normal((C, N, H, W))
    w, b = rng.standard_normal((K, C * H * W)), rng.standard_normal(K)
    ws = np.full(C * H * W * 2, np.nan)                # two samples a chunk (N = 3)
    out = np.full((K, N), np.nan)
    flatten_linear_forward(out, x, w, b, ws)
    np.testing.assert_allclose(out, flatten_linear_ref(x, w, b), rtol=1e-12, atol=1e-12)
    G = rng.standard_normal((K, N))

    def loss():
        flatten_linear_forward(out, x, w, b, ws)
        return float(np.sum(out * G))

    w0, b0 = rng.standard_normal(w.shape), rng.standard_normal(K)
    dw, db, dx = w0.copy(), b0.copy(), np.full_like(x, np.nan)
    flatten_linear_backward(dx, dw, db, G, x, w, ws)
    check_grad(loss, x, dx, rng, eps=eps)
    check_grad(loss, w, dw - w0, rng, eps=eps)
    check_grad(loss, b, db - b0, rng, eps=eps)


def test_flatten_linear_on_a_one_by_one_plane_needs_no_workspace(rng):
    x, w, b = rng.standard_normal((4, 3, 1, 1)), rng.standard_normal((2, 4)), rng.standard_normal(2)
    out = np.empty((2, 3, 1, 1))
    flatten_linear_forward(out, x, w, b)
    np.testing.assert_allclose(out[:, :, 0, 0], flatten_linear_ref(x, w, b), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="needs a workspace of at least 12 elements"):
        flatten_linear_forward(np.empty((2, 3)), rng.standard_normal((3, 3, 2, 2)), rng.standard_normal((2, 12)), b)


@pytest.mark.parametrize("columns", COLUMNS)
def test_depthwise_split_over_two_threads_is_bit_identical(rng, monkeypatch, columns):
    """Channel blocks are disjoint and each sums its offsets in one order: 2 threads equal 1 bit for bit."""
    pytest.importorskip("threadpoolctl")
    from lowmem.system import threads
    monkeypatch.setattr(conv_groups, "DEPTHWISE_BLOCK", 25)   # planes of 20: one sample a block
    x, w = rng.standard_normal((6, 2, 5, 4)), rng.standard_normal((6, 1, 3, 3))
    G = rng.standard_normal((6, 2, 3, 2))
    before, got = threads.threads(), {}
    try:
        for t in (1, 2):
            threads.configure(t)
            out, dx, dw = np.empty((6, 2, 3, 2)), np.empty_like(x), np.zeros_like(w)
            grouped_conv2d_forward(out, x, w, 2, 1, 6, None, columns=columns)
            grouped_conv2d_backward_input(dx, G, w, 2, 1, 6, None, columns=columns)
            grouped_conv2d_backward_weight(dw, x, G, 2, 1, 6, None, columns=columns)
            got[t] = out, dx, dw
    finally:
        threads.configure(before)
    for a, b in zip(got[1], got[2]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(got[1][0], grouped_conv_ref(x, w, 2, 1, 6), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------- bounded temporaries (tracemalloc)

BOOKKEEPING = 16 << 10      # views, slices and lists a call makes (as tests/core/test_engine.py allows a step)


def allocated(f):
    """Peak bytes allocated during f() beyond what was held before (after a warm-up call), less
    BOOKKEEPING: what is left is the arrays."""
    import tracemalloc
    f()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        f()
        return tracemalloc.get_traced_memory()[1] - start - BOOKKEEPING
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_elementwise_ops_allocate_within_their_stated_bound(rng, monkeypatch, dtype):
    """ReLU, clip and dropout on 100,000 elements in blocks of 4,096: each call's temporaries stay
    within its scratch_bytes, a bound set by the block (far below one activation-sized array)."""
    monkeypatch.setattr(bitpack, "BLOCK", 4096)
    n, s = 100_000, np.dtype(dtype).itemsize
    x, g = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
    out, dx = np.empty_like(x), np.empty_like(x)
    m1, m2 = np.empty(bitpack.packed_nbytes(n, 1), np.uint8), np.empty(bitpack.packed_nbytes(n, 2), np.uint8)
    calls = {
        relu: [lambda: relu_forward(out, m1, x), lambda: relu_backward(dx, g, m1),
               lambda: relu_backward(dx, g, m1, accumulate=True), lambda: clip_forward(out, m2, x),
               lambda: clip_backward(dx, g, m2), lambda: clip_backward(dx, g, m2, accumulate=True)],
        dropout: [lambda: dropout_forward(out, m1, x, 0.3, 7), lambda: dropout_backward(dx, g, m1, 0.3),
                  lambda: dropout_backward(dx, g, m1, 0.3, accumulate=True)],
    }
    for module, fs in calls.items():
        bound = module.scratch_bytes(n, s)
        assert bound < n * s / 2                            # bounded by the block, not the array
        for f in fs:
            assert allocated(f) <= bound, (module.__name__, allocated(f), bound)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_depthwise_conv_allocates_within_its_stated_bound(rng, monkeypatch, dtype):
    monkeypatch.setattr(conv_groups, "DEPTHWISE_BLOCK", 2048)
    C, N, H, W = 64, 4, 12, 12
    s = np.dtype(dtype).itemsize
    x, w = rng.standard_normal((C, N, H, W)).astype(dtype), rng.standard_normal((C, 1, 3, 3)).astype(dtype)
    out, dx, dw = np.empty_like(x), np.empty_like(x), np.zeros_like(w)
    from lowmem.system import threads        # the bound is per thread: as many as lowmem runs now
    bound = conv_groups.scratch_bytes(C, C, C, H, W, H, W, s, threads.threads())
    assert bound < x.nbytes / 2
    for f in (lambda: grouped_conv2d_forward(out, x, w, 1, 1, C, None, columns=SLICES),
              lambda: grouped_conv2d_backward_input(dx, out, w, 1, 1, C, None, columns=SLICES),
              lambda: grouped_conv2d_backward_weight(dw, x, out, 1, 1, C, None, columns=SLICES)):
        assert allocated(f) <= bound, (allocated(f), bound)
    assert conv_groups.scratch_bytes(8, 8, 2, H, W, H, W, s) == 0        # not depthwise: the conv's own
