"""Packing K-bit codes into bytes, and walking a (C, M) array in flat chunks.

Codes are packed 8/K per byte, little end first: element i (flat C order) lives at bits
(i % (8/K))·K of byte i // (8/K); packed_nbytes(n, K) = ceil(n·K/8) bytes. pack_codes /
unpack_codes are the checked, chunked entry points; pack_block / unpack_block the raw block
operations under them (array ops on NumPy or CuPy, no checks), which the codes
(units/window.py, units/unbiased.py, units/rangecode.py) call inside their own chunk loops.

Memory: every walk goes CHUNK flat elements at a time (a multiple of 8: every chunk starts on
a byte boundary) with chunk-sized scratch only; `chunks` splits a chunk into at most three
rectangles of the (C, M) rows (`pieces`), so per-channel parameters broadcast over each.
"""
import numpy

from ..system.backend import array_module
from .widths import check_bits

CHUNK = 1 << 16     # flat elements per chunk; a multiple of 8 (tests lower it)


def packed_nbytes(n, bits):
    """Bytes holding n K-bit codes: ceil(n*bits/8)."""
    return (int(n) * check_bits(bits) + 7) // 8


def check_packed(packed, n, bits, name="packed"):
    """ValueError naming `name` unless packed is uint8 of shape (packed_nbytes(n, bits),)."""
    want = packed_nbytes(n, bits)
    if packed.dtype != numpy.uint8 or packed.ndim != 1 or packed.size != want:
        raise ValueError(f"{name} must be uint8 of shape ({want},) for {n} codes at "
                         f"{bits} bits, got {packed.dtype} {packed.shape}")


def chunk_size(n=None):
    """The current CHUNK, checked (tests set it small); with n, no more than n rounded up to
    a multiple of 8, so a small array gets small scratch."""
    if CHUNK <= 0 or CHUNK % 8:
        raise ValueError(f"packing.CHUNK must be a positive multiple of 8, got {CHUNK}")
    return CHUNK if n is None else min(CHUNK, max(8, (int(n) + 7) // 8 * 8))


def chunks(n, M):
    """Yield (a, b, pieces) over the flat index [0, n) of (C, M) rows in CHUNK steps."""
    step = chunk_size()
    for a in range(0, n, step):
        b = min(a + step, n)
        yield a, b, pieces(a, b, M)


def pieces(a, b, M):
    """Split flat range [a, b) of a (C, M) array into at most three rectangles
    (r0, r1, c0, c1, off): a head partial row, whole rows, a tail partial row.
    Each is a contiguous 2-D view, so per-channel params broadcast as [r0:r1, None];
    `off` is its offset inside the chunk."""
    out, off = [], 0
    r, c = divmod(a, M)
    if c:                                       # head: finish row r
        e = min(M, c + (b - a))
        out.append((r, r + 1, c, e, off))
        off += e - c
        r += 1
    full = (b - a - off) // M
    if full:
        out.append((r, r + full, 0, M, off))
        off += full * M
        r += full
    if off < b - a:                             # tail: start of row r
        out.append((r, r + 1, 0, b - a - off, off))
    return out


def pack_block(out, codes, bits, tmp):
    """codes (n,) uint8 -> out (ceil(n*bits/8),) uint8; tmp: >= n*bits/8 uint8 scratch."""
    xp = array_module(codes)
    if bits == 8:
        xp.copyto(out, codes)
        return
    per = 8 // bits
    nfull = codes.size // per
    g = codes[:nfull * per].reshape(nfull, per)     # row i = the codes of byte i
    o, t = out[:nfull], tmp[:nfull]
    xp.copyto(o, g[:, 0])
    for j in range(1, per):
        xp.left_shift(g[:, j], j * bits, out=t)
        xp.bitwise_or(o, t, out=o)
    rest = codes[nfull * per:]                      # n % per codes share a last byte
    if rest.size:
        last = out[nfull:nfull + 1]
        xp.copyto(last, rest[:1])
        for j in range(1, rest.size):
            last |= rest[j:j + 1] << (j * bits)


def unpack_block(codes, packed, bits):
    """packed (ceil(n*bits/8),) uint8 -> codes (n,) uint8, written in place."""
    xp = array_module(packed)
    if bits == 8:
        xp.copyto(codes, packed)
        return
    per, top = 8 // bits, (1 << bits) - 1
    nfull = codes.size // per
    g = codes[:nfull * per].reshape(nfull, per)
    p = packed[:nfull]
    for j in range(per):                            # strided writes, no temporaries
        xp.right_shift(p, j * bits, out=g[:, j])
        xp.bitwise_and(g[:, j], top, out=g[:, j])
    for j in range(codes.size - nfull * per):
        codes[nfull * per + j:nfull * per + j + 1] = (packed[nfull:nfull + 1] >> (j * bits)) & top




def pack_codes(packed_out, codes, bits):
    """Pack uint8 codes (any contiguous shape, values < 2**bits, n in all)
    into packed_out (packed_nbytes(n, bits),) uint8, chunked."""
    bits = check_bits(bits)
    xp = array_module(codes)
    codes = codes.reshape(-1)
    check_packed(packed_out, codes.size, bits, "packed_out")
    step = chunk_size(codes.size)
    tmp = xp.empty(step * bits // 8, numpy.uint8)
    for a in range(0, codes.size, step):
        b = min(a + step, codes.size)
        pack_block(packed_out[a * bits // 8:(b * bits + 7) // 8], codes[a:b], bits, tmp)


def unpack_codes(codes_out, packed, bits):
    """Unpack packed (packed_nbytes(n, bits),) uint8 into codes_out (n codes,
    any contiguous uint8 shape). Allocates nothing."""
    bits = check_bits(bits)
    if codes_out.dtype != numpy.uint8 or not codes_out.flags.c_contiguous:
        raise ValueError(f"codes_out must be C-contiguous uint8, got {codes_out.dtype}")
    flat = codes_out.reshape(-1)                    # a view, written in place
    check_packed(packed, flat.size, bits)
    step = chunk_size()
    for a in range(0, flat.size, step):
        b = min(a + step, flat.size)
        unpack_block(flat[a:b], packed[a * bits // 8:(b * bits + 7) // 8], bits)
