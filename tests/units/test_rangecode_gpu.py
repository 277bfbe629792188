"""The range code's CUDA kernels (lowmem/units/rangecode_gpu.py) against the NumPy reference
(lowmem/units/rangecode.py), on a GPU and on the CPU emulation of the same CUDA text (the `dev`
fixture, tests/cuda_emulation.py): codes, float32 steps and zero points byte for byte, the
decode bit for bit, for float32 and float64, every width, partial groups and bytes, zeros of
both signs, infinities, range ends and subnormal steps; a NaN group keeps a NaN step."""
import numpy as np
import pytest

from lowmem.units import packing
from lowmem.units import rangecode as rc
from lowmem.units import rangecode_gpu as cuda


def reference(x, bits):
    n = x.size
    packed = np.zeros(packing.packed_nbytes(n, bits), np.uint8)
    scale, zero = np.zeros(rc.groups(n), np.float32), np.zeros(rc.groups(n), np.uint8)
    rc.range_encode(packed, scale, zero, x, bits)
    return packed, scale, zero


def same_bits(a, b):
    nan = np.isnan(a)
    assert np.array_equal(nan, np.isnan(b))
    ints = {4: np.uint32, 8: np.uint64}[a.itemsize]
    assert np.array_equal(a[~nan].view(ints), b[~nan].view(ints))


def check(dev, x, bits):
    want = reference(x, bits)
    got = [dev.put(np.full_like(a, 0xA5 if a.dtype == np.uint8 else 7)) for a in want]
    cuda.range_encode(*got, dev.put(x), bits)
    got = [dev.get(a) for a in got]
    assert np.array_equal(want[0], got[0]) and np.array_equal(want[2], got[2])
    same_bits(want[1], got[1])
    ref_out = np.empty_like(x)
    rc.range_decode(ref_out, *want, bits)
    out = dev.put(np.full_like(x, np.nan))
    cuda.range_decode(out, *(dev.put(a) for a in want), bits)
    same_bits(ref_out, dev.get(out))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 256, 3 * 256 + 5])
def test_codes_and_decode_equal_the_reference(dev, rng, dtype, bits, n):
    x = rng.standard_normal(n).astype(dtype)
    x[::3] = np.maximum(x[::3], 0)
    x[1::7] = -0.0
    check(dev, x, bits)
    check(dev, np.maximum(x, 0), bits)
    check(dev, -np.abs(x) * 1e-3, bits)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_range_ends_and_non_finite_values(dev, rng, dtype):
    big = float(np.finfo(np.float32).max)
    groups = [np.zeros(256), -np.zeros(256), rng.standard_normal(256) * big / 4,
              np.r_[big, -big, rng.standard_normal(254)], rng.standard_normal(256) * 1e-44,
              np.r_[np.inf, rng.standard_normal(255)], np.r_[-np.inf, np.inf, rng.standard_normal(254)],
              np.r_[np.nan, rng.standard_normal(255)], np.r_[rng.standard_normal(100), -np.nan, np.zeros(152)]]
    if dtype == "float64":
        groups += [rng.standard_normal(256) * 1e300, np.r_[1e39, -1e-300, rng.standard_normal(254)]]
    with np.errstate(over="ignore", invalid="ignore"):
        x = np.concatenate(groups).astype(dtype)
    for bits in (1, 4, 8):
        check(dev, x, bits)
