"""The paper's claim, measured: test accuracy of exact, approx and naive training, and the
gradient error against SGD noise through training.

    python benchmarks/accuracy.py          # the full-data study (below): hours on a 2-core machine
    python benchmarks/accuracy.py --report-only   # write the doc from the runs finished so far
    python benchmarks/accuracy.py --smoke  # 7 min on a shared 2-core machine: proves the script works
    python benchmarks/accuracy.py --dataset cifar10 --depth 20 --epochs 30   # where CIFAR is present

The default study is what a user runs: `lowmem train --dataset fashion-mnist --pad-to 0 --depth 20
--batch 128 --epochs 5 --schedule cosine --seed S` on the whole Fashion-MNIST (60,000 training and
10,000 test images), with only --mode / --bits / --rounding changed: exact, approx 2-bit unbiased
(rounding="stochastic"), 2-bit with the subtractive dither (rounding="dither") and 4-bit unbiased
for seeds 0, 1, 2, then 4-bit dithered for the three seeds; its page is the "full" section of
docs/accuracy.md.

Part 1, accuracy. The same network (pre-activation ResNet, lowmem.models) is trained with
lowmem.train.trainer in every mode of --modes for every seed of --seeds. A seed fixes the initial
weights, the batch order and the augmentation (random crop + flip), so for one seed every mode
sees exactly the same data in the same order and starts from the same weights: the modes differ
only in what the backward pass uses. Runs go seed by seed, each seed's modes in the order given,
so every finished seed is a complete paired group; a "/" in --modes starts a phase that runs
only after every seed of the phases before it (the comparisons that matter most finish first). Per mode the report gives the final test
accuracy (mean, sample standard deviation, range over seeds) and the difference to exact,
computed per seed (paired) and summarised as mean ± standard error with a 95% t interval: each
mode over the seeds it has finished, each difference over the seeds both modes have (a study
still running reports what has finished).

Part 2, gradient error against SGD noise through training. Along the exact run of the first
seed, at --checkpoints evenly spaced iterations (the first before any step), the network's
current weights are copied and, on B = --noise-batches fixed training batches of the training
batch size (drawn once, normalised, not augmented), every parameter tensor p gets
(lowmem.tools.gradient_error's definitions):

    g_m,b(p)   the gradient of mode m on batch b (training-mode BN, the batch's own statistics)
    error(p)   = rms_b ||g_m,b(p) − g_exact,b(p)||                      (the approximation's error)
    noise(p)   = sqrt(B/(B−1) · mean_b ||g_exact,b(p) − ḡ(p)||²),  ḡ = mean_b g_exact,b
                                                       (the spread of exact mini-batch gradients)
    ratio(p)   = error(p) / noise(p)

||·|| is the Euclidean norm over the tensor's elements; p runs over every conv and FC weight and
bias and every BN γ and β. The report plots the median and the worst ratio over tensors against
the iteration for each of --noise-modes.

Output (--out, default runs/accuracy): results.json, rewritten atomically after every finished
run and every noise checkpoint, and one run folder per run (--out/runs/<mode>-seed<S>: the
trainer's checkpoint at every epoch's end and on SIGINT/SIGTERM, metrics.jsonl). Stopped
however (Ctrl-C, kill, a crash, a reboot), the study continues where it stopped when the same
command is run again: finished runs are not repeated, an unfinished one resumes from its last
checkpoint (lowmem's resume is exact: the same weights, data order, augmentation and draws as
an uninterrupted run). The first seed's exact run also keeps a copy of its checkpoint at every
epoch's end (epoch<E>.ckpt), the weights along training for later measurements. Pausing the
process (SIGSTOP / SIGCONT) changes nothing but the times it records. Then --doc (default
docs/accuracy.md; with --section NAME only the part of the page between that section's markers,
added before the page's first "## " heading if absent, the rest of the page kept) and its two plots
(<doc>[_<section>]_curves.png, _noise.png; need matplotlib, `pip install lowmem[plot]`: without
it the doc is written without them). --headline PAGE (default for the full study:
docs/results.md) also writes the study's headline table into PAGE, right after its "## Accuracy"
heading, once a mode has 3 seeds paired with exact (the page is left alone before). --report-only
trains nothing and writes neither results.json nor a run folder: only the doc, its plots and the
headline. --smoke labels everything as a smoke run.

Data: Fashion-MNIST from the Debian package (/usr/share/datasets/fashion-mnist, see lowmem.data.datasets)
or --data-dir; CIFAR-10/100 only where the archive is already present (never downloaded here).
"""
import argparse
import copy
import functools
import json
import math
import os
import platform
import re
import statistics
import sys
import time

import numpy
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowmem.tools import gradient_error as D  # noqa: E402
from lowmem.units import unbiased, widths, window  # noqa: E402
from lowmem.system.atomic import atomic_write as write_atomically    # noqa: E402
from lowmem.data.datasets import load_dataset                            # noqa: E402
from lowmem.data.files import DataError                                  # noqa: E402
from lowmem.data.transforms import normalize                             # noqa: E402
from lowmem.models import MODELS                                  # noqa: E402
from lowmem.core.engine import Engine                              # noqa: E402
from lowmem.bits.allocate import allocate_bits                         # noqa: E402
from lowmem.train.config import TrainConfig                           # noqa: E402
from lowmem.bits.auto import training_batches                         # noqa: E402
from lowmem.train.rundir import CHECKPOINT, read_metrics                # noqa: E402
from lowmem.train.trainer import Trainer                              # noqa: E402
from harness import cpu                                              # noqa: E402 (benchmarks/harness.py)

# The full study: the user's recipe (module docstring) on all of Fashion-MNIST, 15 runs of 2,340
# steps, the draw noise measured at every epoch's end of the first seed's exact run. (The dithered
# rows came after the first modes; a results file of those alone continues with them: a run's key
# is its mode and seed, whatever the order.)
FULL = dict(dataset="fashion-mnist", depth=20, batch=128, epochs=5, lr=0.1, limit_train=None,
            limit_test=None, seeds="0,1,2", modes="exact,approx2u,approx2d,approx4u/approx4d",
            checkpoints=6, noise_batches=8, noise_modes="approx2u,approx4u", section="full",
            headline="docs/results.md")
SMOKE = dict(dataset="fashion-mnist", depth=8, batch=128, epochs=2, lr=0.1, limit_train=768,
             limit_test=256, seeds="0,1", modes="exact,approx4,naive4", checkpoints=3, noise_batches=2,
             noise_modes="approx4,approx2,naive4", section=None, headline=None)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


class Spec(tuple):
    """(mode, bits, rounding, avg): bits an int, or "auto" with avg the average bits it fits."""
    __slots__ = ()

    def __new__(cls, mode, bits, rounding="nearest", avg=None):
        return super().__new__(cls, (mode, bits, rounding, avg))

    mode, bits, rounding, avg = (property(lambda self, i=i: self[i]) for i in range(4))


SUFFIX = {"": "nearest", "u": "stochastic", "s": "stochastic-window", "d": "dither"}


