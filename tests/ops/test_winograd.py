"""ops/winograd.py (Winograd F(2x2, 3x3), and the drivers F(4x4, 3x3) runs through) against a
float64 reference and the im2col path (F(4x4)'s own transforms: tests/ops/test_winograd4.py).

Accuracy, on every 3x3 conv shape of pre-act ResNet-164 and on the ImageNet stem: the
relative error (||a - ref|| / ||ref||) of each float32 product (forward, input gradient,
weight gradient) against float64. Measured (docs/performance.md): F(2x2)'s forward is more
accurate than im2col's, its input gradient 1.5-1.7x less accurate (still ~3e-7), so the bound
asserted for it is 2x the im2col path's error for the same product and shape; F(4x4)'s is
about 5x (forward) to 11x (input gradient), 1-2.4e-6, asserted at 16x and below 4e-6.
Shapes Winograd does not take (stride 2, the 7x7 stem) must run the im2col path unchanged.
"""
import numpy as np
import pytest

from lowmem.system import threads
from lowmem.units import window_cpu as fast
from lowmem.ops import chunks, conv, winograd, winograd4
from reference import conv_offsets_backward_ref as ref_backward, conv_offsets_ref as ref_forward, conv_ref

pytestmark = pytest.mark.skipif(not fast.AVAILABLE, reason="Winograd runs with numba only")


def products(x, w, g, stride, pad, ws):
    """float32 (out, dx, dw) through ops/conv.py (whichever path applies)."""
    Cout = w.shape[0]
    out = np.empty((Cout, x.shape[1]) + g.shape[2:], np.float32)
    conv.conv2d_forward(out, x, w, stride, pad, ws)
    dx = np.empty_like(x)
    conv.conv2d_backward_input(dx, g, w, stride, pad, ws)
    dw = np.zeros_like(w)
    conv.conv2d_backward_weight(dw, x, g, stride, pad, ws)
    return out, dx, dw


def rel(a, ref):
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def setup(rng, Cin, Cout, H, k, stride, pad, N):
    Ho = (H + 2 * pad - k) // stride + 1
    x = rng.standard_normal((Cin, N, H, H))
    w = rng.standard_normal((Cout, Cin, k, k)) * np.sqrt(2 / (Cin * k * k))
    g = rng.standard_normal((Cout, N, Ho, Ho))
    return x, w, g


# (Cin, Cout, H, k, stride, pad, N): ResNet-164's 3x3 convs (three stages, stride 1; the two
# stride-2 transitions), and the ImageNet stem (7x7 stride 2 on 224x224, one sample)
SHAPES = [(16, 16, 32, 3, 1, 1, 4), (32, 32, 16, 3, 1, 1, 8), (64, 64, 8, 3, 1, 1, 16),
          (32, 32, 32, 3, 2, 1, 2), (64, 64, 16, 3, 2, 1, 4), (3, 64, 224, 7, 2, 3, 1),
          (32, 32, 16, 3, 1, 1, 16), (64, 64, 8, 3, 1, 1, 64)]     # the last two: batches F(4x4) takes


