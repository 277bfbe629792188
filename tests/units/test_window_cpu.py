"""The numba kernels (lowmem/units/window_cpu.py) against the NumPy reference ops and quantizer."""
import numpy as np
import pytest

from lowmem.units import cpu_base, packing, stream, widths, window
from lowmem.system import threads
from lowmem.units import window_cpu as fast
from lowmem.ops import bn_relu_apply_forward, bn_relu_backward
from reference import beyond_window_channels, bn_normalize_forward, unit_case

pytestmark = pytest.mark.skipif(not fast.AVAILABLE, reason="numba not installed")

F = np.float32


def unit(C=6, M=1024, seed=0):
    """float32 unit data (reference.unit_case); M > fast.BLOCK and not a multiple of it (see
    `long_rows`) crosses block boundaries inside a row."""
    return unit_case(F, C, M, seed)


def stats(x):
    C = x.shape[0]
    mean, var, rstd = (np.empty(C, F) for _ in range(3))
    fast.bn_stats(mean, var, rstd, x, 1e-5)
    return mean, var, rstd


def test_stats_match_numpy():
    x, _, _ = unit()
    mean, var, rstd = stats(x)
    ref = [np.empty(x.shape[0], F) for _ in range(3)]
    bn_normalize_forward(np.empty_like(x), *ref, x, 1e-5)
    for a, b in zip((mean, var, rstd), ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bits", widths.BITS)
def test_grid_equals_quant_params(bits):
    """window_cpu.quant_params: window.quant_params' s, lo and k bit for bit, over γ from 1e-40
    (t = -β/|γ| overflows to ±inf) to 1e4, zeros of both signs and negative γ; a non-finite γ
    or β, or float64, takes the reference."""
    rng = np.random.default_rng(bits)
    for _ in range(50):
        C = int(rng.integers(1, 300))
        g = (rng.standard_normal(C) * 10.0 ** rng.integers(-40, 5, C)).astype(F)
        b = (rng.standard_normal(C) * 10.0 ** rng.integers(-6, 6, C)).astype(F)
        g[rng.random(C) < 0.1] = 0
        g[rng.random(C) < 0.05] = -0.0
        for gg, bb in ((g, b), (g.astype(np.float64), b.astype(np.float64))):
            ref, got = window.quant_params(gg, bb, bits), fast.quant_params(gg, bb, bits)
            for f in ("s", "lo", "k", "gamma", "beta"):
                x, y = getattr(ref, f), getattr(got, f)
                assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), f
    g, b = np.ones(4, F), np.zeros(4, F)
    g[2] = np.nan
    with np.errstate(invalid="ignore"):             # the reference's cast of NaN's k
        assert np.array_equal(fast.quant_params(g, b, bits).k, window.quant_params(g, b, bits).k)


def test_a_code_set_remembers_a_units_grid_until_its_parameters_change():
    """FusedCodeUnits.grid (asked by a unit's forward, conv input and backward in one step): the
    grid made for a unit's γ, β is given again while their bytes are unchanged, and made anew
    (window.quant_params' grid) after an in-place change of either, as the optimizer's step makes;
    units with other parameter arrays get their own."""
    from lowmem.units import fused
    rng = np.random.default_rng(5)
    units = fused.FusedCodeUnits(fast, 4)
    g, b = rng.standard_normal(64).astype(F), rng.standard_normal(64).astype(F)
    g2, b2 = rng.standard_normal(64).astype(F), rng.standard_normal(64).astype(F)
    first = units.grid(g, b)
    assert units.grid(g, b) is first and units.grid(g2, b2) is not first
    for change in (lambda: g.__setitem__(3, -g[3]), lambda: b.__setitem__(7, b[7] + 1)):
        change()
        got, ref = units.grid(g, b), window.quant_params(g, b, 4)
        assert got is not first
        for f in ("s", "lo", "k", "gamma", "beta"):
            assert getattr(got, f).tobytes() == getattr(ref, f).tobytes(), f
        first = got
    assert units.grid(g.astype(np.float64), b.astype(np.float64)).dtype == np.float64


