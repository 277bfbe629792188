"""Sensitivity: the gradient error each BN-ReLU unit's K-bit code would cause, estimated cheaply.

The forward pass is exact, so quantizing unit u changes nothing but u's own
backward step: three places read x-tilde instead of x-hat (docs/modes.md),

    dgamma_u   = sum(dy * x)                      over u's elements, per channel
    dx_u       = gamma*rstd * (dy - mean(dy) - x * mean(dy * x))
    dW_conv(u) = the weight gradient of the conv that reads relu(gamma*x + beta),

and from dx_u the error flows on into the gradients of every layer below.
The error vector of the whole gradient is then, to first order, a sum over
units of independent terms (independent rounding errors: cross terms average
out), so its squared norm is additive:

    E(allocation) = sum_u E_u(K_u),    E_u(K) = L_u(K) + G_u * D_u(K)

    L_u(K) = ||delta dgamma_u||^2 + ||delta dW_conv(u)||^2      local, measured directly
    D_u(K) = ||delta dx_u||^2                                   what u injects below
    G_u    = sum over parameter tensors l below u of h_l        how much of it reaches them

All three quantities of a unit are measured at every K in one backward sweep
of an exact-mode engine: at u's steps the exact incoming gradient and the
exact x-hat are at hand, so x-tilde_K = window.quantize_simulated(x-hat, K)
gives each delta exactly, for all four widths (the saturation beyond the
window included: no scaling law is assumed). The gain h_l of tensor l (the
squared error that reaches l per unit of squared dx error injected above it)
comes from ONE more backward sweep on the same forward state with every unit
at the calibration width K0 (`simulate`): there the measured error of tensor
l minus its local part is what arrived from above, and

    h_l = (measured_l(K0) - local_l(K0)) / sum over units u above l of D_u(K0).

Cost per batch: one forward, two backward sweeps, and for each unit four
quantizations and four extra conv weight gradients: a few training steps in
all (`Sensitivity.seconds`; benchmarks/bits_validate.py reports it as a
multiple of a step). All errors are squared norms summed over parameters,
averaged over the batches; `noise_norm` is the SGD noise of all parameters
taken as one vector, as lowmem.tools.gradient_error defines it, so
sqrt(E) / noise_norm is the predicted error-to-noise ratio of `lowmem diagnose`.

`simulate` (lowmem/bits/simulate.py) is also the measurement the estimate is
validated against: the gradients of approx mode with any per-unit widths,
and `simulate_draws` the same split into bias and draw variance.

    sens = measure_sensitivity(net, batches)        # batches: B >= 2 (x, labels)
    sens.predict({"stage1.block0.bn1": 2, ...})     # predicted error norm
"""
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy

from ..units import quantize_simulated, stream
from ..units.widths import BITS, FLOAT, check_bits, check_rounding, code_for
from ..ops import conv2d_backward_weight, grouped_conv2d_backward_weight
from ..core.optable import OPS
from .simulate import BIAS_STEPS, SimulatedCodeUnits, _sq, _units, exact_engine, objective_of, sweep_gradients
from .simulate import simulate, simulate_draws  # noqa: F401  (the measurement the estimate is checked against)

CALIBRATION_BITS = 2


def _xhat(eng, slot, shape):
    """A unit's saved x-hat (exact engine) for the current batch: (C, n*H*W) rows."""
    c, h, w = shape
    return eng.arrays[slot][:, :eng.run.n * h * w]


