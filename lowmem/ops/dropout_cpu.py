"""Dropout with its mask drawn and packed in the op's own pass: numba (optional: lowmem[fast]), the
CPU twin of ops/dropout.py (the reference) and ops/dropout_gpu.py.

    dropout_forward(out, mask, x, p, key)               out = x * keep / (1 - p); mask <- keep
    dropout_backward(dx, dout, mask, p, accumulate)     dx = (or +=) dout * keep / (1 - p)

keep_i is the reference's draw, the counter stream's bits (h_i >> 40) >= round(p * 2**24) with
h_i = mix64(mix64(key) + (i + 1)*phi) in uint64, so the masks are the same bytes; the products
are the reference's, (x * keep) * (1 - p)**-1 in x's dtype, so outputs and gradients are the
same bits (tests/ops/test_dropout_cpu.py). Per block of BLOCK elements (ops/bitpack_cpu.py)
one loop draws, writes the output and one keep per byte into an L1 scratch, then the packer's
loop packs it. float32 and float64; out may be x itself and dx dout itself (without accumulate).
"""
import numpy

from . import dropout as reference
from .bitpack import check_packed, flat
from .bitpack_cpu import AVAILABLE, BLOCK, over_blocks, same_or_apart, supports
from ..system.splitmix import GOLDEN, MIX1, MIX2, mix64

if AVAILABLE:
    from numba import njit
    from .bitpack_cpu import pack_any, unpack_any
    _opts = dict(cache=True, nogil=True)
    U64 = numpy.uint64
    _GOLDEN, _MIX1, _MIX2 = U64(GOLDEN), U64(MIX1), U64(MIX2)
    _S30, _S27, _S31, _SDRAW = U64(30), U64(27), U64(31), U64(64 - reference.DRAW_BITS)

    @njit(**_opts)
    def _keep(c, base, threshold, i0):
        """c[t] <- keep of element i0 + t: mix64(base + (i0 + t + 1)*phi) >> 40 >= threshold."""
        for t in range(c.size):
            z = base + U64(i0 + t + 1) * _GOLDEN
            z = (z ^ (z >> _S30)) * _MIX1
            z = (z ^ (z >> _S27)) * _MIX2
            z = z ^ (z >> _S31)
            c[t] = (z >> _SDRAW) >= threshold

    @njit(**_opts)
    def _scaled(o, s, c, scale, one):
        """o = (s * keep) * scale."""
        nil = one - one
        for t in range(s.size):
            o[t] = (s[t] * (one if c[t] else nil)) * scale

    @njit(**_opts)
    def _scaled_inplace(s, c, scale, one):
        """s = (s * keep) * scale, through one pointer (see ops/bitpack_cpu.same_or_apart)."""
        nil = one - one
        for t in range(s.size):
            s[t] = (s[t] * (one if c[t] else nil)) * scale

    @njit(**_opts)
    def _scaled_add(d, g, c, scale, one):
        nil = one - one
        for t in range(g.size):
            d[t] += (g[t] * (one if c[t] else nil)) * scale

    @njit(**_opts)
    def _forward(out, mask, x, base, threshold, scale, one, a, b, inplace):
        cb = numpy.empty(BLOCK, numpy.uint8)
        for i0 in range(a, b, BLOCK):
            i1 = min(b, i0 + BLOCK)
            c = cb[:i1 - i0]
            _keep(c, base, threshold, i0)
            if inplace:
                _scaled_inplace(x[i0:i1], c, scale, one)
            else:
                _scaled(out[i0:i1], x[i0:i1], c, scale, one)
            pack_any(mask[i0 // 8:(i1 + 7) // 8], c, 1)

    @njit(**_opts)
    def _backward(dx, dout, mask, scale, one, a, b, accumulate, inplace):
        cb = numpy.empty(BLOCK, numpy.uint8)
        for i0 in range(a, b, BLOCK):
            i1 = min(b, i0 + BLOCK)
            c = cb[:i1 - i0]
            unpack_any(c, mask[i0 // 8:(i1 + 7) // 8], 1)
            if accumulate:
                _scaled_add(dx[i0:i1], dout[i0:i1], c, scale, one)
            elif inplace:
                _scaled_inplace(dout[i0:i1], c, scale, one)
            else:
                _scaled(dx[i0:i1], dout[i0:i1], c, scale, one)


def dropout_forward(out, mask, x, p, key):
    """ops.dropout.dropout_forward in one pass: out = x * keep / (1 - p) (may be x); mask <- keep."""
    p = reference.check_p(p)
    if not supports(out, x):
        return reference.dropout_forward(out, mask, x, p, key)
    o, s = flat(out, "out"), flat(x, "x")
    check_packed(mask, s.size, 1, "mask")
    inplace, dt = same_or_apart(o, s), s.dtype.type
    base, threshold = U64(mix64(int(key))), U64(round(p * (1 << reference.DRAW_BITS)))
    scale, one = dt(1 / (1 - p)), dt(1)
    over_blocks(lambda a, b: _forward(o, mask, s, base, threshold, scale, one, a, b, inplace), s.size)


def dropout_backward(dx, dout, mask, p, accumulate=False):
    """ops.dropout.dropout_backward in one pass: dx = (or +=) dout * keep / (1 - p).

    # saved: mask, the 1-bit keep of the forward (exact)."""
    p = reference.check_p(p)
    if not supports(dx, dout):
        return reference.dropout_backward(dx, dout, mask, p, accumulate)
    d, g = flat(dx, "dx"), flat(dout, "dout")
    check_packed(mask, g.size, 1, "mask")
    inplace, dt = same_or_apart(d, g), g.dtype.type
    if inplace and accumulate:
        raise ValueError("dx may be dout only without accumulate")
    scale, one = dt(1 / (1 - p)), dt(1)
    over_blocks(lambda a, b: _backward(d, g, mask, scale, one, a, b, accumulate, inplace), g.size)
