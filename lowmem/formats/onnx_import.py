"""ONNX in: a CNN graph file -> a lowmem Network built through nn.Graph, its initializers as weights.

    net = lowmem.nn.from_onnx("model.onnx")                  # input shape from the file
    net = lowmem.nn.from_onnx("model.onnx", input_shape=(3, 32, 32))   # where H, W are symbolic

Reads files exported by PyTorch in training mode with batch norm kept,

    torch.onnx.export(model, x, path, training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False, dynamo=False)

(the TorchScript exporter: the torch.export-based one needs onnxscript), and lowmem's own
`lowmem export` files (eval-mode batch norm). The `onnx` package parses and checks the file;
nothing here reads protobuf by hand.

Each ONNX node becomes one nn.Graph call (lowmem/formats/onnx_nodes.py: op type -> handler); a node
whose op the builder does not offer is refused with its name, its op type and the list of
supported ops. The builder comes in as an argument (nn.from_onnx hands in nn.Graph), so this
module imports nothing above it. BatchNormalization whose only reader is a Relu becomes one
BN->ReLU unit (`bn_relu`); Flatten -> Gemm inside the network a linear layer;
GlobalAveragePool (or ReduceMean over H, W) -> Flatten -> Gemm at the end, or a last Gemm on a
linear layer's output, the head. Identity and ratio-0 Dropout pass their input through; a
Dropout with a ratio trains as dropout. A Constant, and an Identity or Cast of a constant, is
read as that constant before the walk (docs/onnx.md lists the spellings read). Only standard ops
are read: a node of another domain or a call of a model-local function is refused first. The
file's tensors must all lie inside it (load_checked): lowmem reads no other file.

Names: a layer takes the name of its parameters' initializers (`layer1.0.conv1.weight` ->
layer `layer1.0.conv1`, so parameters keep the ONNX initializer names, which for a torch
model are its `named_parameters()` names); a layer without parameters takes its node's name
when that is a valid layer name, else the builder's default. The classifier (the head's linear
layer) takes its initializers' name too (torchvision's `classifier`), else fc.
"""
import os
import warnings

import numpy

from ..core.network import NetworkError
from .common import ExportError, FormatWarning, check_file, require
from .onnx_nodes import IMPORTS, _attr, builder_has, constant_value, supported_ops

GENERIC_NAMES = ("", "main_graph", "torch_jit", "torch-jit-export")    # exporters' defaults: the file's name instead


