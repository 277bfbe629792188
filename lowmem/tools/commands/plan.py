"""`lowmem plan`: the schedule and memory plan of a network, nothing allocated unless --measure.

    lowmem plan --model preact-cifar --depth 164 --batch 128 --mode approx --bits 4 [--compare] [--measure]
    lowmem plan --model preact-imagenet --depth 152 --input 3x224x224 --classes 1000
    lowmem plan --depth 164 --batch 128 --compare --figure plan.png     # also the picture (lowmem[plot])

A subcommand module of lowmem/tools/commands/: `HELP` (its line in `lowmem --help`),
`add_arguments(parser)` declaring its options and `run(args) -> exit status`
(lowmem/tools/options.py's table); lowmem/tools/cli.py registers it.
"""
from .. import argtypes, peak_memory, plot
from ...core.engine import DEFAULT_WORKSPACE_BYTES, Engine
from ...units.widths import MODES, code_for
from ...core.plan import KINDS
from ...system.memory import fmt_bytes
from ..options import (auto_arguments, auto_widths, build_network, check_auto, describe, mode_label, unit_widths,
                       model_arguments, rounding_argument)

HELP = "print the schedule and memory plan of a network (no allocation unless --measure)"


def add_arguments(p):
    model_arguments(p, depth=164, batch=128)
    p.add_argument("--mode", choices=MODES, default="approx", help="default: %(default)s")
    p.add_argument("--bits", type=argtypes.bits, choices=argtypes.BITS_CHOICES, default=4,
                   help="bits per stored activation in approx/naive mode; auto: a width per unit, "
                        "chosen from measured error to fit --budget or --avg-bits; or per-unit widths "
                        "(layer1.0.bn1=4,*=2 or a JSON file) (default: %(default)s)")
    p.add_argument("--budget", type=argtypes.budget, default=None,
                   help="with --bits auto: the whole plan within this many bytes, e.g. 300MiB")
    auto_arguments(p)
    rounding_argument(p)
    p.add_argument("--workspace-mib", type=argtypes.positive, default=DEFAULT_WORKSPACE_BYTES >> 20,
                   help="bound on the conv workspace, MiB (default: %(default)s)")
    p.add_argument("--compare", action="store_true",
                   help="also plan exact mode and print both side by side, with ratios")
    p.add_argument("--measure", action="store_true",
                   help="allocate and run two training steps on random data; print the measured peak")
    p.add_argument("--no-schedule", action="store_true", help="do not print the schedule")
    p.add_argument("--rows", type=argtypes.positive, default=40, help="plan table rows, largest first (default: %(default)s)")
    p.add_argument("--figure", metavar="FILE", default=None,
                   help="also draw the plan into FILE (.png or .svg): the buffers along the schedule, the "
                        "bytes each layer saves, the totals by kind; with --compare both plans on one "
                        "scale (needs matplotlib: pip install lowmem[plot])")


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


def run(args):
    if args.figure is not None:              # before any work: a bad name or no matplotlib is one line
        args.figure = plot.check_path(args.figure)
        plot.require()
    net, shape = build_network(args)
    ws = args.workspace_mib << 20
    if args.bits == "auto":
        check_auto(args, budget_ok=True)
        a, _ = auto_widths(args, net, shape, args.batch, budget=args.budget, ws=ws)
        print(f"allocation (batch {args.batch}):")
        print(a.table())
        print()
        args.bits = a.bits
    elif args.budget is not None or args.avg_bits is not None:
        raise ValueError("--budget and --avg-bits choose the widths of --bits auto; "
                         "with a fixed --bits drop them")
    eng = Engine(net, args.batch, shape, args.mode, args.bits, args.dtype, ws, allocate=False,
                 rounding=args.rounding)
    print(describe(net, args.batch, shape, args.dtype, "mode " + mode_label(args.mode, unit_widths(eng, args.bits))))
    if eng.bits_per_element() is not None and any(code_for(args.rounding, K).unbiased
                                                  for K in eng.unit_bits.values() if K is not None):
        print(f"saved codes: {eng.bits_per_element():.5g} bits/elem, metadata included "
              f"(rounding {args.rounding})")
    if not args.no_schedule:
        print(f"\nschedule ({len(eng.schedule)} steps):")
        print(eng.schedule.format(max_rows=60))
    print("\nmemory plan:")
    print(eng.plan.report(max_rows=args.rows))
    saved = eng.plan.bytes_by_kind()["saved"]
    print(f"saved for backward: {fmt_bytes(saved)} ({saved / args.batch / 1e6:.3f} MB per sample)")
    ref = None
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
    if args.figure is not None:
        plot.plan_figure(eng, args.figure, compare=ref)
        print(f"\nfigure: {args.figure}")
    if args.measure:
        m = peak_memory.measure_peak(net, args.batch, shape, args.mode, args.bits, args.dtype, steps=2,
                         workspace_bytes=ws)
        print()
        print(m.report())
        print(f"steady-state peak / plan = {m.peak_bytes / m.plan_bytes:.3f}")
    return 0
