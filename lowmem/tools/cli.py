"""The `lowmem` command line (also `python -m lowmem`): the subcommands and their registry.

    lowmem plan --model preact-cifar --depth 164 --batch 128 --mode approx --bits 4 [--compare] [--measure]
    lowmem plan --model preact-imagenet --depth 152 --input 3x224x224 --classes 1000
    lowmem diagnose --depth 20 --batch 32 --bits 4 [--batches 4] [--warmup 0]
    lowmem train --dataset fashion-mnist --depth 20 --epochs 3 --out runs/fm [--resume | --overwrite]
    lowmem maxbatch --model preact-cifar --depth 164 --budget 2GiB --mode approx --bits 4 [--verify]
    lowmem export RUN_DIR model.onnx | model.safetensors
    lowmem predict RUN_DIR_or_model IMAGE...

Subcommands live in one registry, `COMMANDS`: each is a pair of small
functions, `<name>_arguments(parser)` declaring its options and
`<name>_command(args) -> exit code` doing the work, added with `register`
(export and predict keep theirs in lowmem/tools/export.py and lowmem/tools/predict.py).
`network_arguments` / `model_arguments` / `build_network` are the shared
model options (model, depth, classes, input, batch, dtype); the models come
from the one registry, lowmem.models.MODELS. The library code these
commands call stays in its modules (trainer.Trainer, maxbatch.max_batch,
diagnostics, the Engine).

Exit status, the same for every subcommand:

    0    done
    1    the data, a checkpoint, a run folder, the disk, or --verify failed
         (missing or damaged files, a folder lowmem may not use, a full disk)
    2    a bad command line: an option's value, a combination the model, the
         engine or the optimizer refuses, or more memory than the machine has
    3    training diverged (a non-finite loss)
    4    `lowmem train` stopped by --time-limit (resume to continue)
    130  interrupted by Ctrl-C (SIGINT); 143 by SIGTERM (train: after a checkpoint)

Every error is one line on stderr, `lowmem <command>: error: <what>`.
`main(argv)` returns the exit status instead of exiting, so tests call it
in-process; the console script and `python -m lowmem` wrap it in sys.exit.
"""
import argparse
import dataclasses
import os
import signal
import sys
import time
import traceback

import numpy

from . import argtypes, export, predict
from ..system import backend, distributed, memory as sysmem
from .. import models
from ..units import quant
from ..core.engine import DEFAULT_WORKSPACE_BYTES, DTYPES, MODES, Engine
from .maxbatch import MAX_BATCH, max_batch, parse_bytes, planned_engine
from ..core.plan import KINDS, fmt_bytes
from ..system.memory import NotEnoughMemory
from ..train.trainer import SCHEDULES, ConfigError, TrainConfig, Trainer, TrainingDiverged, saved_config

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_DIVERGED, EXIT_TIME_LIMIT = 0, 1, 2, 3, 4
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}     # 128 + signal number

COMMANDS = {}       # name -> (help, add_arguments(parser), run(args) -> int)


def register(name, help, add_arguments, run):
    """Add subcommand `name`: add_arguments(parser) declares its options, run(args) returns an exit code."""
    if name in COMMANDS:
        raise ValueError(f"subcommand {name!r} registered twice")
    COMMANDS[name] = (help, add_arguments, run)


# ---- shared options -----------------------------------------------------------

def network_arguments(p, depth):
    """--model, --depth, --classes, --input (default depth: `depth`); returns the group."""
    g = p.add_argument_group("model")
    g.add_argument("--model", type=argtypes.model, default="preact-cifar", metavar="MODEL",
                   help=argtypes.model_help() + " (default: %(default)s)")
    g.add_argument("--depth", type=argtypes.positive, default=depth,
                   help="; ".join(f"{name}: {spec.depth_help}" for name, spec in models.MODELS.items())
                   + " (default: %(default)s)")
    g.add_argument("--classes", type=argtypes.classes, default=None,
                   help="number of classes, >= 2 (default: " + ", ".join(
                       f"{spec.num_classes} for {name}" for name, spec in models.MODELS.items()) + ")")
    g.add_argument("--input", type=argtypes.shape, default=None, metavar="CxHxW",
                   help="input shape of one sample (default: " + ", ".join(
                       f"{'x'.join(map(str, spec.input_shape))} for {name}"
                       for name, spec in models.MODELS.items()) + ")")
    return g


