"""The training loop: epochs, learning-rate schedule, evaluation, metrics, checkpoints, resume.

    cfg = TrainConfig(dataset="cifar10", depth=164, mode="approx", bits=4, epochs=164, out="runs/c10")
    result = Trainer(cfg).fit()                    # a fresh run into runs/c10
    result = Trainer(cfg, resume=True).fit()       # continue it after a stop

One training step: the next shuffled batch (BatchIterator, drop_last=True, so
every batch has the planned size) is augmented (random crop from the 4-px
zero-padded image + horizontal flip) into a preallocated uint8 array, then
normalised into a preallocated float array (N, C, H, W); the learning rate
is set from the iteration count (`lr_at`); then engine.train_step (forward,
a check that the loss is finite, backward, opt.step). After every epoch the
whole test split is evaluated with BN running statistics (engine.predict,
last partial batch included), one line is appended to metrics.jsonl and a
checkpoint is written atomically (lowmem.checkpoint).

The run directory (`out`; lowmem/rundir.py says when a run may use one and
locks it for as long as the run lives):
  lowmem-run.json  the marker: lowmem made this folder
  lowmem-run.lock  the lock file (fcntl.flock), holding the pid of the last holder
  config.json      the run's configuration (the checkpoint holds the same)
  plan.txt         the memory plan and the schedule of the engine
  metrics.jsonl    one strict JSON object per line (a non-finite number is
                   null): an "epoch" record after every epoch, a "stop" record
                   whenever the process stops
  checkpoint.ckpt  the latest checkpoint: parameters, BN statistics, momentum
                   buffers, SGD state, iteration, the augmentation RNG and the
                   BatchIterator position, the configuration; SHA-256 checked

Resume is exact: everything a step depends on is in the checkpoint and the
learning rate is a function of the iteration, so on NumPy a run stopped at
any step boundary (end of an epoch, SIGTERM, Ctrl-C, --time-limit) and
resumed ends with bitwise the parameters of an uninterrupted run.

Never a bad checkpoint: a non-finite training or test loss stops the run
(TrainingDiverged) without writing one, and every save first checks that
parameters and BN statistics are finite, so the file on disk is always the
last good state. A save that fails part-way leaves the previous file untouched.

Errors: ConfigError (settings that cannot make a run), RunDirError /
ResumeError (a run folder or checkpoint this run may not use), DataError,
CheckpointError, NotEnoughMemory: all ValueErrors naming the problem; the
command line (lowmem/cli.py) maps them to exit codes.

What it does not do: no data loading threads, no mixed precision, no
multi-GPU, no keeping of older checkpoints (one file, replaced atomically).
"""
import contextlib
import dataclasses
import json
import math
import numbers
import os
import signal
import threading
import time

import numpy
from tqdm import tqdm

from . import __version__, backend, distributed, images, quant, rundir, sysmem
from .checkpoint import CheckpointError, checkpoint_info, load_checkpoint, save_checkpoint
from .data import BatchIterator, DataError, augment, load_dataset, normalize
from .engine import DTYPES, MODES, Engine
from .models import MODELS, build_model
from .optim import SGD
from .plan import KINDS, fmt_bytes
from .rundir import CHECKPOINT, CONFIG, METRICS, PLAN, ResumeError, RunDirError   # noqa: F401 (re-exported)

FORMAT = "lowmem-train/1"                     # meta["format"] of a training checkpoint
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
    data_dir: str = None            # where the data lives (None: the defaults of lowmem.data)
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
    workers: int = 4                # folder only: decoding threads (lowmem.images)

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

        for f, choices in (("model", tuple(MODELS)), ("mode", MODES), ("dtype", DTYPES),
                           ("schedule", SCHEDULES), ("rounding", quant.ROUNDINGS)):
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


class TrainingDiverged(FloatingPointError):
    """A non-finite loss or parameter: the run stopped and no checkpoint was written."""


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


