"""What every `lowmem` subcommand shares: the exit statuses and the model, backend and
--bits auto options (lowmem/tools/commands/ holds the subcommands, lowmem/tools/cli.py the dispatcher).

Exit status, the same for every subcommand:

    0    done (also when the reader of its printout stops early: `lowmem plan | head`; not
         for `lowmem train`, whose run then stops: 1)
    1    the data, a checkpoint, a run folder, the disk, or --verify failed
         (missing or damaged files, a folder lowmem may not use, a full disk)
    2    a bad command line: an option's value, a combination the model, the
         engine or the optimizer refuses, or more memory than the machine has
    3    training diverged (a non-finite loss)
    4    `lowmem train` stopped by --time-limit (resume to continue)
    130  interrupted by Ctrl-C (SIGINT); 143 by SIGTERM (train: after a checkpoint)

`network_arguments` / `model_arguments` / `build_network` are the shared model options
(model, depth, classes, input, batch, dtype); the models come from the one registry,
lowmem.models.MODELS. The value types of the options are lowmem/tools/argtypes.py's.
"""
import signal

from . import argtypes, gradient_error
from ..formats.onnx_import import file_input_shape
from .. import models
from ..bits.auto import choose_widths
from ..core.engine import DTYPES
from ..units.widths import ROUNDINGS
from ..units.widths import FLOAT

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_DIVERGED, EXIT_TIME_LIMIT = 0, 1, 2, 3, 4
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}     # 128 + signal number


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
    """--input, or the model's default input shape (an ONNX file's own, where it fixes one)."""
    if args.input or not models.is_onnx_path(args.model):
        return args.input or models.model_spec(args.model).input_shape
    return file_input_shape(args.model)


def build_network(args):
    """(network, input_shape) from the model options; ValueError on a bad combination."""
    shape = input_shape(args)
    net = models.build_model(args.model, args.depth, num_classes=args.classes, in_channels=shape[0],
                             seed=getattr(args, "seed", 0), input_shape=shape)
    return net, shape


def mode_label(mode, bits):
    """'exact', e.g. 'approx 4-bit', or 'approx auto (2.00 bits on average)' for per-unit widths."""
    if mode == "exact":
        return mode
    if isinstance(bits, dict):            # e.g. 'approx 2-bit x16, 4-bit x2, 1-bit x1'
        widths = [FLOAT if k == FLOAT else f"{k}-bit" for k in bits.values()]
        return mode + " " + ", ".join(f"{w} x{widths.count(w)}" for w in dict.fromkeys(widths))
    return f"{mode} {bits}-bit"


def unit_widths(eng, bits):
    """Per-unit widths as the engine resolved them ({unit: K or "float"}; a "*" default counted
    once per unit it covers), or the uniform `bits`."""
    if not isinstance(bits, dict):
        return bits
    return {u: "float" if k is None else k for u, k in eng.unit_bits.items()}


def describe(net, batch, shape, dtype, what):
    """One line: the network, the batch, the input, `what` (the mode) and the dtype."""
    size = "x".join(map(str, shape))
    return (f"{net.name}: {net.num_params():,} parameters, {len(net.layers)} layers; "
            f"batch {batch}, input {size}, {what}, {dtype}")


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


def auto_widths(args, net, shape, batch, budget=None, ws=None):
    """--bits auto for plan and maxbatch, through the one door (lowmem.bits.auto.choose_widths),
    measured on learnable synthetic batches (these commands have no data), at `batch` for
    --avg-bits or `budget` (the whole plan), with the code of --rounding where the command has
    it; prints the measurement's line. (Allocation, Sensitivity)."""
    n = args.measure_batch or min(batch, 32)
    batches = gradient_error.synthetic_batches(args.measure_batches, n, shape, net.num_classes, 0, args.dtype)

    def measured(sens):
        print(f"sensitivity: {args.measure_batches} synthetic batches of {n} (lowmem.data.datasets.synthetic, "
              f"untrained weights), measured in {sens.seconds:.1f} s")
    return choose_widths(net, batches, batch, avg_bits=args.avg_bits, budget=budget, mode=args.mode,
                         dtype=args.dtype, rounding=getattr(args, "rounding", "nearest"), workspace_bytes=ws,
                         measured=measured, names=FLAG_NAMES)


FLAG_NAMES = {"avg_bits": "--avg-bits", "budget": "--budget"}      # the budgets as the user typed them


def rounding_argument(p, help_tail=""):
    """--rounding: the code x-hat is kept in (docs/quantizer.md)."""
    p.add_argument("--rounding", choices=ROUNDINGS, default="nearest",
                   help="the code (docs/quantizer.md): nearest (the fixed window), stochastic (unbiased, with "
                        "group ends: a little metadata per element), dither (the same code with a subtractive dither: "
                        "less draw noise), stochastic-window (stochastic inside the "
                        "fixed window only)" + help_tail + " (default: %(default)s)")
