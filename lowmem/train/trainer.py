"""The training loop: epochs, learning-rate schedule, evaluation, metrics, checkpoints, resume.

    cfg = TrainConfig(dataset="cifar10", depth=164, mode="approx", bits=4, epochs=164, out="runs/c10")
    result = Trainer(cfg).fit()                    # a fresh run into runs/c10
    result = Trainer(cfg, resume=True).fit()       # continue it after a stop

The loop reads as a sequence of calls, like llm.c's main: per step, the
next batch, the learning rate, engine.train_step, the running sums, the stop
check; per epoch, evaluate, log, save. What each call does lives in its own
module:

  lowmem/train/trainstate.py  the checkpoint: save and restore of the network, the
                      optimizer, the data position and the RNG (exact resume)
  lowmem/train/runlog.py    the run folder's files: config.json, plan.txt, and
                      metrics.jsonl (rewritten atomically, one record a line)
  lowmem/train/stop.py      signals, the time limit, and the stop agreement of ranks
  lowmem/data/batches.py    the seeded order of every epoch (BatchIterator, ImageLoader)
  lowmem/system/distributed.py  the start-up agreement of ranks (same settings; a
                      refusal on one rank is a refusal on all, with no folder left)

One training step: the next shuffled batch (drop_last=True, so every batch
has the planned size) is augmented (CIFAR-style: random crop from the 4-px
zero-padded image + horizontal flip; image folders: random-resized-crop +
flip while decoding, on lowmem.data.images' threads) into a preallocated uint8
array, then normalised into a preallocated float array (N, C, H, W); the
learning rate is set from the iteration count (`lr_at`); then
engine.train_step (forward, a check that the loss is finite, backward,
opt.step). After every epoch the whole test split is evaluated with BN
running statistics (engine.predict, last partial batch included), one line
is appended to metrics.jsonl and a checkpoint is written atomically.

The run directory (`out`; lowmem/train/rundir.py says when a run may use one and
locks it for as long as the run lives):
  lowmem-run.json  the marker: lowmem made this folder
  lowmem-run.lock  the lock file (fcntl.flock), holding the pid of the last holder
  config.json      the run's configuration (the checkpoint holds the same)
  plan.txt         the memory plan and the schedule of the engine
  metrics.jsonl    one strict JSON object per line (a non-finite number is
                   null): an "epoch" record after every epoch, a "stop" record
                   whenever the process stops
  checkpoint.ckpt  the latest checkpoint (lowmem/train/trainstate.py): parameters, BN
                   statistics, momentum buffers, SGD state, iteration, the
                   augmentation RNG and the data position, the configuration,
                   and what travels with the weights (class names, input
                   size, normalisation); SHA-256 checked

Resume is exact: everything a step depends on is in the checkpoint and the
learning rate is a function of the iteration, so on NumPy a run stopped at
any step boundary (end of an epoch, SIGTERM, Ctrl-C, --time-limit) and
resumed ends with bitwise the parameters of an uninterrupted run. A resume
whose image folder's classes differ from the checkpoint's is refused.

Never a bad checkpoint: a non-finite training or test loss stops the run
(TrainingDiverged) without writing one, and every save first checks that
parameters and BN statistics are finite, so the file on disk is always the
last good state. A save that fails part-way leaves the previous file untouched.

Errors: ConfigError (settings that cannot make a run), RunDirError /
ResumeError (a run folder or checkpoint this run may not use), DataError,
CheckpointError, NotEnoughMemory: all ValueErrors naming the problem; under
MPI a refusal at start-up is a distributed.StartupError on every rank. The
command line (lowmem/tools/cli.py) maps them to exit codes.

Data parallel (mpiexec, lowmem/system/distributed.py): every rank draws the same
global batch and augmentation and trains on its shard; rank 0 alone writes
the run folder. What it does not do: no mixed precision, no keeping of older
checkpoints (one file, replaced atomically).
"""
import dataclasses
import math
import numbers
import os
import signal
import time

import numpy
from tqdm import tqdm

