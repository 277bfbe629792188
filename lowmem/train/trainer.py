"""The training loop: epochs, evaluation, metrics, checkpoints, resume.

    cfg = TrainConfig(dataset="cifar10", depth=164, mode="approx", bits=4, epochs=164, out="runs/c10")
    result = Trainer(cfg).fit()                    # a fresh run into runs/c10
    result = Trainer(cfg, resume=True).fit()       # continue it after a stop

The loop reads as a sequence of calls, like llm.c's main: per step, the
next batch, the learning rate, engine.train_step, the running sums, the stop
check; per epoch, evaluate, log, save. What each call does lives in its own
module:

  lowmem/train/config.py    TrainConfig (every setting, checked) and the lr schedule (lr_at)
  lowmem/train/pipeline.py  the data, its iterators, and BatchPipeline (augment, shard, normalise)
  lowmem/bits/auto.py       bits="auto": every unit's width, measured at the start
  lowmem/train/trainstate.py  the checkpoint: save and restore of the network, the
                      optimizer, the data position and the RNG (exact resume)
  lowmem/train/rundir.py    the run folder: its lock, config.json, plan.txt, and
                      metrics.jsonl (rewritten atomically, one record a line)
  lowmem/train/steplog.py   the step records between epochs (every config.log_every iterations)
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
                   null): a "step" record every log_every iterations, an "epoch"
                   record after every epoch, a "stop" record whenever the
                   process stops (`lowmem plot` draws them)
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
command line (lowmem/tools/commands/train.py) maps them to exit codes.

Data parallel (mpiexec, lowmem/system/distributed.py): every rank draws the same
global batch and augmentation and trains on its shard; rank 0 alone writes
the run folder. What it does not do: no mixed precision, no keeping of older
checkpoints (one file, replaced atomically).
"""
import dataclasses
import math
import os
import signal
import time

import numpy
from tqdm import tqdm

from ..system import backend, distributed, memory as sysmem
from ..data import images
from . import trainstate
from .checkpoint import CheckpointError, load_checkpoint   # noqa: F401 (re-exported)
from ..bits.auto import AUTO_BATCHES, choose_widths, folder_batches, training_batches
from ..core.engine import Engine
from ..models import build_model
from ..ops import softmax_xent_forward
from .config import WARMUP_DIVISOR, ConfigError, lr_at, warmup_iters
from .optim import SGD
from .pipeline import BatchPipeline, data_info, iterators, load_data
from ..core.plan import KINDS
from ..system.memory import fmt_bytes
from .rundir import CHECKPOINT, CONFIG, METRICS, PLAN, ResumeError, RunDirError, RunLog   # noqa: F401 (re-exported)
from .trainstate import (FORMAT, TrainState, TrainingDiverged, check_training_meta,   # noqa: F401 (re-exported)
                         load_model_state, run_points, saved_config, zero_sums)
from .steplog import StepLog
from .stop import Stop

def allocate_widths(net, data, c, comm):
    """bits='auto': every unit's width through the one door (lowmem/bits/auto.py), measured on
    the first AUTO_BATCHES training batches (in order, not augmented; an image folder's: the
    first its training loader yields, through the eval transform; the same on every rank) at the
    initial weights of `net` (not consumed), or along c.price_along's checkpoints of an earlier run and
    the initial weights (lowmem/bits/along.py), fitted to c.avg_bits. Returns the Allocation."""
    local = c.batch // comm.size
    if isinstance(data, images.ImageFolders):
        batches = folder_batches(data, local, c.dtype, seed=c.seed, workers=c.workers, skip_bad=c.skip_bad)
    else:
        batches = training_batches(data, local, c.dtype)
    along = run_points(net, c.price_along, initial=True) if c.price_along else None
    a, _ = choose_widths(net, batches, local, avg_bits=c.avg_bits, mode=c.mode, dtype=c.dtype,
                         rounding=c.rounding, momentum=c.momentum, along=along)
    return a


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


