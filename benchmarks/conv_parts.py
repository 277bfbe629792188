"""The parts of ResNet-164's convolutions, timed one by one in one process (one lowmem thread).

  * Winograd's tile kernels (ops/winograd.py) per chunk, at each stage's shape and the chunk
    size the step uses: input tiles, output-gradient tiles, output tiles (--scheme f2, the
    default, or f4: ops/winograd4.py's);
  * Winograd's filter transforms (--filters Cout,Cin, repeatable): the forward's, the input
    gradient's (of the flipped, transposed view it passes) and the weight gradient's adjoint,
    F(2x2) and F(4x4), in ns a filter;
  * each 3x3 product (forward, input gradient, weight gradient) through Winograd and
    through im2col (the fast pair with Winograd off: im2col + numba col2im), batch --batch;
  * each 1x1 product through ops/conv.py against a bare numpy.matmul of the same shapes
    (is lowmem's call at the BLAS rate?), with GFLOP/s.

    python benchmarks/conv_parts.py [--batch 128] [--repeat 5]
    python benchmarks/conv_parts.py --parts tiles --stage 128,4,16 --stage 128,2,16 --repeat 21
    python benchmarks/conv_parts.py --parts filters --filters 32,128 --filters 512,512 --repeat 21

--stage C,H[,N] times the parts at C channels on H x H planes instead of ResNet-164's stages
(repeatable; N: the tile kernels' samples, default the chunk a C -> C conv's step takes, at
most --batch); --parts picks which of tiles, 3x3, 1x1 run (default all three).

Best of --repeat; the machine's load average is printed first: on a shared machine read
the ratios, not the times.
"""
import argparse
import os

import numpy as np

from layout import best                 # the fastest of `repeat` timed calls, after one untimed
from lowmem.system import threads
from lowmem.ops import conv, winograd

STAGES = [(16, 32), (32, 16), (64, 8)]          # ResNet-164's 3x3 convs: channels, H = W
IM2COL = conv.NUMBA._replace(name="im2col + numba col2im", winograd=False)


