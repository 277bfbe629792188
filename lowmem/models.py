"""The model families lowmem trains: pre-activation ResNets for CIFAR and ImageNet (He et al. 2016,
"Identity Mappings in Deep Residual Networks"), wide ResNets, VGG with batch norm, and
torchvision's post-activation ResNets, DenseNet-BC and MobileNetV2 (their layouts and names).

In the pre-activation ResNets every block starts with BN -> ReLU on its input; where the shape changes, a
1x1 projection shortcut reads that pre-activated input. Convs have no bias.
Buffers: a block reads its input from "res", runs its branch through the
ping-pong buffers "act0"/"act1", and adds the branch back into "res".

The wide ResNets, VGG-BN and the torchvision families are written with the builder
(lowmem.nn.Graph).
`MODELS` (at the end) is the one registry of model families: name -> builder,
default classes, default input shape and the depths it takes. Every `lowmem`
command and the trainer look models up there (`build_model`); a path ending in .onnx names a
network read from that file instead (lowmem.nn.from_onnx: `lowmem train --model model.onnx`).
"""
import functools
import os
import re
from dataclasses import dataclass
from typing import Callable

from .core.network import Network
from .nn import Graph, from_onnx

CIFAR_WIDTHS = (16, 32, 64)
IMAGENET_WIDTHS = (64, 128, 256, 512)
IMAGENET_BLOCKS = {18: ("basic", (2, 2, 2, 2)), 34: ("basic", (3, 4, 6, 3)),
                   50: ("bottleneck", (3, 4, 6, 3)), 101: ("bottleneck", (3, 4, 23, 3)),
                   152: ("bottleneck", (3, 8, 36, 3))}


def _basic_block(net, name, cin, width, stride):
    """bn1-relu -> 3x3 conv (stride) -> bn2-relu -> 3x3 conv; output width channels."""
    net.bnrelu(name + ".bn1", "res", "act0", cin)
    if stride != 1 or cin != width:
        net.conv(name + ".shortcut", "act0", "res", cin, width, 1, stride, 0)
    net.conv(name + ".conv1", "act0", "act1", cin, width, 3, stride)
    net.bnrelu(name + ".bn2", "act1", "act1", width)
    net.conv(name + ".conv2", "act1", "act0", width, width, 3)
    net.add(name + ".add", "act0")
    return width


def _bottleneck_block(net, name, cin, width, stride):
    """bn1-relu -> 1x1 -> bn2-relu -> 3x3 (stride) -> bn3-relu -> 1x1 (x4); output 4*width."""
    cout = 4 * width
    net.bnrelu(name + ".bn1", "res", "act0", cin)
    if stride != 1 or cin != cout:
        net.conv(name + ".shortcut", "act0", "res", cin, cout, 1, stride, 0)
    net.conv(name + ".conv1", "act0", "act1", cin, width, 1)
    net.bnrelu(name + ".bn2", "act1", "act1", width)
    net.conv(name + ".conv2", "act1", "act0", width, width, 3, stride)
    net.bnrelu(name + ".bn3", "act0", "act0", width)
    net.conv(name + ".conv3", "act0", "act1", width, cout, 1)
    net.add(name + ".add", "act1")
    return cout


def _stages(net, kind, blocks_per_stage, widths, cin, first_stride=1):
    block = _basic_block if kind == "basic" else _bottleneck_block
    for s, (n, width) in enumerate(zip(blocks_per_stage, widths)):
        for b in range(n):
            stride = (first_stride if s == 0 else 2) if b == 0 else 1
            cin = block(net, f"layer{s + 1}.{b}", cin, width, stride)
    return cin


