"""ONNX in: a CNN graph file -> a lowmem Network built through nn.Graph, its initializers as weights.

    net = lowmem.nn.from_onnx("model.onnx")                  # input shape from the file
    net = lowmem.nn.from_onnx("model.onnx", input_shape=(3, 32, 32))   # where H, W are symbolic

Reads files exported by PyTorch in training mode with batch norm kept,

    torch.onnx.export(model, x, path, training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False, dynamo=False)

(the TorchScript exporter: the torch.export-based one needs onnxscript), and lowmem's own
`lowmem export` files (eval-mode batch norm). The `onnx` package parses and checks the file;
nothing here reads protobuf by hand.

Each ONNX node becomes one nn.Graph call (IMPORTS below: op type -> handler); a node whose op
the builder does not offer is refused with its name, its op type and the list of supported
ops. BatchNormalization whose only reader is a Relu becomes one BN->ReLU unit (`bn_relu`);
GlobalAveragePool (or ReduceMean over H, W) -> Flatten -> Gemm at the end becomes the head.
Identity and Dropout in eval form pass their input through.

Names: a layer takes the name of its parameters' initializers (`layer1.0.conv1.weight` ->
layer `layer1.0.conv1`, so parameters keep the ONNX initializer names, which for a torch
model are its `named_parameters()` names); a layer without parameters takes its node's name
when that is a valid layer name, else the builder's default. The classifier (the head's linear
layer) takes its initializers' name too (torchvision's `classifier`), else fc.
"""
import math
import os

import numpy

from .export import ExportError, _require

BN_EPS = 1e-5
BN_MOMENTUM_ONNX = 0.9          # ONNX's momentum is 1 - PyTorch's (0.1, lowmem's)


class _Reader:
    """One pass over a checked onnx.ModelProto, building the nn.Graph and collecting weights."""

    def __init__(self, model, path, input_shape, seed):
        from onnx import numpy_helper
        from .. import nn
        self.nn, self.path = nn, path
        g = model.graph
        self.inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
        self.consts = {}
        self.readers = {}                                 # value -> [nodes reading it]
        for n in g.node:
            for v in n.input:
                if v:
                    self.readers.setdefault(v, []).append(n)
        inputs = [i for i in g.input if i.name not in self.inits]
        if len(inputs) != 1:
            raise ExportError(f"{path}: expected one graph input (the image batch), found "
                              f"{len(inputs)}: {[i.name for i in inputs]}")
        self.outputs = [o.name for o in g.output]
        if len(self.outputs) != 1:
            raise ExportError(f"{path}: expected one graph output (the logits), found {self.outputs}")
        shape = _input_shape(inputs[0], input_shape, path)
        num_classes = self._num_classes(g)
        self.graph = nn.Graph(g.name or os.path.splitext(os.path.basename(path))[0], shape, num_classes, seed)
        self.values = {inputs[0].name: self.graph.input}  # ONNX value -> nn Tensor
        self.weights = {}                                 # lowmem parameter name -> array
        self.done = set()                                 # nodes consumed by a pattern (id)
        self.network = None

    # ------------------------------------------------------------------ walking
    def run(self, nodes):
        for node in nodes:
            if id(node) in self.done:
                continue
            if self.network is not None:
                raise ExportError(f"{self.path}: node {node.name!r} ({node.op_type}) comes after the "
                                  f"classifier; the graph must end with the logits (lowmem applies "
                                  f"softmax cross-entropy itself)")
            handler = IMPORTS.get(node.op_type)
            if handler is None or not self._builder_has(node.op_type):
                raise ExportError(f"{self.path}: node {node.name!r}: op {node.op_type} is not supported; "
                                  f"supported ops: {', '.join(supported_ops())}")
            handler(self, node)
        if self.network is None:
            raise ExportError(f"{self.path}: no classifier head found: the graph must end with a "
                              f"global average pool (GlobalAveragePool or ReduceMean over H, W), "
                              f"Flatten and Gemm")
        return self.network

    @staticmethod
    def _builder_has(op_type):
        from .. import nn
        return all(hasattr(nn.Graph, m) for m in NEEDS.get(op_type, ()))

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


# ---------------------------------------------------------------------- attributes

def _attr(node, name, default=None):
    from onnx import helper
    for a in node.attribute:
        if a.name == name:
            v = helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else v
    return default


