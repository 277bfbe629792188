"""A per-group range code with 0 an exact level: how a conv keeps an input that no BN->ReLU
unit can rebuild (a ReLU after an add, an add, a batch norm alone, a pool, another conv).

Groups: G = 256 consecutive elements of the flat (C*N*H*W,) tensor (channels-major, so a
group lies in one channel's row except where two rows meet). Per group, with lo = min(x, 0)
and hi = max(x, 0) over the group and L = 2**K levels:

    step s = (hi - lo) / (L - 1),  zero point z = round(-lo / s)   (an integer level)
    code q = clip(round(x / s) + z, 0, L - 1),  decode x~ = (q - z) * s

so 0 encodes to z and decodes to exactly 0 (a ReLU's zeros stay zeros), and every element
is within s/2 of its decode (the group's own range always fits: -z*s <= lo + s/2 and
(L-1-z)*s >= hi - s/2). A group of zeros keeps s = 0 and decodes to zeros. Per group the
code stores s (float32) and z (uint8): 5 bytes per 256 elements, 0.16 bits per element on
top of the K-bit codes. Deterministic (nearest rounding, round half to even).

Range ends: s is computed as hi/(L-1) - lo/(L-1), so a group spanning -3.4e38 to 3.4e38 (the
float32 ends) gets a finite step; s is capped at the float32 maximum, and levels whose decode
would pass it are cut, so every finite input decodes to a finite value: within s of x for a
group that reaches within s of the float32 maximum (s/2 elsewhere); a float64 value beyond the
float32 range decodes to at most 3.4e38 in magnitude. Values too small for s (subnormal steps)
decode to 0, within the smallest subnormal of x. inf and NaN: no warning, no exception, the
decode of such a group is meaningless (a NaN element codes as level 0); the engine refuses a
batch holding either and a non-finite loss before backward ever decodes one.

`keeper(bits, kernels)` is what the engine hands every conv that keeps its input: `ExactKeep`
(float, exact mode or bits None) or `RangeKeep(K)`; their slots come from `entries`, `keep`
fills them in forward, `restore` decodes into a buffer for backward (or `code` hands the code
to a consumer that decodes it block by block itself: the depthwise weight gradient's kernels,
ops/conv_groups.py). range_encode and
range_decode here are the reference; `kernels` runs the same code in one pass per group
(units/rangecode_cpu.py, numba; units/rangecode_gpu.py, CUDA; byte for byte the same codes),
chosen once by the engine (units.keeper). Temporaries of the reference: one CHUNK
(packing.CHUNK) of elements at a time, about (2 * itemsize + 2) bytes each; the kernels', one
group of codes per thread.
"""
import sys
from typing import NamedTuple

import numpy

from ..system.backend import array_module
from . import packing
from .widths import check_bits

GROUP = 256                 # elements per group; packing.CHUNK is a multiple of it
F32_MAX = float(numpy.finfo(numpy.float32).max)      # the largest step s (scale is float32)


def groups(n):
    """Groups covering n elements: ceil(n / GROUP)."""
    return (int(n) + GROUP - 1) // GROUP


