"""The newer graph ops, the range code and the registry models used wrongly or at the edges:
each misuse is one NetworkError / ValueError naming the layer and the problem, each legal
edge (relu6 read by an add, a depthwise conv with bias, a constant channel, the float32 range
ends) gives the right numbers."""
import re
import warnings

import numpy as np
import pytest

import lowmem as lm
from lowmem import models, nn
from lowmem.core.engine import Engine
from lowmem.core.network import NetworkError
from lowmem.units import packing
from lowmem.units import rangecode as rc
from reference import batch, check_directional, randomize_units


def graph():
    return nn.Graph("edges", (3, 8, 8), 4)


# ---- nn.Graph: misuse of the newer ops -------------------------------------------------------

def test_concat_of_mismatched_spatial_sizes_names_both_tensors():
    g = graph()
    a = g.conv(g.input, 4, 3, name="a")
    b = g.conv(a, 4, 3, stride=2, name="b")
    with pytest.raises(NetworkError, match=r"concat 'cat': spatial sizes differ: 'a' \(4, 8, 8\), "
                                           r"'b' \(4, 4, 4\); a channel concat needs equal H, W"):
        g.concat(a, b, name="cat")
    with pytest.raises(NetworkError, match=r"concat 'empty': needs at least one tensor"):
        g.concat(name="empty")


@pytest.mark.parametrize("groups,words", [
    (4, r"conv 'dw': groups=4 must divide its 6 input and 6 output channels"),
    (0, r"conv 'dw': groups must be an int >= 1, got 0"),
    (2.0, r"conv 'dw': groups must be an int >= 1, got 2.0")])
def test_groups_that_do_not_divide_the_channels_name_the_conv(groups, words):
    g = graph()
    x = g.conv(g.input, 6, 3)
    with pytest.raises(NetworkError, match=words):
        g.conv(x, 6, 3, groups=groups, name="dw")


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan"), float("inf"), True, "0.5", None])
def test_dropout_p_outside_zero_one_is_refused(p):
    g = graph()
    x = g.conv(g.input, 4, 3)
    with pytest.raises(NetworkError, match=r"dropout: p must be a number in \[0, 1\), got "):
        g.dropout(x, p=p)


@pytest.mark.parametrize("cout", [0, -1, 2.5, True, "3"])
def test_linear_with_no_outputs_is_refused(cout):
    g = graph()
    x = g.conv(g.input, 4, 3)
    with pytest.raises(NetworkError, match=r"linear 'lin': cout must be an int >= 1, got "):
        g.linear(x, cout, name="lin")


def test_a_tensor_of_another_graph_and_a_finished_graph_are_refused():
    a, b = nn.Graph("first", (3, 8, 8), 4), nn.Graph("second", (3, 8, 8), 4)
    t = a.conv(a.input, 4, 3)
    u = b.conv(b.input, 4, 3)
    for call in (lambda: b.conv(t, 4, 3), lambda: b.add(u, t), lambda: b.concat(u, t),
                 lambda: b.relu6(t), lambda: b.dropout(t), lambda: b.linear(t, 3), lambda: b.head(t)):
        with pytest.raises(NetworkError, match=r"belongs to another Graph \('first'\)"):
            call()
    b.head(u)
    with pytest.raises(NetworkError, match=r"graph 'second' is finished \(head\(\) was called\)"):
        b.head(u)                                       # a second Network from one graph: refused
    with pytest.raises(NetworkError, match=r"graph 'second' is finished"):
        b.relu6(u)


def test_a_cycle_cannot_be_written():
    """A node reads only tensors that exist, and a tensor exists only once its node is added, so
    a cycle cannot be expressed; a tensor no later node reads is refused at the head."""
    g = graph()
    a = g.conv(g.input, 4, 3, name="a")
    g.conv(a, 4, 3, name="dangling")
    with pytest.raises(NetworkError, match=r"the output of conv 'dangling' \(4, 8, 8\) is never used"):
        g.head(a)


