"""lowmem.nn: networks written with the Graph builder.

* The builder reproduces lowmem/models.py's hand-written ResNets (layer
  records, buffers and initial weights; the bottleneck layout differs only
  in where the stem writes, with equal losses and gradients).
* Two custom networks (a small VGG-style BN net, a residual net with a
  pooling block) pass float64 finite differences, train (the loss falls on
  a small synthetic set, approx 4-bit) and, where torch is installed, match
  an independent PyTorch implementation (tests/torch_reference.py's
  conventions: loss, logits, every gradient, eval logits).
* The rules left (arguments, shapes, names, every output used) are enforced
  at build time with an explaining NetworkError; `check` rejects broken
  hand-built records the same way the engine does (tests/core/test_engine_graph.py runs
  the graphs the old three-buffer rules refused).
"""
import numpy as np
import pytest

from lowmem.data import datasets as data
from lowmem.data.transforms import normalize
from lowmem import models, nn
from lowmem.core.engine import Engine
from lowmem.core.network import Network
from lowmem.train.optim import SGD
from reference import batch, check_directional, randomize_units


# ------------------------------------------------------------------ networks

def block(g, x, name, width, stride, bottleneck=False):
    """The pre-activation block of lowmem/models.py, written with the builder."""
    a = g.bn_relu(x, name + ".bn1")
    cout = 4 * width if bottleneck else width
    skip = g.conv(a, cout, 1, stride, 0, name + ".shortcut") if stride != 1 or x.shape[0] != cout else x
    if bottleneck:
        h = g.conv(a, width, 1, name=name + ".conv1")
        h = g.conv(g.bn_relu(h, name + ".bn2"), width, 3, stride, name=name + ".conv2")
        h = g.conv(g.bn_relu(h, name + ".bn3"), cout, 1, name=name + ".conv3")
    else:
        h = g.conv(a, width, 3, stride, name=name + ".conv1")
        h = g.conv(g.bn_relu(h, name + ".bn2"), width, 3, name=name + ".conv2")
    return g.add(skip, h, name + ".add")


def resnet_cifar(depth, bottleneck=False):
    n = (depth - 2) // (9 if bottleneck else 6)
    g = nn.Graph(f"preact-resnet{depth}-cifar", (3, 32, 32), 10)
    x = g.conv(g.input, 16, 3, name="conv1")
    for s, width in enumerate((16, 32, 64)):
        for b in range(n):
            x = block(g, x, f"layer{s + 1}.{b}", width, (2 if s else 1) if b == 0 else 1, bottleneck)
    return g.head(g.bn_relu(x, "bn_final"))


def resnet18_imagenet():
    g = nn.Graph("preact-resnet18-imagenet", (3, 64, 64), 10)
    x = g.conv(g.input, 64, 7, 2, 3, name="conv1")
    x = g.max_pool(g.bn_relu(x, "bn1"), 3, 2, 1, name="maxpool")
    for s, width in enumerate((64, 128, 256, 512)):
        for b in range(2):
            x = block(g, x, f"layer{s + 1}.{b}", width, (2 if s else 1) if b == 0 else 1)
    return g.head(g.bn_relu(x, "bn_final"))


def small_vgg(num_classes=4, in_channels=3, size=16, w=8, seed=0):
    """conv-bn-relu x2, pool, conv-bn-relu x2, pool, head; the pool before each stage's last unit."""
    g = nn.Graph("small-vgg", (in_channels, size, size), num_classes, seed)
    x = g.bn_relu(g.conv(g.input, w, 3, name="conv1"), "bn1")
    x = g.conv(x, w, 3, name="conv2")
    x = g.bn_relu(g.max_pool(x, 2, name="pool1"), "bn2")
    x = g.bn_relu(g.conv(x, 2 * w, 3, name="conv3"), "bn3")
    x = g.conv(x, 2 * w, 3, name="conv4")
    x = g.bn_relu(g.max_pool(x, 2, name="pool2"), "bn4")
    return g.head(x)


