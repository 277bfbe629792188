"""lowmem.tools.export: safetensors and ONNX files, and the `lowmem export` subcommand (lowmem.tools.commands.export).

* ONNX: onnxruntime's logits equal Engine.predict's (eval mode, non-trivial BN
  running statistics, some negative gammas) within 1e-5 of the logit scale,
  float32, for the ResNets, a WideResNet, VGG-BN (max-pools) and the ImageNet
  stem; symbolic and fixed input sizes; the graph states opset 17.
* safetensors: the file loads with safetensors.numpy (every name, bit-exact
  float32), into the PyTorch reference model with strict key checking and the
  same eval logits, and back into a fresh Network (load_safetensors).
* Writes are atomic; bad files and bad names get clear errors.
* add_arguments / run on a real (tiny) training run folder.
"""
import argparse
import os

import numpy as np
import pytest

from lowmem.tools import export
from lowmem.tools.commands import export as export_command
from lowmem import models
from lowmem.core.engine import Engine
from reference import randomize_units

NETS = {
    "resnet20": (lambda: models.preact_resnet_cifar(20, num_classes=10), (3, 32, 32)),
    "bottleneck29": (lambda: models.preact_resnet_cifar(29, num_classes=10, block="bottleneck"), (3, 16, 16)),
    "imagenet18": (lambda: models.preact_resnet_imagenet(18, num_classes=7), (3, 64, 64)),
    "wrn-10-2": (lambda: models.wide_resnet(10, 2, num_classes=10), (3, 16, 16)),
    "vgg11-bn": (lambda: models.vgg_bn(11, num_classes=10), (3, 32, 32)),
}


def trained_looking(build, seed=0):
    """A network with non-trivial BN parameters and running statistics (as after training)."""
    net = build()
    randomize_units(net, np.random.default_rng(seed))
    return net


def images(shape, n=4, seed=1):
    return np.random.default_rng(seed).standard_normal((n,) + shape).astype(np.float32)


# ----------------------------------------------------------------------- ONNX

@pytest.mark.parametrize("which", list(NETS))
def test_onnx_runtime_gives_predict_logits(tmp_path, which):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    build, shape = NETS[which]
    net = trained_looking(build)
    path = export.export_onnx(net, tmp_path / "m.onnx")
    x = images(shape)
    logits = Engine(net, len(x), shape, mode="exact").predict(x)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = sess.run(["logits"], {"input": x})
    assert out.shape == logits.shape and out.dtype == np.float32
    scale = float(np.abs(logits).max())
    assert float(np.abs(out - logits).max()) <= 1e-5 * scale, (np.abs(out - logits).max(), scale)


def test_onnx_graph_opset_nodes_and_shapes(tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    net = trained_looking(lambda: models.preact_resnet_cifar(8))
    model = onnx.load(str(export.export_onnx(net, tmp_path / "m.onnx", input_shape=(3, 16, 16))))
    assert [o.version for o in model.opset_import if o.domain == ""] == [export.OPSET] == [17]
    ops = [n.op_type for n in model.graph.node]
    units = sum(1 for L in net.layers if L.op == "bnrelu")
    assert ops.count("BatchNormalization") == ops.count("Relu") == units
    assert ops.count("Conv") == sum(1 for L in net.layers if L.op == "conv")
    assert ops[-3:] == ["GlobalAveragePool", "Flatten", "Gemm"]
    assert {i.name for i in model.graph.initializer} == set(net.state_dict())
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and [d.dim_value for d in dims[1:]] == [3, 16, 16]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception):                       # the fixed size is enforced
        sess.run(None, {"input": images((3, 32, 32))})
    # the default graph takes any size and batch
    free = ort.InferenceSession(export.onnx_model(net).SerializeToString(), providers=["CPUExecutionProvider"])
    for shape, n in (((3, 16, 16), 3), ((3, 24, 20), 1)):
        x = images(shape, n)
        ref = Engine(net, n, shape).predict(x)
        np.testing.assert_allclose(free.run(None, {"input": x})[0], ref, atol=1e-5 * float(np.abs(ref).max()))


