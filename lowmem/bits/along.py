"""The price of a code over a whole run: the sensitivity at points along training, weighed by
the learning rate there.

One measurement (sensitivity.py) prices a unit's code at one set of weights. What a code costs
a run is the error it adds at every step, and both the error and the SGD noise it is measured
against change as training goes: the draw noise of the 2-bit unbiased code is 0.7 of SGD's at
the initial weights and 1.05 by the end of a run (docs/accuracy.md). So the run's price of
widths {u: K_u} is the allocator's objective (Sensitivity.objective: the squared error in the
update momentum applies over the SGD noise's) averaged along the run,

    price = Σ_t w_t Σ_u objective_t(u, K_u),     w_t ∝ ∫ lr(i) φ_t(i) di,   Σ_t w_t = 1

measured at weights from points t of a run (its checkpoints: the iteration i_t of each, the
run's schedule lr(i)), with φ_t the trapezoid rule's hat on the iterations (the objective taken
linear between neighbouring points). The learning rate weighs it because a step moves the
weights by lr times its gradient, noise and error alike: an error of ratio r to SGD's noise at
step i raises the noise the weights take in there by lr(i)·r²σ²; where the rate has decayed
the error no longer moves the weights. The study in docs/bits.md §3c checks the price against
measured accuracy.

    points = lowmem.train.trainstate.run_points(net, ["run/epoch1.ckpt", ...])   # or Point(...)s
    rs = measure_along(points, batches, rounding="stochastic")
    rs.price({"layer1.0.bn1": 2, ...})          # or allocate(rs, batch_size=128, avg_bits=2.125)

A RunSensitivity stands where a Sensitivity does in allocate.allocate: its errors are relative
to the SGD noise of each point (noise_norm 1), so Allocation's error/noise column shows the
run's lr-weighted ratio.
"""
import bisect
import math
from dataclasses import dataclass

from .sensitivity import measure_sensitivity, measured_batches
from .simulate import BIAS_STEPS


@dataclass
class Point:
    """Weights along a run: `net` holding them, the step `iteration` they were taken at, the
    learning rate `lr` the schedule gives there, the run's `total` iterations and its
    `schedule` (iteration -> learning rate; None: unknown, the rates at the points stand for it)."""
    net: object
    iteration: int
    lr: float
    total: int = None
    schedule: object = None


def run_weights(iterations, lrs, total=None, schedule=None):
    """Weights of points at `iterations` (strictly increasing): w_t ∝ Σ_i lr(i)·φ_t(i) over the
    run's iterations i, φ_t the trapezoid rule's hat on the points (1 at i_t, 0 at its
    neighbours; the first and last points also stand for the iterations before the first and,
    up to `total`, after the last), normalised to sum 1. lr(i) is schedule(i) when a schedule
    (iteration -> rate) and `total` are given, else the rates `lrs` at the points, linear between
    them. ValueError for unordered points or when every weight is 0."""
    its, lrs = [int(i) for i in iterations], [float(r) for r in lrs]
    if not its or len(its) != len(lrs):
        raise ValueError("give one learning rate per point, and at least one point")
    if any(b <= a for a, b in zip(its, its[1:])):
        raise ValueError(f"the points must be at increasing iterations, got {its}")
    if any(not math.isfinite(r) or r < 0 for r in lrs):
        raise ValueError(f"the learning rates must be finite and >= 0, got {lrs}")
    end = its[-1] + 1 if total is None else max(int(total), its[-1] + 1)     # the iterations 0 .. end - 1
    if len(its) == 1:
        return [1.0]
    if schedule is None or total is None:
        def schedule(i):
            t = min(max(bisect.bisect_right(its, i) - 1, 0), len(its) - 2)
            f = min(max((i - its[t]) / (its[t + 1] - its[t]), 0.0), 1.0)
            return lrs[t] + f * (lrs[t + 1] - lrs[t])
    raw = [0.0] * len(its)
    for i in range(end):
        t = bisect.bisect_right(its, i) - 1
        r = float(schedule(i))
        if t < 0:
            raw[0] += r
        elif t >= len(its) - 1:
            raw[-1] += r
        else:
            f = (i - its[t]) / (its[t + 1] - its[t])
            raw[t] += r * (1 - f)
            raw[t + 1] += r * f
    if not sum(raw) > 0:
        raise ValueError("every point has weight 0 (learning rate 0 along the whole run)")
    return [w / sum(raw) for w in raw]


