"""Write your own network: a layer vocabulary over tensor handles, checked as you build.

    from lowmem import nn
    g = nn.Graph("my-net", input_shape=(3, 32, 32), num_classes=10)
    x = g.conv(g.input, 16, 3)                 # Tensor handles, like a PyTorch forward()
    h = g.conv(g.bn_relu(x), 16, 3)
    h = g.conv(g.bn_relu(h), 16, 3)
    x = g.add(x, h)                            # a residual connection
    net = g.head(g.bn_relu(x))                 # global average pool + linear -> lowmem.Network

The vocabulary is what the engine runs (lowmem/core/engine.py):

  conv(x, cout, k, stride=1, pad=(k-1)//2, groups=1, bias=False)
                                             k x k convolution (grouped, depthwise; with a bias)
  bn_relu(x)                                 batch norm (affine) then ReLU: one "unit"
  bn(x)                                      batch norm with no ReLU after it
  relu(x), relu6(x)                          on their own (after an add, say)
  dropout(x, p=0.5)                          inverted dropout (training only)
  concat(a, b, ...)                          channel concatenation
  linear(x, cout, bias=True)                 flatten, then fully connected (before the head)
  max_pool(x, k=2, stride=k, pad=0)          max over k x k windows (k <= 4)
  avg_pool(x, k=2, stride=k, pad=0)          mean over k x k windows (zero padding counted)
  add(a, b)                                  a + b, same shape: the residual add
  head(x, name="fc")                         global average pool, then the linear classifier

Any DAG of these runs: a tensor may feed any number of layers, residual
connections may nest, a conv may read any tensor. `head` returns a
`lowmem.core.network.Network`: the same Layer records the model builders of
lowmem/models.py write by hand, with shared buffers assigned here from
liveness (`assign_buffers`: interval colouring over the forward order, like
a register allocator), so you never name a buffer. On a pre-activation
ResNet that finds the paper's three buffers (act0 / act1 ping-pong, res for
the residual stream); a graph with more tensors alive at once gets more
buffers (act2, ...), each sized by the engine to the largest tensor it holds.
A global average pool exists only inside `head`.

What each layer costs backward follows from what it reads (docs/networks.md):
a conv reading the network input or a bn_relu output keeps nothing (the unit's
saved x-hat rebuilds its input); a conv reading anything else (a pool, an add,
another conv) keeps an exact copy of that tensor, once, whatever the number of
convs reading it.

The rules left are the real ones, each a NetworkError (a ValueError) naming
the layer, raised when the layer is added (or, for how a tensor is used later,
at `head`): arguments and shapes (add needs equal shapes, channels match, an
output at least 1x1), tensors of this graph, unique layer names that clash
with no parameter or exported value, and every output used (the backward
sweep needs a gradient for it). The graph is acyclic by construction (a layer
reads tensors that exist).

`check(net, input_shape)` applies the engine's rules to a Network written
with the low-level methods of lowmem/core/network.py (named buffers), where it
also catches a buffer read before it is written and a layer overwriting its
own input.
"""
import numbers
import sys
from dataclasses import dataclass

import numpy

from .core import liveness
from .core.network import Network, NetworkError
from .ops import conv_out_size
from .core.optable import MAX_POOL_WINDOW, OPS
from .core.schedule import walk
from .formats.onnx_import import read_onnx

RESERVED = ("input", "pool", "fc")    # "pool" and "fc" are the head's layer names
# names the engine and the exports give values of their own: the head's outputs (ONNX "pool.out",
# "feat", "logits", node "flatten"); a layer name ending in a parameter's suffix would equal
# another layer's parameter name (an ONNX value or a safetensors key: "fc.weight")
HEAD_VALUES = ("logits", "feat", "pool.out", "flatten")
PARAM_SUFFIXES = ("weight", "bias", "running_mean", "running_var")


@dataclass(frozen=True, eq=False)
class Tensor:
    """A handle on one activation of a Graph: (C, H, W) per sample, and the layer that made it."""
    graph: object
    index: int
    shape: tuple
    op: str          # "input", or the optable op that made it: "conv", "bnrelu", "maxpool", ...
    name: str        # the producing layer ("input" for the network input)

    def __repr__(self):
        return f"Tensor({self.name!r} ({self.op}), shape={self.shape})"


