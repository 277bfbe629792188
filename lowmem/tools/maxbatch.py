"""The largest batch that fits a memory budget, from the memory plan alone.

    max_batch(lambda: preact_resnet_cifar(164), (3, 32, 32), parse_bytes("2GiB"), "approx", 4)
    max_batch(("preact-cifar", 164, 10), (3, 32, 32), 2 << 30, "exact")
    lowmem maxbatch --model preact-cifar --depth 164 --budget 2GiB --mode approx --bits 4 [--verify]
                                                     (the command: lowmem/tools/commands/maxbatch.py)

Nothing is allocated: each candidate batch builds `Engine(..., allocate=False)`
and reads `plan.total_bytes`. The plan is affine in the batch size N except
for two small kinks (the conv workspace stops growing once it reaches its
bound; packed codes round up to whole bytes), so a few secant steps land
next to the answer and a short bisection makes it exact: the returned N
fits and N + 1 does not. The search stops at MAX_BATCH = 2^24 (`limit`): a
budget that allows more returns the cap, which the command line says.

`--verify` then allocates the engine at that batch and runs two real
training steps on random data (peak_memory.measure_peak: tracemalloc on the
CPU, CuPy's pool on a GPU), and checks the measured steady-state peak is
within the budget. The input batch is the caller's array and is reported
beside it, not counted (it is not in the plan either).

What is not counted: the interpreter, imported libraries and their caches
(NumPy, numba's compiled kernels), which a process pays once whatever the
batch (benchmarks/compare_torch.py measures resident memory as a whole).
"""
import re

from .. import models
from ..core.engine import DEFAULT_WORKSPACE_BYTES, Engine
from ..system.memory import fmt_bytes

MAX_BATCH = 1 << 24         # where the search stops (max_batch's default limit)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text):
    """'2GiB' -> 2147483648. Units: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB
    (powers of 1024), case-insensitive; a bare number is bytes. ValueError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", str(text))
    if not m and re.fullmatch(r"\s*-\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", str(text)):
        raise ValueError(f"{text!r}: the budget must be at least 1 byte")
    if not m:
        raise ValueError(f"cannot read a byte count from {text!r}: expected a number and a unit, "
                         f"e.g. 2GiB, 512MiB, 1.5GB or 1000000 (bytes)")
    number, unit = m.group(1), m.group(2).lower()
    if unit not in _UNITS:
        hint = (f" ({unit.upper()} is ambiguous: say {unit[0].upper()}iB for powers of 1024 "
                f"or {unit[0].upper()}B for powers of 1000)" if unit in ("k", "m", "g", "t") else "")
        raise ValueError(f"unknown unit {m.group(2)!r} in {text!r}{hint}; "
                         f"expected one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    if unit in ("", "b") and "." in number:
        raise ValueError(f"{text!r}: a byte count must be a whole number")
    n = int(float(number) * _UNITS[unit]) if "." in number else int(number) * _UNITS[unit]
    if n < 1:
        raise ValueError(f"{text!r}: the budget must be at least 1 byte")
    return n


def _factory(net):
    """A callable returning the Network: `net` itself if callable, else (model, depth, classes)."""
    if callable(net):
        return net
    try:
        model, depth, classes = net
        models.model_spec(model)
    except (TypeError, ValueError):
        raise ValueError(f"expected a network factory or (model, depth, classes) with model in "
                         f"{sorted(models.MODELS)}, got {net!r}") from None
    return lambda: models.build_model(model, depth, num_classes=classes)


def planned_engine(net, batch_size, input_shape, mode="approx", bits=4, dtype="float32",
                   workspace_bytes=DEFAULT_WORKSPACE_BYTES, use_fast=None):
    """Engine(..., allocate=False) for a network or a factory / (model, depth, classes)."""
    if callable(net) or isinstance(net, tuple):
        net = _factory(net)()
    return Engine(net, batch_size, input_shape, mode, bits, dtype, workspace_bytes,
                  allocate=False, use_fast=use_fast)


def smallest_batch(net, input_shape, mode="approx", bits=4, dtype="float32",
                   workspace_bytes=DEFAULT_WORKSPACE_BYTES, use_fast=None):
    """The smallest batch the engine takes for `net` (a Network): 1, or 2 where a batch norm
    unit sees one value per channel and sample (a 1x1 input, as VGG-BN's last stage at 32x32)."""
    try:
        Engine(net, 1, input_shape, mode, bits, dtype, workspace_bytes, allocate=False, use_fast=use_fast)
        return 1
    except ValueError as e:
        if "batch norm" not in str(e):
            raise
    return 2            # N*H*W >= 2 in every unit


def max_batch(net, input_shape, budget_bytes, mode="approx", bits=4, dtype="float32",
              workspace_bytes=DEFAULT_WORKSPACE_BYTES, use_fast=None, limit=MAX_BATCH):
    """The largest batch N <= limit whose plan total is <= budget_bytes (N + 1 does not fit).

    net: a Network factory (called once), or (model, depth, classes) with model in models.MODELS.
    The search starts at smallest_batch (2 where batch norm refuses 1). ValueError when not
    even that fits."""
    if not isinstance(budget_bytes, int) or budget_bytes < 1:
        raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    network = _factory(net)()        # an engine that does not allocate leaves the network alone
    cache = {}

    def total(n):
        if n not in cache:
            cache[n] = Engine(network, n, input_shape, mode, bits, dtype, workspace_bytes,
                              allocate=False, use_fast=use_fast).plan.total_bytes
        return cache[n]

    first = smallest_batch(network, input_shape, mode, bits, dtype, workspace_bytes, use_fast)
    if total(first) > budget_bytes:
        raise ValueError(f"even a batch of {first} needs {fmt_bytes(total(first))} ({total(first):,} B), "
                         f"more than the budget of {fmt_bytes(budget_bytes)} ({budget_bytes:,} B)")
    # secant steps on the (nearly) affine total(N)
    a, b = first, first + 1
    for _ in range(3):
        slope = max(1, (total(b) - total(a)) / (b - a))
        a, b = b, min(limit, max(first, a + int((budget_bytes - total(a)) / slope)))
        if a == b:
            break
    # bracket: total(lo) <= budget < total(hi), then bisect
    lo, hi, step = (b, None, 1) if total(b) <= budget_bytes else (None, b, 1)
    while lo is None:
        lo = max(first, hi - step)
        if total(lo) > budget_bytes:
            hi, lo, step = lo, None, step * 2
    while hi is None:
        nxt = min(limit, lo + step)
        if nxt == lo:                # the limit itself fits
            return lo
        if total(nxt) <= budget_bytes:
            lo, step = nxt, step * 2
        else:
            hi = nxt
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if total(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid
    return lo
