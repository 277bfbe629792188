"""Max-pool with its 4-bit window index written and read in the op's own pass: numba (optional:
lowmem[fast]), the CPU twin of ops/pool.py's max-pool (the reference) and ops/pool_gpu.py.

    maxpool_forward(out, argmax, x, k, stride, pad)     out = each window's max; argmax (packed 4-bit,
                                                        ops/bitpack.py; None in eval) <- the index
                                                        i*k + j of its first maximum
    maxpool_backward(dx, dout, argmax, k, stride, pad)  dx = dout gathered from the outputs whose
                                                        maximum each input was

The reference writes one uint8 index per output into a workspace and packs it in a second pass
(and unpacks it before the backward), and walks the window offsets over the whole tensor, with
masked copies. Here one plane at a time stays in L1, its indices packed from the plane's scratch
(the backward unpacks a plane's); nothing activation-sized is read twice. Each input row is cut
into its `stride` column phases first (x[stride*m + q] -> phase q), so that every window offset
reads a contiguous run and the loops vectorise (strided reads did not: 2.4x slower at the ImageNet
stem's 3x3/2). The forward takes each input row's maximum over the window columns, then each
output's over the window rows; the backward sums each input row's share in its phases, then
interleaves them into dx.

Arithmetic: the reference's, element by element (tests/ops/test_pool_cpu.py): the forward keeps
the first strict maximum in row-major window order (NaN never wins; a window of -inf or NaN gives
-inf and index 0); the backward sums, for each input, over the window offsets in the same order,
dout where the index names that offset and +0 where not, starting from +0: dx bit for bit.
Layout: x, dx (C, N, H, W) and out, dout (C, N, Ho, Wo), C-contiguous, float32 or float64.
"""
import numpy

from .bitpack import check_packed
from .bitpack_cpu import AVAILABLE, GRAIN, supports
from ..system import threads

