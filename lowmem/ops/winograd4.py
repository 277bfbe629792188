"""Winograd F(4x4, 3x3): ops/winograd.py's F(2x2, 3x3) with 4x4 output tiles (CPU, numba).

The same algorithm (Lavin & Gray 2016) and the same three products of training, run by
ops/winograd.py's drivers (its `F4` scheme), with a 6x6 input patch d per 4x4 output tile:

    y (4x4) = A^T [ (G g G^T) * (B^T d B) ] A          (* element-wise, 36 products)

    B^T = [[4, 0,-5, 0, 1, 0],     G = [[ 1/4,    0,    0 ],     A^T = [[1, 1, 1, 1, 1, 0],
           [0,-4,-4, 1, 1, 0],          [-1/6, -1/6, -1/6],            [0, 1,-1, 2,-2, 0],
           [0, 4,-4,-1, 1, 0],          [-1/6,  1/6, -1/6],            [0, 1, 1, 4, 4, 0],
           [0,-2,-1, 2, 1, 0],          [1/24, 1/12,  1/6],            [0, 1,-1, 8,-8, 1]]
           [0, 2,-1,-2, 1, 0],          [1/24,-1/12,  1/6],
           [0, 4, 0,-5, 0, 1]]          [   0,    0,    1]]

36 products per 16 outputs against F(2x2)'s 16 per 4 and im2col's 9 per 1: 4x fewer
multiplies than im2col, 1.78x fewer than F(2x2); the transformed tiles take 2.25x the input
(F(2x2): 4x). The 36 GEMMs of a chunk, M[p] (Cout, T) = U[p] (Cout, Cin) @ V[p] (Cin, T), have
a quarter of F(2x2)'s columns, while the filter transforms (36 planes of float64 work per
filter, once a call) do not shrink with the batch: where a conv has few tiles these cost more
than the GEMMs save, so the engine takes this scheme only where H and W are at least MIN_SIDE
and the batch's planes hold at least MIN_OUTPUTS outputs a channel (`takes`; F(2x2) elsewhere;
measured in docs/performance.md).

Accuracy: the constants 5, 1/6, 1/12, 1/24 round, and the points +-2 scale the products by up
to 8, so float32 F(4x4) is less accurate than F(2x2) (tests/ops/test_winograd.py measures
both against float64; docs/performance.md). The filter transform is computed in float64 and
rounded once, as F(2x2)'s.

The transforms below: a NumPy reference each (the test oracle) and a numba twin that does the
same float32 operations in the same order (bit for bit); each 6-vector transform is written
out with its common terms (no multiplication by a zero entry).
"""
import os

import numpy

from ..system.backend import numba_available

ENABLED = os.environ.get("LOWMEM_WINOGRAD4", "1").strip() not in ("0", "false", "no")   # F(2x2) everywhere if off
AVAILABLE = numba_available()
TILE = 4                    # output tile side
PATCH = 6                   # input patch side: TILE + 2
PLANES = 36                 # PATCH * PATCH transformed values per tile
MIN_SIDE = 8                # planes smaller than this take F(2x2)
MIN_OUTPUTS = 4096          # nor do batches of fewer outputs a channel (N*H*W): see `takes`

