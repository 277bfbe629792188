"""The memory plan: every array the engine allocates, listed before it exists.

Each entry has a name, a kind, a shape and a dtype; its bytes are
`prod(shape) * itemsize`, exactly what `.nbytes` of the allocated array will
report (uint8 codes count 1 byte per element, never 0). The engine allocates
everything from the plan in one place (`Plan.allocate`), so the plan total is
the memory a training step holds, and a test checks the two are equal.
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
