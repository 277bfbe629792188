"""lowmem/formats/weights.py: safetensors files.

* The file loads with safetensors.numpy (every name, bit-exact float32), into the PyTorch reference
  model with strict key checking and the same eval logits, and back into a fresh Network
  (load_safetensors); bad files and mismatched networks get clear errors naming the file.
* Writes are atomic: a failed write keeps the old file and leaves no temporary.
"""
import os

import numpy as np
import pytest

from lowmem import models
from lowmem.core.engine import Engine
from lowmem.formats import weights
from lowmem.formats.common import ExportError
from reference import randomize_units

NETS = {
    "resnet20": (lambda: models.preact_resnet_cifar(20, num_classes=10), (3, 32, 32)),
    "bottleneck29": (lambda: models.preact_resnet_cifar(29, num_classes=10, block="bottleneck"), (3, 16, 16)),
    "imagenet18": (lambda: models.preact_resnet_imagenet(18, num_classes=7), (3, 64, 64)),
    "wrn-10-2": (lambda: models.wide_resnet(10, 2, num_classes=10), (3, 16, 16)),
    "vgg11-bn": (lambda: models.vgg_bn(11, num_classes=10), (3, 32, 32)),
}


def trained_looking(build, seed=0):
    """A network with non-trivial BN parameters and running statistics (as after training)."""
    net = build()
    randomize_units(net, np.random.default_rng(seed))
    return net


def images(shape, n=4, seed=1):
    return np.random.default_rng(seed).standard_normal((n,) + shape).astype(np.float32)


# ---------------------------------------------------------------- safetensors

def test_safetensors_file_loads_with_safetensors_numpy(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    net = trained_looking(lambda: models.preact_resnet_cifar(20))
    path = weights.export_safetensors(net, tmp_path / "m.safetensors")
    got = st.load_file(str(path))
    state = net.state_dict()
    assert set(got) == set(state)
    for k, v in state.items():
        assert got[k].dtype == np.float32 and got[k].shape == v.shape
        np.testing.assert_array_equal(got[k], v)
    with open(path, "rb") as f:                          # metadata names the network
        assert b'"network":"preact-resnet20-cifar"' in f.read(4096)


def test_safetensors_round_trip_into_a_fresh_network(tmp_path):
    pytest.importorskip("safetensors")
    net = trained_looking(lambda: models.wide_resnet(10, 2))
    path = weights.export_safetensors(net, tmp_path / "m.safetensors")
    fresh = models.wide_resnet(10, 2, seed=5)
    assert not np.array_equal(fresh.params["conv1.weight"].data, net.params["conv1.weight"].data)
    weights.load_safetensors(fresh, path)
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(fresh.state_dict()[k], v)
    x = images((3, 16, 16))
    np.testing.assert_array_equal(Engine(fresh, 4, (3, 16, 16)).predict(x), Engine(net, 4, (3, 16, 16)).predict(x))


def test_safetensors_into_a_float64_network_and_engine_owned_parameters(tmp_path):
    """Loading casts to the network's dtype and writes into the engine's arrays in place."""
    pytest.importorskip("safetensors")
    net = trained_looking(lambda: models.preact_resnet_cifar(8))
    path = weights.export_safetensors(net, tmp_path / "m.safetensors")
    other = models.preact_resnet_cifar(8, seed=3)
    eng = Engine(other, 2, (3, 8, 8), dtype="float64")
    weights.load_safetensors(other, path)
    assert other.params["conv1.weight"].data is eng.arrays["conv1.weight"]
    np.testing.assert_array_equal(other.params["conv1.weight"].data, net.params["conv1.weight"].data)


def test_safetensors_loads_into_the_pytorch_reference_strictly(tmp_path):
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    import torch_reference as ref
    for build, make, shape in ((lambda: models.preact_resnet_cifar(20), lambda: ref.preact_resnet_cifar(20), (3, 32, 32)),
                               (lambda: models.preact_resnet_imagenet(18, num_classes=7),
                                lambda: ref.preact_resnet_imagenet(18, num_classes=7), (3, 64, 64))):
        net = trained_looking(build)
        path = weights.export_safetensors(net, tmp_path / "m.safetensors")
        model = make()
        result = model.load_state_dict(st_torch.load_file(str(path)), strict=True)
        assert not result.missing_keys and not result.unexpected_keys
        x = images(shape)
        with torch.no_grad():
            tl = model.eval()(torch.from_numpy(x)).numpy()
        ours = Engine(net, 4, shape).predict(x)
        assert float(np.abs(tl - ours).max()) <= 1e-4 * float(np.abs(ours).max())


def test_safetensors_errors_name_the_file_and_the_mismatch(tmp_path):
    pytest.importorskip("safetensors")
    net = models.preact_resnet_cifar(8)
    with pytest.raises(ExportError, match="no such file"):
        weights.load_safetensors(net, tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ExportError, match="bad.safetensors.*not a readable safetensors"):
        weights.load_safetensors(net, bad)
    other = tmp_path / "other.safetensors"
    weights.export_safetensors(models.preact_resnet_cifar(20), other)
    with pytest.raises(ExportError, match="other.safetensors.*missing|unexpected"):
        weights.load_safetensors(net, other)


# ------------------------------------------------------------------ atomicity

def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    path = tmp_path / "m.safetensors"
    weights.export_safetensors(models.preact_resnet_cifar(8), path)
    before = path.read_bytes()

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        weights.export_safetensors(models.preact_resnet_cifar(8, seed=1), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.safetensors"]
