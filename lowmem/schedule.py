"""The schedule: a network's forward and backward sweeps as an explicit list of steps.

Each Step carries everything its handler (lowmem/layers.py) needs: the buffers
it reads and writes, the per-sample shapes, the saved slots it fills (forward)
or reads (backward), the parameter names, and for backward the buffer holding
the output gradient (`dout`), the one receiving the input gradient (`dest`),
whether that one already holds a gradient (`accumulate`) and a free buffer to
rebuild or decode into (`scratch`). The executor (lowmem/engine.py) runs the
steps in order and reads nothing else. `print(schedule)` shows them all
(`schedule.format(max_rows)` summarises a long one).

Buffers: "input" (the planned copy of the batch), the shared "act0", "act1",
"res", the head's input slot "<fc>.input" (the network's "feat") and
"logits"; gradients reuse act0/act1/res, then "dlogits" and "dfeat".

Backward buffer assignment (`plan_backward`) is decided once, by liveness:
tensors are (buffer, version) pairs of the forward pass; `live` maps each
tensor whose gradient exists, but whose producer has not run backward yet,
to the buffer holding that gradient. A residual add gives both of its inputs
the *same* gradient storage (no copy); the later contribution to the skip
path accumulates into it.
"""
from dataclasses import dataclass

from .layers import OPS

BUFFERS = ("act0", "act1", "res")


@dataclass
class Step:
    index: int
    phase: str                  # "fwd" | "bwd"
    op: str                     # a key of layers.OPS, or "loss"
    layer: object               # the network.Layer (None for the loss): name, k, stride, pad
    src: str = ""               # fwd: buffer read
    dst: str = ""               # fwd: buffer written
    in_shape: tuple = ()        # per sample (C, H, W) of the layer's input
    out_shape: tuple = ()       # ... and output
    saved: tuple = ()           # slot names filled (fwd) or read (bwd)
    saved_bytes: int = 0
    params: tuple = ()          # parameter names (weight, bias)
    dout: str = ""              # bwd: buffer holding the output gradient
    dest: str = ""              # bwd: buffer receiving the input gradient ("" = none)
    accumulate: bool = False    # bwd: dest already holds a gradient: add to it
    scratch: str = ""           # bwd: free buffer for the rebuilt conv input / decoded x-hat
    unit: str = ""              # bwd conv: the BN-ReLU unit whose slot rebuilds the input
    unit_saved: str = ""        # ... that slot's name
    unit_params: tuple = ()     # ... and its gamma, beta
    optional: bool = False      # bwd: dest is the network input's gradient, only on request
    width: str = ""             # bnrelu: its saved slot's width, "4-bit" or "float" (approx, naive)

    @property
    def name(self):
        return self.layer.name if self.layer is not None else "loss"

    def reads(self):
        if self.phase == "fwd":
            return f"{self.src}+{self.dst}" if self.op == "add" else self.src
        parts = [self.dout] + [s.rsplit(".", 1)[-1] if s.endswith((".code", ".xhat")) else s
                               for s in self.saved[:1]]
        if self.unit_saved:
            parts.append(self.unit_saved)
        text = "+".join(p for p in parts if p)
        return text + (f"->{self.scratch}" if self.scratch else "")

    def writes(self):
        if self.phase == "fwd":
            return self.dst
        out = [self.dest + (" (+=)" if self.accumulate else "") + (" (dx, optional)" if self.optional else "")]
        if self.params and self.op in ("conv", "linear"):
            out.insert(0, "dW")
        if self.op == "add":
            out = [f"{self.dest} (shared)"]
        return ", ".join(o for o in out if o)

    def __str__(self):
        saved = ", ".join(self.saved)
        if self.saved_bytes:
            saved += f" ({self.saved_bytes:,} B" + (f", {self.width})" if self.width else ")")
        return (f"{self.index:>5} {self.phase:<4} {self.op:<8} {self.name:<24} "
                f"{self.reads():<26} {self.writes():<20} {saved}")


class Schedule(list):
    """The list of Steps. str() prints every step; format(max_rows) elides the middle."""
    HEADER = f"{'step':>5} {'dir':<4} {'op':<8} {'layer':<24} {'reads':<26} {'writes':<20} saved slot"

    def format(self, max_rows=None):
        rows = [str(s) for s in self]
        if max_rows is not None and len(rows) > max_rows:
            k = max_rows // 2
            rows = rows[:k] + [f"  ... {len(rows) - 2 * k} steps ..."] + rows[-k:]
        return "\n".join([self.HEADER] + rows)

    def __str__(self):
        return self.format()


def resolve(net):
    """{layer name: (src, dst)} with the head's "feat" named after its slot, "<fc>.input"."""
    head = [L for L in net.layers if L.op == "linear"]
    feat = f"{head[-1].name}.input" if head else "feat"
    rename = {"feat": feat}
    return {L.name: (rename.get(L.src, L.src), rename.get(L.dst, L.dst)) for L in net.layers}


