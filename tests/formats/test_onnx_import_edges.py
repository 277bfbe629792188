"""`lowmem train / plan / predict` and nn.from_onnx given ONNX files a careful user can get wrong:
each refused in one line naming the file and the problem, nothing written into the run folder;
a run trained from an ONNX model exports and predicts."""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import helper, numpy_helper  # noqa: E402

from lowmem import models, nn  # noqa: E402
from lowmem.formats import onnx_export  # noqa: E402
from lowmem.tools import cli  # noqa: E402
from lowmem.formats.common import ExportError  # noqa: E402

TRAIN = ["train", "--dataset", "synthetic", "--limit-train", "32", "--limit-test", "8",
         "--batch", "16", "--epochs", "1", "--no-progress"]


def cli_run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


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


def set_value(name, where, value):
    def edit(model):
        t = next(t for t in model.graph.initializer if t.name == name)
        a = numpy_helper.to_array(t).copy()
        a.flat[where] = value
        t.CopyFrom(numpy_helper.from_array(a, t.name))
    return edit


def bad_files(tmp_path, free):
    """(path, words of the one-line error) for files that are not usable models."""
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    folder = tmp_path / "folder.onnx"
    folder.mkdir()
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(open(free, "rb").read()[:3000])

    def newer_opset(model):
        model.opset_import[0].version = 99

    def two_outputs(model):
        model.graph.output.append(helper.make_tensor_value_info(
            model.graph.node[0].output[0], onnx.TensorProto.FLOAT, ["N", 16, "H", "W"]))

    def two_inputs(model):
        model.graph.input.append(helper.make_tensor_value_info("extra", onnx.TensorProto.FLOAT, [1, 3]))
    return [
        (empty, "empty file (0 bytes)"),
        (folder, "is a directory, not a model file"),
        (cut, "not a readable ONNX model"),
        (edited(tmp_path, free, newer_opset, "opset99.onnx"),
         f"written for ONNX opset 99, newer than the installed onnx {onnx.__version__} knows"),
        (edited(tmp_path, free, set_value("layer1.0.conv1.weight", 3, np.nan), "nan.onnx"),
         "initializer 'layer1.0.conv1.weight' (16, 16, 3, 3) holds 1 NaN or inf value(s)"),
        (edited(tmp_path, free, set_value("layer1.0.bn1.running_var", 0, np.inf), "inf.onnx"),
         "initializer 'layer1.0.bn1.running_var' (16,) holds 1 NaN or inf value(s)"),
        (edited(tmp_path, free, set_value("fc.bias", 1, -np.inf), "inf_bias.onnx"),
         "initializer 'fc.bias' (10,) holds 1 NaN or inf value(s)"),
        (edited(tmp_path, free, two_outputs, "two_outputs.onnx"),
         "expected one graph output (the logits), found ['logits', 'conv1']"),
        (edited(tmp_path, free, two_inputs, "two_inputs.onnx"),
         "expected one graph input (the image batch), found 2: ['input', 'extra']"),
    ]


def test_unusable_files_are_refused_by_from_onnx_train_and_plan(tmp_path, free, capsys):
    for path, words in bad_files(tmp_path, free):
        with pytest.raises(ExportError) as e:
            nn.from_onnx(path, input_shape=(3, 32, 32))
        assert words in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
        run = tmp_path / f"run-{path.stem}"
        rc, _, err = cli_run(capsys, *TRAIN, "--model", path, "--out", run)
        assert rc != 0 and words in err and err.count("\n") == 1, err
        assert not (run / "checkpoint.ckpt").exists()
        rc, _, err = cli_run(capsys, "plan", "--model", path, "--input", "3x32x32", "--batch", "4")
        assert rc != 0 and words in err and err.count("\n") == 1, err


def test_predict_names_an_empty_file_a_directory_and_nan_weights(tmp_path, free, capsys):
    img = tmp_path / "a.png"
    from PIL import Image
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(img)
    bad = dict((p.name, p) for p, _ in bad_files(tmp_path, free))
    for name, words in (("empty.onnx", "empty file (0 bytes)"), ("cut.onnx", "not a readable ONNX"),
                        ("folder.onnx", "no model here (a run folder, checkpoint, .safetensors or .onnx)")):
        rc, _, err = cli_run(capsys, "predict", bad[name], img)
        assert rc != 0 and words in err and err.count("\n") == 1, err
    pytest.importorskip("onnxruntime")
    rc, _, err = cli_run(capsys, *TRAIN, "--model", free, "--out", tmp_path / "run")
    assert rc == 0, err
    rc, _, err = cli_run(capsys, "export", tmp_path / "run", tmp_path / "good.onnx")
    assert rc == 0, err
    nan = edited(tmp_path, tmp_path / "good.onnx", set_value("layer1.0.conv1.weight", slice(None), np.nan))
    rc, out, err = cli_run(capsys, "predict", nan, img)
    assert rc != 0 and out == "" and "gives non-finite logits" in err and err.count("\n") == 1, err


