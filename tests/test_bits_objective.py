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
