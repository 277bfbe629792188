"""What defines a training run: TrainConfig (every setting, checked) and the learning-rate schedule.

    cfg = TrainConfig(dataset="cifar10", depth=164, mode="approx", bits=4, epochs=164).validate()
    lr = lr_at(it, total, cfg)          # the rate of step `it` of `total`: a pure function of the step

`TrainConfig.validate` refuses a setting that cannot make a run with a ConfigError naming
the field and what it expects; `FIXED` lists the fields a resumed run must keep. The
schedule (`lr_at`): warm-up at lr / WARMUP_DIVISOR, then "step" (He et al.'s CIFAR recipe),
"cosine" or "constant". The loop that uses them is lowmem/train/trainer.py.
"""
import dataclasses
import math
import numbers
import os

from ..core.engine import DTYPES
from ..models import MODELS, model_spec
from ..units.widths import BITS, MODES, ROUNDINGS

SCHEDULES = ("step", "cosine", "constant")
WARMUP_DIVISOR = 10                           # warm-up lr = lr / 10 (He et al.: 0.01 for lr 0.1)
PAPER_WARMUP_ITERS = 400


class ConfigError(ValueError):
    """Settings that cannot make a run (a bad value, or a model, engine or optimizer that refuses them)."""


@dataclasses.dataclass
class TrainConfig:
    """Everything that defines a run. The FIXED fields must match when resuming."""
    dataset: str = "cifar10"        # cifar10 | cifar100 | fashion-mnist | synthetic | folder
    data_dir: str = None            # where the data lives (None: the defaults of lowmem.data.datasets)
    download: bool = True           # CIFAR only: fetch the archive when it is missing
    pad_to: int = 32                # Fashion-MNIST only: pad 28x28 to this size (0 keeps 28)
    limit_train: int = None         # first N training samples (synthetic: split size)
    limit_test: int = None
    model: str = "preact-cifar"
    depth: int = 20
    mode: str = "approx"            # exact | approx | naive
    bits: int = 4                   # 8, 4, 2, 1; "auto" (resolved to a {unit: K} dict at the start); a dict
    avg_bits: float = None          # bits "auto": the saved x-hat within every unit at avg_bits
    price_along: list = None        # bits "auto": checkpoints of an earlier run the widths are priced along
    rounding: str = "nearest"       # nearest | stochastic | dither (codes drawn from the seed and the iteration)
    dtype: str = "float32"
    batch: int = 128
    epochs: int = 10
    lr: float = 0.1
    schedule: str = "step"          # step | cosine | constant
    warmup_iters: int = None        # None: 400 (the paper), at most 5% of the run
    momentum: float = 0.9
    weight_decay: float = 5e-4
    nesterov: bool = False
    augment: bool = True
    seed: int = 0                   # network init, batch order and augmentation
    out: str = None                 # run directory (None: write nothing)
    time_limit: float = None        # seconds; stop with a checkpoint after this long
    progress: bool = True           # tqdm bar (only on a terminal)
    log_every: int = 20             # a "step" record in metrics.jsonl every N iterations (0: none)
    sync_bn: bool = False           # data parallel: batch norm over the global batch (all ranks)
    image_size: int = 224           # folder only: images are cropped / resized to this square
    workers: int = 4                # folder only: decoding threads (lowmem.data.images)
    skip_bad: bool = False          # folder only: replace unreadable images by the next readable one

    FIXED = ("dataset", "pad_to", "limit_train", "model", "depth", "mode", "bits", "avg_bits", "rounding",
             "dtype", "batch", "augment", "seed", "image_size")

    def validate(self):
        """Check every field; returns self. ConfigError naming the field and what it expects."""
        def bad(field, want):
            raise ConfigError(f"{field}={getattr(self, field)!r}: expected {want}")

        def real(f):
            v = getattr(self, f)
            return isinstance(v, numbers.Real) and not isinstance(v, bool) and not math.isnan(v)

        def integer(f, low, optional=False):
            v = getattr(self, f)
            ok = (optional and v is None) or (isinstance(v, numbers.Integral) and not isinstance(v, bool)
                                              and v >= low)
            if not ok:
                bad(f, f"an integer >= {low}" + (" or None" if optional else ""))

        try:
            model_spec(self.model)                      # a registry name or wrn-K
        except ValueError:
            bad("model", f"one of {', '.join(m for m in MODELS if not m.startswith('wrn-'))} or wrn-K "
                         f"(K a positive integer)")
        for f, choices in (("mode", MODES), ("dtype", DTYPES), ("schedule", SCHEDULES),
                           ("rounding", ROUNDINGS)):
            if str(getattr(self, f)) not in choices:
                bad(f, f"one of {', '.join(choices)}")
        if self.bits == "auto":
            if not (real("avg_bits") and 0 < self.avg_bits <= 32):
                bad("avg_bits", "a number of bits in (0, 32] (bits='auto' fits the saved x-hat to it)")
            if self.mode == "exact":
                bad("bits", "a width per unit only in mode approx or naive (mode exact saves every x-hat in float)")
        elif isinstance(self.bits, dict):
            pass                        # per-unit widths: the engine checks them against the network
        elif not isinstance(self.bits, numbers.Integral) or isinstance(self.bits, bool) or self.bits not in BITS:
            bad("bits", f"one of {', '.join(map(str, BITS[::-1]))}, 'auto' or a dict of per-unit widths")
        if self.mode == "exact" and self.rounding != "nearest":
            bad("rounding", "nearest in mode exact (it saves x-hat in float: nothing is rounded)")
        if self.price_along is not None:
            if self.bits != "auto":
                bad("price_along", "only with bits='auto' (it prices the widths the allocator chooses)")
            if (not isinstance(self.price_along, (list, tuple)) or not self.price_along
                    or not all(isinstance(x, (str, os.PathLike)) and os.fspath(x) for x in self.price_along)):
                bad("price_along", "a list of training checkpoint files of one earlier run")
            self.price_along = [os.fspath(x) for x in self.price_along]
        if not (self.bits == "auto" or isinstance(self.bits, dict)) and self.avg_bits is not None:
            bad("avg_bits", "only with bits='auto' (a resumed auto run keeps it beside its widths)")
        for f in ("depth", "batch", "epochs"):
            integer(f, 1)
        integer("pad_to", 0)
        integer("image_size", 8)
        integer("workers", 1)
        if str(self.dataset) == "folder" and not self.data_dir:
            bad("data_dir", "the image folder (--data DIR holding train/<class>/* and val/<class>/*)")
        if str(self.dataset).lower() in ("fashion-mnist", "fashion_mnist", "fashionmnist") and 0 < self.pad_to < 28:
            bad("pad_to", "0 (keep 28x28) or at least 28 for Fashion-MNIST's 28x28 images")
        integer("seed", 0)
        if self.seed >= 2 ** 64:                    # the counter stream's keys are 64-bit
            bad("seed", "an integer in [0, 2**64)")
        integer("log_every", 0)
        integer("warmup_iters", 0, optional=True)
        integer("limit_train", 1, optional=True)
        integer("limit_test", 1, optional=True)
        if self.limit_train is not None and self.limit_train < self.batch:
            bad("limit_train", f"at least batch={self.batch} images (an epoch drops its last partial "
                               f"batch, so fewer give no training step)")
        if not (real("lr") and 0 < self.lr < math.inf):
            bad("lr", "a finite number > 0")
        if not (real("momentum") and 0 <= self.momentum < 1):
            bad("momentum", "a number in [0, 1)")
        if not (real("weight_decay") and 0 <= self.weight_decay < math.inf):
            bad("weight_decay", "a finite number >= 0")
        if self.nesterov and self.momentum == 0:
            bad("nesterov", "False when momentum is 0 (Nesterov momentum needs momentum > 0)")
        if self.time_limit is not None and not (real("time_limit") and self.time_limit > 0):
            bad("time_limit", "a positive number of seconds")
        self.out = None if self.out is None else os.fspath(self.out)
        if self.out == "":
            bad("out", "a folder name (None writes nothing)")
        self.data_dir = None if self.data_dir is None else os.fspath(self.data_dir)
        return self

    def to_dict(self):
        return dataclasses.asdict(self)


def warmup_iters(config, total):
    """Warm-up length: config.warmup_iters, or 400 (the paper) capped at 5% of `total` iterations."""
    if config.warmup_iters is not None:
        return min(config.warmup_iters, total)
    return min(PAPER_WARMUP_ITERS, total // 20)


def lr_at(it, total, config):
    """Learning rate of step `it` (0-based) of a run of `total` steps.

    Warm-up: lr/10 for the first warmup_iters steps. Then "step": lr, divided
    by 10 at 50% and again at 75% of `total` (He et al.'s CIFAR recipe: 0.01
    for 400 iterations, 0.1, 0.01 from 32k, 0.001 from 48k of 64k); "cosine":
    lr * (1 + cos(pi * t)) / 2 with t from 0 to 1 over the steps after warm-up;
    "constant": lr. A pure function of the step, so a resumed run continues it."""
    w = warmup_iters(config, total)
    if it < w:
        return config.lr / WARMUP_DIVISOR
    if config.schedule == "step":
        return config.lr / 10 ** ((it >= total // 2) + (it >= (3 * total) // 4))
    if config.schedule == "cosine":
        return config.lr * 0.5 * (1 + math.cos(math.pi * (it - w) / max(1, total - w)))
    return config.lr
