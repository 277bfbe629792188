"""Persistent gradient bias of each 2-bit code, through lowmem's simulation path.

    python benchmarks/unbiased_bias.py [--depths 8,14] [--batches 16] [--draws 2] [--warmup 40]

For a pre-act ResNet on Fashion-MNIST batches of 32 (after --warmup exact SGD steps), the
exact engine's backward sweep runs once exactly and, per code, --draws times with every unit's
x̂ replaced by that code's decode (lowmem.bits.sensitivity's SimulatedCodeUnits: the approx
mode's backward, exact mask). lowmem.tools.gradient_error.bias_and_noise then separates, for all
parameters as one vector, the persistent bias ‖E_b E_draw(ĝ_b − g_b)‖ (‖mean‖² − tr(cov)/B)
against ‖E g‖ from the per-step draw noise against SGD noise. Codes: nearest, the fixed window
with stochastic rounding, the unbiased group-range code (both group ends, systematic draws
along lanes of stride 4: the code the engine packs), the same with every element's own draw
(independent: the code before systematic sampling), with lanes of stride 1, 2 and 8, and the
cheaper variant (the group's upper end only, the lower end the channel's), and two base-3
candidates (three values per element, 5 per byte: 1.6 bits plus the group metadata), simulated
from the 2-bit code: its open side as it is (levels t and the group's maximum, systematic
draws), its closed side collapsed onto one level, either the mean of the group's closed x-hat
(rounded to bfloat16: 1.725 bits per element with the group's upper end) or the threshold t
itself (no metadata). Writes benchmarks/results/unbiased_bias.json and prints a table.
"""
import argparse
import json
import os
import sys
import time

import numpy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowmem.bits import simulate as S                         # noqa: E402
from lowmem.data.datasets import load_dataset                  # noqa: E402
from lowmem.data.transforms import normalize                   # noqa: E402
from lowmem.models import MODELS                               # noqa: E402
from lowmem.tools import gradient_error as D                      # noqa: E402
from lowmem.units import stream, unbiased                       # noqa: E402

CODES = {"nearest": ("nearest", None), "stochastic-window": ("stochastic-window", None),
         "unbiased (the code)": ("stochastic", {}),
         "unbiased (independent draws)": ("stochastic", {"draws": "independent"}),
         "unbiased (lanes of stride 1)": ("stochastic", {"lanes": 1}),
         "unbiased (lanes of stride 2)": ("stochastic", {"lanes": 2}),
         "unbiased (lanes of stride 8)": ("stochastic", {"lanes": 8}),
         "unbiased (open end only)": ("stochastic", {"variant": "open"}),
         "base-3 (closed: group mean)": ("stochastic", {"closed": "mean"}),
         "base-3 (closed: threshold)": ("stochastic", {"closed": "threshold"})}


def one_closed_level(xt, mask, xhat, gamma, beta, level):
    """x-tilde with every closed element (mask False) on one level per group of unbiased.GROUP
    consecutive elements of its row: the mean of the group's closed x-hat, rounded to the
    nearest bfloat16 ("mean"), or the threshold x-hat = -beta/gamma ("threshold"; the mean where
    gamma = 0, which has no threshold)."""
    C, M = xhat.shape
    S = unbiased.GROUP
    G = -(-M // S)                     # runs of S from the row's start (a shorter last one)
    pad = lambda a, v: numpy.concatenate([a, numpy.full((C, G * S - M), v, a.dtype)], 1).reshape(C, G, S)  # noqa: E731
    closed = ~pad(mask, True)
    n = closed.sum(2)
    mean = numpy.where(closed, pad(xhat, 0), 0).sum(2) / numpy.maximum(n, 1)
    bits = mean.astype(numpy.float32).view(numpy.uint32)
    mean = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).view(numpy.float32)   # to nearest bf16
    level_of = numpy.repeat(mean, S, axis=1)[:, :M].astype(xt.dtype)
    if level == "threshold":
        with numpy.errstate(divide="ignore", invalid="ignore"):
            t = numpy.where(gamma != 0, -beta / numpy.where(gamma != 0, gamma, 1), 0)
        level_of = numpy.where((gamma != 0)[:, None], t[:, None], level_of).astype(xt.dtype)
    return numpy.where(mask, xt, level_of)