def backend_argument(p):
    p.add_argument("--backend", choices=("numpy", "cupy", "auto"), default=None,
                   help="array backend (default: LOWMEM_BACKEND, else auto)")


def model_arguments(p, depth, batch):
    """The model and batch options shared by subcommands (defaults: depth, batch)."""
    g = network_arguments(p, depth)
    g.add_argument("--batch", type=argtypes.positive, default=batch, help="batch size (default: %(default)s)")
    g.add_argument("--dtype", choices=DTYPES, default="float32", help="default: %(default)s")
    backend_argument(g)


def input_shape(args):
    """--input, or the model's default input shape."""
    return args.input or models.model_spec(args.model).input_shape


def build_network(args):
    """(network, input_shape) from the model options; ValueError on a bad combination."""
    shape = input_shape(args)
    net = models.build_model(args.model, args.depth, num_classes=args.classes, in_channels=shape[0],
                             seed=getattr(args, "seed", 0))
    return net, shape


def mode_label(mode, bits):
    """'exact', e.g. 'approx 4-bit', or 'approx auto (2.00 bits on average)' for per-unit widths."""
    if mode == "exact":
        return mode
    if isinstance(bits, dict):            # e.g. 'approx 2-bit x16, 4-bit x2, 1-bit x1'
        widths = ["float" if k == "float" else f"{k}-bit" for k in bits.values()]
        return mode + " " + ", ".join(f"{w} x{widths.count(w)}" for w in dict.fromkeys(widths))
    return f"{mode} {bits}-bit"


# ---- --bits auto: a width per unit -------------------------------------------------

def auto_arguments(p):
    """The options of --bits auto shared by plan, train and maxbatch (--avg-bits; the measurement)."""
    g = p.add_argument_group("--bits auto (docs/bits.md)")
    g.add_argument("--avg-bits", type=argtypes.average_bits, default=None, metavar="A",
                   help="the saved x-hat within what every unit at A bits would take, e.g. 2")
    g.add_argument("--measure-batches", type=argtypes.positive, default=3, metavar="B",
                   help="mini-batches the sensitivity is measured on, >= 2 (default: %(default)s)")
    g.add_argument("--measure-batch", type=argtypes.positive, default=None, metavar="N",
                   help="their batch size (default: the batch, at most 32)")
    return g


def check_auto(args, budget_ok):
    """--bits auto needs approx or naive mode and one budget (--budget only where budget_ok)."""
    if args.mode == "exact":
        raise ValueError("--bits auto chooses code widths; mode exact saves every x-hat in float")
    given = [n for n, v in (("--budget", getattr(args, "budget", None) if budget_ok else None),
                            ("--avg-bits", args.avg_bits)) if v is not None]
    if len(given) != 1:
        raise ValueError("--bits auto needs " + ("one of --budget (the whole plan) and --avg-bits"
                                                 if budget_ok else "--avg-bits"))
    if args.measure_batches < 2:
        raise ValueError(f"--measure-batches must be at least 2 (the SGD noise compares batches), "
                         f"got {args.measure_batches}")


def measure_sensitivity_synthetic(args, net, shape, batch):
    """The sensitivity of `net` on learnable synthetic batches (plan and maxbatch have no data)."""
    from . import diagnostics as D
    from ..bits.sensitivity import measure_sensitivity
    n = args.measure_batch or min(batch, 32)
    batches = D.synthetic_batches(args.measure_batches, n, shape, net.num_classes, 0, args.dtype)
    sens = measure_sensitivity(net, batches, dtype=args.dtype, rounding=getattr(args, "rounding", "nearest"))
    print(f"sensitivity: {args.measure_batches} synthetic batches of {n} (lowmem.data.datasets.synthetic, "
          f"untrained weights), measured in {sens.seconds:.1f} s")
    return sens


def auto_allocation(args, net, shape, batch, ws):
    """Measure, allocate for --budget or --avg-bits at `batch`, print the table; the Allocation."""
    from ..bits.allocate import allocate_bits
    sens = measure_sensitivity_synthetic(args, net, shape, batch)
    a = allocate_bits(net, None, batch_size=batch, avg_bits=args.avg_bits, budget=getattr(args, "budget", None),
                      mode=args.mode, dtype=args.dtype, workspace_bytes=ws, sens=sens)
    print(f"allocation (batch {batch}):")
    print(a.table())
    print()
    return a