from ..system import backend, distributed, memory as sysmem
from ..data import images
from ..units import quant
from . import trainstate
from .checkpoint import CheckpointError, load_checkpoint   # noqa: F401 (re-exported)
from ..data.datasets import BatchIterator, DataError, augment, load_dataset, normalize
from ..core.engine import DTYPES, MODES, Engine
from ..models import MODELS, build_model, model_spec
from ..ops import softmax_xent_forward
from .optim import SGD
from ..core.plan import KINDS, fmt_bytes
from .rundir import CHECKPOINT, CONFIG, METRICS, PLAN, ResumeError, RunDirError   # noqa: F401 (re-exported)
from .runlog import RunLog, json_line, read_metrics                                # noqa: F401 (re-exported)
from .trainstate import (FORMAT, TrainState, TrainingDiverged, check_training_meta,   # noqa: F401 (re-exported)
                         load_model_state, saved_config, zero_sums)
from .stop import Stop

SCHEDULES = ("step", "cosine", "constant")
AUTO_BATCHES, AUTO_BATCH = 3, 64              # bits="auto": measured on 3 training batches of at most 64
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
    rounding: str = "nearest"       # nearest | stochastic (codes drawn from the seed and the iteration)
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
    sync_bn: bool = False           # data parallel: batch norm over the global batch (all ranks)
    image_size: int = 224           # folder only: images are cropped / resized to this square
    workers: int = 4                # folder only: decoding threads (lowmem.data.images)
    skip_bad: bool = False          # folder only: replace unreadable images by the next readable one

    FIXED = ("dataset", "pad_to", "limit_train", "model", "depth", "mode", "bits", "rounding", "dtype",
             "batch", "augment", "seed", "image_size")

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
                           ("rounding", quant.ROUNDINGS)):
            if str(getattr(self, f)) not in choices:
                bad(f, f"one of {', '.join(choices)}")
        if self.bits == "auto":
            if not (real("avg_bits") and 0 < self.avg_bits <= 32):
                bad("avg_bits", "a number of bits in (0, 32] (bits='auto' fits the saved x-hat to it)")
            if self.mode == "exact":
                bad("bits", "a bit width or 'float' per unit only in approx / naive mode, not 'auto' with exact")
        elif isinstance(self.bits, dict):
            pass                        # per-unit widths: the engine checks them against the network
        elif not isinstance(self.bits, numbers.Integral) or isinstance(self.bits, bool) or self.bits not in quant.BITS:
            bad("bits", f"one of {', '.join(map(str, quant.BITS))}, 'auto' or a dict of per-unit widths")
        if not (self.bits == "auto" or isinstance(self.bits, dict)) and self.avg_bits is not None:
            bad("avg_bits", "None unless bits='auto' (a resumed auto run keeps it beside its widths)")
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


