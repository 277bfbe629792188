"""numba kernels of the unbiased group-range code (units/unbiased.py): the forward (normalise,
find each group's range, draw and pack the codes, write relu(y)), the decodes (x-tilde or the
conv input; optionally the gradient's masking) and the fused BN-ReLU backward.

How they vectorise (as units/window_cpu.py's kernels): a channel's row is walked in blocks of
cpu_base.BLOCK elements (16 groups of 256); per block the codes sit in an L1 uint8 buffer, one per
byte (cpu_base._pack/_unpack move them to and from the slot), and the float work is 1-D loops,
branch-free (selects, unconditional stores), one per group where the group's levels enter,
each reading its group's constants before it starts. What is fixed for a channel or a call
(γ = 0, relu, naive, accumulate) picks a loop outside the loop. The forward normalises a block
into a float buffer first, so no loop both reads x and writes out (out may alias x); the
group ranges are int32 max/min over order-preserving keys of the float bits. error_model=
"numpy": no zero check on a float division (it stops LLVM vectorising; the divisions are the
reference's own, kept as divisions). One call per block, not per group (the variants tried and
what they cost: docs/performance.md, "How the kernels are written"); the per-block helpers
compiled with the row loops' own options are inlined into them (inline="always"): on rows of 64
and 256 elements, where a row is one block, the calls were a tenth to a fifth of a kernel's time.
_sums, which may reassociate, stays a call (inlined, it would take its caller's strict float
options and not vectorise).

Arithmetic: every float operation of unbiased.metadata, Levels and _encode_piece, one rounding
each, in the same order (float32 only, no fastmath outside the backward's sums), and the
counter stream of units/stream.py in uint64: the slot equals unbiased.quantize_pack's byte for
byte for the same x-hat and key (tests/units/test_unbiased.py); `decode` gives
unbiased.decode_each_chunk's x-tilde or conv input bit for bit. `unit_backward`: the reference's
formulas (ops.bn_relu_backward on that x-tilde under the exact mask), its sums in float32 within
a block and float64 across blocks, so dgamma, dbeta and dx agree to float32 rounding
(tests/units/test_unbiased_cpu.py).
"""
import functools

import numpy

from . import cpu_base, stream, unbiased, window
from .stream import resolve

AVAILABLE = cpu_base.AVAILABLE