def describe(net, batch, shape, dtype, what):
    """One line: the network, the batch, the input, `what` (the mode) and the dtype."""
    size = "x".join(map(str, shape))
    return (f"{net.name}: {net.num_params():,} parameters, {len(net.layers)} layers; "
            f"batch {batch}, input {size}, {what}, {dtype}")


# ---- lowmem plan ----------------------------------------------------------------

def plan_arguments(p):
    model_arguments(p, depth=164, batch=128)
    p.add_argument("--mode", choices=MODES, default="approx", help="default: %(default)s")
    p.add_argument("--bits", type=argtypes.bits, choices=argtypes.BITS_CHOICES, default=4,
                   help="bits per stored activation in approx/naive mode; auto: a width per unit, "
                        "chosen from measured error to fit --budget or --avg-bits (default: %(default)s)")
    p.add_argument("--budget", type=_budget, default=None,
                   help="with --bits auto: the whole plan within this many bytes, e.g. 300MiB")
    auto_arguments(p)
    p.add_argument("--rounding", choices=quant.ROUNDINGS, default="nearest",
                   help="the code (docs/quantizer.md): nearest (the fixed window), stochastic (unbiased, with "
                        "group ends: a little metadata per element), stochastic-window (default: %(default)s)")
    p.add_argument("--workspace-mib", type=argtypes.positive, default=DEFAULT_WORKSPACE_BYTES >> 20,
                   help="bound on the conv workspace, MiB (default: %(default)s)")
    p.add_argument("--compare", action="store_true",
                   help="also plan exact mode and print both side by side, with ratios")
    p.add_argument("--measure", action="store_true",
                   help="allocate and run two training steps on random data; print the measured peak")
    p.add_argument("--no-schedule", action="store_true", help="do not print the schedule")
    p.add_argument("--rows", type=argtypes.positive, default=40, help="plan table rows, largest first (default: %(default)s)")


def compare_table(plans):
    """Side by side bytes per kind and total for {label: Plan}; the first is the reference."""
    labels = list(plans)
    kinds = [k for k in KINDS if any(p.bytes_by_kind()[k] for p in plans.values())]
    head = f"{'kind':<10}" + "".join(f" {lab:>14}" for lab in labels)
    head += "".join(f" {lab + '/' + labels[0]:>22}" for lab in labels[1:])
    lines = [head]
    rows = [(k, {lab: p.bytes_by_kind()[k] for lab, p in plans.items()}) for k in kinds]
    rows.append(("total", {lab: p.total_bytes for lab, p in plans.items()}))
    for k, b in rows:
        line = f"{k:<10}" + "".join(f" {fmt_bytes(b[lab]):>14}" for lab in labels)
        for lab in labels[1:]:
            r = b[lab] / b[labels[0]] if b[labels[0]] else float("nan")
            less = f"({1 / r:.2f}x less)" if 0 < r < 1 else ""
            line += f" {r:>9.4f} {less:>12}"
        lines.append(line.rstrip())
    return "\n".join(lines)


def plan_command(args):
    net, shape = build_network(args)
    ws = args.workspace_mib << 20
    if args.bits == "auto":
        check_auto(args, budget_ok=True)
        args.bits = auto_allocation(args, net, shape, args.batch, ws).bits
    elif args.budget is not None or args.avg_bits is not None:
        raise ValueError("--budget and --avg-bits choose the widths of --bits auto; "
                         "with a fixed --bits drop them")
    eng = Engine(net, args.batch, shape, args.mode, args.bits, args.dtype, ws, allocate=False,
                 rounding=args.rounding)
    print(describe(net, args.batch, shape, args.dtype, "mode " + mode_label(args.mode, args.bits)))
    if eng.bits_per_element() is not None and args.rounding == "stochastic":
        print(f"saved codes: {eng.bits_per_element():.4g} bits/elem, metadata included "
              f"(rounding {args.rounding})")
    if not args.no_schedule:
        print(f"\nschedule ({len(eng.schedule)} steps):")
        print(eng.schedule.format(max_rows=60))
    print("\nmemory plan:")
    print(eng.plan.report(max_rows=args.rows))
    saved = eng.plan.bytes_by_kind()["saved"]
    print(f"saved for backward: {fmt_bytes(saved)} ({saved / args.batch / 1e6:.3f} MB per sample)")
    if args.compare:
        other = "exact" if args.mode != "exact" else "approx"
        ref = Engine(net, args.batch, shape, other, 4 if isinstance(args.bits, dict) else args.bits,
                     args.dtype, ws, allocate=False)
        first, second = (ref, eng) if other == "exact" else (eng, ref)
        print(f"\ncompare (batch {args.batch}):")
        print(compare_table({mode_label(e.mode, e.bits): e.plan for e in (first, second)}))
        for e in (first, second):
            s = e.plan.bytes_by_kind()["saved"]
            print(f"saved per sample, {mode_label(e.mode, e.bits)}: {s / args.batch / 1e6:.3f} MB")
    if args.measure:
        from .diagnostics import measure_peak
        m = measure_peak(net, args.batch, shape, args.mode, args.bits, args.dtype, steps=2,
                         workspace_bytes=ws)
        print()
        print(m.report())
        print(f"steady-state peak / plan = {m.peak_bytes / m.plan_bytes:.3f}")
    return 0


