"""ops/winograd4.py (Winograd F(4x4, 3x3)): its numba transforms against their NumPy references
bit for bit, the references against the textbook matrices in float64, the conv products through
ops/conv.py against the im2col path on planes with partial tiles, and where it runs (H and W at
least MIN_SIDE, batches of at least MIN_OUTPUTS outputs a channel; the switch). Its accuracy
against float64: tests/ops/test_winograd.py."""
import numpy as np
import pytest

from lowmem.system import threads
from lowmem.ops import conv, winograd, winograd4 as W4

pytestmark = pytest.mark.skipif(not W4.AVAILABLE, reason="Winograd runs with numba only")

BT = np.array([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0], [0, -2, -1, 2, 1, 0],
               [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]], float)
AT = np.array([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]], float)


def _same_bits(a, b):
    nan = np.isnan(a)
    np.testing.assert_array_equal(nan, np.isnan(b))
    assert a[~nan].tobytes() == b[~nan].tobytes()


def _specials(rng, shape):
    a = (rng.standard_normal(shape) * 10.0 ** rng.integers(-20, 20, shape)).astype(np.float32)
    u = rng.random(shape)
    a[u < 0.05], a[(u >= 0.05) & (u < 0.1)] = -0.0, 0.0
    a[(u >= 0.1) & (u < 0.11)], a[(u >= 0.11) & (u < 0.12)] = np.inf, np.nan
    return a


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("C,H,W", [(16, 32, 32), (3, 17, 18), (2, 16, 21), (5, 4, 4), (2, 1, 1), (3, 7, 10)])
def test_tile_kernels_match_their_numpy_references_bit_for_bit(C, H, W, special):
    """Input, gradient and output transforms (overwriting and accumulating) for partial edge
    tiles and samples n0.. of a larger batch, on normal values and on specials (signed zeros,
    inf, NaN)."""
    rng = np.random.default_rng(C * 100 + H * 10 + W)
    N, n0, ns = 5, 2, 3
    th, tw = W4.tiles(H, W)
    x = _specials(rng, (C, N, H, W)) if special else rng.standard_normal((C, N, H, W)).astype(np.float32)
    with np.errstate(all="ignore"):
        V = np.full((36, C, ns * th * tw), np.nan, np.float32)
        W4._input_tiles(V, x, n0)
        _same_bits(V, W4.input_tiles_reference(x, n0, ns))
        Mg = np.full((36, C, ns * th * tw), np.nan, np.float32)
        W4._gradient_tiles(Mg, x, n0)
        _same_bits(Mg, W4.gradient_tiles_reference(x, n0, ns))
        shape = (36, C, ns * th * tw)
        M = _specials(rng, shape) if special else rng.standard_normal(shape).astype(np.float32)
        for accumulate in (False, True):
            base = rng.standard_normal((C, N, H, W)).astype(np.float32)
            got, want = base.copy(), base.copy()
            W4._output_tiles(got, M, n0, accumulate)
            W4.output_tiles_reference(want, M, n0, accumulate)
            _same_bits(got, want)
            np.testing.assert_array_equal(got[:, :n0], base[:, :n0])      # other samples untouched
            np.testing.assert_array_equal(got[:, n0 + ns:], base[:, n0 + ns:])


@pytest.mark.parametrize("Co,Ci", [(3, 5), (16, 64), (40, 130)])
def test_filter_kernels_match_their_numpy_references_bit_for_bit(Co, Ci):
    """The filter transform (and the flipped, transposed view the input gradient passes) and its
    adjoint against the float64 references, bit for bit on specials, on 1 and 2 threads."""
    rng = np.random.default_rng(Co * 1000 + Ci)
    w, dU, base = _specials(rng, (Co, Ci, 3, 3)), _specials(rng, (36, Co, Ci)), _specials(rng, (Co, Ci, 3, 3))
    wb = w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)
    want_dw = base.copy()
    with np.errstate(all="ignore"):
        want_u, want_ub = W4.filter_tiles_reference(w), W4.filter_tiles_reference(wb)
        W4.filter_gradient_reference(want_dw, dU)
        try:
            for t in (1, 2):
                threads.configure(t)
                _same_bits(winograd.filter_transform(w, winograd.F4), want_u)
                _same_bits(winograd.filter_transform(wb, winograd.F4), want_ub)
                dw = base.copy()
                winograd.filter_gradient_add(dw, dU, winograd.F4)
                _same_bits(dw, want_dw)
        finally:
            threads.configure(1)


