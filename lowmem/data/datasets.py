"""The data sets by name (`load_dataset`): CIFAR, Fashion-MNIST (IDX files) and synthetic
images, loaded on the host in NumPy.

Images are uint8 in PyTorch's NCHW layout, (N, C, H, W), until
lowmem.data.transforms.normalize turns a batch into floats; labels are int64, (N,).

What it does:

* loads CIFAR-10 / CIFAR-100 through lowmem/data/cifar.py (the official
  python-pickle release, from the ``.tar.gz`` or its extracted folder,
  downloaded MD5-checked when allowed);
* loads Fashion-MNIST from IDX files (plain or ``.gz``), by default from the
  Debian package ``dataset-fashion-mnist``, optionally zero-padded to 32x32 so
  CIFAR networks apply unchanged;
* makes a small learnable synthetic dataset for smoke runs;
* computes the per-channel mean and std the normalisation uses (`channel_mean_std`).

What it does not do: normalise or augment (lowmem/data/transforms.py), batch
(lowmem/data/batches.py: `BatchIterator`), read image folders (lowmem/data/images.py);
no threads or prefetching, no caching of decoded arrays, nothing on the GPU.
Every failure to find or read data is a `DataError` (a `ValueError`, from
lowmem/data/files.py) whose message names the file and the problem.

Directory lookup (first match wins; lowmem/data/files.py): an explicit ``data_dir``
replaces the default list; otherwise ``$LOWMEM_DATA`` then ``~/.cache/lowmem`` (for
Fashion-MNIST ``/usr/share/datasets/fashion-mnist`` comes first, and a
``fashion-mnist/`` subfolder of each directory is searched too).
"""
import dataclasses
import gzip
import struct
from pathlib import Path

import numpy as np

from ..system import memory as sysmem
from .cifar import CIFAR, load_cifar
from .files import DataError, dir_list, search_dirs

DATASETS = ("cifar10", "cifar100", "fashion-mnist", "synthetic")
CLASS_NAMES = {         # label order of the official releases (CIFAR-100: numbers; synthetic: numbers)
    "cifar10": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"],
    "fashion-mnist": ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                      "Bag", "Ankle boot"],
}
_ALIASES = {"cifar-10": "cifar10", "cifar-100": "cifar100",
            "fashion_mnist": "fashion-mnist", "fashionmnist": "fashion-mnist"}
FASHION_MNIST_DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")


# ----------------------------------------------------------------------------
# Fashion-MNIST (IDX files)

_FASHION_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                  "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
IDX_IMAGES_MAGIC = 0x00000803      # unsigned bytes, 3 dims
IDX_LABELS_MAGIC = 0x00000801      # unsigned bytes, 1 dim


def read_idx(path, magic=None):
    """Parse an IDX file of unsigned bytes (gzip-compressed if it ends in .gz).

    Returns a uint8 array whose shape is the file's dimensions, e.g.
    (N, 28, 28) for images (magic 0x00000803), (N,) for labels (0x00000801).
    Strict: a wrong magic, a header that does not match the length (truncated
    file or trailing bytes) or an unreadable gzip stream raise DataError.
    """
    path = Path(path)
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            buf = f.read()
    except Exception as e:          # OSError (BadGzipFile), EOFError (truncated gzip), zlib.error
        raise DataError(f"{path}: cannot read ({type(e).__name__}: {e})") from e
    if len(buf) < 4:
        raise DataError(f"{path}: truncated IDX file ({len(buf)} bytes, no header)")
    got = int.from_bytes(buf[:4], "big")
    if got >> 8 != 0x08 or (magic is not None and got != magic):
        want = f"0x{magic:08x}" if magic is not None else "0x000008NN (unsigned bytes)"
        raise DataError(f"{path}: bad IDX magic 0x{got:08x}, expected {want}")
    ndim = got & 0xFF
    head = 4 + 4 * ndim
    if len(buf) < head:
        raise DataError(f"{path}: truncated IDX header ({len(buf)} bytes, needs {head})")
    dims = struct.unpack(f">{ndim}I", buf[4:head])
    size = int(np.prod(dims, dtype=np.int64))
    if len(buf) - head != size:
        what = "truncated" if len(buf) - head < size else "trailing bytes"
        raise DataError(f"{path}: {what}: dims {dims} need {size} data bytes, file has {len(buf) - head}")
    return np.frombuffer(buf, np.uint8, offset=head).reshape(dims).copy()


