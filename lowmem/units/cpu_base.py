"""What the numba kernels of units/window_cpu.py and units/unbiased_cpu.py share: numba's presence,
the float and stream constants, the block sizes, the packer's loops (ops/bitpack_cpu.py's, here
as _pack and _unpack) and the split of a call's channels over lowmem's threads.
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
GRAIN = 1 << 15       # elements per thread below which a block-wise call (norm_cpu's flat passes, rangecode_cpu) is not split
SHORT_ROW = BLOCK // 2  # rows up to this many elements: a block's worth packed in one call (_rows_per_pack)
SPLIT_WORK = 1 << 18  # a thread's share of a unit kernel call, in elements of a plain copy, below which
                      # the call is not split: each kernel states its cost per element in copies


def supports(xp, dtype, M, bits):
    """Whether the fused kernels apply: numba present, NumPy float32 arrays, byte-aligned rows.

    (float64 — used for gradient checks — always takes the NumPy reference path.)"""
    return AVAILABLE and xp is numpy and numpy.dtype(dtype) == numpy.float32 and (M * bits) % 8 == 0


if AVAILABLE:
    # Element-wise kernels: no fastmath, so every float operation rounds as NumPy's does.
    # Reductions: reassociation allowed (vectorised float64 sums; tests use a tolerance).
    _opts = dict(cache=True, nogil=True)
    _reduce = dict(cache=True, nogil=True, fastmath={"reassoc", "nsz"})
    # the packer's loops (one code per byte <-> 8/K codes per byte): ops/bitpack_cpu.py's
    from ..ops.bitpack_cpu import pack_bytes as _pack, unpack_bytes as _unpack  # noqa: F401


    # ---- the counter stream ----

    @njit(inline="always")
    def _counter_bits(z):
        """b = h >> 40 (< 2**24, as int32) of counter z = mix64(key) + (i + 1)*GOLDEN: SplitMix64's
        finaliser (units/stream.py), in uint64."""
        z = (z ^ (z >> S30)) * MIX1
        z = (z ^ (z >> S27)) * MIX2
        z = z ^ (z >> S31)
        return numpy.int32(z >> S_OFF)

    # ---- the window code's split of a channel (window.quant_params, per channel) ----

    @njit(inline="always")
    def _window_split(g, b, L, W, w):
        """(s, t, kr) of a channel from γ and β, window W and bin w (float32): the axis flip s
        (+1 for γ = 0), the threshold t = −β/|γ| (−β where γ = 0) and window.quant_params' k
        before its cast, clip(rint((t + W)/w), 1, L − 1): its float32 operations in its order.
        The window kernels' grid (window_cpu._grid) and the unbiased code's split
        (unbiased_cpu._channel) both start here."""
        s = F32(-1) if g < 0 else F32(1)
        t = -b / (F32(1) if g == 0 else abs(g))
        kr = min(max(numpy.rint((t + W) / w), F32(1)), F32(L - 1))
        return s, t, kr

    @njit(inline="always")
    def _rows_per_pack(M):
        """Rows whose codes one pack (or unpack) call moves: short rows (M at most SHORT_ROW) a
        block's worth together, their codes side by side in the block's scratch as in the slot
        (row c's at bytes c*M*K/8: M*K is a multiple of 8); else 1, block by block. A call per
        short row cost several times a block's per code (DenseNet-121's 4x4 and 2x2 planes:
        docs/performance.md)."""
        return BLOCK // M if M <= SHORT_ROW else 1

    @njit(inline="always")
    def _pack_rows(packed, codes, c0, c1, M, bits):
        """Rows c0 .. c1-1's codes into packed (the whole slice of a call's rows), from codes
        (one per byte, the rows side by side from codes[0]): one call of the packer."""
        per = 8 // bits
        _pack(packed[c0 * M // per:c1 * M // per], codes[:(c1 - c0) * M], bits)

    @njit(inline="always")
    def _unpack_rows(codes, packed, c0, c1, M, bits):
        """The inverse of _pack_rows: rows c0 .. c1-1's codes side by side from codes[0]."""
        per = 8 // bits
        _unpack(codes[:(c1 - c0) * M], packed[c0 * M // per:c1 * M // per], bits)

    @njit(**_opts)
    def _copy(dst, src):
        for t in range(dst.size):
            dst[t] = src[t]


def _over_channels(fn, C, M, cost):
    """fn(c0, c1) over channel ranges, split over lowmem's threads where each range gets at least
    SPLIT_WORK copies' worth of work: `cost` is the kernel's time per element over a plain
    copy's (one core, benchmarks/unit_kernels.py). A split costs a hand-over (tens of
    microseconds, benchmarks/pool_handover.py): a cheap kernel needs more rows to repay it than
    a dear one (the break-evens measured: docs/performance.md, "Cores")."""
    threads.parallel_for(fn, C, grain=max(1, -(-int(SPLIT_WORK / cost) // max(M, 1))))


def _overlap(a, b):
    """Whether two arrays may share memory (a bounds check, cheap): the kernels then go
    through scratch, see _quantize_block."""
    return numpy.may_share_memory(a, b)