def test_references_against_the_float64_definitions():
    """U = G g G^T, dw += G^T dU G (its adjoint), V = B^T d B, Mg = A dy A^T and y = A^T m A per
    tile, by matrix products in float64 (to float32 rounding)."""
    rng = np.random.default_rng(9)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    dU = rng.standard_normal((36, 4, 3)).astype(np.float32)
    U = W4.filter_tiles_reference(w)
    dw = np.zeros_like(w)
    W4.filter_gradient_reference(dw, dU)
    for o in range(4):
        for c in range(3):
            want = W4.G @ w[o, c].astype(float) @ W4.G.T
            np.testing.assert_allclose(U[:, o, c], want.ravel(), rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(dw[o, c], W4.G.T @ dU[:, o, c].reshape(6, 6).astype(float) @ W4.G,
                                       rtol=1e-6, atol=1e-6)
    assert np.isclose(float(np.sum(U.astype(float) * dU)), float(np.sum(w.astype(float) * dw)), rtol=1e-5)
    C, N, H, W = 3, 2, 9, 6
    th, tw = W4.tiles(H, W)
    x = rng.standard_normal((C, N, H, W)).astype(np.float32)
    P = np.zeros((C, N, 4 * th + 2, 4 * tw + 2))
    P[:, :, 1:H + 1, 1:W + 1] = x
    D = np.zeros((C, N, 4 * th, 4 * tw))
    D[:, :, :H, :W] = x
    V, Mg = W4.input_tiles_reference(x, 0, N), W4.gradient_tiles_reference(x, 0, N)
    M = rng.standard_normal((36, C, N * th * tw)).astype(np.float32)
    out = np.zeros((C, N, H, W), np.float32)
    W4.output_tiles_reference(out, M, 0, False)
    Y = np.zeros((C, N, 4 * th, 4 * tw))
    for s in range(N):
        for a in range(th):
            for b in range(tw):
                t = (s * th + a) * tw + b
                for c in range(C):
                    v = BT @ P[c, s, 4 * a:4 * a + 6, 4 * b:4 * b + 6] @ BT.T
                    np.testing.assert_allclose(V[:, c, t], v.ravel(), rtol=1e-5, atol=1e-5)
                    g = AT.T @ D[c, s, 4 * a:4 * a + 4, 4 * b:4 * b + 4] @ AT
                    np.testing.assert_allclose(Mg[:, c, t], g.ravel(), rtol=1e-5, atol=1e-5)
                    Y[c, s, 4 * a:4 * a + 4, 4 * b:4 * b + 4] = AT @ M[:, c, t].reshape(6, 6).astype(float) @ AT.T
    np.testing.assert_allclose(out, Y[:, :, :H, :W], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("H,W", [(16, 16), (17, 19), (18, 32), (8, 9)])
def test_convs_on_partial_tiles_accumulate_and_chunks_match_im2col(monkeypatch, H, W):
    """The three products through ops/conv.py on F(4x4) (one sample a chunk; dx accumulating,
    dw onto ones) against the im2col path, to F(4x4)'s float32 rounding."""
    rng = np.random.default_rng(H * 10 + W)
    Cin, Cout, N = 16, 24, -(-W4.MIN_OUTPUTS // (H * W))
    x = rng.standard_normal((Cin, N, H, W)).astype(np.float32)
    w = (rng.standard_normal((Cout, Cin, 3, 3)) * 0.1).astype(np.float32)
    g = rng.standard_normal((Cout, N, H, W)).astype(np.float32)
    base = rng.standard_normal(x.shape).astype(np.float32)
    assert winograd.scheme(N, H, W) is winograd.F4
    res = {}
    for on in (False, True):
        monkeypatch.setattr(winograd, "ENABLED", on)
        monkeypatch.setattr(winograd, "CACHE_BYTES", 1)     # one sample per chunk
        ws = np.full(W4.per_sample(Cin, Cout, H, W) * 2 + 72 * Cin * Cout + 9 * Cin * H * W * N, np.nan, np.float32)
        assert not on or winograd.applies(x, w, g, 1, 1, ws, weight=True)
        out = np.empty((Cout, N, H, W), np.float32)
        conv.conv2d_forward(out, x, w, 1, 1, ws)
        dx = base.copy()
        conv.conv2d_backward_input(dx, g, w, 1, 1, ws, accumulate=True)
        dw = np.ones_like(w)
        conv.conv2d_backward_weight(dw, x, g, 1, 1, ws)
        res[on] = (out, dx, dw)
    for a, b in zip(res[True], res[False]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5 * np.abs(b).max())


def test_where_it_runs(monkeypatch):
    """F(4x4) on planes of at least MIN_SIDE each way whose batch holds MIN_OUTPUTS outputs a
    channel, F(2x2) elsewhere and everywhere with the switch off (LOWMEM_WINOGRAD4=0); applies()
    asks the scheme's own room."""
    assert winograd.scheme(16, 16, 16) is winograd.F4 and winograd.scheme(64, 8, 8) is winograd.F4
    assert winograd.scheme(8, 32, 17) is winograd.F4 and winograd.scheme(63, 8, 8) is winograd.F2
    assert winograd.scheme(256, 7, 32) is winograd.F2 and winograd.scheme(15, 16, 16) is winograd.F2
    assert W4.may_take(8, 8) and not W4.may_take(7, 64)
    x = np.zeros((16, 16, 16, 16), np.float32)
    w = np.zeros((16, 16, 3, 3), np.float32)
    need = W4.per_sample(16, 16, 16, 16)
    assert need == 36 * 32 * 16 and winograd.per_sample(16, 16, 16, 16) == 16 * 32 * 64
    assert winograd.applies(x, w, x, 1, 1, np.zeros(need, np.float32))
    assert not winograd.applies(x, w, x, 1, 1, np.zeros(need - 1, np.float32))
    assert winograd.applies(x, w, x, 1, 1, np.zeros(need + 72 * 256, np.float32), weight=True)
    assert not winograd.applies(x, w, x, 1, 1, np.zeros(need + 72 * 256 - 1, np.float32), weight=True)
    monkeypatch.setattr(W4, "ENABLED", False)
    assert winograd.scheme(16, 64, 64) is winograd.F2
    assert not winograd.applies(x, w, x, 1, 1, np.zeros(need, np.float32))     # F(2x2) needs more room here
