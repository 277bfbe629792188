"""docs/from_scratch.py, the method in plain NumPy, against lowmem and against finite differences.

* its quantizer gives lowmem's codes: the same x̃ and mask as `window.quantize_simulated`
  bit for bit (same grid, same float expressions), including thresholds outside the window
  and γ = 0;
* its gradients equal lowmem's Engine (float64, reference kernels) on the same weights and
  batch, in exact mode and in 4-bit approx mode;
* its exact-mode gradients match float64 central differences of its own loss.
"""
import copy
import importlib.util
import os

import numpy as np
import pytest

from lowmem.units import window
from lowmem.core.engine import Engine
from lowmem.models import preact_resnet_cifar

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def fs():
    spec = importlib.util.spec_from_file_location(
        "from_scratch", os.path.join(HERE, "..", "docs", "from_scratch.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_lowmem_import(fs):
    src = open(os.path.join(HERE, "..", "docs", "from_scratch.py")).read()
    assert "lowmem" not in "".join(l for l in src.splitlines() if l.startswith(("import", "from")))


def test_constants_are_lowmems(fs):
    assert fs.W == window.half_width(fs.BITS)


def test_quantizer_matches_lowmem_bit_for_bit(fs):
    rng = np.random.default_rng(0)
    C, N = 9, 4
    xhat = rng.standard_normal((N, C, 6, 6)) * 1.6
    gamma = np.array([1.0, -0.7, 0.0, 0.0, 2.0, 0.3, -1.2, 1e-9, 0.5])
    beta = np.array([0.2, 0.1, 0.4, -0.4, -9.0, 3.0, 2.5, 0.1, -0.5])
    xhat[0, 5, 0, :3] = -beta[5] / gamma[5] + np.array([-1e-15, 0, 1e-15])   # on the threshold
    packed = fs.encode(xhat, gamma, beta)
    assert packed.dtype == np.uint8 and packed.size == xhat.size // 2
    xt, mask = fs.decode(packed, xhat.shape, gamma, beta)
    rows = np.ascontiguousarray(xhat.transpose(1, 0, 2, 3).reshape(C, -1))
    want_xt, want_mask = window.quantize_simulated(rows, gamma, beta, fs.BITS)
    got_xt = xt.transpose(1, 0, 2, 3).reshape(C, -1)
    got_mask = mask.transpose(1, 0, 2, 3).reshape(C, -1)
    assert np.array_equal(got_mask, want_mask)
    assert np.array_equal(got_xt, want_xt)                   # to the bit


def lowmem_net_and_params(fs, seed=3):
    net = preact_resnet_cifar(8, in_channels=1, seed=seed)
    rng = np.random.default_rng(seed)
    state = net.state_dict()
    for k in state:                                          # BN affine away from 1/0: γ<0, β≠0
        if k.endswith(("bn1.weight", "bn2.weight", "bn_final.weight")):
            state[k] = rng.uniform(-1.5, 1.5, state[k].shape).astype(state[k].dtype)
        elif k.endswith(("bn1.bias", "bn2.bias", "bn_final.bias")):
            state[k] = rng.uniform(-0.5, 0.5, state[k].shape).astype(state[k].dtype)
    net.load_state_dict(state)
    P = {k: np.asarray(v, np.float64) for k, v in net.state_dict().items() if k in dict(
        (p.name, p) for p in net.parameters())}
    return net, P


def engine_grads(net, x, labels, mode):
    eng = Engine(copy.deepcopy(net), x.shape[0], x.shape[1:], mode, bits=4, dtype="float64")
    loss, _ = eng.forward(x, labels)
    eng.backward()
    return loss, {p.name: np.asarray(p.grad, np.float64).copy() for p in eng.net.parameters()}


@pytest.mark.parametrize("mode", ["exact", "approx"])
def test_gradients_equal_lowmems_engine(fs, mode):
    net, P = lowmem_net_and_params(fs)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 1, 16, 16))
    labels = rng.integers(0, 10, 8)
    loss, saved = fs.forward(P, x, labels, approx=(mode == "approx"))
    G = fs.backward(P, saved)
    want_loss, want = engine_grads(net, x, labels, mode)
    assert set(G) == set(want)
    assert abs(loss - want_loss) < 1e-12
    for k in want:
        scale = np.abs(want[k]).max()
        assert np.abs(G[k] - want[k]).max() <= 1e-9 * scale, k


def test_approx_differs_from_exact(fs):
    """The comparison above is not vacuous: 4-bit gradients differ from exact ones."""
    _, P = lowmem_net_and_params(fs)
    rng = np.random.default_rng(1)
    x, labels = rng.standard_normal((8, 1, 16, 16)), rng.integers(0, 10, 8)
    le, se = fs.forward(P, x, labels, approx=False)
    la, sa = fs.forward(P, x, labels, approx=True)
    assert le == la                                          # the forward pass is exact in both
    ge, ga = fs.backward(P, se), fs.backward(P, sa)
    assert np.array_equal(ge["fc.weight"], ga["fc.weight"])  # reads only exact saved state
    err = np.linalg.norm(ga["layer1.0.conv1.weight"] - ge["layer1.0.conv1.weight"])
    assert 0.01 < err / np.linalg.norm(ge["layer1.0.conv1.weight"]) < 0.5


def test_exact_gradients_match_finite_differences(fs):
    _, P = lowmem_net_and_params(fs)
    rng = np.random.default_rng(2)
    x, labels = rng.standard_normal((4, 1, 8, 8)), rng.integers(0, 10, 4)
    G = fs.backward(P, fs.forward(P, x, labels, approx=False)[1])
    eps = 1e-6
    for k in sorted(P):
        for idx in rng.choice(P[k].size, 2, replace=False):
            i = np.unravel_index(idx, P[k].shape)
            old = P[k][i]
            P[k][i] = old + eps
            lp = fs.forward(P, x, labels, approx=False)[0]
            P[k][i] = old - eps
            lm = fs.forward(P, x, labels, approx=False)[0]
            P[k][i] = old
            fd = (lp - lm) / (2 * eps)
            assert abs(fd - G[k][i]) <= 1e-6 * max(1.0, np.abs(G[k]).max()), (k, i, fd, G[k][i])


def test_missing_data_is_one_clear_line(fs, tmp_path):
    with pytest.raises(SystemExit) as e:
        fs.fashion_mnist(str(tmp_path))
    msg = str(e.value)
    assert "train-images-idx3-ubyte.gz" in msg and str(tmp_path) in msg and "\n" not in msg
