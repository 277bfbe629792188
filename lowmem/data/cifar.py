"""CIFAR-10 and CIFAR-100 from the official python-pickle release: found, read, downloaded.

    x_train, y_train, x_test, y_test = load_cifar("cifar10", data_dir=None, download=True)

Read straight from the ``.tar.gz`` or from its extracted folder, in the directories of
lowmem/data/files.py; downloaded (MD5-checked, written atomically) into the first writable
one when allowed. Images uint8 (N, 3, 32, 32), labels int64 (N,). The front door for every
dataset is lowmem.data.datasets.load_dataset.
"""
import dataclasses
import hashlib
import os
import pickle
import tarfile
import urllib.request

import numpy as np
from tqdm import tqdm

from ..system.atomic import atomic_write
from .files import ALTERNATIVES, DataError, dir_list, search_dirs


@dataclasses.dataclass(frozen=True)
class _CifarSpec:
    title: str
    archive: str           # file name of the release
    folder: str            # top folder inside it
    train: tuple           # member names of the training batches
    test: tuple
    label_key: bytes
    num_classes: int
    url: str
    md5: str


CIFAR = {
    "cifar10": _CifarSpec(
        "CIFAR-10", "cifar-10-python.tar.gz", "cifar-10-batches-py",
        tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",), b"labels", 10,
        "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        "c58f30108f718f92721af3b95e74349a"),
    "cifar100": _CifarSpec(
        "CIFAR-100", "cifar-100-python.tar.gz", "cifar-100-python",
        ("train",), ("test",), b"fine_labels", 100,
        "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
        "eb9058c3a382ffc7106e4002c42a8d85"),
}


def _numpy_reconstruct():
    core = getattr(np, "_core", None) or np.core      # NumPy 2 / NumPy 1
    return core.multiarray._reconstruct


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles plain containers and NumPy arrays only: a data file cannot run code."""
    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module, name):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        if name == "_reconstruct":
            return _numpy_reconstruct()
        return super().find_class(module, name)


def _unpickle(f):
    return _ArrayUnpickler(f, encoding="bytes").load()


def _find_cifar(spec, dirs):
    """A complete extracted folder, else the archive, else an incomplete folder, else None."""
    members = spec.train + spec.test
    partial = None
    for d, _ in dirs:
        for folder in (d / spec.folder, d):          # d itself may be the extracted folder
            if all((folder / m).is_file() for m in members):
                return folder
            if folder.name == spec.folder and folder.is_dir() and partial is None:
                partial = folder
        if (d / spec.archive).is_file():
            return d / spec.archive
    return partial


def _read_cifar_members(source, spec):
    """{member name: unpickled dict} from an extracted folder or a .tar.gz archive."""
    members = spec.train + spec.test
    found = {}
    try:
        if source.is_dir():
            for m in members:
                if not (source / m).is_file():
                    raise DataError(f"{source}: missing {m} (incomplete extraction of {spec.archive}?)")
                with open(source / m, "rb") as f:
                    found[m] = _unpickle(f)
        else:
            # One sequential pass: seeking backwards in a gzip stream decompresses it again.
            wanted = {f"{spec.folder}/{m}": m for m in members}
            with tarfile.open(source, "r:gz") as tar:
                for info in tar:
                    m = wanted.get(info.name.removeprefix("./"))
                    if m is not None and info.isfile():
                        found[m] = _unpickle(tar.extractfile(info))
            missing = [f"{spec.folder}/{m}" for m in members if m not in found]
            if missing:
                raise DataError(f"{source}: archive has no member {', '.join(missing)}; "
                                f"is it the {spec.title} python release?")
    except DataError:
        raise
    except Exception as e:          # tar/gzip/pickle errors of every kind, truncation
        raise DataError(f"{source}: malformed or truncated {spec.title} data "
                        f"({type(e).__name__}: {e})") from e
    return found


def _cifar_batch(batch, where, spec):
    """Validate one unpickled batch -> x (N, 3, 32, 32) uint8, y (N,) int64."""
    if not isinstance(batch, dict) or b"data" not in batch or spec.label_key not in batch:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise DataError(f"{where}: expected a dict with keys b'data' and {spec.label_key!r}, got {keys}")
    data, labels = batch[b"data"], np.asarray(batch[spec.label_key])
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != 3 * 32 * 32:
        desc = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{where}: b'data' must be a uint8 array (N, 3072), got {desc}")
    if labels.ndim != 1 or labels.dtype.kind not in "iu" or len(labels) != len(data):
        raise DataError(f"{where}: {len(data)} images but labels {spec.label_key!r} are "
                        f"{labels.dtype} {labels.shape}; need {len(data)} integers")
    if len(labels) and (labels.min() < 0 or labels.max() >= spec.num_classes):
        raise DataError(f"{where}: labels span {labels.min()}..{labels.max()}, "
                        f"outside 0..{spec.num_classes - 1}")
    # A row is 1024 R, 1024 G, 1024 B, each 32x32 row-major: exactly C, H, W.
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def _download(url, dest, md5):
    """Fetch `url` into `dest` via a temporary file beside it, with a progress bar.

    The file appears under its final name only once complete and MD5-correct;
    on any failure the temporary file is deleted. Network failures surface as
    OSError (urllib.error.URLError is one), a bad checksum as DataError.
    """
    def fetch(r, f):
        digest = hashlib.md5()
        total = int(r.headers.get("Content-Length") or 0) or None
        with tqdm(total=total, unit="B", unit_scale=True, desc=dest.name, disable=None) as bar:
            for chunk in iter(lambda: r.read(1 << 20), b""):
                f.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
        if digest.hexdigest() != md5:
            raise DataError(f"download of {url} is corrupt (MD5 {digest.hexdigest()}, expected {md5}); "
                            f"nothing was kept. Try again, or fetch {dest.name} by hand into {dest.parent}")

    with urllib.request.urlopen(url, timeout=60) as r:     # a refused connection is not a disk error
        atomic_write(dest, lambda f: fetch(r, f), what="download")


def _first_writable(dirs):
    for d, _ in dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK):
            return d
    return None


def load_cifar(name="cifar10", data_dir=None, download=True):
    """CIFAR-10 or CIFAR-100 (fine labels) -> (x_train, y_train, x_test, y_test).

    x: uint8 (N, 3, 32, 32) (N = 50000 / 10000 for the real release), channels
    R, G, B; y: int64 (N,) in 0..9 or 0..99.

    Looks for the extracted folder (``cifar-10-batches-py/``,
    ``cifar-100-python/``) or the archive (``cifar-10-python.tar.gz``,
    ``cifar-100-python.tar.gz``) in the lookup directories (module docstring).
    If neither exists and `download` is true, fetches the archive from the
    official host into the first writable of those directories. Raises
    DataError when the data cannot be found, fetched or parsed.
    """
    if name not in CIFAR:
        raise DataError(f"unknown CIFAR variant {name!r}; expected one of {sorted(CIFAR)}")
    spec = CIFAR[name]
    dirs = search_dirs(data_dir)
    source = _find_cifar(spec, dirs)
    if source is None:
        source = _fetch_cifar(spec, dirs, download)
    batches = _read_cifar_members(source, spec)
    splits = []
    for members in (spec.train, spec.test):
        xs, ys = zip(*(_cifar_batch(batches[m], f"{source}: {m}", spec) for m in members))
        splits += [np.concatenate(xs), np.concatenate(ys)]
    return tuple(splits)


def _fetch_cifar(spec, dirs, download):
    """Download the archive, or raise DataError saying where to put it by hand."""
    where = (f"{spec.title} not found: looked for {spec.archive} (or its extracted folder "
             f"{spec.folder}/) in\n{dir_list(dirs)}\n")
    howto = (f"Put {spec.archive} (from {spec.url}) into one of these directories, "
             f"or point `--data DIR` or LOWMEM_DATA at the directory that holds it.\n{ALTERNATIVES}")
    if not download:
        raise DataError(where + "Downloading is disabled.\n" + howto)
    target = _first_writable(dirs)
    if target is None:
        raise DataError(where + "None of them is writable, so it cannot be downloaded.\n" + howto)
    try:
        _download(spec.url, target / spec.archive, spec.md5)
    except OSError as e:            # URLError, timeouts, refused connections, disk full
        raise DataError(where + f"Downloading {spec.url} failed ({e}); offline?\n" + howto) from e
    return target / spec.archive
