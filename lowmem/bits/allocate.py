"""Allocation: a bit width per BN-ReLU unit, chosen to fit a byte budget at the least predicted error.

Each unit u can keep x-hat at K in {1, 2, 4, 8} bits or in float; choice k costs
bytes[u][k] (its saved slot as its kernel set plans it: units.slot_nbytes)
and adds err[u][k] to the objective (lowmem/bits/sensitivity.py's Sensitivity.objective:
the unit's bias² weighed H = 19 times, as momentum 0.9 sums it over steps, plus its draw
variance, over the SGD noise's; squared errors of different units add, because the forward
pass is exact). The allocation minimises

    sum_u err[u][k_u]    subject to    sum_u bytes[u][k_u] <= budget,

a multiple-choice knapsack. `solve` does it exactly by dynamic programming over a
byte grid: g = the greatest common divisor of every cost, cells = budget // g + 1,
and for each unit in turn best[c] = min over choices k of best_before[c - cost_k] + err_k
(the least error of the units so far within c grid steps). Unit sizes of a ResNet
share large powers of two, so g is large and the grid small; when it would exceed
`max_cells`, costs are rounded UP to a coarser grid instead, the grid runs n cells
past the budget (n units overstate their sum by less than n steps) and the fullest
cell whose allocation fits the true budget is taken (the budget holds; the result
is then near-optimal, `Solution.exact` False).

    sens = sensitivity.measure_sensitivity(net, batches)
    a = allocate(sens, batch_size=128, avg_bits=2)      # or code_bytes=...
    print(a.table()); bits = a.bits                     # {unit: K or "float"}
"""
import math
import numbers
from dataclasses import dataclass
from functools import reduce

import numpy

from ..core.engine import DEFAULT_WORKSPACE_BYTES, Engine
from ..units import slot_nbytes
from ..system.memory import fmt_bytes
from ..units.widths import BITS, FLOAT, check_rounding, code_for
from .sensitivity import measure_sensitivity, measured_batches
from .simulate import BIAS_STEPS, bias_steps_for

CHOICES = BITS + (FLOAT,)                  # every width a unit may get
MAX_CELLS = 1 << 17
NO_UNITS = ("the network has no BN-ReLU unit: there is no saved x-hat width to choose "
            "(train it with any fixed bits)")


def check_choices(choices):
    if not choices or any(c != FLOAT and c not in BITS for c in choices):
        raise ValueError(f"choices must be drawn from {CHOICES}, got {choices!r}")


@dataclass
class Solution:
    choice: list        # per item, the index of its chosen option
    bytes: int          # total cost of the choice (exact, not rounded)
    error: float        # total error of the choice
    exact: bool         # solved on the exact byte grid (else costs rounded up to a coarser one)