def relu6_read_by_add():
    g = graph()
    a = g.conv(g.input, 4, 3, name="a")
    r = g.relu6(a, name="r6")
    c = g.conv(r, 4, 3, groups=4, bias=True, name="dw")    # depthwise with a bias: legal, as in torch
    return g.head(g.add(r, c, name="add"))


def test_relu6_read_by_an_add_and_a_depthwise_bias_conv_have_exact_gradients(rng):
    net = relu6_read_by_add()
    N, shape = 3, (3, 8, 8)
    eng = Engine(net, N, shape, mode="exact", dtype="float64")
    randomize_units(net, rng)
    for p in net.parameters():
        if p.name.startswith("a."):
            p.data *= 3                                 # values past 6: relu6's top region is used
    x, y = batch(rng, net, N, shape)
    eng.forward(x, y)
    dx = eng.backward(input_grad=True)
    grads = {p.name: p.grad.copy() for p in net.parameters()}
    assert "dw.bias" in grads and np.any(grads["dw.bias"] != 0)
    for name, g in grads.items():
        check_directional(lambda: eng.forward(x, y)[0], [net.params[name].data], [g], rng, name)
    check_directional(lambda: eng.forward(x, y)[0], [x], [dx], rng, "input")


# ---- units/rangecode.py at the edges ---------------------------------------------------------

