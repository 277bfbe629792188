"""Simulate: the measured gradient error of approx mode with any per-unit widths, against exact.

What the sensitivity estimate (sensitivity.py) predicts is validated against this. On the exact
engine's forward state, a backward sweep in which unit u reads x-tilde at its width (from the
saved float x-hat, `quantize_simulated`, which the packed codes match bit for bit) instead of
x-hat gives approx mode's gradients; a unit missing from the allocation (or "float") stays exact.

With e_bd = g_approx − g_exact on batch b in draw d (all parameters as one vector; D draws of
a stochastic code per batch, from distinct keys, b = 1..B) and m_b = mean_d e_bd:

    error2       mean_bd ||e_bd||²                                  the raw squared error
    variance2    D/(D−1) · mean_bd ||e_bd − m_b||²                  the draws' own variance
    bias2        error2 − variance2                                 ||E_draw e_b||², mean over b
    persistent2  max(||μ||² − tr cov_b(m_b)/B, 0),  μ = mean_b m_b  ||E_b E_draw e||²: what
                                                                    averages out neither over
                                                                    draws nor over batches

bias2 is what sensitivity's Sensitivity.bias2 predicts (per batch: it includes the part of a
deterministic error that changes from batch to batch); persistent2 is lowmem.tools.gradient_error'
"persistent bias" (the finite-sample part removed, as there). Nearest rounding has variance2
exactly 0 (its draws are identical) and bias2 = error2.

    m = simulate_draws(net, batches, {"layer1.0.bn1": 2, ...}, rounding="stochastic", draws=4)
    m.error_norm, m.bias2, m.variance2, m.persistent2, m.objective
    error_norm, noise_norm = simulate(net, batches, allocation)   # one draw

Both run on exact_engine(net, batches, dtype) and sweep_gradients(eng, units): the backward sweep
over the exact engine's forward state with other kernel sets for some units (with them,
benchmarks/unbiased_bias.py prices quantizers that are not lowmem's codes).
"""
import copy
import math
from dataclasses import dataclass

import numpy

from ..system import backend
from ..units import quantize_simulated, stream
from ..core.engine import Engine
from ..units.reference import ExactUnits
from ..units.widths import FLOAT, check_bits, check_rounding, code_for
from ..ops import bn_relu_backward


class SimulatedCodeUnits(ExactUnits):
    """Reads the exact engine's float x-hat slot but backward sees x-tilde at `bits`: the approx
    mode's backward (exact mask, x-tilde in the BN terms and in the conv input), for one unit.
    Allocates a few unit-sized temporaries per call (a measurement tool, not a training path)."""

    def __init__(self, bits, rounding="nearest", key=0):
        self.bits, self.rounding, self.key = check_bits(bits), check_rounding(rounding), key
        self._kept = None        # (x-tilde, mask) from conv_input, for this unit's backward next

    def _quantize(self, saved, gamma, beta, keep):
        # one set per unit (simulate): its convs' backward steps run just before its own, on
        # the same x-hat, so the quantization is done once per sweep
        if self._kept is None:
            self._kept = quantize_simulated(saved, gamma, beta, self.bits, self.rounding, self.key)
        out = self._kept
        if not keep:
            self._kept = None
        return out

    def conv_input(self, u, saved, gamma, beta):
        xt, mask = self._quantize(saved, gamma, beta, keep=True)
        xp = backend.array_module(u)
        # approx mode's rebuilt input: relu(gamma*x-tilde + beta) where the exact mask is open,
        # else 0 (docs/quantizer.md: the decoded conv input of an open element is never negative;
        # the dithered code's is gamma*x-tilde + beta unclamped, units/unbiased.py)
        rebuilt = xt * gamma[:, None] + beta[:, None]
        if not code_for(self.rounding, self.bits).dither:
            rebuilt = xp.maximum(rebuilt, 0)
        xp.copyto(u, xp.where(mask, rebuilt, 0))

    def backward(self, dx, dgamma, dbeta, dr, saved, rstd, gamma, beta, accumulate, scratch):
        xt, mask = self._quantize(saved, gamma, beta, keep=False)
        dr *= mask
        bn_relu_backward(dx, dgamma, dbeta, dr, xt, gamma, beta, rstd, dr_already_masked=True, accumulate=accumulate)