@dataclass
class _Node:
    op: str
    name: str
    inputs: tuple    # Tensor indices
    out: int         # Tensor index
    args: dict


class Graph:
    """Build a Network from tensor handles; buffers are assigned and rules checked for you.

    name: the network's name; input_shape: (C, H, W) of one sample;
    num_classes: outputs of the head; seed: parameter initialisation (layers
    initialise in the order they are added, as Network's methods do)."""

    def __init__(self, name, input_shape, num_classes, seed=0):
        if not isinstance(name, str) or not name.strip():
            raise NetworkError(f"the network's name must be a non-empty string, got {name!r}")
        if not name.isprintable():          # it stands in one-line messages, logs and run headers
            raise NetworkError(f"the network's name must be printable (no newline or other control "
                               f"character), got {name!r}")
        input_shape = tuple(_number(v) for v in input_shape)
        num_classes = _number(num_classes)
        if len(input_shape) != 3 or not all(_posint(v) for v in input_shape):
            raise NetworkError(f"input_shape must be (C, H, W) of positive ints, got {input_shape!r}")
        if not _posint(num_classes):
            raise NetworkError(f"num_classes must be a positive int, got {num_classes!r}")
        self.name, self.input_shape, self.num_classes, self.seed = name, input_shape, num_classes, seed
        self.tensors = []
        self.nodes = []
        self._names = set()
        self.network = None           # set by head()
        self.input = self._tensor(input_shape, "input", "input")

    # ----------------------------------------------------------- vocabulary
    def conv(self, x, cout, k, stride=1, pad=None, name=None, groups=1, bias=False):
        """k x k convolution of x (C, H, W) to cout channels; He-normal init. groups splits the
        channels into that many independent convs (groups == C == cout: depthwise); bias adds a
        per-channel bias (<name>.bias)."""
        name = self._name(name, "conv")
        self._own(x, name)
        cout, k, stride, pad, groups = (_number(v) for v in (cout, k, stride, pad, groups))
        for what, v, lo in (("cout", cout, 1), ("k", k, 1), ("stride", stride, 1), ("groups", groups, 1)):
            if not _int(v) or v < lo:
                raise NetworkError(f"conv {name!r}: {what} must be an int >= {lo}, got {v!r}")
        pad = (k - 1) // 2 if pad is None else pad
        if not _int(pad) or pad < 0:
            raise NetworkError(f"conv {name!r}: pad must be an int >= 0, got {pad!r}")
        if not isinstance(bias, bool):
            raise NetworkError(f"conv {name!r}: bias must be True or False, got {bias!r}")
        c, h, w = x.shape
        if c % groups or cout % groups:
            raise NetworkError(f"conv {name!r}: groups={groups} must divide its {c} input and {cout} "
                               f"output channels")
        out = (cout, conv_out_size(h, k, stride, pad), conv_out_size(w, k, stride, pad))
        self._check_size(name, x, out)
        args = dict(cin=c, cout=cout, k=k, stride=stride, pad=pad)
        if groups != 1 or bias:
            args.update(groups=groups, bias=bias)
        return self._node("conv", name, (x,), out, args)

    def bn_relu(self, x, name=None):
        """Batch norm (gamma=1, beta=0 at init; running statistics) then ReLU: one BN->ReLU unit."""
        name = self._name(name, "bn")
        self._own(x, name)
        return self._node("bnrelu", name, (x,), x.shape, dict(c=x.shape[0]))

    def bn(self, x, name=None):
        """Batch norm with no ReLU after it (before an add, say): keeps x-hat in float and rstd."""
        name = self._name(name, "bn")
        self._own(x, name)
        return self._node("bn", name, (x,), x.shape, dict(c=x.shape[0]))

    def relu(self, x, name=None):
        """max(x, 0) on its own (after an add, say; bn_relu is the unit for BN then ReLU): keeps a
        1-bit mask."""
        return self._elementwise("relu", "relu", x, name)

    def relu6(self, x, name=None):
        """min(max(x, 0), 6) (MobileNetV2's activation): keeps a 2-bit region code."""
        return self._elementwise("relu6", "relu", x, name)

    def dropout(self, x, p=0.5, name=None):
        """Inverted dropout in training (each element dropped with probability p, the rest scaled
        by 1/(1-p)); the identity in eval. Keeps its 1-bit mask, drawn from the engine's counter
        stream (the same masks after a resume and on every kernel path)."""
        p = _number(p)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
            raise NetworkError(f"dropout: p must be a number in [0, 1), got {p!r}")
        return self._elementwise("dropout", "dropout", x, name, dict(p=float(p)))

    def _elementwise(self, op, prefix, x, name, args=None):
        name = self._name(name, prefix)
        self._own(x, name)
        return self._node(op, name, (x,), x.shape, dict(args or {}))

    def linear(self, x, cout, bias=True, name=None):
        """Flatten x (C, H, W), then a fully connected layer to cout features, as an activation
        (cout, 1, 1) that ReLUs, dropout, more linear layers and the head read (torch's
        nn.Linear on torch.flatten(x, 1): weight (cout, C*H*W), PyTorch's default init)."""
        name = self._name(name, "linear")
        self._own(x, name)
        cout = _number(cout)
        if not _int(cout) or cout < 1:
            raise NetworkError(f"linear {name!r}: cout must be an int >= 1, got {cout!r}")
        if not isinstance(bias, bool):
            raise NetworkError(f"linear {name!r}: bias must be True or False, got {bias!r}")
        return self._node("flatten_linear", name, (x,), (cout, 1, 1),
                          dict(cin=x.shape[0] * x.shape[1] * x.shape[2], cout=cout, bias=bias))

    def concat(self, *xs, name=None):
        """The tensors xs (equal H, W) stacked on the channel axis, in order (DenseNet's blocks)."""
        name = self._name(name, "concat")
        if len(xs) == 1 and isinstance(xs[0], (list, tuple)):
            xs = tuple(xs[0])
        if not xs:
            raise NetworkError(f"concat {name!r}: needs at least one tensor")
        for t in xs:
            self._own(t, name)
        if any(t.shape[1:] != xs[0].shape[1:] for t in xs):
            raise NetworkError(f"concat {name!r}: spatial sizes differ: "
                               f"{', '.join(f'{t.name!r} {t.shape}' for t in xs)}; a channel concat "
                               f"needs equal H, W")
        c = sum(t.shape[0] for t in xs)
        return self._node("concat", name, xs, (c,) + xs[0].shape[1:], dict(cout=c))

    def max_pool(self, x, k=2, stride=None, pad=0, name=None):
        """Max over k x k windows (stride defaults to k), -inf padding; k*k <= 16."""
        return self._pool("maxpool", "max_pool", "pool", x, k, stride, pad, name, max_window=MAX_POOL_WINDOW)

    def avg_pool(self, x, k=2, stride=None, pad=0, name=None):
        """Mean over k x k windows (stride defaults to k); zero padding counts in the mean."""
        return self._pool("avgpool2d", "avg_pool", "avgpool", x, k, stride, pad, name)

    def _pool(self, op, method, prefix, x, k, stride, pad, name, max_window=None):
        """A k x k pooling node (max_pool, avg_pool): the argument checks both share;
        max_window: the largest k*k the op can save (max-pool's 4-bit argmax)."""
        name = self._name(name, prefix)
        self._own(x, name)
        k, stride, pad = (_number(v) for v in (k, stride, pad))
        stride = k if stride is None else stride
        for what, v, lo in (("k", k, 1), ("stride", stride, 1), ("pad", pad, 0)):
            if not _int(v) or v < lo:
                raise NetworkError(f"{method} {name!r}: {what} must be an int >= {lo}, got {v!r}")
        if max_window is not None and k * k > max_window:
            raise NetworkError(f"{method} {name!r}: a {k}x{k} window is too large: the engine saves "
                               f"the argmax as a 4-bit index, so k*k must be <= {max_window} (k <= 4)")
        if pad > k // 2:
            raise NetworkError(f"{method} {name!r}: pad {pad} must be at most k // 2 = {k // 2} "
                               f"(a larger pad makes windows of padding only)")
        c, h, w = x.shape
        out = (c, conv_out_size(h, k, stride, pad), conv_out_size(w, k, stride, pad))
        self._check_size(name, x, out)
        return self._node(op, name, (x,), out, dict(k=k, stride=stride, pad=pad))

    def add(self, a, b, name=None):
        """a + b (same shape): a residual connection (a may be b). The operand computed first
        is the skip (the residual stream)."""
        name = self._name(name, "add")
        self._own(a, name)
        self._own(b, name)
        if a.shape != b.shape:
            raise NetworkError(f"add {name!r}: operand shapes differ: {a.name!r} is {a.shape}, "
                               f"{b.name!r} is {b.shape} (C, H, W); a residual add needs equal shapes "
                               f"(use a strided 1x1 conv as a projection shortcut)")
        skip, branch = (a, b) if a.index < b.index else (b, a)
        return self._node("add", name, (skip, branch), a.shape, {})

    def head(self, x, name="fc"):
        """Finish: global average pool of x, then the linear classifier `name` (parameters
        <name>.weight, <name>.bias; torchvision's DenseNet and MobileNetV2 say "classifier").
        Returns the Network."""
        if self.network is not None:                     # a second head would be a second Network
            raise NetworkError(f"graph {self.name!r} is finished (head() was called); start a new Graph")
        if name != "fc":
            name = self._name(name, "fc")
        self._own(x, "head")
        self._not_input(x, "head", "head")
        self._check_uses(x)
        best = None
        for buf in assign_buffers(self, x):              # the colouring whose buffers cost least
            net = self._records(buf, x, name)
            cost = sum(walk(net, self.input_shape).buffers.values())   # also the engine's rules
            if best is None or cost < best[0]:
                best = (cost, net)
        self.network = best[1]
        return self.network

    def _records(self, buf, x, name):
        """The Network of this graph's nodes with buffers `buf` (tensor index -> buffer)."""
        net = Network(self.name, self.input_shape[0], self.num_classes, self.seed)
        for n in self.nodes:
            src = [buf[i] for i in n.inputs]
            # the Network method named after the op: one src, or every input's buffer in order
            getattr(net, n.op)(n.name, tuple(src) if OPS[n.op].several else src[0], buf[n.out], **n.args)
        net.head(buf[x.index], x.shape[0], name)
        return net

    # -------------------------------------------------------------- helpers
    def _tensor(self, shape, op, name):
        t = Tensor(self, len(self.tensors), tuple(int(v) for v in shape), op, name)
        self.tensors.append(t)
        return t

    def _node(self, op, name, inputs, out_shape, args):
        t = self._tensor(out_shape, op, name)
        self.nodes.append(_Node(op, name, tuple(i.index for i in inputs), t.index, args))
        self._names.add(name)
        return t

    def _name(self, name, prefix):
        return _layer_name(self, name, prefix)

    def _own(self, t, where):
        if not isinstance(t, Tensor):
            raise NetworkError(f"{where}: expected a Tensor of this graph (g.input or a layer's result), "
                               f"got {type(t).__name__}")
        if t.graph is not self:
            raise NetworkError(f"{where}: {t!r} belongs to another Graph ({t.graph.name!r})")

    def _not_input(self, t, what, name):
        if t is self.input:
            raise NetworkError(f"{what} {name!r} reads the network input directly: put a layer "
                               f"(a conv) before it")

    def _check_size(self, name, x, out):
        if min(out) < 1:
            raise NetworkError(f"{name!r}: input {x.shape} is too small, the output would be {out} "
                               f"(input_shape {self.input_shape})")

    def _consumers(self):
        """Tensor index -> [node positions reading it]."""
        uses = {t.index: [] for t in self.tensors}
        for i, n in enumerate(self.nodes):
            for j in n.inputs:
                uses[j].append(i)
        return uses

    def _check_uses(self, x):
        """Every output is used: the backward sweep needs a gradient for it."""
        uses = self._consumers()
        uses[x.index].append(len(self.nodes))            # the head reads x
        for t in self.tensors:
            if not uses[t.index]:
                raise NetworkError(f"the output of {t.op} {t.name!r} {t.shape} is never used: every "
                                   f"layer's output must feed a later layer or the head (backward "
                                   f"needs its gradient)")

    def _label(self, pos):
        return "the head" if pos == len(self.nodes) else f"{self.nodes[pos].op} {self.nodes[pos].name!r}"


