"""lowmem/units/widths.py: the vocabulary and the one rule for which code a unit keeps; the kernel
sets chosen by it, and the slot sizes they plan, which the engine and the bit allocator both read."""
import numpy as np
import pytest

from lowmem import units
from lowmem.bits.allocate import unit_bytes
from lowmem.core.engine import Engine
from lowmem.models import preact_resnet_cifar
from lowmem.units import fused, unbiased, window
from lowmem.units.reference import ExactUnits, UnbiasedCodeUnits
from lowmem.units.widths import BITS, FLOAT, ROUNDINGS, Code, check_bits, check_rounding, code_for


def test_the_rule():
    """"stochastic" and "dither" are the unbiased code from 2 bits up (drawn those two ways) and
    the window code rounded to nearest at 1 bit; the window code's roundings keep their own; a
    float width is x-hat itself."""
    for rounding in ("stochastic", "dither"):
        assert code_for(rounding, 1) == Code("window", 1, "nearest")
        for K in (2, 4, 8):
            code = code_for(rounding, K)
            assert code == Code("unbiased", K, rounding) and code.unbiased and code.dither == (rounding == "dither")
    for rounding in window.ROUNDINGS:
        for K in BITS:
            assert code_for(rounding, K) == Code("window", K, rounding) and not code_for(rounding, K).unbiased
    for rounding in ROUNDINGS:
        assert code_for(rounding, None) == code_for(rounding, FLOAT) == Code(FLOAT)
    with pytest.raises(ValueError, match="rounding must be one of 'nearest', 'stochastic', 'dither', 'stochastic-window'"):
        code_for("up", 4)
    with pytest.raises(ValueError, match=r"bits must be one of \{1, 2, 4, 8\}, got 3"):
        code_for("nearest", 3)
    assert check_bits(np.int64(4)) == 4 and check_rounding("stochastic") == "stochastic"
    with pytest.raises(ValueError, match="got True"):
        check_bits(True)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("bits", BITS)
def test_the_sets_follow_the_rule(rounding, bits):
    """The reference and the fused set of every (rounding, K) hold the code the rule names."""
    code = code_for(rounding, bits)
    sets = [units.reference("approx", bits, rounding)]
    if fused.applies(np, "float32", [1024]):
        sets.append(units.select(np, "approx", bits, "float32", [1024], rounding=rounding))
    for s in sets:
        assert isinstance(s, UnbiasedCodeUnits) == code.unbiased
        assert (s.bits, s.rounding) == (code.bits, code.rounding)
    assert isinstance(units.reference("exact", bits, rounding), ExactUnits)


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_slot_bytes_are_the_kernel_sets_in_the_plan_and_the_allocator(rounding):
    """One slot size per (rounding, K): the engine's planned saved slot of every unit equals
    units.slot_nbytes and bits.allocate.unit_bytes (the unbiased code's group ends included; at
    batch 3 some rows are not whole groups)."""
    net = preact_resnet_cifar(8)
    for K in BITS + (FLOAT,):
        eng = Engine(net, 3, (3, 16, 16), "approx", {"*": K}, rounding=rounding, allocate=False)
        for u in eng.unit_bits:
            C, H, W = eng.in_shape[u]
            planned = eng.nbytes[eng.saved_slots[u][0]]
            assert planned == units.slot_nbytes(K, rounding, C, 3 * H * W, "float32"), (u, K)
            assert planned == unit_bytes(C * 3 * H * W, K, 4, C, rounding), (u, K)
            if code_for(rounding, K).unbiased:
                assert planned == unbiased.slot_nbytes(C, 3 * H * W, K, code_for(rounding, K).dither)


def test_which_units_depend_on_the_split_is_the_kernel_sets_answer():
    """Only the unbiased code's rows that are not whole groups code differently on a shard."""
    net = preact_resnet_cifar(8)
    for rounding in ROUNDINGS:
        for K in BITS:
            eng = Engine(net, 4, (3, 8, 8), "approx", K, rounding=rounding, allocate=False)
            split = eng.split_dependent_units(4)                  # 4*8*8 = 256: whole groups at the stem
            odd = eng.split_dependent_units(3)
            assert split == [u for u in eng.unit_bits if code_for(rounding, K).unbiased
                             and (4 * eng.in_shape[u][1] * eng.in_shape[u][2]) % unbiased.GROUP]
            assert bool(odd) == code_for(rounding, K).unbiased
