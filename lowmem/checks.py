"""The engine's argument and batch checks: each refusal names the problem and the fix.

Run before anything is planned (engine_args, input_shape) or before a batch touches the
engine's arrays (batch, labels), so a bad call changes nothing.
"""
import numbers

import numpy

from . import quant
from .kernels import MODES      # the one list of modes
from .network import Network

DTYPES = ("float32", "float64")

def engine_args(net, batch_size, mode, bits, dtype):
    if not isinstance(net, Network):
        raise TypeError(f"Engine needs a lowmem Network (e.g. lowmem.models.preact_resnet_cifar(20)), "
                        f"got {type(net).__name__}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: expected one of {MODES}")
    bits = quant.check_bits(bits)
    try:
        dt = numpy.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: expected one of {DTYPES}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if net.num_classes < 2:
        raise ValueError(f"network {net.name!r} has num_classes={net.num_classes}: a classifier needs "
                         f"at least 2 classes (with one, the loss is 0 and every gradient vanishes)")
    return mode, bits, dt


def input_shape(input_shape, in_channels):
    try:
        shape = tuple(input_shape)
    except TypeError:
        shape = None
    if shape is None or len(shape) != 3 or shape[0] != in_channels:
        raise ValueError(f"input_shape must be (C, H, W) with C = {in_channels} "
                         f"(the network's in_channels), got {input_shape}")
    if not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) and s > 0 for s in shape):
        raise ValueError(f"input_shape must be (C, H, W) of positive ints, got {shape}")
    return tuple(int(s) for s in shape)


def batch(x, xp, dtype, input_shape, N, what):
    dims = ", ".join(map(str, input_shape))
    if not isinstance(x, xp.ndarray):
        raise TypeError(f"{what}: expected a {xp.__name__} array of shape (N, {dims}), got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{what}: input dtype is {x.dtype}, this engine expects {dtype} "
                        f"(convert with x.astype('{dtype}'))")
    if x.ndim != 4 or tuple(x.shape[1:]) != input_shape:
        raise ValueError(f"{what}: input shape is {tuple(x.shape)}, expected (N, {dims}) with N <= {N}")
    if not 1 <= x.shape[0] <= N:
        raise ValueError(f"{what}: batch of {x.shape[0]} is larger than the planned batch_size "
                         f"{N} (build the Engine with a larger batch_size)" if x.shape[0] > N
                         else f"{what}: empty batch")
    lo, hi = float(x.min()), float(x.max())       # NaN propagates through min/max: no temporary
    if not (numpy.isfinite(lo) and numpy.isfinite(hi)):
        raise ValueError(f"{what}: the input batch contains NaN or Inf")


def labels(labels, xp, n, K):
    if not isinstance(labels, xp.ndarray) or labels.dtype.kind not in "iu":
        raise TypeError(f"labels must be an integer {xp.__name__} array of shape ({n},), "
                        f"got {getattr(labels, 'dtype', type(labels).__name__)}")
    if labels.shape != (n,):
        raise ValueError(f"labels shape is {labels.shape}, expected ({n},) to match the batch")
    if int(labels.min()) < 0 or int(labels.max()) >= K:
        raise ValueError(f"labels out of range: found [{int(labels.min())}, {int(labels.max())}], "
                         f"expected 0 <= label < {K} (num_classes)")
