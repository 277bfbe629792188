"""Data-parallel throughput on one machine: 1 rank x T threads against N ranks x 1 thread.

    python benchmarks/distributed.py --depth 56 --batch 128 --steps 5 --json benchmarks/results/distributed.json

Each configuration runs in its own process(es), same global batch, same network, approx 4-bit:
  single   one process, LOWMEM_THREADS=T (default: the core count; lowmem/system/threads.py keeps
           BLAS at one thread and splits the work itself), and the same at one thread
  mpi      `mpiexec -n N`, one thread per rank (LOWMEM_THREADS=1), per-rank batch = batch / N
and reports the median step time, images/s, and for MPI the share of a step spent in the
gradient allreduce (and the running-statistics one), timed around the communicator's calls.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(args):
    """One rank (or the single process): time steps, print one JSON line from rank 0."""
    import numpy as np
    import lowmem as lm
    from lowmem.system import distributed

    comm = distributed.get_communicator()
    spent = []


    real = comm.allreduce

    def timed_allreduce(a):
        t = time.perf_counter()
        real(a)
        spent[-1] += time.perf_counter() - t

    comm.allreduce = timed_allreduce
    net = lm.models.preact_resnet_cifar(args.depth)
    per = args.batch // comm.size
    eng = lm.Engine(net, per, (3, 32, 32), "approx", 4, comm=comm)
    opt = lm.SGD(net.parameters(), lr=0.05)
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((per, 3, 32, 32)).astype(np.float32)
    y = rng.integers(0, 10, per)
    times = []
    for i in range(args.warmup + args.steps):
        spent.append(0.0)
        comm.barrier()
        t = time.perf_counter()
        eng.train_step(x, y, opt)
        comm.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    comm_share = statistics.median(s / t for s, t in zip(spent[args.warmup:], times))
    if comm.rank == 0:
        print(json.dumps({"world": comm.describe(), "step_s": statistics.median(times), "times": times,
                          "images_per_s": args.batch / statistics.median(times),
                          "comm_share": comm_share, "grad_bytes": int(eng.arrays["grads"].nbytes)}))


def run(cmd, env):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=56)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    cores = os.cpu_count()
    common = [str(Path(__file__).resolve()), "--worker", "--depth", str(args.depth), "--batch", str(args.batch),
              "--steps", str(args.steps), "--warmup", str(args.warmup)]
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    rows = {}
    one = dict(os.environ, OPENBLAS_NUM_THREADS="1", LOWMEM_THREADS="1")     # lowmem's pool too
    rows[f"1 rank x {cores} threads"] = run([sys.executable] + common,
                                            dict(os.environ, LOWMEM_THREADS=str(cores)))
    rows["1 rank x 1 thread"] = run([sys.executable] + common, one)
    rows[f"{args.ranks} ranks x 1 thread"] = run([mpiexec, "-n", str(args.ranks), sys.executable] + common, one)
    print(f"pre-act ResNet-{args.depth}, global batch {args.batch}, approx 4-bit, "
          f"{platform.processor() or platform.machine()}, {cores} cores, load {os.getloadavg()[0]:.1f}")
    print(f"{'configuration':<22} {'step (s)':>9} {'images/s':>9} {'allreduce share':>16}")
    for name, r in rows.items():
        share = f"{100 * r['comm_share']:.1f}%" if "ranks" in name else "-"
        print(f"{name:<22} {r['step_s']:>9.3f} {r['images_per_s']:>9.1f} {share:>16}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "load": os.getloadavg(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
