"""Fused CPU kernels (numba), the CPU analogue of CuPy's fused GPU kernels.

Optional: `pip install lowmem[fast]`. Without numba, or with LOWMEM_FAST=0,
the engine runs the pure-NumPy ops of lowmem/ops and lowmem/quant, which stay
the reference these kernels are tested against (tests/test_kernels_cpu.py).

Why: in NumPy every elementwise step is a full pass over memory. One unit's
BN -> ReLU -> quantize -> pack is about a dozen passes; its backward
(unpack, decode, mask, two reductions, the BN formula) another dozen. Here
each is one loop per channel row that reads the input once for statistics
and once to produce everything else, in parallel over channels.

Layout: (C, M) rows, M = N*H*W, as everywhere in lowmem. Codes: the packed
layout of lowmem/quant.py; a fused kernel writes or reads one channel's
codes as whole bytes, so it applies when M*bits is a multiple of 8 (every
real network: H*W is); `supports()` says when.

Kernels are compiled for float32 only (cached on disk by numba).

Arithmetic: element-wise float maths is written in the dtype of the data,
one rounding per operation, in the same order as the NumPy path, so:
  * the quantizer's codes equal quant.quantize_pack's for the same x-hat;
  * the decoded x-tilde and mask equal quant.unpack_decode's;
  * exact and approx modes still give bit-identical forward passes.
Reductions accumulate in float64 (NumPy's pairwise float32 sums differ in the
last bits: tests compare to tolerance there).
"""
import os

import numpy

try:
    if os.environ.get("LOWMEM_FAST", "1").strip() in ("0", "false", "no"):
        raise ImportError("disabled by LOWMEM_FAST=0")
    import numba
    from numba import njit
    AVAILABLE = True
    F32 = numpy.float32
    F0, HALF = F32(0), F32(0.5)
except ImportError:                                        # pragma: no cover - optional
    AVAILABLE = False


def supports(xp, dtype, M, bits):
    """Whether the fused kernels apply: numba present, NumPy float32 arrays, byte-aligned rows.

    (float64 — used for gradient checks — always takes the NumPy reference path.)"""
    return AVAILABLE and xp is numpy and numpy.dtype(dtype) == numpy.float32 and (M * bits) % 8 == 0


