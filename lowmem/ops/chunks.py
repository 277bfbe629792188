"""Batch and column ranges over the workspace, one per thread: how the convs cut their work.

Dimensions: N batch;  M GEMM columns;  `per_sample` workspace elements one sample needs.

ops/conv.py (im2col + GEMM) and ops/winograd.py (the 3x3 tiles) both run a conv as
contiguous batch ranges, one per lowmem thread (lowmem/system/threads.py), each with its own
slice of the 1-D conv workspace handed in from the memory plan, and a 1x1 conv's GEMM as
contiguous column ranges. This module is that cutting, and nothing else: no conv maths.
Below the grains a call is not split (a thread's start costs more than the work).
"""
from ..system import threads
from ..system.backend import array_module

GEMM_GRAIN = 4096       # columns per thread below which a 1x1-conv GEMM is not split (its light columns)
GEMM_WORK = 1 << 20     # multiply-adds per thread that are worth a split of heavier columns (wide channels)
GEMM_MIN_COLUMNS = 128  # and never fewer columns per thread than this
COLS_GRAIN = 1 << 16    # im2col elements per thread below which a conv's batch is not split


def chunk_size(ws, per_sample, n):
    """Samples of n whose columns fit the workspace ws at once; a clear error when not even one does."""
    nc = min(n, ws.size // per_sample)
    if nc < 1:
        raise ValueError(f"conv workspace too small: {ws.size} elements, one sample needs {per_sample}")
    return nc


def batch_ranges(N, ws, per_sample, most=None):
    """[(n0, n1, ws_part)]: the contiguous batch ranges over_batch cuts, one per lowmem thread (at
    most `most` where given: the caller's own grain of work), each with its own slice of the
    workspace (at least one sample's columns)."""
    chunk_size(ws, per_sample, N)                          # the clear error when even one sample does not fit
    host = 1 if array_module(ws).__name__ == "cupy" else threads.threads()   # the GPU: one stream
    if most is not None:
        host = min(host, most)
    parts = max(1, min(host, N, ws.size // per_sample, N * per_sample // COLS_GRAIN))
    cut, size = threads.bounds(N, parts), ws.size // parts
    return [(cut[t], cut[t + 1], ws[t * size:(t + 1) * size]) for t in range(parts)]


def over_batch(N, ws, per_sample, body, most=None):
    """body(n0, n1, ws_part) over batch_ranges(N, ws, per_sample, most), one range per lowmem
    thread; returns how many ranges."""
    parts = batch_ranges(N, ws, per_sample, most)

    def ranges(t0, t1):
        for t in range(t0, t1):
            body(*parts[t])
    threads.parallel_for(ranges, len(parts))
    return len(parts)


def gemm_grain(per_column):
    """Columns per thread below which a 1x1 conv's GEMM of `per_column` multiply-adds per column
    (Cout * Cin) is not split: GEMM_GRAIN, or fewer where the columns are heavy enough that
    GEMM_WORK of them is worth a thread (at 128 x 256 channels: 128 columns, so DenseNet's 1x1
    convs on 16x16 images at batch 16, 4,096 columns, run on two threads), at least
    GEMM_MIN_COLUMNS (a narrower GEMM runs below BLAS's speed)."""
    return min(GEMM_GRAIN, max(GEMM_MIN_COLUMNS, -(-GEMM_WORK // max(1, per_column))))


def over_columns(M, body, like=None, per_column=1):
    """body(m0, m1) over contiguous GEMM column ranges, one per lowmem thread, each at least
    gemm_grain(per_column) columns (one range for CuPy arrays `like`: the GPU runs the whole GEMM)."""
    if like is not None and array_module(like).__name__ == "cupy":
        body(0, M)
        return
    threads.parallel_for(body, M, grain=gemm_grain(per_column))
