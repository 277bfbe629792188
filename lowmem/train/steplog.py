"""The curves between epochs: a "step" record every `every` iterations, kept in memory until
the run log writes them with its next record.

    steps = StepLog(every=20, steps_per_epoch=390, comm=comm)
    steps.add(iteration, loss_sum, correct, seen, seconds, lr)    # after each training step
    if steps.stale():                                             # a long epoch: now and then
        runlog.append(*steps.take())
    runlog.append(*steps.take(), epoch_record)                    # with an epoch record
    runlog.append(*steps.take(close=True), stop_record)           # the run stops: the last steps too

A record holds, over the iterations since the previous one: train_loss (mean per image),
train_acc, images_per_s (images over the seconds the steps took), and the learning rate of
its last step, and when it was made: {"event": "step", "time": ..., "iteration": 40, "epoch": 0.103, "lr": 0.1, "train_loss":
2.1, "train_acc": 0.22, "images_per_s": 310.5}. A step costs a few additions; every
`every` iterations the sums go into a dict (data parallel: summed over the ranks, one tiny
allreduce every rank makes at the same iteration). Nothing is written here: metrics.jsonl
is rewritten whole on each append (lowmem.system.atomic), so records wait for the next epoch
or stop record, or for `stale()` (FLUSH_S seconds since the last take) on a long epoch; a
crash loses at most those. When the run stops, the steps since the last record make one
more (at the stopping iteration), so the curve reaches the end. every=0: no step records.
"""
import time

from ..system import distributed

FLUSH_S = 60.0


class StepLog:
    def __init__(self, every, steps_per_epoch, comm=None):
        self.every, self.steps_per_epoch = int(every), max(1, int(steps_per_epoch))
        self.comm = comm if comm is not None else distributed.SingleProcess()
        self.pending, self._taken = [], time.monotonic()
        self._clear()

    def _clear(self):
        self._sums = {"loss": 0.0, "correct": 0, "seen": 0}
        self._seconds = 0.0

    def add(self, iteration, loss_sum, correct, seen, seconds, lr):
        """One training step, `iteration` the count after it: the summed loss over its `seen`
        images, how many it classified correctly, the seconds it took, its learning rate."""
        if not self.every:
            return
        s = self._sums
        s["loss"] += loss_sum
        s["correct"] += correct
        s["seen"] += seen
        self._seconds += seconds
        self._last = (iteration, lr)
        if iteration % self.every == 0:
            self._record()

    def _record(self):
        iteration, lr = self._last
        total = distributed.sum_counts(self.comm, self._sums)
        n = max(total["seen"], 1)
        self.pending.append({"event": "step", "time": time.time(), "iteration": int(iteration),
                             "epoch": round(iteration / self.steps_per_epoch, 6), "lr": float(lr),
                             "train_loss": total["loss"] / n, "train_acc": total["correct"] / n,
                             "images_per_s": total["seen"] / max(self._seconds, 1e-9)})
        self._clear()

    def stale(self):
        """Records wait, and the last take was FLUSH_S seconds ago."""
        return bool(self.pending) and time.monotonic() - self._taken > FLUSH_S

    def take(self, close=False):
        """The records waiting, in order; the log keeps none of them. close=True (the run stops):
        first a record over the steps since the last one, if any (data parallel: every rank
        calls it at the same step)."""
        if close and self._sums["seen"]:
            self._record()
        out, self.pending, self._taken = self.pending, [], time.monotonic()
        return out