def test_an_unsupported_op_is_named_with_its_node(tmp_path, free, capsys):
    def insert_sigmoid(model):
        g = model.graph
        first = g.node[0]
        out = first.output[0]
        first.output[0] = "pre"
        g.node.insert(1, helper.make_node("Sigmoid", ["pre"], [out], name="gate"))
    path = edited(tmp_path, free, insert_sigmoid)
    rc, _, err = cli_run(capsys, *TRAIN, "--model", path, "--out", tmp_path / "run")
    assert rc != 0 and "node 'gate': op Sigmoid is not supported; supported ops: " in err
    assert err.count("\n") == 1


def test_a_three_channel_model_on_one_channel_fashion_mnist_is_one_line(tmp_path, free, capsys):
    from lowmem.data import datasets
    try:
        datasets.load_fashion_mnist(limit_train=16, limit_test=8)
    except Exception as e:                              # the Debian package is optional
        pytest.skip(f"Fashion-MNIST files not installed ({e})")
    fixed = onnx_export.export_onnx(models.build_model("preact-cifar", 8, num_classes=10), tmp_path / "fixed.onnx",
                               input_shape=(3, 32, 32))
    base = [a if a != "synthetic" else "fashion-mnist" for a in TRAIN]
    for path, data, words in ((free, [], "input shape 1x32x32 does not match the model's input 3x?x?"),
                              (fixed, [], "input shape 1x32x32 does not match the model's input 3x32x32"),
                              (fixed, ["--pad-to", "0"],
                               "input shape 1x28x28 does not match the model's input 3x32x32")):
        run = tmp_path / f"run-{len(data)}-{path.stem}"
        rc, _, err = cli_run(capsys, *base, *data, "--no-download", "--model", path, "--out", run)
        assert rc != 0 and words in err and err.count("\n") == 1, err
        assert not (run / "checkpoint.ckpt").exists()


def test_a_model_whose_sizes_do_not_fit_the_data_is_one_line(tmp_path, capsys):
    net = models.build_model("preact-cifar", 8, num_classes=10)
    small = onnx_export.export_onnx(net, tmp_path / "small.onnx", input_shape=(3, 8, 8))
    rc, _, err = cli_run(capsys, *TRAIN, "--model", small, "--out", tmp_path / "run")
    assert rc != 0 and "input shape 3x32x32 does not match the model's input 3x8x8" in err
    assert err.count("\n") == 1
    free = onnx_export.export_onnx(models.build_model("densenet", 121, num_classes=10), tmp_path / "dense.onnx")
    with pytest.raises(ExportError, match=r"dense.onnx: 'features.transition1.pool': input \(128, 1, 1\) is "
                                          r"too small, the output would be \(128, 0, 0\) \(input_shape "
                                          r"\(3, 4, 4\)\)"):
        nn.from_onnx(free, input_shape=(3, 4, 4))


def test_a_run_trained_from_onnx_exports_and_predicts(tmp_path, free, capsys):
    pytest.importorskip("onnxruntime")
    from PIL import Image
    from lowmem.tools import predict
    rc, _, err = cli_run(capsys, *TRAIN, "--model", free, "--out", tmp_path / "run")
    assert rc == 0, err
    rc, _, err = cli_run(capsys, "export", tmp_path / "run", tmp_path / "out.onnx")
    assert rc == 0, err
    rng = np.random.default_rng(0)
    imgs = []
    for i, size in enumerate((32, 40)):                 # predict resizes to the stored input
        imgs.append(tmp_path / f"im{i}.png")
        Image.fromarray((rng.random((size, size, 3)) * 255).astype(np.uint8)).save(imgs[-1])
    rc, out_onnx, err = cli_run(capsys, "predict", tmp_path / "out.onnx", *imgs)
    assert rc == 0, err
    rc, out_run, err = cli_run(capsys, "predict", tmp_path / "run", *imgs)
    assert rc == 0, err
    labels = lambda out: [line.rsplit(" (", 1)[0] for line in out.strip().splitlines()]  # noqa: E731
    assert labels(out_onnx) == labels(out_run) and len(labels(out_run)) == 2
    logits_file, _ = predict.load(tmp_path / "out.onnx")
    logits_run, _ = predict.load(tmp_path / "run")
    x = rng.standard_normal((2, 3, 32, 32)).astype(np.float32)
    np.testing.assert_allclose(logits_file(x), logits_run(x), rtol=1e-4, atol=1e-5)


