"""The packer (lowmem/ops/bitpack.py), the one layout of every kept code, and its numba loops
(lowmem/ops/bitpack_cpu.py): the 1-bit layout is numpy.packbits(..., bitorder="little"), the
2-, 4- and 8-bit layouts put code (8/K)*i + j in bits K*j.. of byte i, a last partial byte keeps
its high bits zero; unpacking inverts packing; blocks (BLOCK lowered) change nothing; the numba
loops write the same bytes and read the same codes, for sizes that are not multiples of 8."""
import numpy as np
import pytest

from lowmem.ops import bitpack, bitpack_cpu
from reference import packbits_little

SIZES = [1, 3, 7, 8, 9, 61, 1000]


def by_formula(codes, bits):
    """The layout written out: byte i = sum over j of code[(8/K)*i + j] << (K*j)."""
    per = 8 // bits
    out = np.zeros(-(-codes.size // per), np.uint8)
    for i, c in enumerate(codes):
        out[i // per] |= np.uint8(int(c) << (bits * (i % per)))
    return out


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", SIZES)
def test_the_layout(rng, bits, n, monkeypatch):
    codes = rng.integers(0, 1 << bits, n).astype(np.uint8)
    want = by_formula(codes, bits)
    if bits == 1:
        np.testing.assert_array_equal(want, packbits_little(codes.astype(bool)))
    for block in (bitpack.BLOCK, 8):
        monkeypatch.setattr(bitpack, "BLOCK", block)
        packed = np.full(bitpack.packed_nbytes(n, bits), 0xFF, np.uint8)
        bitpack.pack_codes(packed, codes, bits)
        np.testing.assert_array_equal(packed, want)
        back = np.full(n, 0xEE, np.uint8)
        bitpack.unpack_codes(back, packed, bits)
        np.testing.assert_array_equal(back, codes)


@pytest.mark.skipif(not bitpack_cpu.AVAILABLE, reason="numba not installed")
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", SIZES)
def test_the_numba_loops_write_the_same_bytes(rng, bits, n):
    codes = rng.integers(0, 1 << bits, n).astype(np.uint8)
    packed = np.full(bitpack.packed_nbytes(n, bits), 0xFF, np.uint8)
    bitpack_cpu.pack_any(packed, codes, bits)
    np.testing.assert_array_equal(packed, by_formula(codes, bits))
    back = np.full(n, 0xEE, np.uint8)
    bitpack_cpu.unpack_any(back, packed, bits)
    np.testing.assert_array_equal(back, codes)
    whole = n - n % (8 // bits)                     # the whole-byte loops alone
    bitpack_cpu.pack_bytes(packed[:whole * bits // 8], codes[:whole], bits)
    np.testing.assert_array_equal(packed, by_formula(codes, bits))


def test_bad_widths_and_buffers_are_refused():
    for bad in (3, 0, 16, True):
        with pytest.raises(ValueError, match=r"bits must be one of \{1, 2, 4, 8\}"):
            bitpack.packed_nbytes(10, bad)
    with pytest.raises(ValueError, match=r"packed must be uint8 of shape \(3,\)"):
        bitpack.pack_codes(np.empty(2, np.uint8), np.zeros(10, np.uint8), 2)
    with pytest.raises(ValueError, match="C-contiguous"):
        bitpack.unpack_codes(np.zeros((4, 4), np.uint8)[:, ::2], np.zeros(1, np.uint8), 1)
