"""Pricing widths over a whole run (lowmem/bits/along.py): the learning-rate weights of the points,
the run's objective as their weighed sum, the allocator's choice from it, and the points read
from a run's checkpoints (lowmem.train.trainstate.run_points) as `lowmem train --price-along` uses them."""
import math
import shutil

import numpy as np
import pytest

from lowmem.bits import allocate
from lowmem.bits.along import Point, RunSensitivity, measure_along, run_weights
from lowmem.bits.sensitivity import Sensitivity, measure_sensitivity
from lowmem.data.datasets import Dataset, channel_mean_std, synthetic
from lowmem.models import preact_resnet_cifar
from lowmem.train.config import ConfigError, TrainConfig, lr_at
from lowmem.train.rundir import CHECKPOINT, ResumeError
from lowmem.train.trainer import Trainer
from lowmem.train.trainstate import run_points
from lowmem.units.widths import BITS


def test_weights_integrate_the_learning_rate_over_each_points_span():
    # constant rate, points at 0 and 10 of 20 iterations: point 0 stands for iterations 0..10
    # with hat weights 1, 0.9, ..., 0.1 (5.5), point 10 for the rest (0.1..0.9 then 1 x 10: 14.5)
    assert run_weights([0, 10], [1, 1], 20) == pytest.approx([5.5 / 20, 14.5 / 20])
    # without a schedule the rates at the points, linear between them; no total: up to the last
    w = run_weights([0, 10], [1, 0])
    assert w == pytest.approx([7 / 10, 3 / 10])        # sum (1-f)^2 vs f(1-f) over f = 0, .1, .. 1
    # a schedule that is 0 after iteration 5 leaves the later point only what it shares before
    sched = lambda i: 1.0 if i < 5 else 0.0            # noqa: E731
    w = run_weights([0, 10], [1, 0], 20, sched)
    assert w == pytest.approx([(1 + .9 + .8 + .7 + .6) / 5, (.1 + .2 + .3 + .4) / 5])
    assert run_weights([7], [0.1]) == [1.0]
    with pytest.raises(ValueError, match="increasing iterations"):
        run_weights([10, 0], [1, 1])
    with pytest.raises(ValueError, match="weight 0"):
        run_weights([0, 10], [0, 0])


def synthetic_sensitivity(err, noise_norm):
    """Window-code (nearest) sensitivity of two equal units 'a', 'b' with squared errors err[u][K]."""
    units = ["a", "b"]
    zeros = {u: dict.fromkeys(BITS, 0.0) for u in units}
    local = {u: {k: err[u].get(k, 0.0) for k in BITS} for u in units}
    return Sensitivity(units, {u: (8, 4, 4) for u in units}, {}, local, zeros, dict.fromkeys(units, 0.0),
                       noise_norm, 1.0, {}, 1.0, 8, 2)


