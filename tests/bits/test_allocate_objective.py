"""What the allocator prices for the unbiased code (rounding="stochastic"): its budget counts the
group ends on every path (allocate_bits, choose_widths as the trainer calls it), and the rule for
1-bit units (docs/bits.md §3b)."""
import numpy as np
import pytest

from lowmem.bits import allocate, auto
from lowmem.bits.sensitivity import Sensitivity, measure_sensitivity
from lowmem.units.widths import BITS
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


def unbiased_sensitivity(shapes, bias1, var):
    """A Sensitivity of the unbiased code with given 1-bit biases² and per-width variances (no
    propagated part), sigma 1."""
    units = list(shapes)
    local = {u: {1: bias1[u], **{k: var[u][k] for k in (2, 4, 8)}} for u in units}
    local_var = {u: {1: 0.0, **{k: var[u][k] for k in (2, 4, 8)}} for u in units}
    zeros = {u: dict.fromkeys(BITS, 0.0) for u in units}
    return Sensitivity(units, dict(shapes), {}, local, zeros, dict.fromkeys(units, 0.0), 1.0, 1.0, {}, 0.0, 8, 2,
                       rounding="stochastic", local_var=local_var, inject_var=zeros, mean_grad_norm=1.0)


def test_the_fewest_1_bit_units_the_budget_allows():
    """Two large units whose 1-bit bias is tiny (19x of it still below their 2-bit variance) and two
    small ones that gain much from 4 bits: a byte-for-byte trade of one large unit's 1 bit for both
    small ones' 4 bits lowers the summed objective, and is refused while uniform 2 bits fits; below
    uniform 2-bit's bytes as few 1-bit units as the budget allows are taken."""
    shapes = {"big0": (16, 16, 16), "big1": (16, 16, 16), "small0": (16, 8, 8), "small1": (16, 8, 8)}
    bias1 = {"big0": 1e-4, "big1": 2e-4, "small0": 1.0, "small1": 1.0}
    var = {u: {2: 0.1, 4: 0.1 / 16 if u.startswith("small") else 0.09, 8: 1e-4} for u in shapes}
    sens = unbiased_sensitivity(shapes, bias1, var)
    a = allocate.allocate(sens, 8, avg_bits=2)
    assert a.bits == dict.fromkeys(shapes, 2)
    trade = {"big0": 1, "big1": 2, "small0": 4, "small1": 4}
    c = allocate.allocation_for(sens, trade, 8)
    assert c.total_bytes <= a.budget                              # the trade fits the budget
    assert sum(sens.objective(u, k) for u, k in trade.items()) < sum(sens.objective(u, 2) for u in shapes)
    mine = allocate.allocate(sens, 8, avg_bits=2, objective=sens.objective)    # a callable: as it is
    J = lambda bits: sum(sens.objective(u, k) for u, k in bits.items())      # noqa: E731
    assert 1 in mine.bits.values() and J(mine.bits) <= J(trade) and mine.total_bytes <= mine.budget
    # below uniform 2-bit's bytes: one 1-bit unit fits, and it is the one with the least bias
    budget = a.uniform_bytes[2] - 1
    b = allocate.allocate(sens, 8, code_bytes=budget)
    assert list(b.bits.values()).count(1) == 1 and b.bits["big0"] == 1 and b.total_bytes <= budget


def test_the_bias_weight_follows_the_training_momentum(measured, monkeypatch):
    """H = (1 + β)/(1 − β): 19 at the default β = 0.9, 1 without momentum; allocate_bits hands it to
    the solver, choose_widths passes momentum through, and the trainer passes the run's own."""
    from lowmem.bits.simulate import BIAS_STEPS, bias_steps_for
    assert bias_steps_for(None) == BIAS_STEPS == pytest.approx(bias_steps_for(0.9)) == pytest.approx(19)
    assert bias_steps_for(0) == 1 and bias_steps_for(0.5) == 3
    for bad in (1, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match="momentum must be a number in"):
            bias_steps_for(bad)
    net, batches, sens = measured
    seen, real = [], allocate.allocate
    monkeypatch.setattr(allocate, "allocate", lambda *a, **k: seen.append(k["bias_steps"]) or real(*a, **k))
    allocate.allocate_bits(net, None, avg_bits=2, sens=sens, momentum=0.0)
    auto.choose_widths(net, batches, 8, avg_bits=2, rounding="stochastic", momentum=0.5)
    allocate.allocate_bits(net, None, avg_bits=2, sens=sens)
    assert seen == [1, 3, pytest.approx(19)]
    from lowmem.train import trainer
    from lowmem.train.config import TrainConfig
    got = {}
    monkeypatch.setattr(trainer, "choose_widths", lambda *a, **k: got.update(k) or (None, None))
    monkeypatch.setattr(trainer, "training_batches", lambda *a, **k: batches)
    c = TrainConfig(batch=8, momentum=0.5, bits="auto", avg_bits=2, rounding="stochastic")
    trainer.allocate_widths(net, object(), c, type("One", (), {"size": 1})())
    assert got["momentum"] == 0.5 and got["rounding"] == "stochastic"
