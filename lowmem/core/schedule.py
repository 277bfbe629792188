"""The schedule: a network's whole training step as an explicit list of steps, and the one
walk over a network that checks it, infers its shapes and plans its buffers.

Each Step carries everything its handler (lowmem/core/optable/) needs: the buffers
it reads and writes, the per-sample shapes, the saved slots it fills (forward)
or reads (backward), the parameter names, and for backward the buffer holding
the output gradient (`dout`), the one receiving the input gradient (`dx`;
`dxs` for an op with several inputs), whether that one already holds a
gradient (`accumulate`) and a free buffer to rebuild or decode into
(`scratch`). The engine (lowmem/core/engine.py) runs the steps in order and
reads nothing else. `print(schedule)` shows them all: the layers, the loss,
the gradient copies and sums the walk inserted, and under data parallelism
the averages over ranks (`schedule.format(max_rows)` summarises a long one).

Buffers: "input" (the planned copy of the batch), the shared buffers the layer
records name (act0, act1, res, ... : any name without a dot), the head's input
slot "<fc>.input" (the network's "feat") and "logits"; gradients reuse the
shared buffers (forward activations are dead by then), then "dlogits" and
"dfeat". `schedule.buffers` is {buffer: per-sample elements}, each buffer
sized to the largest tensor, gradient or scratch it ever holds.

`walk` visits the layer records once forward (each record's rules, the op's
own rules and shape, tensor versions) and once backward, planning gradient
buffers by liveness: tensors are (buffer, version) pairs of the forward pass;
`live` maps each tensor whose gradient exists, but whose producer has not run
backward yet, to the buffer holding that gradient. Several tensors may share
one gradient buffer (an add gives its inputs its output's gradient storage,
no copy); before a step changes a shared gradient for one of them, the walk
gives that one a copy of its own (a `copy` step), and an op that can only
write its input gradient (a pool) writes it into a free buffer that an
`addgrad` step sums in when the input has a gradient already. What each op
does there is its entry's `route`. A network the walk refuses raises
network.NetworkError: `nn.check` is this walk, and the engine runs it on every
network.
"""
from dataclasses import dataclass

from .network import BUFFERS, RESERVED_BUFFERS, NetworkError
from .optable import HEAD, OPS, STEP_ONLY

INPUT = ("input", 0)        # the network input as a tensor


