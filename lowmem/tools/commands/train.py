"""`lowmem train`: train a network (datasets, schedules, checkpoints, resume).

    lowmem train --dataset fashion-mnist --depth 20 --epochs 3 --out runs/fm [--resume | --overwrite]

The options are TrainConfig's fields (lowmem/train/config.py); the run is
lowmem.train.trainer.Trainer's. Options left out are absent from the namespace,
so a resumed run takes them from its checkpoint.

A subcommand module of lowmem/tools/commands/: `HELP` (its line in `lowmem --help`),
`add_arguments(parser)` declaring its options and `run(args) -> exit status`
(lowmem/tools/options.py's table); lowmem/tools/cli.py registers it.
"""
import argparse
import dataclasses
import re
import signal
import sys
import time
import traceback

from .. import argtypes
from ... import models
from ...system import backend, distributed
from ...core.engine import DTYPES
from ...units.widths import MODES, ROUNDINGS
from ...system.memory import NotEnoughMemory
from ...train.config import SCHEDULES, ConfigError, TrainConfig
from ...train.stop import Interrupted, preparing
from ...train.trainer import Trainer, TrainingDiverged, saved_config
from ..options import EXIT_DIVERGED, EXIT_ERROR, EXIT_OK, EXIT_SIGNAL, EXIT_TIME_LIMIT, EXIT_USAGE

_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
PER_INVOCATION = ("time_limit",)        # not taken over from the checkpoint by --resume
FLAG_OF = {"data_dir": "--data", "augment": "--no-augment", "download": "--no-download",
           "progress": "--no-progress"}         # the TrainConfig fields whose flag is not --field-name


def flag_of(field):
    """The `lowmem train` flag of a TrainConfig field: --field-name (underscores as dashes), or FLAG_OF's."""
    return FLAG_OF.get(field, "--" + field.replace("_", "-"))


def in_flags(message):
    """A TrainConfig refusal ("avg_bits=None: expected ...") in the words the user typed
    ("--avg-bits is missing: expected ..."); field names inside become flags too."""
    m = re.match(r"(\w+)=(.*?): expected (.*)$", str(message), re.S)
    if str(message).startswith("avg_bits "):        # the allocator's refusal of the budget
        return str(message).replace("avg_bits", "--avg-bits")
    if not m or m.group(1) not in _FIELDS:
        return str(message)
    flag, value, want = flag_of(m.group(1)), m.group(2), m.group(3)
    want = re.sub(r"\b(\w+)=('?)([\w.]+)\2", lambda w: f"{flag_of(w.group(1))} {w.group(3)}"
                  if w.group(1) in _FIELDS else w.group(0), want)
    if value == "None":
        return f"{flag} is missing: expected {want}"
    return f"{flag} {value[1:-1] if value[:1] == value[-1:] == chr(39) else value}: expected {want}"

HELP = "train a network (datasets, schedules, checkpoints, resume)"


