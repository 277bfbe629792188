"""One network's training step with a module setting of lowmem as it is and as --set gives it,
alternated round by round on one engine, in one process: what that setting is worth to a step.

    python benchmarks/switch_alternated.py --set lowmem.ops.conv.SIDE_BY_SIDE=False \
        --model densenet121.onnx --batch 16 --config exact --rounds 16
    python benchmarks/switch_alternated.py --set lowmem.units.cpu_base.SPLIT_WORK=32768 --depth 164

--set MODULE.NAME=VALUE (repeatable) names a module-level setting of lowmem (it must exist) and
the value to compare with (a Python literal: True, False, a number). Each round runs --steps
steps with the settings as they are and --steps with --set's, the order swapped every round;
a side's round is the median of its steps. Printed: both sides' median step and the median
(and range) of the rounds' ratios set / as is. The engine and its plan are the same on both
sides, so only what the settings change between steps differs (a setting read when the engine
is built, such as the plan's, is not compared here: use step_vs_commit.py). Wall-clock on
whatever machine runs it: say which, and time nothing else at once.
"""
import argparse
import ast
import importlib
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lowmem                                                              # noqa: E402
from step_alternated import batch_for, make_step, median_step, parse                   # noqa: E402 (beside this script)


def setting(text):
    """(module, name, value) of MODULE.NAME=VALUE: a lowmem module's existing setting and a literal."""
    target, sep, value = text.partition("=")
    module, _, name = target.rpartition(".")
    if not (sep and module and name):
        raise argparse.ArgumentTypeError(f"a setting is MODULE.NAME=VALUE, got {text!r}")
    if module.split(".")[0] != "lowmem":
        raise argparse.ArgumentTypeError(f"a setting of lowmem's, got module {module!r}")
    try:
        mod = importlib.import_module(module)
    except ImportError:
        raise argparse.ArgumentTypeError(f"no module {module!r}")
    if not hasattr(mod, name):
        raise argparse.ArgumentTypeError(f"{module} has no setting {name!r}")
    try:
        return mod, name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{text!r}: the value must be a Python literal (True, 4096, ...)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", dest="settings", type=setting, action="append", required=True, metavar="MODULE.NAME=VALUE")
    p.add_argument("--model", metavar="FILE.onnx", help="an exported CNN instead of the pre-activation ResNet")
    p.add_argument("--depth", type=int, default=164)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--config", default="approx4", help="exact, approxK, ... (step_alternated.py's)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=2, help="steps per side per round (their median)")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be at least 1")
    x, y = batch_for(p, args)
    step, plan = make_step(lowmem, args.depth, *parse(args.config), x, y, args.model)
    as_is = [(mod, name, getattr(mod, name)) for mod, name, _ in args.settings]

    def timed(values):
        for mod, name, value in values:
            setattr(mod, name, value)
        try:
            return median_step(step, args.steps)
        finally:
            for mod, name, value in as_is:
                setattr(mod, name, value)
    timed(as_is), timed(args.settings)                          # warm-up, both sides
    rows = []
    for r in range(args.rounds):
        order = [("as is", as_is), ("set", args.settings)][::(-1) ** r]
        rows.append({side: timed(values) for side, values in order})
    ratio = [g["set"] / g["as is"] for g in rows]
    names = ", ".join(f"{mod.__name__}.{name}={value!r}" for mod, name, value in args.settings)
    was = ", ".join(f"{value!r}" for _, _, value in as_is)
    network = args.model or f"preact-resnet{args.depth}"
    print(f"{network} b{args.batch} {args.config}, plan {plan:,d} B: as is ({was}) "
          f"{statistics.median(g['as is'] for g in rows):.3f} s, set ({names}) "
          f"{statistics.median(g['set'] for g in rows):.3f} s; set / as is median {statistics.median(ratio):.3f} "
          f"(range {min(ratio):.3f}-{max(ratio):.3f}) over {args.rounds} rounds")
    if args.json:
        from lowmem.system.atomic import atomic_write
        atomic_write(args.json, json.dumps({"network": network, "batch": args.batch, "config": args.config,
                                            "set": names, "as_is": was, "rounds": rows,
                                            "ratio_median": statistics.median(ratio), "ratio_min": min(ratio),
                                            "ratio_max": max(ratio)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
