"""Pooling: 3x3/2 max-pool (ImageNet stem), k x k average pool, global average pool (head).

Dimensions: C channels, N batch, H, W input, Ho, Wo output.
Layout: x (C, N, H, W); max-pool and k x k average pool out (C, N, Ho, Wo); global
average pool out (N, C).
The max-pool here is the reference; ops/codes.py names its one-pass twins (numba, CUDA), which
write and read the packed 4-bit index directly.
"""
from ..system.backend import array_module
from .conv import window_slices


POOL_BLOCK = 1 << 12    # output elements per block: bounds the max-pool's scratch (tests vary it)


def scratch_bytes(itemsize, plane=1, block=None):
    """A bound on what one max-pool call allocates, for output planes of `plane` = Ho*Wo
    elements: a bool mask and (backward) a masked copy of one block of b = max(block, plane)
    output elements, plus NumPy's own buffers for ufuncs on these strided views (up to three
    operands of b elements; measured in tests/ops/test_ops.py)."""
    b = max(POOL_BLOCK if block is None else block, plane)
    return b * (2 + 4 * itemsize)


def _blocks(C, N, plane, block):
    """(channels, samples) slices tiling the output, each at most max(block, plane) elements:
    whole channels when they fit, else samples of one channel. Never part of a plane, so every
    input gradient sums its windows in the same order whatever the blocking (bit for bit)."""
    if N * plane <= block:
        cb = block // (N * plane)
        for c in range(0, C, cb):
            yield slice(c, min(c + cb, C)), slice(0, N)
    else:
        nb = max(1, block // plane)
        for c in range(C):
            for n in range(0, N, nb):
                yield slice(c, c + 1), slice(n, min(n + nb, N))


def maxpool_forward(out, argmax, x, k=3, stride=2, pad=1, block=POOL_BLOCK):
    """out (C, N, Ho, Wo) = max over each k x k window of x; argmax (uint8, same shape)
    = index i*k + j of the first maximum in the window (row-major, as PyTorch).

    Works through the output in blocks of whole planes (`block` elements, or one plane if
    larger), so the scratch is bounded whatever the batch: one bool mask of a block, reused
    for every window offset (scratch_bytes); nothing the size of `out`."""
    xp = array_module(out)
    C, N, H, W = x.shape
    Ho, Wo = out.shape[2:]
    flat_mask = xp.empty(min(out.size, max(block, Ho * Wo)), bool)   # allocated once, reused
    for cs, ns in _blocks(C, N, Ho * Wo, block):
        ob, ab, xb = out[cs, ns], argmax[cs, ns], x[cs, ns]
        ob.fill(-xp.inf)
        ab.fill(0)
        mask = flat_mask[:ob.size].reshape(ob.shape)
        for i, j, oh, ow, ih, iw in window_slices(H, W, Ho, Wo, k, k, stride, pad):
            ov, xv = ob[:, :, oh, ow], xb[:, :, ih, iw]
            better = mask[:, :, :ov.shape[2], :ov.shape[3]]
            xp.greater(xv, ov, out=better)           # strict: the first maximum wins ties
            xp.copyto(ov, xv, where=better)
            xp.copyto(ab[:, :, oh, ow], i * k + j, where=better)


def maxpool_backward(dx, dout, argmax, k=3, stride=2, pad=1, block=POOL_BLOCK):
    """dx (C, N, H, W) = scatter of dout (C, N, Ho, Wo) to each window's argmax.

    In blocks as maxpool_forward: a bool mask and a masked copy of dout for one block, reused
    for every window offset (scratch_bytes); nothing the size of dout. Each input gradient
    sums its windows' contributions in window-offset order, whatever the block.

    # saved: argmax (exact window index per output)."""
    xp = array_module(dx)
    C, N, H, W = dx.shape
    Ho, Wo = dout.shape[2:]
    dx.fill(0)
    size = min(dout.size, max(block, Ho * Wo))                      # allocated once, reused
    flat_mask, flat_routed = xp.empty(size, bool), xp.empty(size, dx.dtype)
    for cs, ns in _blocks(C, N, Ho * Wo, block):
        db, ab, dxb = dout[cs, ns], argmax[cs, ns], dx[cs, ns]
        mask, routed = (a[:db.size].reshape(db.shape) for a in (flat_mask, flat_routed))
        for i, j, oh, ow, ih, iw in window_slices(H, W, Ho, Wo, k, k, stride, pad):
            av, dv = ab[:, :, oh, ow], db[:, :, oh, ow]
            hit, part = (a[:, :, :av.shape[2], :av.shape[3]] for a in (mask, routed))
            xp.equal(av, i * k + j, out=hit)
            part.fill(0)
            xp.copyto(part, dv, where=hit)               # dout where this offset was the max
            dxv = dxb[:, :, ih, iw]
            xp.add(dxv, part, out=dxv)                   # windows overlap when stride < k


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
