"""Stochastic rounding wired through the engine: Engine(..., rounding="stochastic-window", seed=s).

* The forward (loss, logits) is exact mode's, bit for bit: only the saved codes change.
* The codes are those of window.quantize_pack with the key stream.stream_key(seed, step, unit
  index) at each element's global index (stream.Stream) for every unit, on the reference and the
  fused kernels alike; a new training
  forward (engine.step + 1) draws new codes, the same step and seed draw the same ones.
* Nearest rounding (the default) is untouched (tests/core/test_engine_unit_bits.py: bit for bit).
* The trainer keeps `rounding` with the run and sets engine.step to the iteration, so a
  resumed run draws what an uninterrupted one would.
"""
import copy

import numpy as np
import pytest

from lowmem.units import stream, window
from lowmem.core.engine import Engine
from lowmem.models import preact_resnet_cifar
from lowmem.train.config import TrainConfig
from lowmem.train.trainer import Trainer

N, SHAPE = 4, (3, 8, 8)


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((N,) + SHAPE).astype(np.float32), rng.integers(0, 10, N)


def codes(eng):
    return {u: eng.arrays[eng.saved_slots[u][0]].copy() for u in eng.unit_bits}


@pytest.mark.parametrize("use_fast", [False, None])
def test_stochastic_codes_are_quantize_pack_with_the_unit_keys(use_fast):
    net = preact_resnet_cifar(8)
    x, y = batch()
    exact = Engine(copy.deepcopy(net), N, SHAPE, "exact", use_fast=use_fast)
    eng = Engine(copy.deepcopy(net), N, SHAPE, "approx", {"*": 2, "layer2.0.bn1": 4}, rounding="stochastic-window",
                 seed=7, use_fast=use_fast)
    nearest = Engine(copy.deepcopy(net), N, SHAPE, "approx", {"*": 2, "layer2.0.bn1": 4}, use_fast=use_fast)
    eng.step = 5
    loss_e, logits_e = exact.forward(x, y)
    loss, logits = eng.forward(x, y)
    assert loss == loss_e and np.array_equal(logits, logits_e)        # the forward stays exact
    assert eng.step == 6
    nearest.forward(x, y)
    got, near = codes(eng), codes(nearest)
    for i, u in enumerate(eng.unit_bits):
        xhat = exact.arrays[exact.saved_slots[u][0]]
        g, b = (exact.net.params[n].data for n in (u + ".weight", u + ".bias"))
        qp = window.quant_params(g, b, eng.unit_bits[u])
        want = np.empty_like(got[u])
        window.quantize_pack(want, np.ascontiguousarray(xhat), qp, "stochastic-window", stream.stream_key(7, 5, i))
        assert np.array_equal(got[u], want), u
    assert any(not np.array_equal(got[u], near[u]) for u in got)      # stochastic codes differ from nearest


def test_stochastic_draws_follow_seed_and_step_and_match_across_kernels():
    net = preact_resnet_cifar(8)
    x, y = batch()
    make = lambda seed, fast: Engine(copy.deepcopy(net), N, SHAPE, "approx", 2, rounding="stochastic-window",  # noqa
                                     seed=seed, use_fast=fast)
    a, b, c, ref = make(1, None), make(1, None), make(2, None), make(1, False)
    for e in (a, b, c, ref):
        e.forward(x, y)
    first = codes(a)
    assert all(np.array_equal(first[u], codes(b)[u]) for u in first)            # same seed, same step
    assert all(np.array_equal(first[u], codes(ref)[u]) for u in first)          # reference == fused
    assert any(not np.array_equal(first[u], codes(c)[u]) for u in first)        # another seed
    a.forward(x, y)
    assert any(not np.array_equal(first[u], codes(a)[u]) for u in first)        # the next step


def test_rounding_is_checked():
    with pytest.raises(ValueError, match="rounding must be one of 'nearest', 'stochastic', 'dither', 'stochastic-window', got 'up'"):
        Engine(preact_resnet_cifar(8), N, SHAPE, "approx", 2, rounding="up", allocate=False)
    with pytest.raises(Exception, match=r"rounding='up': expected one of nearest, stochastic"):
        TrainConfig(dataset="synthetic", rounding="up").validate()


def test_trainer_resume_draws_the_same_stream(tmp_path):
    def cfg(epochs, out):
        return TrainConfig(dataset="synthetic", limit_train=32, limit_test=8, depth=8, batch=16, epochs=epochs,
                           mode="approx", bits=2, rounding="stochastic-window", seed=3, out=str(out), progress=False,
                           schedule="constant", warmup_iters=0)   # the lr does not depend on the length
    whole = Trainer(cfg(2, tmp_path / "a"), log=lambda s: None)
    assert "stochastic rounding" in whole.describe()
    whole.fit()
    first = Trainer(cfg(1, tmp_path / "b"), log=lambda s: None)
    first.fit()
    resumed = Trainer(cfg(2, tmp_path / "b"), resume=True, log=lambda s: None)
    resumed.fit()
    for p, q in zip(whole.net.parameters(), resumed.net.parameters()):
        assert np.array_equal(p.data, q.data), p.name


def test_stochastic_at_one_bit_is_said_to_be_the_nearest_code_it_is():
    """No unbiased 1-bit code exists (one level per side of the exact mask): a 1-bit unit under
    rounding="stochastic" keeps the window code rounded to nearest (the same gradients), and the
    summary (the plan's, the run header's, plan.txt's) says so instead of "unbiased stochastic"."""
    from lowmem.tools import runcurves
    net = preact_resnet_cifar(8, num_classes=4)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 3, 8, 8)), rng.integers(0, 4, 4)
    grads = []
    for rounding in ("nearest", "stochastic"):
        eng = Engine(copy.deepcopy(net), 4, (3, 8, 8), "approx", 1, "float64", rounding=rounding)
        eng.forward(x, y)
        eng.backward()
        grads.append([np.array(p.grad) for p in eng.net.parameters()])
        if rounding == "stochastic":
            assert "nearest rounding (stochastic has no 1-bit code)" in eng.summary()
            assert "unbiased" not in eng.summary()
    assert all(np.array_equal(a, b) for a, b in zip(*grads))
    mixed = Engine(net, 4, (3, 8, 8), "approx", {"*": 2, "layer1.0.bn1": 1}, allocate=False, rounding="stochastic")
    assert "unbiased stochastic rounding (1-bit units: nearest)" in mixed.summary()
    assert runcurves.mode_label({"mode": "approx", "bits": 1, "rounding": "stochastic"}) == "approx 1-bit"
    assert runcurves.mode_label({"mode": "approx", "bits": 2, "rounding": "stochastic"}) == "approx 2-bit, stochastic"
