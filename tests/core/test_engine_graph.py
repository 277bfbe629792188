"""Any DAG of the supported ops: buffers from liveness, gradients where tensors meet.

* Networks the three fixed buffers could not run (a conv reading a conv, a pool or an add;
  a tensor feeding many layers; nested residuals; a pool whose input feeds later layers;
  an add whose branch feeds other layers; a + a; four tensors alive at once; post-activation
  blocks, a dense block, inverted residuals, flatten + linear layers before the head) build, plan
  and pass float64 finite differences of the engine's own loss (every parameter, the input),
  and their approx 4-bit forward equals the exact one bit for bit.
* The liveness colouring finds the paper's three buffers on the pre-activation ResNets: the
  ResNet-164 batch-128 plan is pinned to the byte, and the builder's records equal models.py's.
* Each shared buffer is sized to the largest tensor, gradient or scratch it holds.
"""
import copy

import numpy as np
import pytest

from lowmem import models, nn
from lowmem.core.engine import Engine
from lowmem.core.network import Network
from reference import batch, check_directional, randomize_units


def stem(g, c=4):
    return g.conv(g.input, c, 3, name="stem")


def conv_reads_conv():
    g = nn.Graph("conv-conv", (3, 8, 8), 3)
    x = g.conv(stem(g), 4, 3, name="c2")                   # a conv reading a conv
    return g.head(g.bn_relu(x, "b1"))


def conv_reads_pool_and_add():
    g = nn.Graph("conv-pool-add", (3, 8, 8), 3)
    x = g.bn_relu(stem(g), "b1")
    p = g.max_pool(x, 2, name="p")                          # its input feeds a layer after it
    q = g.conv(x, 4, 3, stride=2, name="after")
    s = g.add(g.conv(p, 4, 3, name="c_pool"), q, "add1")    # a conv reading a pool
    y = g.conv(s, 4, 3, name="c_add")                       # a conv reading an add
    z = g.conv(s, 4, 1, pad=0, name="c_add2")               # ... and a second conv reading it
    return g.head(g.bn_relu(g.add(y, z, "add2"), "b2"))


def nested_residuals():
    g = nn.Graph("nested", (3, 8, 8), 3)
    x = stem(g)
    a = g.bn_relu(x, "b1")
    inner_skip = g.conv(a, 4, 3, name="c1")
    inner = g.add(inner_skip, g.conv(g.bn_relu(inner_skip, "b2"), 4, 3, name="c2"), "inner")
    outer = g.add(x, g.conv(g.bn_relu(inner, "b3"), 4, 3, name="c3"), "outer")
    return g.head(g.bn_relu(outer, "b4"))


def shared_branch():
    """An add whose branch feeds a layer after it; a skip read after its add; a + a."""
    g = nn.Graph("shared", (3, 8, 8), 3)
    x = stem(g)
    h = g.conv(g.bn_relu(x, "b1"), 4, 3, name="c1")
    y = g.add(x, h, "add1")
    late = g.bn_relu(x, "late")                            # x read after add1
    z = g.add(y, g.conv(g.bn_relu(h, "b2"), 4, 3, name="c2"), "add2")
    w = g.add(z, g.conv(late, 4, 3, name="c3"), "add3")
    d = g.add(w, w, "double")
    return g.head(g.bn_relu(d, "b3"))


def unit_over_shared_gradient():
    """A branch ending in BN-ReLU while its skip is still open (the unit's backward cannot
    overwrite the gradient the two operands share), and a pooled residual stream."""
    g = nn.Graph("unit-branch", (3, 8, 8), 3)
    x = stem(g)
    y = g.add(x, g.bn_relu(x, "b1"), "add1")
    p = g.max_pool(y, 2, name="p")
    z = g.add(p, g.conv(g.bn_relu(p, "b2"), 4, 3, name="c1"), "add2")
    return g.head(g.bn_relu(z, "b3"))


