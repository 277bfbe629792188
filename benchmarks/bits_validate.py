"""Validate the per-unit error estimate (lowmem/bits/sensitivity.py) and time it.

    python benchmarks/bits_validate.py                       # ResNet-8, -20, bottleneck -29 on Fashion-MNIST
    python benchmarks/bits_validate.py --cost-depth 164      # also the cost on ResNet-164 (CIFAR shape)

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

Output: a markdown table on stdout and --json (default benchmarks/results/bits_validate.json).
"""
import argparse
import copy
import json
import os
import platform
import sys
import time

import numpy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowmem import SGD, Engine  # noqa: E402
from lowmem.bits.allocate import CHOICES, allocate                       # noqa: E402
from lowmem.data.datasets import load_dataset                                # noqa: E402
from lowmem.data.transforms import normalize                                 # noqa: E402
from lowmem.tools.diagnostics import synthetic_batches, warm_up           # noqa: E402
from lowmem.models import preact_resnet_cifar                        # noqa: E402
from lowmem.bits.sensitivity import measure_sensitivity, simulate        # noqa: E402
from lowmem.units.widths import BITS                                     # noqa: E402

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
    p.add_argument("--json", default="benchmarks/results/bits_validate.json")
    args = p.parse_args(argv)
    data = load_dataset("fashion-mnist", None, download=False, limit_train=args.limit_train, limit_test=100)
    res = {"command": "python benchmarks/bits_validate.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": platform.processor() or "?", "load": os.getloadavg()[0], "nets": []}
    for name in filter(None, args.nets.split(",")):
        res["nets"].append(validate(name, args, data))
    if args.cost_depth:
        res["cost"] = cost(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
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