@dataclass
class Sensitivity:
    """Per unit (`units`, in forward order), every value averaged over the batches:

    shapes[u]        (C, H, W) per sample;  elements[u] = C*N*H*W at the measured batch N
    local[u][K]      L_u(K): squared error of u's own dgamma and its conv's dW
    inject[u][K]     D_u(K): squared error of u's dx
    local_var, inject_var  the part of each that is draw variance (stochastic codes, two draws per
                     batch: ||d1 − d2||²/2; 0 for nearest rounding): the rest is bias²
    mean_grad_norm   ||E g|| of all parameters (||mean||² − tr(cov)/B over the batches)
    gain[u]          G_u: the fraction of injected squared error reaching the gradients below
    noise_norm       SGD noise of all parameters (gradient_error's sigma, one vector)
    grad_norm        rms over batches of the exact gradient's norm
    calibration      {"bits": K0, "measured": measured squared error at uniform K0}
    seconds          wall time of the measurement; batch, num_batches, input_shape (C, H, W)"""
    units: list
    shapes: dict
    elements: dict
    local: dict
    inject: dict
    gain: dict
    noise_norm: float
    grad_norm: float
    calibration: dict
    seconds: float
    batch: int
    num_batches: int
    input_shape: tuple = ()
    rounding: str = "nearest"
    local_var: dict = None
    inject_var: dict = None
    mean_grad_norm: float = float("nan")

    def error2(self, unit, bits):
        """E_u(K): predicted squared gradient error (all parameters) of `unit` at `bits`
        (FLOAT or None: 0, x-hat is exact)."""
        if bits in (None, FLOAT):
            return 0.0
        return self.local[unit][bits] + self.gain[unit] * self.inject[unit][bits]

    def variance2(self, unit, bits):
        """The draw-variance part of error2 (0 for deterministic codes and for FLOAT)."""
        if bits in (None, FLOAT) or self.local_var is None:
            return 0.0
        return self.local_var[unit][bits] + self.gain[unit] * self.inject_var[unit][bits]

    def bias2(self, unit, bits):
        """The persistent part of error2: what remains after the draws' variance."""
        return max(self.error2(unit, bits) - self.variance2(unit, bits), 0.0)

    def objective(self, unit, bits, bias_steps=BIAS_STEPS):
        """What the allocator minimises (docs/bits.md §3b): (H·bias² + variance) / σ², the unit's
        squared error in the update SGD with momentum applies, against the SGD noise's there (a
        bias adds up over the steps momentum sums, zero-mean noise does not: H = bias_steps =
        (1+β)/(1−β), 19 at β = 0.9). The unbiased code (rounding "stochastic", K >= 2) is priced
        by its variance alone: its bias is 0 by construction (E x̃ = x̂) and the two-draw estimate
        of it is noise; a 1-bit unit (no unbiased code exists) is all bias."""
        if bits in (None, FLOAT):
            return 0.0
        bias2 = 0.0 if code_for(self.rounding, bits).unbiased else self.bias2(unit, bits)
        return objective_of(bias2, self.variance2(unit, bits), self.noise_norm, bias_steps)

    def widths(self, allocation):
        """{unit: K or FLOAT} for every unit of an allocation {unit: K or FLOAT} (missing: FLOAT);
        ValueError naming a unit the network does not have."""
        for u in allocation:
            if u not in self.shapes:
                raise ValueError(f"unknown unit {u!r}; the units are {', '.join(self.units)}")
        return {u: allocation.get(u, FLOAT) for u in self.units}

    def predict2(self, allocation):
        """Predicted squared error norm of an allocation {unit: K or FLOAT} (missing: FLOAT)."""
        return sum(self.error2(u, k) for u, k in self.widths(allocation).items())

    def predict(self, allocation):
        """Predicted rms norm of the gradient error of an allocation (gradient_error's error_norm)."""
        return math.sqrt(self.predict2(allocation))

    def ratio(self, allocation):
        """Predicted error-to-noise ratio of all parameters (gradient_error's total_ratio)."""
        return self.predict(allocation) / self.noise_norm


def measured_batches(batches, what="batches"):
    """`batches`, any iterable of (x, labels) pairs, as a list; ValueError naming what is wrong."""
    if batches is None or isinstance(batches, (str, bytes)) or not isinstance(batches, Iterable):
        raise ValueError(f"{what} must be a few (x, labels) mini-batches (a list or any iterable), "
                         f"got {type(batches).__name__}")
    out = list(batches)
    for i, b in enumerate(out):
        if not (isinstance(b, (tuple, list)) and len(b) == 2 and getattr(b[0], "ndim", None) == 4):
            raise ValueError(f"{what}[{i}] must be an (x, labels) pair with x of shape (N, C, H, W), "
                             f"got {type(b).__name__}")
        if b[0].shape != out[0][0].shape:
            raise ValueError(f"{what}[{i}] has shape {tuple(b[0].shape)}, {what}[0] {tuple(out[0][0].shape)}: "
                             f"measure on batches of one shape")
    return out


