"""lowmem/plan.py and the engine's planning: computable from shapes alone, one entry per array."""
import tracemalloc

import numpy as np
import pytest

from lowmem.engine import Engine
from lowmem.models import preact_resnet_cifar
from lowmem.plan import KINDS, Plan


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
