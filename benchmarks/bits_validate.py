"""Validate the per-unit error estimate (lowmem/bits/sensitivity.py) and time it.

    python benchmarks/bits_validate.py                       # ResNet-8, -20, bottleneck -29 on Fashion-MNIST
    python benchmarks/bits_validate.py --cost-depth 164      # also the cost on ResNet-164 (CIFAR shape)
    python benchmarks/bits_validate.py --rounding stochastic --json benchmarks/results/bits_validate_unbiased.json

Part 1, prediction against measurement. For each network: a few exact SGD steps on Fashion-MNIST
(so the weights are not those of the initialisation), then the sensitivity measured on B batches
(`measure_sensitivity`), then for a set of allocations (uniform 1, 2, 4, 8 bits; the solver's
choice at 1.5, 2, 3 bits on average; random ones) the predicted rms gradient error (all
parameters, against exact, `Sensitivity.predict`) next to the measured one (`simulate`: approx
mode's gradients with those per-unit widths, on the same weights and batches; tests check it
equals the per-unit engine). Measured on the B batches of the estimate ("same") and on B other
batches ("held out"). The factor is predicted / measured.

Part 2, cost: the measurement's wall time as a multiple of one training step (approx 4-bit, the
default kernels) at the same batch, and at the training batch when that is larger (--cost-depth:
a ResNet of that depth on 3x32x32 synthetic data: the sensitivity at --batch, the step at
--batch and at --train-batch). Times are wall-clock on whatever machine runs it: say so.

--rounding stochastic (the unbiased group-range code; 1 bit stays the nearest window code): the
split the allocator minimises instead (docs/bits.md §3b). The sensitivity takes two draws per batch;
per allocation (uniform 1, 2, 4, 8 bits; the solver's choice at 2, 2.5, 3 bits on average, the
code's group ends counted in the bytes; random ones) the predicted bias², draw variance and
objective ((H·bias² + variance)/σ² summed over units, H = 19; the unbiased widths priced by their
variance alone) next to the measured ones (`simulate_draws`: --draws draws per batch from keys
other than the estimate's; the measured objective with the estimate's σ), on the same and on
held-out batches, each factor predicted / measured; and the measured persistent bias² (the part of
the bias that is the same on every batch), which the per-batch bias² bounds from above.

Output: a markdown table on stdout and --json (default benchmarks/results/bits_validate.json).
"""
import argparse
import copy
import json
import os
import sys
import time

import numpy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowmem import SGD, Engine  # noqa: E402
from lowmem.bits.allocate import CHOICES, allocate, allocation_for       # noqa: E402
from lowmem.system.atomic import atomic_write                                # noqa: E402
from lowmem.data.datasets import load_dataset                                # noqa: E402
from lowmem.data.transforms import normalize                                 # noqa: E402
from lowmem.tools.gradient_error import synthetic_batches, warm_up           # noqa: E402
from lowmem.models import preact_resnet_cifar                        # noqa: E402
from lowmem.bits.sensitivity import measure_sensitivity, simulate        # noqa: E402
from lowmem.bits.simulate import objective_of, simulate_draws            # noqa: E402
from lowmem.units.widths import BITS                                     # noqa: E402
import harness                                                      # noqa: E402 (benchmarks/harness.py)

NETS = {"resnet8": (8, None), "resnet20": (20, None), "resnet29-bottleneck": (29, "bottleneck"),
        "resnet56": (56, None)}


def fm_batches(data, batch, count, offset):
    out = []
    for i in range(offset, offset + count):
        xb = data.x_train[i * batch:(i + 1) * batch]
        out.append((normalize(numpy.empty(xb.shape, "float32"), xb, data.mean, data.std),
                    data.y_train[i * batch:(i + 1) * batch]))
    return out


def step_seconds(net, batch, shape, classes, steps=3):
    """Mean wall time of an approx 4-bit train_step (after one untimed step)."""
    b = synthetic_batches(2, batch, shape, classes, seed=5)
    eng = Engine(copy.deepcopy(net), batch, shape, "approx", 4)
    opt = SGD(eng.net.parameters(), lr=0.01, momentum=0.9)
    eng.train_step(*b[0], opt)
    t = time.perf_counter()
    for i in range(steps):
        eng.train_step(*b[i % 2], opt)
    return (time.perf_counter() - t) / steps


