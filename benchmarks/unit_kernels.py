"""The BN-ReLU unit's fused CPU kernels, each against its exact twin and a plain copy, on
ResNet-164's unit shapes (batch 128): ms, GB/s at the bytes each must move, the ratio to the
exact twin, the share of the copy bandwidth; the vector registers in their compiled code
(ymm: AVX2, zmm: AVX-512) and each kernel's first call (its JIT compile).

    python benchmarks/unit_kernels.py [--bits 4] [--threads 2] [--rounding nearest|stochastic|dither]
    python benchmarks/unit_kernels.py --shape 1024,64 --shape 512,256 --shape 128,4096   # DenseNet-121's

--shape C,M (repeatable) times the kernels on units of C channels of M = N*H*W elements instead
of ResNet-164's (M*bits a multiple of 8, as the kernels take).

--rounding nearest (the default) times the window code's kernels (units/window_cpu.py);
stochastic and dither the unbiased code's (units/unbiased_cpu.py, the stochastic or the dithered
draw), each against the same exact twins.

Runs in a fresh process with a new, empty numba cache (so inspect_asm works and the JIT time
shows), after the machine is quiet (benchmarks/harness.py); best of 3 interleaved rounds x 6 calls.
"""
import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time

import harness                                   # benchmarks/harness.py, beside this script

KERNEL_SHAPES = ((16, 131072), (64, 131072), (128, 32768), (256, 8192))   # ResNet-164 b128 units (C, N*H*W)
# window_cpu's compiled kernels (private: the smoke test checks every name exists)
ASM_KERNELS = ("_quantize_block", "_pack", "_unpack", "_decode_relu_block", "_decode_sums", "_decode_dx_block",
               "_forward_exact", "_exact_sums", "_exact_dx_block", "_stats")
# unbiased_cpu's (--rounding stochastic or dither)
UNBIASED_ASM_KERNELS = ("_forward_rows", "_range", "_draw_each", "_draw_dither", "_draw_systematic", "_decode_rows",
                        "_conv_input", "_backward_rows", "_sums", "_dx")


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


def kernel_cases(C, M, bits, rounding="nearest"):
    """(name, exact twin, bytes moved per element, call, setup) for one unit shape. The calls are
    the engine's: forward in place (out is x), backward in place (dx is dr, restored untimed).
    rounding stochastic or dither: the unbiased code's kernels in place of the window code's
    (their slot's bytes per element, metadata included, in place of bits/8)."""
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
    xhat = ((x - mean[:, None]) * rstd[:, None]).astype(F)
    out, buf = np.empty_like(x), x.copy()
    grad = rng.standard_normal(x.shape).astype(F)
    dr, dg, db = grad.copy(), np.zeros(C, F), np.zeros(C, F)
    fresh = lambda: np.copyto(dr, grad)                                        # noqa: E731
    copy = lambda: threads.parallel_for(lambda c0, c1: np.copyto(out[c0:c1], x[c0:c1]), C)  # noqa: E731
    if rounding == "nearest":
        qp = window.quant_params(g, b, bits)
        packed = np.empty(packing.packed_nbytes(x.size, bits), np.uint8)
        window.quantize_pack(packed, xhat, qp)
        tag, kb = f"{bits}-bit", bits / 8
        extra = [("bn_stats", None, 8, lambda: fast.bn_stats(mean, var, rstd, x, 1e-5), None)]
        forward = lambda: fast.unit_forward_code(buf, packed, buf, mean, rstd, g, b, qp, False)   # noqa: E731
        conv_input = lambda: fast.conv_input(out, None, packed, qp, g, b)                         # noqa: E731
        backward = lambda: fast.unit_backward(dr, dg, db, dr, None, packed, qp, g, b, rstd, False)  # noqa: E731
    else:
        from lowmem.units import unbiased, unbiased_cpu as ub
        dither = rounding == "dither"
        slot = np.zeros(unbiased.slot_nbytes(C, M, bits, dither), np.uint8)
        unbiased.quantize_pack(slot, xhat, g, b, bits, 7, dither=dither)     # the reference: no JIT before the timing
        tag, kb, extra = f"{bits}-bit {rounding}", slot.size / x.size, []
        forward = lambda: ub.unit_forward(buf, slot, buf, mean, rstd, g, b, bits, False, 7, dither=dither)  # noqa: E731
        conv_input = lambda: ub.decode(out, slot, g, b, bits, relu=True, dither=dither)                 # noqa: E731
        backward = lambda: ub.unit_backward(dr, dg, db, dr, slot, g, b, rstd, bits, False, dither=dither)  # noqa: E731
    return [("plain copy", None, 8, copy, None)] + extra + [
        ("forward exact", None, 12, lambda: fast.unit_forward_exact(buf, xhat, buf, mean, rstd, g, b), None),
        (f"forward {tag}", "forward exact", 8 + kb, forward, None),
        ("conv input exact", None, 8, lambda: fast.conv_input(out, xhat, None, None, g, b), None),
        (f"conv input {tag}", "conv input exact", 4 + kb, conv_input, None),
        ("backward exact", None, 20,
         lambda: fast.unit_backward(dr, dg, db, dr, xhat, None, None, g, b, rstd, False), fresh),
        (f"backward {tag}", "backward exact", 12 + 2 * kb, backward, fresh),
    ]


