"""Max-pool with its 4-bit window index written and read in the op's own pass: numba (optional:
lowmem[fast]), the CPU twin of ops/pool.py's max-pool (the reference) and ops/pool_gpu.py.

    maxpool_forward(out, argmax, x, k, stride, pad)     out = each window's max; argmax (packed 4-bit,
                                                        ops/bitpack.py; None in eval) <- the index
                                                        i*k + j of its first maximum
    maxpool_backward(dx, dout, argmax, k, stride, pad)  dx = dout gathered from the outputs whose
                                                        maximum each input was

The reference writes one uint8 index per output into a workspace and packs it in a second pass
(and unpacks it before the backward), and walks the window offsets over the whole tensor, with
masked copies. Here one plane at a time stays in L1: its outputs and indices are built offset by
offset as there, and the indices packed from the plane's scratch (the backward unpacks a plane's
and routes dout into the dx plane the same way); nothing activation-sized is read twice.

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

    @njit(**_opts)
    def _forward(out, argmax, x, k, stride, pad, p0, p1, keep, neg):
        """Planes p0 .. p1-1 of out (C*N, Ho, Wo) from x (C*N, H, W), window offset by window
        offset as the reference, in one plane's L1-sized scratch of indices; with keep, the
        indices packed into argmax (a plane may start inside a byte: its low half belongs to the
        plane before, in this range unless p0 starts one)."""
        H, W = x.shape[1], x.shape[2]
        Ho, Wo = out.shape[1], out.shape[2]
        plane = Ho * Wo
        idx = numpy.empty((Ho, Wo), numpy.uint8)
        flat_idx = idx.reshape(plane)
        for p in range(p0, p1):
            o = out[p]
            o[:, :] = neg
            idx[:, :] = 0
            for i in range(k):
                h0, h1 = _window_ranges(H, Ho, i, stride, pad)
                for j in range(k):
                    w0, w1 = _window_ranges(W, Wo, j, stride, pad)
                    code = numpy.uint8(i * k + j)
                    for oh in range(h0, h1):
                        _better(o[oh, w0:w1], idx[oh, w0:w1], x[p, oh * stride - pad + i, w0 * stride - pad + j:],
                                stride, code)
            if keep:
                e = p * plane
                if e % 2:                               # the plane's first index: a high half byte
                    argmax[e // 2] = (argmax[e // 2] & 15) | (flat_idx[0] << 4)
                    pack_any(argmax[(e + 1) // 2:(e + plane + 1) // 2], flat_idx[1:], 4)
                else:
                    pack_any(argmax[e // 2:(e + plane + 1) // 2], flat_idx, 4)

    @njit(**_opts)
    def _better(orow, irow, xs, stride, code):
        """orow, irow <- xs[stride * t] where it is > orow (strictly: the first maximum stays). Every
        store made (selects), the loop over slices from 0 and the common strides as constants: so
        LLVM vectorises it (an index like stride*ow + shift from a range not starting at 0 carries
        numba's negative-index check, which it does not)."""
        if stride == 2:
            for t in range(orow.size):
                v, o = xs[2 * t], orow[t]
                up = v > o
                orow[t] = v if up else o
                irow[t] = code if up else irow[t]
        else:
            for t in range(orow.size):
                v, o = xs[stride * t], orow[t]
                up = v > o
                orow[t] = v if up else o
                irow[t] = code if up else irow[t]

    @njit(**_opts)
    def _backward(dx, dout, argmax, k, stride, pad, p0, p1, nil):
        """Planes p0 .. p1-1 of dx (C*N, H, W) from dout (C*N, Ho, Wo) and the packed indices, as
        the reference: dx = 0, then per window offset in order, + dout where the index names it
        and + 0 where not."""
        H, W = dx.shape[1], dx.shape[2]
        Ho, Wo = dout.shape[1], dout.shape[2]
        plane = Ho * Wo
        idx = numpy.empty((Ho, Wo), numpy.uint8)
        flat_idx = idx.reshape(plane)
        for p in range(p0, p1):
            e = p * plane
            if e % 2:
                flat_idx[0] = argmax[e // 2] >> 4
                unpack_any(flat_idx[1:], argmax[(e + 1) // 2:(e + plane + 1) // 2], 4)
            else:
                unpack_any(flat_idx, argmax[e // 2:(e + plane + 1) // 2], 4)
            d = dx[p]
            d[:, :] = nil
            for i in range(k):
                h0, h1 = _window_ranges(H, Ho, i, stride, pad)
                for j in range(k):
                    w0, w1 = _window_ranges(W, Wo, j, stride, pad)
                    code = numpy.uint8(i * k + j)
                    for oh in range(h0, h1):
                        _route(d[oh * stride - pad + i, w0 * stride - pad + j:], dout[p, oh, w0:w1], idx[oh, w0:w1],
                               stride, code, nil)

    @njit(**_opts)
    def _route(ds, grow, irow, stride, code, nil):
        """ds[stride * t] += grow[t] where the index is `code`, else + 0 (as the reference)."""
        if stride == 2:
            for t in range(grow.size):
                ds[2 * t] += grow[t] if irow[t] == code else nil
        else:
            for t in range(grow.size):
                ds[stride * t] += grow[t] if irow[t] == code else nil


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