# each scheme's bound, (its error below this, at most this many times im2col's), from the
# measurements in docs/performance.md: F(4x4)'s points +-2 and constants 1/6, 1/12, 1/24 cost it
# about 5x im2col's error on the forward and 11x on the input gradient (1-2.4e-6)
BOUNDS = {"F(2x2, 3x3)": (1e-6, 2), "F(4x4, 3x3)": (4e-6, 16)}


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("Cin,Cout,H,k,stride,pad,N", SHAPES)
def test_float32_error_against_float64(monkeypatch, Cin, Cout, H, k, stride, pad, N, wide):
    """Each scheme on the shapes it takes (wide: F(4x4) where it applies, else F(2x2) everywhere)."""
    rng = np.random.default_rng(Cin + H)
    x, w, g = setup(rng, Cin, Cout, H, k, stride, pad, N)
    ref = (ref_forward(x, w, stride, pad),) + ref_backward(x, w, g, stride, pad)
    x32, w32, g32 = (a.astype(np.float32) for a in (x, w, g))
    ws = np.full(1 << 22, np.nan, np.float32)              # garbage: neither path may read it
    monkeypatch.setattr(winograd4, "ENABLED", wide)
    monkeypatch.setattr(winograd, "ENABLED", False)
    im2col = [rel(a, r) for a, r in zip(products(x32, w32, g32, stride, pad, ws), ref)]
    monkeypatch.setattr(winograd, "ENABLED", True)
    takes = winograd.applies(x32, w32, g32, stride, pad, ws)
    assert takes == (k == 3 and stride == 1)
    scheme = winograd.scheme(N, H, H)
    assert (scheme is winograd.F4) == (wide and H >= winograd4.MIN_SIDE and N * H * H >= winograd4.MIN_OUTPUTS)
    wino = [rel(a, r) for a, r in zip(products(x32, w32, g32, stride, pad, ws), ref)]
    below, times = BOUNDS[scheme.name]
    for name, e_w, e_i in zip(("forward", "input gradient", "weight gradient"), wino, im2col):
        if not takes:
            assert e_w == e_i                              # the im2col path, unchanged
            continue
        assert e_w < below, (scheme.name, name, e_w)
        assert e_w <= times * e_i, (scheme.name, name, e_w, e_i)


@pytest.mark.parametrize("H,W", [(8, 8), (7, 5), (1, 1), (2, 3)])
def test_odd_sizes_accumulate_and_chunks_match_im2col(monkeypatch, H, W):
    """Partial edge tiles, dx += (accumulate), chunks of one sample, against the im2col path."""
    rng = np.random.default_rng(H * 10 + W)
    Cin, Cout, N = 16, 24, 3
    x = rng.standard_normal((Cin, N, H, W)).astype(np.float32)
    w = rng.standard_normal((Cout, Cin, 3, 3)).astype(np.float32)
    g = rng.standard_normal((Cout, N, H, W)).astype(np.float32)
    base = rng.standard_normal(x.shape).astype(np.float32)
    res = {}
    for on in (False, True):
        monkeypatch.setattr(winograd, "ENABLED", on)
        monkeypatch.setattr(winograd, "CACHE_BYTES", 1)     # one sample per chunk
        ws = np.full(winograd.per_sample(Cin, Cout, H, W) * 2 + 32 * Cin * Cout, np.nan, np.float32)
        assert not on or winograd.applies(x, w, g, 1, 1, ws, weight=True)
        out = np.empty((Cout, N, H, W), np.float32)
        conv.conv2d_forward(out, x, w, 1, 1, ws)
        dx = base.copy()
        conv.conv2d_backward_input(dx, g, w, 1, 1, ws, accumulate=True)
        dw = np.ones_like(w)
        conv.conv2d_backward_weight(dw, x, g, 1, 1, ws)
        res[on] = (out, dx, dw)
    for a, b in zip(res[True], res[False]):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * np.abs(b).max())


