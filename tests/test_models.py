"""Model definitions: parameter counts, depth rules, names and order, state dicts."""
import copy

import numpy as np
import pytest

from lowmem.core.engine import Engine
from lowmem.models import preact_resnet_cifar, preact_resnet_imagenet
from lowmem.train.optim import SGD


def weighted_layers(net):
    """He et al.'s depth: convs and the FC layer, projection shortcuts not counted."""
    return sum(1 for L in net.layers if L.op in ("conv", "linear") and not L.name.endswith(".shortcut"))


def count_params_by_hand(depth, num_classes, in_channels=3):
    """ResNet-164-style bottleneck count written out from the architecture (He et al. 2016)."""
    n = (depth - 2) // 9
    total = in_channels * 16 * 9                                # stem 3x3 conv
    cin = 16
    for width in (16, 32, 64):
        for b in range(n):
            cout = 4 * width
            total += 2 * cin                                    # bn1
            total += cin * width                                # 1x1
            total += 2 * width + width * width * 9              # bn2, 3x3
            total += 2 * width + width * cout                   # bn3, 1x1
            if b == 0:
                total += cin * cout                             # projection shortcut
            cin = cout
    return total + 2 * cin + cin * num_classes + num_classes    # bn_final, fc


def test_resnet164_parameter_count():
    net = preact_resnet_cifar(164, num_classes=10)
    assert net.num_params() == 1_703_258
    assert count_params_by_hand(164, 10) == 1_703_258
    assert sum(p.data.size for p in net.parameters()) == 1_703_258
    assert preact_resnet_cifar(164, num_classes=100).num_params() == count_params_by_hand(164, 100)


@pytest.mark.parametrize("depth,block,n", [(8, "basic", 1), (20, "basic", 3), (56, "basic", 9),
                                           (110, "basic", 18), (11, "bottleneck", 1),
                                           (29, "bottleneck", 3), (164, "bottleneck", 18)])
def test_cifar_depth_rules(depth, block, n):
    """6n+2 -> n basic blocks per stage; 9n+2 -> n bottlenecks; He et al.'s defaults where both fit."""
    net = preact_resnet_cifar(depth)
    assert weighted_layers(net) == depth
    per_block = {"basic": 2, "bottleneck": 3}[block]
    assert sum(1 for L in net.layers if L.op == "add") == 3 * n
    assert sum(1 for L in net.layers if L.op == "bnrelu") == 3 * n * per_block + 1
    assert net.params["fc.weight"].shape == (10, 64 * (4 if block == "bottleneck" else 1))
    strided = [L.name for L in net.layers if L.op == "conv" and L.stride == 2]
    assert strided == [f"layer{s}.0.{c}" for s in (2, 3) for c in
                       (("shortcut", "conv1") if block == "basic" else ("shortcut", "conv2"))]


def test_cifar_depth_1001_and_block_override():
    net = preact_resnet_cifar(1001)
    assert weighted_layers(net) == 1001
    assert sum(1 for L in net.layers if L.op == "add") == 3 * 111
    # 20, 56 and 110 are 6n+2 and 9n+2: basic by default, bottleneck on request
    assert weighted_layers(preact_resnet_cifar(56, block="bottleneck")) == 56
    assert any(L.name.endswith("bn3") for L in preact_resnet_cifar(56, block="bottleneck").layers)
    assert not any(L.name.endswith("bn3") for L in preact_resnet_cifar(56).layers)
    assert weighted_layers(preact_resnet_cifar(20, block="bottleneck")) == 20
    with pytest.raises(ValueError, match="unsupported depth 26 for bottleneck"):
        preact_resnet_cifar(26, block="bottleneck")
    with pytest.raises(ValueError, match="unsupported depth 11 for basic"):
        preact_resnet_cifar(11, block="basic")
    with pytest.raises(ValueError, match="unknown block 'wide'"):
        preact_resnet_cifar(20, block="wide")


