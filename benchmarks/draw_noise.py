"""Where the unbiased 2-bit code's draw noise comes from, and what lowers it: simulated codes.

    python benchmarks/draw_noise.py [--checkpoint RUN/epoch3.ckpt] [--codes code,g64,...] [--per-unit]
                                    [--batches 4] [--batch 128] [--depth 20] [--out FILE.json]

On a pre-act ResNet (its weights from a lowmem training checkpoint, e.g. the accuracy study's
exact run's epoch<E>.ckpt, or the seed's initial weights) and B fixed Fashion-MNIST training
batches (28x28, normalised, not augmented: benchmarks/accuracy.py's noise batches), the exact
engine's backward sweep runs once exactly and, per code, twice more with every unit's x̂
replaced by an independent draw of that code's decode (lowmem.bits.simulate's path: approx
mode's backward, the exact mask; the forward stays exact). All parameters as one vector:

    draw noise / SGD noise   sqrt(mean_b ||e_b1 − e_b2||²/2) / σ,   σ the spread of the exact
                             mini-batch gradients (lowmem.tools.gradient_error's definitions)
    persistent bias / ‖E g‖  ‖E_b E_draw e‖ (‖mean‖² − tr(cov)/B, clipped at 0) against ‖E g‖
    median over tensors      the median over parameter tensors of each one's draw noise / σ(p)

With --bias-draws N, also a sharper bias check on the first batch: N draws of each code, and the
distance of their mean gradient from the exact one in units of its standard error
(sqrt(Σ_i var_i / N)): about 1 for an unbiased code, growing as sqrt(N) with a bias.

With --per-unit, also each unit's own share: the draw noise when only that unit is coded (the
units' draws are independent, so the shares' squares add up to about the total's).

The codes (`CODES`; the bits per element include the metadata; M per channel row):

    code           the engine's 2-bit code (lowmem.units.unbiased.quantize_simulated): groups of 256
                   consecutive elements of a channel's row, both ends bf16 rounded outward, two
                   levels a side, systematic draws in lanes of stride 4 (2.125 bits)
    independent    the same levels, each element its own draw (2.125)
    dither         the engine's dithered code (rounding="dither"): the same levels, each group's
                   Weyl sequence of draws, the decoder subtracting each draw (2.125 + 24 bytes)
    dither4, bits4 the 4-bit dithered and plain codes (4.125)
    sd, sd-weyl .. the simulated subtractive dither (draws: independent, Weyl along the row, other
                   patterns), alone or with the variants below (sd-g<S>, sd-sub<S>x<b>,
                   sd-g<G>sub<S>x<b>: groups of G with bf16 ends, sub-groups of S)
    g<S>           groups of S elements, the ends exact floats (the metadata not priced: what
                   narrower ranges could give at best)
    sub<S>x<b>     groups of 256 with both ends as the code's, plus per sub-group of S elements a
                   b-bit fraction of the open side's range: the sub-group's top open level is the
                   group's range cut to the smallest of 2**b equal steps holding its open elements
                   (2 + 32/256 + b/S bits; lo and hi as 8-bit values relative to the channel
                   instead of bf16 would bring it back to 2 + 16/256 + b/S)
    onesided       the code, and a group with elements on one side only spends all 4 codes on
                   that side (the decoder tells from the group's ends and t: no metadata)
    minopen        the open side's lowest level the group's smallest open value, the closed side's
                   top its largest closed value, instead of t (2 more values per group: priced 2.25)
    weyl, bayer    stochastic rounding (not subtracted) with the Weyl or an 8x8 Bayer pattern of draws

Each simulated code here draws from NumPy's generator (not the counter stream) and keeps
E[x̃ | x̂] = x̂ and the mask exact; the persistent-bias column checks the first over the batches.
Writes --out (JSON) and prints a table. A measurement tool: nothing is timed. The measurements
in docs/quantizer_appendix.md ("The draw noise that is left") are collected, with their
commands, in benchmarks/results/draw_noise_resnet20.json and .txt.
"""
import argparse
import json
import math
import os
import sys

import numpy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowmem.bits import simulate as S                           # noqa: E402
from lowmem.data.datasets import load_dataset                   # noqa: E402
from lowmem.data.transforms import normalize                    # noqa: E402
from lowmem.models import MODELS                                # noqa: E402
from lowmem.train.trainstate import load_model_state           # noqa: E402
from lowmem.units import unbiased, window                       # noqa: E402


# ---- simulated codes ----------------------------------------------------------------