class _Reader:
    """One pass over a checked onnx.ModelProto, building the nn.Graph and collecting weights."""

    def __init__(self, model, path, input_shape, seed, nn):
        from onnx import numpy_helper
        self.nn, self.path = nn, path
        g = model.graph
        self.inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
        for name, a in self.inits.items():               # as stored: before any conversion
            bad = int(numpy.count_nonzero(~numpy.isfinite(a))) if a.dtype.kind in "fc" else 0
            if bad:
                raise ExportError(f"{path}: initializer {name!r} {a.shape} holds {bad} NaN or inf "
                                  f"value(s); refusing to import non-finite weights")
        _check_domains(model, path)
        inputs = [i for i in g.input if i.name not in self.inits]
        # every node's wrapper held for the reader's life, so that id(node) names one node throughout
        # (protobuf makes a new wrapper, maybe at a freed one's address, when none is alive)
        self.nodes = list(g.node)
        self.done = set()                                 # nodes consumed by a pattern or folded (id)
        self.consts = {}
        for n in self.nodes:                                  # every constant first: a pattern may look ahead
            value = constant_value(self, n)               # a Constant; an Identity or Cast of a constant
            if value is not None:
                # an Identity of an initializer (an exporter's deduplicated weights) is that initializer
                # under the name its reader expects (layer4.1.bn2.weight)
                alias = n.op_type == "Identity" and n.input[0] in self.inits
                (self.inits if alias else self.consts)[n.output[0]] = value
                self.done.add(id(n))
        self.readers = {}                                 # value -> [nodes reading it]
        for n in self.nodes:
            for v in n.input:
                if v:
                    self.readers.setdefault(v, []).append(n)
        if len(inputs) != 1:
            raise ExportError(f"{path}: expected one graph input (the image batch), found "
                              f"{len(inputs)}: {[i.name for i in inputs]}")
        self.outputs = [o.name for o in g.output]
        if len(self.outputs) != 1:
            raise ExportError(f"{path}: expected one graph output (the logits), found {self.outputs}")
        producer = {v: n for n in self.nodes for v in n.output}
        while self.outputs[0] in producer and producer[self.outputs[0]].op_type == "Identity":
            n = producer[self.outputs[0]]                 # Gemm -> Identity -> output: the Gemm's is the logits
            self.done.add(id(n))
            self.outputs = [n.input[0]]
        shape = _input_shape(inputs[0], input_shape, path)
        num_classes = self._num_classes(g)
        name = g.name if g.name.strip() not in GENERIC_NAMES else os.path.splitext(os.path.basename(path))[0]
        self.graph = nn.Graph(name, shape, num_classes, seed)
        self.values = {inputs[0].name: self.graph.input}  # ONNX value -> nn Tensor
        self.weights = {}                                 # lowmem parameter name -> array
        self.network = None

    # ------------------------------------------------------------------ walking
    def run(self):
        for node in self.nodes:
            if id(node) in self.done:                     # constants (read in __init__), patterns
                continue
            if self.network is not None:
                raise ExportError(f"{self.path}: node {node.name!r} ({node.op_type}) comes after the "
                                  f"classifier; the graph must end with the logits (lowmem applies "
                                  f"softmax cross-entropy itself)")
            handler = IMPORTS.get(node.op_type)
            if handler is None or not builder_has(self.nn.Graph, node.op_type):
                raise ExportError(f"{self.path}: node {node.name!r}: op {node.op_type} is not supported; "
                                  f"supported ops: {', '.join(supported_ops(self.nn.Graph))}")
            handler(self, node)
        if self.network is None:
            raise ExportError(f"{self.path}: no classifier head found: the graph must end with a "
                              f"global average pool (GlobalAveragePool or ReduceMean over H, W), "
                              f"Flatten and Gemm")
        return self.network

    def tensor(self, node, i=0):
        v = node.input[i]
        if v not in self.values:
            what = "an initializer" if v in self.inits else "not computed by a supported node"
            raise ExportError(f"{self.path}: node {node.name!r} ({node.op_type}) reads {v!r}, which is "
                              f"{what}; lowmem reads activations there")
        return self.values[v]

    def const(self, node, i):
        """The constant array of input i (an initializer or a Constant node's value), or None."""
        if i >= len(node.input) or not node.input[i]:
            return None
        v = node.input[i]
        if v in self.inits:
            return self.inits[v]
        if v in self.consts:
            return self.consts[v]
        raise ExportError(f"{self.path}: node {node.name!r} ({node.op_type}): input {v!r} must be a "
                          f"constant (an initializer)")

    def only_reader(self, value, op_type):
        """The single node reading `value` if it is an `op_type`, else None."""
        r = self.readers.get(value, [])
        return r[0] if len(r) == 1 and r[0].op_type == op_type and value not in self.outputs else None

    def layer_name(self, node, param_names=(), suffixes=()):
        """The layer name: the common prefix of its parameters' initializer names when they end in
        `suffixes` (conv: .weight), else the node's name when valid, else None (builder default)."""
        if param_names and all(p.endswith(s) for p, s in zip(param_names, suffixes)):
            prefixes = {p[:-len(s)] for p, s in zip(param_names, suffixes)}
            if len(prefixes) == 1:
                return prefixes.pop()
        name = node.name
        if name.startswith("/"):                 # torch's scope path "/layer1/layer1.0/Add": layer1.0.add
            parts = name.strip("/").split("/")
            name = ".".join(parts[-2:-1] + [parts[-1].lower()])
        nn = self.nn
        bad = (not name or name.startswith(".") or name.endswith(".") or name in self.graph._names
               or name in nn.RESERVED or name in nn.HEAD_VALUES or name.startswith(("pool.", "fc."))
               or name.rsplit(".", 1)[-1] in nn.PARAM_SUFFIXES or name.endswith(".bn"))
        return None if bad else name

    def set(self, node, tensor, i=0):
        self.values[node.output[i]] = tensor

    def param(self, name, value, expected_shape, node):
        if tuple(value.shape) != tuple(expected_shape):
            raise ExportError(f"{self.path}: node {node.name!r}: initializer for {name!r} has shape "
                              f"{tuple(value.shape)}, expected {tuple(expected_shape)}")
        if value.dtype.kind != "f":
            raise ExportError(f"{self.path}: node {node.name!r}: initializer for {name!r} is {value.dtype}, "
                              f"expected floating-point values")
        self.weights[name] = value

    def _num_classes(self, g):
        gemms = [n for n in g.node if n.op_type == "Gemm" and self.outputs[0] in n.output]
        if not gemms or gemms[0].input[1] not in self.inits:
            raise ExportError(f"{self.path}: the graph output {self.outputs[0]!r} is not a Gemm with "
                              f"constant weights; lowmem needs a linear classifier at the end "
                              f"(global average pool, Flatten, Gemm)")
        w = self.inits[gemms[0].input[1]]
        return int(w.shape[0] if _attr(gemms[0], "transB", 0) else w.shape[1])


