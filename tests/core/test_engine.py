"""The engine end to end: gradients, the memory plan, errors, eval mode, modes, SGD.

* Whole-network float64 gradient checks (exact mode): every parameter tensor
  along its own random direction, and the input gradient, against central
  differences of the loss.
* An independent NumPy forward (NCHW, written here from the layer list) for
  training-mode logits, BN running statistics and eval-mode predict(); a
  batch smaller than planned equals an engine planned for it.
* Memory: the arrays are the plan, and a steady-state step allocates little
  beyond it (tracemalloc); buffers do not grow with depth.
* Bad input raises a clear error naming the problem (model depth errors: test_models.py);
  approx forward is bit-identical to exact, naive is not.
* SGD against a hand-written NumPy formula (PyTorch semantics).
"""
import copy
import tracemalloc

import numpy as np
import pytest

from lowmem.units import window_cpu as fast
from lowmem.core.engine import Engine
from lowmem.models import preact_resnet_cifar, preact_resnet_imagenet
from lowmem.core.network import Network
from lowmem.train.optim import SGD
from reference import batch, check_directional, randomize_units

BN_EPS = 1e-5
# float32 BN-ReLU units run the fused numba kernels when numba is installed; test both paths
PATHS = [False, True] if fast.AVAILABLE else [False]


def tiny_imagenet_style():
    """The ImageNet layout (7x7/2 stem, BN-ReLU, 3x3/2 max-pool, a strided block with a
    projection, final BN-ReLU, head) at a few thousand parameters."""
    net = Network("tiny-imagenet-style", in_channels=3, num_classes=5)
    net.conv("conv1", "input", "act0", 3, 8, k=7, stride=2, pad=3)
    net.bnrelu("bn1", "act0", "act0", 8)
    net.maxpool("maxpool", "act0", "res")
    net.bnrelu("layer1.0.bn1", "res", "act0", 8)
    net.conv("layer1.0.shortcut", "act0", "res", 8, 16, k=1, stride=2, pad=0)
    net.conv("layer1.0.conv1", "act0", "act1", 8, 16, k=3, stride=2)
    net.bnrelu("layer1.0.bn2", "act1", "act1", 16)
    net.conv("layer1.0.conv2", "act1", "act0", 16, 16, k=3)
    net.add("layer1.0.add", "act0")
    net.bnrelu("bn_final", "res", "act0", 16)
    net.head("act0", 16)
    return net


# ------------------------------------------------ an independent reference

def conv_nchw(x, w, stride, pad):
    kh, kw = w.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    win = np.lib.stride_tricks.sliding_window_view(xp, (kh, kw), axis=(2, 3))[:, :, ::stride, ::stride]
    return np.einsum("nchwij,ocij->nohw", win, w, optimize=True)


def maxpool_nchw(x, k, stride, pad):
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=-np.inf)
    win = np.lib.stride_tricks.sliding_window_view(xp, (k, k), axis=(2, 3))[:, :, ::stride, ::stride]
    return win.max(axis=(-2, -1))


