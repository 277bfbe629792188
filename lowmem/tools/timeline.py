"""What a plan's buffers hold along a schedule, and what each step saves: the data the plan
figure draws (lowmem/tools/plot.py), computed from the plan and the schedule alone.

    t = buffer_timeline(engine.plan, engine.schedule)
    t.rows                      # the plan entries drawn, one row each (every "buffers" entry,
                                #   and any other entry a step reads or writes: input, head slots)
    t.state["act0"][i]          # what step i does to act0: "write", "acc", "shared", "read",
                                #   "scratch", "held" (holds a tensor a later step reads) or ""
    t.text["act0"][i]           # the tensor act0 holds after step i ("bn1", "∂bn1", "Σ∂bn1", "bn1~")
    saved_by_step(engine.plan, engine.schedule, engine.unit_bits, engine.keeper.bits)   # [(step, [(what, bytes)])]

Only Step fields are read: forward `src` (read), `dst` (written; added into when the op's
table entry says `several` and dst is one of its inputs); backward `dout` (read), `dx` (written, `accumulate`: added
into; the same buffer as `dout` for an op that is no unit: shared, nothing written),
`scratch` (a rebuilt conv input or a decoded x-hat, written and read within the step) and,
for the network input kept in its own slot, `src`. A buffer name is any plan entry a step
names, so an engine that assigns its buffers differently draws without change.

Tensor names: a layer's output is named by the last part of the layer's name ("bn1"), its
gradient "∂bn1" ("Σ∂bn1" once a second consumer added its part; after an add's backward,
"∂add" is also the gradient of both its operands), a rebuilt or decoded copy "bn1~"; the
network input "x".
"""
from dataclasses import dataclass, field

from ..core.optable import OPS

STATES = ("write", "acc", "shared", "read", "scratch", "held")     # what a step does to a buffer (or "")


def short(name):
    """The last part of a layer name: "layer1.0.bn1" -> "bn1"."""
    return name.rsplit(".", 1)[-1]


def group_of(name, level=1):
    """The first `level` parts of a layer name: its stage (1: "layer1") or block (2: "layer1.0")."""
    return ".".join(name.split(".")[:level])


@dataclass
class Timeline:
    rows: list                                  # plan entries (core.plan.Alloc), top to bottom
    steps: list                                 # the schedule's steps
    state: dict = field(default_factory=dict)   # row name -> [state of each step]
    text: dict = field(default_factory=dict)    # row name -> [tensor held after each step, or ""]

    @property
    def names(self):
        return [e.name for e in self.rows]

    def groups(self, level=1):
        """[(label, first step, last step + 1, phase)]: runs of consecutive steps of one stage
        (level 1) or block (level 2); the loss and averages form their own groups."""
        out = []
        for i, s in enumerate(self.steps):
            label = group_of(s.name, level)
            if out and out[-1][0] == label and out[-1][3] == s.phase:
                out[-1][2] = i + 1
            else:
                out.append([label, i, i + 1, s.phase])
        return [tuple(g) for g in out]


def _step_reads(step):
    """The buffers a forward step reads: its layer's inputs for an op with several (add,
    concat), else `src`."""
    if step.phase == "fwd" and step.layer is not None and OPS[step.op].several:
        return tuple(step.layer.reads)
    return (step.src,) if step.phase == "fwd" else ()


def _named(step, entries):
    """The plan entries the step reads or writes, by its buffer fields (backward: a step's `src`
    is its forward input, read again only when that is the kept network input)."""
    fields = ("src", "dst") if step.phase == "fwd" else ("dout", "dx", "scratch")
    names = {getattr(step, f) for f in fields} | set(_step_reads(step)) | {b for b, _ in step.dxs}
    if step.phase == "bwd" and step.src in entries and entries[step.src].kind == "input":
        names.add(step.src)
    return names & set(entries)


