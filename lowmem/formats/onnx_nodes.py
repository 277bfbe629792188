"""ONNX in, node by node: each ONNX op type lowmem reads and the nn.Graph call it becomes.

IMPORTS maps an op type to its handler, handler(reader, node): it reads the node's inputs (the
reader's tensors, constants and initializers), calls the builder (reader.graph, an nn.Graph),
records the parameters it loads (reader.param) and maps the node's outputs to the new tensor
(reader.set). NEEDS names the nn.Graph methods a handler calls: an op whose methods this lowmem's
builder lacks is refused by name (supported_ops). The reader, the file checks and the walk are
lowmem/formats/onnx_import.py.
"""
import inspect
import math

import numpy

from .common import ExportError
from ..ops.batchnorm import BN_EPS

ONNX_BN_EPS = 1e-5              # BatchNormalization's epsilon when a node gives none (the ONNX default)
BN_MOMENTUM_ONNX = 0.9          # ONNX's momentum is 1 - PyTorch's (0.1, lowmem's)


# ---------------------------------------------------------------------- attributes

def _attr(node, name, default=None):
    from onnx import helper
    for a in node.attribute:
        if a.name == name:
            v = helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else v
    return default


def _shown(values, limit=4):
    """At most `limit` values of a constant for an error message: a file's constants are its own,
    and a message never echoes a whole array."""
    flat = numpy.ravel(values)
    head = ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in flat[:limit].tolist())
    return f"[{head}]" if flat.size <= limit else f"[{head}, ... ({flat.size} values)]"


def _scalar(r, node, i, what):
    """Input i of the node as one float (a constant of a single value), or None where absent."""
    a = r.const(node, i)
    if a is None:
        return None
    if numpy.size(a) != 1 or numpy.asarray(a).dtype.kind not in "fiub":
        raise ExportError(f"{r.path}: node {node.name!r} ({node.op_type}): its {what} must be a single "
                          f"number; it is a {numpy.asarray(a).dtype} constant of shape {numpy.shape(a)}")
    return float(numpy.ravel(a)[0])


def _window(r, node, kernel):
    """(k, stride, pad) of a square window with equal strides and symmetric, equal pads."""
    k = list(kernel)
    strides = list(_attr(node, "strides", [1] * len(k)))
    pads = list(_attr(node, "pads", [0] * 2 * len(k)))
    dil = list(_attr(node, "dilations", [1] * len(k)))
    problems = []
    if len(k) != 2 or k[0] != k[1]:
        problems.append(f"kernel {_shown(k)} (lowmem's windows are square, 2-D)")
    if len(set(strides)) != 1:
        problems.append(f"strides {_shown(strides)} (must be equal)")
    if len(set(pads)) > 1:
        problems.append(f"pads {_shown(pads)} (must be equal on every side)")
    if any(d != 1 for d in dil):
        problems.append(f"dilations {_shown(dil)} (must be 1)")
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
                          f"is not supported by this lowmem's nn.Graph.conv; supported ops: {', '.join(supported_ops(r.nn.Graph))}")
    t = r.graph.conv(x, int(w.shape[0]), k, stride, pad, name=name, **kwargs)
    r.param(f"{t.name}.weight", w, w.shape, node)
    if bias is not None:
        r.param(f"{t.name}.bias", bias, (w.shape[0],), node)
    r.set(node, t)


def _batchnorm(r, node):
    x = r.tensor(node)
    eps, momentum = _attr(node, "epsilon", ONNX_BN_EPS), _attr(node, "momentum", BN_MOMENTUM_ONNX)
    if not math.isclose(eps, BN_EPS, rel_tol=1e-6):
        raise ExportError(f"{r.path}: node {node.name!r}: batch norm epsilon {eps:.4g}; lowmem's is {BN_EPS:g}")
    if not math.isclose(momentum, BN_MOMENTUM_ONNX, rel_tol=1e-6):
        raise ExportError(f"{r.path}: node {node.name!r}: batch norm momentum {momentum:.4g} (PyTorch's "
                          f"{1 - momentum:.4g}); lowmem's is PyTorch's default 0.1 (ONNX 0.9)")
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
                              f"{', '.join(supported_ops(r.nn.Graph))}")
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
    lo, hi = _scalar(r, node, 1, "lower bound"), _scalar(r, node, 2, "upper bound")
    lo = _attr(node, "min") if lo is None else lo
    hi = _attr(node, "max") if hi is None else hi
    if lo != 0 or hi != 6:
        raise ExportError(f"{r.path}: node {node.name!r}: Clip({lo:g}, {hi:g}); lowmem supports ReLU6, "
                          f"Clip(0, 6)" if lo is not None and hi is not None else
                          f"{r.path}: node {node.name!r}: Clip without both bounds; lowmem supports ReLU6, "
                          f"Clip(0, 6)")
    r.set(node, r.graph.relu6(r.tensor(node), name=r.layer_name(node)))


