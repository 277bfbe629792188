"""2-D convolution (no bias) as im2col + one GEMM, chunked over the batch.

Dimensions:  Cin, Cout channels;  N batch;  H, W input;  Ho, Wo output;
             kh, kw kernel;  K = Cin*kh*kw  (GEMM inner size).
Layout: x (Cin, N, H, W), w (Cout, Cin, kh, kw), out (Cout, N, Ho, Wo).

The only scratch memory is `ws`, a 1-D workspace handed in from the memory
plan. im2col columns for `nc` samples take K*nc*Ho*Wo elements, so the batch
is processed in chunks of nc = ws.size // (K*Ho*Wo) samples: the workspace
bounds memory, whatever N is. A 1x1/stride-1/pad-0 conv on a contiguous
input needs no columns at all: it is the GEMM w(Cout, Cin) @ x(Cin, N*H*W).

Cores (lowmem/system/threads.py, cut by ops/chunks.py): with T lowmem threads the batch is split into T
ranges, each with its own 1/T of the workspace, running its own im2col, GEMM
and col2im (a 1x1 conv's GEMM: T column ranges). Weight gradients are summed
per range into a weight-sized temporary each, then added in range order. So
results are deterministic for a given T, but may differ in the last bits
between thread counts (smaller GEMMs may take other BLAS kernels, too).

Columns: im2col / col2im_add below are the readable NumPy references
(kernel-offset slices). Faster twins sit beside this file, bit-identical:
a numba col2im (ops/columns_cpu.py; a 1x1 stride-1 conv's col2im, one block
addition, stays NumPy's) and one-launch CUDA im2col / col2im
(ops/columns_gpu.py). Which ones a conv runs is a `Columns` pair passed in
(`columns=`): the engine picks it once, `columns_for(xp, fused)`; a direct call
without one gets `columns_for` of its arrays' module.

With the fast pair (`NUMBA`: numba installed and the engine on its fused kernels),
stride-1, pad-1 3x3 convs with at least 16 channels on float32 NumPy arrays take
Winograd F(2x2, 3x3) instead (ops/winograd.py: no columns at all; `winograd.applies`
says when, LOWMEM_WINOGRAD=0 turns it off). The reference pair (`SLICES`, what an
engine with use_fast=False runs) never does: its results are im2col's, bit for bit.
"""
from typing import Callable, NamedTuple

import numpy

from ..system.backend import array_module
from . import columns_cpu, columns_gpu, depthwise_cpu, depthwise_gpu
from .chunks import GEMM_WORK, chunk_size, gemm_grain, over_batch, over_columns
from ..system import threads
from . import winograd as _winograd

def conv_out_size(h, k, stride, pad):
    return (h + 2 * pad - k) // stride + 1


def _flat(a, rows):
    """(rows, -1) view of `a`; raises instead of silently copying."""
    v = a.view()
    v.shape = (rows, -1)
    return v


def _is_pointwise(w, stride, pad):
    return w.shape[2] == 1 and w.shape[3] == 1 and stride == 1 and pad == 0


