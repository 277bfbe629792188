"""Allocation: a bit width per BN-ReLU unit, chosen to fit a byte budget at the least predicted error.

Each unit u can keep x-hat at K in {1, 2, 4, 8} bits or in float; choice k costs
bytes[u][k] (its saved slot: quant.packed_nbytes(C*N*H*W, K), or C*N*H*W*itemsize)
and adds err[u][k] to the objective (lowmem/bits/sensitivity.py's Sensitivity.objective:
the unit's persistent bias² over ||E g||² plus its draw variance over the SGD noise's; squared
errors of different units add, because the forward pass is exact). The allocation minimises

    sum_u err[u][k_u]    subject to    sum_u bytes[u][k_u] <= budget,

a multiple-choice knapsack. `solve` does it exactly by dynamic programming over a
byte grid: g = the greatest common divisor of every cost, cells = budget // g + 1,
and for each unit in turn best[c] = min over choices k of best_before[c - cost_k] + err_k
(the least error of the units so far within c grid steps). Unit sizes of a ResNet
share large powers of two, so g is large and the grid small; when it would exceed
`max_cells`, costs are rounded UP to a coarser grid instead (the budget still
holds; the result is then optimal for the rounded costs, `Solution.exact` False).

    sens = sensitivity.measure_sensitivity(net, batches)
    a = allocate(sens, batch_size=128, avg_bits=2)      # or code_bytes=...
    print(a.table()); bits = a.bits                     # {unit: K or "float"}
"""
import math
from dataclasses import dataclass
from functools import reduce

import numpy

from ..units import quant, unbiased
from ..core.plan import fmt_bytes
from .sensitivity import FLOAT

