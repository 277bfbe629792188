"""The range code in numba (optional: lowmem[fast]), the CPU twin of units/rangecode.py's
NumPy reference and of units/rangecode_gpu.py.

    range_encode(packed, scale, zero, x, bits)   one pass per group of GROUP elements: its
                                                 range (min, max), step and zero point, every
                                                 code, packed; nothing else is written
    range_decode(out, packed, scale, zero, bits) out = (q - z) * s, unpacked inline
    encode_block(...)                            (numba) one block's code from a kernel's own
                                                 L1 scratch, where another pass makes the values
                                                 (units/norm_cpu.py's coded batch norm passes)

Why: the reference walks each chunk a dozen times (min, max, divide, rint, clip, nan_to_num,
the pack's shifts) and decodes through an index array (arange // GROUP). Here a group's 256
elements are read once for the range and once, from L1, for the codes. The codes wait one per
byte in a scratch of BLOCK elements (16 groups) and are packed (or unpacked) a block at a time:
a call of the packer per group cost as much as the quantizing (encode 5.4 -> 4.0 ms, decode
3.0 -> 2.1 ms for 12.6 M float32 elements at 4 bits on one thread of a Zen 4 EPYC). The encode
is bound by its arithmetic (a division per element, and per group a chain of divisions for its
step and zero point): a block's 16 groups take their ranges and constants first and their
codes after, so the chains overlap, and the next block is prefetched into L2 meanwhile
(0.29 -> 0.235 ns per element from L2, 0.34 -> 0.30 from memory).

Arithmetic: the reference's operations in its order and dtype (float32 or float64, whichever x
is; the step is float32), so the packed codes, scales and zero points equal range_encode's byte
for byte, and the decode equals range_decode's bit for bit (tests/units/test_rangecode_cpu.py).
Inputs holding inf or NaN take the reference's path through nan_to_num and clip as well; only the
payload of a NaN step (a group holding NaN, whose decode is meaningless) is not pinned.

Cores: each call splits its groups over lowmem's threads (lowmem/system/threads.py), the kernels
release the GIL; scratch is one block of codes per thread.
"""
import functools

import numpy

from ..system import threads
from .cpu_base import AVAILABLE, BLOCK, GRAIN
from .rangecode import F32_MAX, GROUP

INTS = {4: numpy.int32, 8: numpy.int64}          # a float's bits, by its size
UINTS = {4: numpy.uint32, 8: numpy.uint64}

