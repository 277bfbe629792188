"""One stride-1 convolution's three products (forward, input gradient, weight gradient), and its
two gradients as the engine's backward runs them (conv2d_backward), through ops/conv.py under
several paths, alternated call by call in one process, at the engine's default conv workspace
(16 MiB): is the rule the engine applies the fastest here?

    python benchmarks/conv_paths.py --shape 256,256,8,16 --shape 128,32,4,16 --threads 2
    python benchmarks/conv_paths.py --shape 752,128,2,16,1 --paths engine,apart --threads 2

A shape is Cin,Cout,H,N[,k] (H = W; k the kernel, 3 (the default) or 1, padding k // 2).
Paths (--paths, default: all):
  engine       what the engine runs (Winograd where it applies, its scheme and thread split)
  batch-split  Winograd with batch ranges only (no plane split; a weight gradient whose dU
               and term do not fit takes im2col, as before blocks of output channels)
  split-all    Winograd with every batch split between the threads (no work grain)
  split-planes Winograd with the planes split between the threads wherever a batch range would
               hold fewer than PLANE_TILES tiles, whatever the channels (no PLANE_CHANNELS)
  f2           Winograd F(2x2) everywhere (no F(4x4))
  f4           Winograd F(4x4) wherever a plane is 4x4 or more
  im2col       the im2col path (Winograd off)
  im2col-unflipped  im2col with every weight-gradient GEMM as dout @ cols^T (ops/conv.weight_term
               never flipped: conv.FLIP_COLUMNS out of reach), against im2col's rule
  apart        the engine's rule, with a small conv's two gradients one after the other
               (conv.SIDE_BY_SIDE off), not side by side on two threads
Printed per shape and path: the median milliseconds of each product over --rounds rounds
(the first two not counted), their sum and the sum against the first path's; then both
gradients as conv2d_backward runs them and that against the first path's. Wall-clock on
whatever machine runs it: say which, and time nothing else at once.
"""
import argparse
import contextlib
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lowmem.core.engine import DEFAULT_WORKSPACE_BYTES  # noqa: E402
from lowmem.ops import conv, winograd, winograd4  # noqa: E402
from lowmem.system import threads  # noqa: E402

PATHS = {
    "engine": {},
    "batch-split": {(winograd, "SPLIT_PLANES"): False, (winograd, "MIN_BLOCK"): 1 << 40},
    "split-all": {(winograd, "WORK_GRAIN"): 1},
    "split-planes": {(winograd, "PLANE_CHANNELS"): 1},
    "f2": {(winograd4, "ENABLED"): False},
    "f4": {(winograd4, "MIN_OUTPUTS"): 0, (winograd4, "MIN_SIDE"): 4},
    "im2col": {(winograd, "ENABLED"): False},
    "im2col-unflipped": {(winograd, "ENABLED"): False, (conv, "FLIP_COLUMNS"): 1 << 62},
    "apart": {(conv, "SIDE_BY_SIDE"): False},
}


@contextlib.contextmanager
def path(name):
    """The module settings of path `name`, restored after."""
    old = {key: getattr(*key) for key in PATHS[name]}
    for (mod, attr), value in PATHS[name].items():
        setattr(mod, attr, value)
    try:
        yield
    finally:
        for (mod, attr), value in old.items():
            setattr(mod, attr, value)


def shape_arg(text):
    try:
        sizes = [int(v) for v in text.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) not in (4, 5):
        raise argparse.ArgumentTypeError(f"a shape is Cin,Cout,H,N or Cin,Cout,H,N,k (integers), got {text!r}")
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"a shape's sizes must be positive, got {text!r}")
    if len(sizes) == 5 and sizes[4] not in (1, 3):
        raise argparse.ArgumentTypeError(f"a shape's kernel k is 1 or 3, got {text!r}")
    return tuple(sizes) + ((3,) if len(sizes) == 4 else ())


def products(ci, co, h, n, k, ws, rng):
    """The three products of one conv, and both gradients as conv2d_backward runs them, as
    closures over fresh arrays."""
    x = rng.standard_normal((ci, n, h, h), dtype=np.float32)
    w = (rng.standard_normal((co, ci, k, k)) * np.sqrt(2 / (k * k * ci))).astype(np.float32)
    g = rng.standard_normal((co, n, h, h), dtype=np.float32)
    out, dx, dw = np.empty_like(g), np.empty_like(x), np.zeros_like(w)
    p = k // 2
    return (lambda: conv.conv2d_forward(out, x, w, 1, p, ws, conv.NUMBA),
            lambda: conv.conv2d_backward_input(dx, g, w, 1, p, ws, columns=conv.NUMBA),
            lambda: conv.conv2d_backward_weight(dw, x, g, 1, p, ws, conv.NUMBA),
            lambda: conv.conv2d_backward(dw, dx, x, g, w, 1, p, ws, columns=conv.NUMBA))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=shape_arg, action="append", required=True, help="Cin,Cout,H,N[,k]")
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated, of: " + ", ".join(PATHS))
    p.add_argument("--threads", type=int, default=None, help="lowmem threads (default: all cores)")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    names = args.paths.split(",")
    unknown = [n for n in names if n not in PATHS]
    if unknown:
        p.error(f"unknown path(s) {', '.join(unknown)}: expected some of {', '.join(PATHS)}")
    if args.rounds < 3:
        p.error("--rounds: at least 3 (the first two are not counted)")
    if not (winograd.AVAILABLE and conv.columns_cpu.AVAILABLE):
        sys.exit("conv_paths.py times the numba paths: install lowmem[fast] (numba)")
    threads.configure(args.threads)
    from threadpoolctl import threadpool_limits
    print(f"lowmem threads {threads.threads()}, workspace {DEFAULT_WORKSPACE_BYTES >> 20} MiB, "
          f"load average {os.getloadavg()[0]:.2f}")
    ws = np.empty(DEFAULT_WORKSPACE_BYTES // 4, np.float32)
    rng = np.random.default_rng(0)
    for ci, co, h, n, k in args.shape:
        calls = products(ci, co, h, n, k, ws, rng)
        times = {name: [[], [], [], []] for name in names}
        with threadpool_limits(1):
            for r in range(args.rounds):
                for name in (names if r % 2 == 0 else names[::-1]):
                    with path(name):
                        for i, f in enumerate(calls):
                            t0 = time.perf_counter()
                            f()
                            times[name][i].append(time.perf_counter() - t0)
        med = {name: [1e3 * float(np.median(t[2:])) for t in times[name]] for name in names}
        first, both = sum(med[names[0]][:3]), med[names[0]][3]
        print(f"Cin {ci}, Cout {co}, {k}x{k} on {h}x{h}, batch {n} (ms: forward, input gradient, weight "
              f"gradient = sum, against {names[0]}; both gradients as the backward runs them, against {names[0]})")
        for name in names:
            f, d, w, b = med[name]
            print(f"  {name:12s} {f:8.3f} {d:8.3f} {w:8.3f} = {f + d + w:8.3f}   {(f + d + w) / first:.2f}   "
                  f"both {b:8.3f}   {b / both:.2f}")


if __name__ == "__main__":
    main()
