"""Batch norm on its own (no ReLU after it) in numba: the CPU twin of units/norm_gpu.py, beside
the BN-ReLU unit's kernels (units/window_cpu.py, whose bn_stats it shares).

    forward(out, xhat, x, mean, rstd, gamma, beta)
        xhat = (x - mean)*rstd (the exact slot, or out itself: see below), out = gamma*xhat + beta
    normalize(out, x, mean, rstd)                  out = x-hat (a code is then taken of it)
    apply(out, gamma, beta)                        out = gamma*out + beta, in place
    backward(dx, dgamma, dbeta, dy, xhat, gamma, rstd, accumulate)
        dgamma += sum(dy*xhat), dbeta += sum(dy), dx = (or +=) gamma*rstd*(dy - mean(dy) - xhat*mean(dy*xhat))
    forward_coded, forward_add_relu_coded, backward_coded
        the same with x-hat kept as its range code (approx mode): the code made in the pass that
        makes x-hat (rangecode_cpu.encode_block on each block in L1), and read in the passes that
        use it (decoded block by block), where x-hat went through a buffer to a separate encode
        and came back from a separate decode

The reference is ops/batchnorm.py (bn_normalize, bn_apply_forward, bn_backward). Layout: (C, M)
rows, M = N*H*W, each C-contiguous. Element-wise arithmetic is the reference's, operation for
operation in the data's dtype (no fastmath): the forward's x-hat and out equal bn_normalize's and
bn_apply_forward's bit for bit for the same mean and rstd. The backward's two sums accumulate
per block in the data's dtype and over blocks in float64 (NumPy's pairwise sums differ in the last
bits: to tolerance), then dx as bn_relu_backward_apply writes it.

Passes: the forward reads x once and writes x-hat and out in the same loop over a block (L1
scratch between them, so out may alias x); the backward reads dy and x-hat twice (sums, then dx).
The coded passes write or read the code instead of x-hat: the same bytes as range_encode of
normalize's x-hat, the same values as range_decode's, bit for bit (tests/units/test_norm_cpu.py);
the coded backward decodes a row once, into one row's scratch that the dx pass reads back from L2,
where the row is at most ROW_BYTES (the plan states that scratch), else in each pass.
benchmarks/norm_coded.py times them against the separate passes (figures: docs/performance.md).
Cores: channels split over lowmem's threads (units/cpu_base.py).
"""
import numpy

from ..system import threads
from . import rangecode_cpu
from .cpu_base import AVAILABLE, BLOCK, GRAIN, _over_channels, _overlap

