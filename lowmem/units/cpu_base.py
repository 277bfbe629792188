"""What the numba kernels of units/window_cpu.py and units/unbiased_cpu.py share: numba's presence,
the float and stream constants, the block sizes, the packer (one code per byte <-> 8/K codes
per byte, the layout of units/window.py) and the split of a call's channels over lowmem's threads.
"""
import numpy

from . import stream
from ..system import threads
from ..system.backend import numba_available

AVAILABLE = numba_available()
if AVAILABLE:
    from numba import njit
    F32 = numpy.float32
    F0, HALF = F32(0), F32(0.5)
    # stochastic rounding's stream (stream.random_offsets), as uint64 / float32 constants
    U64 = numpy.uint64
    GOLDEN, MIX1, MIX2 = U64(stream.GOLDEN), U64(stream.MIX1), U64(stream.MIX2)
    S30, S27, S31, S_OFF = U64(30), U64(27), U64(31), U64(64 - stream.OFFSET_BITS)
    OFF_MID, OFF_SCALE = F32(1 << (stream.OFFSET_BITS - 1)), F32(2.0 ** -stream.OFFSET_BITS)

BLOCK = 4096          # elements per block: codes scratch 4 KiB, a multiple of 8 (byte-aligned for any K)
GRAIN = 1 << 15       # elements per thread below which a kernel call is not split


def supports(xp, dtype, M, bits):
    """Whether the fused kernels apply: numba present, NumPy float32 arrays, byte-aligned rows.

    (float64 — used for gradient checks — always takes the NumPy reference path.)"""
    return AVAILABLE and xp is numpy and numpy.dtype(dtype) == numpy.float32 and (M * bits) % 8 == 0


if AVAILABLE:
    # Element-wise kernels: no fastmath, so every float operation rounds as NumPy's does.
    # Reductions: reassociation allowed (vectorised float64 sums; tests use a tolerance).
    _opts = dict(cache=True, nogil=True)
    _reduce = dict(cache=True, nogil=True, fastmath={"reassoc", "nsz"})


    # ---- the counter stream ----

    @njit(inline="always")
    def _counter_bits(z):
        """b = h >> 40 (< 2**24, as int32) of counter z = mix64(key) + (i + 1)*GOLDEN: SplitMix64's
        finaliser (units/stream.py), in uint64."""
        z = (z ^ (z >> S30)) * MIX1
        z = (z ^ (z >> S27)) * MIX2
        z = z ^ (z >> S31)
        return numpy.int32(z >> S_OFF)

    # ---- packing: one code per byte <-> 8/K codes per byte, little end first ----

    @njit(**_opts)
    def _pack(prow, codes, bits):
        """prow (n*bits/8,) uint8 <- codes (n,), n a multiple of 8/bits. One loop per K,
        each with a constant number of codes per byte, so each vectorises."""
        if bits == 8:
            for j in range(prow.size):
                prow[j] = codes[j]
        elif bits == 4:
            for j in range(prow.size):
                prow[j] = codes[2 * j] | (codes[2 * j + 1] << 4)
        elif bits == 2:
            for j in range(prow.size):
                prow[j] = (codes[4 * j] | (codes[4 * j + 1] << 2) | (codes[4 * j + 2] << 4)
                           | (codes[4 * j + 3] << 6))
        else:
            for j in range(prow.size):
                byte = 0
                for q in range(8):
                    byte |= codes[8 * j + q] << q
                prow[j] = byte

    @njit(**_opts)
    def _unpack(codes, prow, bits):
        """codes (n,) <- prow (n*bits/8,): the inverse of _pack; as there, one loop per K with a
        constant number of codes per byte (not the general loop: docs/performance.md)."""
        if bits == 8:
            for j in range(prow.size):
                codes[j] = prow[j]
        elif bits == 4:
            for j in range(prow.size):
                byte = prow[j]
                codes[2 * j] = byte & 15
                codes[2 * j + 1] = byte >> 4
        elif bits == 2:
            for j in range(prow.size):
                byte = prow[j]
                codes[4 * j], codes[4 * j + 1] = byte & 3, (byte >> 2) & 3
                codes[4 * j + 2], codes[4 * j + 3] = (byte >> 4) & 3, byte >> 6
        else:
            per, top = 8 // bits, (1 << bits) - 1
            for j in range(prow.size):
                byte = prow[j]
                for q in range(per):
                    codes[per * j + q] = (byte >> (q * bits)) & top

    @njit(**_opts)
    def _copy(dst, src):
        for t in range(dst.size):
            dst[t] = src[t]


def _over_channels(fn, C, M):
    """fn(c0, c1) over channel ranges, split over lowmem's threads when the rows are big enough."""
    threads.parallel_for(fn, C, grain=max(1, -(-GRAIN // max(M, 1))))


def _overlap(a, b):
    """Whether two arrays may share memory (a bounds check, cheap): the kernels then go
    through scratch, see _quantize_block."""
    return numpy.may_share_memory(a, b)


