"""lowmem/core/plan.py and the engine's planning: computable from shapes alone, one entry per array."""
import tracemalloc

import numpy as np
import pytest

from lowmem.core.engine import Engine
from lowmem.models import preact_resnet_cifar
from lowmem.core.plan import KINDS, Plan


def test_a_plan_draws_no_weight():
    """Engine(..., allocate=False) needs parameter shapes only: no weight or statistic is built."""
    net = preact_resnet_cifar(1001)
    tracemalloc.start()
    try:
        eng = Engine(net, 128, (3, 32, 32), "approx", 4, allocate=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert net._params == {} and net._stats == {}
    params = eng.plan.bytes_by_kind()["params"]
    assert params == 4 * net.num_params() and params > 40e6     # ResNet-1001: 10.3M parameters
    assert peak < params / 4, peak                               # far less than the weights


def test_drawing_later_gives_the_same_weights_as_drawing_at_once():
    a, b = preact_resnet_cifar(20, seed=3), preact_resnet_cifar(20, seed=3)
    Engine(b, 2, (3, 8, 8), allocate=False)                      # b plans first, draws later
    for (na, pa), (nb, pb) in zip(a.params.items(), b.params.items()):
        assert na == nb
        np.testing.assert_array_equal(pa.data, pb.data)


def test_plan_entries_and_kinds():
    p = Plan()
    p.add("x", "input", (3, 4), "float32")
    p.add("c", "saved", (5,), "uint8")
    assert p.total_bytes == 48 + 5 and p.bytes_by_kind()["input"] == 48
    assert set(p.bytes_by_kind()) == set(KINDS)
    with pytest.raises(ValueError, match="duplicate"):
        p.add("x", "saved", (1,), "uint8")
    with pytest.raises(ValueError, match="unknown plan kind"):
        p.add("y", "activations", (1,), "uint8")


def test_the_input_and_labels_slots_are_planned():
    eng = Engine(preact_resnet_cifar(8), 16, (3, 32, 32), "approx", 4, allocate=False)
    entries = {e.name: e for e in eng.plan.entries}
    assert entries["input"].kind == "input" and entries["input"].nbytes == 16 * 3 * 32 * 32 * 4
    assert entries["labels"].kind == "input" and entries["labels"].dtype == "int64"
    assert "relu.mask" not in entries          # the code backward masks chunk by chunk


def _pool_builder_nets():
    """Two builder networks whose largest activation is a max-pool's: a 3x3/2 stem pool
    (ImageNet-style) and a chain of 2x2/2 pools."""
    from lowmem.nn import Graph
    g = Graph("stem-pool", (3, 48, 48), 5)
    h = g.max_pool(g.bn_relu(g.conv(g.input, 64, 3)), 3, 2, 1)
    h = g.conv(g.bn_relu(h), 16, 3)
    a = g.head(g.bn_relu(g.add(h, g.conv(g.bn_relu(h), 16, 3))))
    g = Graph("pool-chain", (3, 32, 32), 4)
    h = g.conv(g.bn_relu(g.max_pool(g.conv(g.input, 96, 3), 2)), 32, 3)
    b = g.head(g.bn_relu(g.max_pool(h, 2)))
    return a, b


STEADY_NETS = ["resnet", "wrn", "vgg-bn", "imagenet-stem", "builder-stem", "builder-chain"]


def _steady_net(name):
    from lowmem import models
    return {"resnet": (lambda: models.preact_resnet_cifar(8), 8, (3, 16, 16)),
            "wrn": (lambda: models.wide_resnet(10, 2), 4, (3, 16, 16)),
            "vgg-bn": (lambda: models.vgg_bn(11), 4, (3, 32, 32)),
            "imagenet-stem": (lambda: models.preact_resnet_imagenet(18, num_classes=10), 2, (3, 32, 32)),
            "builder-stem": (lambda: _pool_builder_nets()[0], 16, (3, 48, 48)),
            "builder-chain": (lambda: _pool_builder_nets()[1], 16, (3, 32, 32))}[name]


def _check_steady_step(name):
    from lowmem.tools.peak_memory import measure_peak
    factory, n, shape = _steady_net(name)
    for mode in ("approx", "exact"):
        bound = Engine(factory(), n, shape, mode, 4, allocate=False).plan.temporary_bytes
        m = measure_peak(factory(), n, shape, mode, 4, steps=2)
        # building holds the plan's arrays plus the engine's Python objects (schedule, views: ~0.1-0.2 MiB)
        assert m.plan_bytes <= m.held_bytes <= m.plan_bytes + (512 << 10), (name, mode, m.held_bytes, m.plan_bytes)
        # a steady step allocates at most the stated temporaries on top of what it holds
        step = m.peak_bytes - m.held_bytes
        assert step <= bound + (64 << 10), (name, mode, step, bound)


@pytest.fixture
def one_thread():
    from lowmem.system import threads
    before = threads.threads()
    threads.configure(1)
    yield
    threads.configure(before)


@pytest.mark.parametrize("name", STEADY_NETS)
def test_a_steady_step_stays_within_the_plan_and_its_stated_temporaries(name, one_thread):
    """What lowmem plan --measure reports (peak_memory.measure_peak) stays within
    what the engine holds (the plan, plus its Python objects) plus the plan's stated bound on
    temporaries (plus 64 KiB of interpreter bookkeeping) for every kind of network, pools included.
    Max-pool forward and backward used to allocate output-sized masks and a `where` copy per
    window offset (VGG-11-BN measured 1.16-1.21x its plan; the two builder nets here 2x their bound)."""
    _check_steady_step(name)


@pytest.mark.parametrize("name", STEADY_NETS)
def test_a_steady_step_stays_within_the_plan_with_lowmem_threads(name):
    """The same at the default thread count: conv2d_backward_weight keeps one weight-sized partial
    sum per thread (and one more while it adds a chunk), which the plan's bound counts."""
    _check_steady_step(name)
