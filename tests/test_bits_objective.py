"""What the allocator prices for the unbiased code (rounding="stochastic"): its budget counts the
group ends on every path (allocate_bits, choose_widths as the trainer calls it), and the rule for
1-bit units (docs/bits.md §3b)."""
import numpy as np
import pytest

from lowmem.bits import allocate, auto
from lowmem.bits.sensitivity import measure_sensitivity
from lowmem.models import preact_resnet_cifar


@pytest.fixture(scope="module")
def measured():
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((8, 3, 16, 16)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(3)]
    net = preact_resnet_cifar(8)
    return net, batches, measure_sensitivity(net, batches, rounding="stochastic")


def test_every_path_budgets_the_unbiased_code_with_its_group_ends(measured):
    net, batches, sens = measured
    a, s = auto.choose_widths(net, batches, 8, avg_bits=2, rounding="stochastic")
    assert s.rounding == "stochastic"
    b = allocate.allocate_bits(net, None, avg_bits=2, sens=sens)            # the rounding of sens
    near = allocate.allocate_bits(net, None, avg_bits=2, sens=measure_sensitivity(net, batches))
    for x in (a, b):
        assert x.budget == x.uniform_bytes[2] > near.budget == near.uniform_bytes[2]
        assert x.total_bytes <= x.budget
    with pytest.raises(ValueError, match="rounding 'nearest' differs from the 'stochastic' the sensitivity"):
        allocate.allocate_bits(net, None, avg_bits=2, sens=sens, rounding="nearest")


def test_a_1_bit_unit_only_where_the_budget_forces_it(measured):
    """The unbiased widths are priced by their variance, a 1-bit unit by its bias weighed 19x:
    at a 2-bit average (uniform 2-bit unbiased fits) no unit takes 1 bit; at 1.5 bits, below
    uniform 2-bit's bytes, some must, and the budget holds. With bias weighed once (bias_steps=1)
    the same measurement prices a unit's 1 bit below the 19x price by exactly 19."""
    net, batches, sens = measured
    for batch in (8, 64):
        a = allocate.allocate(sens, batch, avg_bits=2)
        assert 1 not in a.bits.values() and a.total_bytes <= a.budget
        b = allocate.allocate(sens, batch, avg_bits=1.5)
        assert b.budget < b.uniform_bytes[2]
        assert 1 in b.bits.values() and b.total_bytes <= b.budget
    for u in sens.units:
        assert sens.objective(u, 1) == pytest.approx(19 * sens.objective(u, 1, bias_steps=1))
        assert sens.objective(u, 2) == sens.objective(u, 2, bias_steps=1) > 0      # no bias term
        assert sens.objective(u, "float") == 0.0
    # a callable of one's own: the raw squared error, bias and variance alike, takes 1-bit units
    # here (window 1-bit errors are smaller than the unbiased code's 2-bit ones on this net)
    raw = allocate.allocate(sens, 8, avg_bits=2, objective=sens.error2)
    assert 1 in raw.bits.values() and raw.total_bytes <= raw.budget
