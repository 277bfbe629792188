"""`lowmem predict`: class names for image files, from a run folder or an exported model.

    lowmem predict runs/photos cat.jpg dog.png          # a run folder (its checkpoint)
    lowmem predict model.safetensors cat.jpg            # or model.onnx (needs onnxruntime)

Loading and preprocessing are lowmem/tools/predict.py's (`predict_files`).

A subcommand module of lowmem/tools/commands/: `HELP` (its line in `lowmem --help`),
`add_arguments(parser)` declaring its options and `run(args) -> exit status`
(lowmem/tools/options.py's table); lowmem/tools/cli.py registers it.
"""
import sys

from ..argtypes import positive
from ..predict import CHUNK, predict_files

HELP = "class names of image files from a run folder or an exported model (lowmem predict RUN_DIR_or_model IMAGE...)"


def add_arguments(parser):
    parser.add_argument("model", metavar="MODEL", help="a run folder, a checkpoint, model.safetensors or model.onnx")
    parser.add_argument("images", metavar="IMAGE", nargs="+", help="image files (any format Pillow reads)")
    parser.add_argument("--batch", type=positive, default=CHUNK, metavar="N",
                        help="images per forward pass; memory depends on this, not on the number of "
                             "images (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (default: one on a "
                                                                    "terminal for more than N images)")
    return parser


def run(args):
    """`lowmem predict`: 0 printed; 1 a model or image it cannot use; 2 a missing extra."""
    try:
        results = predict_files(args.model, args.images, args.batch, False if args.no_progress else None)
    except ImportError as e:
        print(f"lowmem predict: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:          # ExportError, DataError, CheckpointError
        print(f"lowmem predict: error: {e}", file=sys.stderr)
        return 1
    for path, name, p in results:
        print(f"{path}: {name} ({p:.3f})")
    return 0