def describe(t):
    """Trainer.describe: the engine's summary, the plan by kind, ranks, data and the schedule of epochs."""
    by, c = t.engine.plan.bytes_by_kind(), t.config
    lines = [t.engine.summary()]
    if t.allocation is not None:
        at = (f"at the initial weights and {len(c.price_along)} checkpoints of an earlier run, learning-rate "
              f"weighed" if c.price_along else "at the initial weights")
        lines += [f"bits auto ({c.avg_bits:g} bits on average), measured on {AUTO_BATCHES} training "
                  f"batches {at}:", t.allocation.table()]
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
            together(self.comm, lambda: self._build(self.config, dataset, resume),
                     usage=(ConfigError, sysmem.NotEnoughMemory))
        except BaseException:
            self.runlog.release(discard=True)       # a folder made just now goes again
            raise

    def _build(self, c, dataset, resume):
        """The run in three phases: load (the checkpoint and the data, checked against the
        settings), build (network, widths, engine, optimizer, data order), resume (the
        checkpoint's state into what was built)."""
        saved = self._load(c, dataset, resume)
        self._make(c, saved)
        if saved is not None:
            self._resume(c, saved)

    def _load(self, c, dataset, resume):
        """The checkpoint ((arrays, meta), None unless resume) and the data; the widths the run
        keeps (`self.widths`: the settings' bits, or an auto run's from its checkpoint)."""
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
        kept = trainstate.auto_widths(saved[1]["config"], c) if saved is not None else None
        self.widths = kept or c.bits
        if saved is not None:
            trainstate.check_resumable(saved[1], self.run_config, self.data_info, self.ckpt_path, self.log)
        if kept:
            self.log(f"bits auto: continuing with the checkpoint's {len(kept)} per-unit widths, chosen "
                     f"for avg_bits {c.avg_bits:g}; nothing is measured again")
        return saved

    def _make(self, c, saved):
        """Network, widths (bits "auto": measured now, once), engine, optimizer, data order, the
        batch pipeline and the loop's bookkeeping."""
        local = c.batch // self.comm.size
        # a run from an ONNX file resumes the network it began with, whatever the file holds now
        kept = saved and trainstate.kept_network(saved[1], self.ckpt_path, c.seed)
        if kept:
            trainstate.check_kept_network(kept, self.data.num_classes, self.data.input_shape, self.ckpt_path)
        try:
            distributed.shard(c.batch, self.comm)                 # refuses a batch the ranks do not divide
            if kept:
                self.net = kept
            else:
                self.net = build_model(c.model, c.depth, num_classes=self.data.num_classes,
                                       in_channels=self.data.input_shape[0], seed=c.seed,
                                       input_shape=self.data.input_shape)
            self.allocation = None
            if self.widths == "auto":   # measured once, at the start; the run's records keep the widths
                self.allocation = allocate_widths(self.net, self.data, c, self.comm)
                self.widths = self.allocation.bits
            self.engine = Engine(self.net, batch_size=local, input_shape=self.data.input_shape, mode=c.mode,
                                 bits=self.widths, dtype=c.dtype, comm=self.comm, sync_bn=c.sync_bn,
                                 rounding=c.rounding, seed=c.seed)
        except sysmem.NotEnoughMemory as e:         # the plan's check before it allocates
            raise sysmem.NotEnoughMemory(f"training {self.net.name} at batch {c.batch}: {e}") from None
        except ValueError as e:                     # the builder or the engine refuses these settings
            raise ConfigError(str(e)) from None
        if saved is not None:
            trainstate.check_world_size(saved[1], c, self.comm.size, self.engine.split_dependent_units,
                                        self.ckpt_path, self.engine.rank_keyed_layers)
        self.opt = SGD(self.net.parameters(), lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay,
                       nesterov=c.nesterov)
        batches, self.test_batches = iterators(self.data, c)
        self.rng = numpy.random.default_rng([c.seed, 1])          # augmentation only
        self.steps_per_epoch = len(batches)
        self.total_iters = self.steps_per_epoch * c.epochs
        self.state = TrainState(self.net, self.opt, batches, self.rng, self.steps_per_epoch)
        self.pipeline = BatchPipeline(self.data, c, self.comm, self.engine)
        self.history = []
        self._resumed = saved is not None
        self.stop = Stop(self.comm, c.time_limit)
        self.steplog = StepLog(c.log_every, self.steps_per_epoch, self.comm)   # metrics.jsonl's step records

    def _resume(self, c, saved):
        """The checkpoint's parameters, statistics, momentum, optimizer, data position and RNG."""
        trainstate.restore(self.state, *saved, self.ckpt_path, self.engine.xp)
        if not self.lead:                           # the saved sums are all ranks': count them once
            self.state.sums = zero_sums()
        if self.iteration > self.total_iters:
            done = self.iteration / self.steps_per_epoch
            raise ResumeError(f"{self.ckpt_path} has already trained {done:g} epochs (iteration "
                              f"{self.iteration}), more than epochs={c.epochs}: pass --epochs "
                              f"{math.ceil(done)} or more to continue it")

    @property
    def run_config(self):
        """The settings as this run records them (config.json, the checkpoint): `config` with the
        widths the engine keeps (`widths`) in place of bits "auto"."""
        return dataclasses.replace(self.config, bits=self.widths)

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
        self.runlog.start(self.run_config, self.engine, fresh=not self._resumed, iteration=self.iteration)
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
                    if self.steplog.stale():                # a long epoch: its step records so far
                        self.runlog.append(*self.steplog.take())
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
            loss, logits = self.engine.train_step(x, y, self.opt, return_logits=True)   # refuses a non-finite loss
        except FloatingPointError as e:
            epoch, b = divmod(self.iteration, self.steps_per_epoch)
            self._diverged(f"{e} at iteration {self.iteration + 1} (epoch {epoch + 1}, "
                           f"step {b + 1}, lr {self.opt.lr:g})")
        correct, seconds = int((logits.argmax(axis=1) == y).sum()), time.perf_counter() - t
        s.iteration += 1
        s.sums["loss"] += loss * len(y)
        s.sums["correct"] += correct
        s.sums["seen"] += len(y)
        s.sums["time"] += seconds
        self.steplog.add(s.iteration, loss * len(y), correct, len(y), seconds, self.opt.lr)
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
        self.runlog.append(*self.steplog.take(), rec)   # metrics first: a crash before the save only repeats this epoch
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
            trainstate.save(self.ckpt_path, self.state, self.run_config, self.data_info, epoch_sums, self.comm.size)

    def _diverged(self, what):
        msg = divergence_message(what, self.ckpt_path, self.out)
        self.runlog.append(*self.steplog.take(), {"event": "stop", "reason": "diverged", "message": msg, "iteration": self.iteration})
        raise TrainingDiverged(msg)

    def _finish(self):
        status = "finished" if self.iteration >= self.total_iters else (self.stop.reason or "stopped")
        ev = self.last_eval or {}
        result = TrainResult(status, self.iteration / self.steps_per_epoch, self.iteration, ev.get("test_acc"),
                             ev.get("test_loss"), self.ckpt_path, self.history, self.stop.signum)
        self.runlog.append(*self.steplog.take(close=True), {"event": "stop", "reason": status, "epoch": result.epoch,
                            "iteration": self.iteration, "test_acc": result.test_acc})
        if status != "finished" and self.out:
            why = signal.Signals(self.stop.signum).name if status == "signal" else status
            self.log(f"stopped ({why}) at iteration {self.iteration} (epoch {result.epoch:.2f}); "
                     f"checkpoint {self.ckpt_path}; continue with --resume")
        return result
