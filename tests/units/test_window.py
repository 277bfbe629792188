"""The quantizer ladder: exact definitions -> simulated (float) -> packed.

Each property of the quantizer (docs/quantizer.md) is checked against its definition written out here
(the exact mask is the engine's expression), then the packed, chunked path
is checked to equal the simulated one bit for bit. The window's half-width
W = q.half_width(K) differs per bit width, so every property is checked for each
K on data and thresholds placed relative to *that* K's window.
"""
import fractions
import tracemalloc
import warnings

import numpy as np
import pytest

from lowmem.units import packing, stream, widths
from lowmem.units import window as q

DTYPES = (np.float64, np.float32)

# (gamma, beta) per channel: signs, zero (incl. -0.0), tiny, and thresholds
# t = -beta/gamma inside, at the edge of, and far outside the ±3 window
# (make_case scales beta by W/3, so for bits K they sit the same way
# relative to K's window ±W).
CASES = [
    (1.0, 0.0), (1.0, 0.5), (2.0, -1.0), (0.7, 2.1), (3.0, 0.1), (-1.0, 0.3),
    (-0.5, -0.2), (-2.0, 5.0), (-3.0, 0.1),
    (0.0, 1.0), (0.0, -1.0), (0.0, 0.0), (-0.0, 0.5),
    (1e-30, 1.0), (1e-30, -1.0), (-1e-30, 1.0), (-1e-30, -1.0), (1e-30, 0.0),
    (1e-30, 1e-30), (-1e-30, 2e-30), (1e-30, -2.9e-30),
    (1.0, 10.0), (1.0, -10.0), (-1.0, 10.0), (-1.0, -10.0),
    (1.0, 3.0), (1.0, -3.0), (1.0, 2.99), (1.0, -2.99), (-1.0, 2.9), (-1.0, -2.9),
    (0.01, 5.0), (0.01, -5.0), (-0.01, 5.0), (-0.01, -5.0), (1e-3, 1.0),
    (1.0, 1e6), (1.0, -1e6),
]


def window_edges(bits):
    """(gamma, beta) whose thresholds lie exactly on, half a bin inside and half a
    bin outside K's window ±W, and on the edge of the lo clip: for every sign of gamma."""
    W, w = q.half_width(bits), q.bin_width(bits)
    out = []
    for t in (W, W - w / 2, W + w / 2, W - w, 1.5 * W, W + 2 * w):
        for sg in (1.0, -1.0):
            out += [(sg, -sg * t), (sg, sg * t)]      # t and -t, both flips
    return out


