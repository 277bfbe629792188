"""lowmem.bits.allocate (the multiple-choice knapsack over per-unit bit widths) and lowmem.bits.sensitivity
(the per-unit error estimate and the simulated per-unit approx gradients it is checked against)."""
import copy
import itertools
import math

import numpy as np
import pytest

from lowmem.bits import allocate, sensitivity
from lowmem.units import packing, window
from lowmem.tools.gradient_error import gradient_errors, synthetic_batches, warm_up
from lowmem.core.engine import Engine
from lowmem.models import preact_resnet_cifar


def brute_force(costs, errors, budget):
    best = None
    for choice in itertools.product(*[range(len(c)) for c in costs]):
        b = sum(costs[i][k] for i, k in enumerate(choice))
        e = sum(errors[i][k] for i, k in enumerate(choice))
        if b <= budget and (best is None or e < best[0] - 1e-12):
            best = (e, choice)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_solver_matches_brute_force_and_keeps_the_budget(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 6))
    sizes = rng.integers(1, 40, n) * 8                      # elements, as a unit's C*N*H*W
    costs = [[packing.packed_nbytes(s, k) for k in (1, 2, 4, 8)] + [4 * int(s)] for s in sizes]
    errors = [sorted(rng.random(5) * s, reverse=True) for s in sizes]
    for i in range(n):
        errors[i][-1] = 0.0                                  # float: exact
    lo, hi = sum(min(c) for c in costs), sum(max(c) for c in costs)
    for budget in (lo, (lo + hi) // 3, (lo + hi) // 2, hi, lo + int(rng.integers(0, hi - lo + 1))):
        sol = allocate.solve(costs, errors, budget)
        ref_err, ref_choice = brute_force(costs, errors, budget)
        assert sol.exact
        assert sol.bytes <= budget
        assert sol.bytes == sum(costs[i][k] for i, k in enumerate(sol.choice))
        assert sol.error == pytest.approx(ref_err, rel=1e-12, abs=1e-12)


def test_solver_on_a_coarse_grid_still_keeps_the_budget():
    rng = np.random.default_rng(7)
    costs = [[int(c) for c in rng.integers(1, 10_000, 4)] for _ in range(6)]
    errors = [list(rng.random(4)) for _ in range(6)]
    budget = sum(sorted(c)[1] for c in costs)
    sol = allocate.solve(costs, errors, budget, max_cells=50)
    assert not sol.exact and sol.bytes <= budget
    assert sol.error >= brute_force(costs, errors, budget)[0] - 1e-12   # never better than optimal


def test_solver_refuses_an_impossible_budget():
    with pytest.raises(ValueError, match=r"below the smallest possible allocation .* \(30 B"):
        allocate.solve([[10, 20], [20, 40]], [[1.0, 0.0], [1.0, 0.0]], 29)


def fake_sensitivity(shapes, local):
    units = list(shapes)
    return sensitivity.Sensitivity(units, shapes, {}, {u: dict(local[u]) for u in units},
                                   {u: dict.fromkeys(sensitivity.BITS, 0.0) for u in units},
                                   dict.fromkeys(units, 0.0), 1.0, 1.0, {}, 0.0, 8, 2)


@pytest.mark.parametrize("K", (1, 2, 4, 8))
def test_uniform_errors_and_a_uniform_budget_give_uniform_bits(K):
    # identical units whose error scales with the squared bin width (the rounding-error law)
    shapes = {f"u{i}": (16, 8, 8) for i in range(6)}
    err = {k: window.bin_width(k) ** 2 for k in (1, 2, 4, 8)}
    a = allocate.allocate(fake_sensitivity(shapes, {u: err for u in shapes}), batch_size=4, avg_bits=K)
    assert set(a.bits.values()) == {K}
    assert a.total_bytes == a.uniform_bytes[K] == a.budget


def test_allocation_favours_the_sensitive_unit_and_prints_a_table():
    shapes = {"a": (16, 8, 8), "b": (16, 8, 8)}
    w2 = {k: window.bin_width(k) ** 2 for k in (1, 2, 4, 8)}
    a = allocate.allocate(fake_sensitivity(shapes, {"a": {k: 100 * v for k, v in w2.items()}, "b": w2}),
                          batch_size=4, avg_bits=2.5)
    assert a.bits == {"a": 4, "b": 1}                   # 4 + 1 bits = 2 x 2.5: the budget exactly
    assert a.total_bytes == a.budget == 5 * 16 * 8 * 8 * 4 // 8
    text = a.table()
    assert text.splitlines()[1].split()[:2] == ["a", "(16,"] and "saved x-hat" in text


def test_allocate_argument_errors():
    s = fake_sensitivity({"a": (4, 2, 2)}, {"a": dict.fromkeys((1, 2, 4, 8), 1.0)})
    with pytest.raises(ValueError, match="exactly one of code_bytes"):
        allocate.allocate(s, 2)
    with pytest.raises(ValueError, match="avg_bits must be a number"):
        allocate.allocate(s, 2, avg_bits=0)
    with pytest.raises(ValueError, match="choices must be drawn from"):
        allocate.allocate(s, 2, avg_bits=2, choices=(3,))


# ---- sensitivity ------------------------------------------------------------

@pytest.fixture(scope="module")
def small():
    net = preact_resnet_cifar(8)
    batches = synthetic_batches(3, 8, (3, 8, 8), 10, seed=0, dtype="float64")
    return warm_up(net, batches, 4, dtype="float64"), batches


def test_simulated_uniform_bits_are_approx_mode(small):
    net, batches = small
    sim, noise = sensitivity.simulate(net, batches, {u: 4 for u in unit_names(net)}, dtype="float64")
    d = gradient_errors(net, batches, bits=4, modes=("approx",), dtype="float64")
    assert sim == pytest.approx(d.total["error_norm"]["approx"], rel=1e-9)
    assert noise == pytest.approx(d.total["noise_norm"], rel=1e-12)
    assert sensitivity.simulate(net, batches, {}, dtype="float64")[0] == 0.0


def unit_names(net):
    return [L.name for L in net.layers if L.op == "bnrelu"]


def test_prediction_matches_the_measured_error(small):
    net, batches = small
    sens = sensitivity.measure_sensitivity(net, batches, dtype="float64")
    units = sens.units
    assert units == unit_names(net)
    assert sens.predict({}) == 0.0
    # calibrated at uniform 2 bits: the prediction there is the measurement, up to the clipping of
    # negative propagated parts
    assert sens.predict(dict.fromkeys(units, 2)) == pytest.approx(math.sqrt(sens.calibration["measured"]),
                                                                   rel=0.02)
    rng = np.random.default_rng(0)
    allocations = [dict.fromkeys(units, k) for k in (1, 4, 8)]
    allocations += [{u: allocate.CHOICES[rng.integers(5)] for u in units} for _ in range(3)]
    for a in allocations:
        measured, _ = sensitivity.simulate(net, batches, a, dtype="float64")
        assert 0.5 < sens.predict(a) / measured < 2.0
    # errors fall with the width, for every unit
    for u in units:
        e = [sens.error2(u, k) for k in (1, 2, 4, 8)]
        assert e == sorted(e, reverse=True) and e[-1] > 0
    with pytest.raises(ValueError, match="unknown unit 'nope'"):
        sens.predict({"nope": 2})


def test_simulated_mixed_widths_are_the_per_unit_engine(small):
    # the measurement the estimate is validated against is the per-unit approx engine itself
    net, batches = small
    units = unit_names(net)
    bits = {u: (1, 2, 4, 8, "float")[i % 5] for i, u in enumerate(units)}
    sim, _ = sensitivity.simulate(net, batches, bits, dtype="float64")
    exact = diagnostics_grads(net, batches, "exact", 4)
    approx = diagnostics_grads(net, batches, "approx", bits)
    err = math.sqrt(np.mean([sum(((approx[n][b] - exact[n][b]) ** 2).sum() for n in exact)
                             for b in range(len(batches))]))
    assert sim == pytest.approx(err, rel=1e-9)


def diagnostics_grads(net, batches, mode, bits):
    from lowmem.tools.gradient_error import parameter_grads
    return parameter_grads(net, batches, mode, bits, dtype="float64")


def test_allocate_bits_fits_its_budgets(small):
    net, batches = small
    shape = batches[0][0].shape[1:]
    sens = sensitivity.measure_sensitivity(net, batches, dtype="float64")
    uniform2 = Engine(copy.deepcopy(net), 16, shape, "approx", 2, "float64", allocate=False)
    a = allocate.allocate_bits(net, None, batch_size=16, avg_bits=2, dtype="float64", sens=sens)
    eng = Engine(copy.deepcopy(net), 16, shape, "approx", a.bits, "float64", allocate=False)
    saved = lambda e: sum(e.nbytes[e.saved_slots[u][0]] for u in e.unit_bits)   # noqa: E731
    assert saved(eng) <= saved(uniform2) and a.total_bytes == saved(eng)
    assert a.predicted_ratio <= sens.ratio(dict.fromkeys(units_of(sens), 2)) + 1e-12   # never worse
    total = uniform2.plan.total_bytes
    b = allocate.allocate_bits(net, None, batch_size=16, budget=total, dtype="float64", sens=sens)
    assert Engine(copy.deepcopy(net), 16, shape, "approx", b.bits, "float64", allocate=False).plan.total_bytes <= total
    with pytest.raises(ValueError, match="budget 1000 B is below the smallest plan at batch 16"):
        allocate.allocate_bits(net, None, batch_size=16, budget=1000, dtype="float64", sens=sens)
    with pytest.raises(ValueError, match=r"input_shape \(3, 32, 32\) differs"):
        allocate.allocate_bits(net, None, avg_bits=2, input_shape=(3, 32, 32), dtype="float64", sens=sens)


def units_of(sens):
    return sens.units


# ---- inputs a user may pass: each the right result or one clear line ---------------------------

def test_the_cheapest_allocation_fits_on_a_coarse_grid():
    # batch 129 makes every unit's cost odd: the exact grid is too fine and the solver rounds costs
    # up; a budget of exactly every unit at 1 bit must still give every unit 1 bit
    shapes = {"a": (16, 45, 45), "b": (32, 23, 23), "c": (64, 12, 12), "d": (7, 45, 45)}
    s = fake_sensitivity(shapes, {u: {1: 8.0, 2: 4.0, 4: 2.0, 8: 1.0} for u in shapes})
    for batch in (129, 131):
        a = allocate.allocate(s, batch, avg_bits=1)
        assert set(a.bits.values()) == {1} and a.total_bytes == a.budget == a.uniform_bytes[1]
    rng = np.random.default_rng(3)
    for _ in range(20):
        costs = [sorted(int(c) for c in rng.integers(1, 10_000, 4)) for _ in range(5)]
        errors = [sorted(rng.random(4), reverse=True) for _ in range(5)]
        least = sum(c[0] for c in costs)
        for budget in (least, least + int(rng.integers(1, 5000))):
            sol = allocate.solve(costs, errors, budget, max_cells=3)
            assert sol.bytes <= budget
            assert sol.error <= sum(e[0] for e in errors) + 1e-12    # never worse than the cheapest


@pytest.fixture(scope="module")
def tiny():
    net = preact_resnet_cifar(8)
    return net, synthetic_batches(3, 4, (3, 8, 8), 10, seed=1)


def test_batches_may_be_any_iterable_and_numpy_numbers_are_numbers(tiny):
    net, batches = tiny
    ref = allocate.allocate_bits(net, batches, avg_bits=2)
    assert allocate.allocate_bits(net, (b for b in batches), avg_bits=2).bits == ref.bits
    assert allocate.allocate_bits(net, tuple(batches), avg_bits=np.float32(2.0)).bits == ref.bits
    sens = sensitivity.measure_sensitivity(net, iter(batches))
    for avg in (np.int64(2), np.float64(2.0), 2.0):
        a = allocate.allocate_bits(net, None, avg_bits=avg, sens=sens)
        assert a.bits == ref.bits and a.budget == ref.budget
    assert allocate.allocate_bits(net, None, batch_size=np.int64(16), avg_bits=2, sens=sens).batch_size == 16


@pytest.mark.parametrize("kwargs, message", [
    ({"avg_bits": True}, r"avg_bits must be a number in \(0, 32\], got True"),
    ({"avg_bits": np.nan}, r"avg_bits must be a number in \(0, 32\], got nan"),
    ({"avg_bits": "2"}, r"avg_bits must be a number in \(0, 32\], got '2'"),
    ({"avg_bits": 33}, r"avg_bits must be a number in \(0, 32\], got 33"),
    ({"budget": "300MiB"}, r"budget must be a number of bytes in \(0, inf\), got '300MiB'"),
    ({"budget": float("nan")}, r"budget must be a number of bytes in \(0, inf\), got nan"),
    ({"budget": float("inf")}, r"budget must be a number of bytes in \(0, inf\), got inf"),
    ({"budget": -5}, r"budget must be a number of bytes in \(0, inf\), got -5"),
    ({"code_bytes": float("nan")}, r"code_bytes must be a number of bytes in \[0, inf\), got nan"),
    ({"code_bytes": None, "avg_bits": 2, "budget": 10**9}, "give exactly one of avg_bits, code_bytes and budget"),
    ({"avg_bits": 2, "batch_size": 0}, "batch_size must be a positive integer, got 0"),
    ({"avg_bits": 2, "batch_size": -3}, "batch_size must be a positive integer, got -3"),
    ({"avg_bits": 2, "batch_size": 2.5}, "batch_size must be a positive integer, got 2.5"),
    ({"avg_bits": 2, "batch_size": True}, "batch_size must be a positive integer, got True"),
])
def test_bad_numbers_name_the_parameter(tiny, kwargs, message, monkeypatch):
    net, batches = tiny
    # every such check comes before the (expensive) measurement
    monkeypatch.setattr(sensitivity, "measure_sensitivity", lambda *a, **k: pytest.fail("measured"))
    with pytest.raises(ValueError, match=message):
        allocate.allocate_bits(net, batches, **kwargs)


@pytest.mark.parametrize("batches, message", [
    (None, "batches must be a few .* got NoneType"),
    (5, "batches must be a few .* got int"),
    ([(np.zeros((4, 3, 8, 8), np.float32), np.zeros(4, np.int64))], "at least 2 are needed"),
    ([np.zeros((4, 3, 8, 8), np.float32)] * 2, r"batches\[0\] must be an \(x, labels\) pair"),
    ([(np.zeros((4, 3, 8, 8), np.float32), np.zeros(4, np.int64)),
      (np.zeros((2, 3, 8, 8), np.float32), np.zeros(2, np.int64))], r"batches\[1\] has shape \(2, 3, 8, 8\)"),
    ([(np.zeros((4, 1, 8, 8), np.float32), np.zeros(4, np.int64))] * 2,
     r"the batches hold 1-channel samples \(1, 8, 8\); preact-resnet8-cifar takes 3 input channels"),
])
def test_bad_batches_are_named(tiny, batches, message):
    with pytest.raises(ValueError, match=message):
        allocate.allocate_bits(tiny[0], batches, avg_bits=2)


def test_a_too_small_budget_says_what_was_given_and_the_least_before_measuring(tiny, monkeypatch):
    net, batches = tiny
    shapes, fixed = allocate.plan_parts(net, 4, (3, 8, 8))
    least = sum(packing.packed_nbytes(int(np.prod(s)) * 4, 1) for s in shapes.values())
    monkeypatch.setattr(sensitivity, "measure_sensitivity", lambda *a, **k: pytest.fail("measured"))
    for budget in (fixed + least - 1, fixed // 2):
        with pytest.raises(ValueError) as e:
            allocate.allocate_bits(net, batches, budget=budget)
        msg = str(e.value)
        assert msg.startswith(f"budget {plan_fmt(budget)} is below the smallest plan at batch 4, "
                              f"{plan_fmt(fixed + least)} ({fixed + least:,} B")
        assert "\n" not in msg
    with pytest.raises(ValueError, match=r"avg_bits 0.5 allows .* below the .* of every unit 1-bit; "
                                         r"avg_bits must be at least 1$"):
        allocate.allocate_bits(net, batches, avg_bits=0.5)


def plan_fmt(b):
    from lowmem.core.plan import fmt_bytes
    return fmt_bytes(b)


def test_identical_batches_and_networks_without_units(tiny):
    net, batches = tiny
    a = allocate.allocate_bits(net, [batches[0]] * 3, avg_bits=2)     # no SGD noise between them
    assert a.total_bytes <= a.budget and math.isnan(a.predicted_ratio)
    text = a.table()
    assert "n/a" in text and "no SGD noise" in text
    from lowmem import nn
    g = nn.Graph("no-units", (3, 8, 8), 10)
    plain = g.head(g.conv(g.input, 4, 3))
    with pytest.raises(ValueError, match="the network has no BN-ReLU unit"):
        allocate.allocate_bits(plain, batches, avg_bits=2)


def test_a_coarse_grid_still_affords_an_allocation_that_fills_the_budget_exactly():
    """Costs with a few odd bytes each (the dithered code's 24-byte stream per unit, group ends)
    make the exact grid too fine; on the coarse one the costs are rounded up. A budget of exactly
    every unit's 2-bit bytes must still give every unit 2 bits, not force one to its (much worse)
    1 bit because the rounded costs overstate the sum."""
    rng = np.random.default_rng(5)
    elements = [int(e) for e in rng.integers(1_000, 200_000, 20) * 64]
    costs = [[e // 8, e * 2 // 8 + e // 256 * 4 + 24, e * 4 // 8 + e // 256 * 4 + 24] for e in elements]
    errors = [[1e6, 1.0, 0.1] for _ in elements]
    budget = sum(c[1] for c in costs)
    sol = allocate.solve(costs, errors, budget, max_cells=1000)
    assert not sol.exact
    assert sol.choice == [1] * len(costs) and sol.bytes == budget
    # and where a little more fits, it is still within the budget and never worse than uniform 2-bit
    more = budget + 3 * costs[0][2]
    sol = allocate.solve(costs, errors, more, max_cells=1000)
    assert sol.bytes <= more and sol.error <= len(costs) * 1.0 and 2 in sol.choice