def _fashion_dirs(data_dir):
    dirs = search_dirs(data_dir)
    if data_dir is None:
        dirs.insert(0, (FASHION_MNIST_DEBIAN_DIR, "Debian package dataset-fashion-mnist"))
    return [(p, why) for d, why in dirs for p in (d, d / "fashion-mnist")]


def _find_fashion(dirs):
    """{file stem: path} from the first directory holding all four files, or None."""
    for d, _ in dirs:
        paths = {}
        for stem in _FASHION_FILES:
            paths[stem] = next((d / n for n in (stem, stem + ".gz") if (d / n).is_file()), None)
        if all(paths.values()):
            return paths
    return None


def pad_images(x, size):
    """Zero-pad uint8 images (N, C, H, W) to (N, C, size, size), centred
    (an odd difference puts the extra row/column at the bottom/right)."""
    n, c, h, w = x.shape
    if size < h or size < w:
        raise DataError(f"pad_to={size} is smaller than the {h}x{w} images")
    sysmem.require(n * c * size * size * x.dtype.itemsize, f"padding {n:,} images to {size}x{size}")
    top, left = (size - h) // 2, (size - w) // 2
    out = np.zeros((n, c, size, size), x.dtype)
    out[:, :, top:top + h, left:left + w] = x
    return out


def load_fashion_mnist(data_dir=None, pad_to=32, limit_train=None, limit_test=None):
    """Fashion-MNIST -> (x_train, y_train, x_test, y_test).

    x: uint8 (N, 1, pad_to, pad_to), the 28x28 images zero-padded by
    (pad_to - 28) / 2 pixels on each side (pad_to=None keeps 28x28);
    y: int64 (N,) in 0..9; N = 60000 / 10000 for the real files, or the
    first limit_train / limit_test of them (taken before padding, so only
    those are padded).
    Reads the four IDX files (each plain or .gz) from the first directory
    that holds all of them (module docstring). DataError if none does.
    """
    dirs = _fashion_dirs(data_dir)
    paths = _find_fashion(dirs)
    if paths is None:
        raise DataError(
            f"Fashion-MNIST not found: looked for {', '.join(_FASHION_FILES)} "
            f"(each may end in .gz) in\n{dir_list(dirs)}\n"
            f"Install them with `apt-get install dataset-fashion-mnist` (to {FASHION_MNIST_DEBIAN_DIR}), "
            f"or put them into a directory and point `--data DIR` or LOWMEM_DATA at it.\n"
            f"Alternative that needs no files: `--dataset synthetic`.")
    out = []
    for split, limit in (("train", limit_train), ("t10k", limit_test)):
        x = read_idx(paths[f"{split}-images-idx3-ubyte"], IDX_IMAGES_MAGIC)
        y = read_idx(paths[f"{split}-labels-idx1-ubyte"], IDX_LABELS_MAGIC)
        if len(x) != len(y):
            raise DataError(f"{paths[f'{split}-labels-idx1-ubyte']}: {len(y)} labels "
                            f"for {len(x)} images in {paths[f'{split}-images-idx3-ubyte']}")
        if len(y) and y.max() > 9:
            raise DataError(f"{paths[f'{split}-labels-idx1-ubyte']}: label {y.max()} outside 0..9")
        x, y = _first(x, limit)[:, None], _first(y, limit)
        out += [pad_images(x, pad_to) if pad_to is not None else x, y.astype(np.int64)]
    return tuple(out)


# ----------------------------------------------------------------------------
# synthetic

def synthetic(n_train, n_test, num_classes=10, shape=(3, 32, 32), seed=0):
    """A learnable toy dataset -> (x_train, y_train, x_test, y_test).

    Each class is a fixed smooth template (a random mix of the 3x3 lowest
    2-D cosine modes per channel, so classes also differ in channel means);
    a sample is 128 + its class template (std 40) + white noise (std 25),
    rounded and clipped to uint8 (N, *shape). Classes are balanced
    (y: int64 (N,), shuffled). Deterministic given `seed`; train and test
    share the templates and draw independent noise.
    """
    c, h, w = shape
    rng = np.random.default_rng(seed)
    k = 3
    fy = np.cos(np.pi * np.arange(k)[:, None] * (np.arange(h) + 0.5) / h)      # (k, H)
    fx = np.cos(np.pi * np.arange(k)[:, None] * (np.arange(w) + 0.5) / w)      # (k, W)
    coef = rng.standard_normal((num_classes, c, k, k))
    templates = np.einsum("ncab,ah,bw->nchw", coef, fy, fx)                   # (K, C, H, W)
    templates = (templates * (40.0 / templates.std())).astype(np.float32)

    def draw(n):
        y = rng.permutation(np.arange(n) % num_classes)
        x = templates[y] + rng.standard_normal((n, c, h, w), dtype=np.float32) * 25 + 128
        return np.clip(np.rint(x), 0, 255).astype(np.uint8), y.astype(np.int64)

    return draw(n_train) + draw(n_test)


