"""How lowmem uses the CPU's cores: one policy, set once by the engine (`configure()`).

The policy: **lowmem owns its threads.** BLAS runs single-threaded (through
threadpoolctl), and lowmem splits its own work — each fused BN-ReLU kernel
over channel ranges, each convolution (im2col, GEMM, col2im) over batch
ranges, each 1x1-conv GEMM over column ranges — on a small pool of Python
threads. This works because every piece releases the GIL: numba kernels are
compiled `nogil=True`, and NumPy's matmul drops the GIL around its BLAS call.

Why not let OpenBLAS and numba each bring their own threads: measured on a
2-core machine (docs/performance.md), OpenBLAS's workers spin for a long
while after every GEMM and numba's OpenMP workers after every parallel
region, each set stealing the cores the other needs: with both at 2 threads
a step was no faster than with 1. `OPENBLAS_THREAD_TIMEOUT` would shorten the
spin, but OpenBLAS reads it only when the library loads (before the first
`import numpy`), which a library cannot control. Pool threads here wait a
bounded ~90 us for the next task, then block on a lock: nothing spins for long.

The hand-over (`_Worker`): the caller bumps a worker's task counter and releases its
`go` lock, runs its own range, and waits for the worker's `fin` counter (then its `done`
lock). Both sides first spin on the counter with atomic loads in a nogil numba loop
(SPIN_READS reads, ~90 us; the GIL stays free) and block on the lock only after that; a worker
stores `fin` from inside that nogil spin's call (spin.publish_and_spin), so the caller that sees
it never finds the GIL still held by the worker and waits for it. A
network's step makes hundreds of split calls (DenseNet-121 at 64x64, batch 16: 539; many
under 200 us of work), and waking a blocked thread costs tens of microseconds on a VM.
An empty split call took 65 - 90 us through concurrent.futures' executor (a queue, a
future and its condition per range), ~47 us with the locks alone and ~21 us with the
spin; side by side in one process, the spin made steps 5 - 10% faster (DenseNet-121,
MobileNetV2; docs/performance.md). Without numba only the locks. A call made while
another thread is using the workers runs serially rather than waiting.

Without threadpoolctl (it comes with `lowmem[fast]`) lowmem cannot take BLAS
down to one thread, so it does not add threads of its own (threads() == 1):
BLAS keeps its threads, everything else runs on one core, as before.

    threads.configure()        # LOWMEM_THREADS, else the cores this process may use
    threads.configure(1)       # everything on one core (BLAS too)
    threads.parallel_for(fn, n, grain)   # fn(lo, hi) over [0, n), split over the threads

Work is split into at most threads() contiguous ranges, the same for the same
sizes every time: results are deterministic for a given thread count (but a
reduction split differently, e.g. on another machine, may differ in the last
bits).
"""
import os
import threading
import time

import numpy

_threads = 1            # how many ranges lowmem splits its work into (1: serial)
_pool = None            # [_Worker] * (_threads - 1) (the caller is the last one), or None
_blas_limit = None      # the threadpoolctl limiter that holds BLAS at one thread
_configured = False     # set by the first configure(); configure(None) then keeps the setting
_local = threading.local()