def preact_resnet_cifar(depth, num_classes=10, in_channels=3, seed=0, block=None):
    """CIFAR pre-act ResNet: depth 6n+2 (basic blocks) or 9n+2 (bottleneck blocks).

    Some depths are both (56, 110, 164: depth-2 divisible by 18). By default,
    as in He et al., depths >= 164 that are 9n+2 use bottlenecks (ResNet-164,
    -1001) and smaller 6n+2 depths use basic blocks (ResNet-20, -56, -110);
    `block="basic"|"bottleneck"` overrides."""
    basic_ok = isinstance(depth, int) and depth >= 8 and (depth - 2) % 6 == 0
    bottle_ok = isinstance(depth, int) and depth >= 11 and (depth - 2) % 9 == 0
    if block is None:
        block = "bottleneck" if bottle_ok and (depth >= 164 or not basic_ok) else "basic"
    if block not in ("basic", "bottleneck"):
        raise ValueError(f"unknown block {block!r}: expected 'basic' or 'bottleneck'")
    if not (basic_ok if block == "basic" else bottle_ok):
        raise ValueError(f"unsupported depth {depth!r} for {block} blocks: expected 6n+2 "
                         f"(basic: 20, 56, 110, ...) or 9n+2 (bottleneck: 164, 1001, ...) with n >= 1")
    kind = block
    n = (depth - 2) // (6 if block == "basic" else 9)
    _check_classes(num_classes, in_channels)
    net = Network(f"preact-resnet{depth}-cifar", in_channels, num_classes, seed)
    net.conv("conv1", "input", "res", in_channels, 16, 3)
    c = _stages(net, kind, (n, n, n), CIFAR_WIDTHS, 16)
    net.bnrelu("bn_final", "res", "act0", c)
    net.head("act0", c)
    return net


def preact_resnet_imagenet(depth, num_classes=1000, in_channels=3, seed=0):
    """ImageNet pre-act ResNet-18/34/50/101/152: 7x7/2 conv, BN-ReLU, 3x3/2 max-pool, 4 stages."""
    if depth not in IMAGENET_BLOCKS:
        raise ValueError(f"unsupported depth {depth!r} for preact_resnet_imagenet: "
                         f"expected one of {sorted(IMAGENET_BLOCKS)}")
    _check_classes(num_classes, in_channels)
    kind, blocks = IMAGENET_BLOCKS[depth]
    net = Network(f"preact-resnet{depth}-imagenet", in_channels, num_classes, seed)
    net.conv("conv1", "input", "act0", in_channels, 64, 7, 2, 3)
    net.bnrelu("bn1", "act0", "act0", 64)
    net.maxpool("maxpool", "act0", "res")
    c = _stages(net, kind, blocks, IMAGENET_WIDTHS, 64)
    net.bnrelu("bn_final", "res", "act0", c)
    net.head("act0", c)
    return net


def _check_classes(num_classes, in_channels):
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    if not isinstance(in_channels, int) or in_channels < 1:
        raise ValueError(f"in_channels must be a positive int, got {in_channels!r}")


# --------------------------------------------------------------------------------------------
# Built with lowmem.nn.Graph (buffers assigned by the builder): WideResNets and VGG with BN.

WRN_WIDTHS = (16, 32, 64)        # times the widening factor k
VGG_CONFIGS = {11: (1, 1, 2, 2, 2), 13: (2, 2, 2, 2, 2), 16: (2, 2, 3, 3, 3), 19: (2, 2, 4, 4, 4)}
VGG_WIDTHS = (64, 128, 256, 512, 512)


def preact_block(g, x, name, width, stride):
    """The pre-activation basic block on a lowmem.nn.Graph: bn1-relu -> 3x3 conv (stride) ->
    bn2-relu -> 3x3 conv, plus x (or a 1x1 projection of the pre-activated x when the shape
    changes). Names as in _basic_block, so weights load into PyTorch's module names."""
    a = g.bn_relu(x, name + ".bn1")
    skip = x
    if stride != 1 or x.shape[0] != width:
        skip = g.conv(a, width, 1, stride, 0, name=name + ".shortcut")
    h = g.conv(a, width, 3, stride, name=name + ".conv1")
    h = g.conv(g.bn_relu(h, name + ".bn2"), width, 3, name=name + ".conv2")
    return g.add(skip, h, name + ".add")


