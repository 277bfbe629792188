"""Image folders: DIR/train/<class>/*.jpg|png and DIR/val/<class>/* (torchvision's ImageFolder layout).

    from lowmem.data import images
    data = images.load_image_folders("photos", size=64)         # scans, checks, computes mean/std
    train = data.loader("train", batch_size=64, seed=0)         # random-resized-crop + flip
    for x, y in train:          # x float32 (N, 3, 64, 64), normalised; y int64 (N,)
        loss = eng.train_step(x, y, opt)
    val = data.loader("val", batch_size=64)                     # resize + centre crop, in order

Pillow is an optional extra: pip install 'lowmem[images]'.

Classes are the sub-folder names in sorted order (label = index), the same
in both splits: a class missing from one split, an empty class folder, or
no classes at all is a DataError naming it. Files: .jpg .jpeg .png .bmp
.gif .webp .tif .tiff (any case); other files, and hidden ones (a leading
dot: macOS's ._name.jpg AppleDouble files), are ignored. Grey and palette
images are converted to RGB (or RGB to grey for channels=1); 16-bit grey
images (Pillow modes I;16 and I, as 16-bit PNG and TIFF open) are scaled
to 8 bits, v * 255 / 65535 rounded, not clipped.

Per sample, on decode (lowmem/data/decode.py: one file -> one sample):
  train  random-resized-crop (torchvision's RandomResizedCrop) to size x size,
         then a horizontal flip with probability 1/2;
  eval   resize the shorter side to size / 0.875 (256 for 224), centre crop.

Normalisation: per-channel mean/std in units of pixel / 255, as
lowmem.data.transforms.normalize uses; computed from up to 1000 training images
(eval transform, exact 256-bin histograms) or given. The statistics pass is
streamed: it holds a few batches of about 1 MiB of pixels
(stats_memory_bytes), whatever the folder and the image size.

Loading runs on `workers` threads (Pillow releases the GIL while it
decodes and resizes) with a bounded prefetch: at most `prefetch` batches
are decoded ahead of the consumer, so memory stays at prefetch + 1 batches
and the engine's step overlaps decoding. The order and augmentation depend
only on (seed, epoch, position): the same for any number of workers, and a
loader's position (epoch, batch) resumes exactly (state_dict /
load_state_dict, like lowmem.data.batches.BatchIterator: both are OrderedBatches).

An unreadable file raises a DataError naming it; with skip_bad=True it is
replaced by the next readable sample of the split, and counted in
`loader.skipped` (the paths). `ImageFolder(..., verify=True)` checks every
file up front instead (Pillow's verify: headers and PNG checksums).
"""
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .batches import EpochOrder, OrderedBatches
from .files import DataError
from .decode import decode, eval_resize, pil
from .transforms import normalize

EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
SPLITS = ("train", "val")
STATS_IMAGES = 1000
STATS_BATCH_BYTES = 1 << 20        # decoded pixels per batch of the statistics pass (at least one image)
STATS_PREFETCH = 2                 # batches the statistics pass decodes ahead
HIST_CHUNK = 1 << 16               # pixels per bincount call (it copies its input as int64)


# --------------------------------------------------------------------------- scanning

class ImageFolder:
    """One split: root/<class>/<file>, classes sorted, samples [(path, label)] sorted by path.

    classes: force this class list (the other split's); verify: open every
    file with Pillow now; skip_bad (with verify): drop unreadable files and
    list them in `skipped` instead of raising."""

    def __init__(self, root, classes=None, verify=False, skip_bad=False):
        self.root = os.fspath(root)
        if not os.path.isdir(self.root):
            raise DataError(f"image folder {self.root} does not exist (expected {self.root}/<class>/<images>)")
        found = sorted(d.name for d in os.scandir(self.root) if d.is_dir() and not d.name.startswith("."))
        if not found:
            raise DataError(f"{self.root} has no class folders (expected {self.root}/<class>/<images>)")
        if classes is not None and found != list(classes):
            only_here = sorted(set(found) - set(classes))
            only_there = sorted(set(classes) - set(found))
            raise DataError(f"{self.root}: classes differ from the training split's: "
                            f"only here {only_here or 'none'}, missing here {only_there or 'none'}")
        self.classes = found
        self.samples = []
        for label, c in enumerate(found):
            folder = os.path.join(self.root, c)
            files = sorted(f for f in os.listdir(folder) if f.lower().endswith(EXTENSIONS)
                           and not f.startswith(".")       # hidden: macOS ._x.jpg AppleDouble, .x.png
                           and os.path.isfile(os.path.join(folder, f)))
            if not files:
                raise DataError(f"class {c!r} is empty: no image files ({', '.join(EXTENSIONS)}) "
                                f"in {folder}")
            self.samples += [(os.path.join(folder, f), label) for f in files]
        self.skipped = []
        if verify:
            self._verify(skip_bad)

    def _verify(self, skip_bad):
        Image = pil()
        good = []
        for path, label in self.samples:
            try:
                with Image.open(path) as im:
                    im.verify()
                good.append((path, label))
            except Exception as e:
                if not skip_bad:
                    raise DataError(f"unreadable image {path}: {e}") from None
                self.skipped.append(path)
        for label, c in enumerate(self.classes):
            if not any(lab == label for _, lab in good):
                raise DataError(f"class {c!r} has no readable images in {os.path.join(self.root, c)}")
        self.samples = good

    @property
    def labels(self):
        return np.array([lab for _, lab in self.samples], np.int64)

    def __len__(self):
        return len(self.samples)

    def __repr__(self):
        return f"ImageFolder({self.root!r}, classes={len(self.classes)}, images={len(self)})"