@pytest.mark.parametrize("depth", [7, 9, 10, 12, 21, 0, -4, 2, 8.0, "20", None])
def test_unsupported_depths_raise(depth):
    with pytest.raises(ValueError) as info:
        preact_resnet_cifar(depth)
    msg = str(info.value)
    assert f"unsupported depth {depth!r}" in msg and "6n+2" in msg and "9n+2" in msg


@pytest.mark.parametrize("depth", [18, 34, 50])
def test_imagenet_depths(depth):
    net = preact_resnet_imagenet(depth, num_classes=7)
    assert weighted_layers(net) == depth
    first = [L.op for L in net.layers[:3]]
    assert first == ["conv", "bnrelu", "maxpool"]
    assert (net.layers[0].k, net.layers[0].stride, net.layers[0].pad) == (7, 2, 3)
    assert (net.layers[2].k, net.layers[2].stride, net.layers[2].pad) == (3, 2, 1)
    assert net.params["fc.weight"].shape == (7, 512 * (4 if depth >= 50 else 1))


@pytest.mark.parametrize("kw,words", [(dict(depth=19), ["unsupported depth 19", "18, 34, 50, 101, 152"]),
                                      (dict(depth=18, num_classes=0), ["num_classes", "0"]),
                                      (dict(depth=18, in_channels=0), ["in_channels", "0"])])
def test_imagenet_bad_arguments(kw, words):
    with pytest.raises(ValueError) as info:
        preact_resnet_imagenet(**kw)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_cifar_bad_classes_and_channels():
    with pytest.raises(ValueError, match="num_classes must be a positive int, got -1"):
        preact_resnet_cifar(20, num_classes=-1)
    with pytest.raises(ValueError, match="in_channels must be a positive int, got 2.5"):
        preact_resnet_cifar(20, in_channels=2.5)
    net = preact_resnet_cifar(20, num_classes=3, in_channels=1)
    assert net.params["conv1.weight"].shape == (16, 1, 3, 3) and net.params["fc.bias"].shape == (3,)


@pytest.mark.parametrize("build", [lambda: preact_resnet_cifar(20), lambda: preact_resnet_cifar(29),
                                   lambda: preact_resnet_imagenet(18)])
def test_parameters_in_forward_order_with_stable_unique_names(build):
    net = build()
    params = net.parameters()
    names = [p.name for p in params]
    assert len(set(names)) == len(names)
    assert names == [p.name for p in build().parameters()]            # stable across builds
    assert all(p.name == n for n, p in net.params.items())
    # forward order: exactly the layers' parameters, layer by layer
    expected = []
    for L in net.layers:
        if L.op == "conv":
            expected.append(L.name + ".weight")
        elif L.op in ("bnrelu", "linear"):
            expected += [L.name + ".weight", L.name + ".bias"]
    assert names == expected
    assert names[0] == "conv1.weight" and names[-2:] == ["fc.weight", "fc.bias"]
    # every BN unit has running statistics, with stable names
    bns = [L.name for L in net.layers if L.op == "bnrelu"]
    assert list(net.stats) == [f"{b}.{s}" for b in bns for s in ("running_mean", "running_var")]
    # the same seed gives the same weights; another seed does not
    np.testing.assert_array_equal(params[0].data, build().parameters()[0].data)


def test_seed_changes_weights():
    a, b = preact_resnet_cifar(20, seed=0), preact_resnet_cifar(20, seed=1)
    assert not np.array_equal(a.params["conv1.weight"].data, b.params["conv1.weight"].data)


