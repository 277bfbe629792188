"""The network description: parameters, BN statistics and an ordered layer list.

A `Network` is data, not code: a list of `Layer` records in forward order,
each naming the buffer(s) it reads (`src`, or `inputs` for an op with several)
and the buffer it writes (`dst`) — "input" (the network input's planned slot)
or any buffer name (no dot: "act0", "act1", "res", ...) — plus the parameters
it owns. A buffer is a shared, planned array: a layer reading it reads the
tensor written there last, so the records themselves say which tensors are
reused when (lowmem.nn.Graph assigns them from liveness; the hand-written
pre-activation ResNets of lowmem/models.py use act0/act1 ping-pong and res
for the residual stream). The network holds no activations and no saved
state: the engine (lowmem/core/engine.py) turns it into a schedule and a
memory plan, each buffer sized to the largest tensor it ever holds.

Layer ops: conv (groups, bias), bnrelu, bn, relu, relu6, dropout, add, concat,
maxpool, avgpool2d, and the head's avgpool (global) and linear; what each does
is its entry in lowmem/core/optable/.
`nn.check(net, input_shape)` says whether the engine can run a Network
(the engine runs the same check on every network it is given).

`network_records(net)` is the architecture as plain JSON data (the Layer records, no
weights) and `network_from_records` builds the same Network from it, every value checked: what
a checkpoint and an export keep of a network read from an ONNX file.

Weights are declared with their shapes while the network is built and drawn
(seeded, in declaration order) only when first used, so the memory plan of
any depth can be computed without building a single weight.
"""
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy

from ..system.backend import to_numpy

BUFFERS = ("act0", "act1", "res")     # the pre-activation layout's buffers (ping-pong, residual stream)
# plan and schedule names no buffer may take (the input slot, the head's arrays, flat plan arrays)
RESERVED_BUFFERS = ("input", "labels", "logits", "dlogits", "dfeat", "feat", "grads")


class NetworkError(ValueError):
    """A network the engine cannot run (or would run wrongly); the message says which layer and why."""


@dataclass(eq=False)
class Parameter:
    """A trainable tensor: `.data`, `.grad` (same shape) and optimizer `.state`.

    `decay` says whether weight decay applies by default (conv and linear
    weights: yes; BN gamma/beta and biases: no)."""
    name: str
    data: object
    grad: object = None
    decay: bool = True
    state: dict = field(default_factory=dict)

    @property
    def shape(self):
        return tuple(self.data.shape)

    def __repr__(self):
        return f"Parameter({self.name!r}, shape={self.shape})"


@dataclass
class Layer:
    op: str            # a key of optable.OPS: conv | bnrelu | bn | relu | relu6 | dropout | add | concat | ...
    name: str
    src: str
    dst: str
    k: int = 1         # kernel size (conv, pools)
    stride: int = 1
    pad: int = 0
    cin: int = 0
    cout: int = 0
    inputs: tuple = ()  # an op with several inputs (add, concat): every buffer it reads, in order
    groups: int = 1     # conv: channel groups (cin == groups: depthwise)
    bias: bool = False  # conv: has a bias (<name>.bias)
    p: float = 0.0      # dropout: the probability of dropping an element

    @property
    def reads(self):
        """The buffers this layer reads, in order (its inputs; `src` alone for a one-input op)."""
        return self.inputs or (self.src,)


