"""Why lowmem stores activations channels-major, (C, N, H, W).

Times, side by side in one process, the two operations that dominate a
bottleneck ResNet on the CPU, in PyTorch's NCHW layout and in CNHW:
  * a 1x1 conv: CNHW is one GEMM  w(Cout, Cin) @ x(Cin, N*H*W);
    NCHW is N batched GEMMs  w @ x[n](Cin, H*W)  (np.matmul broadcasts);
  * batch-norm statistics (per-channel sum and sum of squares): CNHW reduces
    contiguous rows; NCHW reduces over axes (0, 2, 3).

    python benchmarks/layout.py [--batch 128]
"""
import argparse
import time

import numpy as np


def best(f, repeat=5):
    f()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    args = ap.parse_args()
    N = args.batch
    rng = np.random.default_rng(0)
    print(f"{'shape (Cin->Cout, HxW)':<26} {'op':<10} {'NCHW ms':>9} {'CNHW ms':>9} {'NCHW/CNHW':>10}")
    for cin, cout, hw in [(64, 16, 32), (16, 64, 32), (128, 32, 16), (256, 64, 8)]:
        w = rng.standard_normal((cout, cin)).astype(np.float32)
        x_nchw = rng.standard_normal((N, cin, hw, hw)).astype(np.float32)
        x_cnhw = np.ascontiguousarray(x_nchw.transpose(1, 0, 2, 3))
        o_nchw = np.empty((N, cout, hw * hw), np.float32)
        o_cnhw = np.empty((cout, N * hw * hw), np.float32)
        xn, xc = x_nchw.reshape(N, cin, -1), x_cnhw.reshape(cin, -1)
        t1 = best(lambda: np.matmul(w, xn, out=o_nchw))
        t2 = best(lambda: np.matmul(w, xc, out=o_cnhw))
        label = f"{cin}->{cout}, {hw}x{hw}"
        print(f"{label:<26} {'1x1 conv':<10} {t1 * 1e3:>9.2f} {t2 * 1e3:>9.2f} {t1 / t2:>10.2f}")
        s1 = best(lambda: (x_nchw.sum(axis=(0, 2, 3)), np.einsum("nchw,nchw->c", x_nchw, x_nchw)))
        s2 = best(lambda: (xc.sum(axis=1), np.einsum("cm,cm->c", xc, xc)))
        print(f"{'':<26} {'BN stats':<10} {s1 * 1e3:>9.2f} {s2 * 1e3:>9.2f} {s1 / s2:>10.2f}")


if __name__ == "__main__":
    main()
