"""numba kernels of the unbiased group-range code (units/unbiased.py): the forward (normalise,
find each group's range, draw and pack the codes, write relu(y)), the decodes (x-tilde or the
conv input; optionally the gradient's masking) and the fused BN-ReLU backward, each walking a
channel's row group by group (256 elements, which stay in L1).

How they vectorise (as units/cpu.py's kernels): per group the codes sit in a uint8 buffer, one
per byte (cpu._pack/_unpack move them to and from the slot), and the float work is a 1-D loop
over the group's slices written branch-free: selects and unconditional stores; what is fixed for
a channel or a call (γ = 0, relu, naive, accumulate) picks one loop outside the loop. The
forward normalises a group into a 256-float buffer first, so no loop both reads x and writes
out (out may alias x). error_model="numpy": no zero check on a float division (it would stop
LLVM vectorising; the divisions are the reference's own, kept as divisions).

Arithmetic: every float operation of unbiased.metadata, Levels and _encode_piece, one rounding
each, in the same order (float32 only, no fastmath outside the backward's sums), and the
counter stream of units/stream.py in uint64: the slot equals unbiased.quantize_pack's byte for
byte for the same x-hat and key (tests/test_unbiased.py); `decode` gives
unbiased.decode_each_chunk's x-tilde or conv input bit for bit. `unit_backward`: the reference's
formulas (ops.bn_relu_backward on that x-tilde under the exact mask), its sums in float32 within
a group and float64 across groups, so dgamma, dbeta and dx agree to float32 rounding.
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
    _opts = dict(cache=True, nogil=True, error_model="numpy")
    _reduce = dict(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "nsz"})

    # ---- per channel and per group: the constants of unbiased.Levels ----

    @njit(**_opts)
    def _channel(g, b, kc):
        """(s, zero, ag, t_o, t_c, kf) of a channel from γ, β and its split k alone: sign(γ)
        (+1 for γ = 0), γ == 0, |γ|, the threshold t = −β/|γ| as the open side's floor (−inf
        where γ = 0) and as the closed side's ceiling (+inf there), and k as a float."""
        s = F32(-1) if g < 0 else F32(1)
        zero = g == 0
        ag = abs(g)
        t = -b / (F32(1) if zero else ag)
        t_o = -INF if zero else t
        t_c = INF if zero else t
        return s, zero, ag, t_o, t_c, F32(kc)

    @njit(**_opts)
    def _levels(hi, lo, t_o, t_c, kc, L):
        """(base_o, step_o, base_c, step_c) of a group of range [lo, hi] (its bf16 ends)."""
        bo = min(max(t_o, lo), hi)
        top_c = max(min(t_c, hi), lo)
        so = (hi - bo) / F32(max(L - kc - 1, 1))
        if not (L - kc > 1 and so > 0 and so < INF):
            so = F0
        sc = (top_c - lo) / F32(max(kc - 1, 1))
        if not (kc > 1 and sc > 0 and sc < INF):
            sc = F0
        return bo, so, lo, sc

    @njit(**_opts)
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

    @njit(**_opts)
    def _bf16_value(b, box, bits_view):
        bits_view[0] = numpy.uint32(b) << numpy.uint32(16)
        return box[0]

    # ---- one group: 1-D loops over its slices ----

    @njit(**_opts)
    def _normalise(xb, xr, m, r):
        """xb <- x-hat = (x - m)*r (a buffer: out may alias x)."""
        for t in range(xr.size):
            xb[t] = (xr[t] - m) * r

    # float32 bits as int32 keys that order as the floats do (-0 below +0)
    I31 = numpy.int32(0x7FFFFFFF)
    K_NINF, K_INF = (numpy.int32(b ^ ((b >> 31) & 0x7FFFFFFF)) for b in
                     numpy.array([-numpy.inf, numpy.inf], numpy.float32).view(numpy.int32))

    @njit(**_opts)
    def _key_value(key, box, bits_view):
        bits_view[0] = numpy.uint32(key ^ ((key >> 31) & I31))
        return box[0]

    @njit(**_opts)
    def _range(xb, s, box, bits_view):
        """(max, min) of u = x-hat*s over the group, as max/min element by element give them
        (NaNs skipped; of equal values the first kept, so a 0's sign is the first 0's). Through
        int32 keys (a float max with a carried select does not vectorise); u = ±x-hat exactly."""
        xi = xb.view(numpy.int32)
        hi, lo = K_NINF, K_INF
        for t in range(xi.size):
            v = xi[t]
            key = v ^ ((v >> 31) & I31)
            ok = xb[t] == xb[t]
            hi = max(hi, key if ok else K_NINF)
            lo = min(lo, key if ok else K_INF)
        a, b = _key_value(hi, box, bits_view), _key_value(lo, box, bits_view)
        hi_u, lo_u = (a, b) if s > 0 else (-b, -a)
        if hi_u == 0 or lo_u == 0:                    # -0 and +0 tie: the first 0 decides
            for t in range(xb.size):
                if xb[t] == 0:
                    z = xb[t] * s
                    hi_u = z if hi_u == 0 else hi_u
                    lo_u = z if lo_u == 0 else lo_u
                    break
        return hi_u, lo_u

    @njit(**_opts)
    def _draw(codes, orow, xb, g, b, s, bo, so, bc, sc, kf, n_open, z0):
        """codes <- the group's codes (unbiased._encode_piece; element t's draw from counter
        z0 + t*GOLDEN); orow <- relu(y), y = x-hat*g + b."""
        for t in range(xb.size):
            xh = xb[t]
            y = xh * g + b
            on = y > 0
            u = xh * s
            bb = bo if on else bc
            st = so if on else sc
            n = n_open if on else kf
            p = (u - bb) / st
            p = p if st > 0 else F0
            z = z0 + U64(t) * GOLDEN
            z = (z ^ (z >> S30)) * MIX1
            z = (z ^ (z >> S27)) * MIX2
            z = z ^ (z >> S31)
            p = p + F32(numpy.int32(z >> S_OFF)) * R_SCALE       # < 2**24: exact through int32
            j = min(max(numpy.floor(p), F0), n - F32(1))
            code = kf + j if on else j
            codes[t] = numpy.uint8(numpy.int32(code))
            orow[t] = y if on else F0

    @njit(**_opts)
    def _xtilde(orow, codes, kf, s, bo, so, bc, sc):
        """orow <- x-tilde = s*(base + j*step) of the code's side."""
        for t in range(orow.size):
            v = F32(codes[t])
            xo = bo + (v - kf) * so
            xc = bc + v * sc
            orow[t] = s * (xo if v >= kf else xc)

    @njit(**_opts)
    def _conv_input(orow, codes, kf, zero, b, ag, bo, so, t_o):
        """orow <- the conv input: |γ|*((base_o − t) + j*step_o) (β where γ = 0), at least 0,
        on open codes; 0 on closed ones."""
        if zero:
            val = max(b, F0)
            for t in range(orow.size):
                orow[t] = val if F32(codes[t]) >= kf else F0
        else:
            d = bo - t_o
            for t in range(orow.size):
                v = F32(codes[t])
                y = max(ag * (d + (v - kf) * so), F0)
                orow[t] = y if v >= kf else F0

    @njit(**_opts)
    def _mask(drow, codes, kf):
        """drow *= the exact mask (code >= k), as a select (0 where closed)."""
        for t in range(drow.size):
            drow[t] = drow[t] if F32(codes[t]) >= kf else F0

    @njit(**_reduce)
    def _sums(xt, drow, codes, kf):
        """(sum dy, sum dy*x-tilde) over one group, dy = dr masked by code >= k; float32 within
        the group (vectorised), the caller adds the groups in float64."""
        sdy = F0
        sdyx = F0
        for t in range(drow.size):
            dy = drow[t] if F32(codes[t]) >= kf else F0
            sdy += dy
            sdyx += dy * xt[t]
        return sdy, sdyx

    @njit(**_opts)
    def _dx(dxr, xt, drow, codes, kf, a, mdy, mdyx, accumulate):
        """dx (=, or += with accumulate) a*(dy - mean(dy) - x-tilde*mean(dy*x-tilde)) for a group.
        dxr must not alias drow (see cpu._quantize_block)."""
        if accumulate:
            for t in range(drow.size):
                dy = drow[t] if F32(codes[t]) >= kf else F0
                dxr[t] += a * (dy - mdy - xt[t] * mdyx)
        else:
            for t in range(drow.size):
                dy = drow[t] if F32(codes[t]) >= kf else F0
                dxr[t] = a * (dy - mdy - xt[t] * mdyx)

    @njit(**_opts)
    def _group_xtilde(xb, codes, slot_codes, ends, c, g0, M, t_o, t_c, kc, kf, s, L, bits, box, bits_view):
        """Unpack group g0 // GROUP of row c into codes and decode its x-tilde into xb."""
        per = 8 // bits
        n = xb.size
        cpu._unpack(codes, slot_codes[(c * M + g0) // per:(c * M + g0 + n) // per], bits)
        gi = g0 // GROUP
        bo, so, bc, sc = _levels(_bf16_value(ends[c, gi, 0], box, bits_view),
                                 _bf16_value(ends[c, gi, 1], box, bits_view), t_o, t_c, kc, L)
        _xtilde(xb, codes, kf, s, bo, so, bc, sc)

    # ---- whole (C, M) rows ----

    @njit(**_opts)
    def _forward_rows(out, slot_codes, ends, x, mean, rstd, gamma, beta, k, L, naive, c_first,
                      base, start, row, codes, xb, box, bits_view, bits):
        C, M = x.shape
        per = 8 // bits
        for c in range(C):
            m, r, g, b, kc = mean[c], rstd[c], gamma[c], beta[c], k[c]
            s, zero, ag, t_o, t_c, kf = _channel(g, b, kc)
            n_open = F32(L) - kf
            for g0 in range(0, M, GROUP):
                g1 = min(M, g0 + GROUP)
                xg, cg, orow = xb[:g1 - g0], codes[:g1 - g0], out[c, g0:g1]
                _normalise(xg, x[c, g0:g1], m, r)
                hi, lo = _range(xg, s, box, bits_view)
                hi, bh = _bf16(hi, True, box, bits_view)
                lo, bl = _bf16(lo, False, box, bits_view)
                ends[c, g0 // GROUP, 0] = bh
                ends[c, g0 // GROUP, 1] = bl
                bo, so, bc, sc = _levels(hi, lo, t_o, t_c, kc, L)
                z0 = base + U64((c_first + c) * row + start + g0 + 1) * GOLDEN
                _draw(cg, orow, xg, g, b, s, bo, so, bc, sc, kf, n_open, z0)
                if naive:                       # continue from the decoded value
                    _conv_input(orow, cg, kf, zero, b, ag, bo, so, t_o)
                cpu._pack(slot_codes[(c * M + g0) // per:(c * M + g1) // per], cg, bits)

    @njit(**_opts)
    def _decode_rows(out, dr, slot_codes, ends, gamma, beta, k, L, relu, mask_dr, codes, box, bits_view, bits):
        """out <- x-tilde (relu False) or the conv input (relu True); mask_dr: dr *= the mask."""
        C, M = out.shape
        per = 8 // bits
        for c in range(C):
            kc = k[c]
            s, zero, ag, t_o, t_c, kf = _channel(gamma[c], beta[c], kc)
            for g0 in range(0, M, GROUP):
                g1 = min(M, g0 + GROUP)
                cg, orow = codes[:g1 - g0], out[c, g0:g1]
                cpu._unpack(cg, slot_codes[(c * M + g0) // per:(c * M + g1) // per], bits)
                gi = g0 // GROUP
                bo, so, bc, sc = _levels(_bf16_value(ends[c, gi, 0], box, bits_view),
                                         _bf16_value(ends[c, gi, 1], box, bits_view), t_o, t_c, kc, L)
                if relu:
                    _conv_input(orow, cg, kf, zero, beta[c], ag, bo, so, t_o)
                else:
                    _xtilde(orow, cg, kf, s, bo, so, bc, sc)
                if mask_dr:
                    _mask(dr[c, g0:g1], cg, kf)

    @njit(**_opts)
    def _backward_rows(dx, dgamma, dbeta, dr, slot_codes, ends, gamma, beta, rstd, k, L, bits,
                       accumulate, inplace, codes, xb, tmp, box, bits_view):
        """BN-ReLU backward from the slot: two passes per row (sums, then dx), each decoding
        x-tilde group by group into the L1 buffer xb; no decode buffer. inplace: dx overlaps dr,
        so dx goes through tmp (see cpu._quantize_block)."""
        C, M = dr.shape
        for c in range(C):
            kc = k[c]
            s, zero, ag, t_o, t_c, kf = _channel(gamma[c], beta[c], kc)
            sdy = 0.0
            sdyx = 0.0
            for g0 in range(0, M, GROUP):
                g1 = min(M, g0 + GROUP)
                xg, cg = xb[:g1 - g0], codes[:g1 - g0]
                _group_xtilde(xg, cg, slot_codes, ends, c, g0, M, t_o, t_c, kc, kf, s, L, bits, box, bits_view)
                a1, a2 = _sums(xg, dr[c, g0:g1], cg, kf)
                sdy += a1
                sdyx += a2
            dgamma[c] += sdyx
            dbeta[c] += sdy
            a = F32(gamma[c] * rstd[c])
            mdy, mdyx = F32(sdy / M), F32(sdyx / M)
            for g0 in range(0, M, GROUP):
                g1 = min(M, g0 + GROUP)
                xg, cg = xb[:g1 - g0], codes[:g1 - g0]
                _group_xtilde(xg, cg, slot_codes, ends, c, g0, M, t_o, t_c, kc, kf, s, L, bits, box, bits_view)
                if accumulate or not inplace:
                    _dx(dx[c, g0:g1], xg, dr[c, g0:g1], cg, kf, a, mdy, mdyx, accumulate)
                else:
                    tb = tmp[:g1 - g0]
                    _dx(tb, xg, dr[c, g0:g1], cg, kf, a, mdy, mdyx, False)
                    cpu._copy(dx[c, g0:g1], tb)


def _box():
    """A 1-element float32 box and its uint32 view (per thread: the bf16 conversions)."""
    b = numpy.empty(1, numpy.float32)
    return b, b.view(numpy.uint32)


def _check(x, M, bits, what):
    if not cpu.supports(numpy, x.dtype, M, bits):
        raise ValueError(f"the numba unbiased {what} needs float32 rows of M*bits a multiple of 8, "
                         f"got {x.dtype} M={M} at {bits} bits")


def decode(out, slot, gamma, beta, bits, relu=False, dr=None):
    """unbiased.decode_each_chunk's output (x-tilde, or the conv input with relu=True), bit for
    bit, in one numba pass; with dr (C, M): dr *= the exact mask (the backward's masking)."""
    bits = unbiased.check_bits(bits)
    C, M = out.shape
    _check(out, M, bits, "decode")
    codes, ends = unbiased.split_slot(slot, C, M, bits)
    k = unbiased.split(gamma, beta, bits)
    mask_dr = dr is not None
    drr = dr if mask_dr else out

    def rows(c0, c1):
        _decode_rows(out[c0:c1], drr[c0:c1], codes[c0 * M * bits // 8:c1 * M * bits // 8], ends[c0:c1],
                     gamma[c0:c1], beta[c0:c1], k[c0:c1], 1 << bits, bool(relu), mask_dr,
                     numpy.empty(GROUP, numpy.uint8), *_box(), bits)
    cpu._over_channels(rows, C, M)


def unit_forward(out, slot, x, mean, rstd, gamma, beta, bits, naive, key):
    """The fused forward of UnbiasedCodeUnits: slot <- the unbiased code of x-hat = (x - mean)*rstd
    drawn from key (an integer or quant.Stream); out = relu(y) (approx) or the decoded conv input
    (naive). x, out (C, M) float32 C-contiguous (out may alias x), M*bits a multiple of 8."""
    bits = unbiased.check_bits(bits)
    C, M = x.shape
    _check(x, M, bits, "forward")
    codes, ends = unbiased.split_slot(slot, C, M, bits)
    k = unbiased.split(gamma, beta, bits)
    base, start, row = resolve(key, M, what="stochastic")

    def rows(c0, c1):
        _forward_rows(out[c0:c1], codes[c0 * M * bits // 8:c1 * M * bits // 8], ends[c0:c1], x[c0:c1],
                      mean[c0:c1], rstd[c0:c1], gamma[c0:c1], beta[c0:c1], k[c0:c1], 1 << bits, bool(naive),
                      c0, U64(base), start, row, numpy.empty(GROUP, numpy.uint8),
                      numpy.empty(GROUP, numpy.float32), *_box(), bits)
    cpu._over_channels(rows, C, M)


def unit_backward(dx, dgamma, dbeta, dr, slot, gamma, beta, rstd, bits, accumulate):
    """The fused BN-ReLU backward of UnbiasedCodeUnits (ops.bn_relu_backward on the slot's x-tilde
    under the exact mask, without a decode buffer):

        dy = dr * (code >= k),  dgamma += sum(dy * x-tilde),  dbeta += sum(dy)
        dx = (or += with accumulate) gamma*rstd * (dy - mean(dy) - x-tilde * mean(dy * x-tilde))

    # saved: the unbiased code (x-tilde with E = x-hat, exact mask) and rstd (C,) exact.
    dr (C, M) float32 is read only; dx may alias it. Channels split over lowmem's threads."""
    bits = unbiased.check_bits(bits)
    C, M = dr.shape
    _check(dr, M, bits, "backward")
    if dx.shape != (C, M):
        raise ValueError(f"dx must have dr's shape {(C, M)}, got {dx.shape}")
    codes, ends = unbiased.split_slot(slot, C, M, bits)
    k = unbiased.split(gamma, beta, bits)
    inplace = cpu._overlap(dx, dr)

    def rows(c0, c1):
        _backward_rows(dx[c0:c1], dgamma[c0:c1], dbeta[c0:c1], dr[c0:c1], codes[c0 * M * bits // 8:c1 * M * bits // 8],
                       ends[c0:c1], gamma[c0:c1], beta[c0:c1], rstd[c0:c1], k[c0:c1], 1 << bits, bits,
                       bool(accumulate), inplace, numpy.empty(GROUP, numpy.uint8),
                       numpy.empty(GROUP, numpy.float32), numpy.empty(GROUP, numpy.float32), *_box())
    cpu._over_channels(rows, C, M)