def parse_mode(text):
    """'exact'; 'approx4' / 'naive4' (K in 1, 2, 4, 8); 'auto2' (approx, a width per unit chosen
    to fit an average of 2 bits, lowmem/bits/allocate.py); a trailing 'u': the unbiased code
    (rounding="stochastic"), 'd': the unbiased code with a subtractive dither ("dither"), 's': the
    fixed window with stochastic rounding ("stochastic-window")."""
    m = re.fullmatch(r"(exact)|(approx|naive)([1248])([uds]?)|auto(\d+(?:\.\d+)?)([uds]?)", text.strip())
    if not m:
        raise ValueError(f"unknown mode {text!r}: expected exact, approxK, naiveK (K in 1, 2, 4, 8) or autoA, "
                         f"each but exact with an optional u (unbiased code), d (the unbiased code dithered) "
                         f"or s (window stochastic rounding)")
    if m.group(1):
        return Spec("exact", 4)
    if m.group(2):
        return Spec(m.group(2), int(m.group(3)), SUFFIX[m.group(4)])
    return Spec("approx", "auto", SUFFIX[m.group(6)], float(m.group(5)))


def label(spec):
    mode, bits, rounding, avg = spec
    if mode == "exact":
        return mode
    text = f"auto {avg:g}-bit avg" if bits == "auto" else f"{mode} {bits}-bit"
    return text + {"nearest": "", "stochastic": " unbiased", "stochastic-window": " stochastic",
                   "dither": " dithered"}[rounding]


def phases_of(text):
    """--modes as phases of mode specs: modes separated by "," run seed by seed in the order given;
    a "/" starts a phase that runs only after every seed of the phases before it."""
    return [[parse_mode(m) for m in part.split(",") if m.strip()] for part in text.split("/")]


def seeds_of(text):
    return [int(s) for s in text.split(",")]


# ---- results file ---------------------------------------------------------------------

def atomic_write(path, text):
    """Write `text` to `path` (its folder made if missing) via lowmem.system.atomic: never half-written."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomically(path, text)


def load_results(path, settings):
    """The runs already in `path` whose settings equal `settings` (else a fresh study)."""
    if not os.path.exists(path):
        return {"settings": settings, "runs": {}, "noise": None}
    with open(path) as f:
        old = json.load(f)
    if old.get("settings") != settings:
        raise SystemExit(f"{path} holds a study with other settings; use another --out, or delete it "
                         f"to start again")
    return old


# ---- part 1: one training run -----------------------------------------------------------

def config_for(args, spec, seed, out=None):
    """The run's TrainConfig: `lowmem train`'s defaults but for the study's settings (the module
    docstring's user command; tests/benchmarks/test_accuracy.py checks the two agree)."""
    return TrainConfig(dataset=args.dataset, data_dir=args.data_dir, download=False, pad_to=args.pad_to,
                       limit_train=args.limit_train, limit_test=args.limit_test, depth=args.depth,
                       mode=spec.mode, bits=spec.bits, avg_bits=spec.avg, rounding=spec.rounding,
                       batch=args.batch, epochs=args.epochs, lr=args.lr, schedule="cosine", seed=seed,
                       augment=not args.no_augment, out=out, progress=False)


class Stopped(Exception):
    """A run stopped before its last step (SIGINT / SIGTERM); its checkpoint is on disk."""


def run_folder(args, spec, seed):
    """--out/runs/<mode>-seed<S>: the run's checkpoint and metrics.jsonl (lowmem/train/rundir.py)."""
    return os.path.join(args.out, "runs", f"{re.sub(r'[^a-z0-9.]+', '-', label(spec))}-seed{seed}")


def keep_epoch_checkpoints(trainer, record):
    """on_epoch: a copy of the checkpoint just written, as <run folder>/epoch<E>.ckpt (atomic)."""
    with open(trainer.ckpt_path, "rb") as f:
        atomic_write(os.path.join(trainer.out, f"epoch{record['epoch']}.ckpt"), f.read())


def train_run(args, data, spec, seed, on_step=None, on_epoch=None, log=print):
    """Train one (spec, seed) in its run folder, resuming from the folder's checkpoint if one is
    there; returns {"final_test_acc", "history", "seconds"} (auto: also the widths chosen, their
    saved bytes and uniform 2-bit's, the predicted error/noise). seconds: the steps' and the
    evaluations' time over the whole run (every resumed part), pauses included. Raises Stopped
    if a signal stopped the run."""
    out = run_folder(args, spec, seed)
    resume = os.path.exists(os.path.join(out, CHECKPOINT))
    if resume:
        log(f"    resuming from {os.path.join(out, CHECKPOINT)}")
    trainer = Trainer(config_for(args, spec, seed, out), dataset=data, resume=resume,
                      overwrite=not resume and os.path.isdir(out), on_step=on_step, on_epoch=on_epoch,
                      log=lambda s: log(f"    {s}"))
    extra = {}
    if trainer.allocation is not None:
        a = trainer.allocation
        extra = {"bits": a.bits, "saved_code_bytes": a.total_bytes, "uniform2_bytes": a.uniform_bytes[2],
                 "predicted_ratio": a.predicted_ratio, "measure_seconds": None}
        log("    allocation: " + ", ".join(f"{u} {k}" for u, k in a.bits.items())
            + f"; saved x-hat {a.total_bytes:,} B (uniform 2-bit {a.uniform_bytes[2]:,} B)")
    elif spec.bits == "auto":                   # resumed: the checkpoint's widths
        extra = {"bits": trainer.widths}
    if on_step is not None:
        on_step(trainer, None)                  # the checkpoint before the first (or resumed) step
    result = trainer.fit()
    if result.status != "finished":
        raise Stopped(f"{label(spec)}, seed {seed}: {result.status} at iteration {result.iteration}")
    hist = [{k: r[k] for k in ("epoch", "iteration", "train_loss", "train_acc", "test_loss", "test_acc",
                               "train_time_s", "eval_time_s")} for r in read_metrics(out) if r.get("event") == "epoch"]
    seconds = sum(h["train_time_s"] + h["eval_time_s"] for h in hist)
    return {"final_test_acc": result.test_acc, "history": hist, "seconds": seconds, **extra}


# ---- part 2: gradient error against SGD noise at checkpoints -----------------------------

def noise_batches(data, batch, count, seed, dtype="float32"):
    """`count` fixed training batches (x float (batch, C, H, W), labels), normalised, no augmentation."""
    rng = numpy.random.default_rng([seed, 7])
    idx = rng.permutation(len(data.x_train))[:batch * count].reshape(count, batch)
    out = []
    for ix in idx:
        xb = data.x_train[ix]
        out.append((normalize(numpy.empty(xb.shape, dtype), xb, data.mean, data.std), data.y_train[ix]))
    return out


