"""How wrong are approximate gradients? Their error against SGD noise, per parameter tensor.

Gradient error against SGD noise (the argument of Chakrabarti & Moseley
2019): storing activations in K bits is harmless when the error it puts in
each weight gradient is small next to the error SGD already makes by using a
mini-batch instead of the whole data set.

For every parameter tensor p, over B mini-batches b, on the same weights
(every mode sees the same batch b; rms_b is the root mean square over b):

    error_m(p) = rms_b ||g_m,b − g_exact,b|| / rms_b ||g_exact,b||       relative error of mode m
    noise(p)   = σ(p) / ||ḡ||                                            relative SGD noise
    σ(p)       = sqrt(B/(B−1) · mean_b ||g_exact,b − ḡ||²),  ḡ = mean_b g_exact,b
    ratio_m(p) = rms_b ||g_m,b − g_exact,b|| / σ(p)                      error-to-noise ratio

σ estimates how far one mini-batch gradient lies from the expected gradient
(B/(B−1) corrects for ḡ being a sample mean). ratio ≪ 1 means the
approximation is lost in the randomness SGD already has; ratio ~ 1 means it
doubles the gradient's variance (if independent of the sampling noise). The summary gives the median and worst ratio over tensors and
the same numbers for all parameters taken as one vector.

    d = gradient_errors(net, batches, bits=4)       # modes approx and naive
    print(d.table()); print(d.summary_text())

`synthetic_batches` makes learnable data (lowmem.data.datasets.synthetic) and `warm_up`
trains a copy of the network for a few exact steps first, so the gradients
are those of a network that has started learning rather than of its random
initialisation.

`lowmem diagnose` (lowmem/tools/commands/diagnose.py) prints it. The measured peak memory of a
step is lowmem/tools/peak_memory.py's.

Every Engine here gets its own copy.deepcopy of the network: an Engine takes
ownership of its network's parameter arrays. Not here: timing (benchmarks/).
"""
import copy
from dataclasses import dataclass, field

import numpy

from ..system import backend
from ..data.datasets import channel_mean_std, synthetic
from ..data.transforms import normalize
from ..core import checks
from ..core.engine import Engine
from ..units.widths import MODES, named as widths_named
from ..train.optim import SGD


# ---- data and warm-up -------------------------------------------------------

def synthetic_batches(num_batches, batch_size, input_shape, num_classes, seed=0, dtype="float32"):
    """num_batches (x, labels) pairs of learnable synthetic data, normalised per channel.

    x: (batch_size, *input_shape) dtype on the active backend; labels: int64 (batch_size,).
    """
    xs, ys, _, _ = synthetic(num_batches * batch_size, 0, num_classes, tuple(input_shape), seed)
    mean, std = channel_mean_std(xs)
    xp = backend.xp
    out = []
    for b in range(num_batches):
        sl = slice(b * batch_size, (b + 1) * batch_size)
        x = normalize(numpy.empty(xs[sl].shape, dtype), xs[sl], mean, std)
        out.append((xp.asarray(x), xp.asarray(ys[sl])))
    return out


