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
`import numpy`), which a library cannot control. Pool threads here block on a
queue between tasks: nothing spins.

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
from concurrent.futures import ThreadPoolExecutor

_threads = 1            # how many ranges lowmem splits its work into (1: serial)
_pool = None            # ThreadPoolExecutor with _threads - 1 workers (the caller is the last one)
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
            _pool.shutdown(wait=True)
        _pool = ThreadPoolExecutor(n - 1, thread_name_prefix="lowmem") if n > 1 else None
        _threads = n
    return _threads


def threads():
    """How many ranges lowmem splits its work into now (1 until configure() says more)."""
    return _threads


def bounds(n, parts):
    """parts + 1 cut points splitting [0, n) into near-equal contiguous ranges."""
    return [n * i // parts for i in range(parts + 1)]


def parallel_for(fn, n, grain=1):
    """Call fn(lo, hi) over [0, n) split into at most threads() contiguous ranges of at
    least `grain` items each (fewer ranges when n is small); the first range runs on the
    calling thread. Returns when every range is done; the first error is re-raised.
    A call made from inside a range runs serially (no nested pools, no deadlock)."""
    parts = min(_threads, n // max(1, grain))
    if parts <= 1 or _pool is None or getattr(_local, "busy", False):
        if n > 0:
            fn(0, n)
        return
    cut = bounds(n, parts)
    futures = [_pool.submit(_in_range, fn, cut[i], cut[i + 1]) for i in range(1, parts)]
    try:
        _in_range(fn, cut[0], cut[1])
    finally:
        errors = [f.exception() for f in futures]       # waits for every range
    for e in errors:
        if e is not None:
            raise e


def _in_range(fn, lo, hi):
    _local.busy = True
    try:
        fn(lo, hi)
    finally:
        _local.busy = False
