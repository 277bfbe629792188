"""Hand-built Networks (lowmem/core/network.py's named buffers) that nn.check refuses
must be refused by the engine too, with the same message, never an AssertionError, a bare
KeyError such as ('act1', 1), or a run that silently computes something else.

Each network breaks one rule of nn.check; the test asks nn.check for its message and expects
Engine (building it, or its first training step) to raise a ValueError (NetworkError is one)
carrying that message. An engine that did not apply nn.check itself raised AssertionError,
KeyError, other wording, or ran: conv_in_place, bn_reads_input,
res_plus_res and pool_window_too_big train without complaint (the last with 4-bit window
indices that overflow, so its gradients are wrong).
"""
import numpy as np
import pytest

from lowmem import nn
from lowmem.core.engine import Engine
from lowmem.core.network import Network
from lowmem.train.optim import SGD

SHAPE = (3, 8, 8)


def _net():
    return Network("hand", 3, 4)


def conv_reads_conv():
    n = _net()
    n.conv("c1", "input", "act0", 3, 8, 3)
    n.conv("c2", "act0", "act1", 8, 8, 3)                  # a conv reading a conv (its input kept)
    n.bnrelu("b", "act1", "act1", 8)
    n.head("act1", 8)
    return n


def read_before_write():
    n = _net()
    n.conv("c1", "input", "act0", 3, 8, 3)
    n.bnrelu("b", "act1", "act1", 8)                       # act1 was never written
    n.head("act1", 8)
    return n


def conv_in_place():
    n = _net()
    n.conv("c1", "input", "act0", 3, 8, 3)
    n.bnrelu("b", "act0", "act0", 8)
    n.conv("c2", "act0", "act0", 8, 8, 3)                  # reads and overwrites its own input
    n.bnrelu("b2", "act0", "act1", 8)
    n.head("act1", 8)
    return n


def bn_reads_input():
    n = _net()
    n.bnrelu("b", "input", "act0", 3)                      # a unit reading the network input
    n.conv("c1", "act0", "act1", 3, 8, 3)
    n.bnrelu("b2", "act1", "act1", 8)
    n.head("act1", 8)
    return n


def unread_output():
    n = _net()
    n.conv("c1", "input", "act0", 3, 8, 3)
    n.conv("c0", "input", "act1", 3, 8, 3)                 # nobody reads act1
    n.bnrelu("b", "act0", "act0", 8)
    n.head("act0", 8)
    return n


def res_plus_res():
    n = _net()
    n.conv("c1", "input", "res", 3, 8, 3)
    n.add("ad", "res")                                     # res += res
    n.bnrelu("b", "res", "act0", 8)
    n.head("act0", 8)
    return n


def add_before_res():
    n = _net()
    n.conv("c1", "input", "act0", 3, 8, 3)
    n.add("ad", "act0")                                    # res was never written
    n.bnrelu("b", "res", "act0", 8)
    n.head("act0", 8)
    return n


def channel_mismatch():
    n = _net()
    n.conv("c1", "input", "act0", 3, 8, 3)
    n.bnrelu("b", "act0", "act0", 6)                       # act0 holds 8 channels
    n.head("act0", 8)
    return n


def head_not_last():
    n = _net()
    n.conv("c1", "input", "act0", 3, 8, 3)
    n.bnrelu("b", "act0", "act0", 8)
    n.head("act0", 8)
    n.bnrelu("b2", "act0", "act1", 8)                      # a layer after the head
    return n


def shared_gradient():
    n = _net()
    n.conv("c1", "input", "act0", 3, 8, 3)
    n.bnrelu("b", "act0", "act0", 8)
    n.maxpool("p", "act0", "act1")
    n.conv("c2", "act0", "res", 8, 8, 3, 2)                # the pool's input read again after the pool
    n.bnrelu("b2", "act1", "act1", 8)
    n.add("ad", "act1")
    n.bnrelu("b3", "res", "act0", 8)
    n.head("act0", 8)
    return n


def pool_window_too_big():
    n = _net()
    n.conv("c1", "input", "act0", 3, 8, 3)
    n.maxpool("p", "act0", "act1", 5, 2, 2)                # 25 window offsets > a 4-bit index
    n.bnrelu("b", "act1", "act1", 8)
    n.head("act1", 8)
    return n


def branch_feeds_after_add():
    n = _net()
    n.conv("c1", "input", "res", 3, 8, 3)
    n.bnrelu("b", "res", "act0", 8)
    n.conv("c2", "act0", "act1", 8, 8, 3)
    n.add("ad", "act1")
    n.bnrelu("b2", "act1", "act0", 8)                      # the add's operand read after the add
    n.bnrelu("b3", "res", "act1", 8)
    n.head("act1", 8)
    return n


CASES = [read_before_write, conv_in_place, unread_output, add_before_res, channel_mismatch, head_not_last,
         pool_window_too_big, branch_feeds_after_add]
# refused while lowmem ran every network through three fixed buffers; any DAG runs now
VALID = [conv_reads_conv, bn_reads_input, res_plus_res, shared_gradient]


@pytest.mark.parametrize("build", CASES, ids=[f.__name__ for f in CASES])
def test_the_engine_refuses_what_check_refuses_with_the_same_message(build):
    with pytest.raises(nn.NetworkError) as checked:
        nn.check(build(), SHAPE)
    net = build()
    x = np.random.default_rng(0).standard_normal((2,) + SHAPE).astype(np.float32)
    with pytest.raises(ValueError) as refused:
        eng = Engine(net, 2, SHAPE)
        eng.train_step(x, np.array([0, 1]), SGD(net.parameters(), lr=0.1))
    assert str(checked.value) in str(refused.value), (str(refused.value), str(checked.value))


@pytest.mark.parametrize("build", VALID, ids=[f.__name__ for f in VALID])
def test_records_the_three_buffer_rules_refused_now_train_correctly(build):
    """float64, exact mode: every parameter's and the input's gradient against central
    differences of the engine's own loss."""
    from reference import check_directional, randomize_units
    rng = np.random.default_rng(5)
    net = build()
    eng = Engine(net, 3, SHAPE, mode="exact", dtype="float64")
    randomize_units(net, rng)
    x, y = rng.standard_normal((3,) + SHAPE), np.array([0, 1, 3])
    eng.forward(x, y)
    dx = eng.backward(input_grad=True)
    grads = {p.name: p.grad.copy() for p in net.parameters()}

    def loss():
        return eng.forward(x, y)[0]
    for name, g in grads.items():
        check_directional(loss, [net.params[name].data], [g], rng, f"{net.name} {name}")
    check_directional(loss, [x], [dx], rng, "input")