def pooled_resnet(num_classes=4, in_channels=3, size=16, w=8, seed=0):
    """stem; an identity block; a block whose branch max-pools (skip: strided 1x1 projection);
    an identity block; final unit; head."""
    g = nn.Graph("pooled-resnet", (in_channels, size, size), num_classes, seed)
    x = g.conv(g.input, w, 3, name="stem")
    x = block(g, x, "block1", w, 1)
    a = g.bn_relu(x, "block2.bn1")
    skip = g.conv(a, 2 * w, 1, 2, 0, name="block2.shortcut")
    h = g.max_pool(g.conv(a, 2 * w, 3, name="block2.conv1"), 2, name="block2.pool")
    h = g.conv(g.bn_relu(h, "block2.bn2"), 2 * w, 3, name="block2.conv2")
    x = g.add(skip, h, "block2.add")
    x = block(g, x, "block3", 2 * w, 1)
    return g.head(g.bn_relu(x, "bn_final"))


CUSTOM = {"small-vgg": small_vgg, "pooled-resnet": pooled_resnet}


# ----------------------------------------------------- same records as models.py

@pytest.mark.parametrize("built, handwritten", [
    (lambda: resnet_cifar(20), lambda: models.preact_resnet_cifar(20)),
    (lambda: resnet_cifar(56), lambda: models.preact_resnet_cifar(56)),
    (resnet18_imagenet, lambda: models.preact_resnet_imagenet(18, num_classes=10))])
def test_builder_reproduces_the_handwritten_resnets(built, handwritten):
    a, b = built(), handwritten()
    assert a.layers == b.layers
    assert list(a.params) == list(b.params) and list(a.stats) == list(b.stats)
    assert all(np.array_equal(a.params[k].data, b.params[k].data) for k in b.params)


def test_builder_bottleneck_resnet_computes_the_same(rng):
    """The builder keeps the stem's output in act0 (models.py writes res): same numbers."""
    a, b = resnet_cifar(29, bottleneck=True), models.preact_resnet_cifar(29, block="bottleneck")
    assert [(L.op, L.name) for L in a.layers] == [(L.op, L.name) for L in b.layers]
    x, y = batch(rng, a, 4, (3, 16, 16), np.float32)
    results = []
    for net in (a, b):
        eng = Engine(net, 4, (3, 16, 16), mode="approx", bits=4)
        results.append((eng.forward(x, y)[0], eng.backward(input_grad=True),
                        {p.name: p.grad.copy() for p in net.parameters()}))
    assert results[0][0] == results[1][0]
    np.testing.assert_array_equal(results[0][1], results[1][1])
    for k, v in results[0][2].items():
        np.testing.assert_array_equal(v, results[1][2][k])


# ------------------------------------------------------------ custom networks

@pytest.mark.parametrize("which", list(CUSTOM))
def test_custom_network_gradients_match_finite_differences(rng, which):
    net = CUSTOM[which]()
    N, shape = 3, (3, 16, 16)
    eng = Engine(net, batch_size=N, input_shape=shape, mode="exact", dtype="float64")
    randomize_units(net, rng)
    x, y = batch(rng, net, N, shape)
    eng.forward(x, y)
    dx = eng.backward(input_grad=True)
    grads = {p.name: p.grad.copy() for p in net.parameters()}

    def loss():
        return eng.forward(x, y)[0]

    for name, g in grads.items():
        assert np.any(g != 0), f"{which}: {name} got no gradient"
        check_directional(loss, [net.params[name].data], [g], rng, f"{which} {name}")
    check_directional(loss, [x], [dx], rng, f"{which} input")


@pytest.mark.parametrize("which", list(CUSTOM))
def test_custom_network_trains_in_approx_mode(which):
    """SGD on 64 synthetic images (4 classes): the mean loss of the last epoch is well below the first."""
    x_u8, y = data.synthetic(64, 16, num_classes=4, shape=(3, 16, 16), seed=3)[:2]
    net = CUSTOM[which]()
    eng = Engine(net, 16, (3, 16, 16), mode="approx", bits=4)
    opt = SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    x = np.empty((64, 3, 16, 16), np.float32)
    normalize(x, x_u8, *data.channel_mean_std(x_u8))
    epochs = []
    for epoch in range(8):
        losses = [eng.train_step(x[i:i + 16], y[i:i + 16], opt) for i in range(0, 64, 16)]
        epochs.append(float(np.mean(losses)))
    assert np.isfinite(epochs).all()
    assert epochs[-1] < 0.5 * epochs[0], f"{which}: epoch losses {epochs}"


