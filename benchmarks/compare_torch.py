"""lowmem against PyTorch on the CPU: step time and peak resident memory, each configuration
in its own fresh process.

    python benchmarks/compare_torch.py                          # ResNet-164, batch 128, all configs
    python benchmarks/compare_torch.py --depth 1001 --configs lowmem-approx4,torch-exact \\
        --steps 1 --warmup 0 --mem-limit 21GiB
    python benchmarks/compare_torch.py --maxbatch-budget 2GiB --configs none
    python benchmarks/compare_torch.py --configs lowmem-approx4 --profile 10   # + cProfile of one step
    python benchmarks/compare_torch.py --configs torch-exact,lowmem-exact,lowmem-approx4 \
        --scaling lowmem-exact,lowmem-approx4 --jit lowmem-approx4 --kernels
        # + the 1-thread row, first-step JIT overhead (empty vs filled numba cache), per-kernel table

Configurations (the same pre-activation ResNet: tests/torch_reference.py for PyTorch):
  torch-exact      PyTorch autograd, nn modules
  torch-ckpt       PyTorch with torch.utils.checkpoint.checkpoint_sequential over the blocks,
                   round(sqrt(#blocks)) segments (use_reentrant=False)
  lowmem-exact     lowmem, x-hat saved in float32
  lowmem-approx8/4/2   the method, 8/4/2-bit codes
  lowmem-naive4    the paper's baseline, 4-bit
  floor            the machine's floor for the approx-4 step: exactly the step's conv GEMMs (every
                   conv's forward, weight-gradient and input-gradient product on the path lowmem
                   takes at its shape: Winograd's 16 batched GEMMs per chunk of tiles for stride-1
                   3x3 convs, plain GEMMs for 1x1 convs, im2col GEMMs for the stem and strided
                   convs; chunked and split over lowmem's threads as the step does, BLAS at one
                   thread: step_gemms) plus one read and one write of the bytes a step must touch
                   (floor_worker) at the copy bandwidth measured in the same process; also the
                   GEMM rate against the machine's peak (peak_flops), its FLOPs counted both as
                   the GEMMs do them and as the direct convolution would

A step is forward + backward + SGD (momentum 0.9, weight decay 5e-4 on conv/linear weights,
lr 0.01) on random data. Each worker (`--worker CONFIG`, this script) imports its libraries,
reads its baseline VmRSS from /proc/self/status, resets the high-water mark (writing 5 to
/proc/self/clear_refs, where the kernel allows it), builds the model and data, runs
--warmup + --steps steps and reports VmHWM - baseline: everything the model, the data, the
step and any JIT (numba loading its cached kernels) added to the process. The parent
watches every worker's RSS and the machine's MemAvailable and kills a worker that passes
--mem-limit or leaves less than 1 GiB free (a PyTorch ResNet-1001 step needs ~20 GB).

The machine may be shared: before each worker the parent waits (up to --max-wait s) until
the CPUs are quiet (busy < --max-busy over 2 s, from /proc/stat); it records the load
average before and the CPUs other processes used during every run, and reruns a run that
others disturbed (more than --max-others CPUs; up to --retries times). On 2 cores one busy
neighbour slows multi-threaded PyTorch and OpenBLAS/numba many times over. Thread-count environment variables and
OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are reported, never changed silently
(--unset-openblas-env removes the latter two in the workers).

Threads: PyTorch workers use torch.set_num_threads(--threads) and BLAS at --threads; lowmem
workers call lowmem.system.threads.configure(--threads) (lowmem's own policy: BLAS at one thread,
its pool of threads for kernels and conv ranges; docs/performance.md).
"""
import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

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
    "lowmem-naive4": dict(impl="lowmem", mode="naive", bits=4),
    "floor": dict(impl="floor", mode="approx", bits=4),
}
OPENBLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS",
              "NUMBA_THREADING_LAYER", "OMP_WAIT_POLICY")
MiB = 1 << 20
LR, MOMENTUM, WD = 0.01, 0.9, 5e-4


# ---- /proc -------------------------------------------------------------------------------

def proc_status(pid="self"):
    """{'VmRSS': bytes, 'VmHWM': bytes} of a process."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(line.split()[1]) * 1024
    return out


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def cpu_times():
    """(all jiffies, busy jiffies) summed over the machine's CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    return sum(v), sum(v) - v[3] - v[4]


def proc_cpu(pid):
    """utime + stime jiffies of a process and its waited-for children."""
    with open(f"/proc/{pid}/stat") as f:
        v = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in v[11:15])


def cpu_busy(seconds=2.0):
    """Fraction of all CPUs busy over `seconds` (the caller sleeps meanwhile)."""
    t0, b0 = cpu_times()
    time.sleep(seconds)
    t1, b1 = cpu_times()
    return (b1 - b0) / max(1, t1 - t0)


def parse_bytes(text):
    from lowmem.tools.maxbatch import parse_bytes as parse
    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ---- the worker: one configuration in a fresh process --------------------------------------

def torch_step_fn(args, torch):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import torch_reference as ref
    from torch.nn import functional as F
    model = ref.preact_resnet_cifar(args.depth, num_classes=args.classes, block=args.block)
    opt = torch.optim.SGD(ref.sgd_param_groups(model, WD), lr=LR, momentum=MOMENTUM)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, 32, 32, generator=g)
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
        return float(loss)
    return step, extra


