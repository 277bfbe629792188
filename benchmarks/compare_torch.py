"""lowmem against PyTorch on the CPU: step time and peak resident memory, each configuration
in its own fresh process, on a quiet machine (benchmarks/harness.py).

The networks users have (torchvision's, through ONNX):

    python benchmarks/compare_torch.py --model resnet18 --size 128 --batch 32 --kernels
    python benchmarks/compare_torch.py --model mobilenet_v2 --size 128 --batch 32 --rounds 5
    python benchmarks/compare_torch.py --model my_cnn.onnx --batch 16       # lowmem's configs only
    python benchmarks/compare_torch.py --model resnet50 --size 128 --batch 16 --rounds 0 --alternate 8

  --alternate N: the step-time ratios again with every configuration in its own persistent
  process, all built first, then N rounds each running --steps steps of every configuration in
  turn (the order rotated each round, PAUSE_S apart): a drift in the host's speed hits all
  configurations alike, where fresh processes run minutes apart (their rounds moved 10-15% on a
  shared 2-core host). Per ratio the median over rounds of the round's ratio, and its range.
  Memory is not measured there (fresh processes, above; --rounds 0 skips them).

  --model resnet18 | resnet50 | densenet121 | mobilenet_v2: PyTorch trains torchvision's module
  (tests/torchvision_layout.py: torchvision's model code written again, the same modules and
  names; PyPI's torchvision does not import beside this CPU torch), built from seed 0; lowmem
  trains the ONNX export of that same module (the same initial weights), written once per run by
  a worker as benchmarks/onnx_vs_torch.py does:
      torch.onnx.export(model, x, path, training=torch.onnx.TrainingMode.TRAINING,
                        do_constant_folding=False, dynamo=False)
  MobileNetV2 is built and exported with its classifier dropout at p = 0 on both sides (lowmem's
  head is the pool and the linear layer: it refuses a dropout between them). --size S: S x S
  RGB inputs (default 224), --classes (default 1000). Configurations (default): torch-exact,
  lowmem-exact, lowmem-approx4, lowmem-approx2u (the 2-bit unbiased code, rounding="stochastic");
  lowmem-approx2d (its dithered draw, rounding="dither") on request.
  FILE.onnx: lowmem's configurations on that file (no PyTorch module to compare with), its own
  input size (fixed in the file) and classes.

The pre-activation ResNet (the default, no --model; tests/torch_reference.py for PyTorch):

    python benchmarks/compare_torch.py                          # ResNet-164, batch 128, all configs
    python benchmarks/compare_torch.py --depth 1001 --configs lowmem-approx4,torch-exact \\
        --steps 1 --warmup 0 --mem-limit 21GiB
    python benchmarks/compare_torch.py --maxbatch-budget 2GiB --configs none
    python benchmarks/compare_torch.py --configs lowmem-approx4 --profile 10   # + cProfile of one step
    python benchmarks/compare_torch.py --configs torch-exact,lowmem-exact,lowmem-approx4 \\
        --scaling lowmem-exact,lowmem-approx4 --jit lowmem-approx4
        # + the 1-thread row, first-step JIT overhead (empty vs filled numba cache)

Configurations:
  torch-exact      PyTorch autograd, nn modules
  torch-ckpt       PyTorch with torch.utils.checkpoint.checkpoint_sequential over the blocks,
                   round(sqrt(#blocks)) segments (use_reentrant=False); pre-activation ResNet only
  lowmem-exact     lowmem, x-hat saved in float32
  lowmem-approx8/4/2   the method, 8/4/2-bit codes (window code, nearest rounding)
  lowmem-approx4u/2u   the unbiased code (rounding="stochastic"), 4 and 2 bits
  lowmem-approx2d      the unbiased code's dithered draw (rounding="dither"), 2 bits
  lowmem-naive4    the paper's baseline, 4-bit
  floor            the machine's floor for the approx-4 step (benchmarks/gemm_floor.py: exactly the
                   step's conv GEMMs as lowmem runs them, plus one pass over the bytes a step must
                   touch at the copy bandwidth measured in the same process); pre-activation ResNet only

A step is forward + backward + SGD (momentum 0.9, weight decay 5e-4 on conv/linear weights,
lr 0.01) on random data. Each worker (`--worker CONFIG`, this script) imports its libraries,
reads its baseline resident size, resets the high-water mark, builds the model and data, runs
--warmup + --steps steps and reports the peak above the baseline: everything the model, the
data, the step and any JIT (numba loading its cached kernels) added to the process.

Rounds: --rounds R runs every configuration R times, each time in a fresh process, the order
rotated by one each round (a drift in the machine's speed hits every configuration alike); a
configuration's step is the median of its rounds' medians (default: 3 with --model, 1 for the
pre-activation ResNet). The ratios printed: approx-4 / PyTorch, approx-4 / exact, 2-bit
unbiased / exact, exact / PyTorch (and, for the pre-activation ResNet, its floor and
checkpointing rows).

--kernels: where a lowmem step's time goes, by op kind (benchmarks/op_profile.py: cProfile's own
time of each function, charged to the op kind that called it: conv GEMMs, conv columns and
transforms, depthwise conv, range code, masks and packing, the BN-ReLU unit, standalone BN,
pools, add/concat, linear/loss, SGD, other): per lowmem configuration a fresh process on
--kernel-threads lowmem threads (default 1: cProfile sees the calling thread only, so one thread
shows the whole step's work), one warm-up step, then --kernel-steps profiled steps; seconds per
step and the share of the profiled step. With torch-exact among the configurations, PyTorch's
step too (benchmarks/torch_profile.py: torch.profiler's self CPU time of each op, charged to the
outermost op kind above it, on --kernel-threads threads), and every configuration side by side in
the kinds both libraries can name (op_profile.COARSE: lowmem's BN-ReLU units, batch norms and
masks are one row, as PyTorch's batch norms and ReLUs).

The machine is named in the header (CPU model, AVX2 / AVX-512, cores and CPUs). Supervision
(harness.py): before each worker the parent waits (up to --max-wait s) until the CPUs are quiet,
records the load and the CPUs other processes used during every run, reruns a disturbed run (up
to --retries times), and kills a worker that passes --mem-limit or leaves less than 1 GiB free.
Thread-count environment variables and OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are reported, never
changed silently (--unset-openblas-env removes the latter two in the workers).

Threads: PyTorch workers use torch.set_num_threads(--threads) and BLAS at --threads; lowmem
workers call lowmem.system.threads.configure(--threads) (lowmem's own policy: BLAS at one thread,
its pool of threads for kernels and conv ranges; docs/performance.md).
"""
import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import harness                                   # beside this script: benchmarks/harness.py
from harness import MiB, fmt_mib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIGS = {
    "torch-exact": dict(impl="torch", ckpt=False),
    "torch-ckpt": dict(impl="torch", ckpt=True),
    "lowmem-exact": dict(impl="lowmem", mode="exact", bits=8),
    "lowmem-approx8": dict(impl="lowmem", mode="approx", bits=8),
    "lowmem-approx4": dict(impl="lowmem", mode="approx", bits=4),
    "lowmem-approx2": dict(impl="lowmem", mode="approx", bits=2),
    "lowmem-approx4u": dict(impl="lowmem", mode="approx", bits=4, rounding="stochastic"),   # the unbiased code
    "lowmem-approx2u": dict(impl="lowmem", mode="approx", bits=2, rounding="stochastic"),
    "lowmem-approx2d": dict(impl="lowmem", mode="approx", bits=2, rounding="dither"),       # the dithered draw
    "lowmem-naive4": dict(impl="lowmem", mode="naive", bits=4),
    "floor": dict(impl="floor", mode="approx", bits=4),
}
TORCHVISION = ("resnet18", "resnet50", "densenet121", "mobilenet_v2")
IMPORTED_CONFIGS = ("torch-exact", "lowmem-exact", "lowmem-approx4", "lowmem-approx2u")
PREACT_ONLY = ("torch-ckpt", "floor")
LR, MOMENTUM, WD = 0.01, 0.9, 5e-4


