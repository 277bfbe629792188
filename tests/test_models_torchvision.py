"""torchvision's DenseNet-BC and MobileNetV2 layouts (lowmem.models.densenet, mobilenet_v2)
against PyTorch modules written here the way torchvision writes them (importing torchvision
fails in this environment): the same parameter and statistic names and shapes (lowmem's
state_dict loads strictly), torchvision's parameter counts, and in exact float64 mode the loss
and every parameter gradient within 1e-8 of autograd's; the approx 4-bit forward equals the
exact one bit for bit."""
import numpy as np
import pytest

from lowmem.core.engine import Engine
from lowmem.models import densenet, mobilenet_v2

torch = pytest.importorskip("torch")
from torch import nn as tnn                               # noqa: E402
from torch.nn import functional as F                      # noqa: E402
from torch_reference import BatchNorm2d                   # noqa: E402

K = 5


class DenseLayer(tnn.Module):
    def __init__(self, cin, growth, bn_size):
        super().__init__()
        self.norm1, self.relu1 = BatchNorm2d(cin), tnn.ReLU()
        self.conv1 = tnn.Conv2d(cin, bn_size * growth, 1, bias=False)
        self.norm2, self.relu2 = BatchNorm2d(bn_size * growth), tnn.ReLU()
        self.conv2 = tnn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, feats):
        h = self.conv1(self.relu1(self.norm1(torch.cat(feats, 1))))
        return self.conv2(self.relu2(self.norm2(h)))


class DenseBlock(tnn.ModuleDict):
    def __init__(self, n, cin, growth, bn_size):
        super().__init__()
        for i in range(n):
            self.add_module(f"denselayer{i + 1}", DenseLayer(cin + i * growth, growth, bn_size))

    def forward(self, x):
        feats = [x]
        for layer in self.values():
            feats.append(layer(feats))
        return torch.cat(feats, 1)


class Transition(tnn.Sequential):
    def __init__(self, cin, cout):
        super().__init__()
        self.add_module("norm", BatchNorm2d(cin))
        self.add_module("relu", tnn.ReLU())
        self.add_module("conv", tnn.Conv2d(cin, cout, 1, bias=False))
        self.add_module("pool", tnn.AvgPool2d(2, 2))


class DenseNet(tnn.Module):
    def __init__(self, blocks=(6, 12, 24, 16), growth=32, init=64, bn_size=4, classes=K):
        super().__init__()
        self.features = tnn.Sequential()
        self.features.add_module("conv0", tnn.Conv2d(3, init, 7, 2, 3, bias=False))
        self.features.add_module("norm0", BatchNorm2d(init))
        self.features.add_module("relu0", tnn.ReLU())
        self.features.add_module("pool0", tnn.MaxPool2d(3, 2, 1))
        c = init
        for i, n in enumerate(blocks):
            self.features.add_module(f"denseblock{i + 1}", DenseBlock(n, c, growth, bn_size))
            c += n * growth
            if i < len(blocks) - 1:
                self.features.add_module(f"transition{i + 1}", Transition(c, c // 2))
                c //= 2
        self.features.add_module("norm5", BatchNorm2d(c))
        self.classifier = tnn.Linear(c, classes)

    def forward(self, x):
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.features(x)), 1), 1))


def conv_bn_act(cin, cout, k=1, stride=1, groups=1):
    return tnn.Sequential(tnn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
                          BatchNorm2d(cout), tnn.ReLU6())


class InvertedResidual(tnn.Module):
    def __init__(self, cin, cout, stride, t):
        super().__init__()
        hidden = cin * t
        layers = [conv_bn_act(cin, hidden)] if t != 1 else []
        layers += [conv_bn_act(hidden, hidden, 3, stride, hidden), tnn.Conv2d(hidden, cout, 1, bias=False),
                   BatchNorm2d(cout)]
        self.conv = tnn.Sequential(*layers)
        self.use_res = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(tnn.Module):
    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1))

    def __init__(self, classes=K):
        super().__init__()
        layers, c = [conv_bn_act(3, 32, 3, 2)], 32
        for t, cout, n, s in self.SETTINGS:
            for b in range(n):
                layers.append(InvertedResidual(c, cout, s if b == 0 else 1, t))
                c = cout
        layers.append(conv_bn_act(c, 1280))
        self.features = tnn.Sequential(*layers)
        self.classifier = tnn.Sequential(tnn.Identity(), tnn.Linear(1280, classes))   # dropout: see the docstring

    def forward(self, x):
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


SMALL = dict(blocks=(2, 3, 2, 2), growth=8, init=16, bn_size=2)
FAMILIES = {"densenet": (lambda: densenet(121, num_classes=K, input_size=32, **SMALL),
                         lambda: DenseNet(SMALL["blocks"], SMALL["growth"], SMALL["init"], SMALL["bn_size"])),
            "mobilenet-v2": (lambda: mobilenet_v2(num_classes=K, input_size=32), MobileNetV2)}
SHAPE = (3, 32, 32)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_torchvision_names_shapes_and_parameter_counts():
    """The full-size networks: torchvision's counts, and their state_dicts load strictly."""
    for net, model, count in ((densenet(121, num_classes=K), DenseNet(), 7_978_856 - 1025 * 995),
                              (mobilenet_v2(num_classes=K), MobileNetV2(), 3_504_872 - 1281 * 995)):
        assert net.num_params() == count == sum(p.numel() for p in model.parameters())
        model.load_state_dict({k: torch.from_numpy(v) for k, v in net.state_dict().items()}, strict=True)
    assert densenet(121).num_params() == 7_978_856 and mobilenet_v2().num_params() == 3_504_872


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_autograd_in_float64(family):
    build, Module = FAMILIES[family]
    net, model = build(), Module().double().train()
    rng = np.random.default_rng(0)
    for p in net.parameters():                       # BN gammas of both signs, spread betas
        if p.data.ndim == 1 and not p.name.startswith("classifier"):
            p.data[...] = (rng.uniform(0.5, 1.5, p.shape) * rng.choice([-1, 1], p.shape)
                           if p.name.endswith(".weight") else rng.normal(0, 0.5, p.shape))
    model.load_state_dict({k: torch.from_numpy(v.astype(np.float64)) for k, v in net.state_dict().items()},
                          strict=True)
    x, y = rng.standard_normal((4,) + SHAPE), rng.integers(0, K, 4)
    eng = Engine(net, 4, SHAPE, mode="exact", dtype="float64")
    loss, logits = eng.forward(x, y)
    eng.backward()
    tloss = F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
    tloss.backward()
    assert rel(loss, tloss.item()) <= 1e-8
    # relative to the gradient's norm, floored at 1e-6 of the largest one (an error below 1e-14 of
    # it): a BN bias whose every path meets another batch norm has a zero gradient in exact
    # arithmetic, ~1e-16 of the largest gradient in rounding on both sides
    floor = 1e-6 * max(float(np.linalg.norm(p.grad.numpy())) for p in model.parameters())
    bad = {n: e for n, p in model.named_parameters()
           if (e := float(np.linalg.norm(net.params[n].grad - p.grad.numpy()))
               / max(float(np.linalg.norm(p.grad.numpy())), floor)) > 1e-8}
    assert not bad, sorted(bad.items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_approx_forward_equals_exact(family):
    build = FAMILIES[family][0]
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((4,) + SHAPE).astype(np.float32), rng.integers(0, K, 4)
    out = [Engine(build(), 4, SHAPE, mode=m, bits=4).forward(x, y) for m in ("exact", "approx")]
    assert out[0][0] == out[1][0]
    np.testing.assert_array_equal(out[0][1], out[1][1])
