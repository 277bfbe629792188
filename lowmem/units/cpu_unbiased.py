"""numba forward of the unbiased group-range code (units/unbiased.py): normalise, find each group's
range, draw and pack the codes, write relu(y), in one pass over x per group (two over its 256
elements, which stay in cache).

Arithmetic: every float operation of unbiased.metadata, Levels and _encode_piece, one rounding
each, in the same order (float32 only, no fastmath), and the counter stream of units/stream.py
in uint64: the slot equals unbiased.quantize_pack's byte for byte for the same x-hat and key
(tests/test_unbiased.py); `decode` gives unbiased.decode_each_chunk's x-tilde or conv input bit
for bit (and masks the backward's incoming gradient). The set using them is units/fused.py's
FusedUnbiasedCodeUnits; its BN backward sums stay the reference's (NumPy).
"""
import numpy

from . import cpu, quant, unbiased
from .stream import resolve

AVAILABLE = cpu.AVAILABLE

if AVAILABLE:
    from numba import njit
    F32, U64 = numpy.float32, numpy.uint64
    F0 = F32(0)
    INF = F32(numpy.inf)
    GOLDEN, MIX1, MIX2 = cpu.GOLDEN, cpu.MIX1, cpu.MIX2
    S30, S27, S31, S_OFF = cpu.S30, cpu.S27, cpu.S31, cpu.S_OFF
    R_SCALE = F32(2.0 ** -quant.OFFSET_BITS)
    GROUP = unbiased.GROUP

    @njit(cache=True, nogil=True)
    def _bf16(v, up, box, bits_view):
        """The bf16 value next to float32 v, outward (unbiased._bf16), via a 1-element box."""
        box[0] = v
        b = bits_view[0] >> numpy.uint32(16)            # toward zero
        bits_view[0] = b << numpy.uint32(16)
        t = box[0]
        if (up and t < v) or ((not up) and t > v):
            b += numpy.uint32(1)
        bits_view[0] = b << numpy.uint32(16)
        return box[0], numpy.uint16(b)

    @njit(cache=True, nogil=True)
    def _forward_rows(out, slot_codes, ends, x, mean, rstd, gamma, beta, k, L, naive, c_first,
                      base, start, row, codes, box, bits_view, bits):
        C, M = x.shape
        per = 8 // bits
        for c in range(C):
            m, r, g, b = mean[c], rstd[c], gamma[c], beta[c]
            s = F32(-1) if g < 0 else F32(1)
            zero = g == 0
            ag = abs(g)
            t = -b / (F32(1) if zero else ag)
            t_o = -INF if zero else t
            t_c = INF if zero else t
            kc = k[c]
            kf = F32(kc)
            n_open = F32(max(L - kc - 1, 1))
            n_closed = F32(max(kc - 1, 1))
            for g0 in range(0, M, GROUP):
                g1 = min(M, g0 + GROUP)
                hi, lo = -INF, INF
                for i in range(g0, g1):
                    u = ((x[c, i] - m) * r) * s
                    hi = max(hi, u)
                    lo = min(lo, u)
                hi, bh = _bf16(hi, True, box, bits_view)
                lo, bl = _bf16(lo, False, box, bits_view)
                ends[c, g0 // GROUP, 0] = bh
                ends[c, g0 // GROUP, 1] = bl
                bo = min(max(t_o, lo), hi)
                top_c = max(min(t_c, hi), lo)
                so = (hi - bo) / n_open
                if not (L - kc > 1 and so > 0 and so < INF):
                    so = F0
                sc = (top_c - lo) / n_closed
                if not (kc > 1 and sc > 0 and sc < INF):
                    sc = F0
                for i in range(g0, g1):
                    xh = (x[c, i] - m) * r
                    y = xh * g + b
                    on = y > 0
                    u = xh * s
                    if on:
                        bb, st, n = bo, so, F32(L) - kf
                    else:
                        bb, st, n = lo, sc, kf
                    p = (u - bb) / st if st > 0 else F0
                    z = base + U64((c_first + c) * row + start + i + 1) * GOLDEN
                    z = (z ^ (z >> S30)) * MIX1
                    z = (z ^ (z >> S27)) * MIX2
                    z = z ^ (z >> S31)
                    p = p + F32(z >> S_OFF) * R_SCALE
                    j = min(max(numpy.floor(p), F0), n - F32(1))
                    code = kf + j if on else j
                    codes[i - g0] = numpy.uint8(code)
                    if naive:
                        if not on:
                            out[c, i] = F0
                        elif zero:
                            out[c, i] = max(b, F0)
                        else:
                            out[c, i] = max(ag * ((bo - t) + j * so), F0)
                    else:
                        out[c, i] = y if y > 0 else F0
                cpu._pack(slot_codes[(c * M + g0) // per:(c * M + g1) // per], codes[:g1 - g0], bits)

    @njit(cache=True, nogil=True)
    def _levels(ends, c, gi, t_o, t_c, kc, L, box, bits_view):
        """(base_o, step_o, base_c, step_c) of group gi of row c from its stored bf16 ends."""
        bits_view[0] = numpy.uint32(ends[c, gi, 0]) << numpy.uint32(16)
        hi = box[0]
        bits_view[0] = numpy.uint32(ends[c, gi, 1]) << numpy.uint32(16)
        lo = box[0]
        bo = min(max(t_o, lo), hi)
        top_c = max(min(t_c, hi), lo)
        so = (hi - bo) / F32(max(L - kc - 1, 1))
        if not (L - kc > 1 and so > 0 and so < INF):
            so = F0
        sc = (top_c - lo) / F32(max(kc - 1, 1))
        if not (kc > 1 and sc > 0 and sc < INF):
            sc = F0
        return bo, so, lo, sc

    @njit(cache=True, nogil=True)
    def _decode_rows(out, dr, slot_codes, ends, gamma, beta, k, L, relu, mask_dr, codes, box, bits_view, bits):
        """out <- x-tilde (relu False) or the conv input (relu True); mask_dr: dr *= the mask."""
        C, M = out.shape
        per = 8 // bits
        for c in range(C):
            g, b = gamma[c], beta[c]
            s = F32(-1) if g < 0 else F32(1)
            zero = g == 0
            ag = abs(g)
            t = -b / (F32(1) if zero else ag)
            t_o = -INF if zero else t
            t_c = INF if zero else t
            kc = k[c]
            kf = F32(kc)
            for g0 in range(0, M, GROUP):
                g1 = min(M, g0 + GROUP)
                bo, so, bc, sc = _levels(ends, c, g0 // GROUP, t_o, t_c, kc, L, box, bits_view)
                cpu._unpack(codes[:g1 - g0], slot_codes[(c * M + g0) // per:(c * M + g1) // per], bits)
                for i in range(g0, g1):
                    code = F32(codes[i - g0])
                    on = code >= kf
                    j = code - kf if on else code
                    if relu:
                        if not on:
                            out[c, i] = F0
                        elif zero:
                            out[c, i] = max(b, F0)
                        else:
                            out[c, i] = max(ag * ((bo - t_o) + j * so), F0)
                    else:
                        out[c, i] = s * (bo + j * so if on else bc + j * sc)
                    if mask_dr and not on:
                        dr[c, i] = F0


def decode(out, slot, gamma, beta, bits, relu=False, dr=None):
    """unbiased.decode_each_chunk's output (x-tilde, or the conv input with relu=True), bit for
    bit, in one numba pass; with dr (C, M): dr *= the exact mask (the backward's masking)."""
    C, M = out.shape
    codes, ends = unbiased.split_slot(slot, C, M, bits)
    k = unbiased.split(gamma, beta, bits)
    mask_dr = dr is not None
    drr = dr if mask_dr else out

    def rows(c0, c1):
        b = numpy.empty(1, numpy.float32)
        _decode_rows(out[c0:c1], drr[c0:c1], codes[c0 * M * bits // 8:c1 * M * bits // 8], ends[c0:c1],
                     gamma[c0:c1], beta[c0:c1], k[c0:c1], 1 << bits, bool(relu), mask_dr,
                     numpy.empty(GROUP, numpy.uint8), b, b.view(numpy.uint32), bits)
    cpu._over_channels(rows, C, M)


def unit_forward(out, slot, x, mean, rstd, gamma, beta, bits, naive, key):
    """The fused forward of UnbiasedCodeUnits: slot <- the unbiased code of x-hat = (x - mean)*rstd
    drawn from key (an integer or quant.Stream); out = relu(y) (approx) or the decoded conv input
    (naive). x, out (C, M) float32 C-contiguous (out may alias x), M*bits a multiple of 8."""
    bits = unbiased.check_bits(bits)
    C, M = x.shape
    if not cpu.supports(numpy, x.dtype, M, bits):
        raise ValueError(f"the numba unbiased forward needs float32 rows of M*bits a multiple of 8, "
                         f"got {x.dtype} M={M}")
    codes, ends = unbiased.split_slot(slot, C, M, bits)
    k = unbiased.split(gamma, beta, bits)
    stream = resolve(key, M, what="stochastic")
    base, start, row = stream

    def rows(c0, c1):
        b = numpy.empty(1, numpy.float32)                # per thread: the bf16 box
        _forward_rows(out[c0:c1], codes[c0 * M * bits // 8:c1 * M * bits // 8], ends[c0:c1], x[c0:c1],
                      mean[c0:c1], rstd[c0:c1], gamma[c0:c1], beta[c0:c1], k[c0:c1], 1 << bits, bool(naive),
                      c0, U64(base), start, row, numpy.empty(GROUP, numpy.uint8), b, b.view(numpy.uint32), bits)
    cpu._over_channels(rows, C, M)
