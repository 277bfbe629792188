"""benchmarks/gemm_floor.py (compare_torch.py's floor): its list of GEMMs is the list the step's convs run.

The floor times step_gemms(engine), a description of every conv GEMM of a training step
built from the engine's own decisions (winograd.applies, the 1x1 test, the chunking and the
thread ranges of ops/conv.py and ops/winograd.py). Here a real training step runs with
numpy.matmul wrapped, recording each call made from those two modules; the multiset of
(operand shapes and strides, out) must equal the floor's. Nothing is timed.
"""
import collections
import os
import sys

import numpy
import pytest

import lowmem
from lowmem.ops import winograd
from lowmem.system import threads

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import gemm_floor                                                # noqa: E402

CONV_MODULES = ("lowmem.ops.conv", "lowmem.ops.winograd")


def signature(a, b, out):
    return (a.shape, a.strides, b.shape, b.strides, None if out is None else (out.shape, out.strides))


def recorder(real, seen):
    """numpy.matmul that appends the signature of each call made from ops/conv.py or ops/winograd.py
    to `seen`, then runs `real`."""
    def recording(a, b, *args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__") in CONV_MODULES:
            seen.append(signature(a, b, kwargs.get("out", args[0] if args else None)))
        return real(a, b, *args, **kwargs)
    return recording


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def n_threads(request):
    before = threads.threads()
    got = threads.configure(request.param)
    if got != request.param:
        threads.configure(before)
        pytest.skip("threadpoolctl is not installed: lowmem runs on one thread")
    yield got
    threads.configure(before)


def test_floor_gemms_are_the_steps_conv_gemms(n_threads, monkeypatch):
    # bottleneck ResNet-11 on 16x16 images: the stem and the stride-2 3x3 convs (im2col), 1x1
    # convs (plain GEMMs; im2col where the input gradient accumulates), stride-1 3x3 convs with
    # 16+ channels (Winograd where numba is there); a workspace of three samples of the
    # largest im2col (16*9 x 16*16 floats) gives several chunks per range; batch 32 makes the
    # 1x1 GEMMs wide enough (32*16*16 columns) to be split over two threads; the Winograd convs
    # split too (their work grain lowered: at these sizes a conv keeps its batch on one thread)
    monkeypatch.setattr(winograd, "WORK_GRAIN", 1)
    net = lowmem.models.preact_resnet_cifar(11, num_classes=10, block="bottleneck")
    eng = lowmem.Engine(net, 32, (3, 16, 16), "approx", 4, "float32", workspace_bytes=3 * 16 * 9 * 256 * 4)
    products = gemm_floor.step_gemms(eng)
    expected = collections.Counter(signature(a, b, c) for p in products for r in p["ranges"] for a, b, c in r)

    real, seen = numpy.matmul, []
    monkeypatch.setattr(numpy, "matmul", recorder(real, seen))
    rng = numpy.random.default_rng(0)
    x = rng.standard_normal((32, 3, 16, 16)).astype(numpy.float32)
    eng.train_step(x, rng.integers(0, 10, 32), lowmem.SGD(net.parameters(), lr=0.01))
    monkeypatch.setattr(numpy, "matmul", real)

    assert len(seen) == sum(expected.values())
    assert collections.Counter(seen) == expected

    convs = [s for s in eng.schedule if s.op == "conv" and s.phase == "fwd"]
    assert len(products) == 3 * len(convs) - 1                 # no input gradient for the stem
    paths = {p["path"] for p in products}
    assert {"1x1", "im2col"} <= paths
    assert ("winograd" in paths) == eng.run.columns.winograd
    for path in paths - {"1x1"}:                               # chunked (a 1x1 GEMM never is)
        assert any(len(r) > 1 for p in products if p["path"] == path for r in p["ranges"]), path
    if n_threads > 1:
        for path in paths:                                     # split over threads
            assert any(len(p["ranges"]) > 1 for p in products if p["path"] == path), path
    sides = {s.layer.name: s.out_shape[1] for s in convs}
    wide = [p for p in products if p["path"] == "winograd"
            and winograd.scheme(32, sides[p["layer"]], sides[p["layer"]]) is winograd.F4]
    assert bool(wide) == eng.run.columns.winograd              # 16x16 planes: F(4x4); 8x8 at batch 32: F(2x2)
    for p in products:                                         # Winograd on even images: 4x or 2.25x fewer
        if p["path"] == "winograd" and p in wide:
            assert p["direct_flop"] == 4 * p["flop"], p["layer"]
        elif p["path"] == "winograd":
            assert 4 * p["direct_flop"] == 9 * p["flop"], p["layer"]
        else:
            assert p["flop"] == p["direct_flop"], p["layer"]


def test_conv_product_gemms_rejects_an_unknown_product():
    w = numpy.zeros((4, 4, 1, 1), numpy.float32)
    x = numpy.zeros((4, 2, 3, 3), numpy.float32)
    with pytest.raises(ValueError, match="product must be"):
        gemm_floor.conv_product_gemms("backward", None, x, w, x, 1, 0, numpy.zeros(64, numpy.float32))


@pytest.mark.parametrize("case", ["planes", "weight chunks", "blocks"])
def test_floor_gemms_follow_the_plane_split_and_the_blocks(n_threads, monkeypatch, case):
    """The floor's model of a Winograd conv where the threads cut its planes (forward, input
    gradient, weight gradient into one dU, or over chunks through its term) and where dU goes in
    blocks of output channels: the GEMMs equal the ones ops/conv.py runs, operand by operand."""
    if not winograd.AVAILABLE:
        pytest.skip("Winograd runs with numba only")
    from lowmem.ops import conv
    Cin, Cout, H, N = 24, 40, 8, 6
    rng = numpy.random.default_rng(1)
    x = rng.standard_normal((Cin, N, H, H)).astype(numpy.float32)
    w = rng.standard_normal((Cout, Cin, 3, 3)).astype(numpy.float32)
    g = rng.standard_normal((Cout, N, H, H)).astype(numpy.float32)
    s = winograd.scheme(N, H, H)
    per, u, T = s.per_sample(Cin, Cout, H, H), s.planes * Cin * Cout, N * s.tiles(H, H)[0] ** 2
    monkeypatch.setattr(winograd, "PLANE_CHANNELS", 1)
    if case == "blocks":
        monkeypatch.setattr(winograd, "MIN_BLOCK", 8)
        ws = numpy.zeros(s.planes * Cin * T + 16 * s.planes * (T + Cin), numpy.float32)
    else:
        ws = numpy.zeros(2 * u + (2 if case == "weight chunks" else N) * per, numpy.float32)
    products = [("weight", x, g, numpy.zeros_like(w))]
    if case == "planes":
        products += [("forward", x, numpy.empty_like(g), w), ("input", g, numpy.empty_like(x), w)]
    real, seen = numpy.matmul, []
    recording = recorder(real, seen)
    for product, a, b, ww in products:
        path, ranges = gemm_floor.conv_product_gemms(product, conv.NUMBA, a, ww, b, 1, 1, ws)
        assert path == "winograd"
        expected = collections.Counter(signature(p, q, o) for r in ranges for p, q, o in r)
        if n_threads > 1 or case == "blocks":
            assert len(ranges) == n_threads                 # one list per thread's planes
        seen.clear()
        monkeypatch.setattr(numpy, "matmul", recording)
        if product == "forward":
            conv.conv2d_forward(b, a, ww, 1, 1, ws, conv.NUMBA)
        elif product == "input":
            conv.conv2d_backward_input(b, a, ww, 1, 1, ws, columns=conv.NUMBA)
        else:
            conv.conv2d_backward_weight(ww, a, b, 1, 1, ws, conv.NUMBA)
        monkeypatch.setattr(numpy, "matmul", real)
        assert collections.Counter(seen) == expected, (case, product)
