"""`lowmem diagnose`: the gradient error of approx and naive modes against SGD noise, per parameter tensor.

    lowmem diagnose --depth 20 --batch 32 --bits 4 [--batches 4] [--warmup 0] [--rounding stochastic]
    lowmem diagnose --depth 20 --bits auto --avg-bits 2      # the allocation: predicted vs measured

The measurement is lowmem/tools/gradient_error.py's (`gradient_errors`), on learnable
synthetic batches.

A subcommand module of lowmem/tools/commands/: `HELP` (its line in `lowmem --help`),
`add_arguments(parser)` declaring its options and `run(args) -> exit status`
(lowmem/tools/options.py's table); lowmem/tools/cli.py registers it.
"""
import numpy

from .. import argtypes
from ...system import backend, memory as sysmem
from ...bits.auto import choose_widths
from ...core import checks
from ...units.widths import ROUNDINGS, named as widths_named
from ...core.engine import Engine
from .. import gradient_error
from ..options import FLAG_NAMES, build_network, describe, mode_label, model_arguments, unit_widths

HELP = "gradient error of approx and naive modes against SGD noise, per parameter tensor"


def add_arguments(p):
    model_arguments(p, depth=20, batch=32)
    p.add_argument("--bits", type=argtypes.bits, choices=argtypes.BITS_CHOICES, default=4,
                   help="8, 4, 2, 1; auto (widths chosen from the measured sensitivity to fit --avg-bits, "
                        "its predicted error/noise printed beside the measured one); or per-unit widths "
                        "(layer1.0.bn1=4,*=2 or a JSON file) (default: %(default)s)")
    p.add_argument("--avg-bits", type=argtypes.average_bits, default=None, metavar="A",
                   help="with --bits auto: the saved x-hat within what every unit at A bits would take")
    p.add_argument("--rounding", choices=ROUNDINGS, default="nearest",
                   help="how x-hat becomes a code in approx and naive mode; a stochastic one is drawn twice "
                        "per batch, so the persistent bias is told apart from the draws' noise "
                        "(default: %(default)s)")
    p.add_argument("--batches", type=int, default=4,
                   help="mini-batches to average over; >= 2, the SGD noise needs several (default: %(default)s)")
    p.add_argument("--warmup", type=argtypes.count, default=0,
                   help="exact SGD steps on the synthetic data before measuring (default: %(default)s)")
    p.add_argument("--lr", type=argtypes.positive_number, default=0.05,
                   help="warm-up learning rate (default: %(default)s)")
    p.add_argument("--seed", type=argtypes.seed, default=0, help="network and data seed (default: %(default)s)")
    p.add_argument("--no-table", action="store_true", help="print only the summary")


def run(args):
    if args.batches < 2:
        raise ValueError(f"--batches must be at least 2 (the SGD noise compares batches), got {args.batches}")
    if (args.bits == "auto") != (args.avg_bits is not None):
        raise ValueError("--bits auto needs --avg-bits" if args.bits == "auto" else
                         "--avg-bits chooses the widths of --bits auto; with a fixed --bits drop it")
    net, shape = build_network(args)
    widths, bits = "auto", args.bits
    if bits != "auto":                              # per-unit names checked before any work
        bits = unit_widths(Engine(net, args.batch, shape, "approx", bits, args.dtype, allocate=False), bits)
        widths = mode_label("approx", bits)[len("approx "):]
    # one engine lives at a time, beside the batches (host) and the gradients of each mode
    plan = Engine(net, args.batch, shape, "exact", 4, args.dtype, allocate=False).plan.total_bytes
    samples = (args.batches + min(args.warmup, 8)) * args.batch
    data = samples * int(numpy.prod(shape)) * numpy.dtype(args.dtype).itemsize
    sysmem.require(plan + data + 2 * args.batches * net.num_params() * 8,
                   f"diagnosing {net.name} at batch {args.batch} over {args.batches} batches", backend.xp)
    print(describe(net, args.batch, shape, args.dtype, f"modes approx and naive ({widths}"
                   + ("" if bits == "auto" else checks.rounding_label(args.rounding, widths_named(bits)))
                   + ") vs exact"))
    print(f"data: lowmem.data.datasets.synthetic (learnable), {args.batches} batches, seed {args.seed}; "
          f"warm-up: {args.warmup} exact SGD steps (lr {args.lr})")
    batches = gradient_error.synthetic_batches(args.batches, args.batch, shape, net.num_classes, args.seed, args.dtype)
    if args.warmup:
        warm = gradient_error.synthetic_batches(min(args.warmup, 8), args.batch, shape, net.num_classes,
                                   args.seed + 1, args.dtype)
        net = gradient_error.warm_up(net, warm, args.warmup, lr=args.lr, dtype=args.dtype)
    predicted = None
    if bits == "auto":
        a, _ = choose_widths(net, batches, args.batch, avg_bits=args.avg_bits, dtype=args.dtype,
                             rounding=args.rounding, names=FLAG_NAMES)
        bits, predicted = a.bits, a.predicted_ratio
        print(f"\nallocation (batch {args.batch}, measured on the same batches):")
        print(a.table())
    d = gradient_error.gradient_errors(net, batches, bits=bits, dtype=args.dtype, rounding=args.rounding)
    if not args.no_table:
        print()
        print(d.table())
    print()
    print(d.summary_text())
    if predicted is not None:
        print(f"approx error/noise of all parameters: predicted {predicted:.3g} (the allocation), "
              f"measured {d.summary()['approx']['total_ratio']:.3g}")
    return 0