def _add(r, node):
    r.set(node, r.graph.add(r.tensor(node, 0), r.tensor(node, 1), name=r.layer_name(node)))


def _concat(r, node):
    if _attr(node, "axis") not in (1, -3):               # of an (N, C, H, W) batch: the channels
        raise ExportError(f"{r.path}: node {node.name!r}: Concat on axis {_attr(node, 'axis')}; lowmem "
                          f"concatenates channels (axis 1, or -3) only")
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


def _cast(r, node):
    """A Cast of an activation to a float type: the identity (lowmem computes in the engine's
    dtype). A Cast of a constant never gets here: constant_value folds it."""
    from onnx import TensorProto
    if _attr(node, "to") not in (TensorProto.FLOAT, TensorProto.DOUBLE):
        raise ExportError(f"{r.path}: node {node.name!r}: a Cast of an activation to "
                          f"{_numeric_dtype(r, node, _attr(node, 'to'))} is not supported (lowmem computes "
                          f"in float32 or float64; a Cast of a constant is read as that constant)")
    _identity(r, node)


def _pad(r, node):
    """An all-zero Pad (what exporters write before an AveragePool at opsets 7-9): the identity."""
    pads = r.const(node, 1) if len(node.input) > 1 and node.input[1] else _attr(node, "pads")
    if pads is None or numpy.any(numpy.asarray(pads) != 0):
        raise ExportError(f"{r.path}: node {node.name!r}: Pad with pads "
                          f"{None if pads is None else _shown(pads)} is not supported (lowmem reads an "
                          f"all-zero Pad as the identity; a conv or pool pads by itself)")
    _identity(r, node)


def _dropout_ratio(r, node):
    ratio = _scalar(r, node, 1, "ratio")
    ratio = _attr(node, "ratio", 0.5) if ratio is None else ratio
    return float(str(numpy.float32(ratio)))              # the float32 ratio's shortest decimal: 0.3, not 0.30000001


def _dropout_mask_unread(r, node):
    if len(node.output) > 1 and node.output[1] and r.readers.get(node.output[1]):
        raise ExportError(f"{r.path}: node {node.name!r}: Dropout's mask output is read by other nodes; "
                          f"lowmem keeps its mask to itself")


def _dropout(r, node):
    """Dropout with a ratio > 0 trains as dropout (an inference graph writes it as a no-op there,
    a training-mode one with training_mode = 1: either way the model was trained with it). After a
    Flatten (AlexNet's classifier: Flatten, Dropout, Gemm) it drops the same elements of the
    unflattened tensor, which the linear layer then flattens."""
    ratio = _dropout_ratio(r, node)
    _dropout_mask_unread(r, node)
    if ratio == 0:
        return _identity(r, node)
    r.set(node, r.graph.dropout(r.tensor(node), ratio, name=r.layer_name(node)))


def _constant(r, node):
    """A Constant's value, whichever attribute carries it: value (a tensor), value_float(s),
    value_int(s); a sparse or string value is refused."""
    from onnx import numpy_helper
    a = {a.name: a for a in node.attribute}
    if "value" in a:
        return numpy_helper.to_array(a["value"].t)
    for name, field, dtype in (("value_float", "f", numpy.float32), ("value_floats", "floats", numpy.float32),
                               ("value_int", "i", numpy.int64), ("value_ints", "ints", numpy.int64)):
        if name in a:
            v = getattr(a[name], field)
            return numpy.array(v if numpy.isscalar(v) else list(v), dtype)
    raise ExportError(f"{r.path}: node {node.name!r}: a Constant of {', '.join(a) or 'no value'} is not supported "
                      f"(lowmem reads numbers: value, value_float(s), value_int(s))")


def _numeric_dtype(r, node, to):
    from onnx import helper
    try:
        dtype = numpy.dtype(helper.tensor_dtype_to_np_dtype(to))
    except Exception:                                    # an unknown or non-numpy element type
        dtype = None
    if dtype is None or dtype.kind not in "biuf":
        raise ExportError(f"{r.path}: node {node.name!r}: Cast to element type {to} is not supported "
                          f"(lowmem reads numbers)")
    return dtype


def constant_value(r, node):
    """The value of a node that computes a constant, else None: a Constant, or an Identity or Cast
    of a constant (an initializer, or an earlier such node's value: the reader calls this on every
    node in order). Exporters write bounds as Constant -> Cast -> Clip (F.relu6, torch.clamp) and
    deduplicated weights as Identity(initializer)."""
    if node.op_type == "Constant":
        return _constant(r, node)
    if node.op_type not in ("Identity", "Cast") or not node.input or not (
            node.input[0] in r.inits or node.input[0] in r.consts):
        return None
    a = r.const(node, 0)
    if node.op_type == "Cast":
        a = numpy.asarray(a).astype(_numeric_dtype(r, node, _attr(node, "to")))
    return a