def test_the_run_prices_each_point_against_its_own_noise_and_the_allocator_follows_it():
    """At the first point unit 'a' errs most at 2 bits, at the second 'b' (relative to each point's
    own SGD noise). One point alone gives its noisy unit the 4 bits the budget allows; over the run
    the weights decide, and the run's objective is the weighed sum of the points'."""
    early = synthetic_sensitivity({"a": {1: 9, 2: 4.0, 4: 0.3}, "b": {1: 9, 2: 1.0, 4: 0.1}}, 1.0)
    late = synthetic_sensitivity({"a": {1: 36, 2: 4.0, 4: 0.4}, "b": {1: 36, 2: 16.0, 4: 1.2}}, 2.0)
    pts = [Point(None, 0, 0.1), Point(None, 100, 0.05)]
    for w, winner in (([0.9, 0.1], "a"), ([0.2, 0.8], "b")):
        rs = RunSensitivity(pts, [early, late], w)
        for u in "ab":
            for k in BITS:
                want = w[0] * early.objective(u, k) + w[1] * late.objective(u, k)   # each already / its sigma^2
                assert rs.objective(u, k) == pytest.approx(want)
                assert rs.error2(u, k) == pytest.approx(w[0] * early.error2(u, k) + w[1] * late.error2(u, k) / 4)
        a = allocate.allocate(rs, 8, avg_bits=3, choices=(2, 4))
        assert a.bits[winner] == 4 and a.bits[{"a": "b", "b": "a"}[winner]] == 2
        assert a.total_bytes <= a.budget
        assert rs.price(a.bits) == pytest.approx(sum(rs.objective(u, a.bits[u]) for u in "ab"))
        assert rs.price(a.bits) < rs.price({"a": 2, "b": 2})
        assert rs.price_at(2) == [early.objective("a", 2) + early.objective("b", 2),
                                  late.objective("a", 2) + late.objective("b", 2)]
    one = allocate.allocate(RunSensitivity(pts[:1], [early], [1.0]), 8, avg_bits=3, choices=(2, 4))
    assert one.bits == {"a": 4, "b": 2}
    with pytest.raises(ValueError, match="unknown unit"):
        rs.price({"c": 2})
    other = synthetic_sensitivity({"a": {2: 1.0}, "b": {2: 1.0}}, 1.0)
    other.rounding = "stochastic"
    with pytest.raises(ValueError, match="one rounding"):
        RunSensitivity(pts, [early, other], [0.5, 0.5])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 2-epoch run of ResNet-8 on synthetic data keeping its checkpoint after each epoch."""
    x, y, xt, yt = synthetic(64, 16, shape=(3, 16, 16), seed=3)
    data = Dataset("synthetic", x, y, xt, yt, 10, *channel_mean_std(x))
    d = tmp_path_factory.mktemp("run")
    kept = []

    def keep(trainer, record):
        kept.append(str(d / f"epoch{record['epoch']}.ckpt"))
        shutil.copy(trainer.ckpt_path, kept[-1])
    cfg = TrainConfig(dataset="synthetic", depth=8, batch=16, epochs=2, lr=0.05, schedule="cosine",
                      progress=False, out=str(d / "run"))
    Trainer(cfg, dataset=data, log=lambda *_: None, on_epoch=keep).fit()
    return data, cfg, kept


def test_run_points_read_each_checkpoints_iteration_and_rate(run_dir):
    data, cfg, kept = run_dir
    net = preact_resnet_cifar(8)
    before = {p.name: p.data.copy() for p in net.parameters()}
    pts = run_points(net, kept[::-1], initial=True)                   # any order: sorted by iteration
    assert [p.iteration for p in pts] == [0, 4, 8]
    assert pts[0].net is net and all(p.total == 8 for p in pts)
    assert [p.lr for p in pts] == [lr_at(0, 8, cfg), lr_at(4, 8, cfg), lr_at(7, 8, cfg)]
    assert [p.schedule(i) for i in range(8) for p in pts[:1]] == [lr_at(i, 8, cfg) for i in range(8)]
    assert all(np.array_equal(p.data, before[p.name]) for p in net.parameters())    # net unchanged
    last = {p.name: p.data for p in pts[-1].net.parameters()}
    assert any(not np.array_equal(last[n], before[n]) for n in before)              # trained weights
    # the run's weights: its cosine schedule, integrated over each point's span
    rs_w = run_weights([0, 4, 8], [p.lr for p in pts], 8, pts[0].schedule)
    assert sum(rs_w) == pytest.approx(1) and rs_w[-1] < rs_w[1]


def test_run_points_refuse_checkpoints_of_two_runs(run_dir, tmp_path):
    data, cfg, kept = run_dir
    other = TrainConfig(**{**cfg.to_dict(), "seed": 1, "epochs": 1, "out": str(tmp_path / "other")})
    Trainer(other, dataset=data, log=lambda *_: None).fit()
    with pytest.raises(ResumeError, match="another run.*seed 1 vs 0"):
        run_points(preact_resnet_cifar(8), [kept[0], str(tmp_path / "other" / CHECKPOINT)])
    with pytest.raises(ResumeError, match="holds preact-resnet8"):
        run_points(preact_resnet_cifar(14), kept)


def test_measured_along_a_run_the_price_is_the_points_weighed(run_dir):
    data, cfg, kept = run_dir
    net = preact_resnet_cifar(8)
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((8, 3, 16, 16)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(2)]
    pts = run_points(net, kept, initial=True)
    rs = measure_along(pts, batches, rounding="stochastic")
    assert rs.rounding == "stochastic" and len(rs.sens) == 3 and sum(rs.weights) == pytest.approx(1)
    alone = measure_sensitivity(pts[1].net, batches, rounding="stochastic")
    u = rs.units[0]
    assert rs.sens[1].objective(u, 2) == pytest.approx(alone.objective(u, 2))   # same keys, same draws
    for k in (2, 4):
        assert rs.price(k) == pytest.approx(sum(w * p for w, p in zip(rs.weights, rs.price_at(k))))
        assert math.isfinite(rs.price(k)) and rs.price(k) > 0
    assert rs.price(4) < rs.price(2)
    a = allocate.allocate(rs, 16, avg_bits=2)
    assert a.total_bytes <= a.budget and 1 not in a.bits.values()


def test_trainer_prices_bits_auto_along_an_earlier_run(run_dir, tmp_path):
    data, cfg, kept = run_dir
    lines = []
    c = TrainConfig(**{**cfg.to_dict(), "out": str(tmp_path / "auto"), "mode": "approx", "bits": "auto",
                       "avg_bits": 2, "rounding": "stochastic", "price_along": kept, "epochs": 1})
    with Trainer(c, dataset=data, log=lines.append) as t:
        assert t.allocation.total_bytes <= t.allocation.budget
        assert t.engine.unit_bits == t.widths == t.allocation.bits
        assert "at the initial weights and 2 checkpoints of an earlier run" in t.describe()
    with pytest.raises(ConfigError, match="price_along.*only with bits='auto'"):
        TrainConfig(**{**cfg.to_dict(), "price_along": kept}).validate()
    with pytest.raises(ConfigError, match="price_along.*a list of training checkpoint files"):
        TrainConfig(**{**c.to_dict(), "price_along": []}).validate()


def test_the_command_line_passes_the_checkpoints(tmp_path):
    from lowmem.tools import cli
    from lowmem.tools.commands.train import config_from_args
    argv = ["train", "--dataset", "synthetic", "--mode", "approx", "--bits", "auto", "--avg-bits", "2",
            "--out", str(tmp_path / "r"), "--price-along", "a/epoch1.ckpt", "a/epoch2.ckpt"]
    assert config_from_args(cli.make_parser().parse_args(argv)).price_along == ["a/epoch1.ckpt", "a/epoch2.ckpt"]