if AVAILABLE:
    from numba import njit
    from .bitpack_cpu import pack_any, unpack_any
    _opts = dict(cache=True, nogil=True)

    @njit(**_opts)
    def _window_ranges(n_in, n_out, i, stride, pad):
        """The outputs o in [o0, o1) whose offset-i input o*stride - pad + i lies in [0, n_in)
        (ops/conv.py's window_slices, for one offset)."""
        o0 = (pad - i + stride - 1) // stride if pad > i else 0
        last = n_in - 1 + pad - i
        o1 = min(n_out, last // stride + 1) if last >= 0 else 0
        return o0, max(o0, o1)

    @njit(inline='always', **_opts)
    def _phases(ph, xr, stride):
        """ph[q, m] <- xr[stride*m + q]: a row cut into its `stride` column phases, so that every
        window offset reads one phase contiguously (a strided read does not vectorise)."""
        W = xr.size
        for q in range(stride):
            phq = ph[q]
            for m in range((W - q + stride - 1) // stride):
                phq[m] = xr[stride * m + q]

    @njit(inline='always', **_opts)
    def _span(W, Wo, j, stride, pad):
        """(w0, w1, q, m0): the outputs [w0, w1) whose offset-j column lies in the image, and where
        their first column stride*w0 - pad + j lies among the phases (phase q, from m0 on)."""
        w0, w1 = _window_ranges(W, Wo, j, stride, pad)
        c0 = w0 * stride - pad + j
        return w0, w1, c0 % stride, c0 // stride

    @njit(**_opts)
    def _forward(out, argmax, x, k, stride, pad, p0, p1, keep, neg):
        """Planes p0 .. p1-1 of out (C*N, Ho, Wo) from x (C*N, H, W) in two steps, each row in L1:
        every input row's maximum over the window columns j per output column (hm, first j
        kept in hj), from the row's phases; then per output row the maximum of those over the
        window rows i (index i*k + hj). Strictly greater wins at both steps, so the index is
        the reference's first maximum in row-major window order: the first row holding the
        maximum, the first column of it there. With keep, the indices packed into argmax (a
        plane may start inside a byte: its low half belongs to the plane before, in this range
        unless p0 starts one)."""
        H, W = x.shape[1], x.shape[2]
        Ho, Wo = out.shape[1], out.shape[2]
        plane = Ho * Wo
        ph = numpy.empty((stride, (W + stride - 1) // stride), x.dtype)
        hm = numpy.empty((H, Wo), x.dtype)
        hj = numpy.empty((H, Wo), numpy.uint8)
        idx = numpy.empty((Ho, Wo), numpy.uint8)
        flat_idx = idx.reshape(plane)
        for p in range(p0, p1):
            for ih in range(H):
                _phases(ph, x[p, ih], stride)
                hrow, jrow = hm[ih], hj[ih]
                hrow[:] = neg
                jrow[:] = 0
                for j in range(k):
                    w0, w1, q, m0 = _span(W, Wo, j, stride, pad)
                    _better(hrow[w0:w1], jrow[w0:w1], ph[q, m0:m0 + w1 - w0], numpy.uint8(j))
            for oh in range(Ho):
                orow, irow = out[p, oh], idx[oh]
                orow[:] = neg
                irow[:] = 0
                for i in range(k):
                    ih = oh * stride - pad + i
                    if 0 <= ih < H:
                        _better_of_rows(orow, irow, hm[ih], hj[ih], numpy.uint8(i * k))
            if keep:
                e = p * plane
                if e % 2:                               # the plane's first index: a high half byte
                    argmax[e // 2] = (argmax[e // 2] & 15) | (flat_idx[0] << 4)
                    pack_any(argmax[(e + 1) // 2:(e + plane + 1) // 2], flat_idx[1:], 4)
                else:
                    pack_any(argmax[e // 2:(e + plane + 1) // 2], flat_idx, 4)

    @njit(inline='always', **_opts)
    def _better(orow, irow, vals, code):
        """orow, irow <- vals, code where vals > orow (strictly: the first maximum stays). Every
        store made (selects), so LLVM vectorises it."""
        for t in range(orow.size):
            v, o = vals[t], orow[t]
            up = v > o
            orow[t] = v if up else o
            irow[t] = code if up else irow[t]

    @njit(inline='always', **_opts)
    def _better_of_rows(orow, irow, vals, codes, base):
        """_better with an index per element: base + codes[t]."""
        for t in range(orow.size):
            v, o = vals[t], orow[t]
            up = v > o
            orow[t] = v if up else o
            irow[t] = (base + codes[t]) if up else irow[t]

    @njit(**_opts)
    def _backward(dx, dout, argmax, k, stride, pad, p0, p1, nil):
        """Planes p0 .. p1-1 of dx (C*N, H, W) from dout (C*N, Ho, Wo) and the packed indices, as
        the reference: each input from +0, + dout where the index names it and + 0 where not,
        over the window offsets in row-major order (here per input row: the window rows i whose
        output row reads it, each row's columns j), summed into the row's phases, then
        interleaved into dx."""
        H, W = dx.shape[1], dx.shape[2]
        Ho, Wo = dout.shape[1], dout.shape[2]
        plane = Ho * Wo
        ph = numpy.empty((stride, (W + stride - 1) // stride), dx.dtype)
        idx = numpy.empty((Ho, Wo), numpy.uint8)
        flat_idx = idx.reshape(plane)
        for p in range(p0, p1):
            e = p * plane
            if e % 2:
                flat_idx[0] = argmax[e // 2] >> 4
                unpack_any(flat_idx[1:], argmax[(e + 1) // 2:(e + plane + 1) // 2], 4)
            else:
                unpack_any(flat_idx, argmax[e // 2:(e + plane + 1) // 2], 4)
            for ih in range(H):
                ph[:, :] = nil
                for i in range(k):
                    r = ih + pad - i                    # stride * (the output row reading it)
                    if r < 0 or r % stride or r // stride >= Ho:
                        continue
                    grow, irow = dout[p, r // stride], idx[r // stride]
                    for j in range(k):
                        w0, w1, q, m0 = _span(W, Wo, j, stride, pad)
                        _route(ph[q, m0:m0 + w1 - w0], grow[w0:w1], irow[w0:w1], numpy.uint8(i * k + j), nil)
                dr = dx[p, ih]
                for q in range(stride):
                    phq = ph[q]
                    for m in range((W - q + stride - 1) // stride):
                        dr[stride * m + q] = phq[m]

    @njit(inline='always', **_opts)
    def _route(ds, grow, irow, code, nil):
        """ds[t] += grow[t] where the index is `code`, else + 0 (as the reference)."""
        for t in range(grow.size):
            ds[t] += grow[t] if irow[t] == code else nil

def maxpool_forward(out, argmax, x, k=3, stride=2, pad=1):
    """out (C, N, Ho, Wo) = the max of each k x k window of x (C, N, H, W); argmax (packed 4-bit, or
    None) <- each window's index i*k + j of its first maximum."""
    C, N, H, W = x.shape
    Ho, Wo = out.shape[2:]
    n = C * N * Ho * Wo
    keep = argmax is not None
    if keep:
        check_packed(argmax, n, 4, "argmax")
    if not supports(out, x) or out.shape[:2] != (C, N) or k * k > 16:
        raise ValueError(f"maxpool_forward: out {out.shape} {out.dtype} and x {x.shape} {x.dtype} must be "
                         f"C-contiguous float32 or float64 of one dtype, k*k <= 16")
    o, xs = out.reshape(C * N, Ho, Wo), x.reshape(C * N, H, W)
    code = argmax if keep else numpy.empty(1, numpy.uint8)
    neg = x.dtype.type(-numpy.inf)
    _over_planes(lambda p0, p1: _forward(o, code, xs, k, stride, pad, p0, p1, keep, neg), C * N, Ho * Wo, H * W)


def maxpool_backward(dx, dout, argmax, k=3, stride=2, pad=1):
    """dx (C, N, H, W) = dout (C, N, Ho, Wo) routed to each window's maximum, from argmax (packed
    4-bit). Every dx element is written (no fill).

    # saved: argmax (exact window index per output, 4 bits)."""
    C, N, H, W = dx.shape
    Ho, Wo = dout.shape[2:]
    check_packed(argmax, C * N * Ho * Wo, 4, "argmax")
    if not supports(dx, dout) or dout.shape[:2] != (C, N):
        raise ValueError(f"maxpool_backward: dx {dx.shape} {dx.dtype} and dout {dout.shape} {dout.dtype} must "
                         f"be C-contiguous float32 or float64 of one dtype")
    d, g = dx.reshape(C * N, H, W), dout.reshape(C * N, Ho, Wo)
    nil = dx.dtype.type(0)
    _over_planes(lambda p0, p1: _backward(d, g, argmax, k, stride, pad, p0, p1, nil), C * N, Ho * Wo, H * W)


def _over_planes(fn, P, plane, in_plane):
    """fn(p0, p1) over planes split over lowmem's threads; with an odd plane, in pairs, so each range
    starts its indices on a whole byte (a byte is never written by two threads)."""
    step = 2 if plane % 2 else 1
    units = -(-P // step)
    threads.parallel_for(lambda u0, u1: fn(u0 * step, min(P, u1 * step)), units,
                         grain=max(1, GRAIN // max(1, step * (plane + in_plane))))
