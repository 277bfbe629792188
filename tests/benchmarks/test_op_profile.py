"""benchmarks/op_profile.py: a profiled step's own time, shared out by op kind, adds up to the
profile's total; each op kind of a network shows up where the network has it and nowhere else.
Nothing is timed: only which kinds hold time and that nothing is lost."""
import sys
from pathlib import Path

import numpy
import pytest

import lowmem
from lowmem.system import threads
from lowmem.units import norm_cpu

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import op_profile as P                                                  # noqa: E402


@pytest.fixture
def one_thread():
    before = threads.threads()
    threads.configure(1)
    yield
    threads.configure(before)


def profiled(net, mode, bits=4, shape=(3, 32, 32), batch=2, rounding="nearest", use_fast=None):
    eng = lowmem.Engine(net, batch, shape, mode, bits, "float32", rounding=rounding, use_fast=use_fast)
    opt = lowmem.SGD(net.parameters(), lr=0.0)
    rng = numpy.random.default_rng(0)
    x = rng.standard_normal((batch,) + shape).astype(numpy.float32)
    y = rng.integers(0, net.num_classes, batch)
    eng.train_step(x, y, opt)
    stats = P.profile(lambda: eng.train_step(x, y, opt), 1)
    kinds, functions = P.by_kind(stats)
    assert set(kinds) == set(P.KINDS)
    assert sum(kinds.values()) == pytest.approx(P.total_seconds(stats), rel=1e-9)    # nothing lost
    for k in P.KINDS:
        assert sum(functions[k].values()) == pytest.approx(kinds[k], rel=1e-9, abs=1e-12)
    return {k for k, s in kinds.items() if s > 0}, kinds, functions


def test_mobilenet_v2s_kinds(one_thread):
    # torchvision's MobileNetV2 layout: 1x1 and stem convs, depthwise convs, BN -> ReLU6 (a region code),
    # BN without ReLU after each projection (a standalone BN), residual adds; no BN -> ReLU unit, no max pool
    net = lowmem.models.build_model("mobilenet", 2, num_classes=10)
    seen, kinds, functions = profiled(net, "approx")
    must = {"conv GEMMs", "depthwise/grouped conv", "range code, kept inputs", "ReLU/ReLU6/dropout, masks, packing",
            "standalone BN", "linear, loss", "SGD update"}
    assert must <= seen, must - seen
    assert kinds["BN-ReLU unit"] == 0
    assert any("matmul" in f for f in functions["conv GEMMs"])     # the GEMMs are matmul's own time
    exact, _, exact_functions = profiled(net, "exact")
    assert {"conv GEMMs", "depthwise/grouped conv", "standalone BN"} <= exact
    # exact mode keeps float copies of those inputs (rangecode.ExactKeep), no code
    assert not any(name in f for f in exact_functions["range code, kept inputs"]
                   for name in ("range_encode", "range_decode", "_encode"))
    assert any(f.endswith(":range_encode") for f in functions["range code, kept inputs"])


def test_a_post_activation_resnets_kinds(one_thread):
    # torchvision's ResNet-18 layout: the BN -> ReLU unit, a standalone BN before each add, the
    # max pool, the adds; no depthwise conv
    net = lowmem.models.build_model("resnet", 18, num_classes=10)
    seen, kinds, _ = profiled(net, "approx", bits=2, rounding="stochastic")
    must = {"conv GEMMs", "conv columns, transforms", "BN-ReLU unit", "standalone BN", "pools", "add, concat",
            "range code, kept inputs", "SGD update"}
    assert must <= seen, must - seen
    assert kinds["depthwise/grouped conv"] == 0


@pytest.mark.skipif(not norm_cpu.AVAILABLE, reason="the fused kernels need numba")
def test_a_kernel_run_by_the_thread_pool_keeps_its_op_kind(one_thread):
    # the block end's fused kernel (BN -> add -> ReLU) reaches the thread pool's dispatcher as the
    # convs' and the units' kernels do; cProfile's one caller table for the dispatcher must not
    # share its time out among them: it is the standalone BN's, whoever else runs on the pool
    net = lowmem.models.build_model("resnet", 18, num_classes=10)
    _, _, functions = profiled(net, "exact", batch=8, use_fast=True)
    assert functions["standalone BN"].get("units/norm_cpu.py:_forward_add_relu", 0) > 0
    misplaced = [(k, f) for k in P.KINDS if k != "standalone BN" for f in functions[k]
                 if f.startswith("units/norm_cpu.py")]
    assert not misplaced, misplaced
    assert any(f.startswith("ops/winograd.py") for f in functions["conv columns, transforms"])


def test_time_outside_lowmem_is_other():
    def busy():
        return sum(i * i for i in range(20000))
    kinds, functions = P.by_kind(P.profile(busy, 3))
    assert kinds["other"] > 0 and sum(kinds.values()) == kinds["other"]


def test_the_table_has_every_kind_and_the_profiled_step():
    per = {"a": dict.fromkeys(P.KINDS, 0.0), "b": dict.fromkeys(P.KINDS, 0.0)}
    per["a"]["range code, kept inputs"], per["a"]["other"], per["b"]["pools"] = 3.0, 1.0, 2.0
    top = {c: {k: {} for k in P.KINDS} for c in per}
    top["a"]["other"] = {"core/engine.py:_sweep": 1.0}
    text = P.kind_table(per, steps=2, top=top)
    lines = text.splitlines()
    assert lines[0].split()[-2:] == ["a", "b"]
    rows = {line[:36].strip(): line[36:].split() for line in lines[2:2 + len(P.KINDS) + 1]}
    assert list(rows) == list(P.KINDS) + ["profiled step"]
    assert rows["range code, kept inputs"] == ["1.500", "s", "75.0%", "0.000", "s", "0.0%"]
    assert rows["profiled step"] == ["2.000", "s", "100.0%", "1.000", "s", "100.0%"]
    assert "a, largest in other: core/engine.py:_sweep 0.500 s" in text
