"""lowmem/core/optable/: every op's entry is complete, and the op added through it (the k x k
average pool, docs/engine.md) is right: its ops against a naive reference and float64 finite
differences, its engine gradients against finite differences of the engine's own loss, its
ONNX node against onnxruntime."""
import copy

import numpy as np
import pytest

import reference
from lowmem.formats import onnx_export
from lowmem import nn
from lowmem.core.engine import Engine
from lowmem.core.network import Network
from lowmem.ops import avgpool2d_backward, avgpool2d_forward, conv_out_size
from lowmem.core.optable import HEAD, OPS, STEP_ONLY

LAYER_OPS = [op for op in OPS if op not in STEP_ONLY]


@pytest.mark.parametrize("op", list(OPS))
def test_every_entry_has_the_whole_interface(op):
    e = OPS[op]
    for name in ("check", "plan", "slots", "route", "forward", "backward"):
        assert callable(getattr(e, name)), (op, name)
    if op in LAYER_OPS:
        assert callable(e.out_shape) and callable(e.onnx), op
        if op not in HEAD:                    # every body op has its Network builder method
            assert callable(getattr(Network, op)), op


@pytest.mark.parametrize("k,stride,pad,H,W", [(2, 2, 0, 6, 6), (3, 1, 1, 5, 6), (3, 2, 1, 7, 7), (2, 1, 0, 4, 5)])
def test_avgpool2d_forward_matches_naive_loops_and_backward_finite_differences(rng, k, stride, pad, H, W):
    x = rng.standard_normal((3, 2, H, W))
    Ho, Wo = conv_out_size(H, k, stride, pad), conv_out_size(W, k, stride, pad)
    out = np.empty((3, 2, Ho, Wo))
    avgpool2d_forward(out, x, k, stride, pad)
    np.testing.assert_allclose(out, reference.avgpool_ref(x, k, stride, pad), rtol=1e-12, atol=1e-15)
    dout = rng.standard_normal(out.shape)
    dx = np.full_like(x, np.nan)                     # overwritten, never read
    avgpool2d_backward(dx, dout, k, stride, pad)

    def loss():
        avgpool2d_forward(out, x, k, stride, pad)
        return float(np.sum(out * dout))
    reference.check_grad(loss, x, dx, rng, eps=1e-3)  # linear: any eps works


def test_an_avg_pool_network_trains_with_finite_difference_gradients(rng):
    """float64, exact mode: the engine's gradients of its own loss (batch statistics, training
    forward) match central differences, for the conv before the pool and the one after."""
    net = reference.units_randomized(reference.tiny_graph("avg"), rng)
    assert [L.op for L in net.layers].count("avgpool2d") == 1
    x = rng.standard_normal((4, 3, 8, 8))
    y = rng.integers(0, 3, 4)
    eng = Engine(net, 4, (3, 8, 8), mode="exact", dtype="float64")
    eng.forward(x, y)
    eng.backward()
    grads = {p.name: p.grad.copy() for p in net.parameters()}

    def loss():
        return eng.forward(x, y)[0]
    for name in ("conv1.weight", "conv2.weight", "bn2.weight"):
        reference.check_grad(loss, net.params[name].data, grads[name], rng, eps=1e-5, rtol=1e-5, atol=1e-9)


def test_avg_pool_in_approx_mode_forward_equals_exact(rng):
    net = reference.units_randomized(reference.tiny_graph("avg"), rng)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    y = rng.integers(0, 3, 4)
    out = {m: Engine(copy.deepcopy(net), 4, (3, 8, 8), mode=m, bits=2).forward(x, y) for m in ("exact", "approx")}
    assert out["exact"][0] == out["approx"][0]
    np.testing.assert_array_equal(out["exact"][1], out["approx"][1])


def test_avg_pool_builder_rules():
    g = nn.Graph("t", (3, 8, 8), 3)
    x = g.bn_relu(g.conv(g.input, 4, 3))
    with pytest.raises(nn.NetworkError, match="avg_pool 'avgpool1': pad 2 must be at most k // 2 = 1"):
        g.avg_pool(x, 2, pad=2)
    with pytest.raises(nn.NetworkError, match="avg_pool 'avgpool1': k must be an int >= 1"):
        g.avg_pool(x, 0)
    p = g.avg_pool(x, 2)                             # a conv may read it, its input feed more layers
    q = g.conv(x, 4, 3, stride=2)
    s = g.add(g.conv(p, 4, 3, name="c"), q)
    net = g.head(g.bn_relu(s))
    assert {L.name: L.op for L in net.layers}["c"] == "conv"


def test_avg_pool_onnx_node_runs_in_onnxruntime(tmp_path, rng):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    net = reference.units_randomized(reference.tiny_graph("avg"), rng)
    x = rng.standard_normal((3, 3, 8, 8)).astype(np.float32)
    logits = Engine(net, 3, (3, 8, 8)).predict(x)
    path = onnx_export.export_onnx(net, tmp_path / "m.onnx")
    (out,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["logits"], {"input": x})
    assert float(np.abs(out - logits).max()) <= 1e-5 * float(np.abs(logits).max())