def _window(r, node, kernel):
    """(k, stride, pad) of a square window with equal strides and symmetric, equal pads."""
    k = list(kernel)
    strides = list(_attr(node, "strides", [1] * len(k)))
    pads = list(_attr(node, "pads", [0] * 2 * len(k)))
    dil = list(_attr(node, "dilations", [1] * len(k)))
    problems = []
    if len(k) != 2 or k[0] != k[1]:
        problems.append(f"kernel {k} (lowmem's windows are square, 2-D)")
    if len(set(strides)) != 1:
        problems.append(f"strides {strides} (must be equal)")
    if len(set(pads)) > 1:
        problems.append(f"pads {pads} (must be equal on every side)")
    if any(d != 1 for d in dil):
        problems.append(f"dilations {dil} (must be 1)")
    if _attr(node, "auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        problems.append(f"auto_pad {_attr(node, 'auto_pad')} (write explicit pads)")
    if _attr(node, "ceil_mode", 0):
        problems.append("ceil_mode 1 (lowmem rounds output sizes down)")
    if problems:
        raise ExportError(f"{r.path}: node {node.name!r} ({node.op_type}): unsupported " + "; ".join(problems))
    return k[0], strides[0], pads[0] if pads else 0


# ------------------------------------------------------------------------ handlers

def _conv(r, node):
    x = r.tensor(node)
    wname = node.input[1]
    w = r.const(node, 1)
    groups = int(_attr(node, "group", 1))
    bias = r.const(node, 2)
    k, stride, pad = _window(r, node, _attr(node, "kernel_shape", w.shape[2:]))
    if w.shape[1] * groups != x.shape[0]:
        raise ExportError(f"{r.path}: node {node.name!r} (Conv): weight {tuple(w.shape)} with group={groups} "
                          f"does not fit its input's {x.shape[0]} channels")
    names = (wname, node.input[2]) if bias is not None else (wname,)
    name = r.layer_name(node, names, (".weight", ".bias"))
    kwargs = {}
    if groups != 1:
        kwargs["groups"] = groups
    if bias is not None:
        kwargs["bias"] = True
    if kwargs and not _accepts(r.nn.Graph.conv, *kwargs):
        raise ExportError(f"{r.path}: node {node.name!r}: a Conv with {' and '.join(f'{k}={v}' for k, v in kwargs.items())} "
                          f"is not supported by this lowmem's nn.Graph.conv; supported ops: {', '.join(supported_ops())}")
    t = r.graph.conv(x, int(w.shape[0]), k, stride, pad, name=name, **kwargs)
    r.param(f"{t.name}.weight", w, w.shape, node)
    if bias is not None:
        r.param(f"{t.name}.bias", bias, (w.shape[0],), node)
    r.set(node, t)


def _batchnorm(r, node):
    x = r.tensor(node)
    eps, momentum = _attr(node, "epsilon", 1e-5), _attr(node, "momentum", BN_MOMENTUM_ONNX)
    if not math.isclose(eps, BN_EPS, rel_tol=1e-6):
        raise ExportError(f"{r.path}: node {node.name!r}: batch norm epsilon {eps:g}; lowmem's is {BN_EPS:g}")
    if not math.isclose(momentum, BN_MOMENTUM_ONNX, rel_tol=1e-6):
        raise ExportError(f"{r.path}: node {node.name!r}: batch norm momentum {momentum:g} (PyTorch's "
                          f"{1 - momentum:g}); lowmem's is PyTorch's default 0.1 (ONNX 0.9)")
    if any(o and r.readers.get(o) for o in node.output[1:]):
        raise ExportError(f"{r.path}: node {node.name!r}: the batch statistics outputs are read by "
                          f"other nodes; lowmem keeps them to itself")
    params = node.input[1:5]
    arrays = [r.const(node, i) for i in range(1, 5)]
    suffixes = (".weight", ".bias", ".running_mean", ".running_var")
    relu = r.only_reader(node.output[0], "Relu")
    if relu is not None:
        t = r.graph.bn_relu(x, name=r.layer_name(node, params, suffixes))
        r.done.add(id(relu))
        out_node = relu
    else:
        if not hasattr(r.nn.Graph, "bn"):
            raise ExportError(f"{r.path}: node {node.name!r}: a BatchNormalization not followed by a Relu "
                              f"is not supported by this lowmem's nn.Graph; supported ops: "
                              f"{', '.join(supported_ops())}")
        t = r.graph.bn(x, name=r.layer_name(node, params, suffixes))
        out_node = node
    for suffix, a in zip(suffixes, arrays):
        r.param(t.name + suffix, a, (x.shape[0],), node)
    r.set(out_node, t)


def _unary(method):
    def handler(r, node):
        r.set(node, getattr(r.graph, method)(r.tensor(node), name=r.layer_name(node)))
    return handler


def _clip(r, node):
    lo, hi = r.const(node, 1), r.const(node, 2)
    lo = _attr(node, "min") if lo is None else float(lo)
    hi = _attr(node, "max") if hi is None else float(hi)
    if lo != 0 or hi != 6:
        raise ExportError(f"{r.path}: node {node.name!r}: Clip({lo}, {hi}); lowmem supports ReLU6, Clip(0, 6)")
    r.set(node, r.graph.relu6(r.tensor(node), name=r.layer_name(node)))


def _add(r, node):
    r.set(node, r.graph.add(r.tensor(node, 0), r.tensor(node, 1), name=r.layer_name(node)))


def _concat(r, node):
    if _attr(node, "axis") != 1:
        raise ExportError(f"{r.path}: node {node.name!r}: Concat on axis {_attr(node, 'axis')}; lowmem "
                          f"concatenates channels (axis 1) only")
    r.set(node, r.graph.concat(*[r.tensor(node, i) for i in range(len(node.input))], name=r.layer_name(node)))


def _maxpool(r, node):
    if len(node.output) > 1 and node.output[1]:
        raise ExportError(f"{r.path}: node {node.name!r}: MaxPool's Indices output is not supported")
    k, stride, pad = _window(r, node, _attr(node, "kernel_shape"))
    r.set(node, r.graph.max_pool(r.tensor(node), k, stride, pad, name=r.layer_name(node)))


def _avgpool(r, node):
    k, stride, pad = _window(r, node, _attr(node, "kernel_shape"))
    if pad and not _attr(node, "count_include_pad", 0):
        raise ExportError(f"{r.path}: node {node.name!r}: AveragePool with padding excluded from the mean "
                          f"(count_include_pad=0); lowmem counts padding (PyTorch's default)")
    r.set(node, r.graph.avg_pool(r.tensor(node), k, stride, pad, name=r.layer_name(node)))


def _identity(r, node):
    r.set(node, r.tensor(node))


def _dropout(r, node):
    ratio = r.const(node, 1)
    ratio = float(_attr(node, "ratio", 0.5) if ratio is None else ratio)
    training = r.const(node, 2)
    if training is None or not bool(training) or ratio == 0:
        return _identity(r, node)                        # eval form: the identity
    if not hasattr(r.nn.Graph, "dropout"):
        raise ExportError(f"{r.path}: node {node.name!r}: op Dropout (training) is not supported by this "
                          f"lowmem's nn.Graph; supported ops: {', '.join(supported_ops())}")
    r.set(node, r.graph.dropout(r.tensor(node), ratio, name=r.layer_name(node)))


def _constant(r, node):
    from onnx import numpy_helper
    value = next((a for a in node.attribute if a.name == "value"), None)
    if value is None:
        raise ExportError(f"{r.path}: node {node.name!r}: a Constant without a tensor value is not supported")
    r.consts[node.output[0]] = numpy_helper.to_array(value.t)


def _global_pool(r, node):
    """GlobalAveragePool -> Flatten -> Gemm, or ReduceMean(H, W) [-> Flatten] -> Gemm, at the end: the head."""
    x = r.tensor(node)
    if node.op_type == "ReduceMean":
        axes = r.const(node, 1) if len(node.input) > 1 else _attr(node, "axes")
        if axes is None or sorted(int(a) % 4 for a in numpy.ravel(axes)) != [2, 3]:
            raise ExportError(f"{r.path}: node {node.name!r}: ReduceMean over axes {axes}; lowmem reads "
                              f"only the global average over H, W (axes 2, 3) before the classifier")
    chain, v = [], node.output[0]
    flat = r.only_reader(v, "Flatten")
    if flat is not None:
        chain.append(flat)
        v = flat.output[0]
    elif node.op_type == "GlobalAveragePool" or _attr(node, "keepdims", 1):
        raise ExportError(f"{r.path}: node {node.name!r} ({node.op_type}): expected Flatten after it, then Gemm")
    gemm = r.only_reader(v, "Gemm")
    if gemm is None or gemm.output[0] not in r.outputs:
        raise ExportError(f"{r.path}: node {node.name!r} ({node.op_type}): a global average pool must feed "
                          f"the classifier (Flatten, Gemm) that writes the graph's output")
    if _attr(gemm, "alpha", 1.0) != 1 or _attr(gemm, "beta", 1.0) != 1 or _attr(gemm, "transA", 0):
        raise ExportError(f"{r.path}: node {gemm.name!r}: Gemm with alpha, beta != 1 or transA is not supported")
    w, b = r.const(gemm, 1), r.const(gemm, 2)
    if not _attr(gemm, "transB", 0):
        w = w.T
    if b is None:
        raise ExportError(f"{r.path}: node {gemm.name!r}: the classifier needs a bias (lowmem's head has one)")
    name = r.layer_name(gemm, (gemm.input[1], gemm.input[2]), (".weight", ".bias")) or "fc"
    r.network = r.graph.head(x, name=name)
    r.param(f"{name}.weight", numpy.ascontiguousarray(w), (r.graph.num_classes, x.shape[0]), gemm)
    r.param(f"{name}.bias", b, (r.graph.num_classes,), gemm)
    r.done.update(id(n) for n in chain + [gemm])


# ONNX op type -> handler; NEEDS: the nn.Graph methods a handler calls (absent: refused, named)
IMPORTS = {"Conv": _conv, "BatchNormalization": _batchnorm, "Relu": _unary("relu"), "Clip": _clip,
           "Add": _add, "Concat": _concat, "MaxPool": _maxpool, "AveragePool": _avgpool,
           "GlobalAveragePool": _global_pool, "ReduceMean": _global_pool, "Identity": _identity,
           "Dropout": _dropout, "Constant": _constant}
NEEDS = {"Conv": ("conv",), "BatchNormalization": ("bn_relu",), "Relu": ("relu",), "Clip": ("relu6",),
         "Add": ("add",), "Concat": ("concat",), "MaxPool": ("max_pool",), "AveragePool": ("avg_pool",),
         "GlobalAveragePool": ("head",), "ReduceMean": ("head",)}


def supported_ops():
    """The ONNX op types this lowmem imports (those whose nn.Graph method exists)."""
    return sorted(op for op in IMPORTS if _Reader._builder_has(op))


def _accepts(fn, *names):
    import inspect
    params = inspect.signature(fn).parameters
    return all(n in params for n in names)


def _input_shape(value, given, path):
    """(C, H, W) of one sample from the graph input's type, or `given` where H, W are symbolic;
    ExportError when the two disagree."""
    dims = value.type.tensor_type.shape.dim
    if len(dims) != 4:
        raise ExportError(f"{path}: the graph input {value.name!r} has {len(dims)} dimensions; expected "
                          f"an image batch (N, C, H, W)")
    fixed = [d.dim_value if d.HasField("dim_value") else None for d in dims[1:]]
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


def _load(path):
    """The checked onnx.ModelProto of `path`; ExportError naming the file otherwise."""
    onnx = _require("onnx", "onnx")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ExportError(f"{path}: no such file")
    try:
        model = onnx.load(path, load_external_data=False)
        onnx.checker.check_model(model)
    except Exception as e:                               # DecodeError, ValidationError, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"{path}: not a readable ONNX model ({first})") from None
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        raise ExportError(f"{path}: weights stored in external data files are not supported; "
                          f"export with the weights inside the .onnx file")
    return model


def file_input_shape(path):
    """(C, H, W) of one sample as the file fixes it; ExportError where H and W are symbolic
    (then the caller must say: --input CxHxW)."""
    model = _load(path)
    inits = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    if len(inputs) != 1:
        raise ExportError(f"{path}: expected one graph input (the image batch), found {len(inputs)}")
    return _input_shape(inputs[0], None, os.fspath(path))


def read_onnx(path, input_shape=None, seed=0):
    """The Network of an ONNX file, its weights loaded (see the module docstring). ExportError
    (a ValueError) naming the file and the problem for anything it cannot read."""
    path = os.fspath(path)
    model = _load(path)
    r = _Reader(model, path, input_shape, seed)
    from ..core.network import NetworkError
    try:
        net = r.run(model.graph.node)
    except NetworkError as e:
        raise ExportError(f"{path}: {e}") from None
    names = [n for n, _, _ in net.param_shapes()] + [n for n, _ in net.stat_shapes()]
    try:
        net.load_state_dict({n: r.weights[n] for n in names})
    except ValueError as e:
        raise ExportError(f"{path}: {e}") from None
    return net