def test_forward_exact_matches_numpy_given_same_stats():
    x, g, b = unit()
    mean, var, rstd = stats(x)
    xhat, out = np.empty_like(x), np.empty_like(x)
    fast.unit_forward_exact(out, xhat, x, mean, rstd, g, b)
    ref_xhat = (x - mean[:, None]) * rstd[:, None]
    ref_out = np.empty_like(x)
    bn_relu_apply_forward(ref_out, ref_xhat, g, b)
    assert np.array_equal(xhat, ref_xhat) and np.array_equal(out, ref_out)


@pytest.mark.parametrize("bits", widths.BITS)
@pytest.mark.parametrize("naive", [False, True])
def test_forward_code_equals_numpy_quantizer(bits, naive):
    x, g, b = unit(seed=bits)
    mean, var, rstd = stats(x)
    xhat = (x - mean[:, None]) * rstd[:, None]
    qp = window.quant_params(g, b, bits)
    packed = np.empty(packing.packed_nbytes(x.size, bits), np.uint8)
    out = x.copy()
    fast.unit_forward_code(out, packed, out, mean, rstd, g, b, qp, naive)   # in place, like the engine
    ref = np.empty_like(packed)
    window.quantize_pack(ref, xhat, qp)
    assert np.array_equal(packed, ref)
    ref_out = np.empty_like(x)
    if naive:
        window.decode_relu(ref_out, ref, qp, g, b)
    else:
        bn_relu_apply_forward(ref_out, xhat, g, b)
    assert np.array_equal(out, ref_out)


@pytest.mark.parametrize("bits", widths.BITS)
def test_conv_input_equals_decode_relu(bits):
    x, g, b = unit(seed=10 + bits)
    mean, var, rstd = stats(x)
    xhat = (x - mean[:, None]) * rstd[:, None]
    qp = window.quant_params(g, b, bits)
    packed = np.empty(packing.packed_nbytes(x.size, bits), np.uint8)
    window.quantize_pack(packed, xhat, qp)
    u, ref = np.empty_like(x), np.empty_like(x)
    fast.conv_input(u, None, packed, qp, g, b)
    window.decode_relu(ref, packed, qp, g, b)
    assert np.array_equal(u, ref)
    assert not np.signbit(u).any()              # >= 0, and +0 rather than -0
    # the data reach the beyond-the-window case: open elements whose bin midpoint gives
    # gamma*x-tilde + beta < 0 (gamma > 0 and < 0), rebuilt as 0
    xs, ms = window.quantize_simulated(xhat, g, b, bits)
    for c in beyond_window_channels(x.shape[0]):
        assert (ms[c] & (xs[c] * g[c] + b[c] < 0)).any(), c
    fast.conv_input(u, xhat, None, None, g, b)
    bn_relu_apply_forward(ref, xhat, g, b)
    assert np.array_equal(u, ref)


