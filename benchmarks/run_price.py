"""The allocator's price of a code over a whole run, checked against the accuracy study.

    python benchmarks/run_price.py --study DIR [--seeds 0,1,2] [--batches 4] [--out FILE.json]

DIR is an accuracy study's folder (benchmarks/accuracy.py --out DIR: results.json and
runs/exact-seed<S>/epoch<E>.ckpt). For each seed, the points of its exact run (the initial
weights, rebuilt from the seed as the trainer builds them, and every epoch<E>.ckpt) are priced
on --batches fixed training batches of the run's batch size (accuracy.py's noise batches,
seed 0) with lowmem.bits.along.measure_along, for each rounding the study trained
(stochastic: the unbiased code, dither: the dithered one). Then, per allocation:

    predicted   the run's price (RunSensitivity.price: the allocator's objective averaged along
                the run, learning-rate weighed), and the price at the initial weights alone
                (what the allocator sees when it measures at the start of a run)
    measured    the study's accuracy cost, exact minus the allocation's final test accuracy,
                paired per seed (mean ± s.e.) over every seed of --seeds the study trained (the
                prices are the mean over the seeds whose exact run kept its epoch checkpoints)

for the allocations the study trained (uniform 2 and 4 bits under each rounding) and the
allocator's own choice at 2.125 bits per element (avg_bits=2: uniform 2-bit's bytes, the group
ends included) priced over the run, for each rounding. It reports whether the predicted and
measured orderings agree (Kendall's tau over the trained allocations; the pairs whose measured
difference is within its own noise are named). Writes --out (JSON) and prints a table.
A measurement tool: nothing is timed.
"""
import argparse
import glob
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowmem.bits.allocate import allocate                       # noqa: E402
from lowmem.bits.along import RunSensitivity, measure_along      # noqa: E402
from lowmem.data.datasets import load_dataset                   # noqa: E402
from lowmem.models import MODELS                                # noqa: E402
from lowmem.train.checkpoint import load_checkpoint             # noqa: E402
from lowmem.train.trainstate import run_points                  # noqa: E402
from accuracy import noise_batches, paired                         # noqa: E402 (benchmarks/accuracy.py)

# the study's trained allocations: its label -> (rounding, K for every unit)
TRAINED = {"approx 2-bit unbiased": ("stochastic", 2), "approx 2-bit dithered": ("dither", 2),
           "approx 4-bit unbiased": ("stochastic", 4), "approx 4-bit dithered": ("dither", 4)}


def epoch_checkpoints(run_dir):
    """run_dir's epoch<E>.ckpt, by E."""
    found = glob.glob(os.path.join(run_dir, "epoch*.ckpt"))
    return sorted((p for p in found if re.fullmatch(r"epoch\d+\.ckpt", os.path.basename(p))),
                  key=lambda p: int(re.findall(r"\d+", os.path.basename(p))[0]))


def measured_costs(results, seeds):
    """{label: {"per_seed": {s: exact − label}, "mean", "se", "ci"}} of the study's finished runs:
    accuracy.paired's differences to exact, turned into costs."""
    out = {}
    for name in TRAINED:
        d = paired(results, name, "exact", seeds)
        if d is not None:
            lo, hi = d["diff_ci"]
            out[name] = {"per_seed": {s: -x for s, x in zip(d["seeds"], d["diffs"])}, "mean": -d["diff"],
                         "se": d["diff_se"], "ci": (-hi, -lo)}
    return out


