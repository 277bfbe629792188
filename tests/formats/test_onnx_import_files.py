"""What an .onnx file can make lowmem read: the file itself and nothing else.

ONNX lets any tensor (an initializer, a Constant node's value, any node attribute, a subgraph's
or a local function's tensors) name an external data file by a path relative to the model, which
onnx resolves against the current folder when the model was loaded from bytes. lowmem refuses
every such tensor before anything reads it, and no error message echoes a whole constant."""
import sys

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from lowmem import models, nn  # noqa: E402
from lowmem.formats.common import ExportError  # noqa: E402
from lowmem.formats import onnx_export  # noqa: E402
from lowmem.tools import cli  # noqa: E402

OPENED = []          # paths opened while a test watches (an audit hook cannot be removed: it is gated)
WATCHING = [False]


def _audit(event, args):
    if WATCHING[0] and event == "open" and args and isinstance(args[0], (str, bytes)):
        OPENED.append(str(args[0]))


sys.addaudithook(_audit)


@pytest.fixture
def watch():
    OPENED.clear()
    WATCHING[0] = True
    yield OPENED
    WATCHING[0] = False


@pytest.fixture(scope="module")
def free(tmp_path_factory):
    d = tmp_path_factory.mktemp("onnx")
    return onnx_export.export_onnx(models.build_model("preact-cifar", 8, num_classes=10), d / "free.onnx")


def external(name, location, dims=(), dtype=TensorProto.FLOAT):
    """A tensor whose data lies in `location`, relative to the current folder."""
    t = TensorProto(name=name, data_type=dtype, dims=list(dims))
    t.data_location = TensorProto.EXTERNAL
    e = t.external_data.add()
    e.key, e.value = "location", location
    return t


def clip_after_stem(model, bound):
    """conv1 -> Clip(0, bound) -> the rest: with a bound of 6 from the file, a ReLU6."""
    g = model.graph
    lo = helper.make_node("Constant", [], ["lo"], name="lo", value=numpy_helper.from_array(np.float32(0)))
    hi = helper.make_node("Constant", [], ["hi"], name="hi", value=bound)
    clip = helper.make_node("Clip", ["conv1", "lo", "hi"], ["clipped"], name="clip")
    for n in g.node:
        n.input[:] = ["clipped" if v == "conv1" else v for v in n.input]
    g.node.insert(1, clip)
    g.node.insert(0, hi)
    g.node.insert(0, lo)


def reshape_after_stem(model, target):
    """conv1 reshaped by a constant target: refused, its message naming the target."""
    g = model.graph
    for n in g.node:
        n.input[:] = ["reshaped" if v == "conv1" else v for v in n.input]
    g.node.insert(1, helper.make_node("Reshape", ["conv1", "target"], ["reshaped"], name="reshape"))
    g.node.insert(0, helper.make_node("Constant", [], ["target"], name="target", value=target))


def save(model, path):
    onnx.save(model, path)                 # unchecked: the reader must catch it
    return path


def assert_refused(path, watch, secret_name):
    watch.clear()
    with pytest.raises(ExportError) as e:
        nn.from_onnx(path, input_shape=(3, 32, 32))
    msg = str(e.value)
    assert "external data file" in msg and str(path) in msg and "\n" not in msg, msg
    assert not any(o.endswith(secret_name) for o in watch), watch
    return msg


def test_a_constant_bound_in_another_file_is_refused_not_read(tmp_path, free, watch, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "six.bin").write_bytes(np.float32(6).tobytes())
    model = onnx.load(free)
    clip_after_stem(model, external("hi", "six.bin"))
    path = save(model, tmp_path / "clip.onnx")
    msg = assert_refused(path, watch, "six.bin")
    assert "node 'hi' (Constant) attribute 'value'" in msg
    assert any(o.endswith("clip.onnx") for o in watch)          # the file the user named is read