class Network:
    """Layers in forward order plus their parameters (forward order, stable names)."""

    def __init__(self, name, in_channels, num_classes, seed=0):
        self.name = name
        self.in_channels = in_channels
        self.num_classes = num_classes
        self.layers = []
        # Parameters and statistics are declared (name -> shape) while building and
        # drawn only when first used, in declaration order from one seeded generator:
        # a plan (Engine(..., allocate=False), `lowmem plan`) never builds a weight.
        self._param_specs = {}  # name -> (shape, decay, init(rng, shape) -> float32 array)
        self._stat_specs = {}   # name -> (shape, fill value)
        self._params = {}       # name -> Parameter, in forward order (as drawn)
        self._stats = {}        # name -> array: BN running mean / var
        self._rng = numpy.random.default_rng(seed)

    # -- building ---------------------------------------------------------
    def _param(self, name, shape, decay, init):
        if name in self._param_specs:
            raise ValueError(f"network {self.name!r}: parameter {name!r} declared twice")
        self._param_specs[name] = (tuple(int(s) for s in shape), decay, init)

    def conv(self, name, src, dst, cin, cout, k, stride=1, pad=None, groups=1, bias=False):
        """k x k convolution; groups splits the channels (cin == groups: depthwise); bias adds
        <name>.bias (PyTorch's default init, uniform +-1/sqrt(fan-in), no weight decay)."""
        pad = (k - 1) // 2 if pad is None else pad
        fan_in = (cin // groups) * k * k
        std = numpy.sqrt(2.0 / fan_in)                 # He et al. (fan-in, ReLU)
        self._param(name + ".weight", (cout, cin // groups, k, k), True,
                    lambda rng, shape: (rng.standard_normal(shape) * std).astype(numpy.float32))
        if bias:
            bound = 1.0 / numpy.sqrt(fan_in)
            self._param(name + ".bias", (cout,), False,
                        lambda rng, shape: rng.uniform(-bound, bound, shape).astype(numpy.float32))
        self.layers.append(Layer("conv", name, src, dst, k, stride, pad, cin, cout, groups=groups, bias=bool(bias)))

    def bnrelu(self, name, src, dst, c):
        self._bn_params(name, c)
        self.layers.append(Layer("bnrelu", name, src, dst, cin=c, cout=c))

    def bn(self, name, src, dst, c):
        """Batch norm with no ReLU after it (gamma=1, beta=0 at init; running statistics)."""
        self._bn_params(name, c)
        self.layers.append(Layer("bn", name, src, dst, cin=c, cout=c))

    def _bn_params(self, name, c):
        self._param(name + ".weight", (c,), False, lambda rng, shape: numpy.ones(shape, numpy.float32))   # gamma
        self._param(name + ".bias", (c,), False, lambda rng, shape: numpy.zeros(shape, numpy.float32))    # beta
        self._stat_specs[name + ".running_mean"] = ((c,), 0.0)
        self._stat_specs[name + ".running_var"] = ((c,), 1.0)

    def relu(self, name, src, dst):
        """max(x, 0) on its own (not after a batch norm): keeps a 1-bit mask."""
        self.layers.append(Layer("relu", name, src, dst))

    def relu6(self, name, src, dst):
        """min(max(x, 0), 6): keeps a 2-bit region code."""
        self.layers.append(Layer("relu6", name, src, dst))

    def dropout(self, name, src, dst, p=0.5):
        """Inverted dropout (training only): keeps its 1-bit mask, drawn from the engine's stream."""
        self.layers.append(Layer("dropout", name, src, dst, p=float(p)))

    def flatten_linear(self, name, src, dst, cin, cout, bias=True):
        """Flatten src (cin = C*H*W features), then a fully connected layer to cout features (a
        (cout, 1, 1) activation); PyTorch's nn.Linear init (uniform +-1/sqrt(cin))."""
        bound = 1.0 / numpy.sqrt(cin)

        def uniform(rng, shape):
            return rng.uniform(-bound, bound, shape).astype(numpy.float32)
        self._param(name + ".weight", (cout, cin), True, uniform)
        if bias:
            self._param(name + ".bias", (cout,), False, uniform)
        self.layers.append(Layer("flatten_linear", name, src, dst, cin=cin, cout=cout, bias=bool(bias)))

    def concat(self, name, srcs, dst, cout=0):
        """dst = srcs stacked on the channel axis, in order (cout: their channels in all, checked)."""
        srcs = tuple(srcs)
        self.layers.append(Layer("concat", name, srcs[0], dst, cout=cout, inputs=srcs))

    def add(self, name, src, dst="res", skip=None):
        """dst = skip + src, the residual add; skip defaults to dst (dst += src, in place); src
        may also be the pair (skip, src).

        The layer's inputs are (skip, src): dst may be either of them (in place) or another buffer."""
        if isinstance(src, tuple):
            skip, src = src
        skip = dst if skip is None else skip
        self.layers.append(Layer("add", name, src, dst, inputs=(skip, src)))

    def maxpool(self, name, src, dst, k=3, stride=2, pad=1):
        self.layers.append(Layer("maxpool", name, src, dst, k, stride, pad))

    def avgpool2d(self, name, src, dst, k=2, stride=None, pad=0):
        """Mean over k x k windows (stride defaults to k); zero padding counts in the mean."""
        self.layers.append(Layer("avgpool2d", name, src, dst, k, k if stride is None else stride, pad))

    def head(self, src, c, name="fc"):
        """Global average pool, then the fully connected classifier `name` (PyTorch's init;
        parameters <name>.weight, <name>.bias)."""
        bound = 1.0 / numpy.sqrt(c)

        def uniform(rng, shape):
            return rng.uniform(-bound, bound, shape).astype(numpy.float32)

        self.layers.append(Layer("avgpool", "pool", src, "feat", cin=c, cout=c))
        self._param(name + ".weight", (self.num_classes, c), True, uniform)
        self._param(name + ".bias", (self.num_classes,), False, uniform)
        self.layers.append(Layer("linear", name, "feat", "logits", cin=c, cout=self.num_classes))

    # -- using ------------------------------------------------------------
    @property
    def params(self):
        """name -> Parameter, in forward order (draws any parameter not drawn yet).

        O(1) once every declared parameter is drawn: only a new declaration walks the specs."""
        if len(self._params) < len(self._param_specs):
            self._draw()
        return self._params

    def _draw(self):
        for name, (shape, decay, init) in self._param_specs.items():
            if name not in self._params:
                self._params[name] = Parameter(name, init(self._rng, shape), decay=decay)

    @property
    def stats(self):
        """name -> array: the BN running statistics (mean 0, variance 1 when new)."""
        if len(self._stats) == len(self._stat_specs):
            return self._stats
        for name, (shape, value) in self._stat_specs.items():
            if name not in self._stats:
                self._stats[name] = numpy.full(shape, value, numpy.float32)
        return self._stats

    def param_shapes(self):
        """[(name, shape, decay)] in forward order, without drawing any weight."""
        return [(n, shape, decay) for n, (shape, decay, _) in self._param_specs.items()]

    def stat_shapes(self):
        """[(name, shape)] of the BN running statistics, without building them."""
        return [(n, shape) for n, (shape, _) in self._stat_specs.items()]

    def parameters(self):
        """All Parameters in forward order."""
        return list(self.params.values())

    def num_params(self):
        return sum(int(numpy.prod(shape)) for _, shape, _ in self.param_shapes())

    def state_dict(self):
        """name -> host NumPy copy, for parameters and BN running statistics."""
        d = {n: to_numpy(p.data).copy() for n, p in self.params.items()}
        d.update({n: to_numpy(a).copy() for n, a in self.stats.items()})
        return d

    def load_state_dict(self, d):
        """Copy values in place; names and shapes must match exactly.

        Every value must be a real floating-point array (an integer, bool or
        complex array is refused rather than silently cast), finite after the
        cast to the network's dtype, and a running variance must be >= 0.
        Everything is checked before anything is copied: a refused load
        changes nothing. TypeError when `d` is not a mapping, ValueError
        naming the entry otherwise."""
        if not isinstance(d, Mapping):
            raise TypeError(f"load_state_dict expects a dict name -> array (what state_dict() returns), "
                            f"got {type(d).__name__}")
        expected = {n: shape for n, shape, _ in self.param_shapes()}
        expected.update(self.stat_shapes())
        missing = [n for n in expected if n not in d]
        extra = [n for n in d if n not in expected]
        if missing or extra:
            raise ValueError(f"state_dict does not match network {self.name!r}: "
                             f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                             f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}")
        for n, shape in expected.items():
            if tuple(numpy.shape(d[n])) != shape:
                raise ValueError(f"state_dict entry {n!r} has shape {tuple(numpy.shape(d[n]))}, "
                                 f"network {self.name!r} expects {shape}")
        targets = {n: p.data for n, p in self.params.items()}
        targets.update(self.stats)
        values = {n: _like(t, d[n], n) for n, t in targets.items()}      # checked copies, then assign
        for n, t in targets.items():
            t[...] = values[n]

    def __repr__(self):
        return f"Network({self.name!r}, layers={len(self.layers)}, params={self.num_params():,})"


def _like(target, value, name):
    """`value` as an array of target's module and dtype (host -> device when needed), after
    checking it: a real floating-point dtype, finite once cast, >= 0 for a running variance."""
    dtype = numpy.dtype(value.dtype) if hasattr(value, "dtype") else numpy.asarray(value).dtype
    if dtype.kind != "f":
        what = {"i": "an integer", "u": "an unsigned integer", "b": "a bool",
                "c": "a complex"}.get(dtype.kind, "a non-numeric")
        raise ValueError(f"state_dict entry {name!r} is {what} array ({dtype}): "
                         f"expected floating-point values")
    if hasattr(target, "device") and not isinstance(target, numpy.ndarray):
        import cupy
        xp, out = cupy, cupy.asarray(value, dtype=target.dtype)
    else:
        with numpy.errstate(over="ignore"):             # an overflow to inf is reported below
            xp, out = numpy, numpy.asarray(to_numpy(value), dtype=target.dtype)
    if not bool(xp.isfinite(out).all()):
        raise ValueError(f"state_dict entry {name!r} holds NaN or inf (after conversion to "
                         f"{target.dtype}): refusing to load non-finite values")
    if name.endswith(".running_var") and out.size and float(out.min()) < 0:
        raise ValueError(f"state_dict entry {name!r} has a negative running variance "
                         f"(min {float(out.min()):g}): variances are >= 0")
    return out


# --------------------------------------------------------------------- records

# the layer methods a record may name, and the Layer fields each takes after (name, src, dst)
REBUILT_BY = {"conv": ("cin", "cout", "k", "stride", "pad", "groups", "bias"), "bnrelu": ("cin",), "bn": ("cin",),
              "relu": (), "relu6": (), "dropout": ("p",), "flatten_linear": ("cin", "cout", "bias"),
              "maxpool": ("k", "stride", "pad"), "avgpool2d": ("k", "stride", "pad")}
_TYPE_WORDS = {str: "a string", int: "an integer", float: "a number", bool: "True or False", list: "a list of names"}
_FIELD_TYPES = {"op": str, "name": str, "src": str, "dst": str, "k": int, "stride": int, "pad": int, "cin": int,
                "cout": int, "inputs": list, "groups": int, "bias": bool, "p": float}


def network_records(net):
    """The architecture of `net` as plain JSON data: its name, input channels, classes and every
    Layer record (buffers included), no weights. network_from_records builds the same Network
    from it: what a checkpoint and an export keep of a network read from an ONNX file, so the
    run never depends on that file again."""
    layers = []
    for L in net.layers:
        d = {k: getattr(L, k) for k in _FIELD_TYPES}
        d["inputs"] = list(L.inputs)
        layers.append(d)
    return {"name": net.name, "in_channels": net.in_channels, "num_classes": net.num_classes, "layers": layers}


def network_from_records(records, seed=0):
    """The Network network_records wrote (weights drawn from `seed`: load them after). Every value
    is checked (a file's records are not trusted): ValueError (NetworkError) naming the first that
    is not what a network_records record holds; the engine's walk then checks the network."""
    def bad(what):
        return NetworkError(f"network records: {what}")

    if not isinstance(records, dict) or set(records) != {"name", "in_channels", "num_classes", "layers"}:
        raise bad("expected an object of name, in_channels, num_classes and layers")
    name, cin, classes, layers = (records[k] for k in ("name", "in_channels", "num_classes", "layers"))
    if not (isinstance(name, str) and name.strip()):
        raise bad(f"name {name!r} is not a non-empty string")
    for what, v in (("in_channels", cin), ("num_classes", classes)):
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise bad(f"{what} {v!r} is not a positive integer")
    if not (isinstance(layers, list) and len(layers) >= 2):
        raise bad("layers is not a list ending in the head")
    want = []
    for i, d in enumerate(layers):
        if not (isinstance(d, dict) and set(d) == set(_FIELD_TYPES)):
            raise bad(f"layer {i} is not an object of {', '.join(_FIELD_TYPES)}")
        for k, t in _FIELD_TYPES.items():
            v = d[k]
            ok = (isinstance(v, (int, float)) and not isinstance(v, bool) if t is float else
                  isinstance(v, int) and not isinstance(v, bool) if t is int else isinstance(v, t))
            if not ok or (t is list and not all(isinstance(s, str) for s in v)):
                raise bad(f"layer {i}: {k} {v!r} is not {_TYPE_WORDS[t]}")
        want.append(Layer(**{**d, "inputs": tuple(d["inputs"]), "p": float(d["p"])}))
    net = Network(name, cin, classes, seed)
    *body, pool, fc = want
    for L in body:
        if L.op in REBUILT_BY:
            getattr(net, L.op)(L.name, L.src, L.dst, *(getattr(L, k) for k in REBUILT_BY[L.op]))
        elif L.op == "concat":
            net.concat(L.name, L.inputs, L.dst, L.cout)
        elif L.op == "add" and len(L.inputs) == 2:
            net.add(L.name, L.inputs, L.dst)
        else:
            raise bad(f"layer {L.name!r}: op {L.op!r} is not a layer of the network's body")
    if (pool.op, fc.op) != ("avgpool", "linear"):
        raise bad("the last two layers are not the head (avgpool, linear)")
    net.head(pool.src, pool.cin, fc.name)
    if net.layers != want:                      # fields the methods derive (an add's src, ...) must agree
        i = next(i for i, (a, b) in enumerate(zip(net.layers, want)) if a != b)
        raise bad(f"layer {want[i].name!r} is not one a network of these layers holds")
    return net