def buffer_timeline(plan, schedule):
    """The Timeline of `plan`'s buffers along `schedule` (a Schedule or a list of Steps)."""
    entries = {e.name: e for e in plan.entries}
    used = set().union(*(_named(s, entries) for s in schedule))
    order = {"input": 0, "buffers": 1}
    rows = sorted((e for e in plan.entries if e.kind == "buffers" or e.name in used),
                  key=lambda e: order.get(e.kind, 2))          # stable: plan order within each
    t = Timeline(rows, list(schedule))
    n = len(t.steps)
    for e in rows:
        t.state[e.name], t.text[e.name] = [""] * n, [""] * n
    held = {e.name: ("x" if e.kind == "input" else "") for e in rows}
    written = {e.name: (0 if e.kind == "input" else None) for e in rows}   # step of the last write
    fwd_input = {}                              # layer -> the tensor its forward read
    rows_set = set(held)

    def mark(buf, i, what):
        if buf in rows_set and not t.state[buf][i]:
            t.state[buf][i] = what

    def read(buf, i):
        if buf not in rows_set:
            return
        mark(buf, i, "read")
        if written[buf] is not None:            # it held something a later step needed: held till now
            for j in range(written[buf], i):
                if not t.state[buf][j]:
                    t.state[buf][j] = "held"

    def write(buf, i, what, text):
        if buf in rows_set:
            t.state[buf][i] = what
            held[buf], written[buf] = text, i

    for i, s in enumerate(t.steps):
        if s.phase == "fwd":
            fwd_input[s.name] = held.get(s.src, "")
            reads = _step_reads(s)
            for b in reads:
                read(b, i)
            out = short(s.name) if s.layer is not None else s.op
            if OPS[s.op].several and s.dst in reads:    # dst = dst + the others: added into dst
                write(s.dst, i, "acc", out)
            else:
                write(s.dst, i, "write", out)
        else:
            if s.src in entries and entries[s.src].kind == "input":
                read(s.src, i)                  # the kept network input (a stem conv's weight gradient)
            if s.dout:
                read(s.dout, i)
            if s.scratch:
                write(s.scratch, i, "scratch", short(s.unit or s.name) + "~")
            grad = "∂" + (fwd_input.get(s.name) or "")
            if s.dx and s.dx == s.dout and not OPS[s.op].unit:     # both operands' gradient is the output's
                write(s.dx, i, "shared", "∂" + short(s.name))
            elif s.dx and s.accumulate:
                write(s.dx, i, "acc", "Σ" + grad)     # a second consumer's part of the sum
            elif s.dx:
                write(s.dx, i, "write", grad)
            for b, acc in s.dxs:                # several inputs: each one's gradient
                if b == s.dx:
                    continue
                if b == s.dout:
                    write(b, i, "shared", "∂" + short(s.name))
                else:
                    write(b, i, "acc" if acc else "write", grad)
        for b in rows_set:
            t.text[b][i] = held[b]
    return t


def saved_class(entry, unit_bits, code_bits=None):
    """What a saved plan entry keeps, from its name's last part and its dtype: "<K>-bit code" (a
    BN-ReLU unit's code of x-hat: unit_bits[unit] = K), "<K>-bit range code" (a standalone batch
    norm's x-hat or a conv's input kept as a range code, with its per-group scale and zero: the
    engine's keeper in approx and naive modes, code_bits = K), "float x-hat", "region code"
    (ReLU6's 2 bits), "mask", "index" (max-pool's argmax), or "exact" (a float copy: a conv input
    in exact mode, the classifier's input, per-channel statistics)."""
    layer, kind = entry.name.rsplit(".", 1)
    if kind == "code":
        K = (unit_bits or {}).get(layer)
        return f"{K}-bit code" if K else "code"
    if kind.endswith(("_scale", "_zero")) or (entry.dtype == "uint8" and kind in ("xhat", "out")):
        return f"{code_bits}-bit range code" if code_bits else "range code"
    if kind == "xhat":
        return "float x-hat"
    if kind == "region":
        return "region code"
    if kind in ("argmax", "index"):
        return "index"
    if kind == "mask":
        return "mask"
    return "exact"


def saved_by_step(plan, schedule, unit_bits=None, code_bits=None):
    """[(step, [(what, bytes)])] for each forward step that fills saved slots, in schedule order:
    `what` is saved_class of the slot; slots of one class are summed."""
    entries = {e.name: e for e in plan.entries}
    out = []
    for s in schedule:
        if s.phase != "fwd" or not s.saved:
            continue
        parts = {}
        for name in s.saved:
            if name in entries:
                what = saved_class(entries[name], unit_bits, code_bits)
                parts[what] = parts.get(what, 0) + entries[name].nbytes
        out.append((s, list(parts.items())))
    return out
