"""Which ONNX nodes nn.from_onnx reads and what each becomes: the default domain's ops only (a
node of another domain, or a call of a model-local function, is refused even where its name is
a standard op's), and the equivalent spellings other exporters write for the ops lowmem has."""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import helper  # noqa: E402

from lowmem import models, nn  # noqa: E402
from lowmem.formats.common import ExportError  # noqa: E402
from lowmem.formats import onnx_export  # noqa: E402


@pytest.fixture(scope="module")
def free(tmp_path_factory):
    """A preact-resnet8 for 10 classes, H and W symbolic."""
    d = tmp_path_factory.mktemp("onnx")
    return onnx_export.export_onnx(models.build_model("preact-cifar", 8, num_classes=10), d / "free.onnx")


def edited(tmp_path, src, edit, name="edited.onnx"):
    model = onnx.load(src)
    edit(model)
    path = tmp_path / name
    onnx.save(model, path)                               # unchecked: the reader must catch it
    return path


def refused(path, input_shape=(3, 32, 32)):
    with pytest.raises(ExportError) as e:
        nn.from_onnx(path, input_shape=input_shape)
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg, msg
    return msg


# ---------------------------------------------------------------------------- domains

def first(model, op_type):
    return next(n for n in model.graph.node if n.op_type == op_type)


def other_domain(op_type, domain):
    def edit(model):
        first(model, op_type).domain = domain
        model.opset_import.append(helper.make_opsetid(domain, 1))
    return edit


def local_function(domain):
    """The first Relu calls a model-local function `domain:Relu` (which negates)."""
    def edit(model):
        first(model, "Relu").domain = domain
        body = helper.make_node("Neg", ["x"], ["y"])
        model.functions.append(helper.make_function(domain, "Relu", ["x"], ["y"], [body],
                                                    [helper.make_opsetid("", 17)]))
        if domain:
            model.opset_import.append(helper.make_opsetid(domain, 1))
    return edit


@pytest.mark.parametrize("edit,words", [
    (other_domain("Relu", "com.evil"), "domain 'com.evil'"),
    (other_domain("Conv", "com.microsoft"), "domain 'com.microsoft'"),
    (local_function("local"), "domain 'local'"),
    (local_function(""), "model-local function"),
], ids=["com.evil:Relu", "com.microsoft:Conv", "local:Relu", "function Relu"])
def test_a_node_of_another_domain_is_refused_whatever_its_name(tmp_path, free, edit, words):
    msg = refused(edited(tmp_path, free, edit))
    assert words in msg and ("Relu" in msg or "Conv" in msg), msg


# ------------------------------------------------------------------ PyTorch's exports

def torch_export(model, shape, path, opset=17, how="train"):
    """model exported by the TorchScript exporter: how="train" (training mode, no folding: the
    documented flags), "eval" (eval mode, no folding), "default" (torch.onnx.export's defaults:
    eval mode, constant folding)."""
    torch = pytest.importorskip("torch")
    import warnings
    flags = {"train": dict(training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False),
             "eval": dict(training=torch.onnx.TrainingMode.EVAL, do_constant_folding=False),
             "default": {}}[how]
    with warnings.catch_warnings():              # the TorchScript exporter's deprecation and tracer notes
        warnings.simplefilter("ignore")
        torch.onnx.export(model, torch.randn((2,) + shape), str(path), dynamo=False, opset_version=opset, **flags)
    return path


def torch_modules():
    torch = pytest.importorskip("torch")
    from torch import nn as tnn
    from torch.nn import functional as F

    class Block(tnn.Module):
        """torchvision's BasicBlock, small: conv-bn-relu-conv-bn, + x, relu; the activations of
        `act` (relu, F.relu6, torch.clamp(x, 0, 6))."""

        def __init__(self, c, act):
            super().__init__()
            self.conv1, self.bn1 = tnn.Conv2d(c, c, 3, 1, 1, bias=False), tnn.BatchNorm2d(c)
            self.conv2, self.bn2 = tnn.Conv2d(c, c, 3, 1, 1, bias=False), tnn.BatchNorm2d(c)
            self.act = act

        def forward(self, x):
            return self.act(self.bn2(self.conv2(self.act(self.bn1(self.conv1(x))))) + x)

    class Net(tnn.Module):
        def __init__(self, act=F.relu, classes=5):
            super().__init__()
            self.conv1, self.bn1 = tnn.Conv2d(3, 8, 3, 1, 1, bias=False), tnn.BatchNorm2d(8)
            self.layer1 = tnn.Sequential(Block(8, act), Block(8, act))
            self.fc = tnn.Linear(8, classes)
            self.act = act

        def forward(self, x):
            x = self.layer1(self.act(self.bn1(self.conv1(x))))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    class AlexNetStyle(tnn.Module):
        """torchvision's AlexNet layout, small: features, a pool, then Dropout, Linear, ReLU,
        Dropout, Linear, ReLU, Linear on torch.flatten."""

        def __init__(self, classes=5):
            super().__init__()
            self.features = tnn.Sequential(tnn.Conv2d(3, 8, 3, 2, 1), tnn.ReLU(), tnn.MaxPool2d(2),
                                           tnn.Conv2d(8, 6, 3, 1, 1), tnn.ReLU())
            self.avgpool = tnn.AvgPool2d(2)
            self.classifier = tnn.Sequential(tnn.Dropout(0.5), tnn.Linear(6 * 2 * 2, 16), tnn.ReLU(),
                                             tnn.Dropout(0.5), tnn.Linear(16, 12), tnn.ReLU(), tnn.Linear(12, classes))

        def forward(self, x):
            return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))

    return torch, tnn, F, Net, AlexNetStyle


