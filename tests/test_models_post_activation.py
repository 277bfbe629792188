"""torchvision's post-activation ResNets (lowmem.models.resnet) against PyTorch.

The reference is written here the way torchvision writes its ResNet (nn.Module classes
BasicBlock / Bottleneck with conv1, bn1, relu, ..., downsample = Sequential(conv, bn); v1.5
strides), since importing torchvision fails in this environment; it shares no code with lowmem.
In exact float64 mode the loss and every parameter gradient equal autograd's (relative <= 1e-8,
the same names: lowmem's state_dict loads into the module strictly); the approx 4-bit forward
is bit-identical to the exact one; a steady training step holds the plan and allocates no
more than the plan's stated bound on temporaries.
"""
import tracemalloc

import numpy as np
import pytest

from lowmem.core.engine import Engine
from lowmem.models import resnet
from lowmem.train.optim import SGD

torch = pytest.importorskip("torch")
from torch import nn as tnn                               # noqa: E402
from torch.nn import functional as F                      # noqa: E402
from torch_reference import BatchNorm2d                   # noqa: E402  (no num_batches_tracked)

WIDTHS = (8, 8, 16, 16)
SHAPE, N, K = (3, 32, 32), 4, 5


def conv3x3(cin, cout, stride=1):
    return tnn.Conv2d(cin, cout, 3, stride, 1, bias=False)


def conv1x1(cin, cout, stride=1):
    return tnn.Conv2d(cin, cout, 1, stride, bias=False)


class BasicBlock(tnn.Module):
    expansion = 1

    def __init__(self, cin, width, stride, downsample):
        super().__init__()
        self.conv1, self.bn1 = conv3x3(cin, width, stride), BatchNorm2d(width)
        self.relu = tnn.ReLU()
        self.conv2, self.bn2 = conv3x3(width, width), BatchNorm2d(width)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(tnn.Module):
    expansion = 4

    def __init__(self, cin, width, stride, downsample):
        super().__init__()
        self.conv1, self.bn1 = conv1x1(cin, width), BatchNorm2d(width)
        self.conv2, self.bn2 = conv3x3(width, width, stride), BatchNorm2d(width)
        self.conv3, self.bn3 = conv1x1(width, width * 4), BatchNorm2d(width * 4)
        self.relu = tnn.ReLU()
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(tnn.Module):
    def __init__(self, block, layers, widths, num_classes):
        super().__init__()
        self.cin = widths[0]
        self.conv1 = tnn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1, self.relu = BatchNorm2d(widths[0]), tnn.ReLU()
        self.maxpool = tnn.MaxPool2d(3, 2, 1)
        for i, (n, w) in enumerate(zip(layers, widths)):
            setattr(self, f"layer{i + 1}", self._make_layer(block, w, n, 1 if i == 0 else 2))
        self.fc = tnn.Linear(widths[-1] * block.expansion, num_classes)

    def _make_layer(self, block, width, n, stride):
        downsample = None
        if stride != 1 or self.cin != width * block.expansion:
            downsample = tnn.Sequential(conv1x1(self.cin, width * block.expansion, stride),
                                        BatchNorm2d(width * block.expansion))
        layers = [block(self.cin, width, stride, downsample)]
        self.cin = width * block.expansion
        layers += [block(self.cin, width, 1, None) for _ in range(1, n)]
        return tnn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


TORCH = {18: (BasicBlock, (2, 2, 2, 2)), 50: (Bottleneck, (3, 4, 6, 3))}


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def randomized(net, rng):
    """Batch norms with gammas of both signs and spread betas (so every ReLU cuts somewhere)."""
    for p in net.parameters():
        if p.data.ndim == 1 and p.name.endswith(".weight") and not p.name.startswith("fc"):
            p.data[...] = rng.choice([-1.0, 1.0], p.shape) * rng.uniform(0.5, 1.5, p.shape)
        elif p.data.ndim == 1 and p.name.endswith(".bias") and not p.name.startswith("fc"):
            p.data[...] = rng.normal(0, 0.5, p.shape)
    return net


