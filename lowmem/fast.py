"""Fused CPU kernels (numba), the CPU analogue of CuPy's fused GPU kernels.

Optional: `pip install lowmem[fast]`. Without numba, or with LOWMEM_FAST=0,
the engine runs the pure-NumPy ops of lowmem/ops and lowmem/quant, which stay
the reference these kernels are tested against (tests/test_fast.py).

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
    from numba import njit, prange
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
    _opts = dict(parallel=True, cache=True, nogil=True)

    @njit(**_opts)
    def _stats(x, mean, var):
        """mean, var (biased) per row of x (C, M); float64 accumulation, two passes."""
        C, M = x.shape
        for c in prange(C):
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
        for c in prange(C):
            m, r, g, b = mean[c], rstd[c], gamma[c], beta[c]
            for i in range(M):
                xh = (x[c, i] - m) * r
                xhat[c, i] = xh
                y = xh * g + b
                out[c, i] = y if y > 0 else F0

    @njit(**_opts)
    def _forward_code(out, packed, x, mean, rstd, gamma, beta, s, lo, k, w, top, bits, naive):
        """Normalise, quantize and pack x-hat; out = relu(y) (approx) or the decoded
        relu(x-tilde*gamma + beta) (naive). One pass over x after the statistics."""
        C, M = x.shape
        per = 8 // bits
        rowbytes = M // per
        for c in prange(C):
            m, r, g, b = mean[c], rstd[c], gamma[c], beta[c]
            sc, l0, kc = s[c], lo[c], k[c]
            lower_pos, upper_neg = kc, kc - 1
            for j in range(rowbytes):
                byte = 0
                for q in range(per):
                    i = j * per + q
                    xh = (x[c, i] - m) * r
                    y = xh * g + b
                    v = numpy.floor((xh * sc - l0) / w)
                    code = 0 if v < 0 else (top if v > top else int(v))
                    if y > 0:
                        if code < lower_pos:
                            code = lower_pos
                    else:
                        if code > upper_neg:
                            code = upper_neg
                    byte |= code << (q * bits)
                    if naive:
                        if code >= kc:
                            xt = ((F32(code) + HALF) * w + l0) * sc
                            out[c, i] = xt * g + b
                        else:
                            out[c, i] = F0
                    else:
                        out[c, i] = y if y > 0 else F0
                packed[c * rowbytes + j] = byte

    @njit(**_opts)
    def _conv_input_code(u, packed, s, lo, k, w, gamma, beta, bits):
        """u = x-tilde*gamma + beta where the decoded mask is set, else 0 (quant.decode_relu)."""
        C, M = u.shape
        per = 8 // bits
        rowbytes = M // per
        mask_bits = (1 << bits) - 1
        for c in prange(C):
            sc, l0, kc, g, b = s[c], lo[c], k[c], gamma[c], beta[c]
            for j in range(rowbytes):
                byte = packed[c * rowbytes + j]
                for q in range(per):
                    code = (byte >> (q * bits)) & mask_bits
                    if code >= kc:
                        xt = ((F32(code) + HALF) * w + l0) * sc
                        u[c, j * per + q] = xt * g + b
                    else:
                        u[c, j * per + q] = F0

    @njit(**_opts)
    def _conv_input_exact(u, xhat, gamma, beta):
        C, M = u.shape
        for c in prange(C):
            g, b = gamma[c], beta[c]
            for i in range(M):
                y = xhat[c, i] * g + b
                u[c, i] = y if y > 0 else F0

    @njit(**_opts)
    def _backward_code(dx, dgamma, dbeta, dr, packed, s, lo, k, w, gamma, rstd, bits, accumulate):
        """BN-ReLU backward from packed codes: two passes per row, no decode buffer."""
        C, M = dr.shape
        per = 8 // bits
        rowbytes = M // per
        mask_bits = (1 << bits) - 1
        for c in prange(C):
            sc, l0, kc = s[c], lo[c], k[c]
            sdy = 0.0
            sdyx = 0.0
            for j in range(rowbytes):
                byte = packed[c * rowbytes + j]
                for q in range(per):
                    code = (byte >> (q * bits)) & mask_bits
                    if code >= kc:
                        xt = ((F32(code) + HALF) * w + l0) * sc
                        dy = dr[c, j * per + q]
                        sdy += dy
                        sdyx += dy * xt
            dgamma[c] += sdyx
            dbeta[c] += sdy
            a = gamma[c] * rstd[c]
            mdy = sdy / M
            mdyx = sdyx / M
            for j in range(rowbytes):
                byte = packed[c * rowbytes + j]
                for q in range(per):
                    i = j * per + q
                    code = (byte >> (q * bits)) & mask_bits
                    xt = ((F32(code) + HALF) * w + l0) * sc
                    dy = dr[c, i] if code >= kc else 0.0
                    g = a * (dy - mdy - xt * mdyx)
                    if accumulate:
                        dx[c, i] += g
                    else:
                        dx[c, i] = g

    @njit(**_opts)
    def _backward_exact(dx, dgamma, dbeta, dr, xhat, gamma, beta, rstd, accumulate):
        C, M = dr.shape
        for c in prange(C):
            g, b = gamma[c], beta[c]
            sdy = 0.0
            sdyx = 0.0
            for i in range(M):
                xh = xhat[c, i]
                if xh * g + b > 0:
                    dy = dr[c, i]
                    sdy += dy
                    sdyx += dy * xh
            dgamma[c] += sdyx
            dbeta[c] += sdy
            a = g * rstd[c]
            mdy = sdy / M
            mdyx = sdyx / M
            for i in range(M):
                xh = xhat[c, i]
                dy = dr[c, i] if xh * g + b > 0 else 0.0
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
