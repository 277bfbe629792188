"""`lowmem diagnose`: the gradient error of approx and naive modes against SGD noise, per parameter tensor.

    lowmem diagnose --depth 20 --batch 32 --bits 4 [--batches 4] [--warmup 0]

The measurement is lowmem/tools/diagnostics.py's (`gradient_errors`), on learnable
synthetic batches.

A subcommand module of lowmem/tools/commands/: `HELP` (its line in `lowmem --help`),
`add_arguments(parser)` declaring its options and `run(args) -> exit status`
(lowmem/tools/options.py's table); lowmem/tools/cli.py registers it.
"""
import numpy

from .. import argtypes
from ...system import backend, memory as sysmem
from ...units.widths import BITS
from ...core.engine import Engine
from .. import diagnostics as D
from ..options import build_network, describe, model_arguments

HELP = "gradient error of approx and naive modes against SGD noise, per parameter tensor"


def add_arguments(p):
    model_arguments(p, depth=20, batch=32)
    p.add_argument("--bits", type=int, choices=BITS, default=4, help="default: %(default)s")
    p.add_argument("--batches", type=int, default=4,
                   help="mini-batches to average over; >= 2, the SGD noise needs several (default: %(default)s)")
    p.add_argument("--warmup", type=argtypes.count, default=0,
                   help="exact SGD steps on the synthetic data before measuring (default: %(default)s)")
    p.add_argument("--lr", type=argtypes.positive_number, default=0.05,
                   help="warm-up learning rate (default: %(default)s)")
    p.add_argument("--seed", type=argtypes.count, default=0, help="network and data seed (default: %(default)s)")
    p.add_argument("--no-table", action="store_true", help="print only the summary")


def run(args):
    if args.batches < 2:
        raise ValueError(f"--batches must be at least 2 (the SGD noise compares batches), got {args.batches}")
    net, shape = build_network(args)
    # one engine lives at a time, beside the batches (host) and the gradients of each mode
    plan = Engine(net, args.batch, shape, "exact", args.bits, args.dtype, allocate=False).plan.total_bytes
    samples = (args.batches + min(args.warmup, 8)) * args.batch
    data = samples * int(numpy.prod(shape)) * numpy.dtype(args.dtype).itemsize
    sysmem.require(plan + data + 2 * args.batches * net.num_params() * 8,
                   f"diagnosing {net.name} at batch {args.batch} over {args.batches} batches", backend.xp)
    print(describe(net, args.batch, shape, args.dtype, f"modes approx and naive ({args.bits}-bit) vs exact"))
    print(f"data: lowmem.data.datasets.synthetic (learnable), {args.batches} batches, seed {args.seed}; "
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