@pytest.mark.parametrize("which", list(CUSTOM))
def test_custom_network_plans_like_any_other(which):
    """The shared buffers the colouring found (the ping-pong pair at least); the schedule
    names every layer."""
    eng = Engine(CUSTOM[which](), 8, (3, 16, 16), mode="approx", bits=4, allocate=False)
    assert {e.name for e in eng.plan.entries if e.kind == "buffers"} >= {"act0", "act1"}
    names = {s.layer.name for s in eng.schedule if s.layer is not None}
    assert names == {L.name for L in eng.net.layers}


# ------------------------------------------------------ against PyTorch

def torch_models():
    torch = pytest.importorskip("torch")
    from torch import nn as tnn
    from torch.nn import functional as F
    from torch_reference import BatchNorm2d

    def conv(cin, cout, k, stride=1, pad=None):
        return tnn.Conv2d(cin, cout, k, stride, (k - 1) // 2 if pad is None else pad, bias=False)

    class SmallVGG(tnn.Module):
        def __init__(self, w=8, classes=4):
            super().__init__()
            self.conv1, self.bn1, self.conv2, self.bn2 = conv(3, w, 3), BatchNorm2d(w), conv(w, w, 3), BatchNorm2d(w)
            self.conv3, self.bn3 = conv(w, 2 * w, 3), BatchNorm2d(2 * w)
            self.conv4, self.bn4 = conv(2 * w, 2 * w, 3), BatchNorm2d(2 * w)
            self.fc = tnn.Linear(2 * w, classes)

        def forward(self, x):
            x = F.relu(self.bn1(self.conv1(x)))
            x = F.relu(self.bn2(F.max_pool2d(self.conv2(x), 2)))
            x = F.relu(self.bn3(self.conv3(x)))
            x = F.relu(self.bn4(F.max_pool2d(self.conv4(x), 2)))
            return self.fc(x.mean(dim=(2, 3)))

    class Block(tnn.Module):
        def __init__(self, c):
            super().__init__()
            self.bn1, self.conv1, self.bn2, self.conv2 = BatchNorm2d(c), conv(c, c, 3), BatchNorm2d(c), conv(c, c, 3)

        def forward(self, x):
            return x + self.conv2(F.relu(self.bn2(self.conv1(F.relu(self.bn1(x))))))

    class PoolBlock(tnn.Module):
        def __init__(self, cin, cout):
            super().__init__()
            self.bn1, self.shortcut = BatchNorm2d(cin), conv(cin, cout, 1, 2, 0)
            self.conv1, self.bn2, self.conv2 = conv(cin, cout, 3), BatchNorm2d(cout), conv(cout, cout, 3)

        def forward(self, x):
            a = F.relu(self.bn1(x))
            h = F.relu(self.bn2(F.max_pool2d(self.conv1(a), 2)))
            return self.shortcut(a) + self.conv2(h)

    class PooledResNet(tnn.Module):
        def __init__(self, w=8, classes=4):
            super().__init__()
            self.stem, self.block1 = conv(3, w, 3), Block(w)
            self.block2, self.block3 = PoolBlock(w, 2 * w), Block(2 * w)
            self.bn_final, self.fc = BatchNorm2d(2 * w), tnn.Linear(2 * w, classes)

        def forward(self, x):
            x = self.block3(self.block2(self.block1(self.stem(x))))
            return self.fc(F.relu(self.bn_final(x)).mean(dim=(2, 3)))

    return torch, {"small-vgg": SmallVGG, "pooled-resnet": PooledResNet}


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("float64", 1e-9)])
@pytest.mark.parametrize("which", list(CUSTOM))
def test_custom_network_matches_pytorch(which, dtype, tol):
    torch, refs = torch_models()
    from torch_reference import dodge_relu_kinks, load_lowmem_state
    from reference import rel
    net = CUSTOM[which]()
    model = load_lowmem_state(refs[which](), net.state_dict()).to(getattr(torch, dtype)).train()
    eng = Engine(net, 8, (3, 16, 16), mode="exact", dtype=dtype)
    r = np.random.default_rng(5)
    x, y = r.standard_normal((8, 3, 16, 16)).astype(dtype), r.integers(0, 4, 8)
    deltas, margin = dodge_relu_kinks(model, x)
    assert margin > 1e-5
    with torch.no_grad():
        for name, d in deltas.items():
            net.params[name].data += d.astype(dtype)
            model.get_parameter(name).add_(torch.from_numpy(d.astype(dtype)))
    loss, logits = eng.forward(x, y)
    dx = eng.backward(input_grad=True)
    xt = torch.from_numpy(x).requires_grad_(True)
    tlogits = model(xt)
    tloss = torch.nn.functional.cross_entropy(tlogits, torch.from_numpy(y))
    tloss.backward()
    assert rel(loss, tloss.item()) <= tol and rel(logits, tlogits.detach().numpy()) <= tol
    assert rel(dx, xt.grad.numpy()) <= tol
    tgrads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    assert set(tgrads) == {p.name for p in net.parameters()}
    errors = {p.name: rel(p.grad, tgrads[p.name]) for p in net.parameters()}
    assert max(errors.values()) <= tol, errors
    model.eval()
    with torch.no_grad():
        assert rel(eng.predict(x), model(torch.from_numpy(x)).numpy()) <= tol


