"""The packer: K-bit codes (K = 1, 2, 4 or 8) in bytes, the one layout every kept code uses (the
units' x-hat codes, the range codes, ReLU's and dropout's 1-bit masks, ReLU6's 2-bit region
codes, max-pool's 4-bit window indices).

Dimensions: n codes (any contiguous shape, taken flat).
Layout: 8/K codes per byte, little end first: code (8/K)*i + j sits in bits K*j .. K*j + K-1 of
byte i (numpy.packbits(..., bitorder="little") at 1 bit). A last, partial byte holds the
remaining codes in its low bits, its high bits zero. Bytes: packed_nbytes(n, K) = ceil(n*K/8).

    pack_codes(packed, codes, bits)      checked, in blocks of BLOCK codes
    unpack_codes(codes, packed, bits)
    pack_block(out, codes, bits, tmp)    the raw block operations under them (array ops on NumPy
    unpack_block(codes, packed, bits)    or CuPy, no checks), for callers with their own loops

ops/bitpack_cpu.py is its numba twin, the loops the fused kernels pack and unpack with; the CUDA
kernels write the same bytes.

Work runs over blocks of BLOCK codes (a multiple of 8), so every temporary is bounded by one
block (a few bytes per code of it), never activation-sized.
"""
import numpy

from ..system.backend import array_module

BLOCK = 1 << 16         # codes per block; a multiple of 8 (tests lower it)
WIDTHS = (1, 2, 4, 8)   # the layout's code widths: 8/K codes fill a byte


def packed_nbytes(n, bits):
    """Bytes holding n codes of `bits` bits: ceil(n*bits/8)."""
    if bits not in WIDTHS or isinstance(bits, bool):
        raise ValueError(f"bits must be one of {{1, 2, 4, 8}} (8/bits codes fill a byte), got {bits!r}")
    return (int(n) * int(bits) + 7) // 8


def flat(a, name):
    """The (n,) view of a C-contiguous array; ValueError instead of a silent copy."""
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (a copy would be activation-sized), "
                         f"got strides {a.strides}")
    return a.reshape(-1)


def check_packed(packed, n, bits, name="packed"):
    """packed must be uint8 (packed_nbytes(n, bits),); ValueError naming it otherwise."""
    want = packed_nbytes(n, bits)
    if packed.dtype != numpy.uint8 or packed.ndim != 1 or packed.size != want:
        raise ValueError(f"{name} must be uint8 of shape ({want},) for {n} codes at {bits} "
                         f"bit(s), got {packed.dtype} {tuple(packed.shape)}")


def blocks(n, block=None):
    """(a, b) ranges of at most `block` (a multiple of 8) codes covering [0, n)."""
    step = BLOCK if block is None else block
    if step <= 0 or step % 8:
        raise ValueError(f"the block must be a positive multiple of 8, got {step}")
    for a in range(0, n, step):
        yield a, min(n, a + step)


def pack_block(out, codes, bits, tmp=None):
    """out (packed_nbytes(m, bits),) uint8 <- codes (m,) uint8 (values < 2**bits). tmp: scratch of
    at least m*bits/8 bytes (None: one is allocated)."""
    xp = array_module(codes)
    if bits == 8:
        xp.copyto(out, codes)
        return
    per = 8 // bits
    full = codes.size // per
    if tmp is None:
        tmp = xp.empty(full, numpy.uint8)
    g = codes[:full * per].reshape(full, per)       # row i: the codes of byte i
    o, t = out[:full], tmp[:full]
    xp.copyto(o, g[:, 0])
    for j in range(1, per):
        xp.left_shift(g[:, j], j * bits, out=t)
        xp.bitwise_or(o, t, out=o)
    rest = codes[full * per:]                       # m % per codes share a last byte
    if rest.size:
        last = out[full:full + 1]
        xp.copyto(last, rest[:1])
        for j in range(1, rest.size):
            last |= rest[j:j + 1] << (j * bits)


def unpack_block(codes, packed, bits):
    """codes (m,) uint8 <- packed (packed_nbytes(m, bits),), written in place (no temporaries);
    returns codes."""
    xp = array_module(packed)
    if bits == 8:
        xp.copyto(codes, packed)
        return codes
    per, top = 8 // bits, (1 << bits) - 1
    full = codes.size // per
    g = codes[:full * per].reshape(full, per)
    p = packed[:full]
    for j in range(per):                            # strided writes
        xp.right_shift(p, j * bits, out=g[:, j])
        xp.bitwise_and(g[:, j], top, out=g[:, j])
    for j in range(codes.size - full * per):
        codes[full * per + j:full * per + j + 1] = (packed[full:full + 1] >> (j * bits)) & top
    return codes


def pack_codes(packed, codes, bits):
    """packed (packed_nbytes(n, bits),) uint8 <- codes (any contiguous uint8 shape, n in all,
    values < 2**bits), in blocks."""
    xp = array_module(codes)
    codes = flat(codes, "codes")
    check_packed(packed, codes.size, bits, "packed")
    tmp = xp.empty(min(BLOCK, codes.size) * bits // 8 + 1, numpy.uint8)
    for a, b in blocks(codes.size):
        pack_block(packed[a * bits // 8:(b * bits + 7) // 8], codes[a:b], bits, tmp)


def unpack_codes(codes, packed, bits):
    """codes (any contiguous uint8 shape, n in all) <- packed (packed_nbytes(n, bits),). Allocates
    nothing."""
    if codes.dtype != numpy.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    codes = flat(codes, "codes")                    # a view, written in place
    check_packed(packed, codes.size, bits)
    for a, b in blocks(codes.size):
        unpack_block(codes[a:b], packed[a * bits // 8:(b * bits + 7) // 8], bits)
