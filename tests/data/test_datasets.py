"""Tests for lowmem.data.datasets and lowmem.data.cifar: loaders on tiny files written in the real formats,
preprocessing against per-sample references, batching order and resume."""
import gzip
import hashlib
import io
import pickle
import tarfile
import urllib.error
import urllib.request

import numpy as np
import pytest

from lowmem.data import datasets as data
from lowmem.data.batches import BatchIterator
from lowmem.data import cifar
from lowmem.data.cifar import load_cifar
from lowmem.data.datasets import channel_mean_std, load_dataset, load_fashion_mnist, read_idx, synthetic
from lowmem.data.files import DataError
from lowmem.data.transforms import augment, crop_flip, draw_crop_flip, normalize


# ----------------------------------------------------------------------------
# helpers writing the real formats

def _pickle_py2_style(obj):
    """Protocol 2, and NumPy arrays referenced as numpy.core.multiarray the way
    the original (Python 2, NumPy 1) CIFAR files are."""
    return pickle.dumps(obj, protocol=2).replace(b"numpy._core.multiarray", b"numpy.core.multiarray")


def _cifar_members(name, rng, n_per=(3, 4, 2, 5, 3), n_test=4):
    """{member: bytes} for a tiny release, and the expected arrays.
    Returns members, (x_train, y_train, x_test, y_test) with x as (N, 3072) rows."""
    k = 10 if name == "cifar10" else 100
    rows = lambda n: rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    labs = lambda n: [int(v) for v in rng.integers(0, k, n)]
    if name == "cifar10":
        train = [(rows(n), labs(n)) for n in n_per]
        members = {f"data_batch_{i + 1}": {b"batch_label": b"training batch", b"data": d, b"labels": l}
                   for i, (d, l) in enumerate(train)}
        test = (rows(n_test), labs(n_test))
        members["test_batch"] = {b"data": test[0], b"labels": test[1]}
        members["batches.meta"] = {b"label_names": [b"c%d" % i for i in range(10)]}
    else:
        n = sum(n_per)
        train = [(rows(n), labs(n))]
        test = (rows(n_test), labs(n_test))
        members = {split: {b"data": d, b"fine_labels": l, b"coarse_labels": [v // 5 for v in l]}
                   for split, (d, l) in (("train", train[0]), ("test", test))}
        members["meta"] = {b"fine_label_names": [b"f%d" % i for i in range(100)]}
    expected = (np.concatenate([d for d, _ in train]), np.concatenate([l for _, l in train]),
                test[0], np.array(test[1]))
    return {m: _pickle_py2_style(v) for m, v in members.items()}, expected


def _write_archive(path, folder, members):
    with tarfile.open(path, "w:gz") as tar:
        for m, blob in members.items():
            info = tarfile.TarInfo(f"{folder}/{m}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return path


def _make_cifar(directory, name="cifar10", seed=0, extracted=False, **kw):
    spec = cifar.CIFAR[name]
    members, expected = _cifar_members(name, np.random.default_rng(seed), **kw)
    directory.mkdir(parents=True, exist_ok=True)
    if extracted:
        (directory / spec.folder).mkdir()
        for m, blob in members.items():
            (directory / spec.folder / m).write_bytes(blob)
    else:
        _write_archive(directory / spec.archive, spec.folder, members)
    return expected


def _check_cifar(arrays, expected):
    x_train, y_train, x_test, y_test = arrays
    for x, rows in ((x_train, expected[0]), (x_test, expected[2])):
        assert x.dtype == np.uint8 and x.shape == (len(rows), 3, 32, 32)
        # channel order: R is the first 1024 values of a row, G the next, B the last
        for c in range(3):
            np.testing.assert_array_equal(x[:, c], rows[:, 1024 * c:1024 * (c + 1)].reshape(-1, 32, 32))
    for y, labels in ((y_train, expected[1]), (y_test, expected[3])):
        assert y.dtype == np.int64
        np.testing.assert_array_equal(y, labels)


@pytest.fixture
def no_env(monkeypatch, tmp_path):
    """No $LOWMEM_DATA, HOME in tmp, and any download attempt fails loudly."""
    monkeypatch.delenv("LOWMEM_DATA", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))

    def offline(*a, **k):
        raise urllib.error.URLError("no network in tests")
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    return tmp_path


# ----------------------------------------------------------------------------
# CIFAR

@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
@pytest.mark.parametrize("extracted", [False, True])
def test_cifar_roundtrip(no_env, name, extracted):
    expected = _make_cifar(no_env / "d", name, extracted=extracted)
    _check_cifar(load_cifar(name, data_dir=no_env / "d", download=False), expected)


def test_cifar_extracted_folder_given_directly(no_env):
    expected = _make_cifar(no_env / "d", extracted=True)
    _check_cifar(load_cifar("cifar10", data_dir=no_env / "d" / "cifar-10-batches-py"), expected)


def test_cifar_pixel_layout():
    """A pure red image lands in channel 0, green in 1, blue in 2."""
    spec = cifar.CIFAR["cifar10"]
    rows = np.zeros((3, 3072), np.uint8)
    for c in range(3):
        rows[c, 1024 * c:1024 * (c + 1)] = 255
    x, y = cifar._cifar_batch({b"data": rows, b"labels": [0, 1, 2]}, "mem", spec)
    for c in range(3):
        assert (x[c, c] == 255).all() and x[c].sum() == 255 * 1024


def test_python2_pickle_of_the_original_release():
    """The real files were written by Python 2: byte strings everywhere, the
    array's raw data and dtype state included, and numpy.core.multiarray."""
    raw = bytes(range(6))
    blob = (b"\x80\x02}q\x00(U\x04dataq\x01"
            b"cnumpy.core.multiarray\n_reconstruct\nq\x02cnumpy\nndarray\nq\x03K\x00\x85U\x01b\x87R"
            b"(K\x01K\x02K\x03\x86cnumpy\ndtype\nq\x04U\x02u1K\x00K\x01\x87R"
            b"(K\x03U\x01|NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"
            b"\x89U\x06" + raw + b"tb"
            b"U\x06labels]q\x05(K\x01K\x02eu.")
    batch = cifar._unpickle(io.BytesIO(blob))
    assert batch[b"labels"] == [1, 2] and batch[b"data"].dtype == np.uint8
    np.testing.assert_array_equal(batch[b"data"], np.arange(6).reshape(2, 3))


def test_cifar100_uses_fine_labels(no_env):
    expected = _make_cifar(no_env / "d", "cifar100")
    _, y, _, _ = load_cifar("cifar100", data_dir=no_env / "d")
    assert y.max() > 19                      # coarse labels stop at 19
    np.testing.assert_array_equal(y, expected[1])


def test_lookup_order(no_env, monkeypatch):
    env_dir, home_dir, explicit = no_env / "env", no_env / "home" / ".cache" / "lowmem", no_env / "x"
    from_env = _make_cifar(env_dir, seed=1)
    from_home = _make_cifar(home_dir, seed=2, extracted=True)
    from_arg = _make_cifar(explicit, seed=3)
    monkeypatch.setenv("LOWMEM_DATA", str(env_dir))
    _check_cifar(load_cifar("cifar10"), from_env)
    _check_cifar(load_cifar("cifar10", data_dir=explicit), from_arg)
    monkeypatch.delenv("LOWMEM_DATA")
    _check_cifar(load_cifar("cifar10"), from_home)


def test_extracted_folder_preferred_over_archive(no_env):
    from_dir = _make_cifar(no_env / "d", seed=1, extracted=True)
    _make_cifar(no_env / "d", seed=2)
    _check_cifar(load_cifar("cifar10", data_dir=no_env / "d"), from_dir)


def test_offline_error_is_helpful(no_env, monkeypatch):
    monkeypatch.setenv("LOWMEM_DATA", str(no_env / "env"))
    with pytest.raises(DataError) as e:
        load_cifar("cifar10")
    msg = str(e.value)
    for part in ("cifar-10-python.tar.gz", str(no_env / "env"), str(no_env / "home" / ".cache" / "lowmem"),
                 "--data DIR", "LOWMEM_DATA", "--dataset fashion-mnist", "--dataset synthetic",
                 "no network in tests"):
        assert part in msg
    assert isinstance(e.value, ValueError)
    assert not list((no_env / "env").iterdir())          # no partial download left behind


def test_download_disabled_does_not_touch_network(no_env, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("network used")
    monkeypatch.setattr(urllib.request, "urlopen", boom)
    with pytest.raises(DataError, match="cifar-100-python.tar.gz.*\n.*data_dir"):
        load_cifar("cifar100", data_dir=no_env / "d", download=False)


class _FakeResponse(io.BytesIO):
    def __init__(self, payload):
        super().__init__(payload)
        self.headers = {"Content-Length": str(len(payload))}


def _serve(monkeypatch, payload):
    urls = []

    def fake_urlopen(url, timeout=None):
        urls.append(url)
        return _FakeResponse(payload)
    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    return urls


def test_download_md5_mismatch_leaves_nothing(no_env, monkeypatch):
    urls = _serve(monkeypatch, b"not the archive" * 1000)
    with pytest.raises(DataError, match="MD5"):
        load_cifar("cifar10", data_dir=no_env / "d")
    assert urls == ["https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"]
    assert list((no_env / "d").iterdir()) == []


def test_download_success(no_env, monkeypatch):
    expected = _make_cifar(no_env / "src")
    payload = (no_env / "src" / "cifar-10-python.tar.gz").read_bytes()
    spec = cifar.CIFAR["cifar10"]
    monkeypatch.setitem(cifar.CIFAR, "cifar10",
                        cifar.dataclasses.replace(spec, md5=hashlib.md5(payload).hexdigest()))
    _serve(monkeypatch, payload)
    _check_cifar(load_cifar("cifar10"), expected)      # lands in ~/.cache/lowmem
    cache = no_env / "home" / ".cache" / "lowmem"
    assert [p.name for p in cache.iterdir()] == ["cifar-10-python.tar.gz"]


def _corrupt(kind, d):
    """Write a broken CIFAR-10 release of some kind into d; returns the file to be named."""
    spec = cifar.CIFAR["cifar10"]
    members, _ = _cifar_members("cifar10", np.random.default_rng(0))
    archive = d / spec.archive
    d.mkdir()
    if kind == "truncated":
        _write_archive(archive, spec.folder, members)
        archive.write_bytes(archive.read_bytes()[:len(archive.read_bytes()) // 2])
    elif kind == "not-gzip":
        archive.write_bytes(b"hello" * 100)
    elif kind == "missing-member":
        del members["data_batch_3"]
        _write_archive(archive, spec.folder, members)
    elif kind == "bad-pickle":
        members["test_batch"] = members["test_batch"][:50]
        _write_archive(archive, spec.folder, members)
    elif kind == "code-in-pickle":
        members["test_batch"] = b"cos\nsystem\n(S'true'\ntR."     # os.system("true")
        _write_archive(archive, spec.folder, members)
    else:
        bad = {"shape": {b"data": np.zeros((2, 3000), np.uint8), b"labels": [0, 1]},
               "dtype": {b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]},
               "count": {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1, 2]},
               "range": {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]},
               "keys": {b"pixels": np.zeros((2, 3072), np.uint8)},
               "not-dict": [1, 2]}[kind]
        members["data_batch_2"] = _pickle_py2_style(bad)
        _write_archive(archive, spec.folder, members)
    return archive


@pytest.mark.parametrize("kind, words", [
    ("truncated", "malformed or truncated"), ("not-gzip", "malformed or truncated"),
    ("missing-member", "no member cifar-10-batches-py/data_batch_3"),
    ("bad-pickle", "malformed or truncated"), ("code-in-pickle", "refusing to load global os.system"),
    ("shape", "data_batch_2: b'data' must be a uint8 array"), ("dtype", "got float32"),
    ("count", "2 images but labels"), ("range", "outside 0..9"), ("keys", "expected a dict"),
    ("not-dict", "expected a dict")])
def test_malformed_cifar(no_env, kind, words):
    archive = _corrupt(kind, no_env / "d")
    with pytest.raises(DataError) as e:
        load_cifar("cifar10", data_dir=no_env / "d", download=False)
    assert str(archive) in str(e.value) and words in str(e.value)


def test_incomplete_extraction(no_env):
    _make_cifar(no_env / "d", extracted=True)
    (no_env / "d" / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(DataError, match="missing test_batch"):
        load_cifar("cifar10", data_dir=no_env / "d", download=False)


# ----------------------------------------------------------------------------
# IDX / Fashion-MNIST

def _idx_bytes(a, magic_byte=None):
    magic = bytes([0, 0, 8, a.ndim]) if magic_byte is None else magic_byte
    return magic + b"".join(int(d).to_bytes(4, "big") for d in a.shape) + a.tobytes()


def _make_fashion(d, gz, n_train=5, n_test=3, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {"train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
              "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
              "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
              "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8)}
    d.mkdir(parents=True, exist_ok=True)
    for stem, a in arrays.items():
        if gz:
            with gzip.open(d / (stem + ".gz"), "wb") as f:
                f.write(_idx_bytes(a))
        else:
            (d / stem).write_bytes(_idx_bytes(a))
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_idx_roundtrip(tmp_path, gz):
    arrays = _make_fashion(tmp_path, gz)
    for stem, a in arrays.items():
        got = read_idx(tmp_path / (stem + (".gz" if gz else "")))
        assert got.dtype == np.uint8
        np.testing.assert_array_equal(got, a)


@pytest.mark.parametrize("gz", [False, True])
def test_fashion_mnist_padding(tmp_path, gz, monkeypatch):
    monkeypatch.delenv("LOWMEM_DATA", raising=False)
    arrays = _make_fashion(tmp_path / "fashion-mnist", gz)     # subfolder is searched too
    x, y, xt, yt = load_fashion_mnist(data_dir=tmp_path, pad_to=32)
    assert x.shape == (5, 1, 32, 32) and xt.shape == (3, 1, 32, 32) and x.dtype == np.uint8
    np.testing.assert_array_equal(x[:, 0, 2:30, 2:30], arrays["train-images-idx3-ubyte"])
    border = np.ones((32, 32), bool)
    border[2:30, 2:30] = False
    assert (x[:, 0][:, border] == 0).all()
    assert y.dtype == np.int64
    np.testing.assert_array_equal(yt, arrays["t10k-labels-idx1-ubyte"])
    x28 = load_fashion_mnist(data_dir=tmp_path, pad_to=None)[0]
    np.testing.assert_array_equal(x28[:, 0], arrays["train-images-idx3-ubyte"])


def test_fashion_mnist_env_lookup(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "FASHION_MNIST_DEBIAN_DIR", tmp_path / "absent")
    monkeypatch.setenv("LOWMEM_DATA", str(tmp_path / "env"))
    arrays = _make_fashion(tmp_path / "env", gz=True)
    y = load_fashion_mnist()[1]
    np.testing.assert_array_equal(y, arrays["train-labels-idx1-ubyte"])


def test_fashion_mnist_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "FASHION_MNIST_DEBIAN_DIR", tmp_path / "absent")
    monkeypatch.setenv("LOWMEM_DATA", str(tmp_path / "env"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(DataError) as e:
        load_fashion_mnist()
    for part in ("train-images-idx3-ubyte", str(tmp_path / "absent"), str(tmp_path / "env"),
                 "apt-get install dataset-fashion-mnist", "LOWMEM_DATA", "--dataset synthetic"):
        assert part in str(e.value)


@pytest.mark.parametrize("mutate, words", [
    (lambda b: b"\x00\x00\x09\x03" + b[4:], "bad IDX magic 0x00000903"),
    (lambda b: b"\x00\x00\x08\x01" + b[4:], "bad IDX magic 0x00000801, expected 0x00000803"),
    (lambda b: b[:-1], "truncated"),
    (lambda b: b[:10], "truncated"),
    (lambda b: b[:2], "no header"),
    (lambda b: b + b"\x00", "trailing bytes")])
@pytest.mark.parametrize("gz", [False, True])
def test_idx_malformed(tmp_path, mutate, words, gz):
    blob = mutate(_idx_bytes(np.zeros((2, 28, 28), np.uint8)))
    path = tmp_path / ("f.gz" if gz else "f")
    path.write_bytes(gzip.compress(blob) if gz else blob)
    with pytest.raises(DataError, match=words) as e:
        read_idx(path, data.IDX_IMAGES_MAGIC)
    assert str(path) in str(e.value)


def test_idx_truncated_gzip_stream(tmp_path):
    path = tmp_path / "f.gz"
    path.write_bytes(gzip.compress(_idx_bytes(np.zeros((50, 28, 28), np.uint8)))[:-20])
    with pytest.raises(DataError, match="cannot read"):
        read_idx(path)


def test_fashion_label_out_of_range(tmp_path):
    _make_fashion(tmp_path, gz=False)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(_idx_bytes(np.array([1, 12, 3], np.uint8)))
    with pytest.raises(DataError, match="label 12 outside 0..9"):
        load_fashion_mnist(data_dir=tmp_path)


def test_fashion_count_mismatch(tmp_path):
    _make_fashion(tmp_path, gz=False)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(_idx_bytes(np.array([1, 2], np.uint8)))
    with pytest.raises(DataError, match="2 labels for 3 images"):
        load_fashion_mnist(data_dir=tmp_path)


@pytest.mark.skipif(not all((data.FASHION_MNIST_DEBIAN_DIR / f"{s}.gz").is_file()
                            for s in data._FASHION_FILES),
                    reason="Debian package dataset-fashion-mnist not installed")
def test_debian_fashion_mnist(monkeypatch):
    monkeypatch.delenv("LOWMEM_DATA", raising=False)
    ds = load_dataset("fashion-mnist")
    assert ds.x_train.shape == (60000, 1, 32, 32) and ds.x_test.shape == (10000, 1, 32, 32)
    assert ds.y_train.min() == 0 and ds.y_train.max() == 9
    assert np.bincount(ds.y_test).tolist() == [1000] * 10
    assert 0.2 < ds.mean[0] < 0.35 and 0.3 < ds.std[0] < 0.4       # padded images, [0, 1] units


# ----------------------------------------------------------------------------
# synthetic and load_dataset

def test_synthetic_shapes_and_determinism():
    a = synthetic(40, 20, num_classes=4, shape=(2, 8, 8), seed=3)
    b = synthetic(40, 20, num_classes=4, shape=(2, 8, 8), seed=3)
    c = synthetic(40, 20, num_classes=4, shape=(2, 8, 8), seed=4)
    assert [t.shape for t in a] == [(40, 2, 8, 8), (40,), (20, 2, 8, 8), (20,)]
    assert a[0].dtype == np.uint8 and a[1].dtype == np.int64
    assert np.bincount(a[1]).tolist() == [10] * 4
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
    assert not np.array_equal(a[0], c[0])


def test_synthetic_is_learnable():
    """Softmax regression on the pixels: loss falls well below log(10) in 30 steps."""
    x, y, xt, yt = synthetic(500, 200, seed=0)
    ds_mean, ds_std = channel_mean_std(x)

    def features(a):
        return normalize(np.empty(a.shape, np.float32), a, ds_mean, ds_std).reshape(len(a), -1)
    f, ft = features(x), features(xt)
    w = np.zeros((f.shape[1], 10), np.float32)
    for _ in range(30):
        z = f @ w
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(len(y)), y] -= 1
        w -= 0.1 * f.T @ p / len(y) / 30
    zt = ft @ w
    zt -= zt.max(1, keepdims=True)
    loss = -(zt[np.arange(len(yt)), yt] - np.log(np.exp(zt).sum(1))).mean()
    assert loss < 0.5 * np.log(10)


@pytest.mark.parametrize("name", ["cifar10", "cifar100", "fashion-mnist", "synthetic"])
def test_load_dataset(no_env, name):
    if name.startswith("cifar"):
        _make_cifar(no_env / "d", name)
    elif name == "fashion-mnist":
        _make_fashion(no_env / "d", gz=True, n_train=8)
    ds = load_dataset(name, data_dir=no_env / "d", limit_train=6, limit_test=2)
    assert ds.name == name and len(ds.x_train) == len(ds.y_train) == 6 and len(ds.x_test) == 2
    assert ds.num_classes == (100 if name == "cifar100" else 10)
    assert ds.input_shape == ((1, 32, 32) if name == "fashion-mnist" else (3, 32, 32))
    ref = ds.x_train.astype(np.float64) / 255
    assert ds.mean.dtype == ds.std.dtype == np.float32
    np.testing.assert_allclose(ds.mean, ref.mean(axis=(0, 2, 3)), rtol=1e-6)
    np.testing.assert_allclose(ds.std, ref.std(axis=(0, 2, 3)), rtol=1e-5)
    assert name in repr(ds)


def test_load_dataset_limits_take_the_first(no_env):
    expected = _make_cifar(no_env / "d")
    ds = load_dataset("cifar10", data_dir=no_env / "d", limit_train=5, limit_test=100)
    np.testing.assert_array_equal(ds.y_train, expected[1][:5])
    assert len(ds.y_test) == len(expected[3])
    with pytest.raises(DataError, match="positive"):
        load_dataset("synthetic", limit_train=0)


def test_load_dataset_unknown():
    with pytest.raises(DataError, match="cifar10, cifar100, fashion-mnist, synthetic"):
        load_dataset("imagenet")


def test_channel_stats_constant_channel():
    mean, std = channel_mean_std(np.full((2, 1, 3, 3), 51, np.uint8))
    assert mean[0] == np.float32(0.2) and std[0] == 1


# ----------------------------------------------------------------------------
# preprocessing

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_normalize(dtype):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (4, 3, 5, 6), dtype=np.uint8)
    mean, std = np.array([0.49, 0.48, 0.45]), np.array([0.25, 0.24, 0.26])
    out = np.full(x.shape, np.nan, dtype)
    assert normalize(out, x, mean, std) is out
    ref = (x / 255.0 - mean[:, None, None]) / std[:, None, None]
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6 if dtype == np.float32 else 1e-12)
    normalize(out, x.astype(np.float32), mean, std)           # float pixels work too
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError):
        normalize(out[:2], x, mean, std)
    with pytest.raises(ValueError):
        normalize(out, x, mean[:2], std[:2])


def _crop_flip_reference(x, dy, dx, flipped, pad):
    padded = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    h, w = x.shape[2:]
    out = np.empty_like(x)
    for n in range(len(x)):
        win = padded[n, :, dy[n]:dy[n] + h, dx[n]:dx[n] + w]
        out[n] = win[:, :, ::-1] if flipped[n] else win
    return out


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_crop_flip_matches_windows_of_padded_image(dtype):
    rng = np.random.default_rng(1)
    x = rng.integers(1, 256, (16, 3, 7, 9)).astype(dtype)    # no zeros: padding is visible
    dy, dx, flipped = draw_crop_flip(len(x), rng, pad=4)
    assert dy.min() >= 0 and dy.max() <= 8 and flipped.any() and not flipped.all()
    out = crop_flip(np.empty_like(x), x, dy, dx, flipped, pad=4)
    np.testing.assert_array_equal(out, _crop_flip_reference(x, dy, dx, flipped, 4))


def test_augment_deterministic_and_shapes():
    x = np.random.default_rng(0).integers(0, 256, (32, 3, 32, 32), dtype=np.uint8)
    a = augment(np.empty_like(x), x, np.random.default_rng(7))
    b = augment(np.empty_like(x), x, np.random.default_rng(7))
    c = augment(np.empty_like(x), x, np.random.default_rng(8))
    assert a.shape == x.shape and a.dtype == np.uint8
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    # augment == crop_flip with the parameters drawn from the same generator state
    ref = crop_flip(np.empty_like(x), x, *draw_crop_flip(32, np.random.default_rng(7)), pad=4)
    np.testing.assert_array_equal(a, ref)
    f = augment(np.empty(x.shape, np.float32), x, np.random.default_rng(7))   # uint8 -> float out
    np.testing.assert_array_equal(f, a.astype(np.float32))


def test_flip_really_flips_and_in_place():
    x = np.arange(2 * 1 * 3 * 4, dtype=np.float32).reshape(2, 1, 3, 4)
    z = np.zeros(2, int)
    out = crop_flip(np.empty_like(x), x, z, z, np.array([True, False]), pad=0)
    np.testing.assert_array_equal(out[0], x[0, :, :, ::-1])
    np.testing.assert_array_equal(out[1], x[1])
    y = x.copy()
    crop_flip(y, y, z + 1, z, np.array([False, True]), pad=1)   # out is x: still correct
    np.testing.assert_array_equal(y, _crop_flip_reference(x, z + 1, z, [False, True], 1))
    same = augment(np.empty_like(x), x, np.random.default_rng(0), pad=0, flip=False)
    np.testing.assert_array_equal(same, x)


# ----------------------------------------------------------------------------
# batching

def _epoch(it):
    return [(xb.copy(), yb.copy()) for xb, yb in it]


def test_batch_iterator_drop_last_policy():
    x, y = np.arange(10)[:, None] * np.ones((1, 3), np.uint8), np.arange(10)
    train = BatchIterator(x, y, 4, shuffle=True, seed=0, drop_last=True)
    evaluate = BatchIterator(x, y, 4, shuffle=False, drop_last=False)
    assert len(train) == 2 and len(evaluate) == 3
    assert [len(yb) for _, yb in train] == [4, 4]
    batches = _epoch(evaluate)
    assert [len(yb) for _, yb in batches] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate([yb for _, yb in batches]), y)
    for xb, yb in batches:
        np.testing.assert_array_equal(xb[:, 0], yb)          # images stay with their labels
    with pytest.raises(DataError, match="no batch"):
        BatchIterator(x, y, 11, shuffle=True, drop_last=True)
    with pytest.raises(DataError, match="labels"):
        BatchIterator(x, y[:9], 4)


def test_batch_iterator_covers_each_sample_once_and_reshuffles():
    y = np.arange(103)
    it = BatchIterator(y.astype(np.uint8), y, 10, shuffle=True, seed=5, drop_last=True)
    seen, dropped = [], []
    for epoch in range(4):
        ys = np.concatenate([yb for _, yb in it])          # epochs advance by themselves
        assert len(ys) == 100 and len(np.unique(ys)) == 100
        seen.append(ys)
        dropped.append(set(y) - set(ys))
    assert it.epoch == 4
    assert not np.array_equal(seen[0], seen[1])
    assert len({frozenset(d) for d in dropped}) > 1          # a different remainder each epoch
    full = BatchIterator(y, y, 10, shuffle=True, seed=5, drop_last=False)
    np.testing.assert_array_equal(np.sort(np.concatenate([yb for _, yb in full])), y)


def test_batch_iterator_reproducible_across_instances():
    y = np.arange(50)
    a = BatchIterator(y, y, 8, shuffle=True, seed=1, drop_last=True)
    b = BatchIterator(y, y, 8, shuffle=True, seed=1, drop_last=True)
    c = BatchIterator(y, y, 8, shuffle=True, seed=2, drop_last=True)
    b.set_epoch(3)
    for _ in range(3):
        _epoch(a)                                  # a walks to epoch 3, b jumped there
    ya, yb, yc = ([v for _, v in _epoch(it)] for it in (a, b, c))
    np.testing.assert_array_equal(np.concatenate(ya), np.concatenate(yb))
    assert not np.array_equal(np.concatenate(ya), np.concatenate(yc))


def test_batch_iterator_exact_resume():
    y = np.arange(37)
    ref = BatchIterator(y, y, 5, shuffle=True, seed=9, drop_last=True)
    ref.set_epoch(2)
    expected = [v for _, v in _epoch(ref)]
    it = BatchIterator(y, y, 5, shuffle=True, seed=9, drop_last=True)
    it.set_epoch(2)
    got = []
    for _, v in it:
        got.append(v)
        if len(got) == 3:
            break                                  # "crash" after three steps
    state = it.state_dict()
    assert (state["epoch"], state["batch"]) == (2, 3)
    fresh = BatchIterator(y, y, 5, shuffle=True, seed=9, drop_last=True)
    fresh.load_state_dict(state)
    got += [v for _, v in fresh]
    for u, v in zip(got, expected, strict=True):
        np.testing.assert_array_equal(u, v)
    assert (fresh.epoch, fresh.batch) == (3, 0)
    other = BatchIterator(y, y, 5, shuffle=True, seed=10, drop_last=True)
    with pytest.raises(DataError, match="seed"):
        other.load_state_dict(state)


def test_fashion_mnist_limits_apply_before_padding(no_env, monkeypatch):
    """Only the images kept are padded: the limit is what decides the memory padding takes."""
    from lowmem.system import memory as sysmem
    arrays = _make_fashion(no_env / "d", gz=False, n_train=50, n_test=20)
    padded = []
    real_pad = data.pad_images
    monkeypatch.setattr(data, "pad_images", lambda x, size: padded.append(len(x)) or real_pad(x, size))
    # 3 images at 1000x1000 fit in 4 MB; all 50 (50 MB) would not
    monkeypatch.setattr(sysmem, "available_bytes", lambda xp=None: 4_000_000)
    ds = load_dataset("fashion-mnist", data_dir=no_env / "d", pad_to=1000, limit_train=3, limit_test=1)
    assert padded == [3, 1] and ds.x_train.shape == (3, 1, 1000, 1000)
    np.testing.assert_array_equal(ds.x_train[:, 0, 486:514, 486:514], arrays["train-images-idx3-ubyte"][:3])
    np.testing.assert_array_equal(ds.y_train, arrays["train-labels-idx1-ubyte"][:3])
    with pytest.raises(sysmem.NotEnoughMemory, match=r"padding 50 images to 1000x1000 needs 47.68 MiB .* "
                                                     r"only 3.81 MiB of host memory is available"):
        load_dataset("fashion-mnist", data_dir=no_env / "d", pad_to=1000, limit_test=1)