# ------------------------------------------------------- rules, with reasons

def graph(shape=(3, 8, 8)):
    return nn.Graph("t", shape, 3)


def raises(words, f, *args, **kw):
    with pytest.raises(nn.NetworkError) as e:
        f(*args, **kw)
    for w in words:
        assert w in str(e.value), f"{w!r} not in: {e.value}"
    return e.value


def test_residual_add_needs_equal_shapes():
    g = graph()
    a = g.bn_relu(g.conv(g.input, 4, 3, name="c1"))
    b = g.conv(a, 8, 3, name="c2")
    e = raises(["add 'add1'", "(4, 8, 8)", "(8, 8, 8)", "projection"], g.add, a, b)
    assert "'c2'" in str(e)
    c = g.conv(a, 4, 3, stride=2, name="c3")
    raises(["(4, 4, 4)"], g.add, a, c)


def test_bad_arguments_are_named():
    g = graph()
    raises(["cout", "0"], g.conv, g.input, 0, 3)
    raises(["stride"], g.conv, g.input, 4, 3, stride=0)
    raises(["pad"], g.conv, g.input, 4, 3, pad=-1)
    raises(["too small", "(4, 0, 0)"], g.conv, g.input, 4, 9, pad=0)
    x = g.bn_relu(g.conv(g.input, 4, 3))
    raises(["5x5", "4-bit", "k <= 4"], g.max_pool, x, 5)
    raises(["pad 2", "k // 2 = 1"], g.max_pool, x, 2, pad=2)
    raises(["Tensor"], g.bn_relu, np.zeros(3))
    raises(["another Graph"], g.bn_relu, graph().input)
    raises(["input_shape"], nn.Graph, "t", (3, 8), 3)
    raises(["num_classes"], nn.Graph, "t", (3, 8, 8), 0)


def test_numpy_scalars_are_numbers_like_any_other():
    """Sizes and ratios computed with NumPy (np.int64 channels, np.float32 dropout) build the same
    network as Python numbers, with Python numbers in its records."""
    def build(i, f):
        g = nn.Graph("t", (i(3), i(8), i(8)), i(4))
        x = g.bn_relu(g.conv(g.input, i(8), i(3), stride=i(1), pad=i(1), groups=i(1), name="c1"))
        x = g.dropout(g.max_pool(x, i(2), stride=i(2), pad=i(0)), f(0.5))
        x = g.avg_pool(g.conv(x, i(8), i(3), groups=i(8), name="c2"), i(2))
        return g.head(g.dropout(g.linear(x, i(6), name="l"), p=f(0.25)))
    plain, numpy_built = build(int, float), build(np.int64, np.float32)
    assert [vars(L) for L in numpy_built.layers] == [vars(L) for L in plain.layers]
    assert all(type(v) in (int, float, str, bool, tuple) for L in numpy_built.layers for v in vars(L).values())
    raises(["p must be a number in [0, 1)", "True"], graph().dropout, graph().input, np.bool_(True))