def lowmem_step_fn(args, cfg):
    import numpy
    import lowmem
    net = lowmem.models.preact_resnet_cifar(args.depth, num_classes=args.classes, block=args.block)
    eng = lowmem.Engine(net, args.batch, (3, 32, 32), cfg["mode"], cfg["bits"], "float32",
                        rounding=cfg.get("rounding", "nearest"))
    opt = lowmem.SGD(net.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    rng = numpy.random.default_rng(0)
    x = rng.standard_normal((args.batch, 3, 32, 32)).astype(numpy.float32)
    y = rng.integers(0, args.classes, args.batch)
    extra = {"params": net.num_params(), "planned_bytes": eng.plan.total_bytes,
             "planned_by_kind": eng.plan.bytes_by_kind(), "use_fast": eng.use_fast}
    return (lambda: float(eng.train_step(x, y, opt))), extra


def blas_info():
    """The BLAS libraries loaded in this process (threadpoolctl if installed, else numpy's build)."""
    try:
        import threadpoolctl
        return [{k: d.get(k) for k in ("internal_api", "version", "architecture", "num_threads", "filepath")}
                for d in threadpoolctl.threadpool_info()]
    except ImportError:
        import numpy
        cfg = numpy.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
        return [{"internal_api": cfg.get("name"), "version": cfg.get("version"),
                 "architecture": "(threadpoolctl not installed)", "num_threads": None,
                 "filepath": cfg.get("openblas configuration")}]


def peak_flops(cores):
    """(float32 FLOP/s, how): cores x SIMD lanes x 2 (an FMA is two flops) x FMA units x clock.
    Lanes from lscpu's flags (AVX-512: 16, AVX2: 8); clock: lscpu's CPU max MHz, else
    /proc/cpuinfo's cpu MHz; FMA units per core: 2 (stated, not measured: Intel server cores
    with AVX-512 and AMD Zen 2-4 have two FMA pipes)."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    flags = set((re.search(r"^Flags:\s*(.+)$", out, re.M) or [None, ""])[1].split())
    lanes, isa = (16, "AVX-512") if "avx512f" in flags else (8, "AVX2 FMA") if "fma" in flags else (4, "SSE")
    m = re.search(r"^CPU max MHz:\s*([\d.]+)", out, re.M)
    src = "lscpu CPU max MHz"
    if not m:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^cpu MHz\s*:\s*([\d.]+)", f.read(), re.M)
        src = "/proc/cpuinfo cpu MHz"
    ghz = float(m.group(1)) / 1000 if m else float("nan")
    fma = 2
    return (cores * lanes * 2 * fma * ghz * 1e9,
            f"{cores} cores x {lanes} float32 lanes ({isa}) x 2 flops per FMA x {fma} FMA units (stated) "
            f"x {ghz:.2f} GHz ({src})")


def _column_ranges(M, grain):
    """The column ranges threads.parallel_for(body, M, grain) cuts (what ops/chunks.py's
    over_columns runs a 1x1 conv's GEMM over)."""
    from lowmem.system import threads
    parts = min(threads.threads(), M // max(1, grain))
    if parts <= 1:
        return [(0, M)]
    cut = threads.bounds(M, parts)
    return list(zip(cut[:-1], cut[1:]))


def _batch_ranges(N, ws, per):
    """[(n0, n1, workspace part)]: the batch ranges ops/chunks.py's over_batch cuts (one per
    lowmem thread, each with its own slice of the workspace)."""
    from lowmem.system import threads
    from lowmem.ops import chunks
    parts = max(1, min(threads.threads(), N, ws.size // per, N * per // chunks.COLS_GRAIN))
    cut, size = threads.bounds(N, parts), ws.size // parts
    return [(cut[t], cut[t + 1], ws[t * size:(t + 1) * size]) for t in range(parts)]


def _winograd_correlate(x, U, ws):
    """The GEMMs of winograd._correlate: per range and chunk, M (16, Co, T) = U @ V (16, Ci, T)."""
    from lowmem.ops import winograd
    Co, Ci = U.shape[1:]
    N, H, W = x.shape[1:]
    th, tw = winograd.tiles(H, W)
    per = winograd.per_sample(Ci, Co, H, W)
    ranges = []
    for a, b, wsp in _batch_ranges(N, ws, per):
        nc, gemms = winograd._chunk(wsp, per, b - a), []
        for n0 in range(a, b, nc):
            T = (min(b, n0 + nc) - n0) * th * tw
            gemms.append((U, wsp[:16 * Ci * T].reshape(16, Ci, T),
                          wsp[16 * Ci * T:16 * (Ci + Co) * T].reshape(16, Co, T)))
        ranges.append(gemms)
    return ranges


def _winograd_weight(x, dw, ws):
    """The GEMMs of winograd.conv3x3_backward_weight: per range and chunk,
    dU (16, Co, Ci) (+)= Mg (16, Co, T) @ V (16, Ci, T)^T, into the range's acc or term."""
    from lowmem.ops import winograd
    Co, Ci = dw.shape[:2]
    N, H, W = x.shape[1:]
    th, tw = winograd.tiles(H, W)
    per, u = winograd.per_sample(Ci, Co, H, W), 16 * Co * Ci
    ranges = []
    for a, b, wsp in _batch_ranges(N, ws, per + 2 * u):
        acc, term = wsp[:u].reshape(16, Co, Ci), wsp[u:2 * u].reshape(16, Co, Ci)
        tiles_ws = wsp[2 * u:]
        nc, gemms = winograd._chunk(tiles_ws, per, b - a), []
        for n0 in range(a, b, nc):
            T = (min(b, n0 + nc) - n0) * th * tw
            V = tiles_ws[:16 * Ci * T].reshape(16, Ci, T)
            Mg = tiles_ws[16 * Ci * T:16 * (Ci + Co) * T].reshape(16, Co, T)
            gemms.append((Mg, V.transpose(0, 2, 1), acc if n0 == a else term))
        ranges.append(gemms)
    return ranges


def conv_product_gemms(product, columns, x, w, out, stride, pad, ws, accumulate=False):
    """(path, ranges): the GEMMs one conv product runs in lowmem/ops/conv.py, decided as
    conv2d_forward / conv2d_backward_input / conv2d_backward_weight decide (the same
    `winograd.applies` with the same arrays, the same 1x1 test), chunked as they chunk.

    product: "forward" (x (Cin, N, H, W) -> out (Cout, N, Ho, Wo)), "input" (x is dout, out is
    dx) or "weight" (x the conv input, out is dout; w stands for dw). ranges: one list per
    lowmem thread range of (a, b, out or None) matmul operands (None: the step lets
    numpy.matmul allocate the result), views of the same arrays the step uses."""
    from lowmem.ops import chunks, conv, winograd
    Cout, Cin, kh, kw = w.shape
    if product == "forward":
        if columns.winograd and winograd.applies(x, w, out, stride, pad, ws):
            return "winograd", _winograd_correlate(x, winograd.filter_transform(w), ws)
        N, (Ho, Wo) = x.shape[1], out.shape[2:]
        w2 = w.reshape(Cout, -1)
        if conv._is_pointwise(w, stride, pad) and x.flags.c_contiguous:
            x2, o2 = conv._flat(x, Cin), conv._flat(out, Cout)
            cuts = _column_ranges(x2.shape[1], chunks.GEMM_GRAIN)
            return "1x1", [[(w2, x2[:, a:b], o2[:, a:b])] for a, b in cuts]
    elif product == "input":
        dout, dx = x, out
        if columns.winograd and winograd.applies(dout, w, dx, stride, pad, ws):
            wb = w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)
            return "winograd", _winograd_correlate(dout, winograd.filter_transform(wb), ws)
        N, (Ho, Wo) = dx.shape[1], dout.shape[2:]
        w2t = w.reshape(Cout, -1).T
        if conv._is_pointwise(w, stride, pad) and not accumulate:
            g2, d2 = conv._flat(dout, Cout), conv._flat(dx, Cin)
            cuts = _column_ranges(g2.shape[1], chunks.GEMM_GRAIN)
            return "1x1", [[(w2t, g2[:, a:b], d2[:, a:b])] for a, b in cuts]
    elif product == "weight":
        dout = out
        if columns.winograd and winograd.applies(x, w, dout, stride, pad, ws, weight=True):
            return "winograd", _winograd_weight(x, w, ws)
        N, (Ho, Wo) = x.shape[1], dout.shape[2:]
        if conv._is_pointwise(w, stride, pad) and x.flags.c_contiguous:
            x2, g2 = conv._flat(x, Cin), conv._flat(dout, Cout)
            cuts = _column_ranges(x2.shape[1], chunks.GEMM_GRAIN)
            return "1x1", [[(g2[:, a:b], x2[:, a:b].T, None)] for a, b in cuts]
    else:
        raise ValueError(f"product must be forward, input or weight, got {product!r}")
    K = Cin * kh * kw                                      # im2col: one GEMM per chunk of samples
    ranges = []
    for a, b, wsp in _batch_ranges(N, ws, K * Ho * Wo):
        nc, gemms = chunks.chunk_size(wsp, K * Ho * Wo, b - a), []
        for n0 in range(a, b, nc):
            n1 = min(b, n0 + nc)
            cols = wsp[:K * (n1 - n0) * Ho * Wo].reshape(K, -1)
            if product == "forward":
                gemms.append((w2, cols, conv._flat(out[:, n0:n1], Cout)))
            elif product == "input":
                gemms.append((w2t, conv._flat(dout[:, n0:n1], Cout), cols))
            else:
                gemms.append((conv._flat(dout[:, n0:n1], Cout), cols.T, None))
        ranges.append(gemms)
    return "im2col", ranges


def step_gemms(eng):
    """Every conv GEMM one training step of an allocated engine runs, in schedule order:
    [dict(layer, product, path, ranges, flop, direct_flop)] (conv_product_gemms; the
    backward as optable.Conv.backward runs it: the weight gradient, then the input
    gradient unless it is the network input's). Operands are views of the engine's own
    arrays (activation buffers, the conv workspace), so the memory layout is the step's;
    the classifier's two tiny GEMMs are left out. flop: 2 x the multiply-adds the GEMMs do;
    direct_flop: those of the direct convolution (2*Cout*Cin*k*k*N*Ho*Wo)."""
    run, N = eng.run, eng.N
    if run is None:
        raise ValueError("step_gemms needs an allocated engine (allocate=True)")
    run.n = N                                              # what a full-batch forward sets
    ws = run.arrays["conv.cols"]
    out = []
    for step in eng.schedule:
        if step.op != "conv":
            continue
        L, w = step.layer, run.params[step.params[0]].data
        if step.phase == "fwd":
            calls = [("forward", run.act(step.src, step.in_shape), run.act(step.dst, step.out_shape), False)]
        else:
            dout = run.act(step.dout, step.out_shape)
            x = run.act(step.scratch if step.unit else step.src, step.in_shape)
            calls = [("weight", x, dout, False)]
            if step.dx and (run.input_grad or not step.optional):
                calls.append(("input", dout, run.act(step.dx, step.in_shape), step.accumulate))
        direct = 2 * w.size * N * math.prod(step.out_shape[1:])
        for product, a, b, acc in calls:
            path, ranges = conv_product_gemms(product, run.columns, a, w, b, L.stride, L.pad, ws, acc)
            flop = sum(2 * math.prod(p.shape) * q.shape[-1] for r in ranges for p, q, _ in r)
            out.append(dict(layer=L.name, product=product, path=path, ranges=ranges, flop=flop,
                            direct_flop=direct))
    return out


def run_gemms(products):
    """Run the GEMMs of step_gemms: each product's ranges over lowmem's threads, one range
    per thread, as the step splits them."""
    import numpy as np
    from lowmem.system import threads
    for p in products:
        ranges = p["ranges"]

        def body(t0, t1, ranges=ranges):
            for t in range(t0, t1):
                for a, b, c in ranges[t]:
                    np.matmul(a, b, out=c)
        threads.parallel_for(body, len(ranges))


def floor_worker(args):
    """The 'floor' configuration: what the approx-4 step cannot go below on this machine.

    GEMMs: exactly the conv GEMMs the approx-4 step runs (step_gemms: each conv's forward,
    weight-gradient and, except the stem's, input-gradient product on the path lowmem takes
    at that shape: Winograd F(2x2, 3x3)'s 16 batched GEMMs per chunk of tiles for the stride-1
    3x3 convs, the plain GEMM of a 1x1 conv, im2col GEMMs for the stem and strided convs),
    chunked and split over lowmem's threads as the step does, BLAS at one thread
    (threads.configure), on the operands' own arrays in an allocated engine (filled with
    random numbers first). FLOPs both ways: what the GEMMs do, and the direct-convolution
    equivalent (2*Cout*Cin*k*k*N*Ho*Wo per product). Not timed: the transforms, im2col and
    col2im around the GEMMs (passes over memory, below) and the classifier's tiny GEMMs.
    Bytes a step must touch, each moved once (one read and one write): every layer output
    (activation) written and read in the forward, its gradient written and read in the
    backward (4 x activation bytes), the saved codes written and read (2 x the plan's 'saved'),
    the parameters, gradients and optimizer state each read and written once (2 x their
    plan bytes). At the copy bandwidth of numpy.copyto of a 256 MiB buffer over the same
    threads, counting read + write bytes. Floor step = GEMM time + bytes / copy rate."""
    import numpy as np
    import lowmem
    from lowmem.system import threads
    threads.configure(args.threads)
    T = threads.threads()
    net = lowmem.models.preact_resnet_cifar(args.depth, num_classes=args.classes, block=args.block)
    eng = lowmem.Engine(net, args.batch, (3, 32, 32), "approx", 4, "float32")   # as lowmem_step_fn
    N = args.batch
    act_bytes = sum(4 * N * math.prod(eng.out_shape[L.name]) for L in net.layers)
    kinds = eng.plan.bytes_by_kind()
    state = kinds["params"] + kinds["grads"] + kinds["optimizer"]
    touched = 4 * act_bytes + 2 * kinds["saved"] + 2 * state
    rng = np.random.default_rng(0)
    used = {"conv.cols"} | {getattr(s, f) for s in eng.schedule if s.op == "conv"
                            for f in ("src", "dst", "dout", "dx", "scratch")}
    for name in sorted(used - {""}):                      # no zeros, NaNs or denormals in the GEMMs
        a = eng.arrays[name]
        a[...] = rng.standard_normal(a.shape, dtype=np.float32)
    products = step_gemms(eng)
    paths = {}
    for p in products:
        paths[p["path"]] = paths.get(p["path"], 0) + 1
    flop = sum(p["flop"] for p in products)
    direct = sum(p["direct_flop"] for p in products)
    calls = sum(len(r) for p in products for r in p["ranges"])
    src = np.ones(256 << 18, np.float32)
    dst = np.empty_like(src)
    copy_s = min(_time(lambda: threads.parallel_for(lambda a, b: np.copyto(dst[a:b], src[a:b]), src.size))
                 for _ in range(5))
    copy_rate = 2 * src.nbytes / copy_s                     # bytes read + written per second
    mem_s = touched / copy_rate
    times = []
    for i in range(args.warmup + args.steps):
        times.append(_time(lambda: run_gemms(products)))
    gemm = times[args.warmup:]
    rate = flop / statistics.median(gemm)
    peak, how = peak_flops(T)
    res = dict(config="floor", depth=args.depth, block=args.block, batch=N, threads=args.threads,
               lowmem_threads=T, source_sha=source_hash(), blas=blas_info(),
               warmup_s=[t + mem_s for t in times[:args.warmup]], step_s=[t + mem_s for t in gemm],
               gemm_s=gemm, gemm_flop=flop, gemm_flops=rate, gemm_direct_flop=direct,
               gemm_direct_flops=direct / statistics.median(gemm), gemm_calls=calls,
               convs=sum(1 for s in eng.schedule if s.op == "conv" and s.phase == "fwd"),
               products=len(products), products_by_path=paths, winograd=eng.run.columns.winograd,
               peak_flops=peak, peak_how=how, gemm_of_peak=rate / peak,
               bytes_touched=touched, touched_parts=dict(activations_x4=4 * act_bytes, saved_x2=2 * kinds["saved"],
                                                         params_grads_optimizer_x2=2 * state),
               copy_bytes_per_s=copy_rate, mem_s=mem_s, peak_above_base=None, base_rss=None)
    print("RESULT " + json.dumps(res), flush=True)
    return 0


def _time(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


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
    if args.worker == "kernels":
        return kernel_worker(args)
    if args.worker == "floor":
        return floor_worker(args)
    cfg = CONFIGS[args.worker]
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
    base = proc_status()
    try:
        with open("/proc/self/clear_refs", "w") as f:     # VmHWM := VmRSS from here on
            f.write("5")
        hwm_reset = True
    except OSError:
        hwm_reset = False
    t0 = time.perf_counter()
    step, extra = torch_step_fn(args, torch) if cfg["impl"] == "torch" else lowmem_step_fn(args, cfg)
    build_s = time.perf_counter() - t0
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        t = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t)
    end = proc_status()
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
    res = dict(source_sha=source_hash(), **gemm, config=args.worker, depth=args.depth, block=args.block, batch=args.batch,
               build_s=build_s,
               warmup_s=times[:args.warmup], step_s=times[args.warmup:], losses=losses,
               base_rss=base["VmRSS"], base_hwm=base["VmHWM"], hwm_reset=hwm_reset,
               peak_hwm=end["VmHWM"], end_rss=end["VmRSS"],
               peak_above_base=end["VmHWM"] - base["VmRSS"], threads=args.threads, blas=blas_info(), **extra)
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
    print("RESULT " + json.dumps(res), flush=True)
    return 0


# ---- the per-kernel table: each fused kernel against its exact twin and a plain copy --------

KERNEL_SHAPES = ((16, 131072), (64, 131072), (128, 32768), (256, 8192))   # ResNet-164 b128 units (C, N*H*W)
ASM_KERNELS = ("_quantize_block", "_pack", "_unpack", "_decode_relu_block", "_decode_sums", "_decode_dx_block",
               "_forward_exact", "_exact_sums", "_exact_dx_block", "_stats")


def _best_time(fn, reps, setup=None):
    """Fastest of reps + 1 calls (setup, untimed, before each)."""
    best = float("inf")
    for _ in range(reps + 1):
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def kernel_cases(C, M, bits):
    """(name, exact twin, bytes moved per element, call, setup) for one unit shape. The calls are
    the engine's: forward in place (out is x), backward in place (dx is dr, restored untimed)."""
    import numpy as np
    from lowmem.units import packing, window
    from lowmem.system import threads
    from lowmem.units import window_cpu as fast
    F = np.float32
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((C, M)) * 2 + 0.5).astype(F)
    g, b = rng.standard_normal(C).astype(F), rng.standard_normal(C).astype(F)
    mean, var, rstd = (np.empty(C, F) for _ in range(3))
    fast.bn_stats(mean, var, rstd, x, 1e-5)
    qp = window.quant_params(g, b, bits)
    packed = np.empty(packing.packed_nbytes(x.size, bits), np.uint8)
    xhat = ((x - mean[:, None]) * rstd[:, None]).astype(F)
    window.quantize_pack(packed, xhat, qp)
    out, buf = np.empty_like(x), x.copy()
    grad = rng.standard_normal(x.shape).astype(F)
    dr, dg, db = grad.copy(), np.zeros(C, F), np.zeros(C, F)
    fresh = lambda: np.copyto(dr, grad)                                        # noqa: E731
    copy = lambda: threads.parallel_for(lambda c0, c1: np.copyto(out[c0:c1], x[c0:c1]), C)  # noqa: E731
    kb = bits / 8
    return [
        ("plain copy", None, 8, copy, None),
        ("bn_stats", None, 8, lambda: fast.bn_stats(mean, var, rstd, x, 1e-5), None),
        ("forward exact", None, 12, lambda: fast.unit_forward_exact(buf, xhat, buf, mean, rstd, g, b), None),
        (f"forward {bits}-bit", "forward exact", 8 + kb,
         lambda: fast.unit_forward_code(buf, packed, buf, mean, rstd, g, b, qp, False), None),
        ("conv input exact", None, 8, lambda: fast.conv_input(out, xhat, None, None, g, b), None),
        (f"conv input {bits}-bit", "conv input exact", 4 + kb, lambda: fast.conv_input(out, None, packed, qp, g, b),
         None),
        ("backward exact", None, 20,
         lambda: fast.unit_backward(dr, dg, db, dr, xhat, None, None, g, b, rstd, False), fresh),
        (f"backward {bits}-bit", "backward exact", 12 + 2 * kb,
         lambda: fast.unit_backward(dr, dg, db, dr, None, packed, qp, g, b, rstd, False), fresh),
    ]


def kernel_worker(args):
    """Time every fused kernel on ResNet-164's unit shapes (this process, args.threads lowmem
    threads); count the vector registers in their compiled code. Prints RESULT json."""
    import re
    from lowmem.system import threads  # the parent gave this process an empty NUMBA_CACHE_DIR:
    from lowmem.units import window_cpu as fast          # first calls time the JIT, and inspect_asm works
    threads.configure(args.threads)
    if not fast.AVAILABLE:
        print("RESULT " + json.dumps({"status": "numba not installed"}), flush=True)
        return 0
    rows, first_call_s = [], {}
    for C, M in KERNEL_SHAPES:
        cases = kernel_cases(C, M, args.kernel_bits)
        for name, _twin, _bpe, fn, setup in cases:           # first calls: JIT compile or cache load
            if name not in first_call_s:
                t = time.perf_counter()
                fn()
                first_call_s[name] = time.perf_counter() - t
        best = {}
        for _ in range(3):                                   # interleaved rounds: a neighbour's burst hits all
            for name, _twin, _bpe, fn, setup in cases:
                best[name] = min(best.get(name, float("inf")), _best_time(fn, 5, setup))
        copy_bw = 8 * C * M / best["plain copy"]
        for name, twin, bpe, _fn, _setup in cases:
            bw = bpe * C * M / best[name]
            rows.append(dict(shape=f"{C}x{M}", kernel=name, ms=best[name] * 1e3, gb_s=bw / 1e9, bytes_per_elem=bpe,
                             ratio_to_twin=best[name] / best[twin] if twin else None, of_copy_bw=bw / copy_bw))
    asm = {}
    for name in ASM_KERNELS:
        disp = getattr(fast, name)
        try:
            text = "\n".join(disp.inspect_asm().values())
        except Exception as e:                               # cached code cannot be inspected
            asm[name] = f"n/a ({type(e).__name__})"
            continue
        asm[name] = {"ymm": len(re.findall(r"%ymm", text)), "zmm": len(re.findall(r"%zmm", text))}
    res = dict(status="ok", threads=threads.threads(), bits=args.kernel_bits, rows=rows, first_call_s=first_call_s,
               asm=asm, source_sha=source_hash())
    print("RESULT " + json.dumps(res), flush=True)
    return 0


def kernel_table(res):
    head = (f"{'unit (C x N*H*W)':<17} {'kernel':<20} {'ms':>8} {'GB/s':>7} {'B/elem':>7} {'/ exact twin':>12} "
            f"{'/ copy GB/s':>11}")
    lines = [head, "-" * len(head)]
    for r in res["rows"]:
        ratio = f"{r['ratio_to_twin']:.2f}" if r["ratio_to_twin"] is not None else "-"
        lines.append(f"{r['shape']:<17} {r['kernel']:<20} {r['ms']:>8.3f} {r['gb_s']:>7.1f} "
                     f"{r['bytes_per_elem']:>7.3g} {ratio:>12} {r['of_copy_bw']:>11.2f}")
    return "\n".join(lines)


def kernel_summary(res):
    """Worst ratio to the exact twin and worst share of copy bandwidth per 4-bit kernel, over the shapes."""
    out = {}
    for r in res["rows"]:
        if r["ratio_to_twin"] is None:
            continue
        s = out.setdefault(r["kernel"], dict(worst_ratio=0.0, worst_of_copy=9.0))
        s["worst_ratio"] = max(s["worst_ratio"], r["ratio_to_twin"])
        s["worst_of_copy"] = min(s["worst_of_copy"], r["of_copy_bw"])
    return out


def source_hash():
    """sha256 (12 hex) of the lowmem sources this process imported: the code measured
    (the work tree may change between runs)."""
    import hashlib
    h = hashlib.sha256()
    for name in sorted(m for m in sys.modules if m == "lowmem" or m.startswith("lowmem.")):
        path = getattr(sys.modules[name], "__file__", None)
        if path:
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:12]


# ---- the parent ----------------------------------------------------------------------------

def machine_info():
    info = {"python": sys.version.split()[0], "cpus": os.cpu_count()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for key in ("Model name", "Core(s) per socket", "Socket(s)", "Thread(s) per core", "L3 cache"):
            m = re.search(rf"^{re.escape(key)}:\s*(.+)$", out, re.M)
            if m:
                info[key] = m.group(1).strip()
        info["avx512f"] = " avx512f " in out + " "
    except OSError:
        pass
    with open("/proc/meminfo") as f:
        info["mem_total_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    import numpy
    info["numpy"] = numpy.__version__
    info["blas"] = blas_info()
    from importlib import metadata
    for pkg in ("torch", "numba", "threadpoolctl"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    info["env"] = {k: os.environ.get(k) for k in OPENBLAS_ENV + THREAD_ENV}
    return info


def wait_quiet(args, log):
    """Wait until the CPUs are quiet (or --max-wait has passed); return what was seen."""
    t0 = time.time()
    while True:
        busy = cpu_busy()
        load = os.getloadavg()
        if busy < args.max_busy or time.time() - t0 > args.max_wait:
            waited = time.time() - t0
            quiet = busy < args.max_busy
            if not quiet:
                log(f"  machine still busy ({busy:.0%} CPU, load {load[0]:.2f}) after {waited:.0f} s: "
                    f"measuring anyway (recorded)")
            return dict(cpu_busy_before=round(busy, 3), load_before=[round(v, 2) for v in load],
                        waited_s=round(waited, 1), quiet=quiet)
        time.sleep(10)


def run_worker(args, config, batch, steps, warmup, log, profile=0, timed=True, threads=None, env_extra=None,
               empty_cache=False):
    """run_once, repeated (up to --retries times) while other processes used more than
    --max-others CPUs during the run; earlier attempts are kept under "disturbed_attempts".
    timed=False (memory only): once, without waiting for a quiet machine."""
    disturbed = []
    while True:
        res = run_once(args, config, batch, steps, warmup, log, profile, timed, threads, env_extra, empty_cache)
        if not timed or res["other_cpus_during"] <= args.max_others or len(disturbed) >= args.retries \
                or res["status"] != "ok":
            break
        log(f"  {config}: other processes used {res['other_cpus_during']:.2f} CPUs during the run; retrying")
        res.pop("profile", None)
        disturbed.append(res)
    if disturbed:
        res["disturbed_attempts"] = disturbed
    return res


def run_once(args, config, batch, steps, warmup, log, profile=0, timed=True, threads=None, env_extra=None,
             empty_cache=False):
    """Run one configuration in a fresh process under the memory watchdog; returns its result dict.
    threads: instead of --threads; env_extra: variables set in the worker (e.g. NUMBA_CACHE_DIR);
    empty_cache: empty that NUMBA_CACHE_DIR first. The kernel table always gets a new, empty one."""
    import shutil
    import tempfile
    env = dict(os.environ, **(env_extra or {}))
    own_cache = None
    if config == "kernels":
        own_cache = env["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="lowmem-numba-")
    elif empty_cache:
        shutil.rmtree(env["NUMBA_CACHE_DIR"], ignore_errors=True)
    if args.unset_openblas_env:
        for k in OPENBLAS_ENV:
            env.pop(k, None)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", config, "--depth", str(args.depth),
           "--batch", str(batch), "--steps", str(steps), "--warmup", str(warmup),
           "--threads", str(threads or args.threads), "--classes", str(args.classes), "--block", args.block,
           "--profile", str(profile), "--kernel-bits", str(args.kernel_bits)] + \
        (["--gemm-share"] if args.gemm_share else [])
    seen = (wait_quiet(args, log) if args.max_wait > 0 and timed
            else {"load_before": [round(v, 2) for v in os.getloadavg()]})
    t0 = time.time()
    all0, busy0 = cpu_times()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    max_rss, killed, own = 0, None, 0
    while p.poll() is None:
        try:
            rss = proc_status(p.pid).get("VmRSS", 0)
            own = proc_cpu(p.pid)
        except (OSError, ValueError, IndexError):
            rss = 0
        max_rss = max(max_rss, rss)
        avail = mem_available()
        if rss > args.mem_limit or (avail is not None and avail < 1 << 30) or time.time() - t0 > args.timeout:
            why = ("RSS limit" if rss > args.mem_limit else
                   "timeout" if time.time() - t0 > args.timeout else "MemAvailable < 1 GiB")
            killed = f"killed ({why}) at RSS {rss / MiB:.0f} MiB after {time.time() - t0:.0f} s"
            p.kill()
            break
        time.sleep(0.05)
    out, err = p.communicate()
    all1, busy1 = cpu_times()
    if own_cache:
        shutil.rmtree(own_cache, ignore_errors=True)
    ncpu = os.cpu_count()
    # CPUs busy on average during the run, and how many of them were not this worker (the
    # worker's own time is its last reading, up to 50 ms short; the parent's is negligible)
    busy_cpus = ncpu * (busy1 - busy0) / max(1, all1 - all0)
    own_cpus = ncpu * own / max(1, all1 - all0)
    res = {"config": config, "batch": batch, "threads": threads or args.threads}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
    res.update(seen, load_after=[round(v, 2) for v in os.getloadavg()], watched_max_rss=max_rss,
               cpus_busy_during=round(busy_cpus, 2), other_cpus_during=round(max(0.0, busy_cpus - own_cpus), 2),
               wall_s=round(time.time() - t0, 1), unset_openblas_env=args.unset_openblas_env)
    if config == "kernels":
        res["status"] = res.get("status") or killed or f"failed (exit {p.returncode}): {err.strip()[-500:]}"
        res["config"] = "kernels"
    elif "step_s" not in res:
        res["status"] = killed or f"failed (exit {p.returncode}): {err.strip().splitlines()[-1:] or ''}"
    else:
        res["status"] = "ok"
        st = res["step_s"]
        res.update(step_median=statistics.median(st), step_min=min(st), step_max=max(st),
                   images_per_s=batch / statistics.median(st))
    return res


def fmt_mib(b):
    return "-" if b is None else f"{b / MiB:,.0f}"


def table(runs):
    head = (f"{'config':<16} {'batch':>5} {'median s':>9} {'min s':>7} {'max s':>7} {'img/s':>7} "
            f"{'peak RSS MiB':>13} {'planned MiB':>12} {'load 1m':>8} {'others':>6}")
    lines = [head, "-" * len(head)]
    for r in runs:
        load = r.get("load_before", [float("nan")])[0]
        others = r.get("other_cpus_during", float("nan"))
        if r["status"] != "ok":
            lines.append(f"{r['config']:<16} {r['batch']:>5} {r['status']}  "
                         f"(watched max RSS {fmt_mib(r.get('watched_max_rss'))} MiB)")
            continue
        lines.append(f"{r['config']:<16} {r['batch']:>5} {r['step_median']:>9.2f} {r['step_min']:>7.2f} "
                     f"{r['step_max']:>7.2f} {r['images_per_s']:>7.1f} {fmt_mib(r['peak_above_base']):>13} "
                     f"{fmt_mib(r.get('planned_bytes')):>12} {load:>8.2f} {others:>6.2f}")
    return "\n".join(lines)


RATIOS = [("step time   lowmem-approx4 / torch-exact", "step_median", "lowmem-approx4", "torch-exact", "<= 0.8"),
          ("step time   lowmem-approx4 / lowmem-exact", "step_median", "lowmem-approx4", "lowmem-exact", "<= 1.05"),
          ("peak RSS    lowmem-approx4 / torch-exact", "peak_above_base", "lowmem-approx4", "torch-exact",
           "<= 0.125"),
          ("peak RSS    lowmem-approx4 / torch-ckpt", "peak_above_base", "lowmem-approx4", "torch-ckpt", "< 0.25"),
          ("step time   lowmem-approx4 / floor", "step_median", "lowmem-approx4", "floor", "<= 1.6")]


def ratios(runs):
    by = {r["config"]: r for r in runs if r["status"] == "ok"}
    out = {}
    for label, key, a, b, target in RATIOS:
        if a in by and b in by:
            r = by[a][key] / by[b][key]
            ok = r <= float(target.split()[-1]) if target.startswith("<=") else r < float(target.split()[-1])
            out[label] = dict(ratio=r, target=target, met=ok)
    return out


def header(info, args):
    blas = "; ".join(f"{b['internal_api']} {b['version']} ({b['architecture']}, {b['num_threads']} threads)"
                     for b in info["blas"])
    env = ", ".join(f"{k}={v}" for k, v in info["env"].items() if v is not None) or "none set"
    return "\n".join([
        f"machine: {info.get('Model name')}, {info['cpus']} CPUs, {info['mem_total_gib']} GiB RAM; "
        f"python {info['python']}, numpy {info['numpy']}, torch {info['torch']}, numba {info['numba']}",
        f"numpy BLAS: {blas}",
        f"thread / BLAS environment: {env}" + ("  (workers: OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE removed)"
                                               if args.unset_openblas_env else ""),
        f"pre-act ResNet-{args.depth} ({args.block} blocks), {args.classes} classes, 3x32x32 input, float32; "
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
    rows = []
    for name in ("lowmem-exact", "lowmem-approx8", "lowmem-approx4", "lowmem-approx2"):
        cfg = CONFIGS[name]
        n = max_batch(factory, (3, 32, 32), budget, cfg["mode"], cfg["bits"])
        planned = planned_engine(factory, n, (3, 32, 32), cfg["mode"], cfg["bits"]).plan.total_bytes
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
        if c not in CONFIGS:
            raise SystemExit(f"--scaling: unknown config {c!r}")
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
    import tempfile
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=164)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: %(default)s)")
    ap.add_argument("--configs", default="all",
                    help=f"comma-separated subset of {', '.join(CONFIGS)}; 'none' for only --maxbatch-budget. "
                         "floor: the approx-4 step's conv GEMMs exactly as lowmem runs them (Winograd's "
                         "batched GEMMs, 1x1 GEMMs, im2col GEMMs) plus one pass over the bytes a step touches")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch.set_num_threads, numba and BLAS threads (default: os.cpu_count() = %(default)s)")
    ap.add_argument("--json", metavar="PATH", help="also write everything as JSON")
    ap.add_argument("--update", action="store_true",
                    help="with --json: keep the runs already in PATH (same depth and batch) of the configs not "
                         "run now, e.g. to redo a disturbed one; the table and ratios cover them all")
    ap.add_argument("--unset-openblas-env", action="store_true",
                    help="remove OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE in the worker processes")
    ap.add_argument("--mem-limit", type=parse_bytes, default=parse_bytes("21GiB"),
                    help="kill a worker whose RSS passes this (default: 21GiB)")
    ap.add_argument("--timeout", type=float, default=3600, help="kill a worker after this many s")
    ap.add_argument("--max-busy", type=float, default=0.25,
                    help="wait before each worker until CPU busy (all cores, 2 s sample) is below this")
    ap.add_argument("--max-wait", type=float, default=1200, help="longest wait for a quiet machine, s (0: never wait)")
    ap.add_argument("--max-others", type=float, default=0.3,
                    help="rerun a config when other processes used more CPUs than this during it")
    ap.add_argument("--retries", type=int, default=2, help="reruns of a disturbed config (default: %(default)s)")
    ap.add_argument("--maxbatch-budget", type=parse_bytes, default=None, metavar="BYTES",
                    help="also find the max batch at this budget (lowmem from plans, torch-exact measured)")
    ap.add_argument("--maxbatch-time", type=float, default=1200, help="cap on the torch search, s")
    ap.add_argument("--maxbatch-measure", action="store_true",
                    help="also run each lowmem config at its max batch and report its measured peak RSS")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="cProfile one extra (untimed) step of each config; print the top N by tottime")
    ap.add_argument("--worker", choices=list(CONFIGS) + ["kernels"], help=argparse.SUPPRESS)
    ap.add_argument("--gemm-share", action="store_true",
                    help="lowmem configs: one extra (untimed) step with numpy.matmul wrapped by a timer: the "
                         "share of the step's core-seconds spent inside GEMMs")
    ap.add_argument("--kernels", action="store_true",
                    help="also the per-kernel table (fused BN-ReLU kernels vs their exact twins and a plain copy), "
                         "in a fresh process with an empty numba cache (so inspect_asm works and JIT time shows)")
    ap.add_argument("--kernel-bits", type=int, default=4, choices=(8, 4, 2, 1), help="bit width for --kernels")
    ap.add_argument("--scaling", metavar="CONFIGS", default="",
                    help="comma-separated configs to rerun on 1 thread: the 1-core/N-core row")
    ap.add_argument("--jit", metavar="CONFIGS", default="",
                    help="comma-separated lowmem configs run with an empty numba cache, then again with it "
                         "filled: first-step overhead cold and warm")
    ap.add_argument("--block", choices=("auto", "basic", "bottleneck"), default="auto",
                    help="residual block; auto: lowmem's rule (bottleneck for 9n+2 depths >= 164 or not 6n+2)")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)

    sys.path.insert(0, ROOT)
    from lowmem.models import preact_resnet_cifar
    if args.block == "auto":
        net = preact_resnet_cifar(args.depth, num_classes=args.classes)      # lowmem's block rule
        args.block = "bottleneck" if any(L.name.endswith(".bn3") for L in net.layers) else "basic"
    configs = [] if args.configs == "none" else list(CONFIGS) if args.configs == "all" else args.configs.split(",")
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        ap.error(f"unknown config(s) {bad}; expected a subset of {list(CONFIGS)}")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    info = machine_info()
    print(header(info, args), flush=True)
    runs = []
    for c in configs:
        log(f"running {c} (batch {args.batch}) ...")
        runs.append(run_worker(args, c, args.batch, args.steps, args.warmup, log, args.profile))
        r = runs[-1]
        log(f"  {r['status']}" + (f": median {r['step_median']:.2f} s, peak {fmt_mib(r['peak_above_base'])} MiB"
                                  if r["status"] == "ok" else ""))
    if args.update and args.json and os.path.exists(args.json):
        key = (args.depth, args.batch, args.block)
        with open(args.json) as f:
            old = [r for r in json.load(f).get("runs", []) if r["config"] not in configs
                   and (r.get("depth"), r.get("batch"), r.get("block", args.block)) == key]
        runs = sorted(old + runs, key=lambda r: list(CONFIGS).index(r["config"]))
    result = {"machine": info, "args": {k: v for k, v in vars(args).items() if k != "worker"},
              "runs": runs, "ratios": ratios(runs)}
    if runs:
        print(f"\none training step (median/min/max over {args.steps} steps after {args.warmup} warm-up), "
              f"batch {args.batch}; peak RSS = VmHWM - baseline VmRSS; planned = lowmem's plan total;\n"
              f"load 1m = load average before the run; others = CPUs used on average by other processes "
              f"during the run (0 = a quiet machine)")
        print(table(runs))
        for label, r in result["ratios"].items():
            print(f"{label}: {r['ratio']:.3f}  (target {r['target']}: {'met' if r['met'] else 'MISSED'})")
        for r in runs:
            if r["config"] == "floor" and r["status"] == "ok":
                by = r.get("products_by_path")
                what = (f"{r['products']} products as the step runs them ({by.get('winograd', 0)} Winograd "
                        f"F(2x2,3x3): 16 batched GEMMs per chunk of tiles; {by.get('1x1', 0)} 1x1: plain GEMMs; "
                        f"{by.get('im2col', 0)} im2col GEMMs), {r['gemm_calls']:,} matmul calls: "
                        f"{r['gemm_flop'] / 1e9:.1f} GFLOP (direct-conv equivalent "
                        f"{r['gemm_direct_flop'] / 1e9:.1f})" if by is not None else
                        f"3 im2col GEMMs each (a run from before the floor ran the step's own GEMMs): "
                        f"{r['gemm_flop'] / 1e9:.1f} GFLOP")
                direct = f" ({r['gemm_direct_flops'] / 1e9:.1f} direct-equivalent)" if by is not None else ""
                print(f"\nfloor: {r['convs']} convs, {what} in "
                      f"{statistics.median(r['gemm_s']):.2f} s = {r['gemm_flops'] / 1e9:.1f} GFLOP/s{direct}, "
                      f"{r['gemm_of_peak']:.0%} of peak {r['peak_flops'] / 1e9:.0f} GFLOP/s\n"
                      f"  peak = {r['peak_how']}\n"
                      f"  + {r['bytes_touched'] / MiB:,.0f} MiB touched once (activations x4 "
                      f"{r['touched_parts']['activations_x4'] / MiB:,.0f}, saved codes x2 "
                      f"{r['touched_parts']['saved_x2'] / MiB:,.0f}, params/grads/optimizer x2 "
                      f"{r['touched_parts']['params_grads_optimizer_x2'] / MiB:,.0f}) at copy "
                      f"{r['copy_bytes_per_s'] / 1e9:.1f} GB/s (read + write) = {r['mem_s']:.2f} s")
            if r.get("gemm_share") is not None:
                print(f"{r['config']}: share of the step inside GEMMs (numpy.matmul timed, one extra step of "
                      f"{r['gemm_counted_step_s']:.2f} s, {r['gemm_calls']} calls, {r['lowmem_threads']} thread(s)): "
                      f"{r['gemm_share']:.0%}  (target >= 70%)")
        for r in runs:
            if r.get("profile"):
                print(f"\ncProfile of one {r['config']} step ({r['profiled_step_s']:.2f} s under the profiler):")
                print(r["profile"])
    if args.scaling:
        result["scaling"] = scaling_section(args, runs, log)
        print()
        print(scaling_table(result["scaling"], args.threads))
    if args.jit:
        result["jit"] = jit_section(args, log)
        print()
        print(jit_table(result["jit"]))
    if args.kernels:
        log("running the per-kernel table (fresh process, empty numba cache) ...")
        k = run_worker(args, "kernels", args.batch, 0, 0, log)
        result["kernels"] = k
        print()
        if k["status"] != "ok":
            print(f"kernel table: {k['status']}")
        else:
            print(f"fused kernels, {k['threads']} lowmem thread(s), {k['bits']}-bit; best of 3 rounds x 6 calls; "
                  f"bytes moved per element as counted in benchmarks/compare_torch.py:kernel_cases; "
                  f"load 1m {k.get('load_before', [float('nan')])[0]:.2f}, others {k.get('other_cpus_during', float('nan')):.2f} CPUs")
            print(kernel_table(k))
            for name, v in kernel_summary(k).items():
                print(f"{name:<20} worst / exact twin {v['worst_ratio']:.2f} (target <= 1.3: "
                      f"{'met' if v['worst_ratio'] <= 1.3 else 'MISSED'}); worst share of copy GB/s "
                      f"{v['worst_of_copy']:.2f} (target >= 0.5: {'met' if v['worst_of_copy'] >= 0.5 else 'MISSED'})")
            print("vector registers in the compiled kernels (ymm = AVX2, zmm = AVX-512): " +
                  ", ".join(f"{n} {a['ymm']}/{a['zmm']}" if isinstance(a, dict) else f"{n} {a}"
                            for n, a in k["asm"].items()))
            print("first call (JIT compile, empty cache), s: " +
                  ", ".join(f"{n} {t:.2f}" for n, t in k["first_call_s"].items()))
    if args.maxbatch_budget:
        log(f"max batch at {args.maxbatch_budget / MiB:,.0f} MiB ...")
        rows = maxbatch_section(args, args.maxbatch_budget, log)
        result["maxbatch"] = {"budget_bytes": args.maxbatch_budget, "rows": rows}
        print()
        print(maxbatch_table(rows, args.maxbatch_budget))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