G = numpy.array([[1 / 4, 0.0, 0.0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
                 [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0.0, 0.0, 1.0]])      # float64


def tiles(H, W):
    """(th, tw): 4x4 output tiles per sample."""
    return (H + TILE - 1) // TILE, (W + TILE - 1) // TILE


def per_sample(Cin, Cout, H, W):
    """Workspace elements one sample needs (its V and M)."""
    th, tw = tiles(H, W)
    return PLANES * (Cin + Cout) * th * tw


def takes(N, H, W):
    """Whether a conv on N planes of H x W takes this scheme rather than F(2x2). One thread,
    forward + input gradient + weight gradient, F(4x4) / F(2x2): 0.56-0.97 at N*H*W of 4,096 and
    more; below, 1.04-1.45 for 256-512 channels (8x8, 14x14 and 16x16 at N*H*W of 2,048-3,136;
    4x4) but 0.80-0.92 for 64-128 channels at 8x8, batch 32, which this rule on outputs alone
    also leaves on F(2x2)."""
    return ENABLED and AVAILABLE and min(H, W) >= MIN_SIDE and N * H * W >= MIN_OUTPUTS


def may_take(H, W):
    """Whether some batch of H x W planes could take this scheme (the plan's bound)."""
    return ENABLED and AVAILABLE and min(H, W) >= MIN_SIDE


# ---- the 1-D transforms (float32 in, float32 out; the same expressions in NumPy and numba) ----
C2, C4, C5, C8 = (numpy.float32(c) for c in (2, 4, 5, 8))     # float32 constants: float32 arithmetic in both

def _bt(d0, d1, d2, d3, d4, d5):
    """B^T applied to a patch's 6 values (a row or a column)."""
    return (C4 * d0 - C5 * d2 + d4, (d3 + d4) - C4 * (d1 + d2), (d4 - d3) + C4 * (d1 - d2),
            (d4 - d2) - C2 * (d1 - d3), (d4 - d2) + C2 * (d1 - d3), C4 * d1 - C5 * d3 + d5)


def _at(m0, m1, m2, m3, m4, m5):
    """A^T applied to 6 transformed values: 4 outputs."""
    s12, d12, s34, d34 = m1 + m2, m1 - m2, m3 + m4, m3 - m4
    return m0 + s12 + s34, d12 + C2 * d34, s12 + C4 * s34, d12 + C8 * d34 + m5


def _a(g0, g1, g2, g3):
    """A applied to an output gradient tile's 4 values: 6 transformed values."""
    s02, s13 = g0 + g2, g1 + g3
    t02, t13 = g0 + C4 * g2, g1 + C4 * g3
    return g0, s02 + s13, s02 - s13, t02 + C2 * t13, t02 - C2 * t13, g3


# ---- the references ----

def filter_tiles_reference(w):
    """U (36, Cout, Cin) float32 = G g G^T of every filter g = w[o, c] (3x3), in float64: t = G g
    (each entry G[i,0]*g[0,l] + G[i,1]*g[1,l] + G[i,2]*g[2,l], in that order), then t G^T the same way."""
    g = w.astype(numpy.float64)
    t = [G[i, 0] * g[:, :, 0] + G[i, 1] * g[:, :, 1] + G[i, 2] * g[:, :, 2] for i in range(PATCH)]   # (Co, Ci, 3)
    U = numpy.empty((PLANES,) + w.shape[:2], numpy.float32)
    for i in range(PATCH):
        for j in range(PATCH):
            U[PATCH * i + j] = t[i][..., 0] * G[j, 0] + t[i][..., 1] * G[j, 1] + t[i][..., 2] * G[j, 2]
    return U


def filter_gradient_reference(dw, dU):
    """dw (Cout, Cin, 3, 3) += G^T dU G per filter, in float64: t = G^T dU (each entry 0 +
    G[0,p]*dU[j] + G[1,p]*dU[6+j] + ..., added in that order), then t G the same way (no leading 0)."""
    d = dU.astype(numpy.float64)
    for p in range(3):
        t = []
        for j in range(PATCH):
            acc = 0.0
            for i in range(PATCH):
                acc = acc + G[i, p] * d[PATCH * i + j]
            t.append(acc)
        for q in range(3):
            acc = t[0] * G[0, q]
            for j in range(1, PATCH):
                acc = acc + t[j] * G[j, q]
            dw[:, :, p, q] += acc


def input_tiles_reference(x, n0, ns):
    """V (36, C, T) float32 = B^T d B of every tile's 6x6 input patch (pad 1, zero outside)."""
    C, N, H, W = x.shape
    th, tw = tiles(H, W)
    P = numpy.zeros((C, ns, TILE * th + 2, TILE * tw + 2), numpy.float32)
    P[:, :, 1:H + 1, 1:W + 1] = x[:, n0:n0 + ns]
    rows = _bt(*(P[:, :, r:r + TILE * th:TILE] for r in range(PATCH)))          # B^T d, row i
    V = numpy.empty((PLANES, C, ns, th, tw), numpy.float32)
    for i, e in enumerate(rows):
        V[PATCH * i:PATCH * i + PATCH] = _bt(*(e[..., q:q + TILE * tw:TILE] for q in range(PATCH)))   # (.) B
    return V.reshape(PLANES, C, -1)


def gradient_tiles_reference(dout, n0, ns):
    """Mg (36, Co, T) float32 = A dy A^T of every 4x4 tile of dout (zero beyond the image)."""
    Co, N, H, W = dout.shape
    th, tw = tiles(H, W)
    D = numpy.zeros((Co, ns, TILE * th, TILE * tw), numpy.float32)
    D[:, :, :H, :W] = dout[:, n0:n0 + ns]
    rows = _a(*(D[:, :, r::TILE] for r in range(TILE)))                         # A dy
    Mg = numpy.empty((PLANES, Co, ns, th, tw), numpy.float32)
    for i, e in enumerate(rows):
        Mg[PATCH * i:PATCH * i + PATCH] = _a(*(e[..., q::TILE] for q in range(TILE)))   # (.) A^T
    return Mg.reshape(PLANES, Co, -1)


def output_tiles_reference(out, M, n0, accumulate):
    """out[:, n0:n0+ns] (=, or += with accumulate) A^T m A of every tile's 36 values in M."""
    Co, N, H, W = out.shape
    th, tw = tiles(H, W)
    ns = M.shape[2] // (th * tw)
    m = M.reshape(PLANES, Co, ns, th, tw)
    u = [_at(*(m[PATCH * i + j] for i in range(PATCH))) for j in range(PATCH)]   # A^T m: u[j][r]
    Y = numpy.empty((Co, ns, th, TILE, tw, TILE), numpy.float32)
    for r in range(TILE):
        for c, v in enumerate(_at(*(u[j][r] for j in range(PATCH)))):           # (.) A
            Y[:, :, :, r, :, c] = v
    y = Y.reshape(Co, ns, TILE * th, TILE * tw)[:, :, :H, :W]
    if accumulate:
        out[:, n0:n0 + ns] += y
    else:
        out[:, n0:n0 + ns] = y


if AVAILABLE:
    from numba import njit
    _opts = dict(cache=True, nogil=True)
    _bt_nb, _at_nb, _a_nb = (njit(inline="always")(f) for f in (_bt, _at, _a))

    FILTER_BLOCK = 64       # filters (input channels) the filter transforms vectorise over, as F(2x2)'s

    @njit(inline="always")
    def _g6(a, b, c):
        """The six rows of G applied to (a, b, c), float64: G[i,0]*a + G[i,1]*b + G[i,2]*c, the
        zero products kept (no fastmath): filter_tiles_reference's operations, constants inline."""
        return (0.25 * a + 0.0 * b + 0.0 * c, -1 / 6 * a + -1 / 6 * b + -1 / 6 * c,
                -1 / 6 * a + 1 / 6 * b + -1 / 6 * c, 1 / 24 * a + 1 / 12 * b + 1 / 6 * c,
                1 / 24 * a + -1 / 12 * b + 1 / 6 * c, 0.0 * a + 0.0 * b + 1.0 * c)

    @njit(inline="always")
    def _gather_filters(g, w, f, Ci, n):
        """g[m, k] <- value m (row-major 3x3) of flat filter f + k, k < n (filter f = o*Ci + c is
        w[o, c]; any strides, as the input gradient's flipped, transposed view), float32."""
        o, c = f // Ci, f % Ci
        for k in range(n):
            for m in range(9):
                g[m, k] = w[o, c, m // 3, m % 3]
            c += 1
            if c == Ci:
                o, c = o + 1, 0

    @njit(inline="always")
    def _gather_planes(d, dU, o, c0, n):
        """d[p, k] <- dU[p, o, c0 + k], k < n, every plane p (float64): a block of filters' values of
        dU copied first, so the transform's loops read a contiguous scratch (reading dU inside them
        left them scalar). F(2x2)'s filter gradient takes it too."""
        for p in range(d.shape[0]):
            dp, src = d[p], dU[p, o, c0:c0 + n]
            for k in range(n):
                dp[k] = src[k]

    @njit(**_opts)
    def _filter_tiles(U, w, o0, o1):
        """U[6i+j, o, c] = (G g G^T)[i, j] for each filter g = w[o, c] of o0 <= o < o1, in float64,
        bit for bit filter_tiles_reference. As F(2x2)'s: the filters taken flat, FILTER_BLOCK at
        a time, their 9 values gathered (_gather_filters, F(2x2)'s too), the transform vectorised
        over the block, its 36 rows copied into U's planes."""
        Ci = w.shape[1]
        Uf = U.reshape(U.shape[0], U.shape[1] * U.shape[2])
        g = numpy.empty((9, FILTER_BLOCK), numpy.float32)
        u = numpy.empty((PLANES, FILTER_BLOCK))
        f1 = o1 * Ci
        for f in range(o0 * Ci, f1, FILTER_BLOCK):
            n = min(FILTER_BLOCK, f1 - f)
            _gather_filters(g, w, f, Ci, n)
            for k in range(n):
                r0 = _g6(numpy.float64(g[0, k]), numpy.float64(g[3, k]), numpy.float64(g[6, k]))   # column l of G g is r_l
                r1 = _g6(numpy.float64(g[1, k]), numpy.float64(g[4, k]), numpy.float64(g[7, k]))
                r2 = _g6(numpy.float64(g[2, k]), numpy.float64(g[5, k]), numpy.float64(g[8, k]))
                for i in range(PATCH):                      # row i of G g, times G^T
                    v0, v1, v2, v3, v4, v5 = _g6(r0[i], r1[i], r2[i])
                    p = PATCH * i
                    u[p, k], u[p + 1, k], u[p + 2, k] = v0, v1, v2
                    u[p + 3, k], u[p + 4, k], u[p + 5, k] = v3, v4, v5
            for p in range(PLANES):
                Up, up = Uf[p, f:f + n], u[p]
                for k in range(n):
                    Up[k] = up[k]

    @njit(inline="always")
    def _gt6_0(a, b, c, d, e, f):
        """The three columns of G applied to six values, each summed from 0.0: 0 + G[0,p]*a + ... +
        G[5,p]*f, p = 0..2, float64, the zero products kept (filter_gradient_reference's t)."""
        return (0.0 + 0.25 * a + -1 / 6 * b + -1 / 6 * c + 1 / 24 * d + 1 / 24 * e + 0.0 * f,
                0.0 + 0.0 * a + -1 / 6 * b + 1 / 6 * c + 1 / 12 * d + -1 / 12 * e + 0.0 * f,
                0.0 + 0.0 * a + -1 / 6 * b + -1 / 6 * c + 1 / 6 * d + 1 / 6 * e + 1.0 * f)

    @njit(inline="always")
    def _gt6(a, b, c, d, e, f):
        """_gt6_0 with no leading 0.0: a*G[0,q] + ... + f*G[5,q], q = 0..2 (the reference's t G)."""
        return (a * 0.25 + b * (-1 / 6) + c * (-1 / 6) + d * (1 / 24) + e * (1 / 24) + f * 0.0,
                a * 0.0 + b * (-1 / 6) + c * (1 / 6) + d * (1 / 12) + e * (-1 / 12) + f * 0.0,
                a * 0.0 + b * (-1 / 6) + c * (-1 / 6) + d * (1 / 6) + e * (1 / 6) + f * 1.0)

    @njit(**_opts)
    def _filter_gradient_add(dw, dU, o0, o1):
        """dw[o, c] += G^T dU G for o0 <= o < o1, in float64, bit for bit filter_gradient_reference;
        blocked as _filter_tiles, each step one loop over the block with G's entries inline, where
        loops read G (benchmarks/conv_parts.py --parts filters; figures: docs/performance.md)."""
        Ci = dw.shape[1]
        d = numpy.empty((PLANES, FILTER_BLOCK))
        g = numpy.empty((9, FILTER_BLOCK))
        t = numpy.empty((3, PATCH, FILTER_BLOCK))
        for o in range(o0, o1):
            for c0 in range(0, Ci, FILTER_BLOCK):
                n = min(FILTER_BLOCK, Ci - c0)
                _gather_planes(d, dU, o, c0, n)
                for j in range(PATCH):                          # t = G^T dU, from 0: column j
                    for k in range(n):
                        r = _gt6_0(d[j, k], d[PATCH + j, k], d[2 * PATCH + j, k], d[3 * PATCH + j, k],
                                   d[4 * PATCH + j, k], d[5 * PATCH + j, k])
                        t[0, j, k], t[1, j, k], t[2, j, k] = r
                for p in range(3):                              # t G: row p
                    for k in range(n):
                        v = _gt6(t[p, 0, k], t[p, 1, k], t[p, 2, k], t[p, 3, k], t[p, 4, k], t[p, 5, k])
                        g[3 * p, k], g[3 * p + 1, k], g[3 * p + 2, k] = v
                for k in range(n):
                    for m in range(9):
                        dw[o, c0 + k, m // 3, m % 3] += g[m, k]

    @njit(**_opts)
    def _input_tiles(V, x, n0):
        """V (36, C, T) <- B^T d B of every 6x6 input patch of samples n0.. of x (C, N, H, W), zero
        outside the image (pad 1). Bit for bit input_tiles_reference. Per (channel, sample) first
        B^T d for every tile row (E (6, th, 4tw+2), padded column k+1 holding image column k, the
        others zero), then (.) B for every tile, each plane a run of th*tw. (F(2x2)'s kernels go
        tile by tile from a padded copy of the plane instead; on 6x6 patches each tile would
        recompute half again of its neighbours' row transforms, and that ran slower from 16x16 up:
        docs/performance.md.)"""
        C, N, H, W = x.shape
        th, tw = (H + TILE - 1) // TILE, (W + TILE - 1) // TILE
        ns = V.shape[2] // (th * tw)
        E = numpy.zeros((PATCH, th, TILE * tw + 2), numpy.float32)
        zero = numpy.float32(0)
        for c in range(C):
            for s in range(ns):
                n = n0 + s
                for a in range(th):
                    r = TILE * a - 1                        # the patch's first row in the image
                    if r >= 0 and r + 5 < H:                # all six rows inside
                        for k in range(W):
                            e = _bt_nb(x[c, n, r, k], x[c, n, r + 1, k], x[c, n, r + 2, k],
                                       x[c, n, r + 3, k], x[c, n, r + 4, k], x[c, n, r + 5, k])
                            E[0, a, k + 1], E[1, a, k + 1], E[2, a, k + 1] = e[0], e[1], e[2]
                            E[3, a, k + 1], E[4, a, k + 1], E[5, a, k + 1] = e[3], e[4], e[5]
                    else:
                        for k in range(W):
                            d0 = x[c, n, r, k] if r >= 0 else zero
                            d1 = x[c, n, r + 1, k] if r + 1 < H else zero
                            d2 = x[c, n, r + 2, k] if r + 2 < H else zero
                            d3 = x[c, n, r + 3, k] if r + 3 < H else zero
                            d4 = x[c, n, r + 4, k] if r + 4 < H else zero
                            d5 = x[c, n, r + 5, k] if r + 5 < H else zero
                            e = _bt_nb(d0, d1, d2, d3, d4, d5)
                            E[0, a, k + 1], E[1, a, k + 1], E[2, a, k + 1] = e[0], e[1], e[2]
                            E[3, a, k + 1], E[4, a, k + 1], E[5, a, k + 1] = e[3], e[4], e[5]
                t0 = s * th * tw
                for i in range(PATCH):                      # (.) B along each row
                    p = PATCH * i
                    for a in range(th):
                        o = t0 + a * tw
                        for b in range(tw):
                            q = TILE * b
                            v = _bt_nb(E[i, a, q], E[i, a, q + 1], E[i, a, q + 2], E[i, a, q + 3],
                                       E[i, a, q + 4], E[i, a, q + 5])
                            V[p, c, o + b], V[p + 1, c, o + b], V[p + 2, c, o + b] = v[0], v[1], v[2]
                            V[p + 3, c, o + b], V[p + 4, c, o + b], V[p + 5, c, o + b] = v[3], v[4], v[5]

    @njit(**_opts)
    def _output_tiles(out, M, n0, accumulate):
        """out[:, n0:n0+n] (=, or += with accumulate) A^T m A of every tile's 36 values in M (36, Co, T).
        Bit for bit output_tiles_reference. Per tile row: A^T m for all its tiles (u (4, 6, tw),
        each plane read as a run of tw), then (.) A along each output row, the tiles whose four
        columns lie inside the image in one loop, the last, partial one apart."""
        Co, N, H, W = out.shape
        th, tw = (H + TILE - 1) // TILE, (W + TILE - 1) // TILE
        ns = M.shape[2] // (th * tw)
        full = W // TILE
        u = numpy.empty((TILE, PATCH, tw), numpy.float32)
        for c in range(Co):
            for s in range(ns):
                for a in range(th):
                    t0 = s * th * tw + a * tw
                    for j in range(PATCH):                  # A^T m, column j of every tile
                        for b in range(tw):
                            v = _at_nb(M[j, c, t0 + b], M[PATCH + j, c, t0 + b], M[2 * PATCH + j, c, t0 + b],
                                       M[3 * PATCH + j, c, t0 + b], M[4 * PATCH + j, c, t0 + b],
                                       M[5 * PATCH + j, c, t0 + b])
                            u[0, j, b], u[1, j, b], u[2, j, b], u[3, j, b] = v[0], v[1], v[2], v[3]
                    r0 = TILE * a
                    for r in range(min(TILE, H - r0)):      # (.) A, output row r0 + r
                        o = out[c, n0 + s, r0 + r]
                        if accumulate:
                            for b in range(full):
                                y = _at_nb(u[r, 0, b], u[r, 1, b], u[r, 2, b], u[r, 3, b], u[r, 4, b], u[r, 5, b])
                                q = TILE * b
                                o[q] += y[0]
                                o[q + 1] += y[1]
                                o[q + 2] += y[2]
                                o[q + 3] += y[3]
                        else:
                            for b in range(full):
                                y = _at_nb(u[r, 0, b], u[r, 1, b], u[r, 2, b], u[r, 3, b], u[r, 4, b], u[r, 5, b])
                                q = TILE * b
                                o[q], o[q + 1], o[q + 2], o[q + 3] = y[0], y[1], y[2], y[3]
                        for b in range(full, tw):           # the partial tile at the right edge
                            y = _at_nb(u[r, 0, b], u[r, 1, b], u[r, 2, b], u[r, 3, b], u[r, 4, b], u[r, 5, b])
                            for k in range(W - TILE * b):
                                if accumulate:
                                    o[TILE * b + k] += y[k]
                                else:
                                    o[TILE * b + k] = y[k]

    @njit(**_opts)
    def _gradient_tiles(Mg, dout, n0):
        """Mg (36, Co, T) <- A dy A^T of every 4x4 tile of dout (Co, N, H, W), samples n0.. (zero
        beyond the image). Bit for bit gradient_tiles_reference. As _input_tiles above: A dy for
        every tile row (E (6, th, 4tw), columns from W on zero), then (.) A^T per plane."""
        Co, N, H, W = dout.shape
        th, tw = (H + TILE - 1) // TILE, (W + TILE - 1) // TILE
        ns = Mg.shape[2] // (th * tw)
        E = numpy.zeros((PATCH, th, TILE * tw), numpy.float32)
        zero = numpy.float32(0)
        for c in range(Co):
            for s in range(ns):
                n = n0 + s
                for a in range(th):
                    r = TILE * a
                    for k in range(W):
                        g0 = dout[c, n, r, k]
                        g1 = dout[c, n, r + 1, k] if r + 1 < H else zero
                        g2 = dout[c, n, r + 2, k] if r + 2 < H else zero
                        g3 = dout[c, n, r + 3, k] if r + 3 < H else zero
                        e = _a_nb(g0, g1, g2, g3)
                        E[0, a, k], E[1, a, k], E[2, a, k] = e[0], e[1], e[2]
                        E[3, a, k], E[4, a, k], E[5, a, k] = e[3], e[4], e[5]
                t0 = s * th * tw
                for i in range(PATCH):                      # (.) A^T along each row
                    p = PATCH * i
                    for a in range(th):
                        o = t0 + a * tw
                        for b in range(tw):
                            q = TILE * b
                            v = _a_nb(E[i, a, q], E[i, a, q + 1], E[i, a, q + 2], E[i, a, q + 3])
                            Mg[p, c, o + b], Mg[p + 1, c, o + b], Mg[p + 2, c, o + b] = v[0], v[1], v[2]
                            Mg[p + 3, c, o + b], Mg[p + 4, c, o + b], Mg[p + 5, c, o + b] = v[3], v[4], v[5]
