"""ONNX in (lowmem.nn.from_onnx, lowmem/formats/onnx_import.py).

* Round trip: every registry model family, exported by lowmem (formats/onnx_export.py) and read back,
  is the same network: the same layers (ops, names, buffers, sizes), the same parameters and
  statistics bit for bit, the same memory plan and schedule, and a bit-identical training step.
* Bad files: a missing, truncated or non-ONNX file, an unsupported node (named, with its op
  type and the supported ops), an input shape the file does not allow: one clear line each.
PyTorch models exported to ONNX and compared with autograd: tests/formats/test_onnx_import_torch.py.
"""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

from lowmem import models, nn  # noqa: E402
from lowmem.core.engine import Engine  # noqa: E402
from lowmem.formats import onnx_export  # noqa: E402
from lowmem.formats.common import ExportError  # noqa: E402
from lowmem.train.optim import SGD  # noqa: E402
from reference import GRAPHS, random_graph, randomize_units  # noqa: E402

# (registry name, depth, input shape): the smallest of each family, every block kind
ROUND_TRIPS = [("preact-cifar", 8, (3, 16, 16)), ("preact-cifar", 11, (3, 16, 16)),
               ("preact-imagenet", 18, (3, 16, 16)), ("vgg-bn", 11, (3, 32, 32)), ("wrn-1", 10, (3, 16, 16)),
               ("resnet", 18, (3, 16, 16)), ("densenet", 121, (3, 32, 32)), ("mobilenet", 2, (3, 32, 32))]

# The hand-written bottleneck ResNet (models.py) keeps the stem conv's output in `res` although
# no add reads it (the first block projects its pre-activated input); the builder (nn.Graph)
# gives it act0. Same plan (bytes, every entry), same step bit for bit; only that buffer's name differs.
OTHER_BUFFERS = {("preact-cifar", 11), ("preact-cifar", 164)}


def test_every_registry_family_is_round_tripped():
    """A family added to the registry must join ROUND_TRIPS (wrn-K: one widening factor stands for all)."""
    families = {m if not m.startswith("wrn-") else "wrn-1" for m in models.MODELS}
    assert families <= {m for m, _, _ in ROUND_TRIPS}, sorted(families - {m for m, _, _ in ROUND_TRIPS})


def layers(net, buffers=True):
    """The layer records; buffers=False leaves out src / dst (which buffer holds each tensor)."""
    return [(L.op, L.name) + ((L.src, L.dst) if buffers else ()) + (L.k, L.stride, L.pad, L.cin, L.cout)
            for L in net.layers]


def step(net, shape, x, labels):
    eng = Engine(net, len(x), shape, mode="approx", bits=4, dtype="float32")
    opt = SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    loss = eng.train_step(x, labels, opt)
    return eng, loss, net.state_dict()


@pytest.mark.parametrize("model,depth,shape", ROUND_TRIPS, ids=[f"{m}-{d}" for m, d, _ in ROUND_TRIPS])
def test_a_registry_model_round_trips_through_onnx(tmp_path, model, depth, shape):
    round_trip(tmp_path, model, depth, shape, batch=4)


def test_a_deep_bottleneck_resnet_round_trips_through_onnx(tmp_path):
    """Pre-activation ResNet-164 (54 bottleneck blocks) at batch 2 on 3x32x32: the same plan (the
    report: every entry and its bytes), the same schedule, a bit-identical approx 4-bit step."""
    round_trip(tmp_path, "preact-cifar", 164, (3, 32, 32), batch=2)


def round_trip(tmp_path, model, depth, shape, batch):
    rng = np.random.default_rng(3)
    net = randomize_units(models.build_model(model, depth, num_classes=5, in_channels=shape[0]), rng)
    path = onnx_export.export_onnx(net, tmp_path / "m.onnx", input_shape=shape)
    back = nn.from_onnx(path)
    assert back.name == net.name and back.num_classes == 5 and back.in_channels == shape[0]
    assert layers(back, buffers=False) == layers(net, buffers=False)
    a, b = net.state_dict(), back.state_dict()
    assert list(a) == list(b)                                  # names, in forward order
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)   # float32 in, float32 out: exact
    x = rng.standard_normal((batch,) + shape).astype(np.float32)
    labels = rng.integers(0, 5, batch)
    e1, l1, s1 = step(net, shape, x, labels)
    e2, l2, s2 = step(back, shape, x, labels)
    assert e2.plan.report() == e1.plan.report()
    if (model, depth) in OTHER_BUFFERS:
        assert layers(back) != layers(net)                     # see OTHER_BUFFERS
    else:
        assert layers(back) == layers(net)
        assert str(e2.schedule) == str(e1.schedule)
    assert l1 == l2
    for k in s1:
        np.testing.assert_array_equal(s1[k], s2[k], err_msg=k)


