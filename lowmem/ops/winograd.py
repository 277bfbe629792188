"""Winograd F(2x2, 3x3): the stride-1, pad-1 3x3 convolutions without im2col (CPU, numba).

Dimensions as in ops/conv.py:  x (Cin, N, H, W), w (Cout, Cin, 3, 3), out (Cout, N, H, W).
Tiles: the output is cut into 2x2 tiles, th = ceil(H/2) by tw = ceil(W/2) per sample; tile t
of a chunk of n samples is t = (s*th + a)*tw + b. Each reads a 4x4 input patch (rows 2a-1..2a+2).

The algorithm (Lavin & Gray 2016), per tile, with the 4x4 input patch d, the 3x3 filter g:

    y (2x2) = A^T [ (G g G^T) * (B^T d B) ] A          (* element-wise, 16 products)

    B^T = [[1, 0,-1, 0],     G = [[ 1,   0,   0 ],     A^T = [[1, 1, 1, 0],
           [0, 1, 1, 0],          [1/2, 1/2, 1/2],            [0, 1,-1,-1]]
           [0,-1, 1, 0],          [1/2,-1/2, 1/2],
           [0, 1, 0,-1]]          [ 0,   0,   1 ]]

Summed over input channels, the 16 element-wise products of each tile become 16 GEMMs over
all tiles at once: M[p] (Cout, T) = U[p] (Cout, Cin) @ V[p] (Cin, T), p = 0..15, with
U = G g G^T (the filter, once per call) and V = B^T d B (the input tiles). That is 16 products
per 4 outputs against im2col's 9 per output: 2.25x fewer multiplies, and the transformed
tiles take 4x the input instead of 9x. The three products of training:

    forward          V from x,        M = U @ V,            out <- A^T M A
    input gradient   the same conv of dout with w turned 180 degrees and Cin/Cout swapped
                     (stride 1, pad 1), so the same three steps; `accumulate` adds into dx
    weight gradient  V from x,  Mg = A dy A^T from each 2x2 output-gradient tile,
                     dU[p] = Mg[p] @ V[p]^T (summed over tiles),  dw = G^T dU G

Memory: V and M for `n` samples take 16*(Cin + Cout)*th*tw*n elements of the conv
workspace (the weight gradient also keeps two 16*Cout*Cin sums per range there) (under im2col's 9*Cin*H*W*n when Cin = Cout); chunks are capped at CACHE_BYTES so
V and M stay in the core's cache between the transform and the GEMM. Threads as in
ops/conv.py (ops/chunks.py): batch ranges, each with its own part of the workspace.

Accuracy: the transforms' constants are 0, +-1 and +-1/2, so float32 Winograd stays close to
im2col; tests/ops/test_winograd.py checks every 3x3 conv shape of ResNet-164 against float64.
When it applies: `applies()` (numba present, NumPy float32 C-contiguous arrays, 3x3,
stride 1, pad 1, at least MIN_CHANNELS channels in and out, one sample fits the workspace);
else ops/conv.py's im2col path runs. ENABLED = False (or LOWMEM_WINOGRAD=0 in the environment)
turns it off.
"""
import os

import numpy

from .chunks import over_batch
from ..system.backend import numba_available

ENABLED = os.environ.get("LOWMEM_WINOGRAD", "1").strip() not in ("0", "false", "no")   # the switch
AVAILABLE = numba_available()          # its tile transforms are numba loops
MIN_CHANNELS = 16           # below this the 16 GEMMs are too thin to beat one im2col GEMM (the stem's Cin = 3)
CACHE_BYTES = 1 << 20       # bytes of transformed tiles (V and M) per chunk



def tiles(H, W):
    """(th, tw): 2x2 output tiles per sample."""
    return (H + 1) // 2, (W + 1) // 2


def per_sample(Cin, Cout, H, W):
    """Workspace elements one sample needs (its V and M)."""
    th, tw = tiles(H, W)
    return 16 * (Cin + Cout) * th * tw


