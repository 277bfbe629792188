"""`lowmem export`: a run's model as .safetensors or .onnx, with what travels with the weights.

    lowmem export RUN_DIR model.onnx | model.safetensors [--input CxHxW] [--opset N]

The formats and their metadata are lowmem/formats/'s (onnx_export.py, weights.py, metadata.py).

A subcommand module of lowmem/tools/commands/: `HELP` (its line in `lowmem --help`),
`add_arguments(parser)` declaring its options and `run(args) -> exit status`
(lowmem/tools/options.py's table); lowmem/tools/cli.py registers it.
"""
import argparse
import os
import sys

from .. import argtypes
from ...train.rundir import CHECKPOINT
from ...formats.common import ExportError
from ...formats.metadata import FORMATS, model_metadata
from ...formats.onnx_export import MIN_OPSET, OPSET, check_opset, export_onnx
from ...formats.weights import export_safetensors
from ..predict import REQUIRED, check_info, network_from_checkpoint

HELP = "write a run's model as .safetensors or .onnx (lowmem export RUN_DIR model.onnx)"


def add_arguments(parser):
    """Options of `lowmem export RUN_DIR OUT`."""
    parser.add_argument("run", metavar="RUN_DIR",
                        help="a training run folder (its checkpoint.ckpt) or a checkpoint file")
    parser.add_argument("output", metavar="OUT", help="model.safetensors or model.onnx (the suffix picks the format)")
    parser.add_argument("--input", type=_shape, default=None, metavar="CxHxW",
                        help="ONNX only: fix the input's height and width (default: symbolic)")
    parser.add_argument("--opset", type=_opset, default=OPSET,
                        help=f"ONNX opset, {MIN_OPSET} to the installed onnx's newest (default: %(default)s)")
    return parser


def _opset(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer opset, got {text!r}") from None
    try:
        return check_opset(value)
    except ImportError:            # without onnx, run() names the missing extra
        return value
    except ExportError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _shape(text):
    return argtypes.shape(text)


def run(args):
    """`lowmem export`: 0 written; 1 bad run folder or checkpoint; 2 a bad command line (the
    output's suffix) or a missing extra. Errors are one line, `lowmem export: error: ...`."""
    path = os.path.join(args.run, CHECKPOINT) if os.path.isdir(args.run) else args.run
    fmt = FORMATS.get(os.path.splitext(args.output)[1].lower())

    def error(e, code):
        print(f"lowmem export: error: {e}", file=sys.stderr)
        return code

    if fmt is None:
        return error(f"{args.output}: unknown format; the output must end in {' or '.join(FORMATS)}", 2)
    try:
        if not os.path.exists(path):
            raise ExportError(f"{path}: no checkpoint here (is {args.run} a lowmem training run folder?)")
        net, meta = network_from_checkpoint(path)
        if fmt == "onnx":
            export_onnx(net, args.output, args.input, args.opset, metadata=model_metadata(meta))
        else:
            export_safetensors(net, args.output, metadata=model_metadata(meta))
    except ImportError as e:
        return error(e, 2)
    except (ValueError, OSError) as e:           # ExportError, CheckpointError, ResumeError, onnx checks
        return error(e, 1)
    _warn_if_unpredictable(path, args.output, meta)
    print(f"wrote {args.output}: {net.name}, {net.num_params():,} parameters, iteration "
          f"{meta.get('iteration', '?')}" + (f", ONNX opset {args.opset}" if fmt == "onnx" else ""))
    return 0


def _warn_if_unpredictable(path, output, meta):
    """A warning on stderr when the checkpoint lacks what `lowmem predict` needs (a run of an older
    lowmem): the weights are exported all the same."""
    data = meta.get("data") or {}
    missing = [k for k in REQUIRED if k not in data]
    try:
        if missing:
            raise ExportError(f"{path} stores no {', '.join(missing)} (a run of a lowmem from before they "
                              f"were stored)")
        check_info(dict(data), path, run=True)
    except ExportError as e:
        print(f"lowmem export: warning: {e}; {output} holds the weights, but lowmem predict cannot use it",
              file=sys.stderr)


def main(argv=None):
    """`python -m lowmem.tools.commands.export RUN_DIR OUT` (the same as `lowmem export`)."""
    parser = add_arguments(argparse.ArgumentParser(prog="lowmem export", description=__doc__.split("\n")[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