def test_state_dict_round_trip_after_a_training_step():
    rng = np.random.default_rng(0)
    net = preact_resnet_cifar(8, num_classes=4)
    eng = Engine(net, batch_size=4, input_shape=(3, 8, 8), mode="approx", bits=4)
    opt = SGD(net.parameters(), lr=0.1)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    y = np.array([0, 1, 2, 3])
    eng.train_step(x, y, opt)
    d = net.state_dict()
    assert set(d) == set(net.params) | set(net.stats)
    assert not np.array_equal(d["conv1.weight"], preact_resnet_cifar(8, num_classes=4).params["conv1.weight"].data)
    assert not np.all(d["bn_final.running_mean"] == 0)               # the step moved the statistics
    # the dict is a copy: training on does not change it
    eng.train_step(x, y, opt)
    assert not np.array_equal(d["conv1.weight"], net.params["conv1.weight"].data)
    # load into a fresh network / engine: identical eval outputs and identical state
    fresh = preact_resnet_cifar(8, num_classes=4, seed=5)
    eng2 = Engine(fresh, batch_size=4, input_shape=(3, 8, 8), mode="approx", bits=4)
    fresh.load_state_dict(d)
    for k, v in fresh.state_dict().items():
        np.testing.assert_array_equal(v, d[k], err_msg=k)
    assert fresh.params["conv1.weight"].data is eng2.arrays["conv1.weight"]   # loaded in place
    net.load_state_dict(d)
    np.testing.assert_array_equal(eng2.predict(x), eng.predict(x))
    # float64 values load into a float32 network
    net.load_state_dict({k: v.astype(np.float64) for k, v in d.items()})
    np.testing.assert_array_equal(net.state_dict()["fc.weight"], d["fc.weight"])


def test_load_state_dict_rejects_wrong_names_and_shapes():
    net = preact_resnet_cifar(8)
    good = net.state_dict()
    before = copy.deepcopy(good)
    bad = dict(good)
    bad["conv1.weight"] = np.zeros((16, 3, 5, 5), np.float32)
    with pytest.raises(ValueError, match=r"'conv1.weight' has shape \(16, 3, 5, 5\).*expects \(16, 3, 3, 3\)"):
        net.load_state_dict(bad)
    bad = dict(good)
    del bad["layer1.0.bn1.running_var"]
    with pytest.raises(ValueError, match=r"missing \['layer1.0.bn1.running_var'\]"):
        net.load_state_dict(bad)
    bad = dict(good)
    bad["fc.wieght"] = bad.pop("fc.weight")
    with pytest.raises(ValueError) as info:
        net.load_state_dict(bad)
    assert "missing ['fc.weight']" in str(info.value) and "unexpected ['fc.wieght']" in str(info.value)
    bad = dict(good)
    bad["extra.weight"] = np.zeros(3)
    with pytest.raises(ValueError, match=r"unexpected \['extra.weight'\]"):
        net.load_state_dict(bad)
    # a rejected load changes nothing
    bad = dict(good)
    bad = {k: v + 1 for k, v in bad.items()}
    bad["fc.bias"] = np.zeros(11)
    with pytest.raises(ValueError, match="fc.bias"):
        net.load_state_dict(bad)
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


# ---------------------------------------------------------------- WideResNet and VGG-BN

from lowmem.models import vgg_bn, wide_resnet          # noqa: E402
from lowmem import nn as lnn  # noqa: E402


def count_wrn_by_hand(depth, k, num_classes, in_channels=3):
    """WRN-d-k written out from Zagoruyko & Komodakis 2016 (Table 1): conv1 3x3 to 16; groups
    of n = (d-4)/6 basic blocks of widths 16k, 32k, 64k; a 1x1 projection where the shape
    changes; BN (gamma, beta) before every conv and at the end; FC with bias."""
    n = (depth - 4) // 6
    total, cin = in_channels * 16 * 9, 16
    for width in (16 * k, 32 * k, 64 * k):
        for b in range(n):
            total += 2 * cin + cin * width * 9 + 2 * width + width * width * 9
            if cin != width or b == 0 and width != 16 * k:
                total += cin * width
            cin = width
    return total + 2 * cin + cin * num_classes + num_classes


@pytest.mark.parametrize("depth, k, paper_millions", [(28, 10, 36.5), (16, 4, 2.7), (40, 4, 8.9),
                                                       (16, 8, 11.0), (22, 8, 17.2)])