def _global_pool(r, node):
    """GlobalAveragePool -> Flatten -> Gemm, or ReduceMean(H, W) [-> Flatten] -> Gemm, at the end: the head.
    A Dropout on the pooled features (torchvision's MobileNetV2: pool, Flatten, Dropout, Gemm) becomes
    the global pool as one k x k avg_pool window, the dropout on its (C, 1, 1) output, then the head
    (whose global pool over 1 x 1 is the identity)."""
    x = r.tensor(node)
    if node.op_type == "ReduceMean":
        axes = r.const(node, 1) if len(node.input) > 1 else _attr(node, "axes")
        if axes is None or sorted(int(a) % 4 for a in numpy.ravel(axes)) != [2, 3]:
            raise ExportError(f"{r.path}: node {node.name!r}: ReduceMean over axes "
                              f"{None if axes is None else _shown(axes)}; lowmem reads "
                              f"only the global average over H, W (axes 2, 3) before the classifier")
    chain, drops, v = [], [], node.output[0]

    def skip_identities(v):
        """Past Identity and Dropout nodes (a ratio-0 Dropout is the identity; one with a ratio is
        kept in `drops`)."""
        while True:
            nxt = r.only_reader(v, "Identity") or r.only_reader(v, "Dropout")
            if nxt is None:
                return v
            chain.append(nxt)
            if nxt.op_type == "Dropout":
                _dropout_mask_unread(r, nxt)
                if _dropout_ratio(r, nxt) != 0:
                    drops.append(nxt)
            v = nxt.output[0]

    v = skip_identities(v)
    flat = r.only_reader(v, "Flatten")
    if flat is not None:
        chain.append(flat)
        v = skip_identities(flat.output[0])
    gemm = r.only_reader(v, "Gemm")
    if gemm is None or gemm.output[0] not in r.outputs:
        readers = sorted({n.op_type for n in r.readers.get(v, [])})
        inner = None                                  # squeeze-excitation and the like: what reads the pool
        if readers and not set(readers) <= {"Flatten", "Gemm"}:
            inner = ", ".join(readers)
        elif gemm is not None:                        # SENet's gate of linear layers: pool, Flatten, Gemm, ...
            inner = f"{'Flatten, then ' if flat is not None else ''}Gemm {gemm.name!r}, which does not write " \
                    f"the graph's output"
        if inner is not None:
            raise ExportError(f"{r.path}: node {node.name!r} ({node.op_type}): a global average pool inside the "
                              f"network (read by {inner}) is not supported: lowmem pools globally "
                              f"only in its classifier head (pool, Flatten, Gemm writing the graph's output), "
                              f"and has no op for a squeeze-and-excitation gate (Sigmoid, channel-wise Mul)")
        if flat is None and (node.op_type == "GlobalAveragePool" or _attr(node, "keepdims", 1)):
            raise ExportError(f"{r.path}: node {node.name!r} ({node.op_type}): expected Flatten after it, then Gemm")
        raise ExportError(f"{r.path}: node {node.name!r} ({node.op_type}): a global average pool must feed "
                          f"the classifier (Flatten, Gemm) that writes the graph's output")
    if len(drops) > 1:
        raise ExportError(f"{r.path}: nodes {drops[0].name!r} and {drops[1].name!r}: two Dropouts between the "
                          f"global pool and the classifier are not supported (one is)")
    if drops:
        c, h, w = x.shape
        if h != w:
            raise ExportError(f"{r.path}: node {drops[0].name!r}: a Dropout between the global pool and the "
                              f"classifier needs a square feature map there (lowmem writes the pool as one "
                              f"k x k window before the dropout); it is {h} x {w}")
        if h > 1:
            x = r.graph.avg_pool(x, h, h, 0, name=r.layer_name(node))
        x = r.graph.dropout(x, _dropout_ratio(r, drops[0]), name=r.layer_name(drops[0]))
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


def _flatten(r, node):
    """Flatten (axis 1) feeding a Gemm: lowmem's linear layer flattens its input itself, so the
    flattened value is the same tensor (its (c, h, w) order is torch.flatten's)."""
    if _attr(node, "axis", 1) != 1:
        raise ExportError(f"{r.path}: node {node.name!r}: Flatten on axis {_attr(node, 'axis')}; lowmem "
                          f"flattens (C, H, W) per sample (axis 1) only")
    def feeds_gemms(v):                  # through Dropout and Identity, elementwise: the same values
        return all(feeds_gemms(n.output[0]) if n.op_type in ("Dropout", "Identity") else n.op_type == "Gemm"
                   for n in r.readers.get(v, []))
    if not feeds_gemms(node.output[0]):
        raise ExportError(f"{r.path}: node {node.name!r}: a Flatten must feed linear layers (Gemm) only "
                          f"(through Dropout or Identity)")
    r.set(node, r.tensor(node))