def measure_checkpoint(net, batches, modes, auto_bits):
    """Per tensor, the error and noise norms of ratio(p) (module docstring) for each mode spec
    (auto: the widths in auto_bits[label], those its run of the first seed trains with)."""
    exact = D.parameter_grads(net, batches, "exact")
    names = list(exact)
    B = len(batches)
    sq = lambda a: (a.reshape(a.shape[0], -1) ** 2).sum(axis=1)      # noqa: E731
    noise = numpy.array([math.sqrt(sq(exact[n] - exact[n].mean(axis=0, keepdims=True)).mean() * B / (B - 1))
                         for n in names])
    grad = numpy.array([math.sqrt(sq(exact[n]).mean()) for n in names])
    rec = {"names": names, "noise_norm": noise.tolist(), "grad_norm": grad.tolist(), "modes": {}}
    for spec in modes:
        bits = auto_bits[label(spec)] if spec.bits == "auto" else spec.bits
        # two independent draws of a stochastic code (one of nearest's): bias apart from noise
        draws = [D.parameter_grads(net, batches, spec.mode, bits, rounding=spec.rounding, seed=d)
                 for d in range(1 if spec.rounding == "nearest" else 2)]
        g = draws[0]
        bn = D.bias_and_noise(exact, draws)
        err = numpy.array([math.sqrt(sq(g[n] - exact[n]).mean()) for n in names])
        ratio = err / numpy.where(noise > 0, noise, numpy.nan)
        rel = err / numpy.where(grad > 0, grad, numpy.nan)
        worst = int(numpy.nanargmax(ratio))
        rec["modes"][label(spec)] = {
            "error_norm": err.tolist(), "median_ratio": float(numpy.nanmedian(ratio)),
            "worst_ratio": float(ratio[worst]), "worst_tensor": names[worst],
            "median_rel_error": float(numpy.nanmedian(rel)),
            "bias_ratio": bn["bias_ratio"], "draw_noise_ratio": bn["noise_ratio"] if len(draws) > 1 else 0.0}
    return rec


def noise_hook(args, data, template, checkpoints, total_iters, modes, store, log, auto_bits, saved=None):
    """on_step callback measuring at `checkpoints` (iteration numbers); records go to `store`,
    then saved(store) is called (the study writes them to its results file)."""
    batches = noise_batches(data, args.batch, args.noise_batches, args.noise_seed)

    def hook(trainer, loss):
        it = trainer.iteration
        if it not in checkpoints or any(r["iteration"] == it for r in store):
            return
        t = time.time()
        net = copy.deepcopy(template)
        net.load_state_dict(trainer.net.state_dict())
        rec = measure_checkpoint(net, batches, modes, auto_bits)
        rec["iteration"] = it
        rec["epoch"] = it / trainer.steps_per_epoch
        rec["seconds"] = time.time() - t
        store.append(rec)
        if saved is not None:
            saved(store)
        log("    noise @ iteration %d: " % it + "; ".join(
            f"{m} median {v['median_ratio']:.3g} worst {v['worst_ratio']:.3g}" for m, v in rec["modes"].items())
            + f" ({rec['seconds']:.0f} s)")
    return hook


# ---- report ---------------------------------------------------------------------------

def paired(results, name, base, seeds):
    """name − base per seed over the seeds of `seeds` where both runs have finished:
    {"seeds", "diff" (mean), "diff_se" (standard error; nan for one seed), "diff_ci" (95% t
    interval)}, or None if no seed has both."""
    runs = results["runs"]
    both = [s for s in seeds if f"{name}|{s}" in runs and f"{base}|{s}" in runs]
    if not both:
        return None
    d = [runs[f"{name}|{s}"]["final_test_acc"] - runs[f"{base}|{s}"]["final_test_acc"] for s in both]
    m = statistics.mean(d)
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
    t = T95.get(len(d) - 1, 1.96)
    return {"seeds": both, "diffs": d, "diff": m, "diff_se": se, "diff_ci": (m - t * se, m + t * se)}


def summarise(results, modes, seeds):
    """Per mode label with at least one finished run among `seeds`: its seeds, accuracies, mean,
    sd, and (paired) the difference to exact over the seeds where exact has finished too."""
    out = {}
    for m in modes:
        name = label(m)
        done = [s for s in seeds if f"{name}|{s}" in results["runs"]]
        if not done:
            continue
        a = [results["runs"][f"{name}|{s}"]["final_test_acc"] for s in done]
        row = {"seeds": done, "acc": a, "mean": statistics.mean(a),
               "sd": statistics.stdev(a) if len(a) > 1 else float("nan")}
        d = paired(results, name, "exact", seeds) if name != "exact" else None
        if d is not None:
            row.update(paired_seeds=d["seeds"], diff=d["diff"], diff_se=d["diff_se"], diff_ci=d["diff_ci"])
        out[name] = row
    return out


def saved_bits(spec, args):
    """Saved bits per element of the study network's BN-ReLU units under `spec`, metadata
    included: 32 exact, K for the window code; for the unbiased codes the plan's own figure
    (Engine.bits_per_element: the group ends, the dithered code's stream), at the study's batch
    and input."""
    if spec.mode == "exact":
        return "32"
    if spec.bits == "auto":
        return f"{spec.avg:g} on average"
    if spec.rounding not in ("stochastic", "dither"):
        return f"{spec.bits:g}"
    return plan_bits(spec.mode, spec.bits, spec.rounding, args.depth, args.batch,
                     tuple(args.input_shape), args.num_classes)


@functools.lru_cache(maxsize=None)
def plan_bits(mode, bits, rounding, depth, batch, input_shape, num_classes):
    """Engine.bits_per_element of the study's network as a string (once per code: the page's
    table and the headline's both ask)."""
    net = MODELS["preact-cifar"].build(depth, num_classes=num_classes, in_channels=input_shape[0], seed=0)
    eng = Engine(net, batch, input_shape, mode, bits, allocate=False, rounding=rounding)
    return f"{eng.bits_per_element():.5g}"


def comparisons(modes):
    """The pairs (dithered, unbiased) of the same width among `modes`: the dither's own effect."""
    names = {label(m) for m in modes}
    return [(n, n.replace(" dithered", " unbiased")) for n in sorted(names)
            if n.endswith(" dithered") and n.replace(" dithered", " unbiased") in names]


def pp(d):
    """A paired difference as text: mean ± s.e. pp and the 95% interval (one seed: its value)."""
    if not math.isfinite(d["diff_se"]):
        return f"{100 * d['diff']:+.2f} pp (one seed)", "—"
    return (f"{100 * d['diff']:+.2f} ± {100 * d['diff_se']:.2f} pp",
            f"[{100 * d['diff_ci'][0]:+.2f}, {100 * d['diff_ci'][1]:+.2f}]")


def _within(r, bound):
    """'met' if the 95% interval of the difference lies inside ±bound, 'missed' if it lies
    wholly outside, else 'not resolved' (the interval straddles the bound)."""
    lo, hi = r["diff_ci"]
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "not resolved (one seed)"
    if -bound <= lo and hi <= bound:
        return "met"
    if hi < -bound or lo > bound:
        return "missed"
    return "not resolved"


def gap_halved(s, auto, uniform):
    """The target of per-unit widths: auto's gap to exact at most half uniform's (paired means),
    with both numbers."""
    a, u = s[auto]["diff"], s[uniform]["diff"]
    ok = abs(a) <= 0.5 * abs(u)
    return (f"* {auto} vs {uniform}: the gap to exact at least halved: {'met' if ok else 'missed'} "
            f"({100 * a:+.2f} pp against {100 * u:+.2f} pp, paired means)")