def kendall(a, b):
    """Kendall's tau-a of two equal-length sequences, and the discordant pairs (i, j)."""
    n, s, bad = len(a), 0, []
    for i in range(n):
        for j in range(i + 1, n):
            x = (a[i] - a[j]) * (b[i] - b[j])
            s += (x > 0) - (x < 0)
            if x < 0:
                bad.append((i, j))
    return (s / (n * (n - 1) / 2) if n > 1 else float("nan")), bad


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", required=True, help="the accuracy study's folder (results.json, runs/)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--batches", type=int, default=4, help="fixed training batches priced on (>= 2)")
    p.add_argument("--roundings", default="stochastic,dither")
    p.add_argument("--limit-train", type=int, default=None, help="(tests) load only this many training images")
    p.add_argument("--out", default=None, help="write the results here (JSON)")
    args = p.parse_args(argv)
    with open(os.path.join(args.study, "results.json")) as f:
        results = json.load(f)
    seeds = [int(s) for s in args.seeds.split(",")]
    roundings = args.roundings.split(",")
    settings = results["settings"]
    data = load_dataset(settings["dataset"], pad_to=settings["pad_to"] or None, download=False,
                        limit_train=args.limit_train, limit_test=16)
    batches = noise_batches(data, settings["batch"], args.batches, 0)
    out = {"settings": {"study": os.path.abspath(args.study), "batches": args.batches, "seeds": seeds},
           "seeds": {}}
    for seed in seeds:
        run_dir = os.path.join(args.study, "runs", f"exact-seed{seed}")
        ckpts = epoch_checkpoints(run_dir)
        if not ckpts:
            print(f"seed {seed}: no epoch checkpoints in {run_dir}: skipped")
            continue
        meta = load_checkpoint(ckpts[0])[1]
        c = meta["config"]
        net = MODELS[c["model"]].build(c["depth"], num_classes=len(meta["data"]["classes"]),
                                       in_channels=meta["data"]["input_shape"][0], seed=c["seed"])
        points = run_points(net, ckpts, initial=True)
        rec = {"iterations": [q.iteration for q in points], "lr": [q.lr for q in points]}
        for rounding in roundings:
            print(f"seed {seed}, rounding {rounding}: {len(points)} points")
            rs = measure_along(points, batches, rounding=rounding, log=print)
            init = RunSensitivity(points[:1], rs.sens[:1], [1.0])
            r = {"weights": rs.weights, "seconds": rs.seconds, "uniform": {}}
            for k in (2, 4):
                r["uniform"][k] = {"run": rs.price(k), "initial": init.price(k), "along": rs.price_at(k)}
            for name, sens in (("run", rs), ("initial", init)):
                a = allocate(sens, settings["batch"], avg_bits=2)
                r[f"chosen_{name}"] = {"bits": {u: str(v) for u, v in a.bits.items()}, "run": rs.price(a.bits),
                                       "initial": init.price(a.bits), "average_bits": a.average_bits,
                                       "uniform2": all(v == 2 for v in a.bits.values())}
            rec[rounding] = r
        out["seeds"][seed] = rec
    report(out, results, seeds, roundings)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def report(out, results, seeds, roundings):
    measured = measured_costs(results, seeds)         # every seed the study trained, priced or not
    priced = [s for s in out["seeds"].values()]
    if not priced:
        return
    rows = []
    for name, (rounding, k) in TRAINED.items():
        if rounding not in roundings or name not in measured:
            continue
        run = statistics.mean(s[rounding]["uniform"][k]["run"] for s in priced)
        ini = statistics.mean(s[rounding]["uniform"][k]["initial"] for s in priced)
        m = measured[name]
        rows.append((name, run, ini, m["mean"], m["se"], m["ci"]))
    print(f"\n{'allocation':<24} {'run price':>10} {'at start':>9} {'measured cost, pp':>26}")
    for name, run, ini, mean, se, ci in rows:
        print(f"{name:<24} {run:>10.4f} {ini:>9.4f}   {100 * mean:+.2f} ± {100 * se:.2f} "
              f"[{100 * ci[0]:+.2f}, {100 * ci[1]:+.2f}]")
    for key in ("run", "initial"):
        tau, bad = kendall([r[1] if key == "run" else r[2] for r in rows], [r[3] for r in rows])
        names = "; ".join(f"{rows[i][0]} / {rows[j][0]}" for i, j in bad) or "none"
        print(f"Kendall tau, {'run price' if key == 'run' else 'price at the start'} vs measured cost: "
              f"{tau:+.2f} over {len(rows)} allocations (discordant: {names})")
        out[f"kendall_{key}"] = {"tau": tau, "discordant": [(rows[i][0], rows[j][0]) for i, j in bad]}
    for rounding in roundings:
        for key in ("run", "initial"):
            ch = [s[rounding][f"chosen_{key}"] for s in priced]
            print(f"allocator at 2.125 bits, {rounding}, priced {'over the run' if key == 'run' else 'at the start'}: "
                  + ", ".join(("uniform 2-bit" if c["uniform2"] else
                               f"{sum(v != '2' for v in c['bits'].values())} units not at 2 bits") +
                              f" (run price {c['run']:.4f})" for c in ch))
    out["measured"] = measured
    out["rows"] = [{"allocation": r[0], "run_price": r[1], "start_price": r[2], "measured_cost": r[3],
                    "measured_se": r[4], "measured_ci": r[5]} for r in rows]


if __name__ == "__main__":
    main()
