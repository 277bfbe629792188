"""lowmem.core.inference: the eval-only engine (no saved slots, gradients or optimizer state)
computes what Engine.predict computes, on a plan that holds only what an eval forward touches."""
import copy

import numpy as np
import pytest

import reference
from lowmem.core.engine import Engine
from lowmem.core.inference import InferenceEngine
from lowmem.models import preact_resnet_cifar, preact_resnet_imagenet


def networks():
    rng = np.random.default_rng(0)
    yield reference.randomize_units(preact_resnet_cifar(8), rng), (3, 8, 8)
    yield reference.randomize_units(preact_resnet_imagenet(18, num_classes=5), rng), (3, 32, 32)
    yield reference.randomize_units(reference.tiny_graph("avg"), rng), (3, 8, 8)
    yield reference.randomize_units(reference.tiny_graph("max"), rng), (3, 8, 8)


@pytest.mark.parametrize("case", range(4))
def test_inference_logits_equal_the_training_engines_and_the_plan_is_what_it_holds(case):
    net, shape = list(networks())[case]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5,) + shape).astype(np.float32)
    inf = InferenceEngine(copy.deepcopy(net), 4, shape)
    train = Engine(copy.deepcopy(net), 4, shape, "exact")
    for chunk in (x[:4], x[4:]):                       # a full and a partial batch
        np.testing.assert_array_equal(inf.predict(chunk), train.predict(chunk))
    assert inf.plan.total_bytes == sum(a.nbytes for a in inf.arrays.values())
    by = inf.plan.bytes_by_kind()
    assert by["saved"] == by["grads"] == by["optimizer"] == 0
    assert by["params"] == train.plan.bytes_by_kind()["params"]
    assert inf.plan.total_bytes < train.plan.total_bytes - train.plan.bytes_by_kind()["saved"]
    # the network is not taken over: a training engine may still own it
    owned = Engine(net, 4, shape, "exact")
    InferenceEngine(net, 4, shape).predict(x[:2])
    owned.predict(x[:2])                                # no "belong to another Engine"


def test_inference_refuses_a_batch_larger_than_planned():
    net = preact_resnet_cifar(8)
    eng = InferenceEngine(net, 2, (3, 8, 8))
    with pytest.raises(ValueError, match="batch of 3 is larger than the planned batch_size 2"):
        eng.predict(np.zeros((3, 3, 8, 8), np.float32))
