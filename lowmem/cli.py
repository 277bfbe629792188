"""The `lowmem` command line.

    lowmem plan --model preact-cifar --depth 164 --batch 128 --mode approx --bits 4 [--compare] [--measure]
    lowmem plan --model preact-imagenet --depth 152 --input 3x224x224 --classes 1000
    lowmem diagnose --depth 20 --batch 32 --bits 4 [--batches 4] [--warmup 0]

Subcommands live in one registry, `COMMANDS`: each is a pair of small
functions, `<name>_arguments(parser)` declaring its options and
`<name>_command(args) -> exit code` doing the work, added with `register`.
`model_arguments` / `build_network` are the shared model options (model,
depth, classes, input, batch, dtype) any subcommand may use.

Bad arguments are usage errors (exit status 2, a message naming the
problem): argparse checks choices (mode, bits in {1, 2, 4, 8}, model,
dtype); the model builders and the Engine check the rest, and `main`
turns their ValueError into the same kind of message.

`main(argv)` returns the exit status instead of exiting, so tests call it
in-process; the console script wraps it in sys.exit.
"""
import argparse
import os
import sys

from . import argtypes, backend, quant
from .engine import DEFAULT_WORKSPACE_BYTES, DTYPES, MODES, Engine
from .models import preact_resnet_cifar, preact_resnet_imagenet
from .plan import KINDS, fmt_bytes

COMMANDS = {}       # name -> (help, add_arguments(parser), run(args) -> int)


def register(name, help, add_arguments, run):
    """Add subcommand `name`: add_arguments(parser) declares its options, run(args) returns an exit code."""
    if name in COMMANDS:
        raise ValueError(f"subcommand {name!r} registered twice")
    COMMANDS[name] = (help, add_arguments, run)


# ---- shared options -----------------------------------------------------------

MODELS = {"preact-cifar": (preact_resnet_cifar, 10, (3, 32, 32)),
          "preact-imagenet": (preact_resnet_imagenet, 1000, (3, 224, 224))}


def model_arguments(p, depth, batch):
    """The model and batch options shared by subcommands (defaults: depth, batch)."""
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=sorted(MODELS), default="preact-cifar",
                   help="network family (default: %(default)s)")
    g.add_argument("--depth", type=argtypes.positive, default=depth,
                   help="preact-cifar: 6n+2 or 9n+2 (20, 56, 110, 164, 1001, ...); "
                        "preact-imagenet: 18, 34, 50, 101, 152 (default: %(default)s)")
    g.add_argument("--classes", type=argtypes.positive, default=None,
                   help="number of classes (default: 10 for preact-cifar, 1000 for preact-imagenet)")
    g.add_argument("--input", type=argtypes.shape, default=None, metavar="CxHxW",
                   help="input shape of one sample (default: 3x32x32 for preact-cifar, 3x224x224 for preact-imagenet)")
    g.add_argument("--batch", type=argtypes.positive, default=batch, help="batch size (default: %(default)s)")
    g.add_argument("--dtype", choices=DTYPES, default="float32", help="default: %(default)s")
    g.add_argument("--backend", choices=("numpy", "cupy", "auto"), default=None,
                   help="array backend (default: LOWMEM_BACKEND, else auto)")


def build_network(args):
    """(network, input_shape) from the model options; ValueError on a bad combination."""
    make, classes, shape = MODELS[args.model]
    shape = args.input or shape
    net = make(args.depth, num_classes=args.classes or classes, in_channels=shape[0], seed=getattr(args, "seed", 0))
    return net, shape


def mode_label(mode, bits):
    """'exact' or e.g. 'approx 4-bit'."""
    return mode if mode == "exact" else f"{mode} {bits}-bit"


def describe(net, batch, shape, dtype, what):
    """One line: the network, the batch, the input, `what` (the mode) and the dtype."""
    size = "x".join(map(str, shape))
    return (f"{net.name}: {net.num_params():,} parameters, {len(net.layers)} layers; "
            f"batch {batch}, input {size}, {what}, {dtype}")


