"""Weights that leave lowmem: safetensors files and ONNX inference graphs.

    from lowmem import export
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
lowmem/optable.py (`onnx`): Conv (no bias), BatchNormalization (running
statistics, epsilon 1e-5) + Relu for each BN-ReLU unit (not folded: in a
pre-activation network most units follow an add, not a conv), Add, MaxPool,
AveragePool, GlobalAveragePool + Flatten + Gemm for the head. Input "input"
(batch, C, H, W), output "logits" (batch, num_classes); the batch dimension
is symbolic, and so are H and W unless `input_shape` is given.

Files are written atomically: a temporary file beside the target, fsync,
then a rename over it, so an interrupted export never leaves a half-written
model (nor harms an existing one).

`add_arguments(parser)` / `run(args)` are the `lowmem export RUN_DIR OUT` subcommand:
the model of a run folder's checkpoint, to OUT.safetensors or OUT.onnx.
"""
import os
import secrets
import sys

import numpy

from . import __version__
from .checkpoint import fsync_directory
from .optable import OPS

OPSET = 17
FORMATS = {".safetensors": "safetensors", ".onnx": "onnx"}


class ExportError(ValueError):
    """A network or file that cannot be exported or read back; the message names it."""


# --------------------------------------------------------------------------- files

def _atomic_write(path, data):
    """Write bytes `data` to `path` via a temporary file and a rename (fsync'd)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_directory(directory)              # the rename itself durable (checkpoint.py's helper)


def _require(module, extra):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise ImportError(f"{module} is not installed: pip install 'lowmem[{extra}]'") from None


# --------------------------------------------------------------------- safetensors

def export_safetensors(net, path, dtype="float32"):
    """Write net's parameters and BN running statistics to `path` (safetensors, NumPy API).

    dtype: the stored float type ("float32", PyTorch's default; None keeps the
    network's). Metadata: the network's name and the lowmem version."""
    st = _require("safetensors.numpy", "safetensors")
    state = net.state_dict()                             # host copies
    if dtype is not None:
        state = {k: numpy.ascontiguousarray(v, dtype=dtype) for k, v in state.items()}
    meta = {"format": "pt", "network": net.name, "lowmem_version": __version__}
    _atomic_write(path, st.save(state, metadata=meta))
    return path


def read_safetensors(path):
    """name -> NumPy array of a safetensors file; ExportError naming the file if it is not one."""
    st = _require("safetensors.numpy", "safetensors")
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

def onnx_model(net, input_shape=None, opset=OPSET):
    """The eval-mode graph of `net` as an onnx.ModelProto (checked by onnx.checker).

    input_shape: (C, H, W) to fix H and W in the graph's input type; None
    leaves them symbolic (convolutional networks take any size)."""
    onnx = _require("onnx", "onnx")
    from onnx import TensorProto, helper, numpy_helper
    state = net.state_dict()
    inits = [numpy_helper.from_array(numpy.ascontiguousarray(v, numpy.float32), k) for k, v in state.items()]
    version = {"input": 0, "act0": 0, "act1": 0, "res": 0}
    names = {("input", 0): "input"}
    nodes = []

    def read(buf):
        return names[(buf, version[buf])]

    def write(buf, name):
        version[buf] += 1
        names[(buf, version[buf])] = name
        return name

    for L in net.layers:                                 # each op's node(s): lowmem/optable.py
        if not hasattr(OPS.get(L.op), "onnx"):
            raise ExportError(f"layer {L.name!r}: op {L.op!r} has no ONNX translation")
        nodes += OPS[L.op].onnx(L, helper, read, write)
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
    onnx.checker.check_model(model)
    return model


def export_onnx(net, path, input_shape=None, opset=OPSET):
    """Write the eval-mode graph of `net` to `path` (ONNX, opset 17, float32). Returns path."""
    _atomic_write(path, onnx_model(net, input_shape, opset).SerializeToString())
    return path


# ------------------------------------------------------------------- `lowmem export`

def add_arguments(parser):
    """Options of `lowmem export RUN_DIR OUT`."""
    parser.add_argument("run", metavar="RUN_DIR",
                        help="a training run folder (its checkpoint.ckpt) or a checkpoint file")
    parser.add_argument("output", metavar="OUT", help="model.safetensors or model.onnx (the suffix picks the format)")
    parser.add_argument("--input", type=_shape, default=None, metavar="CxHxW",
                        help="ONNX only: fix the input's height and width (default: symbolic)")
    parser.add_argument("--opset", type=int, default=OPSET, help="ONNX opset (default: %(default)s)")
    return parser


def _shape(text):
    from .argtypes import shape
    return shape(text)


def network_from_checkpoint(path):
    """(network with the checkpoint's weights, meta) of a lowmem training checkpoint.

    The architecture is rebuilt from the run's configuration (model, depth,
    seed) with the class and channel counts read off the stored weights."""
    from .checkpoint import load_checkpoint
    from .models import MODELS
    from .trainer import load_model_state
    arrays, meta = load_checkpoint(path)
    config = meta.get("config") or {}
    model = config.get("model")
    if model not in MODELS:
        raise ExportError(f"{path}: unknown model {model!r} in the checkpoint's configuration "
                          f"(this lowmem knows {', '.join(sorted(MODELS))})")
    fc, first = arrays.get("net/fc.weight"), next((a for k, a in arrays.items()
                                                   if k.startswith("net/") and a.ndim == 4), None)
    if fc is None or first is None:
        raise ExportError(f"{path}: no network weights (net/fc.weight, a conv) in this checkpoint")
    net = MODELS[model].build(config["depth"], num_classes=int(fc.shape[0]), in_channels=int(first.shape[1]),
                              seed=config.get("seed", 0))
    load_model_state(path, net)
    return net, meta


def run(args):
    """`lowmem export`: 0 written; 1 bad run folder, checkpoint or output name; 2 missing extra."""
    from .trainer import CHECKPOINT
    path = os.path.join(args.run, CHECKPOINT) if os.path.isdir(args.run) else args.run
    fmt = FORMATS.get(os.path.splitext(args.output)[1].lower())
    try:
        if fmt is None:
            raise ExportError(f"{args.output}: unknown format; the output must end in "
                              f"{' or '.join(FORMATS)}")
        if not os.path.exists(path):
            raise ExportError(f"{path}: no checkpoint here (is {args.run} a lowmem training run folder?)")
        net, meta = network_from_checkpoint(path)
        if fmt == "onnx":
            export_onnx(net, args.output, args.input, args.opset)
        else:
            export_safetensors(net, args.output)
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:           # ExportError, CheckpointError, ResumeError, onnx checks
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: {net.name}, {net.num_params():,} parameters, iteration "
          f"{meta.get('iteration', '?')}" + (f", ONNX opset {args.opset}" if fmt == "onnx" else ""))
    return 0


def main(argv=None):
    """`python -m lowmem.export RUN_DIR OUT` (the same as `lowmem export`)."""
    import argparse
    parser = add_arguments(argparse.ArgumentParser(prog="lowmem export", description=__doc__.split("\n")[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