class Trainer:
    """One run: data, network, engine, optimizer, iterators; `fit()` trains it.

    dataset: a lowmem.data.Dataset to use instead of loading config.dataset
      (e.g. synthetic images of another size); config.dataset still names it.
    resume: continue from out/checkpoint.ckpt (fields in TrainConfig.FIXED must match).
    overwrite: start afresh in `out` even though it is not empty (lowmem's own files
      there are replaced when fit() starts; lowmem/rundir.py).
    The run folder is locked from construction to the end of fit() (or close()).
    on_step(trainer, loss) after every step; on_epoch(trainer, record) after
      every epoch. Either may call trainer.request_stop(reason).
    log: where messages go (default: tqdm.write, which keeps bars intact).
    comm: a lowmem.distributed communicator (default: from the launcher). Data parallel: every
      rank draws the same global batch and augmentation and trains on its shard (config.batch
      stays the global batch); rank 0 alone writes the run folder."""

    def __init__(self, config, dataset=None, resume=False, overwrite=False, on_step=None, on_epoch=None,
                 log=None, comm=None):
        self.config = config.validate()
        self.comm = comm if comm is not None else distributed.get_communicator(xp=backend.xp)
        self.lead = self.comm.rank == 0
        self.on_step, self.on_epoch = on_step, on_epoch
        self.log = (log or tqdm.write) if self.lead else (lambda *a, **k: None)
        self.out = config.out
        self.ckpt_path = os.path.join(self.out, CHECKPOINT) if self.out else None
        if resume and not self.out:
            raise ResumeError("resume needs a run directory (out)")
        if overwrite and not self.out:
            raise ConfigError("overwrite needs a run directory (out)")
        # the folder is locked from here to the end of fit(): no other run can pass these checks too
        self._run = rundir.claim(self.out, resume=resume, overwrite=overwrite) if self.out and self.lead else None
        try:
            self._build(config, dataset, resume)
        except BaseException:
            if self._run is not None:
                self._run.release(discard=True)     # a folder made just now goes again
            raise

    def _build(self, c, dataset, resume):
        saved = load_checkpoint(self.ckpt_path) if resume else None
        if saved is not None:
            self._check_resumable(saved[1], self.ckpt_path)
        if c.dataset == "folder" and dataset is None:       # decoded on worker threads (lowmem.images)
            self.data = images.load_image_folders(c.data_dir, size=c.image_size, workers=c.workers)
            n_train = len(self.data.train)
        else:
            self.data = dataset if dataset is not None else load_dataset(
                c.dataset, c.data_dir, download=c.download, pad_to=c.pad_to or None,
                limit_train=c.limit_train, limit_test=c.limit_test, seed=c.seed)
            n_train = len(self.data.x_train)
        if n_train < c.batch:
            raise ConfigError(f"batch={c.batch} is larger than the {n_train} training images: "
                              f"an epoch drops its last partial batch, so no step would run")
        try:
            self.part = distributed.shard(c.batch, self.comm)      # this rank's part of each batch
            self.net = build_model(c.model, c.depth, num_classes=self.data.num_classes,
                                   in_channels=self.data.input_shape[0], seed=c.seed)
            self.allocation = None
            if c.bits == "auto":        # measured once, at the start; the config keeps the widths (resume)
                self.allocation = self._allocate(c)
                c.bits = self.allocation.bits
            engine_args = dict(batch_size=c.batch // self.comm.size, input_shape=self.data.input_shape,
                               mode=c.mode, bits=c.bits, dtype=c.dtype, comm=self.comm, sync_bn=c.sync_bn,
                               rounding=c.rounding, seed=c.seed)
            planned = Engine(self.net, allocate=False, **engine_args)
        except ValueError as e:                     # the builder or the engine refuses these settings
            raise ConfigError(str(e)) from None
        sysmem.require(planned.plan.total_bytes, f"training {self.net.name} at batch {c.batch} "
                       f"(its memory plan)", planned.xp)
        self.engine = Engine(self.net, **engine_args)
        self.opt = SGD(self.net.parameters(), lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay,
                       nesterov=c.nesterov)
        if c.dataset == "folder" and dataset is None:       # random-resized-crop + flip while decoding
            self.batches = self.data.loader("train", c.batch, seed=c.seed, dtype="uint8", workers=c.workers)
            self.test_batches = self.data.loader("val", c.batch, dtype="uint8", workers=c.workers)
        else:
            self.batches = BatchIterator(self.data.x_train, self.data.y_train, c.batch, shuffle=True,
                                         seed=c.seed, drop_last=True)
            self.test_batches = BatchIterator(self.data.x_test, self.data.y_test, c.batch)
        self.rng = numpy.random.default_rng([c.seed, 1])          # augmentation only
        self.steps_per_epoch = len(self.batches)
        self.total_iters = self.steps_per_epoch * c.epochs
        # the batch pipeline's preallocated arrays: uint8 after augmentation, then the engine's dtype
        xp, shape = self.engine.xp, (c.batch,) + self.data.input_shape
        local = (self.engine.N,) + self.data.input_shape
        self._x_u8 = numpy.empty(shape, numpy.uint8)           # the global batch, augmented
        self._x_u8_dev = xp.empty(local, numpy.uint8) if xp is not numpy else self._x_u8
        self._x = xp.empty(local, self.engine.dtype)
        self.iteration = 0
        self._sums = {"loss": 0.0, "correct": 0, "seen": 0, "time": 0.0}    # of the current epoch
        self.last_eval = None
        self.history = []
        self._stop = None
        self._signal = None
        self._resumed = saved is not None
        if saved is not None:
            self._restore(*saved)
            if self.iteration > self.total_iters:
                done = self.iteration / self.steps_per_epoch
                raise ResumeError(f"{self.ckpt_path} has already trained {done:g} epochs (iteration "
                                  f"{self.iteration}), more than epochs={c.epochs}: pass --epochs "
                                  f"{math.ceil(done)} or more to continue it")

    def _allocate(self, c):
        """bits='auto': every unit's width from the sensitivity measured on the first
        AUTO_BATCHES training batches (in order, not augmented; the same on every rank) at the
        initial weights, fitted to avg_bits (lowmem/allocate.py). Returns the Allocation."""
        if not hasattr(self.data, "x_train"):
            raise ConfigError("bits='auto' measures on the in-memory training arrays; the folder dataset "
                              "has none: give per-unit widths instead")
        from .allocate import allocate_bits
        batches = auto_batches(self.data, c.batch // self.comm.size, c.dtype)
        return allocate_bits(self.net, batches, batch_size=c.batch // self.comm.size, avg_bits=c.avg_bits,
                             mode=c.mode, dtype=c.dtype, rounding=c.rounding)

    def close(self):
        """Release the run folder's lock (fit() does this when it returns; idempotent)."""
        if getattr(self, "_run", None) is not None:
            self._run.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----------------------------------------------------------------- info
    def describe(self):
        """The memory plan summary (engine.summary() and totals by kind) and the run's shape."""
        by = self.engine.plan.bytes_by_kind()
        c = self.config
        lines = [self.engine.summary()]
        if self.allocation is not None:
            a = self.allocation
            lines += [f"bits auto ({c.avg_bits:g} bits on average), measured on {AUTO_BATCHES} training "
                      f"batches at the initial weights:", a.table()]
        lines.append("planned memory by kind:")
        lines += [f"  {k:<10} {fmt_bytes(by[k]):>12}" for k in KINDS if by[k]]
        lines.append(f"  {'total':<10} {fmt_bytes(self.engine.plan.total_bytes):>12}")
        w = warmup_iters(c, self.total_iters)
        lines.append(f"{self.comm.describe()}, per-rank batch {self.engine.N}"
                     + (", synchronized batch norm" if c.sync_bn else ""))
        lines.append(f"data: {self.data!r}")
        lines.append(f"training: {c.epochs} epochs x {self.steps_per_epoch} steps = {self.total_iters} "
                     f"iterations, lr {c.lr:g} ({c.schedule}"
                     + (f", warm-up {c.lr / WARMUP_DIVISOR:g} for {w} iterations" if w else "") + ")"
                     + (f", resuming at iteration {self.iteration}" if self.iteration else ""))
        return "\n".join(lines)

    def request_stop(self, reason="stopped"):
        """Stop at the next step boundary, after writing a checkpoint."""
        self._stop = self._stop or reason

    # ------------------------------------------------------------------ data
    def _batch(self, xb, yb, train):
        """Augment (training) and normalise a uint8 batch into the preallocated arrays.

        The whole (global) batch is augmented, so every rank makes the same random draws;
        then this rank keeps its shard: rows [n*r/R, n*(r+1)/R) of n."""
        n, r, size = len(xb), self.comm.rank, self.comm.size
        u8 = self._x_u8[:n]
        if train and self.config.augment and self.config.dataset != "folder":   # folder: done decoding
            augment(u8, xb, self.rng)
        else:
            u8[...] = xb
        lo, hi = n * r // size, n * (r + 1) // size
        u8, yb = u8[lo:hi], yb[lo:hi]
        if self._x_u8_dev is not self._x_u8:
            self._x_u8_dev[:hi - lo].set(u8)
            u8 = self._x_u8_dev[:hi - lo]
        x = normalize(self._x[:hi - lo], u8, self.data.mean, self.data.std)
        return x, self.engine.xp.asarray(yb)

    # ------------------------------------------------------------------ train
    def fit(self):
        """Train up to config.epochs; returns a TrainResult. Raises TrainingDiverged on a non-finite
        loss. Releases the run folder when it returns or raises (one fit() per Trainer with `out`)."""
        if self._run is not None and not self._run.held:
            raise RuntimeError(f"this Trainer's run in {self.out} has ended; build a new Trainer "
                               f"(resume=True) to continue it")
        try:
            if self._resumed and self.iteration >= self.total_iters:
                return self._already_finished()
            return self._fit()
        finally:
            self.close()

    def _already_finished(self):
        """A resumed run that has done all its epochs: report it, write nothing."""
        ev = self.last_eval or {}
        return TrainResult("finished", self.iteration / self.steps_per_epoch, self.iteration,
                           ev.get("test_acc"), ev.get("test_loss"), self.ckpt_path, [], already_finished=True)

    def _fit(self):
        t0 = time.monotonic()
        spe = self.steps_per_epoch
        if self.out and self.lead:
            self._prepare_run_dir()
        with self._signal_handlers():
            while self.iteration < self.total_iters and not self._stop:
                epoch, b = divmod(self.iteration, spe)
                self.batches.set_epoch(epoch, b)
                bar = tqdm(total=spe, initial=b, desc=f"epoch {epoch + 1}/{self.config.epochs}",
                           disable=None if self.config.progress and self.lead else True, leave=False,
                           dynamic_ncols=True)
                for xb, yb in self.batches:
                    loss = self._step(xb, yb)
                    s = self._sums
                    bar.update()
                    bar.set_postfix_str(f"loss {s['loss'] / s['seen']:.3f} "
                                        f"acc {s['correct'] / s['seen']:.3f} "
                                        f"{s['seen'] / max(s['time'], 1e-9):.0f} img/s "
                                        f"mem {fmt_bytes(self.engine.plan.total_bytes)}", refresh=False)
                    if self.on_step:
                        self.on_step(self, loss)
                    if self.config.time_limit and time.monotonic() - t0 >= self.config.time_limit:
                        self.request_stop("time-limit")
                    self._agree_on_stop()
                    if self._stop and self.iteration % spe:
                        break                       # mid-epoch stop; at the epoch's end finish it first
                bar.close()
                if self.iteration % spe == 0:
                    self._end_epoch()
                elif self.out:
                    self._save_mid_epoch()
        return self._finish()

    def _agree_on_stop(self):
        """Data parallel: every rank stops at the same step (a signal or a time limit seen by one)."""
        if self.comm.size == 1:
            return
        flags = numpy.array([self._stop == "signal", self._stop == "time-limit"], numpy.float64)
        self.comm.allreduce(flags)
        if flags[0] and not self._stop:
            self._signal = self._signal or signal.SIGTERM
        self.request_stop("signal" if flags[0] else "time-limit" if flags[1] else None)

    def _global_sums(self, *values):
        """The values summed over ranks (float64)."""
        a = numpy.array(values, numpy.float64)
        self.comm.allreduce(a)
        return a

    def _step(self, xb, yb):
        t = time.perf_counter()
        x, y = self._batch(xb, yb, train=True)
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
        self.iteration += 1
        s = self._sums
        s["loss"] += loss * len(y)
        s["correct"] += int((logits.argmax(axis=1) == y).sum())
        s["seen"] += len(y)
        s["time"] += time.perf_counter() - t
        return loss

    def _diverged(self, what):
        msg = f"{what}: training diverged and was stopped. "
        if self.ckpt_path and os.path.exists(self.ckpt_path):
            it = self._checkpoint_iteration()
            msg += (f"The last good checkpoint {self.ckpt_path} (iteration {it}) is kept; resume from it "
                    f"with a lower --lr (the continuation then differs from the original run).")
        else:
            msg += ("No checkpoint was written yet; start again with a lower --lr (and --overwrite to "
                    "reuse this --out)." if self.out else "No checkpoint was written.")
        self._metrics({"event": "stop", "reason": "diverged", "message": msg, "iteration": self.iteration})
        raise TrainingDiverged(msg)

    def _checkpoint_iteration(self):
        try:
            return checkpoint_info(self.ckpt_path)["meta"].get("iteration", "?")
        except CheckpointError:
            return "?"

    def evaluate(self):
        """(mean loss, accuracy) on the whole test split, BN running statistics, last partial batch included."""
        loss, correct, n = 0.0, 0, 0
        self.test_batches.set_epoch(0)
        for xb, yb in self.test_batches:
            x, y = self._batch(xb, yb, train=False)          # this rank's shard of the batch
            if len(x) == 0:
                continue
            y = backend.to_numpy(y)
            logits = backend.to_numpy(self.engine.predict(x)).astype(numpy.float64)
            m = logits.max(axis=1)
            lse = m + numpy.log(numpy.exp(logits - m[:, None]).sum(axis=1))
            loss += float((lse - logits[numpy.arange(len(y)), y]).sum())
            correct += int((logits.argmax(axis=1) == y).sum())
            n += len(y)
        if self.comm.size > 1:
            loss, correct, n = self._global_sums(loss, correct, n)
        return loss / n, int(correct) / n

    def _end_epoch(self):
        s, epoch = self._sums, self.iteration // self.steps_per_epoch
        if self.comm.size > 1:                      # the epoch's figures over the global batch
            loss, correct, seen = self._global_sums(s["loss"], s["correct"], s["seen"])
            s = dict(s, loss=loss, correct=int(correct), seen=int(seen))
        t = time.perf_counter()
        test_loss, test_acc = self.evaluate()
        finite_test = math.isfinite(test_loss)
        rec = {"event": "epoch", "epoch": epoch, "iteration": self.iteration,
               "lr": self.opt.lr, "train_loss": s["loss"] / s["seen"], "train_acc": s["correct"] / s["seen"],
               "test_loss": test_loss, "test_acc": test_acc,
               "images_per_s": s["seen"] / max(s["time"], 1e-9), "train_time_s": s["time"],
               "eval_time_s": time.perf_counter() - t, "planned_bytes": self.engine.plan.total_bytes}
        self.last_eval = {"epoch": epoch, "test_loss": test_loss, "test_acc": test_acc}
        self.history.append(rec)
        self._sums = {"loss": 0.0, "correct": 0, "seen": 0, "time": 0.0}
        self.log(f"epoch {epoch}/{self.config.epochs}: train loss {rec['train_loss']:.4f} "
                 f"acc {rec['train_acc']:.4f} | test loss {test_loss:.4f} acc {test_acc:.4f} | "
                 f"lr {rec['lr']:g}, {rec['images_per_s']:.0f} img/s, {s['time']:.1f} s")
        self._metrics(rec)      # metrics first: a crash before the save only repeats this epoch
        if not finite_test:     # finite weights can still give inf logits: this state is no good either
            self._check_finite_state()                  # names the tensor, if one is not finite
            self._diverged(f"non-finite test loss {test_loss} after epoch {epoch} (iteration {self.iteration}); "
                           f"not saving this state")
        if self.out and self.lead:
            self.save()
        if self.on_epoch:
            self.on_epoch(self, rec)

    def _finish(self):
        spe = self.steps_per_epoch
        status = "finished" if self.iteration >= self.total_iters else (self._stop or "stopped")
        ev = self.last_eval or {}
        result = TrainResult(status, self.iteration / spe, self.iteration, ev.get("test_acc"),
                             ev.get("test_loss"), self.ckpt_path, self.history, self._signal)
        self._metrics({"event": "stop", "reason": status, "epoch": result.epoch, "iteration": self.iteration,
                       "test_acc": result.test_acc})
        if status != "finished" and self.out:
            why = signal.Signals(self._signal).name if status == "signal" else status
            self.log(f"stopped ({why}) at iteration {self.iteration} (epoch {result.epoch:.2f}); "
                     f"checkpoint {self.ckpt_path}; continue with --resume")
        return result

    # ---------------------------------------------------------------- signals
    @contextlib.contextmanager
    def _signal_handlers(self):
        """SIGINT / SIGTERM ask for a stop at the next step boundary (with a checkpoint);
        a second Ctrl-C raises KeyboardInterrupt at once (the last checkpoint stays)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self._signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self._signal = signum          # no printing here: the handler may interrupt a print
            self.request_stop("signal")

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    # ------------------------------------------------------------- checkpoints
    def _check_finite_state(self):
        arrays = [(n, p.data) for n, p in self.net.params.items()] + list(self.net.stats.items())
        arrays += [(n + " (momentum)", p.state["momentum"]) for n, p in self.net.params.items()]
        for name, a in arrays:
            if not (math.isfinite(float(a.min())) and math.isfinite(float(a.max()))):   # NaN propagates
                self._diverged(f"non-finite values in {name} after iteration {self.iteration}; "
                               f"not saving them")

    def _save_mid_epoch(self):
        """A stop inside an epoch: rank 0 saves the epoch's sums so far over all ranks."""
        sums = self._sums
        if self.comm.size > 1:
            loss, correct, seen = self._global_sums(sums["loss"], sums["correct"], sums["seen"])
            sums = dict(sums, loss=float(loss), correct=int(correct), seen=int(seen))
        if self.lead:
            self.save(sums)

    def save(self, epoch_sums=None):
        """Write out/checkpoint.ckpt atomically (after checking the state is finite)."""
        self._check_finite_state()
        arrays = {f"net/{n}": p.data for n, p in self.net.params.items()}
        arrays.update({f"net/{n}": a for n, a in self.net.stats.items()})
        arrays.update({f"momentum/{p.name}": p.state["momentum"] for p in self.net.parameters()})
        meta = {"format": FORMAT, "lowmem_version": __version__, "config": self.config.to_dict(),
                "network": {"name": self.net.name, "num_params": self.net.num_params()},
                "iteration": self.iteration, "epoch": self.iteration / self.steps_per_epoch,
                "optimizer": self.opt.state_dict(), "rng": self.rng.bit_generator.state,
                "batches": self.batches.state_dict(), "epoch_sums": epoch_sums or self._sums,
                "last_eval": self.last_eval}
        save_checkpoint(self.ckpt_path, arrays, meta)

    def _check_resumable(self, meta, path):
        check_training_meta(meta, path)
        saved, mine = meta["config"], self.config.to_dict()
        diff = [f"{k} (checkpoint {saved.get(k)!r}, this run {mine[k]!r})"
                for k in TrainConfig.FIXED if saved.get(k) != mine[k]]
        if diff:
            arch = any(saved.get(k) != mine[k] for k in ("model", "depth", "dataset", "pad_to"))
            raise ResumeError(f"cannot resume from {path}: " + ("it holds a different architecture; " if arch else "")
                              + "it differs in " + "; ".join(diff))
        changed = [f"{k} {mine[k]!r} (checkpoint {saved.get(k)!r})" for k in mine
                   if k not in TrainConfig.FIXED and k not in ("out", "data_dir", "progress", "time_limit",
                                                                "download") and saved.get(k) != mine[k]]
        if changed:
            self.log("note: resuming with " + ", ".join(changed) + "; the continuation will differ "
                     "from an uninterrupted run of the original settings")

    def _restore(self, arrays, meta):
        path = self.ckpt_path
        state = {k[4:]: v for k, v in arrays.items() if k.startswith("net/")}
        try:
            self.net.load_state_dict(state)
        except ValueError as e:
            raise ResumeError(f"cannot resume from {path}: {e}") from None
        xp = self.engine.xp
        for p in self.net.parameters():
            m = arrays.get(f"momentum/{p.name}")
            if m is None or m.shape != p.shape:
                raise ResumeError(f"cannot resume from {path}: momentum buffer of {p.name} is "
                                  f"{'missing' if m is None else m.shape}, expected {p.shape}")
            if m.dtype.kind != "f" or not numpy.isfinite(m).all():
                raise ResumeError(f"cannot resume from {path}: momentum buffer of {p.name} is "
                                  + ("not finite" if m.dtype.kind == "f" else f"of dtype {m.dtype}"))
            p.state["momentum"][...] = xp.asarray(m)
        try:
            self.opt.load_state_dict(meta["optimizer"])
            self.rng.bit_generator.state = meta["rng"]
            self.batches.load_state_dict(meta["batches"])
        except DataError as e:
            raise ResumeError(f"cannot resume from {path}: {e}") from None
        except (ValueError, TypeError, KeyError) as e:      # a malformed optimizer, RNG or batch state
            raise CheckpointError(f"checkpoint {path!r}: malformed training metadata "
                                  f"({type(e).__name__}: {e})") from None
        self.iteration = int(meta["iteration"])
        if divmod(self.iteration, self.steps_per_epoch) != (self.batches.epoch, self.batches.batch):
            raise ResumeError(f"{path}: iteration {self.iteration} and batch position "
                              f"{self.batches.epoch}:{self.batches.batch} disagree")
        self._sums, self.last_eval = meta["epoch_sums"], meta["last_eval"]
        if not self.lead:                           # the saved sums are all ranks': count them once
            self._sums = {"loss": 0.0, "correct": 0, "seen": 0, "time": 0.0}
        if self.lead:
            self._drop_metrics_after(self.iteration)

    # ----------------------------------------------------------------- metrics
    def _metrics(self, record):
        if not self.out or not self.lead:
            return
        _write(os.path.join(self.out, METRICS), json_line({"time": time.time(), **record}), "a")

    def _drop_metrics_after(self, iteration):
        """Epoch records past the checkpoint will be written again by the resumed run."""
        path = os.path.join(self.out, METRICS)
        if not os.path.exists(path):
            return
        keep = [r for r in read_metrics(self.out)
                if not (r.get("event") == "epoch" and r.get("iteration", 0) > iteration)]
        _write(path + ".tmp", "".join(json_line(r) for r in keep))
        os.replace(path + ".tmp", path)

    def _prepare_run_dir(self):
        """Mark the folder as lowmem's (a fresh --overwrite run first removes lowmem's old files);
        write config.json and plan.txt (a fresh run also starts metrics.jsonl anew)."""
        self._run.start(fresh=not self._resumed)
        _write(os.path.join(self.out, CONFIG), json.dumps(self.config.to_dict(), indent=2) + "\n")
        _write(os.path.join(self.out, PLAN), self.engine.summary() + "\n\n"
               + self.engine.plan.report(max_rows=10 ** 6) + "\n\n"
               + str(self.engine.schedule) + "\n")
        if self.iteration == 0 and os.path.exists(os.path.join(self.out, METRICS)):
            os.remove(os.path.join(self.out, METRICS))


def _write(path, text, mode="w"):
    """Write text to path; an OSError (a full disk) names the file."""
    try:
        with open(path, mode) as f:
            f.write(text)
    except OSError as e:
        what = f"cannot write {path!r}: {e.strerror or e}"
        raise (OSError(e.errno, what) if e.errno is not None else OSError(what)) from e


def _json_safe(value):
    """value with every non-finite float replaced by None (JSON has no NaN or inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def json_line(record):
    """One strict JSON line (non-finite numbers as null) for metrics.jsonl."""
    return json.dumps(_json_safe(record), allow_nan=False) + "\n"


_META_FIELDS = {"config": dict, "iteration": int, "optimizer": dict, "rng": dict, "batches": dict,
                "epoch_sums": dict}


def check_training_meta(meta, path):
    """Check the metadata of a training checkpoint holds every field resume reads.

    ResumeError when it is not a training checkpoint (format); CheckpointError
    naming each missing or mistyped field otherwise."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {os.fspath(path)!r}: metadata is a {type(meta).__name__}, "
                              f"not a dict")
    if meta.get("format") != FORMAT:
        raise ResumeError(f"{path}: not a lowmem training checkpoint (format {meta.get('format')!r})")
    problems = []
    for key, kind in _META_FIELDS.items():
        if key not in meta:
            problems.append(f"{key!r} is missing")
        elif not isinstance(meta[key], kind) or isinstance(meta[key], bool):
            problems.append(f"{key!r} is a {type(meta[key]).__name__}, expected a {kind.__name__}")
    if isinstance(meta.get("iteration"), int) and meta["iteration"] < 0:
        problems.append(f"'iteration' is {meta['iteration']}, expected >= 0")
    sums = meta.get("epoch_sums")
    if isinstance(sums, dict):
        bad = [k for k in ("loss", "correct", "seen", "time")
               if not isinstance(sums.get(k), (int, float)) or isinstance(sums.get(k), bool)]
        if bad:
            problems.append(f"'epoch_sums' lacks the numbers {bad}")
    if meta.get("last_eval") is not None and not isinstance(meta["last_eval"], dict):
        problems.append(f"'last_eval' is a {type(meta['last_eval']).__name__}, expected a dict or null")
    if problems:
        raise CheckpointError(f"checkpoint {os.fspath(path)!r}: malformed training metadata: "
                              + "; ".join(problems))


