"""lowmem/core/network.py: declared parameters drawn lazily, and per-step bookkeeping that stays
O(layers): a training step never walks every parameter spec once per layer (a walk that did
made a ResNet-1001 step grow with depth squared)."""
import re

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


# ---- records: the architecture as plain data ----------------------------------------------

def test_records_rebuild_every_registry_family_with_the_same_plan():
    import json
    from lowmem import models
    from lowmem.core.engine import Engine
    from lowmem.core.network import network_from_records, network_records
    for name, depth, shape in (("preact-cifar", 20, (3, 32, 32)), ("resnet", 18, (3, 32, 32)),
                               ("densenet", 121, (3, 32, 32)), ("mobilenet", 2, (3, 32, 32)),
                               ("vgg-bn", 11, (3, 32, 32)), ("wrn-2", 10, (3, 32, 32))):
        net = models.build_model(name, depth)
        back = network_from_records(json.loads(json.dumps(network_records(net))))
        assert back.layers == net.layers and back.param_shapes() == net.param_shapes(), name
        plans = [Engine(n, 2, shape, "approx", 4, allocate=False).plan.report(max_rows=10 ** 6) for n in (net, back)]
        assert plans[0] == plans[1], name


@pytest.mark.parametrize("change,words", [
    (lambda r: r.update(name=" "), "name ' ' is not a non-empty string"),
    (lambda r: r.update(num_classes=True), "num_classes True is not a positive integer"),
    (lambda r: r["layers"][0].update(op="__init__"), "op '__init__' is not a layer"),
    (lambda r: r["layers"][0].update(k="3"), "layer 0: k '3' is not an integer"),
    (lambda r: r["layers"][0].update(extra=1), "layer 0 is not an object of"),
    (lambda r: r["layers"].pop(), "the last two layers are not the head"),
    (lambda r: next(L for L in r["layers"] if L["op"] == "add").update(src="elsewhere"),
     "is not one a network of these layers holds"),
    (lambda r: r.pop("layers"), "expected an object of name"),
])
def test_records_that_are_no_network_are_refused_by_name(change, words):
    from lowmem import models
    from lowmem.core.network import network_from_records, network_records
    records = network_records(models.build_model("resnet", 18))
    change(records)
    with pytest.raises(NetworkError, match=re.escape(words)):
        network_from_records(records)
