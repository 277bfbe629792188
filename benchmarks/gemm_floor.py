"""The machine's floor for a training step: exactly the step's conv GEMMs, plus one pass over the
bytes a step must touch.

step_gemms(eng) lists every conv GEMM one training step of an allocated engine runs, decided as
lowmem/ops/conv.py and lowmem/ops/winograd.py decide (the same `winograd.applies`, the same 1x1
test, the same chunking and thread ranges), on views of the engine's own arrays;
tests/benchmarks/test_gemm_floor.py runs a real step with numpy.matmul recorded and checks that
the list is the step's. measure(eng, ...) times them (run_gemms) and adds the memory traffic at
the copy bandwidth measured in the same process; benchmarks/compare_torch.py's "floor"
configuration runs it in a fresh process. It reads conv's and winograd's private functions
(conv._flat, conv._is_pointwise, winograd._chunk, _pair, _most, _split_planes, _weight_planes,
_weight_block): a model of their decisions, pinned by that test.
"""
import math
import re
import statistics
import subprocess
import time
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


def _plane_ranges(P):
    """The plane ranges threads.parallel_for(body, P) cuts (a plane-split chunk's GEMMs)."""
    return _column_ranges(P, 1)


def _by_planes(chunks_, ranges):
    """One list of GEMMs per thread from per-chunk [(a, b, out)] whole-plane-stack operands, each
    cut by plane into that thread's range (ranges: _plane_ranges)."""
    return [[(a[p0:p1], b[p0:p1], o[p0:p1]) for a, b, o in chunks_] for p0, p1 in ranges]


