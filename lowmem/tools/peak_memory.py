"""How much memory does a training step take? Measured, next to the plan.

`measure_peak` builds an Engine, runs a few real training steps on random data and reports the
measured peak next to the plan total (CPU: tracemalloc, which sees NumPy's allocations; CuPy: a
MemoryHook on the default memory pool). `lowmem plan --verify` and `lowmem maxbatch --verify`
print it. Not here: timing (benchmarks/).
"""
import tracemalloc
from dataclasses import dataclass

import numpy

from ..core.engine import Engine
from ..system import backend, memory as sysmem
from ..system.memory import fmt_bytes
from ..train.optim import SGD


@dataclass
class MemoryMeasurement:
    """Bytes: plan_bytes (the plan total); held_bytes (allocated by building the
    Engine: the plan's arrays); step_peaks[i] = held_bytes + the most a step
    allocated on top of what was live when it started (its transient
    scratch); kept_bytes: what stayed allocated after the first step beyond
    the held arrays (one-time imports, JIT compilation caches; 0 is ideal);
    input_bytes: the batch, allocated outside the measurement and not part of
    the plan. how: "tracemalloc" or "cupy pool"."""
    plan_bytes: int
    held_bytes: int
    step_peaks: list
    kept_bytes: int
    input_bytes: int
    how: str

    @property
    def peak_bytes(self):
        """The steady-state peak: the last step's."""
        return self.step_peaks[-1]

    def report(self):
        lines = [f"measured ({self.how}, {len(self.step_peaks)} training steps on random data):"]
        rows = [("plan total", self.plan_bytes), ("held after build", self.held_bytes)]
        rows += [(f"peak, step {i + 1}", p) for i, p in enumerate(self.step_peaks)]
        for name, b in rows:
            lines.append(f"  {name:<18} {b:>16,} {fmt_bytes(b):>12}  {b / self.plan_bytes:7.3f} x plan")
        lines.append(f"  a step's peak is the held arrays plus the most it allocated on top of them; not "
                     f"counted: the input batch ({fmt_bytes(self.input_bytes)}) and what the first step "
                     f"kept ({fmt_bytes(self.kept_bytes)}: imports, JIT caches)")
        return "\n".join(lines)


class _PeakTracker:
    """Current and peak bytes allocated from CuPy's default memory pool while active."""

    def __init__(self):
        import cupy
        self.pool = cupy.get_default_memory_pool()
        tracker = self

        class Hook(cupy.cuda.MemoryHook):
            name = "lowmem-peak"

            def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
                tracker.current += mem_size
                tracker.peak = max(tracker.peak, tracker.current)

            def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
                tracker.current -= mem_size

        self.hook = Hook()
        self.current = self.peak = self.pool.used_bytes()

    def reset_peak(self):
        self.peak = self.current


def measure_peak(net, batch_size, input_shape, mode="approx", bits=4, dtype="float32", steps=2,
                 seed=0, **engine_kw):
    """Build Engine(net, ...) and run `steps` training steps (SGD) on random
    data of a full batch; return a MemoryMeasurement. Takes ownership of
    `net` as an Engine does (pass a deep copy to keep yours)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    xp = backend.xp
    # refuse before allocating anything: the plan and the input batch must fit in free memory
    planned = Engine(net, batch_size, input_shape, mode, bits, dtype, allocate=False, **engine_kw)
    input_bytes = batch_size * int(numpy.prod(input_shape)) * planned.dtype.itemsize
    sysmem.require(planned.plan.total_bytes + input_bytes,
                   f"measuring {steps} training steps at batch {batch_size} (the plan "
                   f"{fmt_bytes(planned.plan.total_bytes)} and the input batch {fmt_bytes(input_bytes)})", xp)
    rng = numpy.random.default_rng(seed)
    x = xp.asarray(rng.standard_normal((batch_size,) + tuple(input_shape), dtype=planned.dtype))
    labels = xp.asarray(rng.integers(0, net.num_classes, batch_size))
    gpu = backend.name == "cupy"
    if gpu:
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()
        tracker = _PeakTracker()
        tracker.hook.__enter__()
        current = lambda: tracker.current                      # noqa: E731
        peak = lambda: tracker.peak                            # noqa: E731
        reset = tracker.reset_peak
    else:
        tracemalloc.start()
        current = lambda: tracemalloc.get_traced_memory()[0]   # noqa: E731
        peak = lambda: tracemalloc.get_traced_memory()[1]      # noqa: E731
        reset = tracemalloc.reset_peak
    try:
        base = current()
        eng = Engine(net, batch_size, input_shape, mode, bits, dtype, **engine_kw)
        opt = SGD(net.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
        held = current() - base
        peaks, kept = [], 0
        for i in range(steps):
            start = current()
            if i == 1:
                kept = start - base - held
            reset()
            eng.train_step(x, labels, opt)
            if gpu:
                cupy.cuda.Device().synchronize()
            peaks.append(held + peak() - start)
    finally:
        if gpu:
            tracker.hook.__exit__(None, None, None)
        else:
            tracemalloc.stop()
    return MemoryMeasurement(eng.plan.total_bytes, held, peaks, kept, int(x.nbytes),
                             "cupy pool" if gpu else "tracemalloc")
