"""A bit width per BN-ReLU unit: Engine(..., bits={"*": K, "<unit>": K or "float"}).

* A dict giving every unit the same K is the uniform engine, bit for bit (loss, logits,
  every gradient, two SGD steps), on the reference and the fused kernels.
* "float" for every unit in approx mode is the exact engine, bit for bit.
* A mixed engine saves each unit's slot at that unit's width: the slots equal those of the
  uniform engine of the same width, and the plan's saved bytes follow the per-unit formula.
* Gradients of a mixed engine: those computed before the backward sweep reaches a unit
  whose width changed are the uniform engine's; the changed unit's own are not.
* Bad dicts are refused with a message naming the problem.
"""
import copy

import numpy as np
import pytest

from lowmem.units import packing
from lowmem.core.engine import Engine
from lowmem.models import preact_resnet_cifar
from lowmem.train.optim import SGD

PATHS = [False, None]          # the reference array ops; the fused kernels where they apply
N, SHAPE = 4, (3, 8, 8)


def network():
    net = preact_resnet_cifar(8)
    rng = np.random.default_rng(3)
    for p in net.parameters():  # gammas of both signs, thresholds inside and outside the window
        if p.data.ndim == 1 and p.name.endswith(".weight"):
            p.data[...] = rng.choice([-1.0, 1.0], p.shape) * rng.uniform(0.3, 1.5, p.shape)
        elif p.data.ndim == 1 and "bn" in p.name:
            p.data[...] = rng.normal(0, 1.5, p.shape)
    return net


def units(net):
    return [L.name for L in net.layers if L.op == "bnrelu"]


def run(net, mode, bits, use_fast=None, steps=2):
    """(losses, logits, {param: grad} of the first step, slots after the first forward, engine)."""
    eng = Engine(copy.deepcopy(net), N, SHAPE, mode, bits=bits, use_fast=use_fast)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N,) + SHAPE).astype(np.float32)
    y = rng.integers(0, net.num_classes, N)
    opt = SGD(eng.net.parameters(), lr=0.1, momentum=0.9)
    losses, grads, slots = [], None, None
    for _ in range(steps):
        loss, logits = eng.forward(x, y)
        if slots is None:
            slots = {L: eng.arrays[eng.saved_slots[L][0]].copy() for L in units(net)}   # n = N: whole
        eng.backward()
        if grads is None:
            grads = {p.name: p.grad.copy() for p in eng.net.parameters()}
        opt.step()
        losses.append(loss)
    return losses, logits, grads, slots, eng


def same(a, b):
    assert a[0] == b[0]
    np.testing.assert_array_equal(a[1], b[1])
    for name in a[2]:
        np.testing.assert_array_equal(a[2][name], b[2][name], err_msg=name)


@pytest.mark.parametrize("use_fast", PATHS)
@pytest.mark.parametrize("mode,K", [("approx", 1), ("approx", 2), ("approx", 4), ("approx", 8), ("naive", 2)])
def test_a_dict_with_one_width_is_the_uniform_engine(mode, K, use_fast):
    net = network()
    uniform = run(net, mode, K, use_fast)
    same(run(net, mode, {"*": K}, use_fast), uniform)
    named = run(net, mode, dict.fromkeys(units(net), K), use_fast)
    same(named, uniform)
    assert named[4].unit_bits == dict.fromkeys(units(net), K)
    assert named[4].bits == dict.fromkeys(units(net), K)      # what was passed, checked


@pytest.mark.parametrize("use_fast", PATHS)
@pytest.mark.parametrize("mode", ["approx", "naive", "exact"])
def test_every_unit_float_is_the_exact_engine(mode, use_fast):
    net = network()
    exact = run(net, "exact", 4, use_fast)
    got = run(net, mode, {"*": "float"}, use_fast)
    same(got, exact)
    assert set(got[4].unit_bits.values()) == {None}