def four_alive():
    """Four branches of one input alive at once, summed: more than three buffers."""
    g = nn.Graph("four", (3, 8, 8), 3)
    a = g.bn_relu(stem(g), "b0")
    branches = [g.conv(a, 4, 3, name=f"br{i}") for i in range(4)]
    s = g.add(branches[0], branches[1], "s1")
    s = g.add(s, branches[2], "s2")
    s = g.add(s, branches[3], "s3")
    return g.head(g.bn_relu(s, "b1"))


def input_read_by_many():
    """The network input read by a pool, a BN-ReLU unit and a conv."""
    g = nn.Graph("input-many", (3, 8, 8), 3)
    p = g.avg_pool(g.input, 2, name="pool_in")
    u = g.bn_relu(g.input, "bn_in")
    c = g.conv(u, 3, 3, stride=2, name="c1")
    s = g.add(p, c, "add1")
    return g.head(g.bn_relu(g.conv(s, 4, 3, name="c2"), "b1"))


def post_activation_blocks():
    """torchvision's basic block: conv-bn-relu-conv-bn, + skip (a strided 1x1 conv + bn where the
    shape changes), then relu; the next conv reads relu(add)."""
    g = nn.Graph("post-act", (3, 8, 8), 3)
    x = g.relu(g.bn(g.conv(g.input, 4, 3, name="conv1"), "bn1"), "relu1")
    for i, (c, s) in enumerate(((4, 1), (8, 2))):
        h = g.bn_relu(g.conv(x, c, 3, s, name=f"b{i}.conv1"), f"b{i}.bn1")
        h = g.bn(g.conv(h, c, 3, name=f"b{i}.conv2"), f"b{i}.bn2")
        skip = x if s == 1 else g.bn(g.conv(x, c, 1, s, 0, name=f"b{i}.down"), f"b{i}.down_bn")
        x = g.relu(g.add(h, skip, f"b{i}.add"), f"b{i}.relu")
    return g.head(x)


def dense_block():
    """DenseNet-BC style: each layer reads the concat of everything before it."""
    g = nn.Graph("dense", (3, 8, 8), 3)
    feats = [g.conv(g.input, 4, 3, name="stem")]
    for i in range(3):
        x = feats[0] if len(feats) == 1 else g.concat(*feats, name=f"cat{i}")
        h = g.conv(g.bn_relu(x, f"l{i}.bn1"), 8, 1, pad=0, name=f"l{i}.conv1")
        feats.append(g.conv(g.bn_relu(h, f"l{i}.bn2"), 2, 3, name=f"l{i}.conv2"))
    x = g.concat(*feats, name="cat_out")
    x = g.avg_pool(g.conv(g.bn_relu(x, "trans.bn"), 4, 1, pad=0, name="trans.conv"), 2, name="trans.pool")
    return g.head(g.bn_relu(x, "bn_final"))


def inverted_residuals():
    """MobileNetV2 style: 1x1 expand -> bn -> relu6 -> 3x3 depthwise -> bn -> relu6 -> 1x1 project
    -> bn (no ReLU) + skip; a conv with a bias and dropout before the head."""
    g = nn.Graph("inverted", (3, 8, 8), 3)
    x = g.relu6(g.bn(g.conv(g.input, 4, 3, name="stem"), "stem_bn"), "stem_act")
    for i in range(2):
        h = g.relu6(g.bn(g.conv(x, 8, 1, pad=0, name=f"ir{i}.expand"), f"ir{i}.bn1"), f"ir{i}.act1")
        h = g.relu6(g.bn(g.conv(h, 8, 3, groups=8, name=f"ir{i}.dw"), f"ir{i}.bn2"), f"ir{i}.act2")
        h = g.bn(g.conv(h, 4, 1, pad=0, name=f"ir{i}.project"), f"ir{i}.bn3")
        x = g.add(x, h, f"ir{i}.add")
    x = g.conv(x, 6, 3, groups=2, bias=True, name="grouped_bias")
    return g.head(g.dropout(g.relu(x, "last_relu"), 0.25, "drop"))