def forward_steps(net, io, in_shape, out_shape, saved, nbytes):
    """One Step per layer, then the loss. saved: {layer name: [slot names]}; nbytes: {slot: bytes}."""
    steps = []
    for L in net.layers:
        src, dst = io[L.name]
        slots = tuple(saved.get(L.name, ()))
        if L.op == "avgpool":
            slots = (dst,)                   # fills the head's saved input
        elif L.op == "linear":
            slots = ()                       # reads it
        steps.append(Step(len(steps), "fwd", L.op, L, src, dst, in_shape[L.name], out_shape[L.name],
                          slots, sum(nbytes[s] for s in slots), params=_params(net, L)))
    steps.append(Step(len(steps), "fwd", "loss", None, "logits", "loss.probs", saved=("loss.probs",),
                      saved_bytes=nbytes["loss.probs"]))
    return steps


def _params(net, L):
    names = (L.name + ".weight", L.name + ".bias")
    return tuple(n for n in names if n in net._param_specs)


def plan_backward(net, io, in_shape, out_shape, saved, nbytes, decodes, start):
    """The backward Steps, numbered from `start`. decodes: the names of the BN-ReLU units whose
    slot holds a code; each gets a scratch buffer to decode x-tilde into (reference kernels)."""
    version = {"input": 0, "act0": 0, "act1": 0, "res": 0}
    tin, tout, producer = {}, {}, {}
    for L in net.layers:
        src, dst = io[L.name]
        version.setdefault(src, 0)
        version.setdefault(dst, 0)
        tin[L.name] = (src, version[src])
        if L.op == "add":
            tin[L.name + "/skip"] = (dst, version[dst])
        version[dst] += 1
        tout[L.name] = (dst, version[dst])
        producer[tout[L.name]] = L

    live, steps = {}, []

    def free(*busy):
        taken = set(live.values()) | set(busy)
        for b in BUFFERS:
            if b not in taken:
                return b
        raise AssertionError("backward planning ran out of buffers")

    def add(op, L, **kw):
        steps.append(Step(start + len(steps), "bwd", op, L, **kw))

    add("loss", None, dest="dlogits", saved=("loss.probs",), saved_bytes=nbytes["loss.probs"])
    for L in reversed(net.layers):
        src, dst = io[L.name]
        shapes = dict(src=src, in_shape=in_shape[L.name], out_shape=out_shape[L.name], params=_params(net, L))
        slots = tuple(saved.get(L.name, ()))
        t = tin[L.name]
        if L.op == "linear":
            add("linear", L, dout="dlogits", dest="dfeat", saved=(src,), saved_bytes=nbytes[src], **shapes)
            continue
        if L.op == "avgpool":
            dest = free()
            live[t] = dest
            add("avgpool", L, dout="dfeat", dest=dest, **shapes)
            continue
        dout = live.pop(tout[L.name])
        rule = OPS[L.op].grad
        if rule == "shared":
            skip = tin[L.name + "/skip"]
            if t in live or skip in live:       # sharing would overwrite that other gradient
                raise ValueError(f"{L.name}: an input of this residual add is also read by a layer "
                                 f"after it; the engine shares the add's gradient storage and cannot "
                                 f"plan that network (copy the tensor through a conv or unit first)")
            live[t] = dout                      # branch gradient = output gradient
            live[skip] = dout                   # skip gradient: same storage
            add(L.op, L, dout=dout, dest=dout, **shapes)
        elif rule == "same":
            if [k for k, b in live.items() if b == dout]:
                raise ValueError(f"{L.name}: its output gradient is shared with a residual add's other "
                                 f"input, and a BN-ReLU computes its input gradient in place; the engine "
                                 f"cannot plan a branch that is only a BN-ReLU unit")
            scratch = free(dout) if L.name in decodes else ""
            acc = t in live
            dest = live[t] if acc else dout     # in place unless the input already has a gradient
            live[t] = dest
            add(L.op, L, dout=dout, dest=dest, accumulate=acc, scratch=scratch, saved=slots,
                saved_bytes=sum(nbytes[s] for s in slots), **shapes)
        elif L.op == "conv":
            acc = t in live
            if src == "input":                  # the stem: input gradient only on request
                dest = live[t] if acc else free(dout)
                live[t] = dest
                add("conv", L, dout=dout, dest=dest, accumulate=acc, optional=True, **shapes)
                continue
            unit = producer.get(t)
            assert unit is not None and unit.op == "bnrelu", f"{L.name} must read a BN-ReLU output"
            scratch = free(dout)
            dest = live[t] if acc else scratch  # the rebuilt input is dead once dW is done
            live[t] = dest
            unit_slot = saved[unit.name][0]
            add("conv", L, dout=dout, dest=dest, accumulate=acc, scratch=scratch, unit=unit.name,
                unit_saved=unit_slot, unit_params=_params(net, unit), **shapes)
        else:                                   # "other" without accumulation: the max-pool
            assert t not in live, f"{L.name}: its input has a second consumer ({L.op} cannot accumulate)"
            dest = free(dout)
            live[t] = dest
            add(L.op, L, dout=dout, dest=dest, saved=slots, saved_bytes=sum(nbytes[s] for s in slots), **shapes)
    return steps