def measure_sensitivity(net, batches, calibration_bits=CALIBRATION_BITS, dtype="float32", rounding="nearest"):
    """Measure L_u(K), D_u(K) for K in 1, 2, 4, 8 and G_u for every unit of `net` on `batches`
    (a list of B >= 2 (x, labels) of equal batch size; the noise needs several). `net` is not
    consumed (the exact engine gets a deep copy). rounding="stochastic": the errors of
    stochastic codes (one draw per unit, K and batch, from fixed keys). Returns a Sensitivity."""
    rounding = check_rounding(rounding)
    batches = measured_batches(batches)
    B = len(batches)
    if B < 2:
        raise ValueError(f"measure_sensitivity needs at least 2 batches to measure SGD noise, got {B}")
    calibration_bits = check_bits(calibration_bits)
    t0 = time.perf_counter()
    eng = exact_engine(net, batches, dtype)
    xp = eng.xp
    units = _units(eng)
    shapes = {u: eng.in_shape[u] for u in units}
    params = [p.name for p in eng.net.parameters()]
    owner = {}                                    # parameter tensor -> the unit whose code it reads locally
    local = {u: dict.fromkeys(BITS, 0.0) for u in units}
    inject = {u: dict.fromkeys(BITS, 0.0) for u in units}
    local_var = {u: dict.fromkeys(BITS, 0.0) for u in units}
    inject_var = {u: dict.fromkeys(BITS, 0.0) for u in units}
    acc = (local, inject, local_var, inject_var)
    tensor_local = {p: 0.0 for p in params}       # L at K0, by parameter tensor (for the gains)
    arrival = {p: 0.0 for p in params}            # sum of D_u(K0) over units above tensor p
    measured_tensor = {p: 0.0 for p in params}
    exact_grads, measured_total = [], 0.0
    for bi, (x, labels) in enumerate(batches):
        eng.forward(x, labels)
        keys = {u: stream.stream_key(bi, 0, i) for i, u in enumerate(units)}
        injected_so_far = [0.0]                   # sum of D_u(K0) of the units swept so far
        cache = {}                                # unit -> (mask, {K: x-tilde - x-hat}), until u's own step

        def before(step):
            if OPS[step.op].unit:                 # a BN-ReLU unit (the op table's flag)
                u = step.layer.name
                g, b = (eng.run.params[n].data for n in step.params)
                owner[step.params[0]] = u
                for p in step.params:
                    arrival[p] += injected_so_far[0]
                _measure_unit(eng, step, u, g, b, acc, tensor_local, calibration_bits, cache,
                              rounding, keys[u])
                injected_so_far[0] += inject_batch[u]
            elif step.unit:                       # a conv whose input a unit's slot rebuilds
                u = step.unit
                owner[step.params[0]] = u
                arrival[step.params[0]] += injected_so_far[0]
                _measure_conv(eng, step, u, acc, tensor_local, calibration_bits, cache, rounding, keys[u])
            else:
                for p in step.params:
                    arrival[p] += injected_so_far[0]

        inject_batch = _InjectView(inject, calibration_bits)
        exact = sweep_gradients(eng, before=before)
        calib = {u: SimulatedCodeUnits(calibration_bits, rounding, keys[u]) for u in units}
        approx = sweep_gradients(eng, units=calib)
        exact_grads.append(exact)
        for p in params:
            e = _sq(approx[p] - exact[p])
            measured_tensor[p] += e
            measured_total += e
    # averages over batches
    for d in acc:
        for u in units:
            for k in BITS:
                d[u][k] /= B
    for d in (tensor_local, arrival, measured_tensor):
        for p in params:
            d[p] /= B
    measured_total /= B
    # the gain of each tensor, then G_u = the sum of the gains of the tensors below u
    h = {p: (max(measured_tensor[p] - tensor_local[p], 0.0) / arrival[p] if arrival[p] > 0 else 0.0)
         for p in params}
    order = _backward_order(eng)                 # (unit or None, [param names]) in backward order
    gain, below = {}, 0.0
    for unit, ps in reversed(order):             # from the input up: accumulate what lies below
        if unit is not None:
            gain[unit] = below                   # tensors strictly below u's dx (its own gamma excluded)
        below += sum(h[p] for p in ps)
    flat = numpy.stack([numpy.concatenate([g[p].ravel() for p in params]) for g in exact_grads])
    mean = flat.mean(axis=0)
    noise_norm = math.sqrt(((flat - mean) ** 2).sum(axis=1).mean() * B / (B - 1))
    grad_norm = math.sqrt((flat ** 2).sum(axis=1).mean())
    mean_grad = math.sqrt(max((mean ** 2).sum() - ((flat - mean) ** 2).sum() / (B - 1) / B, 0.0))
    n = batches[0][0].shape[0]
    return Sensitivity(units, shapes, {u: int(math.prod(shapes[u])) * n for u in units}, local, inject,
                       gain, noise_norm, grad_norm, {"bits": calibration_bits, "measured": measured_total},
                       time.perf_counter() - t0, n, B, tuple(batches[0][0].shape[1:]), rounding,
                       local_var, inject_var, mean_grad)


class _InjectView:
    """inject[u][K0] of the current batch (the running sum minus what it held before)."""

    def __init__(self, inject, k0):
        self.inject, self.k0 = inject, k0
        self.before = {u: d[k0] for u, d in inject.items()}

    def __getitem__(self, u):
        return self.inject[u][self.k0] - self.before[u]