def grouped(a, size, fill):
    """(C, M) -> (C, G, size), the last group padded with `fill`."""
    C, M = a.shape
    G = -(-M // size)
    out = numpy.full((C, G * size), fill, a.dtype)
    out[:, :M] = a
    return out.reshape(C, G, size)


PHI = 0.6180339887498949                   # frac of the golden ratio
R2 = (0.7548776662466927, 0.5698402909980532)   # 1/ρ, 1/ρ² (ρ the plastic number): a 2-D Weyl lattice
BAYER8 = numpy.array([[0, 32, 8, 40, 2, 34, 10, 42], [48, 16, 56, 24, 50, 18, 58, 26],
                      [12, 44, 4, 36, 14, 46, 6, 38], [60, 28, 52, 20, 62, 30, 54, 22],
                      [3, 35, 11, 43, 1, 33, 9, 41], [51, 19, 59, 27, 49, 17, 57, 25],
                      [15, 47, 7, 39, 13, 45, 5, 37], [63, 31, 55, 23, 61, 29, 53, 21]]) / 64.0


def pattern(kind, M, hw):
    """(M,) offsets in [0, 1) of a dither pattern over a channel's row (n, h, w in C order); each
    group adds its own uniform draw (mod 1), so every element's r stays uniform."""
    j = numpy.arange(M)
    H, W = hw
    h, w = (j // W) % H, j % W
    if kind == "weyl":                         # along the row, every element φ after the one before
        return (j * PHI) % 1.0
    if kind == "weyl382":
        return (j * PHI * PHI) % 1.0
    if kind == "weyl414":
        return (j * (2 ** 0.5 - 1)) % 1.0
    if kind == "lanes":                        # lanes of stride 4 (as the walk's), each a φ sequence
        return ((j % 4) * PHI * PHI + (j // 4) * PHI) % 1.0
    if kind == "r2":                           # a 2-D lattice over (h, w)
        return (h * R2[0] + w * R2[1]) % 1.0
    if kind == "bayer":                        # ordered dither: the 8x8 Bayer matrix over (h, w)
        return BAYER8[h % 8, w % 8] + 0.5 / 64
    raise ValueError(kind)


def simulated(xhat, gamma, beta, rng, hw=None, bits=2, group=256, ends="bf16", one_sided=False, open_base="t",
              sub=None, sub_bits=0, draws="systematic", lanes=unbiased.LANES, subtract=False):
    """(x̃, mask) of x̂ (C, M) under a variant of the unbiased code (module docstring); unbiased
    for every element, the mask exact. rng: numpy Generator of this unit's draw.
    draws: "systematic" (the code's walk), "independent" (a uniform per element) or "weyl" (a
    uniform per group u0, element i of the group r = frac(u0 + i·φ): marginally uniform, and
    regenerable by a decoder from the group's draw alone). subtract: the decoder subtracts the
    dither, x̃ = base + (j − r + 1/2)·step (needs r known at decode: not with "systematic"), so
    the error is uniform on ±step/2 whatever x̂ (variance step²/12 against stochastic rounding's
    f(1−f)·step², f the fraction of (x̂ − base)/step)."""
    C, M = xhat.shape
    x = xhat.astype(numpy.float64)
    g, b = gamma.astype(numpy.float64), beta.astype(numpy.float64)
    s = numpy.where(g < 0, -1.0, 1.0)[:, None]
    mask = (xhat * gamma[:, None]) + beta[:, None] > 0               # the engine's mask, in its dtype
    with numpy.errstate(divide="ignore", invalid="ignore"):
        t = numpy.where(g != 0, -b / numpy.where(g != 0, numpy.abs(g), 1), numpy.nan)[:, None, None]
    u3 = grouped(s * x, group, numpy.nan)
    m3 = grouped(mask, group, False)
    valid = ~numpy.isnan(u3)
    hi = numpy.nanmax(u3, axis=2, keepdims=True)
    lo = numpy.nanmin(u3, axis=2, keepdims=True)
    if ends == "bf16":
        hi = unbiased.bf16_value(unbiased.bf16_up(hi), numpy.float64)      # outward, as the code
        lo = unbiased.bf16_value(unbiased.bf16_down(lo), numpy.float64)
    has_o = (m3 & valid).any(axis=2, keepdims=True)
    has_c = (~m3 & valid).any(axis=2, keepdims=True)
    L = 1 << bits
    k = numpy.clip(window.quant_params(gamma, beta, bits).k, 2, L - 2).astype(numpy.float64)[:, None, None]
    n_o, n_c = L - k + 0 * hi, k + 0 * hi
    if one_sided:
        n_o = numpy.where(has_c, n_o, L)
        n_c = numpy.where(has_o, n_c, L)
    tt = numpy.where(numpy.isnan(t), numpy.inf, t)
    if open_base == "min":
        base_o = numpy.where(has_o, numpy.nanmin(numpy.where(m3, u3, numpy.nan), axis=2, keepdims=True), hi)
        top_c = numpy.where(has_c, numpy.nanmax(numpy.where(~m3 & valid, u3, numpy.nan), axis=2, keepdims=True), lo)
    else:
        base_o = numpy.where(has_c, numpy.maximum(numpy.minimum(tt, hi), lo), lo)
        top_c = numpy.where(has_o, numpy.maximum(numpy.minimum(tt, hi), lo), hi)
    top_o = hi + 0 * base_o
    if sub:                       # each sub-group's open top: the group's range cut to 2**sub_bits steps
        C_, G_, _ = u3.shape
        us = numpy.where(m3, u3, -numpy.inf).reshape(C_, G_, group // sub, sub).max(axis=3)
        span = top_o - base_o
        with numpy.errstate(divide="ignore", invalid="ignore"):
            q = numpy.ceil((us - base_o) / numpy.where(span > 0, span, 1) * (1 << sub_bits))
        q = numpy.clip(numpy.where(numpy.isfinite(q), q, 1), 1, 1 << sub_bits)
        top_sub = base_o + span * q / (1 << sub_bits)
        top_sub = numpy.maximum(top_sub, us)               # float rounding: the top holds its data
        top_o = numpy.repeat(top_sub, sub, axis=2)
    base = numpy.where(m3, base_o, lo)
    top = numpy.where(m3, top_o, top_c)
    n = numpy.where(m3, n_o, n_c)
    step = (top - base) / numpy.maximum(n - 1, 1)
    with numpy.errstate(divide="ignore", invalid="ignore"):
        p = numpy.where(step > 0, (u3 - base) / numpy.where(step > 0, step, 1), 0)
    p = numpy.where(valid, p, 0)
    if draws == "systematic":
        if subtract:
            raise ValueError("subtractive dither needs draws the decoder can regenerate: independent or weyl")
        u0 = rng.integers(0, 1 << 24, size=p.shape[:2] + (1,))
        r = unbiased.systematic_uniforms(p, m3, u0, lanes)
    elif draws in ("weyl", "r2", "bayer", "weyl382", "weyl414", "lanes"):
        offs = grouped(pattern(draws, M, hw)[None, :], group, 0.0)         # (1, G, group)
        r = (rng.random(p.shape[:2] + (1,)) + offs) % 1.0
    else:
        r = rng.random(p.shape)
    j = numpy.minimum(numpy.maximum(numpy.floor(p + r), 0), n - 1)
    level = j - (r - 0.5) * (step > 0) if subtract else j
    xt = (s[:, :, None] * (base + level * step)).reshape(C, -1)[:, :M]
    return xt.astype(xhat.dtype), mask


def engine_code(bits, draws=None):
    def fn(xhat, gamma, beta, rng, hw):
        key = int(rng.integers(0, 1 << 62))
        return unbiased.quantize_simulated(xhat, gamma, beta, bits, key, draws=draws)
    return fn


def variant(**kw):
    return lambda xhat, gamma, beta, rng, hw: simulated(xhat, gamma, beta, rng, hw, **kw)


CODES = {"code": (engine_code(2), 2.125), "independent": (engine_code(2, "independent"), 2.125),
         "bits4": (engine_code(4), 4.125),
         "dither": (engine_code(2, "dither"), 2.125), "dither4": (engine_code(4, "dither"), 4.125),
         "same": (variant(), 2.125),                   # the generic simulation set as the code: a check
         "onesided": (variant(one_sided=True), 2.125), "minopen": (variant(open_base="min"), 2.25)}
for _S in (128, 64, 32, 16):
    CODES[f"g{_S}"] = (variant(group=_S, ends="exact"), None)
    CODES[f"sd-g{_S}"] = (variant(group=_S, ends="exact", draws="independent", subtract=True), None)
CODES["sd"] = (variant(draws="independent", subtract=True), 2.125)
CODES["sd-weyl"] = (variant(draws="weyl", subtract=True), 2.125)
CODES["sd-weyl4"] = (variant(bits=4, draws="weyl", subtract=True), 4.125)
CODES["weyl"] = (variant(draws="weyl"), 2.125)
for _k in ("weyl382", "weyl414", "lanes"):
    CODES[f"sd-{_k}"] = (variant(draws=_k, subtract=True), 2.125)
for _G, _S, _b in ((512, 32, 2), (1024, 32, 3), (512, 16, 1), (1024, 16, 2)):
    CODES[f"sd-g{_G}sub{_S}x{_b}"] = (variant(group=_G, sub=_S, sub_bits=_b, draws="weyl", subtract=True),
                                      2 + 32 / _G + _b / _S)
CODES["sd-r2"] = (variant(draws="r2", subtract=True), 2.125)
CODES["sd-bayer"] = (variant(draws="bayer", subtract=True), 2.125)
CODES["bayer"] = (variant(draws="bayer"), 2.125)
for _S, _b in ((64, 2), (32, 2), (32, 1), (16, 1), (64, 3)):
    CODES[f"sub{_S}x{_b}"] = (variant(sub=_S, sub_bits=_b), 2 + 32 / 256 + _b / _S)
    CODES[f"sd-sub{_S}x{_b}"] = (variant(sub=_S, sub_bits=_b, draws="weyl", subtract=True), 2 + 32 / 256 + _b / _S)


class CodeUnits(S.SimulatedCodeUnits):
    """A unit's backward on x̃ from `fn(x̂, γ, β, rng)` (approx mode's: the exact mask)."""

    def __init__(self, fn, seed, hw):
        self.fn, self.rng, self.hw, self._kept = fn, numpy.random.default_rng(seed), hw, None

    def conv_input(self, u, saved, gamma, beta):
        # the conv input of an open element is γ·x̃ + β, not clamped at 0: a subtractive dither
        # decodes some open elements below t, and a clamp there would bias them
        xt, mask = self._quantize(saved, gamma, beta, keep=True)
        numpy.copyto(u, numpy.where(mask, xt * gamma[:, None] + beta[:, None], 0))

    def _quantize(self, saved, gamma, beta, keep):
        if self._kept is None:
            self._kept = self.fn(saved, gamma, beta, self.rng, self.hw)
        out = self._kept
        if not keep:
            self._kept = None
        return out


# ---- the measurement --------------------------------------------------------------------

def flat(grads):
    return numpy.concatenate([grads[p].ravel() for p in grads])


def measure(net, batches, codes, per_unit, draws=2, log=print):
    """{code: {"total": {...}, "units": {unit: ratio}}} (module docstring) and the exact σ."""
    eng = S.exact_engine(net, batches, "float32")
    units = S._units(eng)
    names = [p.name for p in eng.net.parameters()]
    exact, err = [], {c: {"all": [], **({u: [] for u in units} if per_unit else {})} for c in codes}
    for bi, (x, y) in enumerate(batches):
        eng.forward(x, y)
        gx = S.sweep_gradients(eng)
        exact.append(gx)
        for ci, c in enumerate(codes):
            fn = CODES[c][0]
            for who in ["all"] + (units if per_unit else []):
                es = []
                for d in range(draws):
                    sets = {u: CodeUnits(fn, [ci, bi, d, i], eng.in_shape[u][1:]) for i, u in enumerate(units)
                            if who in ("all", u)}
                    ga = S.sweep_gradients(eng, units=sets)
                    es.append({p: ga[p] - gx[p] for p in names})
                err[c][who].append(es)
        log(f"  batch {bi + 1}/{len(batches)} done")
    B = len(batches)
    G = numpy.stack([flat(g) for g in exact])                               # (B, P)
    sigma = math.sqrt(((G - G.mean(0)) ** 2).sum(1).mean() * B / (B - 1))
    sig_p = {p: math.sqrt(((numpy.stack([g[p].ravel() for g in exact]) -
                            numpy.stack([g[p].ravel() for g in exact]).mean(0)) ** 2).sum(1).mean() * B / (B - 1))
             for p in names}
    mean_g = math.sqrt(S.corrected_mean2(G))
    out = {"sgd_noise": sigma, "mean_grad": mean_g, "codes": {}}
    for c in codes:
        def var_of(who, p=None):
            pick = (lambda e: e[p].ravel()) if p else flat
            return numpy.mean([((pick(es[0]) - pick(es[1])) ** 2).sum() / 2 for es in err[c][who]])
        draw_noise = math.sqrt(var_of("all"))
        means = numpy.stack([numpy.mean([flat(e) for e in es], axis=0) for es in err[c]["all"]])
        per_tensor = [math.sqrt(var_of("all", p)) / sig_p[p] for p in names if sig_p[p] > 0]
        rec = {"draw_noise_ratio": draw_noise / sigma, "bias_ratio": math.sqrt(S.corrected_mean2(means)) / mean_g,
               "median_tensor_ratio": float(numpy.median(per_tensor)), "bits": CODES[c][1]}
        if per_unit:
            rec["units"] = {u: math.sqrt(var_of(u)) / sigma for u in units}
        out["codes"][c] = rec
    return out


def bias_distance(net, batch, codes, draws):
    """{code: ‖mean over `draws` draws of g_code − g_exact‖ / its standard error} on one batch."""
    eng = S.exact_engine(net, [batch], "float32")
    units = S._units(eng)
    eng.forward(*batch)
    g0 = flat(S.sweep_gradients(eng))
    out = {}
    for ci, c in enumerate(codes):
        gs = numpy.stack([flat(S.sweep_gradients(eng, units={u: CodeUnits(CODES[c][0], [ci, 99, d, i], eng.in_shape[u][1:])
                                                         for i, u in enumerate(units)})) for d in range(draws)])
        se = math.sqrt(gs.var(axis=0, ddof=1).sum() / draws)
        out[c] = float(numpy.linalg.norm(gs.mean(axis=0) - g0) / se)
    return out


def batches_of(data, batch, count, seed=0):
    """benchmarks/accuracy.py's noise batches: `count` fixed training batches, normalised, unaugmented."""
    rng = numpy.random.default_rng([seed, 7])
    idx = rng.permutation(len(data.x_train))[:batch * count].reshape(count, batch)
    return [(normalize(numpy.empty(data.x_train[i].shape, "float32"), data.x_train[i], data.mean, data.std),
             data.y_train[i]) for i in idx]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None, help="a lowmem training checkpoint (default: initial weights)")
    p.add_argument("--depth", type=int, default=20)
    p.add_argument("--seed", type=int, default=0, help="initial weights without --checkpoint")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--codes", default="code,same,onesided,g64,g32,sub32x2")
    p.add_argument("--per-unit", action="store_true")
    p.add_argument("--bias-draws", type=int, default=0, help="draws of the bias check on the first batch (0: none)")
    p.add_argument("--out", default=None, help="JSON results (default: print only)")
    args = p.parse_args(argv)
    codes = args.codes.split(",")
    unknown = [c for c in codes if c not in CODES]
    if unknown:
        p.error(f"unknown codes {unknown}; the codes are {', '.join(CODES)}")
    data = load_dataset("fashion-mnist", pad_to=None, limit_test=16)
    net = MODELS["preact-cifar"].build(args.depth, num_classes=10, in_channels=1, seed=args.seed)
    if args.checkpoint:
        load_model_state(args.checkpoint, net)
    batches = batches_of(data, args.batch, args.batches)
    print(f"ResNet-{args.depth}, {args.checkpoint or 'initial weights'}, {args.batches} batches of {args.batch}")
    res = measure(net, batches, codes, args.per_unit) if args.batches > 1 else {"codes": {}}
    res["settings"] = vars(args)
    if args.bias_draws:
        res["bias_distance"] = bias_distance(net, batches[0], codes, args.bias_draws)
        print(f"bias check, {args.bias_draws} draws on one batch: distance of the mean gradient from the exact "
              f"one in standard errors (unbiased: about 1): "
              + ", ".join(f"{c} {v:.2f}" for c, v in res["bias_distance"].items()))
    print(f"{'code':<12} {'bits/elem':>9} {'draw noise/SGD':>14} {'median tensor':>13} {'bias/|Eg|':>9}")
    for c, r in res["codes"].items():
        bits = "—" if r["bits"] is None else f"{r['bits']:.4g}"
        print(f"{c:<12} {bits:>9} {r['draw_noise_ratio']:>14.3f} {r['median_tensor_ratio']:>13.3f} {r['bias_ratio']:>9.3f}")
    if args.per_unit:
        units = list(next(iter(res["codes"].values()))["units"])
        print("per unit, draw noise / SGD noise with only that unit coded:")
        print(f"{'unit':<22}" + "".join(f"{c:>10}" for c in codes))
        for u in units:
            print(f"{u:<22}" + "".join(f"{res['codes'][c]['units'][u]:>10.3f}" for c in codes))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
