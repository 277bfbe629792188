"""What the unbiased code's 4-bit draw costs in the numba forward, and three cheaper draws.

    python benchmarks/unbiased_draw_cost.py [--channels 64] [--elements 32768] [--repeats 7]

Times unbiased_cpu.unit_forward (normalise, group ranges, draws, pack, relu) on one thread, best
of --repeats calls, with its per-element draw (_draw_each: SplitMix64's finaliser of the
element's counter, two 64-bit multiplies) as it is and swapped for variants compiled here from
_draw_each's own source with the draw's expression replaced (and, for the 32-bit hash,
the group's seed computed where the group's counter is):

  * no hash: the counter's low 24 bits, not a valid draw: it prices the hash;
  * a hash per pair: one finaliser for two elements, its high and middle 24 bits;
  * 32-bit hash: lowbias32 of the group's seed (the 64-bit hash of the group's counter) plus the
    element's index times 0x9E3779B9, one per element;
  * systematic: the 2-bit code's draws (one hash per group, the lanes' walk) at 4 bits;

and the engine's own 2-bit and 4-bit forwards. The variants only price a design; none is the
code the engine packs. Machine-dependent (AVX2 emulates the 64-bit multiplies): name the
machine with the figures.
"""
import argparse
import inspect
import os
import sys
import textwrap
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowmem.system import threads  # noqa: E402
from lowmem.units import unbiased_cpu as cu, unbiased  # noqa: E402

if not cu.AVAILABLE:
    sys.exit("numba is not installed: pip install -e '.[fast]'")

from numba import njit  # noqa: E402

U64 = np.uint64
MIX1, MIX2 = U64(0xBF58476D1CE4E5B9), U64(0x94D049BB133111EB)
S30, S27, S31, S40, S16 = U64(30), U64(27), U64(31), U64(40), U64(16)
M24 = U64((1 << 24) - 1)
OPTS = dict(cache=False, nogil=True, error_model="numpy")

DRAW = "cpu_base._counter_bits(zq + U64(t) * GOLDEN)"       # _draw_each's draw
GROUP_COUNTER = "zq = z0 + U64(q0) * GOLDEN"


@njit(**OPTS)
def _pair_bits(z, t):
    """24 bits of the finaliser of counter z: its high ones for even t, its middle ones for odd t."""
    z = (z ^ (z >> S30)) * MIX1
    z = (z ^ (z >> S27)) * MIX2
    z = z ^ (z >> S31)
    return np.int32(z >> S40) if (t & 1) == 0 else np.int32((z >> S16) & M24)


@njit(**OPTS)
def _lowbias32(x):
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def _variant(draw, seed=None):
    """_draw_each compiled with `draw` for its draw's expression (and `seed` set after
    the group's counter)."""
    src = textwrap.dedent(inspect.getsource(cu._draw_each.py_func))
    src = src.split("\n", 1)[1]                               # without its decorator
    assert DRAW in src and GROUP_COUNTER in src, "unbiased_cpu._draw_each changed: update DRAW"
    src = src.replace(DRAW, draw)
    if seed is not None:
        indent = src.split(GROUP_COUNTER)[0].rsplit("\n", 1)[1]
        src = src.replace(GROUP_COUNTER, f"{GROUP_COUNTER}\n{indent}seed = {seed}")
    ns = dict(cu._draw_each.py_func.__globals__, _pair_bits=_pair_bits, _lowbias32=_lowbias32)
    exec(src, ns)
    return njit(**OPTS)(ns["_draw_each"])


VARIANTS = {
    "no hash": "(numpy.int32(zq + U64(t)) & R_MASK)",
    "a hash per pair": "_pair_bits(z0 + U64((q0 + t) >> 1) * GOLDEN, t)",
    "32-bit hash": "numpy.int32(_lowbias32(seed + numpy.uint32(t) * numpy.uint32(0x9E3779B9)) >> numpy.uint32(8))",
}
SEED_32 = "numpy.uint32(cpu_base._counter_bits(zq))"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--elements", type=int, default=32768, help="elements per channel (N*H*W)")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    C, M = a.channels, a.elements
    if M % 8:
        sys.exit("--elements must be a multiple of 8")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((C, M)).astype(np.float32)
    mean, rstd = x.mean(1).astype(np.float32), (1 / x.std(1)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, C).astype(np.float32)
    g[::4] *= -1
    b = rng.uniform(-0.3, 0.3, C).astype(np.float32)
    out = np.empty_like(x)
    threads.configure(1)
    glob = cu._forward_rows.py_func.__globals__
    draw, systematic = glob["_draw_each"], glob["SYSTEMATIC_BITS"]

    def timed(bits, draw_fn=None, systematic_bits=None):
        slot = np.zeros(unbiased.slot_nbytes(C, M, bits), np.uint8)
        saved = cu._forward_rows
        if draw_fn is not None or systematic_bits is not None:
            glob["_draw_each"] = draw_fn or draw
            glob["SYSTEMATIC_BITS"] = systematic if systematic_bits is None else systematic_bits
            cu._forward_rows = njit(**OPTS)(saved.py_func)      # compiled with the swapped draw
        try:
            best = float("inf")
            for _ in range(a.repeats + 1):                      # the first call compiles
                t0 = time.perf_counter()
                cu.unit_forward(out, slot, x, mean, rstd, g, b, bits, False, 7)
                best = min(best, time.perf_counter() - t0)
        finally:
            cu._forward_rows = saved
            glob["_draw_each"], glob["SYSTEMATIC_BITS"] = draw, systematic
        return best

    print(f"unit_forward, {C} channels x {M} elements, one thread, best of {a.repeats}:")
    rows = [("4-bit, the code", lambda: timed(4)),
            ("4-bit, no hash (prices it)", lambda: timed(4, _variant(VARIANTS["no hash"]))),
            ("4-bit, a hash per pair", lambda: timed(4, _variant(VARIANTS["a hash per pair"]))),
            ("4-bit, 32-bit hash", lambda: timed(4, _variant(VARIANTS["32-bit hash"], SEED_32))),
            ("4-bit, systematic draws", lambda: timed(4, systematic_bits=4)),
            ("2-bit, the code", lambda: timed(2))]
    for name, run in rows:
        print(f"  {name:28s} {run() * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