def randomized(model, seed=1):
    """Non-trivial BN affine parameters and running statistics, in place."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.3)
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.2)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
    return model


def same_as_torch_eval(net, model, shape, strict=True):
    """The imported weights load into the torch model under the same names, and the network's
    eval-mode predict (float64) equals the torch model's eval logits."""
    from lowmem.core.engine import Engine
    torch = pytest.importorskip("torch")
    state = {k: torch.from_numpy(v.astype(np.float64)) for k, v in net.state_dict().items()}
    result = model.double().load_state_dict(state, strict=False)
    if strict:
        assert not result.unexpected_keys
        assert all(k.endswith("num_batches_tracked") for k in result.missing_keys), result.missing_keys
    x = np.random.default_rng(5).standard_normal((3,) + shape)
    with torch.no_grad():
        want = model.eval()(torch.from_numpy(x)).numpy()
    got = Engine(net, 3, shape, mode="exact", dtype="float64").predict(x)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_an_eval_mode_export_with_deduplicated_weights_reads(tmp_path):
    """PyTorch's eval-mode export deduplicates equal initializers (every fresh batch norm's
    weights are ones) into Identity nodes of one of them: each Identity is that constant, under
    the name its batch norm reads."""
    torch, tnn, F, Net, _ = torch_modules()
    model = Net()
    path = torch_export(model, (3, 8, 8), tmp_path / "dedup.onnx", how="eval")
    assert any(n.op_type == "Identity" and n.input[0] in {t.name for t in onnx.load(path).graph.initializer}
               for n in onnx.load(path).graph.node)
    net = nn.from_onnx(path)
    assert [L.op for L in net.layers].count("bnrelu") == 3
    same_as_torch_eval(net, model, (3, 8, 8))


@pytest.mark.parametrize("opset", [9, 11, 17])
@pytest.mark.parametrize("act", ["relu6", "clamp"])
def test_relu6_and_clamp_export_as_cast_bounds_and_read_as_relu6(tmp_path, opset, act):
    """F.relu6(x) and torch.clamp(x, 0, 6) export their bounds as Constant -> Cast -> Clip from
    opset 11 (attributes before): a Cast of a constant is that constant."""
    torch, tnn, F, Net, _ = torch_modules()
    fn = F.relu6 if act == "relu6" else (lambda x: torch.clamp(x, 0, 6))
    model = randomized(Net(fn))
    net = nn.from_onnx(torch_export(model.train(), (3, 8, 8), tmp_path / f"{act}.onnx", opset))
    assert [L.op for L in net.layers].count("relu6") == 5
    same_as_torch_eval(net, model, (3, 8, 8))


@pytest.mark.parametrize("opset", [7, 9, 12, 17])
def test_mobilenet_v2_with_its_classifier_dropout_reads(tmp_path, opset):
    """torchvision's MobileNetV2 at its default dropout 0.2 (pool, Flatten, Dropout, Gemm): the pool
    as one k x k window, the dropout on its (C, 1, 1) output, then the head."""
    pytest.importorskip("torch")
    import torchvision_layout as tv
    model = randomized(tv.mobilenet_v2(5, dropout=0.2, width_mult=0.25))
    net = nn.from_onnx(torch_export(model.train(), (3, 64, 64), tmp_path / "mobilenet.onnx", opset))
    tail = [(L.op, L.k, L.p) for L in net.layers[-4:]]
    assert tail == [("avgpool2d", 2, 0.0), ("dropout", 1, 0.2), ("avgpool", 1, 0.0), ("linear", 1, 0.0)], tail
    same_as_torch_eval(net, model, (3, 64, 64))


