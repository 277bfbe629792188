"""lowmem.bits.sensitivity on the convs a BN-ReLU unit may feed: a unit's local error L_u(K) is the
squared error its K-bit code puts into its own gamma gradient and into the weight gradient of the
conv reading it, grouped and depthwise convs included, checked against an approx Engine's."""
import numpy as np
import pytest

import lowmem as lm
from lowmem import nn
from lowmem.bits import sensitivity
from lowmem.core.engine import Engine
from lowmem.tools import cli
from reference import batch


def one_unit(groups):
    """conv -> the one BN-ReLU unit "u" -> a conv of `groups` groups ("g") -> the head: nothing
    approximated above u, so an approx engine's gradients of u's gamma and g's weight differ from
    exact ones by u's local error alone (the conv below, c, gets u's dx error)."""
    g = nn.Graph("one-unit", (3, 6, 6), 4, seed=3)
    x = g.bn_relu(g.conv(g.input, 8, 3, name="c"), name="u")
    return g.head(g.conv(x, 8, 3, groups=groups, name="g"))


def randomized(net, rng):
    for name, p in net.params.items():
        if name.startswith("u."):
            p.data[...] = rng.uniform(0.5, 1.5, p.shape) if name.endswith("weight") else rng.normal(0, 0.5, p.shape)
    return net


@pytest.mark.parametrize("groups", [1, 4, 8], ids=["dense", "grouped", "depthwise"])
def test_a_units_local_error_is_its_gamma_and_conv_weight_errors(groups):
    rng = np.random.default_rng(0)
    net = randomized(one_unit(groups), rng)
    batches = [batch(rng, net, 4, (3, 6, 6)) for _ in range(2)]
    sens = sensitivity.measure_sensitivity(net, batches, dtype="float64")
    for k in (1, 2, 4, 8):
        want = 0.0
        for x, y in batches:
            grads = []
            for mode in ("exact", "approx"):
                eng = Engine(net, 4, (3, 6, 6), mode, k, dtype="float64")
                eng.forward(x, y)
                eng.backward()
                grads.append({p.name: np.array(p.grad) for p in net.parameters()})
            exact, approx = grads
            apart = {n for n in exact if not np.array_equal(exact[n], approx[n])}
            assert apart <= {"u.weight", "g.weight", "c.weight"}, apart       # c: u's dx error, below it
            want += sum(float(((approx[n] - exact[n]) ** 2).sum()) for n in ("u.weight", "g.weight"))
        assert sens.local["u"][k] == pytest.approx(want / len(batches), rel=1e-9, abs=1e-30), (k, groups)


def test_bits_auto_runs_on_a_network_of_grouped_and_depthwise_convs(tmp_path, capsys):
    """A BN-ReLU unit feeding a grouped conv (ResNeXt, RegNetX) or a depthwise one (MobileNet-style
    blocks): allocate_bits and --bits auto measure and allocate."""
    for groups in (4, 8):
        net = randomized(one_unit(groups), np.random.default_rng(1))
        alloc = lm.allocate_bits(net, [batch(np.random.default_rng(i), net, 4, (3, 6, 6), np.float32)
                                       for i in range(2)], 4, avg_bits=2)
        assert set(alloc.bits) == {"u"}
    pytest.importorskip("onnx")
    from lowmem.formats import onnx_export
    path = onnx_export.export_onnx(one_unit(8), tmp_path / "depthwise.onnx", input_shape=(3, 6, 6))
    rc = cli.main(["plan", "--model", str(path), "--batch", "4", "--bits", "auto", "--avg-bits", "2",
                   "--measure-batches", "2", "--no-schedule", "--rows", "1"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "allocation (batch 4)" in out
