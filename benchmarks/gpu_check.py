"""lowmem on an NVIDIA GPU, checked in one run of a few minutes: tests, then benchmarks.

    LOWMEM_BACKEND=cupy python benchmarks/gpu_check.py --json gpu.json
    ... --skip-tests --no-torch --budget 8GiB --steps 5 --tf32

1. Tests: pytest on tests/units/test_units_gpu.py (every CUDA kernel against NumPy on the GPU, the engine
   on CuPy against the NumPy engine, the pool's peak against the plan) and tests/core/test_engine.py
   (it builds NumPy inputs, so conftest keeps it on NumPy: it checks the install on that machine).
2. Benchmarks, pre-activation ResNet-164 (CIFAR, bottleneck), batch 128, float32, random data,
   SGD (momentum 0.9, weight decay 5e-4 on conv/linear weights), one process, same GPU:
     lowmem exact, approx8/4/2, naive4      step time (median of --steps after --warmup),
                                            images/s, planned bytes, measured peak (CuPy's pool
                                            through a MemoryHook: peak_memory.measure_peak)
     lowmem exact/approx4 slices            the same with im2col/col2im as lowmem.ops.conv's
                                            Python loop of CuPy slice copies instead of the one-launch
                                            kernels of lowmem/ops/columns_gpu.py (the engine's default)
     lowmem approx4, largest batch          lowmem.tools.maxbatch within --budget less a reserve of
                                            2% (from the plan), then measured: peak <= budget?
     lowmem approx4 ResNet-1001, batch 128  peak (target: under 11 GB) and step time
     torch exact (cuDNN)                    tests/torch_reference.py in a subprocess, batch 128:
                                            time, torch.cuda.max_memory_allocated; its largest
                                            batch within --budget (peak(N) is affine: fitted on
                                            two batches, then confirmed by a step)
   The lowmem conv workspace is --workspace (default 256 MiB, counted in the plan: the engine's
   16 MiB default is sized for CPUs and chunks a batch-128 conv into ~5 GEMMs).
3. One table, the targets (approx4/exact step time <= 1.10; approx4 >= 0.8x PyTorch images/s;
   max batch at equal memory >= 6x PyTorch; ResNet-1001 batch 128 4-bit < 11 GB; peak within 5%
   of the plan), and --json with everything, including the device and library versions.

TF32: off by default for both (float32 GEMMs/convs in full precision). --tf32 sets CUPY_TF32=1
(before CuPy is imported) and torch's cudnn/matmul allow_tf32: faster, ~1e-3 relative error
per product.

Not counted in lowmem's plan or peak: the CUDA context, cuBLAS's own workspace, the input batch
(the caller's array). torch's peak counts its input batch and cuDNN workspace.
"""
import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
LR, MOMENTUM, WD = 0.01, 0.9, 5e-4
GB, MiB = 10**9, 1 << 20
SHAPE = (3, 32, 32)
LOWMEM = [("exact", "exact", 8), ("approx8", "approx", 8), ("approx4", "approx", 4),
          ("approx2", "approx", 2), ("naive4", "naive", 4)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write every result here")
    p.add_argument("--depth", type=int, default=164)
    p.add_argument("--big-depth", type=int, default=1001, help="0 skips the big network")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget", default="8GiB", help="memory budget for the max-batch comparison")
    p.add_argument("--workspace", default="256MiB", help="lowmem conv workspace (in the plan)")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--no-maxbatch", action="store_true")
    p.add_argument("--tf32", action="store_true", help="CUPY_TF32=1 and torch allow_tf32")
    p.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- tests -----------------------------------------------------------------------------------

def run_tests():
    env = dict(os.environ, LOWMEM_BACKEND="cupy",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "tests/units/test_units_gpu.py", "tests/core/test_engine.py"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    out = r.stdout + r.stderr
    tail = out.strip().splitlines()[-1] if out.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", tail)}
    print(out[-4000:] if r.returncode else tail)
    return {"command": " ".join(cmd), "returncode": r.returncode, "summary": tail, "counts": counts,
            "seconds": round(time.perf_counter() - t0, 1),
            "failures": re.findall(r"^(?:FAILED|ERROR) .*$", out, re.M)[:50]}


# ---- lowmem ----------------------------------------------------------------------------------

@contextlib.contextmanager
def cuda_im2col(enabled):
    """lowmem/ops/columns_gpu.py's im2col/col2im_add (the default on CuPy) or, when not enabled,
    the reference CuPy slice copies of lowmem.ops.conv, in the engines built while active."""
    from lowmem.core import engine
    from lowmem.ops import conv
    saved = engine.columns_for
    if not enabled:
        engine.columns_for = lambda xp: conv.SLICES
    try:
        yield
    finally:
        engine.columns_for = saved


def batch(xp, n, classes=10, seed=0):
    import numpy
    rng = numpy.random.default_rng(seed)
    return (xp.asarray(rng.standard_normal((n,) + SHAPE).astype("float32")),
            xp.asarray(rng.integers(0, classes, n)))


def lowmem_config(name, depth, n, mode, bits, args, im2col=True, steps=None, warmup=None):
    """Measured peak (a fresh engine, 2 steps, MemoryHook) and step times (another engine)."""
    import cupy
    import lowmem
    from lowmem.tools.peak_memory import measure_peak
    from lowmem.tools.maxbatch import parse_bytes
    steps = args.steps if steps is None else steps
    warmup = args.warmup if warmup is None else warmup
    ws = parse_bytes(args.workspace)
    make = lambda: lowmem.models.preact_resnet_cifar(depth)               # noqa: E731
    pool = cupy.get_default_memory_pool()
    res = {"config": name, "impl": "lowmem", "depth": depth, "batch": n, "mode": mode,
           "bits": None if mode == "exact" else bits, "cuda_im2col": im2col}
    try:
        with cuda_im2col(im2col):
            m = measure_peak(make(), n, SHAPE, mode, bits, "float32", steps=2, workspace_bytes=ws)
            pool.free_all_blocks()
            eng = lowmem.Engine(make(), n, SHAPE, mode, bits, "float32", workspace_bytes=ws)
            opt = lowmem.SGD(eng.net.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
            x, y = batch(cupy, n)
            times = []
            for i in range(warmup + steps):
                cupy.cuda.Device().synchronize()
                t0 = time.perf_counter()
                eng.train_step(x, y, opt)
                cupy.cuda.Device().synchronize()
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            res.update(use_fast=eng.use_fast, plan_bytes=m.plan_bytes, held_bytes=m.held_bytes,
                       peak_bytes=m.peak_bytes, step_peaks=m.step_peaks, kept_bytes=m.kept_bytes,
                       input_bytes=m.input_bytes, peak_over_plan=m.peak_bytes / m.plan_bytes,
                       plan_by_kind=eng.plan.bytes_by_kind(), step_s=statistics.median(times),
                       step_times=times, images_per_s=n / statistics.median(times))
            del eng, opt, x, y
    except Exception as e:                                  # report and go on with the others
        res["error"] = f"{type(e).__name__}: {e}"
    pool.free_all_blocks()
    return res


def lowmem_maxbatch(args):
    from lowmem import models
    from lowmem.tools.maxbatch import max_batch, parse_bytes
    budget = parse_bytes(args.budget)
    # the plan leaves out a step's transients (strided-GEMM copies of a chunked conv: tens of MB
    # at a batch of thousands): plan for the budget less a reserve, then measure against it all
    reserve = max(budget // 50, min(64 * MiB, budget // 10))
    n = max_batch(lambda: models.preact_resnet_cifar(args.depth), SHAPE, budget - reserve, "approx", 4,
                  workspace_bytes=parse_bytes(args.workspace))
    res = lowmem_config(f"approx4 max batch ({args.budget})", args.depth, n, "approx", 4, args,
                        steps=2, warmup=1)
    res.update(budget_bytes=budget, reserve_bytes=reserve,
               fits=res.get("peak_bytes", budget + 1) <= budget)
    return res


# ---- torch (a subprocess: its own allocator, its own process) --------------------------------

def torch_worker(args):
    import torch
    from torch.nn import functional as F
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import torch_reference as ref
    from lowmem.tools.maxbatch import parse_bytes
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    dev = torch.device("cuda")
    model = ref.preact_resnet_cifar(args.depth, num_classes=10, block="bottleneck").to(dev).train()
    opt = torch.optim.SGD(ref.sgd_param_groups(model, WD), lr=LR, momentum=MOMENTUM)

    def measure(n, steps, warmup):
        torch.cuda.empty_cache()                 # the previous batch's blocks
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn((n,) + SHAPE, device=dev, generator=g)
        y = torch.randint(0, 10, (n,), device=dev, generator=g)

        def step():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), torch.cuda.max_memory_allocated(), times

    out = {"config": "torch exact (cuDNN)", "impl": "torch", "depth": args.depth, "batch": args.batch,
           "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "tf32": args.tf32}
    t, peak, times = measure(args.batch, args.steps, args.warmup)
    out.update(step_s=t, step_times=times, images_per_s=args.batch / t, peak_bytes=peak)
    if not args.no_maxbatch:
        budget = parse_bytes(args.budget)
        half = max(1, args.batch // 2)
        _, p_half, _ = measure(half, 1, 1)
        slope = (peak - p_half) / (args.batch - half)
        n = max(1, int(args.batch + (budget - peak) / slope))
        found = None
        for _ in range(6):                 # confirm; shrink by 3% on OOM or over budget
            try:
                t_n, p_n, _ = measure(n, 1, 1)
            except torch.cuda.OutOfMemoryError:
                t_n, p_n = None, None
                torch.cuda.empty_cache()
            if p_n is not None and p_n <= budget:
                found = {"batch": n, "peak_bytes": p_n, "step_s": t_n, "images_per_s": n / t_n}
                break
            n = max(1, int(n * 0.97))
        out["maxbatch"] = {"budget_bytes": budget, "slope_bytes_per_sample": slope,
                           "predicted": int(args.batch + (budget - peak) / slope), "confirmed": found}
    print("JSON " + json.dumps(out))


def torch_run(args):
    cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", "--depth", str(args.depth),
           "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--budget", args.budget] + (["--tf32"] if args.tf32 else []) \
        + (["--no-maxbatch"] if args.no_maxbatch else [])
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    for line in r.stdout.splitlines():
        if line.startswith("JSON "):
            return json.loads(line[5:])
    return {"config": "torch exact (cuDNN)", "impl": "torch",
            "error": (r.stderr or r.stdout).strip()[-2000:] or f"exit {r.returncode}"}


def torch_installed():
    """Without importing it here: torch's CUDA libraries stay out of this (CuPy) process."""
    import importlib.util
    return importlib.util.find_spec("torch") is not None


# ---- report ----------------------------------------------------------------------------------

def device_info():
    import cupy
    import numpy
    rt = cupy.cuda.runtime
    props = rt.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    try:
        from cupy.cuda import nvrtc
        nv = ".".join(map(str, nvrtc.getVersion()))
    except Exception:
        nv = None
    return {"gpu": name, "memory_bytes": props["totalGlobalMem"], "compute_capability":
            f"{props['major']}{props['minor']}", "driver": rt.driverGetVersion(),
            "runtime": rt.runtimeGetVersion(), "nvrtc": nv, "cupy": cupy.__version__,
            "numpy": numpy.__version__, "CUPY_TF32": os.environ.get("CUPY_TF32", "0"),
            "python": sys.version.split()[0]}


def mib(b):
    return "-" if b is None else f"{b / MiB:,.0f}"


def table(rows, exact, torch_row):
    head = (f"{'config':<34} {'batch':>6} {'step ms':>9} {'img/s':>8} {'plan MiB':>9} "
            f"{'peak MiB':>9} {'peak/plan':>9} {'vs exact':>8} {'vs torch':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['config']:<34} {r.get('batch', ''):>6}  ERROR {r['error'][:80]}")
            continue
        t = r["step_s"]
        vs_exact = f"{t / exact['step_s']:.2f}" if exact and "step_s" in exact \
            and r.get("batch") == exact["batch"] and r.get("depth") == exact["depth"] else "-"
        vs_torch = f"{r['images_per_s'] / torch_row['images_per_s']:.2f}" if torch_row \
            and "images_per_s" in torch_row and r.get("batch") == torch_row["batch"] \
            and r.get("depth") == torch_row["depth"] else "-"
        ratio = f"{r['peak_over_plan']:.3f}" if "peak_over_plan" in r else "-"
        lines.append(f"{r['config']:<34} {r['batch']:>6} {1e3 * t:>9.1f} {r['images_per_s']:>8.0f} "
                     f"{mib(r.get('plan_bytes')):>9} {mib(r.get('peak_bytes')):>9} {ratio:>9} "
                     f"{vs_exact:>8} {vs_torch:>8}")
    return "\n".join(lines)


def targets(res):
    by = {r["config"]: r for r in res["lowmem"]}
    exact, a4 = by.get("exact", {}), by.get("approx4", {})
    tr = res.get("torch") or {}
    out = []

    def add(name, value, ok, note=""):
        out.append({"target": name, "value": value, "met": ok, "note": note})
    if "step_s" in exact and "step_s" in a4:
        v = a4["step_s"] / exact["step_s"]
        add("approx4 / exact step time <= 1.10", round(v, 3), v <= 1.10)
    if "images_per_s" in a4 and "images_per_s" in tr:
        v = a4["images_per_s"] / tr["images_per_s"]
        add("approx4 images/s >= 0.8x PyTorch cuDNN", round(v, 3), v >= 0.8)
    mb, tmb = res.get("maxbatch") or {}, (tr.get("maxbatch") or {}).get("confirmed")
    if mb.get("fits") and tmb:
        v = mb["batch"] / tmb["batch"]
        add(f"max batch at {res['args']['budget']} >= 6x PyTorch", round(v, 2), v >= 6,
            f"lowmem {mb['batch']} vs torch {tmb['batch']}")
    big = res.get("big") or {}
    if "peak_bytes" in big:
        add(f"ResNet-{big['depth']} batch {big['batch']} 4-bit < 11 GB", f"{big['peak_bytes'] / GB:.2f} GB",
            big["peak_bytes"] < 11 * GB)
    ratios = {r["config"]: r["peak_over_plan"] for r in res["lowmem"] if "peak_over_plan" in r}
    if ratios:
        worst = max(ratios, key=ratios.get)
        add("steady-state peak within 5% of the plan", f"worst {ratios[worst]:.3f} ({worst})",
            ratios[worst] <= 1.05)
    return out


def nccl_smoke():
    """1-rank NCCL: the communicator lowmem picks for CuPy arrays sums a buffer (NCCL refuses
    two ranks on one GPU, so one rank is all a single-GPU machine can check), and a data-parallel
    engine step over it equals a plain one."""
    import cupy
    import numpy
    import lowmem as lm
    from lowmem.system import distributed
    try:
        comm = distributed.NCCL()
        a = cupy.arange(1000, dtype=cupy.float32)
        comm.allreduce(a)
        ok_sum = bool((a == cupy.arange(1000, dtype=cupy.float32)).all())
        out = []
        for c in (None, comm):
            net = lm.models.preact_resnet_cifar(20, seed=0)
            eng = lm.Engine(net, 32, (3, 32, 32), "approx", 4, comm=c)
            opt = lm.SGD(net.parameters(), lr=0.1)
            x, y = batch(cupy, 32)
            eng.train_step(x, y, opt)
            out.append(net.state_dict())
        same = all(numpy.array_equal(out[0][k], out[1][k]) for k in out[0])
        return {"communicator": comm.describe(), "allreduce_ok": ok_sum, "engine_step_equal": same}
    except Exception as e:                      # report, do not stop the other checks
        return {"error": f"{type(e).__name__}: {e}"}


def main():
    args = parse_args()
    if args.tf32:
        os.environ["CUPY_TF32"] = "1"          # read by CuPy at its first GEMM
    if args.torch_worker:
        return torch_worker(args)
    import lowmem
    lowmem.set_backend("cupy")                 # a clear error when CuPy or the GPU is missing
    res = {"args": vars(args), "device": device_info(),
           "note": "lowmem peak: CuPy pool via MemoryHook (plan arrays + transient scratch, not the "
                   "input batch, CUDA context or cuBLAS workspace); torch peak: max_memory_allocated"}
    print(json.dumps(res["device"]))
    if not args.skip_tests:
        res["tests"] = run_tests()
    res["nccl"] = nccl_smoke()
    print("nccl:", json.dumps(res["nccl"]))
    res["lowmem"] = [lowmem_config(name, args.depth, args.batch, mode, bits, args)
                     for name, mode, bits in LOWMEM]
    res["lowmem"] += [lowmem_config(f"{name} slices", args.depth, args.batch, mode, bits, args, im2col=False)
                      for name, mode, bits in (LOWMEM[0], LOWMEM[2])]
    if not args.no_maxbatch:
        res["maxbatch"] = lowmem_maxbatch(args)
    if args.big_depth:
        res["big"] = lowmem_config(f"approx4 ResNet-{args.big_depth}", args.big_depth, args.batch,
                                   "approx", 4, args, steps=2, warmup=1)
    if not args.no_torch and torch_installed():
        res["torch"] = torch_run(args)
    rows = res["lowmem"] + [r for r in (res.get("maxbatch"), res.get("big")) if r]
    torch_row = res.get("torch")
    if torch_row:
        rows.append(torch_row)
        if "maxbatch" in torch_row and torch_row["maxbatch"]["confirmed"]:
            c = torch_row["maxbatch"]["confirmed"]
            rows.append({"config": f"torch max batch ({args.budget})", "batch": c["batch"],
                         "step_s": c["step_s"], "images_per_s": c["images_per_s"],
                         "peak_bytes": c["peak_bytes"]})
    exact = next((r for r in res["lowmem"] if r["config"] == "exact"), None)
    print()
    print(f"pre-act ResNet-{args.depth} (CIFAR, float32), {res['device']['gpu']}, TF32 "
          f"{'on' if args.tf32 else 'off'}, lowmem conv workspace {args.workspace}")
    print(table(rows, exact, torch_row if torch_row and "error" not in torch_row else None))
    res["targets"] = targets(res)
    print()
    for t in res["targets"]:
        print(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['value']} {t['note']}")
    if "tests" in res:
        print(f"\ntests: {res['tests']['summary']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 1 if res.get("tests", {}).get("returncode") else 0


if __name__ == "__main__":
    sys.exit(main())
