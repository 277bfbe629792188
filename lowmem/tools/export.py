"""Weights that leave lowmem: safetensors files and ONNX inference graphs.

    from lowmem.tools import export
    export.export_safetensors(net, "model.safetensors")   # names = PyTorch module names
    export.load_safetensors(net, "model.safetensors")     # and back, names and shapes checked
    export.export_onnx(net, "model.onnx")                 # opset 17, eval-mode graph

safetensors (optional extra `lowmem[safetensors]`): every parameter and BN
running statistic of `net.state_dict()` under its lowmem name, which is the
PyTorch `state_dict` key of the same network written with torch.nn
(`layer1.0.bn1.weight`, `layer1.0.bn1.running_var`, `fc.bias`; see
tests/torch_reference.py), so `model.load_state_dict(safetensors.torch.load_file(p),
strict=True)` works. BN's `num_batches_tracked` is not stored (lowmem keeps no
batch counter); a plain `nn.BatchNorm2d` needs `strict=False` for just that key.

ONNX (optional extra `lowmem[onnx]`): the inference graph of `Engine.predict`,
opset 17 (OPSET), one node per operation, each written by its op's entry in
lowmem/core/optable.py (`onnx`): Conv (no bias), BatchNormalization (running
statistics, epsilon 1e-5) + Relu for each BN-ReLU unit (not folded: in a
pre-activation network most units follow an add, not a conv), Add, MaxPool,
AveragePool, GlobalAveragePool + Flatten + Gemm for the head. Input "input"
(batch, C, H, W), output "logits" (batch, num_classes); the batch dimension
is symbolic, and so are H and W unless `input_shape` is given.

What travels with the weights (`lowmem export` writes it into both formats:
safetensors' header metadata, ONNX's metadata_props; each value a JSON
string; `read_metadata(path)` decodes it): classes (names in label order),
input_shape, image_size, resize (the eval transform: shorter side to
`resize`, centre crop `image_size`), mean and std (per channel, pixel / 255),
dataset, model and depth. `lowmem predict` (lowmem/tools/predict.py) uses them.

Files are written atomically (lowmem.system.atomic.atomic_write: a temporary file
beside the target, fsync, then a rename over it), so an interrupted export never leaves a half-written
model (nor harms an existing one).

`network_from_checkpoint(path)` rebuilds a training run's network with its weights: what
`lowmem export RUN_DIR OUT` (lowmem/tools/commands/export.py) writes out.
"""
import collections
import json
import os

import numpy

from .._version import __version__
from ..core.optable import OPS
from ..models import MODELS, build_model, is_onnx_path, model_spec
from ..system.atomic import atomic_write
from ..train.checkpoint import load_checkpoint
from ..train.trainstate import load_model_state
from ..formats.common import ExportError, check_file, require

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


FORMATS = {".safetensors": "safetensors", ".onnx": "onnx"}


# --------------------------------------------------------------------- safetensors

def export_safetensors(net, path, dtype="float32", metadata=None):
    """Write net's parameters and BN running statistics to `path` (safetensors, NumPy API).

    dtype: the stored float type ("float32", PyTorch's default; None keeps the
    network's). Metadata: the network's name and the lowmem version, plus
    `metadata` (a dict of strings, e.g. `model_metadata(meta)`: classes, preprocessing)."""
    st = require("safetensors.numpy", "safetensors")
    state = net.state_dict()                             # host copies
    if dtype is not None:
        state = {k: numpy.ascontiguousarray(v, dtype=dtype) for k, v in state.items()}
    meta = {**(metadata or {}), "format": "pt", "network": net.name, "lowmem_version": __version__}
    atomic_write(path, st.save(state, metadata=meta))
    return path


def read_safetensors(path):
    """name -> NumPy array of a safetensors file; ExportError naming the file if it is not one."""
    st = require("safetensors.numpy", "safetensors")
    if not os.path.isfile(path):
        raise ExportError(f"{path}: no such file")
    try:
        return st.load_file(os.fspath(path))
    except Exception as e:                               # SafetensorError, header errors
        raise ExportError(f"{path}: not a readable safetensors file ({e})") from None