@pytest.mark.parametrize("which", list(GRAPHS))
def test_a_graph_of_the_new_ops_round_trips_through_onnx(tmp_path, which):
    """Post-activation blocks, dense blocks, inverted residuals, convs with bias: exported by lowmem
    and read back, the same layers and buffers, parameters, plan, schedule, and training step."""
    rng = np.random.default_rng(4)
    net = random_graph(which, rng)
    back = nn.from_onnx(onnx_export.export_onnx(net, tmp_path / "m.onnx", input_shape=(3, 8, 8)))
    assert layers(back) == layers(net)
    a, b = net.state_dict(), back.state_dict()
    assert list(a) == list(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    labels = rng.integers(0, 4, 4)
    e1, l1, s1 = step(net, (3, 8, 8), x, labels)
    e2, l2, s2 = step(back, (3, 8, 8), x, labels)
    assert e2.plan.report() == e1.plan.report()
    assert str(e2.schedule) == str(e1.schedule)
    assert l1 == l2
    for k in s1:
        np.testing.assert_array_equal(s1[k], s2[k], err_msg=k)


@pytest.mark.parametrize("opset", [onnx_export.MIN_OPSET, 10, 11, 12, onnx_export.OPSET, onnx_export.max_opset()])
def test_relu6_and_dropout_round_trip_at_every_opset(tmp_path, opset):
    """Clip has attribute bounds before opset 11 and Dropout an attribute ratio before 12: at
    each opset the file passes onnx's checker, runs in onnxruntime with Engine.predict's logits
    (dropout is the identity in inference), and reads back as the same layers with the same p."""
    g = nn.Graph("drop6", (3, 8, 8), 4)
    x = g.relu6(g.bn(g.conv(g.input, 4, 3, name="c1"), name="b1"), name="r1")
    x = g.dropout(x, 0.2, name="d1")
    x = g.relu6(g.bn(g.conv(x, 6, 3, groups=2, name="c2"), name="b2"), name="r2")
    net = randomize_units(g.head(g.dropout(x, 0.5, name="d2")), np.random.default_rng(5))
    path = onnx_export.export_onnx(net, tmp_path / "m.onnx", input_shape=(3, 8, 8), opset=opset)
    back = nn.from_onnx(path)
    assert layers(back) == layers(net)
    assert [L.p for L in back.layers if L.op == "dropout"] == [0.2, 0.5]
    ort = pytest.importorskip("onnxruntime")
    x = np.random.default_rng(6).standard_normal((2, 3, 8, 8)).astype(np.float32)
    ref = Engine(net, 2, (3, 8, 8), mode="exact").predict(x)
    out = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    assert float(np.abs(out - ref).max()) <= 1e-5 * float(np.abs(ref).max())


def test_bn_then_relu_reads_back_as_one_unit(tmp_path):
    """g.bn then g.relu is written as BatchNormalization + Relu, the same nodes as a bn_relu unit,
    and read back as the unit: the same function, keeping one x-hat code instead of x-hat and a mask."""
    g = nn.Graph("split", (3, 8, 8), 4)
    net = g.head(g.relu(g.bn(g.conv(g.input, 6, 3, name="conv1"), name="bn1"), name="relu1"))
    back = nn.from_onnx(onnx_export.export_onnx(net, tmp_path / "m.onnx", input_shape=(3, 8, 8)))
    assert [L.op for L in net.layers[:3]] == ["conv", "bn", "relu"]
    assert [(L.op, L.name) for L in back.layers[:2]] == [("conv", "conv1"), ("bnrelu", "bn1")]
    assert list(back.state_dict()) == list(net.state_dict())


def test_a_classifier_keeps_its_own_name(tmp_path):
    """torchvision's DenseNet and MobileNetV2 call their last linear layer `classifier`."""
    g = nn.Graph("named-head", (3, 8, 8), 4)
    x = g.conv(g.input, 6, 3, name="features.0")
    net = g.head(g.bn_relu(x, name="features.1"), name="classifier")
    assert [p.name for p in net.parameters()][-2:] == ["classifier.weight", "classifier.bias"]
    back = nn.from_onnx(onnx_export.export_onnx(net, tmp_path / "m.onnx", input_shape=(3, 8, 8)))
    assert list(back.state_dict()) == list(net.state_dict())
    assert layers(back) == layers(net)


def test_symbolic_sizes_need_an_input_shape_and_a_given_one_must_match(tmp_path):
    net = models.build_model("preact-cifar", 8, num_classes=3)
    free = onnx_export.export_onnx(net, tmp_path / "free.onnx")                       # H, W symbolic
    with pytest.raises(ExportError, match=r"input height and width are symbolic; give input_shape"):
        nn.from_onnx(free)
    assert layers(nn.from_onnx(free, input_shape=(3, 16, 16))) == layers(net)
    fixed = onnx_export.export_onnx(net, tmp_path / "fixed.onnx", input_shape=(3, 16, 16))
    with pytest.raises(ExportError, match=r"input shape 3x28x28 does not match the model's input 3x16x16"):
        nn.from_onnx(fixed, input_shape=(3, 28, 28))
    with pytest.raises(ExportError, match=r"input shape 1x16x16 does not match"):
        nn.from_onnx(free, input_shape=(1, 16, 16))


def test_unreadable_files_are_one_clear_line(tmp_path):
    net = models.build_model("preact-cifar", 8, num_classes=3)
    good = onnx_export.export_onnx(net, tmp_path / "m.onnx", input_shape=(3, 16, 16))
    data = open(good, "rb").read()
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(data[:len(data) // 2])
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"this is not a protobuf\x00\xff" * 10)
    for path, what in ((tmp_path / "none.onnx", "no such file"), (cut, "not a readable ONNX model"),
                       (junk, "not a readable ONNX model")):
        with pytest.raises(ExportError) as e:
            nn.from_onnx(path)
        assert what in str(e.value) and str(path) in str(e.value)
        assert "\n" not in str(e.value)


def edited(tmp_path, net, edit):
    """net exported, its ModelProto changed by edit(model), saved unchecked."""
    model = onnx_export.onnx_model(net, input_shape=(3, 16, 16))
    edit(model)
    path = tmp_path / "edited.onnx"
    onnx.save(model, path)
    return path


def test_an_unsupported_node_is_named_with_its_op_and_the_supported_ops(tmp_path):
    from onnx import helper
    net = models.build_model("preact-cifar", 8, num_classes=3)

    def insert_sigmoid(model):
        g = model.graph
        first = g.node[0]
        out = first.output[0]
        first.output[0] = "pre"
        g.node.insert(1, helper.make_node("Sigmoid", ["pre"], [out], name="gate"))
    with pytest.raises(ExportError) as e:
        nn.from_onnx(edited(tmp_path, net, insert_sigmoid))
    msg = str(e.value)
    assert "node 'gate': op Sigmoid is not supported; supported ops: " in msg
    for op in ("Conv", "BatchNormalization", "Add", "MaxPool", "GlobalAveragePool"):
        assert op in msg
    assert "\n" not in msg


def test_unsupported_attributes_are_named(tmp_path):
    from onnx import helper
    net = models.build_model("preact-cifar", 8, num_classes=3)

    def dilate(model):
        conv = model.graph.node[0]
        conv.attribute.append(helper.make_attribute("dilations", [2, 2]))
    with pytest.raises(ExportError, match=r"node 'conv1' \(Conv\): unsupported dilations \[2, 2\]"):
        nn.from_onnx(edited(tmp_path, net, dilate))

    def softmax_after(model):
        g = model.graph
        g.node[-1].output[0] = "raw"
        g.node.append(helper.make_node("Softmax", ["raw"], ["logits"], name="sm"))
    with pytest.raises(ExportError, match=r"is not a Gemm with constant weights"):
        nn.from_onnx(edited(tmp_path, net, softmax_after))


@pytest.mark.parametrize("attr,value,words", [
    ("momentum", 0.99, r"batch norm momentum 0.99 \(PyTorch's 0.01\); lowmem's is PyTorch's default 0.1"),
    ("epsilon", 1e-3, r"batch norm epsilon 0.001; lowmem's is 1e-05")])
def test_batch_norm_settings_lowmem_does_not_have_are_named(tmp_path, attr, value, words):
    from onnx import helper
    net = models.build_model("preact-cifar", 8, num_classes=3)

    def change(model):
        node = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
        kept = [a for a in node.attribute if a.name != attr]
        del node.attribute[:]
        node.attribute.extend(kept + [helper.make_attribute(attr, value)])
    with pytest.raises(ExportError, match=r"node 'layer1.0.bn1.bn': " + words):
        nn.from_onnx(edited(tmp_path, net, change))


def test_weights_that_do_not_fit_name_the_node(tmp_path):
    net = models.build_model("preact-cifar", 8, num_classes=3)

    def wrong_channels(model):
        w = next(t for t in model.graph.initializer if t.name == "layer1.0.conv1.weight")
        a = onnx.numpy_helper.to_array(w)
        w.CopyFrom(onnx.numpy_helper.from_array(np.ascontiguousarray(a[:, :8]), w.name))
    with pytest.raises(ExportError, match=r"node 'layer1.0.conv1' \(Conv\): weight \(16, 8, 3, 3\) with "
                                          r"group=1 does not fit its input's 16 channels"):
        nn.from_onnx(edited(tmp_path, net, wrong_channels))


# ---- lowmem train / plan --model PATH.onnx --------------------------------------------------

def cli_run(capsys, *argv):
    from lowmem.tools import cli
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


TRAIN = ["train", "--dataset", "synthetic", "--limit-train", "32", "--limit-test", "8",
         "--batch", "16", "--epochs", "1", "--no-progress"]


def test_train_and_plan_take_an_onnx_file(tmp_path, capsys):
    net = models.build_model("preact-cifar", 8, num_classes=10)
    free = onnx_export.export_onnx(net, tmp_path / "free.onnx")              # H, W symbolic: the data's
    rc, out, err = cli_run(capsys, *TRAIN, "--model", free, "--out", tmp_path / "run")
    assert rc == 0, err
    assert net.name in out and "final test accuracy" in out
    rc, out, err = cli_run(capsys, "export", tmp_path / "run", tmp_path / "again.onnx")   # the run's weights out
    assert rc == 0, err
    again = nn.from_onnx(tmp_path / "again.onnx", input_shape=(3, 32, 32))
    assert layers(again) == layers(nn.from_onnx(free, input_shape=(3, 32, 32)))
    pytest.importorskip("safetensors")
    from lowmem.tools import predict
    rc, out, err = cli_run(capsys, "export", tmp_path / "run", tmp_path / "again.safetensors")
    assert rc == 0, err
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    from_run, _ = predict.load(tmp_path / "run")
    from_file, info = predict.load(tmp_path / "again.safetensors")      # rebuilt from the .onnx it names
    np.testing.assert_array_equal(from_file(x), from_run(x))
    rc, out, err = cli_run(capsys, "plan", "--model", free, "--input", "3x32x32", "--batch", "8")
    assert rc == 0, err
    assert net.name in out


def test_train_with_an_onnx_file_that_does_not_fit_the_data_is_one_line(tmp_path, capsys):
    net = models.build_model("preact-cifar", 8, num_classes=10)
    fixed = onnx_export.export_onnx(net, tmp_path / "fixed.onnx", input_shape=(3, 16, 16))
    rc, _, err = cli_run(capsys, *TRAIN, "--model", fixed, "--out", tmp_path / "a")
    assert rc != 0 and "input shape 3x32x32 does not match the model's input 3x16x16" in err
    assert err.count("\n") == 1 and not (tmp_path / "a" / "checkpoint.ckpt").exists()
    five = onnx_export.export_onnx(models.build_model("preact-cifar", 8, num_classes=5), tmp_path / "five.onnx")
    rc, _, err = cli_run(capsys, *TRAIN, "--model", five, "--out", tmp_path / "b")
    assert rc != 0 and "the model has 5 classes (its classifier fc), the data 10" in err
    assert err.count("\n") == 1
    rc, _, err = cli_run(capsys, *TRAIN, "--model", tmp_path / "none.onnx", "--out", tmp_path / "c")
    assert rc != 0 and "none.onnx: no such file" in err and err.count("\n") == 1
    rc, _, err = cli_run(capsys, "plan", "--model", five)                  # symbolic sizes, no --input
    assert rc != 0 and "input height and width are symbolic" in err and err.count("\n") == 1