if AVAILABLE:
    # Serial kernels: on a 2-core machine a parallel region competes with
    # OpenBLAS's spinning threads and loses (measured: slower than NumPy).
    # Each kernel is written as short, branch-free loops over a block of one
    # row so LLVM vectorises them; codes go through a small L1-sized scratch.
    _opts = dict(cache=True, nogil=True)
    _reduce = dict(cache=True, nogil=True, fastmath={"reassoc", "nsz"})   # sums may reorder
    BLOCK = 1024

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
        """xhat = (x - mean)*rstd (saved, float); out = relu(xhat*gamma + beta). out may alias x."""
        C, M = x.shape
        for c in range(C):
            m, r, g, b = mean[c], rstd[c], gamma[c], beta[c]
            for i in range(M):
                xh = (x[c, i] - m) * r
                xhat[c, i] = xh
                y = xh * g + b
                out[c, i] = y if y > 0 else F0

    @njit(**_opts)
    def _pack(packed, base, codes, n, bits):
        """packed[base + j] <- codes[j*per : (j+1)*per], little end first."""
        per = 8 // bits
        for j in range(n // per):
            byte = 0
            for q in range(per):
                byte |= codes[j * per + q] << (q * bits)
            packed[base + j] = byte

    @njit(**_opts)
    def _unpack(codes, packed, base, n, bits):
        per = 8 // bits
        top = (1 << bits) - 1
        for j in range(n // per):
            byte = packed[base + j]
            for q in range(per):
                codes[j * per + q] = (byte >> (q * bits)) & top

    @njit(**_opts)
    def _quantize_block(out, codes, x, i0, n, m, r, g, b, sc, l0, kf, km1, ftop, w, naive):
        """One block of one row: x-hat, its clamped code, and the unit's output."""
        for t in range(n):
            xh = (x[i0 + t] - m) * r
            y = xh * g + b
            pos = y > 0
            v = numpy.floor((xh * sc - l0) / w)
            v = max(v, kf if pos else F0)          # the mask clamp, as quant.quantize_pack
            v = min(v, ftop if pos else km1)
            codes[t] = numpy.uint8(v)
            if not naive:
                out[i0 + t] = y if pos else F0
        if naive:                                  # continue from the decoded value
            for t in range(n):
                v = F32(codes[t])
                xt = ((v + HALF) * w + l0) * sc
                out[i0 + t] = xt * g + b if v >= kf else F0

    @njit(**_opts)
    def _forward_code(out, packed, x, mean, rstd, gamma, beta, s, lo, k, w, top, bits, naive):
        """Normalise, quantize and pack x-hat; out = relu(y) (approx) or the decoded
        relu(x-tilde*gamma + beta) (naive). The same float operations, in the same
        order, as quant.quantize_pack and quant.decode_relu."""
        C, M = x.shape
        per = 8 // bits
        codes = numpy.empty(BLOCK, numpy.uint8)
        ftop = F32(top)
        for c in range(C):
            xr, orow = x[c], out[c]
            kf, km1 = F32(k[c]), F32(k[c] - 1)
            for i0 in range(0, M, BLOCK):
                n = min(BLOCK, M - i0)
                _quantize_block(orow, codes, xr, i0, n, mean[c], rstd[c], gamma[c], beta[c], s[c], lo[c],
                                kf, km1, ftop, w, naive)
                _pack(packed, (c * M + i0) // per, codes, n, bits)

    @njit(**_opts)
    def _conv_input_code(u, packed, s, lo, k, w, gamma, beta, bits):
        """u = x-tilde*gamma + beta where the decoded mask is set, else 0 (quant.decode_relu)."""
        C, M = u.shape
        per = 8 // bits
        codes = numpy.empty(BLOCK, numpy.uint8)
        for c in range(C):
            sc, l0, kf, g, b = s[c], lo[c], F32(k[c]), gamma[c], beta[c]
            for i0 in range(0, M, BLOCK):
                n = min(BLOCK, M - i0)
                _unpack(codes, packed, (c * M + i0) // per, n, bits)
                for t in range(n):
                    v = F32(codes[t])
                    xt = ((v + HALF) * w + l0) * sc
                    u[c, i0 + t] = xt * g + b if v >= kf else F0

    @njit(**_opts)
    def _conv_input_exact(u, xhat, gamma, beta):
        C, M = u.shape
        for c in range(C):
            g, b = gamma[c], beta[c]
            for i in range(M):
                y = xhat[c, i] * g + b
                u[c, i] = y if y > 0 else F0

    @njit(**_opts)
    def _decode_block(xt, dy, codes, dr_row, i0, n, sc, l0, kf, w):
        """x-tilde and the masked gradient of one block (exact arithmetic, no reassociation)."""
        for t in range(n):
            v = F32(codes[t])
            xt[t] = ((v + HALF) * w + l0) * sc
            dy[t] = dr_row[i0 + t] if v >= kf else F0

    @njit(**_reduce)
    def _block_sums(xt, dy, n):
        sdy = 0.0
        sdyx = 0.0
        for t in range(n):
            sdy += dy[t]
            sdyx += dy[t] * xt[t]
        return sdy, sdyx

    @njit(**_opts)
    def _dx_block(dxr, i0, n, xt, dy, a, mdy, mdyx, accumulate):
        """dx = gamma*rstd*(dy - mean(dy) - x-tilde*mean(dy*x-tilde)) for one block."""
        if accumulate:
            for t in range(n):
                dxr[i0 + t] += a * (dy[t] - mdy - xt[t] * mdyx)
        else:
            for t in range(n):
                dxr[i0 + t] = a * (dy[t] - mdy - xt[t] * mdyx)

    @njit(**_opts)
    def _backward_code(dx, dgamma, dbeta, dr, packed, s, lo, k, w, gamma, rstd, bits, accumulate):
        """BN-ReLU backward from packed codes: two passes per row, no decode buffer."""
        C, M = dr.shape
        per = 8 // bits
        codes = numpy.empty(BLOCK, numpy.uint8)
        xt = numpy.empty(BLOCK, numpy.float32)
        dy = numpy.empty(BLOCK, numpy.float32)
        for c in range(C):
            sc, l0, kf = s[c], lo[c], F32(k[c])
            sdy = 0.0
            sdyx = 0.0
            for i0 in range(0, M, BLOCK):
                n = min(BLOCK, M - i0)
                _unpack(codes, packed, (c * M + i0) // per, n, bits)
                _decode_block(xt, dy, codes, dr[c], i0, n, sc, l0, kf, w)
                a1, a2 = _block_sums(xt, dy, n)
                sdy += a1
                sdyx += a2
            dgamma[c] += sdyx
            dbeta[c] += sdy
            a = F32(gamma[c] * rstd[c])
            mdy, mdyx = F32(sdy / M), F32(sdyx / M)
            for i0 in range(0, M, BLOCK):
                n = min(BLOCK, M - i0)
                _unpack(codes, packed, (c * M + i0) // per, n, bits)
                _decode_block(xt, dy, codes, dr[c], i0, n, sc, l0, kf, w)
                _dx_block(dx[c], i0, n, xt, dy, a, mdy, mdyx, accumulate)

    @njit(**_reduce)
    def _exact_sums(xhat_row, dr_row, g, b, M):
        sdy = 0.0
        sdyx = 0.0
        for i in range(M):
            xh = xhat_row[i]
            dy = dr_row[i] if xh * g + b > 0 else F0
            sdy += dy
            sdyx += dy * xh
        return sdy, sdyx

    @njit(**_opts)
    def _backward_exact(dx, dgamma, dbeta, dr, xhat, gamma, beta, rstd, accumulate):
        C, M = dr.shape
        for c in range(C):
            g, b = gamma[c], beta[c]
            sdy, sdyx = _exact_sums(xhat[c], dr[c], g, b, M)
            dgamma[c] += sdyx
            dbeta[c] += sdy
            a = F32(g * rstd[c])
            mdy, mdyx = F32(sdy / M), F32(sdyx / M)
            for i in range(M):
                xh = xhat[c, i]
                dy = dr[c, i] if xh * g + b > 0 else F0
                v = a * (dy - mdy - xh * mdyx)
                if accumulate:
                    dx[c, i] += v
                else:
                    dx[c, i] = v


# ---- the engine-facing functions (same maths as lowmem/ops + lowmem/quant) ----

def _w(qp):
    return numpy.dtype(qp.dtype).type(qp.w)


def bn_stats(mean, var, rstd, x, eps):
    """mean, var (biased), rstd (C,) of x (C, M)."""
    _stats(x, mean, var)
    numpy.add(var, eps, out=rstd)
    numpy.sqrt(rstd, out=rstd)
    numpy.reciprocal(rstd, out=rstd)


def unit_forward_exact(out, xhat, x, mean, rstd, gamma, beta):
    _forward_exact(out, xhat, x, mean, rstd, gamma, beta)


def unit_forward_code(out, packed, x, mean, rstd, gamma, beta, qp, naive):
    _forward_code(out, packed, x, mean, rstd, gamma, beta, qp.s, qp.lo, qp.k, _w(qp),
                  qp.levels - 1, qp.bits, naive)


def conv_input(u, xhat, packed, qp, gamma, beta):
    """u = relu(gamma*x-hat + beta) from the float slot (xhat) or the code (packed)."""
    if packed is None:
        _conv_input_exact(u, xhat, gamma, beta)
    else:
        _conv_input_code(u, packed, qp.s, qp.lo, qp.k, _w(qp), gamma, beta, qp.bits)


def unit_backward(dx, dgamma, dbeta, dr, xhat, packed, qp, gamma, beta, rstd, accumulate):
    if packed is None:
        _backward_exact(dx, dgamma, dbeta, dr, xhat, gamma, beta, rstd, accumulate)
    else:
        _backward_code(dx, dgamma, dbeta, dr, packed, qp.s, qp.lo, qp.k, _w(qp), gamma, rstd,
                       qp.bits, accumulate)