register("plan", "print the schedule and memory plan of a network (no allocation unless --measure)",
         plan_arguments, plan_command)


# ---- lowmem diagnose --------------------------------------------------------------

def diagnose_arguments(p):
    model_arguments(p, depth=20, batch=32)
    p.add_argument("--bits", type=int, choices=quant.BITS[::-1], default=4, help="default: %(default)s")
    p.add_argument("--rounding", choices=quant.ROUNDINGS, default="nearest",
                   help="the code (docs/quantizer.md); a stochastic one is drawn twice per batch, so the "
                        "persistent bias is told apart from the draws' noise (default: %(default)s)")
    p.add_argument("--batches", type=int, default=4,
                   help="mini-batches to average over; >= 2, the SGD noise needs several (default: %(default)s)")
    p.add_argument("--warmup", type=argtypes.count, default=0,
                   help="exact SGD steps on the synthetic data before measuring (default: %(default)s)")
    p.add_argument("--lr", type=argtypes.positive_number, default=0.05,
                   help="warm-up learning rate (default: %(default)s)")
    p.add_argument("--seed", type=argtypes.count, default=0, help="network and data seed (default: %(default)s)")
    p.add_argument("--no-table", action="store_true", help="print only the summary")


def diagnose_command(args):
    from . import diagnostics as D
    if args.batches < 2:
        raise ValueError(f"--batches must be at least 2 (the SGD noise compares batches), got {args.batches}")
    net, shape = build_network(args)
    # one engine lives at a time, beside the batches (host) and the gradients of each mode
    plan = Engine(net, args.batch, shape, "exact", args.bits, args.dtype, allocate=False).plan.total_bytes
    samples = (args.batches + min(args.warmup, 8)) * args.batch
    data = samples * int(numpy.prod(shape)) * numpy.dtype(args.dtype).itemsize
    sysmem.require(plan + data + 2 * args.batches * net.num_params() * 8,
                   f"diagnosing {net.name} at batch {args.batch} over {args.batches} batches", backend.xp)
    print(describe(net, args.batch, shape, args.dtype, f"modes approx and naive ({args.bits}-bit, rounding "
                                                       f"{args.rounding}) vs exact"))
    print(f"data: lowmem.data.datasets.synthetic (learnable), {args.batches} batches, seed {args.seed}; "
          f"warm-up: {args.warmup} exact SGD steps (lr {args.lr})")
    batches = D.synthetic_batches(args.batches, args.batch, shape, net.num_classes, args.seed, args.dtype)
    if args.warmup:
        warm = D.synthetic_batches(min(args.warmup, 8), args.batch, shape, net.num_classes,
                                   args.seed + 1, args.dtype)
        net = D.warm_up(net, warm, args.warmup, lr=args.lr, dtype=args.dtype)
    d = D.gradient_errors(net, batches, bits=args.bits, dtype=args.dtype, rounding=args.rounding)
    if not args.no_table:
        print()
        print(d.table())
    print()
    print(d.summary_text())
    return 0


register("diagnose", "gradient error of approx and naive modes against SGD noise, per parameter tensor",
         diagnose_arguments, diagnose_command)


# ---- lowmem train ----------------------------------------------------------------

_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
PER_INVOCATION = ("time_limit",)        # not taken over from the checkpoint by --resume


