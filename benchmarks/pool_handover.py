"""lowmem's thread pool hand-over against concurrent.futures', side by side in one process.

    python benchmarks/pool_handover.py [--model FILE.onnx --batch B | --depth 164 --batch 128]
                                       [--config approx4] [--rounds 8] [--calls 2000]

Two pools split the same work over the same 2 threads (lowmem.system.threads.configure(2)):
lowmem's (a counter and a lock per worker, both sides spinning a bounded while on the counter
before they block; lowmem/system/threads.py) and a reference one as the pool was before it: a
concurrent.futures.ThreadPoolExecutor, one submitted future per range, the caller waiting on
the futures. Printed: the seconds of an empty split call through each (the hand-over alone),
then one network's training step (step_alternated.py's, from --model or pre-act ResNet-<depth>)
with lowmem's parallel_for swapped between the two, alternated round by round, and the median
(and range) of the per-round ratios lowmem / reference. Wall-clock on whatever machine runs it:
say which.
"""
import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lowmem                                                              # noqa: E402
from lowmem.system import threads                                          # noqa: E402
from step_alternated import make_step, median_step, parse, random_batch                 # noqa: E402 (beside this script)


def reference_pool(workers):
    """parallel_for as it was on concurrent.futures: (fn(fn, n, grain), the executor)."""
    ex = ThreadPoolExecutor(workers, thread_name_prefix="reference")

    def parallel_for(fn, n, grain=1):
        parts = min(threads.threads(), n // max(1, grain))
        if parts <= 1 or getattr(threads._local, "busy", False):
            if n > 0:
                fn(0, n)
            return
        cut = threads.bounds(n, parts)
        futures = [ex.submit(threads._in_range, fn, cut[i], cut[i + 1]) for i in range(1, parts)]
        try:
            threads._in_range(fn, cut[0], cut[1])
        finally:
            errors = [f.exception() for f in futures]
        for e in errors:
            if e is not None:
                raise e
    return parallel_for, ex


def empty_call(parallel_for, calls):
    """Seconds of one empty split call over 2 ranges (the best of 3 runs of `calls`)."""
    def nothing(lo, hi):
        pass
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls):
            parallel_for(nothing, 2)
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="an .onnx file (default: pre-act ResNet-<depth>)")
    p.add_argument("--depth", type=int, default=164)
    p.add_argument("--batch", type=int, default=None, help="default: 16 with --model, else 128")
    p.add_argument("--config", default="approx4", help="exact, approxK, ... (step_alternated.py's)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="steps per pool per round (their median)")
    p.add_argument("--calls", type=int, default=2000, help="empty split calls timed per run")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if threads.configure(2) != 2:
        raise SystemExit("needs lowmem[fast] (threadpoolctl) for a pool of 2 threads")
    ours = threads.parallel_for
    ref, ex = reference_pool(1)
    out = {"empty_call_s": {"lowmem": empty_call(ours, args.calls), "reference": empty_call(ref, args.calls)}}
    print("empty split call: lowmem %.1f us, reference (concurrent.futures) %.1f us"
          % (1e6 * out["empty_call_s"]["lowmem"], 1e6 * out["empty_call_s"]["reference"]))
    mode, bits, rounding = parse(args.config)
    if args.model:
        import onnx
        dims = onnx.load(args.model, load_external_data=False).graph.input[0].type.tensor_type.shape.dim
        shape, classes = tuple(d.dim_value for d in dims[1:]), 1000
    else:
        shape, classes = (3, 32, 32), 10
    batch = args.batch or (16 if args.model else 128)
    x, y = random_batch(batch, shape, classes)
    step, _ = make_step(lowmem, args.depth, mode, bits, rounding, x, y, model=args.model)

    def timed(pf):
        threads.parallel_for = pf
        try:
            return median_step(step, args.steps)
        finally:
            threads.parallel_for = ours
    timed(ref), timed(ours)                                     # warm-up
    rows = []
    for r in range(args.rounds):
        order = [("reference", ref), ("lowmem", ours)][::(-1) ** r]
        got = {name: timed(pf) for name, pf in order}
        rows.append(got)
    ratio = [g["lowmem"] / g["reference"] for g in rows]
    out.update(rounds=rows, ratio_median=statistics.median(ratio), ratio_min=min(ratio), ratio_max=max(ratio),
               network=args.model or f"preact-resnet{args.depth}", batch=batch, config=args.config)
    print(f"{out['network']} b{batch} {args.config}: step lowmem {statistics.median(g['lowmem'] for g in rows):.3f} s, "
          f"reference {statistics.median(g['reference'] for g in rows):.3f} s; lowmem / reference median "
          f"{out['ratio_median']:.3f} (range {out['ratio_min']:.3f}-{out['ratio_max']:.3f}) over {args.rounds} rounds")
    ex.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