@pytest.mark.parametrize("use_fast", PATHS)
def test_a_mixed_engine_saves_each_unit_at_its_width(use_fast):
    net = network()
    names = units(net)
    first, last = names[0], names[-1]
    bits = {"*": 2, first: 8, last: "float"}
    mixed = run(net, "approx", bits, use_fast)
    eng = mixed[4]
    assert eng.unit_bits == {**dict.fromkeys(names, 2), first: 8, last: None}
    by_width = {2: run(net, "approx", 2, use_fast), 8: run(net, "approx", 8, use_fast),
                None: run(net, "exact", 4, use_fast)}
    for name, K in eng.unit_bits.items():         # forward is exact: each slot is its width's
        np.testing.assert_array_equal(mixed[3][name], by_width[K][3][name], err_msg=name)
    assert mixed[0][0] == by_width[None][0][0]    # the forward (loss) is exact's in every mode
    # backward runs last layer first: every step before the first one that reads `first`'s
    # slot sees only units at the widths of the engine {"*": 2, last: "float"}
    tail = run(net, "approx", {"*": 2, last: "float"}, use_fast)
    checked = 0
    for step in eng.schedule:
        if step.phase != "bwd" or step.op == "loss":
            continue
        if step.name == first or step.unit == first:
            break
        for p in step.params:
            np.testing.assert_array_equal(mixed[2][p], tail[2][p], err_msg=p)
            checked += 1
    assert checked > 10
    # read at 8 bits: the unit's gamma gradient and the weight gradient of the conv it feeds
    # (its beta gradient reads only the exact mask, so it may agree)
    readers = [s.name + ".weight" for s in eng.schedule if s.phase == "bwd" and s.unit == first]
    for p in [first + ".weight"] + readers:
        assert not np.array_equal(mixed[2][p], tail[2][p]), p


def test_mixed_plan_saved_bytes_follow_the_per_unit_formula():
    net = network()
    names = units(net)
    bits = {"*": 4, names[0]: 1, names[1]: 8, names[2]: "float", names[3]: 2}
    eng = Engine(net, N, SHAPE, "approx", bits=bits, allocate=False)
    expect = 0
    for L in net.layers:
        if L.op != "bnrelu":
            continue
        c, h, w = eng.in_shape[L.name]
        K = eng.unit_bits[L.name]
        body = c * N * h * w * 4 if K is None else packing.packed_nbytes(c * N * h * w, K)
        expect += body + c * 4                   # + rstd (C,) float32
        step = next(s for s in eng.schedule if s.phase == "fwd" and s.name == L.name)
        assert step.saved_bytes == body + c * 4
        assert ("float" if K is None else f"{K}-bit") in str(step)
    others = sum(e.nbytes for e in eng.plan.entries if e.kind == "saved" and not e.name.startswith(tuple(names)))
    assert eng.plan.bytes_by_kind()["saved"] == expect + others
    assert "1-bit x1, 8-bit x1, float x1, 2-bit x1, 4-bit x3" in eng.summary()


@pytest.mark.parametrize("bits,match", [
    ({"*": 3}, r"bits\['\*'\] must be one of \{1, 2, 4, 8\} or 'float', got 3"),
    ({"*": 4, "layer1.0.bn1": "half"}, r"bits\['layer1.0.bn1'\] must be one of"),
    ({"*": 4, "layer1.0.bn1": True}, r"bits\['layer1.0.bn1'\] must be one of"),
    ({"*": 4, "nosuch": 2}, r"'nosuch', not a BN-ReLU unit of this network"),
    ({"*": 4, "layer1.0.conv1": 2}, r"'layer1.0.conv1', not a BN-ReLU unit"),
    ({"layer1.0.bn1": 2}, r"gives no width for unit\(s\) 'layer1.0.bn2'.*'\*': K"),
    ({4: 2}, r"keys are unit names or '\*'"),
])
def test_bad_bit_dicts_are_refused(bits, match):
    with pytest.raises(ValueError, match=match):
        Engine(network(), N, SHAPE, "approx", bits=bits, allocate=False)


def test_exact_mode_refuses_a_dict_with_widths_and_ignores_an_int():
    with pytest.raises(ValueError, match=r"mode 'exact' saves every x-hat in float.*'layer1.0.bn1'"):
        Engine(network(), N, SHAPE, "exact", bits={"*": "float", "layer1.0.bn1": 4}, allocate=False)
    eng = Engine(network(), N, SHAPE, "exact", bits=2, allocate=False)
    assert eng.bits == 2 and set(eng.unit_bits.values()) == {None}


@pytest.mark.parametrize("mode", ["exact", "approx", "naive"])
def test_an_unknown_unit_name_is_refused_in_every_mode(mode):
    with pytest.raises(ValueError, match=r"'nosuch', not a BN-ReLU unit of this network"):
        Engine(network(), N, SHAPE, mode, bits={"nosuch": "float"}, allocate=False)
    eng = Engine(network(), N, SHAPE, mode, bits={"*": "float", "layer1.0.bn1": "float"}, allocate=False)
    assert set(eng.unit_bits.values()) == {None}
