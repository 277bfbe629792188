"""The `lowmem` command line (also `python -m lowmem`): the dispatcher over its subcommands.

    lowmem plan --model preact-cifar --depth 164 --batch 128 --mode approx --bits 4 [--compare] [--measure]
    lowmem diagnose --depth 20 --batch 32 --bits 4 [--batches 4] [--warmup 0]
    lowmem train --dataset fashion-mnist --depth 20 --epochs 3 --out runs/fm [--resume | --overwrite]
    lowmem maxbatch --model preact-cifar --depth 164 --budget 2GiB --mode approx --bits 4 [--verify]
    lowmem export RUN_DIR model.onnx | model.safetensors
    lowmem predict RUN_DIR_or_model IMAGE...
    lowmem plot RUN_DIR [RUN_DIR ...] --out curves.png

One module per subcommand, one convention: lowmem/tools/commands/<name>.py is
`lowmem <name>`, with `HELP`, `add_arguments(parser)` and `run(args) -> exit status`.
This module registers them in `COMMANDS` (`register`), builds the parser and maps the
errors a subcommand lets through to exit statuses. What the subcommands share (the exit
statuses, the model and --bits auto options) is lowmem/tools/options.py; the library code
they call stays in its modules (trainer.Trainer, maxbatch.max_batch, gradient_error, the Engine).

Every error is one line on stderr, `lowmem <command>: error: <what>`; a warning about a file
that reads but likely not as meant (formats.common.FormatWarning), `lowmem <command>: warning: <what>`.
`main(argv)` returns the exit status instead of exiting, so tests call it
in-process; the console script and `python -m lowmem` wrap it in sys.exit.
"""
import argparse
import os
import re
import signal
import sys
import warnings

from .._version import __version__
from ..formats.common import FormatWarning
from ..system import backend
from .commands import diagnose, export, maxbatch, plan, plot, predict, train
from .options import EXIT_DIVERGED, EXIT_ERROR, EXIT_OK, EXIT_SIGNAL, EXIT_USAGE

COMMANDS = {}       # name -> (help, add_arguments(parser), run(args) -> int)
NEGATIVE = re.compile(r"^-\.?\d")


def register(name, help, add_arguments, run):
    """Add subcommand `name`: add_arguments(parser) declares its options, run(args) returns an exit code."""
    if name in COMMANDS:
        raise ValueError(f"subcommand {name!r} registered twice")
    COMMANDS[name] = (help, add_arguments, run)


for _command in (plan, diagnose, train, maxbatch, export, predict, plot):      # the order of `lowmem --help`
    register(_command.__name__.rsplit(".", 1)[1], _command.HELP, _command.add_arguments, _command.run)
del _command


def make_parser():
    parser = argparse.ArgumentParser(
        prog="lowmem", description="Memory-efficient CNN training with backprop through approximate activations.")
    parser.add_argument("--version", action="version", version=f"lowmem {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="command")
    for name, (help, add_arguments, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help, description=help)
        # a value starting "-<digit>" is a value, not an option (lowmem has no such option): argparse
        # takes only "-1" and "-1.5" as negative numbers, so "--budget -1MiB" said "expected one argument"
        # and the value's own check never ran
        p._negative_number_matcher = NEGATIVE
        add_arguments(p)
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

    def warn(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, FormatWarning):          # lowmem's own: one line, like its errors
            print(f"lowmem {args.command}: warning: {message}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    shown = warnings.showwarning
    try:
        with warnings.catch_warnings():
            warnings.showwarning = warn
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
    except BrokenPipeError:                  # `lowmem plan | head`: the reader took what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        # a command whose work is its printout is done; a training run that stopped is not
        return EXIT_ERROR if args.command == "train" else EXIT_OK
    except OSError as e:                     # a file a command could not write (a full disk, ...)
        return error(re.sub(r"^\[Errno \d+\] ", "", str(e)), EXIT_ERROR)


if __name__ == "__main__":
    sys.exit(main())