def _layer_name(graph, name, prefix):
    """A checked layer name for a new node of graph (a made-up one when name is None)."""
    if graph.network is not None:
        raise NetworkError(f"graph {graph.name!r} is finished (head() was called); start a new Graph")
    if name is None:
        i = 1
        while f"{prefix}{i}" in graph._names:
            i += 1
        return f"{prefix}{i}"
    if not isinstance(name, str) or not name or name.startswith(".") or name.endswith("."):
        raise NetworkError(f"layer name must be a non-empty string without leading or trailing "
                           f"dots, got {name!r}")
    if not name.isprintable():
        raise NetworkError(f"layer name must be printable (no newline or other control character), "
                           f"got {name!r}")
    if name in RESERVED or name in HEAD_VALUES or name.startswith(("pool.", "fc.")):
        raise NetworkError(f"layer name {name!r} is reserved ({', '.join(RESERVED + HEAD_VALUES)} "
                           f"and pool.* / fc.*: the input, the head and its values)")
    if name.rsplit(".", 1)[-1] in PARAM_SUFFIXES:
        raise NetworkError(f"layer name {name!r} ends in a parameter's name (.{name.rsplit('.', 1)[-1]}); "
                           f"it would clash with a layer's parameters ({', '.join(PARAM_SUFFIXES)})")
    unit = {n.name for n in graph.nodes if getattr(OPS.get(n.op), "unit", False)}
    if (name.endswith(".bn") and name[:-3] in unit) or (prefix == "bn" and f"{name}.bn" in graph._names):
        raise NetworkError(f"layer name {name!r} clashes with the batch-norm value of bn_relu "
                           f"{name if prefix == 'bn' else name[:-3]!r} (its export names it <unit>.bn)")
    if name in graph._names:
        raise NetworkError(f"layer name {name!r} is used twice; names key the parameters "
                           f"({name}.weight, ...) and must be unique")
    return name


