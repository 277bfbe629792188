"""Gradient error of stochastic against nearest rounding, at a few bit widths.

    python benchmarks/stochastic_rounding.py                      # ResNet-20, 4 and 2 bits
    python benchmarks/stochastic_rounding.py --depth 8 --bits 2 --batches 4

On the same weights (pre-activation ResNet at initialisation) and the same B batches of
learnable synthetic data (lowmem.tools.gradient_error.synthetic_batches, float32, approx mode), for each
bit width K and each rounding it measures, against exact gradients g_b (all parameters as one
vector):

  rms error     rms_b ||g~_b − g_b|| / rms_b ||g_b||     (diagnose's "all parameters" error)
  error/noise   rms_b ||g~_b − g_b|| / SGD noise         (diagnose's ratio)
  mean error    ||mean_b (g~_b − g_b)|| / ||mean_b g_b||: the error left in the gradient averaged
                over the B batches. Nearest rounding's error is a fixed function of the data, so
                part of it survives averaging; stochastic rounding's is mostly fresh noise.
  draw-mean     stochastic only: batch 0 quantized with R independent streams;
                ||mean_r g~_r − g_0|| / ||g_0||, against the rms single-draw error on that batch:
                how much of the error is zero-mean (it shrinks as 1/sqrt(R) where it is).
                For nearest rounding both are its (deterministic) error on batch 0.

Stochastic rounding is the engine's option (Engine(..., rounding="stochastic")): each unit of
each training forward draws from stream.stream_key(0, engine step, unit index).
"""
import argparse
import os
import sys
import time

import numpy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowmem.tools import gradient_error as D  # noqa: E402
from lowmem.models import preact_resnet_cifar           # noqa: E402


def grads(net, batches, mode, bits, rounding, repeat_first=1):
    """{name: (B', *shape)} float64 gradients, one per batch (batch 0 repeated repeat_first
    times: each repeat is a new engine step, so stochastic rounding draws new codes)."""
    order = [batches[0]] * repeat_first + list(batches[1:] if repeat_first == 1 else [])
    return D.parameter_grads(net, order, mode, bits, "float32", rounding)


def flat(d):
    return numpy.concatenate([a.reshape(a.shape[0], -1) for a in d.values()], axis=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, default=20)
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--draws", type=int, default=8, help="streams on batch 0 (draw-mean)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    net = preact_resnet_cifar(a.depth)
    batches = D.synthetic_batches(a.batches, a.batch_size, (3, 32, 32), net.num_classes, seed=a.seed)
    exact = flat(grads(net, batches, "exact", 4, "nearest"))
    B = exact.shape[0]
    mean = exact.mean(axis=0)
    noise = numpy.sqrt(((exact - mean) ** 2).sum(axis=1).mean() * B / (B - 1))
    rms_g = numpy.sqrt((exact ** 2).sum(axis=1).mean())
    print(f"pre-act ResNet-{a.depth} at initialisation, {B} batches of {a.batch_size}, float32, approx mode; "
          f"SGD noise / |g| = {noise / rms_g:.3f}")
    print(f"{'K':>2} {'rounding':<10} {'rms error':>10} {'error/noise':>12} {'mean error':>11} "
          f"{'draw-mean (R)':>14} {'single draw':>12}")
    for K in a.bits:
        for rounding in ("nearest", "stochastic"):
            g = flat(grads(net, batches, "approx", K, rounding))
            err = numpy.sqrt(((g - exact) ** 2).sum(axis=1).mean())
            mean_err = numpy.linalg.norm((g - exact).mean(axis=0)) / numpy.linalg.norm(mean)
            e0 = numpy.linalg.norm(g[0] - exact[0]) / numpy.linalg.norm(exact[0])
            extra = f" {e0:>10.4f} (det) {e0:>12.4f}"          # deterministic: every draw alike
            if rounding == "stochastic" and a.draws > 1:
                r = flat(grads(net, batches, "approx", K, rounding, repeat_first=a.draws))
                g0 = numpy.linalg.norm(exact[0])
                dm = numpy.linalg.norm(r.mean(axis=0) - exact[0]) / g0
                single = numpy.sqrt(((r - exact[0]) ** 2).sum(axis=1).mean()) / g0
                extra = f" {dm:>10.4f} ({a.draws}) {single:>12.4f}"
            print(f"{K:>2} {rounding:<10} {err / rms_g:>10.4f} {err / noise:>12.4f} {mean_err:>11.4f}{extra}",
                  flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