# ---- the worker: one configuration in a fresh process --------------------------------------

def torchvision_module(name, classes):
    """torchvision's module `name` (tests/torchvision_layout.py), MobileNetV2 without dropout."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import torchvision_layout as tv
    return {"resnet18": lambda: tv.resnet(18, classes), "resnet50": lambda: tv.resnet(50, classes),
            "densenet121": lambda: tv.densenet(121, classes),
            "mobilenet_v2": lambda: tv.mobilenet_v2(classes, dropout=0.0)}[name]()


def shape_of(args):
    return tuple(int(v) for v in args.shape.split(","))


def torch_step_fn(args, torch):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import torch_reference as ref
    from torch.nn import functional as F
    torch.manual_seed(0)
    if args.model:
        model = torchvision_module(args.model, args.classes)
    else:
        model = ref.preact_resnet_cifar(args.depth, num_classes=args.classes, block=args.block)
    opt = torch.optim.SGD(ref.sgd_param_groups(model, WD), lr=LR, momentum=MOMENTUM)
    g = torch.Generator().manual_seed(0)
    x = torch.randn((args.batch,) + shape_of(args), generator=g)
    y = torch.randint(0, args.classes, (args.batch,), generator=g)
    extra = {"params": sum(p.numel() for p in model.parameters())}
    if CONFIGS[args.worker]["ckpt"]:
        from torch.utils.checkpoint import checkpoint_sequential
        head = torch.nn.Sequential(model.bn_final, torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                   torch.nn.Flatten(), model.fc)
        blocks = [b for s in range(model.num_stages) for b in getattr(model, f"layer{s + 1}")]
        seq = torch.nn.Sequential(model.conv1, *blocks, head)
        segments = max(1, round(math.sqrt(len(blocks))))
        extra.update(segments=segments, blocks=len(blocks))
        forward = lambda: checkpoint_sequential(seq, segments, x, use_reentrant=False)  # noqa: E731
    else:
        forward = lambda: model(x)                                                       # noqa: E731
    model.train()

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward(), y)
        loss.backward()
        opt.step()
        return float(loss.detach())
    return step, extra


def lowmem_engine(args, mode, bits, rounding="nearest"):
    """(network, engine) of the worker's model: the ONNX file, else the pre-activation ResNet."""
    import lowmem
    shape = shape_of(args)
    if args.onnx:
        net = lowmem.nn.from_onnx(args.onnx, input_shape=shape)
    else:
        net = lowmem.models.preact_resnet_cifar(args.depth, num_classes=args.classes, block=args.block)
    return net, lowmem.Engine(net, args.batch, shape, mode, bits, "float32", rounding=rounding)


def lowmem_step_fn(args, cfg):
    import numpy
    import lowmem
    net, eng = lowmem_engine(args, cfg["mode"], cfg["bits"], cfg.get("rounding", "nearest"))
    opt = lowmem.SGD(net.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    rng = numpy.random.default_rng(0)
    x = rng.standard_normal((args.batch,) + shape_of(args)).astype(numpy.float32)
    y = rng.integers(0, net.num_classes, args.batch)
    extra = {"params": net.num_params(), "planned_bytes": eng.plan.total_bytes,
             "planned_by_kind": eng.plan.bytes_by_kind(), "use_fast": eng.use_fast}
    return (lambda: float(eng.train_step(x, y, opt))), extra


def export_worker(args):
    """Write the ONNX export of torchvision's module (seed 0, as torch_step_fn builds it) to args.onnx."""
    import torch
    torch.manual_seed(0)
    model = torchvision_module(args.model, args.classes).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, torch.randn((2,) + shape_of(args)), args.onnx,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, dynamo=False)
    harness.result_line({"exported": args.onnx, "params": sum(p.numel() for p in model.parameters())})
    return 0


def floor_worker(args):
    """The 'floor' configuration: gemm_floor.measure on the approx-4 engine lowmem_step_fn builds."""
    import gemm_floor
    from lowmem.system import threads
    threads.configure(args.threads)
    _net, eng = lowmem_engine(args, "approx", 4)
    res = dict(config="floor", depth=args.depth, block=args.block, batch=args.batch, threads=args.threads,
               lowmem_threads=threads.threads(), source_sha=harness.source_hash(), blas=harness.blas_info(),
               peak_above_base=None, base_rss=None, **gemm_floor.measure(eng, args.warmup, args.steps))
    harness.result_line(res)
    return 0


