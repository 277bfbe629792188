"""Depthwise convolution on the CPU: direct numba loops over channel planes (optional: lowmem[fast]).

Dimensions:  Cin input channels;  m channel multiplier;  Cout = m*Cin output channels;
             N batch;  H, W input;  Ho, Wo output;  k x k kernel;  s stride.
Layout: x, dx (Cin, N, H, W), w, dw (Cout, 1, k, k), out, dout (Cout, N, Ho, Wo), each
C-contiguous (`applies`). Output channel o reads input channel o // m (groups = Cin).

ops/conv_groups.py's slice additions (m = 1) and its per-group GEMMs (m > 1) are the reference.

How: per channel, a block of samples' planes (as many as fit BLOCK_ELEMS, one at least: small
planes go many to a block) is first copied into a zero-padded scratch (L1/L2-resident), the
planes stacked, so no loop below has a border case and one loop runs over a whole block (the
rows between two samples' outputs are junk, computed and never copied out):
  * forward and weight gradient read x's padded plane split into its s column phases,
    P[p, r, u] = xpad[r, u*s + p], so that tap (i, j) of output row oh is the contiguous run
    P[j % s, oh*s + i, j // s + t] over t (a run-time stride does not vectorise);
  * the input gradient reads dout dilated by s and padded by k - 1 - pad,
    Z[r*s + e, q*s + e] = dout[r, q] (zero elsewhere, e = k - 1 - pad), as the correlation
    dx[ih, iw] = sum over (i, j) of Z[ih + k-1-i, iw + k-1-j] * w[i, j].
An element's terms are added in (i, j) order (per output channel, in order, for m > 1), from 0
(or from dx, accumulating), each product rounded, then the sum (no fastmath), 3x3 kernels in
one loop over a row (the nine terms held in a register), other sizes one pass per tap. The
padding adds terms 0 * w, which leave a sum unchanged (a sum from +0 is never -0), so for
m = 1 and finite weights the forward and the input gradient equal the slice additions bit for
bit (accumulating onto a dx of -0 may give +0 where they keep -0). The weight gradient, a
reduction, sums each lane of a row over a plane in the data's dtype and the planes in float64:
to tolerance, as the reference's blocked sums. For m > 1 (the reference: GEMMs) all three
to tolerance.

Memory: per call and thread two blocks of padded planes (each at most max(BLOCK_ELEMS, one
padded plane) elements, s*s*ceil((H + 2*pad)/s)*ceil((W + 2*pad)/s) a plane, (H + k - 1)*(W + k - 1)
for the input gradient), allocated zeroed: the junk outputs read a few elements past the last
plane, and in the weight gradient such a read meets a zero of dout (0 * NaN would be NaN); no
workspace. backward_weight_coded (x kept as a range code) adds one block of decoded planes and
its codes (one byte each): each block's planes are decoded there (bitpack_cpu.decode_span, the
range code's values bit for bit) and read from L1 by the padding pass, so no decoded copy of
the whole input is written to memory and read back.
Threads split the input channels, so every result is the same bit for bit for any thread count.

Indexing: the loops index flat arrays with offsets cast to uint64: numba then adds no
negative-index wrap-around, which keeps LLVM from vectorising (measured 6-9x slower on rows of
64), and makes no array views (each a reference count taken and dropped).
"""
import numpy

from ..system import threads
from ..system.backend import numba_available

AVAILABLE = numba_available()

GRAIN = 1 << 15       # output elements per thread below which a call is not split
BLOCK_ELEMS = 4096    # scratch elements a block of samples' stacked planes aims at (16 KiB in float32)


