"""A batch norm alone in approx mode: its coded passes (units/norm_cpu.py forward_coded,
forward_add_relu_coded, backward_coded: x-hat's range code made and read inside the pass)
against the separate passes they replace (normalize, rangecode_cpu.range_encode, apply or
forward_add_relu; range_decode into a buffer, backward), alternated call by call in one process.

    python benchmarks/norm_coded.py --shape 512,65536 --shape 256,16384 --threads 2

A shape is C,M (channels, elements per channel: N*H*W), float32, --bits K (default 4). The coded
backward decodes a row once, into a row's scratch, where the row is at most norm_cpu.ROW_BYTES
(--row-bytes sets it: 0 decodes each block in each pass). Printed
per shape and pass: the median milliseconds of each way over --rounds rounds (the first two
not counted) and coded / separate. Both ways write the same bytes (tests/units/test_norm_cpu.py).
Wall-clock on whatever machine runs it: say which, and time nothing else at once.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lowmem.ops import batchnorm  # noqa: E402
from lowmem.system import threads  # noqa: E402
from lowmem.units import norm_cpu, rangecode, rangecode_cpu  # noqa: E402


def passes(C, M, bits, rng):
    """{pass: (separate, coded, written)}: zero-argument calls on one shape's arrays, and the arrays
    both write (x-hat's buffer for the separate passes is one more (C, M) array, as the engine's
    scratch; the backward adds into dgamma and dbeta)."""
    x = rng.standard_normal((C, M)).astype(np.float32)
    other = rng.standard_normal((C, M)).astype(np.float32)
    dy = rng.standard_normal((C, M)).astype(np.float32)
    g, b = rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    mean, var, rstd = (np.empty(C, np.float32) for _ in range(3))
    batchnorm.bn_stats(mean, var, rstd, x, batchnorm.BN_EPS)
    n = C * M
    code = rangecode.RangeCode(np.zeros(rangecode.packing.packed_nbytes(n, bits), np.uint8),
                               np.zeros(rangecode.groups(n), np.float32), np.zeros(rangecode.groups(n), np.uint8), bits)
    out, scratch, dx = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    mask = np.zeros((n + 7) // 8, np.uint8)
    dg, db = np.zeros(C, np.float32), np.zeros(C, np.float32)

    def forward():
        norm_cpu.normalize(out, x, mean, rstd)
        rangecode_cpu.range_encode(*code[:3], out.reshape(-1), bits)
        norm_cpu.apply(out, g, b)

    def add_relu():
        norm_cpu.normalize(scratch, x, mean, rstd)
        rangecode_cpu.range_encode(*code[:3], scratch.reshape(-1), bits)
        norm_cpu.forward_add_relu(out, mask, None, scratch, other, mean, rstd, g, b)

    def backward():
        rangecode_cpu.range_decode(scratch.reshape(-1), *code[:3], bits)
        norm_cpu.backward(dx, dg, db, dy, scratch, g, rstd)

    return {
        "forward": (forward, lambda: norm_cpu.forward_coded(out, code, x, mean, rstd, g, b), [out, *code[:3]]),
        "BN -> add -> ReLU": (add_relu, lambda: norm_cpu.forward_add_relu_coded(out, mask, code, x, other, mean, rstd,
                                                                                 g, b), [out, mask, *code[:3]]),
        "backward": (backward, lambda: norm_cpu.backward_coded(dx, dg, db, dy, code, g, rstd), [dx, dg, db]),
    }


def shape(text):
    try:
        C, M = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is C,M (two integers), got {text!r}") from None
    if C < 1 or M < 1:
        raise argparse.ArgumentTypeError(f"C and M must be positive, got {text!r}")
    return C, M


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=shape, action="append", required=True, help="C,M (repeatable)")
    ap.add_argument("--bits", type=int, default=4, choices=(1, 2, 4, 8))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=threads.threads())
    ap.add_argument("--row-bytes", type=int, default=norm_cpu.ROW_BYTES,
                    help="norm_cpu.ROW_BYTES for the coded backward (default: %(default)s)")
    args = ap.parse_args(argv)
    if not norm_cpu.AVAILABLE:
        raise SystemExit("the coded passes are numba's: pip install lowmem[fast]")
    if args.rounds < 3:
        ap.error("--rounds must be at least 3 (the first two are not counted)")
    if args.row_bytes < 0:
        ap.error("--row-bytes must be at least 0")
    threads.configure(args.threads)
    norm_cpu.ROW_BYTES = args.row_bytes
    rng = np.random.default_rng(0)
    print(f"{args.threads} thread(s), float32, {args.bits} bits, rows decoded once up to {args.row_bytes} bytes; "
          f"median ms over {args.rounds - 2} rounds")
    for C, M in args.shape:
        for name, (*ways, _) in passes(C, M, args.bits, rng).items():
            times = ([], [])
            for r in range(args.rounds):
                for k in ((0, 1) if r % 2 else (1, 0)):
                    t = time.perf_counter()
                    ways[k]()
                    if r >= 2:
                        times[k].append(time.perf_counter() - t)
            sep, cod = (float(np.median(t)) * 1e3 for t in times)
            print(f"{C}x{M:<8d} {name:18s} separate {sep:8.3f}  coded {cod:8.3f}  coded / separate {cod / sep:.2f}")


if __name__ == "__main__":
    main()