def wide_resnet(depth, widen_factor=10, num_classes=10, in_channels=3, seed=0, input_size=32):
    """Pre-activation WideResNet WRN-depth-k (Zagoruyko & Komodakis 2016, "Wide Residual Networks").

    depth = 6n + 4: a 3x3 conv to 16 channels, three groups of n basic blocks
    of widths 16k, 32k, 64k (stride 1, 2, 2 on each group's first block; a 1x1
    projection shortcut on the pre-activated input where the shape changes),
    final BN-ReLU, global average pool, FC with bias. No dropout (the paper's
    dropout variant is not built). WRN-28-10: 36.5M parameters for 10
    classes, WRN-16-4: 2.7M (the paper's Table; tests/test_models.py checks
    the exact counts). input_size only sets the Graph's planning shape."""
    if not isinstance(depth, int) or depth < 10 or (depth - 4) % 6:
        raise ValueError(f"unsupported depth {depth!r} for wide_resnet: expected 6n+4 with n >= 1 "
                         f"(10, 16, 22, 28, 40, ...)")
    if not isinstance(widen_factor, int) or widen_factor < 1:
        raise ValueError(f"widen_factor must be a positive int, got {widen_factor!r}")
    _check_classes(num_classes, in_channels)
    n = (depth - 4) // 6
    g = Graph(f"wrn-{depth}-{widen_factor}", (in_channels, input_size, input_size), num_classes, seed)
    x = g.conv(g.input, 16, 3, name="conv1")
    for s, width in enumerate(WRN_WIDTHS):
        for b in range(n):
            stride = (1 if s == 0 else 2) if b == 0 else 1
            x = preact_block(g, x, f"layer{s + 1}.{b}", width * widen_factor, stride)
    return g.head(g.bn_relu(x, "bn_final"))


def vgg_bn(depth=16, num_classes=10, in_channels=3, seed=0, input_size=32):
    """VGG-11/13/16/19 with batch norm (Simonyan & Zisserman 2015; BN as in torchvision's vgg*_bn),
    CIFAR-style head: global average pool + one FC (on 32x32 inputs the pool sees 1x1).

    Five stages of 3x3 convs (64, 128, 256, 512, 512 channels), each ending in
    a 2x2/2 max-pool. One change from torchvision's order, forced by the
    method: a conv must read a BN->ReLU output (backward rebuilds the conv's
    input from that unit's saved x-hat), so each stage's pool sits between its
    last conv and that conv's BN-ReLU: conv -> max-pool -> bn-relu -> conv.
    (max commutes with ReLU, not with BN's batch statistics: the network is a
    slightly different one, with the same parameter count.) Names:
    features.{stage}.{i}.conv / .bn, then fc."""
    if depth not in VGG_CONFIGS:
        raise ValueError(f"unsupported depth {depth!r} for vgg_bn: expected one of {sorted(VGG_CONFIGS)}")
    _check_classes(num_classes, in_channels)
    g = Graph(f"vgg{depth}-bn", (in_channels, input_size, input_size), num_classes, seed)
    x = g.input
    for s, (convs, width) in enumerate(zip(VGG_CONFIGS[depth], VGG_WIDTHS)):
        for i in range(convs):
            name = f"features.{s}.{i}"
            x = g.conv(x, width, 3, name=name + ".conv")
            if i == convs - 1:
                x = g.max_pool(x, 2, 2, name=f"features.{s}.pool")
            x = g.bn_relu(x, name + ".bn")
    return g.head(x)


# --------------------------------------------------------------------------------------------
# Post-activation ResNets with torchvision's layout and parameter names (He et al. 2015, "Deep
# Residual Learning"; torchvision.models.resnet, v1.5: the stride on the bottleneck's 3x3 conv)

def _post_basic(g, x, name, width, stride):
    """conv1 3x3 (stride) -> bn1 -> relu -> conv2 3x3 -> bn2, + x (or downsample: 1x1 conv
    (stride) -> bn), then relu. torchvision's BasicBlock."""
    h = g.bn_relu(g.conv(x, width, 3, stride, name=name + ".conv1"), name + ".bn1")
    h = g.bn(g.conv(h, width, 3, name=name + ".conv2"), name + ".bn2")
    return g.relu(g.add(h, _downsample(g, x, name, width, stride), name + ".add"), name + ".relu")


def _post_bottleneck(g, x, name, width, stride):
    """conv1 1x1 -> bn1-relu -> conv2 3x3 (stride) -> bn2-relu -> conv3 1x1 (4x) -> bn3, + x (or
    downsample), then relu. torchvision's Bottleneck."""
    cout = 4 * width
    h = g.bn_relu(g.conv(x, width, 1, pad=0, name=name + ".conv1"), name + ".bn1")
    h = g.bn_relu(g.conv(h, width, 3, stride, name=name + ".conv2"), name + ".bn2")
    h = g.bn(g.conv(h, cout, 1, pad=0, name=name + ".conv3"), name + ".bn3")
    return g.relu(g.add(h, _downsample(g, x, name, cout, stride), name + ".add"), name + ".relu")


