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



@pytest.mark.parametrize("mode", ["exact", "approx"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_post_activation_block_end_runs_as_one_handler(monkeypatch, mode, dtype):
    """forward_groups: with the fused batch-norm kernels, a BN -> add -> ReLU block end runs as
    BN.forward_add_relu; the step (loss, logits, every gradient, every saved slot, eval logits)
    is the one its three forwards give, bit for bit."""
    from lowmem.core import engine as engine_module
    from lowmem.core.optable import _block_end, forward_groups
    from lowmem.units import norm as norm_module, norm_cpu
    if not norm_cpu.AVAILABLE:
        pytest.skip("numba not installed")
    monkeypatch.setattr(engine_module.kernels, "select_norms", lambda xp, fused, keeper, partials=None:
                        norm_module.FusedNormKernels(norm_cpu, keeper))
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((5, 3, 8, 8)).astype(dtype), rng.integers(0, 4, 5)
    runs = {}
    for fuse in (True, False):
        if not fuse:
            monkeypatch.setattr(engine_module, "forward_groups", lambda schedule, fused: forward_groups(schedule, False))
        eng = Engine(reference.random_graph("postact", np.random.default_rng(9)), 5, (3, 8, 8), mode=mode, bits=4,
                     dtype=dtype)
        fused = [h for h, _ in eng._forward_groups if h is _block_end]
        assert len(fused) == (1 if fuse else 0)
        loss, logits = eng.forward(x, y)
        saved = {e.name: np.array(eng.arrays[e.name]) for e in eng.plan.entries if e.kind == "saved"}
        eng.backward()
        runs[fuse] = (loss, logits, {p.name: p.grad.copy() for p in eng.net.parameters()}, saved, eng.predict(x))
    (l1, o1, g1, s1, p1), (l2, o2, g2, s2, p2) = runs[True], runs[False]
    assert l1 == l2
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(p1, p2)
    for name in g2:
        np.testing.assert_array_equal(g1[name], g2[name])
    assert s1.keys() == s2.keys()
    for name in s2:
        np.testing.assert_array_equal(s1[name], s2[name], err_msg=name)


def test_a_batch_norm_output_read_twice_is_not_fused():
    """The batch norm's output read by a conv as well as the add: its tensor is needed, so the
    three steps run on their own."""
    from lowmem.core.optable import _block_end, forward_groups
    g = nn.Graph("twice", (3, 8, 8), 4)
    x = g.bn_relu(g.conv(g.input, 6, 3, name="c1"), name="u1")
    h = g.bn(g.conv(x, 6, 3, name="c2"), name="b2")
    z = g.relu(g.add(h, x, name="add"), name="r")
    net = g.head(g.add(z, g.conv(h, 6, 1, name="c3"), name="add2"))
    eng = Engine(net, 2, (3, 8, 8), allocate=False)
    assert not [h for h, _ in forward_groups(eng.schedule, True) if h is _block_end]
    g2 = nn.Graph("once", (3, 8, 8), 4)
    x = g2.bn_relu(g2.conv(g2.input, 6, 3, name="c1"), name="u1")
    h = g2.bn(g2.conv(x, 6, 3, name="c2"), name="b2")
    eng2 = Engine(g2.head(g2.relu(g2.add(h, x, name="add"), name="r")), 2, (3, 8, 8), allocate=False)
    assert [h for h, _ in forward_groups(eng2.schedule, True) if h is _block_end]


def test_a_synchronized_block_end_takes_the_global_batch(monkeypatch):
    """With sync_bn, the one-pass block end takes its statistics over all ranks and updates the
    running statistics with the global count: rank 1 of 2 (whose allreduce stands in for rank 0
    holding the same shard) equals one process at the batch of both shards."""
    from lowmem.core import engine as engine_module
    from lowmem.core.optable import _block_end
    from lowmem.system import distributed
    from lowmem.units import norm as norm_module, norm_cpu
    if not norm_cpu.AVAILABLE:
        pytest.skip("numba not installed")
    monkeypatch.setattr(engine_module.kernels, "select_norms", lambda xp, fused, keeper, partials=None:
                        norm_module.FusedNormKernels(norm_cpu, keeper))

    class Rank1(distributed.Communicator):
        rank, size = 1, 2

        def allreduce(self, a):
            a *= 2

    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((5, 3, 8, 8)), rng.integers(0, 4, 5)
    net = reference.random_graph("postact", np.random.default_rng(9))
    two = Engine(copy.deepcopy(net), 5, (3, 8, 8), mode="approx", bits=4, dtype="float64", comm=Rank1(),
                 sync_bn=True)
    one = Engine(copy.deepcopy(net), 10, (3, 8, 8), mode="approx", bits=4, dtype="float64")
    assert [h for h, _ in two._forward_groups if h is _block_end]
    two.forward(x, y)
    one.forward(np.concatenate([x, x]), np.concatenate([y, y]))
    assert two.run.stats.keys() == one.run.stats.keys()
    for name, want in one.run.stats.items():
        np.testing.assert_allclose(two.run.stats[name], want, rtol=1e-12, atol=1e-14, err_msg=name)
