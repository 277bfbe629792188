"""The schedule: a network's whole training step as an explicit list of steps, and the one
walk over a network that checks it, infers its shapes and plans its backward buffers.

Each Step carries everything its handler (lowmem/core/optable.py) needs: the buffers
it reads and writes, the per-sample shapes, the saved slots it fills (forward)
or reads (backward), the parameter names, and for backward the buffer holding
the output gradient (`dout`), the one receiving the input gradient (`dx`),
whether that one already holds a gradient (`accumulate`) and a free buffer to
rebuild or decode into (`scratch`). The engine (lowmem/core/engine.py) runs the
steps in order and reads nothing else. `print(schedule)` shows them all: the
layers, the loss, and under data parallelism the averages over ranks
(`schedule.format(max_rows)` summarises a long one).

Buffers: "input" (the planned copy of the batch), the shared "act0", "act1",
"res", the head's input slot "<fc>.input" (the network's "feat") and
"logits"; gradients reuse act0/act1/res, then "dlogits" and "dfeat".

`walk` visits the layer records once forward (each record's rules, the op's
own rules and shape, tensor versions) and once backward, planning gradient
buffers by liveness: tensors are (buffer, version) pairs of the forward pass;
`live` maps each tensor whose gradient exists, but whose producer has not run
backward yet, to the buffer holding that gradient. A residual add gives both
of its inputs the *same* gradient storage (no copy); the later contribution
to the skip path accumulates into it. What each op does there is its entry's
`route`. A network the walk refuses raises network.NetworkError: `nn.check`
is this walk, and the engine runs it on every network.
"""
from dataclasses import dataclass

from .network import BUFFERS, NetworkError
from .optable import HEAD, OPS, STEP_ONLY

ROLES = ("input",) + BUFFERS


@dataclass
class Step:
    index: int
    phase: str                  # "fwd" | "bwd"
    op: str                     # a key of optable.OPS
    layer: object               # the network.Layer (None for the loss and averages): name, k, stride, pad
    src: str = ""               # fwd: buffer read (average: the plan array averaged)
    dst: str = ""               # fwd: buffer written
    in_shape: tuple = ()        # per sample (C, H, W) of the layer's input
    out_shape: tuple = ()       # ... and output
    saved: tuple = ()           # slot names filled (fwd) or read (bwd)
    saved_bytes: int = 0
    params: tuple = ()          # parameter names (weight, bias)
    dout: str = ""              # bwd: buffer holding the output gradient
    dx: str = ""                # bwd: buffer receiving the input gradient ("" = none)
    accumulate: bool = False    # bwd: dx already holds a gradient: add to it
    scratch: str = ""           # bwd: free buffer for the rebuilt conv input / decoded x-hat
    unit: str = ""              # bwd conv: the BN-ReLU unit whose slot rebuilds the input
    unit_saved: str = ""        # ... that slot's name
    unit_params: tuple = ()     # ... and its gamma, beta
    optional: bool = False      # bwd: dx is the network input's gradient, only on request
    width: str = ""             # bnrelu: its saved slot's width, "4-bit" or "float" (approx, naive)

    @property
    def name(self):
        return self.layer.name if self.layer is not None else self.op

    def reads(self):
        if self.phase == "fwd":
            return f"{self.src}+{self.dst}" if OPS[self.op].reads_dst else self.src
        parts = [self.dout] + [s.rsplit(".", 1)[-1] if s.endswith((".code", ".xhat")) else s
                               for s in self.saved[:1]]
        if self.unit_saved:
            parts.append(self.unit_saved)
        text = "+".join(p for p in parts if p) or self.src
        return text + (f"->{self.scratch}" if self.scratch else "")

    def writes(self):
        if self.phase == "fwd":
            return self.dst
        if self.dx and self.dx == self.dout and not OPS[self.op].unit:
            return f"{self.dx} (shared)"
        out = [self.dx + (" (+=)" if self.accumulate else "") + (" (dx, optional)" if self.optional else "")]
        if self.params and not OPS[self.op].unit:
            out.insert(0, "dW")
        return ", ".join(o for o in out if o)

    def __str__(self):
        saved = ", ".join(self.saved)
        if self.saved_bytes:
            saved += f" ({self.saved_bytes:,} B" + (f", {self.width})" if self.width else ")")
        return (f"{self.index:>5} {self.phase:<4} {self.op:<8} {self.name:<24} "
                f"{self.reads():<26} {self.writes():<20} {saved}")