def _backward_order(eng):
    """[(unit name or None, [parameter tensors whose gradient this backward step writes])] in
    backward order; a unit's entry lists its gamma and beta."""
    out = []
    for step in eng.schedule:
        if step.phase == "bwd" and step.layer is not None:          # not the loss
            out.append((step.layer.name if OPS[step.op].unit else None, list(step.params)))
    return out


def _deltas(cache, u, xhat, gamma, beta, rounding, key):
    """(exact mask, {K: [x-tilde_K - x-hat of each draw]}) of unit u, once per batch (unit-sized
    arrays): one draw for nearest rounding, two independent ones (keys key, mix64(key + 1)) for a
    stochastic code, so bias and variance can be told apart."""
    if u not in cache:
        mask = (xhat * gamma[:, None]) + beta[:, None] > 0      # the forward's exact expression
        keys = [key] if rounding == "nearest" else [key, stream.mix64(key + 1)]
        cache[u] = mask, {k: [quantize_simulated(xhat, gamma, beta, k, rounding, kk)[0] - xhat
                              for kk in keys] for k in BITS}
    return cache[u]


def _add(acc, i, u, k, vectors):
    """Accumulate the squared error (mean over draws) and its draw variance of one measured
    quantity: acc[i] += mean ||d||², acc[i + 2] += ||d1 − d2||²/2 (two draws). Returns the first."""
    e = sum(_sq(v) for v in vectors) / len(vectors)
    acc[i][u][k] += e
    if len(vectors) == 2:
        acc[i + 2][u][k] += min(_sq(vectors[0] - vectors[1]) / 2, e)
    return e


def _measure_unit(eng, step, u, gamma, beta, acc, tensor_local, k0, cache, rounding, key):
    """At unit u's backward step, before it runs: the exact incoming gradient dr and x-hat give
    delta dgamma and delta dx of quantizing u at each K (each draw)."""
    xhat = _xhat(eng, step.saved[0], step.in_shape)
    rstd = eng.arrays[step.saved[1]]
    C, M = xhat.shape
    mask, deltas = _deltas(cache, u, xhat, gamma, beta, rounding, key)
    del cache[u]                                            # u's convs ran before it: done with u
    dy = eng.run.rows(step.dout, step.out_shape) * mask
    s_exact = (dy * xhat).sum(axis=1)
    for k in BITS:
        dgammas, ddxs = [], []
        for delta in deltas[k]:
            dgamma = (dy * delta).sum(axis=1)                # delta dgamma = S(x-tilde) - S(x-hat), (C,)
            # dx differs only in its last term, gamma*rstd/M * x*S(x): the difference of it at
            # x-tilde = x-hat + delta and at x-hat
            dgammas.append(dgamma)
            ddxs.append((gamma * rstd / M)[:, None] * (xhat * s_exact[:, None]
                                                       - (xhat + delta) * (s_exact + dgamma)[:, None]))
        e_local = _add(acc, 0, u, k, dgammas)
        _add(acc, 1, u, k, ddxs)
        if k == k0:
            tensor_local[step.params[0]] += e_local


def _measure_conv(eng, step, u, acc, tensor_local, k0, cache, rounding, key):
    """At the backward step of a conv reading unit u: delta dW of u's code at each K, from the
    exact output gradient: one extra weight gradient per width (the conv input's error at each
    K, rebuilt into the scratch buffer the handler is about to overwrite)."""
    xp, run = eng.xp, eng.run
    L, p = step.layer, run.params[step.params[0]]
    g, b = (run.params[n].data for n in step.unit_params)
    xhat = _xhat(eng, step.unit_saved, step.in_shape)
    mask, deltas = _deltas(cache, u, xhat, g, b, rounding, key)
    du = run.rows(step.scratch, step.in_shape)
    for k in BITS:
        dws = []
        for delta in deltas[k]:
            # approx's rebuilt input minus the exact one where the mask is open (0 where closed);
            # the dithered code's is not clamped at 0 (units/unbiased.py)
            rebuilt = (xhat + delta) * g[:, None] + b[:, None]
            if not code_for(rounding, k).dither:
                rebuilt = xp.maximum(rebuilt, 0)
            xp.copyto(du, xp.where(mask, rebuilt - (xhat * g[:, None] + b[:, None]), 0))
            dw = xp.zeros_like(p.data)
            x, dout, ws = run.act(step.scratch, step.in_shape), run.act(step.dout, step.out_shape), eng.arrays["conv.cols"]
            if L.groups == 1:
                conv2d_backward_weight(dw, x, dout, L.stride, L.pad, ws)
            else:                                   # grouped and depthwise: each group's own weights
                grouped_conv2d_backward_weight(dw, x, dout, L.stride, L.pad, L.groups, ws)
            dws.append(dw)
        e = _add(acc, 0, u, k, dws)
        if k == k0:
            tensor_local[step.params[0]] += e