if AVAILABLE:
    from numba import njit
    from ..ops.bitpack_cpu import decode_span, pack_any
    from .cpu_base import _copy, _opts, _reduce
    from .rangecode import GROUP
    from .rangecode_cpu import encode_block

    @njit(**_opts)
    def _normalize_block(h, xr, m, r):
        for t in range(xr.size):
            h[t] = (xr[t] - m) * r

    @njit(**_opts)
    def _apply_block(orow, h, g, b):
        for t in range(h.size):
            orow[t] = h[t] * g + b

    @njit(**_opts)
    def _forward(out, xhat, x, mean, rstd, gamma, beta, keep, apply):
        """Per block of a row: x-hat into L1 scratch, then (keep) into xhat and out = x-hat*gamma +
        beta (apply), else out = x-hat. x is read before out is written, block by block, and no
        loop reads and writes one array (out may alias x)."""
        C, M = x.shape
        h = numpy.empty(BLOCK, x.dtype)
        for c in range(C):
            m, r, g, b = mean[c], rstd[c], gamma[c], beta[c]
            for i0 in range(0, M, BLOCK):
                i1 = min(M, i0 + BLOCK)
                hb = h[:i1 - i0]
                _normalize_block(hb, x[c, i0:i1], m, r)
                if keep:
                    _copy(xhat[c, i0:i1], hb)
                if apply:
                    _apply_block(out[c, i0:i1], hb, g, b)
                else:
                    _copy(out[c, i0:i1], hb)

    @njit(**_opts)
    def _apply(out, gamma, beta):
        C, M = out.shape
        for c in range(C):
            g, b = gamma[c], beta[c]
            for i in range(M):
                out[c, i] = out[c, i] * g + b

    @njit(**_reduce)
    def _sums(dyr, hr, zero):
        """(sum dy, sum dy*x-hat) over one block, in the data's dtype (vectorised; the caller adds
        the blocks in float64)."""
        a = zero
        b = zero
        for t in range(dyr.size):
            a += dyr[t]
            b += dyr[t] * hr[t]
        return a, b

    @njit(**_opts)
    def _dx_block(dxr, dyr, hr, a, mdy, mdyx, accumulate):
        """dx (=, or +=) (dy - (x-hat*mean(dy*x-hat) + mean(dy))) * a: bn_relu_backward_apply's order."""
        if accumulate:
            for t in range(dyr.size):
                dxr[t] += (dyr[t] - (hr[t] * mdyx + mdy)) * a
        else:
            for t in range(dyr.size):
                dxr[t] = (dyr[t] - (hr[t] * mdyx + mdy)) * a

    @njit(**_opts)
    def _backward(dx, dgamma, dbeta, dy, xhat, gamma, rstd, accumulate, inplace, zero):
        """Two passes per row: the sums, then dx (through L1 scratch when dx overlaps dy)."""
        C, M = dy.shape
        tmp = numpy.empty(BLOCK, dy.dtype)
        f = numpy.empty(3, dy.dtype)                        # conversions into the data's dtype
        f[2] = M
        for c in range(C):
            s1 = 0.0
            s2 = 0.0
            for i0 in range(0, M, BLOCK):
                i1 = min(M, i0 + BLOCK)
                a1, a2 = _sums(dy[c, i0:i1], xhat[c, i0:i1], zero)
                s1 += a1
                s2 += a2
            f[0], f[1] = s1, s2                               # the sums in the data's dtype, as the reference's
            sum_dy, sum_dyx = f[0], f[1]
            dgamma[c] += sum_dyx
            dbeta[c] += sum_dy
            a = gamma[c] * rstd[c]
            mdy, mdyx = sum_dy / f[2], sum_dyx / f[2]
            for i0 in range(0, M, BLOCK):
                i1 = min(M, i0 + BLOCK)
                if accumulate or not inplace:
                    _dx_block(dx[c, i0:i1], dy[c, i0:i1], xhat[c, i0:i1], a, mdy, mdyx, accumulate)
                else:
                    tb = tmp[:i1 - i0]
                    _dx_block(tb, dy[c, i0:i1], xhat[c, i0:i1], a, mdy, mdyx, False)
                    _copy(dx[c, i0:i1], tb)


    @njit(**_opts)
    def _add_relu_block(rb, cb, hb, src, other, mean, rstd, gamma, beta, M, a, b, normalized, zero):
        """Flat elements [a, b) into L1 scratch: hb = x-hat ((x - mean)*rstd, or src itself when
        normalized), rb = relu(x-hat*gamma + beta + other) (numpy.maximum's: NaN passes, -0 and
        below become +0: zero), cb = [x-hat*gamma + beta + other > 0]; channel by channel (c = e // M).
        Each channel's run is indexed from 0 through slices and its select has no short circuit
        (`|`, not `or`): indexed as hb[t - a], numba's check for a negative index kept LLVM from
        vectorising, and the loop ran 2.8 ns per element on random signs (0.4 ns now)."""
        e = a
        while e < b:
            c = e // M
            e1 = min(b, (c + 1) * M)
            m, r, g, bb = mean[c], rstd[c], gamma[c], beta[c]
            s_, o_ = src[e:e1], other[e:e1]
            h_, c_, r_ = hb[e - a:e1 - a], cb[e - a:e1 - a], rb[e - a:e1 - a]
            for t in range(e1 - e):
                h = s_[t] if normalized else (s_[t] - m) * r
                z = (h * g + bb) + o_[t]
                on = z > 0
                h_[t] = h
                c_[t] = on
                r_[t] = z if on | (z != z) else zero
            e = e1

    @njit(**_opts)
    def _forward_add_relu(out, mask, xhat, src, other, mean, rstd, gamma, beta, M, b0, b1, keep, normalized, zero):
        """Blocks b0 .. b1 - 1 of BLOCK flat elements: the block's x-hat, relu output and mask bits
        in scratch (so out may alias src or other), then x-hat kept (keep), out and the mask's
        bytes written."""
        n = src.size
        hb = numpy.empty(BLOCK, src.dtype)
        rb = numpy.empty(BLOCK, src.dtype)
        cb = numpy.empty(BLOCK, numpy.uint8)
        for k in range(b0, b1):
            a, b = k * BLOCK, min(n, (k + 1) * BLOCK)
            _add_relu_block(rb, cb, hb, src, other, mean, rstd, gamma, beta, M, a, b, normalized, zero)
            if keep:
                _copy(xhat[a:b], hb[:b - a])
            _copy(out[a:b], rb[:b - a])
            pack_any(mask[a // 8:(b + 7) // 8], cb[:b - a], 1)   # a: a multiple of 8

    # ---- with x-hat kept as its range code (approx mode): the code made in the same pass ----

    @njit(**_opts)
    def _forward_add_relu_coded(out, mask, packed, scale, zero, src, other, mean, rstd, gamma, beta, M, b0, b1,
                                zero_f, h, hi, hu, ends, codes, f, par, bits, lev, fmax, big, nil_i, sign, inf_i,
                                inf_u):
        """_forward_add_relu with x-hat coded where it is made: per block, x-hat, the relu output and
        the mask bits in scratch, x-hat's range code from the scratch (rangecode_cpu.encode_block),
        then out and the mask's bytes."""
        n = src.size
        rb = numpy.empty(BLOCK, src.dtype)
        cb = numpy.empty(BLOCK, numpy.uint8)
        for k in range(b0, b1):
            a, b = k * BLOCK, min(n, (k + 1) * BLOCK)
            _add_relu_block(rb, cb, h, src, other, mean, rstd, gamma, beta, M, a, b, False, zero_f)
            encode_block(packed, scale, zero, h[:b - a], hi, hu, ends, codes, f, par, a, bits, lev, fmax, big, nil_i,
                         sign, inf_i, inf_u)
            _copy(out[a:b], rb[:b - a])
            pack_any(mask[a // 8:(b + 7) // 8], cb[:b - a], 1)   # a: a multiple of 8

    @njit(**_opts)
    def _forward_coded(out, packed, scale, zero, x, mean, rstd, gamma, beta, M, b0, b1, h, hi, hu, ends, codes, f,
                       par, bits, lev, fmax, big, nil_i, sign, inf_i, inf_u):
        """Blocks b0 .. b1 - 1 of BLOCK flat elements: x-hat into scratch channel by channel (c =
        e // M), its range code from the scratch, then out = x-hat*gamma + beta (out may alias x)."""
        n = x.size
        for k in range(b0, b1):
            a, b = k * BLOCK, min(n, (k + 1) * BLOCK)
            e = a
            while e < b:
                c = e // M
                e1 = min(b, (c + 1) * M)
                _normalize_block(h[e - a:e1 - a], x[e:e1], mean[c], rstd[c])
                e = e1
            encode_block(packed, scale, zero, h[:b - a], hi, hu, ends, codes, f, par, a, bits, lev, fmax, big, nil_i,
                         sign, inf_i, inf_u)
            e = a
            while e < b:
                c = e // M
                e1 = min(b, (c + 1) * M)
                _apply_block(out[e:e1], h[e - a:e1 - a], gamma[c], beta[c])
                e = e1

    @njit(**_opts)
    def _backward_coded(dx, dgamma, dbeta, dy, packed, scale, zero, bits, c0, gamma, rstd, accumulate, inplace,
                        zero_f, row, keep):
        """_backward with x-hat decoded block by block from its range code (rows c0 .. of the whole
        tensor's code; ops/bitpack_cpu.decode_span, range_decode's values), where it was decoded
        into a buffer and read back. With keep, the sums' pass decodes each block into its place in
        row (M,), one row's scratch reused row after row (in L2), and the dx pass reads it back;
        else each pass decodes the block into L1 scratch. A twin of _backward's loops: one kernel
        with a helper returning either x-hat's row or the scratch made the plain backward
        measurably slower (one thread), so each keeps its own loops."""
        C, M = dy.shape
        tmp = numpy.empty(BLOCK, dy.dtype)
        h = numpy.empty(BLOCK, dy.dtype)
        codes = numpy.empty(BLOCK + 8, numpy.uint8)
        fd = numpy.empty(2, dy.dtype)
        f = numpy.empty(3, dy.dtype)
        f[2] = M
        for c in range(C):
            s1 = 0.0
            s2 = 0.0
            base = (c0 + c) * M
            for i0 in range(0, M, BLOCK):
                i1 = min(M, i0 + BLOCK)
                hb = row[i0:i1] if keep else h[:i1 - i0]
                decode_span(hb, codes, packed, scale, zero, bits, GROUP, base + i0, fd)
                a1, a2 = _sums(dy[c, i0:i1], hb, zero_f)
                s1 += a1
                s2 += a2
            f[0], f[1] = s1, s2
            sum_dy, sum_dyx = f[0], f[1]
            dgamma[c] += sum_dyx
            dbeta[c] += sum_dy
            a = gamma[c] * rstd[c]
            mdy, mdyx = sum_dy / f[2], sum_dyx / f[2]
            for i0 in range(0, M, BLOCK):
                i1 = min(M, i0 + BLOCK)
                if keep:
                    hb = row[i0:i1]
                else:
                    hb = h[:i1 - i0]
                    decode_span(hb, codes, packed, scale, zero, bits, GROUP, base + i0, fd)
                if accumulate or not inplace:
                    _dx_block(dx[c, i0:i1], dy[c, i0:i1], hb, a, mdy, mdyx, accumulate)
                else:
                    tb = tmp[:i1 - i0]
                    _dx_block(tb, dy[c, i0:i1], hb, a, mdy, mdyx, False)
                    _copy(dx[c, i0:i1], tb)


def supports(*arrays):
    """Whether the kernels take these arrays: numba present, C-contiguous NumPy float32 or float64
    arrays of one dtype."""
    return (AVAILABLE and all(type(a) is numpy.ndarray and a.flags.c_contiguous for a in arrays)
            and arrays[0].dtype in (numpy.float32, numpy.float64)
            and all(a.dtype == arrays[0].dtype for a in arrays))


# Each kernel's time per element over a plain copy's, one core (the BN-ReLU unit's kernels of
# the same kind, benchmarks/unit_kernels.py): how many rows a thread must get before a call is
# split (cpu_base._over_channels).
COST = {"forward": 1.5, "normalize": 1, "apply": 1, "backward": 3, "backward coded": 5}


def _split(fn, C, M, kind):
    _over_channels(fn, C, M, COST[kind])


def forward(out, xhat, x, mean, rstd, gamma, beta):
    """xhat (C, M) <- (x - mean)*rstd, out (C, M) = xhat*gamma + beta; out may alias x."""
    C, M = x.shape
    _split(lambda c0, c1: _forward(out[c0:c1], xhat[c0:c1], x[c0:c1], mean[c0:c1], rstd[c0:c1], gamma[c0:c1],
                                   beta[c0:c1], True, True), C, M, "forward")


def normalize(out, x, mean, rstd):
    """out (C, M) = (x - mean)*rstd; out may alias x."""
    C, M = x.shape
    _split(lambda c0, c1: _forward(out[c0:c1], out[c0:c1], x[c0:c1], mean[c0:c1], rstd[c0:c1], mean[c0:c1],
                                   mean[c0:c1], False, False), C, M, "normalize")


def apply(out, gamma, beta):
    """out (C, M) = out*gamma + beta, in place."""
    C, M = out.shape
    _split(lambda c0, c1: _apply(out[c0:c1], gamma[c0:c1], beta[c0:c1]), C, M, "apply")


def backward(dx, dgamma, dbeta, dy, xhat, gamma, rstd, accumulate=False):
    """ops.bn_backward: dgamma += sum(dy*xhat), dbeta += sum(dy), dx = (or += with accumulate)
    gamma*rstd*(dy - mean(dy) - xhat*mean(dy*xhat)). dy is read only; dx may alias dy."""
    C, M = dy.shape
    inplace, zero = _overlap(dx, dy), dy.dtype.type(0)
    _split(lambda c0, c1: _backward(dx[c0:c1], dgamma[c0:c1], dbeta[c0:c1], dy[c0:c1], xhat[c0:c1], gamma[c0:c1],
                                    rstd[c0:c1], bool(accumulate), inplace, zero), C, M, "backward")


def forward_add_relu(out, mask, xhat, src, other, mean, rstd, gamma, beta):
    """A batch norm, an add and a ReLU in one pass over (C, M) rows: with xhat (the float slot)
    x-hat = (src - mean)*rstd is kept there, with xhat None src is x-hat already; out =
    relu(x-hat*gamma + beta + other) (numpy.maximum's rules), mask (ceil(C*M/8),) uint8 <- [that
    sum > 0], the layout of ops/bitpack.py. The three ops' operations in their order: bit for
    bit bn_apply_forward, add_forward and relu_forward. out may alias src or other."""
    C, M = src.shape
    n, o, s_, t = C * M, out.reshape(-1), src.reshape(-1), other.reshape(-1)
    h = xhat.reshape(-1) if xhat is not None else o
    blocks = -(-n // BLOCK)
    zero = src.dtype.type(0)
    threads.parallel_for(lambda b0, b1: _forward_add_relu(o, mask, h, s_, t, mean, rstd, gamma, beta, M, b0, b1,
                                                          xhat is not None, xhat is None, zero),
                         blocks, grain=max(1, GRAIN // BLOCK))


def _blocks(fn, n, dtype, bits):
    """fn(b0, b1, scratch, consts) over the BLOCKs of n flat elements, split over lowmem's threads;
    scratch: one rangecode_cpu.block_scratch per range."""
    consts = rangecode_cpu.encode_constants(dtype, bits)
    threads.parallel_for(lambda b0, b1: fn(b0, b1, rangecode_cpu.block_scratch(dtype), consts), -(-n // BLOCK),
                         grain=max(1, GRAIN // BLOCK))


def forward_coded(out, code, x, mean, rstd, gamma, beta):
    """normalize, the range code of x-hat and apply in one pass: out (C, M) = x-hat*gamma + beta
    with x-hat = (x - mean)*rstd, code (a rangecode.RangeCode of the C*M elements) <- x-hat's
    range code: the bytes rangecode_cpu.range_encode writes for normalize's x-hat, out apply's,
    bit for bit. out may alias x."""
    C, M = x.shape
    o, xf = out.reshape(-1), x.reshape(-1)
    _blocks(lambda b0, b1, sc, k: _forward_coded(o, code.packed, code.scale, code.zero, xf, mean, rstd, gamma, beta,
                                                 M, b0, b1, *sc, code.bits, *k), C * M, x.dtype, code.bits)


def forward_add_relu_coded(out, mask, code, src, other, mean, rstd, gamma, beta):
    """forward_add_relu with x-hat kept as its range code (a rangecode.RangeCode), made in the same
    pass: the code's bytes range_encode writes for x-hat, out and mask forward_add_relu's, bit for
    bit. out may alias src or other."""
    C, M = src.shape
    o, s_, t = out.reshape(-1), src.reshape(-1), other.reshape(-1)
    zero = src.dtype.type(0)
    _blocks(lambda b0, b1, sc, k: _forward_add_relu_coded(o, mask, code.packed, code.scale, code.zero, s_, t, mean,
                                                          rstd, gamma, beta, M, b0, b1, zero, *sc, code.bits, *k),
            C * M, src.dtype, code.bits)


# A row of x-hat up to this many bytes is decoded once, into a row's scratch per thread (in L2),
# and read back by the dx pass; a longer one is decoded in each pass (benchmarks/norm_coded.py)
ROW_BYTES = 1 << 19


def backward_coded(dx, dgamma, dbeta, dy, code, gamma, rstd, accumulate=False):
    """backward with x-hat read from its range code (a rangecode.RangeCode of the C*M elements),
    decoded block by block in the kernel: the same results as backward on range_decode's x-hat,
    bit for bit. Where a row is at most ROW_BYTES, each call on a thread's rows allocates one
    row's scratch (M elements), which the plan states (optable.step_temporaries). dy is read
    only; dx may alias dy."""
    C, M = dy.shape
    inplace, zero = _overlap(dx, dy), dy.dtype.type(0)
    keep = M * dy.itemsize <= ROW_BYTES
    _split(lambda c0, c1: _backward_coded(dx[c0:c1], dgamma[c0:c1], dbeta[c0:c1], dy[c0:c1], code.packed,
                                          code.scale, code.zero, code.bits, c0, gamma[c0:c1], rstd[c0:c1],
                                          bool(accumulate), inplace, zero, numpy.empty(M if keep else 0, dy.dtype),
                                          keep),
           C, M, "backward coded")