def test_a_reshape_target_in_another_file_is_refused_and_never_echoed(tmp_path, free, watch, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".ssh").mkdir()
    key = b"-----BEGIN OPENSSH PRIVATE KEY-----\n"
    (tmp_path / ".ssh" / "id_rsa").write_bytes(key)
    model = onnx.load(free)
    reshape_after_stem(model, external("target", ".ssh/id_rsa", (len(key) // 8,), TensorProto.INT64))
    path = save(model, tmp_path / "evil.onnx")
    msg = assert_refused(path, watch, "id_rsa")
    for v in np.frombuffer(key[:len(key) // 8 * 8], np.int64):
        assert str(v) not in msg
    rc = cli.main(["plan", "--model", str(path), "--input", "3x32x32", "--batch", "4"])
    assert rc != 0


def test_external_tensors_are_refused_wherever_they_sit(tmp_path, free, watch, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w.bin").write_bytes(np.zeros(16 * 3 * 3 * 3, np.float32).tobytes())

    def initializer(m):
        t = next(t for t in m.graph.initializer if t.name == "conv1.weight")
        t.CopyFrom(external("conv1.weight", "w.bin", (16, 3, 3, 3)))

    def sparse_initializer(m):
        m.graph.sparse_initializer.append(helper.make_sparse_tensor(
            external("s", "w.bin", (2,)), numpy_helper.from_array(np.array([0, 1], np.int64), "i"), [4]))

    def subgraph(m):
        def branch(k):
            return helper.make_graph([helper.make_node("Identity", ["k"], ["y"])], "branch", [],
                                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                                     initializer=[k])
        cond = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array(True)))
        m.graph.node.insert(0, helper.make_node(
            "If", ["c"], ["unused"], name="if", then_branch=branch(external("k", "w.bin", (2,))),
            else_branch=branch(numpy_helper.from_array(np.zeros(2, np.float32), "k"))))
        m.graph.node.insert(0, cond)

    def attribute_list(m):
        m.graph.node[0].attribute.append(helper.make_attribute("extra", [external("e", "w.bin", (2,))]))

    def function(m):
        body = helper.make_node("Constant", [], ["z"], name="c", value=external("f", "w.bin", (2,)))
        m.functions.append(helper.make_function("local", "F", [], ["z"], [body],
                                                [helper.make_opsetid("", 17)]))

    def function_default(m):                 # a local function's default attribute value
        body = helper.make_node("Constant", [], ["z"], name="c", value_float=1.0)
        m.functions.append(helper.make_function(
            "local", "G", [], ["z"], [body], [helper.make_opsetid("", 17)],
            attribute_protos=[helper.make_attribute("w", external("d", "w.bin", (2,)))]))

    cases = {"initializer": (initializer, "initializer 'conv1.weight'"),
             "sparse": (sparse_initializer, "sparse initializer 's' (values)"),
             "subgraph": (subgraph, "node 'if' (If) attribute 'then_branch': initializer 'k'"),
             "list": (attribute_list, "attribute 'extra'"),
             "function": (function, "function 'F': node 'c' (Constant)"),
             "function default": (function_default, "function 'G': attribute 'w'")}
    for name, (edit, where) in cases.items():
        model = onnx.load(free)
        edit(model)
        msg = assert_refused(save(model, tmp_path / f"{name}.onnx"), watch, "w.bin")
        assert where in msg, (name, msg)


def test_a_refusal_shows_a_few_values_of_a_constant_not_all(tmp_path, free):
    model = onnx.load(free)
    reshape_after_stem(model, numpy_helper.from_array(np.arange(1000, 1100, dtype=np.int64)))
    path = save(model, tmp_path / "long.onnx")
    with pytest.raises(ExportError) as e:
        nn.from_onnx(path, input_shape=(3, 32, 32))
    msg = str(e.value)
    assert "[1000, 1001, 1002, 1003, ... (100 values)]" in msg and "1050" not in msg, msg


def test_a_clip_bound_that_is_not_one_number_is_named(tmp_path, free):
    model = onnx.load(free)
    clip_after_stem(model, numpy_helper.from_array(np.full(5, 6, np.float32)))
    path = save(model, tmp_path / "wide.onnx")
    with pytest.raises(ExportError) as e:
        nn.from_onnx(path, input_shape=(3, 32, 32))
    assert "upper bound must be a single number" in str(e.value) and "(5,)" in str(e.value)


def test_a_refusal_shows_a_few_values_of_an_attribute_list_not_all(tmp_path, free):
    model = onnx.load(free)
    conv = next(n for n in model.graph.node if n.op_type == "Conv")
    strides = next(a for a in conv.attribute if a.name == "strides")
    strides.ints[:] = list(range(1000, 1100))
    path = save(model, tmp_path / "strides.onnx")
    with pytest.raises(ExportError) as e:
        nn.from_onnx(path, input_shape=(3, 32, 32))
    msg = str(e.value)
    assert "strides [1000, 1001, 1002, 1003, ... (100 values)]" in msg and "1050" not in msg, msg