def add_arguments(parser):
    """Add the `lowmem train` options to an argparse parser.

    Options left out are absent from the namespace (default SUPPRESS), so a
    resumed run takes them from its checkpoint; config_from_args fills the
    rest from TrainConfig's defaults."""
    S = argparse.SUPPRESS

    def opt(field, help, **kw):
        default = _FIELDS[field].default
        help += "" if default is None else f" (default: {default})"
        parser.add_argument(flag_of(field), dest=field, default=S, help=help, **kw)

    opt("dataset", "cifar10 | cifar100 | fashion-mnist | synthetic | folder (--data DIR with "
        "train/<class>/*.jpg and val/<class>/*, needs lowmem[images])",
        choices=("cifar10", "cifar100", "fashion-mnist", "synthetic", "folder"))
    opt("data_dir", "directory holding the dataset files", metavar="DIR")
    parser.add_argument(flag_of("download"), dest="download", action="store_false", default=S,
                        help="never download CIFAR; fail if the files are missing")
    opt("pad_to", "Fashion-MNIST: zero-pad the 28x28 images to this size (0 keeps 28)",
        type=argtypes.count, metavar="SIZE")
    opt("image_size", "folder: crop / resize images to SIZE x SIZE", type=argtypes.positive,
        metavar="SIZE")
    opt("workers", "folder: decoding threads", type=argtypes.positive, metavar="N")
    parser.add_argument(flag_of("skip_bad"), dest="skip_bad", action="store_true", default=S,
                        help="folder: replace an unreadable image by the next readable one of its split "
                             "(counted) instead of stopping")
    opt("limit_train", "use the first N training images (synthetic: how many)",
        type=argtypes.positive, metavar="N")
    opt("limit_test", "use the first N test images", type=argtypes.positive, metavar="N")
    opt("model", argtypes.model_help(), type=argtypes.model, metavar="MODEL")
    opt("depth", "; ".join(f"{name}: {spec.depth_help}" for name, spec in models.MODELS.items()),
        type=argtypes.positive)
    opt("mode", "exact | approx (the method) | naive (the paper's baseline)", choices=MODES)
    opt("bits", "bits per stored activation in approx / naive mode: 8, 4, 2, 1, or auto (a width "
        "per unit, chosen from error measured on the first training batches to fit --avg-bits), or per-unit "
        "widths (layer1.0.bn1=4,*=2 or a JSON file)",
        type=argtypes.bits, choices=argtypes.BITS_CHOICES)
    opt("avg_bits", "with --bits auto: the saved x-hat within what every unit at A bits would take",
        type=argtypes.average_bits, metavar="A")
    opt("price_along", "with --bits auto: price the widths along an earlier run of this network, "
        "at its training checkpoints (e.g. RUN/epoch1.ckpt ... RUN/epoch5.ckpt) and the initial weights, "
        "each weighed by the learning rate there (docs/bits.md 3c), instead of at the initial weights alone",
        nargs="+", metavar="CKPT")
    opt("rounding", "how x-hat becomes a code: nearest (the fixed window), stochastic (unbiased "
        "everywhere: group ends stored, at most 2.125 bits/elem at --bits 2), dither (the same code, "
        "its decoder subtracting each element's draw: about half the draw variance), or "
        "stochastic-window (stochastic inside the fixed window only); the ReLU mask is exact and "
        "the draws follow --seed and the iteration",
        choices=ROUNDINGS)
    opt("dtype", "float32 | float64", choices=DTYPES)
    opt("batch", "batch size (also the planned batch of the engine)", type=argtypes.positive)
    opt("epochs", "epochs to train in total (including those already done)", type=argtypes.positive)
    opt("lr", "base learning rate", type=argtypes.positive_number)
    opt("schedule", "step: /10 at 50%% and 75%%; cosine; constant", choices=SCHEDULES)
    opt("warmup_iters", "iterations at lr/10 first; default: 400, at most 5%% of the run",
        type=argtypes.count, metavar="N")
    opt("momentum", "SGD momentum, in [0, 1)", type=argtypes.momentum)
    opt("weight_decay", "weight decay of conv and FC weights", type=argtypes.nonnegative_number)
    parser.add_argument(flag_of("nesterov"), dest="nesterov", action="store_true", default=S,
                        help="Nesterov momentum")
    parser.add_argument(flag_of("augment"), dest="augment", action="store_false", default=S,
                        help="no random crop / flip")
    opt("seed", "seed of the initial weights, batch order and augmentation", type=argtypes.seed,
        metavar="S")
    opt("out", "run folder: checkpoint, metrics, config; new or empty unless --resume or "
        "--overwrite (required)", metavar="RUN_DIR", type=argtypes.folder, required=True)
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--resume", action="store_true", default=False,
                     help="continue the run in RUN_DIR from its checkpoint (settings come from it)")
    how.add_argument("--overwrite", action="store_true", default=False,
                     help="start a new run in RUN_DIR even though it is not empty: replaces lowmem's "
                          "files there (checkpoint, metrics, config, plan), leaves all others")
    opt("time_limit", "stop after this many seconds of training, with a checkpoint",
        type=argtypes.positive_number, metavar="SECONDS")
    opt("log_every", "a step record (loss, accuracy, lr, img/s) in metrics.jsonl every N "
        "iterations, 0 for none", type=argtypes.count, metavar="N")
    parser.add_argument(flag_of("progress"), dest="progress", action="store_false", default=S,
                        help="no progress bar")
    parser.add_argument(flag_of("sync_bn"), dest="sync_bn", action="store_true", default=S,
                        help="under mpiexec: batch-norm statistics over the global batch (default: per rank)")
    return parser


def config_from_args(args):
    """TrainConfig from a namespace of add_arguments; with --resume the unset fields
    come from the checkpoint in --out."""
    given = {k: v for k, v in vars(args).items() if k in _FIELDS}
    if not given.get("out"):
        raise ConfigError("--out RUN_DIR is required")
    base = {}
    if getattr(args, "resume", False):
        base = {k: v for k, v in saved_config(given["out"]).items()
                if k in _FIELDS and k not in PER_INVOCATION}
        if "bits" in given and not isinstance(given["bits"], dict) and given["bits"] != "auto":
            base.pop("avg_bits", None)      # a fixed --bits has no average: the resume check names bits
    return TrainConfig(**{**base, **given})


def run(args):
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
        with preparing():                    # a signal now stops the preparation: nothing to save yet
            config = config_from_args(args)
            trainer = Trainer(config, resume=args.resume, overwrite=args.overwrite, comm=comm)
        if trainer.lead:
            print(trainer.describe(), flush=True)
        t = time.monotonic()
        result = trainer.fit()
    except distributed.StartupError:
        raise
    except Interrupted as e:
        return error(f"stopped by {e} while preparing the run (loading data, measuring --bits auto); "
                     f"nothing was trained and no checkpoint written", EXIT_SIGNAL[e.signum])
    except TrainingDiverged as e:
        return error(e, EXIT_DIVERGED)
    except ConfigError as e:                 # settings this run cannot have, in the flags' words
        return error(in_flags(e), EXIT_USAGE)
    except NotEnoughMemory as e:
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