def exact_engine(net, batches, dtype):
    """An exact-mode Engine for a copy of `net` at the batches' size and shape, whose units keep
    the float x-hat that `sweep_gradients` hands to other kernel sets."""
    x0 = batches[0][0]
    eng = Engine(copy.deepcopy(net), x0.shape[0], x0.shape[1:], "exact", dtype=dtype)
    if any(u.saved_suffix != "xhat" for u in eng.selected.values()):
        raise RuntimeError("the sensitivity measurement needs an exact-mode float x-hat slot")
    return eng


def _units(eng):
    return list(eng.unit_bits)


def sweep_gradients(eng, units=None, before=None):
    """The engine's backward sweep over the current forward state of the exact engine `eng`
    (exact_engine; kept for another sweep), with `units` {unit: kernel set} in place of the exact
    sets (e.g. SimulatedCodeUnits) and `before(step)` before each step (Engine.backward); returns
    {param name: float64 grad copy}.

        eng = exact_engine(net, batches, "float32"); eng.forward(x, y)
        exact = sweep_gradients(eng)
        approx = sweep_gradients(eng, {u: SimulatedCodeUnits(2) for u in eng.unit_bits})"""
    eng.backward(units=units, before=before, keep=True)
    return {p.name: backend.to_numpy(p.grad).astype(numpy.float64) for p in eng.net.parameters()}


def _sq(a):
    """||a||^2 as a Python float (a dot product: no float64 copy of an activation-sized array)."""
    xp = backend.array_module(a)
    a = a.reshape(-1) if a.flags.c_contiguous else xp.ascontiguousarray(a).reshape(-1)
    return float(xp.dot(a, a))


BIAS_STEPS = 19      # H = (1 + β)/(1 − β) at SGD momentum β = 0.9 (the trainer's default)


def bias_steps_for(momentum):
    """H = (1 + β)/(1 − β) for SGD momentum β in [0, 1) (objective_of says why); None: BIAS_STEPS."""
    if momentum is None:
        return BIAS_STEPS
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
    return (1 + momentum) / (1 - momentum)


def objective_of(bias2, variance2, noise_norm, bias_steps=BIAS_STEPS):
    """(H·bias² + variance) / σ², H = bias_steps (docs/bits.md §3b): the squared error of the
    update momentum applies over the SGD noise's in it. With momentum β the update is
    Σ_k β^k g_{t−k}: a bias the same at every step passes with weight Σ β^k = 1/(1−β), zero-mean
    noise independent from step to step with Σ β^2k = 1/(1−β²), so against the noise a bias
    weighs H = (1+β)/(1−β) times what it does in one gradient. σ = 0 (batches all alike):
    H·bias² + variance itself."""
    n2 = noise_norm ** 2
    raw = bias_steps * bias2 + variance2
    return raw / n2 if n2 > 0 else raw


def corrected_mean2(v):
    """||E v_b||² of B >= 2 samples v (B, P) without their sampling part: ||mean||² − tr cov/B,
    clipped at 0 (lowmem.tools.gradient_error' estimate)."""
    B = v.shape[0]
    mu = v.mean(axis=0)
    return max(float((mu ** 2).sum()) - float(((v - mu) ** 2).sum()) / (B - 1) / B, 0.0)


@dataclass
class Measured:
    """The measured error of one allocation (the module docstring's quantities, squared norms of
    all parameters), with the exact gradients' SGD noise σ (noise_norm) and ||E g||
    (mean_grad_norm) on the same batches; draws D and batches B."""
    error2: float
    bias2: float
    variance2: float
    persistent2: float
    noise_norm: float
    mean_grad_norm: float
    draws: int
    batches: int

    @property
    def error_norm(self):
        """rms gradient error norm (simulate's first return)."""
        return math.sqrt(self.error2)

    def objective(self, bias_steps=BIAS_STEPS):
        """The allocator's objective measured: (H·bias2 + variance2) / σ² (objective_of; what
        Sensitivity.objective summed over units predicts)."""
        return objective_of(self.bias2, self.variance2, self.noise_norm, bias_steps)

    def persistent_objective(self, bias_steps=BIAS_STEPS):
        """The same with only the bias that persists over batches as bias and all the rest of the
        error (draw variance and the batch-to-batch part of the bias) as noise."""
        return objective_of(self.persistent2, max(self.error2 - self.persistent2, 0.0), self.noise_norm,
                            bias_steps)