def _downsample(g, x, name, cout, stride):
    if stride == 1 and x.shape[0] == cout:
        return x
    return g.bn(g.conv(x, cout, 1, stride, 0, name=name + ".downsample.0"), name + ".downsample.1")


def resnet(depth, num_classes=1000, in_channels=3, seed=0, input_size=224, widths=IMAGENET_WIDTHS):
    """torchvision's ResNet-18/34/50/101/152 (post-activation): 7x7/2 conv1 -> bn1-relu -> 3x3/2
    max-pool -> layer1..layer4 (64/128/256/512 wide; basic blocks for 18/34, bottlenecks for
    50+) -> global average pool -> fc. Parameter and statistic names are torchvision's
    (`layer1.0.conv1.weight`, `layer2.0.downsample.1.running_var`, `fc.bias`), so
    `lowmem export` weights load into a torchvision-shaped module strictly. BN->ReLU pairs are
    the method's units; the BN before each add is a batch norm alone (x-hat kept in float), the
    ReLU after it keeps a 1-bit mask, and the conv reading that ReLU keeps its input. Counts:
    ResNet-18 11,689,512 and ResNet-50 25,557,032 parameters for 1000 classes (torchvision's).
    input_size only sets the Graph's planning shape; widths (torchvision's 64/128/256/512, the
    stem as wide as the first stage) makes a narrower network of the same layout."""
    if depth not in IMAGENET_BLOCKS:
        raise ValueError(f"unsupported depth {depth!r} for resnet: expected one of {sorted(IMAGENET_BLOCKS)}")
    _check_classes(num_classes, in_channels)
    kind, blocks = IMAGENET_BLOCKS[depth]
    block = _post_basic if kind == "basic" else _post_bottleneck
    g = Graph(f"resnet{depth}", (in_channels, input_size, input_size), num_classes, seed)
    x = g.bn_relu(g.conv(g.input, widths[0], 7, 2, 3, name="conv1"), "bn1")
    x = g.max_pool(x, 3, 2, 1, name="maxpool")
    for s, (n, width) in enumerate(zip(blocks, widths)):
        for b in range(n):
            x = block(g, x, f"layer{s + 1}.{b}", width, (1 if s == 0 else 2) if b == 0 else 1)
    return g.head(x)


DENSENET_BLOCKS = {121: (6, 12, 24, 16), 169: (6, 12, 32, 32), 201: (6, 12, 48, 32)}


def densenet(depth=121, num_classes=1000, in_channels=3, seed=0, input_size=224, growth=32, init=64, bn_size=4,
             blocks=None):
    """torchvision's DenseNet-BC-121/169/201 (Huang et al. 2017): conv0 7x7/2 -> norm0-relu ->
    3x3/2 max-pool -> four dense blocks (each layer: norm1-relu -> 1x1 conv to bn_size*growth ->
    norm2-relu -> 3x3 conv to growth, reading the concat of every feature before it), a
    transition after the first three (norm-relu -> 1x1 conv halving the channels -> 2x2 average
    pool) -> norm5-relu -> global average pool -> classifier. torchvision's names
    (`features.denseblock1.denselayer1.norm1.weight`, `features.transition1.conv.weight`,
    `classifier.bias`); DenseNet-121: 7,978,856 parameters for 1000 classes. Every BN is
    followed by a ReLU (a unit), and every concat is read by a unit only, so no conv keeps an
    input; the feature maps of a block stay alive until its last concat (more buffers).
    growth, init, bn_size and blocks (the layers per block; default the depth's) make a smaller
    network of the same layout."""
    if depth not in DENSENET_BLOCKS:
        raise ValueError(f"unsupported depth {depth!r} for densenet: expected one of {sorted(DENSENET_BLOCKS)}")
    _check_classes(num_classes, in_channels)
    g = Graph(f"densenet{depth}", (in_channels, input_size, input_size), num_classes, seed)
    x = g.bn_relu(g.conv(g.input, init, 7, 2, 3, name="features.conv0"), "features.norm0")
    x = g.max_pool(x, 3, 2, 1, name="features.pool0")
    blocks = DENSENET_BLOCKS[depth] if blocks is None else tuple(blocks)
    for b, n in enumerate(blocks):
        block = f"features.denseblock{b + 1}"
        feats = [x]
        for i in range(n):
            layer = f"{block}.denselayer{i + 1}"
            h = feats[0] if len(feats) == 1 else g.concat(*feats, name=f"{layer}.cat")
            h = g.conv(g.bn_relu(h, f"{layer}.norm1"), bn_size * growth, 1, pad=0, name=f"{layer}.conv1")
            feats.append(g.conv(g.bn_relu(h, f"{layer}.norm2"), growth, 3, name=f"{layer}.conv2"))
        x = g.concat(*feats, name=f"{block}.cat")
        if b < len(blocks) - 1:
            t = f"features.transition{b + 1}"
            x = g.conv(g.bn_relu(x, f"{t}.norm"), x.shape[0] // 2, 1, pad=0, name=f"{t}.conv")
            x = g.avg_pool(x, 2, name=f"{t}.pool")
    return g.head(g.bn_relu(x, "features.norm5"), name="classifier")


MOBILENET_V2 = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1))                # (expansion t, channels c, blocks n, first stride s)