class Schedule(list):
    """The list of Steps. str() prints every step; format(max_rows) elides the middle.

    Also holds the walk's shapes: in_shape / out_shape {layer name: per-sample (C, H, W)}."""
    HEADER = f"{'step':>5} {'dir':<4} {'op':<8} {'layer':<24} {'reads':<26} {'writes':<20} saved slot"
    in_shape = out_shape = None

    def format(self, max_rows=None):
        rows = [str(s) for s in self]
        if max_rows is not None and len(rows) > max_rows:
            k = max_rows // 2
            rows = rows[:k] + [f"  ... {len(rows) - 2 * k} steps ..."] + rows[-k:]
        return "\n".join([self.HEADER] + rows)

    def __str__(self):
        return self.format()

    def fill_slots(self, saved, nbytes, widths):
        """Name each step's saved slots and their bytes, from the plan: saved {layer: slot
        names}, nbytes {entry: bytes}; widths {unit: "4-bit" | "float" | ""} for printing."""
        for s in self:
            s.saved = tuple(OPS[s.op].slots(s, saved))
            s.saved_bytes = sum(nbytes[x] for x in s.saved)
            s.unit_saved = saved[s.unit][0] if s.unit else ""
            s.width = widths.get(s.name, "") if s.layer is not None else ""


class Walk:
    """The bookkeeping of one walk; the op table's `check` and `route` read and update it."""

    def __init__(self, net, decodes):
        self.net, self._decodes = net, decodes
        self.shape, self.version = {}, dict.fromkeys(ROLES, 0)
        self.tin, self.tout, self.producer, self.skip_of = {}, {}, {}, {}
        self.live, self.shared_by = {}, {}       # tensor -> gradient buffer; buffer -> add sharing it
        self.shape_in, self.shape_out = {}, {}   # layer -> per-sample (C, H, W) of its input, output
        self.steps, self.io = [], {}             # backward steps; layer -> (src, dst) buffers

    def params(self, L):
        specs = self.net._param_specs
        return tuple(n for n in (L.name + ".weight", L.name + ".bias") if n in specs)

    def decodes(self, L):
        return self._decodes is None or L.name in self._decodes

    def step(self, L, **kw):
        src, dst = self.io[L.name]
        self.steps.append(Step(len(self.steps), "bwd", L.op, L, src=src, in_shape=self.shape_in[L.name],
                               out_shape=self.shape_out[L.name], params=self.params(L), **kw))

    def output_grad(self, L):
        """The buffer holding L's output gradient, which L's backward consumes."""
        if self.tout[L.name] not in self.live:
            raise NetworkError(f"the output of {L.op} {L.name!r} ({L.dst}) is never read before being "
                               f"overwritten or the network ends; every output must feed a later layer")
        return self.live.pop(self.tout[L.name])

    def free(self, L, *busy):
        taken = set(self.live.values()) | set(busy)
        for b in BUFFERS:
            if b not in taken:
                return b
        raise NetworkError(f"backward of {L.op} {L.name!r} needs a fourth buffer: three gradients "
                           f"are alive there; restructure so fewer branches are open at once")

    def sharing(self, buf, me):
        return [t for t, b in self.live.items() if b == buf and t != me]

    def no_sum_into_shared(self, L, t):
        if t in self.live and self.sharing(self.live[t], t):
            raise NetworkError(f"{L.op} {L.name!r}: its input also feeds add {self.shared_by[self.live[t]]!r} "
                               f"while the add's other operand is still open in backward; summing its "
                               f"gradient into the shared buffer would corrupt that operand's gradient. "
                               f"Read the skip only before the branch starts")