def test_a_graph_the_builder_refuses_is_an_export_error_naming_the_file(tmp_path, free, capsys):
    """A graph name of spaces is an exporter's default (the file's name is used); an input
    dimension of 0 is refused as the file's, an ExportError naming it, not a NetworkError."""
    def spaces(model):
        model.graph.name = "   "
    net = nn.from_onnx(edited(tmp_path, free, spaces, "spaced.onnx"), input_shape=(3, 32, 32))
    assert net.name == "spaced"

    def zero_height(model):
        dims = model.graph.input[0].type.tensor_type.shape.dim
        dims[2].dim_value = 0
        dims[3].dim_value = 32
    path = edited(tmp_path, free, zero_height, "zero.onnx")
    with pytest.raises(ExportError, match=f"{path}: the graph input 'input' has a dimension of 0"):
        nn.from_onnx(path)
    rc, out, err = cli_run(capsys, "plan", "--model", path)
    assert rc == 2 and err == f"lowmem plan: error: {path}: the graph input 'input' has a dimension of 0; " \
                              f"an image batch (N, C, H, W) needs C, H, W >= 1\n", err


def test_a_graph_or_layer_name_with_a_control_character_is_refused_in_one_line(tmp_path, free, capsys):
    """A name stands in one-line messages and logs: a newline in the graph's name or in a weight's
    (a layer's) name is refused as the file's, in one line."""
    def newline(model):
        model.graph.name = "a\nb"
    path = edited(tmp_path, free, newline, "newline.onnx")
    with pytest.raises(ExportError, match="network's name must be printable"):
        nn.from_onnx(path, input_shape=(3, 32, 32))
    rc, out, err = cli_run(capsys, "plan", "--model", path, "--input", "3x32x32")
    assert rc == 2 and err.count("\n") == 1 and str(path) in err and "printable" in err, err
    g = nn.Graph("g", (3, 8, 8), 10)
    with pytest.raises(nn.NetworkError, match="layer name must be printable"):
        g.conv(g.input, 4, 3, name="c\x1b[2J")


def pooled_graph():
    """conv, BN-ReLU, a 2x2 max-pool, conv, BN-ReLU, head: 10 classes (a pool to swap in the file)."""
    g = nn.Graph("pooled", (3, 32, 32), 10, seed=4)
    x = g.max_pool(g.bn_relu(g.conv(g.input, 4, 3, name="c1"), name="b1"), 2, name="pool1")
    return g.head(g.bn_relu(g.conv(x, 8, 3, name="c2"), name="b2"))


def test_a_run_trained_from_onnx_keeps_its_own_architecture(tmp_path, capsys, monkeypatch):
    """The run does not depend on the .onnx file after it started: with the file edited (its
    MaxPool now an AveragePool) or gone, and from another folder, predict gives the same
    logits from the run and from its exported .safetensors, export writes the same network, and
    --resume trains the network the run began with."""
    from lowmem.tools import predict
    pytest.importorskip("safetensors")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    model = onnx_export.export_onnx(pooled_graph(), tmp_path / "models" / "net.onnx")
    rc, _, err = cli_run(capsys, *TRAIN, "--model", "models/net.onnx", "--out", "run")     # as typed: relative
    assert rc == 0, err
    rc, _, err = cli_run(capsys, "export", "run", "net.safetensors")
    assert rc == 0, err
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    before = {m: predict.load(m)[0](x) for m in ("run", "net.safetensors")}

    swapped = onnx.load(model)
    next(n for n in swapped.graph.node if n.op_type == "MaxPool").op_type = "AveragePool"
    onnx.save(swapped, model)
    assert [L.op for L in nn.from_onnx(model, input_shape=(3, 32, 32)).layers].count("avgpool2d") == 1
    for m, want in before.items():
        np.testing.assert_array_equal(predict.load(m)[0](x), want)
    rc, _, err = cli_run(capsys, "export", "run", "again.safetensors")
    assert rc == 0, err
    np.testing.assert_array_equal(predict.load("again.safetensors")[0](x), before["run"])
    rc, out, err = cli_run(capsys, *TRAIN[:-3], "--epochs", "2", "--no-progress", "--out", "run", "--resume")
    assert rc == 0, err
    assert "maxpool" in (tmp_path / "run" / "plan.txt").read_text()
    assert "avgpool2d" not in (tmp_path / "run" / "plan.txt").read_text()

    model.unlink()                                       # the file gone, another folder
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    np.testing.assert_array_equal(predict.load(tmp_path / "net.safetensors")[0](x), before["net.safetensors"])
    logits, _ = predict.load(tmp_path / "run")
    assert logits(x).shape == (2, 10)
    rc, _, err = cli_run(capsys, "export", tmp_path / "run", tmp_path / "out.onnx")
    assert rc == 0, err