def auto_batches(data, batch, dtype="float32"):
    """What bits="auto" measures on: the first AUTO_BATCHES training batches of min(batch,
    AUTO_BATCH) images, in order, normalised, not augmented: [(x, labels)] on the backend."""
    n = min(batch, AUTO_BATCH)
    count = min(AUTO_BATCHES, len(data.x_train) // n)
    if count < 2:
        raise ConfigError(f"bits='auto' needs at least 2 batches of {n} training images to measure on")
    xp = backend.xp
    return [(xp.asarray(normalize(numpy.empty((n,) + data.input_shape, dtype), data.x_train[i * n:(i + 1) * n],
                                  data.mean, data.std)),
             xp.asarray(data.y_train[i * n:(i + 1) * n])) for i in range(count)]



def allocate_widths(net, data, c, comm):
    """bits='auto': every unit's width from the sensitivity of `net` (not consumed) measured on
    the first AUTO_BATCHES training batches (in order, not augmented; the same on every rank) at
    the initial weights, fitted to c.avg_bits (lowmem/bits/allocate.py). Returns the Allocation."""
    if not hasattr(data, "x_train"):
        raise ConfigError("bits='auto' measures on the in-memory training arrays; the folder dataset "
                          "has none: give per-unit widths instead")
    from ..bits.allocate import allocate_bits
    batches = auto_batches(data, c.batch // comm.size, c.dtype)
    return allocate_bits(net, batches, batch_size=c.batch // comm.size, avg_bits=c.avg_bits,
                         mode=c.mode, dtype=c.dtype, rounding=c.rounding)


@dataclasses.dataclass
class TrainResult:
    status: str             # "finished" | "time-limit" | "signal" | "stopped"
    epoch: float            # epochs done (fractional after a mid-epoch stop)
    iteration: int
    test_acc: float         # last evaluation (None before the first)
    test_loss: float
    checkpoint: str         # path of the latest checkpoint (None without a run directory)
    history: list           # this process's epoch records
    signal: int = None
    already_finished: bool = False    # resumed a run that had already done config.epochs: nothing trained


def data_info(data, config):
    """What travels with the weights (checkpoint meta["data"], both exports): class names in label
    order, the input shape, and the eval preprocessing (resize the shorter side to `resize`,
    centre crop `image_size`, normalise with mean/std in pixel / 255)."""
    shape = [int(v) for v in data.input_shape]
    folder = isinstance(data, images.ImageFolders)
    classes = getattr(data, "classes", None) or [str(k) for k in range(data.num_classes)]
    return {"classes": [str(c) for c in classes], "input_shape": shape, "image_size": shape[-1],
            "resize": images.eval_resize(shape[-1]) if folder else shape[-1],
            "mean": [float(v) for v in data.mean], "std": [float(v) for v in data.std],
            "dataset": str(config.dataset)}


def load_data(c, saved_data=None, check=True):
    """config.dataset's data. Image folders: decoded on threads; the limits are seeded subsets; a
    resumed run keeps its checkpoint's normalisation (`saved_data`); check: decode-check val/ now,
    so that a bad file stops the run before its first epoch, not after it."""
    if c.dataset != "folder":
        return load_dataset(c.dataset, c.data_dir, download=c.download, pad_to=c.pad_to or None,
                            limit_train=c.limit_train, limit_test=c.limit_test, seed=c.seed)
    mean, std = (saved_data["mean"], saved_data["std"]) if saved_data and "mean" in saved_data else (None, None)
    data = images.load_image_folders(c.data_dir, size=c.image_size, mean=mean, std=std, workers=c.workers,
                                     limit_train=c.limit_train, limit_test=c.limit_test, seed=c.seed,
                                     skip_bad=c.skip_bad)
    if check and not c.skip_bad:           # with --skip-bad the loaders count and skip bad files
        images.check_decodable(data.val, workers=c.workers)
    return data


def iterators(data, c):
    """(training batches: shuffled, drop_last; test batches: in order, all of them)."""
    if not isinstance(data, images.ImageFolders):
        return (BatchIterator(data.x_train, data.y_train, c.batch, shuffle=True, seed=c.seed, drop_last=True),
                BatchIterator(data.x_test, data.y_test, c.batch))
    # random-resized-crop + flip while decoding; --no-augment: the eval transform, still shuffled
    train = data.loader("train", c.batch, seed=c.seed, dtype="uint8", workers=c.workers, train=c.augment,
                        shuffle=True, drop_last=True, skip_bad=c.skip_bad)
    return train, data.loader("val", c.batch, dtype="uint8", workers=c.workers, skip_bad=c.skip_bad)


def describe(t):
    """Trainer.describe: the engine's summary, the plan by kind, ranks, data and the schedule of epochs."""
    by, c = t.engine.plan.bytes_by_kind(), t.config
    lines = [t.engine.summary()]
    if t.allocation is not None:
        lines += [f"bits auto ({c.avg_bits:g} bits on average), measured on {AUTO_BATCHES} training "
                  f"batches at the initial weights:", t.allocation.table()]
    lines.append("planned memory by kind:")
    lines += [f"  {k:<10} {fmt_bytes(by[k]):>12}" for k in KINDS if by[k]]
    lines.append(f"  {'total':<10} {fmt_bytes(t.engine.plan.total_bytes):>12}")
    w = warmup_iters(c, t.total_iters)
    lines.append(f"{t.comm.describe()}, per-rank batch {c.batch // t.comm.size}"
                 + (", synchronized batch norm" if c.sync_bn else ""))
    lines.append(f"data: {t.data!r}")
    lines.append(f"training: {c.epochs} epochs x {t.steps_per_epoch} steps = {t.total_iters} "
                 f"iterations, lr {c.lr:g} ({c.schedule}"
                 + (f", warm-up {c.lr / WARMUP_DIVISOR:g} for {w} iterations" if w else "") + ")"
                 + (f", resuming at iteration {t.iteration}" if t.iteration else ""))
    return "\n".join(lines)


def divergence_message(what, ckpt_path, out):
    """What a TrainingDiverged says: the cause, and where the last good state is."""
    msg = f"{what}: training diverged and was stopped. "
    if ckpt_path and os.path.exists(ckpt_path):
        return msg + (f"The last good checkpoint {ckpt_path} (iteration {trainstate.checkpoint_iteration(ckpt_path)}) "
                      f"is kept; resume from it with a lower --lr (the continuation then differs from the "
                      f"original run).")
    return msg + ("No checkpoint was written yet; start again with a lower --lr (and --overwrite to reuse "
                  "this --out)." if out else "No checkpoint was written.")


class BatchPipeline:
    """A uint8 batch -> this rank's normalised shard in the engine's dtype, through arrays
    allocated once (uint8 after augmentation, then the engine's dtype; a device copy on CuPy).

    The whole (global) batch is augmented, so every rank makes the same random draws; then this
    rank keeps its shard: rows [n*r/R, n*(r+1)/R) of n. Image folders are augmented while decoding."""

    def __init__(self, data, config, comm, engine):
        self.data, self.comm, self.xp = data, comm, engine.xp
        self.augment = config.augment and config.dataset != "folder"
        shape, local = data.input_shape, config.batch // comm.size
        self.u8 = numpy.empty((config.batch,) + shape, numpy.uint8)           # the global batch, augmented
        self.u8_device = self.xp.empty((local,) + shape, numpy.uint8) if self.xp is not numpy else self.u8
        self.x = self.xp.empty((local,) + shape, engine.dtype)

    def __call__(self, xb, yb, rng, train):
        n, r, size = len(xb), self.comm.rank, self.comm.size
        u8 = self.u8[:n]
        if train and self.augment:
            augment(u8, xb, rng)
        else:
            u8[...] = xb
        lo, hi = n * r // size, n * (r + 1) // size
        u8, yb = u8[lo:hi], yb[lo:hi]
        if self.u8_device is not self.u8:
            self.u8_device[:hi - lo].set(u8)
            u8 = self.u8_device[:hi - lo]
        x = normalize(self.x[:hi - lo], u8, self.data.mean, self.data.std)
        return x, self.xp.asarray(yb)


class Trainer:
    """One run: data, network, engine, optimizer, iterators; `fit()` trains it.

    dataset: a lowmem.data.datasets.Dataset to use instead of loading config.dataset
      (e.g. synthetic images of another size); config.dataset still names it.
    resume: continue from out/checkpoint.ckpt (fields in TrainConfig.FIXED must match).
    overwrite: start afresh in `out` even though it is not empty (lowmem's own files
      there are replaced when fit() starts; lowmem/train/rundir.py).
    The run folder is locked from construction to the end of fit() (or close()).
    on_step(trainer, loss) after every step; on_epoch(trainer, record) after
      every epoch. Either may call trainer.request_stop(reason).
    log: where messages go (default: tqdm.write, which keeps bars intact).
    comm: a lowmem.system.distributed communicator (default: from the launcher). Data parallel: every
      rank draws the same global batch and augmentation and trains on its shard (config.batch
      stays the global batch); rank 0 alone writes the run folder."""

    def __init__(self, config, dataset=None, resume=False, overwrite=False, on_step=None, on_epoch=None,
                 log=None, comm=None):
        self.comm = comm if comm is not None else distributed.get_communicator(xp=backend.xp)
        self.lead = self.comm.rank == 0
        self.on_step, self.on_epoch = on_step, on_epoch
        self.log = (log or tqdm.write) if self.lead else (lambda *a, **k: None)
        # start-up: every check on every rank, and a refusal on one rank is a refusal on all
        together = distributed.together
        self.config = together(self.comm, config.validate, usage=(ConfigError,))
        distributed.check_same_settings(self.comm, config.to_dict(), ignore=("progress",))
        self.out = config.out
        self.ckpt_path = os.path.join(self.out, CHECKPOINT) if self.out else None
        if resume and not self.out:
            raise ResumeError("resume needs a run directory (out)")
        if overwrite and not self.out:
            raise ConfigError("overwrite needs a run directory (out)")
        # the folder is locked from here to the end of fit(): no other run can pass these checks too
        self.runlog = together(self.comm, lambda: RunLog.claim(self.out, resume, overwrite)
                               if self.out and self.lead else RunLog.none())
        try:
            together(self.comm, lambda: self._build(config, dataset, resume),
                     usage=(ConfigError, sysmem.NotEnoughMemory))
        except BaseException:
            self.runlog.release(discard=True)       # a folder made just now goes again
            raise

    def _build(self, c, dataset, resume):
        saved = load_checkpoint(self.ckpt_path) if resume else None
        if saved is not None:
            check_training_meta(saved[1], self.ckpt_path)
        if dataset is None:     # every rank reads the same files (their settings agree): one check is enough
            dataset = load_data(c, saved and saved[1].get("data"), check=self.lead)
        self.data = dataset
        n_train = len(self.data.train) if isinstance(self.data, images.ImageFolders) else len(self.data.x_train)
        if n_train < c.batch:
            raise ConfigError(f"batch={c.batch} is larger than the {n_train} training images: "
                              f"an epoch drops its last partial batch, so no step would run")
        self.data_info = data_info(self.data, c)
        if saved is not None:
            trainstate.check_resumable(saved[1], c, self.data_info, self.ckpt_path, self.log)
        local = c.batch // self.comm.size
        try:
            distributed.shard(c.batch, self.comm)                 # refuses a batch the ranks do not divide
            self.net = build_model(c.model, c.depth, num_classes=self.data.num_classes,
                                   in_channels=self.data.input_shape[0], seed=c.seed)
            self.allocation = None
            if c.bits == "auto":        # measured once, at the start; the config keeps the widths (resume)
                self.allocation = allocate_widths(self.net, self.data, c, self.comm)
                c.bits = self.allocation.bits
            self.engine = Engine(self.net, batch_size=local, input_shape=self.data.input_shape, mode=c.mode,
                                 bits=c.bits, dtype=c.dtype, comm=self.comm, sync_bn=c.sync_bn,
                                 rounding=c.rounding, seed=c.seed)
        except sysmem.NotEnoughMemory as e:         # the plan's check before it allocates
            raise sysmem.NotEnoughMemory(f"training {self.net.name} at batch {c.batch}: {e}") from None
        except ValueError as e:                     # the builder or the engine refuses these settings
            raise ConfigError(str(e)) from None
        if saved is not None:
            trainstate.check_world_size(saved[1], c, self.comm.size, self.engine.split_dependent_units,
                                        self.ckpt_path)
        self.opt = SGD(self.net.parameters(), lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay,
                       nesterov=c.nesterov)
        batches, self.test_batches = iterators(self.data, c)
        self.rng = numpy.random.default_rng([c.seed, 1])          # augmentation only
        self.steps_per_epoch = len(batches)
        self.total_iters = self.steps_per_epoch * c.epochs
        self.state = TrainState(self.net, self.opt, batches, self.rng, self.steps_per_epoch)
        self.pipeline = BatchPipeline(self.data, c, self.comm, self.engine)
        xp = self.engine.xp
        self.history = []
        self._resumed = saved is not None
        self.stop = Stop(self.comm, c.time_limit)
        if saved is not None:
            trainstate.restore(self.state, *saved, self.ckpt_path, xp)
            if not self.lead:                       # the saved sums are all ranks': count them once
                self.state.sums = zero_sums()
            if self.iteration > self.total_iters:
                done = self.iteration / self.steps_per_epoch
                raise ResumeError(f"{self.ckpt_path} has already trained {done:g} epochs (iteration "
                                  f"{self.iteration}), more than epochs={c.epochs}: pass --epochs "
                                  f"{math.ceil(done)} or more to continue it")

    iteration = property(lambda self: self.state.iteration)
    batches = property(lambda self: self.state.batches, lambda self, b: setattr(self.state, "batches", b))
    last_eval = property(lambda self: self.state.last_eval)

    def close(self):
        """Release the run folder's lock (fit() does this when it returns; idempotent)."""
        if getattr(self, "runlog", None) is not None:
            self.runlog.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def describe(self):
        """The memory plan summary (engine.summary() and totals by kind) and the run's shape."""
        return describe(self)

    def request_stop(self, reason="stopped"):
        """Stop at the next step boundary, after writing a checkpoint."""
        self.stop.request(reason)

    # ------------------------------------------------------------------ the loop
    def fit(self):
        """Train up to config.epochs; returns a TrainResult. Raises TrainingDiverged on a non-finite
        loss. Releases the run folder when it returns or raises (one fit() per Trainer with `out`)."""
        if self.out and self.lead and not self.runlog.held:
            raise RuntimeError(f"this Trainer's run in {self.out} has ended; build a new Trainer "
                               f"(resume=True) to continue it")
        try:
            if self._resumed and self.iteration >= self.total_iters:     # report it, write nothing
                ev = self.last_eval or {}
                return TrainResult("finished", self.iteration / self.steps_per_epoch, self.iteration,
                                   ev.get("test_acc"), ev.get("test_loss"), self.ckpt_path, [],
                                   already_finished=True)
            return self._fit()
        finally:
            self.close()

    def _fit(self):
        spe, s = self.steps_per_epoch, self.state
        self.stop.started = time.monotonic()
        self.runlog.start(self.config, self.engine, fresh=not self._resumed, iteration=self.iteration)
        with self.stop.signals():
            while self.iteration < self.total_iters and not self.stop.reason:
                epoch, b = divmod(self.iteration, spe)
                self.batches.set_epoch(epoch, b)
                bar = tqdm(total=spe, initial=b, desc=f"epoch {epoch + 1}/{self.config.epochs}",
                           disable=None if self.config.progress and self.lead else True, leave=False,
                           dynamic_ncols=True)
                for xb, yb in self.batches:
                    loss = self._step(xb, yb)
                    bar.update()
                    bar.set_postfix_str(f"loss {s.sums['loss'] / s.sums['seen']:.3f} "
                                        f"acc {s.sums['correct'] / s.sums['seen']:.3f} "
                                        f"{s.sums['seen'] / max(s.sums['time'], 1e-9):.0f} img/s "
                                        f"mem {fmt_bytes(self.engine.plan.total_bytes)}", refresh=False)
                    if self.on_step:
                        self.on_step(self, loss)
                    self.stop.check_time()
                    self.stop.agree()                       # data parallel: every rank stops at one step
                    if self.stop.reason and self.iteration % spe:
                        break                               # mid-epoch stop; at the epoch's end finish it first
                bar.close()
                if self.iteration % spe == 0:
                    self._end_epoch()
                elif self.out:
                    self.save(distributed.sum_counts(self.comm, s.sums))    # mid-epoch: the epoch so far
        return self._finish()

    def _step(self, xb, yb):
        t, s = time.perf_counter(), self.state
        x, y = self.pipeline(xb, yb, self.rng, train=True)
        self.opt.lr = lr_at(self.iteration, self.total_iters, self.config)
        self.engine.step = self.iteration        # stochastic rounding's streams follow the iteration (resume)
        try:
            loss = self.engine.train_step(x, y, self.opt)     # refuses a non-finite loss before backward
        except FloatingPointError as e:
            epoch, b = divmod(self.iteration, self.steps_per_epoch)
            self._diverged(f"{e} at iteration {self.iteration + 1} (epoch {epoch + 1}, "
                           f"step {b + 1}, lr {self.opt.lr:g})")
        # the step's logits are still in the plan's "logits" buffer (backward and the update leave it)
        logits = self.engine.arrays["logits"][:len(y)]
        s.iteration += 1
        s.sums["loss"] += loss * len(y)
        s.sums["correct"] += int((logits.argmax(axis=1) == y).sum())
        s.sums["seen"] += len(y)
        s.sums["time"] += time.perf_counter() - t
        return loss

    def evaluate(self):
        """(mean loss, accuracy) on the whole test split, BN running statistics, last partial batch included."""
        loss, correct, n = 0.0, 0, 0
        self.test_batches.set_epoch(0)
        for xb, yb in self.test_batches:
            x, y = self.pipeline(xb, yb, self.rng, train=False)          # this rank's shard of the batch
            if len(x) == 0:
                continue
            y = backend.to_numpy(y)
            logits = backend.to_numpy(self.engine.predict(x)).astype(numpy.float64)
            loss += softmax_xent_forward(numpy.empty_like(logits), logits, y) * len(y)
            correct += int((logits.argmax(axis=1) == y).sum())
            n += len(y)
        total = distributed.sum_counts(self.comm, {"loss": loss, "correct": correct, "seen": n})  # data parallel
        return total["loss"] / total["seen"], total["correct"] / total["seen"]

    def _end_epoch(self):
        s, epoch = distributed.sum_counts(self.comm, self.state.sums), self.iteration // self.steps_per_epoch
        t = time.perf_counter()
        test_loss, test_acc = self.evaluate()
        rec = {"event": "epoch", "epoch": epoch, "iteration": self.iteration,
               "lr": self.opt.lr, "train_loss": s["loss"] / s["seen"], "train_acc": s["correct"] / s["seen"],
               "test_loss": test_loss, "test_acc": test_acc,
               "images_per_s": s["seen"] / max(s["time"], 1e-9), "train_time_s": s["time"],
               "eval_time_s": time.perf_counter() - t, "planned_bytes": self.engine.plan.total_bytes}
        self.state.last_eval = {"epoch": epoch, "test_loss": test_loss, "test_acc": test_acc}
        self.state.sums = zero_sums()
        self.history.append(rec)
        self.log(f"epoch {epoch}/{self.config.epochs}: train loss {rec['train_loss']:.4f} "
                 f"acc {rec['train_acc']:.4f} | test loss {test_loss:.4f} acc {test_acc:.4f} | "
                 f"lr {rec['lr']:g}, {rec['images_per_s']:.0f} img/s, {s['time']:.1f} s")
        self.runlog.append(rec)     # metrics first: a crash before the save only repeats this epoch
        if not math.isfinite(test_loss):    # finite weights can still give inf logits: no good either
            self._check_finite()                            # names the tensor, if one is not finite
            self._diverged(f"non-finite test loss {test_loss} after epoch {epoch} (iteration {self.iteration}); "
                           f"not saving this state")
        if self.out:
            self.save()
        if self.on_epoch:
            self.on_epoch(self, rec)

    def _check_finite(self):
        try:
            trainstate.check_finite(self.state, "not saving them")
        except TrainingDiverged as e:
            self._diverged(str(e))

    def save(self, epoch_sums=None):
        """Rank 0 writes out/checkpoint.ckpt atomically (after checking the state is finite, on every rank)."""
        self._check_finite()
        if self.lead:
            trainstate.save(self.ckpt_path, self.state, self.config, self.data_info, epoch_sums, self.comm.size)

    def _diverged(self, what):
        msg = divergence_message(what, self.ckpt_path, self.out)
        self.runlog.append({"event": "stop", "reason": "diverged", "message": msg, "iteration": self.iteration})
        raise TrainingDiverged(msg)

    def _finish(self):
        status = "finished" if self.iteration >= self.total_iters else (self.stop.reason or "stopped")
        ev = self.last_eval or {}
        result = TrainResult(status, self.iteration / self.steps_per_epoch, self.iteration, ev.get("test_acc"),
                             ev.get("test_loss"), self.ckpt_path, self.history, self.stop.signum)
        self.runlog.append({"event": "stop", "reason": status, "epoch": result.epoch,
                            "iteration": self.iteration, "test_acc": result.test_acc})
        if status != "finished" and self.out:
            why = signal.Signals(self.stop.signum).name if status == "signal" else status
            self.log(f"stopped ({why}) at iteration {self.iteration} (epoch {result.epoch:.2f}); "
                     f"checkpoint {self.ckpt_path}; continue with --resume")
        return result