DEFAULT_DOMAINS = ("", "ai.onnx")          # the standard ops; any other domain's op means what it says


def _check_domains(model, path):
    """ExportError naming the first node that is not a standard ONNX op: a node of another domain
    (com.microsoft:Conv, com.evil:Relu) or a call of a model-local function, whose meaning is its
    own whatever its name. Checked before the walk: handlers and patterns go by op type alone."""
    local = {(f.domain, f.name) for f in model.functions}
    for n in model.graph.node:
        if n.domain not in DEFAULT_DOMAINS:
            raise ExportError(f"{path}: node {n.name!r}: op {n.op_type} of domain {n.domain!r} is not "
                              f"supported; lowmem reads the standard ONNX ops (domain '' or 'ai.onnx') only")
        if (n.domain, n.op_type) in local:
            raise ExportError(f"{path}: node {n.name!r}: op {n.op_type} calls the model-local function "
                              f"{n.op_type!r}, not the standard op; lowmem reads the standard ONNX ops only")


def _input_shape(value, given, path):
    """(C, H, W) of one sample from the graph input's type, or `given` where H, W are symbolic;
    ExportError when the two disagree."""
    dims = value.type.tensor_type.shape.dim
    if len(dims) != 4:
        raise ExportError(f"{path}: the graph input {value.name!r} has {len(dims)} dimensions; expected "
                          f"an image batch (N, C, H, W)")
    fixed = [d.dim_value if d.HasField("dim_value") else None for d in dims[1:]]
    if any(f is not None and f < 1 for f in fixed):
        raise ExportError(f"{path}: the graph input {value.name!r} has a dimension of "
                          f"{min(f for f in fixed if f is not None)}; an image batch (N, C, H, W) needs C, H, W >= 1")
    if fixed[0] is None:
        raise ExportError(f"{path}: the graph input's channel count is symbolic; lowmem needs it fixed")
    if given is not None:
        given = tuple(int(v) for v in given)
        if len(given) != 3 or any(f is not None and f != v for f, v in zip(fixed, given)):
            shown = "x".join("?" if f is None else str(f) for f in fixed)
            raise ExportError(f"{path}: input shape {'x'.join(map(str, given))} does not match the model's "
                              f"input {shown} (C x H x W)")
        return given
    if None in fixed:
        raise ExportError(f"{path}: the model's input height and width are symbolic; give input_shape "
                          f"(C, H, W), e.g. input_shape=({fixed[0]}, 32, 32) (--input on the command line)")
    return tuple(fixed)


def load_checked(path):
    """The checked onnx.ModelProto of `path`, every tensor inside the file (none names an external
    data file); ExportError naming the file otherwise. Whatever runs an .onnx file (this reader,
    `lowmem predict` through onnxruntime) loads it here first, so it reads no other file."""
    onnx = require("onnx", "onnx")
    path = os.fspath(path)
    check_file(path)
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as e:                               # DecodeError, ...
        raise ExportError(f"{path}: not a readable ONNX model ({_first_line(e)})") from None
    known = onnx.defs.onnx_opset_version()               # the newest default-domain opset onnx knows
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx") and o.version > known:
            raise ExportError(f"{path}: written for ONNX opset {o.version}, newer than the installed onnx "
                              f"{onnx.__version__} knows (opset {known}); export with opset <= {known} "
                              f"or upgrade onnx")
    for where, t in _tensors(model):                     # before the checker, which looks for such files
        if t.data_location == onnx.TensorProto.EXTERNAL or len(t.external_data):
            raise ExportError(f"{path}: {where} is stored in an external data file; lowmem reads no file "
                              f"but the .onnx itself: export with every tensor inside the .onnx file")
    try:
        onnx.checker.check_model(model)
    except Exception as e:                               # ValidationError, ...
        raise ExportError(f"{path}: not a readable ONNX model ({_first_line(e)})") from None
    return model