def targets(s, noise, n_seeds):
    """Lines judging the measured numbers against the targets set before the runs (met / missed / not resolved);
    a verdict on fewer than the study's `n_seeds` paired seeds says "so far"."""
    out = []

    def so_far(r):
        return " so far" if len(r["paired_seeds"]) < n_seeds else ""
    auto = [n for n in s if n.startswith("auto 2-bit avg") and "diff" in s[n]]
    for name in auto:                           # within 0.5 pp of exact (paired mean)
        r = s[name]
        diff, ci = pp(r)
        out.append(f"* {name} within 0.5 pp of exact (paired mean): {'met' if abs(r['diff']) <= 0.005 else 'missed'}"
                   f"{so_far(r)}; stretch, interval inside ±0.5 pp: {_within(r, 0.005)}{so_far(r)} "
                   f"({diff}, 95% interval {ci})")
        uniform = "approx 2-bit" + next((" " + w for w in ("stochastic", "unbiased") if name.endswith(w)), "")
        if uniform in s and "diff" in s[uniform]:
            out.append(gap_halved(s, name, uniform))
        if name.endswith(("stochastic", "unbiased")) and "approx 2-bit" in s and "diff" in s.get("approx 2-bit", {}):
            out.append(gap_halved(s, name, "approx 2-bit"))
    for name, floor, stretch in (("approx 2-bit unbiased", 0.005, 0.003), ("approx 4-bit unbiased", 0.002, None),
                                 ("approx 2-bit dithered", 0.005, 0.003), ("approx 4-bit dithered", 0.002, None),
                                 ("auto 2-bit avg unbiased", 0.005, None)):
        if name in s and "diff" in s[name]:
            r = s[name]
            diff, ci = pp(r)
            line = (f"* {name}: paired mean at least −{100 * floor:g} pp: "
                    f"{'met' if r['diff'] >= -floor else 'missed'}{so_far(r)} ({diff}, 95% interval {ci}, "
                    f"{len(r['paired_seeds'])} of {n_seeds} seeds)")
            if stretch is not None:
                ok = r["diff"] >= -stretch and r["diff_ci"][0] >= -0.008
                verdict = (("met" if ok else "missed") + so_far(r) if math.isfinite(r["diff_se"])
                           else "not resolved (one seed)")
                line += f"; stretch (at least −{100 * stretch:g} pp and the interval's lower end at least −0.8): " \
                        f"{verdict}"
            out.append(line)
    for name, bound in (("approx 4-bit", 0.003), ("approx 2-bit", 0.01)):
        if name in s and "diff" in s[name]:
            r = s[name]
            diff, ci = pp(r)
            out.append(f"* {name} within {100 * bound:g} pp of exact: {_within(r, bound)}{so_far(r)} "
                       f"({diff}, 95% interval {ci})")
    if "naive 4-bit" in s and "diff" in s["naive 4-bit"]:
        r = s["naive 4-bit"]
        worse = r["diff_ci"][1] < 0
        diff, ci = pp(r)
        out.append(f"* naive 4-bit visibly worse than exact: {'yes' if worse else 'not resolved'} "
                   f"({diff}, interval {ci})")
    if noise and "naive 4-bit" in noise[0]["modes"] and "approx 4-bit" in noise[0]["modes"]:
        f = statistics.median(r["modes"]["naive 4-bit"]["median_ratio"] / r["modes"]["approx 4-bit"]["median_ratio"]
                              for r in noise)
        out.append(f"* naive 4-bit's error-to-noise ratio at least 5x approx 4-bit's: "
                   f"{'met' if f >= 5 else 'missed'} (median over checkpoints of the ratio of the two medians: {f:.2f}x)")
    if noise and "approx 4-bit" in noise[0]["modes"]:
        m = max(r["modes"]["approx 4-bit"]["median_ratio"] for r in noise)
        out.append(f"* approx 4-bit error / SGD noise, median over tensors, below 1/10 through training: "
                   f"{'met' if m < 0.1 else 'missed'} (largest over checkpoints {m:.3g})")
    return out