if AVAILABLE:
    from numba import njit
    from .cpu_base import _opts
    from ..ops.bitpack_cpu import decode_span, pack_any as _pack_any
    from ..system.prefetch import prefetch

    LINE = 16                   # float32 elements per 64-byte cache line (float64: every other line)

    @njit(**_opts)
    def _range(xi, xu, nil, sign):
        """(largest signed, largest unsigned) bit pattern of a group, the float's bits read as integers
        (xi, xu: two integer views of it). Plain integer max reductions, so the loop vectorises
        (a float min/max reduction does not without fast-math, which would lose the reference's
        rules). Positive floats order as their signed bits, negative ones by magnitude as their
        unsigned bits above `sign` (the sign bit alone, -0): the caller turns them into the
        group's max and min. nil: 0 as xi's integer (so the max stays that wide)."""
        hi = nil
        lo = sign
        for i in range(xi.size):
            hi = max(hi, xi[i])
            lo = max(lo, xu[i])
        return hi, lo

    @njit(**_opts)
    def _quantize_group(cb, xr, safe, z, q_lo, q_hi, nil):
        """cb <- clip(rint(x / safe) + z, q_lo, q_hi), NaN to 0 (the reference's element order)."""
        for i in range(xr.size):
            q = numpy.rint(xr[i] / safe) + z
            q = q_lo if q < q_lo else q
            q = q_hi if q > q_hi else q
            q = q if q == q else nil
            cb[i] = numpy.uint8(numpy.int32(q))

    @njit(**_opts)
    def _encode(packed, scale, zero, x, xi, xu, ends, bits, g0, g1, lev, fmax, big, nil_i, sign, inf_i, inf_u):
        """Groups g0 .. g1-1 of x (n,); xi, xu: x's bits as signed and unsigned integers; ends: two
        integers the caller also views as two floats of x's dtype (the range's ends, bits to float).
        lev = 2**bits - 1, fmax = the float32 maximum and big = the dtype's maximum (nan_to_num's
        +inf), in x's dtype; nil_i: 0 as xi's integer; sign: the sign bit alone (-0); inf_i, inf_u:
        +inf's and -inf's bits.
        Reference: rangecode._encode."""
        codes = numpy.empty(BLOCK, numpy.uint8)       # a block's codes, one per byte, packed at its end
        f = numpy.zeros(4, x.dtype)                     # conversions into x's dtype (as astype); f[3] stays 0
        par = numpy.empty((BLOCK // GROUP, 4), x.dtype)   # per group of a block: safe, z, q_lo, q_hi
        _encode_in(packed, scale, zero, x, xi, xu, ends, bits, g0, g1, lev, fmax, big, nil_i, sign, inf_i, inf_u,
                   codes, f, par)

    @njit(**_opts)
    def _encode_in(packed, scale, zero, x, xi, xu, ends, bits, g0, g1, lev, fmax, big, nil_i, sign, inf_i, inf_u,
                   codes, f, par):
        """_encode in the caller's scratch: codes (BLOCK,) uint8, f (4,) of x's dtype with f[3] == 0,
        par (BLOCK // GROUP, 4) of x's dtype."""
        n = x.size
        e = ends.view(x.dtype)
        nil = f[3]
        nan = (big + big) - (big + big)
        end = min(n, g1 * GROUP)
        for a0 in range(g0 * GROUP, end, BLOCK):
            a1 = min(end, a0 + BLOCK)
            # first every group's range and constants (independent chains, which the core overlaps),
            # then its codes: a group's codes wait on its step and zero point, not on the next range
            for a in range(a0, a1, GROUP):
                g = a // GROUP
                b = min(n, a + GROUP)
                top, bottom = _range(xi[a:b], xu[a:b], nil_i, sign)
                ends[0] = top                               # maximum(max(v), 0): +0 if nothing is above 0
                ends[1] = bottom                            # minimum(min(v), 0): +0 if only -0 is below
                hi = e[0] if top > 0 else nil
                lo = e[1] if bottom > sign else nil
                if top > inf_i or bottom > inf_u:           # NaN propagates through min and max
                    lo = hi = nan
                s = hi / lev - lo / lev
                s = fmax if s > fmax else s                 # minimum(s, F32_MAX); NaN stays NaN
                s32 = numpy.float32(s)
                f[0] = s32 if s32 > 0 else numpy.float32(1)
                safe = f[0]
                z = numpy.rint(-lo / safe)                  # nan_to_num, then clip into [0, lev]
                z = nil if z != z else (big if z > big else z)
                z = nil if z < nil else (lev if z > lev else z)
                s64 = numpy.float64(safe)
                if s64 * (lev + 1.0) <= F32_MAX:             # every level's decode is finite (exact:
                    f[1] = 0.0                              # lev + 1 is a power of two, so reach
                    f[2] = lev                              # >= lev below): no float64 division
                else:
                    reach = numpy.floor(F32_MAX / s64)      # levels whose decode stays finite
                    if reach * s64 > F32_MAX:
                        reach -= 1.0
                    f[1] = max(numpy.float64(z) - reach, 0.0)
                    f[2] = min(numpy.float64(z) + reach, numpy.float64(lev))
                q = (a - a0) // GROUP
                par[q, 0], par[q, 1], par[q, 2], par[q, 3] = safe, z, f[1], f[2]
                scale[g] = s32
                zero[g] = numpy.uint8(numpy.int32(z))
            for a in range(a0, a1, GROUP):
                b = min(n, a + GROUP)
                q = (a - a0) // GROUP
                for p in range(a + BLOCK, min(end, a + BLOCK + GROUP), LINE):    # the next block's group q
                    prefetch(xi, p)
                _quantize_group(codes[a - a0:b - a0], x[a:b], par[q, 0], par[q, 1], par[q, 2], par[q, 3], nil)
            _pack_any(packed[a0 * bits // 8:(a1 * bits + 7) // 8], codes[:a1 - a0], bits)

    @njit(**_opts)
    def encode_block(packed, scale, zero, h, hi, hu, ends, codes, f, par, a, bits, lev, fmax, big, nil_i, sign,
                     inf_i, inf_u):
        """The range code of flat elements a .. a + h.size - 1 of a tensor, held in h (at most BLOCK
        elements; hi, hu: h's bits as signed and unsigned integers), into the tensor's packed,
        scale and zero (whole arrays): the bytes range_encode writes for them. a: a multiple of
        GROUP (so of a byte's codes at any width); h runs to the tensor's end or to a group's.
        ends, codes, f, par: block_scratch's (nothing is allocated per block)."""
        n = h.size
        _encode_in(packed[a * bits // 8:], scale[a // GROUP:], zero[a // GROUP:], h, hi[:n], hu[:n], ends, bits, 0,
                   (n + GROUP - 1) // GROUP, lev, fmax, big, nil_i, sign, inf_i, inf_u, codes, f, par)

    @njit(**_opts)
    def _decode(out, packed, scale, zero, bits, g0, g1):
        """out[groups g0 .. g1-1] <- (q - z) * s, in out's dtype. Reference: rangecode.range_decode."""
        codes = numpy.empty(BLOCK + 8, numpy.uint8)   # a block's codes, one per byte
        f = numpy.empty(2, out.dtype)
        end = min(out.size, g1 * GROUP)
        for a0 in range(g0 * GROUP, end, BLOCK):
            a1 = min(end, a0 + BLOCK)
            decode_span(out[a0:a1], codes, packed, scale, zero, bits, GROUP, a0, f)


def supports(*arrays):
    """Whether these kernels take the arrays: numba present, NumPy, C-contiguous, and the data
    float32 or float64 (the first array)."""
    return (AVAILABLE and all(type(a) is numpy.ndarray and a.flags.c_contiguous for a in arrays)
            and arrays[0].dtype in (numpy.float32, numpy.float64))


def _groups(fn, n):
    G = (n + GROUP - 1) // GROUP
    threads.parallel_for(fn, G, grain=max(1, GRAIN // GROUP))


def encode_constants(dtype, bits):
    """What _encode takes besides the arrays, for data of `dtype` at `bits`: (lev, fmax, big, nil_i,
    sign, inf_i, inf_u) (its docstring). Made once per (dtype, bits): a dozen NumPy scalars, asked
    by every encoding call."""
    return _constants(numpy.dtype(dtype), int(bits))


@functools.lru_cache(maxsize=None)
def _constants(dtype, bits):
    dt, si, ui = dtype.type, INTS[dtype.itemsize], UINTS[dtype.itemsize]
    inf_u, ninf_u = numpy.array([numpy.inf, -numpy.inf], dtype).view(ui)
    return (dt((1 << bits) - 1), dt(F32_MAX), dt(numpy.finfo(dtype).max), si(0), ui(1 << (8 * dtype.itemsize - 1)),
            si(inf_u), ninf_u)


def block_scratch(dtype):
    """A thread's scratch for encoding a block where it is made (units/norm_cpu.py's coded passes):
    (h, h as signed integers, h as unsigned integers, ends, codes, f, par), h BLOCK elements of
    `dtype`, the rest encode_block's."""
    dtype = numpy.dtype(dtype)
    h = numpy.empty(BLOCK, dtype)
    return (h, h.view(INTS[dtype.itemsize]), h.view(UINTS[dtype.itemsize]), numpy.empty(2, UINTS[dtype.itemsize]),
            numpy.empty(BLOCK, numpy.uint8), numpy.zeros(4, dtype), numpy.empty((BLOCK // GROUP, 4), dtype))


def range_encode(packed, scale, zero, x, bits):
    """rangecode.range_encode's bytes: packed (packed_nbytes(n, bits),) uint8, scale (groups(n),)
    float32, zero (groups(n),) uint8 <- the range code of x (n,) float32 or float64."""
    x = x.reshape(-1)
    consts = encode_constants(x.dtype, bits)
    xi, xu = x.view(INTS[x.dtype.itemsize]), x.view(UINTS[x.dtype.itemsize])

    def groups(g0, g1):
        ends = numpy.empty(2, UINTS[x.dtype.itemsize])                     # one per thread
        _encode(packed, scale, zero, x, xi, xu, ends, bits, g0, g1, *consts)
    _groups(groups, x.size)


def range_decode(out, packed, scale, zero, bits):
    """rangecode.range_decode's values: out (n,) <- (q - z) * s in out's dtype."""
    out = out.reshape(-1)
    _groups(lambda g0, g1: _decode(out, packed, scale, zero, bits, g0, g1), out.size)
