"""Packing K-bit codes into bytes, and walking a (C, M) array in flat chunks.

Codes are packed 8/K per byte, little end first: element i (flat C order) lives at bits
(i % (8/K))·K of byte i // (8/K); ceil(n·K/8) bytes. These are the raw block operations
(array ops on NumPy or CuPy, no checks); quant.pack_codes / unpack_codes are the checked,
chunked entry points, and every code (units/quant.py, units/unbiased.py) packs through them.
"""
from ..system.backend import array_module


def _pieces(a, b, M):
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


def _pack_block(out, codes, bits, tmp):
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


def _unpack_block(codes, packed, bits):
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


