"""One network's training step at an older commit against this checkout's, side by side in one
process (steps alternated, so a change in the machine's load hits both alike).

    python benchmarks/step_vs_commit.py 60bea4c --depth 164 --batch 128 --mode approx --bits 4

    python benchmarks/step_vs_commit.py 60bea4c --model mobilenet_v2.onnx --batch 32 --bits 4

The older commit's `lowmem/` is extracted with `git archive` into a temporary folder as the
package `lowmem_old` (lowmem imports itself relatively, so two copies load side by side; the
numba cache of the copy compiles on its first use: the warm-up steps are not timed). Both build
`models.preact_resnet_cifar(depth)` from seed 0, or the network of --model (an .onnx file, at the
input shape it fixes), and train on the same random batch. Printed:
each copy's plan bytes, its median step, and the median of the per-round ratios new / old with
their range. The figures are wall-clock on whatever machine runs it: say which.
"""
import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

import numpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from step_alternated import alternate, batch_for, make_step, ratios  # noqa: E402 (beside this script)


def extract(commit, into):
    """`lowmem/` of `commit` as the package `lowmem_old` under `into`."""
    tar = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", commit, "lowmem"],
                         check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    os.rename(os.path.join(into, "lowmem"), os.path.join(into, "lowmem_old"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("commit", help="the older commit (any git revision)")
    p.add_argument("--depth", type=int, default=164)
    p.add_argument("--model", metavar="FILE.onnx", help="an exported CNN instead of the pre-activation ResNet")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--mode", default="approx", choices=("exact", "approx", "naive"))
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--rounding", default="nearest")
    p.add_argument("--rounds", type=int, default=12, help="timed steps of each copy (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    x, y = batch_for(p, args)                 # before the copy: a file it cannot read leaves nothing
    tmp = tempfile.mkdtemp(prefix="lowmem_old_")
    extract(args.commit, tmp)
    sys.path.insert(0, tmp)
    import lowmem
    import lowmem_old
    built = {k: make_step(L, args.depth, args.mode, args.bits, args.rounding, x, y, args.model)
             for k, L in (("old", lowmem_old), ("new", lowmem))}
    times = alternate({k: step for k, (step, _) in built.items()}, args.rounds, args.warmup)
    r = ratios(times, "new", "old")
    out = {"commit": args.commit, "model": args.model, "depth": None if args.model else args.depth,
           "batch": args.batch, "mode": args.mode, "bits": args.bits, "rounding": args.rounding,
           "plan_old": built["old"][1], "plan_new": built["new"][1],
           "median_old_s": float(numpy.median(times["old"])), "median_new_s": float(numpy.median(times["new"])),
           "ratio_median": float(numpy.median(r)), "ratio_min": min(r), "ratio_max": max(r),
           "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    print(json.dumps(out))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
