"""PyTorch models (written here as ordinary nn.Modules) exported to ONNX in training mode with
batch norm kept, imported by lowmem.nn.from_onnx, and compared with autograd in float64.

    torch.onnx.export(model, x, path, training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False, dynamo=False)

Compared on one training-mode batch (the imported weights loaded into the torch model, which
checks that every name matches): the loss, and every parameter gradient under the same name,
relative error ||a - b|| / ||b|| <= 1e-8 (TOL; float64 with a different summation order
measures ~1e-14, so a real difference in the maths shows). Approx 4-bit mode gives the same
loss bit for bit (its forward is exact).

Full-size torchvision architectures (ResNet-18/50, DenseNet-121, MobileNetV2): benchmarks/onnx_vs_torch.py.
Each family needs the builder's ops (NEEDS: nn.Graph methods); a family whose ops this
lowmem's builder does not have is skipped, naming them.
"""
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")
from torch import nn as tnn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from lowmem import nn  # noqa: E402
from lowmem.core.engine import Engine  # noqa: E402
import torch_reference as ref  # noqa: E402
import torchvision_layout as tv  # noqa: E402

torch.set_num_threads(1)
N, K, TOL = 4, 5, 1e-8


def bn(c):
    return tnn.BatchNorm2d(c)


class PostActBlock(tnn.Module):
    """torchvision's BasicBlock: conv-bn-relu-conv-bn, + identity (or 1x1 conv-bn), relu."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = tnn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = bn(cout)
        self.conv2 = tnn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = bn(cout)
        self.downsample = (tnn.Sequential(tnn.Conv2d(cin, cout, 1, stride, bias=False), bn(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class PostActResNet(tnn.Module):
    def __init__(self, cin=3):
        super().__init__()
        self.conv1 = tnn.Conv2d(cin, 8, 3, 1, 1, bias=False)
        self.bn1 = bn(8)
        self.maxpool = tnn.MaxPool2d(3, 2, 1)
        self.layer1 = tnn.Sequential(PostActBlock(8, 8, 1), PostActBlock(8, 8, 1))
        self.layer2 = tnn.Sequential(PostActBlock(8, 16, 2), PostActBlock(16, 16, 1))
        self.avgpool = tnn.AdaptiveAvgPool2d(1)
        self.fc = tnn.Linear(16, K)

    def forward(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class DenseLayer(tnn.Module):
    def __init__(self, cin, growth):
        super().__init__()
        self.norm1, self.conv1 = bn(cin), tnn.Conv2d(cin, 2 * growth, 1, bias=False)
        self.norm2, self.conv2 = bn(2 * growth), tnn.Conv2d(2 * growth, growth, 3, 1, 1, bias=False)

    def forward(self, x):
        new = self.conv2(F.relu(self.norm2(self.conv1(F.relu(self.norm1(x))))))
        return torch.cat([x, new], 1)


class DenseNet(tnn.Module):
    """DenseNet-BC: two dense blocks of three layers (growth 4) and a transition between."""

    def __init__(self, cin=3):
        super().__init__()
        self.conv0 = tnn.Conv2d(cin, 8, 3, 1, 1, bias=False)
        self.block1 = tnn.Sequential(*[DenseLayer(8 + 4 * i, 4) for i in range(3)])
        self.norm_t, self.conv_t = bn(20), tnn.Conv2d(20, 10, 1, bias=False)
        self.pool_t = tnn.AvgPool2d(2)
        self.block2 = tnn.Sequential(*[DenseLayer(10 + 4 * i, 4) for i in range(3)])
        self.norm5 = bn(22)
        self.fc = tnn.Linear(22, K)

    def forward(self, x):
        x = self.block1(self.conv0(x))
        x = self.block2(self.pool_t(self.conv_t(F.relu(self.norm_t(x)))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.norm5(x)), 1), 1))


class InvertedResidual(tnn.Module):
    """MobileNetV2's block: 1x1 expand-bn-relu6, 3x3 depthwise-bn-relu6, 1x1 project-bn (+ x)."""

    def __init__(self, cin, cout, stride, expand):
        super().__init__()
        hidden = cin * expand
        self.conv = tnn.Sequential(
            tnn.Conv2d(cin, hidden, 1, bias=False), bn(hidden), tnn.ReLU6(),
            tnn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), bn(hidden), tnn.ReLU6(),
            tnn.Conv2d(hidden, cout, 1, bias=False), bn(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.conv(x) if self.residual else self.conv(x)


class MobileNet(tnn.Module):
    def __init__(self, cin=3):
        super().__init__()
        self.stem = tnn.Sequential(tnn.Conv2d(cin, 8, 3, 2, 1, bias=False), bn(8), tnn.ReLU6())
        self.blocks = tnn.Sequential(InvertedResidual(8, 8, 1, 2), InvertedResidual(8, 12, 2, 3),
                                     InvertedResidual(12, 12, 1, 3))
        self.head = tnn.Sequential(tnn.Conv2d(12, 16, 1, bias=False), bn(16), tnn.ReLU6())
        self.fc = tnn.Linear(16, K)

    def forward(self, x):
        x = self.head(self.blocks(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class GroupedNet(tnn.Module):
    """Grouped convs of the shapes ResNeXt / RegNet use (several channels a group), a depthwise
    conv with a channel multiplier, each at strides 1 and 2."""

    def __init__(self, cin=3):
        super().__init__()
        self.stem = tnn.Sequential(tnn.Conv2d(cin, 8, 3, 1, 1, bias=False), bn(8), tnn.ReLU())
        self.grouped = tnn.Sequential(tnn.Conv2d(8, 8, 3, 1, 1, groups=4, bias=False), bn(8), tnn.ReLU(),
                                      tnn.Conv2d(8, 12, 3, 2, 1, groups=2, bias=False), bn(12), tnn.ReLU())
        self.multiplier = tnn.Sequential(tnn.Conv2d(12, 24, 3, 2, 1, groups=12, bias=False), bn(24), tnn.ReLU(),
                                         tnn.Conv2d(24, 24, 5, 1, 2, groups=24, bias=False), bn(24), tnn.ReLU())
        self.fc = tnn.Linear(24, K)

    def forward(self, x):
        x = self.multiplier(self.grouped(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class BiasNet(tnn.Module):
    """Convs with biases and plain ReLUs, no batch norm."""

    def __init__(self, cin=3):
        super().__init__()
        self.conv1 = tnn.Conv2d(cin, 6, 3, 1, 1)
        self.conv2 = tnn.Conv2d(6, 8, 3, 2, 1)
        self.conv3 = tnn.Conv2d(8, 8, 1)
        self.fc = tnn.Linear(8, K)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = F.relu(self.conv3(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class VGGStyle(tnn.Module):
    """torchvision's VGG shape: features, a pool, then classifier = Linear-ReLU-Dropout-Linear-ReLU-Linear
    on torch.flatten (dropout at p = 0 here: its masks are PyTorch's own)."""

    def __init__(self, cin=3):
        super().__init__()
        self.features = tnn.Sequential(tnn.Conv2d(cin, 6, 3, 1, 1, bias=False), bn(6), tnn.ReLU(),
                                       tnn.MaxPool2d(2), tnn.Conv2d(6, 8, 3, 1, 1), tnn.ReLU())
        self.avgpool = tnn.AvgPool2d(2)
        self.classifier = tnn.Sequential(tnn.Linear(8 * 2 * 2, 16), tnn.ReLU(), tnn.Dropout(0.0),
                                         tnn.Linear(16, 12), tnn.ReLU(), tnn.Linear(12, K))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def preact():
    return ref.preact_resnet_cifar(8, num_classes=K)


# family -> (model factory, input shape, the nn.Graph methods its import needs)
FAMILIES = {
    "preact-resnet": (preact, (3, 12, 12), ()),
    "postact-resnet": (PostActResNet, (3, 12, 12), ("bn", "relu")),
    "densenet": (DenseNet, (3, 8, 8), ("concat",)),
    "inverted-residual": (MobileNet, (3, 12, 12), ("bn", "relu6")),
    "grouped": (GroupedNet, (3, 11, 11), ()),
    "conv-bias": (BiasNet, (3, 8, 8), ("relu",)),
    "vgg-classifier": (VGGStyle, (3, 8, 8), ("relu", "linear")),
    # torchvision's own modules and names (tests/torchvision_layout.py), small instances
    "tv-densenet": (lambda: tv.DenseNet(growth=4, blocks=(2, 3), init=8, bn_size=2, num_classes=K),
                    (3, 32, 32), ("concat",)),
    "tv-mobilenet_v2": (lambda: tv.mobilenet_v2(K, dropout=0.0, width_mult=0.25), (3, 64, 64), ("bn", "relu6")),
}


def randomized(model, seed):
    """Non-trivial BN affine parameters and running statistics (float32), in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, tnn.BatchNorm2d):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.3)
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.2)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
    return model


def export(model, shape, path):
    x = torch.randn((2,) + shape)
    with warnings.catch_warnings():              # the TorchScript exporter's deprecation and tracer notes
        warnings.simplefilter("ignore")
        torch.onnx.export(model, x, str(path), training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, dynamo=False)
    return path


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    nb = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / nb) if nb else float(np.linalg.norm(a))


def matches_autograd(model, x, labels, loss, logits, grads):
    """Asserts lowmem's loss, logits and gradients {name: array} of one step on (x, labels) equal
    the torch model's under autograd within TOL. Gradients relative to their own norm, floored at
    1e-8 of the largest one: a BN bias whose every path runs into another batch norm has an
    exactly-zero gradient in exact arithmetic (~1e-17 in float64 on both sides), where a
    norm-relative error measures only rounding noise."""
    tlogits = model(torch.from_numpy(x))
    tloss = F.cross_entropy(tlogits, torch.from_numpy(labels))
    model.zero_grad(set_to_none=True)
    tloss.backward()
    assert rel(loss, tloss.item()) <= TOL
    assert rel(logits, tlogits.detach().numpy()) <= TOL
    floor = 1e-8 * max(np.linalg.norm(p.grad.numpy()) for p in model.parameters())
    errors = {n: float(np.linalg.norm(grads[n] - p.grad.numpy()) / max(np.linalg.norm(p.grad.numpy()), floor))
              for n, p in model.named_parameters()}
    bad = {n: e for n, e in errors.items() if not e <= TOL}
    assert not bad, sorted(bad.items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kernels", ["reference", "fast"])
def test_imported_model_matches_autograd_in_float64(tmp_path, monkeypatch, family, kernels):
    """kernels "fast": the engine's convs on the fast columns (numba's col2im, depthwise loops) and
    its batch norms without a ReLU on the fused set (units/norm.py), which float64 engines do not
    choose by themselves."""
    if kernels == "fast":
        from lowmem.core import engine as engine_module
        from lowmem.ops import conv as conv_module
        from lowmem.units import norm as norm_module
        if not conv_module.columns_cpu.AVAILABLE:
            pytest.skip("numba not installed")
        monkeypatch.setattr(engine_module, "columns_for", lambda xp, fast=True: conv_module.NUMBA)
        monkeypatch.setattr(engine_module.kernels, "select_norms", lambda xp, fused, keeper, partials=None:
                            norm_module.FusedNormKernels(norm_module.norm_cpu, keeper))
    make, shape, needs = FAMILIES[family]
    missing = [m for m in needs if not hasattr(nn.Graph, m)]
    if missing:
        pytest.skip(f"this lowmem's nn.Graph has no {', '.join(missing)}")
    torch.manual_seed(0)
    model = randomized(make(), 1).train()
    net = nn.from_onnx(export(model, shape, tmp_path / f"{family}.onnx"))
    # the file's weights into the torch model by name: the names must be torch's, all of them
    state = {k: torch.from_numpy(v.astype(np.float64)) for k, v in net.state_dict().items()}
    result = model.double().load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith("num_batches_tracked") for k in result.missing_keys), result.missing_keys
    assert {p.name for p in net.parameters()} == {n for n, _ in model.named_parameters()}
    assert net.name == family                         # the file's name: torch calls every graph main_graph

    rng = np.random.default_rng(2)
    x, labels = rng.standard_normal((N,) + shape), rng.integers(0, K, N)
    eng = Engine(net, N, shape, mode="exact", dtype="float64")
    loss, logits = eng.forward(x, labels)
    eng.backward()
    grads = {p.name: np.array(p.grad) for p in net.parameters()}

    matches_autograd(model, x, labels, loss, logits, grads)

    approx = nn.from_onnx(tmp_path / f"{family}.onnx")
    approx.load_state_dict(net.state_dict())
    loss4, logits4 = Engine(approx, N, shape, mode="approx", bits=4, dtype="float64").forward(x, labels)
    assert loss4 == loss
    np.testing.assert_array_equal(logits4, logits)


class DropoutNet(tnn.Module):
    def __init__(self, cin=3):
        super().__init__()
        self.conv1, self.bn1 = tnn.Conv2d(cin, 6, 3, 1, 1, bias=False), bn(6)
        self.drop = tnn.Dropout(0.3)
        self.conv2, self.bn2 = tnn.Conv2d(6, 6, 3, 1, 1, bias=False), bn(6)
        self.fc = tnn.Linear(6, K)

    def forward(self, x):
        x = self.drop(F.relu(self.bn1(self.conv1(x))))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def test_a_dropout_before_the_classifier_needs_a_square_feature_map(tmp_path):
    """torchvision's MobileNetV2 ends pool, Flatten, Dropout(0.2), Linear; lowmem writes the pool as
    one k x k window, the dropout, then the head (tests/formats/test_onnx_import_ops.py), which a
    non-square final map cannot have: refused by name, saying so."""
    from lowmem.formats.common import ExportError
    model = tv.mobilenet_v2(K, dropout=0.2, width_mult=0.25).train()
    with pytest.raises(ExportError, match=r"node '/classifier/classifier.0/Dropout': a Dropout between the "
                                          r"global pool and the classifier needs a square feature map there "
                                          r".*; it is 2 x 1"):
        nn.from_onnx(export(model, (3, 64, 32), tmp_path / "m.onnx"))


def test_dropout_trains_as_dropout_and_predicts_as_torch_eval(tmp_path):
    """A training-mode Dropout node becomes a dropout layer with its ratio; its masks are lowmem's own
    (a counter stream, not torch's generator), so what is compared is eval mode, where dropout is the
    identity: the imported network's predict equals the torch model's eval logits in float64."""
    if not hasattr(nn.Graph, "dropout"):
        pytest.skip("this lowmem's nn.Graph has no dropout")
    torch.manual_seed(0)
    model = randomized(DropoutNet(), 3)
    net = nn.from_onnx(export(model.train(), (3, 8, 8), tmp_path / "drop.onnx"))
    drops = [L for L in net.layers if L.op == "dropout"]
    assert [(L.name, L.p) for L in drops] == [("drop.dropout", 0.3)]     # torch's node "/drop/Dropout"
    model.double().load_state_dict({k: torch.from_numpy(v.astype(np.float64)) for k, v in net.state_dict().items()},
                                   strict=False)
    x, labels = np.random.default_rng(5).standard_normal((N, 3, 8, 8)), np.arange(N) % K
    eng = Engine(net, N, (3, 8, 8), mode="exact", dtype="float64")
    with torch.no_grad():
        want = model.eval()(torch.from_numpy(x)).numpy()
    assert rel(eng.predict(x), want) <= TOL              # before training moves the running statistics
    loss, _ = eng.forward(x, labels)                      # a training step runs, with lowmem's masks
    eng.backward()
    assert np.isfinite(loss) and all(np.isfinite(p.grad).all() for p in net.parameters())


class AlexNetStyle(tnn.Module):
    """torchvision's AlexNet classifier on small features: Dropout, Linear, ReLU, Dropout, Linear,
    ReLU, Linear on torch.flatten (ONNX: Flatten -> Dropout -> Gemm)."""

    def __init__(self, cin=3):
        super().__init__()
        self.features = tnn.Sequential(tnn.Conv2d(cin, 6, 3, 2, 1, bias=False), bn(6), tnn.ReLU(), tnn.MaxPool2d(2))
        self.classifier = tnn.Sequential(tnn.Dropout(0.5), tnn.Linear(6 * 2 * 2, 12), tnn.ReLU(), tnn.Dropout(0.3),
                                         tnn.Linear(12, 10), tnn.ReLU(), tnn.Linear(10, K))

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


class FixedDropout(tnn.Module):
    """Inverted dropout with a given keep mask (lowmem's, in torch's layout)."""

    def __init__(self, keep, p):
        super().__init__()
        self.keep, self.p = keep, p

    def forward(self, x):
        return x * self.keep.reshape(x.shape) / (1 - self.p)


@pytest.mark.parametrize("family", ["tv-mobilenet_v2-dropout", "alexnet-classifier"])
def test_a_classifier_with_dropout_matches_autograd_under_lowmem_masks(tmp_path, family):
    """MobileNetV2 at its default dropout (pool, Flatten, Dropout, Gemm: read as a k x k pool, the
    dropout on its (C, 1, 1) output, then the head) and AlexNet's classifier (Flatten, Dropout, Gemm:
    the dropout on the unflattened tensor): one training step in float64 against autograd, the
    torch model's Dropouts replaced by lowmem's keep masks of that step (its counter stream,
    ops/dropout.py), so loss, logits and every parameter gradient must agree."""
    from lowmem.ops import dropout
    make, shape = {"tv-mobilenet_v2-dropout": (lambda: tv.mobilenet_v2(K, dropout=0.2, width_mult=0.25), (3, 64, 64)),
                   "alexnet-classifier": (AlexNetStyle, (3, 8, 8))}[family]
    torch.manual_seed(0)
    model = randomized(make(), 1).train()
    net = nn.from_onnx(export(model, shape, tmp_path / f"{family}.onnx"))
    drops = [L for L in net.layers if L.op == "dropout"]
    tdrops = [(parent, name, m) for parent in model.modules() for name, m in parent.named_children()
              if isinstance(m, tnn.Dropout)]
    assert [L.p for L in drops] == [pytest.approx(m.p) for _, _, m in tdrops] and drops
    model.double().load_state_dict({k: torch.from_numpy(v.astype(np.float64)) for k, v in net.state_dict().items()},
                                   strict=False)

    rng = np.random.default_rng(2)
    x, labels = rng.standard_normal((N,) + shape), rng.integers(0, K, N)
    eng = Engine(net, N, shape, mode="exact", dtype="float64")
    for i, (L, (parent, name, m)) in enumerate(zip(drops, tdrops)):
        c, h, w = eng.in_shape[L.name]                    # lowmem's (C, N, H, W) activation, flat
        n = c * N * h * w
        mask = np.empty((n + 7) // 8, np.uint8)
        dropout.dropout_mask(mask, n, L.p, dropout.stream_key(eng.seed, eng.step, i, 0))
        keep = np.unpackbits(mask, bitorder="little")[:n].reshape(c, N, h, w).transpose(1, 0, 2, 3)
        assert 0 < keep.mean() < 1
        setattr(parent, name, FixedDropout(torch.from_numpy(keep.astype(np.float64)), L.p))
    loss, logits = eng.forward(x, labels)
    eng.backward()
    grads = {p.name: np.array(p.grad) for p in net.parameters()}
    matches_autograd(model, x, labels, loss, logits, grads)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "tv-mobilenet_v2"])
def test_imported_model_steps_within_its_plan(tmp_path, family):
    """A steady approx 4-bit float32 step of each imported model allocates at most the plan's
    stated bound on temporaries beyond the plan (plus 16 KiB of interpreter bookkeeping, as
    tests/core/test_engine.py allows), and keeps nothing between steps (tracemalloc)."""
    import tracemalloc
    from lowmem.train.optim import SGD
    make, shape, needs = FAMILIES[family]
    if [m for m in needs if not hasattr(nn.Graph, m)]:
        pytest.skip("this lowmem's nn.Graph lacks the family's ops")
    torch.manual_seed(0)
    net = nn.from_onnx(export(randomized(make(), 1).train(), shape, tmp_path / f"{family}.onnx"))
    eng = Engine(net, 16, shape, mode="approx", bits=4, dtype="float32")
    opt = SGD(net.parameters(), lr=0.01)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16,) + shape).astype(np.float32), rng.integers(0, K, 16)
    eng.train_step(x, y, opt)                                     # first step: caches, imports
    tracemalloc.start()
    try:
        eng.train_step(x, y, opt)
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        eng.train_step(x, y, opt)
        end, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - start <= eng.plan.temporary_bytes + (16 << 10), (peak - start, eng.plan.temporary_bytes)
    assert end - start < 16 << 10
