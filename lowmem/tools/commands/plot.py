"""`lowmem plot`: the curves of training runs, several runs on the same axes.

    lowmem plot runs/exact runs/4bit runs/2bit --out curves.png     # or .svg

Loss, accuracy (train and test), learning rate and images per second against the
iteration, from each run folder's metrics.jsonl; each run's legend entry names its mode,
model and planned memory (lowmem/tools/plot.py draws, lowmem/tools/runcurves.py reads).
Needs matplotlib, the optional extra lowmem[plot].

A subcommand module of lowmem/tools/commands/: `HELP` (its line in `lowmem --help`),
`add_arguments(parser)` declaring its options and `run(args) -> exit status`
(lowmem/tools/options.py's table); lowmem/tools/cli.py registers it.
"""
import sys

from .. import plot
from ..options import EXIT_ERROR, EXIT_OK
from ..runcurves import RunError

HELP = "draw the curves of training runs (lowmem plot RUN_DIR [RUN_DIR ...] --out curves.png)"


def add_arguments(parser):
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="folders of lowmem train runs; several are drawn on the same axes")
    parser.add_argument("--out", required=True, metavar="FILE", help="the figure to write: .png or .svg")
    return parser


def run(args):
    """0 written; 1 a folder that holds no run, or the file could not be written; 2 a bad
    --out name or no matplotlib (a ValueError: the dispatcher's one line)."""
    out = plot.check_path(args.out)
    plot.require()
    try:
        plot.curves_figure(args.runs, out)
    except (RunError, OSError) as e:
        print(f"lowmem plot: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    print(f"wrote {out}")
    return EXIT_OK