def kinds_worker(args, cfg):
    """One warm-up step, then args.kernel_steps steps under cProfile on args.kernel_threads lowmem
    threads: own time by op kind (op_profile.by_kind) and each kind's largest functions."""
    import op_profile
    from lowmem.system import threads
    threads.configure(args.kernel_threads)
    step, _extra = lowmem_step_fn(args, cfg)
    return kinds_result(args, step, op_profile, lowmem_threads=threads.threads())


def torch_kinds_worker(args):
    """kinds_worker for PyTorch: torch.profiler on args.kernel_threads threads (torch's and BLAS's),
    self CPU time by op kind in op_profile's coarse kinds (benchmarks/torch_profile.py)."""
    import torch
    import torch_profile
    torch.set_num_threads(args.kernel_threads)
    try:
        import threadpoolctl
        threadpoolctl.threadpool_limits(args.kernel_threads, user_api="blas")
    except ImportError:
        pass
    step, _extra = torch_step_fn(args, torch)
    return kinds_result(args, step, torch_profile, torch_threads=torch.get_num_threads())


def kinds_result(args, step, profiler, **extra):
    """One warm-up step, then args.kernel_steps steps of `step` under `profiler` (op_profile or
    torch_profile: profile, by_kind, total_seconds); prints the kinds and each kind's largest
    functions (or ops) as the worker's RESULT line."""
    step()
    t = time.perf_counter()
    record = profiler.profile(step, args.kernel_steps)
    wall = time.perf_counter() - t
    kinds, functions = profiler.by_kind(record)
    top = {k: dict(sorted(f.items(), key=lambda kv: -kv[1])[:8]) for k, f in functions.items()}
    harness.result_line(dict(config=args.worker, kinds=kinds, functions=top, steps=args.kernel_steps,
                             profiled_wall_s=wall, own_total_s=profiler.total_seconds(record),
                             source_sha=harness.source_hash(), **extra))
    return 0


def gemm_counter(numpy):
    """Wrap numpy.matmul (what ops/conv.py and ops/winograd.py call, through the module
    attribute) with a counter of seconds spent inside it, summed over threads; returns
    (seconds list, restore)."""
    real = numpy.matmul
    spent = []

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            spent.append(time.perf_counter() - t)
    numpy.matmul = timed
    return spent, lambda: setattr(numpy, "matmul", real)


def worker(args):
    sys.path.insert(0, ROOT)
    if args.worker == "export":
        return export_worker(args)
    if args.worker == "floor":
        return floor_worker(args)
    cfg = CONFIGS[args.worker]
    if args.kind_profile:
        return torch_kinds_worker(args) if cfg["impl"] == "torch" else kinds_worker(args, cfg)
    import numpy  # noqa: F401
    limits = None
    if cfg["impl"] == "torch":
        import torch
        torch.set_num_threads(args.threads)
        try:
            import threadpoolctl
            limits = threadpoolctl.threadpool_limits(args.threads, user_api="blas")
        except ImportError:
            pass
    else:
        import lowmem  # noqa: F401   (imports numba when installed)
        from lowmem.system import threads
        from lowmem.units import window_cpu as fast
        threads.configure(args.threads)     # lowmem's own policy: BLAS at 1 thread, its pool for the rest
    base = harness.proc_status()
    hwm_reset = harness.reset_peak()                 # VmHWM := VmRSS from here on
    t0 = time.perf_counter()
    step, extra = torch_step_fn(args, torch) if cfg["impl"] == "torch" else lowmem_step_fn(args, cfg)
    build_s = time.perf_counter() - t0
    if args.serve:
        return serve(step, args.warmup)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        t = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t)
    end = harness.proc_status()
    gemm = {}
    if args.gemm_share and cfg["impl"] == "lowmem":
        import numpy
        spent, restore = gemm_counter(numpy)
        t = time.perf_counter()
        step()
        counted_s = time.perf_counter() - t
        restore()
        gemm = dict(gemm_counted_step_s=counted_s, gemm_core_s=sum(spent), gemm_calls=len(spent),
                    gemm_share=sum(spent) / (counted_s * threads.threads()))
    res = dict(source_sha=harness.source_hash(), **gemm, config=args.worker, model=args.model or "preact",
               depth=args.depth, block=args.block, batch=args.batch, shape=list(shape_of(args)), build_s=build_s,
               warmup_s=times[:args.warmup], step_s=times[args.warmup:], losses=losses,
               base_rss=base["VmRSS"], base_hwm=base["VmHWM"], hwm_reset=hwm_reset,
               peak_hwm=end["VmHWM"], end_rss=end["VmRSS"],
               peak_above_base=end["VmHWM"] - base["VmRSS"], threads=args.threads, blas=harness.blas_info(), **extra)
    if cfg["impl"] == "torch":
        res.update(torch_threads=torch.get_num_threads(), torch_version=torch.__version__)
    else:
        res.update(lowmem_threads=threads.threads(), use_fast_kernels=fast.AVAILABLE,
                   numba_cache_dir=os.environ.get("NUMBA_CACHE_DIR"))
    if args.profile:
        import cProfile
        import io
        import pstats
        pr = cProfile.Profile()
        t = time.perf_counter()
        pr.runcall(step)
        res["profiled_step_s"] = time.perf_counter() - t
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.profile)
        res["profile"] = s.getvalue()
    if limits is not None:
        limits.restore_original_limits()
    harness.result_line(res)
    return 0


def serve(step, warmup):
    """A persistent worker (--alternate): warm up, say READY, then per line "STEP n" on stdin run n
    steps and print their seconds ("TIMES [...]"), until "END" or the end of stdin."""
    for _ in range(warmup):
        step()
    print("READY", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "END":
            break
        times = []
        for _ in range(int(words[1])):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        print("TIMES " + json.dumps(times), flush=True)
    return 0


# ---- the parent ----------------------------------------------------------------------------

def worker_command(args, config, batch, steps, warmup, profile=0, threads=None, kind_profile=False):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", config, "--depth", str(args.depth),
           "--batch", str(batch), "--steps", str(steps), "--warmup", str(warmup),
           "--threads", str(threads or args.threads), "--classes", str(args.classes), "--block", args.block,
           "--shape", args.shape, "--profile", str(profile), "--kernel-threads", str(args.kernel_threads),
           "--kernel-steps", str(args.kernel_steps)]
    if args.model:
        cmd += ["--model", args.model]
    if args.onnx:
        cmd += ["--onnx", args.onnx]
    return cmd + (["--gemm-share"] if args.gemm_share else []) + (["--kind-profile"] if kind_profile else [])


