"""2-D convolution (no bias) as im2col + one GEMM, chunked over the batch.

Dimensions:  Cin, Cout channels;  N batch;  H, W input;  Ho, Wo output;
             kh, kw kernel;  K = Cin*kh*kw  (GEMM inner size).
Layout: x (Cin, N, H, W), w (Cout, Cin, kh, kw), out (Cout, N, Ho, Wo).

The only scratch memory is `ws`, a 1-D workspace handed in from the memory
plan. im2col columns for `nc` samples take K*nc*Ho*Wo elements, so the batch
is processed in chunks of nc = ws.size // (K*Ho*Wo) samples: the workspace
bounds memory, whatever N is. A 1x1/stride-1/pad-0 conv on a contiguous
input needs no columns at all: it is the GEMM w(Cout, Cin) @ x(Cin, N*H*W).
"""
from ..backend import array_module


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


def _chunk(ws, per_sample, n):
    nc = min(n, ws.size // per_sample)
    if nc < 1:
        raise ValueError(f"conv workspace too small: {ws.size} elements, one sample needs {per_sample}")
    return nc


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


def conv2d_forward(out, x, w, stride, pad, ws):
    """out (Cout, N, Ho, Wo) = conv(x (Cin, N, H, W), w (Cout, Cin, kh, kw)).

    x may be a strided view (e.g. the caller's NCHW batch transposed)."""
    xp = array_module(out)
    Cout, Cin, kh, kw = w.shape
    N = x.shape[1]
    Ho, Wo = out.shape[2:]
    w2 = w.reshape(Cout, -1)
    if _is_pointwise(w, stride, pad) and x.flags.c_contiguous:
        xp.matmul(w2, _flat(x, Cin), out=_flat(out, Cout))
        return
    K = Cin * kh * kw
    nc = _chunk(ws, K * Ho * Wo, N)
    for n0 in range(0, N, nc):
        n1 = min(N, n0 + nc)
        cols = ws[:K * (n1 - n0) * Ho * Wo].reshape(Cin, kh, kw, n1 - n0, Ho, Wo)
        im2col(cols, x[:, n0:n1], kh, kw, stride, pad)
        xp.matmul(w2, cols.reshape(K, -1), out=_flat(out[:, n0:n1], Cout))


def conv2d_backward_input(dx, dout, w, stride, pad, ws, accumulate=False):
    """dx (Cin, N, H, W) = (or += with accumulate) conv's input gradient from dout (Cout, N, Ho, Wo).

    # saved: nothing but the weights (exact)."""
    xp = array_module(dx)
    Cout, Cin, kh, kw = w.shape
    N = dx.shape[1]
    Ho, Wo = dout.shape[2:]
    w2t = w.reshape(Cout, -1).T
    if _is_pointwise(w, stride, pad) and not accumulate:
        xp.matmul(w2t, _flat(dout, Cout), out=_flat(dx, Cin))
        return
    if not accumulate:
        dx.fill(0)
    K = Cin * kh * kw
    nc = _chunk(ws, K * Ho * Wo, N)
    for n0 in range(0, N, nc):
        n1 = min(N, n0 + nc)
        cols = ws[:K * (n1 - n0) * Ho * Wo].reshape(Cin, kh, kw, n1 - n0, Ho, Wo)
        xp.matmul(w2t, _flat(dout[:, n0:n1], Cout), out=cols.reshape(K, -1))
        col2im_add(dx[:, n0:n1], cols, kh, kw, stride, pad)


def conv2d_backward_weight(dw, x, dout, stride, pad, ws):
    """dw (Cout, Cin, kh, kw) += dout (Cout, N, Ho, Wo) correlated with x (Cin, N, H, W).

    # saved: the conv input x (exact, or decoded from a K-bit code by the caller).
    Allocates one weight-sized temporary per chunk (never activation-sized)."""
    xp = array_module(dw)
    Cout, Cin, kh, kw = dw.shape
    N = x.shape[1]
    Ho, Wo = dout.shape[2:]
    dw2 = dw.reshape(Cout, -1)
    if _is_pointwise(dw, stride, pad) and x.flags.c_contiguous:
        dw2 += xp.matmul(_flat(dout, Cout), _flat(x, Cin).T)
        return
    K = Cin * kh * kw
    nc = _chunk(ws, K * Ho * Wo, N)
    for n0 in range(0, N, nc):
        n1 = min(N, n0 + nc)
        cols = ws[:K * (n1 - n0) * Ho * Wo].reshape(Cin, kh, kw, n1 - n0, Ho, Wo)
        im2col(cols, x[:, n0:n1], kh, kw, stride, pad)
        dw2 += xp.matmul(_flat(dout[:, n0:n1], Cout), cols.reshape(K, -1).T)
