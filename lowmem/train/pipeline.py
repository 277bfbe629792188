"""What a training run feeds the engine: its data, the batch iterators, and the pipeline that
turns a uint8 batch into this rank's normalised shard.

    data = load_data(config)                        # a Dataset, or image folders (decoded on threads)
    train, test = iterators(data, config)           # shuffled with drop_last; in order, every sample
    pipeline = BatchPipeline(data, config, comm, engine)
    x, y = pipeline(xb, yb, rng, train=True)        # augmented, sharded, normalised, on the backend

`data_info` is what travels with the weights (class names, input shape, eval preprocessing).
The loop that uses them is lowmem/train/trainer.py.
"""
import numpy

from ..data import images
from ..data.batches import BatchIterator
from ..data.datasets import load_dataset
from ..data.decode import eval_resize
from ..data.transforms import augment, normalize


def data_info(data, config):
    """What travels with the weights (checkpoint meta["data"], both exports): class names in label
    order, the input shape, and the eval preprocessing (resize the shorter side to `resize`,
    centre crop `image_size`, normalise with mean/std in pixel / 255)."""
    shape = [int(v) for v in data.input_shape]
    folder = isinstance(data, images.ImageFolders)
    classes = getattr(data, "classes", None) or [str(k) for k in range(data.num_classes)]
    return {"classes": [str(c) for c in classes], "input_shape": shape, "image_size": shape[-1],
            "resize": eval_resize(shape[-1]) if folder else shape[-1],
            "mean": [float(v) for v in data.mean], "std": [float(v) for v in data.std],
            "dataset": str(config.dataset)}


def load_data(c, saved_data=None, check=True):
    """config.dataset's data. Image folders: decoded on threads; the limits are seeded subsets; a
    resumed run keeps its checkpoint's normalisation (`saved_data`); check: decode-check val/ now,
    so that a bad file stops the run before its first epoch, not after it."""
    if c.dataset != "folder":
        return load_dataset(c.dataset, c.data_dir, download=c.download, pad_to=c.pad_to or None,
                            limit_train=c.limit_train, limit_test=c.limit_test, seed=c.seed)
    mean, std = (saved_data["mean"], saved_data["std"]) if saved_data and "mean" in saved_data else (None, None)
    data = images.load_image_folders(c.data_dir, size=c.image_size, mean=mean, std=std, workers=c.workers,
                                     limit_train=c.limit_train, limit_test=c.limit_test, seed=c.seed,
                                     skip_bad=c.skip_bad)
    if check and not c.skip_bad:           # with --skip-bad the loaders count and skip bad files
        images.check_decodable(data.val, workers=c.workers)
    return data


def iterators(data, c):
    """(training batches: shuffled, drop_last; test batches: in order, all of them)."""
    if not isinstance(data, images.ImageFolders):
        return (BatchIterator(data.x_train, data.y_train, c.batch, shuffle=True, seed=c.seed, drop_last=True),
                BatchIterator(data.x_test, data.y_test, c.batch))
    # random-resized-crop + flip while decoding; --no-augment: the eval transform, still shuffled
    train = data.loader("train", c.batch, seed=c.seed, dtype="uint8", workers=c.workers, train=c.augment,
                        shuffle=True, drop_last=True, skip_bad=c.skip_bad)
    return train, data.loader("val", c.batch, dtype="uint8", workers=c.workers, skip_bad=c.skip_bad)


class BatchPipeline:
    """A uint8 batch -> this rank's normalised shard in the engine's dtype, through arrays
    allocated once (uint8 after augmentation, then the engine's dtype; a device copy on CuPy).

    The whole (global) batch is augmented, so every rank makes the same random draws; then this
    rank keeps its shard: rows [n*r/R, n*(r+1)/R) of n. Image folders are augmented while decoding."""

    def __init__(self, data, config, comm, engine):
        self.data, self.comm, self.xp = data, comm, engine.xp
        self.augment = config.augment and config.dataset != "folder"
        shape, local = data.input_shape, config.batch // comm.size
        self.u8 = numpy.empty((config.batch,) + shape, numpy.uint8)           # the global batch, augmented
        self.u8_device = self.xp.empty((local,) + shape, numpy.uint8) if self.xp is not numpy else self.u8
        self.x = self.xp.empty((local,) + shape, engine.dtype)

    def __call__(self, xb, yb, rng, train):
        n, r, size = len(xb), self.comm.rank, self.comm.size
        u8 = self.u8[:n]
        if train and self.augment:
            augment(u8, xb, rng)
        else:
            u8[...] = xb
        lo, hi = n * r // size, n * (r + 1) // size
        u8, yb = u8[lo:hi], yb[lo:hi]
        if self.u8_device is not self.u8:
            self.u8_device[:hi - lo].set(u8)
            u8 = self.u8_device[:hi - lo]
        x = normalize(self.x[:hi - lo], u8, self.data.mean, self.data.std)
        return x, self.xp.asarray(yb)