def train_arguments(parser):
    """Add the `lowmem train` options to an argparse parser.

    Options left out are absent from the namespace (default SUPPRESS), so a
    resumed run takes them from its checkpoint; config_from_args fills the
    rest from TrainConfig's defaults."""
    S = argparse.SUPPRESS

    def opt(flag, field, help, **kw):
        default = _FIELDS[field].default
        help += "" if default is None else f" (default: {default})"
        parser.add_argument(flag, dest=field, default=S, help=help, **kw)

    opt("--dataset", "dataset", "cifar10 | cifar100 | fashion-mnist | synthetic | folder (--data DIR with "
        "train/<class>/*.jpg and val/<class>/*, needs lowmem[images])",
        choices=("cifar10", "cifar100", "fashion-mnist", "synthetic", "folder"))
    opt("--data", "data_dir", "directory holding the dataset files", metavar="DIR")
    parser.add_argument("--no-download", dest="download", action="store_false", default=S,
                        help="never download CIFAR; fail if the files are missing")
    opt("--pad-to", "pad_to", "Fashion-MNIST: zero-pad the 28x28 images to this size (0 keeps 28)",
        type=argtypes.count, metavar="SIZE")
    opt("--image-size", "image_size", "folder: crop / resize images to SIZE x SIZE", type=argtypes.positive,
        metavar="SIZE")
    opt("--workers", "workers", "folder: decoding threads", type=argtypes.positive, metavar="N")
    parser.add_argument("--skip-bad", dest="skip_bad", action="store_true", default=S,
                        help="folder: replace an unreadable image by the next readable one of its split "
                             "(counted) instead of stopping")
    opt("--limit-train", "limit_train", "use the first N training images (synthetic: how many)",
        type=argtypes.positive, metavar="N")
    opt("--limit-test", "limit_test", "use the first N test images", type=argtypes.positive, metavar="N")
    opt("--model", "model", argtypes.model_help(), type=argtypes.model, metavar="MODEL")
    opt("--depth", "depth", "; ".join(f"{name}: {spec.depth_help}" for name, spec in models.MODELS.items()),
        type=argtypes.positive)
    opt("--mode", "mode", "exact | approx (the method) | naive (the paper's baseline)", choices=MODES)
    opt("--bits", "bits", "bits per stored activation in approx / naive mode: 8, 4, 2, 1, or auto (a width "
        "per unit, chosen from error measured on the first training batches to fit --avg-bits)",
        type=argtypes.bits, choices=argtypes.BITS_CHOICES)
    opt("--avg-bits", "avg_bits", "with --bits auto: the saved x-hat within what every unit at A bits would take",
        type=argtypes.average_bits, metavar="A")
    opt("--rounding", "rounding", "how x-hat becomes a code: nearest (the fixed window), stochastic (unbiased "
        "everywhere: group ends stored, 2.125 bits/elem at --bits 2), or stochastic-window (stochastic inside "
        "the fixed window only); the ReLU mask is exact and the draws follow --seed and the iteration",
        choices=quant.ROUNDINGS)
    opt("--dtype", "dtype", "float32 | float64", choices=DTYPES)
    opt("--batch", "batch", "batch size (also the planned batch of the engine)", type=argtypes.positive)
    opt("--epochs", "epochs", "epochs to train in total (including those already done)", type=argtypes.positive)
    opt("--lr", "lr", "base learning rate", type=argtypes.positive_number)
    opt("--schedule", "schedule", "step: /10 at 50%% and 75%%; cosine; constant", choices=SCHEDULES)
    opt("--warmup-iters", "warmup_iters", "iterations at lr/10 first; default: 400, at most 5%% of the run",
        type=argtypes.count, metavar="N")
    opt("--momentum", "momentum", "SGD momentum, in [0, 1)", type=argtypes.momentum)
    opt("--weight-decay", "weight_decay", "weight decay of conv and FC weights", type=argtypes.nonnegative_number)
    parser.add_argument("--nesterov", dest="nesterov", action="store_true", default=S,
                        help="Nesterov momentum")
    parser.add_argument("--no-augment", dest="augment", action="store_false", default=S,
                        help="no random crop / flip")
    opt("--seed", "seed", "seed of the initial weights, batch order and augmentation", type=argtypes.count,
        metavar="S")
    opt("--out", "out", "run folder: checkpoint, metrics, config; new or empty unless --resume or "
        "--overwrite (required)", metavar="RUN_DIR", type=argtypes.folder, required=True)
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--resume", action="store_true", default=False,
                     help="continue the run in RUN_DIR from its checkpoint (settings come from it)")
    how.add_argument("--overwrite", action="store_true", default=False,
                     help="start a new run in RUN_DIR even though it is not empty: replaces lowmem's "
                          "files there (checkpoint, metrics, config, plan), leaves all others")
    opt("--time-limit", "time_limit", "stop after this many seconds of training, with a checkpoint",
        type=argtypes.positive_number, metavar="SECONDS")
    parser.add_argument("--no-progress", dest="progress", action="store_false", default=S,
                        help="no progress bar")
    parser.add_argument("--sync-bn", dest="sync_bn", action="store_true", default=S,
                        help="under mpiexec: batch-norm statistics over the global batch (default: per rank)")
    return parser


