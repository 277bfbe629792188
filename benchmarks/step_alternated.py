"""Several engine configurations of one network, their training steps alternated in one process,
so that a change in the machine's load hits every configuration alike (compare_torch.py runs
each in its own fresh process, which measures memory cleanly but lets the load drift between
rows by 10% and more on a shared machine).

    python benchmarks/step_alternated.py --depth 164 --batch 128 --configs exact,approx4,approx4u,approx2u

    python benchmarks/step_alternated.py --model resnet50.onnx --batch 16 --configs exact,approx4,approx2u

A config is exact, approxK or naiveK (K in 1, 2, 4, 8), with a "u" suffix for the unbiased code
(rounding="stochastic") or a "d" for its dithered draw (rounding="dither"). Every engine is built from models.preact_resnet_cifar(depth) with seed 0,
or from --model (an .onnx file, at the input shape it fixes: compare_torch.py --worker export
writes torchvision's), and trains on the same random batch; round r steps each config once, the order rotated by r.
Printed: per config its plan bytes and median step, and the median (and range) over rounds of
its step / the first config's step of the same round. Wall-clock on whatever machine runs it.

--kernels N: then `--rounds` more rounds under cProfile (alternated as the timed ones, and not
timed), and per config the seconds per step of the N functions with the most own time (the
--json file keeps every function of 1 ms or more). cProfile sees the calling thread only: run
with LOWMEM_THREADS=1 for a step's whole work.

--ops: then `--rounds` more rounds with every op's forward and backward handler timed on the
wall clock (all threads' work inside it: run at the thread count you study), and per op kind
(a fused forward group counts as one, e.g. bn+add+relu) its milliseconds per step for each
config and the difference to the first config: which ops an approximate mode's extra sits in.
--by-plane keeps each kind apart by the plane its op writes and a conv by its kernel too
("bwd conv 3x3 4x4"): run at LOWMEM_THREADS=1 and 2, where two threads lose, op by op.
"""
import argparse
import collections
import cProfile
import json
import os
import pstats
import re
import sys
import time

import numpy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lowmem  # noqa: E402


def parse(config):
    m = re.fullmatch(r"(exact)|(approx|naive)([1248])([ud]?)", config)
    if not m:
        raise SystemExit(f"unknown config {config!r}: expected exact, approxK or naiveK, K in 1, 2, 4, 8, "
                         f"optionally with a 'u' suffix (the unbiased code) or a 'd' (its dithered draw)")
    if m.group(1):
        return "exact", 4, "nearest"
    return m.group(2), int(m.group(3)), {"u": "stochastic", "d": "dither", "": "nearest"}[m.group(4)]


def random_batch(n, shape=(3, 32, 32), classes=10):
    """The batch every engine trains on: n standard-normal images of `shape` and labels, seed 0."""
    rng = numpy.random.default_rng(0)
    return rng.standard_normal((n,) + tuple(shape)).astype(numpy.float32), rng.integers(0, classes, n)


def batch_for(parser, args):
    """random_batch(args.batch) for the pre-activation ResNet, or at the input shape and classes
    of args.model (an .onnx file; a file it cannot read is the parser's error)."""
    if not args.model:
        return random_batch(args.batch)
    from lowmem.formats.onnx_import import file_input_shape
    try:
        shape, classes = file_input_shape(args.model), lowmem.nn.from_onnx(args.model).num_classes
    except (OSError, ValueError) as e:
        parser.error(f"--model: {e}")
    return random_batch(args.batch, shape, classes)


def make_step(L, depth, mode, bits, rounding, x, y, model=None):
    """(one training step of a fresh engine, its plan bytes): models.preact_resnet_cifar(depth) of
    the lowmem package L (this checkout's, or an older copy: rounding is passed only when not
    "nearest", so a copy from before the keyword builds too), or the network of the .onnx file
    `model`."""
    if model is not None:
        net = L.nn.from_onnx(model, input_shape=x.shape[1:])
    else:
        net = L.models.preact_resnet_cifar(depth, num_classes=10)
    kw = {} if rounding == "nearest" else {"rounding": rounding}
    eng = L.Engine(net, len(x), x.shape[1:], mode, bits, "float32", **kw)
    opt = L.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)

    def step():
        return eng.train_step(x, y, opt)
    step.engine = eng                                  # for op_times
    return step, eng.plan.total_bytes


def alternate(steps, rounds, warmup):
    """{name: [seconds per timed step]}: `warmup` untimed rounds, then `rounds` in which every step
    of `steps` {name: callable} runs once, the order rotated by one each round."""
    names = list(steps)
    for _ in range(warmup):
        for n in names:
            steps[n]()
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            steps[n]()
            times[n].append(time.perf_counter() - t)
    return times


def median_step(step, n):
    """The median seconds of n calls of step()."""
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    return float(numpy.median(ts))


