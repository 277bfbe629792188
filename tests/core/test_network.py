"""lowmem/core/network.py: declared parameters drawn lazily, and per-step bookkeeping that stays
O(layers): a training step never walks every parameter spec once per layer (a walk that did
made a ResNet-1001 step grow with depth squared)."""
import numpy as np
import pytest

from lowmem.core.engine import Engine
from lowmem.models import preact_resnet_cifar
from lowmem.core.network import BUFFERS, Network, NetworkError
from lowmem.train.optim import SGD


def test_parameters_are_declared_then_drawn_once_in_order():
    net = preact_resnet_cifar(8)
    assert net._params == {}                              # declared only: a plan draws nothing
    Engine(net, 2, (3, 8, 8), "approx", allocate=False)
    assert net._params == {}
    first = net.params
    assert list(first) == [n for n, _, _ in net.param_shapes()]
    assert net.params is first and all(net.params[n] is first[n] for n in first)


def test_a_training_step_does_not_walk_the_parameter_specs(monkeypatch):
    """Count, not time: after the engine is built, a step never re-walks the specs (Network._draw),
    and reads Network.params / .stats a number of times that does not grow with depth."""
    counts = {}
    for depth in (8, 20):
        net = preact_resnet_cifar(depth)
        eng = Engine(net, 2, (3, 8, 8), "approx", bits=4)
        opt = SGD(net.parameters(), lr=0.01, momentum=0.9)
        calls = {"draw": 0, "params": 0, "stats": 0}
        draw, params, stats = Network._draw, Network.params, Network.stats

        def counted(name, prop):
            def get(self):
                calls[name] += 1
                return prop.fget(self)
            return property(get)

        def counted_draw(self):
            calls["draw"] += 1
            return draw(self)
        monkeypatch.setattr(Network, "_draw", counted_draw)
        monkeypatch.setattr(Network, "params", counted("params", params))
        monkeypatch.setattr(Network, "stats", counted("stats", stats))
        rng = np.random.default_rng(0)
        x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
        eng.train_step(x, rng.integers(0, 10, 2), opt)
        monkeypatch.undo()
        assert calls["draw"] == 0, calls
        counts[depth] = calls
    assert counts[8]["params"] == counts[20]["params"] and counts[8]["stats"] == counts[20]["stats"], counts
    assert counts[20]["params"] <= 2, counts


def test_buffers_and_the_error_type_are_defined_here():
    assert BUFFERS == ("act0", "act1", "res")
    assert issubclass(NetworkError, ValueError)


def test_avgpool2d_and_head_records():
    net = Network("n", 3, 2)
    net.avgpool2d("p", "act0", "act1", k=3)
    net.avgpool2d("q", "act1", "act0", k=2, stride=1, pad=1)
    assert [(L.op, L.k, L.stride, L.pad) for L in net.layers] == [("avgpool2d", 3, 3, 0), ("avgpool2d", 2, 1, 1)]
    with pytest.raises(ValueError, match="declared twice"):
        net.head("act0", 4)
        net.head("act0", 4)