def saved_config(run_dir):
    """The TrainConfig fields (a dict) stored in run_dir's checkpoint: what --resume starts from.
    ResumeError when there is no checkpoint; CheckpointError when it is damaged or malformed."""
    path = os.path.join(run_dir, CHECKPOINT)
    if not os.path.exists(path):
        raise ResumeError(f"nothing to resume: {path} does not exist")
    meta = load_checkpoint(path)[1]
    check_training_meta(meta, path)
    return meta["config"]


def read_metrics(run_dir):
    """The records of run_dir/metrics.jsonl as a list of dicts (a torn last line is skipped)."""
    out = []
    with open(os.path.join(run_dir, METRICS)) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def load_model_state(path, net):
    """Load the parameters and BN statistics of a training checkpoint into `net`.

    Raises CheckpointError for a damaged file and ResumeError (a ValueError)
    naming the mismatch when the checkpoint holds another architecture."""
    arrays, meta = load_checkpoint(path)
    state = {k[4:]: v for k, v in arrays.items() if k.startswith("net/")}
    try:
        net.load_state_dict(state)
    except ValueError as e:
        network = meta.get("network")
        name = network.get("name", "?") if isinstance(network, dict) else "?"
        raise ResumeError(f"{path} holds {name}, not {net.name}: {e}") from None
    return meta