CHOICES = (1, 2, 4, 8, FLOAT)
MAX_CELLS = 1 << 17


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
    budget = int(budget)
    least = sum(min(c) for c in costs)
    if least > budget:
        raise ValueError(f"the budget {fmt_bytes(budget)} is below the smallest possible allocation "
                         f"{fmt_bytes(least)} ({least:,} B: every unit at its cheapest width)")
    if n == 0:
        return Solution([], 0, 0.0, True)
    g = reduce(math.gcd, (int(b) for c in costs for b in c), 0) or 1
    exact = budget // g + 1 <= max_cells
    if not exact:                                 # a coarser grid; costs rounded up: still within budget
        g = -(-budget // (max_cells - 1))
    cells = budget // g + 1
    steps = [[-(-int(b) // g) for b in c] for c in costs]
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
    c = cells - 1
    if not numpy.isfinite(best[c]):
        raise ValueError(f"no allocation fits the budget {fmt_bytes(budget)} on the rounded grid "
                         f"of {fmt_bytes(g)}; raise the budget")
    choice = [0] * n
    for i in range(n - 1, -1, -1):                # walk back: the option taken, then its cost
        k = int(picks[i, c])
        choice[i] = k
        c -= steps[i][k]
    total = sum(int(costs[i][k]) for i, k in enumerate(choice))
    return Solution(choice, total, float(sum(errors[i][k] for i, k in enumerate(choice))), exact)


def unit_bytes(elements, choice, itemsize=4, channels=None, rounding="nearest"):
    """Bytes of a unit's saved x-hat slot for `elements` = C*N*H*W at `choice` (K or FLOAT);
    the unbiased code (rounding="stochastic", K >= 2) with its group ends and split (needs
    `channels` = C): units/unbiased.py's slot_nbytes, the engine's plan entry."""
    if choice == FLOAT:
        return int(elements) * int(itemsize)
    if rounding == "stochastic" and choice > 1:
        return unbiased.slot_nbytes(channels, int(elements) // channels, choice)
    return quant.packed_nbytes(elements, choice)


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

    @property
    def predicted_ratio(self):
        """Predicted error-to-noise ratio of all parameters (sqrt of the summed squared errors)."""
        return math.sqrt(sum(self.error2.values())) / self.noise_norm

    @property
    def average_bits(self):
        """Saved x-hat bits per element (float counts as 8 * itemsize)."""
        return 8 * self.total_bytes / sum(int(math.prod(s)) * self.batch_size for s in self.shapes.values())

    def table(self):
        """One line per unit: name, shape, K, bytes, predicted error/noise; then the totals."""
        lines = [f"{'unit':<24} {'shape (C,H,W)':<15} {'K':>5} {'bytes':>14} {'error/noise':>12}"]
        for u, k in self.bits.items():
            r = math.sqrt(self.error2[u]) / self.noise_norm
            lines.append(f"{u:<24} {str(tuple(self.shapes[u])):<15} {str(k):>5} {self.bytes[u]:>14,} {r:>12.3g}")
        lines.append(f"{'total':<24} {'':<15} {self.average_bits:>5.2f} {self.total_bytes:>14,} "
                     f"{self.predicted_ratio:>12.3g}")
        uni = ", ".join(f"{k}-bit {fmt_bytes(b)}" for k, b in self.uniform_bytes.items())
        lines.append(f"saved x-hat {fmt_bytes(self.total_bytes)} of a budget of {fmt_bytes(self.budget)} "
                     f"(batch {self.batch_size}; uniform: {uni}); error/noise: predicted rms gradient "
                     f"error over the SGD noise of all parameters (per unit: its own share)")
        return "\n".join(lines)


def allocate(sens, batch_size, code_bytes=None, avg_bits=None, choices=CHOICES, itemsize=4,
             max_cells=MAX_CELLS):
    """The least-error widths for `sens` (a sensitivity.Sensitivity) at `batch_size`, with the
    units' saved x-hat slots within `code_bytes`, or within what every unit at `avg_bits` bits
    per element would take (exactly uniform K's bytes for K in 1, 2, 4, 8). Returns an Allocation."""
    if (code_bytes is None) == (avg_bits is None):
        raise ValueError("give exactly one of code_bytes (a byte budget) and avg_bits")
    if not choices or any(c != FLOAT and c not in quant.BITS for c in choices):
        raise ValueError(f"choices must be drawn from {CHOICES}, got {choices!r}")
    batch_size = int(batch_size)
    elements = {u: int(math.prod(sens.shapes[u])) * batch_size for u in sens.units}
    channels = {u: int(sens.shapes[u][0]) for u in sens.units}
    rounding = getattr(sens, "rounding", "nearest")
    uniform = _uniform(elements, channels, rounding)
    if avg_bits is not None:
        if not (isinstance(avg_bits, (int, float)) and 0 < avg_bits <= 32):
            raise ValueError(f"avg_bits must be a number in (0, 32], got {avg_bits!r}")
        if avg_bits in quant.BITS:          # uniform K of the same code, its metadata included
            code_bytes = uniform[int(avg_bits)]
        else:
            code_bytes = int(sum(elements.values()) * avg_bits // 8)
    code_bytes = int(code_bytes)
    costs = [[unit_bytes(elements[u], c, itemsize, channels[u], rounding) for c in choices] for u in sens.units]
    # what is minimised: persistent bias² against ||E g||² plus draw variance against the SGD
    # noise's (Sensitivity.objective; docs/bits.md). Both were measured at sens.batch; squared
    # norms of batch means scale like 1/N for independent errors, and so do the squared noise
    # and (its finite-sample part removed) nothing else: the choice does not depend on N
    objective = getattr(sens, "objective", sens.error2)
    errors = [[objective(u, c) for c in choices] for u in sens.units]
    sol = solve(costs, errors, code_bytes, max_cells)
    bits = {u: choices[k] for u, k in zip(sens.units, sol.choice)}
    return Allocation(bits, dict(sens.shapes),
                      {u: unit_bytes(elements[u], bits[u], itemsize, channels[u], rounding) for u in bits},
                      {u: sens.error2(u, bits[u]) for u in bits}, sens.noise_norm, batch_size, code_bytes,
                      sol.exact, uniform)


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


def fixed_plan_bytes(net, batch_size, input_shape, mode="approx", dtype="float32", workspace_bytes=None):
    """Plan bytes that do not depend on the units' widths: the plan total less every unit's
    saved x-hat slot (the same for any widths: only those slots change; rstd stays)."""
    from ..core.engine import DEFAULT_WORKSPACE_BYTES, Engine
    ws = DEFAULT_WORKSPACE_BYTES if workspace_bytes is None else workspace_bytes
    eng = Engine(net, batch_size, input_shape, mode, 1, dtype, ws, allocate=False)
    slots = sum(eng.nbytes[eng.saved_slots[u][0]] for u in eng.unit_bits)
    return eng.plan.total_bytes - slots


def allocate_bits(net, batches, batch_size=None, avg_bits=None, code_bytes=None, budget=None,
                  input_shape=None, mode="approx", dtype="float32", workspace_bytes=None,
                  choices=CHOICES, sens=None, rounding="nearest"):
    """Measure `net`'s sensitivity on `batches` (a few (x, labels), B >= 2; not consumed: the
    measurement runs on a copy) and choose every unit's width for an engine at `batch_size`
    (default: the batches' size). Exactly one budget:

      avg_bits    the units' saved x-hat within what every unit at that many bits would take
      code_bytes  the units' saved x-hat slots within this many bytes
      budget      the WHOLE plan total (lowmem plan / maxbatch's sense) within this many bytes

    Returns an Allocation; `Engine(net, ..., mode="approx", bits=allocation.bits)` uses it.
    sens: a sensitivity.Sensitivity already measured (then batches may be None). rounding: the
    engine's ("stochastic" codes have larger, unbiased errors: measured as such)."""
    from .sensitivity import measure_sensitivity
    if sum(b is not None for b in (avg_bits, code_bytes, budget)) != 1:
        raise ValueError("give exactly one of avg_bits, code_bytes and budget (the whole plan's bytes)")
    if sens is None:
        sens = measure_sensitivity(net, batches, dtype=dtype, rounding=rounding)
    if batch_size is None:
        batch_size = sens.batch
    itemsize = numpy.dtype(dtype).itemsize
    measured_shape = tuple(sens.input_shape)
    if input_shape is not None and tuple(input_shape) != measured_shape:
        raise ValueError(f"input_shape {tuple(input_shape)} differs from the shape the sensitivity was "
                         f"measured at, {measured_shape}: measure on batches of the training input shape")
    fixed = None
    if budget is not None:
        shape = measured_shape
        fixed = fixed_plan_bytes(net, batch_size, shape, mode, dtype, workspace_bytes)
        if budget <= fixed:
            raise ValueError(f"the budget {fmt_bytes(budget)} does not cover what the plan needs besides "
                             f"the saved x-hat slots ({fmt_bytes(fixed)} at batch {batch_size})")
        code_bytes = budget - fixed
    a = allocate(sens, batch_size, code_bytes=code_bytes, avg_bits=avg_bits, choices=choices, itemsize=itemsize)
    a.fixed_bytes = fixed
    return a
