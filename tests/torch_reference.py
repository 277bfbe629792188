"""An independent PyTorch implementation of lowmem's pre-activation ResNets.

He et al. 2016, "Identity Mappings in Deep Residual Networks", written the
ordinary PyTorch way (nn.Conv2d, nn.BatchNorm2d, nn.Linear, autograd) so
tests/test_models_torch.py can check lowmem's hand-written forward and
backward against it. It shares no code with lowmem.

`state_dict()` keys equal lowmem's names exactly (`conv1.weight`,
`layer1.0.bn1.weight`, `layer2.0.shortcut.weight`, `bn_final.running_var`,
`fc.bias`, ...), so a lowmem network's weights load with strict checking:

    model = preact_resnet_cifar(20)
    load_lowmem_state(model, net.state_dict())

Block (both kinds): a = relu(bn1(x)); skip = shortcut(a) where the shape
changes (1x1 conv, stride), else x; the branch reads a; out = branch + skip.
  basic:      conv1 3x3 (stride) -> bn2-relu -> conv2 3x3
  bottleneck: conv1 1x1 -> bn2-relu -> conv2 3x3 (stride) -> bn3-relu -> conv3 1x1 (4x width)
Head: bn_final -> relu -> global average pool -> fc (with bias).
ImageNet stem: conv1 7x7/2 -> bn1-relu -> 3x3/2 max-pool (pad 1).

Also: sgd_param_groups (lowmem's weight-decay rule as torch.optim groups) and
dodge_relu_kinks (keeps float32 comparisons away from ReLU's kink).
"""
import copy

import numpy
import torch
from torch import nn
from torch.nn import functional as F

BN_EPS = 1e-5
BN_MOMENTUM = 0.1
CIFAR_WIDTHS = (16, 32, 64)
IMAGENET_WIDTHS = (64, 128, 256, 512)
IMAGENET_BLOCKS = {18: ("basic", (2, 2, 2, 2)), 34: ("basic", (3, 4, 6, 3)),
                   50: ("bottleneck", (3, 4, 6, 3)), 101: ("bottleneck", (3, 4, 23, 3)),
                   152: ("bottleneck", (3, 8, 36, 3))}


class BatchNorm2d(nn.BatchNorm2d):
    """nn.BatchNorm2d (eps 1e-5, momentum 0.1) without the num_batches_tracked buffer.

    lowmem keeps no batch counter (its momentum is fixed), so the state here is
    exactly weight, bias, running_mean, running_var."""

    def __init__(self, c):
        super().__init__(c, eps=BN_EPS, momentum=BN_MOMENTUM)
        self.register_buffer("num_batches_tracked", None)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        # a plain dict carries no version; declare it current so torch does not
        # insert a legacy num_batches_tracked entry (strict loading would reject it)
        super()._load_from_state_dict(state_dict, prefix, {**local_metadata, "version": self._version}, *args)


