"""Choose the quantizer's window per bit width K from measured gradient errors.

    python benchmarks/window_sweep.py --json benchmarks/results/window_sweep.json \\
        --md benchmarks/results/window_sweep.md
    python benchmarks/window_sweep.py --bits 8 --windows 8:3,4,5 --nets resnet20   # a quick look
    python benchmarks/window_sweep.py --xhat-table     # x̂ error: rounding vs clipping, ±3 and window.WINDOWS

The grid of lowmem/units/window.py covers about ±W in x̂ units with L = 2**K bins of
width w = 2·W/L; W = window.WINDOWS[K]. For every candidate W of every K this
measures, on the same weights and the same batches:

  gradient error   per parameter tensor p, over B batches b (as lowmem.tools.gradient_error):
                   err(p) = rms_b ||g_approx,b(p) − g_exact,b(p)|| / rms_b ||g_exact,b(p)||
                   reported as the median and the worst over the network's tensors;
                   approx mode, float32, learnable synthetic data (gradient_error.synthetic_batches)
  x̂ error          relative rms error ||x̃ − x̂|| / ||x̂|| of window.quantize_simulated on
                   (a) a standard Gaussian, centred grid (exact integrals, no sampling), and
                   (b) the x̂ of every BN-ReLU unit of a float64 ResNet-20 (median over units)

on several networks (default: ResNet-20, ResNet-8 and the bottleneck ResNet-11 and -29 at
initialisation, and ResNet-20 after 100 exact SGD steps on the same kind of data; batch 32,
8 batches). It also finds the W minimising the
Gaussian error for each K (golden-section search).

The tables are rewritten after every network (a stopped sweep keeps what it measured);
--from-log rebuilds them from the printed log of an earlier run without measuring again.

The choice rule: for each K, the candidate W with the smallest mean, over the networks,
of the median per-tensor gradient error. The table marks it, and marks window.WINDOWS's
current value; the two should agree (the window in units/window.py is set from this table).

Only dyadic-friendly W are allowed (window.half_width checks: w = m·2**e with small odd m):
multiples of 1/4 such as 2.75, 4.5.
"""
import argparse
import copy
import json
import math
import os
import re
import sys
import time
from contextlib import contextmanager

import numpy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowmem.tools import gradient_error as D  # noqa: E402
from lowmem.units import widths, window  # noqa: E402
from lowmem.core.engine import Engine                # noqa: E402
from lowmem.models import preact_resnet_cifar   # noqa: E402

CANDIDATES = {8: (3.0, 5.0, 5.5, 6.0, 6.5, 7.0),
              4: (3.0, 3.25, 3.5, 3.75, 4.0),
              2: (2.0, 2.25, 2.5, 3.0, 3.5),
              1: (1.5, 1.75, 2.0, 2.5, 3.0)}
# (narrowed from a wider sweep on ResNet-20: benchmarks/results/window_sweep_wide_resnet20.md)

# label -> (depth, block, exact warm-up steps before measuring)
NETS = {"resnet20": (20, "basic", 0),
        "resnet8": (8, "basic", 0),
        "bottleneck11": (11, "bottleneck", 0),
        "bottleneck29": (29, "bottleneck", 0),
        "resnet20-warm100": (20, "basic", 100)}
DEFAULT_NETS = tuple(NETS)


@contextmanager
def window_override(bits, W):
    """window.WINDOWS[bits] = W inside the block (checked by window.half_width), restored after."""
    old = window.WINDOWS[bits]
    window.WINDOWS[bits] = W
    try:
        window.half_width(bits)
        yield
    finally:
        window.WINDOWS[bits] = old


# ---- x̂ error on a Gaussian, exact integrals ---------------------------------

def _phi(x):
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi) if math.isfinite(x) else 0.0


def _Phi(x):
    return 0.5 * (1 + math.erf(x / math.sqrt(2))) if math.isfinite(x) else (1.0 if x > 0 else 0.0)


def _sq_err(a, b, m):
    """∫_a^b (x − m)² φ(x) dx for the standard normal density φ (a, b may be ±inf)."""
    def F(x):                                   # an antiderivative of (x² − 2mx + m²)φ
        xphi = 0.0 if not math.isfinite(x) else x * _phi(x)
        return _Phi(x) - xphi + 2 * m * _phi(x) + m * m * _Phi(x)
    return F(b) - F(a)


def gaussian_rel_rms(W, bits):
    """Relative rms error of the centred grid lo = −W (midpoint decode, saturating end
    bins) on a standard Gaussian: sqrt(E[(x̃ − x)²]) (E[x²] = 1)."""
    L = 1 << bits
    w = 2 * W / L
    total = 0.0
    for c in range(L):
        a = -math.inf if c == 0 else -W + c * w
        b = math.inf if c == L - 1 else -W + (c + 1) * w
        total += _sq_err(a, b, -W + (c + 0.5) * w)
    return math.sqrt(total)