def linear_classifier():
    """VGG's classifier: flatten + linear layers (with ReLU and dropout) before the head; one
    linear layer reads a unit's output (rebuilt from its code), another a ReLU's (kept)."""
    g = nn.Graph("mlp-head", (3, 8, 8), 3)
    x = g.max_pool(g.bn_relu(g.conv(g.input, 4, 3, name="c1"), "b1"), 2, name="p1")
    x = g.linear(g.bn_relu(x, "b2"), 16, name="fc1")            # reads a unit's output
    x = g.dropout(g.relu(x, "r1"), 0.25, "d1")
    x = g.relu(g.linear(x, 12, name="fc2"), "r2")              # reads dropout's output (kept)
    x = g.linear(x, 8, bias=False, name="fc3")
    return g.head(g.relu(x, "r3"))


GRAPHS = {f.__name__: f for f in (conv_reads_conv, conv_reads_pool_and_add, nested_residuals,
                                  shared_branch, unit_over_shared_gradient, four_alive, input_read_by_many,
                                  post_activation_blocks, dense_block, inverted_residuals, linear_classifier)}


@pytest.mark.parametrize("which", list(GRAPHS))
def test_dag_gradients_match_finite_differences(rng, which):
    net = GRAPHS[which]()
    N, shape = 3, (3, 8, 8)
    eng = Engine(net, N, shape, mode="exact", dtype="float64")
    randomize_units(net, rng)
    x, y = batch(rng, net, N, shape)
    eng.forward(x, y)
    dx = eng.backward(input_grad=True)
    grads = {p.name: p.grad.copy() for p in net.parameters()}

    def loss():
        eng.step = 0                       # the same dropout masks as the step differentiated
        return eng.forward(x, y)[0]
    for name, g in grads.items():
        assert np.any(g != 0), f"{which}: {name} got no gradient"
        check_directional(loss, [net.params[name].data], [g], rng, f"{which} {name}")
    check_directional(loss, [x], [dx], rng, f"{which} input")


@pytest.mark.parametrize("which", list(GRAPHS))
def test_dag_approx_forward_is_exact_and_backward_runs(rng, which):
    net = GRAPHS[which]()
    randomize_units(net, rng)
    x, y = batch(rng, net, 4, (3, 8, 8), np.float32)
    out = {}
    for mode in ("exact", "approx"):
        eng = Engine(copy.deepcopy(net), 4, (3, 8, 8), mode=mode, bits=4)
        out[mode] = eng.forward(x, y)
        eng.backward()
        assert all(np.isfinite(p.grad).all() for p in eng.net.parameters())
    assert out["exact"][0] == out["approx"][0]
    np.testing.assert_array_equal(out["exact"][1], out["approx"][1])


def test_more_tensors_alive_get_more_buffers_each_sized_by_what_it_holds():
    eng = Engine(four_alive(), 2, (3, 8, 8), allocate=False)
    buffers = {e.name: e.nbytes for e in eng.plan.entries if e.kind == "buffers"}
    assert {"act0", "act1", "res", "act2"} <= set(buffers)
    assert set(eng.schedule.buffers) <= set(buffers)
    for b, per_sample in eng.schedule.buffers.items():
        assert buffers[b] == 2 * per_sample * 4
    table = eng.schedule.buffer_table(2)
    assert "act2" in table and "br" in table              # the layers using each buffer


