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
    opset = check_opset(opset)
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
    parser.add_argument("--opset", type=_opset, default=OPSET,
                        help=f"ONNX opset, {MIN_OPSET} to the installed onnx's newest (default: %(default)s)")
    return parser


def _opset(text):
    import argparse
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer opset, got {text!r}") from None
    try:
        return check_opset(value)
    except ImportError:            # without onnx, run() names the missing extra
        return value
    except ExportError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    if config.get("depth") is None:
        raise ExportError(f"{path}: the checkpoint's configuration has no depth for model {model!r}, "
                          f"so the network cannot be rebuilt (was it written by lowmem train?)")
    net = MODELS[model].build(config["depth"], num_classes=int(fc.shape[0]), in_channels=int(first.shape[1]),
                              seed=config.get("seed", 0))
    load_model_state(path, net)
    return net, meta


def run(args):
    """`lowmem export`: 0 written; 1 bad run folder or checkpoint; 2 a bad command line (the
    output's suffix) or a missing extra. Errors are one line, `lowmem export: error: ...`."""
    from .trainer import CHECKPOINT
    path = os.path.join(args.run, CHECKPOINT) if os.path.isdir(args.run) else args.run
    fmt = FORMATS.get(os.path.splitext(args.output)[1].lower())

    def error(e, code):
        print(f"lowmem export: error: {e}", file=sys.stderr)
        return code

    if fmt is None:
        return error(f"{args.output}: unknown format; the output must end in {' or '.join(FORMATS)}", 2)
    try:
        if not os.path.exists(path):
            raise ExportError(f"{path}: no checkpoint here (is {args.run} a lowmem training run folder?)")
        net, meta = network_from_checkpoint(path)
        if fmt == "onnx":
            export_onnx(net, args.output, args.input, args.opset)
        else:
            export_safetensors(net, args.output)
    except ImportError as e:
        return error(e, 2)
    except (ValueError, OSError) as e:           # ExportError, CheckpointError, ResumeError, onnx checks
        return error(e, 1)
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