def applies(x, w, out, stride, pad, ws, weight=False):
    """Whether the Winograd path runs this conv (see the module docstring); weight: for the
    weight gradient, which also keeps two (16, Cout, Cin) sums in the workspace."""
    if not (ENABLED and AVAILABLE):
        return False
    Cout, Cin, kh, kw = w.shape
    if (kh, kw, stride, pad) != (3, 3, 1, 1) or min(Cin, Cout) < MIN_CHANNELS:
        return False
    arrays = (x, w, out, ws)
    if not all(type(a) is numpy.ndarray and a.dtype == numpy.float32 for a in arrays):
        return False
    if not (x.flags.c_contiguous and out.flags.c_contiguous):
        return False
    H, W = x.shape[2:]
    if out.shape[2:] != (H, W):
        return False
    need = per_sample(Cin, Cout, H, W) + (32 * Cin * Cout if weight else 0)
    return ws.size >= need                                 # the batch split gives each range at least this


def temporary_bytes(convs, dtype):
    """Bound on the NumPy temporaries this path adds to a step (for the engine's plan):
    convs, (k, stride, pad, Cin, Cout) per conv. The forward and input gradient allocate the
    transformed filters U (16*Cout*Cin float32); the weight gradient works in the workspace."""
    sizes = [ci * co for k, s, p, ci, co in convs
             if (k, s, p) == (3, 1, 1) and min(ci, co) >= MIN_CHANNELS]
    if not (sizes and ENABLED and AVAILABLE and numpy.dtype(dtype) == numpy.float32):
        return 0
    return 16 * max(sizes) * 4


def filter_transform(w):
    """U (16, Cout, Cin) float32 = G g G^T per filter (w (Cout, Cin, 3, 3), any strides),
    each computed in float64 and rounded once; the only allocation is U."""
    U = numpy.empty((16,) + w.shape[:2], numpy.float32)
    _filter_tiles(U, w)
    return U