def solve(costs, errors, budget, max_cells=MAX_CELLS):
    """Multiple-choice knapsack: one option per item, total cost <= budget, least total error.

    costs: per item a list of non-negative int byte costs; errors: the matching floats;
    budget: int bytes. Ties go to the earlier option. ValueError if even the cheapest
    option of every item exceeds the budget."""
    n = len(costs)
    if len(errors) != n or any(len(c) != len(e) or not c for c, e in zip(costs, errors)):
        raise ValueError("costs and errors must list the same non-empty options for every item")
    if any(int(b) != b or b < 0 for c in costs for b in c):
        raise ValueError("costs must be non-negative integers (bytes)")
    if any(math.isnan(e) for es in errors for e in es):
        raise ValueError("the predicted errors contain NaN: are the weights and the batches finite?")
    budget = int(budget)
    least = sum(min(c) for c in costs)
    if least > budget:
        raise ValueError(f"the budget {fmt_bytes(budget)} is below the smallest possible allocation "
                         f"{fmt_bytes(least)} ({least:,} B: every unit at its cheapest width)")
    if n == 0:
        return Solution([], 0, 0.0, True)
    # the grid measures each option's cost above its item's cheapest: every cheapest option is
    # 0 cells, so the cheapest allocation fits whenever least <= budget, on any grid
    base = [min(int(b) for b in c) for c in costs]
    extra = [[int(b) - m for b in c] for c, m in zip(costs, base)]
    room = budget - least
    g = reduce(math.gcd, (b for c in extra for b in c), 0) or 1
    exact = room // g + 1 <= max_cells
    if not exact:                                 # a coarser grid; costs rounded up: still within budget
        g = -(-room // (max_cells - 1))
    steps = [[-(-b // g) for b in c] for c in extra]
    # rounded up, the costs of n items overstate their sum by less than n grid steps: the cells up
    # to room // g + n may hold allocations that fit the true budget (uniform K's bytes exactly,
    # e.g., where every unit's cost carries a few odd bytes); the fullest that does is taken below
    top = room // g + (0 if exact else n)
    cells = top + 1
    best = numpy.zeros(cells)                     # no item yet: error 0 within any budget
    picks = numpy.empty((n, cells), numpy.int16)
    for i in range(n):
        new = numpy.full(cells, numpy.inf)
        for k, (s, e) in enumerate(zip(steps[i], errors[i])):
            if s >= cells:
                continue
            cand = numpy.full(cells, numpy.inf)
            cand[s:] = best[:cells - s] + e
            better = cand < new                   # strict: ties keep the earlier option
            new[better] = cand[better]
            picks[i, better] = k
        best = new

    def walk(c):                                  # the options taken within c cells: the last's, then back
        choice = [0] * n
        for i in range(n - 1, -1, -1):
            choice[i] = int(picks[i, c])
            c -= steps[i][choice[i]]
        return choice
    for c in range(top, room // g - 1, -1):       # room // g always fits (costs rounded up)
        if not numpy.isfinite(best[c]):
            continue
        choice = walk(c)
        if sum(extra[i][k] for i, k in enumerate(choice)) <= room:
            break
    else:                                         # only where errors are infinite
        raise ValueError(f"no allocation within the budget {fmt_bytes(budget)} has a finite predicted error")
    total = sum(int(costs[i][k]) for i, k in enumerate(choice))
    return Solution(choice, total, float(sum(errors[i][k] for i, k in enumerate(choice))), exact)


def unit_bytes(elements, choice, itemsize=4, channels=None, rounding="nearest"):
    """Bytes of a unit's saved x-hat slot for `elements` = C*N*H*W at `choice` (K or FLOAT) under
    `rounding`: the engine's plan entry, as the unit's kernel set sizes it (units.slot_nbytes: the
    unbiased code's group ends included, for which `channels` = C is needed; default 1)."""
    C = int(channels or 1)
    return slot_nbytes(choice, rounding, C, int(elements) // C, numpy.dtype(f"f{int(itemsize)}"))


def _uniform(elements, channels, rounding):
    return {k: sum(unit_bytes(n, k, channels=channels[u], rounding=rounding) for u, n in elements.items())
            for k in (8, 4, 2, 1)}


@dataclass
class Allocation:
    """bits {unit: K or FLOAT}; per unit shapes (C, H, W), bytes, error2 (predicted squared
    error); noise_norm (the SGD noise the ratios are relative to); batch_size the bytes are for;
    budget (code bytes allowed); uniform_bytes {K: bytes of every unit at K}."""
    bits: dict
    shapes: dict
    bytes: dict
    error2: dict
    noise_norm: float
    batch_size: int
    budget: int
    exact: bool
    uniform_bytes: dict

    @property
    def total_bytes(self):
        return sum(self.bytes.values())

    def _ratio(self, error2):
        # NaN when the measured batches show no SGD noise (identical batches): no ratio exists
        return math.sqrt(error2) / self.noise_norm if self.noise_norm > 0 else float("nan")

    @property
    def predicted_ratio(self):
        """Predicted error-to-noise ratio of all parameters (sqrt of the summed squared errors);
        NaN when the SGD noise measured is 0 (identical batches)."""
        return self._ratio(sum(self.error2.values()))

    @property
    def average_bits(self):
        """Saved x-hat bits per element (float counts as 8 * itemsize)."""
        return 8 * self.total_bytes / sum(int(math.prod(s)) * self.batch_size for s in self.shapes.values())

    def table(self):
        """One line per unit: name, shape, K, bytes, predicted error/noise; then the totals."""
        lines = [f"{'unit':<24} {'shape (C,H,W)':<15} {'K':>5} {'bytes':>14} {'error/noise':>12}"]
        for u, k in self.bits.items():
            r = _fmt_ratio(self._ratio(self.error2[u]))
            lines.append(f"{u:<24} {str(tuple(self.shapes[u])):<15} {str(k):>5} {self.bytes[u]:>14,} {r:>12}")
        lines.append(f"{'total':<24} {'':<15} {self.average_bits:>5.2f} {self.total_bytes:>14,} "
                     f"{_fmt_ratio(self.predicted_ratio):>12}")
        uni = ", ".join(f"{k}-bit {fmt_bytes(b)}" for k, b in self.uniform_bytes.items())
        lines.append(f"saved x-hat {fmt_bytes(self.total_bytes)} of a budget of {fmt_bytes(self.budget)} "
                     f"(batch {self.batch_size}; uniform: {uni}); error/noise: predicted rms gradient "
                     f"error over the SGD noise of all parameters (per unit: its own share)")
        if not self.noise_norm > 0:
            lines.append("the measured batches show no SGD noise (identical batches?): no error/noise "
                         "ratio; the widths minimise the predicted error itself")
        return "\n".join(lines)


def _fmt_ratio(r):
    return "n/a" if math.isnan(r) else f"{r:.3g}"


def check_amount(name, value, low, high=math.inf, low_open=True, what="a number"):
    """`value` as a float if it is a finite real number (not a bool) in (low, high] (or [low, high]
    when not low_open); else ValueError naming the parameter `name`."""
    ok = (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
          and (value > low if low_open else value >= low) and value <= high)
    if not ok:
        span = f"{'(' if low_open else '['}{low:g}, {'inf)' if high == math.inf else f'{high:g}]'}"
        raise ValueError(f"{name} must be {what} in {span}, got {value!r}")
    return float(value)


def check_batch_size(batch_size, name="batch_size"):
    """`batch_size` as an int if it is a positive integer (not a bool); else ValueError."""
    if not (isinstance(batch_size, numbers.Integral) and not isinstance(batch_size, bool) and batch_size >= 1):
        raise ValueError(f"{name} must be a positive integer, got {batch_size!r}")
    return int(batch_size)


def code_budget(elements, avg_bits, code_bytes, uniform):
    """The saved x-hat bytes allowed: `code_bytes`, or what every unit at `avg_bits` would take
    (for K in 1, 2, 4, 8 exactly uniform K's bytes, `uniform` {K: bytes}: the code's metadata
    included, e.g. the unbiased code's group ends); elements {unit: C*N*H*W}."""
    if avg_bits is None:
        return int(check_amount("code_bytes", code_bytes, 0, low_open=False, what="a number of bytes"))
    avg_bits = check_amount("avg_bits", avg_bits, 0, 32)
    if avg_bits in BITS:
        return uniform[int(avg_bits)]
    return int(sum(elements.values()) * avg_bits // 8)


def check_fits(elements, code_bytes, choices, itemsize, said, channels=None, rounding="nearest"):
    """ValueError unless every unit at its cheapest choice fits `code_bytes`; `said` words the
    budget the way the caller gave it (a callable: least bytes -> the message)."""
    channels = channels or {}
    least = sum(min(unit_bytes(n, c, itemsize, channels.get(u), rounding) for c in choices)
                for u, n in elements.items())
    if least > code_bytes:
        raise ValueError(said(least))


def allocate(sens, batch_size, code_bytes=None, avg_bits=None, choices=CHOICES, itemsize=4,
             max_cells=MAX_CELLS, bias_steps=BIAS_STEPS, objective=None):
    """The least-error widths for `sens` (a sensitivity.Sensitivity) at `batch_size`, with the
    units' saved x-hat slots within `code_bytes`, or within what every unit at `avg_bits` bits
    per element would take (exactly uniform K's bytes for K in 1, 2, 4, 8). What is minimised:
    sens.objective(unit, K, bias_steps) summed over units (bias_steps H = (1+β)/(1−β) for SGD
    momentum β: 19 at 0.9), for the unbiased code (sens measured with rounding "stochastic")
    with as few 1-bit units as the budget allows (docs/bits.md §3b); or objective(unit, K), a
    callable of your own, as it is. Returns an Allocation."""
    if (code_bytes is None) == (avg_bits is None):
        raise ValueError("give exactly one of code_bytes (a byte budget) and avg_bits")
    check_choices(choices)
    batch_size = check_batch_size(batch_size)
    if not sens.units:
        raise ValueError(NO_UNITS)
    elements = {u: int(math.prod(sens.shapes[u])) * batch_size for u in sens.units}
    channels = {u: int(sens.shapes[u][0]) for u in sens.units}
    rounding = getattr(sens, "rounding", "nearest")
    uniform = _uniform(elements, channels, rounding)
    code_bytes = code_budget(elements, avg_bits, code_bytes, uniform)
    costs = [[unit_bytes(elements[u], c, itemsize, channels[u], rounding) for c in choices] for u in sens.units]
    # what is minimised: the units' squared error in the update momentum applies, bias weighed
    # H times, against the SGD noise's (Sensitivity.objective; docs/bits.md §3b). Both were
    # measured at sens.batch; squared norms of batch means scale like 1/N for independent errors,
    # and so does the squared noise: the choice does not depend on N
    if objective is None:
        objective = (lambda u, c: sens.objective(u, c, bias_steps)) if hasattr(sens, "objective") else sens.error2
        objective = _biased_when_forced(objective, sens.units, choices, rounding)
    errors = [[objective(u, c) for c in choices] for u in sens.units]
    sol = solve(costs, errors, code_bytes, max_cells)
    bits = {u: choices[k] for u, k in zip(sens.units, sol.choice)}
    return Allocation(bits, dict(sens.shapes),
                      {u: unit_bytes(elements[u], bits[u], itemsize, channels[u], rounding) for u in bits},
                      {u: sens.error2(u, bits[u]) for u in bits}, sens.noise_norm, batch_size, code_bytes,
                      sol.exact, uniform)


def _biased_when_forced(objective, units, choices, rounding):
    """Where `rounding` has an unbiased code (widths.code_for), a width whose code is biased (the
    window code at 1 bit: no unbiased 1-bit code exists) only where the budget forces it. Each such
    choice is surcharged above what any allocation without one can cost, so the solver takes as
    few of them as the budget allows and, among those, the least objective."""
    biased = [c for c in choices if code_for(rounding, c).name == "window"]
    others = [c for c in choices if c not in biased]
    if not any(code_for(rounding, K).unbiased for K in BITS) or not biased or not others:
        return objective
    surcharge = 1.0 + sum(max(objective(u, c) for c in others) for u in units)

    def priced(u, c):
        return objective(u, c) + (surcharge if c in biased else 0.0)
    return priced


def allocation_for(sens, bits, batch_size, budget=None, itemsize=4, exact=True):
    """The Allocation record (bytes, predicted errors, table) of given widths {unit: K or FLOAT}
    at `batch_size` (e.g. an allocation chosen at one batch, shown at another)."""
    elements = {u: int(math.prod(sens.shapes[u])) * int(batch_size) for u in sens.units}
    channels = {u: int(sens.shapes[u][0]) for u in sens.units}
    rounding = getattr(sens, "rounding", "nearest")
    nbytes = {u: unit_bytes(elements[u], bits[u], itemsize, channels[u], rounding) for u in sens.units}
    return Allocation(dict(bits), dict(sens.shapes), nbytes, {u: sens.error2(u, bits[u]) for u in sens.units},
                      sens.noise_norm, int(batch_size), sum(nbytes.values()) if budget is None else int(budget),
                      exact, _uniform(elements, channels, rounding))


def plan_parts(net, batch_size, input_shape, mode="approx", dtype="float32", workspace_bytes=None):
    """({unit: (C, H, W)}, fixed bytes) of `net`'s plan at `batch_size`, from shapes alone: the
    units whose widths are chosen, and the plan total less every unit's saved x-hat slot (the
    same for any widths: only those slots change; rstd stays)."""
    ws = DEFAULT_WORKSPACE_BYTES if workspace_bytes is None else workspace_bytes
    eng = Engine(net, batch_size, input_shape, mode, 1, dtype, ws, allocate=False)
    slots = sum(eng.nbytes[eng.saved_slots[u][0]] for u in eng.unit_bits)
    return {u: tuple(eng.in_shape[u]) for u in eng.unit_bits}, eng.plan.total_bytes - slots


def fixed_plan_bytes(net, batch_size, input_shape, mode="approx", dtype="float32", workspace_bytes=None):
    """Plan bytes that do not depend on the units' widths (plan_parts)."""
    return plan_parts(net, batch_size, input_shape, mode, dtype, workspace_bytes)[1]


def check_budget(net, batch_size, input_shape, avg_bits=None, code_bytes=None, budget=None, mode="approx",
                 dtype="float32", workspace_bytes=None, choices=CHOICES, names=None, rounding="nearest"):
    """Before any measurement: ValueError, in one line, unless exactly one budget is given, it is
    a valid number and the cheapest allocation fits it at `batch_size`. names: how the caller
    spells the three ({"avg_bits": "--avg-bits", ...}; default the parameter names). Returns the
    saved x-hat bytes allowed (code_bytes) and the fixed plan bytes (None unless budget)."""
    names = {"avg_bits": "avg_bits", "code_bytes": "code_bytes", "budget": "budget", **(names or {})}
    given = [n for n, v in (("avg_bits", avg_bits), ("code_bytes", code_bytes), ("budget", budget))
             if v is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of {names['avg_bits']}, {names['code_bytes']} and "
                         f"{names['budget']} (the whole plan's bytes)")
    check_choices(choices)
    batch_size = check_batch_size(batch_size)
    if budget is not None:
        budget = check_amount(names["budget"], budget, 0, what="a number of bytes")
    elif avg_bits is not None:
        check_amount(names["avg_bits"], avg_bits, 0, 32)
    else:
        check_amount(names["code_bytes"], code_bytes, 0, low_open=False, what="a number of bytes")
    shapes, fixed = plan_parts(net, batch_size, input_shape, mode, dtype, workspace_bytes)
    if not shapes:
        raise ValueError(NO_UNITS)
    elements = {u: int(math.prod(s)) * batch_size for u, s in shapes.items()}
    channels = {u: int(s[0]) for u, s in shapes.items()}
    itemsize = numpy.dtype(dtype).itemsize
    cheapest = min(choices, key=lambda c: unit_bytes(8, c, itemsize))
    width = "float" if cheapest == FLOAT else f"{cheapest}-bit"
    if budget is not None:
        budget = int(budget)
        check_fits(elements, budget - fixed, choices, itemsize, channels=channels, rounding=rounding, said=lambda least: (
            f"{names['budget']} {fmt_bytes(budget)} is below the smallest plan at batch {batch_size}, "
            f"{fmt_bytes(fixed + least)} ({fixed + least:,} B: {fmt_bytes(fixed)} besides the saved x-hat, "
            f"{fmt_bytes(least)} with every unit {width}); give at least that"))
        return budget - fixed, fixed
    allowed = code_budget(elements, avg_bits, code_bytes, _uniform(elements, channels, rounding))
    name, given = (names["avg_bits"], f"{avg_bits:g}") if avg_bits is not None else \
        (names["code_bytes"], fmt_bytes(int(code_bytes)))
    check_fits(elements, allowed, choices, itemsize, channels=channels, rounding=rounding, said=lambda least: (
        f"{name} {given} allows {fmt_bytes(allowed)} of saved x-hat at batch {batch_size}, below the "
        f"{fmt_bytes(least)} of every unit {width}; {name} must be at least "
        + (f"{least * 8 / sum(elements.values()):.4g}" if avg_bits is not None else f"{least:,} B")))
    return allowed, None


def allocate_bits(net, batches, batch_size=None, avg_bits=None, code_bytes=None, budget=None,
                  input_shape=None, mode="approx", dtype="float32", workspace_bytes=None,
                  choices=CHOICES, sens=None, rounding=None, momentum=None):
    """Measure `net`'s sensitivity on `batches` (a few (x, labels), B >= 2, any iterable; not
    consumed: the measurement runs on a copy) and choose every unit's width for an engine at
    `batch_size` (default: the batches' size). Exactly one budget:

      avg_bits    the units' saved x-hat within what every unit at that many bits would take
      code_bytes  the units' saved x-hat slots within this many bytes
      budget      the WHOLE plan total (lowmem plan / maxbatch's sense) within this many bytes

    The budget is checked (check_budget) before the measurement. Returns an Allocation;
    `Engine(net, ..., mode="approx", bits=allocation.bits)` uses it. sens: a
    sensitivity.Sensitivity already measured (then batches may be None). rounding: the
    engine's ("stochastic" codes have larger, unbiased errors: measured as such; their group ends
    count in the budget); default "nearest", or the rounding `sens` was measured with.
    momentum: the training's SGD momentum β, which sets how much a bias weighs against noise
    (H = (1+β)/(1−β), docs/bits.md §3b); None: β = 0.9, H = 19."""
    bias_steps = bias_steps_for(momentum)
    if sens is not None:
        measured = getattr(sens, "rounding", "nearest")
        if rounding is not None and check_rounding(rounding) != measured:
            raise ValueError(f"rounding {rounding!r} differs from the {measured!r} the sensitivity was "
                             f"measured with: measure it with rounding={rounding!r}")
        rounding = measured
    rounding = check_rounding("nearest" if rounding is None else rounding)
    if sens is None:
        batches = measured_batches(batches)
        if len(batches) < 2:
            raise ValueError(f"batches: at least 2 are needed to measure SGD noise, got {len(batches)}")
        measured_shape, measured_n = tuple(batches[0][0].shape[1:]), batches[0][0].shape[0]
    else:
        measured_shape, measured_n = tuple(sens.input_shape), sens.batch
    if batch_size is None:
        batch_size = measured_n
    if getattr(net, "in_channels", None) not in (None, measured_shape[0]):
        raise ValueError(f"the batches hold {measured_shape[0]}-channel samples {measured_shape}; "
                         f"{net.name} takes {net.in_channels} input channels")
    if input_shape is not None and tuple(input_shape) != measured_shape:
        raise ValueError(f"input_shape {tuple(input_shape)} differs from the shape the sensitivity was "
                         f"measured at, {measured_shape}: measure on batches of the training input shape")
    allowed, fixed = check_budget(net, batch_size, measured_shape, avg_bits, code_bytes, budget, mode, dtype,
                                  workspace_bytes, choices, rounding=rounding)
    if sens is None:
        sens = measure_sensitivity(net, batches, dtype=dtype, rounding=rounding)
    itemsize = numpy.dtype(dtype).itemsize
    a = allocate(sens, batch_size, code_bytes=allowed, choices=choices, itemsize=itemsize, bias_steps=bias_steps)
    a.fixed_bytes = fixed
    return a