class VariantUnits(S.SimulatedCodeUnits):
    """SimulatedCodeUnits with the unbiased code's measured variant chosen (unbiased.quantize_simulated's
    keywords: variant, draws, lanes)."""

    def __init__(self, bits, rounding, key, variant):
        super().__init__(bits, rounding, key)
        self.variant = variant

    def _quantize(self, saved, gamma, beta, keep):
        if self._kept is None and self.variant is not None:
            kw = {k: v for k, v in self.variant.items() if k != "closed"}
            xt, mask = unbiased.quantize_simulated(saved, gamma, beta, self.bits, self.key, **kw)
            if "closed" in self.variant:
                xt = one_closed_level(xt, mask, saved, gamma, beta, self.variant["closed"])
            self._kept = xt, mask
        return super()._quantize(saved, gamma, beta, keep)


def batches_of(data, batch, count, seed):
    rng = numpy.random.default_rng(seed)
    idx = rng.permutation(len(data.x_train))[:batch * count].reshape(count, batch)
    return [(normalize(numpy.empty(data.x_train[i].shape, "float32"), data.x_train[i], data.mean, data.std),
             data.y_train[i]) for i in idx]


def measure(depth, data, args):
    net = MODELS["preact-cifar"].build(depth, num_classes=10, in_channels=1, seed=0)
    warm = batches_of(data, args.batch, args.warmup, 1)
    net = D.warm_up(net, warm, args.warmup, lr=0.05)
    batches = batches_of(data, args.batch, args.batches, 2)
    eng = S.exact_engine(net, batches, "float32")
    units = list(eng.unit_bits)
    exact = []
    draws = {c: [[] for _ in range(args.draws)] for c in CODES}
    for bi, (x, y) in enumerate(batches):
        eng.forward(x, y)
        exact.append(S.sweep_gradients(eng))
        for c, (rounding, variant) in CODES.items():
            for d in range(args.draws if rounding != "nearest" else 1):
                sets = {u: VariantUnits(args.bits, rounding, stream.stream_key(100 + d, bi, i), variant)
                        for i, u in enumerate(units)}
                draws[c][d].append(S.sweep_gradients(eng, units=sets))
    stack = lambda gs: {n: numpy.stack([g[n] for g in gs]) for n in gs[0]}     # noqa: E731
    ex = stack(exact)
    out = {}
    for c, ds in draws.items():
        ds = [stack(d) for d in ds if d]
        out[c] = D.bias_and_noise(ex, ds)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depths", default="8,14")
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--codes", default=None, help="comma-separated names of CODES (default: all)")
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--draws", type=int, default=2)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "unbiased_bias.json"))
    args = p.parse_args(argv)
    if args.codes:
        wanted = args.codes.split(",")
        unknown = [c for c in wanted if c not in CODES]
        if unknown:
            p.error(f"unknown codes {unknown}; the codes are {list(CODES)}")
        for c in [c for c in CODES if c not in wanted]:
            del CODES[c]
    data = load_dataset("fashion-mnist", pad_to=None, limit_train=4000, limit_test=16)
    results = {"settings": vars(args), "depths": {}}
    for depth in [int(d) for d in args.depths.split(",")]:
        t = time.time()
        results["depths"][depth] = measure(depth, data, args)
        results["depths"][depth]["seconds"] = time.time() - t
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"ResNet-{depth}, {args.bits} bits, {args.batches} batches of {args.batch}, {args.draws} draws "
              f"({time.time() - t:.0f} s):")
        print(f"  {'code':<28} {'persistent bias / |E g|':>24} {'draw noise / SGD noise':>23} {'error / SGD noise':>18}")
        for c, r in results["depths"][depth].items():
            if c == "seconds":
                continue
            print(f"  {c:<28} {r['bias_ratio']:>24.3f} {r['noise_ratio']:>23.3f} {r['error'] / r['sgd_noise']:>18.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