def _check_allocation(eng, allocation):
    units = _units(eng)
    for u in allocation:
        if u not in units:
            raise ValueError(f"unknown unit {u!r}; the units are {', '.join(units)}")
    return {u: i for i, u in enumerate(units)}


def simulate_draws(net, batches, allocation, dtype="float32", rounding="nearest", draws=2, seed=0):
    """Measured error of approx mode with per-unit widths `allocation` {unit: K or FLOAT} (missing
    units: FLOAT) against exact, on the same weights and batches ((x, labels) of one shape; B >= 2
    for persistent2, σ and ||E g||, else those are nan), `draws` D >= 1 draws per batch. Draw d of
    batch b reads unit i's code from key stream.stream_key(seed + d, b, i): what an approx Engine
    with seed + d draws at its b-th training forward (nearest: no key, every draw alike).
    Returns a Measured."""
    rounding = check_rounding(rounding)
    if not (isinstance(draws, int) and not isinstance(draws, bool) and draws >= 1):
        raise ValueError(f"draws must be a positive integer, got {draws!r}")
    eng = exact_engine(net, batches, dtype)
    order = _check_allocation(eng, allocation)
    widths = {u: k for u, k in allocation.items() if k not in (None, FLOAT)}
    exact_flat, means, spread, err = [], [], 0.0, 0.0
    for bi, (x, labels) in enumerate(batches):
        eng.forward(x, labels)
        exact = sweep_gradients(eng)
        g = numpy.concatenate([exact[p].ravel() for p in exact])
        es = []
        for d in range(draws):
            sets = {u: SimulatedCodeUnits(k, rounding, stream.stream_key(seed + d, bi, order[u]))
                    for u, k in widths.items()}
            approx = sweep_gradients(eng, units=sets)
            es.append(numpy.concatenate([approx[p].ravel() for p in exact]) - g)
        es = numpy.stack(es)                                  # (D, P)
        # the spread about the first draw's error: draws all alike (nearest) give exactly 0
        diffs = es - es[0]
        shift = diffs.mean(axis=0)
        m = es[0] + shift
        err += float((es ** 2).sum()) / draws
        spread += float(((diffs - shift) ** 2).sum()) / draws
        exact_flat.append(g)
        means.append(m)
    B = len(batches)
    exact_flat, means = numpy.stack(exact_flat), numpy.stack(means)
    error2 = err / B
    if draws > 1:
        variance2 = spread / B * draws / (draws - 1)
    else:                          # one draw: no variance to tell apart, unless the code has none
        variance2 = 0.0 if rounding == "nearest" or not widths else float("nan")
    bias2 = max(error2 - variance2, 0.0) if not math.isnan(variance2) else float("nan")
    if B > 1:
        noise = math.sqrt(((exact_flat - exact_flat.mean(axis=0)) ** 2).sum(axis=1).mean() * B / (B - 1))
        persistent2, mean_grad = corrected_mean2(means), math.sqrt(corrected_mean2(exact_flat))
    else:
        noise = persistent2 = mean_grad = float("nan")
    return Measured(error2, bias2, variance2, persistent2, noise, mean_grad, draws, B)


def simulate(net, batches, allocation, dtype="float32", rounding="nearest"):
    """Measured rms gradient error norm (all parameters) of approx mode with per-unit widths
    `allocation` {unit: K or FLOAT} (missing units: FLOAT) against exact, on the same weights and
    batches, one draw per batch (an Engine's with seed 0), and the exact gradients' noise norm
    (nan for one batch): returns (error_norm, noise_norm). simulate_draws splits the error into
    bias and variance."""
    m = simulate_draws(net, batches, allocation, dtype, rounding, draws=1)
    return m.error_norm, m.noise_norm