def test_wide_resnet_parameter_counts_match_the_paper(depth, k, paper_millions):
    """The paper's Table 4 (CIFAR-10) rounds to 0.1M; the exact count is the hand formula."""
    net = wide_resnet(depth, k, num_classes=10)
    assert net.num_params() == count_wrn_by_hand(depth, k, 10)
    assert round(net.num_params() / 1e6, 1) == paper_millions
    assert net.name == f"wrn-{depth}-{k}"


def test_wide_resnet_exact_counts():
    assert wide_resnet(28, 10).num_params() == 36_479_194
    assert wide_resnet(16, 4).num_params() == 2_748_890
    assert wide_resnet(16, 4, num_classes=100).num_params() == count_wrn_by_hand(16, 4, 100)


def test_wide_resnet_structure():
    net = wide_resnet(16, 2)
    assert weighted_layers(net) == 16 - 2                # 12 block convs + stem + fc; shortcuts not counted
    shortcuts = [L.name for L in net.layers if L.name.endswith(".shortcut")]
    assert shortcuts == ["layer1.0.shortcut", "layer2.0.shortcut", "layer3.0.shortcut"]  # 16 -> 32 too
    assert [L.stride for L in net.layers if L.name.endswith(".shortcut")] == [1, 2, 2]
    assert net.params["fc.weight"].shape == (10, 128)
    lnn.check(net, (3, 32, 32))