def _tensors(model):
    """(where, TensorProto) for every tensor the model holds: the graph's initializers (dense and
    sparse), every node attribute's tensors, the subgraphs of If/Loop/Scan nodes, the model's local
    functions (their nodes and default attribute values) and its training-info graphs, walked to
    any depth. Any of these could name an
    external data file, which numpy_helper.to_array would open relative to the current folder."""
    def sparse(where, s):
        yield f"{where} (values)", s.values
        yield f"{where} (indices)", s.indices

    def graph(g, scope):
        for t in g.initializer:
            yield f"{scope}initializer {t.name!r}", t
        for s in g.sparse_initializer:
            yield from sparse(f"{scope}sparse initializer {s.values.name!r}", s)
        for n in g.node:
            yield from node(n, scope)

    def node(n, scope):
        yield from attributes(n.attribute, f"{scope}node {n.name!r} ({n.op_type}) ")

    def attributes(attrs, scope):
        for a in attrs:
            where = f"{scope}attribute {a.name!r}"
            if a.HasField("t"):
                yield where, a.t
            for t in a.tensors:
                yield where, t
            if a.HasField("sparse_tensor"):
                yield from sparse(where, a.sparse_tensor)
            for s in a.sparse_tensors:
                yield from sparse(where, s)
            if a.HasField("g"):
                yield from graph(a.g, f"{where}: ")
            for g in a.graphs:
                yield from graph(g, f"{where}: ")

    yield from graph(model.graph, "")
    for f in model.functions:
        yield from attributes(f.attribute_proto, f"function {f.name!r}: ")     # default attribute values
        for n in f.node:
            yield from node(n, f"function {f.name!r}: ")
    for i, info in enumerate(model.training_info):
        yield from graph(info.initialization, f"training info {i} initialization: ")
        yield from graph(info.algorithm, f"training info {i} algorithm: ")


FOLD_PREFIX = "onnx::"      # PyTorch's name for a tensor its constant folding made (onnx::Conv_193)


def _warn_if_folded(model, path):
    """FormatWarning when convs read tensors named by the exporter: torch.onnx.export's defaults
    (eval mode, constant folding) fold each batch norm that follows a conv into that conv's weights
    and bias, leaving no BN-ReLU unit to compress there and other names. A batch norm after
    anything else (a concatenation, an add) stays a node, so a file may hold some and still have
    lost the others: counted, not only when no BatchNormalization is left."""
    g = model.graph
    convs = [n for n in g.node if n.op_type == "Conv"]
    folded = [vs for vs in ([v for v in n.input[1:] if v.startswith(FOLD_PREFIX)] for n in convs) if vs]
    if not folded:
        return
    n_folded, first = len(folded), folded[0][0]
    if any(n.op_type == "BatchNormalization" for n in g.node):
        what = (f"{n_folded} of its {len(convs)} convs read tensors the exporter made ({first!r}, ...): "
                f"PyTorch's default export (eval mode, constant folding) folds each batch norm that follows "
                f"a conv into it (the others stay), so lowmem has no BN-ReLU unit to compress there and "
                f"those parameter names are not the model's")
    else:
        what = (f"no BatchNormalization node, and its convs read tensors the exporter made ({first!r}, "
                f"...): PyTorch's default export (eval mode, constant folding) folds every batch norm into "
                f"its conv, so lowmem has no BN-ReLU unit to compress and the parameter names are not the "
                f"model's")
    warnings.warn(FormatWarning(
        f"{path}: {what}; export with training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, "
        f"dynamo=False"), stacklevel=3)


def _first_line(e):
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def file_input_shape(path):
    """(C, H, W) of one sample as the file fixes it; ExportError where H and W are symbolic
    (then the caller must say: --input CxHxW)."""
    model = load_checked(path)
    inits = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    if len(inputs) != 1:
        raise ExportError(f"{path}: expected one graph input (the image batch), found {len(inputs)}")
    return _input_shape(inputs[0], None, os.fspath(path))


def read_onnx(nn, path, input_shape=None, seed=0):
    """The Network of an ONNX file, its weights loaded (see the module docstring). ExportError
    (a ValueError) naming the file and the problem for anything it cannot read. nn: the builder
    module (lowmem.nn, whose from_onnx calls this: handed in, so the reader does not import it back)."""
    path = os.fspath(path)
    model = load_checked(path)
    try:
        r = _Reader(model, path, input_shape, seed, nn)
        net = r.run()
    except NetworkError as e:                            # the builder's rules: named with the file
        raise ExportError(f"{path}: {e}") from None
    _warn_if_folded(model, path)
    names = [n for n, _, _ in net.param_shapes()] + [n for n, _ in net.stat_shapes()]
    try:
        net.load_state_dict({n: r.weights[n] for n in names})
    except ValueError as e:
        raise ExportError(f"{path}: {e}") from None
    return net
