"""ReLU and ReLU6 / clip with their codes written in the op's own pass: numba (optional:
lowmem[fast]), the CPU twin of ops/relu.py (the reference) and ops/relu_gpu.py.

    relu_forward(out, mask, x)                    out = max(x, 0); mask <- [x > 0], 1 bit each
    relu_backward(dx, dout, mask, accumulate)     dx = (or +=) dout * [x > 0]
    clip_forward(out, code, x, lo, hi)            out = clip(x, lo, hi); code <- the 2-bit region
    clip_backward(dx, dout, code, accumulate)     dx = (or +=) dout * [lo < x < hi]

Per block of BLOCK elements (ops/bitpack_cpu.py) one loop does the float work and writes one code
per byte into an L1 scratch, then the packer's loop packs it: the reference's separate passes
(compare, cast, shifts, clip, unpack, multiply) become one read and one write of the activation.

Arithmetic: NumPy's rules element by element, so outputs, gradients and codes equal the
reference's bit for bit (tests/ops/test_relu_cpu.py): maximum(x, 0) gives x where x > 0 or x is
NaN, else +0 (also for x = -0); clip(x, lo, hi) gives lo below lo, hi above hi, else x (a -0
stays -0, NaN stays NaN); a backward multiplies by 1.0 or 0.0 (so 0 * inf is NaN, as there).
float32 and float64; out may be x itself and dx dout itself (without accumulate); a partial
overlap is refused.
"""
import numpy

from . import relu as reference
from .bitpack import check_packed, flat
from .bitpack_cpu import AVAILABLE, BLOCK, over_blocks, same_or_apart, supports

