"""The range code's numba kernels (lowmem/units/rangecode_cpu.py) against the NumPy reference
(lowmem/units/rangecode.py): the packed codes, the float32 steps and the zero points equal the
reference's byte for byte, and the decode equals its decode bit for bit, for float32 and float64,
every width, sizes that are not multiples of 8, of a group or of a block (the kernels' packing unit), zeros of both signs, infinities,
values near the float32 maximum and beyond it (float64), subnormal steps, and over 1 or 2 threads.
A group holding NaN keeps a NaN step (its payload is not pinned) and the same codes."""
import numpy as np
import pytest

from lowmem.system import threads
from lowmem.units import packing
from lowmem.units import rangecode as rc
from lowmem.units import rangecode_cpu as fast

pytestmark = pytest.mark.skipif(not fast.AVAILABLE, reason="numba not installed")

SIZES = [1, 7, 255, 256, 257, 3 * 256 + 5, 1000, 2 * fast.BLOCK + 3 * 256 + 5]     # the last: whole blocks and a part


def encode(module, x, bits):
    n = x.size
    packed = np.full(packing.packed_nbytes(n, bits), 0xA5, np.uint8)      # every byte must be written
    scale, zero = np.full(rc.groups(n), 7, np.float32), np.full(rc.groups(n), 9, np.uint8)
    module.range_encode(packed, scale, zero, x, bits)
    return packed, scale, zero


def decode(module, code, n, dtype, bits):
    out = np.full(n, np.nan, dtype)
    module.range_decode(out, *code, bits)
    return out


def same_bits(a, b):
    """Equal bit for bit; NaN anywhere equal to NaN (the payload of a NaN group's step is not pinned)."""
    nan = np.isnan(a)
    assert np.array_equal(nan, np.isnan(b))
    ints = {4: np.uint32, 8: np.uint64}[a.itemsize]
    assert np.array_equal(a[~nan].view(ints), b[~nan].view(ints))


def check(x, bits):
    want, got = encode(rc, x, bits), encode(fast, x, bits)
    assert np.array_equal(want[0], got[0]) and np.array_equal(want[2], got[2])
    same_bits(want[1], got[1])
    for code in (want, got):        # each decode of the reference's code
        same_bits(decode(rc, want, x.size, x.dtype, bits), decode(fast, code, x.size, x.dtype, bits))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", SIZES)
def test_codes_and_decode_equal_the_reference(rng, dtype, bits, n):
    x = rng.standard_normal(n).astype(dtype)
    x[::3] = np.maximum(x[::3], 0)
    x[1::7] = -0.0
    check(x, bits)
    check(np.maximum(x, 0), bits)               # a ReLU's output: every step from max alone
    check(-np.abs(x) * 1e-3, bits)              # non-positive groups


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bits", [1, 4, 8])
def test_range_ends_and_non_finite_values_take_the_reference_path(rng, dtype, bits):
    big = float(np.finfo(np.float32).max)
    groups = [np.zeros(256), -np.zeros(256), rng.standard_normal(256) * big / 4,
              np.r_[big, -big, rng.standard_normal(254)], rng.standard_normal(256) * 1e-44,
              np.r_[np.inf, rng.standard_normal(255)], np.r_[-np.inf, np.inf, rng.standard_normal(254)],
              np.r_[np.nan, rng.standard_normal(255)], np.r_[rng.standard_normal(100), -np.nan, np.zeros(155)]]
    if dtype == np.float64:
        groups += [rng.standard_normal(256) * 1e300, np.r_[1e39, -1e-300, rng.standard_normal(254)]]
    with np.errstate(over="ignore", invalid="ignore"):
        x = np.concatenate(groups).astype(dtype)
    check(x, bits)
    check(x[:len(x) - 3], bits)                 # a partial last group


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def split(request, monkeypatch):
    """The groups split over 1 or 2 lowmem threads (GRAIN lowered so small arrays are split)."""
    before = threads.threads()
    threads.configure(request.param)
    monkeypatch.setattr(fast, "GRAIN", 256)
    yield
    threads.configure(before)


@pytest.mark.parametrize("bits", [2, 4])
def test_codes_across_threads(rng, split, bits):
    for n in (9 * 256 + 3, 5 * fast.BLOCK + 9 * 256 + 3):      # the second: a thread's range starts inside a block
        check(rng.standard_normal(n).astype(np.float32), bits)


def test_supports():
    x = np.zeros(16, np.float32)
    assert fast.supports(x) and fast.supports(x.astype(np.float64))
    assert not fast.supports(x.astype(np.float16)) and not fast.supports(np.zeros((4, 4), np.float32)[:, :2])
