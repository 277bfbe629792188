"""lowmem.core.checks, called directly: each refusal is the documented exception with a message that
names the problem (the Engine runs these before it plans or touches its arrays)."""
import numpy as np
import pytest

from lowmem.core import checks
from lowmem.models import preact_resnet_cifar
from lowmem.core.network import Network

NET = preact_resnet_cifar(8)
UNITS = ["bn1", "layer1.0.bn2", "bn_final"]


def test_engine_args_returns_the_normalised_values():
    mode, bits, dt = checks.engine_args(NET, 4, "approx", 2, "f4")
    assert (mode, bits, dt) == ("approx", 2, np.dtype("float32"))
    assert checks.engine_args(NET, 4, "naive", {"*": 4, "bn1": "float"}, "float64")[1] == {"*": 4, "bn1": "float"}


@pytest.mark.parametrize("args,exc,words", [
    ((None, 4, "exact", 4, "float32"), TypeError, "Engine needs a lowmem Network"),
    ((NET, 4, "fast", 4, "float32"), ValueError, "unknown mode 'fast'"),
    ((NET, 4, "approx", 3, "float32"), ValueError, "bits must be one of"),
    ((NET, 4, "approx", 4, "float16"), ValueError, "unsupported dtype 'float16'"),
    ((NET, 4, "approx", 4, object), ValueError, "unsupported dtype"),
    ((NET, 0, "approx", 4, "float32"), ValueError, "batch_size must be a positive int, got 0"),
    ((NET, True, "approx", 4, "float32"), ValueError, "batch_size must be a positive int, got True"),
    ((NET, 2.0, "approx", 4, "float32"), ValueError, "batch_size must be a positive int"),
    ((NET, 4, "approx", {3: 4}, "float32"), ValueError, "keys are unit names or '\\*'"),
    ((NET, 4, "approx", {"bn1": 3}, "float32"), ValueError, "bits\\['bn1'\\] must be one of"),
    ((NET, 4, "exact", {"bn1": 4}, "float32"), ValueError, "mode 'exact' saves every x-hat in float"),
])
def test_engine_args_refuse_bad_values(args, exc, words):
    with pytest.raises(exc, match=words):
        checks.engine_args(*args)


def test_a_one_class_network_is_refused():
    net = Network("one", in_channels=3, num_classes=1)
    with pytest.raises(ValueError, match="num_classes=1: a classifier needs at least 2 classes"):
        checks.engine_args(net, 4, "exact", 4, "float32")


def test_unit_bits_per_unit_and_defaults():
    assert checks.unit_bits(4, "exact", UNITS) == dict.fromkeys(UNITS)
    assert checks.unit_bits(2, "approx", UNITS) == dict.fromkeys(UNITS, 2)
    got = checks.unit_bits({"*": 4, "bn1": "float", "bn_final": 8}, "approx", UNITS)
    assert got == {"bn1": None, "layer1.0.bn2": 4, "bn_final": 8}
    assert checks.width_labels("approx", got) == {"bn1": "float", "layer1.0.bn2": "4-bit", "bn_final": "8-bit"}
    assert checks.width_labels("exact", got) == dict.fromkeys(UNITS, "")
    assert checks.bits_label("approx", got) == "float x1, 4-bit x1, 8-bit x1"
    assert checks.bits_label("approx", dict.fromkeys(UNITS, 4)) == "4-bit"


def test_unit_bits_refuse_unknown_and_missing_units():
    with pytest.raises(ValueError, match="bits names 'bn9', not a BN-ReLU unit of this network"):
        checks.unit_bits({"*": 4, "bn9": 2}, "approx", UNITS)
    with pytest.raises(ValueError, match="bits gives no width for unit\\(s\\) 'layer1.0.bn2', 'bn_final'"):
        checks.unit_bits({"bn1": 4}, "approx", UNITS)


def test_batch_norm_refuses_one_value_per_channel():
    checks.batch_norm({"bn": (4, 1, 1)}, 2, "forward: batch of")
    with pytest.raises(ValueError, match="forward: batch of 1: batch norm bn would normalise one value"):
        checks.batch_norm({"bn": (4, 1, 1)}, 1, "forward: batch of")


def test_input_shape():
    assert checks.input_shape([3, np.int64(8), 8], 3) == (3, 8, 8)
    for bad in ((1, 8, 8), (3, 8), 5, None):
        with pytest.raises(ValueError, match="input_shape must be \\(C, H, W\\) with C = 3"):
            checks.input_shape(bad, 3)
    for bad in ((3, 0, 8), (3, 8.0, 8), (3, True, 8)):
        with pytest.raises(ValueError, match="input_shape must be \\(C, H, W\\) of positive ints"):
            checks.input_shape(bad, 3)


def test_batch_and_labels():
    x = np.zeros((2, 3, 4, 4), np.float32)
    checks.batch(x, np, np.dtype("float32"), (3, 4, 4), 4, "forward")
    checks.labels(np.array([0, 9]), np, 2, 10)
    bad_batches = [
        ([[0.0]], TypeError, "forward: expected a numpy array of shape \\(N, 3, 4, 4\\), got list"),
        (x.astype(np.float64), TypeError, "input dtype is float64, this engine expects float32"),
        (np.zeros((2, 3, 4, 5), np.float32), ValueError, "input shape is \\(2, 3, 4, 5\\)"),
        (np.zeros((5, 3, 4, 4), np.float32), ValueError, "batch of 5 is larger than the planned batch_size 4"),
        (np.zeros((0, 3, 4, 4), np.float32), ValueError, "empty batch"),
        (np.full((2, 3, 4, 4), np.nan, np.float32), ValueError, "contains NaN or Inf"),
    ]
    for bad, exc, words in bad_batches:
        with pytest.raises(exc, match=words):
            checks.batch(bad, np, np.dtype("float32"), (3, 4, 4), 4, "forward")
    bad_labels = [
        (np.array([0.0, 1.0]), TypeError, "labels must be an integer numpy array of shape \\(2,\\)"),
        ([0, 1], TypeError, "labels must be an integer"),
        (np.array([0, 1, 2]), ValueError, "labels shape is \\(3,\\), expected \\(2,\\)"),
        (np.array([0, 10]), ValueError, "labels out of range: found \\[0, 10\\], expected 0 <= label < 10"),
        (np.array([-1, 0]), ValueError, "labels out of range"),
    ]
    for bad, exc, words in bad_labels:
        with pytest.raises(exc, match=words):
            checks.labels(bad, np, 2, 10)
