"""Does the approximation reach the forward pass? Per unit, how far each mode's batch statistics drift.

    python docs/figures/forward_drift.py [--depth 20] [--batch 32] [--bits 4]

One forward pass of the same pre-act CIFAR ResNet (random initialisation) on the
same batch of learnable synthetic data in exact, approx and naive mode. For every
BN-ReLU unit, in forward order, it prints the relative difference of the unit's
batch rstd (1/std of its input over the batch: a statistic of the forward pass)
from exact mode's, max_c |rstd_m - rstd_exact| / rstd_exact, and at the end the
loss of each mode. approx's are zero (its forward is exact mode's, bit for bit);
naive's grow with depth, because each unit's quantization error changes every
activation after it. No plot: the table is the result.
"""
import argparse
import copy
import os
import sys

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import lowmem as lm                                  # noqa: E402
from lowmem.tools.gradient_error import synthetic_batches     # noqa: E402


def drift(depth, batch, bits, seed=0):
    net = lm.models.preact_resnet_cifar(depth, seed=seed)
    (x, labels), = synthetic_batches(1, batch, (3, 32, 32), net.num_classes, seed)
    out = {}
    for mode in ("exact", "approx", "naive"):
        eng = lm.Engine(copy.deepcopy(net), batch, (3, 32, 32), mode, bits)
        loss, _ = eng.forward(x, labels)
        units = [s.name for s in eng.schedule if s.phase == "fwd" and s.op == "bnrelu"]
        out[mode] = (loss, {u: eng.arrays[u + ".rstd"].astype(numpy.float64) for u in units})
    return units, out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=20)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--bits", type=int, default=4)
    a = p.parse_args(argv)
    units, out = drift(a.depth, a.batch, a.bits)
    ref = out["exact"][1]
    print(f"pre-act ResNet-{a.depth}, batch {a.batch}, {a.bits}-bit: max over channels of "
          f"|rstd - rstd_exact| / rstd_exact, per unit in forward order")
    print(f"{'unit':<16} {'approx':>8} {'naive':>8}")
    for u in units:
        row = [numpy.max(numpy.abs(out[m][1][u] - ref[u]) / ref[u]) for m in ("approx", "naive")]
        print(f"{u:<16} {row[0]:>8.2g} {row[1]:>8.2g}")
    print("loss: " + ", ".join(f"{m} {out[m][0]:.6f}" for m in out)
          + f"; approx == exact bit for bit: {out['approx'][0] == out['exact'][0]}")


if __name__ == "__main__":
    main()