def validate(name, args, data):
    depth, block = NETS[name]
    net = preact_resnet_cifar(depth, num_classes=data.num_classes, in_channels=data.input_shape[0], block=block)
    B, n = args.batches, args.batch
    warm = fm_batches(data, n, 8, 0)
    net = warm_up(net, warm, args.warmup)
    same, held = fm_batches(data, n, B, 8), fm_batches(data, n, B, 8 + B)
    sens = measure_sensitivity(net, same)
    step = step_seconds(net, n, data.input_shape, data.num_classes)
    units = sens.units
    rng = numpy.random.default_rng(0)
    allocs = {f"uniform {k}": dict.fromkeys(units, k) for k in BITS}
    for avg in (1.5, 2, 3):
        allocs[f"solver avg {avg:g}"] = allocate(sens, n, avg_bits=avg).bits
    for i in range(2):
        allocs[f"random {i}"] = {u: CHOICES[rng.integers(len(CHOICES))] for u in units}
    rows = []
    for label, a in allocs.items():
        pred = sens.predict(a)
        m_same, noise_same = simulate(net, same, a)
        m_held, noise_held = simulate(net, held, a)
        rows.append({"allocation": label, "predicted": pred, "measured_same": m_same, "measured_held": m_held,
                     "factor_same": pred / m_same, "factor_held": pred / m_held,
                     "ratio_same": m_same / noise_same, "ratio_held": m_held / noise_held})
        print(f"  {name} {label}: predicted {pred:.4g}, measured {m_same:.4g} (same) {m_held:.4g} (held out)",
              flush=True)
    return {"network": name, "units": len(units), "batch": n, "batches": B, "sens_seconds": sens.seconds,
            "step_seconds": step, "cost_steps": sens.seconds / step, "rows": rows}


def predicted_split(sens, a):
    """(bias², variance, objective) the estimate predicts for allocation a, summed over units."""
    units = sens.units
    return (sum(sens.bias2(u, a.get(u, "float")) for u in units),
            sum(sens.variance2(u, a.get(u, "float")) for u in units),
            sum(sens.objective(u, a.get(u, "float")) for u in units))


def factor(p, m):
    return p / m if m > 0 else float("nan")


def validate_split(name, args, data):
    """--rounding stochastic: predicted bias², variance and objective against measured ones."""
    depth, block = NETS[name]
    net = preact_resnet_cifar(depth, num_classes=data.num_classes, in_channels=data.input_shape[0], block=block)
    B, n = args.batches, args.batch
    net = warm_up(net, fm_batches(data, n, 8, 0), args.warmup)
    same, held = fm_batches(data, n, B, 8), fm_batches(data, n, B, 8 + B)
    sens = measure_sensitivity(net, same, rounding=args.rounding)
    units = sens.units
    rng = numpy.random.default_rng(0)
    allocs = {f"uniform {k}": dict.fromkeys(units, k) for k in BITS}
    for avg in (2, 2.5, 3):
        allocs[f"solver avg {avg:g}"] = allocate(sens, n, avg_bits=avg).bits
    for i in range(2):
        allocs[f"random {i}"] = {u: CHOICES[rng.integers(len(CHOICES))] for u in units}
    rows = []
    for label, a in allocs.items():
        pb, pv, pj = predicted_split(sens, a)
        row = {"allocation": label, "bits": [a.get(u, "float") for u in units],
               "average_bits": allocation_for(sens, a, n).average_bits,
               "predicted_bias2": pb, "predicted_variance2": pv, "predicted_objective": pj}
        for where, bs in (("same", same), ("held", held)):
            # draws from seeds 1.. : keys the estimate's own draws do not use
            m = simulate_draws(net, bs, a, rounding=args.rounding, draws=args.draws, seed=1)
            # the objective of the measured parts against the estimate's sigma (on the same
            # batches the measurement's own; on held-out ones the factor then compares errors)
            row[where] = {"error2": m.error2, "bias2": m.bias2, "variance2": m.variance2,
                          "persistent2": m.persistent2,
                          "objective": objective_of(m.bias2, m.variance2, sens.noise_norm),
                          "persistent_objective": objective_of(m.persistent2, m.error2 - m.persistent2,
                                                               sens.noise_norm),
                          "noise_norm": m.noise_norm, "mean_grad_norm": m.mean_grad_norm}
            row[f"factor_bias2_{where}"] = factor(pb, m.bias2)
            row[f"factor_variance2_{where}"] = factor(pv, m.variance2)
            row[f"factor_objective_{where}"] = factor(pj, row[where]["objective"])
        rows.append(row)
        s_ = row["same"]
        print(f"  {name} {label}: bias2 {pb:.3g}/{s_['bias2']:.3g} (persistent {s_['persistent2']:.3g}), "
              f"variance {pv:.3g}/{s_['variance2']:.3g}, objective {pj:.3g}/{s_['objective']:.3g} "
              f"(predicted/measured, same batches)", flush=True)
    return {"network": name, "units": len(units), "unit_names": units, "batch": n, "batches": B,
            "draws": args.draws, "sens_seconds": sens.seconds, "noise_norm": sens.noise_norm,
            "mean_grad_norm": sens.mean_grad_norm, "rows": rows}