@pytest.mark.parametrize("bits", [None, 8, 4, 1])
@pytest.mark.parametrize("accumulate", [False, True])
def test_backward_matches_numpy(bits, accumulate):
    x, g, b = unit(seed=20)
    rng = np.random.default_rng(1)
    mean, var, rstd = stats(x)
    xhat = (x - mean[:, None]) * rstd[:, None]
    dr = rng.standard_normal(x.shape).astype(F)
    base = rng.standard_normal(x.shape).astype(F)
    C = x.shape[0]
    if bits is None:
        qp, packed, xt, mask = None, None, xhat, None
    else:
        qp = window.quant_params(g, b, bits)
        packed = np.empty(packing.packed_nbytes(x.size, bits), np.uint8)
        window.quantize_pack(packed, xhat, qp)
        xt, mask = np.empty_like(x), np.empty(x.shape, bool)
        window.unpack_decode(xt, packed, qp, mask_out=mask)
    dx, dg, db = base.copy(), np.zeros(C, F), np.zeros(C, F)
    fast.unit_backward(dx, dg, db, dr.copy(), xhat, packed, qp, g, b, rstd, accumulate)
    rdx, rdg, rdb = base.copy(), np.zeros(C, F), np.zeros(C, F)
    bn_relu_backward(rdx, rdg, rdb, dr.copy(), xt, g, b, rstd, relu_mask=mask, accumulate=accumulate)
    np.testing.assert_allclose(dg, rdg, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(db, rdb, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(dx, rdx, rtol=1e-4, atol=1e-4 * np.abs(rdx).max())


def test_supports():
    assert fast.supports(np, "float32", 1024, 4)
    assert not fast.supports(np, "float64", 1024, 4)
    assert not fast.supports(np, "float32", 3, 4)      # 12 bits: rows not byte-aligned


# ---- block boundaries, the engine's aliasing, threads ----------------------------------------

@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def long_rows(request, monkeypatch):
    """Rows of 2.5 blocks (partial last block), split over 1 or 2 lowmem threads (SPLIT_WORK
    lowered so these small arrays are split too); the thread setting is restored afterwards."""
    before = threads.threads()
    threads.configure(request.param)
    monkeypatch.setattr(cpu_base, "SPLIT_WORK", 64)
    yield 5 * fast.BLOCK // 2 + 8
    threads.configure(before)


@pytest.fixture(params=[(1, "long"), (2, "long"), (1, "short"), (2, "short"), (2, "shortest")],
                ids=["long rows, 1 thread", "long rows, 2 threads", "short rows, 1 thread", "short rows, 2 threads",
                     "rows of 8, 2 threads"])
def rows(request, monkeypatch):
    """(C, M): rows of 2.5 blocks (partial last block; long_rows), or short rows whose codes the
    kernels pack and unpack a block's worth of rows at a time (64 rows of 64, 512 rows of 8) in
    a number of rows that leaves a partial last batch, split over 1 or 2 lowmem threads (a
    range may start inside a batch)."""
    before = threads.threads()
    threads.configure(request.param[0])
    monkeypatch.setattr(cpu_base, "SPLIT_WORK", 64)
    yield {"long": (5, 5 * fast.BLOCK // 2 + 8), "short": (150, 64), "shortest": (1100, 8)}[request.param[1]]
    threads.configure(before)


@pytest.mark.parametrize("bits", widths.BITS)
@pytest.mark.parametrize("inplace", [True, False])
def test_codes_cross_blocks_and_threads(rows, bits, inplace):
    """Codes, outputs and decodes stay bit-exact across block, row-batch and thread-range
    boundaries, with the forward in place (out is x, as the engine runs bn2/bn3) or not (bn1)."""
    C, M = rows
    x, g, b = unit(C=C, M=M, seed=30 + bits)
    mean, var, rstd = stats(x)
    xhat = (x - mean[:, None]) * rstd[:, None]
    qp = window.quant_params(g, b, bits)
    packed, ref = (np.empty(packing.packed_nbytes(x.size, bits), np.uint8) for _ in range(2))
    out = x.copy() if inplace else np.full_like(x, np.nan)
    fast.unit_forward_code(out, packed, out if inplace else x, mean, rstd, g, b, qp, False)
    window.quantize_pack(ref, xhat, qp)
    assert np.array_equal(packed, ref)
    ref_out = np.empty_like(x)
    bn_relu_apply_forward(ref_out, xhat, g, b)
    assert np.array_equal(out, ref_out)
    u, ref_u = np.empty_like(x), np.empty_like(x)
    fast.conv_input(u, None, packed, qp, g, b)
    window.decode_relu(ref_u, packed, qp, g, b)
    assert np.array_equal(u, ref_u)
    xh2, out2 = np.empty_like(x), x.copy()
    fast.unit_forward_exact(out2, xh2, out2, mean, rstd, g, b)
    assert np.array_equal(xh2, xhat) and np.array_equal(out2, ref_out)


@pytest.mark.parametrize("bits", [None, 4, 2])
@pytest.mark.parametrize("accumulate", [False, True])
def test_backward_in_place_across_blocks_and_threads(rows, bits, accumulate):
    """dx may be dr itself (the engine's in-place case when not accumulating)."""
    C, M = rows
    x, g, b = unit(C=C, M=M, seed=40)
    rng = np.random.default_rng(2)
    mean, var, rstd = stats(x)
    xhat = (x - mean[:, None]) * rstd[:, None]
    dr = rng.standard_normal(x.shape).astype(F)
    if bits is None:
        qp, packed, xt, mask = None, None, xhat, None
    else:
        qp = window.quant_params(g, b, bits)
        packed = np.empty(packing.packed_nbytes(x.size, bits), np.uint8)
        window.quantize_pack(packed, xhat, qp)
        xt, mask = np.empty_like(x), np.empty(x.shape, bool)
        window.unpack_decode(xt, packed, qp, mask_out=mask)
    C = x.shape[0]
    prior = rng.standard_normal(x.shape).astype(F)
    dx = prior.copy() if accumulate else dr.copy()      # not accumulating: dx is the gradient buffer
    dg, db = np.zeros(C, F), np.zeros(C, F)
    fast.unit_backward(dx, dg, db, dx if not accumulate else dr.copy(), xhat, packed, qp, g, b, rstd, accumulate)
    rdx, rdg, rdb = prior.copy(), np.zeros(C, F), np.zeros(C, F)
    bn_relu_backward(rdx, rdg, rdb, dr.copy(), xt, g, b, rstd, relu_mask=mask, accumulate=accumulate)
    np.testing.assert_allclose(dg, rdg, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(db, rdb, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(dx, rdx, rtol=1e-4, atol=1e-4 * np.abs(rdx).max())


def test_stats_across_threads(long_rows):
    x, _, _ = unit(C=7, M=long_rows)
    mean, var, rstd = stats(x)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(mean, x64.mean(axis=1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(var, x64.var(axis=1), rtol=1e-5)


# ---- col2im ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k,stride,pad,H,W", [(3, 1, 1, 7, 6), (3, 2, 1, 7, 7), (1, 2, 0, 6, 5),
                                              (7, 2, 3, 9, 8), (3, 1, 0, 5, 5), (1, 1, 0, 4, 4)])
def test_col2im_equals_numpy_reference(dtype, k, stride, pad, H, W):
    """The numba col2im adds each element's terms in the reference's order: bit-identical,
    here into samples 2..4 of a 6-sample gradient (the per-thread range case)."""
    from lowmem.ops import columns_cpu, conv
    rng = np.random.default_rng(k * 10 + stride)
    Cin, N, n0, n = 3, 6, 2, 3
    Ho, Wo = conv.conv_out_size(H, k, stride, pad), conv.conv_out_size(W, k, stride, pad)
    cols = rng.standard_normal((Cin, k, k, n, Ho, Wo)).astype(dtype)
    base = rng.standard_normal((Cin, N, H, W)).astype(dtype)
    ref, got = base.copy(), base.copy()
    conv.col2im_add(ref[:, n0:n0 + n], cols, k, k, stride, pad)
    assert columns_cpu.supports(got, cols)
    columns_cpu.col2im_add(got, cols, k, k, stride, pad, n0)
    assert np.array_equal(got, ref)
    assert not columns_cpu.supports(got[:, 1:], cols)    # a strided dx takes the reference path
    assert conv.columns_for(np) is conv.NUMBA
    picked = base.copy()                                 # what a conv on the numba columns runs
    conv.NUMBA.col2im(picked, n0, n0 + n, cols, k, k, stride, pad)   # (a 1x1 stride-1 block: NumPy's add)
    assert np.array_equal(picked, ref)


# ---- stochastic rounding: the same codes as window.quantize_pack for the same key --------------

@pytest.mark.parametrize("bits", widths.BITS)
@pytest.mark.parametrize("naive", [False, True])
@pytest.mark.parametrize("inplace", [True, False])
def test_stochastic_codes_equal_numpy_across_blocks_and_threads(long_rows, bits, naive, inplace):
    """rounding="stochastic-window": the numba codes (and naive's decoded output) equal
    window.quantize_pack's for the same key bit for bit, with rows of 2.5 blocks split over
    threads (the stream counts the global element index c*M + i); another key gives other codes,
    the same key the same ones, and the mask stays exact."""
    x, g, b = unit(C=5, M=long_rows, seed=50 + bits)
    mean, var, rstd = stats(x)
    xhat = (x - mean[:, None]) * rstd[:, None]
    qp = window.quant_params(g, b, bits)
    key = stream.stream_key(7, 3, 2)
    packed, ref = (np.empty(packing.packed_nbytes(x.size, bits), np.uint8) for _ in range(2))
    out = x.copy() if inplace else np.full_like(x, np.nan)
    fast.unit_forward_code(out, packed, out if inplace else x, mean, rstd, g, b, qp, naive, "stochastic-window", key)
    window.quantize_pack(ref, xhat, qp, "stochastic-window", key)
    assert np.array_equal(packed, ref)
    ref_out = np.empty_like(x)
    if naive:
        window.decode_relu(ref_out, ref, qp, g, b)
    else:
        bn_relu_apply_forward(ref_out, xhat, g, b)       # approx: the forward is exact still
    assert np.array_equal(out, ref_out)
    xt, mask = np.empty_like(x), np.empty(x.shape, bool)
    window.unpack_decode(xt, packed, qp, mask_out=mask)
    assert np.array_equal(mask, (xhat * g[:, None]) + b[:, None] > 0)
    near = np.empty_like(packed)
    window.quantize_pack(near, xhat, qp)
    again, other = np.empty_like(packed), np.empty_like(packed)
    fast.unit_forward_code(np.empty_like(x), again, x, mean, rstd, g, b, qp, naive, "stochastic-window", key)
    fast.unit_forward_code(np.empty_like(x), other, x, mean, rstd, g, b, qp, naive, "stochastic-window", key + 1)
    assert np.array_equal(again, packed) and not np.array_equal(other, packed)
    assert not np.array_equal(near, packed)


def test_the_code_sets_round_stochastically_alike():
    """FusedCodeUnits(cpu, rounding="stochastic-window") and CodeUnits(rounding="stochastic-window"): the same
    saved codes and conv input for the same key; forward without a key is refused."""
    from lowmem.units import fused
    from lowmem.units.reference import CodeUnits
    x, g, b = unit(C=6, M=2048, seed=60)
    C, M = x.shape
    mean, var, rstd = stats(x)
    got = {}
    for name, units in (("ref", CodeUnits(2, rounding="stochastic-window")),
                        ("numba", fused.FusedCodeUnits(fast, 2, rounding="stochastic-window"))):
        shape, dt = units.saved_entry(C, M, F)
        slot, out, u = np.zeros(shape, dt), np.empty_like(x), np.empty_like(x)
        with pytest.raises(ValueError, match="needs a key"):
            units.forward(out, units.saved_view(slot, C, M), x, mean, rstd, g, b)
        units.forward(out, units.saved_view(slot, C, M), x, mean, rstd, g, b, key=99)
        units.conv_input(u, units.saved_view(slot, C, M), g, b)
        got[name] = (slot, out, u)
    for a, c in zip(got["ref"], got["numba"]):
        assert np.array_equal(a, c)
    with pytest.raises(ValueError, match="rounding must be"):
        CodeUnits(4, rounding="floor")


def test_a_unit_kernel_call_splits_by_its_cost(monkeypatch):
    """cpu_base._over_channels gives each thread at least SPLIT_WORK copies' worth of work: a
    kernel of cost k splits C rows of M elements only where C*M*k holds 2*SPLIT_WORK, and the
    ranges cover the rows once, in order; and the long_rows fixture's 2-thread case does split."""
    before = threads.threads()
    threads.configure(2)
    try:
        def ranges(C, M, cost):
            got = []
            cpu_base._over_channels(lambda c0, c1: got.append((c0, c1)), C, M, cost)
            return sorted(got)
        work = cpu_base.SPLIT_WORK
        assert ranges(8, work // 8, 1) == [(0, 8)]                  # one thread's worth: not split
        assert ranges(16, work // 8, 1) == [(0, 8), (8, 16)]        # two threads' worth
        assert ranges(16, work // 8, 0.5) == [(0, 16)]              # a cheaper kernel: not yet
        assert ranges(8, work // 8, 2) == [(0, 4), (4, 8)]          # a dearer one: already
        monkeypatch.setattr(cpu_base, "SPLIT_WORK", 64)
        assert ranges(5, 5 * fast.BLOCK // 2 + 8, COST_LEAST) == [(0, 2), (2, 5)]
    finally:
        threads.configure(before)


COST_LEAST = min(fast.COST.values())