def _winograd_correlate(x, U, ws):
    """The GEMMs of winograd._correlate: M (P, Co, T) = U @ V (P, Ci, T), P the planes of the
    conv's scheme (winograd.scheme: F(2x2) 16, F(4x4) 36): per batch range and chunk, or where
    winograd._split_planes cuts the planes, per chunk of the batch and plane range."""
    from lowmem.ops import chunks, winograd
    Co, Ci = U.shape[1:]
    N, H, W = x.shape[1:]
    s = winograd.scheme(N, H, W)
    P = s.planes
    th, tw = s.tiles(H, W)
    per = s.per_sample(Ci, Co, H, W)
    if winograd._split_planes(N, th * tw, Ci * Co, ws, per):
        nc, gemms = min(N, ws.size // per), []
        for n0 in range(0, N, nc):
            T = (min(N, n0 + nc) - n0) * th * tw
            V, M = winograd._pair(ws, Ci, Co, T, P)
            gemms.append((U, V, M))
        return _by_planes(gemms, _plane_ranges(P))
    ranges = []
    for a, b, wsp in chunks.batch_ranges(N, ws, per, winograd._most(P * Ci * Co * N * th * tw)):
        nc, gemms = winograd._chunk(wsp, per, b - a), []
        for n0 in range(a, b, nc):
            T = (min(b, n0 + nc) - n0) * th * tw
            V, M = winograd._pair(wsp, Ci, Co, T, P)
            gemms.append((U, V, M))
        ranges.append(gemms)
    return ranges


def _winograd_weight(x, dw, ws):
    """The GEMMs of winograd.conv3x3_backward_weight: dU (P, Co, Ci) (+)= Mg (P, Co, T) @
    V (P, Ci, T)^T, per batch range and chunk into the range's acc or term; or cut by plane
    (winograd._weight_planes: per chunk into dU, or its term after the first); or, where a
    whole dU does not fit, per block of output channels, cut by plane."""
    from lowmem.ops import chunks, winograd
    Co, Ci = dw.shape[:2]
    N, H, W = x.shape[1:]
    s = winograd.scheme(N, H, W)
    P = s.planes
    th, tw = s.tiles(H, W)
    per, u = s.per_sample(Ci, Co, H, W), P * Co * Ci
    if winograd._weight_planes(N, th * tw, Ci * Co, ws, per, u):
        one = N * per + u <= ws.size
        dU = ws[:u].reshape(P, Co, Ci)
        term = None if one else ws[u:2 * u].reshape(P, Co, Ci)
        tiles_ws = ws[u:] if one else ws[2 * u:]
        nc, gemms = min(N, tiles_ws.size // per), []
        for n0 in range(0, N, nc):
            T = (min(N, n0 + nc) - n0) * th * tw
            V, Mg = winograd._pair(tiles_ws, Ci, Co, T, P)
            gemms.append((Mg, V.transpose(0, 2, 1), dU if n0 == 0 else term))
        return _by_planes(gemms, _plane_ranges(P))
    if ws.size < per + 2 * u:                              # blocks of output channels
        T = N * th * tw
        ob = winograd._weight_block(N, Ci, Co, H, W, s, ws)
        V = ws[:P * Ci * T].reshape(P, Ci, T)
        rest, gemms = ws[P * Ci * T:], []
        for o0 in range(0, Co, ob):
            b = min(Co, o0 + ob) - o0
            Mg = rest[:P * b * T].reshape(P, b, T)
            dU = rest[P * b * T:P * b * (T + Ci)].reshape(P, b, Ci)
            gemms.append((Mg, V.transpose(0, 2, 1), dU))
        return _by_planes(gemms, _plane_ranges(P))
    ranges = []
    for a, b, wsp in chunks.batch_ranges(N, ws, per + 2 * u, winograd._most(u * N * th * tw)):
        acc, term = wsp[:u].reshape(P, Co, Ci), wsp[u:2 * u].reshape(P, Co, Ci)
        tiles_ws = wsp[2 * u:]
        nc, gemms = winograd._chunk(tiles_ws, per, b - a), []
        for n0 in range(a, b, nc):
            T = (min(b, n0 + nc) - n0) * th * tw
            V, Mg = winograd._pair(tiles_ws, Ci, Co, T, P)
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
            return "winograd", _winograd_correlate(x, winograd.filter_transform(w, winograd.scheme(*x.shape[1:])), ws)
        N, (Ho, Wo) = x.shape[1], out.shape[2:]
        w2 = w.reshape(Cout, -1)
        if conv._is_pointwise(w, stride, pad) and x.flags.c_contiguous:
            x2, o2 = conv._flat(x, Cin), conv._flat(out, Cout)
            cuts = _column_ranges(x2.shape[1], chunks.gemm_grain(Cout * Cin))
            return "1x1", [[(w2, x2[:, a:b], o2[:, a:b])] for a, b in cuts]
    elif product == "input":
        dout, dx = x, out
        if columns.winograd and winograd.applies(dout, w, dx, stride, pad, ws):
            wb = w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)
            return "winograd", _winograd_correlate(dout, winograd.filter_transform(wb, winograd.scheme(*dx.shape[1:])),
                                                   ws)
        N, (Ho, Wo) = dx.shape[1], dout.shape[2:]
        w2t = w.reshape(Cout, -1).T
        if conv._is_pointwise(w, stride, pad) and not accumulate:
            g2, d2 = conv._flat(dout, Cout), conv._flat(dx, Cin)
            cuts = _column_ranges(g2.shape[1], chunks.gemm_grain(Cout * Cin))
            return "1x1", [[(w2t, g2[:, a:b], d2[:, a:b])] for a, b in cuts]
    elif product == "weight":
        dout = out
        if columns.winograd and winograd.applies(x, w, dout, stride, pad, ws, weight=True):
            return "winograd", _winograd_weight(x, w, ws)
        N, (Ho, Wo) = x.shape[1], dout.shape[2:]
        if conv._is_pointwise(w, stride, pad) and x.flags.c_contiguous:
            x2, g2 = conv._flat(x, Cin), conv._flat(dout, Cout)
            cuts = _column_ranges(x2.shape[1], chunks.gemm_grain(Cout * Cin))
            return "1x1", [[conv.weight_operands(conv.array_module(x), g2[:, a:b], x2[:, a:b])[:2] + (None,)] for a, b in cuts]
    else:
        raise ValueError(f"product must be forward, input or weight, got {product!r}")
    K = Cin * kh * kw                                      # im2col: one GEMM per chunk of samples
    ranges = []
    for a, b, wsp in chunks.batch_ranges(N, ws, K * Ho * Wo):
        nc, gemms = chunks.chunk_size(wsp, K * Ho * Wo, b - a), []
        for n0 in range(a, b, nc):
            n1 = min(b, n0 + nc)
            cols = wsp[:K * (n1 - n0) * Ho * Wo].reshape(K, -1)
            if product == "forward":
                gemms.append((w2, cols, conv._flat(out[:, n0:n1], Cout)))
            elif product == "input":
                gemms.append((w2t, conv._flat(dout[:, n0:n1], Cout), cols))
            else:
                gemms.append(conv.weight_operands(conv.array_module(x), conv._flat(dout[:, n0:n1], Cout), cols)[:2] + (None,))
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


def _time(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(eng, warmup, steps):
    """What the approx-4 step of the allocated engine `eng` cannot go below on this machine
    (with lowmem's threads as configured): a dict of the floor's figures, step_s its steps.

    GEMMs: exactly the conv GEMMs the step runs (step_gemms: each conv's forward,
    weight-gradient and, except the stem's, input-gradient product on the path lowmem takes
    at that shape: Winograd F(2x2, 3x3)'s 16 batched GEMMs per chunk of tiles for the stride-1
    3x3 convs, the plain GEMM of a 1x1 conv, im2col GEMMs for the stem and strided convs),
    chunked and split over lowmem's threads as the step does, BLAS at one thread
    (threads.configure), on the operands' own arrays in the engine (filled with random
    numbers first). FLOPs both ways: what the GEMMs do, and the direct-convolution
    equivalent (2*Cout*Cin*k*k*N*Ho*Wo per product). Not timed: the transforms, im2col and
    col2im around the GEMMs (passes over memory, below) and the classifier's tiny GEMMs.
    Bytes a step must touch, each moved once (one read and one write): every layer output
    (activation) written and read in the forward, its gradient written and read in the
    backward (4 x activation bytes), the saved codes written and read (2 x the plan's 'saved'),
    the parameters, gradients and optimizer state each read and written once (2 x their
    plan bytes). At the copy bandwidth of numpy.copyto of a 256 MiB buffer over the same
    threads, counting read + write bytes. Floor step = GEMM time + bytes / copy rate."""
    import numpy as np
    from lowmem.system import threads
    N = eng.N
    act_bytes = sum(4 * N * math.prod(eng.out_shape[L.name]) for L in eng.net.layers)
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
    times = [_time(lambda: run_gemms(products)) for _ in range(warmup + steps)]
    gemm = times[warmup:]
    rate = flop / statistics.median(gemm)
    peak, how = peak_flops(threads.threads())
    return dict(warmup_s=[t + mem_s for t in times[:warmup]], step_s=[t + mem_s for t in gemm],
                gemm_s=gemm, gemm_flop=flop, gemm_flops=rate, gemm_direct_flop=direct,
                gemm_direct_flops=direct / statistics.median(gemm), gemm_calls=calls,
                convs=sum(1 for s in eng.schedule if s.op == "conv" and s.phase == "fwd"),
                products=len(products), products_by_path=paths, winograd=eng.run.columns.winograd,
                peak_flops=peak, peak_how=how, gemm_of_peak=rate / peak,
                bytes_touched=touched, touched_parts=dict(activations_x4=4 * act_bytes, saved_x2=2 * kinds["saved"],
                                                          params_grads_optimizer_x2=2 * state),
                copy_bytes_per_s=copy_rate, mem_s=mem_s)


def describe(r):
    """The floor's lines in compare_torch's report, from measure()'s dict."""
    MiB = 1 << 20
    by = r.get("products_by_path")
    what = (f"{r['products']} products as the step runs them ({by.get('winograd', 0)} Winograd "
            f"F(2x2,3x3): 16 batched GEMMs per chunk of tiles; {by.get('1x1', 0)} 1x1: plain GEMMs; "
            f"{by.get('im2col', 0)} im2col GEMMs), {r['gemm_calls']:,} matmul calls: "
            f"{r['gemm_flop'] / 1e9:.1f} GFLOP (direct-conv equivalent "
            f"{r['gemm_direct_flop'] / 1e9:.1f})" if by is not None else
            f"3 im2col GEMMs each (a run from before the floor ran the step's own GEMMs): "
            f"{r['gemm_flop'] / 1e9:.1f} GFLOP")
    direct = f" ({r['gemm_direct_flops'] / 1e9:.1f} direct-equivalent)" if by is not None else ""
    return (f"floor: {r['convs']} convs, {what} in "
            f"{statistics.median(r['gemm_s']):.2f} s = {r['gemm_flops'] / 1e9:.1f} GFLOP/s{direct}, "
            f"{r['gemm_of_peak']:.0%} of peak {r['peak_flops'] / 1e9:.0f} GFLOP/s\n"
            f"  peak = {r['peak_how']}\n"
            f"  + {r['bytes_touched'] / MiB:,.0f} MiB touched once (activations x4 "
            f"{r['touched_parts']['activations_x4'] / MiB:,.0f}, saved codes x2 "
            f"{r['touched_parts']['saved_x2'] / MiB:,.0f}, params/grads/optimizer x2 "
            f"{r['touched_parts']['params_grads_optimizer_x2'] / MiB:,.0f}) at copy "
            f"{r['copy_bytes_per_s'] / 1e9:.1f} GB/s (read + write) = {r['mem_s']:.2f} s")