# ---- lowmem plan ----------------------------------------------------------------

def plan_arguments(p):
    model_arguments(p, depth=164, batch=128)
    p.add_argument("--mode", choices=MODES, default="approx", help="default: %(default)s")
    p.add_argument("--bits", type=int, choices=quant.BITS[::-1], default=4,
                   help="bits per stored activation in approx/naive mode (default: %(default)s)")
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
    eng = Engine(net, args.batch, shape, args.mode, args.bits, args.dtype, ws, allocate=False)
    print(describe(net, args.batch, shape, args.dtype, "mode " + mode_label(args.mode, args.bits)))
    if not args.no_schedule:
        print(f"\nschedule ({len(eng.schedule)} steps):")
        print(eng.schedule.format(max_rows=60))
    print("\nmemory plan:")
    print(eng.plan.report(max_rows=args.rows))
    saved = eng.plan.bytes_by_kind()["saved"]
    print(f"saved for backward: {fmt_bytes(saved)} ({saved / args.batch / 1e6:.3f} MB per sample)")
    if args.compare:
        other = "exact" if args.mode != "exact" else "approx"
        ref = Engine(net, args.batch, shape, other, args.bits, args.dtype, ws, allocate=False)
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
    p.add_argument("--batches", type=int, default=4,
                   help="mini-batches to average over; >= 2, the SGD noise needs several (default: %(default)s)")
    p.add_argument("--warmup", type=argtypes.count, default=0,
                   help="exact SGD steps on the synthetic data before measuring (default: %(default)s)")
    p.add_argument("--lr", type=float, default=0.05, help="warm-up learning rate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="network and data seed (default: %(default)s)")
    p.add_argument("--no-table", action="store_true", help="print only the summary")


def diagnose_command(args):
    from . import diagnostics as D
    if args.batches < 2:
        raise ValueError(f"--batches must be at least 2 (the SGD noise compares batches), got {args.batches}")
    net, shape = build_network(args)
    print(describe(net, args.batch, shape, args.dtype, f"modes approx and naive ({args.bits}-bit) vs exact"))
    print(f"data: lowmem.data.synthetic (learnable), {args.batches} batches, seed {args.seed}; "
          f"warm-up: {args.warmup} exact SGD steps (lr {args.lr})")
    batches = D.synthetic_batches(args.batches, args.batch, shape, net.num_classes, args.seed, args.dtype)
    if args.warmup:
        warm = D.synthetic_batches(min(args.warmup, 8), args.batch, shape, net.num_classes,
                                   args.seed + 1, args.dtype)
        net = D.warm_up(net, warm, args.warmup, lr=args.lr, dtype=args.dtype)
    d = D.gradient_errors(net, batches, bits=args.bits, dtype=args.dtype)
    if not args.no_table:
        print()
        print(d.table())
    print()
    print(d.summary_text())
    return 0


register("diagnose", "gradient error of approx and naive modes against SGD noise, per parameter tensor",
         diagnose_arguments, diagnose_command)


# ---- train, maxbatch: they live with their concern ------------------------------

from .trainer import add_train_arguments, run_train          # noqa: E402
from .maxbatch import add_maxbatch_arguments, run_maxbatch    # noqa: E402

register("train", "train a network (datasets, schedules, checkpoints, resume)", add_train_arguments, run_train)
register("maxbatch", "the largest batch whose memory plan fits a budget", add_maxbatch_arguments, run_maxbatch)


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
        return 2
    run = COMMANDS[args.command][2]
    try:
        if getattr(args, "backend", None):
            backend.set_backend(args.backend)
        return run(args)
    except ValueError as e:                  # a bad value the builders or the Engine rejected
        print(f"lowmem {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:                  # `lowmem plan | head`: the reader has gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
