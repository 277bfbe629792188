"""`lowmem maxbatch`: the largest batch whose memory plan fits a budget.

    lowmem maxbatch --model preact-cifar --depth 164 --budget 2GiB --mode approx --bits 4 [--verify]

The search is lowmem/tools/maxbatch.py's (`max_batch`), from the plan alone;
--verify measures two real steps (lowmem/tools/peak_memory.py's `measure_peak`).

A subcommand module of lowmem/tools/commands/: `HELP` (its line in `lowmem --help`),
`add_arguments(parser)` declaring its options and `run(args) -> exit status`
(lowmem/tools/options.py's table); lowmem/tools/cli.py registers it.
"""
import numpy

from .. import argtypes, peak_memory
from ... import models
from ...core.engine import DEFAULT_WORKSPACE_BYTES, DTYPES
from ...units.widths import MODES
from ...core.plan import KINDS
from ...system.memory import fmt_bytes
from ...bits.allocate import allocation_for
from ..maxbatch import MAX_BATCH, max_batch, planned_engine
from ..options import (EXIT_ERROR, EXIT_OK, auto_arguments, auto_widths, backend_argument, check_auto,
                       input_shape, mode_label, network_arguments, unit_widths)

HELP = "the largest batch whose memory plan fits a budget"


def add_arguments(p):
    """Options of `lowmem maxbatch`."""
    g = network_arguments(p, depth=164)
    g.add_argument("--dtype", choices=DTYPES, default="float32", help="default: %(default)s")
    backend_argument(g)
    p.add_argument("--budget", type=argtypes.budget, required=True,
                   help="memory budget, e.g. 2GiB, 512MiB, 1.5GB or 1000000 (bytes)")
    p.add_argument("--mode", choices=MODES, default="approx", help="default: %(default)s")
    p.add_argument("--bits", type=argtypes.bits, choices=argtypes.BITS_CHOICES, default=4,
                   help="bits per stored activation; auto: a width per unit, chosen from measured error "
                        "so that the saved x-hat is within --avg-bits on average; or per-unit widths "
                        "(layer1.0.bn1=4,*=2 or a JSON file) (default: %(default)s)")
    auto_arguments(p)
    p.add_argument("--batch", type=argtypes.positive, default=32,
                   help="with --bits auto: the batch the widths are measured at (default: %(default)s)")
    p.add_argument("--workspace-mib", type=argtypes.positive, default=DEFAULT_WORKSPACE_BYTES >> 20,
                   help="bound on the conv workspace, MiB (default: %(default)s)")
    p.add_argument("--reserve", type=argtypes.reserve, default=0,
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


def run(args):
    """`lowmem maxbatch`: print the batch and its plan by kind; 0, or 1 when --verify fails."""
    shape = input_shape(args)
    factory = lambda: models.build_model(args.model, args.depth, num_classes=args.classes,  # noqa: E731
                                         in_channels=shape[0], input_shape=shape)
    ws = args.workspace_mib << 20
    if args.reserve >= args.budget:
        raise ValueError(f"--reserve ({fmt_bytes(args.reserve)}) must be smaller than --budget "
                         f"({fmt_bytes(args.budget)})")
    planned_budget = args.budget - args.reserve
    sens = None
    if args.bits == "auto":
        # the widths for an average of --avg-bits do not depend on the batch (every unit's bytes
        # scale with it alike), so they are chosen once and the search runs over the batch
        check_auto(args, budget_ok=False)
        a, sens = auto_widths(args, factory(), shape, args.batch)
        args.bits = a.bits
    elif args.avg_bits is not None:
        raise ValueError("--avg-bits chooses the widths of --bits auto; with a fixed --bits drop it")
    n = max_batch(factory, shape, planned_budget, args.mode, args.bits, args.dtype, ws)
    eng = planned_engine(factory, n, shape, args.mode, args.bits, args.dtype, ws)
    over = planned_engine(factory, n + 1, shape, args.mode, args.bits, args.dtype, ws).plan.total_bytes
    total = eng.plan.total_bytes
    print(f"{eng.net.name}: {eng.net.num_params():,} parameters; input {'x'.join(map(str, shape))}, "
          f"mode {mode_label(args.mode, unit_widths(eng, args.bits))}, {args.dtype}")
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
    m = peak_memory.measure_peak(factory(), n, shape, args.mode, args.bits, args.dtype, steps=2, workspace_bytes=ws)
    print()
    print(m.report())
    ok = m.peak_bytes <= args.budget
    print(f"verify: measured steady-state peak {fmt_bytes(m.peak_bytes)} ({m.peak_bytes:,} B) is "
          f"{'within' if ok else 'OVER'} the budget of {fmt_bytes(args.budget)} "
          f"({m.peak_bytes / args.budget:.1%}); the input batch ({fmt_bytes(m.input_bytes)}) is not counted")
    if not ok:
        print(over_budget_causes(m, eng.plan, args.reserve))
    return EXIT_OK if ok else EXIT_ERROR