@dataclass
class Step:
    index: int
    phase: str                  # "fwd" | "bwd"
    op: str                     # a key of optable.OPS
    layer: object               # the network.Layer (None for the loss, averages, copies, sums)
    src: str = ""               # fwd: buffer read (average: the plan array averaged; copy, addgrad: the source)
    dst: str = ""               # fwd: buffer written
    in_shape: tuple = ()        # per sample (C, H, W) of the layer's (first) input
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
    in_shapes: tuple = ()       # several inputs: each one's per-sample shape
    dxs: tuple = ()             # bwd, several inputs: ((buffer, accumulate), ...), one per input
    keep: str = ""              # fwd conv: the saved slot its input is copied into
    input_slot: str = ""        # conv: where backward reads its input ("input", a kept slot; "": rebuilt)

    @property
    def name(self):
        return self.layer.name if self.layer is not None else self.op

    def reads(self):
        if self.phase == "fwd":
            if self.layer is not None and OPS[self.op].several:
                return "+".join([self.src] + [b for b in self.layer.reads if b != self.src])
            return self.src
        if self.op in ("copy", "addgrad"):
            return self.src
        parts = [self.dout] + [s.rsplit(".", 1)[-1] if s.endswith((".code", ".xhat")) else s
                               for s in self.saved[:1]]
        if self.unit_saved:
            parts.append(self.unit_saved)
        text = "+".join(p for p in parts if p) or self.src
        return text + (f"->{self.scratch}" if self.scratch else "")

    def writes(self):
        if self.phase == "fwd":
            return self.dst
        if self.dxs:                # an input sharing the output gradient's storage: "(shared)", once
            parts = [b + (" (+=)" if acc else " (shared)" if b == self.dout else "") for b, acc in self.dxs]
            return ", ".join(dict.fromkeys(parts))
        out = [self.dx + (" (+=)" if self.accumulate or self.op == "addgrad" else "")
               + (" (dx, optional)" if self.optional else "")]
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

    Also holds the walk's results: in_shape / out_shape {layer name: per-sample (C, H, W)},
    buffers {shared buffer: per-sample elements it must hold}, users {shared buffer: the
    layers whose forward writes it}, input_grad (the buffer left holding the network
    input's gradient)."""
    HEADER = f"{'step':>5} {'dir':<4} {'op':<8} {'layer':<24} {'reads':<26} {'writes':<20} saved slot"
    in_shape = out_shape = buffers = users = input_grad = None

    def format(self, max_rows=None):
        rows = [str(s) for s in self]
        if max_rows is not None and len(rows) > max_rows:
            k = max_rows // 2
            rows = rows[:k] + [f"  ... {len(rows) - 2 * k} steps ..."] + rows[-k:]
        return "\n".join([self.HEADER] + rows)

    def __str__(self):
        return self.format()

    def buffer_table(self, N=1):
        """The shared buffers: name, elements at batch N, and the layers writing each (forward)."""
        lines = [f"{'buffer':<10} {'elements':>14}  written by (forward)"]
        for b, per in self.buffers.items():
            users = self.users.get(b, [])
            shown = ", ".join(users[:6]) + (f", ... ({len(users)} layers)" if len(users) > 6 else "")
            lines.append(f"{b:<10} {per * N:>14,}  {shown or '(backward only)'}")
        return "\n".join(lines)

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

    def __init__(self, net, decodes, keep_codes=False):
        self.net, self._decodes = net, decodes
        self.keep_codes = keep_codes              # kept conv inputs are codes (decoded into scratch)
        self.shape, self.version = {}, {"input": 0}
        self.tin, self.tout, self.producer, self.tshape = {}, {}, {}, {}
        self.live = {}                           # tensor -> gradient buffer (several may share one)
        self.kept = {}                           # tensor -> the saved slot a conv keeps it in
        self.extra = {}                          # layer -> Step fields its entry's check decided
        self.shape_in, self.shapes_in, self.shape_out = {}, {}, {}
        self.steps, self.io = [], {}             # backward steps; layer -> (src, dst) buffers
        self.written = {}                        # shared buffer -> layers writing it (forward order)
        self.pool = list(BUFFERS)                # the buffers backward may use, in preference order

    def params(self, L):
        specs = self.net._param_specs
        return tuple(n for n in (L.name + ".weight", L.name + ".bias") if n in specs)

    @staticmethod
    def is_unit(L):
        return OPS[L.op].unit

    def decodes(self, L):
        return self._decodes is None or L.name in self._decodes

    def step(self, L, **kw):
        src, dst = self.io[L.name]
        self.steps.append(Step(len(self.steps), "bwd", L.op, L, src=src, in_shape=self.shape_in[L.name],
                               out_shape=self.shape_out[L.name], params=self.params(L),
                               in_shapes=self.shapes_in[L.name], **kw))

    def output_grad(self, L):
        """The buffer holding L's output gradient, which L's backward consumes."""
        if self.tout[L.name] not in self.live:
            raise NetworkError(f"the output of {L.op} {L.name!r} ({L.dst}) is never read before being "
                               f"overwritten or the network ends; every output must feed a later layer")
        return self.live.pop(self.tout[L.name])

    def free(self, L, *busy):
        """A buffer holding no live gradient (and none of `busy`): the first in the pool, or a new one."""
        taken = set(self.live.values()) | set(busy)
        for b in self.pool:
            if b not in taken:
                return b
        k = 0
        while f"act{k}" in self.pool:
            k += 1
        self.pool.append(f"act{k}")
        return f"act{k}"

    def shared(self, buf, t):
        """The live tensors other than t whose gradient is in buf."""
        return [u for u, b in self.live.items() if b == buf and u != t]

    def own(self, L, t, reading=(), busy=()):
        """t's gradient buffer, about to change: first copied into one of its own when another
        tensor's gradient shares it or the step also reads it (`reading`)."""
        buf = self.live[t]
        if self.shared(buf, t) or buf in reading:
            new = self.free(L, buf, *reading, *busy)
            self.steps.append(Step(len(self.steps), "bwd", "copy", None, src=buf, dx=new,
                                   in_shape=self.tshape[t], out_shape=self.tshape[t]))
            self.live[t] = new
        return self.live[t]

    def consumable(self, L, buf):
        """buf, an output gradient L's backward uses as scratch (a BN-ReLU unit masks it in
        place), or a copy of it when another tensor's gradient shares buf."""
        if not self.shared(buf, None):
            return buf
        new = self.free(L, buf)
        shape = self.shape_out[L.name]
        self.steps.append(Step(len(self.steps), "bwd", "copy", None, src=buf, dx=new, in_shape=shape,
                               out_shape=shape))
        return new

    def grad_for(self, L, t, *busy, in_place=None, reading=()):
        """(buffer, accumulate) for the gradient L's backward gives its input t: added to t's
        own when t has one; else over `in_place` (the output gradient, for an op that may
        overwrite it) unless another tensor shares it; else a free buffer."""
        if t in self.live:
            return self.own(L, t, reading, busy), True
        if in_place is not None and not self.shared(in_place, None):
            self.live[t] = in_place
            return in_place, False
        buf = self.live[t] = self.free(L, *busy)
        return buf, False

    def write(self, L, t, *busy, **kw):
        """The step of an op that writes its input gradient (never adds): into a free buffer,
        then an addgrad step sums it into t's gradient if t has one already."""
        tmp = self.free(L, *busy)
        self.step(L, dx=tmp, **kw)
        if t not in self.live:
            self.live[t] = tmp
            return
        target = self.own(L, t, reading=(tmp,), busy=(tmp,))
        self.steps.append(Step(len(self.steps), "bwd", "addgrad", None, src=tmp, dx=target,
                               in_shape=self.tshape[t], out_shape=self.tshape[t]))


def walk(net, input_shape, decodes=None, average_stats=False, average_grads=False, keep_codes=False):
    """The network's Schedule (saved slots not yet named: Schedule.fill_slots), after checking
    every rule; raises NetworkError naming the layer. decodes: the units whose slot is a code
    (they get a scratch buffer; None: all); keep_codes: the inputs convs keep are codes (those
    convs get one too). average_*: data parallel, the mean over ranks of the running
    statistics after forward / of the gradients after backward."""
    w = Walk(net, decodes, keep_codes)
    body, head = _split_head(net)
    feat = f"{head[-1].name}.input"
    w.shape["input"] = w.tshape[INPUT] = tuple(input_shape)
    fwd, names = [], {"input"} | {L.name for L in head}     # the input's and the head's names
    for L in body:
        _check_record(L, names, w)
        _forward(w, L, L.reads, L.dst)
        w.written.setdefault(L.dst, []).append(L.name)
    src = head[0].src
    if src == "input" or w.version.get(src, 0) == 0:
        raise NetworkError(f"the head reads {src}, which no layer wrote")
    if w.shape[src][0] != head[0].cin:
        raise NetworkError(f"the head expects {head[0].cin} channels, {src} holds {w.shape[src][0]}")
    _forward(w, head[0], (src,), feat)
    _forward(w, head[1], (feat,), "logits")
    w.pool += [b for b in w.written if b not in w.pool]
    for L in net.layers:
        fwd.append(Step(len(fwd), "fwd", L.op, L, *w.io[L.name], w.shape_in[L.name], w.shape_out[L.name],
                        params=w.params(L), in_shapes=w.shapes_in[L.name], **w.extra.get(L.name, {})))
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
    steps.buffers, steps.users = _buffer_sizes(steps, w.pool), w.written
    steps.input_grad = w.live.get(INPUT)
    return steps


def _buffer_sizes(steps, pool):
    """{shared buffer: per-sample elements}: the largest tensor, gradient or scratch any step
    puts there (buffers no step uses are left out), in the pool's order."""
    size = dict.fromkeys(pool, 0)

    def use(buf, shape):
        if buf in size and shape:
            size[buf] = max(size[buf], _elems(shape))
    for s in steps:
        if s.phase == "fwd":
            use(s.dst, s.out_shape)
            continue
        use(s.dout, s.out_shape)
        use(s.scratch, s.in_shape)
        use(s.src if s.op in ("copy", "addgrad") else "", s.in_shape)
        for (buf, _), shape in zip(s.dxs or ((s.dx, s.accumulate),), s.in_shapes or (s.in_shape,)):
            use(buf, shape)
    return {b: n for b, n in size.items() if n}


def _elems(shape):
    n = 1
    for v in shape:
        n *= int(v)
    return n


def _forward(w, L, reads, dst):
    """One layer of the forward walk: its op's rules and shape, and the tensor versions."""
    w.io[L.name] = (L.src if L.src in reads else reads[0], dst)
    w.tin[L.name] = tuple((b, w.version[b]) for b in reads)
    shapes = tuple(w.shape[b] for b in reads)
    w.shape_in[L.name], w.shapes_in[L.name] = shapes[0], shapes
    OPS[L.op].check(L, shapes[0], w)
    out = tuple(OPS[L.op].out_shape(L, *shapes))
    if min(out) < 1:
        raise NetworkError(f"input_shape {w.shape['input']} is too small: layer {L.name!r} "
                           f"would produce {out}")
    w.shape_out[L.name] = out
    w.version[dst] = w.version.get(dst, 0) + 1
    w.shape[dst] = out
    w.tout[L.name] = (dst, w.version[dst])
    w.tshape[w.tout[L.name]] = out
    w.producer[w.tout[L.name]] = L


def _split_head(net):
    layers = list(net.layers)
    ops = [L.op for L in layers]
    if tuple(ops[-2:]) != HEAD or any(op in HEAD for op in ops[:-2]):
        raise NetworkError(f"network {net.name!r} must end with exactly one head (Network.head: "
                           f"global average pool, then linear), and have no other "
                           f"{'/'.join(HEAD)} layer")
    return layers[:-2], layers[-2:]


def buffer_name_ok(b):
    """A name a shared buffer may have: a non-empty string without dots, not reserved."""
    return isinstance(b, str) and b and "." not in b and b not in RESERVED_BUFFERS


def _check_record(L, names, w):
    """The rules every layer record obeys, whatever its op."""
    if L.op not in OPS or L.op in HEAD or L.op in STEP_ONLY:
        raise NetworkError(f"layer {L.name!r}: unknown op {L.op!r}")
    if L.name in names:
        raise NetworkError(f"layer name {L.name!r} is used twice or reserved; names must be unique")
    names.add(L.name)
    if not buffer_name_ok(L.dst):
        raise NetworkError(f"layer {L.name!r} writes {L.dst!r}; layers write a shared buffer, a name "
                           f"without dots other than {', '.join(RESERVED_BUFFERS)} (never the input)")
    if bool(L.inputs) != OPS[L.op].several or (L.inputs and L.src not in L.inputs):
        raise NetworkError(f"layer {L.name!r} ({L.op}): its record names its buffers in "
                           f"{'inputs (with src among them)' if OPS[L.op].several else 'src alone'}")
    for b in L.reads:
        if b != "input" and w.version.get(b, 0) == 0:
            raise NetworkError(f"layer {L.name!r} reads {b} before any layer wrote it")
    if L.dst in L.reads and not OPS[L.op].in_place:
        raise NetworkError(f"{L.op} {L.name!r} reads and writes {L.dst}: it cannot run in place "
                           f"(its output has another shape and is written while the input is read)")
