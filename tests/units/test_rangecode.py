"""lowmem/units/rangecode.py: the per-group range code a conv keeps a non-unit input in.

0 decodes to exactly 0 (a ReLU's zeros stay zeros); every element is within half a step of
its decode (the group's own range, float32 steps); a constant-zero group decodes to zeros;
codes are deterministic and the chunked encoder equals one pass (packing.CHUNK lowered)."""
import numpy as np
import pytest

from lowmem.units import packing
from lowmem.units import rangecode as rc


def code(x, bits):
    n = x.size
    packed = np.zeros(packing.packed_nbytes(n, bits), np.uint8)
    scale, zero = np.zeros(rc.groups(n), np.float32), np.zeros(rc.groups(n), np.uint8)
    rc.range_encode(packed, scale, zero, x, bits)
    out = np.empty_like(x)
    rc.range_decode(out, packed, scale, zero, bits)
    return packed, scale, zero, out


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [7, 256, 1000, 3 * 256 + 5])
@pytest.mark.parametrize("kind", ["relu", "signed", "negative"])
def test_zero_is_exact_and_the_error_is_half_a_step(rng, bits, n, kind):
    x = rng.standard_normal(n)
    x = {"relu": np.maximum(x, 0), "signed": x, "negative": -np.abs(x)}[kind]
    x[::5] = 0
    _, scale, zero, out = code(x, bits)
    assert np.all(out[x == 0] == 0)
    step = np.repeat(scale.astype(np.float64), rc.GROUP)[:n]
    assert np.all(np.abs(out - x) <= 0.5 * step * (1 + 1e-6) + 1e-12)
    assert np.all(zero < 2 ** bits)


def test_a_zero_group_decodes_to_zeros_and_codes_are_deterministic(rng):
    x = np.zeros(600, np.float32)
    x[300:] = rng.standard_normal(300)
    a, b = code(x, 4), code(x.copy(), 4)
    assert np.all(a[3] [:256] == 0) and a[1][0] == 0
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


def test_chunked_encoding_equals_one_pass(rng, monkeypatch):
    x = rng.standard_normal(5 * 256 + 17).astype(np.float32)
    whole = code(x, 4)
    monkeypatch.setattr(packing, "CHUNK", 512)
    chunked = code(x, 4)
    for u, v in zip(whole, chunked):
        np.testing.assert_array_equal(u, v)