def assign_buffers(graph, x):
    """Candidate buffer assignments {tensor index: buffer} of a Graph whose head reads x: the
    liveness colourings of lowmem/core/liveness.py over its nodes (Graph.head keeps the one
    whose planned buffers hold least)."""
    return liveness.colourings([(n.op, n.inputs, n.out) for n in graph.nodes], len(graph.tensors), x.index)


# --------------------------------------------------------------------------- check

def check(net, input_shape):
    """Raise NetworkError unless the engine can plan and run `net` on (C, H, W) inputs correctly.

    This is the engine's own walk (schedule.walk, which the Engine runs on every
    network): the layer records themselves (lowmem/core/network.py's named buffers:
    known ops and buffer names, unique names, the head last, each layer reads a
    buffer that was written and does not overwrite its own input unless it may
    run in place), each op's rules from its optable entry (channels, shapes),
    then the backward sweep the way the engine plans it, rejecting an output
    nobody reads (it would have no gradient)."""
    walk(net, tuple(input_shape))


def from_onnx(path, input_shape=None, seed=0):
    """A Network built from an ONNX file (a CNN exported by PyTorch in training mode with batch
    norm kept, or by `lowmem export`), its initializers loaded as the weights; parameter names
    are the initializers' names. input_shape (C, H, W): needed where the file leaves H and W
    symbolic, checked against the file otherwise. Raises ValueError (export.ExportError) with
    one line naming the problem: an unreadable file, an unsupported node (its name, op type
    and the supported ops), a shape the file does not allow. lowmem/formats/onnx_import.py
    (handed this module as its builder, so the reader imports nothing above core/)."""
    return read_onnx(sys.modules[__name__], path, input_shape, seed)


def _number(v):
    """A NumPy integer or float scalar as the Python number of the same value (np.int64(8) -> 8);
    anything else as it is, for the checks to name."""
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return int(v)
    if isinstance(v, numbers.Real) and not isinstance(v, (bool, numpy.bool_)):
        return float(v)
    return v


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _posint(v):
    return _int(v) and v > 0