def _chunk(wsp, per, n):
    """Samples per chunk in this range's workspace: what fits, at most CACHE_BYTES."""
    return max(1, min(n, wsp.size // per, CACHE_BYTES // (4 * per)))


def _correlate(out, x, U, ws, accumulate):
    """out (Co, N, H, W) (+)= the stride-1 pad-1 3x3 correlation of x (Ci, N, H, W) with the
    filters whose transforms are U (16, Co, Ci)."""
    Co, Ci = U.shape[1:]
    N, H, W = x.shape[1:]
    th, tw = tiles(H, W)
    per = per_sample(Ci, Co, H, W)

    def samples(a, b, wsp):
        nc = _chunk(wsp, per, b - a)
        for n0 in range(a, b, nc):
            n1 = min(b, n0 + nc)
            T = (n1 - n0) * th * tw
            V = wsp[:16 * Ci * T].reshape(16, Ci, T)
            M = wsp[16 * Ci * T:16 * (Ci + Co) * T].reshape(16, Co, T)
            _input_tiles(V, x, n0)
            numpy.matmul(U, V, out=M)
            _output_tiles(out, M, n0, accumulate)
    over_batch(N, ws, per, samples)


def conv3x3_forward(out, x, w, ws):
    """out (Cout, N, H, W) = conv(x (Cin, N, H, W), w (Cout, Cin, 3, 3)), stride 1, pad 1."""
    _correlate(out, x, filter_transform(w), ws, False)


def conv3x3_backward_input(dx, dout, w, ws, accumulate=False):
    """dx (Cin, N, H, W) = (or += ) the input gradient: dout correlated with w turned 180 degrees,
    in and out channels swapped."""
    wb = w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)
    _correlate(dx, dout, filter_transform(wb), ws, accumulate)


def conv3x3_backward_weight(dw, x, dout, ws):
    """dw (Cout, Cin, 3, 3) += dout (Cout, N, H, W) correlated with x (Cin, N, H, W).

    Each batch range keeps its running dU (16, Cout, Cin) and one chunk's GEMM result at the
    start of its own part of the workspace (so no temporaries); the ranges' sums are added
    in range order (deterministic for a given thread count), then dw += G^T dU G."""
    Co, Ci = dw.shape[:2]
    N, H, W = x.shape[1:]
    th, tw = tiles(H, W)
    per, u = per_sample(Ci, Co, H, W), 16 * Co * Ci
    sums = {}

    def samples(a, b, wsp):
        acc, term = wsp[:u].reshape(16, Co, Ci), wsp[u:2 * u].reshape(16, Co, Ci)
        tiles_ws = wsp[2 * u:]
        nc = _chunk(tiles_ws, per, b - a)
        for n0 in range(a, b, nc):
            n1 = min(b, n0 + nc)
            T = (n1 - n0) * th * tw
            V = tiles_ws[:16 * Ci * T].reshape(16, Ci, T)
            Mg = tiles_ws[16 * Ci * T:16 * (Ci + Co) * T].reshape(16, Co, T)
            _input_tiles(V, x, n0)
            _gradient_tiles(Mg, dout, n0)
            if n0 == a:
                numpy.matmul(Mg, V.transpose(0, 2, 1), out=acc)
            else:
                acc += numpy.matmul(Mg, V.transpose(0, 2, 1), out=term)
        sums[a] = acc
    over_batch(N, ws, per + 2 * u, samples)        # each range: one sample's tiles + dU + a term
    starts = sorted(sums)
    dU = sums[starts[0]]
    for start in starts[1:]:
        dU += sums[start]
    _filter_gradient_add(dw, dU)


# ---- the tile transforms in NumPy: the references the numba kernels below match bit for bit
# (the same float32 operations in the same order; tests/ops/test_winograd.py). Each takes ns
# samples from n0 on; T = ns*th*tw tiles, tile (s, a, b) at column (s*th + a)*tw + b.

def input_tiles_reference(x, n0, ns):
    """V (16, C, T) float32 = B^T d B of every tile's 4x4 input patch (pad 1, zero outside)."""
    C, N, H, W = x.shape
    th, tw = tiles(H, W)
    P = numpy.zeros((C, ns, 2 * th + 2, 2 * tw + 2), numpy.float32)
    P[:, :, 1:H + 1, 1:W + 1] = x[:, n0:n0 + ns]
    d = [P[:, :, r:r + 2 * th:2] for r in range(4)]                   # row r of every patch
    rows = (d[0] - d[2], d[1] + d[2], d[2] - d[1], d[1] - d[3])      # B^T d
    V = numpy.empty((16, C, ns, th, tw), numpy.float32)
    for i, e in enumerate(rows):
        e = [e[..., q:q + 2 * tw:2] for q in range(4)]               # column q of every patch
        V[4 * i:4 * i + 4] = (e[0] - e[2], e[1] + e[2], e[2] - e[1], e[1] - e[3])   # (.) B
    return V.reshape(16, C, -1)


def gradient_tiles_reference(dout, n0, ns):
    """Mg (16, Co, T) float32 = A dy A^T of every 2x2 tile of dout (zero beyond the image)."""
    Co, N, H, W = dout.shape
    th, tw = tiles(H, W)
    D = numpy.zeros((Co, ns, 2 * th, 2 * tw), numpy.float32)
    D[:, :, :H, :W] = dout[:, n0:n0 + ns]
    g0, g1 = D[:, :, 0::2], D[:, :, 1::2]
    Mg = numpy.empty((16, Co, ns, th, tw), numpy.float32)
    for i, e in enumerate((g0, g0 + g1, g0 - g1, -g1)):              # A dy
        f0, f1 = e[..., 0::2], e[..., 1::2]
        Mg[4 * i:4 * i + 4] = (f0, f0 + f1, f0 - f1, -f1)            # (.) A^T
    return Mg.reshape(16, Co, -1)


def output_tiles_reference(out, M, n0, accumulate):
    """out[:, n0:n0+ns] (=, or += with accumulate) A^T m A of every tile's 16 values in M."""
    Co, N, H, W = out.shape
    th, tw = tiles(H, W)
    ns = M.shape[2] // (th * tw)
    m = M.reshape(16, Co, ns, th, tw)
    u = [m[j] + m[4 + j] + m[8 + j] for j in range(4)]               # A^T m: rows 0+1+2
    v = [m[4 + j] - m[8 + j] - m[12 + j] for j in range(4)]          # and 1-2-3
    Y = numpy.empty((Co, ns, th, 2, tw, 2), numpy.float32)
    Y[:, :, :, 0, :, 0], Y[:, :, :, 0, :, 1] = u[0] + u[1] + u[2], u[1] - u[2] - u[3]
    Y[:, :, :, 1, :, 0], Y[:, :, :, 1, :, 1] = v[0] + v[1] + v[2], v[1] - v[2] - v[3]
    y = Y.reshape(Co, ns, 2 * th, 2 * tw)[:, :, :H, :W]
    if accumulate:
        out[:, n0:n0 + ns] += y
    else:
        out[:, n0:n0 + ns] = y


if AVAILABLE:
    from numba import njit
    _opts = dict(cache=True, nogil=True)

    @njit(**_opts)
    def _filter_tiles(U, w):
        """U[4i+j, o, c] = (G g G^T)[i, j] for each filter g = w[o, c] (3x3), in float64."""
        G = numpy.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])
        Co, Ci = w.shape[0], w.shape[1]
        t = numpy.empty((4, 3))
        for o in range(Co):
            for c in range(Ci):
                for i in range(4):                          # t = G g
                    for l in range(3):
                        t[i, l] = G[i, 0] * w[o, c, 0, l] + G[i, 1] * w[o, c, 1, l] + G[i, 2] * w[o, c, 2, l]
                for i in range(4):                          # (G g) G^T
                    for j in range(4):
                        U[4 * i + j, o, c] = t[i, 0] * G[j, 0] + t[i, 1] * G[j, 1] + t[i, 2] * G[j, 2]

    @njit(**_opts)
    def _filter_gradient_add(dw, dU):
        """dw[o, c] += G^T dU G, dU[4i+j, o, c] the gradient of U, in float64 (the adjoint of _filter_tiles)."""
        G = numpy.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])
        Co, Ci = dw.shape[0], dw.shape[1]
        t = numpy.empty((3, 4))
        for o in range(Co):
            for c in range(Ci):
                for p in range(3):                          # t = G^T dU
                    for j in range(4):
                        acc = 0.0
                        for i in range(4):
                            acc += G[i, p] * dU[4 * i + j, o, c]
                        t[p, j] = acc
                for p in range(3):                          # (G^T dU) G
                    for q in range(3):
                        dw[o, c, p, q] += t[p, 0] * G[0, q] + t[p, 1] * G[1, q] + t[p, 2] * G[2, q] + t[p, 3] * G[3, q]

    @njit(**_opts)
    def _input_tiles(V, x, n0):
        """V (16, C, T) <- B^T d B of every 4x4 input patch of samples n0.. of x (C, N, H, W),
        zero outside the image (pad 1; a zero column/row more when H or W is odd).
        Bit for bit input_tiles_reference.

        Per (channel, sample): first B^T d for every tile row (E (4, th, 2tw+2): column k
        holds padded column k, its zero columns never written), then (.) B for every tile,
        each plane of V written as one run of th*tw. Every array is indexed directly: a
        numba view (a row, a slice) costs a reference-count update, which dominated the
        per-row work on the small images (8x8, 16x16)."""
        C, N, H, W = x.shape
        th, tw = (H + 1) // 2, (W + 1) // 2
        ns = V.shape[2] // (th * tw)
        E = numpy.zeros((4, th, 2 * tw + 2), numpy.float32)
        zero = numpy.float32(0)
        for c in range(C):
            for s in range(ns):
                n = n0 + s
                for a in range(th):                         # B^T d: rows 0-2, 1+2, 2-1, 1-3
                    r = 2 * a - 1                           # the patch's first row in the image
                    if r >= 0 and r + 3 < H:                # all four rows inside
                        for k in range(W):
                            d0, d1 = x[c, n, r, k], x[c, n, r + 1, k]
                            d2, d3 = x[c, n, r + 2, k], x[c, n, r + 3, k]
                            E[0, a, k + 1] = d0 - d2
                            E[1, a, k + 1] = d1 + d2
                            E[2, a, k + 1] = d2 - d1
                            E[3, a, k + 1] = d1 - d3
                    else:                                   # the first and last tile rows
                        for k in range(W):
                            d0 = x[c, n, r, k] if r >= 0 else zero
                            d1 = x[c, n, r + 1, k]
                            d2 = x[c, n, r + 2, k] if r + 2 < H else zero
                            d3 = x[c, n, r + 3, k] if r + 3 < H else zero
                            E[0, a, k + 1] = d0 - d2
                            E[1, a, k + 1] = d1 + d2
                            E[2, a, k + 1] = d2 - d1
                            E[3, a, k + 1] = d1 - d3
                t0 = s * th * tw
                for i in range(4):                          # (.) B: the same along each row
                    p = 4 * i
                    for a in range(th):
                        o = t0 + a * tw
                        for b in range(tw):
                            q = 2 * b
                            V[p, c, o + b] = E[i, a, q] - E[i, a, q + 2]
                            V[p + 1, c, o + b] = E[i, a, q + 1] + E[i, a, q + 2]
                            V[p + 2, c, o + b] = E[i, a, q + 2] - E[i, a, q + 1]
                            V[p + 3, c, o + b] = E[i, a, q + 1] - E[i, a, q + 3]

    @njit(**_opts)
    def _output_tiles(out, M, n0, accumulate):
        """out[:, n0:n0+n] (=, or += with accumulate) A^T m A of every tile's 16 values in M (16, Co, T)."""
        Co, N, H, W = out.shape
        th, tw = (H + 1) // 2, (W + 1) // 2
        ns = M.shape[2] // (th * tw)
        for c in range(Co):
            for s in range(ns):
                o = out[c, n0 + s]
                for a in range(th):
                    t0 = s * th * tw + a * tw
                    r = 2 * a
                    for b in range(tw):
                        t = t0 + b
                        # A^T m: rows 0+1+2 and 1-2-3, per column j
                        u0 = M[0, c, t] + M[4, c, t] + M[8, c, t]
                        u1 = M[1, c, t] + M[5, c, t] + M[9, c, t]
                        u2 = M[2, c, t] + M[6, c, t] + M[10, c, t]
                        u3 = M[3, c, t] + M[7, c, t] + M[11, c, t]
                        v0 = M[4, c, t] - M[8, c, t] - M[12, c, t]
                        v1 = M[5, c, t] - M[9, c, t] - M[13, c, t]
                        v2 = M[6, c, t] - M[10, c, t] - M[14, c, t]
                        v3 = M[7, c, t] - M[11, c, t] - M[15, c, t]
                        y00, y01 = u0 + u1 + u2, u1 - u2 - u3
                        y10, y11 = v0 + v1 + v2, v1 - v2 - v3
                        q = 2 * b
                        if not accumulate:
                            o[r, q] = y00
                            if q + 1 < W:
                                o[r, q + 1] = y01
                            if r + 1 < H:
                                o[r + 1, q] = y10
                                if q + 1 < W:
                                    o[r + 1, q + 1] = y11
                        else:
                            o[r, q] += y00
                            if q + 1 < W:
                                o[r, q + 1] += y01
                            if r + 1 < H:
                                o[r + 1, q] += y10
                                if q + 1 < W:
                                    o[r + 1, q + 1] += y11

    @njit(**_opts)
    def _gradient_tiles(Mg, dout, n0):
        """Mg (16, Co, T) <- A dy A^T of every 2x2 tile of dout (Co, N, H, W), samples n0..
        (zero beyond the image when H or W is odd). A = [[1,0],[1,1],[1,-1],[0,-1]].
        Bit for bit gradient_tiles_reference. Organised as _input_tiles: A dy for every tile
        row of a sample (E (4, th, 2tw), column W stays zero), then (.) A^T per plane."""
        Co, N, H, W = dout.shape
        th, tw = (H + 1) // 2, (W + 1) // 2
        ns = Mg.shape[2] // (th * tw)
        E = numpy.zeros((4, th, 2 * tw), numpy.float32)
        zero = numpy.float32(0)
        for c in range(Co):
            for s in range(ns):
                n = n0 + s
                for a in range(th):                         # A dy: rows g0, g0+g1, g0-g1, -g1
                    if 2 * a + 1 < H:
                        for k in range(W):
                            g0, g1 = dout[c, n, 2 * a, k], dout[c, n, 2 * a + 1, k]
                            E[0, a, k] = g0
                            E[1, a, k] = g0 + g1
                            E[2, a, k] = g0 - g1
                            E[3, a, k] = -g1
                    else:                                   # H odd: the last row's partner is zero
                        for k in range(W):
                            g0 = dout[c, n, 2 * a, k]
                            E[0, a, k] = g0
                            E[1, a, k] = g0 + zero
                            E[2, a, k] = g0 - zero
                            E[3, a, k] = -zero
                t0 = s * th * tw
                for i in range(4):                          # (.) A^T: the same along each row
                    p = 4 * i
                    for a in range(th):
                        o = t0 + a * tw
                        for b in range(tw):
                            q = 2 * b
                            Mg[p, c, o + b] = E[i, a, q]
                            Mg[p + 1, c, o + b] = E[i, a, q] + E[i, a, q + 1]
                            Mg[p + 2, c, o + b] = E[i, a, q] - E[i, a, q + 1]
                            Mg[p + 3, c, o + b] = -E[i, a, q + 1]
