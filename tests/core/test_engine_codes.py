"""The one-pass kernels of the codes the general graph's ops keep (the range code of a conv's,
a linear layer's or a lone BN's input, units/rangecode_cpu.py; ReLU's, ReLU6's and dropout's
masks and max-pool's indices, ops/codes.py's numba set) leave a training step bit for bit what
it was on the NumPy references: the loss, the logits and every parameter gradient of
the same engine, run once on its kernels and once with the references swapped in, for every
hand-built graph of the newer ops (post-activation, dense, inverted residual, biased,
classifier) and a small residual network with a max-pool (and their eval logits), float32 and float64, 4-bit nearest
and 2-bit unbiased codes, at a batch whose activations end in partial groups."""
import numpy as np
import pytest

from lowmem.core.engine import Engine
from lowmem.ops import codes
from lowmem.units import rangecode_cpu
from reference import GRAPHS, batch, random_graph, randomize_units, tiny_graph

pytestmark = pytest.mark.skipif(not rangecode_cpu.AVAILABLE, reason="numba not installed")
SHAPE = (3, 8, 8)          # every graph here reads 3x8x8 inputs


def on_references(eng):
    """The engine with its code kernels swapped for the NumPy references."""
    eng.keeper.kernels = None
    eng.run.codes = codes.REFERENCE
    return eng


def step(eng, x, y):
    loss, logits = eng.forward(x, y)
    logits = logits.copy()
    eng.backward()
    grads = {p.name: p.grad.copy() for p in eng.net.parameters()}
    return loss, np.concatenate([logits, eng.predict(x)]), grads


def network(which, rng):
    return randomize_units(tiny_graph("max"), rng) if which == "tiny" else random_graph(which, rng)


@pytest.mark.parametrize("which", sorted(GRAPHS) + ["tiny"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("bits,rounding", [(4, "nearest"), (2, "stochastic")])
def test_a_step_is_bit_identical_on_the_code_kernels(which, dtype, bits, rounding):
    rng = np.random.default_rng(5)
    net = network(which, rng)
    x, y = batch(rng, net, 3, SHAPE, dtype)
    steps = []
    for swap in (False, True):
        net_copy = network(which, np.random.default_rng(5))
        eng = Engine(net_copy, 3, SHAPE, mode="approx", bits=bits, rounding=rounding, dtype=dtype)
        assert eng.keeper.kernels is rangecode_cpu and eng.run.codes is codes.NUMBA
        steps.append(step(on_references(eng) if swap else eng, x, y))
    (loss, logits, grads), (ref_loss, ref_logits, ref_grads) = steps
    assert loss == ref_loss and np.array_equal(logits, ref_logits)
    for name, g in ref_grads.items():
        assert np.array_equal(grads[name], g), name


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("bits,rounding", [(4, "nearest"), (2, "stochastic")])
def test_the_depthwise_weight_gradient_reads_the_kept_code_itself(monkeypatch, dtype, bits, rounding):
    """A depthwise conv whose input is kept as a range code (the inverted residual's 3x3 reads a
    ReLU6's output) gets its weight gradient from the code (ops/depthwise_cpu.py decodes it block
    by block), no buffer decoded first: the step bit for bit the one that decodes first."""
    from lowmem.core.optable import conv as conv_op
    from lowmem.ops import depthwise_cpu
    rng = np.random.default_rng(7)
    net = network("inverted", rng)
    x, y = batch(rng, net, 3, SHAPE, dtype)
    calls = []
    coded = depthwise_cpu.backward_weight_coded
    monkeypatch.setattr(depthwise_cpu, "backward_weight_coded", lambda *a: (calls.append(a[2]), coded(*a)))
    steps = []
    for decode_first in (False, True):
        if decode_first:
            monkeypatch.setattr(conv_op, "coded_input", lambda *a: None)
        eng = Engine(network("inverted", np.random.default_rng(7)), 3, SHAPE, mode="approx", bits=bits,
                     rounding=rounding, dtype=dtype)
        steps.append(step(eng, x, y))
        if not decode_first:
            assert calls == [(12, 3, 8, 8)]                  # the depthwise conv, once
            calls.clear()
    assert not calls
    (loss, logits, grads), (ref_loss, ref_logits, ref_grads) = steps
    assert loss == ref_loss and np.array_equal(logits, ref_logits)
    for name, g in ref_grads.items():
        assert np.array_equal(grads[name], g), name