def tile_kernels(stages, batch, repeat, s):
    print(f"Winograd {s.name} tile kernels, one chunk (us per call): input | output-gradient | output")
    for C, H, *n in stages:
        th, tw = s.tiles(H, H)
        ns = n[0] if n else max(1, min(batch, winograd.CACHE_BYTES // (4 * s.per_sample(C, C, H, H))))
        x = np.random.default_rng(0).standard_normal((C, ns, H, H)).astype(np.float32)
        V, M = (winograd._planes(np.zeros(s.planes * (C * ns * th * tw + winograd.PLANE_GAP), np.float32), C,
                                 ns * th * tw, s.planes) for _ in range(2))
        out = np.empty_like(x)                          # the planes laid as the conv lays them (_planes)
        t = [best(lambda: s.input_tiles(V, x, 0), repeat),
             best(lambda: s.gradient_tiles(V, x, 0), repeat),
             best(lambda: s.output_tiles(out, M, 0, False), repeat)]
        print(f"  C {C:3d}, {H:2d}x{H:<2d} ({ns} samples): " + " | ".join(f"{s * 1e6:7.1f}" for s in t))


def filter_kernels(shapes, repeat):
    print("Winograd filter transforms (ns a filter): forward | input gradient's (flipped view) | adjoint")
    rng = np.random.default_rng(0)
    for co, ci in shapes:
        w = rng.standard_normal((co, ci, 3, 3)).astype(np.float32)
        flipped = w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)
        for s in (winograd.F2, winograd.F4):
            dU = rng.standard_normal((s.planes, co, ci)).astype(np.float32)
            dw = np.zeros_like(w)
            t = [best(lambda: winograd.filter_transform(w, s), repeat),
                 best(lambda: winograd.filter_transform(flipped, s), repeat),
                 best(lambda: winograd.filter_gradient_add(dw, dU, s), repeat)]
            print(f"  {co:3d} x {ci:3d}, {s.name}: " + " | ".join(f"{v * 1e9 / (co * ci):6.2f}" for v in t))


def conv3x3(stages, N, repeat):
    print(f"3x3 convs, batch {N} (ms): forward | input gradient | weight gradient, Winograd / im2col")
    ws = np.empty(1 << 22, np.float32)                  # 16 MiB, the default conv workspace
    rng = np.random.default_rng(0)
    for C, H, *_ in stages:
        x = rng.standard_normal((C, N, H, H)).astype(np.float32)
        w = rng.standard_normal((C, C, 3, 3)).astype(np.float32)
        g = rng.standard_normal((C, N, H, H)).astype(np.float32)
        out, dx, dw = np.empty_like(g), np.empty_like(x), np.zeros_like(w)
        row = []
        for run in (lambda cols: conv.conv2d_forward(out, x, w, 1, 1, ws, columns=cols),
                    lambda cols: conv.conv2d_backward_input(dx, g, w, 1, 1, ws, columns=cols),
                    lambda cols: conv.conv2d_backward_weight(dw, x, g, 1, 1, ws, columns=cols)):
            a = best(lambda: run(conv.NUMBA), repeat)
            b = best(lambda: run(IM2COL), repeat)
            row.append(f"{a * 1e3:6.1f} / {b * 1e3:6.1f}")
        print(f"  C {C:3d}, {H:2d}x{H:<2d}: " + " | ".join(row))


def conv1x1(stages, N, repeat):
    print(f"1x1 convs, batch {N} (ms, GFLOP/s): ops/conv.py / bare numpy.matmul")
    rng = np.random.default_rng(0)
    ws = np.empty(16, np.float32)
    for C, H, *_ in stages:
        for ci, co in ((4 * C, C), (C, 4 * C)):
            M = N * H * H
            x = rng.standard_normal((ci, N, H, H)).astype(np.float32)
            w = rng.standard_normal((co, ci, 1, 1)).astype(np.float32)
            g = rng.standard_normal((co, N, H, H)).astype(np.float32)
            out, dx, dw = np.empty_like(g), np.empty_like(x), np.zeros_like(w)
            x2, g2, w2 = x.reshape(ci, M), g.reshape(co, M), w.reshape(co, ci)
            flop = 2 * ci * co * M
            row = []
            for name, ours, bare in (
                    ("fwd", lambda: conv.conv2d_forward(out, x, w, 1, 0, ws),
                     lambda: np.matmul(w2, x2, out=out.reshape(co, M))),
                    ("dx", lambda: conv.conv2d_backward_input(dx, g, w, 1, 0, ws),
                     lambda: np.matmul(w2.T, g2, out=dx.reshape(ci, M))),
                    ("dw", lambda: conv.conv2d_backward_weight(dw, x, g, 1, 0, ws),
                     lambda: np.matmul(g2, x2.T))):
                a, b = best(ours, repeat), best(bare, repeat)
                row.append(f"{name} {a * 1e3:5.2f} / {b * 1e3:5.2f} ({flop / a / 1e9:3.0f} / {flop / b / 1e9:3.0f})")
            print(f"  {ci:3d} -> {co:3d}, {H:2d}x{H:<2d}: " + " | ".join(row))


PARTS = {"tiles": tile_kernels, "filters": filter_kernels, "3x3": conv3x3, "1x1": conv1x1}


def stage(text):
    """--stage C,H[,N]: positive integers."""
    try:
        v = tuple(int(t) for t in text.split(","))
    except ValueError:
        v = ()
    if len(v) not in (2, 3) or min(v) < 1:
        raise argparse.ArgumentTypeError(f"want C,H or C,H,N (positive integers), got {text!r}")
    return v


def pair(text):
    """--filters Cout,Cin: two positive integers."""
    try:
        v = tuple(int(t) for t in text.split(","))
    except ValueError:
        v = ()
    if len(v) != 2 or min(v) < 1:
        raise argparse.ArgumentTypeError(f"want Cout,Cin (positive integers), got {text!r}")
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--stage", action="append", type=stage, metavar="C,H[,N]",
                    help="channels and plane side (and the tile kernels' samples) instead of ResNet-164's stages")
    ap.add_argument("--parts", default="tiles,3x3,1x1",
                    help="which parts run: tiles, filters, 3x3, 1x1 (comma-separated)")
    ap.add_argument("--scheme", choices=("f2", "f4"), default="f2", help="the tile kernels' Winograd scheme")
    ap.add_argument("--filters", action="append", type=pair, metavar="Cout,Cin",
                    help="the filter transforms' shapes (repeatable; default 32,128 and 256,256)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"--parts: unknown {', '.join(unknown)} (choose from {', '.join(PARTS)})")
    stages = args.stage or STAGES
    threads.configure(1)
    print(f"load average before: {os.getloadavg()[0]:.2f}; one lowmem thread, BLAS at one thread")
    for name in parts:
        if name == "tiles":
            tile_kernels(stages, args.batch, args.repeat, winograd.F4 if args.scheme == "f4" else winograd.F2)
        elif name == "filters":
            filter_kernels(args.filters or [(32, 128), (256, 256)], args.repeat)
        else:
            PARTS[name](stages, args.batch, args.repeat)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