def load_safetensors(net, path):
    """Load a safetensors file into `net` in place (Network.load_state_dict: names and shapes
    must match exactly; values are cast to the network's dtype). Returns net."""
    state = read_safetensors(path)
    try:
        net.load_state_dict(state)
    except ValueError as e:
        raise ExportError(f"{path}: {e}") from None
    return net


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

    for L in net.layers:                                 # each op's node(s): lowmem/core/optable.py
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


# ---------------------------------------------------- what travels with the weights

METADATA_KEYS = ("classes", "input_shape", "image_size", "resize", "mean", "std", "dataset", "model", "depth")


def model_metadata(meta):
    """The metadata both formats store (each value a JSON string), from a training checkpoint's meta:
    its "data" (class names in label order, input shape, eval resize / crop, mean / std in pixel / 255)
    and the architecture (model, depth) that rebuilds the network from a safetensors file."""
    data, config = meta.get("data") or {}, meta.get("config") or {}
    values = {**data, "model": config.get("model"), "depth": config.get("depth")}
    return {k: json.dumps(values[k]) for k in METADATA_KEYS if values.get(k) is not None}


def read_metadata(path):
    """The metadata of an exported .safetensors or .onnx file, values decoded from JSON (as
    `model_metadata` wrote them); keys it lacks are absent. ExportError if it is not such a file."""
    path = os.fspath(path)
    fmt = FORMATS.get(os.path.splitext(path)[1].lower())
    check_file(path)
    if fmt == "safetensors":
        require("safetensors", "safetensors")
        from safetensors import safe_open
        try:
            with safe_open(path, "np") as f:
                raw = f.metadata() or {}
        except Exception as e:
            raise ExportError(f"{path}: not a readable safetensors file ({e})") from None
    elif fmt == "onnx":
        onnx = require("onnx", "onnx")
        try:
            raw = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}
        except Exception as e:
            raise ExportError(f"{path}: not a readable ONNX file ({e})") from None
    else:
        raise ExportError(f"{path}: unknown format; expected {' or '.join(FORMATS)}")
    out = {}
    for k in METADATA_KEYS:
        if k in raw:
            try:
                out[k] = json.loads(raw[k])
            except ValueError:
                raise ExportError(f"{path}: metadata {k!r} is not JSON ({raw[k]!r})") from None
    return out


def network_from_checkpoint(path):
    """(network with the checkpoint's weights, meta) of a lowmem training checkpoint.

    The architecture is rebuilt from the run's configuration (model, depth,
    seed) with the class and channel counts read off the stored weights."""
    arrays, meta = load_checkpoint(path)
    config = meta.get("config") or {}
    model = config.get("model")
    try:
        model_spec(model)
    except (ValueError, TypeError):
        raise ExportError(f"{path}: unknown model {model!r} in the checkpoint's configuration "
                          f"(this lowmem knows {', '.join(sorted(MODELS))} and .onnx files)") from None
    shape = (meta.get("data") or {}).get("input_shape")      # an ONNX model's sizes (where symbolic)
    if is_onnx_path(model):                                  # the file has the architecture and classes
        net = build_model(model, None, seed=config.get("seed", 0), input_shape=tuple(shape) if shape else None)
        load_model_state(path, net)
        return net, meta
    fc, first = arrays.get("net/fc.weight"), next((a for k, a in arrays.items()
                                                   if k.startswith("net/") and a.ndim == 4), None)
    if fc is None or first is None:
        raise ExportError(f"{path}: no network weights (net/fc.weight, a conv) in this checkpoint")
    if config.get("depth") is None:
        raise ExportError(f"{path}: the checkpoint's configuration has no depth for model {model!r}, "
                          f"so the network cannot be rebuilt (was it written by lowmem train?)")
    net = build_model(model, config["depth"], num_classes=int(fc.shape[0]), in_channels=int(first.shape[1]),
                      seed=config.get("seed", 0))
    load_model_state(path, net)
    return net, meta