def run_worker(args, config, batch, steps, warmup, log, profile=0, timed=True, threads=None, env_extra=None,
               empty_cache=False, kind_profile=False):
    """One configuration in a fresh process (harness.run_supervised); its step statistics added.
    threads: instead of --threads; env_extra: variables set in the worker (e.g. NUMBA_CACHE_DIR);
    empty_cache: empty that NUMBA_CACHE_DIR first; kind_profile: the --kernels worker."""
    env = dict(os.environ, **(env_extra or {}))
    if empty_cache:
        shutil.rmtree(env["NUMBA_CACHE_DIR"], ignore_errors=True)
    if args.unset_openblas_env:
        for k in harness.OPENBLAS_ENV:
            env.pop(k, None)
    cmd = worker_command(args, config, batch, steps, warmup, profile, threads, kind_profile)
    res = harness.run_supervised(cmd, harness.Supervision.from_args(args), log, timed=timed, env=env, label=config,
                                 done=(lambda r: "kinds" in r) if kind_profile else None)
    res.setdefault("config", config)
    res.setdefault("batch", batch)
    res.setdefault("threads", threads or args.threads)
    res["unset_openblas_env"] = args.unset_openblas_env
    if res["status"] == "ok" and not kind_profile:
        st = res["step_s"]
        res.update(step_median=statistics.median(st), step_min=min(st), step_max=max(st),
                   images_per_s=batch / statistics.median(st))
    return res


def merge_rounds(rounds):
    """One row from a configuration's rounds: its step is the median of the rounds' medians,
    min / max over every timed step, peak memory the largest, load and others the worst seen."""
    ok = [r for r in rounds if r["status"] == "ok"]
    if len(ok) < len(rounds) or len(rounds) == 1:
        row = dict(next((r for r in rounds if r["status"] != "ok"), rounds[0]))
    else:
        row = dict(ok[0])
        steps = [t for r in ok for t in r["step_s"]]
        peaks = [r["peak_above_base"] for r in ok if r.get("peak_above_base") is not None]
        row.update(step_median=harness.median_of_medians(ok), step_min=min(steps), step_max=max(steps),
                   peak_above_base=max(peaks) if peaks else None,
                   load_before=max((r["load_before"] for r in ok), key=lambda v: v[0]),
                   other_cpus_during=max(r["other_cpus_during"] for r in ok))
        row["images_per_s"] = row["batch"] / row["step_median"]
    row["round_medians"] = [r.get("step_median") for r in rounds]
    if len(rounds) > 1:
        row["rounds"] = [{k: v for k, v in r.items() if k != "profile"} for r in rounds]
    return row


def table(runs):
    head = (f"{'config':<16} {'batch':>5} {'rounds':>6} {'median s':>9} {'min s':>7} {'max s':>7} {'img/s':>7} "
            f"{'peak RSS MiB':>13} {'planned MiB':>12} {'load 1m':>8} {'others':>6}")
    lines = [head, "-" * len(head)]
    for r in runs:
        load = r.get("load_before", [float("nan")])[0]
        others = r.get("other_cpus_during", float("nan"))
        n = len(r.get("round_medians", [None]))
        if r["status"] != "ok":
            lines.append(f"{r['config']:<16} {r['batch']:>5} {n:>6} {r['status']}  "
                         f"(watched max RSS {fmt_mib(r.get('watched_max_rss'))} MiB)")
            continue
        lines.append(f"{r['config']:<16} {r['batch']:>5} {n:>6} {r['step_median']:>9.2f} {r['step_min']:>7.2f} "
                     f"{r['step_max']:>7.2f} {r['images_per_s']:>7.1f} {fmt_mib(r['peak_above_base']):>13} "
                     f"{fmt_mib(r.get('planned_bytes')):>12} {load:>8.2f} {others:>6.2f}")
    return "\n".join(lines)


# (label, key, numerator, denominator, target or None)
PREACT_RATIOS = [
    ("step time   lowmem-approx4 / torch-exact", "step_median", "lowmem-approx4", "torch-exact", "<= 0.8"),
    ("step time   lowmem-approx4 / lowmem-exact", "step_median", "lowmem-approx4", "lowmem-exact", "<= 1.05"),
    ("step time   lowmem-approx2u / lowmem-exact", "step_median", "lowmem-approx2u", "lowmem-exact", None),
    ("step time   lowmem-exact / torch-exact", "step_median", "lowmem-exact", "torch-exact", None),
    ("peak RSS    lowmem-approx4 / torch-exact", "peak_above_base", "lowmem-approx4", "torch-exact", "<= 0.125"),
    ("peak RSS    lowmem-approx4 / torch-ckpt", "peak_above_base", "lowmem-approx4", "torch-ckpt", "< 0.25"),
    ("step time   lowmem-approx4 / floor", "step_median", "lowmem-approx4", "floor", "<= 1.6")]


PAUSE_S = 0.5     # between two configurations' turns: a PyTorch step's OpenMP threads spin a while after it


def _reply(proc, prefix, config):
    """The worker's next line starting with `prefix` (its other output skipped); a clear error
    when it ends first."""
    for line in proc.stdout:
        if line.startswith(prefix):
            return line[len(prefix):]
    raise RuntimeError(f"--alternate: the {config} worker ended (exit code {proc.wait()}) before {prefix.strip()}")


def alternate_section(args, configs, rounds, log):
    """Every config's worker started and warmed up first, then `rounds` rounds of --steps steps of
    each in turn (harness.rotated order). Returns {config: [round medians]} (seconds)."""
    procs = {}
    per = {c: [] for c in configs}
    try:
        for c in configs:
            log(f"alternated: building {c} (batch {args.batch}) ...")
            cmd = worker_command(args, c, args.batch, 0, args.warmup) + ["--serve"]
            procs[c] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            _reply(procs[c], "READY", c)
        for r in range(rounds):
            for c in harness.rotated(configs, r):
                time.sleep(PAUSE_S)
                procs[c].stdin.write(f"STEP {args.steps}\n")
                procs[c].stdin.flush()
                per[c].append(statistics.median(json.loads(_reply(procs[c], "TIMES ", c))))
            log(f"alternated: round {r + 1}/{rounds}: " + ", ".join(f"{c} {per[c][-1]:.3f} s" for c in configs))
    finally:
        for proc in procs.values():
            try:
                proc.stdin.write("END\n")
                proc.stdin.close()
            except OSError:
                pass
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return per