def _ranges(h, ho, k_off, stride, pad):
    """Output index range [lo, hi) whose input row  k_off - pad + stride*o  lies in [0, h)."""
    lo = max(0, -(-(pad - k_off) // stride))
    hi = min(ho, (h - 1 - k_off + pad) // stride + 1)
    return lo, max(lo, hi)


def window_slices(H, W, Ho, Wo, kh, kw, stride, pad):
    """For each kernel offset (i, j): the output window (h0:h1, w0:w1) that reads inside the
    image, and the matching strided input slices. Shared by im2col, col2im and the max-pool."""
    for i in range(kh):
        h0, h1 = _ranges(H, Ho, i, stride, pad)
        hs = i - pad + stride * h0
        for j in range(kw):
            w0, w1 = _ranges(W, Wo, j, stride, pad)
            ws = j - pad + stride * w0
            yield (i, j, slice(h0, h1), slice(w0, w1),
                   slice(hs, hs + stride * (h1 - h0), stride), slice(ws, ws + stride * (w1 - w0), stride))


def im2col(cols, x, kh, kw, stride, pad):
    """cols (Cin, kh, kw, n, Ho, Wo) <- patches of x (Cin, n, H, W); zero outside the image."""
    H, W = x.shape[2:]
    Ho, Wo = cols.shape[4:]
    for i, j, oh, ow, ih, iw in window_slices(H, W, Ho, Wo, kh, kw, stride, pad):
        c = cols[:, i, j]
        # zero only the border strips the image does not cover
        c[:, :, :oh.start] = 0
        c[:, :, oh.stop:] = 0
        c[:, :, oh, :ow.start] = 0
        c[:, :, oh, ow.stop:] = 0
        c[:, :, oh, ow] = x[:, :, ih, iw]


def col2im_add(dx, cols, kh, kw, stride, pad):
    """dx (Cin, n, H, W) += the scatter of cols (Cin, kh, kw, n, Ho, Wo) (im2col's adjoint)."""
    H, W = dx.shape[2:]
    Ho, Wo = cols.shape[4:]
    for i, j, oh, ow, ih, iw in window_slices(H, W, Ho, Wo, kh, kw, stride, pad):
        dx[:, :, ih, iw] += cols[:, i, j, :, oh, ow]


class Columns(NamedTuple):
    """The two column functions a conv runs:
    im2col(cols, x, kh, kw, stride, pad)              cols <- patches of x (as `im2col` above)
    col2im(dx, n0, n1, cols, kh, kw, stride, pad)     dx[:, n0:n1] += the scatter of cols
    (col2im gets the whole dx and the sample range: the numba loop indexes dx flat).
    winograd: stride-1 3x3 convs that ops/winograd.py takes run there instead (no columns).
    depthwise: the direct depthwise kernels (ops/depthwise_cpu.py, depthwise_gpu.py) that
    ops/conv_groups.py runs where they apply; None: its reference slices and GEMMs.
    batched: other grouped convs as batched GEMMs over tiles of (groups, samples), not a
    conv per group (ops/conv_groups.py)."""
    name: str
    im2col: Callable
    col2im: Callable
    winograd: bool = False
    depthwise: object = None
    batched: bool = False


def _col2im_slices(dx, n0, n1, cols, kh, kw, stride, pad):
    col2im_add(dx[:, n0:n1], cols, kh, kw, stride, pad)


def _col2im_numba(dx, n0, n1, cols, kh, kw, stride, pad):
    # a 1x1 stride-1 conv's col2im (the input gradient that accumulates) is one whole-block
    # addition, which NumPy's add streams; the numba loop walks it row by row (rows of 4-32)
    if columns_cpu.supports(dx, cols) and (kh, kw, stride, pad) != (1, 1, 1, 0):
        columns_cpu.col2im_add(dx, cols, kh, kw, stride, pad, n0)
    else:                                                  # the slices: a 1x1 block, or a strided dx
        _col2im_slices(dx, n0, n1, cols, kh, kw, stride, pad)


def _col2im_cuda(dx, n0, n1, cols, kh, kw, stride, pad):
    columns_gpu.col2im_add(dx[:, n0:n1], cols, kh, kw, stride, pad)


SLICES = Columns("slices", im2col, _col2im_slices)                    # the references above
NUMBA = Columns("numba col2im + Winograd + depthwise", im2col, _col2im_numba, True, depthwise_cpu, True)
CUDA = Columns("cuda", columns_gpu.im2col, _col2im_cuda, depthwise=depthwise_gpu, batched=True)  # columns_gpu.py


def columns_for(xp, fast=True):
    """The fastest columns for array module xp: one CUDA launch each on CuPy; on NumPy, when
    numba is there and `fast` (the engine's fused flag), the numba col2im and Winograd for the
    3x3 convs it takes; else the slices (the reference: what an engine with use_fast=False runs)."""
    if getattr(xp, "__name__", "") == "cupy":
        return CUDA
    return NUMBA if fast and columns_cpu.AVAILABLE else SLICES


def conv2d_forward(out, x, w, stride, pad, ws, columns=None):
    """out (Cout, N, Ho, Wo) = conv(x (Cin, N, H, W), w (Cout, Cin, kh, kw)).

    x may be a strided view (e.g. the caller's NCHW batch transposed).
    columns: the `Columns` to run (None: columns_for the arrays' module)."""
    xp = array_module(out)
    columns = columns or columns_for(xp)
    if columns.winograd and _winograd.applies(x, w, out, stride, pad, ws):   # stride-1 3x3: no im2col
        return _winograd.conv3x3_forward(out, x, w, ws)
    Cout, Cin, kh, kw = w.shape
    N = x.shape[1]
    Ho, Wo = out.shape[2:]
    w2 = w.reshape(Cout, -1)
    if _is_pointwise(w, stride, pad) and x.flags.c_contiguous:
        x2, o2 = _flat(x, Cin), _flat(out, Cout)
        M = x2.shape[1]
        if xp is numpy and M < 2 * gemm_grain(Cout * Cin) and Cout * Cin * M >= 2 * GEMM_WORK:
            # too few columns to split (DenseNet's 1x1 convs on 2x2 planes): split the output channels
            threads.parallel_for(lambda r0, r1: xp.matmul(w2[r0:r1], x2, out=o2[r0:r1]), Cout,
                                 grain=max(1, -(-GEMM_WORK // (Cin * M))))
            return
        over_columns(M, lambda m0, m1: xp.matmul(w2, x2[:, m0:m1], out=o2[:, m0:m1]), x2, Cout * Cin)
        return
    K = Cin * kh * kw

    def samples(a, b, wsp):
        nc = chunk_size(wsp, K * Ho * Wo, b - a)
        for n0 in range(a, b, nc):
            n1 = min(b, n0 + nc)
            cols = wsp[:K * (n1 - n0) * Ho * Wo].reshape(Cin, kh, kw, n1 - n0, Ho, Wo)
            columns.im2col(cols, x[:, n0:n1], kh, kw, stride, pad)
            xp.matmul(w2, cols.reshape(K, -1), out=_flat(out[:, n0:n1], Cout))
    over_batch(N, ws, K * Ho * Wo, samples)


def conv2d_backward_input(dx, dout, w, stride, pad, ws, accumulate=False, columns=None):
    """dx (Cin, N, H, W) = (or += with accumulate) conv's input gradient from dout (Cout, N, Ho, Wo).

    # saved: nothing but the weights (exact)."""
    xp = array_module(dx)
    columns = columns or columns_for(xp)
    if columns.winograd and _winograd.applies(dout, w, dx, stride, pad, ws):
        return _winograd.conv3x3_backward_input(dx, dout, w, ws, accumulate)
    Cout, Cin, kh, kw = w.shape
    N = dx.shape[1]
    Ho, Wo = dout.shape[2:]
    w2t = w.reshape(Cout, -1).T
    if _is_pointwise(w, stride, pad) and not accumulate:
        g2, d2 = _flat(dout, Cout), _flat(dx, Cin)
        over_columns(g2.shape[1], lambda m0, m1: xp.matmul(w2t, g2[:, m0:m1], out=d2[:, m0:m1]), g2, Cout * Cin)
        return
    K = Cin * kh * kw

    def samples(a, b, wsp):
        if not accumulate:
            dx[:, a:b].fill(0)
        nc = chunk_size(wsp, K * Ho * Wo, b - a)
        for n0 in range(a, b, nc):
            n1 = min(b, n0 + nc)
            cols = wsp[:K * (n1 - n0) * Ho * Wo].reshape(Cin, kh, kw, n1 - n0, Ho, Wo)
            xp.matmul(w2t, _flat(dout[:, n0:n1], Cout), out=cols.reshape(K, -1))
            columns.col2im(dx, n0, n1, cols, kh, kw, stride, pad)
    over_batch(N, ws, K * Ho * Wo, samples)


SIDE_BY_SIDE = True     # off: conv2d_backward runs the two gradients one after the other (benchmarks/conv_paths.py)


def conv2d_backward(dw, dx, x, dout, w, stride, pad, ws, accumulate=False, columns=None):
    """Both gradients of a conv: dw += the weight gradient, dx (+)= the input gradient. x may be
    dx itself (where the engine rebuilds a unit's output in the buffer dx then takes): x is read
    before dx is written. Where neither gradient would split between the threads (a conv on
    small planes), the two run side by side, one per thread (winograd.conv3x3_backward_both);
    a 1x1 conv on few columns splits both by input channels (_pointwise_backward_both); else
    one after the other, conv2d_backward_weight then conv2d_backward_input. The results are
    theirs, bit for bit; except that where a 1x1 conv's columns would have split, its weight
    gradient is summed over the columns in one piece, as on one thread, not in per-range parts
    (the last bits may differ from the two calls' on several threads, as between thread counts)."""
    xp = array_module(dw)
    columns = columns or columns_for(xp)
    if SIDE_BY_SIDE and xp is numpy and threads.threads() > 1:
        if columns.winograd and _winograd.applies(x, dw, dout, stride, pad, ws, weight=True) and \
                _winograd.applies(dout, w, dx, stride, pad, ws):
            if _winograd.conv3x3_backward_both(dw, dx, x, dout, w, ws, accumulate):
                return
        elif _pointwise_backward_both(dw, dx, x, dout, w, stride, pad, accumulate):
            return
    conv2d_backward_weight(dw, x, dout, stride, pad, ws, columns)
    conv2d_backward_input(dx, dout, w, stride, pad, ws, accumulate, columns)


ROW_COLUMNS = 256       # GEMM columns a thread would get, below which a 1x1 conv's two gradients split by rows


def _pointwise_backward_both(dw, dx, x, dout, w, stride, pad, accumulate):
    """A 1x1 conv's two gradient GEMMs on few columns (under ROW_COLUMNS a thread, or too few
    to split at all: DenseNet's 1x1 convs on 4x4 and 2x2 planes) split by input channels, each
    thread its rows of both: dw[:, rows] += dout @ x[rows]^T, then dx[rows] = w[:, rows]^T @ dout,
    one hand-over for both, every GEMM as wide as the batch. A thread reads its rows of x before
    it writes those of dx, so x may be dx itself. Where the columns are wide enough to split (or
    the work is under chunks.GEMM_WORK a thread, or dx is accumulated, or shares memory with dout,
    or with x other than as x itself) returns False, doing nothing."""
    if not (_is_pointwise(w, stride, pad) and not accumulate and x.flags.c_contiguous and dx.flags.c_contiguous):
        return False
    Cout, Cin = w.shape[:2]
    M = x.size // Cin
    narrow = M < threads.threads() * ROW_COLUMNS or M < 2 * gemm_grain(Cout * Cin)
    if not narrow or Cout * Cin * M < 2 * GEMM_WORK or numpy.may_share_memory(dx, dout):
        return False
    if numpy.may_share_memory(dx, x) and not (dx.ctypes.data == x.ctypes.data and dx.shape == x.shape):
        return False
    x2, g2, d2, dw2 = _flat(x, Cin), _flat(dout, Cout), _flat(dx, Cin), dw.reshape(Cout, Cin)
    w2t = w.reshape(Cout, Cin).T

    def rows(c0, c1):
        dw2[:, c0:c1] += weight_term(numpy, g2, x2[c0:c1])
        numpy.matmul(w2t[c0:c1], g2, out=d2[c0:c1])
    threads.parallel_for(rows, Cin, grain=max(1, -(-GEMM_WORK // (Cout * M))))
    return True


FLIP_COLUMNS = 2048      # GEMM columns from which a weight gradient's GEMM may run flipped (weight_term)


def weight_term(xp, g, c):
    """A weight gradient's GEMM, g (Cout, M) @ c (K, M).T, as a (Cout, K) array. On NumPy where
    K > Cout and M >= FLIP_COLUMNS it runs as (c @ g.T).T, its larger side as the GEMM's rows,
    the orientation OpenBLAS runs faster there (benchmarks/conv_paths.py's im2col-unflipped path
    against im2col; figures in docs/performance.md). The result is then a transposed view, which
    the caller adds into dw across its layout, a cost the flip does not repay on narrow GEMMs:
    only wide ones flip. The sums differ from g @ c.T's in the last bits only (BLAS adds the M
    terms in another order)."""
    a, b, flipped = weight_operands(xp, g, c)
    t = xp.matmul(a, b)
    return t.T if flipped else t


def weight_operands(xp, g, c):
    """(a, b, flipped): the matmul a @ b weight_term runs for g @ c.T (flipped: a @ b is its transpose)."""
    if xp is numpy and c.shape[0] > g.shape[0] and g.shape[1] >= FLIP_COLUMNS:
        return c, g.T, True
    return g, c.T, False


def conv2d_backward_weight(dw, x, dout, stride, pad, ws, columns=None):
    """dw (Cout, Cin, kh, kw) += dout (Cout, N, Ho, Wo) correlated with x (Cin, N, H, W).

    # saved: the conv input x (exact, or decoded from a K-bit code by the caller).
    Allocates one weight-sized temporary per chunk, plus one per thread (never activation-sized)."""
    xp = array_module(dw)
    columns = columns or columns_for(xp)
    if columns.winograd and _winograd.applies(x, dw, dout, stride, pad, ws, weight=True):
        return _winograd.conv3x3_backward_weight(dw, x, dout, ws)
    Cout, Cin, kh, kw = dw.shape
    N = x.shape[1]
    Ho, Wo = dout.shape[2:]
    dw2 = dw.reshape(Cout, -1)
    parts = {}                                             # range start -> its partial sum

    def add(partial, term):
        if partial is None:
            return term
        partial += term
        return partial

    if _is_pointwise(dw, stride, pad) and x.flags.c_contiguous:
        x2, g2 = _flat(x, Cin), _flat(dout, Cout)

        def columns(m0, m1):
            parts[m0] = weight_term(xp, g2[:, m0:m1], x2[:, m0:m1])
        over_columns(x2.shape[1], columns, x2, Cout * Cin)
    else:
        K = Cin * kh * kw

        def samples(a, b, wsp):
            acc = None
            nc = chunk_size(wsp, K * Ho * Wo, b - a)
            for n0 in range(a, b, nc):
                n1 = min(b, n0 + nc)
                cols = wsp[:K * (n1 - n0) * Ho * Wo].reshape(Cin, kh, kw, n1 - n0, Ho, Wo)
                columns.im2col(cols, x[:, n0:n1], kh, kw, stride, pad)
                acc = add(acc, weight_term(xp, _flat(dout[:, n0:n1], Cout), cols.reshape(K, -1)))
            parts[a] = acc
        over_batch(N, ws, K * Ho * Wo, samples)
    for start in sorted(parts):                            # a fixed order: deterministic for a given T
        dw2 += parts[start]