def conv(cin, cout, k, stride=1):
    return nn.Conv2d(cin, cout, k, stride=stride, padding=(k - 1) // 2, bias=False)


class BasicBlock(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        self.bn1 = BatchNorm2d(cin)
        self.shortcut = conv(cin, width, 1, stride) if stride != 1 or cin != width else None
        self.conv1 = conv(cin, width, 3, stride)
        self.bn2 = BatchNorm2d(width)
        self.conv2 = conv(width, width, 3)
        self.out_channels = width

    def forward(self, x):
        a = F.relu(self.bn1(x))
        skip = self.shortcut(a) if self.shortcut is not None else x
        out = self.conv1(a)
        out = self.conv2(F.relu(self.bn2(out)))
        return out + skip


class BottleneckBlock(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        cout = 4 * width
        self.bn1 = BatchNorm2d(cin)
        self.shortcut = conv(cin, cout, 1, stride) if stride != 1 or cin != cout else None
        self.conv1 = conv(cin, width, 1)
        self.bn2 = BatchNorm2d(width)
        self.conv2 = conv(width, width, 3, stride)
        self.bn3 = BatchNorm2d(width)
        self.conv3 = conv(width, cout, 1)
        self.out_channels = cout

    def forward(self, x):
        a = F.relu(self.bn1(x))
        skip = self.shortcut(a) if self.shortcut is not None else x
        out = self.conv1(a)
        out = self.conv2(F.relu(self.bn2(out)))
        out = self.conv3(F.relu(self.bn3(out)))
        return out + skip


class PreActResNet(nn.Module):
    """stem -> layer1..layerS -> bn_final-relu -> avg pool -> fc."""

    def __init__(self, kind, blocks_per_stage, widths, num_classes, in_channels, imagenet=False):
        super().__init__()
        self.imagenet = imagenet
        if imagenet:
            self.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
            self.bn1 = BatchNorm2d(64)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
            c = 64
        else:
            self.conv1 = conv(in_channels, 16, 3)
            c = 16
        block = BasicBlock if kind == "basic" else BottleneckBlock
        for s, (n, width) in enumerate(zip(blocks_per_stage, widths)):
            blocks = []
            for b in range(n):
                blocks.append(block(c, width, 2 if (b == 0 and s > 0) else 1))
                c = blocks[-1].out_channels
            self.add_module(f"layer{s + 1}", nn.Sequential(*blocks))
        self.num_stages = len(blocks_per_stage)
        self.bn_final = BatchNorm2d(c)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x):
        x = self.conv1(x)
        if self.imagenet:
            x = self.maxpool(F.relu(self.bn1(x)))
        for s in range(self.num_stages):
            x = getattr(self, f"layer{s + 1}")(x)
        x = F.relu(self.bn_final(x))
        return self.fc(x.mean(dim=(2, 3)))


def preact_resnet_cifar(depth, num_classes=10, in_channels=3, block="basic"):
    """depth 6n+2 (block="basic") or 9n+2 (block="bottleneck"); widths 16/32/64."""
    n = (depth - 2) // (6 if block == "basic" else 9)
    return PreActResNet(block, (n, n, n), CIFAR_WIDTHS, num_classes, in_channels)


def preact_resnet_imagenet(depth, num_classes=1000, in_channels=3):
    kind, blocks = IMAGENET_BLOCKS[depth]
    return PreActResNet(kind, blocks, IMAGENET_WIDTHS, num_classes, in_channels, imagenet=True)


def load_lowmem_state(model, state):
    """Load a lowmem state_dict (name -> NumPy array) with strict checking of every name."""
    ours, theirs = set(model.state_dict()), set(state)
    if ours != theirs:
        raise KeyError(f"names differ: only in torch {sorted(ours - theirs)[:5]}, "
                       f"only in lowmem {sorted(theirs - ours)[:5]}")
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()}, strict=True)
    return model


def sgd_param_groups(model, weight_decay):
    """torch.optim.SGD groups: decay on conv and linear weights only (lowmem's default)."""
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            is_weight = isinstance(module, (nn.Conv2d, nn.Linear)) and name == "weight"
            (decay if is_weight else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def dodge_relu_kinks(model, x, reach=0.02):
    """Shift BN betas so no pre-ReLU value of this batch lies near ReLU's kink.

    Two float32 implementations agree only to ~1e-6; a pre-ReLU value that
    close to 0 can take the other branch in one of them, and that single
    element moves its channel's gradient (and everything upstream) by ~1e-3,
    hiding real bugs or failing correct code. Like Chainer's numerical checks,
    we dodge the kink: a training-mode forward of a copy of `model` on
    x (N, C, H, W) where each BN module, in forward order, adds a per-channel
    delta (|delta| <= reach) to its beta that puts 0 in the middle of the
    widest gap between its pre-ReLU values (the model's own dtype suffices:
    float32 is accurate to ~1e-6, the gaps are ~1e-4 wide). Returns
    {bias name: delta} (NumPy, the model's dtype) to add to both
    implementations' betas, and the smallest |pre-ReLU| value left (the margin)."""
    probe = copy.deepcopy(model).train()     # a copy: the probe forward updates running stats
    deltas, margin = {}, [numpy.inf]

    def hook(module, args, y, name):
        y = y.detach().numpy()
        C = y.shape[1]
        z = -y.transpose(1, 0, 2, 3).reshape(C, -1)     # pre-ReLU y + delta == 0 at delta = -y
        z = numpy.sort(numpy.concatenate([z, numpy.full((C, 1), -reach, z.dtype), numpy.full((C, 1), reach, z.dtype)], 1), 1)
        mid, gap = (z[:, 1:] + z[:, :-1]) / 2, z[:, 1:] - z[:, :-1]
        gap[numpy.abs(mid) > reach] = -1
        delta = mid[numpy.arange(C), numpy.argmax(gap, 1)]
        y = y + delta[None, :, None, None]
        deltas[name + ".bias"] = delta
        margin[0] = min(margin[0], float(numpy.abs(y).min()))
        return torch.from_numpy(y)

    handles = [m.register_forward_hook(lambda m, a, y, n=n: hook(m, a, y, n))
               for n, m in probe.named_modules() if isinstance(m, nn.BatchNorm2d)]
    with torch.no_grad():
        probe(torch.as_tensor(x))
    for h in handles:
        h.remove()
    return deltas, margin[0]