def _chunk_elems():
    step = packing.chunk_size()
    return max(GROUP, step // GROUP * GROUP)


def range_encode(packed, scale, zero, x, bits):
    """packed (packed_nbytes(n, bits),) uint8, scale (groups(n),) float32, zero (groups(n),)
    uint8 <- the range code of x (n,) (any float dtype, C-contiguous)."""
    xp = array_module(x)
    n, levels = x.size, (1 << bits) - 1
    with numpy.errstate(over="ignore", invalid="ignore"):      # inf / NaN inputs: see the module docstring
        _encode(xp, packed, scale, zero, x, bits, n, levels)


def _encode(xp, packed, scale, zero, x, bits, n, levels):
    for a in range(0, n, _chunk_elems()):
        b = min(a + _chunk_elems(), n)
        full = (b - a) // GROUP * GROUP
        g0 = a // GROUP
        codes = xp.empty(b - a, numpy.uint8)
        for lo_i, hi_i, rows in ((a, a + full, full // GROUP), (a + full, b, 1 if b > a + full else 0)):
            if not rows:
                continue
            v = x[lo_i:hi_i].reshape(rows, -1)
            lo = xp.minimum(v.min(axis=1), 0)
            hi = xp.maximum(v.max(axis=1), 0)
            s = hi / levels - lo / levels               # not (hi - lo) / levels: that overflows near the float32 max
            s = xp.minimum(s, F32_MAX).astype(numpy.float32)      # a NaN group keeps NaN here
            safe = xp.where(s > 0, s, 1).astype(v.dtype)          # NaN > 0 is False: 1
            z = xp.clip(xp.nan_to_num(xp.rint(-lo / safe)), 0, levels)
            # levels whose decode (q - z) * s would pass the float32 max are cut (near the range ends)
            s64 = safe.astype(numpy.float64)
            reach = xp.floor(F32_MAX / s64)
            reach -= reach * s64 > F32_MAX                             # reach * s is exact in float64
            q_lo = xp.maximum(z - reach, 0).astype(v.dtype)
            q_hi = xp.minimum(z + reach, levels).astype(v.dtype)
            q = xp.rint(v / safe[:, None]) + z[:, None]                 # one chunk
            xp.clip(q, q_lo[:, None], q_hi[:, None], out=q)
            q[q != q] = 0                                               # NaN elements (never in a checked batch)
            codes[lo_i - a:hi_i - a] = q.reshape(-1).astype(numpy.uint8)
            g = g0 + (lo_i - a) // GROUP
            scale[g:g + rows] = s
            zero[g:g + rows] = z.astype(numpy.uint8)
        packing.pack_codes(packed[a * bits // 8:(b * bits + 7) // 8], codes, bits)


def range_decode(out, packed, scale, zero, bits):
    """out (n,) <- (q - z) * s, the decoded range code (out's dtype)."""
    xp = array_module(out)
    n = out.size
    for a in range(0, n, _chunk_elems()):
        b = min(a + _chunk_elems(), n)
        codes = xp.empty(b - a, numpy.uint8)
        packing.unpack_codes(codes, packed[a * bits // 8:(b * bits + 7) // 8], bits)
        g = xp.arange(a, b) // GROUP                                    # one chunk
        o = out[a:b]
        xp.subtract(codes, zero[g], out=o, dtype=o.dtype, casting="unsafe")
        o *= scale[g]


class ExactKeep:
    """The input kept exactly, in float (exact mode, or no code width)."""
    bits = None
    decodes = False

    @staticmethod
    def entries(name, n, dtype):
        return [(name, "saved", (n,), dtype)]

    @staticmethod
    def keep(slots, x):
        slots[0][:x.size] = x

    @staticmethod
    def restore(out, slots):
        out[...] = slots[0][:out.size]


class RangeKeep:
    """The input kept as a K-bit range code (approx and naive modes); `kernels`: a module with
    supports(x), range_encode and range_decode (rangecode_cpu, rangecode_gpu), or None: the
    reference here. Arrays its kernels do not take (not C-contiguous, not float32 or float64)
    take the reference."""
    decodes = True

    def __init__(self, bits, kernels=None):
        self.bits = check_bits(bits)
        self.kernels = kernels

    def _module(self, x):
        fast = self.kernels
        return fast if fast is not None and fast.supports(x) else _REFERENCE

    def entries(self, name, n, dtype):
        return [(name, "saved", (packing.packed_nbytes(n, self.bits),), "uint8"),
                (name + "_scale", "saved", (groups(n),), "float32"),
                (name + "_zero", "saved", (groups(n),), "uint8")]

    def keep(self, slots, x):
        n = x.size
        self._module(x).range_encode(slots[0][:packing.packed_nbytes(n, self.bits)], slots[1][:groups(n)],
                                     slots[2][:groups(n)], x, self.bits)

    def restore(self, out, slots):
        n = out.size
        self._module(out).range_decode(out, *self.code(slots, n)[:3], self.bits)

    def code(self, slots, n):
        """The kept code of an n-element input as a RangeCode (for a consumer that decodes it itself)."""
        return RangeCode(slots[0][:packing.packed_nbytes(n, self.bits)], slots[1][:groups(n)], slots[2][:groups(n)],
                         self.bits)


class RangeCode(NamedTuple):
    """A kept range code as its consumers read it: packed (packed_nbytes(n, bits),) uint8, scale
    (groups(n),) float32, zero (groups(n),) uint8, bits; its decode is range_decode's."""
    packed: object
    scale: object
    zero: object
    bits: int


def keeper(bits, kernels=None):
    """ExactKeep for bits None (exact mode), else RangeKeep(bits, kernels)."""
    return ExactKeep() if bits is None else RangeKeep(bits, kernels)


_REFERENCE = sys.modules[__name__]          # range_encode and range_decode above
