"""`--bits auto`: the one door through which a training run and the commands choose every
unit's width (docs/bits.md).

    batches = training_batches(data, 128)                    # what `lowmem train` measures on
    a, sens = choose_widths(net, batches, 128, avg_bits=2)   # or budget= (the whole plan, bytes)
    Engine(net, 128, (3, 32, 32), "approx", bits=a.bits)     # {unit: K or "float"}

`choose_widths` measures the sensitivity of `net` (lowmem/bits/sensitivity.py; `net` is not
consumed) on a few batches and fits the widths to one budget (lowmem/bits/allocate.py).
What it measures on is the caller's: `lowmem train` the first AUTO_BATCHES training batches
(`training_batches`: in order, normalised, not augmented, the same on every rank), `lowmem
plan` and `lowmem maxbatch` learnable synthetic batches (they have no data).
"""
import itertools

import numpy

from ..data.transforms import normalize
from ..system import backend
from .allocate import allocate_bits, check_budget
from .along import measure_along
from .sensitivity import measure_sensitivity, measured_batches

AUTO_BATCHES, AUTO_BATCH = 3, 64              # training: measured on 3 training batches of at most 64


def training_batches(data, batch, dtype="float32", count=AUTO_BATCHES, limit=AUTO_BATCH):
    """The first `count` training batches of min(batch, limit) images of `data` (a
    lowmem.data.datasets.Dataset), in order, normalised, not augmented: [(x, labels)] on the
    backend. ValueError when fewer than 2 such batches fit (the SGD noise compares batches)."""
    n = min(batch, limit)
    count = min(count, len(data.x_train) // n)
    if count < 2:
        raise ValueError(f"bits='auto' needs at least 2 batches of {n} training images to measure on")
    xp = backend.xp
    return [(xp.asarray(normalize(numpy.empty((n,) + data.input_shape, dtype), data.x_train[i * n:(i + 1) * n],
                                  data.mean, data.std)),
             xp.asarray(data.y_train[i * n:(i + 1) * n])) for i in range(count)]


def folder_batches(data, batch, dtype="float32", seed=0, workers=4, skip_bad=False, count=AUTO_BATCHES,
                   limit=AUTO_BATCH):
    """The first `count` batches of min(batch, limit) images of an image folder (a
    lowmem.data.images.ImageFolders) as its training loader yields them (the run's seeded
    order), through the eval transform (not augmented), normalised: [(x, labels)] on the
    backend. ValueError when fewer than 2 such batches fit."""
    n = min(batch, limit)
    count = min(count, len(data.train) // n)
    if count < 2:
        raise ValueError(f"bits='auto' needs at least 2 batches of {n} training images to measure on")
    loader = data.loader("train", n, train=False, shuffle=True, drop_last=True, seed=seed, dtype=dtype,
                         workers=workers, skip_bad=skip_bad)
    xp, it = backend.xp, iter(loader)
    try:
        return [(xp.asarray(x), xp.asarray(y)) for x, y in itertools.islice(it, count)]
    finally:
        it.close()                                # the decoding threads end here


def choose_widths(net, batches, batch_size, avg_bits=None, budget=None, mode="approx", dtype="float32",
                  rounding="nearest", workspace_bytes=None, measured=None, names=None, momentum=None,
                  along=None):
    """Every unit's width for an engine of `net` at `batch_size`, measured on `batches` (B >= 2
    (x, labels)) and fitted to exactly one of avg_bits (the saved x-hat within what every unit
    at that many bits would take) and budget (the whole plan's bytes). measured(sens): called
    once the sensitivity is measured, before the widths are fitted (a command prints it).
    The budget is checked first (allocate.check_budget; `names` spells avg_bits and budget the
    caller's way, e.g. as flags), so a budget no allocation fits costs no measurement.
    momentum: the training's SGD momentum (allocate_bits; None: 0.9). along: [along.Point] of a
    run (lowmem.train.trainstate.run_points): the widths priced over that run, each point's
    sensitivity weighed by the learning rate there (lowmem/bits/along.py), not at `net` alone.
    Returns (Allocation, Sensitivity): the sensitivity serves to show the widths at another batch
    (allocate.allocation_for)."""
    batches = measured_batches(batches)
    if len(batches) >= 2:                         # fewer: measure_sensitivity names the problem
        check_budget(net, batch_size, tuple(batches[0][0].shape[1:]), avg_bits=avg_bits, budget=budget,
                     mode=mode, dtype=dtype, workspace_bytes=workspace_bytes, names=names, rounding=rounding)
    if along:
        sens = measure_along(along, batches, rounding=rounding, dtype=dtype)
    else:
        sens = measure_sensitivity(net, batches, dtype=dtype, rounding=rounding)
    if measured is not None:
        measured(sens)
    a = allocate_bits(net, None, batch_size=batch_size, avg_bits=avg_bits, budget=budget, mode=mode, dtype=dtype,
                      workspace_bytes=workspace_bytes, sens=sens, rounding=rounding, momentum=momentum)
    return a, sens