class RunSensitivity:
    """The sensitivity at points along a run (sensitivity.Sensitivity each), weighed by
    run_weights: the quantities of one Sensitivity averaged over the run, each relative to its
    own point's SGD noise (so noise_norm is 1)."""

    noise_norm = 1.0

    def __init__(self, points, sens, weights):
        if not sens or len(sens) != len(weights) or len(points) != len(sens):
            raise ValueError("one sensitivity and one weight per point")
        first = sens[0]
        for s in sens[1:]:
            if s.units != first.units or s.shapes != first.shapes or s.rounding != first.rounding:
                raise ValueError("the points' sensitivities differ in units, shapes or rounding: "
                                 "price one network with one rounding")
        self.points, self.sens, self.weights = points, sens, list(weights)
        self.units, self.shapes, self.elements = first.units, first.shapes, first.elements
        self.rounding, self.batch, self.input_shape = first.rounding, first.batch, first.input_shape
        self.seconds = sum(s.seconds for s in sens)

    def _mean(self, value):
        return sum(w * value(s) / (s.noise_norm ** 2 if s.noise_norm > 0 else 1.0)
                   for w, s in zip(self.weights, self.sens))

    def error2(self, unit, bits):
        """E_u(K) over the run: Σ_t w_t error2_t / σ_t²."""
        return self._mean(lambda s: s.error2(unit, bits))

    def variance2(self, unit, bits):
        return self._mean(lambda s: s.variance2(unit, bits))

    def bias2(self, unit, bits):
        return self._mean(lambda s: s.bias2(unit, bits))

    def objective(self, unit, bits, bias_steps=BIAS_STEPS):
        """Σ_t w_t objective_t(u, K): what the allocator minimises, over the run."""
        return sum(w * s.objective(unit, bits, bias_steps) for w, s in zip(self.weights, self.sens))

    def price_at(self, bits, bias_steps=BIAS_STEPS):
        """[Σ_u objective_t(u, K_u) for each point t]: the price's path along the run."""
        bits = self._check(bits)
        return [sum(s.objective(u, bits[u], bias_steps) for u in self.units) for s in self.sens]

    def price(self, bits, bias_steps=BIAS_STEPS):
        """The run's price of widths {unit: K or "float"} (missing units: float), or of one K
        for every unit: Σ_t w_t Σ_u objective_t(u, K_u)."""
        return sum(w * p for w, p in zip(self.weights, self.price_at(bits, bias_steps)))

    def _check(self, bits):
        return self.sens[0].widths(bits) if isinstance(bits, dict) else dict.fromkeys(self.units, bits)


def measure_along(points, batches, rounding="nearest", dtype="float32", total=None, log=None):
    """Measure the sensitivity (measure_sensitivity) of each Point's net on the same `batches`
    (B >= 2 (x, labels)) and weigh the points by run_weights (total: the run's iterations, so the
    last point also stands for the steps after it). log(text): a line per point measured.
    Returns a RunSensitivity."""
    if not points:
        raise ValueError("measure_along needs at least one point of the run")
    batches = measured_batches(batches)
    if total is None:
        total = points[-1].total
    sens = []
    for p in points:
        sens.append(measure_sensitivity(p.net, batches, dtype=dtype, rounding=rounding))
        if log is not None:
            log(f"  measured at iteration {p.iteration} (lr {p.lr:.4g}) in {sens[-1].seconds:.0f} s")
    w = run_weights([p.iteration for p in points], [p.lr for p in points], total, points[-1].schedule)
    return RunSensitivity(points, sens, w)