@pytest.mark.parametrize("depth", [10, 16, 28])
def test_wide_resnet_width_1_is_the_preact_resnet_layout(depth):
    """WRN-d-1 has He et al.'s pre-act layout with 6n+4 layers: same records as a hand-built block."""
    net = wide_resnet(depth, 1)
    assert net.layers[1].name == "layer1.0.bn1" and net.layers[-1].op == "linear"
    assert sum(1 for L in net.layers if L.op == "add") == 3 * ((depth - 4) // 6)


@pytest.mark.parametrize("kw, words", [(dict(depth=20), r"6n\+4"), (dict(depth=28, widen_factor=0), "widen_factor"),
                                       (dict(depth=28, num_classes=0), "num_classes")])
def test_wide_resnet_bad_arguments(kw, words):
    with pytest.raises(ValueError, match=words):
        wide_resnet(**kw)


def count_vgg_by_hand(depth, num_classes, in_channels=3):
    """3x3 convs without bias (BN follows), each with BN (gamma, beta); FC 512 -> classes."""
    convs = {11: [64, 128, 256, 256, 512, 512, 512, 512],
             13: [64, 64, 128, 128, 256, 256, 512, 512, 512, 512],
             16: [64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512],
             19: [64, 64, 128, 128] + [256] * 4 + [512] * 8}[depth]
    total, cin = 0, in_channels
    for c in convs:
        total += cin * c * 9 + 2 * c
        cin = c
    return total + 512 * num_classes + num_classes


@pytest.mark.parametrize("depth", [11, 13, 16, 19])
def test_vgg_bn_parameter_counts_and_layout(depth):
    net = vgg_bn(depth, num_classes=10)
    assert net.num_params() == count_vgg_by_hand(depth, 10)
    assert weighted_layers(net) == depth - 2          # the classifier is one FC, not three
    assert sum(1 for L in net.layers if L.op == "maxpool") == 5
    ops = [L.op for L in net.layers]
    for i, op in enumerate(ops):                       # pool sits between a conv and its BN-ReLU
        if op == "maxpool":
            assert ops[i - 1] == "conv" and ops[i + 1] == "bnrelu"
    lnn.check(net, (3, 32, 32))


def test_vgg_matches_a_pytorch_implementation():
    """VGG-11-BN written the ordinary PyTorch way (pool between conv and BN): names, count,
    loss, logits and every gradient in float64."""
    torch = pytest.importorskip("torch")
    from torch import nn as tnn
    import torch_reference as ref
    from reference import rel

    class Unit(tnn.Module):
        def __init__(self, cin, c):
            super().__init__()
            self.conv, self.bn = tnn.Conv2d(cin, c, 3, padding=1, bias=False), ref.BatchNorm2d(c)

    class VGG(tnn.Module):
        def __init__(self, cfg, widths, classes):
            super().__init__()
            stages, cin = [], 3
            for convs, c in zip(cfg, widths):
                stages.append(tnn.ModuleList([Unit(cin if i == 0 else c, c) for i in range(convs)]))
                cin = c
            self.features, self.fc = tnn.ModuleList(stages), tnn.Linear(cin, classes)

        def forward(self, x):
            for stage in self.features:
                for i, u in enumerate(stage):
                    x = u.conv(x)
                    if i == len(stage) - 1:
                        x = torch.nn.functional.max_pool2d(x, 2)
                    x = torch.relu(u.bn(x))
            return self.fc(x.mean(dim=(2, 3)))

    net = vgg_bn(11, num_classes=10)
    model = ref.load_lowmem_state(VGG((1, 1, 2, 2, 2), (64, 128, 256, 512, 512), 10),
                                  net.state_dict()).double().train()
    assert sum(p.numel() for p in model.parameters()) == net.num_params()
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((2, 3, 32, 32)), rng.integers(0, 10, 2)
    eng = Engine(net, 2, (3, 32, 32), mode="exact", dtype="float64")
    loss, logits = eng.forward(x, y)
    eng.backward()
    tl = model(torch.from_numpy(x))
    tloss = torch.nn.functional.cross_entropy(tl, torch.from_numpy(y))
    tloss.backward()
    assert rel(loss, tloss.item()) < 1e-9 and rel(logits, tl.detach().numpy()) < 1e-9
    for n, p in model.named_parameters():
        assert rel(net.params[n].grad, p.grad.numpy()) < 1e-8, n


def test_vgg_bad_depth():
    with pytest.raises(ValueError, match="11, 13, 16, 19"):
        vgg_bn(12)


@pytest.mark.parametrize("build, shape", [(lambda: wide_resnet(10, 2, num_classes=5), (3, 8, 8)),
                                          (lambda: vgg_bn(11, num_classes=5, input_size=32), (3, 32, 32))])
def test_new_models_pass_finite_differences(build, shape):
    """Float64 gradients of a few tensors against central differences (exact mode)."""
    from reference import batch, check_directional, randomize_units
    rng = np.random.default_rng(7)
    net = build()
    eng = Engine(net, 2 if shape[1] == 32 else 3, shape, mode="exact", dtype="float64")
    randomize_units(net, rng)
    x, y = batch(rng, net, eng.N, shape)
    eng.forward(x, y)
    eng.backward()
    names = [n for n in net.params if n.endswith(("conv1.weight", ".0.0.conv.weight", "bn.bias", "fc.weight"))][:4]
    assert names
    for name in names:
        check_directional(lambda: eng.forward(x, y)[0], [net.params[name].data],
                          [net.params[name].grad.copy()], rng, name)


def test_wide_resnet_matches_the_pytorch_reference():
    """WRN-10-2 is torch_reference's PreActResNet with widths 32/64/128: loss, logits, gradients."""
    torch = pytest.importorskip("torch")
    import torch_reference as ref
    from reference import rel
    net = wide_resnet(10, 2, num_classes=10)
    model = ref.load_lowmem_state(ref.PreActResNet("basic", (1, 1, 1), (32, 64, 128), 10, 3),
                                  net.state_dict()).double().train()
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 3, 16, 16)), rng.integers(0, 10, 4)
    eng = Engine(net, 4, (3, 16, 16), mode="exact", dtype="float64")
    loss, logits = eng.forward(x, y)
    eng.backward()
    tl = model(torch.from_numpy(x))
    tloss = torch.nn.functional.cross_entropy(tl, torch.from_numpy(y))
    tloss.backward()
    assert rel(loss, tloss.item()) < 1e-9 and rel(logits, tl.detach().numpy()) < 1e-9
    for n, p in model.named_parameters():
        assert rel(net.params[n].grad, p.grad.numpy()) < 1e-9, n


