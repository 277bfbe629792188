"""Fully connected layers: the classifier head, and flatten + linear inside the network.

Dimensions: N batch, C in features (channels), K out features; H, W the input's plane,
F = C*H*W flattened features.
Layout: the head: x (N, C), w (K, C) as PyTorch's nn.Linear, b (K,), out (N, K).
Inside the network (flatten_linear_*), activations stay channels-major: x (C, N, H, W) and
out (K, N) (a (K, N, 1, 1) activation, what a ReLU, dropout or the head reads next);
w (K, F) is nn.Linear's weight on torch.flatten(x, 1), features in (c, h, w) order.

flatten + linear is a convolution whose kernel covers the whole H x W plane: w viewed as
(K, C, H, W), stride 1, no padding, one output pixel. So it runs on ops/conv.py (im2col +
one GEMM, chunked over the batch by the workspace `ws`, F elements per sample; none when
H = W = 1 and x is contiguous: then it is the GEMM w @ x (C, N)).
"""
from ..system.backend import array_module
from .conv import conv2d_backward_input, conv2d_backward_weight, conv2d_forward


def linear_forward(out, x, w, b):
    """out (N, K) = x @ w.T + b."""
    xp = array_module(out)
    xp.matmul(x, w.T, out=out)
    out += b


def linear_backward(dx, dw, db, dout, x, w):
    """dx (N, C) = dout @ w;  dw += dout.T @ x;  db += sum_n dout.

    # saved: x, the FC input (N, C), exact (it is tiny)."""
    xp = array_module(dout)
    dw += dout.T @ x
    db += dout.sum(axis=0)
    if dx is not None:
        xp.matmul(dout, w, out=dx)


def _as_conv(out, x, w, where, ws, accumulate=False):
    C, N, H, W = x.shape
    K = w.shape[0]
    if ws is None and not (H == W == 1 and x.flags.c_contiguous and not accumulate):
        raise ValueError(f"flatten_linear {where}: x {tuple(x.shape)} needs a workspace of at least "
                         f"{C * H * W} elements (ws=None works only for a contiguous (C, N, 1, 1) x)")
    if w.shape != (K, C * H * W) or out.shape[:2] != (K, N) or out.size != K * N:
        raise ValueError(f"flatten_linear {where}: w {tuple(w.shape)} and out {tuple(out.shape)} do not "
                         f"fit x {tuple(x.shape)}: expected w (K, {C * H * W}) and out (K, {N})")
    return out.reshape(K, N, 1, 1), w.reshape(K, C, H, W)


def flatten_linear_workspace(C, H, W):
    """Workspace elements per sample that the flatten_linear functions chunk with (F = C*H*W)."""
    return C * H * W


def flatten_linear_forward(out, x, w, b, ws=None, columns=None):
    """out (K, N) = w (K, F) @ flatten(x (C, N, H, W)) + b (K,), features in (c, h, w) order.

    ws: a workspace of at least F elements (1-D; more samples per GEMM when larger); not needed
    when H = W = 1 and x is contiguous."""
    o4, w4 = _as_conv(out, x, w, "forward", ws)
    conv2d_forward(o4, x, w4, 1, 0, ws, columns)
    if b is not None:
        out += b.reshape((-1,) + (1,) * (out.ndim - 1))    # any view: no copy to lose


def flatten_linear_backward(dx, dw, db, dout, x, w, ws=None, accumulate=False, columns=None):
    """dx (C, N, H, W) = (or += with accumulate) the input gradient; dw (K, F) += dout @ flat(x).T;
    db (K,) += sum_n dout. dx or db may be None (not wanted / no bias).

    # saved: x, the layer's input (C, N, H, W), exact (or decoded by the caller)."""
    d4, w4 = _as_conv(dout, x, w, "backward", ws, accumulate and dx is not None)
    conv2d_backward_weight(dw.reshape(w4.shape), x, d4, 1, 0, ws, columns)
    if db is not None:
        db += dout.sum(axis=tuple(range(1, dout.ndim)))
    if dx is not None:
        conv2d_backward_input(dx, d4, w4, 1, 0, ws, accumulate, columns)