if AVAILABLE:
    from numba import njit, uint64 as U
    from .bitpack_cpu import decode_span
    _opts = dict(cache=True, nogil=True)          # no fastmath: every operation rounds as NumPy's
    _reduce = dict(cache=True, nogil=True, fastmath={"reassoc", "nsz"})   # the weight gradient's sums

    @njit(**_opts)
    def _phases(Q, R, xf, xb, H, W, pad, s, Hq, Wq, T, a0):
        """Rows a0 .. a0 + Hq - 1 of Q (s, s, T, Wq) flat <- the phases of x's plane at xb, padded
        by pad: Q[pr, pc, a0 + a, b] = x[a*s + pr - pad, b*s + pc - pad], 0 outside the image.
        R: s*Wq scratch (stride > 1: each padded row is built there, then split)."""
        for r in range(s * Hq):
            ih = r - pad
            pr, a = r % s, a0 + r // s
            if ih < 0 or ih >= H:
                for pc in range(s):
                    d = ((pr * s + pc) * T + a) * Wq
                    for u in range(Wq):
                        Q[U(d + u)] = 0
                continue
            row, d = (Q, a * Wq) if s == 1 else (R, 0)
            for u in range(pad):
                row[U(d + u)] = 0
            x0 = xb + ih * W
            for u in range(W):
                row[U(d + pad + u)] = xf[U(x0 + u)]
            for u in range(pad + W, s * Wq):
                row[U(d + u)] = 0
            if s == 2:                               # both column phases in one loop
                d0, d1 = (pr * 2 * T + a) * Wq, ((pr * 2 + 1) * T + a) * Wq
                for u in range(Wq):
                    Q[U(d0 + u)] = R[U(2 * u)]
                    Q[U(d1 + u)] = R[U(2 * u + 1)]
            elif s > 2:
                for pc in range(s):
                    d = ((pr * s + pc) * T + a) * Wq
                    for u in range(Wq):
                        Q[U(d + u)] = R[U(u * s + pc)]

    @njit(**_opts)
    def _taps(k, s, T, Wq):
        """Offset in Q (s, s, T, Wq) of tap (i, j) of output element (0, 0) of the block's first
        sample: x-pad[i, j] = Q[i % s, j % s, i // s, j // s]."""
        off = numpy.empty(k * k, numpy.int64)
        for i in range(k):
            for j in range(k):
                off[i * k + j] = (((i % s) * s + j % s) * T + i // s) * Wq + j // s
        return off

    @njit(**_opts)
    def _per_block(N, plane):
        """Samples a block stacks: as many planes as fit a few thousand elements (L1), one at least."""
        return max(1, min(N, BLOCK_ELEMS // max(plane, 1)))

    @njit(**_opts)
    def _correlate(O, Q, off, wf, wb, k, n, start, zero):
        """O[e] = (O[e] if start else 0) + sum over taps q in order of Q[off[q] + e] * w[wb + q],
        e in [0, n): a whole plane at the scratch's row pitch (a few junk columns a row)."""
        if k == 3:
            a0, a1, a2 = wf[U(wb)], wf[U(wb + 1)], wf[U(wb + 2)]
            a3, a4, a5 = wf[U(wb + 3)], wf[U(wb + 4)], wf[U(wb + 5)]
            a6, a7, a8 = wf[U(wb + 6)], wf[U(wb + 7)], wf[U(wb + 8)]
            p0, p1, p2, p3, p4, p5, p6, p7, p8 = off[0], off[1], off[2], off[3], off[4], off[5], off[6], off[7], off[8]
            for e in range(n):
                v = O[U(e)] if start else zero
                v += Q[U(p0 + e)] * a0
                v += Q[U(p1 + e)] * a1
                v += Q[U(p2 + e)] * a2
                v += Q[U(p3 + e)] * a3
                v += Q[U(p4 + e)] * a4
                v += Q[U(p5 + e)] * a5
                v += Q[U(p6 + e)] * a6
                v += Q[U(p7 + e)] * a7
                v += Q[U(p8 + e)] * a8
                O[U(e)] = v
            return
        if not start:
            for e in range(n):
                O[U(e)] = zero
        for q in range(k * k):
            a, p = wf[U(wb + q)], off[q]
            for e in range(n):
                O[U(e)] += Q[U(p + e)] * a

    @njit(**_opts)
    def _rows_out(of, ob, O, rows, width, pitch):
        """of[ob + r*width + t] = O[r*pitch + t]: a plane from the scratch's pitch to its own."""
        for r in range(rows):
            for t in range(width):
                of[U(ob + r * width + t)] = O[U(r * pitch + t)]

    @njit(**_opts)
    def _rows_in(O, gf, gb, rows, width, pitch, zero):
        """O[r*pitch + t] = gf[gb + r*width + t], the junk columns t >= width 0."""
        for r in range(rows):
            for t in range(width):
                O[U(r * pitch + t)] = gf[U(gb + r * width + t)]
            for t in range(width, pitch):
                O[U(r * pitch + t)] = zero

    @njit(**_opts)
    def _forward(of, xf, wf, m, N, H, W, Ho, Wo, k, s, pad, zero, c0, c1):
        """out[o] for the output channels of input channels c0 .. c1 - 1, in blocks of samples
        whose planes are stacked in the scratch: one correlation runs over a whole block (the
        rows between two samples' outputs are junk, never copied out)."""
        Hq, Wq = (H + 2 * pad + s - 1) // s, (W + 2 * pad + s - 1) // s
        nb = _per_block(N, s * s * Hq * Wq)
        T = nb * Hq
        Q, R = numpy.zeros(s * s * T * Wq + Wq + k, xf.dtype), numpy.zeros(s * Wq, xf.dtype)
        O = numpy.empty(T * Wq, xf.dtype)
        off = _taps(k, s, T, Wq)
        for c in range(c0, c1):
            for n0 in range(0, N, nb):
                n1 = min(N, n0 + nb)
                for n in range(n0, n1):
                    _phases(Q, R, xf, (c * N + n) * H * W, H, W, pad, s, Hq, Wq, T, (n - n0) * Hq)
                for o in range(c * m, (c + 1) * m):
                    _correlate(O, Q, off, wf, o * k * k, k, ((n1 - n0 - 1) * Hq + Ho) * Wq, False, zero)
                    for n in range(n0, n1):
                        _rows_out(of, (o * N + n) * Ho * Wo, O[(n - n0) * Hq * Wq:], Ho, Wo, Wq)

    @njit(**_opts)
    def _dilate(Z, gf, gb, Ho, Wo, s, e, Hz, Wz):
        """Z (Hz, Wz) flat <- dout's plane at gb dilated by s and shifted by e: Z[r*s + e, q*s + e]
        = dout[r, q], 0 elsewhere (an element that would land outside Z reaches no dx element:
        e < 0 when pad > k - 1)."""
        for t in range(Z.size):
            Z[U(t)] = 0
        for r in range(Ho):
            a = r * s + e
            if a < 0 or a >= Hz:
                continue
            for q in range(Wo):
                b = q * s + e
                if 0 <= b < Wz:
                    Z[U(a * Wz + b)] = gf[U(gb + r * Wo + q)]

    @njit(**_opts)
    def _backward_input(df, gf, wf, m, N, H, W, Ho, Wo, k, s, pad, accumulate, zero, c0, c1):
        """dx[c] for input channels c0 .. c1 - 1: per output channel of c, in order, the
        correlation of the dilated, padded output gradient with the flipped taps, in blocks of
        samples stacked as the forward's."""
        Hz, Wz = H + k - 1, W + k - 1
        nb = _per_block(N, Hz * Wz)
        T = nb * Hz
        Z, D = numpy.zeros(T * Wz + k, df.dtype), numpy.zeros(T * Wz, df.dtype)
        off = numpy.empty(k * k, numpy.int64)
        for i in range(k):
            for j in range(k):
                off[i * k + j] = (k - 1 - i) * Wz + (k - 1 - j)
        for c in range(c0, c1):
            for n0 in range(0, N, nb):
                n1 = min(N, n0 + nb)
                if accumulate:
                    for n in range(n0, n1):
                        _rows_in(D[(n - n0) * Hz * Wz:], df, (c * N + n) * H * W, H, W, Wz, zero)
                for o in range(c * m, (c + 1) * m):
                    for n in range(n0, n1):
                        _dilate(Z[(n - n0) * Hz * Wz:(n - n0 + 1) * Hz * Wz], gf, (o * N + n) * Ho * Wo, Ho, Wo, s,
                                k - 1 - pad, Hz, Wz)
                    _correlate(D, Z, off, wf, o * k * k, k, ((n1 - n0 - 1) * Hz + H) * Wz,
                               accumulate or o > c * m, zero)
                for n in range(n0, n1):
                    _rows_out(df, (c * N + n) * H * W, D[(n - n0) * Hz * Wz:], H, W, Wz)

    @njit(**_reduce)
    def _dot9(tot, G, Q, off, n, zero):
        """tot[q] += the sum of G[e] * Q[off[q] + e] over e in [0, n), q < 9: nine sums in one pass
        over G, each in the data's dtype over the plane (vector lanes), added to tot in float64."""
        p0, p1, p2, p3, p4, p5, p6, p7, p8 = off[0], off[1], off[2], off[3], off[4], off[5], off[6], off[7], off[8]
        v0 = v1 = v2 = v3 = v4 = v5 = v6 = v7 = v8 = zero
        for e in range(n):
            g = G[U(e)]
            v0 += g * Q[U(p0 + e)]
            v1 += g * Q[U(p1 + e)]
            v2 += g * Q[U(p2 + e)]
            v3 += g * Q[U(p3 + e)]
            v4 += g * Q[U(p4 + e)]
            v5 += g * Q[U(p5 + e)]
            v6 += g * Q[U(p6 + e)]
            v7 += g * Q[U(p7 + e)]
            v8 += g * Q[U(p8 + e)]
        tot[0] += v0
        tot[1] += v1
        tot[2] += v2
        tot[3] += v3
        tot[4] += v4
        tot[5] += v5
        tot[6] += v6
        tot[7] += v7
        tot[8] += v8

    @njit(**_reduce)
    def _dot(G, Q, p, n):
        """sum of G[e] * Q[p + e] over e in [0, n), in float64 (products exact for float32)."""
        v = 0.0
        for e in range(n):
            v += numpy.float64(G[U(e)]) * numpy.float64(Q[U(p + e)])
        return v

    @njit(**_opts)
    def _backward_weight(dwf, xf, gf, m, N, H, W, Ho, Wo, k, s, pad, zero, c0, c1, packed, scale, zeros, bits,
                         group):
        """dw[o] += the correlation of dout[o] with x[o // m], for the output channels of input
        channels c0 .. c1 - 1: per tap and block of samples (stacked as the forward's, dout's
        junk rows and columns 0) a sum (3x3: in the data's dtype, over vector lanes), the blocks'
        sums added in float64. bits > 0: x is not there (xf unread) but kept as an affine code
        (packed, scale, zeros in groups of `group`: the range code), each block's planes decoded
        into an L1 scratch first (bitpack_cpu.decode_span), the same values as a decoded x."""
        Hq, Wq = (H + 2 * pad + s - 1) // s, (W + 2 * pad + s - 1) // s
        nb = _per_block(N, s * s * Hq * Wq)
        T = nb * Hq
        Q, R = numpy.zeros(s * s * T * Wq + Wq + k, gf.dtype), numpy.zeros(s * Wq, gf.dtype)
        G = numpy.zeros(T * Wq, gf.dtype)
        span = nb * H * W if bits else 0
        X, codes, f = numpy.empty(span, gf.dtype), numpy.empty(span + 8, numpy.uint8), numpy.empty(2, gf.dtype)
        off = _taps(k, s, T, Wq)
        tot = numpy.zeros(k * k)
        for c in range(c0, c1):
            for o in range(c * m, (c + 1) * m):
                tot[:] = 0.0
                for n0 in range(0, N, nb):
                    n1 = min(N, n0 + nb)
                    if bits:                       # the block's planes, decoded
                        decode_span(X[:(n1 - n0) * H * W], codes, packed, scale, zeros, bits, group,
                                    (c * N + n0) * H * W, f)
                    for n in range(n0, n1):
                        if bits:
                            _phases(Q, R, X, (n - n0) * H * W, H, W, pad, s, Hq, Wq, T, (n - n0) * Hq)
                        else:
                            _phases(Q, R, xf, (c * N + n) * H * W, H, W, pad, s, Hq, Wq, T, (n - n0) * Hq)
                        _rows_in(G[(n - n0) * Hq * Wq:], gf, (o * N + n) * Ho * Wo, Ho, Wo, Wq, zero)
                        for t in range(Ho * Wq, Hq * Wq):
                            G[U((n - n0) * Hq * Wq + t)] = zero
                    n = ((n1 - n0 - 1) * Hq + Ho) * Wq
                    if k == 3:
                        _dot9(tot, G, Q, off, n, zero)
                    else:
                        for q in range(k * k):
                            tot[q] += _dot(G, Q, off[q], n)
                for q in range(k * k):
                    dwf[U(o * k * k + q)] += tot[q]


def applies(a, b, w):
    """Whether the loops take these arrays: numba, C-contiguous NumPy arrays of one float dtype
    (float32 or float64), a square kernel w (Cout, 1, k, k)."""
    return (AVAILABLE and all(type(v) is numpy.ndarray and v.flags.c_contiguous for v in (a, b, w))
            and a.dtype == b.dtype == w.dtype and a.dtype in (numpy.float32, numpy.float64)
            and w.shape[1] == 1 and w.shape[2] == w.shape[3])


def _sizes(x, out, w):
    Cin, N, H, W = x.shape
    return Cin, w.shape[0] // Cin, N, H, W, out.shape[2], out.shape[3], w.shape[2]


def _split(fn, channels, per_channel):
    threads.parallel_for(fn, channels, grain=max(1, -(-GRAIN // max(per_channel, 1))))


def forward(out, x, w, stride, pad):
    """out (Cout, N, Ho, Wo) = the depthwise conv of x (Cin, N, H, W) with w (Cout, 1, k, k)."""
    Cin, m, N, H, W, Ho, Wo, k = _sizes(x, out, w)
    of, xf, wf, zero = out.reshape(-1), x.reshape(-1), w.reshape(-1), x.dtype.type(0)
    _split(lambda c0, c1: _forward(of, xf, wf, m, N, H, W, Ho, Wo, k, stride, pad, zero, c0, c1),
           Cin, m * N * Ho * Wo)


def backward_input(dx, dout, w, stride, pad, accumulate=False):
    """dx (Cin, N, H, W) = (or += with accumulate) the input gradient from dout (Cout, N, Ho, Wo)."""
    Cin, m, N, H, W, Ho, Wo, k = _sizes(dx, dout, w)
    df, gf, wf, zero = dx.reshape(-1), dout.reshape(-1), w.reshape(-1), dx.dtype.type(0)
    _split(lambda c0, c1: _backward_input(df, gf, wf, m, N, H, W, Ho, Wo, k, stride, pad, bool(accumulate), zero,
                                          c0, c1), Cin, m * N * H * W)


def backward_weight(dw, x, dout, stride, pad):
    """dw (Cout, 1, k, k) += dout (Cout, N, Ho, Wo) correlated with x (Cin, N, H, W)."""
    Cin, m, N, H, W, Ho, Wo, k = _sizes(x, dout, dw)
    dwf, xf, gf, zero = dw.reshape(-1), x.reshape(-1), dout.reshape(-1), x.dtype.type(0)
    none = numpy.empty(0, numpy.uint8)
    _split(lambda c0, c1: _backward_weight(dwf, xf, gf, m, N, H, W, Ho, Wo, k, stride, pad, zero, c0, c1,
                                           none, none.view(numpy.float32), none, 0, 1), Cin, m * N * Ho * Wo)


def applies_coded(dout, w, code):
    """Whether backward_weight_coded takes these: `applies` for dout and w, and the code's arrays
    C-contiguous NumPy (packed and zero uint8, scale float32)."""
    arrays = (code.packed, code.scale, code.zero)
    return (applies(dout, dout, w) and all(type(a) is numpy.ndarray and a.flags.c_contiguous for a in arrays)
            and code.packed.dtype == code.zero.dtype == numpy.uint8 and code.scale.dtype == numpy.float32)


def backward_weight_coded(dw, code, x_shape, dout, stride, pad, group):
    """backward_weight with x (x_shape) kept as an affine code (code: packed, scale, zero, bits; in
    groups of `group` elements: the range code of units/rangecode.py), which each block of planes
    decodes into the kernel's own scratch: the decoded x's result bit for bit, without x."""
    Cin, N, H, W = x_shape
    m, Ho, Wo, k = dw.shape[0] // Cin, dout.shape[2], dout.shape[3], dw.shape[2]
    dwf, gf, zero = dw.reshape(-1), dout.reshape(-1), dout.dtype.type(0)
    _split(lambda c0, c1: _backward_weight(dwf, gf[:0], gf, m, N, H, W, Ho, Wo, k, stride, pad, zero, c0, c1,
                                           code.packed, code.scale, code.zero, code.bits, group),
           Cin, m * N * Ho * Wo)