def make_case(dtype, seed=0, m_random=200, bits=None):
    """gamma, beta (C,) and xhat (C, M): random values, values within a few
    ulps of each channel's threshold, and fixed far/edge values.

    bits=None: the ±3 window's case (W = 3). bits=K: the same case scaled by
    W/3 for K's window W (random and fixed x̂, the thresholds of CASES), plus
    thresholds on and next to ±W (window_edges) and x̂ at ±W, ±(W ∓ w/2)."""
    rng = np.random.default_rng(seed)
    scale = 1.0 if bits is None else q.half_width(bits) / 3
    edges = [] if bits is None else window_edges(bits)
    g = [c[0] for c in CASES] + list(rng.normal(size=8) * 2) + [e[0] for e in edges]
    b = ([c[1] * scale for c in CASES] + list(rng.normal(size=8) * 3 * scale)
         + [e[1] for e in edges])
    gamma, beta = np.array(g, dtype), np.array(b, dtype)
    C = gamma.size
    fixed = [0.0, -0.0] + [v * scale for v in (3.0, -3.0, 2.99, -2.99, 3.5, -3.5, 10.0, -10.0)] + [1e6, -1e6]
    if bits is not None:
        W, w = q.half_width(bits), q.bin_width(bits)
        fixed += [W, -W, W - w / 2, -(W - w / 2), W + w / 2, -(W + w / 2)]
    fixed = np.array(fixed, dtype)
    near = np.zeros((C, 9), dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        thr = -beta / gamma                       # the threshold in x̂ units
    for c in range(C):
        t = thr[c] if np.isfinite(thr[c]) else dtype(0)
        lo = hi = t
        near[c, 4] = t
        for j in range(1, 5):                     # t ± 1..4 ulps
            lo, hi = np.nextafter(lo, dtype(-np.inf)), np.nextafter(hi, dtype(np.inf))
            near[c, 4 - j], near[c, 4 + j] = lo, hi
    x = np.concatenate([(rng.normal(size=(C, m_random)) * 2 * scale).astype(dtype),
                        np.broadcast_to(fixed, (C, fixed.size)), near], axis=1)
    return gamma, beta, np.ascontiguousarray(x)


def exact_mask(xhat, gamma, beta):
    return (xhat * gamma[:, None]) + beta[:, None] > 0


def packed_roundtrip(xhat, gamma, beta, bits):
    qp = q.quant_params(gamma, beta, bits)
    packed = np.empty(packing.packed_nbytes(xhat.size, bits), np.uint8)
    q.quantize_pack(packed, xhat, qp)
    xt = np.empty_like(xhat)
    mask = np.empty(xhat.shape, bool)
    q.unpack_decode(xt, packed, qp, mask_out=mask)
    return packed, xt, mask, qp


# ---- property 1: the ReLU mask is exact -----------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", widths.BITS)
def test_mask_exact_every_element(dtype, bits):
    gamma, beta, x = make_case(dtype, bits=bits)
    want = exact_mask(x, gamma, beta)
    _, _, mask, qp = packed_roundtrip(x, gamma, beta, bits)
    np.testing.assert_array_equal(mask, want)
    # the mask really is carried by the codes: code >= k
    packed = np.empty(packing.packed_nbytes(x.size, bits), np.uint8)
    q.quantize_pack(packed, x, qp)
    codes = np.empty(x.shape, np.uint8)
    packing.unpack_codes(codes, packed, bits)
    np.testing.assert_array_equal(codes >= qp.k[:, None], want)
    assert codes.max() < 2 ** bits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", (None,) + widths.BITS)
def test_threshold_neighbourhood_is_really_tested(dtype, bits):
    # guard on make_case: the ±ulp columns straddle the threshold, so the
    # mask flips inside them for ordinary channels and the window-edge ones
    gamma, beta, x = make_case(dtype, bits=bits)
    near = exact_mask(x, gamma, beta)[:, -9:]
    edges = [] if bits is None else list(range(len(CASES) + 8, gamma.size))
    for c in list(range(9)) + edges:
        assert near[c].any() and not near[c].all(), (gamma[c], beta[c])


@pytest.mark.parametrize("bits", widths.BITS)
def test_one_sided_clamp_would_fail(bits):
    # why both sides are clamped: with beta/gamma far outside the window the
    # raw bin index alone puts elements on the wrong side of k
    scale = q.half_width(bits) / 3                  # the same picture for K's window
    gamma, beta = np.array([1.0, 1.0]), np.array([10.0, -10.0]) * scale
    x = np.array([[-5.0, 0.0, 2.0], [12.0, 2.0, -1.0]]) * scale
    qp = q.quant_params(gamma, beta, bits)
    raw = np.clip(np.floor((x * qp.s[:, None] - qp.lo[:, None]) / qp.w), 0, 2 ** bits - 1)
    assert ((raw >= qp.k[:, None]) != exact_mask(x, gamma, beta)).any()
    _, _, mask, _ = packed_roundtrip(x, gamma, beta, bits)
    np.testing.assert_array_equal(mask, exact_mask(x, gamma, beta))


# ---- property 2: bounded error, saturation ---------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", widths.BITS)
def test_error_bounded_inside_window(dtype, bits):
    gamma, beta, x = make_case(dtype, bits=bits)
    _, xt, _, qp = packed_roundtrip(x, gamma, beta, bits)
    w, W = qp.w, q.half_width(bits)
    assert qp.window == W and w == 2 * W / 2 ** bits
    tol = 64 * np.finfo(dtype).eps           # rounding of (u - lo)/w and of the decode
    inside = np.abs(x) <= W - w / 2           # covered for every gamma, beta
    err = np.abs(xt.astype(np.float64) - x.astype(np.float64))
    assert inside.sum() > x.size // 2
    assert err[inside].max() <= w / 2 + tol
    # decoded values never leave [-W, W]: outside the window codes saturate
    assert np.abs(xt).max() <= W + tol


@pytest.mark.parametrize("bits", widths.BITS)
def test_window_arithmetic_is_exact(bits):
    # K's window keeps the decode exact: (code + 0.5)*w, k*w and w/2 carry no
    # rounding in float32 or float64, so the one rounding of x̃ is the + lo
    W, w = q.half_width(bits), q.bin_width(bits)
    F = fractions.Fraction
    assert F(w) == F(W) * 2 / 2 ** bits and 0 < W < 16
    codes = np.arange(2 ** bits)
    for dt in DTYPES:
        assert F(float(dt(w))) == F(w) and F(float(dt(w) / 2)) == F(w) / 2
        mid = (codes.astype(dt) + dt(0.5)) * dt(w)
        kw = codes.astype(dt) * dt(w)
        assert [F(float(v)) for v in mid] == [F(2 * int(c) + 1, 2) * F(w) for c in codes]
        assert [F(float(v)) for v in kw] == [int(c) * F(w) for c in codes]
    qp = q.quant_params(np.ones(1), np.zeros(1), bits)
    assert (qp.window, qp.w) == (W, w)


@pytest.mark.parametrize("bad", [0.1, 3.01, 1 / 3, 4.03125, 0.0, -3.0, float("nan"), float("inf"), "3", None])
def test_window_rejects_inexact_or_bad(bad, monkeypatch):
    monkeypatch.setitem(q.WINDOWS, 4, bad)
    with pytest.raises(ValueError, match=r"window\.WINDOWS\[4\]") as e:
        q.half_width(4)
    assert repr(bad) in str(e.value)
    with pytest.raises(ValueError, match=r"window\.WINDOWS\[4\]"):
        q.quant_params(np.ones(2), np.zeros(2), 4)
    q.half_width(8)                                 # the other widths are unaffected


def test_window_accepts_quarter_multiples(monkeypatch):
    for W in (0.25, 2.75, 4.5, 7.75, 3):
        monkeypatch.setitem(q.WINDOWS, 8, W)
        assert q.half_width(8) == W and q.bin_width(8) == 2 * W / 256


@pytest.mark.parametrize("bits", widths.BITS)
def test_saturation_at_end_bins(bits):
    gamma, beta = np.array([1.0, -1.0]), np.array([0.0, 0.0])
    far = 2 * q.half_width(bits)                    # well beyond K's window
    x = np.array([[-1e6, -far, far, 1e6], [-1e6, -far, far, 1e6]])
    _, xt, _, qp = packed_roundtrip(x, gamma, beta, bits)
    L, w = 2 ** bits, qp.w
    first, last = qp.lo + 0.5 * w, qp.lo + (L - 0.5) * w   # end-bin midpoints, in u
    np.testing.assert_array_equal(xt[0], [first[0], first[0], last[0], last[0]])
    np.testing.assert_array_equal(xt[1], [-last[1], -last[1], -first[1], -first[1]])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", widths.BITS)
def test_grid_edge_on_threshold_and_centred(dtype, bits):
    gamma, beta, _ = make_case(dtype, bits=bits)
    qp = q.quant_params(gamma, beta, bits)
    L, w, W = 2 ** bits, qp.w, q.half_width(bits)
    nz = gamma != 0
    # gamma != 0: both sides keep a code; the window stays within w/2 of centred
    assert np.all((qp.k[nz] >= 1) & (qp.k[nz] <= L - 1))
    assert np.all(np.abs(qp.lo[nz] + W) <= w / 2 + 8 * np.finfo(dtype).eps)
    np.testing.assert_array_equal(qp.s, np.where(gamma < 0, -1, 1))
    # a threshold inside the window gets a bin edge on it (up to rounding)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        t = -beta.astype(np.float64) / np.abs(gamma.astype(np.float64))
    on = nz & (np.abs(t) < W - w / 2)
    assert on.sum() > 10
    np.testing.assert_allclose(qp.lo[on] + qp.k[on] * w, t[on], rtol=0, atol=16 * np.finfo(dtype).eps)
    # gamma == 0: plain centred grid, k says "always" (0) or "never" (L)
    np.testing.assert_array_equal(qp.lo[~nz], -W)
    np.testing.assert_array_equal(qp.k[~nz], np.where(beta[~nz] > 0, 0, L))


@pytest.mark.parametrize("bits", widths.BITS)
def test_gamma_zero_plain_grid(bits):
    rng = np.random.default_rng(1)
    W = q.half_width(bits)
    x = rng.normal(size=(2, 300)) * 2 * W / 3
    gamma, beta = np.array([0.0, 0.0]), np.array([0.7, -0.7])
    _, xt, mask, qp = packed_roundtrip(x, gamma, beta, bits)
    L, w = 2 ** bits, 2 * W / 2 ** bits
    want = -W + (np.clip(np.floor((x + W) / w), 0, L - 1) + 0.5) * w
    np.testing.assert_array_equal(xt, want)
    assert mask[0].all() and not mask[1].any()


# ---- property 3: deterministic, gamma/beta only ----------------------------

@pytest.mark.parametrize("bits", widths.BITS)
def test_deterministic_and_data_independent_grid(bits):
    gamma, beta, x = make_case(np.float32, bits=bits)
    p1, x1, m1, _ = packed_roundtrip(x, gamma, beta, bits)
    p2, x2, m2, _ = packed_roundtrip(x.copy(), gamma.copy(), beta.copy(), bits)
    np.testing.assert_array_equal(p1, p2)
    np.testing.assert_array_equal(x1, x2)
    # the grid depends on gamma, beta only: a column's code does not change
    # when the rest of the data is scaled
    x3 = x.copy()
    x3[:, 1:] *= 100
    p3, xt3, _, _ = packed_roundtrip(x3, gamma, beta, bits)
    np.testing.assert_array_equal(xt3[:, 0], x1[:, 0])


# ---- property 4: packing -----------------------------------------------------

@pytest.mark.parametrize("bits", widths.BITS)
@pytest.mark.parametrize("n", [1, 7, 8, 13, 1001])
@pytest.mark.parametrize("chunk", [8, 64, 1 << 16])
def test_pack_unpack_bit_exact(bits, n, chunk, monkeypatch):
    monkeypatch.setattr(packing, "CHUNK", chunk)
    rng = np.random.default_rng(n)
    codes = rng.integers(0, 2 ** bits, size=n, dtype=np.uint8)
    packed = np.empty(packing.packed_nbytes(n, bits), np.uint8)
    assert packed.size == -(-n * bits // 8)
    packing.pack_codes(packed, codes, bits)
    back = np.empty(n, np.uint8)
    packing.unpack_codes(back, packed, bits)
    np.testing.assert_array_equal(back, codes)
    # the layout itself: element i at bit (i % (8/K))*K of byte i // (8/K)
    per = 8 // bits
    i = np.arange(n)
    bit_of = (packed[i // per] >> ((i % per) * bits)) & (2 ** bits - 1)
    np.testing.assert_array_equal(bit_of, codes)
    # unused high bits of the last byte stay zero
    used = (n % per) * bits
    if used:
        assert packed[-1] >> used == 0


def test_pack_layout_examples():
    out = np.empty(2, np.uint8)
    packing.pack_codes(out, np.array([1, 2, 3, 0, 1], np.uint8), 2)
    assert out.tolist() == [1 | 2 << 2 | 3 << 4, 1]
    out = np.empty(1, np.uint8)
    packing.pack_codes(out, np.array([0xA, 0x5], np.uint8), 4)
    assert out.tolist() == [0x5A]
    bits1 = np.array([1, 0, 1, 1, 0, 0, 0, 1, 1, 1], np.uint8)
    out = np.empty(2, np.uint8)
    packing.pack_codes(out, bits1, 1)
    np.testing.assert_array_equal(out, np.packbits(bits1, bitorder="little"))


# ---- the ladder: packed == simulated, bit for bit ----------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", widths.BITS)
def test_packed_equals_simulated(dtype, bits):
    gamma, beta, x = make_case(dtype, seed=2, bits=bits)
    xs, ms = q.quantize_simulated(x, gamma, beta, bits)
    _, xt, mask, _ = packed_roundtrip(x, gamma, beta, bits)
    assert xs.dtype == dtype and xt.dtype == dtype
    np.testing.assert_array_equal(xt, xs)
    np.testing.assert_array_equal(mask, ms)
    np.testing.assert_array_equal(ms, exact_mask(x, gamma, beta))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", widths.BITS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (7, 13), (5, 1001), (1, 100)])
def test_chunk_size_does_not_change_results(dtype, bits, shape, monkeypatch):
    # small CHUNKs split rows (M > CHUNK) and span several short rows
    rng = np.random.default_rng(3)
    C, M = shape
    x = (rng.normal(size=shape) * 2).astype(dtype)
    gamma = (rng.normal(size=C) * np.where(np.arange(C) % 3 == 2, 0, 1)).astype(dtype)
    beta = (rng.normal(size=C) * 4).astype(dtype)
    ref = packed_roundtrip(x, gamma, beta, bits)
    xs, ms = q.quantize_simulated(x, gamma, beta, bits)
    for chunk in (8, 64, 24):
        monkeypatch.setattr(packing, "CHUNK", chunk)
        got = packed_roundtrip(x, gamma, beta, bits)
        for a, b in zip(got[:3], ref[:3]):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ref[1], xs)
    np.testing.assert_array_equal(ref[2], ms)


def test_accepts_channels_major_4d():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(3, 2, 5, 5))
    gamma, beta = np.array([1.0, -2.0, 0.0]), np.array([0.1, 0.2, 0.3])
    qp = q.quant_params(gamma, beta, 4)
    packed = np.empty(packing.packed_nbytes(x.size, 4), np.uint8)
    q.quantize_pack(packed, x, qp)
    xt = np.empty_like(x)
    q.unpack_decode(xt, packed, qp)
    xs, _ = q.quantize_simulated(x.reshape(3, -1), gamma, beta, 4)
    np.testing.assert_array_equal(xt.reshape(3, -1), xs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", widths.BITS)
def test_decode_relu(dtype, bits, monkeypatch):
    monkeypatch.setattr(packing, "CHUNK", 64)
    gamma, beta, x = make_case(dtype, bits=bits)
    packed, _, _, qp = packed_roundtrip(x, gamma, beta, bits)
    out = np.full_like(x, np.nan)
    q.decode_relu(out, packed, qp, gamma, beta)
    xs, ms = q.quantize_simulated(x, gamma, beta, bits)
    affine = (xs * gamma[:, None]) + beta[:, None]
    want = np.where(ms & (affine > 0), affine, 0)
    np.testing.assert_array_equal(out, want)
    assert not np.signbit(out).any()           # never negative, and +0 rather than -0
    # the rule changes only open elements decoded to the closed side (t beyond the window's
    # top: CASES' beta/gamma = -10, x-hat = ±1e6), and make_case has them
    changed = out != np.where(ms, affine, 0)
    assert changed.any() and ms[changed].all() and (affine[changed] < 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", widths.BITS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_conv_input_past_the_window(dtype, bits, sign):
    """The conv input rebuilt from the code is >= 0 on the open side and 0 on the closed side
    for every threshold, inside the window or far outside it on either side, for both signs of
    gamma; strictly positive where the threshold lies below the top bin's midpoint."""
    W, w = q.half_width(bits), q.bin_width(bits)
    ts = np.array([-1e6, -10 * W, -2 * W, -W - w, -W, 0.0, W - w, W, W + w / 4, W + w, 2 * W,
                   10 * W, 1e6])
    gamma = np.full(ts.size, sign * 0.5, dtype)
    beta = (-ts * 0.5).astype(dtype)            # t = -beta/|gamma|
    u = np.concatenate([np.linspace(-3, 3, 61) * W, ts[ts < 0] * 2, np.abs(ts) * 2])
    u = np.broadcast_to(u, (ts.size, u.size)) + ts[:, None] * 0   # the same u for every channel
    x = np.ascontiguousarray(sign * np.concatenate([u, (ts + 1e-3 * np.maximum(1, np.abs(ts)))[:, None]], axis=1),
                             dtype=dtype)       # x-hat = s*u; the last column is just past t
    packed, xt, mask, qp = packed_roundtrip(x, gamma, beta, bits)
    out = np.full_like(x, np.nan)
    q.decode_relu(out, packed, qp, gamma, beta)
    want_mask = exact_mask(x, gamma, beta)
    np.testing.assert_array_equal(mask, want_mask)
    assert want_mask[:, -1].all() and want_mask.any(axis=1).all() and (~want_mask).any()
    assert not np.signbit(out).any()            # >= 0 everywhere, +0 not -0
    assert (out[~want_mask] == 0).all()         # closed: 0
    top_mid = qp.lo + (2 ** bits - 0.5) * w     # in u units
    inside = ts < top_mid                       # the open side has a midpoint above t
    assert (out[inside][want_mask[inside]] > 0).all()
    # beyond the top midpoint every open element is rebuilt as 0 (the nearest value its side
    # allows): the bug was gamma*x-tilde + beta < 0, e.g. -0.5 at gamma=1, beta=-4, 4 bits
    assert inside.sum() >= 7 and (~inside).sum() >= 3
    assert (out[~inside] == 0).all()
    affine = (xt * gamma[:, None]) + beta[:, None]
    assert (affine[~inside][want_mask[~inside]] <= 0).all()     # = 0: t on the top midpoint


def test_conv_input_of_a_threshold_beyond_the_window():
    # gamma = 1, beta = -4, 4 bits: the open elements (x-hat > 4) used to be rebuilt as -0.5
    gamma, beta = np.array([1.0]), np.array([-4.0])
    x = np.array([[0.0, 3.9, 4.1, 5.0, 8.0, 1e3]])
    packed, xt, mask, qp = packed_roundtrip(x, gamma, beta, 4)
    assert (xt[0, 2:] * gamma + beta == -0.5).all()      # the decoded bin: 3.5 < t
    out = np.full_like(x, np.nan)
    q.decode_relu(out, packed, qp, gamma, beta)
    np.testing.assert_array_equal(out, np.zeros_like(x))
    np.testing.assert_array_equal(mask, x > 4)


# ---- stochastic rounding ------------------------------------------------------

def stochastic_roundtrip(xhat, gamma, beta, bits, key):
    qp = q.quant_params(gamma, beta, bits)
    packed = np.empty(packing.packed_nbytes(xhat.size, bits), np.uint8)
    q.quantize_pack(packed, xhat, qp, "stochastic-window", key)
    xt = np.empty_like(xhat)
    mask = np.empty(xhat.shape, bool)
    q.unpack_decode(xt, packed, qp, mask_out=mask)
    return packed, xt, mask, qp


def test_the_stream_is_splitmix64():
    # SplitMix64 seeded with 0: its published first outputs are mix64(i*phi), i = 1, 2, 3
    assert [stream.mix64(i * stream.GOLDEN) for i in (1, 2, 3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4,
                                                          0x06C45D188009454F]
    # random_offsets is that stream seeded with mix64(key), 24 bits, exact; no overflow warnings
    key = 0xFFFF_FFFF_FFFF_FFFF
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype in DTYPES:
            d = stream.random_offsets(key, 300, dtype, start=2 ** 40)
            want = [((stream.mix64(stream.mix64(key) + (i + 1) * stream.GOLDEN) >> 40) - 2 ** 23) / 2 ** 24
                    for i in range(2 ** 40, 2 ** 40 + 300)]
            assert d.dtype == dtype
            np.testing.assert_array_equal(d, np.array(want, dtype))
    d = stream.random_offsets(3, 1 << 16, np.float64)
    assert d.min() >= -0.5 and d.max() < 0.5 and (d * 2 ** 24 == np.round(d * 2 ** 24)).all()
    # uniform: 16 equal bins each within 5 standard deviations of 4096 draws
    counts = np.histogram(d, 16, (-0.5, 0.5))[0]
    assert (np.abs(counts - 4096) < 5 * np.sqrt(4096 * 15 / 16)).all(), counts


def test_stream_key():
    keys = {stream.stream_key(seed, step, unit) for seed in range(3) for step in range(20)
            for unit in range(10)}
    assert len(keys) == 3 * 20 * 10 and all(0 <= k < 2 ** 64 for k in keys)
    assert stream.stream_key(1, 2, 3) == stream.stream_key(np.int64(1), 2, 3)
    with pytest.raises(TypeError):
        stream.stream_key(1, 2, 3, 0)                    # no rank: the global index tells shards apart
    with pytest.raises(ValueError, match=r"key must be an integer in \[0, 2\*\*64\)"):
        stream.stream_key(-1, 0, 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", widths.BITS)
def test_stochastic_packed_equals_simulated(dtype, bits, monkeypatch):
    gamma, beta, x = make_case(dtype, seed=2, bits=bits)
    xs, ms = q.quantize_simulated(x, gamma, beta, bits, "stochastic-window", 12345)
    for chunk in (packing.CHUNK, 8, 24, 64):                  # pieces and chunks split rows
        monkeypatch.setattr(packing, "CHUNK", chunk)
        _, xt, mask, _ = stochastic_roundtrip(x, gamma, beta, bits, 12345)
        np.testing.assert_array_equal(xt, xs)
        np.testing.assert_array_equal(mask, ms)
    np.testing.assert_array_equal(ms, exact_mask(x, gamma, beta))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", widths.BITS)
def test_stochastic_mask_exact_on_every_draw(dtype, bits):
    # make_case: gamma of both signs, 0, -0, tiny; thresholds in, on the edge of and far outside
    # the window on both sides; x-hat within ulps of every threshold
    gamma, beta, x = make_case(dtype, bits=bits)
    want = exact_mask(x, gamma, beta)
    nearest = packed_roundtrip(x, gamma, beta, bits)[0]
    near_codes = np.empty(x.shape, np.uint8)
    packing.unpack_codes(near_codes, nearest, bits)
    differs = 0
    for draw in range(20):
        packed, _, mask, qp = stochastic_roundtrip(x, gamma, beta, bits, stream.stream_key(0, draw, 3))
        np.testing.assert_array_equal(mask, want)
        codes = np.empty(x.shape, np.uint8)
        packing.unpack_codes(codes, packed, bits)
        np.testing.assert_array_equal(codes >= qp.k[:, None], want)
        assert codes.max() < 2 ** bits
        differs += not np.array_equal(packed, nearest)
        if bits == 1:                   # one code per side where gamma != 0: nothing to choose
            np.testing.assert_array_equal(codes[gamma != 0], near_codes[gamma != 0])
    assert differs == 20          # the draws do round differently (at 1 bit: the gamma = 0 channels)


@pytest.mark.parametrize("bits", widths.BITS)
def test_stochastic_is_deterministic_per_key(bits):
    gamma, beta, x = make_case(np.float32, bits=bits)
    a = stochastic_roundtrip(x, gamma, beta, bits, 77)[0]
    b = stochastic_roundtrip(x, gamma, beta, bits, 77)[0]
    c = stochastic_roundtrip(x, gamma, beta, bits, 78)[0]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)     # at 1 bit through the gamma = 0 channels (both codes allowed)
    # nearest ignores the key; stochastic needs one
    qp = q.quant_params(gamma, beta, bits)
    n0, n1 = (np.empty(packing.packed_nbytes(x.size, bits), np.uint8) for _ in range(2))
    q.quantize_pack(n0, x, qp)
    q.quantize_pack(n1, x, qp, "nearest", 77)
    np.testing.assert_array_equal(n0, n1)
    with pytest.raises(ValueError, match="rounding='stochastic-window' needs a key"):
        q.quantize_pack(n0, x, qp, "stochastic-window")
    with pytest.raises(ValueError, match="rounding must be one of 'nearest', 'stochastic', 'dither', 'stochastic-window', got 'up'"):
        q.quantize_pack(n0, x, qp, "up", 1)
    for bad in (-1, 2 ** 64, 1.0, True, "1"):
        with pytest.raises(ValueError, match=r"key must be an integer in \[0, 2\*\*64\)"):
            q.quantize_simulated(x, gamma, beta, bits, "stochastic-window", bad)


def allowed_codes(x, gamma, beta, qp):
    """(lowest, highest) code each element's side of the threshold allows, (C, M) each."""
    L, k = qp.levels, qp.k[:, None]
    on = exact_mask(x, gamma, beta)
    return np.where(on, k, 0), np.where(on, L - 1, k - 1)


@pytest.mark.parametrize("bits", (8, 4, 2))
def test_stochastic_rounding_is_unbiased_within_the_window(bits):
    """E[x-tilde] = x-hat wherever u lies between the midpoints of the lowest and highest code its
    side of the threshold allows; elsewhere (within half a bin of the threshold, at and beyond
    the window's ends) every draw gives nearest rounding's code.

    Statistics: K = 400 draws (keys stream_key(0, draw, 0)). Per element the decoded value takes
    two neighbouring midpoints, the upper with probability p, so the mean's standard error is
    w*sqrt(p(1-p)/K); tolerance 6 standard errors plus 3 flips' worth (3w/K: the binomial's skew
    where K*p is small). Over all elements together, the mean deviation within 5 of its
    standard errors. Fixed data and keys: deterministic."""
    W, w, L = q.half_width(bits), q.bin_width(bits), 2 ** bits
    # gamma of both signs and 0; thresholds inside, beyond the top and below the bottom
    gamma = np.array([1.0, -0.7, 2.0, 1.0, -1.0, 1.0, 0.0, 0.0, -0.5])
    beta = np.array([0.3, -0.2, 1.1, -10 * W, -10 * W, 10 * W, 1.0, -1.0, 0.8]) * np.abs(gamma + (gamma == 0))
    rng = np.random.default_rng(11)
    x = rng.uniform(-W - 2 * w, W + 2 * w, (gamma.size, 600))
    # and elements within half a bin of each threshold (beyond the window: saturated ones)
    sgn = np.where(gamma < 0, -1.0, 1.0)
    t = np.where(gamma == 0, 0.0, -beta / np.abs(gamma + (gamma == 0)))
    near = sgn[:, None] * (t[:, None] + w * np.array([-0.45, -0.3, -0.1, 0.1, 0.3, 0.45]))
    x = np.concatenate([x, near], axis=1)
    qp = q.quant_params(gamma, beta, bits)
    K = 400
    total = np.zeros_like(x)
    nearest, _ = q.quantize_simulated(x, gamma, beta, bits)
    want_mask = exact_mask(x, gamma, beta)
    all_nearest = np.ones(x.shape, bool)
    for draw in range(K):
        xt, mask = q.quantize_simulated(x, gamma, beta, bits, "stochastic-window", stream.stream_key(0, draw, 0))
        np.testing.assert_array_equal(mask, want_mask)
        total += xt
        all_nearest &= xt == nearest
    mean = total / K
    # classify by u = s*x-hat against the allowed end codes' midpoints (a 1e-9 band left out)
    s, lo = qp.s[:, None], qp.lo[:, None]
    u = x * s
    cmin, cmax = allowed_codes(x, gamma, beta, qp)
    mid = lambda c: lo + (c + 0.5) * w
    eps = 1e-9
    inside = (u > mid(cmin) + eps) & (u < mid(cmax) - eps)
    outside = (u < mid(cmin) - eps) | (u > mid(cmax) + eps)
    assert inside.sum() > 1000 and outside.sum() > 100
    # every kind of channel has elements inside (cases: t in, above, below the window; gamma 0)
    assert inside.any(axis=1).all()
    # outside: deterministic, nearest rounding's code on every draw
    assert all_nearest[outside].all()
    # inside: unbiased
    p = ((u - lo) / w - 0.5) % 1.0
    se = w * np.sqrt(p * (1 - p) / K)
    dev = np.abs(mean - x)
    tol = 6 * se + 3 * w / K
    assert (dev[inside] <= tol[inside]).all(), (dev - tol)[inside].max()
    agg = (mean - x)[inside].mean()
    agg_se = np.sqrt((se[inside] ** 2).sum()) / inside.sum()
    assert abs(agg) <= 5 * agg_se, (agg, agg_se)
    # the test has power: nearest rounding (deterministic midpoints) fails it on most elements
    assert ((np.abs(nearest - x) > tol)[inside]).mean() > 0.5


def test_stochastic_bias_regions_are_half_a_bin_at_the_threshold():
    # an element in (t, t + w/2) always gets code k (decoded t + w/2), whatever the key;
    # one in (t + w/2, t + w) gets k or k+1 depending on the key
    bits, w = 4, q.bin_width(4)
    gamma, beta = np.array([1.0]), np.array([-0.6])         # t = 0.6 inside the window
    qp = q.quant_params(gamma, beta, bits)
    t = 0.6
    x = np.array([[t + w / 8, t + 3 * w / 8, t + 5 * w / 8, t + 7 * w / 8]])
    codes = []
    for draw in range(200):
        packed = np.empty(packing.packed_nbytes(4, bits), np.uint8)
        q.quantize_pack(packed, x, qp, "stochastic-window", draw)
        c = np.empty(4, np.uint8)
        packing.unpack_codes(c, packed, bits)
        codes.append(c)
    codes = np.array(codes) - qp.k[0]
    assert (codes[:, :2] == 0).all()
    assert set(codes[:, 2]) == {0, 1} and set(codes[:, 3]) == {0, 1}
    assert codes[:, 2].mean() < codes[:, 3].mean()          # p = 1/8 vs 3/8


# ---- memory: scratch bounded by CHUNK, not by the array ---------------------

def test_scratch_bounded_by_chunk():
    C, M = 16, 1 << 16                              # 8 MiB of float64
    rng = np.random.default_rng(5)
    x = rng.normal(size=(C, M))
    gamma, beta = rng.normal(size=C), rng.normal(size=C)
    bits = 4
    qp = q.quant_params(gamma, beta, bits)
    packed = np.empty(packing.packed_nbytes(x.size, bits), np.uint8)
    xt = np.empty_like(x)
    mask = np.empty(x.shape, bool)
    bound = 24 * packing.CHUNK + (1 << 16)               # ~20 B per chunk element + slack
    assert bound < x.nbytes / 4
    tracemalloc.start()
    try:
        for call in (lambda: q.quantize_pack(packed, x, qp),
                     lambda: q.unpack_decode(xt, packed, qp, mask_out=mask),
                     lambda: q.decode_relu(xt, packed, qp, gamma, beta)):
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            call()
            peak = tracemalloc.get_traced_memory()[1] - base
            assert peak < bound, (peak, bound)
        # stochastic rounding: + three uint64 arrays of CHUNK (the stream)
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        q.quantize_pack(packed, x, qp, "stochastic-window", 5)
        peak = tracemalloc.get_traced_memory()[1] - base
        assert peak < bound + 24 * packing.CHUNK, (peak, bound)
    finally:
        tracemalloc.stop()


# ---- bad input -----------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, 3, 16, -1, "4", 4.0, None, True])
def test_check_bits_rejects(bad):
    with pytest.raises(ValueError, match=r"bits must be one of \{1, 2, 4, 8\}") as e:
        widths.check_bits(bad)
    assert repr(bad) in str(e.value)


def test_check_bits_accepts_ints():
    for b in (1, 2, 4, 8, np.int64(4), np.uint8(2)):
        assert widths.check_bits(b) == int(b) and type(widths.check_bits(b)) is int
    assert packing.packed_nbytes(13, 1) == 2 and packing.packed_nbytes(13, 8) == 13
    assert packing.packed_nbytes(0, 4) == 0


def test_bad_shapes_and_dtypes():
    g, b = np.ones(3), np.zeros(3)
    with pytest.raises(ValueError, match="share dtype"):
        q.quant_params(g, b.astype(np.float32), 4)
    with pytest.raises(ValueError, match="equal shape"):
        q.quant_params(g, np.zeros(4), 4)
    qp = q.quant_params(g, b, 4)
    x = np.zeros((3, 10))
    with pytest.raises(ValueError, match="packed_out must be uint8 of shape \\(15,\\)"):
        q.quantize_pack(np.empty(14, np.uint8), x, qp)
    packed = np.empty(15, np.uint8)
    with pytest.raises(ValueError, match="dtype float64"):
        q.quantize_pack(packed, x.astype(np.float32), qp)
    with pytest.raises(ValueError, match="C=3"):
        q.quantize_pack(packed, np.zeros((5, 6)), qp)
    with pytest.raises(ValueError, match="C-contiguous"):
        q.quantize_pack(packed, np.zeros((10, 3)).T, qp)
    q.quantize_pack(packed, x, qp)
    with pytest.raises(ValueError, match="float"):
        q.unpack_decode(np.zeros((3, 10), np.int32), packed, qp)
    with pytest.raises(ValueError, match="mask_out"):
        q.unpack_decode(np.zeros((3, 10)), packed, qp, mask_out=np.zeros((3, 10), np.uint8))
