"""ONNX out: the inference graph of `Engine.predict` as an .onnx file (optional extra `lowmem[onnx]`).

    from lowmem.formats import onnx_export
    onnx_export.export_onnx(net, "model.onnx")            # opset 17, eval-mode graph

Opset 17 (OPSET; MIN_OPSET up to the installed onnx's newest on request), one node per
operation, each written by its op's entry in lowmem/core/optable/ (`onnx`): Conv (no bias),
BatchNormalization (running statistics, epsilon 1e-5) + Relu for each BN-ReLU unit (not folded:
in a pre-activation network most units follow an add, not a conv), Add, MaxPool, AveragePool,
GlobalAveragePool + Flatten + Gemm for the head. Input "input" (batch, C, H, W), output "logits"
(batch, num_classes); the batch dimension is symbolic, and so are H and W unless `input_shape`
is given. `metadata` (formats/metadata.py: what travels with the weights) goes into the model's
metadata_props. The file is written atomically (lowmem.system.atomic.atomic_write: a temporary
file beside the target, fsync, then a rename over it), so an interrupted export never leaves a
half-written model (nor harms an existing one). The reader is formats/onnx_import.py.
"""
import collections

import numpy

from .._version import __version__
from ..core.optable import OPS
from ..system.atomic import atomic_write
from .common import ExportError, require

OPSET = 17
MIN_OPSET = 7          # onnxruntime runs the graph from opset 7 (BatchNormalization-7); onnx's checker
                       # refuses 1-5, and onnxruntime has no BatchNormalization-6 kernel


def max_opset():
    """The newest opset the installed onnx knows (28 for onnx 1.23, which onnxruntime 1.32 runs)."""
    from onnx import defs
    return defs.onnx_opset_version()


def check_opset(opset):
    """opset as an int in MIN_OPSET..max_opset(); ExportError naming the range otherwise."""
    newest = max_opset()
    if isinstance(opset, bool) or not isinstance(opset, (int, numpy.integer)) or not MIN_OPSET <= opset <= newest:
        raise ExportError(f"ONNX opset {opset!r} is not supported: expected {MIN_OPSET}..{newest} "
                          f"(default {OPSET}; the newest is the installed onnx's)")
    return int(opset)


# ---------------------------------------------------------------------------- ONNX

def onnx_model(net, input_shape=None, opset=OPSET, metadata=None):
    """The eval-mode graph of `net` as an onnx.ModelProto (checked by onnx.checker).

    input_shape: (C, H, W) to fix H and W in the graph's input type; None
    leaves them symbolic (convolutional networks take any size). metadata:
    a dict of strings stored as the model's metadata_props."""
    onnx = require("onnx", "onnx")
    from onnx import TensorProto, helper, numpy_helper
    opset = check_opset(opset)
    state = net.state_dict()
    inits = [numpy_helper.from_array(numpy.ascontiguousarray(v, numpy.float32), k) for k, v in state.items()]
    version = collections.defaultdict(int)
    names = {("input", 0): "input"}
    nodes = []

    def read(buf):
        return names[(buf, version[buf])]

    def write(buf, name):
        version[buf] += 1
        names[(buf, version[buf])] = name
        return name

    for L in net.layers:                                 # each op's node(s): lowmem/core/optable/
        if not hasattr(OPS.get(L.op), "onnx"):
            raise ExportError(f"layer {L.name!r}: op {L.op!r} has no ONNX translation")
        nodes += OPS[L.op].onnx(L, helper, read, write, opset)
    values = ["input"] + [o for n in nodes for o in n.output] + list(state)       # one namespace
    names = [n.name for n in nodes]                                                # and another
    clash = sorted({v for v in values if values.count(v) > 1} | {v for v in names if names.count(v) > 1})
    if clash:          # a hand-built Network's layer name equal to a value the graph names itself
        raise ExportError(f"network {net.name!r}: layer names clash with names the ONNX graph uses "
                          f"({', '.join(map(repr, clash))}); rename those layers")
    if input_shape is None:
        dims = ["batch", net.in_channels, "height", "width"]
    else:
        if len(tuple(input_shape)) != 3 or tuple(input_shape)[0] != net.in_channels:
            raise ExportError(f"input_shape must be (C, H, W) with C = {net.in_channels}, got {input_shape!r}")
        dims = ["batch"] + [int(v) for v in input_shape]
    graph = helper.make_graph(
        nodes, net.name, [helper.make_tensor_value_info("input", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", net.num_classes])],
        initializer=inits)
    model = helper.make_model(graph, producer_name="lowmem", producer_version=__version__,
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = min(model.ir_version, 8)          # readable by onnxruntime >= 1.10
    helper.set_model_props(model, dict(metadata or {}))
    onnx.checker.check_model(model)
    return model


def export_onnx(net, path, input_shape=None, opset=OPSET, metadata=None):
    """Write the eval-mode graph of `net` to `path` (ONNX, opset 17, float32). Returns path."""
    atomic_write(path, onnx_model(net, input_shape, opset, metadata).SerializeToString())
    return path