if AVAILABLE:
    from numba import njit
    F32, U64 = numpy.float32, numpy.uint64
    F0 = F32(0)
    INF = F32(numpy.inf)
    GOLDEN = cpu_base.GOLDEN
    R_SCALE = F32(2.0 ** -stream.OFFSET_BITS)
    R_UNIT = F32(2.0 ** stream.OFFSET_BITS)
    R_MASK = numpy.int32((1 << stream.OFFSET_BITS) - 1)
    HALF = numpy.int32(1 << (stream.OFFSET_BITS - 1))
    WEYL = numpy.int64(unbiased.WEYL)
    HALF_F = F32(HALF)
    # the dithered code's t*WEYL mod 2**24 of a group's element t (unbiased.weyl_bits from 0),
    # that less 2**24 and its negation, as float32 (exact: at most 2**24 in magnitude)
    # (a row's last group holds up to 2*GROUP - 1 elements)
    WEYL_F = unbiased.weyl_bits(numpy.zeros(1, numpy.int64), 2 * unbiased.GROUP)[0].astype(F32)
    WEYL_WRAP = WEYL_F - R_UNIT
    WEYL_NEG = -WEYL_WRAP
    GROUP, LANES, SYSTEMATIC_BITS = unbiased.GROUP, unbiased.LANES, unbiased.SYSTEMATIC_BITS
    BLOCK = cpu_base.BLOCK             # a multiple of GROUP: blocks are whole groups
    SPAN = BLOCK + GROUP               # a row's last block also takes its last group's remainder
    _opts = dict(cache=True, nogil=True, error_model="numpy")
    _reduce = dict(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "nsz"})

    # ---- per channel and per group: the constants of unbiased.Levels ----

    @njit(**_opts)
    def _channel(g, b, L, W, w):
        """(s, zero, ag, t_o, t_c, k, kf) of a channel from γ and β alone: sign(γ) (+1 for γ = 0),
        γ == 0, |γ|, the threshold t = −β/|γ| as the open side's floor (−inf where γ = 0) and as
        the closed side's ceiling (+inf there), and the split k (unbiased.split: the window
        code's k of window.quant_params, window W and bin w, clipped to [2, L−2]; 0 or L where
        γ = 0), as an int and a float: the same float32 operations, so the same k."""
        s, t, kr = cpu_base._window_split(g, b, L, W, w)               # quant_params' clip
        zero = g == 0
        ag = abs(g)
        t_o = -INF if zero else t
        t_c = INF if zero else t
        kc = (0 if b > 0 else L) if zero else (min(max(int(kr), 2), L - 2) if kr == kr else 2)
        return s, zero, ag, t_o, t_c, kc, F32(kc)

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
    def _bf16_value(b, box, bits_view):
        bits_view[0] = numpy.uint32(b) << numpy.uint32(16)
        return box[0]

    @njit(inline="always")
    def _row_levels(lv, ends, c, t_o, t_c, kc, L, box, bits_view):
        """lv[gi] <- (base_o, step_o, base_c, step_c) of every group gi of row c (stored ends)."""
        for gi in range(lv.shape[0]):
            bo, so, bc, sc = _levels(_bf16_value(ends[c, gi, 0], box, bits_view),
                                     _bf16_value(ends[c, gi, 1], box, bits_view), t_o, t_c, kc, L)
            lv[gi, 0], lv[gi, 1], lv[gi, 2], lv[gi, 3] = bo, so, bc, sc

    # ---- one block of a row (BLOCK elements, whole groups) ----
    # A row's blocks: BLOCK elements each, the last one to the row's end (_block_end: it also
    # takes a remainder shorter than a group); the groups of a block: GROUP elements each but
    # the row's last group, which runs to the row's end (unbiased.groups).

    @njit(inline="always")
    def _block_end(i0, M):
        i1 = i0 + BLOCK
        return M if M - i1 < GROUP else i1

    @njit(inline="always")
    def _groups(n):
        """Groups in a block of n elements (whole groups, or the row's last block)."""
        return max(1, n // GROUP)

    @njit(inline="always")
    def _group(q, nq, n):
        """(q0, q1): group q's elements within a block of n elements and nq groups."""
        q0 = q * GROUP
        return q0, (n if q == nq - 1 else q0 + GROUP)
    # Per group q of the block its constants are read before a loop over its elements: indexed
    # unsigned (a signed index that does not start at 0 keeps numba's negative-index wraparound,
    # which stops LLVM vectorising), or over the group's slices where the loop writes a float
    # array it also reads from (LLVM's runtime overlap check needs them).

    @njit(inline="always")
    def _normalise(xb, xr, m, r):
        """xb <- x-hat = (x - m)*r (a buffer: out may alias x)."""
        for t in range(xr.size):
            xb[t] = (xr[t] - m) * r

    # float32 bits as int32 keys that order as the floats do (-0 below +0)
    I31, S31_32, F_INF_BITS = numpy.int32(0x7FFFFFFF), numpy.int32(31), numpy.int32(0x7F800000)
    K_NINF, K_INF = (numpy.int32(b ^ ((b >> 31) & 0x7FFFFFFF)) for b in
                     numpy.array([-numpy.inf, numpy.inf], numpy.float32).view(numpy.int32))

    SIGN = numpy.int32(-0x80000000)
    I0 = numpy.int32(0)

    @njit(**_opts)
    def _key_bits(key):
        return numpy.int32(key ^ ((key >> S31_32) & I31))

    @njit(**_opts)
    def _range(xi, t0, t1, neg):
        """The float bits (int32) of (max, min) of u = x-hat*s over xi[t0:t1] (x-hat's bits;
        t0, t1 uint64; neg: s = -1), as max/min element by element give them (NaNs skipped; of
        equal values the first kept, so a 0's sign is the first 0's). Through int32 keys (a
        float max with a carried select does not vectorise); u = ±x-hat exactly, so its bits
        are x-hat's with the sign flipped where s = -1."""
        hi, lo = K_NINF, K_INF
        for t in range(t0, t1):
            v = xi[t]
            key = numpy.int32(v ^ ((v >> S31_32) & I31))           # int32 throughout: 16 lanes
            ok = (v & I31) <= F_INF_BITS                            # not a NaN
            kh = key if ok else K_NINF
            kl = key if ok else K_INF
            hi = kh if kh > hi else hi
            lo = kl if kl < lo else lo
        hb, lb = _key_bits(hi), _key_bits(lo)
        if neg:
            hb, lb = numpy.int32(lb ^ SIGN), numpy.int32(hb ^ SIGN)
        if (hb & I31) == 0 or (lb & I31) == 0:        # -0 and +0 tie: the first 0 decides
            for t in range(t0, t1):
                if (xi[t] & I31) == 0:
                    z = numpy.int32(xi[t] ^ SIGN) if neg else xi[t]
                    hb = z if (hb & I31) == 0 else hb
                    lb = z if (lb & I31) == 0 else lb
                    break
        return hb, lb

    @njit(**_opts)
    def _bf16_bits(fb, up):
        """The bf16 bits (uint16) next to the float with bits fb, outward (unbiased._bf16):
        toward zero, then one step out where that moved a positive value down (up) or a
        negative one up (down)."""
        u = numpy.uint32(fb)
        b = u >> numpy.uint32(16)
        if (u & numpy.uint32(0xFFFF)) != 0 and ((u >> numpy.uint32(31)) != 0) != up:
            b += numpy.uint32(1)
        return numpy.uint16(b)

    @njit(inline="always")
    def _block_ranges(ends, lv, xi, c, gi0, neg, t_o, t_c, kc, L, box, bits_view):
        """Per group of the block (the first one gi0 of row c; xi: x-hat's bits): its range of
        u = x-hat*s, stored as bf16 ends (outward), and its levels (into lv)."""
        n = xi.size
        nq = _groups(n)
        for q in range(nq):
            q0, q1 = _group(q, nq, n)
            hb, lb = _range(xi, U64(q0), U64(q1), neg)
            bh, bl = _bf16_bits(hb, True), _bf16_bits(lb, False)
            ends[c, gi0 + q, 0] = bh
            ends[c, gi0 + q, 1] = bl
            bo, so, bc, sc = _levels(_bf16_value(bh, box, bits_view), _bf16_value(bl, box, bits_view),
                                     t_o, t_c, kc, L)
            lv[gi0 + q, 0], lv[gi0 + q, 1], lv[gi0 + q, 2], lv[gi0 + q, 3] = bo, so, bc, sc

    @njit(inline="always")
    def _position(xh, g, b, s, bo, so, bc, sc):
        """(p, on, y) of one element (unbiased._encode_block) from its x-hat and its group's
        levels: y = x-hat*g + b, on = y > 0, p = (u − base)/step of its side (0 where the side's
        step is 0), u = x-hat*s."""
        y = xh * g + b
        on = y > 0
        u = xh * s
        bb = bo if on else bc
        st = so if on else sc
        p = (u - bb) / st
        return (p if st > 0 else F0), on, y

    @njit(inline="always")
    def _code(p, rf, on, n_open, kf):
        """The code of an element at position p on its side (on: open) with its draw R < 2**24
        as a float32 rf (exact): floor(p + R*2**−24) clamped to the side's levels."""
        p = p + rf * R_SCALE
        nn = n_open if on else kf
        j = min(max(numpy.floor(p), F0), nn - F32(1))
        code = kf + j if on else j
        return numpy.uint8(numpy.int32(code))

    @njit(inline="always")
    def _drawn(xh, g, b, s, bo, so, bc, sc, n_open, kf, rf):
        """(code, relu(y)) of one element from its x-hat, its group's levels and its draw rf."""
        p, on, y = _position(xh, g, b, s, bo, so, bc, sc)
        return _code(p, rf, on, n_open, kf), (y if on else F0)

    @njit(**_opts)
    def _draw_each(codes, orow, xb, lv, gi0, g, b, s, kf, L, z0):
        """codes <- the block's codes when each element draws its own uniform (unbiased._encode_block,
        from its groups' levels lv): at K >= 3 bits element t's own counter z0 + t*GOLDEN.
        orow <- relu(y), y = x-hat*g + b."""
        n = xb.size
        n_open = F32(L) - kf
        nq = _groups(n)
        for q in range(nq):
            bo, so, bc, sc = lv[gi0 + q, 0], lv[gi0 + q, 1], lv[gi0 + q, 2], lv[gi0 + q, 3]
            q0, q1 = _group(q, nq, n)
            xq, cq, oq = xb[q0:q1], codes[q0:q1], orow[q0:q1]
            zq = z0 + U64(q0) * GOLDEN
            for t in range(xq.size):
                rf = F32(cpu_base._counter_bits(zq + U64(t) * GOLDEN))                   # < 2**24: exact
                cq[t], oq[t] = _drawn(xq[t], g, b, s, bo, so, bc, sc, n_open, kf, rf)

    @njit(**_opts)
    def _draw_dither(codes, orow, xb, lv, gi0, g, b, s, kf, L, z0):
        """codes <- the block's codes of the dithered code (unbiased.weyl_uniforms): element t of
        a group draws R = (u0 + t*WEYL) mod 2**24 from the group's draw u0 (counter z0 + (its
        first element)*GOLDEN), in float32: u0 − (2**24 − t*WEYL mod 2**24) where that is >= 0,
        else u0 + t*WEYL mod 2**24 (each exact: below 2**24 in magnitude), so the loop
        vectorises 16 wide (the same R in int64 ran at half the speed). orow <- relu(y),
        y = x-hat*g + b."""
        n = xb.size
        n_open = F32(L) - kf
        nq = _groups(n)
        for q in range(nq):
            bo, so, bc, sc = lv[gi0 + q, 0], lv[gi0 + q, 1], lv[gi0 + q, 2], lv[gi0 + q, 3]
            q0, q1 = _group(q, nq, n)
            xq, cq, oq = xb[q0:q1], codes[q0:q1], orow[q0:q1]
            u0 = F32(cpu_base._counter_bits(z0 + U64(q0) * GOLDEN))                  # < 2**24: exact
            for t in range(xq.size):
                v = u0 - WEYL_NEG[t]
                rf = v if v >= F0 else u0 + WEYL_F[t]
                cq[t], oq[t] = _drawn(xq[t], g, b, s, bo, so, bc, sc, n_open, kf, rf)

    @njit(inline="always")
    def _dither_a(z0, q0):
        """a = 2**23 − u0 (float32, exact) of the group whose first element is q0 (its draw u0
        from counter z0 + q0*GOLDEN): what _dither turns into each element's offset."""
        return F32(HALF - numpy.int32(cpu_base._counter_bits(z0 + U64(q0) * GOLDEN)))

    @njit(inline="always")
    def _dither(a, t):
        """The dithered code's d = (2**23 − R)*2**−24 of element t of a group (unbiased's
        dither_offsets, R = (u0 + t*WEYL) mod 2**24) from the group's a = 2**23 − u0:
        a − t*WEYL mod 2**24, plus 2**24 where that is at most −2**23; in float32, exact where
        kept (in (−2**23, 2**23]), so it vectorises 16 wide."""
        v = a - WEYL_F[t]
        return (v if v > -HALF_F else a - WEYL_WRAP[t]) * R_SCALE

    if LANES != 4:              # _draw_systematic's sums reach four rows of four lanes back
        raise RuntimeError(f"the numba 2-bit draw is written for 4 lanes, unbiased.LANES is {LANES}")
    AHEAD = 4 * LANES           # the sums' reach: R of element t from R of element t − AHEAD
    A1, A2, A3, A4 = U64(LANES), U64(2 * LANES), U64(3 * LANES), U64(AHEAD)

    @njit(inline="always")
    def _draw_systematic(codes, orow, xb, lv, gi0, g, b, s, kf, L, z0, pb, qs, eo, ec):
        """codes <- the block's codes at 2 bits (unbiased._encode_block, from its groups' levels
        lv; each group's draw from counter z0 + (its first element)*GOLDEN, then unbiased's
        systematic sampling along each lane of each side); orow <- relu(y), y = x-hat*g + b.
        Scratch: pb float32 (2*GROUP: p), qs, eo, ec int32 (2*GROUP + AHEAD).

        Per group two loops, both vectorised. The first: p, y and q = floor(f*2**24) of each
        element, q stored as q on the open side and ~q (negative) on the closed one, so one
        array carries both sides and the side. The second: each element's R on both sides,
        from the element AHEAD = 4 lanes' rows back,

            R_o[t] = R_o[t − 16] + q_o[t − 16] + q_o[t − 12] + q_o[t − 8] + q_o[t − 4]

        (and R_c from q_c): lane l's running sum, as unbiased.systematic_uniforms's, since t and
        t − 16 share a lane and the four terms are that lane's elements between them; then the
        code. A reach of 16 lets LLVM run the loop 16 int32 wide with R in registers (a reach of
        4, e[t] = e[t − 4] + q[t − 4], limits it to 4). The first 16 entries of eo, ec hold each
        lane's start (the sums from there on are its start) and of qs zeros, so the loop starts
        at the group's first element. The sums wrap at 2**32; R takes their low 24 bits (2**24
        divides 2**32). Indices are unsigned (see _group's note). The variants measured against
        it: docs/performance.md."""
        n = xb.size
        n_open = F32(L) - kf
        nq = _groups(n)
        for q in range(nq):
            bo, so, bc, sc = lv[gi0 + q, 0], lv[gi0 + q, 1], lv[gi0 + q, 2], lv[gi0 + q, 3]
            q0, q1 = _group(q, nq, n)
            xq, cq, oq = xb[q0:q1], codes[q0:q1], orow[q0:q1]
            m = xq.size
            sq = qs[AHEAD:AHEAD + m]
            for t in range(m):
                p, on, y = _position(xq[t], g, b, s, bo, so, bc, sc)
                f = p - numpy.floor(p)
                f = f if (f >= F0) & (f < F32(1)) else F0
                v = numpy.int32(f * R_UNIT)
                pb[t] = p
                sq[t] = v if on else ~v
                oq[t] = y if on else F0
            start = numpy.int64(cpu_base._counter_bits(z0 + U64(q0) * GOLDEN))       # < 2**24
            for l in range(LANES):                                  # unbiased.lane_starts
                ro = numpy.int32((start + l * WEYL) & R_MASK)
                rc = numpy.int32((ro + HALF) & R_MASK)
                for i in range(l, AHEAD, LANES):
                    eo[i], ec[i], qs[i] = ro, rc, I0
            for t in range(A4, U64(m) + A4):
                s4, s3, s2, s1 = qs[t - A4], qs[t - A3], qs[t - A2], qs[t - A1]
                ro = numpy.int32(eo[t - A4] + ((max(s4, I0) + max(s3, I0)) + (max(s2, I0) + max(s1, I0))))
                rc = numpy.int32(ec[t - A4] + ((max(~s4, I0) + max(~s3, I0)) + (max(~s2, I0) + max(~s1, I0))))
                eo[t] = ro
                ec[t] = rc
                on = qs[t] >= I0
                cq[t - A4] = _code(pb[t - A4], F32((ro if on else rc) & R_MASK), on, n_open, kf)

    @njit(inline="always")
    def _xtilde(orow, codes, lv, gi0, kf, s, dith, z0):
        """orow <- x-tilde = s*(base + j*step) of each code's side (dith: j + d, d of the groups'
        draws from counter z0, _dither)."""
        n = orow.size
        nq = _groups(n)
        for q in range(nq):
            bo, so, bc, sc = lv[gi0 + q, 0], lv[gi0 + q, 1], lv[gi0 + q, 2], lv[gi0 + q, 3]
            q0, q1 = _group(q, nq, n)
            oq, cq = orow[q0:q1], codes[q0:q1]
            if dith:
                a = _dither_a(z0, q0)
                for t in range(oq.size):
                    v = F32(cq[t])
                    d = _dither(a, t)
                    oq[t] = s * ((bo + ((v - kf) + d) * so) if v >= kf else (bc + (v + d) * sc))
            else:
                for t in range(oq.size):
                    v = F32(cq[t])
                    oq[t] = s * ((bo + (v - kf) * so) if v >= kf else (bc + v * sc))

    @njit(inline="always")
    def _conv_input(orow, codes, lv, gi0, kf, zero, b, ag, t_o, dith, z0):
        """orow <- the conv input: |γ|*((base_o − t) + j*step_o) (β where γ = 0), at least 0,
        on open codes; 0 on closed ones. dith: j + d (_dither, from counter z0), not clamped at 0."""
        n = orow.size
        if zero:
            val = b if dith else max(b, F0)
            for t in range(n):
                orow[t] = val if F32(codes[t]) >= kf else F0
            return
        nq = _groups(n)
        for q in range(nq):
            d, so = lv[gi0 + q, 0] - t_o, lv[gi0 + q, 1]
            q0, q1 = _group(q, nq, n)
            oq, cq = orow[q0:q1], codes[q0:q1]
            if dith:
                a = _dither_a(z0, q0)
                for t in range(oq.size):
                    v = F32(cq[t])
                    y = ag * (d + ((v - kf) + _dither(a, t)) * so)
                    oq[t] = y if v >= kf else F0
            else:
                for t in range(oq.size):
                    v = F32(cq[t])
                    y = max(ag * (d + (v - kf) * so), F0)
                    oq[t] = y if v >= kf else F0

    @njit(inline="always")
    def _mask(drow, codes, kf):
        """drow *= the exact mask (code >= k), as a select (0 where closed)."""
        for t in range(drow.size):
            drow[t] = drow[t] if F32(codes[t]) >= kf else F0

    @njit(**_reduce)
    def _sums(drow, codes, lv, gi0, kf, s, dith, z0):
        """(sum dy, sum dy*x-tilde) over one block, dy = dr masked by code >= k, x-tilde decoded
        inline (dith: j + d, _dither from counter z0); float32 within the block (vectorised),
        the caller adds the blocks in float64."""
        n = drow.size
        sdy = F0
        sdyx = F0
        nq = _groups(n)
        for q in range(nq):
            bo, so, bc, sc = lv[gi0 + q, 0], lv[gi0 + q, 1], lv[gi0 + q, 2], lv[gi0 + q, 3]
            q0, q1 = _group(q, nq, n)
            rq, cq = drow[q0:q1], codes[q0:q1]
            if dith:
                a = _dither_a(z0, q0)
                for t in range(rq.size):
                    v = F32(cq[t])
                    on = v >= kf
                    dy = rq[t] if on else F0
                    d = _dither(a, t)
                    sdy += dy
                    sdyx += dy * (s * ((bo + ((v - kf) + d) * so) if on else (bc + (v + d) * sc)))
            else:
                for t in range(rq.size):
                    v = F32(cq[t])
                    on = v >= kf
                    dy = rq[t] if on else F0
                    sdy += dy
                    sdyx += dy * (s * ((bo + (v - kf) * so) if on else (bc + v * sc)))
        return sdy, sdyx

    @njit(inline="always")
    def _dx(dxr, drow, codes, lv, gi0, kf, s, a, mdy, mdyx, accumulate, dith, z0):
        """dx (=, or += with accumulate) a*(dy - mean(dy) - x-tilde*mean(dy*x-tilde)) for a
        block, x-tilde decoded inline (dith: j + d, _dither from counter z0). dxr must not alias
        drow (see window_cpu._quantize_block)."""
        n = drow.size
        nq = _groups(n)
        for q in range(nq):
            bo, so, bc, sc = lv[gi0 + q, 0], lv[gi0 + q, 1], lv[gi0 + q, 2], lv[gi0 + q, 3]
            q0, q1 = _group(q, nq, n)
            dq, rq, cq = dxr[q0:q1], drow[q0:q1], codes[q0:q1]
            if dith:
                da = _dither_a(z0, q0)
                if accumulate:
                    for t in range(rq.size):
                        v = F32(cq[t])
                        on = v >= kf
                        d = _dither(da, t)
                        xt = s * ((bo + ((v - kf) + d) * so) if on else (bc + (v + d) * sc))
                        dq[t] += a * ((rq[t] if on else F0) - mdy - xt * mdyx)
                else:
                    for t in range(rq.size):
                        v = F32(cq[t])
                        on = v >= kf
                        d = _dither(da, t)
                        xt = s * ((bo + ((v - kf) + d) * so) if on else (bc + (v + d) * sc))
                        dq[t] = a * ((rq[t] if on else F0) - mdy - xt * mdyx)
            elif accumulate:
                for t in range(rq.size):
                    v = F32(cq[t])
                    on = v >= kf
                    xt = s * ((bo + (v - kf) * so) if on else (bc + v * sc))
                    dq[t] += a * ((rq[t] if on else F0) - mdy - xt * mdyx)
            else:
                for t in range(rq.size):
                    v = F32(cq[t])
                    on = v >= kf
                    xt = s * ((bo + (v - kf) * so) if on else (bc + v * sc))
                    dq[t] = a * ((rq[t] if on else F0) - mdy - xt * mdyx)

    # ---- whole (C, M) rows, block by block ----

    @njit(inline="always")
    def _block_counter(base, start, row, r, i0):
        """The counter of element i0 of row r (stream.draw_bits' z for resolve()'s (base, start,
        row)): the forward, the decodes and the backward all draw from it."""
        return base + U64(r * row + start + i0 + 1) * GOLDEN

    @njit(**_opts)
    def _forward_rows(out, slot_codes, ends, x, mean, rstd, gamma, beta, W, w, L, naive, c_first,
                      base, start, row, bits, dith, box, bits_view):
        C, M = x.shape
        per = 8 // bits
        codes = numpy.empty(SPAN, numpy.uint8)
        xb = numpy.empty(SPAN, numpy.float32)
        xi = xb.view(numpy.int32)
        lv = numpy.empty((ends.shape[1], 4), numpy.float32)
        pb = numpy.empty(2 * GROUP, numpy.float32)
        qs, eo = numpy.empty(2 * GROUP + AHEAD, numpy.int32), numpy.empty(2 * GROUP + AHEAD, numpy.int32)
        ec = numpy.empty(2 * GROUP + AHEAD, numpy.int32)
        R = cpu_base._rows_per_pack(M)             # short rows: packed R at a time
        for c0 in range(0, C, R):
            c1 = min(C, c0 + R)
            for c in range(c0, c1):
                g, b = gamma[c], beta[c]
                s, zero, ag, t_o, t_c, kc, kf = _channel(g, b, L, W, w)
                o = (c - c0) * M                     # the row's codes in the scratch (0 for a long row: R = 1)
                i0, i1 = 0, 0
                while i1 < M:
                    i0, i1 = i1, _block_end(i1, M)
                    xg, cg, orow = xb[:i1 - i0], codes[o:o + i1 - i0], out[c, i0:i1]
                    _normalise(xg, x[c, i0:i1], mean[c], rstd[c])
                    z0 = _block_counter(base, start, row, c_first + c, i0)
                    _block_ranges(ends, lv, xi[:i1 - i0], c, i0 // GROUP, s < 0, t_o, t_c, kc, L, box, bits_view)
                    if dith:
                        _draw_dither(cg, orow, xg, lv, i0 // GROUP, g, b, s, kf, L, z0)
                    elif bits <= SYSTEMATIC_BITS:
                        _draw_systematic(cg, orow, xg, lv, i0 // GROUP, g, b, s, kf, L, z0, pb, qs, eo, ec)
                    else:
                        _draw_each(cg, orow, xg, lv, i0 // GROUP, g, b, s, kf, L, z0)
                    if naive:                       # continue from the decoded value
                        _conv_input(orow, cg, lv, i0 // GROUP, kf, zero, b, ag, t_o, dith, z0)
                    if R == 1:
                        cpu_base._pack(slot_codes[(c * M + i0) // per:(c * M + i1) // per], cg, bits)
            if R > 1:
                cpu_base._pack_rows(slot_codes, codes, c0, c1, M, bits)

    @njit(**_opts)
    def _decode_rows(out, dr, slot_codes, ends, gamma, beta, W, w, L, relu, mask_dr, bits, dith, c_first,
                     base, start, row, box, bits_view):
        """out <- x-tilde (relu False) or the conv input (relu True); mask_dr: dr *= the mask.
        dith: the dithered code, its offsets from the stream (base, start, row; rows from c_first)."""
        C, M = out.shape
        per = 8 // bits
        codes = numpy.empty(SPAN, numpy.uint8)
        lv = numpy.empty((ends.shape[1], 4), numpy.float32)
        R = cpu_base._rows_per_pack(M)             # short rows: unpacked R at a time
        for c0 in range(0, C, R):
            c1 = min(C, c0 + R)
            if R > 1:
                cpu_base._unpack_rows(codes, slot_codes, c0, c1, M, bits)
            for c in range(c0, c1):
                s, zero, ag, t_o, t_c, kc, kf = _channel(gamma[c], beta[c], L, W, w)
                _row_levels(lv, ends, c, t_o, t_c, kc, L, box, bits_view)
                o = (c - c0) * M
                i0, i1 = 0, 0
                while i1 < M:
                    i0, i1 = i1, _block_end(i1, M)
                    cg, orow = codes[o:o + i1 - i0], out[c, i0:i1]
                    if R == 1:
                        cpu_base._unpack(cg, slot_codes[(c * M + i0) // per:(c * M + i1) // per], bits)
                    z0 = _block_counter(base, start, row, c_first + c, i0)
                    if relu:
                        _conv_input(orow, cg, lv, i0 // GROUP, kf, zero, beta[c], ag, t_o, dith, z0)
                    else:
                        _xtilde(orow, cg, lv, i0 // GROUP, kf, s, dith, z0)
                    if mask_dr:
                        _mask(dr[c, i0:i1], cg, kf)

    @njit(**_opts)
    def _backward_rows(dx, dgamma, dbeta, dr, slot_codes, ends, gamma, beta, rstd, W, w, L, bits,
                       accumulate, inplace, dith, c_first, base, start, row, box, bits_view):
        """BN-ReLU backward from the slot: two passes per row (sums, then dx), each unpacking
        block by block into L1 scratch and decoding x-tilde inline (the row's group levels
        computed once); no decode buffer. inplace: dx overlaps dr, so dx goes through tmp (see
        window_cpu._quantize_block)."""
        C, M = dr.shape
        per = 8 // bits
        codes = numpy.empty(SPAN, numpy.uint8)
        tmp = numpy.empty(SPAN, numpy.float32)
        lv = numpy.empty((ends.shape[1], 4), numpy.float32)
        R = cpu_base._rows_per_pack(M)             # short rows: unpacked R at a time, once for both passes
        for c0 in range(0, C, R):
            c1 = min(C, c0 + R)
            if R > 1:
                cpu_base._unpack_rows(codes, slot_codes, c0, c1, M, bits)
            for c in range(c0, c1):
                s, zero, ag, t_o, t_c, kc, kf = _channel(gamma[c], beta[c], L, W, w)
                _row_levels(lv, ends, c, t_o, t_c, kc, L, box, bits_view)
                o = (c - c0) * M
                sdy = 0.0
                sdyx = 0.0
                i0, i1 = 0, 0
                while i1 < M:
                    i0, i1 = i1, _block_end(i1, M)
                    cg = codes[o:o + i1 - i0]
                    if R == 1:
                        cpu_base._unpack(cg, slot_codes[(c * M + i0) // per:(c * M + i1) // per], bits)
                    z0 = _block_counter(base, start, row, c_first + c, i0)
                    a1, a2 = _sums(dr[c, i0:i1], cg, lv, i0 // GROUP, kf, s, dith, z0)
                    sdy += a1
                    sdyx += a2
                dgamma[c] += sdyx
                dbeta[c] += sdy
                a = F32(gamma[c] * rstd[c])
                mdy, mdyx = F32(sdy / M), F32(sdyx / M)
                i0, i1 = 0, 0
                while i1 < M:
                    i0, i1 = i1, _block_end(i1, M)
                    cg = codes[o:o + i1 - i0]
                    if R == 1:
                        cpu_base._unpack(cg, slot_codes[(c * M + i0) // per:(c * M + i1) // per], bits)
                    z0 = _block_counter(base, start, row, c_first + c, i0)
                    if accumulate or not inplace:
                        _dx(dx[c, i0:i1], dr[c, i0:i1], cg, lv, i0 // GROUP, kf, s, a, mdy, mdyx, accumulate, dith,
                            z0)
                    else:
                        tb = tmp[:i1 - i0]
                        _dx(tb, dr[c, i0:i1], cg, lv, i0 // GROUP, kf, s, a, mdy, mdyx, False, dith, z0)
                        cpu_base._copy(dx[c, i0:i1], tb)


# Each kernel's time per element over a plain copy's, one core (benchmarks/unit_kernels.py
# --rounding stochastic or dither, --threads 1, units of 256 x 1024 and 1024 x 256; AMD EPYC Zen 4):
# the forward by its draws (unbiased.default_draws, or the dithered code's), the decodes, the
# backward. How many rows a thread must get before a call is split (cpu_base._over_channels).
COST = {"systematic": 12, "independent": 10, "dither": 7, "decode": 3, "backward": 6}


def _box():
    """A 1-element float32 box and its uint32 view (per thread: the bf16 conversions)."""
    b = numpy.empty(1, numpy.float32)
    return b, b.view(numpy.uint32)


def _window(bits, gamma):
    """quant_params' window W and bin w as float32 (what the kernels derive the split k from)."""
    if gamma.dtype != numpy.float32:
        raise ValueError(f"the numba unbiased kernels need float32 gamma and beta, got {gamma.dtype}")
    return _window_of(bits)


@functools.lru_cache(maxsize=None)
def _window_of(bits):
    return numpy.float32(window.half_width(bits)), numpy.float32(window.bin_width(bits))


def _check(x, M, bits, what):
    if not cpu_base.supports(numpy, x.dtype, M, bits):
        raise ValueError(f"the numba unbiased {what} needs float32 rows of M*bits a multiple of 8, "
                         f"got {x.dtype} M={M} at {bits} bits")


def _stream_of(slot, C, M, bits, dither):
    """(base uint64, start, row) from a dithered slot, typed as unit_forward passes them (a
    uint64 start or row would make numba's index arithmetic float); zeros otherwise (not read)."""
    if not dither:
        return U64(0), 0, 0
    base, start, row = unbiased.read_stream(slot, C, M, bits)
    return U64(base), start, row


def decode(out, slot, gamma, beta, bits, relu=False, dr=None, dither=False):
    """unbiased.decode_each_chunk's output (x-tilde, or the conv input with relu=True), bit for
    bit, in one numba pass; with dr (C, M): dr *= the exact mask (the backward's masking).
    dither: a dithered slot (rounding "dither")."""
    bits = unbiased.check_bits(bits)
    C, M = out.shape
    _check(out, M, bits, "decode")
    codes, ends = unbiased.split_slot(slot, C, M, bits, dither)
    W, w = _window(bits, gamma)
    mask_dr = dr is not None
    drr = dr if mask_dr else out
    base, start, row = _stream_of(slot, C, M, bits, dither)

    def rows(c0, c1):
        _decode_rows(out[c0:c1], drr[c0:c1], codes[c0 * M * bits // 8:c1 * M * bits // 8], ends[c0:c1],
                     gamma[c0:c1], beta[c0:c1], W, w, 1 << bits, bool(relu), mask_dr, bits, bool(dither),
                     c0, base, start, row, *_box())
    cpu_base._over_channels(rows, C, M, COST["decode"])


def unit_forward(out, slot, x, mean, rstd, gamma, beta, bits, naive, key, dither=False):
    """The fused forward of UnbiasedCodeUnits: slot <- the unbiased code of x-hat = (x - mean)*rstd
    drawn from key (an integer or stream.Stream); out = relu(y) (approx) or the decoded conv input
    (naive). x, out (C, M) float32 C-contiguous (out may alias x), M*bits a multiple of 8.
    dither: the dithered code (its stream written into the slot)."""
    bits = unbiased.check_bits(bits)
    C, M = x.shape
    _check(x, M, bits, "forward")
    codes, ends = unbiased.split_slot(slot, C, M, bits, dither)
    W, w = _window(bits, gamma)
    base, start, row = resolve(key, M, what="dither" if dither else "stochastic")
    if dither:
        unbiased.slot_stream(slot, C, M, bits)[:] = (base, start, row)

    def rows(c0, c1):
        _forward_rows(out[c0:c1], codes[c0 * M * bits // 8:c1 * M * bits // 8], ends[c0:c1], x[c0:c1],
                      mean[c0:c1], rstd[c0:c1], gamma[c0:c1], beta[c0:c1], W, w, 1 << bits, bool(naive),
                      c0, U64(base), start, row, bits, bool(dither), *_box())
    cpu_base._over_channels(rows, C, M, COST[unbiased.default_draws(bits) if not dither else "dither"])


def unit_backward(dx, dgamma, dbeta, dr, slot, gamma, beta, rstd, bits, accumulate, dither=False):
    """The fused BN-ReLU backward of UnbiasedCodeUnits (ops.bn_relu_backward on the slot's x-tilde
    under the exact mask, without a decode buffer):

        dy = dr * (code >= k),  dgamma += sum(dy * x-tilde),  dbeta += sum(dy)
        dx = (or += with accumulate) gamma*rstd * (dy - mean(dy) - x-tilde * mean(dy * x-tilde))

    # saved: the unbiased code (x-tilde with E = x-hat, exact mask) and rstd (C,) exact.
    dr (C, M) float32 is read only; dx may alias it. Channels split over lowmem's threads.
    dither: a dithered slot."""
    bits = unbiased.check_bits(bits)
    C, M = dr.shape
    _check(dr, M, bits, "backward")
    if dx.shape != (C, M):
        raise ValueError(f"dx must have dr's shape {(C, M)}, got {dx.shape}")
    codes, ends = unbiased.split_slot(slot, C, M, bits, dither)
    W, w = _window(bits, gamma)
    inplace = cpu_base._overlap(dx, dr)
    base, start, row = _stream_of(slot, C, M, bits, dither)

    def rows(c0, c1):
        _backward_rows(dx[c0:c1], dgamma[c0:c1], dbeta[c0:c1], dr[c0:c1], codes[c0 * M * bits // 8:c1 * M * bits // 8],
                       ends[c0:c1], gamma[c0:c1], beta[c0:c1], rstd[c0:c1], W, w, 1 << bits, bits,
                       bool(accumulate), inplace, bool(dither), c0, base, start, row, *_box())
    cpu_base._over_channels(rows, C, M, COST["backward"])