def estimate_full(results, args):
    """A sentence estimating the full study's time from this (smoke) run's measured rates:
    seconds per training image per mode (modes the smoke did not run: approx 4-bit's rate),
    the noise checkpoints scaled by batches and checkpoints, evaluation by test images."""
    rate, ev = {}, []
    for key, run in results["runs"].items():
        name = key.split("|")[0]
        imgs = sum(h["iteration"] for h in run["history"][-1:]) * args.batch
        rate.setdefault(name, []).append(sum(h["train_time_s"] for h in run["history"]) / max(imgs, 1))
        ev += [h["eval_time_s"] / max(args.limit_test or 1, 1) for h in run["history"]]
    rate = {k: statistics.mean(v) for k, v in rate.items()}
    base = rate.get("approx 4-bit", max(rate.values()))
    F = FULL
    n_train, n_test = F["limit_train"] or 60000, F["limit_test"] or 10000    # Fashion-MNIST's whole splits
    per_run_imgs = (n_train // F["batch"]) * F["batch"] * F["epochs"]
    full_modes = [m for phase in phases_of(F["modes"]) for m in phase]
    train = len(seeds_of(F["seeds"])) * sum(per_run_imgs * rate.get(label(m), base) for m in full_modes)
    evals = len(seeds_of(F["seeds"])) * len(full_modes) * F["epochs"] * n_test * statistics.mean(ev)
    noise = results.get("noise") or []
    per_ckpt = statistics.mean(r["seconds"] for r in noise) if noise else 0.0
    noise_s = per_ckpt * F["checkpoints"] * F["noise_batches"] / max(args.noise_batches, 1)
    total = train + evals + noise_s
    return (f"Estimated time of the full study from this run's measured rates (same machine and load; "
            f"modes not run here at the approx 4-bit rate): {total / 60:.0f} min "
            f"(training {train / 60:.0f}, evaluation {evals / 60:.0f}, noise checkpoints {noise_s / 60:.0f}).")


def machine():
    return f"{cpu()}, Python {platform.python_version()}, numpy {numpy.__version__}"


def plots(results, modes, seeds, doc_dir, stem):
    """Training curves and the noise plot as PNGs next to the doc; [] without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    # exact last, black and thick, so it stays visible above the modes that track it; the shaded
    # band is the spread (min to max) over the seeds, the line their mean
    order = [m for m in modes if m[0] != "exact"] + [m for m in modes if m[0] == "exact"]
    for k, m in enumerate(order):
        hs = [results["runs"][f"{label(m)}|{s}"]["history"] for s in seeds if f"{label(m)}|{s}" in results["runs"]]
        if not hs:
            continue
        ep = [r["epoch"] for r in hs[0]]
        style = (dict(color="k", lw=2.2, ls="--", zorder=5) if m[0] == "exact" else dict(color=f"C{k}", lw=1.3))
        for ax, key, scale in ((a1, "test_acc", 100), (a2, "train_loss", 1)):
            v = [[scale * h[i][key] for h in hs] for i in range(len(ep))]
            ax.plot(ep, [statistics.mean(x) for x in v], marker="o", label=f"{label(m)} ({len(hs)})", **style)
            ax.fill_between(ep, [min(x) for x in v], [max(x) for x in v], color=style["color"],
                            alpha=0.12, lw=0)
    a1.set(xlabel="epoch", ylabel="test accuracy, % (mean; band: min-max over seeds)",
           title="test accuracy (legend: seeds finished)")
    a2.set(xlabel="epoch", ylabel="training loss (mean; band: min-max over seeds)",
           title="training loss", yscale="log")
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3)
    a2.grid(alpha=0.3)
    fig.tight_layout()
    name = f"{stem}_curves.png"
    fig.savefig(os.path.join(doc_dir, name), dpi=110)
    plt.close(fig)
    files.append(name)
    noise = results.get("noise") or []
    if noise:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        its = [r["iteration"] for r in noise]
        handles = []
        for i, m in enumerate(noise[0]["modes"]):
            c = f"C{i}"
            handles += ax.plot(its, [r["modes"][m]["median_ratio"] for r in noise], color=c, marker="o", label=m)
            ax.plot(its, [r["modes"][m]["worst_ratio"] for r in noise], color=c, ls="--", marker="x")
        handles += ax.plot([], [], color="0.4", marker="o", label="solid: median over tensors")
        handles += ax.plot([], [], color="0.4", ls="--", marker="x", label="dashed: worst tensor")
        ax.axhline(1, color="k", lw=0.8)
        ax.axhline(0.1, color="k", lw=0.8, ls=":")
        ax.set(xlabel="iteration (exact training run, first seed)", yscale="log",
               ylabel="gradient error / SGD noise", title="approximation error against SGD noise")
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the curves
        ax.grid(alpha=0.3, which="both")
        fig.tight_layout()
        name = f"{stem}_noise.png"
        fig.savefig(os.path.join(doc_dir, name), dpi=110)
        plt.close(fig)
        files.append(name)
    return files


def g3(x):
    """A ratio to 3 significant digits; — when undefined (None or nan)."""
    return "—" if x is None or not math.isfinite(x) else f"{x:.3g}"


def total_ratio(rec, mode_rec):
    """Error over noise of all parameters as one vector: squared norms add over tensors."""
    err = math.sqrt(sum(e * e for e in mode_rec["error_norm"]))
    noise = math.sqrt(sum(n * n for n in rec["noise_norm"]))
    return err / noise if noise > 0 else float("nan")


def write_doc(path, results, args, modes, seeds, command, smoke, total_s, cifar_note, pending=(), section=None):
    """The report on the finished runs of `seeds` into `path` (each mode over the seeds it has
    finished, each difference over the seeds both modes have): the whole page, or with `section`
    only that section of it (place_section). pending: the run keys not finished."""
    s = summarise(results, modes, seeds)
    doc_dir = os.path.dirname(os.path.abspath(path))
    stem = os.path.splitext(os.path.basename(path))[0] + (f"_{section}" if section else "")
    os.makedirs(doc_dir, exist_ok=True)         # the plots go there before the page does
    figs = plots(results, modes, seeds, doc_dir, stem)
    steps = (results["runs"][f"exact|{s['exact']['seeds'][0]}"]["history"][-1]["iteration"] if "exact" in s
             else "?")
    runs = results["runs"].values()
    L = []
    unfinished = ([f"> **Not finished: {len(pending)} run(s) to go** ({'; '.join(k.replace('|', ', seed ') for k in pending)}). "
                   f"Each row holds the seeds its mode has finished, each difference the seeds both modes have; "
                   f"rerun the command below to continue (an unfinished run resumes from its checkpoint).", ""]
                  if pending else [])
    if section:
        n_train = "all" if args.limit_train is None else f"{args.limit_train:,}"
        L += [f"# Study: pre-act ResNet-{args.depth}, {n_train} {args.dataset} training images, "
              f"{args.epochs} epochs, batch {args.batch}", ""]
        L += unfinished
        L += [f"Produced by `{command}` on {machine()}. Run times are not reported: the machine was shared "
              f"with other work and the study was paused at times (results.json keeps each run's).", ""]
    elif smoke:
        est = estimate_full(results, args)
        L += ["# Accuracy study — SMOKE RUN (not the study's result)", "",
              "> **This page is the output of `--smoke`: a few minutes of training on a small subset, "
              "to prove that `benchmarks/accuracy.py` works end to end. Its numbers say nothing about "
              "the method.** The full study is `python benchmarks/accuracy.py` (results in "
              "runs/accuracy); it rewrites this page. " + est, ""]
    else:
        L += ["# Accuracy: exact, approx and naive training on real data", ""] + unfinished
    if not section:
        L += [f"Produced by `{command}`: {total_s / 60:.1f} min of runs in all "
          f"({statistics.mean(r['seconds'] for r in runs):.0f} s per run on average, noise checkpoints "
          f"included) on {machine()}; load average {results.get('load', '?')} (1-minute, at the start of "
          f"each invocation: the machine is shared, so times vary with the other work on it).", ""]
    L += [f"Data: {args.dataset}, {args.limit_train or 'all'} training and {args.limit_test or 'all'} test "
          f"images{' (28x28, unpadded)' if args.dataset == 'fashion-mnist' and args.pad_to == 0 else ''}. "
          f"{cifar_note}", "",
          f"Network: {MODELS['preact-cifar'].build.__name__}(depth={args.depth}); SGD momentum 0.9, weight "
          f"decay 5e-4, lr {args.lr:g} (warm-up then cosine), batch {args.batch}, {args.epochs} epochs "
          f"({steps} iterations), {'no augmentation' if args.no_augment else 'random crop + flip'}. Seeds {', '.join(map(str, seeds))}: a seed fixes "
          f"the initial weights, batch order and augmentation, the same for every mode. Quantizer "
          f"windows (half-widths W per bit width, docs/quantizer.md): "
          + ", ".join(f"{k}-bit ±{window.WINDOWS[k]:g}" for k in widths.BITS[::-1]) + ".", "",
          "## 1. Final test accuracy", "",
          "Test accuracy after the last epoch (BN running statistics, whole test split), over the seeds "
          "each mode has finished. Difference: per seed, mode − exact (same seed: same data and initial "
          "weights), then mean ± standard error over the seeds both have finished and a 95% t interval.", "",
          "| mode | saved bits per element | seeds | mean | sd over seeds | min – max | − exact (paired) "
          "| 95% interval | per seed |",
          "|---|---|---|---|---|---|---|---|---|"]
    specs = {label(m): m for m in modes}
    for name, r in s.items():
        diff, ci = pp(r) if "diff" in r else ("—", "—")
        sd = f"{100 * r['sd']:.2f}" if math.isfinite(r["sd"]) else "—"
        L.append(f"| {name} | {saved_bits(specs[name], args)} | {len(r['seeds'])} | {100 * r['mean']:.2f}% | {sd} | "
                 f"{100 * min(r['acc']):.2f} – {100 * max(r['acc']):.2f} | {diff} | {ci} | "
                 + ", ".join(f"{seed}: {100 * a:.2f}" for seed, a in zip(r["seeds"], r["acc"])) + " |")
    pairs = [(a, b, paired(results, a, b, seeds)) for a, b in comparisons(modes)]
    pairs = [(a, b, d) for a, b, d in pairs if d is not None]
    if pairs:
        L += ["", "The dither's own effect, paired per seed (the same seed's two runs differ only in the draw "
              "and decode of the code):", "",
              "| comparison | seeds | difference (paired) | 95% interval | per seed |", "|---|---|---|---|---|"]
        for a, b, d in pairs:
            diff, ci = pp(d)
            L.append(f"| {a} − {b} | {len(d['seeds'])} | {diff} | {ci} | "
                     + ", ".join(f"{seed}: {100 * x:+.2f}" for seed, x in zip(d["seeds"], d["diffs"])) + " |")
    se = [(r["diff_se"], len(r["paired_seeds"])) for r in s.values()
          if "diff_se" in r and math.isfinite(r["diff_se"])]
    if se:
        half = max(T95.get(n - 1, 1.96) * e for e, n in se)
        L += ["", f"What this resolves: the paired differences to exact have standard errors of "
              f"{'–'.join(dict.fromkeys(f'{100 * e:.2f}' for e in (min(e for e, _ in se), max(e for e, _ in se))))} pp, so with "
              f"{'–'.join(str(n) for n in sorted({min(n for _, n in se), max(n for _, n in se)}))} seeds a difference "
              f"smaller than about "
              f"{100 * half:.2f} pp (the widest 95% half-interval) cannot be told from zero; larger ones "
              f"can. A target such as \"within 0.3 pp of exact\" is met only if the whole interval lies "
              f"within ±0.3 pp."]
    if figs:
        L += ["", f"![training curves]({figs[0]})"]
    noise = results.get("noise") or []
    L += ["", "### Against the targets set before the runs", ""] + (targets(s, noise, len(seeds)) or [
        "None can be judged yet: no mode has a finished seed paired with exact."])
    autos = [(k, r) for k, r in results["runs"].items() if "bits" in r]
    if autos:
        L += ["", "Auto allocations (chosen by each run at its start from the first 3 training batches, "
              "lowmem/bits/allocate.py; saved x-hat bytes against uniform 2-bit's):", "",
              "| run | widths (units in forward order) | saved x-hat | uniform 2-bit | predicted error/noise |",
              "|---|---|---|---|---|"]
        for k, r in autos:
            L.append(f"| {k.replace('|', ', seed ')} | {' '.join(str(b) for b in r['bits'].values())} | "
                     f"{r['saved_code_bytes']:,} B | "
                     f"{r['uniform2_bytes']:,} B | {r['predicted_ratio']:.3g} |")
    L += ["", "## 2. Gradient error against SGD noise through training", "",
          "Along the exact run of the first seed, at evenly spaced iterations (0: before the first "
          f"step), on B = {args.noise_batches} fixed training batches of {args.batch} images (drawn once, "
          "normalised, not augmented; the same batches at every checkpoint), for every parameter tensor p "
          "(each conv/FC weight and bias, each BN γ and β) and mode m:", "",
          "* **error** `e_m(p) = rms_b ‖g_m,b(p) − g_exact,b(p)‖`: the mode's gradient against the exact "
          "gradient on the *same* batch b and the same weights (training-mode BN);",
          "* **SGD noise** `σ(p) = sqrt(B/(B−1) · mean_b ‖g_exact,b(p) − ḡ(p)‖²)`, "
          "`ḡ = mean_b g_exact,b`: the spread of exact gradients over *different* batches, i.e. how far "
          "one mini-batch gradient lies from the expected one (B/(B−1): ḡ is a sample mean);",
          "* **ratio** `e_m(p) / σ(p)`; ‖·‖ is the Euclidean norm over the tensor's elements. Below 1 the "
          "approximation adds less to the gradient's error than SGD's sampling already has.", "",
          "The third number in each cell is the ratio of all parameters taken as one vector: "
          "`sqrt(Σ_p e_m(p)²) / sqrt(Σ_p σ(p)²)`. The last two separate bias from noise "
          "(lowmem.tools.gradient_error.bias_and_noise, all parameters as one vector, two independent draws "
          "of a stochastic code per batch): **persistent bias / ‖E g‖**, the part of the error that "
          "averages out over neither batches nor draws (`‖mean‖² − tr(cov)/B`, clipped at 0) against the "
          "expected gradient's norm, and **draw noise / SGD noise**, the per-step noise of the draws (0 "
          "for nearest rounding). A bias rotates every expected step; noise of the same size is averaged "
          "away by SGD.", "",
          "| iteration | epoch | " + " | ".join(f"{m}: median / worst / all / bias / draw noise" for m in
                                                 (noise[0]["modes"] if noise else [])) + " |",
          "|---|---|" + "---|" * (len(noise[0]["modes"]) if noise else 0)]
    for r in noise:
        L.append(f"| {r['iteration']} | {r['epoch']:.2f} | " + " | ".join(
            f"{v['median_ratio']:.3g} / {v['worst_ratio']:.3g} / {total_ratio(r, v):.3g} / "
            f"{g3(v.get('bias_ratio'))} / {g3(v.get('draw_noise_ratio'))}" for v in r["modes"].values()) + " |")
    if any(v.get("bias_ratio") is not None and not math.isfinite(v["bias_ratio"])
           for r in noise for v in r["modes"].values()):
        L += ["", "— in the bias column: at that checkpoint ‖E g‖ is not resolved from the batch noise (its "
              "estimate `‖mean‖² − tr(cov)/B` of the exact gradients is clipped at 0), so bias / ‖E g‖ is "
              "undefined."]
    if noise and any("draw_noise_ratio" in v for v in noise[0]["modes"].values()):
        L += ["", "Draw noise / SGD noise (all parameters as one vector), range over checkpoints: " + "; ".join(
            f"{m} {min(r['modes'][m]['draw_noise_ratio'] for r in noise):.3g}–"
            f"{max(r['modes'][m]['draw_noise_ratio'] for r in noise):.3g}"
            for m in noise[0]["modes"] if noise[0]["modes"][m].get("draw_noise_ratio")) + "."]
    if noise:
        L += ["", "Median over tensors of the ratio, over all checkpoints: " + "; ".join(
            f"{m} {statistics.median(r['modes'][m]['median_ratio'] for r in noise):.3g} "
            f"(max over checkpoints {max(r['modes'][m]['median_ratio'] for r in noise):.3g})"
            for m in noise[0]["modes"]) + "."]
    if len(figs) > 1:
        L += ["", f"![error against noise]({figs[1]})", "",
              "*Gradient error over SGD noise at each checkpoint of the first seed's exact run, per mode "
              "(solid: median over parameter tensors; dashed: the worst tensor); 1 is the noise itself, "
              "the dotted line a tenth of it. Drawn by this study's script from its results.*"]
    L += ["", "## Rerun", "", "```", command, "```", "",
          f"Raw numbers: `{os.path.join(args.out, 'results.json')}` (per run: the per-epoch history; per "
          "checkpoint: every tensor's error and noise norms)."]
    if section:
        L = ["#" + line if line.startswith("#") else line for line in L]     # one level under the page's title
        place_section(path, section, "\n".join(L) + "\n")
    else:
        atomic_write(path, "\n".join(L) + "\n")
    return figs


MARK = "<!-- benchmarks/accuracy.py section"


def section_markers(name):
    return (f"{MARK} {name}: begin (written by the script; edit the script, not this) -->", f"{MARK} {name}: end -->")


def place_section(path, name, text):
    """Replace section `name` of the page at `path` (the lines between its markers) by `text`; a page
    without them gets the section before its first "## " heading or other section (after the title
    and its introduction; at the end if there is none), the rest of the page kept as it is. A page with one
    marker but not the other is refused."""
    begin, end = section_markers(name)
    page = open(path).read() if os.path.exists(path) else ""
    block = f"{begin}\n{text}{end}\n"
    if begin in page and end in page and page.index(begin) < page.index(end):
        head, rest = page.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        page = head + block + ("\n" + tail if tail else "")
    elif begin in page or end in page:
        raise SystemExit(f"{path}: section {name!r} has one marker without the other; fix the page first")
    else:
        lines = page.split("\n")
        cut = next((i for i, line in enumerate(lines) if line.startswith(("## ", MARK))),
                   len(lines))                  # the first "## " heading or another section's start
        head = "\n".join(lines[:cut]).rstrip("\n")
        body = "\n".join(lines[cut:])
        page = (head + "\n\n" if head else "") + block + ("\n" + body if body else "")
    atomic_write(path, page)


HEADLINE_SEEDS = 3                  # a mode enters the headline with this many paired seeds
HEADLINE_ANCHOR = "## Accuracy"


def write_headline(path, results, args, modes, seeds, command):
    """The study's headline into the page at `path` (its section `<section>-headline`, placed
    right after the page's HEADLINE_ANCHOR heading): the modes with HEADLINE_SEEDS or more seeds
    paired with exact, and the dither's paired effect. Returns False (the page untouched) while
    no mode has that many."""
    s = summarise(results, modes, seeds)
    rows = [n for n, r in s.items() if len(r.get("paired_seeds", ())) >= HEADLINE_SEEDS]
    if not rows:
        return False
    specs = {label(m): m for m in modes}
    runs = results["runs"]
    n_train = "all" if args.limit_train is None else f"{args.limit_train:,}"
    n_test = "the whole test split" if args.limit_test is None else f"{args.limit_test:,} test images"
    doc = os.path.relpath(os.path.abspath(args.doc), os.path.dirname(os.path.abspath(path))).replace(os.sep, "/")
    L = [f"### Pre-activation ResNet-{args.depth}, {n_train} {args.dataset} training images, {args.epochs} epochs",
         "", f"Batch {args.batch}, cosine schedule, {'no augmentation' if args.no_augment else 'random crop + flip'}, "
         f"{n_test}; per seed every mode trains from the same weights on the same batches, so the differences "
         f"are paired, and each mode's mean is over its seeds paired with exact "
         f"([{os.path.basename(doc)}]({doc}) has every run, the curves and the draw noise; written by "
         f"`{command}`):", "",
         "| mode | saved bits per element | seeds | final test accuracy, mean | − exact (paired), mean ± s.e. "
         "| 95% interval |", "|---|---|---|---|---|---|",
         f"| exact | 32 | {len(s['exact']['seeds'])} | {100 * s['exact']['mean']:.2f}% | — | — |"]
    for name in rows:
        r = s[name]
        diff, ci = pp(r)
        mean = statistics.mean(runs[f"{name}|{seed}"]["final_test_acc"] for seed in r["paired_seeds"])
        L.append(f"| {name} | {saved_bits(specs[name], args)} | {len(r['paired_seeds'])} | {100 * mean:.2f}% "
                 f"| {diff} | {ci} |")
    for a, b in comparisons(modes):
        d = paired(results, a, b, seeds)
        if d is not None and len(d["seeds"]) >= HEADLINE_SEEDS:
            diff, ci = pp(d)
            L += ["", f"The dither's own effect, {a} − {b} per seed: {diff}, 95% interval {ci} "
                  f"({len(d['seeds'])} seeds)."]
    L = "\n".join(L) + "\n"
    name = f"{args.section or 'study'}-headline"
    begin, end = section_markers(name)
    page = open(path).read()
    if begin not in page and end not in page:     # first time: empty markers right after the heading
        lines = page.split("\n")
        at = next((i for i, line in enumerate(lines) if line.rstrip() == HEADLINE_ANCHOR), None)
        if at is None:
            raise SystemExit(f"{path}: no '{HEADLINE_ANCHOR}' heading to put the headline after")
        rest = "\n".join(lines[at + 1:]).lstrip("\n")
        page = "\n".join(lines[:at + 1]) + f"\n\n{begin}\n{end}\n" + ("\n" + rest if rest else "")
        atomic_write(path, page)
    place_section(path, name, L)
    return True


# ---- main --------------------------------------------------------------------------------

def parse_args(argv):
    """The study's settings: the options given, the rest from FULL (or SMOKE with --smoke)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a few minutes on a small subset; labelled as a smoke run")
    p.add_argument("--dataset", default=None, help="fashion-mnist (default), cifar10, cifar100")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--pad-to", type=int, default=0, help="Fashion-MNIST: pad 28x28 to this (0: keep 28)")
    p.add_argument("--depth", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--limit-train", type=int, default=None)
    p.add_argument("--limit-test", type=int, default=None)
    p.add_argument("--seeds", default=None, help="comma-separated")
    p.add_argument("--modes", default=None, help="e.g. exact,approx8,approx4,approx2,approx1,naive4; a '/' "
                   "starts a phase run after every seed of the modes before it")
    p.add_argument("--checkpoints", type=int, default=None, help="noise measurements along the run (0: none)")
    p.add_argument("--noise-batches", type=int, default=None)
    p.add_argument("--noise-modes", default=None)
    p.add_argument("--noise-seed", type=int, default=0)
    p.add_argument("--no-augment", action="store_true", help="no random crop / flip (shorter runs converge faster)")
    p.add_argument("--out", default=None, help="results directory (default runs/accuracy[-smoke])")
    p.add_argument("--doc", default=None, help="the report page (default docs/accuracy.md, section full; "
                   "--smoke: OUT/accuracy.md); a page named here is written whole unless --section is given")
    p.add_argument("--section", default=None, help="write only this section of --doc (between its markers), "
                   "keeping the rest of the page")
    p.add_argument("--headline", default=None, help="also write this page's accuracy headline (its section "
                   f"between markers, after its '{HEADLINE_ANCHOR}' heading) once a mode has {HEADLINE_SEEDS} "
                   "paired seeds (default for the full study: docs/results.md)")
    p.add_argument("--report-only", action="store_true", help="write the doc from the runs finished so far; train nothing")
    args = p.parse_args(argv)
    base = SMOKE if args.smoke else FULL
    if args.doc is not None:                    # a page named: whole, unless a section is named too
        base = {k: v for k, v in base.items() if k not in ("section", "headline")}
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.out = args.out or ("runs/accuracy-smoke" if args.smoke else "runs/accuracy")
    args.doc = args.doc or (os.path.join(args.out, "accuracy.md") if args.smoke else "docs/accuracy.md")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    phases = phases_of(args.modes)
    noise_modes = [parse_mode(m) for m in args.noise_modes.split(",")] if args.checkpoints else []
    if any(m.mode == "exact" for m in noise_modes):
        raise SystemExit("--noise-modes compares with exact: list approxK / naiveK modes only")
    if args.checkpoints and args.noise_batches < 2:
        raise SystemExit(f"--noise-batches must be >= 2 (the noise compares batches), got {args.noise_batches}")
    if all(Spec("exact", 4) not in phase for phase in phases):
        phases[0].insert(0, Spec("exact", 4))   # the reference of every difference
    modes = [m for phase in phases for m in phase]
    seeds = seeds_of(args.seeds)
    command = " ".join(["python benchmarks/accuracy.py"] + [a for a in argv if a != "--report-only"])

    def log(text):
        tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()

    cifar_note = ""
    if args.dataset == "fashion-mnist":
        for name in ("cifar10", "cifar100"):
            try:
                load_dataset(name, args.data_dir, download=False, limit_train=1, limit_test=1)
                cifar_note += f"{name} is present here: rerun with --dataset {name}. "
            except DataError:
                cifar_note += f"{name}: not present on this machine (not run). "
    data = load_dataset(args.dataset, args.data_dir, download=False, pad_to=args.pad_to or None,
                        limit_train=args.limit_train, limit_test=args.limit_test)
    log(f"{data!r}; modes {[label(m) for m in modes]}; seeds {seeds}; {args.epochs} epochs of batch {args.batch}")
    args.input_shape, args.num_classes = data.input_shape, data.num_classes      # (saved_bits)
    settings = {k: getattr(args, k) for k in ("dataset", "pad_to", "depth", "batch", "epochs", "lr",
                                              "limit_train", "limit_test", "noise_batches", "noise_seed",
                                              "checkpoints", "noise_modes")}
    if args.no_augment:                         # (absent when off: older studies' settings still match)
        settings["no_augment"] = True
    settings["windows"] = {str(k): window.WINDOWS[k] for k in widths.BITS[::-1]}
    path = os.path.join(args.out, "results.json")
    results = load_results(path, settings)
    load = f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"
    if not args.report_only:
        results["load"] = f"{results['load']}, {load}" if results.get("load") else load
    t0 = time.time()
    order = [(seed, spec) for phase in phases for seed in seeds for spec in phase]   # seed by seed per phase
    todo = [(seed, spec) for seed, spec in order if f"{label(spec)}|{seed}" not in results["runs"]]
    stopped = None
    if not args.report_only:
        stopped = run_all(args, data, results, path, todo, seeds, noise_modes, log)
    pending = [f"{label(spec)}|{seed}" for seed, spec in order if f"{label(spec)}|{seed}" not in results["runs"]]
    finished = [k for k in (f"{label(m)}|{s}" for m in modes for s in seeds) if k in results["runs"]]
    total_s = sum(r["seconds"] for r in results["runs"].values())
    if not any(f"exact|{s}" in results["runs"] for s in seeds):
        log(f"no exact run has finished yet: {args.doc} not written")
    else:
        figs = write_doc(args.doc, results, args, modes, seeds, command, args.smoke, total_s, cifar_note,
                         pending, args.section)
        log(f"wrote {args.doc}" + (f" (section {args.section})" if args.section else "")
            + (f" and {', '.join(figs)}" if figs else " (no matplotlib: no plots)")
            + f" from {len(finished)} finished run(s); training time {total_s / 60:.1f} min in all, this process "
            f"{(time.time() - t0) / 60:.1f} min")
        if args.headline and write_headline(args.headline, results, args, modes, seeds, command):
            log(f"wrote the headline of {args.headline} (modes with {HEADLINE_SEEDS} or more paired seeds)")
    if stopped:
        log(f"stopped: {stopped}. Run the same command again to continue.")
        return 130
    return 0


def run_all(args, data, results, path, todo, seeds, noise_modes, log):
    """Train the (seed, spec) runs of `todo` in order, writing results.json after each (and after
    each noise checkpoint); a progress bar over all their steps. Returns None, or why it stopped."""
    steps_per_run = (len(data.x_train) // args.batch) * args.epochs
    bar = tqdm(total=len(todo) * steps_per_run, unit="step", desc="study", dynamic_ncols=True, file=sys.stdout,
               mininterval=0.5 if sys.stdout.isatty() else 60, smoothing=0.02)
    for n, (seed, spec) in enumerate(todo):
        key = f"{label(spec)}|{seed}"
        bar.set_postfix_str(f"run {n + 1}/{len(todo)}: {key.replace('|', ', seed ')}", refresh=False)

        def advance(trainer, loss, n=n):
            bar.update(n * steps_per_run + trainer.iteration - bar.n)
        hook, store, on_epoch = None, [], None
        if spec.mode == "exact" and seed == seeds[0]:
            on_epoch = keep_epoch_checkpoints
        if spec.mode == "exact" and seed == seeds[0] and args.checkpoints and results.get("noise") is None:
            spe = len(data.x_train) // args.batch
            total = spe * args.epochs
            cps = sorted({round(i * total / max(1, args.checkpoints - 1)) for i in range(args.checkpoints)})
            template = MODELS["preact-cifar"].build(args.depth, num_classes=data.num_classes,
                                                    in_channels=data.input_shape[0], seed=seed)
            # auto modes: the widths their run of this seed will choose (the trainer's own
            # measurement: the same first batches and initial weights), for the whole curve
            auto_bits = {label(m): allocate_bits(template, training_batches(data, args.batch), batch_size=args.batch,
                                                 avg_bits=m.avg, rounding=m.rounding).bits
                         for m in noise_modes if m.bits == "auto"}
            results["noise_bits"] = auto_bits
            store = results.setdefault("noise_partial", [])       # measured before an interruption

            def saved(store):
                atomic_write(path, json.dumps(results))
            hook = noise_hook(args, data, template, set(cps), total, noise_modes, store, log, auto_bits, saved)
        log(f"{key}: training")

        def on_step(trainer, loss, hook=hook, advance=advance):
            if hook is not None:
                hook(trainer, loss)
            advance(trainer, loss)
        try:
            run = train_run(args, data, spec, seed, on_step=on_step, on_epoch=on_epoch, log=log)
        except Stopped as e:
            bar.close()
            return str(e)
        results["runs"][key] = run
        if hook is not None:
            results["noise"] = sorted(results.pop("noise_partial"), key=lambda r: r["iteration"])
        atomic_write(path, json.dumps(results))
        log(f"{key}: test accuracy {100 * run['final_test_acc']:.2f}%")
    bar.close()
    return None


if __name__ == "__main__":
    sys.exit(main())