def config_from_args(args):
    """TrainConfig from a namespace of train_arguments; with --resume the unset fields
    come from the checkpoint in --out."""
    given = {k: v for k, v in vars(args).items() if k in _FIELDS}
    if not given.get("out"):
        raise ConfigError("--out RUN_DIR is required")
    base = {}
    if getattr(args, "resume", False):
        base = {k: v for k, v in saved_config(given["out"]).items()
                if k in _FIELDS and k not in PER_INVOCATION}
    return TrainConfig(**{**base, **given})


def train_command(args):
    """`lowmem train`: print the memory plan, train, print the final test accuracy; returns the
    exit code (the module docstring's table; a second Ctrl-C while stopping also gives 130).

    Under mpiexec (lowmem.system.distributed): one model on every rank, --batch the global batch;
    rank 0 prints and writes the run folder; a rank that fails ends the whole job (MPI_Abort)
    with its message and exit code, so no rank waits forever on it."""
    comm = None
    try:
        comm = distributed.get_communicator(xp=backend.xp)
        code = _train(args, comm)
    except distributed.StartupError as e:     # refused at start-up on every rank alike: no abort needed
        if comm.rank == 0:
            print(f"lowmem train: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:                # a second Ctrl-C, wherever it lands: no new checkpoint
        print("lowmem train: aborted by a second Ctrl-C; the last checkpoint (if any) is kept",
              file=sys.stderr)
        code = EXIT_SIGNAL[signal.SIGINT]
    except BaseException:
        if comm is None or comm.size == 1:
            raise
        traceback.print_exc()
        code = EXIT_ERROR
    if comm is not None and comm.size > 1 and code not in (EXIT_OK, EXIT_TIME_LIMIT) and code < 128:
        sys.stderr.flush()
        comm.abort(code)                     # the other ranks may be inside a collective
    return code


def _train(args, comm):
    def error(e, code):
        print(f"lowmem train: error: {e}", file=sys.stderr)
        return code

    try:
        config = config_from_args(args)
        trainer = Trainer(config, resume=args.resume, overwrite=args.overwrite, comm=comm)
        if trainer.lead:
            print(trainer.describe(), flush=True)
        t = time.monotonic()
        result = trainer.fit()
    except distributed.StartupError:
        raise
    except TrainingDiverged as e:
        return error(e, EXIT_DIVERGED)
    except (ConfigError, NotEnoughMemory) as e:     # settings this run cannot have
        return error(e, EXIT_USAGE)
    except (ValueError, OSError) as e:       # DataError, CheckpointError, RunDirError, ResumeError; disk
        return error(e, EXIT_ERROR)
    took = time.monotonic() - t
    if not trainer.lead:                     # rank 0 reports; the others exit as it does
        return EXIT_OK if result.status in ("finished",) or result.already_finished else (
            EXIT_SIGNAL.get(result.signal, 128 + (result.signal or 0)) if result.status == "signal" else
            EXIT_TIME_LIMIT if result.status == "time-limit" else EXIT_OK)
    acc = "n/a (no epoch finished)" if result.test_acc is None else f"{result.test_acc:.4f}"
    if result.already_finished:
        print(f"already finished: {result.checkpoint} has done {result.epoch:g} epochs (--epochs "
              f"{config.epochs}), last test accuracy {acc}; nothing to train (pass a larger --epochs "
              f"to train longer)")
        return EXIT_OK
    if result.status == "finished":
        print(f"final test accuracy {acc} after {config.epochs} epochs ({took:.0f} s); run in {config.out}")
        return EXIT_OK
    print(f"stopped ({result.status}) at epoch {result.epoch:.2f}, last test accuracy {acc} ({took:.0f} s); "
          f"continue with: lowmem train --out {config.out} --resume")
    if result.status == "signal":
        return EXIT_SIGNAL.get(result.signal, 128 + (result.signal or 0))
    return EXIT_TIME_LIMIT if result.status == "time-limit" else EXIT_OK


register("train", "train a network (datasets, schedules, checkpoints, resume)", train_arguments, train_command)


# ---- lowmem maxbatch ----------------------------------------------------------------

def _budget(text):
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _reserve(text):
    return 0 if str(text).strip() == "0" else _budget(text)


def maxbatch_arguments(p):
    """Options of `lowmem maxbatch`."""
    g = network_arguments(p, depth=164)
    g.add_argument("--dtype", choices=DTYPES, default="float32", help="default: %(default)s")
    backend_argument(g)
    p.add_argument("--budget", type=_budget, required=True,
                   help="memory budget, e.g. 2GiB, 512MiB, 1.5GB or 1000000 (bytes)")
    p.add_argument("--mode", choices=MODES, default="approx", help="default: %(default)s")
    p.add_argument("--bits", type=argtypes.bits, choices=argtypes.BITS_CHOICES, default=4,
                   help="bits per stored activation; auto: a width per unit, chosen from measured error "
                        "so that the saved x-hat is within --avg-bits on average (default: %(default)s)")
    auto_arguments(p)
    p.add_argument("--batch", type=argtypes.positive, default=32,
                   help="with --bits auto: the batch the widths are measured at (default: %(default)s)")
    p.add_argument("--workspace-mib", type=argtypes.positive, default=DEFAULT_WORKSPACE_BYTES >> 20,
                   help="bound on the conv workspace, MiB (default: %(default)s)")
    p.add_argument("--reserve", type=_reserve, default=0,
                   help="bytes of the budget to keep for what the plan does not count (the engine's "
                        "Python objects, small temporaries: ~0.1-2 MiB), e.g. 4MiB (default: 0)")
    p.add_argument("--verify", action="store_true",
                   help="allocate at that batch, run two training steps on random data and check "
                        "the measured peak is within the budget")


def over_budget_causes(m, plan, reserve):
    """What a measured peak spent beyond the plan, by cause, and the --reserve that covers it."""
    objects = max(0, m.held_bytes - m.plan_bytes)       # building the engine: schedule, views, ...
    step = m.peak_bytes - m.held_bytes                   # what a steady step allocated on top
    stated = plan.temporary_bytes
    parts = [f"the step's temporaries {fmt_bytes(step)}"
             + (f", {fmt_bytes(step - stated)} more than the plan's stated bound of {fmt_bytes(stated)} "
                f"(arrays the plan does not count)" if step > stated else
                f" (within the plan's stated bound of {fmt_bytes(stated)}: "
                + "; ".join(f"{what} {fmt_bytes(b)}" for what, b in plan.temporaries) + ")")]
    if objects:
        parts.append(f"the engine's Python objects {fmt_bytes(objects)}")
    unplanned = m.peak_bytes - m.plan_bytes
    return (f"beyond its plan the run used {fmt_bytes(unplanned)}: " + ", ".join(parts)
            + f"; rerun with --reserve {max(1, -(-(unplanned + reserve) // 2**20))}MiB")


def maxbatch_command(args):
    """`lowmem maxbatch`: print the batch and its plan by kind; 0, or 1 when --verify fails."""
    shape = input_shape(args)
    factory = lambda: models.build_model(args.model, args.depth, num_classes=args.classes,  # noqa: E731
                                         in_channels=shape[0])
    ws = args.workspace_mib << 20
    if args.reserve >= args.budget:
        raise ValueError(f"--reserve ({fmt_bytes(args.reserve)}) must be smaller than --budget "
                         f"({fmt_bytes(args.budget)})")
    planned_budget = args.budget - args.reserve
    sens = None
    if args.bits == "auto":
        # the widths for an average of --avg-bits do not depend on the batch (every unit's bytes
        # scale with it alike), so they are chosen once and the search runs over the batch
        from ..bits.allocate import allocate, allocation_for
        check_auto(args, budget_ok=False)
        sens = measure_sensitivity_synthetic(args, factory(), shape, args.batch)
        args.bits = allocate(sens, args.batch, avg_bits=args.avg_bits,
                             itemsize=numpy.dtype(args.dtype).itemsize).bits
    elif args.avg_bits is not None:
        raise ValueError("--avg-bits chooses the widths of --bits auto; with a fixed --bits drop it")
    n = max_batch(factory, shape, planned_budget, args.mode, args.bits, args.dtype, ws)
    eng = planned_engine(factory, n, shape, args.mode, args.bits, args.dtype, ws)
    over = planned_engine(factory, n + 1, shape, args.mode, args.bits, args.dtype, ws).plan.total_bytes
    total = eng.plan.total_bytes
    print(f"{eng.net.name}: {eng.net.num_params():,} parameters; input {'x'.join(map(str, shape))}, "
          f"mode {mode_label(args.mode, args.bits)}, {args.dtype}")
    reserve = f", less a reserve of {fmt_bytes(args.reserve)}" if args.reserve else ""
    if n == MAX_BATCH and over <= planned_budget:      # the search's cap bound the answer, not the budget
        print(f"budget {fmt_bytes(args.budget)} ({args.budget:,} B{reserve}): largest batch searched "
              f"{n:,} = 2^{MAX_BATCH.bit_length() - 1}, the search's cap, not the budget: batch {n:,} "
              f"plans only {fmt_bytes(total)} ({total / args.budget:.1%} of the budget)")
    else:
        print(f"budget {fmt_bytes(args.budget)} ({args.budget:,} B{reserve}): largest batch {n} "
              f"(batch {n + 1} would plan {fmt_bytes(over)})")
    if sens is not None:
        print(f"\nallocation (batch {n}):")
        print(allocation_for(sens, args.bits, n, itemsize=numpy.dtype(args.dtype).itemsize).table())
    print(f"\nplanned at batch {n}:")
    by = eng.plan.bytes_by_kind()
    for k in KINDS:
        if by[k]:
            print(f"  {k:<10} {by[k]:>16,} {fmt_bytes(by[k]):>12}")
    print(f"  {'total':<10} {total:>16,} {fmt_bytes(total):>12}  ({total / args.budget:.1%} of the budget)")
    if not args.verify:
        return EXIT_OK
    from .diagnostics import measure_peak
    m = measure_peak(factory(), n, shape, args.mode, args.bits, args.dtype, steps=2, workspace_bytes=ws)
    print()
    print(m.report())
    ok = m.peak_bytes <= args.budget
    print(f"verify: measured steady-state peak {fmt_bytes(m.peak_bytes)} ({m.peak_bytes:,} B) is "
          f"{'within' if ok else 'OVER'} the budget of {fmt_bytes(args.budget)} "
          f"({m.peak_bytes / args.budget:.1%}); the input batch ({fmt_bytes(m.input_bytes)}) is not counted")
    if not ok:
        print(over_budget_causes(m, eng.plan, args.reserve))
    return EXIT_OK if ok else EXIT_ERROR


register("maxbatch", "the largest batch whose memory plan fits a budget", maxbatch_arguments, maxbatch_command)
register("export", "write a run's model as .safetensors or .onnx (lowmem export RUN_DIR model.onnx)",
         export.add_arguments, export.run)
register("predict", "class names of image files from a run folder or an exported model "
         "(lowmem predict RUN_DIR_or_model IMAGE...)", predict.add_arguments, predict.run)


# ---- main ---------------------------------------------------------------------------

def make_parser():
    parser = argparse.ArgumentParser(
        prog="lowmem", description="Memory-efficient CNN training with backprop through approximate activations.")
    sub = parser.add_subparsers(dest="command", metavar="command")
    for name, (help, add_arguments, _) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=help, description=help))
    return parser


def main(argv=None):
    """Run the command line `argv` (default sys.argv[1:]); returns the exit status."""
    parser = make_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:                  # argparse: usage errors (2) and --help (0)
        return e.code
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    run = COMMANDS[args.command][2]

    def error(what, code):
        print(f"lowmem {args.command}: error: {what}", file=sys.stderr)
        return code

    try:
        if getattr(args, "backend", None):
            backend.set_backend(args.backend)
        return run(args)
    except ValueError as e:                  # a bad value the builders, the Engine or a memory check rejected
        return error(e, EXIT_USAGE)
    except FloatingPointError as e:          # diagnose's warm-up diverged
        return error(f"training diverged: {e}; try a lower --lr", EXIT_DIVERGED)
    except MemoryError as e:                 # what the checks before allocating did not foresee
        return error(f"out of memory ({e or 'no detail'})", EXIT_ERROR)
    except KeyboardInterrupt:
        return error("interrupted", EXIT_SIGNAL[signal.SIGINT])
    except BrokenPipeError:                  # `lowmem plan | head`: the reader has gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
