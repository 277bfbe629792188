"""Dropout with inverted scaling; its 1-bit keep mask drawn from a counter stream.

Dimensions: n elements (any shape: (C, N, H, W) or (K, N) activations, taken flat).
Layout: x, out, dout, dx C-contiguous, all of one shape; the mask packed 1 bit per element
(ops/bitpack.py: element 8*i + j in bit j of byte i), ceil(n/8) bytes.

    keep_i = [u_i >= p],   out = x * keep / (1 - p),   dx = dout * keep / (1 - p)

u_i is a counter-based draw, not a generator's state: h_i = mix64(mix64(key) + (i+1)*φ)
(SplitMix64, Steele, Lea & Flood 2014, the stream units/window.py draws stochastic rounding
from), u_i = (h_i >> 40) / 2**24. The key mixes (seed, step, layer, rank) (`stream_key`), so
element i of one layer in one step draws the same bit whatever the block size, the thread count
or the kernel path, after a resume, and each data-parallel rank its own bits. P(keep) is
1 - round(p*2**24)/2**24, exact to 6e-8 of 1 - p.
Temporaries: one block (ops/bitpack.py BLOCK) of uint64 counters and a mask.
These are the references; ops/codes.py names their one-pass twins (numba, CUDA).
"""
import numbers

import numpy

from ..system.backend import array_module
from ..system.splitmix import GOLDEN, MASK64, mix64, mix64_array, mix_parts
from . import bitpack
from .bitpack import check_packed, flat, pack_block, unpack_block

DRAW_BITS = 24                  # u has 24 random bits


def scratch_bytes(n, itemsize, block=None):
    """A bound on what one dropout_* call on n elements allocates beyond its arguments: per block
    of m = min(n, BLOCK) elements, two uint64 counters arrays (16 bytes an element), the keep mask,
    its packing and, backward with accumulate, one product of the block (measured in
    tests/ops/test_ops_graph.py): m * (19 + itemsize), whatever n is."""
    m = bitpack.BLOCK if block is None else block
    m = m if n is None else min(int(n), m)          # n None: any n (the bound of a full block)
    return (m + 7) // 8 * 8 * (19 + int(itemsize))


def stream_key(seed, step, layer, rank=0):
    """The key of one dropout layer's mask in one training step: a uint64 (Python int) mixing
    the run's seed, the step, the layer's index and the data-parallel rank (non-negative ints),
    built as units/window.py's stream_key builds a unit's."""
    parts = (("seed", seed), ("step", step), ("layer", layer), ("rank", rank))
    for what, part in parts:
        if not isinstance(part, numbers.Integral) or isinstance(part, bool) or not 0 <= int(part) <= MASK64:
            raise ValueError(f"dropout stream_key: {what} must be an integer in [0, 2**64), got {part!r}")
    return mix_parts([part for _, part in parts])


def check_p(p):
    """p as a float in [0, 1); ValueError otherwise (p = 1 would drop everything: scale 1/0)."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 <= float(p) < 1:
        raise ValueError(f"dropout probability must be a number in [0, 1), got {p!r}")
    return float(p)


def _keep_block(xp, base, threshold, a, b):
    """bool (b-a,): keep_i for elements a .. b-1 of the stream starting at `base`."""
    z = xp.arange(a + 1, b + 1, dtype=numpy.uint64)
    z *= numpy.uint64(GOLDEN)
    z += numpy.uint64(base)
    mix64_array(z, xp.empty_like(z))
    z >>= numpy.uint64(64 - DRAW_BITS)
    return z >= numpy.uint64(threshold)


def dropout_mask(mask, n, p, key, block=None, xp=numpy):
    """mask (ceil(n/8),) uint8 <- the packed keep bits of n elements for probability p and key."""
    p = check_p(p)
    check_packed(mask, n, 1, "mask")
    base, threshold = mix64(int(key)), round(p * (1 << DRAW_BITS))
    for a, b in bitpack.blocks(n, block):
        pack_block(mask[a // 8:(b + 7) // 8], _keep_block(xp, base, threshold, a, b).view(numpy.uint8), 1)


def dropout_forward(out, mask, x, p, key, block=None):
    """out = x * keep / (1 - p) (may alias x); mask (ceil(n/8),) uint8 <- keep, drawn from `key`
    (stream_key(seed, step, layer, rank)). p = 0 keeps everything (out = x)."""
    p = check_p(p)
    xp = array_module(out)
    o, s = flat(out, "out"), flat(x, "x")
    check_packed(mask, s.size, 1, "mask")
    base, threshold, scale = mix64(int(key)), round(p * (1 << DRAW_BITS)), 1 / (1 - p)
    for a, b in bitpack.blocks(s.size, block):
        keep = _keep_block(xp, base, threshold, a, b)
        pack_block(mask[a // 8:(b + 7) // 8], keep.view(numpy.uint8), 1)
        xp.multiply(s[a:b], keep, out=o[a:b])
        o[a:b] *= scale


def dropout_backward(dx, dout, mask, p, accumulate=False, block=None):
    """dx = (or += with accumulate) dout * keep / (1 - p). dx may alias dout (without accumulate).

    # saved: mask, the 1-bit keep of the forward (exact)."""
    scale = 1 / (1 - check_p(p))
    xp = array_module(dout)
    d, g = flat(dx, "dx"), flat(dout, "dout")
    check_packed(mask, g.size, 1, "mask")
    codes = xp.empty(min(g.size, bitpack.BLOCK if block is None else block), numpy.uint8)
    for a, b in bitpack.blocks(g.size, block):
        keep = codes[:b - a]
        unpack_block(keep, mask[a // 8:(b + 7) // 8], 1)
        if accumulate:
            t = xp.multiply(g[a:b], keep)            # bounded temporary (one block)
            t *= scale
            d[a:b] += t
        else:
            xp.multiply(g[a:b], keep, out=d[a:b])
            d[a:b] *= scale