def print_split(res):
    print("\n| network | allocation | avg bits | bias² pred / meas (factor) | persistent bias² | "
          "variance pred / meas (factor) | objective pred / meas (factor) | held out: bias² f, variance f, "
          "objective f |")
    print("|---|---|---|---|---|---|---|---|")
    for r in res["nets"]:
        for row in r["rows"]:
            s = row["same"]
            print(f"| {r['network']} | {row['allocation']} | {row['average_bits']:.3g} | {row['predicted_bias2']:.3g} / "
                  f"{s['bias2']:.3g} ({row['factor_bias2_same']:.2f}) | {s['persistent2']:.3g} | "
                  f"{row['predicted_variance2']:.3g} / {s['variance2']:.3g} ({row['factor_variance2_same']:.2f}) | "
                  f"{row['predicted_objective']:.3g} / {s['objective']:.3g} ({row['factor_objective_same']:.2f}) | "
                  f"{row['factor_bias2_held']:.2f}, {row['factor_variance2_held']:.2f}, "
                  f"{row['factor_objective_held']:.2f} |")
    print()
    for r in res["nets"]:
        print(f"{r['network']} ({r['units']} units): ||E g|| {r['mean_grad_norm']:.4g}, sigma {r['noise_norm']:.4g}; "
              f"estimate {r['sens_seconds']:.1f} s ({r['batches']} batches of {r['batch']}, "
              f"{r['draws']} measured draws per batch)")


def cost(args):
    """Steps timed just before and just after the estimate (their mean), so that a change in the
    machine's load during the run biases the ratio less."""
    net = preact_resnet_cifar(args.cost_depth)
    shape = (3, 32, 32)
    batches = synthetic_batches(args.batches, args.batch, shape, 10, seed=0)
    before = step_seconds(net, args.batch, shape, 10)
    big = step_seconds(net, args.train_batch, shape, 10, steps=2) if args.train_batch != args.batch else None
    sens = measure_sensitivity(net, batches)
    after = step_seconds(net, args.batch, shape, 10)
    out = {"depth": args.cost_depth, "units": len(sens.units), "batch": args.batch, "batches": args.batches,
           "sens_seconds": sens.seconds, "step_seconds": (before + after) / 2, "step_before": before,
           "step_after": after}
    if big is not None:
        big = (big + step_seconds(net, args.train_batch, shape, 10, steps=2)) / 2
        out["train_batch"], out["train_step_seconds"] = args.train_batch, big
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nets", default="resnet8,resnet20,resnet29-bottleneck", help=f"of {', '.join(NETS)}")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--warmup", type=int, default=20, help="exact SGD steps before measuring")
    p.add_argument("--limit-train", type=int, default=2000)
    p.add_argument("--cost-depth", type=int, default=0, help="also time the estimate on a ResNet of this depth")
    p.add_argument("--train-batch", type=int, default=128)
    p.add_argument("--rounding", default="nearest", choices=("nearest", "stochastic"),
                   help="stochastic: the unbiased code, validated as bias, variance and objective")
    p.add_argument("--draws", type=int, default=3, help="--rounding stochastic: measured draws per batch")
    p.add_argument("--json", default="benchmarks/results/bits_validate.json")
    args = p.parse_args(argv)
    if args.rounding != "nearest" and args.cost_depth:
        p.error("--cost-depth times the nearest estimate: run it without --rounding")
    data = load_dataset("fashion-mnist", None, download=False, limit_train=args.limit_train, limit_test=100)
    res = {"command": "python benchmarks/bits_validate.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": harness.cpu(), "load": os.getloadavg()[0], "nets": []}
    t0 = time.perf_counter()
    for name in filter(None, args.nets.split(",")):
        res["nets"].append((validate if args.rounding == "nearest" else validate_split)(name, args, data))
    res["seconds"] = time.perf_counter() - t0
    if args.cost_depth:
        res["cost"] = cost(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    atomic_write(args.json, json.dumps(res, indent=1))       # never a half-written file
    if args.rounding != "nearest":
        print_split(res)
        print(f"{res['seconds']:.0f} s in all; load average at start {res['load']:.1f}")
        return 0
    print("\n| network | units | allocation | predicted | measured (same batches) | factor | measured (held out) "
          "| factor | measured error/noise |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res["nets"]:
        for row in r["rows"]:
            print(f"| {r['network']} | {r['units']} | {row['allocation']} | {row['predicted']:.4g} | "
                  f"{row['measured_same']:.4g} | {row['factor_same']:.3f} | {row['measured_held']:.4g} | "
                  f"{row['factor_held']:.3f} | {row['ratio_same']:.3g} |")
    print()
    for r in res["nets"]:
        fs = [row[k] for row in r["rows"] for k in ("factor_same", "factor_held")]
        print(f"{r['network']}: factors {min(fs):.3f}-{max(fs):.3f}; estimate {r['sens_seconds']:.1f} s = "
              f"{r['cost_steps']:.1f} approx-4 steps at batch {r['batch']} ({r['batches']} batches)")
    if "cost" in res:
        c = res["cost"]
        line = (f"ResNet-{c['depth']} ({c['units']} units): estimate on {c['batches']} batches of {c['batch']} "
                f"{c['sens_seconds']:.1f} s = {c['sens_seconds'] / c['step_seconds']:.1f} steps at batch {c['batch']}")
        if "train_step_seconds" in c:
            line += f" = {c['sens_seconds'] / c['train_step_seconds']:.1f} steps at batch {c['train_batch']}"
        print(line)
    print(f"load average at start {res['load']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