def own_times(steps, rounds):
    """{name: Counter(function -> own seconds per step)}: `rounds` rounds as `alternate`'s, each
    step under its own cProfile (the calling thread only)."""
    names = list(steps)
    own = {n: collections.Counter() for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            prof = cProfile.Profile()
            prof.enable()
            steps[n]()
            prof.disable()
            for (path, _, fn), row in pstats.Stats(prof).stats.items():
                own[n][f"{os.path.basename(path)}:{fn}"] += row[2] / rounds
    return own


def op_times(steps, rounds, by_plane=False):
    """{name: Counter(op kind -> wall seconds per step)}: `rounds` rounds as `alternate`'s, with
    each engine's forward handlers (a fused group as one kind, its ops joined by '+') and
    backward handlers timed; the engines are put back afterwards. by_plane: each kind apart by
    the plane its op writes (its first op's output, H x W), and a conv's by its kernel too."""
    from lowmem.core.optable import OPS
    names = list(steps)
    walls = {n: collections.Counter() for n in names}

    def kind(step):
        if not by_plane:
            return step.op
        k = getattr(step.layer, "k", None) if step.op == "conv" else None
        shape = step.out_shape if step.phase == "fwd" else step.in_shape
        plane = f" {shape[-2]}x{shape[-1]}" if len(shape) == 3 else ""
        return f"{step.op}{f' {k}x{k}' if k else ''}{plane}"

    def instrument(eng, wall):
        def timed(kind, fn):
            def run(*a):
                t = time.perf_counter()
                fn(*a)
                wall[kind] += (time.perf_counter() - t) / rounds
            return run
        eng._forward_groups = [(timed("fwd " + "+".join(kind(s) for s in st), h), st) for h, st in eng._forward_groups]
        sweep = eng._sweep

        def backward_sweep(phase, before=None):
            if phase == "fwd":
                return sweep(phase, before)
            for step in eng.schedule:
                if step.phase == phase:
                    if before is not None:
                        before(step)
                    timed("bwd " + kind(step), OPS[step.op].backward)(eng.run, step)
        eng._sweep = backward_sweep

    saved = {n: steps[n].engine._forward_groups for n in names}
    for n in names:
        instrument(steps[n].engine, walls[n])
    try:
        alternate(steps, rounds, 0)
    finally:
        for n in names:
            eng = steps[n].engine
            eng._forward_groups = saved[n]
            del eng._sweep                                 # the class's method again
    return walls


def ratios(times, name, first):
    """Each round's step of `name` over the step of `first` in the same round."""
    return [a / b for a, b in zip(times[name], times[first])]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", type=int, default=164)
    p.add_argument("--model", metavar="FILE.onnx", help="an exported CNN instead of the pre-activation ResNet")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--configs", default="exact,approx4,approx4u,approx2u")
    p.add_argument("--rounds", type=int, default=10, help="timed steps of each config (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", help="also write the result here")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="then profile as many rounds and print the N functions with the most own time")
    p.add_argument("--ops", action="store_true",
                   help="then time every op's handlers for as many rounds: ms per step by op kind")
    p.add_argument("--by-plane", action="store_true",
                   help="with --ops: each op kind apart by the plane it writes (and a conv by its kernel)")
    args = p.parse_args(argv)
    if args.by_plane and not args.ops:
        p.error("--by-plane goes with --ops")
    configs = args.configs.split(",")
    x, y = batch_for(p, args)
    steps, plans = {}, {}
    for c in configs:
        steps[c], plans[c] = make_step(lowmem, args.depth, *parse(c), x, y, args.model)
    times = alternate(steps, args.rounds, args.warmup)
    first = configs[0]
    out = {"model": args.model or "preact", "depth": args.depth, "batch": args.batch, "rounds": args.rounds,
           "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "configs": {}}
    for c in configs:
        r = ratios(times, c, first)
        out["configs"][c] = {"plan_bytes": plans[c], "median_s": float(numpy.median(times[c])),
                             f"per_round_vs_{first}": [round(v, 4) for v in r],
                             f"median_vs_{first}": float(numpy.median(r)), "min": min(r), "max": max(r)}
        print(f"{c:10s} plan {plans[c]:>14,d} B  median {numpy.median(times[c]):6.2f} s  vs {first}: "
              f"median {numpy.median(r):.3f} (range {min(r):.3f}-{max(r):.3f})", flush=True)
    if args.kernels:
        own = own_times(steps, args.rounds)
        top = sorted(set().union(*own.values()), key=lambda f: -max(own[c][f] for c in configs))[:args.kernels]
        print("own seconds per step (cProfile, the calling thread; LOWMEM_THREADS="
              f"{os.environ.get('LOWMEM_THREADS', 'unset')}):")
        print(" ".join(f"{c:>9s}" for c in configs), " function")
        for f in top:
            print(" ".join(f"{own[c][f]:9.3f}" for c in configs), "", f)
        kept = [f for f in set().union(*own.values()) if max(own[c][f] for c in configs) >= 1e-3]
        out["own_seconds_per_step"] = {c: {f: round(own[c][f], 4) for f in sorted(kept)} for c in configs}
    if args.ops:
        walls = op_times(steps, args.rounds, args.by_plane)
        kinds = sorted(set().union(*walls.values()), key=lambda k: -max(walls[c][k] for c in configs))
        print(f"wall ms per step by op kind (handlers timed, {args.rounds} rounds; "
              f"LOWMEM_THREADS={os.environ.get('LOWMEM_THREADS', 'unset')}):")
        print(" ".join(f"{c:>9s}" for c in configs), " ".join(f"{c + '-' + first:>12s}" for c in configs[1:]), " op")
        for k in kinds:
            print(" ".join(f"{walls[c][k] * 1e3:9.2f}" for c in configs),
                  " ".join(f"{(walls[c][k] - walls[first][k]) * 1e3:+12.2f}" for c in configs[1:]), "", k)
        out["op_ms_per_step"] = {c: {k: round(walls[c][k] * 1e3, 3) for k in kinds} for c in configs}
    if args.json:
        from lowmem.system.atomic import atomic_write
        atomic_write(args.json, json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