# ---- the registry ----------------------------------------------------------------------

def test_registry_builds_every_family_with_its_defaults():
    from lowmem.models import MODELS, build_model, model_spec
    assert sorted(MODELS) == ["densenet", "mobilenet", "preact-cifar", "preact-imagenet", "resnet", "vgg-bn",
                              "wrn-1", "wrn-10", "wrn-2", "wrn-4", "wrn-8"]
    for name, depth in (("preact-cifar", 8), ("preact-imagenet", 18), ("vgg-bn", 11), ("wrn-4", 16)):
        spec = model_spec(name)
        net = build_model(name, depth)
        assert net.num_classes == spec.num_classes and net.in_channels == spec.input_shape[0]
        assert net.num_params() == spec.build(depth).num_params()          # the builder, unchanged
        assert str(depth) in spec.depth_help or "6n+" in spec.depth_help
    assert build_model("preact-cifar", 8, num_classes=3, in_channels=1).num_params() == \
        preact_resnet_cifar(8, num_classes=3, in_channels=1).num_params()
    assert build_model("wrn-4", 16).num_params() == 2_748_890                # WRN-16-4
    with pytest.raises(ValueError, match="unknown model 'vgg': expected one of densenet, mobilenet, preact-cifar, "
                                         "preact-imagenet, resnet, vgg-bn"):
        build_model("vgg", 16)


# ---- load_state_dict refuses what would load silently wrong --------------------------------

@pytest.mark.parametrize("entry, value, words", [
    ("conv1.weight", lambda v: np.where(v > 0, np.nan, v), r"'conv1.weight' holds NaN or inf"),
    ("fc.bias", lambda v: v + np.inf, r"'fc.bias' holds NaN or inf"),
    ("fc.bias", lambda v: v.astype(np.float64) + 1e39, r"'fc.bias' holds NaN or inf \(after conversion to float32"),
    ("layer1.0.bn1.running_var", lambda v: v - 2, r"'layer1.0.bn1.running_var' has a negative running variance"),
    ("layer1.0.bn1.running_mean", lambda v: v.astype(np.int64), r"'layer1.0.bn1.running_mean' is an integer array"),
    ("fc.weight", lambda v: v.astype(np.complex64), r"'fc.weight' is a complex array"),
    ("fc.bias", lambda v: v > 0, r"'fc.bias' is a bool array"),
    ("fc.bias", lambda v: [int(t) for t in v], r"'fc.bias' is an integer array"),
])
def test_load_state_dict_refuses_bad_values_by_name(entry, value, words):
    net = preact_resnet_cifar(8)
    good = net.state_dict()
    before = copy.deepcopy(good)
    bad = {k: v + 1 for k, v in good.items()}      # everything else changed: nothing may be copied
    bad[entry] = value(good[entry])
    with pytest.raises(ValueError, match=words):
        net.load_state_dict(bad)
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


@pytest.mark.parametrize("d", [None, [("fc.bias", np.zeros(10))], "weights.ckpt", 3])
def test_load_state_dict_wants_a_dict(d):
    with pytest.raises(TypeError, match=r"load_state_dict expects a dict name -> array .* got "
                                        + type(d).__name__):
        preact_resnet_cifar(8).load_state_dict(d)


def test_load_state_dict_accepts_float64_and_zero_variance():
    net = preact_resnet_cifar(8)
    d = {k: v.astype(np.float64) for k, v in net.state_dict().items()}
    d["layer1.0.bn1.running_var"][:] = 0                    # a dead channel: variance 0 is legal
    net.load_state_dict(d)
    assert (net.stats["layer1.0.bn1.running_var"] == 0).all()