def cores():
    """CPUs this process may run on (the affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                               # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _requested(threads):
    """The thread count asked for: the argument, else $LOWMEM_THREADS, else cores()."""
    if threads is None:
        env = os.environ.get("LOWMEM_THREADS", "").strip()
        if not env:
            return cores()
        try:
            threads = int(env)
        except ValueError:
            raise ValueError(f"LOWMEM_THREADS must be a positive integer, got {env!r}") from None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    return threads


def _limit_blas_to_one():
    """BLAS at one thread for the rest of the process; False if threadpoolctl is missing."""
    global _blas_limit
    if _blas_limit is not None:
        return True
    try:
        import threadpoolctl
    except ImportError:
        return False
    _blas_limit = threadpoolctl.threadpool_limits(1, user_api="blas")
    return True


def configure(threads=None):
    """Set how lowmem uses the cores; returns threads(). The engine calls configure() when
    it is built: that keeps whatever an earlier call chose, so a user's configure(1) stands.

    threads: None -> (first call) $LOWMEM_THREADS, else cores(); an int re-sizes.
    BLAS is held at one thread and lowmem splits its own work over `threads`
    threads (the calling thread plus threads - 1 pool workers). Without
    threadpoolctl nothing changes and threads() stays 1."""
    global _threads, _pool, _configured
    if threads is None and _configured:
        return _threads
    n = _requested(threads)
    _configured = True
    if not _limit_blas_to_one():
        n = 1
    if n != _threads or (n > 1 and _pool is None):
        if _pool is not None:
            for w in _pool:
                w.stop()
        spinner = _spinner() if n > 1 else None
        _pool = [_Worker(i, spinner) for i in range(n - 1)] if n > 1 else None
        _threads = n
    return _threads


def threads():
    """How many ranges lowmem splits its work into now (1 until configure() says more)."""
    return _threads


def bounds(n, parts):
    """parts + 1 cut points splitting [0, n) into near-equal contiguous ranges."""
    return [n * i // parts for i in range(parts + 1)]


def _spinner():
    """lowmem/system/spin.py's (spin, publish_and_spin) (compiled, or loaded from numba's cache,
    now), or None without numba (or with one that cannot build them): then the pool uses its
    locks alone."""
    try:
        from .spin import publish_and_spin, spin
        flag = numpy.ones(1, numpy.int64)
        spin(flag, 0, 1)
        publish_and_spin(numpy.zeros(1, numpy.int64), 0, flag, 0, 1)
    except Exception:                                     # pragma: no cover - no numba: locks only
        return None
    return spin, publish_and_spin


SPIN_READS = 1 << 18    # about 90 us of reads (0.33 ns each on a Zen 4 EPYC): how long a pool thread
                        # waits for the next task before it blocks on its lock
WAIT_READS = 1 << 18    # and how long the caller waits for a worker's range (0: block at once)


class _Worker:
    """One pool thread. It waits for a task, spinning SPIN_READS reads on `seq` (a counter the
    caller bumps per task) and then blocking on the `go` lock (released once per task); runs the
    range it was given, records an error, releases `done` and then stores `fin` (which the
    caller spins on: fin == seq means `done` was released; stored from nogil code, which then
    spins for the next task). Without numba only the locks."""

    def __init__(self, i, spinner):
        self.go, self.done = threading.Lock(), threading.Lock()
        self.go.acquire()
        self.done.acquire()
        self.seq, self.fin = numpy.zeros(1, numpy.int64), numpy.zeros(1, numpy.int64)
        self.spin, self.publish = spinner if spinner is not None else (None, None)
        self.task = self.error = None
        self.thread = threading.Thread(target=self._loop, name=f"lowmem-{i}", daemon=True)
        self.thread.start()

    def _loop(self):
        seen, spun = 0, False
        while True:
            if self.spin is not None and not spun:
                self.spin(self.seq, seen, SPIN_READS)
            self.go.acquire()                            # at once when the spin saw the task
            seen = int(self.seq[0])
            task = self.task
            if task is None:                             # stop()
                self.done.release()
                self.fin[0] = seen
                return
            try:
                _in_range(*task)
            except BaseException as e:                   # re-raised by the caller
                self.error = e
            self.done.release()                          # then fin: fin == seq means `done` was released
            if self.publish is not None:                 # fin from outside the GIL, then the next task's spin
                self.publish(self.fin, seen, self.seq, seen, SPIN_READS)
                spun = True
            else:
                self.fin[0] = seen

    def _settle(self):
        """After a wait() that an exception (Ctrl-C) cut short: let that range end and take its
        `done`, so the worker is idle and `done` held, as after a full wait. At once otherwise."""
        while int(self.fin[0]) != int(self.seq[0]):
            time.sleep(0.0001)
        self.done.acquire(blocking=False)

    def start(self, fn, lo, hi):
        self._settle()
        self.task, self.error = (fn, lo, hi), None
        self.seq[0] += 1                                 # before go: the worker reads seq once it has go
        self.go.release()

    def wait(self):
        """Block until the range is done; its error, or None."""
        if self.spin is not None and WAIT_READS:
            self.spin(self.fin, self.seq[0] - 1, WAIT_READS)
        self.done.acquire()
        self.task = None
        return self.error

    def stop(self):
        self._settle()
        self.task = None
        self.seq[0] += 1
        self.go.release()
        self.done.acquire()
        self.thread.join()


_using = threading.Lock()       # held by the thread whose call is using the workers


def parallel_for(fn, n, grain=1):
    """Call fn(lo, hi) over [0, n) split into at most threads() contiguous ranges of at
    least `grain` items each (fewer ranges when n is small); the first range runs on the
    calling thread. Returns when every range is done; the first error is re-raised.
    A call made from inside a range runs serially (no nested pools, no deadlock), and so
    does a call made while another thread's call has the workers."""
    parts = min(_threads, n // max(1, grain))
    pool = _pool
    if parts <= 1 or pool is None or getattr(_local, "busy", False) or not _using.acquire(blocking=False):
        if n > 0:
            fn(0, n)
        return
    try:
        cut = bounds(n, parts)
        workers = pool[:parts - 1]
        for i, w in enumerate(workers, 1):
            w.start(fn, cut[i], cut[i + 1])
        try:
            _in_range(fn, cut[0], cut[1])
        finally:
            errors = [w.wait() for w in workers]         # waits for every range
    finally:
        _using.release()
    for e in errors:
        if e is not None:
            raise e


def _in_range(fn, lo, hi):
    _local.busy = True
    try:
        fn(lo, hi)
    finally:
        _local.busy = False
