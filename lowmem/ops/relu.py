"""ReLU and ReLU6 / clip on their own (not after a batch norm), each keeping a packed code.

Dimensions: n elements (any shape: (C, N, H, W) activations, taken flat).
Layout: x, out, dout, dx C-contiguous, all of one shape; codes packed as ops/bitpack.py says.

    relu:  out = max(x, 0);  dx = dout * [x > 0]
    clip:  out = min(max(x, lo), hi);  dx = dout * [lo < x < hi]      (ReLU6: lo = 0, hi = 6)

The derivative at a kink is 0 (PyTorch's rule: relu's backward passes where the output is
> 0, hardtanh's where min < x < max), so what backward needs is exact and small:
  * ReLU keeps a 1-bit mask, [x > 0]: n/8 bytes;
  * clip keeps a 2-bit region code per element, 0 below (x <= lo), 1 inside (lo < x < hi),
    2 above (x >= hi): n/4 bytes. Its derivative needs only "inside or not"; the third value
    says which side a clipped element left by, for a caller that wants it.
Both forwards may run in place (out aliases x): the code is taken from each block of x before
the block is overwritten. Temporaries: one block (ops/bitpack.py BLOCK) of masks / codes.
These are the references; ops/codes.py names their one-pass twins (numba, CUDA).
"""
from ..system.backend import array_module
from . import bitpack
from .bitpack import check_packed, flat, pack_block, unpack_block

import numpy

BELOW, INSIDE, ABOVE = 0, 1, 2          # clip's region codes


def scratch_bytes(n, itemsize, block=None):
    """A bound on what one relu_* or clip_* call on n elements allocates beyond its arguments:
    per block of m = min(n, BLOCK) elements, masks and codes (a few bytes per element), NumPy's
    cast buffers for the uint8-by-float products and, with accumulate, one product of the block
    (measured in tests/ops/test_ops_graph.py): m * (4 + 2 * itemsize), whatever n is."""
    m = bitpack.BLOCK if block is None else block
    m = m if n is None else min(int(n), m)          # n None: any n (the bound of a full block)
    return (m + 7) // 8 * 8 * (4 + 2 * int(itemsize))


def relu_forward(out, mask, x, block=None):
    """out = max(x, 0) (same shape as x, may alias it); mask (ceil(n/8),) uint8 <- [x > 0], 1 bit each."""
    xp = array_module(out)
    o, s = flat(out, "out"), flat(x, "x")
    check_packed(mask, s.size, 1, "mask")
    for a, b in bitpack.blocks(s.size, block):
        pack_block(mask[a // 8:(b + 7) // 8], xp.greater(s[a:b], 0).view(numpy.uint8), 1)
        xp.maximum(s[a:b], 0, out=o[a:b])


def relu_backward(dx, dout, mask, accumulate=False, block=None):
    """dx = (or += with accumulate) dout * [x > 0]. dx may alias dout (without accumulate).

    # saved: mask, the 1-bit [x > 0] of the forward's input (exact)."""
    xp = array_module(dout)
    d, g = flat(dx, "dx"), flat(dout, "dout")
    check_packed(mask, g.size, 1, "mask")
    codes = xp.empty(min(g.size, bitpack.BLOCK if block is None else block), numpy.uint8)
    for a, b in bitpack.blocks(g.size, block):
        keep = codes[:b - a]
        unpack_block(keep, mask[a // 8:(b + 7) // 8], 1)
        if accumulate:
            d[a:b] += xp.multiply(g[a:b], keep)      # bounded temporary (one block)
        else:
            xp.multiply(g[a:b], keep, out=d[a:b])


def _check_range(lo, hi):
    if not lo < hi:
        raise ValueError(f"clip needs lo < hi, got lo={lo!r}, hi={hi!r}")


def clip_forward(out, code, x, lo=0.0, hi=6.0, block=None):
    """out = min(max(x, lo), hi) (may alias x); code (ceil(n/4),) uint8 <- the 2-bit region of
    each element: 0 below (x <= lo), 1 inside (lo < x < hi), 2 above (x >= hi)."""
    _check_range(lo, hi)
    xp = array_module(out)
    o, s = flat(out, "out"), flat(x, "x")
    check_packed(code, s.size, 2, "code")
    for a, b in bitpack.blocks(s.size, block):
        region = xp.greater(s[a:b], lo).view(numpy.uint8)        # 1 above lo
        region += xp.greater_equal(s[a:b], hi).view(numpy.uint8)   # 2 at or above hi
        pack_block(code[a // 4:(b + 3) // 4], region, 2)
        xp.clip(s[a:b], lo, hi, out=o[a:b])


def clip_backward(dx, dout, code, accumulate=False, block=None):
    """dx = (or += with accumulate) dout * [lo < x < hi]. dx may alias dout (without accumulate).

    # saved: code, the 2-bit region of the forward's input (exact)."""
    xp = array_module(dout)
    d, g = flat(dx, "dx"), flat(dout, "dout")
    check_packed(code, g.size, 2, "code")
    codes = xp.empty(min(g.size, bitpack.BLOCK if block is None else block), numpy.uint8)
    for a, b in bitpack.blocks(g.size, block):
        unpack_block(codes[:b - a], code[a // 4:(b + 3) // 4], 2)
        inside = xp.equal(codes[:b - a], INSIDE)
        if accumulate:
            d[a:b] += xp.multiply(g[a:b], inside)
        else:
            xp.multiply(g[a:b], inside, out=d[a:b])


def relu6_forward(out, code, x, block=None):
    """ReLU6: clip_forward with lo = 0, hi = 6."""
    clip_forward(out, code, x, 0.0, 6.0, block)


relu6_backward = clip_backward        # the region code is all it reads