def mobilenet_v2(depth=2, num_classes=1000, in_channels=3, seed=0, input_size=224):
    """torchvision's MobileNetV2 (Sandler et al. 2018; depth: the version, 2): features.0 (3x3/2
    conv to 32 -> BN -> ReLU6), 17 inverted residuals (1x1 expand -> BN -> ReLU6, 3x3 depthwise
    -> BN -> ReLU6, 1x1 project -> BN, plus the block input where stride 1 and the widths
    agree), features.18 (1x1 conv to 1280 -> BN -> ReLU6), global average pool, classifier.1.
    torchvision's names (`features.1.conv.0.0.weight`, `features.2.conv.3.running_var`,
    `classifier.1.bias`); 3,504,872 parameters for 1000 classes. torchvision's classifier.0
    (dropout 0.2 on the pooled features) is not built: in training lowmem would drop before
    the pool, another distribution; eval is the same network. Every BN here is a batch norm
    alone (ReLU6 or nothing follows), kept as a range code in approx mode; each ReLU6 keeps a
    2-bit region code, and the convs reading them keep their input as a range code."""
    if depth != 2:
        raise ValueError(f"unsupported depth {depth!r} for mobilenet: expected 2 (MobileNetV2)")
    _check_classes(num_classes, in_channels)
    g = Graph("mobilenet-v2", (in_channels, input_size, input_size), num_classes, seed)

    def conv_bn_act(x, name, cout, k=1, stride=1, groups=1):
        x = g.bn(g.conv(x, cout, k, stride, (k - 1) // 2, name=name + ".0", groups=groups), name + ".1")
        return g.relu6(x, name + ".2")

    x, i = conv_bn_act(g.input, "features.0", 32, 3, 2), 1
    for t, c, n, s in MOBILENET_V2:
        for b in range(n):
            name, cin, stride = f"features.{i}.conv", x.shape[0], s if b == 0 else 1
            h, j = x, 0
            if t != 1:
                h, j = conv_bn_act(h, f"{name}.0", cin * t), 1
            h = conv_bn_act(h, f"{name}.{j}", h.shape[0], 3, stride, groups=h.shape[0])
            h = g.bn(g.conv(h, c, 1, pad=0, name=f"{name}.{j + 1}"), f"{name}.{j + 2}")
            x = g.add(x, h, f"features.{i}.add") if stride == 1 and cin == c else h
            i += 1
    x = conv_bn_act(x, f"features.{i}", 1280)
    return g.head(x, name="classifier.1")


# ---- the registry: every command line and the trainer build models through it --------

@dataclass(frozen=True)
class ModelSpec:
    """One model family: build(depth, num_classes=, in_channels=, seed=) -> Network, and its defaults."""
    build: Callable
    num_classes: int            # default classes (the family's usual dataset)
    input_shape: tuple          # default (C, H, W) of one sample
    depth_help: str             # the depths `build` accepts, for --help


def _wrn_spec(k):
    return ModelSpec(functools.partial(wide_resnet, widen_factor=k), 10, (3, 32, 32),
                     f"6n+4 (10, 16, 22, 28, 40, ...); widening factor {k}")


MODELS = {
    "preact-cifar": ModelSpec(preact_resnet_cifar, 10, (3, 32, 32),
                              "6n+2 with basic blocks (20, 56, 110, ...) or 9n+2 with bottlenecks "
                              "(164, 1001, ...)"),
    "preact-imagenet": ModelSpec(preact_resnet_imagenet, 1000, (3, 224, 224),
                                 ", ".join(map(str, sorted(IMAGENET_BLOCKS)))),
    "vgg-bn": ModelSpec(vgg_bn, 10, (3, 32, 32), ", ".join(map(str, sorted(VGG_CONFIGS)))),
    "resnet": ModelSpec(resnet, 1000, (3, 224, 224), ", ".join(map(str, sorted(IMAGENET_BLOCKS)))
                        + " (torchvision's post-activation ResNets)"),
    "densenet": ModelSpec(densenet, 1000, (3, 224, 224), ", ".join(map(str, sorted(DENSENET_BLOCKS)))
                          + " (torchvision's DenseNet-BC)"),
    "mobilenet": ModelSpec(mobilenet_v2, 1000, (3, 224, 224), "2 (torchvision's MobileNetV2)"),
}
# WRN-d-k: the widening factor is in the name (--model wrn-10 --depth 28 is WRN-28-10)
# (any other wrn-K is built on demand by model_spec)
for _k in (1, 2, 4, 8, 10):
    MODELS[f"wrn-{_k}"] = _wrn_spec(_k)


ONNX_SUFFIX = ".onnx"


def is_onnx_path(name):
    """True when a --model value names an ONNX file (ends in .onnx) rather than a registry family."""
    return isinstance(name, (str, os.PathLike)) and os.fspath(name).lower().endswith(ONNX_SUFFIX)


def onnx_network(path, depth=None, num_classes=None, in_channels=None, seed=0, input_shape=None):
    """The network of an ONNX file (lowmem.nn.from_onnx), checked against what the caller has:
    num_classes and in_channels (the data's; None: the file's), input_shape (C, H, W; needed
    where the file leaves H and W symbolic). depth is ignored: the file fixes the architecture.
    ValueError with one line naming the mismatch."""
    if input_shape is not None and in_channels is not None and input_shape[0] != in_channels:
        raise ValueError(f"input_shape {tuple(input_shape)} does not have in_channels={in_channels}")
    net = from_onnx(path, input_shape, seed)
    if num_classes is not None and num_classes != net.num_classes:
        raise ValueError(f"{os.fspath(path)}: the model has {net.num_classes} classes (its classifier "
                         f"{net.layers[-1].name}), the data {num_classes}")
    if in_channels is not None and in_channels != net.in_channels:
        raise ValueError(f"{os.fspath(path)}: the model reads {net.in_channels} input channels, the data has "
                         f"{in_channels}")
    return net


def model_spec(name):
    """The ModelSpec of `name` (a MODELS key, wrn-K for any positive integer K, or a path ending
    in .onnx: its spec has no default classes or input shape, the file has them); ValueError
    naming the known models otherwise."""
    if is_onnx_path(name):
        return ModelSpec(functools.partial(onnx_network, os.fspath(name)), None, None,
                         "ignored (the ONNX file fixes the architecture)")
    if isinstance(name, str) and name not in MODELS:
        m = re.fullmatch(r"wrn-([1-9][0-9]*)", name)
        if m:
            return _wrn_spec(int(m.group(1)))
    try:
        return MODELS[name]
    except (KeyError, TypeError):
        families = sorted(n for n in MODELS if not n.startswith("wrn-"))
        raise ValueError(f"unknown model {name!r}: expected one of {', '.join(families)}, or wrn-K with K a "
                         f"positive integer (the widening factor: --model wrn-10 --depth 28 is "
                         f"WRN-28-10)") from None


def build_model(name, depth, num_classes=None, in_channels=None, seed=0, input_shape=None):
    """Network `name` of `depth`; num_classes / in_channels default to the family's (10 / 3 for
    preact-cifar, 1000 / 3 for preact-imagenet). input_shape (C, H, W) matters only for an ONNX
    file (onnx_network: its sizes are checked against it, or taken from it where symbolic)."""
    if is_onnx_path(name):
        return onnx_network(name, depth, num_classes, in_channels, seed, input_shape)
    spec = model_spec(name)
    return spec.build(depth, num_classes=spec.num_classes if num_classes is None else num_classes,
                      in_channels=spec.input_shape[0] if in_channels is None else in_channels, seed=seed)