def walk(net, input_shape, decodes=None, average_stats=False, average_grads=False):
    """The network's Schedule (saved slots not yet named: Schedule.fill_slots), after checking
    every rule; raises NetworkError naming the layer. decodes: the units whose slot is a code
    (they get a scratch buffer; None: all). average_*: data parallel, the mean over ranks of
    the running statistics after forward / of the gradients after backward."""
    w = Walk(net, decodes)
    body, head = _split_head(net)
    feat = f"{head[-1].name}.input"
    w.shape["input"] = tuple(input_shape)
    fwd, names = [], {"input"} | {L.name for L in head}     # the input's and the head's names
    for L in body:
        _check_record(L, names, w.version)
        _forward(w, L, L.src, L.dst)
    src = head[0].src
    if src == "input" or w.version[src] == 0:
        raise NetworkError(f"the head reads {src}, which no layer wrote")
    if w.shape[src][0] != head[0].cin:
        raise NetworkError(f"the head expects {head[0].cin} channels, {src} holds {w.shape[src][0]}")
    _forward(w, head[0], src, feat)
    _forward(w, head[1], feat, "logits")
    for L in net.layers:
        fwd.append(Step(len(fwd), "fwd", L.op, L, *w.io[L.name], w.shape_in[L.name], w.shape_out[L.name],
                        params=w.params(L)))
    if average_stats:
        fwd.append(Step(len(fwd), "fwd", "average", None, src="bn.running"))
    fwd.append(Step(len(fwd), "fwd", "loss", None, src="logits", dst="loss.probs"))
    w.steps.append(Step(0, "bwd", "loss", None, dx="dlogits"))
    for L in reversed(net.layers):
        OPS[L.op].route(L, w)
    if average_grads:
        w.steps.append(Step(0, "bwd", "average", None, src="grads"))
    steps = Schedule(fwd + w.steps)
    for i, s in enumerate(steps):
        s.index = i
    steps.in_shape, steps.out_shape = w.shape_in, w.shape_out
    return steps


def _forward(w, L, src, dst):
    """One layer of the forward walk: its op's rules and shape, and the tensor versions."""
    w.io[L.name] = (src, dst)
    w.version.setdefault(dst, 0)
    t = (src, w.version[src])
    c, h, wd = w.shape[src]
    w.tin[L.name] = t
    OPS[L.op].check(L, (c, h, wd), w)
    out = tuple(OPS[L.op].out_shape(L, (c, h, wd)))
    if min(out) < 1:
        raise NetworkError(f"input_shape {w.shape['input']} is too small: layer {L.name!r} "
                           f"would produce {out}")
    w.shape_in[L.name], w.shape_out[L.name] = (c, h, wd), out
    w.version[dst] += 1
    w.shape[dst] = out
    w.tout[L.name] = (dst, w.version[dst])
    w.producer[w.tout[L.name]] = L


def _split_head(net):
    layers = list(net.layers)
    ops = [L.op for L in layers]
    if tuple(ops[-2:]) != HEAD or any(op in HEAD for op in ops[:-2]):
        raise NetworkError(f"network {net.name!r} must end with exactly one head (Network.head: "
                           f"global average pool, then linear), and have no other "
                           f"{'/'.join(HEAD)} layer")
    return layers[:-2], layers[-2:]


def _check_record(L, names, version):
    """The rules every layer record obeys, whatever its op."""
    if L.op not in OPS or L.op in HEAD or L.op in STEP_ONLY:
        raise NetworkError(f"layer {L.name!r}: unknown op {L.op!r}")
    if L.name in names:
        raise NetworkError(f"layer name {L.name!r} is used twice or reserved; names must be unique")
    names.add(L.name)
    if L.src not in ROLES or L.dst not in BUFFERS:
        raise NetworkError(f"layer {L.name!r}: reads {L.src!r} and writes {L.dst!r}; layers read "
                           f"{', '.join(ROLES)} and write {', '.join(BUFFERS)} (never the input)")
    if L.src != "input" and version[L.src] == 0:
        raise NetworkError(f"layer {L.name!r} reads {L.src} before any layer wrote it")
    if L.src == "input" and not OPS[L.op].reads_input:
        raise NetworkError(f"{L.op} {L.name!r} reads the network input, which may feed convs only")
    if L.src == L.dst and not OPS[L.op].in_place:
        raise NetworkError(f"{L.op} {L.name!r} reads and writes {L.src}: it cannot run in place "
                           f"(its output has another shape and is written while the input is read)")