def worker(args):
    """Time every fused kernel on ResNet-164's unit shapes, or --shape's (this process,
    args.threads lowmem threads); count the vector registers in their compiled code. Prints
    RESULT json."""
    from lowmem.system import threads  # the parent gave this process an empty NUMBA_CACHE_DIR:
    from lowmem.units import window_cpu as fast          # first calls time the JIT, and inspect_asm works
    threads.configure(args.threads)
    if args.split_work is not None:
        from lowmem.units import cpu_base
        cpu_base.SPLIT_WORK = args.split_work
    if not fast.AVAILABLE:
        harness.result_line({"status": "numba not installed"})
        return 0
    rows, first_call_s = [], {}
    for C, M in args.shape or KERNEL_SHAPES:
        cases = kernel_cases(C, M, args.bits, args.rounding)
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
    from lowmem.units import unbiased_cpu
    module, names = (fast, ASM_KERNELS) if args.rounding == "nearest" else (unbiased_cpu, UNBIASED_ASM_KERNELS)
    for name in names:
        disp = getattr(module, name, None)
        if disp is None:                                     # an older checkout's kernel set
            asm[name] = "n/a (absent)"
            continue
        if not disp.signatures:                              # inline="always": compiled into its callers only
            asm[name] = "inlined"
            continue
        try:
            text = "\n".join(disp.inspect_asm().values())
        except Exception as e:                               # cached code cannot be inspected
            asm[name] = f"n/a ({type(e).__name__})"
            continue
        asm[name] = {"ymm": len(re.findall(r"%ymm", text)), "zmm": len(re.findall(r"%zmm", text))}
    res = dict(status="ok", threads=threads.threads(), bits=args.bits, rounding=args.rounding, rows=rows,
               first_call_s=first_call_s, asm=asm, source_sha=harness.source_hash())
    harness.result_line(res)
    return 0


def kernel_table(res):
    head = (f"{'unit (C x N*H*W)':<17} {'kernel':<28} {'ms':>8} {'GB/s':>7} {'B/elem':>7} {'/ exact twin':>12} "
            f"{'/ copy GB/s':>11}")
    lines = [head, "-" * len(head)]
    for r in res["rows"]:
        ratio = f"{r['ratio_to_twin']:.2f}" if r["ratio_to_twin"] is not None else "-"
        lines.append(f"{r['shape']:<17} {r['kernel']:<28} {r['ms']:>8.3f} {r['gb_s']:>7.1f} "
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




def unit_shape(text):
    """--shape C,M: two positive integers."""
    try:
        C, M = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a unit shape is C,M (two integers), got {text!r}") from None
    if min(C, M) < 1:
        raise argparse.ArgumentTypeError(f"a unit shape's sizes must be positive, got {text!r}")
    return C, M


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, default=4, choices=(8, 4, 2, 1), help="bit width (default: %(default)s)")
    ap.add_argument("--rounding", default="nearest", choices=("nearest", "stochastic", "dither"),
                    help="the window code's kernels (nearest) or the unbiased code's (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="lowmem threads (default: os.cpu_count() = %(default)s)")
    ap.add_argument("--shape", action="append", type=unit_shape, metavar="C,M",
                    help="a unit of C channels of M = N*H*W elements (repeatable; default: ResNet-164's at batch 128)")
    ap.add_argument("--split-work", type=int, metavar="N",
                    help="split a kernel call between the threads from N plain-copy elements a thread "
                         "(units/cpu_base.SPLIT_WORK; default: lowmem's; 1: split every call)")
    ap.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    harness.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.split_work is not None and args.split_work < 1:
        ap.error(f"--split-work must be at least 1, got {args.split_work}")
    for C, M in args.shape or ():
        if M * args.bits % 8:
            ap.error(f"--shape {C},{M}: M*bits must be a multiple of 8 (the kernels' byte-aligned rows)")
    if args.worker:
        sys.path.insert(0, harness.ROOT)
        return worker(args)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    info = harness.machine_info()
    print(f"machine: {harness.machine_line(info)}\n{harness.libraries_line(info)}", flush=True)
    cache = tempfile.mkdtemp(prefix="lowmem-numba-")
    try:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--bits", str(args.bits),
               "--threads", str(args.threads), "--rounding", args.rounding]
        for C, M in args.shape or ():
            cmd += ["--shape", f"{C},{M}"]
        if args.split_work is not None:
            cmd += ["--split-work", str(args.split_work)]
        k = harness.run_supervised(cmd, harness.Supervision.from_args(args), log, label="unit kernels",
                                   env=dict(os.environ, NUMBA_CACHE_DIR=cache), done=lambda r: "rows" in r)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if k["status"] != "ok":
        print(f"kernel table: {k['status']}")
        return 1
    split = f", split from {args.split_work} copies a thread" if args.split_work is not None else ""
    print(f"fused kernels, {k['threads']} lowmem thread(s){split}, {k['bits']}-bit, rounding {k['rounding']}; "
          f"best of 3 rounds x 6 calls; "
          f"bytes moved per element as counted in kernel_cases; load 1m {k['load_before'][0]:.2f}, "
          f"others {k['other_cpus_during']:.2f} CPUs")
    print(kernel_table(k))
    for name, v in kernel_summary(k).items():
        print(f"{name:<28} worst / exact twin {v['worst_ratio']:.2f} (target <= 1.3: "
              f"{'met' if v['worst_ratio'] <= 1.3 else 'MISSED'}); worst share of copy GB/s "
              f"{v['worst_of_copy']:.2f} (target >= 0.5: {'met' if v['worst_of_copy'] >= 0.5 else 'MISSED'})")
    print("vector registers in the compiled kernels (ymm = AVX2, zmm = AVX-512): " +
          ", ".join(f"{n} {a['ymm']}/{a['zmm']}" if isinstance(a, dict) else f"{n} {a}" for n, a in k["asm"].items()))
    print("first call (JIT compile, empty cache), s: " + ", ".join(f"{n} {t:.2f}" for n, t in k["first_call_s"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "kernels": k}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