def test_a_conv_reading_a_non_unit_tensor_keeps_it_once():
    """c_add and c_add2 read the same add output: one slot, filled by the first; float in exact
    mode, a 4-bit range code (plus a scale and a zero point per 256 elements) in approx mode."""
    n = 4 * 2 * 4 * 4                                       # add1's output at batch 2
    for mode in ("exact", "approx"):
        eng = Engine(conv_reads_pool_and_add(), 2, (3, 8, 8), mode=mode, bits=4, allocate=False)
        slots = {e.name: e for e in eng.plan.entries if e.kind == "saved"}
        if mode == "exact":
            assert slots["add1.out"].shape == (n,) and slots["add1.out"].dtype == "float32"
        else:
            assert slots["add1.out"].nbytes == n // 2 and slots["add1.out_scale"].shape == (1,)
            assert slots["add1.out_zero"].dtype == "uint8"
        fwd = {s.name: s for s in eng.schedule if s.phase == "fwd"}
        assert fwd["c_add"].keep == "add1.out" and fwd["c_add2"].keep == ""
        assert fwd["c_add2"].input_slot == "add1.out" and "add1.out" in str(fwd["c_add"])
        bwd = {s.name: s for s in eng.schedule if s.phase == "bwd"}
        assert bwd["c_add2"].saved == fwd["c_add"].saved                  # both read the one slot
        assert bool(bwd["c_add2"].scratch) == (mode == "approx")          # a code is decoded
        assert not any(k.startswith(("b1.", "stem.")) and k.endswith(".out") for k in slots)


def test_approx_gradients_of_kept_codes_are_close_to_exact(rng):
    """A post-activation net in approx mode: the 8-bit codes' gradients within 2% of exact
    (relative norm, seed 0), the 2-bit ones further off but correlated (cosine > 0.9)."""
    net = post_activation_blocks()
    randomize_units(net, np.random.default_rng(0))
    x, y = batch(np.random.default_rng(1), net, 8, (3, 8, 8), np.float32)
    grads = {}
    for mode, bits in (("exact", 4), ("approx", 8), ("approx", 2)):
        eng = Engine(copy.deepcopy(net), 8, (3, 8, 8), mode=mode, bits=bits)
        eng.forward(x, y)
        eng.backward()
        grads[mode, bits] = np.concatenate([p.grad.ravel() for p in eng.net.parameters()])
    g = grads["exact", 4]
    assert np.linalg.norm(grads["approx", 8] - g) < 0.02 * np.linalg.norm(g)
    g2 = grads["approx", 2]
    assert float(g2 @ g) / (np.linalg.norm(g2) * np.linalg.norm(g)) > 0.9


def test_shared_gradients_are_copied_before_they_change():
    text = str(Engine(shared_branch(), 2, (3, 8, 8), allocate=False).schedule)
    assert " copy " in text


def test_resnet164_b128_plan_is_pinned():
    """The bytes of today's plan (three shared buffers of 64x32x32 per sample)."""
    net = models.preact_resnet_cifar(164)
    want = {"exact": 1_752_588_280, "approx": 341_467_128}
    for mode, total in want.items():
        eng = Engine(net, 128, (3, 32, 32), mode, 4, allocate=False)
        assert eng.plan.total_bytes == total, mode
        buffers = {e.name: e.nbytes for e in eng.plan.entries if e.kind == "buffers"}
        assert {b: buffers[b] for b in ("act0", "act1", "res")} == dict.fromkeys(("act0", "act1", "res"),
                                                                                 64 * 32 * 32 * 128 * 4)


def test_vgg11_plan_is_pinned_and_no_larger_than_the_three_fixed_buffers():
    """VGG-11-BN b128: every buffer sized by what it holds, below the three fixed buffers'
    265,835,640 B exact / 239,916,152 B at 4 bits (each buffer the largest activation)."""
    net = models.vgg_bn(11, num_classes=10)
    want = {"exact": 207_115_384, "approx": 181_195_896}
    for mode, total in want.items():
        assert Engine(net, 128, (3, 32, 32), mode, 4, allocate=False).plan.total_bytes == total, mode


def test_the_colouring_finds_three_buffers_on_preact_networks():
    for net in (models.wide_resnet(16, 4), models.vgg_bn(11), models.wide_resnet(10, 2)):
        bufs = {b for L in net.layers for b in (L.dst, *L.reads)} - {"input", "feat", "logits"}
        assert bufs <= {"act0", "act1", "res"}, (net.name, bufs)


