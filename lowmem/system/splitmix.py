"""SplitMix64's integer hash (Steele, Lea & Flood 2014; the finaliser Stafford's "Mix13"): what
lowmem's counter streams draw from, the stochastic rounding of units/stream.py and the dropout
masks of ops/dropout.py. Integer-only, so NumPy, numba and CUDA compute the same numbers.

    mix64(z)          the finaliser: a bijection of uint64, every output bit depending on every input bit
    mix_parts(parts)  a key mixing non-negative integers: z <- mix64(z ^ part) + phi per part, then mix64
    mix64_array(z, t) mix64 of a uint64 array in place
"""
import numpy

from .backend import array_module

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15     # φ·2**64, the stream's increment
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB


def mix64(z):
    """SplitMix64's finaliser on a Python int (taken mod 2**64)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def mix_parts(parts):
    """A uint64 key (Python int) mixing the integers `parts` (each in [0, 2**64), checked by the
    caller) in order: each part gives a new, well-mixed value."""
    z = 0
    for part in parts:
        z = mix64(z ^ int(part)) + GOLDEN
    return mix64(z)


def mix64_array(z, tmp):
    """mix64 of uint64 array z in place (tmp: uint64 scratch of z's size). Array ops wrap
    mod 2**64 silently (NumPy warns only for scalars)."""
    xp = array_module(z)
    for shift, mult in ((30, MIX1), (27, MIX2)):
        xp.right_shift(z, numpy.uint64(shift), out=tmp)
        xp.bitwise_xor(z, tmp, out=z)
        xp.multiply(z, numpy.uint64(mult), out=z)
    xp.right_shift(z, numpy.uint64(31), out=tmp)
    xp.bitwise_xor(z, tmp, out=z)
