"""Which ONNX nodes nn.from_onnx reads and what each becomes: the default domain's ops only (a
node of another domain, or a call of a model-local function, is refused even where its name is
a standard op's), and the equivalent spellings other exporters write for the ops lowmem has."""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import helper  # noqa: E402

from lowmem import models, nn  # noqa: E402
from lowmem.formats.common import ExportError  # noqa: E402
from lowmem.tools import export  # noqa: E402


@pytest.fixture(scope="module")
def free(tmp_path_factory):
    """A preact-resnet8 for 10 classes, H and W symbolic."""
    d = tmp_path_factory.mktemp("onnx")
    return export.export_onnx(models.build_model("preact-cifar", 8, num_classes=10), d / "free.onnx")


def edited(tmp_path, src, edit, name="edited.onnx"):
    model = onnx.load(src)
    edit(model)
    path = tmp_path / name
    onnx.save(model, path)                               # unchecked: the reader must catch it
    return path


def refused(path):
    with pytest.raises(ExportError) as e:
        nn.from_onnx(path, input_shape=(3, 32, 32))
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
