"""The memory plan: every array the engine allocates, listed before it exists.

Each entry has a name, a kind, a shape and a dtype; its bytes are
`prod(shape) * itemsize`, exactly what `.nbytes` of the allocated array will
report (uint8 codes count 1 byte per element, never 0). `training_plan` sizes
everything a training step holds in this one place (as llm.c sizes its buffers in
one function), from shapes alone: the network's parameters, the walk's buffers, what
each layer keeps (its op table entry, `plan`, over the unit's kernel set). The engine
allocates everything from it at once (`Plan.allocate`), so the plan total is the
memory a training step holds, and a test checks the two are equal.
`bind_parameters` then moves the network's weights and running statistics
into their planned arrays.

Kinds:
  params     trainable weights            grads      their gradients
  optimizer  SGD momentum                 stats      BN running statistics, batch-stat scratch
  input      the engine's copy of the batch (channels-major) and its labels: the caller
             may reuse its own arrays as soon as forward() returns
  buffers    the shared activation / gradient buffers (act0, act1, res) and tiny head buffers
  saved      what each layer keeps for backward (x-hat or its K-bit code, rstd, argmax, FC input, probs)
  workspace  bounded scratch: conv im2col columns, max-pool window indices, the CUDA
             reductions' partial sums (bn.partials), synchronized BN's sums (sync.bn)
"""
import math
from dataclasses import dataclass

import numpy

from ..system.backend import to_numpy
from ..system.memory import fmt_bytes, require
from .optable import OPS, step_temporaries

KINDS = ("params", "grads", "optimizer", "stats", "input", "buffers", "saved", "workspace")


@dataclass(frozen=True)
class Alloc:
    name: str
    kind: str
    shape: tuple
    dtype: str
    nbytes: int = None      # prod(shape) * itemsize, computed by Plan.add

    def __post_init__(self):
        if self.nbytes is None:
            object.__setattr__(self, "nbytes", math.prod(self.shape) * numpy.dtype(self.dtype).itemsize)


class Plan:
    def __init__(self):
        self.entries = []
        self._names = set()
        self.temporaries = []     # (what, bytes): bounded scratch a step allocates, not held

    def add_temporary(self, what, nbytes):
        """Record a bound on short-lived scratch a step allocates outside the plan (NumPy
        temporaries: row blocks, quantizer chunks, weight-sized GEMM results). Not allocated,
        not in total_bytes; `report()` lists them so the bound is visible."""
        self.temporaries.append((what, int(nbytes)))

    @property
    def temporary_bytes(self):
        """The most the listed temporaries can add on top of the plan at once (their sum)."""
        return sum(b for _, b in self.temporaries)

    def add(self, name, kind, shape, dtype):
        if kind not in KINDS:
            raise ValueError(f"unknown plan kind {kind!r}; expected one of {KINDS}")
        if name in self._names:
            raise ValueError(f"duplicate plan entry {name!r}")
        self._names.add(name)
        dt = numpy.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        self.entries.append(Alloc(name, kind, shape, dt.name, math.prod(shape) * dt.itemsize))

    @property
    def total_bytes(self):
        return sum(e.nbytes for e in self.entries)

    def bytes_by_kind(self):
        """{kind: bytes} for every kind in KINDS (0 where the plan has none)."""
        out = dict.fromkeys(KINDS, 0)
        for e in self.entries:
            out[e.kind] += e.nbytes
        return out

    def allocate(self, xp):
        """Allocate every entry (zero-filled) on array module xp; returns {name: array}.
        First system.memory.NotEnoughMemory if the plan's total is more than xp's free memory."""
        require(self.total_bytes, "allocating the memory plan", xp)
        return {e.name: xp.zeros(e.shape, dtype=e.dtype) for e in self.entries}

    def report(self, max_rows=40):
        """The table (largest entries first when long) and totals by kind."""
        rows = self.entries
        lines = [f"{'name':<44} {'kind':<10} {'shape':<24} {'dtype':<8} {'bytes':>12}"]
        shown = rows if len(rows) <= max_rows else sorted(rows, key=lambda e: -e.nbytes)[:max_rows]
        for e in shown:
            lines.append(f"{e.name:<44} {e.kind:<10} {str(e.shape):<24} {e.dtype:<8} {e.nbytes:>12,}")
        if len(shown) < len(rows):
            lines.append(f"... {len(rows) - len(shown)} smaller entries not shown (largest {max_rows} above)")
        lines.append("")
        lines.append(f"{'kind':<10} {'entries':>8} {'bytes':>16} {'':>12}")
        counts = {k: sum(1 for e in rows if e.kind == k) for k in KINDS}
        for k, b in self.bytes_by_kind().items():
            if counts[k]:
                lines.append(f"{k:<10} {counts[k]:>8} {b:>16,} {fmt_bytes(b):>12}")
        lines.append(f"{'total':<10} {len(rows):>8} {self.total_bytes:>16,} {fmt_bytes(self.total_bytes):>12}")
        if self.temporaries:
            lines.append(f"not held, at most {self.temporary_bytes:,} B ({fmt_bytes(self.temporary_bytes)}) "
                         f"of temporaries during a step: "
                         + "; ".join(f"{what} {fmt_bytes(b)}" for what, b in self.temporaries))
        return "\n".join(lines)

    def __repr__(self):
        return f"Plan({len(self.entries)} entries, {fmt_bytes(self.total_bytes)})"


