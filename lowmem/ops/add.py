"""The residual add, out += x (same shape), split over lowmem's threads.

One pass over two activation-sized arrays: on ResNet-164 at batch 128 it was the largest
piece of a step that ran on one core only (54 adds; the time: docs/performance.md). Elementwise, so the
split changes nothing: bit for bit `out += x` for every thread count.
"""
from ..system import threads
from ..system.backend import array_module

GRAIN = 1 << 16         # elements per thread below which the add is not split


def add_forward(out, x):
    """out (any shape) += x (the same shape)."""
    if out.shape != x.shape:
        raise ValueError(f"add: shapes differ, {out.shape} and {x.shape}")
    if (array_module(out).__name__ == "cupy" or not (out.flags.c_contiguous and x.flags.c_contiguous)
            or threads.threads() == 1):
        out += x
        return
    o, s = out.reshape(-1), x.reshape(-1)

    def part(lo, hi):
        o[lo:hi] += s[lo:hi]
    threads.parallel_for(part, o.size, grain=GRAIN)