# -------------------------------------------------------------------------- loading

class ImageLoader(OrderedBatches):
    """Batches (x, y) of an ImageFolder, decoded on worker threads with a bounded prefetch.

    size: output height = width; train: the random transform (else eval);
    shuffle (default: train) and drop_last (default: train) as lowmem.data.batches.BatchIterator
    (the order, position and state: OrderedBatches); dtype: "float32"/"float64" normalised
    with (mean, std), or "uint8" raw pixels (mean, std unused); channels: 3 (RGB) or 1.
    Iterating yields x (N, C, size, size) and y int64 (N,), fresh arrays."""

    def __init__(self, folder, batch_size, size, train=True, mean=None, std=None, shuffle=None,
                 drop_last=None, seed=0, workers=4, prefetch=None, dtype="float32", channels=3,
                 resize=None, skip_bad=False):
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise DataError(f"ImageLoader: batch_size must be a positive integer, got {batch_size!r}")
        if not isinstance(size, (int, np.integer)) or size < 1:
            raise DataError(f"ImageLoader: size must be a positive integer, got {size!r}")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise DataError(f"ImageLoader: seed must be a non-negative integer, got {seed!r}")
        if not isinstance(workers, (int, np.integer)) or workers < 1:
            raise DataError(f"ImageLoader: workers must be a positive integer, got {workers!r}")
        if channels not in (1, 3):
            raise DataError(f"ImageLoader: channels must be 1 or 3, got {channels!r}")
        if str(dtype) not in ("float32", "float64", "uint8"):
            raise DataError(f"ImageLoader: dtype must be float32, float64 or uint8, got {dtype!r}")
        self.dtype = np.dtype(dtype)
        if self.dtype != np.uint8:
            if mean is None or std is None:
                raise DataError("ImageLoader: a float dtype needs mean and std (per channel, pixel / 255); "
                                "compute them with channel_stats(folder, size)")
            mean, std = np.asarray(mean, np.float32).reshape(-1), np.asarray(std, np.float32).reshape(-1)
            if mean.shape != (channels,) or std.shape != (channels,) or not (std > 0).all():
                raise DataError(f"ImageLoader: mean and std need {channels} values (std > 0), "
                                f"got {mean.tolist()}, {std.tolist()}")
        pil()
        self.folder, self.batch_size, self.size, self.train = folder, int(batch_size), int(size), bool(train)
        self.shuffle = self.train if shuffle is None else bool(shuffle)
        self.drop_last = self.train if drop_last is None else bool(drop_last)
        self.position = EpochOrder(len(folder), self.batch_size, self.shuffle, seed, self.drop_last,
                                   "ImageLoader", "loader", DataError)
        self.seed, self.workers = int(seed), int(workers)
        self.prefetch = 2 * self.workers if prefetch is None else max(1, int(prefetch))
        self.mean, self.std, self.channels = mean, std, channels
        self.mode = "RGB" if channels == 3 else "L"
        self.resize = eval_resize(self.size) if resize is None else int(resize)
        self.skip_bad = bool(skip_bad)
        self.skipped = []
        self._lock = threading.Lock()
        if len(self) == 0:
            raise DataError(f"ImageLoader: {len(folder)} images in {folder.root} give no batch of "
                            f"{batch_size}" + (" with drop_last=True" if self.drop_last else ""))

    @property
    def input_shape(self):
        return (self.channels, self.size, self.size)

    def state_settings(self):
        """What a saved position must match besides the order's settings (OrderedBatches)."""
        return {"size": self.size, "train": self.train}

    def _sample(self, out, index, epoch, position):
        """Decode sample `index` (at `position` of the epoch's order) into out (C, H, W) uint8."""
        n = len(self.folder)
        for k in range(n):
            path = self.folder.samples[(index + k) % n][0]
            rng = np.random.default_rng([self.seed, int(epoch), int(position), 1])   # per-sample stream
            try:
                decode(out, path, self.size, self.train, rng, self.mode, self.resize)
                return self.folder.samples[(index + k) % n][1]
            except Exception as e:
                if not self.skip_bad:
                    raise DataError(f"unreadable image {path}: {e} (lowmem train --skip-bad, or "
                                    f"skip_bad=True, replaces it with the next readable image and "
                                    f"counts it)") from None
                with self._lock:
                    if path not in self.skipped:
                        self.skipped.append(path)
        raise DataError(f"no readable image in {self.folder.root}")

    def _chunk(self, x, y, indices, epoch, start):
        for j, index in enumerate(indices):
            y[j] = self._sample(x[j], int(index), epoch, start + j)

    def _submit(self, pool, order, epoch, i):
        """Start decoding batch i of the epoch: (x uint8, y, [futures])."""
        b, n = self.batch_size, len(self.folder)
        s, e = i * b, min((i + 1) * b, n)
        x = np.empty((e - s,) + self.input_shape, np.uint8)
        y = np.empty(e - s, np.int64)
        indices = order[s:e]                   # this batch's samples; a chunk never reads past them
        step = -(-(e - s) // self.workers)
        futures = [pool.submit(self._chunk, x[k:k + step], y[k:k + step], indices[k:k + step], epoch, s + k)
                   for k in range(0, e - s, step)]
        return x, y, futures

    def _finish(self, x):
        if self.dtype == np.uint8:
            return x
        return normalize(np.empty(x.shape, self.dtype), x, self.mean, self.std)

    def __iter__(self):
        epoch, order = self.epoch, self.order(self.epoch)
        pending = deque()
        with ThreadPoolExecutor(self.workers, thread_name_prefix="lowmem-images") as pool:
            try:
                nxt = self.batch
                while self.batch < len(self):
                    while nxt < len(self) and len(pending) < self.prefetch:
                        pending.append(self._submit(pool, order, epoch, nxt))
                        nxt += 1
                    x, y, futures = pending.popleft()
                    for f in futures:
                        f.result()                       # re-raises a worker's DataError here
                    self.batch += 1                      # a checkpoint after this step resumes at the next
                    yield self._finish(x), y
            finally:
                for _, _, futures in pending:            # stopping early: drop what was queued
                    for f in futures:
                        f.cancel()
        self.epoch, self.batch = epoch + 1, 0


# ----------------------------------------------------------------------- statistics

def _stats_batch(size, channels):
    return max(1, min(64, STATS_BATCH_BYTES // (channels * size * size)))


def stats_memory_bytes(size, channels=3, workers=4):
    """The most channel_stats holds at once (Python-allocated), whatever the number of images:
    STATS_PREFETCH + 1 batches of decoded uint8 pixels (about STATS_BATCH_BYTES each, at least
    one image), the decoded image each worker thread is converting (Pillow's tobytes joins its
    chunks: two copies), and one histogram chunk's int64 copy."""
    image = channels * size * size
    return ((STATS_PREFETCH + 1) * _stats_batch(size, channels) * image + 2 * workers * image
            + 8 * HIST_CHUNK)


def channel_stats(folder, size, limit=STATS_IMAGES, channels=3, workers=4, seed=0, skip_bad=False):
    """Per-channel mean and std (pixel / 255, float32 (C,)) of up to `limit` images of `folder`
    (a seeded random subset when there are more), after the eval transform; exact from 256-bin
    histograms. A constant channel gets std 1. Streamed: holds at most
    stats_memory_bytes(size, channels, workers)."""
    loader = ImageLoader(folder, batch_size=min(_stats_batch(size, channels), len(folder)), size=size,
                         train=False, shuffle=True, drop_last=False, seed=seed, workers=workers,
                         prefetch=STATS_PREFETCH, dtype="uint8", channels=channels, skip_bad=skip_bad)
    counts, seen = np.zeros((channels, 256), np.int64), 0
    for x, _ in loader:
        x = x[:max(0, limit - seen)]
        for image in x:
            for c in range(channels):
                plane = image[c].reshape(-1)                  # contiguous: a view
                for a in range(0, plane.size, HIST_CHUNK):
                    counts[c] += np.bincount(plane[a:a + HIST_CHUNK], minlength=256)
        seen += len(x)
        if seen >= limit:
            break
    values = np.arange(256) / 255.0
    p = counts / counts.sum(axis=1, keepdims=True)
    mean = p @ values
    std = np.sqrt(np.maximum((p * (values[None] - mean[:, None]) ** 2).sum(axis=1), 0))
    std[std == 0] = 1
    return mean.astype(np.float32), std.astype(np.float32)


@dataclass
class ImageFolders:
    """Both splits of DIR, their shared classes and the normalisation of the training split."""
    root: str
    train: ImageFolder
    val: ImageFolder
    size: int
    mean: np.ndarray
    std: np.ndarray
    channels: int = 3

    @property
    def classes(self):
        return self.train.classes

    @property
    def num_classes(self):
        return len(self.train.classes)

    @property
    def input_shape(self):
        return (self.channels, self.size, self.size)

    def loader(self, split, batch_size, **kw):
        """An ImageLoader of "train" (random transform, shuffled, drop_last) or "val" (eval, in order)."""
        if split not in SPLITS:
            raise DataError(f"split must be one of {SPLITS}, got {split!r}")
        kw.setdefault("train", split == "train")
        return ImageLoader(getattr(self, split), batch_size, self.size, mean=self.mean, std=self.std,
                           channels=self.channels, **kw)

    def __repr__(self):
        return (f"ImageFolders({self.root!r}, train={len(self.train)}, val={len(self.val)}, "
                f"classes={self.num_classes}, input_shape={self.input_shape})")


def limit_samples(folder, n, seed=0):
    """Keep a seeded random subset of n samples of `folder` (in path order; all of them when n is None
    or not smaller). The files are sorted by class, so the first n would be the first classes only."""
    if n is None or n >= len(folder):
        return folder
    keep = np.sort(np.random.default_rng([int(seed), 2]).permutation(len(folder))[:n])
    folder.samples = [folder.samples[i] for i in keep]
    return folder


def check_decodable(folder, workers=4, size=8):
    """Decode every file of `folder` once, small (JPEGs at a reduced scale): a DataError naming the
    first file that fails, now rather than when the split is first used. Cost: one pass of reads
    and (reduced) decodes over the split, on `workers` threads; nothing is kept."""
    pil()

    def one(path):
        try:
            decode(np.empty((3, size, size), np.uint8), path, size, False, None, "RGB", size)
        except Exception as e:
            return f"unreadable image {path}: {e}"

    with ThreadPoolExecutor(max(1, int(workers)), thread_name_prefix="lowmem-check") as pool:
        for problem in pool.map(one, [p for p, _ in folder.samples]):
            if problem:
                raise DataError(problem)


def load_image_folders(data_dir, size, mean=None, std=None, channels=3, verify=False, skip_bad=False,
                       stats_images=STATS_IMAGES, workers=4, limit_train=None, limit_test=None, seed=0):
    """Scan DIR/train and DIR/val (same classes), and compute mean/std when not given -> ImageFolders.
    limit_train / limit_test: a seeded random subset of each split (`limit_samples`), taken
    before the statistics."""
    root = os.fspath(data_dir)
    if not os.path.isdir(root):
        raise DataError(f"--data {root}: no such directory (expected {root}/train/<class>/*.jpg and "
                        f"{root}/val/<class>/*)")
    for split in SPLITS:
        if not os.path.isdir(os.path.join(root, split)):
            raise DataError(f"{root} has no {split}/ folder (expected {root}/train/<class>/* and "
                            f"{root}/val/<class>/*, the torchvision ImageFolder layout)")
    train = ImageFolder(os.path.join(root, "train"), verify=verify, skip_bad=skip_bad)
    val = ImageFolder(os.path.join(root, "val"), classes=train.classes, verify=verify, skip_bad=skip_bad)
    limit_samples(train, limit_train, seed)
    limit_samples(val, limit_test, seed)
    if (mean is None) != (std is None):
        raise DataError("give both mean and std, or neither (then they are computed)")
    if mean is None:
        mean, std = channel_stats(train, size, stats_images, channels, workers, skip_bad=skip_bad)
    return ImageFolders(root, train, val, int(size), np.asarray(mean, np.float32), np.asarray(std, np.float32),
                        channels)