def warm_up(net, batches, steps, lr=0.05, dtype="float32"):
    """A copy of `net` after `steps` exact SGD steps (momentum 0.9, weight decay
    5e-4) cycling through `batches`; `net` itself is left untouched."""
    if steps <= 0:
        return copy.deepcopy(net)
    x0 = batches[0][0]
    eng = Engine(copy.deepcopy(net), x0.shape[0], x0.shape[1:], "exact", dtype=dtype)
    opt = SGD(eng.net.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    for i in range(steps):
        eng.train_step(*batches[i % len(batches)], opt)
    trained = copy.deepcopy(net)
    trained.load_state_dict(eng.net.state_dict())
    return trained


# ---- gradient error ----------------------------------------------------------

def parameter_grads(net, batches, mode, bits=4, dtype="float32", rounding="nearest", seed=0):
    """Per parameter name, the float64 host gradients on each batch: {name: (B, *shape)}.

    Uses an Engine on a deep copy of `net` (so `net` is not consumed). bits: K or per-unit
    widths (Engine's bits); stochastic rounding: batch b draws the codes of engine step b of
    `seed` (another seed: another, independent draw of every code)."""
    x0 = batches[0][0]
    eng = Engine(copy.deepcopy(net), x0.shape[0], x0.shape[1:], mode, bits, dtype, rounding=rounding,
                 seed=seed)
    params = eng.net.parameters()
    out = {p.name: numpy.empty((len(batches),) + p.shape) for p in params}
    for b, (x, labels) in enumerate(batches):
        eng.forward(x, labels)
        eng.backward()
        for p in params:
            out[p.name][b] = backend.to_numpy(p.grad)
    return out


def bias_and_noise(exact, draws):
    """Bias apart from noise, all parameters as one vector. exact: {name: (B, ...)} exact
    gradients; draws: a list of D >= 1 such dicts of one approximate mode, each an independent
    draw of its codes on the same B batches. With e_bd = g_bd − g_b (flattened), m_b its mean
    over draws and μ = mean_b m_b:

        persistent_bias  sqrt(max(||μ||² − tr cov_b(m_b)/B, 0)): ||E_b E_draw e|| with the
                         finite-sample part removed; the error that does not average out
        mean_grad        the same estimate of ||E_b g_b||
        draw_noise       sqrt(D/(D−1) · mean_bd ||e_bd − m_b||²) (D >= 2; else nan): per-step noise
        sgd_noise        σ of all parameters (the module docstring)
        error            rms_bd ||e_bd||
    Returns a dict of these floats, plus bias_ratio = persistent_bias / mean_grad and
    noise_ratio = draw_noise / sgd_noise."""
    names = list(exact)
    g = numpy.concatenate([exact[n].reshape(exact[n].shape[0], -1) for n in names], axis=1)
    e = numpy.stack([numpy.concatenate([d[n].reshape(d[n].shape[0], -1) for n in names], axis=1) - g
                     for d in draws])                                   # (D, B, P)
    D, B = e.shape[0], e.shape[1]
    if B < 2:
        raise ValueError(f"bias_and_noise needs at least 2 batches, got {B}")

    def corrected(v):                         # ||E v_b||² without the sampling part, v (B, P)
        mu = v.mean(axis=0)
        tr = ((v - mu) ** 2).sum() / (B - 1)
        return float(numpy.sqrt(max((mu ** 2).sum() - tr / B, 0.0)))
    m = e.mean(axis=0)
    out = {"persistent_bias": corrected(m), "mean_grad": corrected(g),
           "draw_noise": float(numpy.sqrt(((e - m) ** 2).sum(axis=2).mean() * D / (D - 1))) if D > 1 else float("nan"),
           "sgd_noise": float(numpy.sqrt(((g - g.mean(axis=0)) ** 2).sum(axis=1).mean() * B / (B - 1))),
           "error": float(numpy.sqrt((e ** 2).sum(axis=2).mean()))}
    out["bias_ratio"] = out["persistent_bias"] / out["mean_grad"] if out["mean_grad"] > 0 else float("nan")
    out["noise_ratio"] = out["draw_noise"] / out["sgd_noise"] if out["sgd_noise"] > 0 else float("nan")
    return out


def _sq_norms(a):
    """||a[b]||^2 for each leading index b of a (B, ...) array."""
    return (a.reshape(a.shape[0], -1) ** 2).sum(axis=1)


@dataclass
class GradientDiagnosis:
    """Per parameter tensor (same order as `names`), all (T,) float64 arrays:

    grad_norm      rms over batches of ||g_exact,b||
    noise_norm     rms deviation of a mini-batch gradient from the expected one:
                   sqrt(B/(B-1) · mean_b ||g_exact,b − ḡ||²)  (B/(B-1): ḡ is itself a sample mean)
    noise          noise_norm / ||ḡ||, the relative SGD noise
    error_norm[m]  rms over batches of ||g_m,b − g_exact,b||
    error[m]       error_norm[m] / grad_norm, the relative gradient error of mode m
    ratio(m)       error_norm[m] / noise_norm: the error-to-noise ratio

    `total` holds the same quantities for all parameters taken as one vector."""
    names: list
    shapes: list
    bits: object                         # K, or per-unit widths {unit: K or "float"}
    num_batches: int
    grad_norm: numpy.ndarray
    mean_norm: numpy.ndarray
    noise_norm: numpy.ndarray
    error_norm: dict                     # mode -> (T,)
    total: dict = field(default_factory=dict)
    rounding: str = "nearest"
    dtype: str = "float32"

    @property
    def no_gradient(self):
        """(T,) bool: tensors whose exact gradient is rounding noise, 100 ulps of the dtype below the
        largest tensor's: zero in exact arithmetic (a conv's bias before a batch norm, which takes
        the mean out). Their ratios are noise over zero: medians and the worst skip them."""
        return self.grad_norm <= 100 * numpy.finfo(self.dtype).eps * numpy.max(self.grad_norm)

    @property
    def widths(self):
        """'4-bit', or per-unit widths by count ('per-unit 4-bit x3, 2-bit x4'), and the rounding."""
        if isinstance(self.bits, dict):
            w = ["float" if k == "float" else f"{k}-bit" for k in self.bits.values()]
            label = "per-unit " + ", ".join(f"{k} x{w.count(k)}" for k in dict.fromkeys(w))
        else:
            label = f"{self.bits}-bit"
        return label + checks.rounding_label(self.rounding, widths_named(self.bits))

    @staticmethod
    def _div(a, b):
        with numpy.errstate(divide="ignore", invalid="ignore"):
            return numpy.where(b > 0, a / numpy.where(b > 0, b, 1), numpy.nan)

    @property
    def modes(self):
        return list(self.error_norm)

    @property
    def noise(self):
        return self._div(self.noise_norm, self.mean_norm)

    @property
    def error(self):
        return {m: self._div(e, self.grad_norm) for m, e in self.error_norm.items()}

    def ratio(self, mode):
        """error / noise per tensor (nan where the noise is 0)."""
        return self._div(self.error_norm[mode], self.noise_norm)

    def summary(self):
        """{"noise": {median, total}, "no_gradient": [tensor names], mode: {median_error, total_error,
        median_ratio, worst_ratio, worst_tensor, total_ratio}}; medians and worst skip nan tensors
        and those with no gradient."""
        t, div = self.total, lambda a, b: float(self._div(numpy.float64(a), numpy.float64(b)))
        out = {"noise": {"median": _nanmedian(self.noise), "total": div(t["noise_norm"], t["mean_norm"])}}
        zero = self.no_gradient
        out["no_gradient"] = [n for n, z in zip(self.names, zero) if z]
        for m in self.modes:
            r = numpy.where(zero, numpy.nan, self.ratio(m))
            worst = int(numpy.nanargmax(r)) if not numpy.isnan(r).all() else None   # all nan: no gradient
            out[m] = {"median_error": _nanmedian(numpy.where(zero, numpy.nan, self.error[m])),
                      "total_error": div(t["error_norm"][m], t["grad_norm"]),
                      "median_ratio": _nanmedian(r),
                      "worst_ratio": float("nan") if worst is None else float(r[worst]),
                      "worst_tensor": None if worst is None else self.names[worst],
                      "total_ratio": div(t["error_norm"][m], t["noise_norm"])}
            if m in t.get("bias", {}):
                out[m]["bias_ratio"] = t["bias"][m]["bias_ratio"]
                out[m]["draw_noise_ratio"] = t["bias"][m]["noise_ratio"]
        return out

    def table(self):
        """One line per parameter tensor."""
        head = f"{'parameter':<28} {'shape':<16} {'|g|':>9} {'noise':>9}"
        for m in self.modes:
            head += f" {m + ' err':>11} {m + '/noise':>13}"
        lines = [head]
        err = self.error
        ratios = {m: self.ratio(m) for m in self.modes}
        for i, (n, s) in enumerate(zip(self.names, self.shapes)):
            row = f"{n:<28} {str(s):<16} {self.grad_norm[i]:>9.2e} {self.noise[i]:>9.2e}"
            for m in self.modes:
                row += f" {err[m][i]:>11.2e} {ratios[m][i]:>13.2e}"
            lines.append(row)
        return "\n".join(lines)

    def summary_text(self):
        s = self.summary()
        lines = [f"{self.widths}, {len(self.names)} parameter tensors, {self.num_batches} batches. "
                 f"SGD noise (relative): median {s['noise']['median']:.3g}, "
                 f"all parameters {s['noise']['total']:.3g}"]
        for m in self.modes:
            d = s[m]
            lines.append(f"{m:<7} relative error: median {d['median_error']:.3g}, all parameters "
                         f"{d['total_error']:.3g} | error/noise: median {d['median_ratio']:.3g}, "
                         f"worst {d['worst_ratio']:.3g} ({d['worst_tensor'] or 'no gradient'}), "
                         f"all parameters {d['total_ratio']:.3g}"
                         + (f" | persistent bias / |E g| "
                            + (f"{d['bias_ratio']:.3g}" if d["bias_ratio"] == d["bias_ratio"]
                               else "not resolved (|E g| within the batches' noise: use more --batches)")
                            + ", draw noise / SGD noise "
                            f"{d['draw_noise_ratio']:.3g}" if "bias_ratio" in d else ""))
        if s["no_gradient"]:
            lines.append(f"no gradient (zero in exact arithmetic, e.g. a conv's bias before a batch norm; "
                         f"its ratios are rounding noise over zero, left out above): "
                         + ", ".join(s["no_gradient"][:5]) + (f" and {len(s['no_gradient']) - 5} more"
                                                            if len(s["no_gradient"]) > 5 else ""))
        return "\n".join(lines)


def _nanmedian(a):
    """numpy.nanmedian without its warning: nan when every entry is nan (all gradients zero)."""
    a = a[~numpy.isnan(a)]
    return float(numpy.median(a)) if a.size else float("nan")


def gradient_errors(net, batches, bits=4, modes=("approx", "naive"), dtype="float32", rounding="nearest"):
    """Compare each mode's gradients with exact ones on the same weights and batches; bias apart
    from noise (bias_and_noise: total["bias"][mode]), from two draws of a stochastic code.

    net: a Network (not consumed: each Engine gets a deep copy); batches: a
    list of B >= 2 (x, labels) of equal batch size (B >= 2: the noise needs
    several batches); bits: K or per-unit widths (Engine's bits); rounding: the
    coded modes' ("stochastic": batch b draws engine step b's codes, seed 0).
    One Engine lives at a time; the host holds B gradients of the network per
    mode. Returns a GradientDiagnosis."""
    B = len(batches)
    if B < 2:
        raise ValueError(f"gradient_errors needs at least 2 batches to measure SGD noise, got {B}")
    for m in modes:
        if m not in MODES or m == "exact":
            raise ValueError(f"unknown mode {m!r} to compare with exact: expected 'approx' or 'naive'")
    exact = parameter_grads(net, batches, "exact", 4, dtype)      # exact mode: no widths
    names = list(exact)

    def flat(d):                                    # (B, P): all parameters as one vector
        return numpy.concatenate([d[n].reshape(B, -1) for n in names], axis=1)

    def stats(g):                                   # g: (B, ...) exact gradients of one tensor
        mean = g.mean(axis=0, keepdims=True)
        return (numpy.sqrt(_sq_norms(g).mean()), numpy.sqrt(_sq_norms(mean)[0]),
                numpy.sqrt(_sq_norms(g - mean).mean() * B / (B - 1)))

    per = numpy.array([stats(exact[n]) for n in names])          # (T, 3)
    e_all = flat(exact)
    g_all, m_all, n_all = stats(e_all)
    total = {"grad_norm": float(g_all), "mean_norm": float(m_all), "noise_norm": float(n_all),
             "error_norm": {}}
    error_norm = {}
    total["bias"] = {}
    for m in modes:
        draws = [parameter_grads(net, batches, m, bits, dtype, rounding, seed=d)
                 for d in range(1 if rounding == "nearest" else 2)]
        g = draws[0]
        error_norm[m] = numpy.array([numpy.sqrt(_sq_norms(g[n] - exact[n]).mean()) for n in names])
        total["error_norm"][m] = float(numpy.sqrt(_sq_norms(flat(g) - e_all).mean()))
        total["bias"][m] = bias_and_noise(exact, draws)
    return GradientDiagnosis(names, [exact[n].shape[1:] for n in names], bits, B,
                             per[:, 0], per[:, 1], per[:, 2], error_norm, total, rounding, str(dtype))
