"""Small codes packed into bytes: the 1-bit masks (ReLU, dropout) and the 2-bit region codes
(ReLU6 / clip) that an op keeps for its backward.

Dimensions: n elements (any contiguous shape, taken flat).
Layout: numpy.packbits(..., bitorder="little") for 1 bit: element 8*i + j sits in bit j of
byte i; at b bits, element (8/b)*i + j sits in bits b*j .. b*j + b-1 of byte i (the layout of
lowmem's K-bit codes, units/packing.py's pack_codes). A last, partial byte holds the remaining
elements in its low bits, its high bits zero. Planned bytes: packed_nbytes(n, bits) = ceil(n*bits/8).

Work runs over blocks of BLOCK elements (a multiple of 8), so every temporary is bounded by
one block (a few bytes per element of it), never activation-sized.
"""
from ..system.backend import array_module

import numpy

BLOCK = 1 << 16         # elements per block; a multiple of 8 (tests lower it)


def packed_nbytes(n, bits):
    """Bytes holding n codes of `bits` (1 or 2) bits: ceil(n*bits/8)."""
    return (int(n) * int(bits) + 7) // 8


def flat(a, name):
    """The (n,) view of a C-contiguous array; ValueError instead of a silent copy."""
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (a copy would be activation-sized), "
                         f"got strides {a.strides}")
    return a.reshape(-1)


def check_packed(packed, n, bits, name):
    """packed must be uint8 (packed_nbytes(n, bits),); ValueError naming it otherwise."""
    want = packed_nbytes(n, bits)
    if packed.dtype != numpy.uint8 or packed.ndim != 1 or packed.size != want:
        raise ValueError(f"{name} must be uint8 of shape ({want},) for {n} elements at {bits} "
                         f"bit(s), got {packed.dtype} {tuple(packed.shape)}")


def blocks(n, block=None):
    """(a, b) element ranges of at most `block` (a multiple of 8) elements covering [0, n)."""
    step = BLOCK if block is None else block
    if step <= 0 or step % 8:
        raise ValueError(f"the block must be a positive multiple of 8, got {step}")
    for a in range(0, n, step):
        yield a, min(n, a + step)


def pack_block(out, codes, bits):
    """out (packed_nbytes(m, bits),) uint8 <- codes (m,) uint8 (values < 2**bits)."""
    xp = array_module(codes)
    per = 8 // bits
    full = codes.size // per
    g = codes[:full * per].reshape(full, per)      # row i: the codes of byte i
    o = out[:full]
    xp.copyto(o, g[:, 0])
    for j in range(1, per):
        o |= xp.left_shift(g[:, j], j * bits)      # bounded temporary (one block / per)
    rest = codes.size - full * per
    if rest:
        last = out[full:full + 1]
        xp.copyto(last, codes[full * per:full * per + 1])
        for j in range(1, rest):
            last |= xp.left_shift(codes[full * per + j:full * per + j + 1], j * bits)


def unpack_block(packed, m, bits):
    """codes (m,) uint8 of packed (packed_nbytes(m, bits),): a new array of one block."""
    xp = array_module(packed)
    per, top = 8 // bits, (1 << bits) - 1
    nbytes = packed_nbytes(m, bits)
    codes = xp.empty((nbytes, per), numpy.uint8)
    for j in range(per):
        xp.right_shift(packed[:nbytes], j * bits, out=codes[:, j])
        xp.bitwise_and(codes[:, j], top, out=codes[:, j])
    return codes.reshape(-1)[:m]