def gaussian_optimum(bits, lo=0.3, hi=10.0, iters=80):
    """(W, error) minimising gaussian_rel_rms for `bits` (golden-section search; unimodal)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = gaussian_rel_rms(c, bits), gaussian_rel_rms(d, bits)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = gaussian_rel_rms(c, bits)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = gaussian_rel_rms(d, bits)
    W = (a + b) / 2
    return W, gaussian_rel_rms(W, bits)


# ---- x̂ of a real network ------------------------------------------------------

def network_xhats(net, batch, seed=0):
    """[(xhat (C, M) float64, gamma, beta)] for every BN-ReLU unit of `net` on one synthetic
    batch: captured from window.quantize_pack in a float64 approx Engine (float64 always takes
    the NumPy path, so every unit's x̂ passes through window.quantize_pack)."""
    x, y = D.synthetic_batches(1, batch, (net.in_channels, 32, 32), net.num_classes, seed, "float64")[0]
    eng = Engine(copy.deepcopy(net), batch, x.shape[1:], "approx", 4, "float64")
    got, real = [], window.quantize_pack

    def capture(packed_out, xhat, qp):
        got.append((numpy.array(xhat, numpy.float64).reshape(qp.channels, -1), qp.gamma.copy(), qp.beta.copy()))
        real(packed_out, xhat, qp)

    window.quantize_pack = capture
    try:
        eng.forward(x, y)
    finally:
        window.quantize_pack = real
    if not got:
        raise RuntimeError("no x-hat captured: the Engine no longer calls window.quantize_pack "
                           "on its float64 path")
    return got


def xhat_rel_rms(units, bits):
    """Median over units of ||x̃ − x̂|| / ||x̂|| with the current window."""
    errs = []
    for xh, g, b in units:
        xt, _ = window.quantize_simulated(xh, g, b, bits)
        errs.append(float(numpy.linalg.norm(xt - xh) / numpy.linalg.norm(xh)))
    return float(numpy.median(errs))


def gaussian_split(W, bits):
    """(in-window, clipping) parts of gaussian_rel_rms: total² = in² + clip²."""
    L = 1 << bits
    w = 2 * W / L
    inner = sum(_sq_err(-W + c * w, -W + (c + 1) * w, -W + (c + 0.5) * w) for c in range(L))
    tails = _sq_err(-math.inf, -W, -W + 0.5 * w) + _sq_err(W, math.inf, W - 0.5 * w)
    return math.sqrt(inner), math.sqrt(tails)


def unit_split(units, bits):
    """Per unit (total, in-window part, clipping part) of ||x̃ − x̂|| / ||x̂||, and the fraction
    of all x̂ beyond ±W, with the current window. An element is "clipped" when its raw bin
    index floor((s·x̂ − lo)/w) lies outside [0, L−1] (it saturated into an end bin)."""
    rows, beyond, n = [], 0, 0
    for xh, g, b in units:
        xt, _ = window.quantize_simulated(xh, g, b, bits)
        qp = window.quant_params(g, b, bits)
        raw = numpy.floor((xh * qp.s[:, None] - qp.lo[:, None]) / qp.w)
        out = (raw < 0) | (raw > qp.levels - 1)
        e2, x2 = (xt - xh) ** 2, float((xh ** 2).sum())
        rows.append((math.sqrt(e2.sum() / x2), math.sqrt(e2[~out].sum() / x2), math.sqrt(e2[out].sum() / x2)))
        beyond += int((numpy.abs(xh) > qp.window).sum())
        n += xh.size
    return numpy.array(rows), beyond / n


def xhat_table(units, windows):
    """Markdown: the x̂ error of each K's window in `windows` ({K: W}), split into rounding
    inside the window and clipping beyond it, on a Gaussian and on the network's units."""
    lines = ["| K | W | w | w/√12 | Gaussian: total | in-window part | clipping part | "
             "ResNet-20 units: total, median (min–max) | clipping part (median) | x̂ beyond ±W |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for bits, W in windows.items():
        with window_override(bits, W):
            w = window.bin_width(bits)
            gi, gc = gaussian_split(W, bits)
            r, beyond = unit_split(units, bits)
            lines.append(f"| {bits} | {W:g} | {w:.5g} | {w / math.sqrt(12):.4f} | {gaussian_rel_rms(W, bits):.4f} | "
                         f"{gi:.4f} | {gc:.4f} | {numpy.median(r[:, 0]):.4f} ({r[:, 0].min():.4f}–"
                         f"{r[:, 0].max():.4f}) | {numpy.median(r[:, 2]):.4f} | {100 * beyond:.3f}% |")
    return "\n".join(lines)


# ---- gradient error -------------------------------------------------------------

def grad_errors(net, batches, exact, bits):
    """Per-tensor relative error of approx mode (current window) against `exact`: (T,) array,
    sqrt(mean over batches of ||g_b - exact_b||^2 / mean over batches of ||exact_b||^2)."""
    g = D.parameter_grads(net, batches, "approx", bits)
    sq = lambda a: (a.reshape(len(a), -1) ** 2).sum(axis=1).mean()         # noqa: E731
    return numpy.array([math.sqrt(sq(g[n] - exact[n]) / sq(exact[n])) for n in exact])


def sweep_net(label, args, bits_list, candidates, log):
    depth, block, warm = NETS[label]
    net = preact_resnet_cifar(depth, num_classes=10, in_channels=3, seed=args.seed, block=block)
    shape = (3, 32, 32)
    batches = D.synthetic_batches(args.batches, args.batch, shape, 10, args.seed, "float32")
    if warm:
        wb = D.synthetic_batches(8, args.batch, shape, 10, args.seed + 1, "float32")
        net = D.warm_up(net, wb, warm, lr=0.05)
    t0 = time.time()
    exact = D.parameter_grads(net, batches, "exact")
    out = {}
    for bits in bits_list:
        for W in candidates[bits]:
            with window_override(bits, W):
                e = grad_errors(net, batches, exact, bits)
            out[(bits, W)] = {"median": float(numpy.median(e)), "worst": float(e.max()),
                              "worst_tensor": list(exact)[int(e.argmax())]}
            log(f"  {label:<18} {bits}-bit W={W:<5} median {out[(bits, W)]['median']:.4f} "
                f"worst {out[(bits, W)]['worst']:.4f} ({out[(bits, W)]['worst_tensor']})  "
                f"[{time.time() - t0:.0f} s]")
    return out


# ---- report ---------------------------------------------------------------------------

def choose(results, nets, bits, candidates):
    """The candidate W with the smallest mean over nets of the median per-tensor error."""
    score = {W: numpy.mean([results[n][(bits, W)]["median"] for n in nets]) for W in candidates[bits]}
    return min(score, key=score.get), score


def markdown(results, nets, bits_list, candidates, gauss, xhat, command, meta):
    lines = [f"Measured by `{command}`", "",
             f"{meta}", "",
             "Gradient error: per parameter tensor, rms over batches of ||g_approx − g_exact|| / "
             "rms over batches of ||g_exact||; each cell is median / worst over the network's tensors. "
             "x̂ error: relative rms ||x̃ − x̂|| / ||x̂|| (Gaussian: exact integral, centred grid; "
             "ResNet-20 units: median over its BN-ReLU units, one float64 batch). "
             "**bold**: the choice (smallest mean of the medians); (now): the value in window.WINDOWS.", ""]
    for bits in bits_list:
        best, score = choose(results, nets, bits, candidates)
        gW, gE = gauss["optimum"][bits]
        lines.append(f"### K = {bits}  (Gaussian-optimal W = {gW:.3f}, error {gE:.4f})")
        lines.append("")
        head = "| W | w | x̂ err Gaussian | x̂ err ResNet-20 | " + " | ".join(nets) + " | mean of medians |"
        lines += [head, "|" + "---|" * (5 + len(nets))]
        for W in candidates[bits]:
            cells = [f"{results[n][(bits, W)]['median']:.4f} / {results[n][(bits, W)]['worst']:.4f}" for n in nets]
            name = f"**{W:g}**" if W == best else f"{W:g}"
            name += " (now)" if W == window.WINDOWS[bits] else ""
            lines.append(f"| {name} | {2 * W / (1 << bits):.5g} | {gauss[(bits, W)]:.4f} | "
                         f"{xhat[(bits, W)]:.4f} | " + " | ".join(cells) + f" | {score[W]:.4f} |")
        lines.append("")
    return "\n".join(lines)


def write_report(args, results, nets, bits_list, candidates, gauss, xhat, command, meta):
    """The markdown tables (returned), and --md / --json written (after every network, so a
    stopped sweep keeps what it measured)."""
    md = markdown(results, nets, bits_list, candidates, gauss, xhat, command, meta)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md + "\n")
    if args.json:
        data = {"command": command, "meta": meta, "windows_now": {str(b): window.WINDOWS[b] for b in bits_list},
                "gaussian_optimum": {str(b): gauss["optimum"][b] for b in bits_list},
                "rows": [{"bits": b, "W": W, "w": 2 * W / (1 << b), "gaussian_xhat_err": gauss[(b, W)],
                          "resnet20_xhat_err": xhat[(b, W)],
                          **{n: results[n][(b, W)] for n in nets}}
                         for b in bits_list for W in candidates[b]]}
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return md


LOG_LINE = re.compile(r"^\s+(\S+)\s+(\d)-bit W=(\S+)\s+median (\S+) worst (\S+) \((\S+)\)")


def results_from_log(path, nets):
    """The gradient errors of `nets` as this script's log printed them (4 decimals), so the
    tables of a sweep that was stopped part-way can be rebuilt without measuring again."""
    out = {}
    with open(path) as f:
        for line in f:
            m = LOG_LINE.match(line)
            if m and m.group(1) in nets:
                out.setdefault(m.group(1), {})[(int(m.group(2)), float(m.group(3)))] = {
                    "median": float(m.group(4)), "worst": float(m.group(5)), "worst_tensor": m.group(6)}
    return out


def parse_windows(text):
    """'8:3,4,5;4:2.5,3' -> {8: (3.0, 4.0, 5.0), 4: (2.5, 3.0)}."""
    out = {}
    for part in text.split(";"):
        k, _, ws = part.partition(":")
        out[widths.check_bits(int(k))] = tuple(float(w) for w in ws.split(","))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bits", default="8,4,2,1", help="bit widths to sweep (default: %(default)s)")
    p.add_argument("--windows", default=None, help="candidates, e.g. '8:3,4,5;4:2.5,3' (default: built in)")
    p.add_argument("--nets", default=",".join(DEFAULT_NETS), help=f"from {list(NETS)} (default: %(default)s)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write all numbers here")
    p.add_argument("--md", default=None, help="write the markdown tables here")
    p.add_argument("--xhat-table", action="store_true",
                   help="only print the x̂ error split (rounding / clipping) of W = 3 and of window.WINDOWS")
    p.add_argument("--from-log", default=None, metavar="LOG",
                   help="take the gradient errors of the nets this log of the script has from it "
                        "(4 decimals) instead of measuring them again; measure the rest")
    args = p.parse_args(argv)
    bits_list = [widths.check_bits(int(b)) for b in args.bits.split(",")]
    if args.xhat_table:
        units = network_xhats(preact_resnet_cifar(20, seed=args.seed), args.batch, args.seed)
        for title, win in (("the paper's window, W = 3 for every K", {b: 3.0 for b in bits_list}),
                           ("lowmem's windows, window.WINDOWS", {b: window.WINDOWS[b] for b in bits_list})):
            print(f"x̂ error, {title}; ResNet-20 (depth 20, seed {args.seed}) at initialisation, one float64 "
                  f"batch of {args.batch} synthetic images, {len(units)} BN-ReLU units:\n")
            print(xhat_table(units, win) + "\n")
        return 0
    candidates = dict(CANDIDATES)
    if args.windows:
        candidates.update(parse_windows(args.windows))
    nets = args.nets.split(",")
    for n in nets:
        if n not in NETS:
            raise SystemExit(f"unknown net {n!r}: expected one of {list(NETS)}")
    for bits in bits_list:                       # reject non-exact windows before any work
        for W in candidates[bits]:
            with window_override(bits, W):
                pass
    command = "python benchmarks/window_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:])
    log = lambda s: print(s, flush=True)          # noqa: E731
    t0 = time.time()
    gauss = {"optimum": {b: gaussian_optimum(b) for b in bits_list}}
    for bits in bits_list:
        for W in candidates[bits]:
            gauss[(bits, W)] = gaussian_rel_rms(W, bits)
        log(f"Gaussian-optimal window {bits}-bit: W = {gauss['optimum'][bits][0]:.3f} "
            f"(relative rms error {gauss['optimum'][bits][1]:.4f})")
    units = network_xhats(preact_resnet_cifar(20, seed=args.seed), args.batch, args.seed)
    xhat = {}
    for bits in bits_list:
        for W in candidates[bits]:
            with window_override(bits, W):
                xhat[(bits, W)] = xhat_rel_rms(units, bits)
    results = results_from_log(args.from_log, nets) if args.from_log else {}
    for n in nets:
        if n not in results:
            results[n] = sweep_net(n, args, bits_list, candidates, log)
        done = [m for m in nets if m in results]
        meta = (f"batch {args.batch}, {args.batches} batches of lowmem.data.datasets.synthetic (seed {args.seed}), "
                f"float32, approx mode; nets: " + ", ".join(
                    f"{m} (depth {NETS[m][0]} {NETS[m][1]}, {NETS[m][2]} exact warm-up steps)" for m in done)
                + (f"; rebuilt from the log {args.from_log}" if args.from_log else
                   f"; {time.time() - t0:.0f} s so far") + ("" if len(done) == len(nets) else " (partial)") + ".")
        md = write_report(args, results, done, bits_list, candidates, gauss, xhat, command, meta)
    print()
    print(md)
    for bits in bits_list:
        best, _ = choose(results, nets, bits, candidates)
        print(f"{bits}-bit: measured choice W = {best:g}; window.WINDOWS[{bits}] = {window.WINDOWS[bits]:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
