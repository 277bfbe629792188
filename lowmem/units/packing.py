"""Walking a (C, M) array in flat chunks, and the packer the codes here use (ops/bitpack.py's,
the one packer of lowmem's bit layout: 8/K codes per byte, little end first; packed_nbytes(n, K)
= ceil(n·K/8) bytes).

pack_codes / unpack_codes are the checked entry points; pack_block / unpack_block the raw block
operations under them, which the codes (units/window.py, units/unbiased.py, units/rangecode.py)
call inside their own chunk loops.

Memory: every walk goes CHUNK flat elements at a time (a multiple of 8: every chunk starts on
a byte boundary) with chunk-sized scratch only; `chunks` splits a chunk into at most three
rectangles of the (C, M) rows (`pieces`), so per-channel parameters broadcast over each.
"""
from ..ops.bitpack import check_packed, pack_block, pack_codes, packed_nbytes, unpack_block, unpack_codes  # noqa: F401

CHUNK = 1 << 16     # flat elements per chunk; a multiple of 8 (tests lower it)


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