def test_hand_built_records_with_shared_gradients_run(rng):
    """Records check() used to refuse: a branch read after its add (the gradient is now
    copied, not lost), a unit whose output shares its gradient, res += res."""
    nets = []
    net = Network("hazard", 3, 3)
    net.conv("conv1", "input", "res", 3, 4, 3)
    net.bnrelu("bn1", "res", "act0", 4)
    net.conv("conv2", "act0", "act1", 4, 4, 3)
    net.add("add1", "act1")
    net.bnrelu("bnx", "act1", "act0", 4)              # reads the branch after the add
    net.conv("conv3", "act0", "act1", 4, 4, 3)
    net.add("add2", "act1")
    net.bnrelu("bn_final", "res", "act0", 4)
    net.head("act0", 4)
    nets.append(net)
    net = Network("doubling", 3, 3)
    net.conv("conv1", "input", "res", 3, 4, 3)
    net.bnrelu("bn1", "res", "act0", 4)
    net.add("add", "act0")
    net.add("twice", "res")                           # res += res
    net.bnrelu("bn_final", "res", "act0", 4)
    net.head("act0", 4)
    nets.append(net)
    for net in nets:
        eng = Engine(net, 3, (3, 6, 6), mode="exact", dtype="float64")
        randomize_units(net, rng)
        x, y = batch(rng, net, 3, (3, 6, 6))
        eng.forward(x, y)
        dx = eng.backward(input_grad=True)
        grads = {p.name: p.grad.copy() for p in net.parameters()}

        def loss():
            return eng.forward(x, y)[0]
        for name, g in grads.items():
            check_directional(loss, [net.params[name].data], [g], rng, f"{net.name} {name}")
        check_directional(loss, [x], [dx], rng, f"{net.name} input")


@pytest.mark.parametrize("which", ["post_activation_blocks", "dense_block", "inverted_residuals",
                                   "linear_classifier"])
def test_new_ops_export_to_onnx_and_run_in_onnxruntime(tmp_path, which):
    """bn, relu, relu6 (Clip), concat, grouped and biased convs, dropout (Identity in eval):
    onnxruntime's logits equal the engine's eval logits (float32)."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from lowmem.formats import onnx_export
    net = GRAPHS[which]()
    randomize_units(net, np.random.default_rng(0))
    x, y = batch(np.random.default_rng(1), net, 3, (3, 8, 8), np.float32)
    eng = Engine(net, 3, (3, 8, 8))
    eng.forward(x, y)                                   # running statistics off their start
    logits = eng.predict(x)
    path = onnx_export.export_onnx(net, tmp_path / "m.onnx")
    (out,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["logits"], {"input": x})
    assert float(np.abs(out - logits).max()) <= 1e-5 * float(np.abs(logits).max())


def test_a_resume_on_another_number_of_ranks_is_refused_for_dropout():
    """Dropout's masks are drawn per rank's shard: a run with dropout saved on 2 ranks cannot continue
    identically on 1 (or the reverse); the resume is refused naming the layer, in any rounding."""
    from lowmem.train import trainstate
    eng = Engine(inverted_residuals(), 4, (3, 8, 8), "exact", allocate=False)
    assert eng.rank_keyed_layers == ("drop",)

    class Config:
        rounding, mode, batch = "nearest", "exact", 8
    trainstate.check_world_size({"world_size": 2}, Config, 2, eng.split_dependent_units, "run/c.ckpt",
                                eng.rank_keyed_layers)                                  # same world: fine
    with pytest.raises(trainstate.ResumeError, match=r"cannot resume from run/c.ckpt on 1 rank\(s\): it was "
                                                     r"saved on 2, and dropout layer drop's masks"):
        trainstate.check_world_size({"world_size": 2}, Config, 1, eng.split_dependent_units, "run/c.ckpt",
                                    eng.rank_keyed_layers)
    plain = Engine(models.preact_resnet_cifar(8), 4, (3, 8, 8), "exact", allocate=False)
    assert plain.rank_keyed_layers == ()
    trainstate.check_world_size({"world_size": 2}, Config, 1, plain.split_dependent_units, "run/c.ckpt",
                                plain.rank_keyed_layers)                                # no dropout: fine
