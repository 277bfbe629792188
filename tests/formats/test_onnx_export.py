"""lowmem/formats/onnx_export.py: the inference graph as an ONNX file.

* onnxruntime's logits equal Engine.predict's (eval mode, non-trivial BN running statistics, some
  negative gammas) within 1e-5 of the logit scale, float32, for the ResNets, a WideResNet, VGG-BN
  (max-pools) and the ImageNet stem; symbolic and fixed input sizes; the graph states opset 17;
  every supported opset runs.
* Names: what the builder refuses because the graph uses it, and a hand-built network whose
  layer names clash with the graph's is refused by the export.
"""
import numpy as np
import pytest

from lowmem import models
from lowmem.core.engine import Engine
from lowmem.formats import onnx_export
from lowmem.formats.common import ExportError
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
    path = onnx_export.export_onnx(net, tmp_path / "m.onnx")
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
    model = onnx.load(str(onnx_export.export_onnx(net, tmp_path / "m.onnx", input_shape=(3, 16, 16))))
    assert [o.version for o in model.opset_import if o.domain == ""] == [onnx_export.OPSET] == [17]
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
    free = ort.InferenceSession(onnx_export.onnx_model(net).SerializeToString(), providers=["CPUExecutionProvider"])
    for shape, n in (((3, 16, 16), 3), ((3, 24, 20), 1)):
        x = images(shape, n)
        ref = Engine(net, n, shape).predict(x)
        np.testing.assert_allclose(free.run(None, {"input": x})[0], ref, atol=1e-5 * float(np.abs(ref).max()))


def test_onnx_bad_input_shape():
    pytest.importorskip("onnx")
    with pytest.raises(ExportError, match="C = 3"):
        onnx_export.onnx_model(models.preact_resnet_cifar(8), input_shape=(1, 32, 32))


def test_every_supported_opset_runs_in_onnxruntime():
    ort = pytest.importorskip("onnxruntime")
    net = trained_looking(lambda: models.vgg_bn(11, num_classes=10))
    x = images((3, 32, 32))
    ref = Engine(net, 4, (3, 32, 32)).predict(x)
    for opset in (onnx_export.MIN_OPSET, onnx_export.OPSET, onnx_export.max_opset()):
        model = onnx_export.onnx_model(net, opset=opset)
        out = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"input": x})[0]
        assert float(np.abs(out - ref).max()) <= 1e-5 * float(np.abs(ref).max()), opset
    for bad in (onnx_export.MIN_OPSET - 1, onnx_export.max_opset() + 1, -1, 17.0, True):
        with pytest.raises(ExportError, match="opset .* is not supported"):
            onnx_export.onnx_model(net, opset=bad)


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
    with pytest.raises(ExportError, match="layer names clash .*'logits'"):
        onnx_export.onnx_model(net)
