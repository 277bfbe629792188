"""docs/leaky_relu.py, the op docs/new_op.md adds through lowmem's op table, checked as lowmem's
own ops are: its functions against the formula and float64 finite differences (several step
sizes, away from the kink), in place and accumulating; its saved slot in the plan; the engine's
gradients of a network using it against finite differences of the engine's loss; approx
forward equal to exact; and the trained network."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

import reference
import lowmem as lm
from lowmem.core.optable import OPS

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def leaky():
    """The example module, its entry registered for these tests only."""
    spec = importlib.util.spec_from_file_location("leaky_relu", ROOT / "docs" / "leaky_relu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert "leaky" not in OPS
    mod.register()
    yield mod
    del OPS["leaky"]


def away_from_zero(rng, shape):
    x = rng.standard_normal(shape)
    return np.where(np.abs(x) < 0.05, 0.05 * np.sign(x) + 0.05 * (x == 0), x)


@pytest.mark.parametrize("n", [1, 7, 8, 61, 1000])
def test_functions_match_the_formula_and_finite_differences(leaky, n):
    rng = np.random.default_rng(n)
    x = away_from_zero(rng, n)
    out, mask = np.empty(n), np.empty((n + 7) // 8, np.uint8)
    leaky.leaky_forward(out, mask, x)
    assert np.array_equal(out, np.where(x > 0, x, leaky.SLOPE * x))
    assert np.array_equal(mask, np.packbits(x > 0, bitorder="little"))
    dout = rng.standard_normal(n)
    dx = np.full(n, np.nan)                              # overwritten, never read
    leaky.leaky_backward(dx, dout, mask)

    def loss():
        leaky.leaky_forward(out, np.empty_like(mask), x)
        return float(np.sum(out * dout))
    for eps in (1e-3, 1e-5, 1e-7):                       # every step stays on one side of 0
        reference.check_grad(loss, x, dx, rng, eps=eps, rtol=1e-6, atol=1e-9)


def test_in_place_accumulate_and_the_kink(leaky):
    x = np.array([-2.0, -0.0, 0.0, 1e-300, 3.0, -5.0, 7.0, 0.5, -0.25], np.float32)
    mask = np.empty(2, np.uint8)
    y = x.copy()
    leaky.leaky_forward(y, mask, y)                      # out aliases x
    assert np.array_equal(y, np.where(x > 0, x, np.float32(leaky.SLOPE) * x))
    d = np.arange(9, dtype=np.float32)
    want = np.where(x > 0, d, np.float32(leaky.SLOPE) * d)   # at 0 the slope, as PyTorch
    g = d.copy()
    leaky.leaky_backward(g, g, mask)                     # dx aliases dout
    assert np.array_equal(g, want)
    acc = np.ones(9, np.float32)
    leaky.leaky_backward(acc, d, mask, accumulate=True)
    assert np.array_equal(acc, 1 + want)
    with pytest.raises(ValueError, match="mask must be uint8 of shape"):
        leaky.leaky_forward(y, np.empty(1, np.uint8), x)


def test_the_plan_and_schedule_hold_its_mask(leaky):
    eng = lm.Engine(leaky.small_net(), 32, (1, 8, 8), "approx", bits=4, allocate=False)
    rows = {e.name: e for e in eng.plan.entries}
    assert rows["leaky1.mask"].nbytes == 8 * 32 * 8 * 8 // 8 and rows["leaky1.mask"].kind == "saved"
    assert rows["leaky2.mask"].nbytes == 16 * 32 * 4 * 4 // 8
    steps = [s for s in eng.schedule if s.op == "leaky"]
    assert [(s.phase, s.name, s.saved) for s in steps] == [
        ("fwd", "leaky1", ("leaky1.mask",)), ("fwd", "leaky2", ("leaky2.mask",)),
        ("bwd", "leaky2", ("leaky2.mask",)), ("bwd", "leaky1", ("leaky1.mask",))]
    assert all(s.dx == s.dout and not s.accumulate for s in steps if s.phase == "bwd")   # in place


def test_engine_gradients_match_finite_differences(leaky):
    """Every parameter of the network, float64 exact mode, through the example's own check and
    through the tests' reference one."""
    assert leaky.check_gradients() < 1e-6
    rng = np.random.default_rng(3)
    net = leaky.small_net(seed=3)
    eng = lm.Engine(net, 4, (1, 8, 8), "exact", dtype="float64")
    x, y = rng.standard_normal((4, 1, 8, 8)), rng.integers(0, 4, 4)
    eng.forward(x, y)
    eng.backward()
    grads = {p.name: p.grad.copy() for p in net.parameters()}

    def loss():
        return eng.forward(x, y)[0]
    for p in net.parameters():
        reference.check_grad(loss, p.data, grads[p.name], rng, eps=1e-6, rtol=1e-5, atol=1e-9)


def test_a_second_consumer_makes_its_backward_accumulate(leaky):
    """conv1's output feeds the leaky op and a residual add: the add's gradient reaches it first,
    so the op's route adds its dx (+=); the gradients still match finite differences."""
    from lowmem.core.network import Network
    net = Network("leaky-skip", 1, 4, 0)
    net.conv("conv1", "input", "act0", 1, 8, 3)
    leaky.leaky(net, "leaky1", "act0", "act1")
    net.conv("conv2", "act1", "res", 8, 8, 3)
    net.add("add", "res", dst="act0")
    net.head("act0", 8)
    eng = lm.Engine(net, 4, (1, 8, 8), "exact", dtype="float64")
    step = next(s for s in eng.schedule if s.phase == "bwd" and s.op == "leaky")
    assert step.accumulate and step.dx != step.dout
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((4, 1, 8, 8)), rng.integers(0, 4, 4)
    eng.forward(x, y)
    eng.backward()
    grads = {p.name: p.grad.copy() for p in net.parameters()}

    def loss():
        return eng.forward(x, y)[0]
    for p in net.parameters():
        reference.check_grad(loss, p.data, grads[p.name], rng, eps=1e-6, rtol=1e-5, atol=1e-9)


def test_approx_forward_equals_exact_and_predict_keeps_nothing(leaky):
    rng = np.random.default_rng(0)
    x, y = leaky.stripes_batch(rng, 8)
    losses = [lm.Engine(leaky.small_net(), 8, (1, 8, 8), mode, bits=4, dtype="float64").forward(x, y)[0]
              for mode in ("exact", "approx")]
    assert losses[0] == losses[1]
    eng = lm.Engine(leaky.small_net(), 8, (1, 8, 8), "exact", dtype="float64")
    before = eng.arrays["leaky1.mask"].copy()
    logits = eng.predict(x)
    assert np.array_equal(eng.arrays["leaky1.mask"], before) and logits.shape == (8, 4)


def test_the_network_learns(leaky, capsys):
    leaky.train()
    lines = capsys.readouterr().out.splitlines()
    first, last = float(lines[0].split()[-1]), float(lines[-2].split()[-1])
    assert last < first / 4
    assert float(lines[-1].split()[-1]) > 0.9