# ----------------------------------------------------------------------------
# the common entry point

@dataclasses.dataclass
class Dataset:
    """A loaded dataset; the arrays live on the host.

    x_train: uint8 (N, C, H, W); y_train: int64 (N,); x_test, y_test likewise;
    mean, std: float32 (C,), per-channel statistics of x_train / 255, what
    `normalize` expects.
    """
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    mean: np.ndarray
    std: np.ndarray
    classes: list = None        # class names in label order (None: the labels' numbers)

    @property
    def input_shape(self):
        """(C, H, W) of one image."""
        return tuple(self.x_train.shape[1:])

    def __repr__(self):
        return (f"Dataset({self.name!r}, train={len(self.x_train)}, test={len(self.x_test)}, "
                f"input_shape={self.input_shape}, num_classes={self.num_classes})")


def channel_mean_std(x):
    """Per-channel mean and std of uint8 images (N, C, H, W), in units of x / 255.

    Exact (from a 256-bin histogram per channel, no float copy of x);
    returns float32 (C,), (C,). A constant channel gets std 1 so that
    normalising by it stays finite.
    """
    if x.dtype != np.uint8 or x.ndim != 4:
        raise DataError(f"channel_mean_std wants uint8 (N, C, H, W), got {x.dtype} {x.shape}")
    values = np.arange(256, dtype=np.float64) / 255
    mean, std = np.empty(x.shape[1], np.float32), np.empty(x.shape[1], np.float32)
    for c in range(x.shape[1]):
        p = np.bincount(x[:, c].ravel(), minlength=256) / max(x[:, c].size, 1)
        m = p @ values
        mean[c], std[c] = m, np.sqrt(max(p @ (values - m) ** 2, 0.0))
    std[std == 0] = 1
    return mean, std


def _first(a, limit):
    if limit is None or limit >= len(a):
        return a
    return a[:limit].copy()         # a copy, so the full array can be freed


def load_dataset(name, data_dir=None, download=True, pad_to=32, limit_train=None,
                 limit_test=None, seed=0):
    """Load a dataset by name -> Dataset.

    name: "cifar10", "cifar100", "fashion-mnist" or "synthetic".
    data_dir: directory to search instead of the defaults (module docstring).
    download: CIFAR only; fetch the archive when it is not found.
    pad_to: Fashion-MNIST only; pad 28x28 to pad_to x pad_to (None: keep 28).
    limit_train / limit_test: keep only the first N samples of each split
        (the files' order; more than there are keeps all). For "synthetic"
        they are the split sizes (default 2048 / 512).
    seed: synthetic only (the other datasets are read, not drawn).
    mean / std are computed from the (limited) training split.
    """
    key = _ALIASES.get(name.lower(), name.lower())
    for lim in (limit_train, limit_test):
        if lim is not None and (not isinstance(lim, (int, np.integer)) or lim < 1):
            raise DataError(f"limits must be positive integers or None, got {lim!r}")
    if key in CIFAR:
        arrays = load_cifar(key, data_dir, download)
        num_classes = CIFAR[key].num_classes
    elif key == "fashion-mnist":
        arrays = load_fashion_mnist(data_dir, pad_to, limit_train, limit_test)   # limits before padding
        num_classes = 10
    elif key == "synthetic":
        arrays = synthetic(limit_train or 2048, limit_test or 512, seed=seed)
        num_classes = 10
    else:
        raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    x_train, y_train = _first(arrays[0], limit_train), _first(arrays[1], limit_train)
    x_test, y_test = _first(arrays[2], limit_test), _first(arrays[3], limit_test)
    mean, std = channel_mean_std(x_train)
    return Dataset(key, x_train, y_train, x_test, y_test, num_classes, mean, std, CLASS_NAMES.get(key))