def _gemm(r, node):
    """Gemm: a linear layer (flatten + linear) inside the network; the graph's last one, reading a
    (C, 1, 1) tensor, is the head (its global average pool over 1 x 1 is the identity)."""
    x = r.tensor(node)
    if _attr(node, "alpha", 1.0) != 1 or _attr(node, "beta", 1.0) != 1 or _attr(node, "transA", 0):
        raise ExportError(f"{r.path}: node {node.name!r}: Gemm with alpha, beta != 1 or transA is not supported")
    w, b = r.const(node, 1), r.const(node, 2)
    w = numpy.ascontiguousarray(w if _attr(node, "transB", 0) else w.T)
    names = (node.input[1], node.input[2]) if b is not None else (node.input[1],)
    name = r.layer_name(node, names, (".weight", ".bias"))
    if node.output[0] in r.outputs:
        if x.shape[1:] != (1, 1) or b is None:
            raise ExportError(f"{r.path}: node {node.name!r}: the classifier must read a global average pool "
                              f"or a 1 x 1 tensor and have a bias (lowmem's head is a global average pool and "
                              f"a linear layer with bias); it reads {x.shape}")
        name = name or "fc"
        r.network = r.graph.head(x, name=name)
        r.param(f"{name}.weight", w, (r.graph.num_classes, x.shape[0]), node)
        r.param(f"{name}.bias", b, (r.graph.num_classes,), node)
        return
    t = r.graph.linear(x, int(w.shape[0]), bias=b is not None, name=name)
    r.param(f"{t.name}.weight", w, (w.shape[0], x.shape[0] * x.shape[1] * x.shape[2]), node)
    if b is not None:
        r.param(f"{t.name}.bias", b, (w.shape[0],), node)
    r.set(node, t)


def _reshape(r, node):
    """A Reshape of a linear layer's (K, 1, 1) output to (N, K, 1, 1) or (N, K), either way: the same tensor."""
    x, shape = r.tensor(node), r.const(node, 1)
    target = [int(v) for v in numpy.ravel(shape)] if shape is not None else None
    k = x.shape[0]
    fits = target is not None and x.shape[1:] == (1, 1) and len(target) in (2, 4) and \
        target[1] in (k, -1) and all(v == 1 for v in target[2:]) and target[0] in (0, -1)
    if not fits:
        raise ExportError(f"{r.path}: node {node.name!r}: Reshape of {x.shape} to "
                          f"{None if shape is None else _shown(shape)} is not supported "
                          f"(lowmem reads a linear layer's output as (N, K) or (N, K, 1, 1) only)")
    r.set(node, x)


# ONNX op type -> handler; NEEDS: the nn.Graph methods a handler calls (absent: refused, named)
IMPORTS = {"Conv": _conv, "BatchNormalization": _batchnorm, "Relu": _unary("relu"), "Clip": _clip,
           "Add": _add, "Concat": _concat, "MaxPool": _maxpool, "AveragePool": _avgpool,
           "GlobalAveragePool": _global_pool, "ReduceMean": _global_pool, "Identity": _identity,
           "Dropout": _dropout, "Constant": _constant, "Flatten": _flatten, "Gemm": _gemm, "Reshape": _reshape,
           "Cast": _cast, "Pad": _pad}
NEEDS = {"Conv": ("conv",), "BatchNormalization": ("bn_relu",), "Relu": ("relu",), "Clip": ("relu6",),
         "Add": ("add",), "Concat": ("concat",), "MaxPool": ("max_pool",), "AveragePool": ("avg_pool",),
         "GlobalAveragePool": ("head",), "ReduceMean": ("head",), "Dropout": ("dropout",),
         "Flatten": ("linear",), "Gemm": ("linear", "head"), "Reshape": ("linear",)}


def builder_has(graph, op_type):
    """Whether the builder class `graph` (this lowmem's nn.Graph) has the methods the op type's
    handler calls."""
    return all(hasattr(graph, m) for m in NEEDS.get(op_type, ()))


def supported_ops(graph):
    """The ONNX op types this lowmem imports (those whose methods the builder class `graph` has)."""
    return sorted(op for op in IMPORTS if builder_has(graph, op))


def _accepts(fn, *names):
    params = inspect.signature(fn).parameters
    return all(n in params for n in names)
