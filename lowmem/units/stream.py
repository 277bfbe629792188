"""The counter stream of stochastic rounding: random numbers keyed by an element's place, from integers alone.

Element (c, j) of a unit's (C, M) rows draws from the counter

    i = c·row + start + j        (row: elements per channel of the GLOBAL batch,
                                  start: where this process's shard begins in it)

so an element's draw depends on the run's seed, the step, the unit and the element's place in
the global batch, never on how the batch is split over data-parallel ranks: 2 ranks draw what
one rank at the global batch draws, and a resume on another world size continues the same
stream. One process: row = M, start = 0, and i is the element's flat C-order index.

The hash: h = mix64(mix64(K) + (i + 1)·φ mod 2**64) (SplitMix64 seeded with mix64(K):
φ = 0x9E3779B97F4A7C15, mix64 its finaliser; Steele, Lea, Flood 2014, the finaliser Stafford's
"Mix13"); its top 24 bits b = h >> 40 give the window code's offset d = (b − 2**23)·2**−24 in
[−1/2, 1/2) and the unbiased code's r = b·2**−24 in [0, 1) (one per element), or at 2 bits
the unbiased code's group draw (one per group of 256, the counter of the group's first
element: `group_bits`; units/unbiased.py walks each group's lanes from it), all exact in
float32 and float64. Integer-only, so NumPy, numba and CUDA compute the same numbers and,
with the same float operations, the same codes.

`stream_key(seed, step, unit)` derives a key per unit and step; `Stream(key, start, row)`
carries a key with the shard's place (a plain integer key means start 0, row M).
"""
import numbers
from typing import NamedTuple

import numpy

from ..system.splitmix import GOLDEN, MASK64, MIX1, MIX2, mix64, mix64_array, mix_parts  # noqa: F401

OFFSET_BITS = 24                # 24 random bits per element: exact in float32 and float64


class Stream(NamedTuple):
    """A unit's draws for one step: key (stream_key), start (the first global element index of
    this shard in each channel's row: sample offset·H·W), row (elements per channel of the global
    batch; None: the local M, i.e. one process)."""
    key: int
    start: int = 0
    row: int = None


def check_key(key, what="key"):
    """Return `key` as an int if it is an integer in [0, 2**64); else ValueError naming it `what`."""
    ok = isinstance(key, numbers.Integral) and not isinstance(key, bool) and 0 <= int(key) <= MASK64
    if not ok:
        raise ValueError(f"{what} must be an integer in [0, 2**64), got {key!r}")
    return int(key)


def stream_key(seed, step, unit):
    """The key of one unit's stochastic rounding in one training step: a uint64 (Python int)
    mixing the run's seed, the step number and the unit's index (each a non-negative integer),
    so every unit and step draws its own stream and a rerun with the same seed draws the same
    ones. No rank: the element's global index (Stream) tells the shards apart."""
    # the last 0: the keys of runs saved before keep their values
    return mix_parts([check_key(part) for part in (seed, step, unit, 0)])


def resolve(key, M, needed=True, what="stochastic"):
    """(base = mix64(key), start, row) of an integer key or a Stream for rows of M local
    elements; None when key is None and not needed. A key is required when `needed`."""
    if key is None:
        if needed:
            raise ValueError(f"rounding={what!r} needs a key: an integer in [0, 2**64), "
                             f"e.g. stream.stream_key(seed, step, unit), or a stream.Stream")
        return None
    if isinstance(key, Stream):
        start, row = check_key(key.start), M if key.row is None else check_key(key.row)
        if row < start + M:
            raise ValueError(f"stream: a shard starting at {start} with {M} elements per channel does "
                             f"not fit in a global row of {row}")
        return mix64(check_key(key.key)), start, row
    return mix64(check_key(key)), 0, M


def draw_bits(resolved, r0, r1, c0, c1, xp=numpy, stride=1):
    """(r1−r0, g) uint64: b = h >> 40 (< 2**24) of elements [r0:r1, c0:c1:stride] of a unit's
    (C, M) rows (g = ceil((c1 − c0)/stride)), from resolve()'s (base, start, row). Allocates two
    arrays of that shape."""
    base, start, row = resolved
    heads = [(base + (r * row + start + c0 + 1) * GOLDEN) & MASK64 for r in range(r0, r1)]
    z = xp.arange(-(-(c1 - c0) // stride), dtype=numpy.uint64)[None, :] * numpy.uint64(stride * GOLDEN & MASK64)
    z = z + xp.asarray(numpy.array(heads, dtype=numpy.uint64))[:, None]
    mix64_array(z, xp.empty_like(z))
    xp.right_shift(z, numpy.uint64(64 - OFFSET_BITS), out=z)
    return z


def group_bits(resolved, r0, r1, c0, c1, group, xp=numpy):
    """(r1−r0, g) uint64: b of the first element of each run of `group` columns in [c0, c1):
    one draw per group."""
    return draw_bits(resolved, r0, r1, c0, c1, xp, stride=group)


def uniforms(resolved, r0, r1, c0, c1, dtype, xp=numpy):
    """r = b·2**−24 in [0, 1) (dtype) of elements [r0:r1, c0:c1] (the unbiased code's draw)."""
    r = draw_bits(resolved, r0, r1, c0, c1, xp).astype(dtype)
    r *= 2.0 ** -OFFSET_BITS
    return r


def random_offsets(key, n, dtype, start=0, xp=numpy):
    """d (n,) in dtype: the window code's offsets of flat elements start .. start+n−1 of a call
    with integer `key` (one process); d = (b − 2**23)·2**−24 in [−1/2, 1/2)."""
    d = draw_bits(resolve(key, start + n), 0, 1, start, start + n, xp)[0].astype(dtype)
    d -= 1 << (OFFSET_BITS - 1)
    d *= 2.0 ** -OFFSET_BITS
    return d