def test_two_threads_match_one(monkeypatch):
    """Batch ranges over 2 lowmem threads: the three products equal 1 thread's to float32
    rounding (a range's tile GEMMs are narrower, and BLAS may take other kernels for other
    sizes, as ops/conv.py says; the weight gradient's range sums are added in order)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 6, 8, 8)).astype(np.float32)
    w = rng.standard_normal((16, 16, 3, 3)).astype(np.float32)
    g = rng.standard_normal((16, 6, 8, 8)).astype(np.float32)
    ws = np.full(1 << 18, np.nan, np.float32)
    monkeypatch.setattr(chunks, "COLS_GRAIN", 1)
    monkeypatch.setattr(winograd, "WORK_GRAIN", 1)        # split even this small conv
    res = []
    try:
        for t in (1, 2):
            threads.configure(t)
            assert winograd.applies(x, w, g, 1, 1, ws)
            res.append(products(x, w, g, 1, 1, ws))
    finally:
        threads.configure(1)
    for one, two in zip(*res):
        np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-5 * np.abs(one).max())


@pytest.mark.parametrize("N,H,chunked", [(6, 8, False), (6, 8, True), (16, 16, False), (5, 7, True)])
def test_planes_split_between_threads_match_one_thread(monkeypatch, N, H, chunked):
    """The plane split (each thread a share of the GEMMs' planes, the tile transforms cut by
    channel rows, the batch's tiles in chunks as the workspace allows; the weight gradient's
    dU summed over chunks through its term): the three products on 2 threads equal the batch
    split's on 1 thread to float32 rounding, with F(2x2) and F(4x4) (16x16, batch 16), and odd
    sizes. It must run: the transforms' row splits are counted."""
    rng = np.random.default_rng(N * 100 + H)
    Cin, Cout = 24, 40
    x = rng.standard_normal((Cin, N, H, H)).astype(np.float32)
    w = rng.standard_normal((Cout, Cin, 3, 3)).astype(np.float32)
    g = rng.standard_normal((Cout, N, H, H)).astype(np.float32)
    s = winograd.scheme(N, H, H)
    assert (s is winograd.F4) == (H == 16)
    per, u = s.per_sample(Cin, Cout, H, H), s.planes * Cin * Cout
    size = 2 * u + 2 * per if chunked else u + N * per      # chunks of 2 samples, or the batch at once
    ws = np.full(size, np.nan, np.float32)
    assert winograd.applies(x, w, g, 1, 1, ws, weight=True)
    res, rows = [], []
    try:
        threads.configure(1)
        res.append(products(x, w, g, 1, 1, ws))
        threads.configure(2)
        monkeypatch.setattr(winograd, "PLANE_CHANNELS", 1)
        monkeypatch.setattr(winograd, "ROW_GRAIN", 1)
        split = winograd._rows
        monkeypatch.setattr(winograd, "_rows", lambda fn, n, grain=1: (rows.append(n), split(fn, n, 1)))
        assert winograd._split_planes(N, s.tiles(H, H)[0] ** 2, Cin * Cout, ws, per)
        assert winograd._weight_planes(N, s.tiles(H, H)[0] ** 2, Cin * Cout, ws, per, u)
        res.append(products(x, w, g, 1, 1, ws))
    finally:
        threads.configure(1)
    chunks_ = 1 if not chunked else -(-N // 2)
    assert rows.count(Cin) >= 2 * chunks_ and rows.count(Cout) >= 2 * chunks_     # each product's transforms
    for one, two in zip(*res):
        np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-5 * np.abs(one).max())