@pytest.mark.parametrize("depth", [18, 50])
def test_post_activation_resnet_matches_autograd_in_float64(depth):
    rng = np.random.default_rng(depth)
    net = randomized(resnet(depth, num_classes=K, widths=WIDTHS, input_size=SHAPE[1]), rng)
    model = ResNet(*TORCH[depth], WIDTHS, K).double().train()
    model.load_state_dict({k: torch.from_numpy(v.astype(np.float64)) for k, v in net.state_dict().items()},
                          strict=True)                  # the same names, every one
    assert {p.name for p in net.parameters()} == {n for n, _ in model.named_parameters()}
    x, y = rng.standard_normal((N,) + SHAPE), rng.integers(0, K, N)
    eng = Engine(net, N, SHAPE, mode="exact", dtype="float64")
    loss, logits = eng.forward(x, y)
    eng.backward()
    tlogits = model(torch.from_numpy(x))
    tloss = F.cross_entropy(tlogits, torch.from_numpy(y))
    tloss.backward()
    assert rel(loss, tloss.item()) <= 1e-8 and rel(logits, tlogits.detach().numpy()) <= 1e-8
    errors = {n: rel(net.params[n].grad, p.grad.numpy()) for n, p in model.named_parameters()}
    bad = {n: e for n, e in errors.items() if not e <= 1e-8}
    assert not bad, sorted(bad.items(), key=lambda kv: -kv[1])[:5]
    running = {n: rel(a, model.state_dict()[n].numpy()) for n, a in net.stats.items()}
    assert max(running.values()) <= 1e-8, running


@pytest.mark.parametrize("depth", [18, 50])
def test_post_activation_resnet_approx_forward_equals_exact(depth):
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((N,) + SHAPE).astype(np.float32), rng.integers(0, K, N)
    out = {}
    for mode in ("exact", "approx"):
        net = resnet(depth, num_classes=K, widths=WIDTHS, input_size=SHAPE[1], seed=3)
        out[mode] = Engine(net, N, SHAPE, mode=mode, bits=4).forward(x, y)
    assert out["exact"][0] == out["approx"][0]
    np.testing.assert_array_equal(out["exact"][1], out["approx"][1])


@pytest.mark.parametrize("mode", ["exact", "approx"])
def test_post_activation_steady_step_stays_within_the_plan(mode):
    """tracemalloc, after a first engine has run (imports, JIT caches): building holds the plan
    (within 2%, plus 256 KiB of Python objects: the schedule's steps, the kernel sets), and a
    steady step adds at most the
    plan's stated bound on temporaries (plus 64 KiB for NumPy's small bookkeeping), keeping
    nothing."""
    net = resnet(18, num_classes=K, widths=(16, 16, 32, 32), input_size=SHAPE[1])
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16,) + SHAPE).astype(np.float32), rng.integers(0, K, 16)
    warm = resnet(18, num_classes=K, widths=(16, 16, 32, 32), input_size=SHAPE[1])   # imports, JIT caches
    Engine(warm, 16, SHAPE, mode=mode, bits=4).train_step(x, y, SGD(warm.parameters(), lr=0.01))
    tracemalloc.start()
    try:
        c0 = tracemalloc.get_traced_memory()[0]
        eng = Engine(net, 16, SHAPE, mode=mode, bits=4)
        built = tracemalloc.get_traced_memory()[0] - c0
        opt = SGD(net.parameters(), lr=0.01)
        eng.train_step(x, y, opt)
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        eng.train_step(x, y, opt)
        end, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    total, bound = eng.plan.total_bytes, eng.plan.temporary_bytes
    assert abs(built - total) < 0.02 * total + (256 << 10), (built, total)
    assert peak - start <= bound + (64 << 10), (peak - start, bound)
    assert end - start < 0.01 * total


def test_resnet_registry_family():
    from lowmem.models import build_model, model_spec
    spec = model_spec("resnet")
    assert spec.num_classes == 1000 and spec.input_shape == (3, 224, 224)
    assert build_model("resnet", 18).num_params() == 11_689_512          # torchvision's counts
    assert build_model("resnet", 50).num_params() == 25_557_032
    with pytest.raises(ValueError, match="unsupported depth 20 for resnet"):
        build_model("resnet", 20)