def alternate_ratios(per, spec):
    """Per step-time ratio of `spec` (imported_ratios' rows) whose configs ran: the median over
    rounds of the round's ratio, its range, and the target's verdict on the median."""
    out = {}
    for label, key, a, b, target in spec:
        if key != "step_median" or not (per.get(a) and per.get(b)):
            continue
        rs = sorted(x / y for x, y in zip(per[a], per[b]))
        r = statistics.median(rs)
        out[label] = dict(ratio=r, low=rs[0], high=rs[-1], target=target, met=met(r, target))
    return out


def alternate_report(per, ratios_, rounds, args):
    lines = [f"alternated in persistent processes: {rounds} rounds of {args.steps} steps each, after "
             f"{args.warmup} warm-up; a config's step = the median over rounds of its round medians",
             f"{'config':16s} {'median s':>9s} {'min s':>8s} {'max s':>8s}"]
    for c, ts in per.items():
        lines.append(f"{c:16s} {statistics.median(ts):9.3f} {min(ts):8.3f} {max(ts):8.3f}")
    for label, r in ratios_.items():
        lines.append(f"{label}: {r['ratio']:.3f} (rounds {r['low']:.3f}-{r['high']:.3f}){verdict(r)}")
    return "\n".join(lines)


def imported_ratios(model):
    """The ratios of an imported network; targets (docs/performance.md) for torchvision's four."""
    named = model in TORCHVISION
    return [("step time   lowmem-approx4 / torch-exact", "step_median", "lowmem-approx4", "torch-exact",
             ("<= 1.0" if model == "mobilenet_v2" else "<= 0.8") if named else None),
            ("step time   lowmem-approx4 / lowmem-exact", "step_median", "lowmem-approx4", "lowmem-exact",
             "<= 1.0" if named else None),
            ("step time   lowmem-approx2u / lowmem-exact", "step_median", "lowmem-approx2u", "lowmem-exact",
             "<= 1.05" if named else None),
            ("step time   lowmem-approx2d / lowmem-exact", "step_median", "lowmem-approx2d", "lowmem-exact", None),
            ("step time   lowmem-exact / torch-exact", "step_median", "lowmem-exact", "torch-exact",
             "<= 1.0" if named else None),
            ("peak RSS    lowmem-approx4 / torch-exact", "peak_above_base", "lowmem-approx4", "torch-exact", None)]


def met(r, target):
    """Whether ratio r meets a target such as "<= 0.8" or "< 1" (None: no target)."""
    if not target:
        return None
    bound = float(target.split()[-1])
    return r <= bound if target.startswith("<=") else r < bound


def verdict(r):
    """The printed verdict of a ratio entry (ratios' or alternate_ratios'): "" without a target."""
    return f"  (target {r['target']}: {'met' if r['met'] else 'MISSED'})" if r["target"] else ""


def ratios(runs, spec):
    by = {r["config"]: r for r in runs if r["status"] == "ok"}
    out = {}
    for label, key, a, b, target in spec:
        if a in by and b in by and by[a].get(key) is not None and by[b].get(key):
            r = by[a][key] / by[b][key]
            out[label] = dict(ratio=r, target=target, met=met(r, target))
    return out


def header(info, args):
    net = (f"torchvision {args.model} (PyTorch: tests/torchvision_layout.py; lowmem: its ONNX export)"
           if args.model in TORCHVISION else f"{args.model} (lowmem only)" if args.model else
           f"pre-act ResNet-{args.depth} ({args.block} blocks)")
    return "\n".join([
        f"machine: {harness.machine_line(info)}",
        harness.libraries_line(info) + ("  (workers: OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE removed)"
                                        if args.unset_openblas_env else ""),
        f"{net}, {args.classes} classes, {args.shape.replace(',', 'x')} input, batch {args.batch}, float32; "
        f"threads {args.threads}; SGD momentum {MOMENTUM}, wd {WD}"])