def test_layer_names_are_unique_and_not_reserved():
    g = graph()
    x = g.conv(g.input, 4, 3, name="conv1")
    raises(["'conv1'", "twice"], g.bn_relu, x, name="conv1")
    raises(["reserved"], g.bn_relu, x, name="fc")
    raises(["non-empty"], g.bn_relu, x, name="")
    assert g.bn_relu(x).name == "bn1" and g.conv(g.input, 4, 3).name == "conv2"   # auto names skip used ones


def test_every_output_must_be_used():
    g = graph()
    x = g.bn_relu(g.conv(g.input, 4, 3, name="c1"), name="b1")
    g.conv(x, 4, 3, name="dead")
    raises(["'dead'", "never used"], g.head, x)


def test_finished_graph_cannot_grow():
    g = graph()
    x = g.bn_relu(g.conv(g.input, 4, 3))
    net = g.head(x)
    assert g.network is net and isinstance(net, Network)
    raises(["finished"], g.conv, x, 4, 3)


# --------------------------------------------- check() on hand-built Networks

def tiny(changes=None):
    """A valid hand-built block network; `changes` replace layer fields by layer name."""
    net = Network("hand", 3, 3)
    net.conv("conv1", "input", "res", 3, 4, 3)
    net.bnrelu("bn1", "res", "act0", 4)
    net.conv("conv2", "act0", "act1", 4, 4, 3)
    net.bnrelu("bn2", "act1", "act1", 4)
    net.conv("conv3", "act1", "act0", 4, 4, 3)
    net.add("add", "act0")
    net.bnrelu("bn_final", "res", "act0", 4)
    net.head("act0", 4)
    for L in net.layers:
        for k, v in (changes or {}).get(L.name, {}).items():
            setattr(L, k, v)
    return net


def engine_refuses_as_check(net, shape, **kw):
    """The engine runs nn.check's walk on every network: the same NetworkError, word for word."""
    with pytest.raises(nn.NetworkError) as checked:
        nn.check(net, shape)
    for mode in ("exact", "approx"):
        with pytest.raises(nn.NetworkError) as built:
            Engine(net, 3, shape, **{"mode": mode, "allocate": False, **kw})
        assert str(built.value) == str(checked.value)


def test_check_accepts_the_models_and_a_valid_hand_built_net():
    nn.check(tiny(), (3, 8, 8))
    nn.check(models.preact_resnet_cifar(20), (3, 32, 32))
    nn.check(models.preact_resnet_cifar(164), (3, 32, 32))
    nn.check(models.preact_resnet_imagenet(50), (3, 224, 224))


@pytest.mark.parametrize("changes, words", [
    ({"bn1": {"src": "act1"}}, ["'bn1'", "act1 before any layer wrote it"]),
    ({"conv2": {"dst": "act0"}}, ["conv 'conv2'", "in place"]),
    ({"conv2": {"dst": "input"}}, ["never the input"]),
    ({"conv2": {"dst": "fc.x"}}, ["'fc.x'", "without dots"]),
    ({"add": {"inputs": ("res", "act1")}}, ["layer 'add'", "src among them"]),
    ({"bn2": {"cin": 5}}, ["'bn2'", "5 input channels", "holds 4"]),
    ({"conv3": {"stride": 2}}, ["add 'add'", "(4, 4, 4)", "(4, 8, 8)"]),
    ({"conv3": {"dst": "act1"}}, ["in place"]),
    ({"bn2": {"op": "softmax"}}, ["unknown op 'softmax'"]),
    ({"conv2": {"name": "conv3"}}, ["'conv3'", "twice"]),
])
def test_check_rejects_broken_records(changes, words):
    raises(words, nn.check, tiny(changes), (3, 8, 8))
    engine_refuses_as_check(tiny(changes), (3, 8, 8))


def test_check_rejects_an_output_overwritten_before_it_is_read():
    net = Network("dead", 3, 3)
    net.conv("conv1", "input", "res", 3, 4, 3)
    net.bnrelu("bn1", "res", "act0", 4)
    net.bnrelu("unread", "res", "act1", 4)            # act1 is overwritten by conv2 before any read
    net.conv("conv2", "act0", "act1", 4, 4, 3)
    net.add("add", "act1")
    net.bnrelu("bn_final", "res", "act0", 4)
    net.head("act0", 4)
    raises(["bnrelu 'unread'", "never read"], nn.check, net, (3, 6, 6))
    engine_refuses_as_check(net, (3, 6, 6))