def code(x, bits):
    n = x.size
    packed = np.zeros(packing.packed_nbytes(n, bits), np.uint8)
    scale, zero = np.zeros(rc.groups(n), np.float32), np.zeros(rc.groups(n), np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # no RuntimeWarning at the range ends
        rc.range_encode(packed, scale, zero, x, bits)
        out = np.empty_like(x)
        rc.range_decode(out, packed, scale, zero, bits)
    return scale, out


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_zero_and_constant_channels_with_groups_not_dividing_the_size(rng, bits):
    C, M = 3, 2 * 5 * 7                                 # N*H*W = 70: groups straddle the channels
    x = rng.standard_normal((C, M)).astype(np.float32)
    x[0] = 0
    x[1] = 2.5
    scale, out = code(x.ravel(), bits)
    out = out.reshape(C, M)
    assert np.all(out[0] == 0)
    step = np.repeat(scale.astype(np.float64), rc.GROUP)[:x.size].reshape(C, M)
    assert np.all(np.abs(out - x) <= 0.5 * step * (1 + 1e-6))
    one = code(np.full(M, 2.5, np.float32), bits)[1]    # a constant channel alone: its value exactly
    np.testing.assert_allclose(one, 2.5, rtol=1e-6)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_the_float32_range_ends_decode_finite_and_close(bits):
    big = np.finfo(np.float32).max
    for x in (np.array([big, -big, 1.0, 0.0] * 70, np.float32),      # spans the whole float32 range
              np.full(300, big, np.float32), np.full(300, -big, np.float32)):
        scale, out = code(x, bits)
        assert np.all(np.isfinite(out)) and np.all(np.isfinite(scale))
        assert np.all(out[x == 0] == 0)
        step = np.repeat(scale.astype(np.float64), rc.GROUP)[:x.size]
        assert np.all(np.abs(out.astype(np.float64) - x) <= step * (1 + 1e-6)), bits
    if bits > 1:                                        # one sign: the end itself is a level
        np.testing.assert_allclose(code(np.full(300, big, np.float32), bits)[1], big, rtol=1e-6)
    tiny = np.array([1e-45, -1e-45, 3e-38, 0.0] * 70, np.float32)   # subnormals
    scale, out = code(tiny, bits)
    assert np.all(np.isfinite(out)) and np.all(out[tiny == 0] == 0)
    assert np.max(np.abs(out - tiny)) <= max(3e-38 / ((1 << bits) - 1), 1.5e-45)


def test_inf_and_nan_code_without_warnings_and_the_engine_refuses_them_first(rng):
    for bad in (np.inf, -np.inf, np.nan):
        x = np.array([bad, 1.0, 0.0] * 100, np.float32)
        code(x, 4)                                      # no exception, no RuntimeWarning
    net = relu6_read_by_add()
    eng = Engine(net, 2, (3, 8, 8), mode="approx", bits=2)
    opt = lm.SGD(net.parameters(), lr=0.1)
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    for bad in (np.nan, np.inf):
        x[1, 0, 0, 0] = bad
        with pytest.raises(ValueError, match=r"the input batch contains NaN or Inf"):
            eng.train_step(x, np.array([0, 1]), opt)


# ---- the registry models: batches that do not fit ---------------------------------------------

@pytest.fixture(scope="module", params=[("resnet", 18), ("densenet", 121), ("mobilenet", 2)])
def registry(request):
    fam, depth = request.param
    net = models.build_model(fam, depth, num_classes=3)
    return fam, net, Engine(net, 2, (3, 32, 32), mode="approx", bits=2)


def test_a_batch_larger_than_planned_an_empty_one_and_batch_one_are_one_line(registry, rng):
    fam, net, eng = registry
    opt = lm.SGD(net.parameters(), lr=0.0)
    big = rng.standard_normal((5, 3, 32, 32)).astype(np.float32)
    for call in (lambda: eng.train_step(big, np.zeros(5, int), opt), lambda: eng.predict(big)):
        with pytest.raises(ValueError, match=r"batch of 5 is larger than the planned batch_size 2"):
            call()
    empty = np.zeros((0, 3, 32, 32), np.float32)
    for call in (lambda: eng.train_step(empty, np.zeros(0, int), opt), lambda: eng.predict(empty)):
        with pytest.raises(ValueError, match=r"empty batch"):
            call()
    with pytest.raises(ValueError, match=r"forward: batch of 1: batch norm \S+ would normalise one value "
                                         r"per channel .*Use a batch of at least 2"):
        eng.train_step(big[:1], np.zeros(1, int), opt)
    with pytest.raises(ValueError, match=r"batch_size 1: batch norm \S+ would normalise one value per channel"):
        Engine(net, 1, (3, 32, 32), mode="approx", bits=2)
    assert eng.predict(big[:1]).shape == (1, 3)         # eval: running statistics, batch 1 is fine
    with pytest.raises(ValueError, match=r"input_shape must be \(C, H, W\) with C = 3 .*got \(1, 32, 32\)"):
        Engine(net, 2, (1, 32, 32), mode="approx")


@pytest.mark.parametrize("family,depth,valid", [
    ("densenet", 7, r"expected one of \[121, 169, 201\]"), ("resnet", 19, r"expected one of \[18, 34, 50, 101, 152\]"),
    ("mobilenet", 3, r"expected 2 \(MobileNetV2\)")])
def test_an_unsupported_registry_depth_lists_the_valid_ones(family, depth, valid, capsys):
    from lowmem.tools import cli
    assert cli.main(["plan", "--model", family, "--depth", str(depth)]) != 0
    err = capsys.readouterr().err
    assert f"unsupported depth {depth} for {family}" in err
    assert re.search(valid, err) and err.count("\n") == 1


def test_a_dict_of_unit_widths_without_a_default_still_codes_the_conv_inputs():
    """A width named for every unit and no "*" (what --bits auto gives): the convs' range-coded
    inputs take the widest width named, so the plan equals {"*": 4}'s for an all-4 dict, and is
    not the float-input plan; every unit "float" leaves them float."""
    net = models.resnet(18, num_classes=10, input_size=32)
    units = [L.name for L in net.layers if L.op == "bnrelu"]
    plan = lambda bits: Engine(net, 2, (3, 32, 32), "approx", bits, "float32").plan   # noqa: E731
    assert plan({u: 4 for u in units}).total_bytes == plan({"*": 4}).total_bytes == plan(4).total_bytes
    mixed = dict.fromkeys(units, 2) | {units[0]: 8}
    assert plan(mixed).report() == plan(dict(mixed, **{"*": 8})).report()
    assert plan(dict.fromkeys(units, "float")).total_bytes == plan({"*": "float"}).total_bytes
    assert plan({"*": "float"}).total_bytes > plan({"*": 8}).total_bytes