def torch_max_batch(args, budget, log):
    """Largest batch whose measured torch-exact peak RSS (2 steps) is <= budget: bisection in fresh
    processes, starting from a linear fit through two small batches; capped at --maxbatch-time s."""
    t0, probes = time.time(), []

    def fits(n):
        r = run_worker(args, "torch-exact", n, 1, 1, log, timed=False)
        ok = r["status"] == "ok" and r["peak_above_base"] <= budget
        probes.append(dict(batch=n, peak_above_base=r.get("peak_above_base"), fits=ok, status=r["status"],
                           load_before=r.get("load_before"), step_s=r.get("step_median")))
        log(f"  torch-exact batch {n}: {fmt_mib(r.get('peak_above_base'))} MiB -> {'fits' if ok else 'over'}")
        return ok

    a, b = 8, 16
    if not fits(a):
        return dict(batch=None, probes=probes, note=f"batch {a} does not fit")
    fits(b)
    pa, pb = probes[0]["peak_above_base"], probes[1]["peak_above_base"]
    guess = max(b, int(a + (budget - pa) * (b - a) / max(1, pb - pa)))
    lo, hi = (b, None) if probes[1]["fits"] else (a, b)
    if hi is None:
        lo, hi = (guess, None) if fits(guess) else (b, guess)
        step = max(1, guess // 16)
        while hi is None and time.time() - t0 < args.maxbatch_time:
            if fits(lo + step):
                lo, step = lo + step, step * 2
            else:
                hi = lo + step
    while hi is not None and hi - lo > 1 and time.time() - t0 < args.maxbatch_time:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    exact = hi is not None and hi - lo == 1
    return dict(batch=lo, exact=exact, upper=hi, probes=probes, search_s=round(time.time() - t0))


def maxbatch_section(args, budget, log):
    from lowmem.tools.maxbatch import max_batch, planned_engine
    from lowmem.models import preact_resnet_cifar
    factory = lambda: preact_resnet_cifar(args.depth, num_classes=args.classes, block=args.block)  # noqa: E731
    shape = tuple(int(v) for v in args.shape.split(","))
    rows = []
    for name in ("lowmem-exact", "lowmem-approx8", "lowmem-approx4", "lowmem-approx2"):
        cfg = CONFIGS[name]
        n = max_batch(factory, shape, budget, cfg["mode"], cfg["bits"])
        planned = planned_engine(factory, n, shape, cfg["mode"], cfg["bits"]).plan.total_bytes
        row = dict(config=name, batch=n, how="plan", planned_bytes=planned)
        if args.maxbatch_measure:
            r = run_worker(args, name, n, 1, 0, log, timed=False)   # one step: the first is the largest
            row.update(measured_peak_above_base=r.get("peak_above_base"), measured_status=r["status"],
                       load_before=r.get("load_before"))
        rows.append(row)
        log(f"  {name}: batch {n} (plan {fmt_mib(planned)} MiB)")
    t = torch_max_batch(args, budget, log)
    rows.append(dict(config="torch-exact", how="measured (2 steps, peak RSS above baseline)", **t))
    return rows


def maxbatch_table(rows, budget):
    ref = next((r["batch"] for r in rows if r["config"] == "torch-exact"), None)
    lines = [f"max batch at a budget of {budget / MiB:,.0f} MiB (pre-act ResNet, float32)",
             f"{'config':<16} {'max batch':>9} {'x torch':>8} {'how':<46} {'measured RSS MiB':>16}"]
    for r in rows:
        x = f"{r['batch'] / ref:.2f}" if ref and r["batch"] else "-"
        meas = fmt_mib(r.get("measured_peak_above_base"))
        how = r["how"] if r["config"] != "torch-exact" or r.get("exact", True) else \
            f"measured, search capped: {r['batch']} <= max < {r.get('upper')}"
        lines.append(f"{r['config']:<16} {str(r['batch']):>9} {x:>8} {how:<46} {meas:>16}")
    return "\n".join(lines)


def scaling_section(args, runs, log):
    """The --scaling configs on 1 thread, beside their --threads runs (rerun when not in `runs`)."""
    by = {r["config"]: r for r in runs if r["status"] == "ok"}
    rows = []
    for c in args.scaling.split(","):
        many = by.get(c) or run_worker(args, c, args.batch, args.steps, args.warmup, log)
        log(f"running {c} on 1 thread ...")
        one = run_worker(args, c, args.batch, args.steps, args.warmup, log, threads=1)
        rows.append(dict(config=c, one=one, many=many))
    return rows


def scaling_table(rows, n):
    lines = [f"{'config':<16} {'1 thread s':>10} {f'{n} threads s':>11} {f'{n}/1':>6}  target <= 0.6   "
             f"(load 1m / others, 1 thread; {n} threads)"]
    for r in rows:
        one, many = r["one"], r["many"]
        if one["status"] != "ok" or many["status"] != "ok":
            lines.append(f"{r['config']:<16} {one['status']} / {many['status']}")
            continue
        q = many["step_median"] / one["step_median"]
        lines.append(f"{r['config']:<16} {one['step_median']:>10.2f} {many['step_median']:>11.2f} {q:>6.2f}  "
                     f"{'met' if q <= 0.6 else 'MISSED':<14} ({one['load_before'][0]:.2f} / "
                     f"{one['other_cpus_during']:.2f}; {many['load_before'][0]:.2f} / {many['other_cpus_during']:.2f})")
    return "\n".join(lines)


def jit_section(args, log):
    """Each --jit config twice in fresh processes sharing one new numba cache: cold (empty: every
    kernel compiles) then warm (loaded from disk). First-step overhead = first step - median step."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="lowmem-numba-") as cache:
        for c in args.jit.split(","):
            for state in ("cold", "warm"):
                log(f"running {c} with a {state} numba cache ...")
                r = run_worker(args, c, args.batch, max(1, args.steps), 1, log, env_extra={"NUMBA_CACHE_DIR": cache},
                               empty_cache=state == "cold")
                rows.append(dict(config=c, cache=state, run=r))
    return rows


def jit_table(rows):
    lines = [f"{'config':<16} {'numba cache':<11} {'build s':>8} {'first step s':>12} {'median s':>9} "
             f"{'overhead s':>10}"]
    for row in rows:
        r = row["run"]
        if r["status"] != "ok":
            lines.append(f"{row['config']:<16} {row['cache']:<11} {r['status']}")
            continue
        first = r["warmup_s"][0]
        lines.append(f"{row['config']:<16} {row['cache']:<11} {r['build_s']:>8.2f} {first:>12.2f} "
                     f"{r['step_median']:>9.2f} {first - r['step_median']:>10.2f}")
    return "\n".join(lines)


def kinds_section(args, configs, log):
    """{config: the kinds worker's result} for each lowmem and PyTorch configuration (--kernels)."""
    out = {}
    for c in configs:
        if CONFIGS[c]["impl"] not in ("lowmem", "torch") or CONFIGS[c].get("ckpt"):
            continue
        log(f"profiling {c} by op kind ({args.kernel_threads} thread(s), {args.kernel_steps} steps) ...")
        out[c] = run_worker(args, c, args.batch, 0, 0, log, kind_profile=True)
    return out


def kinds_report(kinds, args):
    """lowmem's kinds (op_profile's table); with a PyTorch configuration there too, every
    configuration side by side in the coarse kinds both can name."""
    import op_profile
    ok = {c: k for c, k in kinds.items() if k["status"] == "ok"}
    mine = {c: k for c, k in ok.items() if CONFIGS[c]["impl"] == "lowmem"}
    lines = [f"own time per step by op kind (cProfile, {args.kernel_threads} lowmem thread(s), "
             f"{args.kernel_steps} profiled steps after one warm-up; benchmarks/op_profile.py; "
             f"the profiler's overhead is in it: read the shares)"]
    if mine:
        lines.append(op_profile.kind_table({c: k["kinds"] for c, k in mine.items()}, args.kernel_steps,
                                           {c: k["functions"] for c, k in mine.items()}))
    if len(mine) < len(ok):
        side = {c: (op_profile.coarse(k["kinds"]) if c in mine else k["kinds"]) for c, k in ok.items()}
        lines += ["", f"side by side with PyTorch (its self CPU time per op from torch.profiler, on {args.kernel_threads} "
                      f"thread(s); benchmarks/torch_profile.py), lowmem's kinds folded as op_profile.COARSE_OF folds them:",
                  op_profile.kind_table(side, args.kernel_steps, kinds=op_profile.COARSE)]
    lines += [f"{c}: {k['status']}" for c, k in kinds.items() if k["status"] != "ok"]
    return "\n".join(lines)


def resolve_model(args, ap):
    """Fill in the model's defaults (size, classes, input shape, block); return the default configs.
    A file is read here (its input shape and classes); torchvision's modules are exported later."""
    if args.model is None:
        from lowmem.models import preact_resnet_cifar
        args.size = args.size or 32
        args.classes = args.classes or 10
        if args.block == "auto":
            net = preact_resnet_cifar(args.depth, num_classes=args.classes)      # lowmem's block rule
            args.block = "bottleneck" if any(L.name.endswith(".bn3") for L in net.layers) else "basic"
        args.shape = f"3,{args.size},{args.size}"
        return "all"
    for flag in ("maxbatch_budget", "scaling"):
        if getattr(args, flag):
            ap.error(f"--{flag.replace('_', '-')} runs on the pre-activation ResNet only (no --model)")
    if args.model in TORCHVISION:
        args.size = args.size or 224
        args.classes = args.classes or 1000
        args.shape = f"3,{args.size},{args.size}"
        return ",".join(IMPORTED_CONFIGS)
    if not args.model.endswith(".onnx"):
        ap.error(f"--model: expected one of {', '.join(TORCHVISION)} or a path ending in .onnx, got {args.model!r}")
    from lowmem.formats.onnx_import import file_input_shape
    from lowmem import nn
    args.onnx = os.path.abspath(args.model)
    try:
        shape = file_input_shape(args.onnx)
        classes = nn.from_onnx(args.onnx).num_classes
    except ValueError as e:
        ap.error(f"--model: {e}")
    if args.size and (args.size, args.size) != tuple(shape[1:]):
        ap.error(f"--size {args.size}: {args.model} fixes its input at {'x'.join(map(str, shape))}")
    if args.classes and args.classes != classes:
        ap.error(f"--classes {args.classes}: {args.model} has {classes}")
    args.size, args.classes, args.shape = shape[1], classes, ",".join(map(str, shape))
    return ",".join(c for c in IMPORTED_CONFIGS if CONFIGS[c]["impl"] == "lowmem")


def export_model(args, ap, log, folder):
    """The ONNX file of torchvision's module that lowmem's workers train (written by a worker:
    torch is not imported here)."""
    args.onnx = os.path.join(folder, args.model + ".onnx")
    log(f"exporting torchvision's {args.model} to ONNX ({args.shape.replace(',', 'x')}) ...")
    r = harness.run_supervised(worker_command(args, "export", 2, 0, 0), harness.Supervision.from_args(args), log,
                               timed=False, label="export", done=lambda r: "exported" in r)
    if r["status"] != "ok":
        ap.exit(1, f"compare_torch.py: the export failed: {r['status']}\n")


def parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help=f"{' | '.join(TORCHVISION)} | FILE.onnx (default: the pre-activation ResNet of --depth)")
    ap.add_argument("--size", type=int, default=None,
                    help="input height and width (default: 32 for the pre-activation ResNet, 224 for torchvision's)")
    ap.add_argument("--depth", type=int, default=164, help="the pre-activation ResNet's depth (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--classes", type=int, default=None,
                    help="default: 10 for the pre-activation ResNet, 1000 for torchvision's, the file's own")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per worker (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="fresh processes per config, the order rotated each round; the median of the rounds' "
                         "medians (default: 3 with --model, 1 for the pre-activation ResNet)")
    ap.add_argument("--configs", default=None,
                    help=f"comma-separated subset of {', '.join(CONFIGS)}; 'none' for only --maxbatch-budget "
                         f"(default: all for the pre-activation ResNet, {','.join(IMPORTED_CONFIGS)} with --model)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch.set_num_threads, numba and BLAS threads (default: os.cpu_count() = %(default)s)")
    ap.add_argument("--json", metavar="PATH", help="also write everything as JSON")
    ap.add_argument("--update", action="store_true",
                    help="with --json: keep the runs already in PATH (same model, size and batch) of the configs "
                         "not run now, e.g. to redo a disturbed one; the table and ratios cover them all")
    ap.add_argument("--unset-openblas-env", action="store_true",
                    help="remove OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE in the worker processes")
    harness.add_arguments(ap)
    ap.add_argument("--maxbatch-budget", type=harness.parse_bytes, default=None, metavar="BYTES",
                    help="also find the max batch at this budget (lowmem from plans, torch-exact measured)")
    ap.add_argument("--maxbatch-time", type=float, default=1200, help="cap on the torch search, s")
    ap.add_argument("--maxbatch-measure", action="store_true",
                    help="also run each lowmem config at its max batch and report its measured peak RSS")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="cProfile one extra (untimed) step of each config in the first round; print the top N "
                         "by tottime")
    ap.add_argument("--kernels", action="store_true",
                    help="also the own time per step by op kind of each lowmem config (cProfile, a fresh process), "
                         "and of torch-exact (torch.profiler) side by side")
    ap.add_argument("--kernel-threads", type=int, default=1,
                    help="threads of the --kernels workers, lowmem's or PyTorch's (default: 1, where the profilers "
                         "see the whole step)")
    ap.add_argument("--kernel-steps", type=int, default=2, help="profiled steps of a --kernels worker (default: 2)")
    ap.add_argument("--gemm-share", action="store_true",
                    help="lowmem configs: one extra (untimed) step with numpy.matmul wrapped by a timer: the "
                         "share of the step's core-seconds spent inside GEMMs")
    ap.add_argument("--scaling", metavar="CONFIGS", default="",
                    help="comma-separated configs to rerun on 1 thread: the 1-core/N-core row")
    ap.add_argument("--jit", metavar="CONFIGS", default="",
                    help="comma-separated lowmem configs run with an empty numba cache, then again with it "
                         "filled: first-step overhead cold and warm")
    ap.add_argument("--block", choices=("auto", "basic", "bottleneck"), default="auto",
                    help="residual block; auto: lowmem's rule (bottleneck for 9n+2 depths >= 164 or not 6n+2)")
    ap.add_argument("--alternate", type=int, default=0, metavar="N",
                    help="then N rounds with the configs alternated in persistent processes (the step-time "
                         "ratios with the host's drift shared; see above)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)   # a persistent --alternate worker
    ap.add_argument("--worker", choices=list(CONFIGS) + ["export"], help=argparse.SUPPRESS)
    ap.add_argument("--kind-profile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)          # C,H,W, resolved by the parent
    ap.add_argument("--onnx", help=argparse.SUPPRESS)           # the file lowmem's workers read
    return ap


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    sys.path.insert(0, ROOT)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    folder = tempfile.mkdtemp(prefix="compare_torch-")
    try:
        return compare(args, ap, log, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def compare(args, ap, log, folder):
    default_configs = resolve_model(args, ap)
    spec = args.configs or default_configs
    configs = [] if spec == "none" else list(CONFIGS) if spec == "all" else spec.split(",")
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        ap.error(f"unknown config(s) {bad}; expected a subset of {list(CONFIGS)}")
    for flag, names in (("--scaling", args.scaling), ("--jit", args.jit)):
        wrong = [c for c in names.split(",") if c and c not in CONFIGS]
        if wrong:
            ap.error(f"{flag}: unknown config(s) {wrong}")
    if args.model:
        excluded = [c for c in configs if c in PREACT_ONLY or (args.model not in TORCHVISION and
                                                               CONFIGS[c]["impl"] == "torch")]
        if excluded:
            ap.error(f"config(s) {excluded} do not run on --model {args.model} (torch-ckpt and floor: the "
                     f"pre-activation ResNet only; torch-*: a torchvision model, not a file)")
    rounds = (3 if args.model else 1) if args.rounds is None else args.rounds
    if rounds < 1 and not (rounds == 0 and args.alternate > 0):
        ap.error("--rounds must be at least 1 (0 only with --alternate)")
    if args.alternate < 0:
        ap.error("--alternate must be at least 0")
    if args.alternate and len(configs) < 2:
        ap.error("--alternate needs two configs or more to compare")
    if args.model in TORCHVISION:
        export_model(args, ap, log, folder)

    info = harness.machine_info()
    print(header(info, args), flush=True)
    per_config = {c: [] for c in configs}
    for r in range(rounds):
        for c in harness.rotated(configs, r):
            log(f"round {r + 1}/{rounds}: running {c} (batch {args.batch}) ...")
            res = run_worker(args, c, args.batch, args.steps, args.warmup, log, args.profile if r == 0 else 0)
            per_config[c].append(res)
            log(f"  {res['status']}" + (f": median {res['step_median']:.2f} s, peak "
                                        f"{fmt_mib(res['peak_above_base'])} MiB" if res["status"] == "ok" else ""))
    runs = [merge_rounds(per_config[c]) for c in configs] if rounds else []
    model = args.model or "preact"
    if args.update and args.json and os.path.exists(args.json):
        key = (model, args.depth, args.block, args.size, args.batch)
        with open(args.json) as f:
            old = [r for r in json.load(f).get("runs", []) if r["config"] not in configs
                   and (r.get("model", "preact"), r.get("depth"), r.get("block", args.block),
                        r.get("shape", [3, 32, 32])[-1], r.get("batch")) == key]
        runs = sorted(old + runs, key=lambda r: list(CONFIGS).index(r["config"]))
    result = {"machine": info, "args": {k: v for k, v in vars(args).items() if k not in ("worker", "onnx")},
              "rounds": rounds, "runs": runs,
              "ratios": ratios(runs, imported_ratios(args.model) if args.model else PREACT_RATIOS)}
    if runs:
        print(f"\none training step: the median over {rounds} round(s) of each fresh process's median of "
              f"{args.steps} steps after {args.warmup} warm-up (min / max over every timed step); peak RSS = "
              f"VmHWM - baseline VmRSS (the largest over rounds); planned = lowmem's plan total;\n"
              f"load 1m = load average before the run; others = CPUs used on average by other processes "
              f"during the run (0 = a quiet machine; the worst over rounds)")
        print(table(runs))
        for label, r in result["ratios"].items():
            print(f"{label}: {r['ratio']:.3f}{verdict(r)}")
        for r in runs:
            if r["config"] == "floor" and r["status"] == "ok":
                import gemm_floor
                print("\n" + gemm_floor.describe(r))
            if r.get("gemm_share") is not None:
                print(f"{r['config']}: share of the step inside GEMMs (numpy.matmul timed, one extra step of "
                      f"{r['gemm_counted_step_s']:.2f} s, {r['gemm_calls']} calls, {r['lowmem_threads']} thread(s)): "
                      f"{r['gemm_share']:.0%}  (target >= 70%)")
        for c in configs:
            first = per_config[c][0]
            if first.get("profile"):
                print(f"\ncProfile of one {c} step ({first['profiled_step_s']:.2f} s under the profiler):")
                print(first["profile"])
    if args.alternate:
        per = alternate_section(args, configs, args.alternate, log)
        alt = alternate_ratios(per, imported_ratios(args.model) if args.model else PREACT_RATIOS)
        result["alternated"] = {"rounds": args.alternate, "steps": args.steps, "round_medians_s": per,
                                "ratios": alt}
        print()
        print(alternate_report(per, alt, args.alternate, args), flush=True)
    if args.kernels:
        result["kinds"] = kinds_section(args, configs, log)
        print()
        print(kinds_report(result["kinds"], args))
    if args.scaling:
        result["scaling"] = scaling_section(args, runs, log)
        print()
        print(scaling_table(result["scaling"], args.threads))
    if args.jit:
        result["jit"] = jit_section(args, log)
        print()
        print(jit_table(result["jit"]))
    if args.maxbatch_budget:
        log(f"max batch at {args.maxbatch_budget / MiB:,.0f} MiB ...")
        rows = maxbatch_section(args, args.maxbatch_budget, log)
        result["maxbatch"] = {"budget_bytes": args.maxbatch_budget, "rows": rows}
        print()
        print(maxbatch_table(rows, args.maxbatch_budget))
    if args.json:
        from lowmem.system.atomic import atomic_write
        atomic_write(args.json, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
