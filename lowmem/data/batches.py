"""Batches: the order in which an epoch visits a dataset, where in it a run stands, and the
in-memory batch iterator.

    pos = EpochOrder(num_samples=50000, batch_size=128, shuffle=True, seed=0, drop_last=True)
    order = pos.order(pos.epoch)          # int64 (N,): a seeded permutation of 0..N-1
    start, stop = pos.span(pos.batch)     # the slice of `order` that is the next batch
    state = pos.state_dict()              # into a checkpoint; load_state_dict(state) resumes

`BatchIterator` (arrays in memory, below) and lowmem.data.images.ImageLoader
(files decoded on threads) are both an EpochOrder plus a way to fetch the
samples of one batch: `OrderedBatches` is what they share (length, order,
position, state), written once.

* The order of epoch e is a function of (seed, e) only:
  `numpy.random.default_rng([seed, e]).permutation(N)`, or 0..N-1 without
  shuffling. So the whole state of a run through the data is the position
  (epoch, batch), and a resumed run sees the same batches.
* drop_last=True (training): every batch has exactly batch_size samples;
  the N % batch_size left over are dropped, a different set each epoch.
  drop_last=False (evaluation): the last batch is smaller, every sample is
  seen once.
* `state_dict` saves the position with the settings the order depends on;
  `load_state_dict` refuses a state whose settings differ (another seed,
  data set size, batch size...) instead of resuming a different order.
"""
import numpy as np

from .files import DataError


class EpochOrderError(ValueError):
    """A setting or a saved position that cannot give this order (the owners re-raise it as DataError)."""


class EpochOrder:
    """Seeded per-epoch order, the position (epoch, batch) in it, and its state for resume.

    owner, noun: how error messages name the object that holds it ("BatchIterator", "iterator")."""

    SETTINGS = ("seed", "num_samples", "batch_size", "shuffle", "drop_last")

    def __init__(self, num_samples, batch_size, shuffle=False, seed=0, drop_last=False, owner="EpochOrder",
                 noun="order", error=EpochOrderError):
        self.owner, self.noun, self.error = owner, noun, error
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise error(f"{owner}: batch_size must be a positive integer, got {batch_size!r}")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise error(f"{owner}: seed must be a non-negative integer, got {seed!r}")
        self.num_samples, self.batch_size = int(num_samples), int(batch_size)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        self.batch = 0          # index of the next batch of this epoch

    def __len__(self):
        """Batches per epoch."""
        n, b = self.num_samples, self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def order(self, epoch):
        """Sample indices (N,) of an epoch, a function of (seed, epoch) only."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_samples)

    def span(self, i):
        """(start, stop): batch i's slice of the epoch's order."""
        return i * self.batch_size, min((i + 1) * self.batch_size, self.num_samples)

    def set_epoch(self, epoch, batch=0):
        """Continue from batch `batch` of epoch `epoch`."""
        if not 0 <= batch <= len(self):
            raise self.error(f"{self.owner}: batch {batch} outside 0..{len(self)}")
        self.epoch, self.batch = int(epoch), int(batch)

    def next_epoch(self):
        """The epoch has been run through: position 0 of the next."""
        self.epoch, self.batch = self.epoch + 1, 0

    def state_dict(self, **extra):
        """The position plus the settings the order depends on (and `extra` settings of the owner)."""
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed, "num_samples": self.num_samples,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "drop_last": self.drop_last, **extra}

    def load_state_dict(self, state, **extra):
        """Restore a position saved by `state_dict`; every setting (and `extra`) must match."""
        mine = self.state_dict(**extra)
        for k in self.SETTINGS + tuple(extra):
            if state.get(k) != mine[k]:
                raise self.error(f"{self.owner}: saved state has {k}={state.get(k)!r}, this {self.noun} has "
                                 f"{mine[k]!r}; cannot resume the same order")
        self.set_epoch(state["epoch"], state["batch"])


class OrderedBatches:
    """The order and position of a batch source, held in `self.position` (an EpochOrder):
    len(), order(epoch), set_epoch, epoch / batch and the state for resume. A subclass sets
    `self.position` in its __init__ and names in `state_settings()` any settings of its own
    that a saved state must match (ImageLoader: its image size and transform)."""

    def state_settings(self):
        return {}

    def _field(name):
        return property(lambda self: getattr(self.position, name),
                        lambda self, value: setattr(self.position, name, value))
    epoch = _field("epoch")
    batch = _field("batch")                                 # index of the next batch of this epoch
    del _field

    def __len__(self):
        """Batches per epoch."""
        return len(self.position)

    def order(self, epoch):
        """Sample indices (N,) of an epoch, a function of (seed, epoch) only."""
        return self.position.order(epoch)

    def set_epoch(self, epoch, batch=0):
        """Continue from batch `batch` of epoch `epoch`."""
        self.position.set_epoch(epoch, batch)

    def state_dict(self):
        """Everything needed to resume exactly: the position plus the settings it depends on."""
        return self.position.state_dict(**self.state_settings())

    def load_state_dict(self, state):
        """Restore a position saved by `state_dict`; the settings must match."""
        self.position.load_state_dict(state, **self.state_settings())


class BatchIterator(OrderedBatches):
    """Batches of (x, y) in a seeded order that can be resumed exactly.

    x: (N, ...) array, y: (N,). Iterating yields (x_batch, y_batch): copies
    when shuffling, views into x and y otherwise. An epoch's order depends
    only on (seed, epoch), so the iterator's whole state is (epoch, batch):
    `state_dict` / `load_state_dict` save and restore it (OrderedBatches over EpochOrder,
    the same as lowmem.data.images.ImageLoader's).

    Last partial batch, an explicit policy:
    * drop_last=True (training): every batch has exactly batch_size samples,
      so the planned batch never changes mid-epoch; the N % batch_size
      samples left over are dropped, a different set each epoch because the
      order is reshuffled.
    * drop_last=False (evaluation): the final batch is smaller and every
      sample is seen once.

    Iteration runs from the current position to the end of the epoch, then
    moves to the next epoch (position 0); `set_epoch` jumps anywhere.
    Stopping early (break) keeps the position: the next iteration resumes.
    """

    def __init__(self, x, y, batch_size, shuffle=False, seed=0, drop_last=False):
        if len(x) != len(y):
            raise DataError(f"BatchIterator: {len(x)} images but {len(y)} labels")
        self.x, self.y = x, y
        self.position = EpochOrder(len(x), batch_size, shuffle, seed, drop_last, "BatchIterator", "iterator",
                                   DataError)
        self.batch_size, self.shuffle = self.position.batch_size, self.position.shuffle
        self.seed, self.drop_last = self.position.seed, self.position.drop_last
        if len(self) == 0:
            raise DataError(f"BatchIterator: {len(x)} samples give no batch of {batch_size}"
                            + (" with drop_last=True" if drop_last else ""))

    def __iter__(self):
        pos = self.position
        order = pos.order(pos.epoch) if self.shuffle else None
        while pos.batch < len(pos):
            s = slice(*pos.span(pos.batch))
            pos.batch += 1          # a checkpoint taken after this step resumes at the next batch
            if order is None:
                yield self.x[s], self.y[s]
            else:
                yield self.x[order[s]], self.y[order[s]]
        pos.next_epoch()