def test_onnx_bad_input_shape():
    pytest.importorskip("onnx")
    with pytest.raises(export.ExportError, match="C = 3"):
        export.onnx_model(models.preact_resnet_cifar(8), input_shape=(1, 32, 32))


# ---------------------------------------------------------------- safetensors

def test_safetensors_file_loads_with_safetensors_numpy(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    net = trained_looking(lambda: models.preact_resnet_cifar(20))
    path = export.export_safetensors(net, tmp_path / "m.safetensors")
    got = st.load_file(str(path))
    state = net.state_dict()
    assert set(got) == set(state)
    for k, v in state.items():
        assert got[k].dtype == np.float32 and got[k].shape == v.shape
        np.testing.assert_array_equal(got[k], v)
    with open(path, "rb") as f:                          # metadata names the network
        assert b'"network":"preact-resnet20-cifar"' in f.read(4096)


def test_safetensors_round_trip_into_a_fresh_network(tmp_path):
    pytest.importorskip("safetensors")
    net = trained_looking(lambda: models.wide_resnet(10, 2))
    path = export.export_safetensors(net, tmp_path / "m.safetensors")
    fresh = models.wide_resnet(10, 2, seed=5)
    assert not np.array_equal(fresh.params["conv1.weight"].data, net.params["conv1.weight"].data)
    export.load_safetensors(fresh, path)
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(fresh.state_dict()[k], v)
    x = images((3, 16, 16))
    np.testing.assert_array_equal(Engine(fresh, 4, (3, 16, 16)).predict(x), Engine(net, 4, (3, 16, 16)).predict(x))


def test_safetensors_into_a_float64_network_and_engine_owned_parameters(tmp_path):
    """Loading casts to the network's dtype and writes into the engine's arrays in place."""
    pytest.importorskip("safetensors")
    net = trained_looking(lambda: models.preact_resnet_cifar(8))
    path = export.export_safetensors(net, tmp_path / "m.safetensors")
    other = models.preact_resnet_cifar(8, seed=3)
    eng = Engine(other, 2, (3, 8, 8), dtype="float64")
    export.load_safetensors(other, path)
    assert other.params["conv1.weight"].data is eng.arrays["conv1.weight"]
    np.testing.assert_array_equal(other.params["conv1.weight"].data, net.params["conv1.weight"].data)


def test_safetensors_loads_into_the_pytorch_reference_strictly(tmp_path):
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    import torch_reference as ref
    for build, make, shape in ((lambda: models.preact_resnet_cifar(20), lambda: ref.preact_resnet_cifar(20), (3, 32, 32)),
                               (lambda: models.preact_resnet_imagenet(18, num_classes=7),
                                lambda: ref.preact_resnet_imagenet(18, num_classes=7), (3, 64, 64))):
        net = trained_looking(build)
        path = export.export_safetensors(net, tmp_path / "m.safetensors")
        model = make()
        result = model.load_state_dict(st_torch.load_file(str(path)), strict=True)
        assert not result.missing_keys and not result.unexpected_keys
        x = images(shape)
        with torch.no_grad():
            tl = model.eval()(torch.from_numpy(x)).numpy()
        ours = Engine(net, 4, shape).predict(x)
        assert float(np.abs(tl - ours).max()) <= 1e-4 * float(np.abs(ours).max())


def test_safetensors_errors_name_the_file_and_the_mismatch(tmp_path):
    pytest.importorskip("safetensors")
    net = models.preact_resnet_cifar(8)
    with pytest.raises(export.ExportError, match="no such file"):
        export.load_safetensors(net, tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    with pytest.raises(export.ExportError, match="bad.safetensors.*not a readable safetensors"):
        export.load_safetensors(net, bad)
    other = tmp_path / "other.safetensors"
    export.export_safetensors(models.preact_resnet_cifar(20), other)
    with pytest.raises(export.ExportError, match="other.safetensors.*missing|unexpected"):
        export.load_safetensors(net, other)


# ------------------------------------------------------------------ atomicity

def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    path = tmp_path / "m.safetensors"
    export.export_safetensors(models.preact_resnet_cifar(8), path)
    before = path.read_bytes()

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        export.export_safetensors(models.preact_resnet_cifar(8, seed=1), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.safetensors"]


# --------------------------------------------------------- `lowmem export` pair

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real tiny training run (synthetic data, ResNet-8, one epoch) with its checkpoint."""
    from lowmem.train.config import TrainConfig
    from lowmem.train.trainer import Trainer
    out = tmp_path_factory.mktemp("run")
    cfg = TrainConfig(dataset="synthetic", model="preact-cifar", depth=8, batch=16, epochs=1,
                      limit_train=32, limit_test=16, out=str(out), progress=False)
    Trainer(cfg, log=lambda *a: None).fit()
    return out


def parse(*argv):
    return export_command.add_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_export_command_writes_both_formats(run_dir, tmp_path, capsys):
    pytest.importorskip("safetensors")
    ort = pytest.importorskip("onnxruntime")
    from lowmem.train.trainer import load_model_state
    net = models.preact_resnet_cifar(8)
    load_model_state(os.path.join(run_dir, "checkpoint.ckpt"), net)
    assert export_command.run(parse(str(run_dir), str(tmp_path / "m.safetensors"))) == 0
    assert "preact-resnet8-cifar" in capsys.readouterr().out
    assert set(export.read_safetensors(tmp_path / "m.safetensors")) == set(net.state_dict())
    assert export_command.run(parse(str(run_dir / "checkpoint.ckpt"), str(tmp_path / "m.onnx"), "--input", "3x32x32")) == 0
    assert "opset 17" in capsys.readouterr().out
    x = images((3, 32, 32))
    out = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    ref = Engine(net, 4, (3, 32, 32)).predict(x)
    assert float(np.abs(out - ref).max()) <= 1e-5 * float(np.abs(ref).max())


def test_export_command_errors(run_dir, tmp_path, capsys):
    assert export_command.run(parse(str(run_dir), str(tmp_path / "m.pt"))) == 2      # a bad command line
    assert "must end in .safetensors or .onnx" in capsys.readouterr().err
    assert export_command.run(parse(str(tmp_path), str(tmp_path / "m.onnx"))) == 1
    assert "no checkpoint here" in capsys.readouterr().err
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes(b"garbage")
    assert export_command.run(parse(str(broken), str(tmp_path / "m.onnx"))) == 1
    assert "broken.ckpt" in capsys.readouterr().err
    assert not (tmp_path / "m.onnx").exists()


def test_a_missing_extra_names_the_pip_install(run_dir, tmp_path, monkeypatch, capsys):
    import sys
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(ImportError, match=r"pip install 'lowmem\[safetensors\]'"):
        export.export_safetensors(models.preact_resnet_cifar(8), tmp_path / "m.safetensors")
    assert export_command.run(parse(str(run_dir), str(tmp_path / "m.onnx"))) == 2
    assert "lowmem[onnx]" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


# ------------------------------------------------- bad opsets, configs and names

@pytest.mark.parametrize("opset", ["5", "-1", "99", "6", "seven"])
def test_unsupported_opsets_are_refused_on_the_command_line(run_dir, tmp_path, capsys, opset):
    from lowmem.tools.cli import main
    pytest.importorskip("onnx")
    rc = main(["export", str(run_dir), str(tmp_path / "m.onnx"), "--opset", opset])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("lowmem export: error: argument --opset")
    assert opset == "seven" or f"expected {export.MIN_OPSET}..{export.max_opset()}" in last
    assert not (tmp_path / "m.onnx").exists()


def test_every_supported_opset_runs_in_onnxruntime():
    ort = pytest.importorskip("onnxruntime")
    net = trained_looking(lambda: models.vgg_bn(11, num_classes=10))
    x = images((3, 32, 32))
    ref = Engine(net, 4, (3, 32, 32)).predict(x)
    for opset in (export.MIN_OPSET, export.OPSET, export.max_opset()):
        model = export.onnx_model(net, opset=opset)
        out = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"input": x})[0]
        assert float(np.abs(out - ref).max()) <= 1e-5 * float(np.abs(ref).max()), opset
    for bad in (export.MIN_OPSET - 1, export.max_opset() + 1, -1, 17.0, True):
        with pytest.raises(export.ExportError, match="opset .* is not supported"):
            export.onnx_model(net, opset=bad)


def test_command_line_errors_carry_the_prefix_and_the_documented_code(run_dir, tmp_path, capsys):
    from lowmem.tools.cli import main
    assert main(["export", str(run_dir), str(tmp_path / "m.pt")]) == 2
    assert capsys.readouterr().err.strip() == (f"lowmem export: error: {tmp_path / 'm.pt'}: unknown format; "
                                               f"the output must end in .safetensors or .onnx")
    assert main(["export", str(tmp_path), str(tmp_path / "m.onnx")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("lowmem export: error: ") and "no checkpoint here" in err and "\n" not in err


def test_a_checkpoint_without_a_depth_is_a_clear_error(run_dir, tmp_path, capsys):
    from lowmem.train.checkpoint import load_checkpoint, save_checkpoint
    arrays, meta = load_checkpoint(os.path.join(run_dir, "checkpoint.ckpt"))
    del meta["config"]["depth"]
    save_checkpoint(tmp_path / "nodepth.ckpt", arrays, meta)
    assert export_command.run(parse(str(tmp_path / "nodepth.ckpt"), str(tmp_path / "m.safetensors"))) == 1
    err = capsys.readouterr().err
    assert "has no depth for model 'preact-cifar'" in err and "Traceback" not in err and "KeyError" not in err


@pytest.mark.parametrize("name", ["logits", "feat", "pool.out", "flatten", "fc.weight", "pool.x", "fc.y",
                                  "block.bias", "a.running_var", "conv1.weight"])
def test_builder_names_the_exports_use_are_refused(name):
    from lowmem.nn import Graph, NetworkError
    g = Graph("n", (3, 8, 8), 3)
    with pytest.raises(NetworkError, match=f"layer name {name!r}"):
        g.conv(g.input, 4, 3, name=name)


def test_a_unit_and_its_bn_value_cannot_share_a_name():
    from lowmem.nn import Graph, NetworkError
    g = Graph("n", (3, 8, 8), 3)
    h = g.bn_relu(g.conv(g.input, 4, 3, name="c"), name="u")
    with pytest.raises(NetworkError, match="'u.bn' clashes with the batch-norm value of bn_relu 'u'"):
        g.conv(h, 4, 3, name="u.bn")
    g = Graph("n", (3, 8, 8), 3)
    h = g.bn_relu(g.conv(g.input, 4, 3, name="x.bn"))
    with pytest.raises(NetworkError, match="clashes with the batch-norm value of bn_relu 'x'"):
        g.bn_relu(g.conv(h, 4, 3), name="x")
    g = Graph("n", (3, 8, 8), 3)                               # VGG-BN's names stay fine
    g.head(g.bn_relu(g.conv(g.input, 4, 3, name="features.0.0.conv"), name="features.0.0.bn"))


@pytest.mark.parametrize("name", [None, "", "  ", 3])
def test_a_graph_needs_a_name(name):
    from lowmem.nn import Graph, NetworkError
    with pytest.raises(NetworkError, match="the network's name must be a non-empty string"):
        Graph(name, (3, 8, 8), 3)


def test_a_hand_built_network_with_clashing_names_is_refused_by_the_onnx_export():
    pytest.importorskip("onnx")
    from lowmem.core.network import Network
    net = Network("hand", 3, 4)
    net.conv("logits", "input", "act0", 3, 8, 3)
    net.bnrelu("bn", "act0", "act0", 8)
    net.head("act0", 8)
    with pytest.raises(export.ExportError, match="layer names clash .*'logits'"):
        export.onnx_model(net)


def test_an_output_under_a_file_is_named_not_a_temporary(run_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for out in ("m.onnx", "m.safetensors"):
        code = export_command.run(parse(str(run_dir), str(tmp_path / "file" / out)))
        err = capsys.readouterr().err
        assert code == 1 and f"{tmp_path / 'file' / out}" in err and ".tmp-" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["file"]
