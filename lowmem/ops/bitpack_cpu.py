"""The packer's loops in numba (optional: lowmem[fast]), ops/bitpack.py's layout: one code per byte
<-> 8/K codes per byte, little end first. Every numba kernel that keeps or reads a code packs and
unpacks through these (the units' codes in units/window_cpu.py and unbiased_cpu.py through
units/cpu_base.py, the range code, ReLU's, ReLU6's and dropout's masks, max-pool's indices).

    pack_bytes(prow, codes, bits)     codes (n,) -> prow (n*bits/8,), n a multiple of 8/bits
    unpack_bytes(codes, prow, bits)   the inverse
    pack_any, unpack_any              any n: whole bytes, then a last partial byte (high bits 0)
    decode_group, decode_span         an affine code's values (q - z) * s, the range code's decode

The kernels call them on blocks of a few thousand codes held one per byte in an L1 scratch: a
float loop writes that scratch element by element and one of these loops packs it (written the
other way, shifting each code into its byte inside the float loop, LLVM gives up vectorising).
"""
import numpy

from ..system import threads
from ..system.backend import numba_available

AVAILABLE = numba_available()
if AVAILABLE:
    from numba import njit
    _opts = dict(cache=True, nogil=True)

    @njit(**_opts)
    def pack_bytes(prow, codes, bits):
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
    def unpack_bytes(codes, prow, bits):
        """codes (n,) <- prow (n*bits/8,): the inverse of pack_bytes; as there, one loop per K with a
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
        else:                   # 1 bit, written out (a loop over a byte's 8 codes ran scalar, ~7x slower)
            for j in range(prow.size):
                byte = prow[j]
                codes[8 * j], codes[8 * j + 1] = byte & 1, (byte >> 1) & 1
                codes[8 * j + 2], codes[8 * j + 3] = (byte >> 2) & 1, (byte >> 3) & 1
                codes[8 * j + 4], codes[8 * j + 5] = (byte >> 4) & 1, (byte >> 5) & 1
                codes[8 * j + 6], codes[8 * j + 7] = (byte >> 6) & 1, byte >> 7

    @njit(**_opts)
    def pack_any(prow, codes, bits):
        """prow (ceil(n*bits/8),) <- codes (n,), any n: whole bytes, then a last partial byte."""
        per = 8 // bits
        full = codes.size // per
        pack_bytes(prow[:full], codes[:full * per], bits)
        if full * per < codes.size:
            byte = 0
            for q in range(codes.size - full * per):
                byte |= codes[full * per + q] << (q * bits)
            prow[full] = byte

    @njit(**_opts)
    def unpack_any(codes, prow, bits):
        """codes (n,) <- prow (ceil(n*bits/8),): the inverse of pack_any."""
        per, top = 8 // bits, (1 << bits) - 1
        full = codes.size // per
        unpack_bytes(codes[:full * per], prow[:full], bits)
        for q in range(codes.size - full * per):
            codes[full * per + q] = (prow[full] >> (q * bits)) & top

    # ---- an affine code's decode, group by group (the range code's: units/rangecode.py) ----

    @njit(**_opts)
    def decode_group(out, codes, z, s):
        """out <- (codes - z) * s, z and s of out's dtype: one group of an affine code."""
        for i in range(out.size):
            out[i] = (codes[i] - z) * s

    @njit(**_opts)
    def decode_span(out, codes, packed, scale, zero, bits, group, i0, f):
        """out (n,) <- the decode (q - zero[g]) * scale[g] of the flat codes i0 .. i0 + n - 1 of an
        affine code in groups of `group` elements (g = i // group), over any span: what a consumer
        decoding block by block into its own scratch calls (ops/depthwise_cpu.py). codes: scratch
        of at least n + 7 bytes; f: two of out's dtype."""
        n = out.size
        lead = i0 % (8 // bits)                         # codes before i0 in its first byte
        a = i0 - lead
        unpack_any(codes[:n + lead], packed[a * bits // 8:((i0 + n) * bits + 7) // 8], bits)
        t0 = 0
        while t0 < n:
            g = (i0 + t0) // group
            t1 = min(n, (g + 1) * group - i0)
            f[0] = zero[g]                              # exact small integers in out's dtype
            f[1] = scale[g]
            decode_group(out[t0:t1], codes[lead + t0:lead + t1], f[0], f[1])
            t0 = t1


BLOCK = 4096            # codes per block of the elementwise code kernels: a multiple of 8, its codes in L1
GRAIN = 1 << 15         # elements per thread below which a call is not split


def over_blocks(fn, n):
    """fn(a, b) over [0, n) in ranges of whole BLOCKs (so every range starts on a byte of any
    width's codes), split over lowmem's threads when n is large enough."""
    nblocks = -(-n // BLOCK)
    threads.parallel_for(lambda b0, b1: fn(b0 * BLOCK, min(n, b1 * BLOCK)), nblocks,
                         grain=max(1, GRAIN // BLOCK))


def supports(*arrays):
    """Whether the elementwise code kernels take the arrays: numba present, NumPy, C-contiguous,
    float32 or float64 of one dtype."""
    return (AVAILABLE and all(type(a) is numpy.ndarray and a.flags.c_contiguous for a in arrays)
            and arrays[0].dtype in (numpy.float32, numpy.float64) and all(a.dtype == arrays[0].dtype for a in arrays))


def same_or_apart(a, b):
    """True when a and b are one array (the kernels then read and write it through one pointer:
    LLVM vectorises a loop over two pointers that may overlap only behind a runtime check, which
    an exact alias fails); False when they share no memory; ValueError for a partial overlap."""
    if a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape:
        return True
    if numpy.may_share_memory(a, b):
        raise ValueError("the output overlaps the input without being it")
    return False