def reference_forward(net, x, train):
    """Float64 NCHW forward from net.layers (buffer names as tensor names).
    Returns logits and {bn layer: (batch mean, biased batch var, elements per channel)}."""
    P = {n: np.asarray(p.data, np.float64) for n, p in net.params.items()}
    S = {n: np.asarray(a, np.float64) for n, a in net.stats.items()}
    t, stats = {"input": np.asarray(x, np.float64)}, {}
    for L in net.layers:
        a = t[L.src]
        if L.op == "conv":
            out = conv_nchw(a, P[L.name + ".weight"], L.stride, L.pad)
        elif L.op == "bnrelu":
            if train:
                mean, var = a.mean(axis=(0, 2, 3)), a.var(axis=(0, 2, 3))
                stats[L.name] = (mean, var, a.size // a.shape[1])
            else:
                mean, var = S[L.name + ".running_mean"], S[L.name + ".running_var"]
            c = (slice(None), None, None)
            xhat = (a - mean[c]) / np.sqrt(var[c] + BN_EPS)
            out = np.maximum(P[L.name + ".weight"][c] * xhat + P[L.name + ".bias"][c], 0)
        elif L.op == "add":
            out = t["res"] + a
        elif L.op == "maxpool":
            out = maxpool_nchw(a, L.k, L.stride, L.pad)
        elif L.op == "avgpool":
            out = a.mean(axis=(2, 3))
        elif L.op == "linear":
            out = a @ P["fc.weight"].T + P["fc.bias"]
        t[L.dst] = out
    return t["logits"], stats


def reference_loss(logits, labels):
    m = logits.max(axis=1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
    return -logp[np.arange(len(labels)), labels].mean()


# -------------------------------------------------- whole-network gradients

# name: (builder, input shape, batch, tensors to check (None: all))
NETS = {
    "cifar8-basic": (lambda: preact_resnet_cifar(8), (3, 8, 8), 3, None),
    "cifar11-bottleneck": (lambda: preact_resnet_cifar(11), (3, 8, 8), 3, None),
    "tiny-imagenet-style": (tiny_imagenet_style, (3, 16, 16), 3, None),
    # The real ImageNet-18 (11M parameters): one direction per tensor for a few tensors on the
    # stem -> max-pool path, plus one joint direction over every tensor (a full per-tensor sweep
    # costs ~30 s here; tiny-imagenet-style checks every tensor of the same layout).
    # Batch 4, not 2: stage 4 is 1x1, and BN over M = 2 values is nearly singular (x-hat = +-1,
    # directional derivatives ~1e3), which leaves eps = 1e-7 differences only ~1e-3 accurate.
    "imagenet18-maxpool": (lambda: preact_resnet_imagenet(18, num_classes=5), (3, 32, 32), 4,
                           ["conv1.weight", "bn1.bias", "layer1.0.conv1.weight"]),
}


@pytest.mark.parametrize("which", list(NETS))
def test_network_gradients_match_finite_differences(rng, which):
    build, shape, N, names = NETS[which]
    net = build()
    eng = Engine(net, batch_size=N, input_shape=shape, mode="exact", dtype="float64")
    randomize_units(net, rng)
    x, y = batch(rng, net, N, shape)
    loss0, _ = eng.forward(x, y)
    dx = eng.backward(input_grad=True)
    assert dx.shape == x.shape
    grads = {p.name: p.grad.copy() for p in net.parameters()}

    def loss():
        return eng.forward(x, y)[0]

    assert loss() == loss0                          # deterministic, params restored
    for name in names or list(grads):
        check_directional(loss, [net.params[name].data], [grads[name]], rng, f"{which} {name}")
    check_directional(loss, [x], [dx], rng, f"{which} input")
    params = net.parameters()                           # all tensors at once, one direction
    check_directional(loss, [p.data for p in params], [grads[p.name] for p in params], rng,
                      f"{which} all parameters")
    assert loss() == loss0


def test_training_forward_and_running_stats_match_reference(rng):
    """Logits and loss against the independent NCHW forward; every BN's running
    statistics follow momentum 0.1 with the unbiased batch variance."""
    for net, shape, N in ((preact_resnet_cifar(11), (3, 8, 8), 3),
                          (preact_resnet_imagenet(18, num_classes=5), (3, 32, 32), 2)):
        eng = Engine(net, batch_size=N, input_shape=shape, dtype="float64")
        randomize_units(net, rng)
        before = {n: a.copy() for n, a in net.stats.items()}
        x, y = batch(rng, net, N, shape)
        ref_logits, ref_stats = reference_forward(net, x, train=True)
        loss, logits = eng.forward(x, y)
        np.testing.assert_allclose(logits, ref_logits, rtol=1e-9, atol=1e-10)
        assert np.isclose(loss, reference_loss(ref_logits, y), rtol=1e-10)
        assert set(ref_stats) == {n.rsplit(".", 1)[0] for n in net.stats}
        for name, (mean, var, M) in ref_stats.items():
            rm, rv = before[name + ".running_mean"], before[name + ".running_var"]
            np.testing.assert_allclose(net.stats[name + ".running_mean"], 0.9 * rm + 0.1 * mean,
                                       rtol=1e-9, atol=1e-10)
            np.testing.assert_allclose(net.stats[name + ".running_var"], 0.9 * rv + 0.1 * var * M / (M - 1),
                                       rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("mode,build,shape", [
    ("exact", lambda: preact_resnet_cifar(8), (3, 8, 8)),
    ("approx", lambda: preact_resnet_cifar(11), (3, 8, 8)),
    ("exact", lambda: tiny_imagenet_style(), (3, 16, 16)),
    ("approx", lambda: tiny_imagenet_style(), (3, 16, 16)),
])
def test_batch_smaller_than_planned_matches_an_engine_planned_for_it(rng, mode, build, shape):
    """Views at the start of the shared buffers and saved slots: a batch of 3 in an
    engine planned for 5 gives the loss and gradients of an engine planned for 3."""
    net = build()
    randomize_units(net, rng)
    big = Engine(copy.deepcopy(net), batch_size=5, input_shape=shape, mode=mode, dtype="float64")
    exact = Engine(copy.deepcopy(net), batch_size=3, input_shape=shape, mode=mode, dtype="float64")
    x, y = batch(rng, net, 5, shape)
    big.forward(x, y)                                   # fill every buffer and slot with a full batch first
    big.backward()
    out = []
    for eng in (big, exact):
        loss, logits = eng.forward(x[:3], y[:3])
        dx = eng.backward(input_grad=True)
        out.append((loss, logits, dx, [p.grad.copy() for p in eng.net.parameters()]))
    (l1, z1, dx1, g1), (l2, z2, dx2, g2) = out
    assert np.isclose(l1, l2, rtol=1e-12)
    np.testing.assert_allclose(z1, z2, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dx1, dx2, rtol=1e-9, atol=1e-13)
    for p, a, b in zip(net.parameters(), g1, g2):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-13, err_msg=p.name)


@pytest.mark.parametrize("n", [4, 3])
@pytest.mark.parametrize("mode,build", [("exact", tiny_imagenet_style), ("approx", tiny_imagenet_style),
                                        ("approx", lambda: preact_resnet_cifar(11))])
def test_backward_reads_only_saved_state(rng, mode, build, n):
    """Between forward and backward, the shared buffers and the workspace hold nothing backward
    needs: filling them with garbage (NaN, 0xFF, True) leaves every gradient unchanged."""
    net = build()
    eng = Engine(net, batch_size=4, input_shape=(3, 16, 16), mode=mode, dtype="float64")
    randomize_units(net, rng)
    x, y = batch(rng, net, n, (3, 16, 16))
    grads = []
    for clobber in (False, True):
        eng.forward(x, y)
        if clobber:
            for e in eng.plan.entries:
                if e.kind in ("buffers", "workspace"):
                    a = eng.arrays[e.name]
                    a[...] = True if a.dtype == bool else (255 if a.dtype == np.uint8 else np.nan)
        dx = eng.backward(input_grad=True)
        grads.append([dx] + [p.grad.copy() for p in net.parameters()])
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------- predict

def test_predict_uses_running_stats(rng):
    net = preact_resnet_cifar(8)
    N, shape = 4, (3, 8, 8)
    eng = Engine(net, batch_size=N, input_shape=shape, dtype="float64")
    randomize_units(net, rng)
    x, y = batch(rng, net, N, shape)
    state = net.state_dict()
    p1 = eng.predict(x)
    np.testing.assert_allclose(p1, reference_forward(net, x, train=False)[0], rtol=1e-9, atol=1e-10)
    np.testing.assert_array_equal(eng.predict(x), p1)                  # deterministic
    for n, v in net.state_dict().items():                               # touches no parameter or statistic
        np.testing.assert_array_equal(v, state[n], err_msg=n)
    # samples are independent in eval mode: a smaller batch gives the same rows
    np.testing.assert_allclose(eng.predict(x[1:3]), p1[1:3], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(eng.predict(x[:1]), p1[:1], rtol=1e-12, atol=1e-12)
    # training mode (batch statistics) differs
    _, train_logits = eng.forward(x, y)
    assert not np.allclose(train_logits, p1)
    # predict() consumes the saved state: backward must refuse, not return stale gradients
    eng.predict(x)
    with pytest.raises(RuntimeError, match="forward"):
        eng.backward()


# ---------------------------------------------------------------- memory

PLAN_CONFIGS = [     # (network, batch, input shape, mode, bits, dtype)
    (lambda: preact_resnet_imagenet(18, num_classes=7), 3, (3, 40, 36), "exact", 2, "float32"),
    (lambda: preact_resnet_imagenet(18, num_classes=7), 3, (3, 40, 36), "approx", 2, "float64"),
    (lambda: preact_resnet_imagenet(18, num_classes=7), 3, (3, 40, 36), "naive", 2, "float32"),
    (lambda: preact_resnet_cifar(8), 4, (3, 8, 8), "exact", 2, "float32"),
    (lambda: preact_resnet_cifar(8), 4, (3, 8, 8), "approx", 2, "float32"),
    (lambda: preact_resnet_cifar(8), 4, (3, 8, 8), "naive", 2, "float32"),
]


@pytest.mark.parametrize("config", range(len(PLAN_CONFIGS)))
def test_arrays_are_exactly_the_plan(config):
    """Every planned entry is allocated with its shape, dtype and bytes, and nothing else: the
    plan total (and its saved bytes) equals the arrays' .nbytes."""
    make, n, shape, mode, bits, dtype = PLAN_CONFIGS[config]
    eng = Engine(make(), batch_size=n, input_shape=shape, mode=mode, bits=bits, dtype=dtype)
    assert set(eng.arrays) == {e.name for e in eng.plan.entries}
    for e in eng.plan.entries:
        a = eng.arrays[e.name]
        assert (a.nbytes, tuple(a.shape), str(a.dtype)) == (e.nbytes, e.shape, e.dtype), e.name
    assert sum(a.nbytes for a in eng.arrays.values()) == eng.plan.total_bytes
    assert sum(eng.plan.bytes_by_kind().values()) == eng.plan.total_bytes
    saved = [e.name for e in eng.plan.entries if e.kind == "saved"]
    assert eng.plan.bytes_by_kind()["saved"] == sum(eng.arrays[name].nbytes for name in saved)
    codes = [e for e in eng.plan.entries if e.name.endswith(".code")]
    assert bool(codes) == (mode != "exact")      # codes are uint8 and counted at 1 byte each
    assert all(e.dtype == "uint8" and e.nbytes > 0 and eng.arrays[e.name].nbytes > 0 for e in codes)
    # the engine owns the parameters: they are the plan's arrays, and the gradients (the
    # running statistics) are consecutive views into one flat buffer, in forward order
    offset = 0
    for p in eng.net.parameters():
        assert p.data is eng.arrays[p.name] and p.grad.base is eng.arrays["grads"]
        assert p.grad.shape == p.shape and p.grad.flags.c_contiguous
        assert np.shares_memory(p.grad, eng.arrays["grads"][offset:offset + p.grad.size])
        offset += p.grad.size
    assert offset == eng.arrays["grads"].size
    for a in eng.net.stats.values():
        assert a.base is eng.arrays["bn.running"]


@pytest.mark.parametrize("use_fast", PATHS)
@pytest.mark.parametrize("depth,mode", [(20, "exact"), (20, "approx"), (8, "approx")])
def test_steady_state_step_allocates_little_beyond_the_plan(rng, depth, mode, use_fast):
    """tracemalloc sees NumPy's allocations: building holds the plan, and a steady-state step
    (after a first one: imports, JIT caches) may add only bounded scratch (row blocks, quantizer
    chunks, weight-sized GEMM results), never an activation-sized temporary, and keeps nothing.
    ResNet-8's plan (~25 MB) is mostly activation-sized."""
    net = preact_resnet_cifar(depth)
    N = 32
    tracemalloc.start()
    try:
        c0 = tracemalloc.get_traced_memory()[0]
        eng = Engine(net, batch_size=N, input_shape=(3, 32, 32), mode=mode, bits=4, dtype="float32",
                     use_fast=use_fast)
        built = tracemalloc.get_traced_memory()[0] - c0
        opt = SGD(net.parameters(), lr=0.01)
        x, y = batch(rng, net, N, (3, 32, 32), np.float32)
        eng.train_step(x, y, opt)                      # first step
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        eng.train_step(x, y, opt)                      # steady state
        end, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    total, extra = eng.plan.total_bytes, peak - start
    # what the engine holds is what the plan says (the network's own float32 copies are released)
    assert abs(built - total) < 0.02 * total, (built, total)
    assert extra < 0.10 * total, (extra, total)
    assert built + extra <= 1.10 * total, (built + extra) / total
    # the largest activation (16 x 32 x 32 per sample, one shared buffer) is 2 MB here
    assert extra < 0.5 * eng.arrays["act0"].nbytes, (extra, eng.arrays["act0"].nbytes)
    assert end - start < 0.01 * total                  # nothing retained between steps


def plan_only(net, **kw):
    """The Engine's plan without allocating it (a depth-1001 exact plan is ~10 GB)."""
    eng = Engine(net, allocate=False, **kw)
    assert eng.arrays is None
    return eng.plan


def test_buffers_do_not_grow_with_depth():
    nets = {d: preact_resnet_cifar(d) for d in (164, 1001)}
    by = {(d, mode): plan_only(net, batch_size=128, input_shape=(3, 32, 32),
                               mode=mode, bits=4).bytes_by_kind()
          for d, net in nets.items() for mode in ("exact", "approx")}
    for mode in ("exact", "approx"):
        small, big = by[164, mode], by[1001, mode]
        assert small["buffers"] == big["buffers"]
        assert small["workspace"] == big["workspace"]
        # saved state grows with the number of units: 333 vs 54 bottleneck blocks
        assert 5.5 < big["saved"] / small["saved"] < 6.5
    for d in (164, 1001):
        assert by[d, "exact"]["buffers"] == by[d, "approx"]["buffers"]
        # 4-bit codes: 8x less saved state (rstd, FC input and probs stay exact)
        assert 7.9 < by[d, "exact"]["saved"] / by[d, "approx"]["saved"] <= 8.0
    # saved state dominates the exact depth-1001 plan; buffers are a small fixed cost
    assert by[1001, "exact"]["buffers"] < 0.02 * by[1001, "exact"]["saved"]


def test_schedule_and_plan_are_printable():
    eng = Engine(preact_resnet_cifar(8), batch_size=2, input_shape=(3, 8, 8), mode="approx", bits=4)
    text = str(eng.schedule)
    assert "fwd" in text and "bwd" in text and "layer1.0.bn1.code" in text
    report = eng.plan.report()
    assert "total" in report and f"{eng.plan.total_bytes:,}" in report


# ---------------------------------------------------------------- errors

@pytest.fixture(scope="module")
def small():
    net = preact_resnet_cifar(8, num_classes=10)
    return Engine(net, batch_size=4, input_shape=(3, 8, 8), dtype="float32")


def test_bad_input_is_rejected_with_a_clear_message(small):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    y = np.array([0, 1, 2, 9])

    def poisoned(value):
        bad = x.copy()
        bad[2, 1, 3, 4] = value
        return bad

    # (x, labels, exception, words the message must contain, also checked by predict())
    cases = [
        (x[:, :, :7], y, ValueError, ["input shape", "(4, 3, 7, 8)", "(N, 3, 8, 8)"], True),
        (x[:, :2], y, ValueError, ["input shape", "(N, 3, 8, 8)"], True),
        (x[0], y, ValueError, ["input shape", "(3, 8, 8)"], True),
        (x.astype(np.float64), y, TypeError, ["dtype", "float64", "float32"], True),
        (x.tolist(), y, TypeError, ["array", "list"], True),
        (np.concatenate([x, x[:1]]), np.arange(5), ValueError, ["batch of 5", "batch_size 4"], True),
        (x[:0], y[:0], ValueError, ["empty batch"], True),
        (poisoned(np.nan), y, ValueError, ["NaN"], True),
        (poisoned(np.inf), y, ValueError, ["Inf"], True),
        (poisoned(-np.inf), y, ValueError, ["Inf"], True),
        (x, np.array([0, 1, -1, 2]), ValueError, ["labels out of range", "-1", "< 10"], False),
        (x, np.array([0, 1, 10, 2]), ValueError, ["labels out of range", "10", "< 10"], False),
        (x, np.array([0, 1, 2]), ValueError, ["labels shape", "(3,)", "(4,)"], False),
        (x, np.array([0.0, 1, 2, 3]), TypeError, ["labels", "integer"], False),
        (x, [0, 1, 2, 3], TypeError, ["labels", "integer"], False),
    ]
    for xi, yi, exc, words, in_predict in cases:
        calls = [lambda: small.forward(xi, yi)] + ([lambda: small.predict(xi)] if in_predict else [])
        for call in calls:
            with pytest.raises(exc) as info:
                call()
            for w in words:
                assert w in str(info.value), (w, str(info.value))
    loss, _ = small.forward(x, y)                 # the engine is still usable
    assert np.isfinite(loss)


@pytest.mark.parametrize("kw,exc,words", [
    (dict(mode="fast"), ValueError, ["unknown mode", "'fast'", "exact", "approx", "naive"]),
    (dict(mode="approx", bits=3), ValueError, ["bits", "{1, 2, 4, 8}", "3"]),
    (dict(mode="approx", bits=16), ValueError, ["bits", "16"]),
    (dict(mode="approx", bits=4.0), ValueError, ["bits"]),
    (dict(dtype="float16"), ValueError, ["unsupported dtype", "float16", "float32", "float64"]),
    (dict(dtype="int32"), ValueError, ["dtype"]),
    (dict(batch_size=0), ValueError, ["batch_size", "positive"]),
    (dict(input_shape=(1, 8, 8)), ValueError, ["input_shape", "in_channels", "3"]),
    (dict(input_shape=(8, 8)), ValueError, ["input_shape", "(C, H, W)"]),
])
def test_bad_engine_arguments(kw, exc, words):
    args = dict(batch_size=2, input_shape=(3, 8, 8))
    args.update(kw)
    with pytest.raises(exc) as info:
        Engine(preact_resnet_cifar(8), **args)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_input_too_small_for_the_network():
    net = Network("tiny", in_channels=3, num_classes=2)
    net.conv("conv1", "input", "res", 3, 4, k=3, stride=1, pad=0)
    net.bnrelu("bn_final", "res", "act0", 4)
    net.head("act0", 4)
    Engine(net, batch_size=2, input_shape=(3, 3, 3))      # (batch 1: BN over one value, refused)
    with pytest.raises(ValueError, match=r"input_shape \(3, 2, 2\) is too small: layer 'conv1' would produce \(4, 0, 0\)"):
        Engine(copy.deepcopy(net), batch_size=1, input_shape=(3, 2, 2))


def test_backward_before_forward_raises():
    eng = Engine(preact_resnet_cifar(8), batch_size=2, input_shape=(3, 8, 8))
    with pytest.raises(RuntimeError, match="forward"):
        eng.backward()


def test_one_network_one_engine():
    net = preact_resnet_cifar(8)
    first = Engine(net, batch_size=2, input_shape=(3, 8, 8))
    Engine(net, batch_size=2, input_shape=(3, 8, 8))
    x = np.zeros((2, 3, 8, 8), np.float32)
    with pytest.raises(RuntimeError, match="deepcopy"):
        first.forward(x, np.array([0, 1]))


# ------------------------------------------------------------------ modes


@pytest.mark.skipif(not fast.AVAILABLE, reason="fused kernels unavailable (no numba, or LOWMEM_FAST=0)")
@pytest.mark.parametrize("mode", ["exact", "approx"])
def test_fused_and_numpy_paths_agree_in_full_and_partial_batches(rng, mode):
    """float32: the fused BN-ReLU kernels give the NumPy path's gradients to float rounding,
    for a full batch and for a batch of 8 in an engine planned for 16."""
    net = tiny_imagenet_style()
    randomize_units(net, rng)
    x, y = batch(rng, net, 8, (3, 16, 16), np.float32)
    out = {}
    for use_fast in (False, True):
        for N in (8, 16):
            eng = Engine(copy.deepcopy(net), batch_size=N, input_shape=(3, 16, 16), mode=mode,
                         use_fast=use_fast)
            loss, _ = eng.forward(x, y)
            dx = eng.backward(input_grad=True)
            out[use_fast, N] = (loss, np.concatenate([dx.ravel()] + [p.grad.ravel() for p in eng.net.parameters()]))
    ref_loss, ref = out[False, 8]
    for key, (loss, g) in out.items():
        assert np.isclose(loss, ref_loss, rtol=1e-6), key
        assert np.abs(g - ref).max() <= 1e-5 * np.abs(ref).max(), key


# -------------------------------------------------------------------- SGD

def sgd_reference(ws, grads_per_step, lrs, momentum, wd, nesterov, decays):
    """PyTorch's SGD, written out: the first step sets v = g."""
    ws = [w.copy() for w in ws]
    vs = [None] * len(ws)
    for grads, lr in zip(grads_per_step, lrs):
        for i, (w, g) in enumerate(zip(ws, grads)):
            g = g + wd * w if decays[i] else g.copy()
            if momentum:
                vs[i] = g if vs[i] is None else momentum * vs[i] + g
                g = g + momentum * vs[i] if nesterov else vs[i]
            ws[i] = w - lr * g
    return ws


PARAM_NAMES = [("conv1.weight", True), ("layer1.0.bn1.weight", False), ("layer1.0.bn1.bias", False),
               ("bn_final.weight", False), ("fc.weight", True), ("fc.bias", False)]


@pytest.mark.parametrize("momentum,nesterov,wd", [(0.9, False, 5e-4), (0.9, True, 1e-2),
                                                   (0.0, False, 1e-2), (0.5, False, 0.0)])
def test_sgd_matches_reference(rng, make_param, momentum, nesterov, wd):
    params = [make_param(n, rng.standard_normal((3, 2)), decay) for n, decay in PARAM_NAMES]
    w0 = [p.data.copy() for p in params]
    grads = [[rng.standard_normal((3, 2)) for _ in params] for _ in range(4)]
    lrs = [0.1, 0.1, 0.02, 0.05]                  # lr changes between steps take effect
    opt = SGD(params, lr=lrs[0], momentum=momentum, weight_decay=wd, nesterov=nesterov)
    for step_grads, lr in zip(grads, lrs):
        opt.lr = lr
        for p, g in zip(params, step_grads):
            p.grad[...] = g
        opt.step()
    ref = sgd_reference(w0, grads, lrs, momentum, wd, nesterov, [d for _, d in PARAM_NAMES])
    for p, r in zip(params, ref):
        np.testing.assert_allclose(p.data, r, rtol=1e-13, atol=1e-15, err_msg=p.name)


def test_sgd_decay_flags(rng, make_param):
    """Default: conv/linear weights decay, BN and biases do not; decay_bn / decay_bias opt in."""
    for kw, decays in (({}, [True, False, False, False, True, False]),
                       ({"decay_bn": True}, [True, True, True, True, True, False]),
                       ({"decay_bias": True}, [True, False, False, False, True, True])):
        params = [make_param(n, rng.standard_normal(3), d) for n, d in PARAM_NAMES]
        w0 = [p.data.copy() for p in params]
        opt = SGD(params, lr=1.0, momentum=0.0, weight_decay=0.5, **kw)
        opt.step()                                   # zero gradients: only decay moves weights
        moved = [not np.array_equal(p.data, w) for p, w in zip(params, w0)]
        assert moved == decays, kw
        for p, w, d in zip(params, w0, decays):
            np.testing.assert_allclose(p.data, w * 0.5 if d else w, rtol=1e-15)


def test_model_decay_defaults():
    for p in preact_resnet_imagenet(18, num_classes=3).parameters():
        is_bn = p.name.split(".")[-2].startswith("bn")
        assert p.decay == (p.name.endswith(".weight") and not is_bn), p.name


def test_sgd_bad_arguments(make_param):
    p = [make_param("fc.weight", np.ones(2), True)]
    with pytest.raises(ValueError, match="empty"):
        SGD([], lr=0.1)
    with pytest.raises(ValueError, match=">= 0"):
        SGD(p, lr=-0.1)
    with pytest.raises(ValueError, match="nesterov"):
        SGD(p, lr=0.1, momentum=0.0, nesterov=True)


def test_train_step_is_forward_backward_step_with_planned_momentum(rng):
    net = preact_resnet_cifar(8)
    randomize_units(net, rng)
    nets = [copy.deepcopy(net), copy.deepcopy(net)]
    engs = [Engine(n, batch_size=3, input_shape=(3, 8, 8), dtype="float64") for n in nets]
    opts = [SGD(n.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True) for n in nets]
    for p in nets[0].parameters():         # the optimizer state is the plan's, so the plan counts it
        assert p.state["momentum"] is engs[0].arrays[p.name + ".momentum"]
    for _ in range(2):
        x, y = batch(rng, net, 3, (3, 8, 8))
        loss = engs[0].train_step(x, y, opts[0])
        loss1, _ = engs[1].forward(x, y)
        engs[1].backward()
        opts[1].step()
        assert loss == loss1
    for a, b in zip(nets[0].state_dict().values(), nets[1].state_dict().values()):
        np.testing.assert_array_equal(a, b)


def test_training_reduces_the_loss_on_a_fixed_batch(rng):
    """Sanity: a few steps on one batch lower its loss, in every mode (NumPy path: the fused
    kernels are checked against it in test_window_cpu.py, test_units.py and above)."""
    net = preact_resnet_cifar(8, num_classes=4)
    x, y = batch(rng, net, 8, (3, 8, 8), np.float32)
    for mode in ("exact", "approx", "naive"):
        n = copy.deepcopy(net)
        eng = Engine(n, batch_size=8, input_shape=(3, 8, 8), mode=mode, bits=4, use_fast=False)
        opt = SGD(n.parameters(), lr=0.05, momentum=0.9, weight_decay=0.0)
        losses = [eng.train_step(x, y, opt) for _ in range(6)]
        assert losses[-1] < 0.5 * losses[0], (mode, losses)


# ------------------------------------------------- the edges a careless user reaches

def test_batch_norm_over_one_value_per_channel_is_refused():
    net = Network("one-pixel", in_channels=3, num_classes=2)
    net.conv("conv1", "input", "res", 3, 4, k=3, stride=1, pad=0)
    net.bnrelu("bn_final", "res", "act0", 4)
    net.head("act0", 4)
    with pytest.raises(ValueError, match=r"batch_size 1: batch norm bn_final .*\(4, 1, 1\).*N\*H\*W = 1"):
        Engine(net, batch_size=1, input_shape=(3, 3, 3))
    eng = Engine(copy.deepcopy(net), batch_size=2, input_shape=(3, 3, 3))
    x = np.ones((1, 3, 3, 3), np.float32)
    with pytest.raises(ValueError, match="batch of 1: batch norm bn_final"):
        eng.forward(x, np.array([1]))
    assert eng.predict(x).shape == (1, 2)           # eval mode uses running statistics: fine


def test_the_caller_may_reuse_its_batch_between_forward_and_backward(rng):
    net = preact_resnet_cifar(8)
    eng = Engine(net, batch_size=4, input_shape=(3, 8, 8), dtype="float64")
    x, y = batch(rng, net, 4, (3, 8, 8))
    eng.forward(x.copy(), y.copy())
    want = eng.backward(input_grad=True), [p.grad.copy() for p in net.parameters()]
    xb, yb = x.copy(), y.copy()
    eng.forward(xb, yb)
    xb[...] = rng.standard_normal(xb.shape)         # prefetch the next batch into the same arrays
    yb[...] = (yb + 1) % net.num_classes
    got = eng.backward(input_grad=True), [p.grad.copy() for p in net.parameters()]
    np.testing.assert_array_equal(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        np.testing.assert_array_equal(a, b)


def test_a_huge_finite_input_is_refused_before_the_running_statistics_change():
    net = preact_resnet_cifar(8)
    eng = Engine(net, batch_size=4, input_shape=(3, 8, 8))
    before = {k: v.copy() for k, v in net.stats.items()}
    x = np.full((4, 3, 8, 8), 1e30, np.float32)
    x[0] = -1e30
    with pytest.raises(FloatingPointError, match="non-finite batch statistics"):
        eng.forward(x, np.array([0, 1, 2, 3]))
    for k, v in net.stats.items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    with pytest.raises(RuntimeError, match="forward"):
        eng.backward()


@pytest.mark.parametrize("n", [4, 3])
def test_approx_forward_equals_exact_bit_for_bit_with_default_kernels(rng, n):
    """Units whose N*H*W is not a multiple of 8 (n = 3: 3*5*5 = 75) run the reference kernels
    in every mode, so exact and approx still compute the same forward."""
    net = preact_resnet_cifar(8)
    randomize_units(net, rng)
    x, y = batch(rng, net, n, (3, 5, 5), np.float32)
    out = {}
    for mode in ("exact", "approx"):
        eng = Engine(copy.deepcopy(net), batch_size=4, input_shape=(3, 5, 5), mode=mode, bits=4)
        out[mode] = eng.forward(x, y)
    assert out["exact"][0] == out["approx"][0]
    np.testing.assert_array_equal(out["exact"][1], out["approx"][1])


@pytest.mark.parametrize("dtype", [np.float32, "f4", np.dtype("float64"), "<f8"])
def test_any_spelling_of_a_float_dtype_is_accepted(dtype):
    eng = Engine(preact_resnet_cifar(8), 2, (3, 8, 8), dtype=dtype, allocate=False)
    assert eng.dtype == np.dtype(dtype)


@pytest.mark.parametrize("args,exc,words", [
    ((None, 8, (3, 32, 32)), TypeError, ["Network", "NoneType"]),
    (("net", 8, (3, 32.0, 32)), ValueError, ["input_shape", "positive ints", "32.0"]),
    (("net", 8, (3, 0, 32)), ValueError, ["input_shape", "positive ints"]),
    (("net", True, (3, 8, 8)), ValueError, ["batch_size"]),
])
def test_more_bad_engine_arguments(args, exc, words):
    args = tuple(preact_resnet_cifar(8) if a == "net" else a for a in args)
    with pytest.raises(exc) as info:
        Engine(*args)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_one_class_is_refused():
    with pytest.raises(ValueError, match="num_classes=1.*at least 2 classes"):
        Engine(preact_resnet_cifar(8, num_classes=1), 2, (3, 8, 8), allocate=False)


def test_train_step_checks_the_optimizer_before_running(rng):
    net = preact_resnet_cifar(8)
    eng = Engine(net, batch_size=2, input_shape=(3, 8, 8))
    x, y = batch(rng, net, 2, (3, 8, 8), np.float32)
    before = net.stats["bn1.running_mean"].copy() if "bn1.running_mean" in net.stats else None
    stats = {k: v.copy() for k, v in net.stats.items()}
    with pytest.raises(TypeError, match="optimizer.*NoneType"):
        eng.train_step(x, y, None)
    for k, v in net.stats.items():                  # nothing ran: the running statistics are untouched
        np.testing.assert_array_equal(v, stats[k])
    del before


@pytest.mark.parametrize("depth,N,shape,mode,use_fast", [
    (8, 2, (3, 2, 2), "approx", None), (8, 16, (3, 32, 32), "approx", False),
    (20, 16, (3, 16, 16), "exact", False), (8, 4, (3, 5, 5), "naive", None)])
def test_step_temporaries_stay_within_the_bound_the_plan_states(rng, depth, N, shape, mode, use_fast):
    """What a steady step allocates beyond the plan (NumPy temporaries) is at most the plan's
    stated bound (plus 16 KiB of interpreter bookkeeping), even where the plan itself is tiny."""
    net = preact_resnet_cifar(depth)
    eng = Engine(net, N, shape, mode, 4, use_fast=use_fast)
    opt = SGD(net.parameters(), lr=0.01)
    x, y = batch(rng, net, N, shape, np.float32)
    eng.train_step(x, y, opt)
    tracemalloc.start()
    try:
        eng.train_step(x, y, opt)
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        eng.train_step(x, y, opt)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak - start <= eng.plan.temporary_bytes + (16 << 10), (peak - start, eng.plan.temporary_bytes)
    assert "of temporaries during a step" in eng.plan.report()


# ---------------------------------------------------------------- the backward sweep's measurement hooks

def test_backward_with_units_before_and_keep(rng):
    """backward(keep=True) leaves an exact forward sweepable again (the same gradients twice);
    units={unit: set} runs that set for one sweep only (x-tilde at 2 bits changes the gradients,
    the next plain sweep is exact again); before(step) sees every backward step in order."""
    from lowmem.bits.sensitivity import SimulatedCodeUnits
    net = preact_resnet_cifar(8, num_classes=10, seed=1)
    eng = Engine(net, batch_size=4, input_shape=(3, 8, 8), mode="exact", dtype="float64")
    x, labels = batch(rng, net, 4, (3, 8, 8))
    eng.forward(x, labels)
    grads = lambda: {p.name: p.grad.copy() for p in net.parameters()}          # noqa: E731
    seen = []
    eng.backward(keep=True, before=seen.append)
    first = grads()
    assert seen == [s for s in eng.schedule if s.phase == "bwd"]
    unit = next(iter(eng.unit_bits))
    exact_set = eng.units[unit]
    eng.backward(keep=True, units={unit: SimulatedCodeUnits(2)})
    assert eng.units[unit] is exact_set
    assert any(not np.array_equal(first[n], g) for n, g in grads().items())
    eng.backward(keep=True)
    assert all(np.array_equal(first[n], g) for n, g in grads().items())
    with pytest.raises(ValueError, match="unknown unit.*'nope'"):
        eng.backward(units={"nope": SimulatedCodeUnits(2)})
    eng.backward()                                                          # consumes it
    with pytest.raises(RuntimeError, match="forward"):
        eng.backward()
    approx = Engine(preact_resnet_cifar(8), batch_size=4, input_shape=(3, 8, 8), mode="approx")
    approx.forward(x.astype(np.float32), labels)
    with pytest.raises(ValueError, match="keep=True.*only exact"):
        approx.backward(keep=True)
