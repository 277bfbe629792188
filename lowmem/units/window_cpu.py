"""Fused CPU kernels (numba) for the BN-ReLU units, the CPU twin of lowmem/units/window_gpu.py.

bn_stats, unit_forward_exact, unit_forward_code, conv_input and unit_backward:
units/fused.py wraps them into the engine's kernel sets. (The conv's numba
col2im sits beside the conv, in lowmem/ops/columns_cpu.py.)

Optional: `pip install lowmem[fast]`. Without numba, or with LOWMEM_FAST=0,
the engine runs the pure-NumPy ops of lowmem/ops and lowmem/units/window.py, which stay
the reference these kernels are tested against (tests/units/test_window_cpu.py).

Why: in NumPy every elementwise step is a full pass over memory. One unit's
BN -> ReLU -> quantize -> pack is about a dozen passes; its backward
(unpack, decode, mask, two reductions, the BN formula) another dozen. Here
each is one loop per channel row that reads the input once for statistics
and once to produce everything else.

Layout: (C, M) rows, M = N*H*W, as everywhere in lowmem. Codes: the packed
layout of lowmem/units/window.py (element i at bits (i % (8/K))*K of byte i // (8/K));
a fused kernel writes or reads one channel's codes as whole bytes, so it
applies when M*bits is a multiple of 8 (every real network: H*W is);
`supports()` says when.

How they vectorise (AVX2/AVX-512: benchmarks/compare_torch.py counts the
ymm/zmm registers of each compiled kernel through numba's `inspect_asm`): a row is
walked in blocks of BLOCK elements. Per block, one contiguous loop does the
float work (normalise, quantize, or decode) element by element, with the
codes in a small L1-resident uint8 scratch, one code per byte; a second loop
packs or unpacks that scratch, 8/K codes per byte. Written the other way
(shifting each code into its byte inside the float loop) LLVM must
de-interleave neighbours and gives up on the backward reductions (what each
choice cost when measured: docs/performance.md, "How the kernels are written").

Cores: the engine-facing functions split their channels over lowmem's
threads (lowmem/system/threads.py; the kernels release the GIL).

Kernels are compiled for float32 only (cached on disk by numba). What they share with
units/unbiased_cpu.py (constants, block sizes, the packer, the channel split) is units/cpu_base.py.

Arithmetic: element-wise float maths is written in the dtype of the data,
one rounding per operation, in the same order as the NumPy path, so:
  * the quantizer's codes equal window.quantize_pack's for the same x-hat;
  * the decoded x-tilde and mask equal window.unpack_decode's;
  * exact and approx modes still give bit-identical forward passes.
Reductions accumulate in float64 (NumPy's pairwise float32 sums differ in the
last bits: tests compare to tolerance there).
"""
import numpy

from . import window
from .cpu_base import AVAILABLE, BLOCK, GRAIN, SHORT_ROW, _over_channels, _overlap, supports  # noqa: F401 (the API)