if AVAILABLE:
    from numba import njit
    from .bitpack_cpu import pack_any, unpack_any
    _opts = dict(cache=True, nogil=True)

    @njit(**_opts)
    def _relu_forward(out, mask, x, a, b, inplace, zero):
        """out[a:b] = max(x, 0), mask's bytes of [a, b) <- [x > 0]; out is x when inplace; zero: +0
        in x's dtype."""
        cb = numpy.empty(BLOCK, numpy.uint8)
        for i0 in range(a, b, BLOCK):
            i1 = min(b, i0 + BLOCK)
            c = cb[:i1 - i0]
            if inplace:
                _relu_block_inplace(c, x[i0:i1], zero)
            else:
                _relu_block(c, out[i0:i1], x[i0:i1], zero)
            pack_any(mask[i0 // 8:(i1 + 7) // 8], c, 1)

    @njit(**_opts)
    def _relu_block(c, o, s, zero):
        for i in range(s.size):
            v = s[i]
            on = v > 0
            c[i] = on
            o[i] = v if on or v != v else zero           # NaN passes, -0 becomes +0 (numpy.maximum)

    @njit(**_opts)
    def _relu_block_inplace(c, s, zero):
        for i in range(s.size):
            v = s[i]
            on = v > 0
            c[i] = on
            s[i] = v if on or v != v else zero

    @njit(**_opts)
    def _clip_forward(out, code, x, lo, hi, a, b, inplace):
        """out[a:b] = clip(x, lo, hi), code's bytes of [a, b) <- (x > lo) + (x >= hi)."""
        cb = numpy.empty(BLOCK, numpy.uint8)
        for i0 in range(a, b, BLOCK):
            i1 = min(b, i0 + BLOCK)
            c = cb[:i1 - i0]
            if inplace:
                _clip_block_inplace(c, x[i0:i1], lo, hi)
            else:
                _clip_block(c, out[i0:i1], x[i0:i1], lo, hi)
            pack_any(code[i0 // 4:(i1 + 3) // 4], c, 2)

    @njit(**_opts)
    def _clip_block(c, o, s, lo, hi):
        for i in range(s.size):
            v = s[i]
            c[i] = numpy.uint8(v > lo) + numpy.uint8(v >= hi)
            v = lo if v < lo else v
            o[i] = hi if v > hi else v

    @njit(**_opts)
    def _clip_block_inplace(c, s, lo, hi):
        for i in range(s.size):
            v = s[i]
            c[i] = numpy.uint8(v > lo) + numpy.uint8(v >= hi)
            v = lo if v < lo else v
            s[i] = hi if v > hi else v

    @njit(**_opts)
    def _backward_kernel(dx, dout, packed, bits, passes, a, b, accumulate, inplace, one):
        """dx[a:b] = (or +=) dout * [code == passes], the codes of `bits` bits in packed; one: 1 in
        dout's dtype (the factor is 1.0 or 0.0, as the reference's uint8-to-float multiply)."""
        per = 8 // bits
        cb = numpy.empty(BLOCK, numpy.uint8)
        for i0 in range(a, b, BLOCK):
            i1 = min(b, i0 + BLOCK)
            c = cb[:i1 - i0]
            unpack_any(c, packed[i0 // per:(i1 + per - 1) // per], bits)
            if inplace:
                _gate_inplace(dout[i0:i1], c, passes, one)
            else:
                _gate(dx[i0:i1], dout[i0:i1], c, passes, accumulate, one)

    @njit(**_opts)
    def _gate(d, g, c, passes, accumulate, one):
        nil = one - one
        if accumulate:
            for i in range(g.size):
                d[i] += g[i] * (one if c[i] == passes else nil)
        else:
            for i in range(g.size):
                d[i] = g[i] * (one if c[i] == passes else nil)

    @njit(**_opts)
    def _gate_inplace(g, c, passes, one):
        nil = one - one
        for i in range(g.size):
            g[i] = g[i] * (one if c[i] == passes else nil)


def relu_forward(out, mask, x):
    """ops.relu.relu_forward in one pass: out = max(x, 0) (may be x); mask <- [x > 0] packed."""
    if not supports(out, x):
        return reference.relu_forward(out, mask, x)
    o, s = flat(out, "out"), flat(x, "x")
    check_packed(mask, s.size, 1, "mask")
    inplace = same_or_apart(o, s)
    zero = s.dtype.type(0)
    over_blocks(lambda a, b: _relu_forward(o, mask, s, a, b, inplace, zero), s.size)


def relu_backward(dx, dout, mask, accumulate=False):
    """ops.relu.relu_backward in one pass: dx = (or +=) dout * [x > 0].

    # saved: mask, the 1-bit [x > 0] of the forward's input (exact)."""
    _backward(dx, dout, mask, 1, 1, accumulate, reference.relu_backward)


def clip_forward(out, code, x, lo=0.0, hi=6.0):
    """ops.relu.clip_forward in one pass: out = clip(x, lo, hi) (may be x); code <- the 2-bit
    region (0 below, 1 inside, 2 above)."""
    reference._check_range(lo, hi)
    if not supports(out, x):
        return reference.clip_forward(out, code, x, lo, hi)
    o, s = flat(out, "out"), flat(x, "x")
    check_packed(code, s.size, 2, "code")
    inplace, dt = same_or_apart(o, s), s.dtype.type
    over_blocks(lambda a, b: _clip_forward(o, code, s, dt(lo), dt(hi), a, b, inplace), s.size)


def clip_backward(dx, dout, code, accumulate=False):
    """ops.relu.clip_backward in one pass: dx = (or +=) dout * [lo < x < hi].

    # saved: code, the 2-bit region of the forward's input (exact)."""
    _backward(dx, dout, code, 2, reference.INSIDE, accumulate, reference.clip_backward)


def relu6_forward(out, code, x):
    """ReLU6: clip_forward with lo = 0, hi = 6."""
    clip_forward(out, code, x, 0.0, 6.0)


relu6_backward = clip_backward


def _backward(dx, dout, packed, bits, passes, accumulate, fallback):
    if not supports(dx, dout):
        return fallback(dx, dout, packed, accumulate)
    d, g = flat(dx, "dx"), flat(dout, "dout")
    check_packed(packed, g.size, bits, "mask" if bits == 1 else "code")
    inplace = same_or_apart(d, g)
    if inplace and accumulate:
        raise ValueError("dx may be dout only without accumulate")
    one = g.dtype.type(1)
    over_blocks(lambda a, b: _backward_kernel(d, g, packed, bits, passes, a, b, accumulate, inplace, one), g.size)