@pytest.mark.parametrize("threads_", [1, 2])
@pytest.mark.parametrize("N,H,Cin,Cout", [(3, 8, 24, 40), (2, 7, 24, 40), (16, 16, 64, 168)])
def test_weight_gradient_in_blocks_of_output_channels_matches_im2col(monkeypatch, threads_, N, H, Cin, Cout):
    """Where a whole dU and its term do not fit the workspace: the batch's input tiles once, dU
    in blocks of output channels (here 16 each, the last 8), dw += G^T dU G per block, against
    the im2col path to float32 rounding (Winograd's), on 1 and 2 threads, with F(2x2), odd
    sizes, and F(4x4) (16x16, batch 16); dw accumulates (+=) into what it held."""
    rng = np.random.default_rng(N * 10 + H)
    x = rng.standard_normal((Cin, N, H, H)).astype(np.float32)
    g = rng.standard_normal((Cout, N, H, H)).astype(np.float32)
    base = rng.standard_normal((Cout, Cin, 3, 3)).astype(np.float32)
    s = winograd.scheme(N, H, H)
    th, tw = s.tiles(H, H)
    T = N * th * tw
    monkeypatch.setattr(winograd, "MIN_BLOCK", 8)
    ws = np.full(s.planes * Cin * T + 16 * s.planes * (T + Cin) + 7, np.nan, np.float32)
    assert ws.size < s.per_sample(Cin, Cout, H, H) + 2 * s.planes * Cin * Cout
    assert winograd._weight_block(N, Cin, Cout, H, H, s, ws) == 16
    assert winograd.applies(x, base, g, 1, 1, ws, weight=True)
    blocks = []
    grad = winograd.filter_gradient_add
    monkeypatch.setattr(winograd, "filter_gradient_add", lambda dw, dU, s_: (blocks.append(dw.shape[0]), grad(dw, dU, s_)))
    try:
        threads.configure(threads_)
        dw = base.copy()
        conv.conv2d_backward_weight(dw, x, g, 1, 1, ws)
    finally:
        threads.configure(1)
    assert blocks == [16] * (Cout // 16) + [8]
    monkeypatch.setattr(winograd, "ENABLED", False)
    want = base.copy()
    conv.conv2d_backward_weight(want, x, g, 1, 1, np.empty(1 << 20, np.float32))
    np.testing.assert_allclose(dw, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    monkeypatch.setattr(winograd, "ENABLED", True)
    small = ws[:s.planes * Cin * T + 7 * s.planes * (T + Cin)]      # room for blocks of 7 < 8: im2col
    assert not winograd.applies(x, base, g, 1, 1, small, weight=True)
    with pytest.raises(ValueError, match="workspace too small for a Winograd weight gradient"):
        winograd.conv3x3_backward_weight(dw, x, g, ws[:s.planes * Cin * T])    # called past applies()


def test_batch_split_only_where_each_range_has_the_work(monkeypatch):
    """A conv whose GEMMs hold fewer than 2 * WORK_GRAIN multiply-adds runs its batch as one
    range on 2 threads (a hand-over costs more than the half it saves: DenseNet-121's 4x4 and 2x2
    convs); with the grain lowered, as two ranges. Forward, input gradient, weight gradient."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((32, 8, 4, 4)).astype(np.float32)
    w = rng.standard_normal((16, 32, 3, 3)).astype(np.float32)
    g = rng.standard_normal((16, 8, 4, 4)).astype(np.float32)
    ws = np.full(1 << 18, np.nan, np.float32)
    ranges = []
    split = winograd.over_batch
    monkeypatch.setattr(winograd, "over_batch", lambda *a: ranges.append(split(*a)))
    monkeypatch.setattr(chunks, "COLS_GRAIN", 1)
    work = 16 * 32 * 16 * 8 * 4                            # planes * Cin * Cout * tiles
    try:
        threads.configure(2)
        assert work < 2 * winograd.WORK_GRAIN
        products(x, w, g, 1, 1, ws)
        assert ranges == [1, 1, 1]
        monkeypatch.setattr(winograd, "WORK_GRAIN", work // 2)
        products(x, w, g, 1, 1, ws)
        assert ranges[3:] == [2, 2, 2]
    finally:
        threads.configure(1)


def test_not_taken_when_it_does_not_apply():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 2, 8, 8)).astype(np.float32)
    w = rng.standard_normal((16, 16, 3, 3)).astype(np.float32)
    out = np.zeros((16, 2, 8, 8), np.float32)
    ws = np.zeros(1 << 16, np.float32)
    assert winograd.applies(x, w, out, 1, 1, ws)
    assert not winograd.applies(x.astype(np.float64), w.astype(np.float64), out.astype(np.float64), 1, 1,
                                ws.astype(np.float64))                                   # float64: reference
    assert not winograd.applies(x[:3], w[:, :3], out, 1, 1, ws)                          # Cin < MIN_CHANNELS
    assert not winograd.applies(x, w, out[:, :, :4, :4], 2, 1, ws)                       # stride 2
    assert not winograd.applies(x, w, out, 1, 1, ws[:winograd.per_sample(16, 16, 8, 8) - 1])   # no room
    room = ws[:winograd.per_sample(16, 16, 8, 8) + 32 * 16 * 16]
    assert winograd.applies(x, w, out, 1, 1, room, weight=True)
    assert not winograd.applies(x, w, out, 1, 1, room[:-1], weight=True)      # no room for the dU sums
    assert not winograd.applies(x.transpose(0, 1, 3, 2), w, out, 1, 1, ws)              # not C-contiguous


def test_only_the_fast_columns_take_it(monkeypatch):
    """The reference columns (what an engine with use_fast=False runs) never take Winograd, so
    the reference path's results stay im2col's bit for bit; the fast pair takes it."""
    import lowmem as lm

    assert conv.columns_for(np, fast=False) is conv.SLICES and not conv.SLICES.winograd
    assert conv.columns_for(np) is conv.NUMBA and conv.NUMBA.winograd
    calls = []
    real = winograd.conv3x3_forward
    monkeypatch.setattr(winograd, "conv3x3_forward", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 3, 16, 16)).astype(np.float32), rng.integers(0, 10, 8)
    grads = {}
    for fast_path in (False, True):
        net = lm.models.preact_resnet_cifar(depth=8, num_classes=10, in_channels=3, seed=0)
        eng = lm.Engine(net, batch_size=8, input_shape=(3, 16, 16), mode="approx", bits=4, use_fast=fast_path)
        assert eng.run.columns is (conv.NUMBA if fast_path else conv.SLICES)
        n = len(calls)
        eng.forward(x, y)
        eng.backward()
        assert (len(calls) > n) == fast_path
        grads[fast_path] = np.concatenate([p.grad.ravel() for p in net.parameters()])
    monkeypatch.setattr(winograd, "ENABLED", False)             # Winograd off everywhere: the same bits
    net = lm.models.preact_resnet_cifar(depth=8, num_classes=10, in_channels=3, seed=0)
    eng = lm.Engine(net, batch_size=8, input_shape=(3, 16, 16), mode="approx", bits=4, use_fast=False)
    eng.forward(x, y)
    eng.backward()
    np.testing.assert_array_equal(np.concatenate([p.grad.ravel() for p in net.parameters()]), grads[False])


def _same_bits(a, b):
    """Equal bit for bit: -0 is not +0 (assert_array_equal takes them as equal)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("C,H,W", [(16, 32, 32), (64, 8, 8), (3, 7, 5), (2, 1, 1), (2, 2, 3), (5, 6, 9),
                                   (4, 2, 2), (4, 4, 4), (3, 3, 3)])
def test_tile_kernels_match_their_numpy_references_bit_for_bit(C, H, W):
    """The numba tile transforms against winograd.*_reference (the same float32 operations in
    the same order): equal bit for bit, signed zeros included (the gradient tiles' padding row
    and column of an odd H or W give -0 where the reference negates a zero), for odd sizes,
    the small planes of DenseNet's last blocks and samples n0.. of a larger batch."""
    rng = np.random.default_rng(C * 100 + H * 10 + W)
    N, n0, ns = 5, 2, 3
    th, tw = winograd.tiles(H, W)
    x = rng.standard_normal((C, N, H, W)).astype(np.float32)
    V = np.full((16, C, ns * th * tw), np.nan, np.float32)
    winograd._input_tiles(V, x, n0)
    _same_bits(V, winograd.input_tiles_reference(x, n0, ns))
    Mg = np.full((16, C, ns * th * tw), np.nan, np.float32)
    winograd._gradient_tiles(Mg, x, n0)
    _same_bits(Mg, winograd.gradient_tiles_reference(x, n0, ns))
    M = rng.standard_normal((16, C, ns * th * tw)).astype(np.float32)
    for accumulate in (False, True):
        base = rng.standard_normal((C, N, H, W)).astype(np.float32)
        got, want = base.copy(), base.copy()
        winograd._output_tiles(got, M, n0, accumulate)
        winograd.output_tiles_reference(want, M, n0, accumulate)
        _same_bits(got, want)
        np.testing.assert_array_equal(got[:, :n0], base[:, :n0])    # other samples untouched
        np.testing.assert_array_equal(got[:, n0 + ns:], base[:, n0 + ns:])


def test_output_planes_apart_by_an_odd_number_of_lines(monkeypatch):
    """M's 16 planes (read side by side by _output_tiles) lie an odd number of 64-byte lines apart
    where rows*T would put them a multiple of 4 KiB apart, inside the workspace (a view, written
    through); without the room, or where they do not alias, as they come. The forward and the
    accumulating input gradient through the spaced planes equal the unspaced ones bit for bit, and
    _output_tiles on a spaced M equals its reference."""
    ws = np.zeros(16 * (64 * 256 + winograd.PLANE_GAP), np.float32)
    M = winograd._planes(ws, 64, 256)
    assert M.shape == (16, 64, 256) and np.shares_memory(M, ws)
    assert M.strides[0] % 64 == 0 and (M.strides[0] // 64) % 2 == 1
    M[15, 63, 255] = 7.0
    assert ws[15 * (64 * 256 + winograd.PLANE_GAP) + 64 * 256 - 1] == 7.0
    assert winograd._planes(ws[:16 * 64 * 256], 64, 256).flags.c_contiguous        # no room
    assert winograd._planes(ws, 63, 16).flags.c_contiguous                         # 63*16: an odd number of lines
    rng = np.random.default_rng(3)
    N, H = 3, 32
    x = rng.standard_normal((64, N, H, H)).astype(np.float32)
    w = (rng.standard_normal((64, 64, 3, 3)) * 0.05).astype(np.float32)
    base = rng.standard_normal((64, N, H, H)).astype(np.float32)
    ws = np.empty(1 << 21, np.float32)
    got = {}
    for gap in (1 << 40, winograd.PLANE_GAP):                 # 1 << 40: never spaced
        monkeypatch.setattr(winograd, "PLANE_GAP", gap)
        out, dx = np.empty_like(x), base.copy()
        winograd.conv3x3_forward(out, x, w, ws)
        winograd.conv3x3_backward_input(dx, x, w, ws, accumulate=True)
        got[gap] = out, dx
    for a, b in zip(*got.values()):
        _same_bits(a, b)
    th, tw = winograd.tiles(H, H)
    M = winograd._planes(np.empty(16 * (64 * th * tw + 16), np.float32), 64, th * tw)
    M[...] = rng.standard_normal(M.shape)
    assert not M.flags.c_contiguous
    for accumulate in (False, True):
        have, want = base.copy(), base.copy()
        winograd._output_tiles(have, M, 1, accumulate)
        winograd.output_tiles_reference(want, np.ascontiguousarray(M), 1, accumulate)
        _same_bits(have, want)


@pytest.mark.parametrize("C,H,W", [(8, 4, 4), (4, 7, 5), (16, 2, 2)])
def test_tile_kernels_in_either_plane_layout(C, H, W):
    """_input_tiles and _gradient_tiles write a tile's 16 planes at once where the planes lie an
    odd number of cache lines apart, and 4 at a time where they lie a multiple of 2 KiB apart
    (winograd.SET_BYTES: 8 or 16 planes to an L1 set): either way the reference's bits, and
    nothing between the planes is written."""
    rng = np.random.default_rng(C + H + W)
    N, n0, ns = 4, 1, 3
    th, tw = winograd.tiles(H, W)
    n = C * ns * th * tw
    x = rng.standard_normal((C, N, H, W)).astype(np.float32)
    want = {winograd._input_tiles: winograd.input_tiles_reference(x, n0, ns),
            winograd._gradient_tiles: winograd.gradient_tiles_reference(x, n0, ns)}
    apart = -(-n // 512) * 512 + 512                              # a multiple of 2 KiB, of 4 KiB or not
    odd = (-(-n // 16) | 1) * 16                                  # an odd number of 64-byte lines
    for stride in (apart, apart + 512, odd):
        for kernel, ref in want.items():
            buf = np.full(16 * stride, np.nan, np.float32)
            V = buf.reshape(16, stride)[:, :n].reshape(16, C, ns * th * tw)
            assert (V.strides[0] % winograd.SET_BYTES == 0) == (stride != odd)
            kernel(V, x, n0)
            _same_bits(np.ascontiguousarray(V), ref)
            assert np.isnan(buf.reshape(16, stride)[:, n:]).all()


def test_input_and_gradient_tiles_spaced_as_the_products(monkeypatch):
    """_pair spaces both stacks a chunk writes side by side (V and M, or V and Mg) as _planes
    does, the second after the first, inside the workspace; the tile transforms write into the
    spaced planes what their references give, and the weight gradient through them equals the
    unspaced one bit for bit."""
    n = 128 * 32                                           # 128 channels on 32 tiles: 16 KiB apart
    ws = np.zeros(16 * (n + winograd.PLANE_GAP) * 2, np.float32)
    V, M = winograd._pair(ws, 128, 128, 32, 16)
    for a in (V, M):
        assert np.shares_memory(a, ws) and a.strides[0] % 64 == 0 and (a.strides[0] // 64) % 2 == 1
    assert M.__array_interface__["data"][0] >= V[-1, -1, -1:].__array_interface__["data"][0] + 4
    a, b = winograd._pair(ws[:16 * n * 2], 128, 128, 32, 16)                   # no room: as they come
    assert a.flags.c_contiguous and b.flags.c_contiguous
    rng = np.random.default_rng(4)
    x = rng.standard_normal((128, 8, 8, 8)).astype(np.float32)
    winograd._input_tiles(V, x, 0)
    winograd._gradient_tiles(M, x, 0)
    np.testing.assert_array_equal(V, winograd.input_tiles_reference(x, 0, 2))        # 2 samples of 16 tiles
    np.testing.assert_array_equal(M, winograd.gradient_tiles_reference(x, 0, 2))
    g = rng.standard_normal((128, 8, 8, 8)).astype(np.float32)
    got = []
    for gap in (1 << 40, winograd.PLANE_GAP):
        monkeypatch.setattr(winograd, "PLANE_GAP", gap)
        dw = np.zeros((128, 128, 3, 3), np.float32)
        winograd.conv3x3_backward_weight(dw, x, g, np.empty(1 << 22, np.float32))
        got.append(dw)
    _same_bits(*got)


def _specials(rng, shape, zeros=False):
    """float32 values over many magnitudes, with signed zeros, infinities and NaNs mixed in;
    zeros: mostly signed zeros (where the order of a sum decides a zero's sign)."""
    if zeros:
        return rng.choice(np.array([-0.0, 0.0, -1.5, 1.5, np.inf, np.nan], np.float32), shape,
                          p=[0.45, 0.35, 0.08, 0.08, 0.02, 0.02])
    a = (rng.standard_normal(shape) * 10.0 ** rng.integers(-30, 30, shape)).astype(np.float32)
    u = rng.random(shape)
    a[u < 0.05], a[(u >= 0.05) & (u < 0.1)] = -0.0, 0.0
    a[(u >= 0.1) & (u < 0.11)], a[(u >= 0.11) & (u < 0.12)], a[(u >= 0.12) & (u < 0.13)] = np.inf, -np.inf, np.nan
    return a


def _same_bits(a, b):
    """Equal bit for bit, signed zeros included; NaN where the other is NaN (any payload)."""
    nan = np.isnan(a)
    np.testing.assert_array_equal(nan, np.isnan(b))
    assert a[~nan].tobytes() == b[~nan].tobytes()


@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("Co,Ci", [(3, 5), (16, 64), (40, 130), (2, 200)])
def test_filter_kernels_match_their_numpy_references_bit_for_bit(Co, Ci, zeros):
    """The numba filter transform (forward, and the flipped, transposed view the input gradient
    passes) and its adjoint (the weight gradient's dw += G^T dU G) against the float64 NumPy
    references, bit for bit on special values, on 1 and 2 threads (Cout split), blocks of
    input channels cut at odd places (FILTER_BLOCK)."""
    rng = np.random.default_rng(Co * 1000 + Ci)
    w = _specials(rng, (Co, Ci, 3, 3), zeros)
    dU = _specials(rng, (16, Co, Ci), zeros)
    base = _specials(rng, (Co, Ci, 3, 3), zeros)
    wb = w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)
    want_dw = base.copy()
    with np.errstate(all="ignore"):
        want_u, want_ub = winograd.filter_tiles_reference(w), winograd.filter_tiles_reference(wb)
        winograd.filter_gradient_reference(want_dw, dU)
    try:
        for t in (1, 2):
            threads.configure(t)
            old = winograd.FILTER_GRAIN
            winograd.FILTER_GRAIN = 1                       # split even these small filters
            try:
                _same_bits(winograd.filter_transform(w), want_u)
                _same_bits(winograd.filter_transform(wb), want_ub)
                dw = base.copy()
                winograd.filter_gradient_add(dw, dU)
                _same_bits(dw, want_dw)
            finally:
                winograd.FILTER_GRAIN = old
    finally:
        threads.configure(1)


def test_filter_references_against_the_float64_definitions():
    """U = G g G^T per filter and dw += G^T dU G (its adjoint: <U(w), dU> = <w, G^T dU G>), by
    matrix products in float64 (to float32 rounding)."""
    rng = np.random.default_rng(3)
    G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    dU = rng.standard_normal((16, 4, 3)).astype(np.float32)
    U = winograd.filter_tiles_reference(w)
    dw = np.zeros_like(w)
    winograd.filter_gradient_reference(dw, dU)
    for o in range(4):
        for c in range(3):
            np.testing.assert_allclose(U[:, o, c], (G @ w[o, c].astype(float) @ G.T).ravel(), rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(dw[o, c], G.T @ dU[:, o, c].reshape(4, 4).astype(float) @ G,
                                       rtol=1e-6, atol=1e-7)
    assert np.isclose(float(np.sum(U.astype(float) * dU)), float(np.sum(w.astype(float) * dw)), rtol=1e-5)


def test_tile_references_against_the_float64_definitions():
    """The references are the textbook transforms: B^T d B, A dy A^T and A^T m A per tile,
    computed here by matrix products in float64 (to float32 rounding)."""
    rng = np.random.default_rng(9)
    C, N, H, W = 3, 2, 5, 6
    th, tw = winograd.tiles(H, W)
    BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], float)
    A = np.array([[1, 0], [1, 1], [1, -1], [0, -1]], float)
    x = rng.standard_normal((C, N, H, W)).astype(np.float32)
    P = np.zeros((C, N, 2 * th + 2, 2 * tw + 2))
    P[:, :, 1:H + 1, 1:W + 1] = x
    D = np.zeros((C, N, 2 * th, 2 * tw))
    D[:, :, :H, :W] = x
    V, Mg = winograd.input_tiles_reference(x, 0, N), winograd.gradient_tiles_reference(x, 0, N)
    M = rng.standard_normal((16, C, N * th * tw)).astype(np.float32)
    out = np.zeros((C, N, H, W), np.float32)
    winograd.output_tiles_reference(out, M, 0, False)
    Y = np.zeros((C, N, 2 * th, 2 * tw))
    for s in range(N):
        for a in range(th):
            for b in range(tw):
                t = (s * th + a) * tw + b
                for c in range(C):
                    v = BT @ P[c, s, 2 * a:2 * a + 4, 2 * b:2 * b + 4] @ BT.T
                    np.testing.assert_allclose(V[:, c, t], v.ravel(), rtol=1e-6, atol=1e-6)
                    g = A @ D[c, s, 2 * a:2 * a + 2, 2 * b:2 * b + 2] @ A.T
                    np.testing.assert_allclose(Mg[:, c, t], g.ravel(), rtol=1e-6, atol=1e-6)
                    Y[c, s, 2 * a:2 * a + 2, 2 * b:2 * b + 2] = A.T @ M[:, c, t].reshape(4, 4).astype(float) @ A
    np.testing.assert_allclose(out, Y[:, :, :H, :W], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k, stride, pad", [(3, 1, 1), (3, 2, 1), (1, 1, 0), (7, 2, 3)])
def test_the_offsets_reference_equals_the_naive_loops(k, stride, pad):
    """The float64 reference used above (fast enough for real layer shapes) against
    tests/reference.py's conv_ref (naive loops), and its backward against a finite difference of it."""
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((3, 2, 9, 9)), rng.standard_normal((4, 3, k, k))
    out = ref_forward(x, w, stride, pad)
    np.testing.assert_allclose(out, conv_ref(x, w, stride, pad), rtol=1e-12, atol=1e-12)
    g = rng.standard_normal(out.shape)
    dx, dw = ref_backward(x, w, g, stride, pad)
    for arr, grad in ((x, dx), (w, dw)):
        d = rng.standard_normal(arr.shape)
        h = 1e-6
        arr += h * d
        up = float(np.sum(ref_forward(x, w, stride, pad) * g))
        arr -= 2 * h * d
        down = float(np.sum(ref_forward(x, w, stride, pad) * g))
        arr += h * d
        assert abs((up - down) / (2 * h) - float(np.sum(grad * d))) <= 1e-6 * abs(float(np.sum(grad * d))) + 1e-9