def test_an_alexnet_classifier_with_dropout_after_flatten_reads(tmp_path):
    """Flatten -> Dropout -> Gemm: the dropout drops the same elements before the linear layer
    flattens them."""
    torch, tnn, F, _, AlexNetStyle = torch_modules()
    model = AlexNetStyle()
    net = nn.from_onnx(torch_export(model.train(), (3, 16, 16), tmp_path / "alexnet.onnx"))
    ops = [(L.op, L.p) for L in net.layers if L.op in ("dropout", "flatten_linear")]
    assert ops == [("dropout", 0.5), ("flatten_linear", 0.0), ("dropout", 0.5), ("flatten_linear", 0.0)], ops
    same_as_torch_eval(net, model, (3, 16, 16))


def test_a_default_export_with_batch_norm_folded_away_is_warned_about(tmp_path, capsys):
    """torch.onnx.export's defaults (eval mode, constant folding) fold every batch norm into its
    conv's bias: the network reads, but has no BN-ReLU unit to compress and the exporter's
    parameter names. The user is told, with the flags that keep batch norm."""
    from lowmem.formats.common import FormatWarning
    from lowmem.tools import cli
    torch, tnn, F, Net, _ = torch_modules()
    path = torch_export(Net(), (3, 8, 8), tmp_path / "folded.onnx", how="default")
    with pytest.warns(FormatWarning) as w:
        net = nn.from_onnx(path)
    msg = str(w[0].message)
    assert "no BatchNormalization" in msg and "do_constant_folding=False" in msg and "TRAINING" in msg, msg
    assert "bnrelu" not in [L.op for L in net.layers]
    capsys.readouterr()
    assert cli.main(["plan", "--model", str(path), "--batch", "2", "--no-schedule"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("lowmem plan: warning: ") and "no BatchNormalization" in err and len(err.splitlines()) == 1
    import warnings
    with warnings.catch_warnings():                              # a network with batch norm: no word
        warnings.simplefilter("error", FormatWarning)
        nn.from_onnx(torch_export(Net(), (3, 8, 8), tmp_path / "kept.onnx"))


def test_a_default_export_with_some_batch_norms_folded_is_warned_about(tmp_path):
    """Constant folding folds only a batch norm that follows a conv: in a DenseNet the others (after
    a concatenation) stay BatchNormalization nodes, so the file has some, yet half its convs carry
    their batch norm folded in. Warned about as well, counting the convs."""
    from lowmem.formats.common import FormatWarning
    pytest.importorskip("torch")
    import torchvision_layout as tv
    model = tv.DenseNet(growth=4, blocks=(2, 2), init=8, bn_size=2, num_classes=5)
    path = torch_export(model, (3, 32, 32), tmp_path / "partial.onnx", how="default")
    nodes = onnx.load(path).graph.node
    assert "BatchNormalization" in [n.op_type for n in nodes]
    with pytest.warns(FormatWarning) as w:
        net = nn.from_onnx(path)
    msg = str(w[0].message)
    assert "5 of its 10 convs read tensors the exporter made ('onnx::Conv_" in msg, msg
    assert "do_constant_folding=False" in msg and "TRAINING" in msg, msg
    assert [L.op for L in net.layers].count("bnrelu") == 6             # norm1 of each layer, the transition, norm5


# ------------------------------------------------------------------ spellings

def spelled_graph():
    g = nn.Graph("spelled", (3, 8, 8), 4)
    a = g.conv(g.input, 4, 3, name="a")
    b = g.conv(g.input, 4, 3, name="b")
    x = g.relu6(g.bn(g.concat(a, b, name="cat"), name="bn"), name="clip")
    return g.head(g.avg_pool(x, 2, name="pool2"))


def concat_axis_minus_3(model):
    next(a for a in first(model, "Concat").attribute if a.name == "axis").i = -3


def bounds_as_value_float(model):
    clip = first(model, "Clip")
    for n in model.graph.node:
        if n.op_type == "Constant" and n.output[0] in clip.input[1:]:
            value = float(onnx.numpy_helper.to_array(n.attribute[0].t))
            n.ClearField("attribute")
            n.attribute.append(helper.make_attribute("value_float", value))


def identity_after_the_classifier(model):
    g = model.graph
    out = g.output[0].name
    next(n for n in g.node if out in n.output).output[0] = "pre_logits"
    g.node.append(helper.make_node("Identity", ["pre_logits"], [out], name="out"))


def zero_pad_before_the_pool(model):
    """An all-zero Pad before the AveragePool, its pads a Constant of value_ints."""
    g = model.graph
    pool = first(model, "AveragePool")
    pad = helper.make_node("Pad", [pool.input[0], "zeros"], ["padded"], name="pad", mode="constant")
    g.node.insert(list(g.node).index(pool), pad)
    g.node.insert(0, helper.make_node("Constant", [], ["zeros"], name="zeros", value_ints=[0] * 8))
    pool.input[0] = "padded"


@pytest.mark.parametrize("respell", [concat_axis_minus_3, bounds_as_value_float, identity_after_the_classifier,
                                     zero_pad_before_the_pool], ids=lambda f: f.__name__)
def test_spellings_other_exporters_write_read_as_the_same_network(tmp_path, respell):
    """Each reads as the network the plain spelling (lowmem's export) makes, with the same plan."""
    from lowmem.core.engine import Engine
    plain = spelled_graph()
    path = onnx_export.export_onnx(plain, tmp_path / "plain.onnx")
    back = nn.from_onnx(edited(tmp_path, path, respell, "respelled.onnx"), input_shape=(3, 8, 8))
    assert [(L.op, L.name, L.src, L.dst, L.inputs) for L in back.layers] == \
        [(L.op, L.name, L.src, L.dst, L.inputs) for L in plain.layers]
    e1, e2 = (Engine(n, 2, (3, 8, 8), "approx", 4, allocate=False) for n in (plain, back))
    assert e1.plan.report(max_rows=10 ** 6) == e2.plan.report(max_rows=10 ** 6)


def test_a_pad_that_pads_is_refused_by_name(tmp_path):
    def edit(model):
        zero_pad_before_the_pool(model)
        c = next(n for n in model.graph.node if n.name == "zeros")
        c.ClearField("attribute")
        c.attribute.append(helper.make_attribute("value_ints", [0, 0, 1, 1, 0, 0, 1, 1]))
    path = onnx_export.export_onnx(spelled_graph(), tmp_path / "plain.onnx")
    msg = refused(edited(tmp_path, path, edit), (3, 8, 8))
    assert "node 'pad': Pad with pads [0, 0, 1, 1, ... (8 values)] is not supported" in msg, msg


@pytest.mark.parametrize("opset", [7, 8, 9])
def test_densenet_at_opsets_7_to_9_reads_its_zero_pads(tmp_path, opset):
    """PyTorch writes DenseNet's transition AvgPool2d as an all-zero Pad, then AveragePool, at
    opsets 7-9."""
    pytest.importorskip("torch")
    import torchvision_layout as tv
    model = randomized(tv.DenseNet(growth=4, blocks=(2, 2), init=8, bn_size=2, num_classes=5))
    path = torch_export(model.train(), (3, 32, 32), tmp_path / "densenet.onnx", opset)
    assert "Pad" in [n.op_type for n in onnx.load(path).graph.node]
    same_as_torch_eval(nn.from_onnx(path), model, (3, 32, 32))


def test_squeeze_excitation_is_refused_naming_the_real_reason(tmp_path):
    """RegNetY's squeeze-excitation: a global average pool inside the network, Conv, ReLU, Conv,
    Sigmoid, Mul. lowmem pools globally only in its head and has no gate op: said so."""
    torch, tnn, F, _, _ = torch_modules()

    class SE(tnn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = tnn.Conv2d(3, 8, 3, 1, 1, bias=False), tnn.BatchNorm2d(8)
            self.fc1, self.fc2 = tnn.Conv2d(8, 2, 1), tnn.Conv2d(2, 8, 1)
            self.fc = tnn.Linear(8, 5)

        def forward(self, x):
            x = F.relu(self.bn(self.conv(x)))
            x = x * torch.sigmoid(self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(x, 1)))))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    msg = refused(torch_export(SE(), (3, 8, 8), tmp_path / "se.onnx"), None)
    assert "global average pool inside the network (read by Conv)" in msg and "squeeze-and-excitation" in msg, msg


