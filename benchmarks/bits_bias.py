"""What a 1-bit unit costs next to the unbiased code's 2-bit variance, measured.

    python benchmarks/bits_bias.py           # ResNet-8, Fashion-MNIST 28x28, batch 64 (the accuracy study's)

The accuracy study's "auto 2-bit avg unbiased" (depth 8, batch 64, Fashion-MNIST, --limit-train
training images) chooses its widths through lowmem.bits.auto.choose_widths as the trainer does:
measured on the first 3 training batches at the initial weights of --seed. This script prints that
choice, then, at the initial weights and after each of --warmup exact SGD steps (lr 0.1,
momentum 0.9, weight decay 5e-4, on the training batches in order), measures every unit alone
(`simulate_draws`, --draws draws on each of --batches training batches after the trainer's 3):

    1-bit (the window code, nearest: no unbiased 1-bit code exists)
        bias²/||E g||²     the price the objective gave it (docs/bits.md §3b, before)
        H·bias²/σ²         the price of its bias in the update momentum applies (H = (1+β)/(1−β))
        persistent         the part of its bias² the same on every batch, over its bias²
    2-bit and 4-bit unbiased: variance/σ² (their bias is 0 by construction; measured, it is noise)

and per allocation (uniform 2-bit unbiased, the choices of the objective before and now) the sum
of those measured prices under either rule. ||E g|| and σ: on the same batches, all parameters.
Times are wall-clock on a shared machine: say so.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowmem.bits import simulate as S                                     # noqa: E402
from lowmem.bits.allocate import allocate                                 # noqa: E402
from lowmem.bits.auto import choose_widths, training_batches              # noqa: E402
from lowmem.data.datasets import load_dataset                             # noqa: E402
from lowmem.models import build_model                                     # noqa: E402
from lowmem.system.atomic import atomic_write                             # noqa: E402
from lowmem.tools.gradient_error import warm_up                           # noqa: E402
import harness  # noqa: E402 (benchmarks/harness.py)

H = S.BIAS_STEPS


def old_objective(sens):
    """The objective before: bias²/||E g||² + variance/σ², the estimate's measured bias at every
    width (σ in place of a zero ||E g||, as it was)."""
    n2 = sens.noise_norm ** 2
    g2 = sens.mean_grad_norm ** 2 if sens.mean_grad_norm > 0 else n2

    def J(u, k):
        return sens.bias2(u, k) / g2 + sens.variance2(u, k) / n2
    return J


def per_unit(net, batches, units, draws):
    out = {}
    for u in units:
        r = {}
        for k in (1, 2, 4):
            m = S.simulate_draws(net, batches, {u: k}, rounding="stochastic", draws=draws, seed=1)
            r[k] = {"error2": m.error2, "bias2": m.bias2, "variance2": m.variance2, "persistent2": m.persistent2}
        out[u] = r
        g2, n2 = m.mean_grad_norm ** 2, m.noise_norm ** 2
    return out, g2, n2


def prices(units, meas, g2, n2, bits):
    """(price before, price now) of allocation `bits` from the single-unit measurements."""
    before = now = 0.0
    for u in units:
        k = bits[u]
        if k == "float":
            continue
        r = meas[u][k]
        if k == 1:
            before += r["bias2"] / g2
            now += H * r["bias2"] / n2
        else:
            before += r["bias2"] / g2 + r["variance2"] / n2
            now += r["variance2"] / n2
    return before, now


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit-train", type=int, default=12000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--draws", type=int, default=2)
    p.add_argument("--warmup", default="60,250", help="exact SGD steps (cumulative) before each later measurement")
    p.add_argument("--json", default="benchmarks/results/bits_bias.json")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    data = load_dataset("fashion-mnist", None, download=False, pad_to=None, limit_train=args.limit_train,
                        limit_test=100)
    net = build_model("preact-cifar", 8, num_classes=10, in_channels=1, seed=args.seed)
    n = args.batch
    first = training_batches(data, n)                           # what the trainer measures on
    a, sens = choose_widths(net, first, n, avg_bits=2, rounding="stochastic")
    units = sens.units
    old = allocate(sens, n, avg_bits=2, objective=old_objective(sens)).bits
    uniform = dict.fromkeys(units, 2)
    print(f"choose_widths (now): {a.bits}\nthe objective before: {old}", flush=True)
    res = {"command": "python benchmarks/bits_bias.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": harness.cpu(), "load": os.getloadavg()[0], "H": H, "chosen": a.bits,
           "chosen_before": old, "checkpoints": []}
    allb = training_batches(data, n, count=3 + args.batches + 200)
    measure, train = allb[3:3 + args.batches], allb[3 + args.batches:]
    steps, done, current = [0] + [int(s) for s in args.warmup.split(",") if s], 0, net
    for s in steps:
        current = warm_up(current, train[done:] + train[:done], s - done, lr=0.1) if s > done else current
        done = s
        meas, g2, n2 = per_unit(current, measure, units, args.draws)
        cp = {"steps": s, "mean_grad2": g2, "noise2": n2, "units": meas,
              "allocations": {name: prices(units, meas, g2, n2, b)
                              for name, b in (("uniform 2-bit unbiased", uniform), ("chosen before", old),
                                              ("chosen now", a.bits))}}
        res["checkpoints"].append(cp)
        print(f"\nafter {s} exact steps: ||E g||² {g2:.4g}, σ² {n2:.4g}, ||E g||²/σ² {g2 / n2:.3g}")
        print("| unit | 1-bit bias²/‖E g‖² | 1-bit H·bias²/σ² | 1-bit persistent/bias² | 2-bit unbiased var/σ² "
              "| 4-bit unbiased var/σ² |\n|---|---|---|---|---|---|")
        for u in units:
            r = meas[u]
            pers = r[1]["persistent2"] / r[1]["bias2"] if r[1]["bias2"] > 0 else float("nan")
            print(f"| {u} | {r[1]['bias2'] / g2:.3g} | {H * r[1]['bias2'] / n2:.3g} | {pers:.2f} | "
                  f"{r[2]['variance2'] / n2:.3g} | {r[4]['variance2'] / n2:.3g} |")
        for name, (b, w) in cp["allocations"].items():
            print(f"{name}: priced {b:.3g} (before), {w:.3g} (now)")
        print(flush=True)
    res["seconds"] = time.perf_counter() - t0
    atomic_write(args.json, json.dumps(res, indent=1))
    print(f"{res['seconds']:.0f} s in all; load average at start {res['load']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
