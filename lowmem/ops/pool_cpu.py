"""Max-pool with its 4-bit window index written and read in the op's own pass: numba (optional:
lowmem[fast]), the CPU twin of ops/pool.py's max-pool (the reference) and ops/pool_gpu.py.

    maxpool_forward(out, argmax, x, k, stride, pad)     out = each window's max; argmax (packed 4-bit,
                                                        ops/bitpack.py; None in eval) <- the index
                                                        i*k + j of its first maximum
    maxpool_backward(dx, dout, argmax, k, stride, pad)  dx = dout gathered from the outputs whose
                                                        maximum each input was

The reference writes one uint8 index per output into a workspace and packs it in a second pass
(and unpacks it before the backward), and walks the windows offset by offset over the whole
tensor. Here each output's window is read once and its index goes straight into the packed code;
the backward reads the code where it needs it and writes every dx element once.

Arithmetic: the reference's, element by element (tests/ops/test_pool_cpu.py): the forward keeps
the first strict maximum in row-major window order (NaN never wins; a window of -inf or NaN gives
-inf and index 0); the backward sums, for each input, over the window offsets in the same order,
dout where the index names that offset and +0 where not, starting from +0: dx bit for bit.
Layout: x, dx (C, N, H, W) and out, dout (C, N, Ho, Wo), C-contiguous, float32 or float64.
"""
import numpy

from .bitpack import check_packed
from .bitpack_cpu import AVAILABLE, BLOCK, GRAIN
from ..system import threads

if AVAILABLE:
    from numba import njit
    from .bitpack_cpu import pack_any
    _opts = dict(cache=True, nogil=True)

    @njit(**_opts)
    def _forward(out, argmax, x, k, stride, pad, a, b, keep, neg):
        """Flat outputs [a, b) of out (C*N*Ho*Wo,) from x (C*N, H, W); with keep, their 4-bit
        indices packed into argmax (a and b even, so the range owns whole bytes). neg: -inf in
        x's dtype."""
        P, H, W = x.shape
        Ho, Wo = out.shape[1], out.shape[2]
        cb = numpy.empty(BLOCK, numpy.uint8)
        for e0 in range(a, b, BLOCK):
            e1 = min(b, e0 + BLOCK)
            for e in range(e0, e1):
                p, r = e // (Ho * Wo), e % (Ho * Wo)
                oh, ow = r // Wo, r % Wo
                best, arg = neg, 0
                for i in range(k):
                    ih = oh * stride - pad + i
                    if ih < 0 or ih >= H:
                        continue
                    for j in range(k):
                        iw = ow * stride - pad + j
                        if iw < 0 or iw >= W:
                            continue
                        v = x[p, ih, iw]
                        if v > best:
                            best, arg = v, i * k + j
                out[p, oh, ow] = best
                cb[e - e0] = arg
            if keep:
                pack_any(argmax[e0 // 2:(e1 + 1) // 2], cb[:e1 - e0], 4)

    @njit(**_opts)
    def _backward(dx, dout, argmax, k, stride, pad, p0, p1, nil):
        """Planes p0 .. p1-1 of dx (C*N, H, W) from dout (C*N, Ho, Wo) and the packed indices; nil:
        +0 in dx's dtype."""
        H, W = dx.shape[1], dx.shape[2]
        Ho, Wo = dout.shape[1], dout.shape[2]
        for p in range(p0, p1):
            for h in range(H):
                for w in range(W):
                    acc = nil
                    for i in range(k):
                        t = h + pad - i
                        if t < 0 or t % stride:
                            continue
                        oh = t // stride
                        if oh >= Ho:
                            continue
                        for j in range(k):
                            u = w + pad - j
                            if u < 0 or u % stride:
                                continue
                            ow = u // stride
                            if ow >= Wo:
                                continue
                            e = (p * Ho + oh) * Wo + ow
                            code = (argmax[e >> 1] >> ((e & 1) * 4)) & 15
                            acc += dout[p, oh, ow] if code == i * k + j else nil
                    dx[p, h, w] = acc


def supports(*arrays):
    """Whether these kernels take the arrays: numba present, NumPy float32 or float64, C-contiguous."""
    return (AVAILABLE and all(type(a) is numpy.ndarray and a.flags.c_contiguous for a in arrays)
            and arrays[0].dtype in (numpy.float32, numpy.float64) and all(a.dtype == arrays[0].dtype for a in arrays))


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
    blocks = -(-n // BLOCK)
    threads.parallel_for(lambda b0, b1: _forward(o, code, xs, k, stride, pad, b0 * BLOCK, min(n, b1 * BLOCK),
                                                 keep, neg), blocks, grain=max(1, GRAIN // BLOCK))


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
    threads.parallel_for(lambda p0, p1: _backward(d, g, argmax, k, stride, pad, p0, p1, nil), C * N,
                         grain=max(1, GRAIN // max(1, H * W)))