def training_plan(net, schedule, N, dtype, input_shape, unit_sets, keeper, norm_sizes, workspace_bytes,
                  partials_size=lambda C: 0, sync_bn=False):
    """The memory plan of a training step at batch N, from shapes alone; and {layer: its saved
    slot names} ({("kept", buffer): ...} too, for a conv input kept once for every conv reading it).

    schedule: the walk's (its buffers, per-sample elements, and its forward steps); unit_sets:
    {unit: kernel set} (each plans its own saved slot); keeper: how a conv keeps an input no unit
    rebuilds (units/rangecode.py); norm_sizes: {batch norm: (C, H, W)}; workspace_bytes: the bound
    on a conv's column workspace; partials_size(C): float64 elements of the CUDA reductions'
    workspace for units of up to C channels (0: none); sync_bn: the 2C sums each unit exchanges."""
    plan, dt = Plan(), numpy.dtype(dtype)
    specs = net.param_shapes()
    for kind, suffix in (("params", ""), ("optimizer", ".momentum")):
        for name, shape, _ in specs:
            plan.add(name + suffix, kind, shape, dt)
    # one flat buffer each for the gradients and the running statistics: p.grad and the
    # statistics are views into them, and a data-parallel step sums each in one allreduce
    plan.add("grads", "grads", (sum(int(math.prod(sh)) for _, sh, _ in specs),), dt)
    plan.add("bn.running", "stats", (sum(int(math.prod(sh)) for _, sh in net.stat_shapes()),), dt)
    max_c = max((c for (c, _, _) in norm_sizes.values()), default=1)
    plan.add("bn.batch_mean", "stats", (max_c,), dt)
    plan.add("bn.batch_var", "stats", (max_c,), dt)
    partials = partials_size(max_c)
    if partials:
        plan.add("bn.partials", "workspace", (partials,), "float64")
    if sync_bn:                                   # the 2C sums each unit exchanges
        plan.add("sync.bn", "workspace", (2 * max_c,), "float64")

    # the shared buffers the walk planned by liveness: each holds the largest tensor,
    # gradient or scratch it ever holds (schedule.buffers: per-sample elements)
    for b, per_sample in schedule.buffers.items():
        plan.add(b, "buffers", (per_sample * N,), dt)
    head = net.layers[-1]                         # the classifier (the walk checked the head)
    plan.add("logits", "buffers", (N, head.cout), dt)
    plan.add("dlogits", "buffers", (N, head.cout), dt)
    plan.add("dfeat", "buffers", (N, head.cin), dt)

    # what backward needs: the batch itself, then what each layer keeps (optable: `plan`)
    plan.add("input", "input", (int(math.prod(input_shape)) * N,), dt)
    plan.add("labels", "input", (N,), "int64")
    saved, shared = {}, {}
    budget = max(1, workspace_bytes // dt.itemsize)
    for step in schedule:
        if step.phase != "fwd" or step.layer is None:
            continue
        L = step.layer
        entries = OPS[L.op].plan(step, N, unit_sets.get(L.name, keeper), dt, budget)
        saved[L.name] = [name for name, kind, _, _ in entries if kind == "saved"]
        if step.keep:                             # a kept conv input: every conv reading it finds it
            saved[("kept", step.keep)] = saved[L.name]
        for name, kind, shape, edtype in entries:
            if name.startswith(L.name + "."):
                plan.add(name, kind, shape, edtype)
            else:                                 # shared by several layers: the largest request
                old = shared.get(name, (kind, (0,), edtype))
                shared[name] = max(old, (kind, shape, edtype), key=lambda e: math.prod(e[1]))
    plan.add("loss.probs", "saved", (N, head.cout), dt)
    for name, (kind, shape, edtype) in shared.items():
        plan.add(name, kind, shape, edtype)
    decodes = any(u.decodes for u in unit_sets.values())
    for what, nbytes in step_temporaries(net, schedule.out_shape, norm_sizes, N, dt.itemsize, decodes):
        plan.add_temporary(what, nbytes)            # bounds, not held (lowmem/core/optable/)
    return plan, saved


def code_bits(plan, saved_slots, unit_bits, unit_sizes, N):
    """{coded unit: bits per element of its saved code slot, metadata included}: 8 * the slot's
    planned bytes / (C*N*H*W). The window codes hold K (plus the last byte's padding); the
    unbiased code adds its group ends and split (units/unbiased.py)."""
    nbytes = {e.name: e.nbytes for e in plan.entries}
    return {u: 8 * nbytes[saved_slots[u][0]] / (math.prod(unit_sizes[u]) * N)
            for u, K in unit_bits.items() if K is not None}


def bind_parameters(arrays, net, xp):
    """Move a network's parameter values and BN running statistics into the allocated plan
    (the engine owns them from then on): p.data becomes arrays[p.name], p.state["momentum"]
    arrays[p.name + ".momentum"], and each p.grad and each running statistic a view into the
    flat "grads" / "bn.running" buffers, in the network's order (so a data-parallel step sums
    each buffer in one allreduce)."""
    grads, running = _views(arrays["grads"]), _views(arrays["bn.running"])
    for p in net.parameters():
        arrays[p.name][...] = xp.asarray(to_numpy(p.data) if xp is not numpy else p.data)
        p.data, p.grad = arrays[p.name], grads(p.shape)
        p.state["momentum"] = arrays[p.name + ".momentum"]
    for name, s in net.stats.items():
        view = running(s.shape)
        view[...] = xp.asarray(to_numpy(s) if xp is not numpy else s)
        net.stats[name] = view


def _views(flat):
    """shape -> the next view of that shape into the flat array, in call order."""
    offset = [0]

    def take(shape):
        n = int(math.prod(shape))
        view = flat[offset[0]:offset[0] + n].reshape(shape)
        offset[0] += n
        return view
    return take