def test_a_squeeze_excitation_of_linear_layers_is_refused_naming_the_real_reason(tmp_path):
    """SENet's own gate: pool, Flatten, Linear, ReLU, Linear, Sigmoid, view, Mul. The pool reaches a
    Gemm through a Flatten, as a classifier would, but that Gemm does not write the logits: the
    refusal names the pool inside the network, not the classifier's spelling."""
    torch, tnn, F, _, _ = torch_modules()

    class LinearSE(tnn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = tnn.Conv2d(3, 8, 3, 1, 1, bias=False), tnn.BatchNorm2d(8)
            self.fc1, self.fc2 = tnn.Linear(8, 2), tnn.Linear(2, 8)
            self.fc = tnn.Linear(8, 5)

        def forward(self, x):
            x = F.relu(self.bn(self.conv(x)))
            gate = torch.sigmoid(self.fc2(F.relu(self.fc1(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)))))
            x = x * gate.view(-1, 8, 1, 1)
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    msg = refused(torch_export(LinearSE(), (3, 8, 8), tmp_path / "linear_se.onnx"), None)
    assert "a global average pool inside the network (read by Flatten, then Gemm '/fc1/Gemm', which does not " \
           "write the graph's output) is not supported" in msg and "squeeze-and-excitation" in msg, msg
