"""A training run's curves, read from its run folder: what `lowmem plot` draws.

    run = read_run("runs/a")
    run.label                       # "runs/a: approx 4-bit, preact-cifar-20, 1.23 MiB planned"
    run.series("train_loss")        # ([iteration, ...], [value, ...])

metrics.jsonl holds "step" records every `log_every` iterations (train_loss, train_acc,
lr, images_per_s over the iterations since the previous one) and an "epoch" record after
each epoch (the same over the epoch, and test_loss, test_acc). A training quantity is read
from the step records when the run has them, else from the epoch records (a folder written
before step records existed: one point per epoch); the test quantities always come from
the epoch records. The planned memory is the epoch records' planned_bytes, else the
"planned" figure of plan.txt; the mode and widths come from config.json.
"""
import json
import math
import os
import re
from dataclasses import dataclass

from ..models import is_onnx_path
from ..units.widths import BITS, UNBIASED_ROUNDINGS, code_for, named
from ..system.memory import fmt_bytes
from ..train.rundir import CONFIG, METRICS, PLAN, read_metrics

TEST_ONLY = ("test_loss", "test_acc")


class RunError(ValueError):
    """A folder that holds no run lowmem can draw."""


@dataclass
class RunCurves:
    name: str                   # the folder as given
    config: dict                # config.json ({} when missing)
    records: list               # the epoch and step records, by iteration
    planned_bytes: int = None

    @property
    def label(self):
        planned = f"{fmt_bytes(self.planned_bytes)} planned" if self.planned_bytes else "planned memory unknown"
        what = [w for w in (mode_label(self.config), model_label(self.config)) if w]
        return f"{self.name}: " + ", ".join(what + [planned])

    @property
    def steps_per_epoch(self):
        """Iterations per epoch, from the epoch records (None before the first)."""
        ep = [r for r in self.records if r.get("event") == "epoch" and _number(r.get("epoch")) and r.get("iteration")]
        return ep[0]["iteration"] / ep[0]["epoch"] if ep else None

    def series(self, key):
        """([iterations], [values]) of `key`: from the step records if any carry it (never for
        test_*), else from the epoch records; a missing or non-finite value is left out."""
        steps = [r for r in self.records if r.get("event") == "step" and key in r]
        use = steps if steps and key not in TEST_ONLY else [r for r in self.records if r.get("event") == "epoch"]
        pts = [(r["iteration"], r[key]) for r in use
               if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) and "iteration" in r]
        return [p[0] for p in pts], [p[1] for p in pts]


def _number(v):
    """v if it is a finite number other than 0 (not a bool), else None."""
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v else None


def mode_label(config):
    """'exact', 'approx 4-bit', 'approx per-unit widths (2 bits on average)', from a run's config."""
    mode, bits = config.get("mode"), config.get("bits")
    if mode is None:
        return ""
    if mode == "exact":
        return str(mode)
    if isinstance(bits, dict):
        avg = _number(config.get("avg_bits"))
        text = f"{mode} per-unit widths" + (f" ({avg:g} bits on average)" if avg else "")
    else:
        text = f"{mode} {bits}-bit"
    rounding = config.get("rounding")
    unbiased = rounding in UNBIASED_ROUNDINGS and any(
        k in BITS and code_for(rounding, k).unbiased for k in named(bits) if not isinstance(k, bool))
    return text + ({"stochastic": ", stochastic", "dither": ", dither"}[rounding] if unbiased else "")


def model_label(config):
    """'preact-cifar-20' (a registry family and its depth), or an ONNX model's file name (the
    file fixes the architecture: its depth setting is not used)."""
    model, depth = config.get("model"), config.get("depth")
    if is_onnx_path(model):
        return os.path.basename(os.fspath(model))
    return f"{model}-{depth}" if model and depth else ""


def planned_from_plan_txt(path):
    """The plan total of a run folder's plan.txt (its "total" row), or None."""
    try:
        with open(os.path.join(path, PLAN), errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    m = re.search(r"^total\s+\d+\s+([\d,]+)\s", text, re.MULTILINE)
    return int(m.group(1).replace(",", "")) if m else None


def read_run(path):
    """The RunCurves of run folder `path`; RunError if it holds no metrics to draw."""
    name = os.fspath(path)
    if os.path.isfile(name):
        raise RunError(f"{name} is a file, not a run folder: give the folder that holds {METRICS} "
                       f"({os.path.dirname(name) or '.'})")
    if not os.path.isdir(name):
        raise RunError(f"{name}: no such run folder")
    if not os.path.exists(os.path.join(name, METRICS)):
        raise RunError(f"{name} holds no {METRICS}: not a lowmem run folder, or its run wrote nothing yet")
    records = sorted((r for r in read_metrics(name) if r.get("event") in ("epoch", "step")),
                     key=lambda r: (r["iteration"], r["event"] == "epoch"))
    if not records:
        raise RunError(f"{name}/{METRICS} has no step or epoch records yet: nothing to draw")
    try:
        with open(os.path.join(name, CONFIG), "rb") as f:
            config = json.loads(f.read().decode("utf-8", "replace"))
    except (OSError, ValueError):
        config = {}
    if not isinstance(config, dict):                     # null, a list: no settings to read
        config = {}
    planned = [r["planned_bytes"] for r in records if isinstance(r.get("planned_bytes"), int)]
    return RunCurves(name, config, records, planned[-1] if planned else planned_from_plan_txt(name))