if AVAILABLE:
    from numba import njit
    from .cpu_base import (F0, F32, GOLDEN, HALF, OFF_MID, OFF_SCALE, U64, _copy, _counter_bits, _opts, _pack,
                           _pack_rows, _reduce, _rows_per_pack, _unpack, _unpack_rows, _window_split)

    @njit(**_reduce)
    def _stats(x, mean, var):
        """mean, var (biased) per row of x (C, M); float64 accumulation, two passes."""
        C, M = x.shape
        for c in range(C):
            s = 0.0
            for i in range(M):
                s += x[c, i]
            m = s / M
            q = 0.0
            for i in range(M):
                d = x[c, i] - m
                q += d * d
            mean[c] = m
            var[c] = q / M

    @njit(**_opts)
    def _forward_exact(out, xhat, x, mean, rstd, gamma, beta):
        """xhat = (x - mean)*rstd (saved, float); out = relu(xhat*gamma + beta). out may alias x:
        per block, the second loop reads xhat (still in cache), never x, so neither loop both
        reads and writes one array (see _quantize_block)."""
        C, M = x.shape
        for c in range(C):
            m, r, g, b = mean[c], rstd[c], gamma[c], beta[c]
            for i0 in range(0, M, BLOCK):
                i1 = min(M, i0 + BLOCK)
                xr, hr, orow = x[c, i0:i1], xhat[c, i0:i1], out[c, i0:i1]
                for t in range(hr.size):
                    hr[t] = (xr[t] - m) * r
                for t in range(hr.size):
                    y = hr[t] * g + b
                    orow[t] = y if y > 0 else F0

    # ---- one block of one row: the float work, contiguous ----

    @njit(**_opts)
    def _grid(s, lo, k, gamma, beta, L, consts):
        """s, lo, k (C,) <- window.quant_params' grid of each channel, its float32 operations in its
        order (t = -β/|γ|; k = clip(rint((t + W)/w), 1, L-1); lo = clip(t - k*w, -W - w/2, -W + w/2);
        γ == 0: s = 1, lo = -W, k = 0 if β > 0 else L). consts: float32 W, w, -W - w/2, -W + w/2 (one
        array: numba's dispatch costs per argument). Returns False (the grid unwritten past that
        channel) at a γ or β that is inf or NaN."""
        W, w, lo_min, lo_max = consts[0], consts[1], consts[2], consts[3]
        for c in range(gamma.size):
            g, b = gamma[c], beta[c]
            if not (abs(g) < numpy.inf and abs(b) < numpy.inf):
                return False
            s[c], t, kr = _window_split(g, b, L, W, w)
            if g == 0:
                lo[c] = -W
                k[c] = 0 if b > 0 else L
            else:
                lo[c] = min(max(t - kr * w, lo_min), lo_max)
                k[c] = numpy.int32(kr)
        return True

    @njit(**_opts)
    def _quantize_block(codes, ys, xr, m, r, g, b, sc, l0, kf, km1, ftop, w):
        """codes <- the clamped code of x-hat = (x - m)*r; ys <- relu(y), y = x-hat*g + b.
        The same operations, in the same order, as window.quantize_pack. Both outputs are
        scratch, never the caller's out: out may alias x, and a loop that reads and writes
        the same array fails LLVM's overlap check and runs scalar."""
        for t in range(xr.size):
            xh = (xr[t] - m) * r
            y = xh * g + b
            pos = y > F0
            v = numpy.floor((xh * sc - l0) / w)
            v = max(v, kf if pos else F0)          # the mask clamp, as window.quantize_pack
            v = min(v, ftop if pos else km1)
            codes[t] = numpy.uint8(numpy.int32(v))
            ys[t] = y if pos else F0

    @njit(**_opts)
    def _quantize_block_stochastic(codes, ys, xr, m, r, g, b, sc, l0, kf, km1, ftop, w, z0):
        """_quantize_block with stochastic rounding: + d before the floor, d of element t from
        counter z0 + t*GOLDEN (z0: the block's first element's counter, stream.random_offsets's
        mix64(key) + (i + 1)*GOLDEN), the same integer and float operations as window.quantize_pack."""
        for t in range(xr.size):
            xh = (xr[t] - m) * r
            y = xh * g + b
            pos = y > F0
            d = (F32(_counter_bits(z0 + U64(t) * GOLDEN)) - OFF_MID) * OFF_SCALE    # exact
            v = numpy.floor((xh * sc - l0) / w + d)
            v = max(v, kf if pos else F0)
            v = min(v, ftop if pos else km1)
            codes[t] = numpy.uint8(numpy.int32(v))
            ys[t] = y if pos else F0

    @njit(**_opts)
    def _decode_relu_block(orow, codes, sc, l0, kf, w, g, b):
        """orow <- x-tilde*g + b where the decoded mask (code >= k) is set and that value is > 0,
        else 0 (window.decode_relu: an open code decoded below the threshold gives 0)."""
        for t in range(orow.size):
            v = F32(codes[t])
            xt = ((v + HALF) * w + l0) * sc
            y = xt * g + b
            orow[t] = y if (v >= kf) & (y > F0) else F0

    @njit(**_reduce)
    def _decode_sums(codes, drow, sc, l0, kf, w):
        """(sum dy, sum dy*x-tilde) over one block, dy = dr masked by code >= k. float32 within
        the block (vectorised 8 wide; the caller adds the blocks in float64: as accurate as
        NumPy's pairwise float32 sums, which the reference uses)."""
        sdy = F0
        sdyx = F0
        for t in range(drow.size):
            v = F32(codes[t])
            xt = ((v + HALF) * w + l0) * sc
            dy = drow[t] if v >= kf else F0
            sdy += dy
            sdyx += dy * xt
        return sdy, sdyx

    @njit(**_opts)
    def _decode_dx_block(dxr, codes, drow, sc, l0, kf, w, a, mdy, mdyx, accumulate):
        """dx (=, or += with accumulate) a*(dy - mean(dy) - x-tilde*mean(dy*x-tilde)) for a block.
        dxr must not alias drow (see _quantize_block)."""
        if accumulate:
            for t in range(drow.size):
                v = F32(codes[t])
                xt = ((v + HALF) * w + l0) * sc
                dy = drow[t] if v >= kf else F0
                dxr[t] += a * (dy - mdy - xt * mdyx)
        else:
            for t in range(drow.size):
                v = F32(codes[t])
                xt = ((v + HALF) * w + l0) * sc
                dy = drow[t] if v >= kf else F0
                dxr[t] = a * (dy - mdy - xt * mdyx)

    @njit(**_reduce)
    def _exact_sums(xhat_row, dr_row, g, b):
        """(sum dy, sum dy*x-hat) over one block, dy = dr masked by x-hat*g + b > 0 (float32, as above)."""
        sdy = F0
        sdyx = F0
        for i in range(dr_row.size):
            xh = xhat_row[i]
            dy = dr_row[i] if xh * g + b > 0 else F0
            sdy += dy
            sdyx += dy * xh
        return sdy, sdyx

    @njit(**_opts)
    def _exact_dx_block(dxr, xhat_row, dr_row, g, b, a, mdy, mdyx, accumulate):
        if accumulate:
            for i in range(dr_row.size):
                xh = xhat_row[i]
                dy = dr_row[i] if xh * g + b > 0 else F0
                dxr[i] += a * (dy - mdy - xh * mdyx)
        else:
            for i in range(dr_row.size):
                xh = xhat_row[i]
                dy = dr_row[i] if xh * g + b > 0 else F0
                dxr[i] = a * (dy - mdy - xh * mdyx)

    # ---- whole (C, M) arrays ----

    @njit(**_opts)
    def _forward_code(out, packed, x, mean, rstd, gamma, beta, s, lo, k, w, top, bits, naive, inplace,
                      stochastic, base, c_first, m_all, start):
        """Normalise, quantize and pack x-hat; out = relu(y) (approx) or the decoded
        relu(x-tilde*gamma + beta) (naive). inplace: out overlaps x, so relu(y) goes through
        scratch (see _quantize_block); else straight into out. stochastic: round with the
        stream starting at base (uint64); row c here is row c_first + c, and element i of it has
        the global counter (c_first + c)*m_all + start + i (units/stream.py)."""
        C, M = x.shape
        per = 8 // bits
        codes = numpy.empty(BLOCK, numpy.uint8)
        ys = numpy.empty(BLOCK, numpy.float32)
        ftop = F32(top)
        for c in range(C):
            kf, km1 = F32(k[c]), F32(k[c] - 1)
            for i0 in range(0, M, BLOCK):
                i1 = min(M, i0 + BLOCK)
                cb, orow = codes[:i1 - i0], out[c, i0:i1]
                yb = ys[:i1 - i0] if inplace or naive else orow
                if stochastic:
                    z0 = base + U64((c_first + c) * m_all + start + i0 + 1) * GOLDEN
                    _quantize_block_stochastic(cb, yb, x[c, i0:i1], mean[c], rstd[c], gamma[c], beta[c],
                                               s[c], lo[c], kf, km1, ftop, w, z0)
                else:
                    _quantize_block(cb, yb, x[c, i0:i1], mean[c], rstd[c], gamma[c], beta[c],
                                    s[c], lo[c], kf, km1, ftop, w)
                if naive:                                  # continue from the decoded value
                    _decode_relu_block(orow, cb, s[c], lo[c], kf, w, gamma[c], beta[c])
                elif inplace:
                    _copy(orow, yb)
                _pack(packed[(c * M + i0) // per:(c * M + i1) // per], cb, bits)

    @njit(**_opts)
    def _forward_code_short(out, packed, x, mean, rstd, gamma, beta, s, lo, k, w, top, bits, naive, inplace,
                            stochastic, base, c_first, m_all, start):
        """_forward_code for rows of at most SHORT_ROW elements (cpu_base._rows_per_pack): a row is
        one block, and the codes of a block's worth of rows wait side by side in the scratch, as
        in the slot, for one call of the packer."""
        C, M = x.shape
        R = _rows_per_pack(M)
        codes = numpy.empty(BLOCK, numpy.uint8)
        ys = numpy.empty(M, numpy.float32)
        ftop = F32(top)
        for c0 in range(0, C, R):
            c1 = min(C, c0 + R)
            for c in range(c0, c1):
                kf, km1 = F32(k[c]), F32(k[c] - 1)
                cb, orow = codes[(c - c0) * M:(c - c0 + 1) * M], out[c]
                yb = ys if inplace or naive else orow
                if stochastic:
                    z0 = base + U64((c_first + c) * m_all + start + 1) * GOLDEN
                    _quantize_block_stochastic(cb, yb, x[c], mean[c], rstd[c], gamma[c], beta[c],
                                               s[c], lo[c], kf, km1, ftop, w, z0)
                else:
                    _quantize_block(cb, yb, x[c], mean[c], rstd[c], gamma[c], beta[c], s[c], lo[c], kf, km1, ftop, w)
                if naive:                                  # continue from the decoded value
                    _decode_relu_block(orow, cb, s[c], lo[c], kf, w, gamma[c], beta[c])
                elif inplace:
                    _copy(orow, yb)
            _pack_rows(packed, codes, c0, c1, M, bits)

    @njit(**_opts)
    def _conv_input_code(u, packed, s, lo, k, w, gamma, beta, bits):
        """u = relu(x-tilde*gamma + beta) where the decoded mask is set, else 0 (window.decode_relu)."""
        C, M = u.shape
        per = 8 // bits
        codes = numpy.empty(BLOCK, numpy.uint8)
        for c in range(C):
            kf = F32(k[c])
            for i0 in range(0, M, BLOCK):
                i1 = min(M, i0 + BLOCK)
                cb = codes[:i1 - i0]
                _unpack(cb, packed[(c * M + i0) // per:(c * M + i1) // per], bits)
                _decode_relu_block(u[c, i0:i1], cb, s[c], lo[c], kf, w, gamma[c], beta[c])

    @njit(**_opts)
    def _conv_input_code_short(u, packed, s, lo, k, w, gamma, beta, bits):
        """_conv_input_code for rows of at most SHORT_ROW elements: a block's worth of rows
        unpacked in one call."""
        C, M = u.shape
        R = _rows_per_pack(M)
        codes = numpy.empty(BLOCK, numpy.uint8)
        for c0 in range(0, C, R):
            c1 = min(C, c0 + R)
            _unpack_rows(codes, packed, c0, c1, M, bits)
            for c in range(c0, c1):
                _decode_relu_block(u[c], codes[(c - c0) * M:(c - c0 + 1) * M], s[c], lo[c], F32(k[c]), w, gamma[c],
                                   beta[c])

    @njit(**_opts)
    def _conv_input_exact(u, xhat, gamma, beta):
        C, M = u.shape
        for c in range(C):
            g, b = gamma[c], beta[c]
            for i in range(M):
                y = xhat[c, i] * g + b
                u[c, i] = y if y > 0 else F0

    @njit(**_opts)
    def _backward_code(dx, dgamma, dbeta, dr, packed, s, lo, k, w, gamma, rstd, bits, accumulate, inplace):
        """BN-ReLU backward from packed codes: two passes per row (sums, then dx), each
        unpacking block by block into L1 scratch; no decode buffer. inplace: dx overlaps dr
        (the engine's usual case), so dx goes through scratch, see _quantize_block."""
        C, M = dr.shape
        per = 8 // bits
        codes = numpy.empty(BLOCK, numpy.uint8)
        tmp = numpy.empty(BLOCK, numpy.float32)
        for c in range(C):
            sc, l0, kf = s[c], lo[c], F32(k[c])
            sdy = 0.0
            sdyx = 0.0
            for i0 in range(0, M, BLOCK):
                i1 = min(M, i0 + BLOCK)
                cb = codes[:i1 - i0]
                _unpack(cb, packed[(c * M + i0) // per:(c * M + i1) // per], bits)
                a1, a2 = _decode_sums(cb, dr[c, i0:i1], sc, l0, kf, w)
                sdy += a1
                sdyx += a2
            dgamma[c] += sdyx
            dbeta[c] += sdy
            a = F32(gamma[c] * rstd[c])
            mdy, mdyx = F32(sdy / M), F32(sdyx / M)
            for i0 in range(0, M, BLOCK):
                i1 = min(M, i0 + BLOCK)
                cb = codes[:i1 - i0]
                _unpack(cb, packed[(c * M + i0) // per:(c * M + i1) // per], bits)
                if accumulate or not inplace:
                    _decode_dx_block(dx[c, i0:i1], cb, dr[c, i0:i1], sc, l0, kf, w, a, mdy, mdyx, accumulate)
                else:
                    tb = tmp[:i1 - i0]
                    _decode_dx_block(tb, cb, dr[c, i0:i1], sc, l0, kf, w, a, mdy, mdyx, False)
                    _copy(dx[c, i0:i1], tb)

    @njit(**_opts)
    def _backward_code_short(dx, dgamma, dbeta, dr, packed, s, lo, k, w, gamma, rstd, bits, accumulate, inplace):
        """_backward_code for rows of at most SHORT_ROW elements: a block's worth of rows unpacked
        in one call, once for both passes of each row."""
        C, M = dr.shape
        R = _rows_per_pack(M)
        codes = numpy.empty(BLOCK, numpy.uint8)
        tmp = numpy.empty(M, numpy.float32)
        for c0 in range(0, C, R):
            c1 = min(C, c0 + R)
            _unpack_rows(codes, packed, c0, c1, M, bits)
            for c in range(c0, c1):
                sc, l0, kf = s[c], lo[c], F32(k[c])
                cb = codes[(c - c0) * M:(c - c0 + 1) * M]
                a1, a2 = _decode_sums(cb, dr[c], sc, l0, kf, w)
                sdy = 0.0 + a1                                  # one block: its float32 sums, in float64
                sdyx = 0.0 + a2
                dgamma[c] += sdyx
                dbeta[c] += sdy
                a = F32(gamma[c] * rstd[c])
                mdy, mdyx = F32(sdy / M), F32(sdyx / M)
                if accumulate or not inplace:
                    _decode_dx_block(dx[c], cb, dr[c], sc, l0, kf, w, a, mdy, mdyx, accumulate)
                else:
                    _decode_dx_block(tmp, cb, dr[c], sc, l0, kf, w, a, mdy, mdyx, False)
                    _copy(dx[c], tmp)

    @njit(**_opts)
    def _backward_exact(dx, dgamma, dbeta, dr, xhat, gamma, beta, rstd, accumulate, inplace):
        """The float-slot twin of _backward_code, blocked the same way."""
        C, M = dr.shape
        tmp = numpy.empty(BLOCK, numpy.float32)
        for c in range(C):
            g, b = gamma[c], beta[c]
            sdy = 0.0
            sdyx = 0.0
            for i0 in range(0, M, BLOCK):
                i1 = min(M, i0 + BLOCK)
                a1, a2 = _exact_sums(xhat[c, i0:i1], dr[c, i0:i1], g, b)
                sdy += a1
                sdyx += a2
            dgamma[c] += sdyx
            dbeta[c] += sdy
            a = F32(g * rstd[c])
            mdy, mdyx = F32(sdy / M), F32(sdyx / M)
            for i0 in range(0, M, BLOCK):
                i1 = min(M, i0 + BLOCK)
                if accumulate or not inplace:
                    _exact_dx_block(dx[c, i0:i1], xhat[c, i0:i1], dr[c, i0:i1], g, b, a, mdy, mdyx, accumulate)
                else:
                    tb = tmp[:i1 - i0]
                    _exact_dx_block(tb, xhat[c, i0:i1], dr[c, i0:i1], g, b, a, mdy, mdyx, False)
                    _copy(dx[c, i0:i1], tb)


# ---- the engine-facing functions (same maths as lowmem/ops + lowmem/units/window.py) ----
# Each splits its channels into contiguous ranges, one per lowmem thread
# (threads.parallel_for); channel c's codes are bytes [c*M*K/8, (c+1)*M*K/8).

def quant_params(gamma, beta, bits):
    """window.quant_params(gamma, beta, bits), the same grid bit for bit, from one kernel call
    instead of a dozen (C,) NumPy operations (it runs three times per unit per step: forward,
    conv input, backward). float32 γ, β with finite values; anything else (a non-finite parameter,
    whose grid NumPy's casts define) takes window's."""
    if not (AVAILABLE and type(gamma) is numpy.ndarray and gamma.dtype == beta.dtype == numpy.float32
            and gamma.ndim == 1 and beta.shape == gamma.shape):
        return window.quant_params(gamma, beta, bits)
    W, w = window.half_width(bits), window.bin_width(bits)
    C = gamma.shape[0]
    s, lo, k = numpy.empty(C, numpy.float32), numpy.empty(C, numpy.float32), numpy.empty(C, numpy.int32)
    consts = numpy.array([W, w, -W - w / 2, -W + w / 2], numpy.float32)     # exact: see window.half_width
    if not _grid(s, lo, k, gamma, beta, 1 << bits, consts):
        return window.quant_params(gamma, beta, bits)
    return window.QuantParams(bits, s, lo, k, gamma.copy(), beta.copy())


# Each kernel's time per element over a plain copy's, one core (benchmarks/unit_kernels.py,
# --threads 1, units of 256 x 1024 and 1024 x 256; AMD EPYC Zen 4): how many rows a thread must
# get before a call is split (cpu_base._over_channels).
COST = {"stats": 2, "forward exact": 1.5, "forward code": 3, "forward code, stochastic": 6,
        "conv input exact": 1, "conv input code": 2, "backward exact": 3, "backward code": 4}


def _w(qp):
    return numpy.dtype(qp.dtype).type(qp.w)


def _code_rows(packed, c0, c1, M, bits):
    return packed[c0 * M * bits // 8:c1 * M * bits // 8]


def bn_stats(mean, var, rstd, x, eps):
    """mean, var (biased), rstd (C,) of x (C, M)."""
    C, M = x.shape
    _over_channels(lambda c0, c1: _stats(x[c0:c1], mean[c0:c1], var[c0:c1]), C, M, COST["stats"])
    numpy.add(var, eps, out=rstd)
    numpy.sqrt(rstd, out=rstd)
    numpy.reciprocal(rstd, out=rstd)


def unit_forward_exact(out, xhat, x, mean, rstd, gamma, beta):
    C, M = x.shape
    _over_channels(lambda c0, c1: _forward_exact(out[c0:c1], xhat[c0:c1], x[c0:c1], mean[c0:c1],
                                                 rstd[c0:c1], gamma[c0:c1], beta[c0:c1]), C, M, COST["forward exact"])


def unit_forward_code(out, packed, x, mean, rstd, gamma, beta, qp, naive, rounding="nearest", key=None):
    """Normalise, quantize (rounding "nearest" or "stochastic-window" with the stream of `key`, as
    window.quantize_pack) and pack x-hat; out = relu(y), or naive's decoded relu."""
    C, M = x.shape
    w, top, bits, inplace = _w(qp), qp.levels - 1, qp.bits, _overlap(out, x)
    stream = window.stream_base(window.check_window_rounding(rounding, "window_cpu.unit_forward_code"), key, M)
    stochastic = stream is not None
    base, start, row = stream if stochastic else (0, 0, M)
    base = numpy.uint64(base)

    kernel = _forward_code_short if M <= SHORT_ROW else _forward_code

    def rows(c0, c1):
        kernel(out[c0:c1], _code_rows(packed, c0, c1, M, bits), x[c0:c1], mean[c0:c1], rstd[c0:c1],
               gamma[c0:c1], beta[c0:c1], qp.s[c0:c1], qp.lo[c0:c1], qp.k[c0:c1], w, top, bits, naive,
               inplace, stochastic, base, c0, row, start)
    _over_channels(rows, C, M, COST["forward code, stochastic" if stochastic else "forward code"])


def conv_input(u, xhat, packed, qp, gamma, beta):
    """u = relu(gamma*x-hat + beta) from the float slot (xhat) or the code (packed)."""
    C, M = u.shape
    if packed is None:
        _over_channels(lambda c0, c1: _conv_input_exact(u[c0:c1], xhat[c0:c1], gamma[c0:c1], beta[c0:c1]),
                       C, M, COST["conv input exact"])
        return
    w, bits = _w(qp), qp.bits
    kernel = _conv_input_code_short if M <= SHORT_ROW else _conv_input_code
    _over_channels(lambda c0, c1: kernel(u[c0:c1], _code_rows(packed, c0, c1, M, bits), qp.s[c0:c1],
                                         qp.lo[c0:c1], qp.k[c0:c1], w, gamma[c0:c1], beta[c0:c1], bits),
                   C, M, COST["conv input code"])


def unit_backward(dx, dgamma, dbeta, dr, xhat, packed, qp, gamma, beta, rstd, accumulate):
    C, M = dr.shape
    inplace = _overlap(dx, dr)
    if packed is None:
        def rows(c0, c1):
            _backward_exact(dx[c0:c1], dgamma[c0:c1], dbeta[c0:c1], dr[c0:c1], xhat[c0:c1], gamma[c0:c1],
                            beta[c0:c1], rstd[c0:c1], accumulate, inplace)
    else:
        w, bits = _w(qp), qp.bits
        kernel = _backward_code_short if M <= SHORT_ROW else _backward_code

        def rows(c0, c1):
            kernel(dx[c0:c1], dgamma[c0:c1], dbeta[c0:c1], dr[c0:c1], _code_rows(packed, c0, c1, M, bits),
                   qp.s[c0:c1], qp.lo[c0:c1], qp.k[c0:c1], w, gamma[c0:c1], rstd[c0:c1], bits, accumulate, inplace)
    _over_channels(rows, C, M, COST["backward code" if packed is not None else "backward exact"])
