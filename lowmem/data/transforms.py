"""Normalise, crop and flip: batches of images into preallocated arrays, vectorised over the batch.

Images are (N, C, H, W), uint8 or float pixels 0..255 (lowmem.data.datasets, lowmem.data.images);
`normalize` writes floats per channel (NumPy or CuPy arrays), `augment` is the standard CIFAR
augmentation (a random crop from a 4-px zero-padded image, then a horizontal flip), drawn from
a numpy.random.Generator so a seed fixes it. Nothing here loads or batches data.
"""
import numpy as np

from ..system.backend import array_module


def normalize(out, x, mean, std):
    """out = (x / 255 - mean[c]) / std[c], per channel.

    out: float (N, C, H, W), written; x: uint8 or float pixels 0..255, same
    shape; mean, std: (C,) in units of x / 255 (see lowmem.data.datasets.channel_mean_std).
    Two passes (scale, then shift) straight into `out`, no temporary; out and
    x may be NumPy or CuPy arrays (the same kind). Returns out.
    """
    if out.shape != x.shape or out.ndim != 4:
        raise ValueError(f"normalize: out {out.shape} and x {x.shape} must be the same (N, C, H, W)")
    if out.dtype.kind != "f":
        raise ValueError(f"normalize: out must be a float array, got {out.dtype}")
    xp = array_module(out)
    mean = np.asarray(mean, np.float64).reshape(-1)
    std = np.asarray(std, np.float64).reshape(-1)
    if mean.shape != (x.shape[1],) or std.shape != (x.shape[1],):
        raise ValueError(f"normalize: mean/std need {x.shape[1]} channels, got {mean.shape}, {std.shape}")
    scale = (1.0 / (255.0 * std)).astype(out.dtype).reshape(1, -1, 1, 1)
    shift = (-mean / std).astype(out.dtype).reshape(1, -1, 1, 1)
    xp.multiply(x, xp.asarray(scale), out=out)
    xp.add(out, xp.asarray(shift), out=out)
    return out


def draw_crop_flip(n, rng, pad=4, flip=True):
    """Random augmentation parameters for n samples, in this order from `rng`:
    dy, dx: int (n,) in 0..2*pad, the window's corner in the padded image;
    flipped: bool (n,), horizontal flip (all False when flip is off)."""
    dy = rng.integers(0, 2 * pad + 1, n)
    dx = rng.integers(0, 2 * pad + 1, n)
    flipped = rng.random(n) < 0.5 if flip else np.zeros(n, bool)
    return dy, dx, flipped


def crop_flip(out, x, dy, dx, flipped, pad=4):
    """out[n] = the H x W window at (dy[n], dx[n]) of x[n] zero-padded by `pad`
    pixels on each side, mirrored left-right where flipped[n].

    out, x: (N, C, H, W), any dtypes (out may be x: the padded copy is made
    first). One gather over the whole batch, no loop over samples;
    temporaries: the padded batch and the gathered batch, each about the
    size of x.
    """
    n, c, h, w = x.shape
    if out.shape != x.shape:
        raise ValueError(f"crop_flip: out {out.shape} must match x {x.shape}")
    padded = np.zeros((n, c, h + 2 * pad, w + 2 * pad), x.dtype)
    padded[:, :, pad:pad + h, pad:pad + w] = x
    rows = dy[:, None] + np.arange(h)                             # (N, H)
    cols = dx[:, None] + np.arange(w)                             # (N, W)
    cols = np.where(flipped[:, None], cols[:, ::-1], cols)
    out[...] = padded[np.arange(n)[:, None, None, None], np.arange(c)[None, :, None, None],
                      rows[:, None, :, None], cols[:, None, None, :]]
    return out


def augment(out, x, rng, pad=4, flip=True):
    """Standard CIFAR augmentation: per sample, a random crop from the image
    zero-padded by `pad` px on each side, then a random horizontal flip.

    out, x: (N, C, H, W), uint8 or float; rng: numpy.random.Generator (the
    result depends only on its state). Vectorised (see `crop_flip`).
    Returns out.
    """
    return crop_flip(out, x, *draw_crop_flip(len(x), rng, pad, flip), pad=pad)
