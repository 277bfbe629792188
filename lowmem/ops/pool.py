"""Pooling: 3x3/2 max-pool (ImageNet stem), k x k average pool, global average pool (head).

Dimensions: C channels, N batch, H, W input, Ho, Wo output.
Layout: x (C, N, H, W); max-pool and k x k average pool out (C, N, Ho, Wo); global
average pool out (N, C).
"""
from ..backend import array_module
from .conv import window_slices


def maxpool_forward(out, argmax, x, k=3, stride=2, pad=1):
    """out (C, N, Ho, Wo) = max over each k x k window of x; argmax (uint8, same shape)
    = index i*k + j of the first maximum in the window (row-major, as PyTorch).

    Temporaries: one bool comparison per window offset, the size of `out`."""
    xp = array_module(out)
    H, W = x.shape[2:]
    Ho, Wo = out.shape[2:]
    out.fill(-xp.inf)
    argmax.fill(0)
    for i, j, oh, ow, ih, iw in window_slices(H, W, Ho, Wo, k, k, stride, pad):
        xv = x[:, :, ih, iw]
        ov, av = out[:, :, oh, ow], argmax[:, :, oh, ow]
        better = xv > ov                     # strict: the first maximum wins ties
        xp.copyto(ov, xv, where=better)
        xp.copyto(av, i * k + j, where=better)


def maxpool_backward(dx, dout, argmax, k=3, stride=2, pad=1):
    """dx (C, N, H, W) = scatter of dout (C, N, Ho, Wo) to each window's argmax.

    # saved: argmax (exact window index per output)."""
    xp = array_module(dx)
    H, W = dx.shape[2:]
    Ho, Wo = dout.shape[2:]
    dx.fill(0)
    for i, j, oh, ow, ih, iw in window_slices(H, W, Ho, Wo, k, k, stride, pad):
        hit = argmax[:, :, oh, ow] == i * k + j
        dx[:, :, ih, iw] += xp.where(hit, dout[:, :, oh, ow], 0)


def avgpool_forward(out, x):
    """out (N, C) = mean of x (C, N, H, W) over H, W."""
    xp = array_module(out)
    xp.mean(x, axis=(2, 3), out=out.T)


def avgpool_backward(dx, dout):
    """dx (C, N, H, W) = dout (N, C) / (H*W), broadcast over H, W.

    # saved: nothing."""
    xp = array_module(dx)
    H, W = dx.shape[2:]
    xp.multiply(dout.T[:, :, None, None], 1.0 / (H * W), out=dx)


def avgpool2d_forward(out, x, k, stride, pad):
    """out (C, N, Ho, Wo) = mean of x (C, N, H, W) over each k x k window; zero padding
    counts in the mean (divide by k*k everywhere, as PyTorch's count_include_pad=True)."""
    H, W = x.shape[2:]
    Ho, Wo = out.shape[2:]
    out.fill(0)
    for i, j, oh, ow, ih, iw in window_slices(H, W, Ho, Wo, k, k, stride, pad):
        out[:, :, oh, ow] += x[:, :, ih, iw]
    out *= 1.0 / (k * k)


def avgpool2d_backward(dx, dout, k, stride, pad):
    """dx (C, N, H, W) = each dout (C, N, Ho, Wo) / (k*k), spread over its window.

    # saved: nothing (the backward needs only the shapes)."""
    H, W = dx.shape[2:]
    Ho, Wo = dout.shape[2:]
    dx.fill(0)
    for i, j, oh, ow, ih, iw in window_slices(H, W, Ho, Wo, k, k, stride, pad):
        dx[:, :, ih, iw] += dout[:, :, oh, ow]          # in place: no temporary
    dx *= 1.0 / (k * k)
