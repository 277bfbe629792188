"""The unbiased group-range code (rounding="stochastic", lowmem/units/unbiased.py), and its
dithered draw (rounding="dither": the same levels, a decoder that subtracts each element's draw).

* E[x̃ | x̂] = x̂ in the threshold's half-bins, beyond the fixed window and in between, on both
  sides of the threshold; the fixed-window stochastic code fails the same test;
* the ReLU mask is exact on every draw (γ > 0, γ < 0, γ = 0, t inside and outside the data,
  an all-zero and a constant channel); the lowest open level rebuilds a conv input of exactly 0;
* the packed slot decodes bit for bit what quantize_simulated computes, for any chunking, and a
  shard keyed by its global place draws the codes the whole batch draws there;
* the group ends are bf16, rounded outward; the slot's bytes are what the plan counts;
* the systematic draws keep each lane's count of round-ups within one of its expectation and
  cut the variance of group sums against independent draws;
* the dithered code's error is uniform on ±step/2 whatever x̂, it keeps every property above
  (unbiased, exact mask, packed = simulated, shards, numba = reference) and halves the gradient's
  draw variance through the engine.
"""
import numpy as np
import pytest

from lowmem import units
from lowmem.units import packing, stream, unbiased, window
from lowmem.units.stream import Stream

W2 = window.WINDOWS[2]          # the fixed window's half-width at 2 bits
HALF = window.bin_width(2) / 2   # half a bin of the fixed window at 2 bits


def region_bias(x, gamma, beta, bits, rounding, K=400, seed=0):
    """{region: (mean error, its standard error)} of x̃ − x over the elements of each region and K
    draws (keys stream_key(seed, d, 0), d < K), every draw's mask checked exact. Regions (at t = 0):
    the threshold's half-bins of the fixed window (open, closed), beyond the fixed window's reach
    (|x| > W − w/2; open, closed) and in between. The standard error is the spread over draws of
    each draw's mean over the region, over sqrt(K): the draws are independent (their keys), the
    elements of one draw need not be (the dithered code's Weyl sequence ties a group's together)."""
    a = np.abs(x)
    regions = {"half-bin open": (x > 0) & (a < HALF), "half-bin closed": (x <= 0) & (a < HALF),
               "beyond open": x > W2 - HALF, "beyond closed": x < -(W2 - HALF),
               "between": (a >= HALF) & (a <= W2 - HALF)}
    per_draw = np.empty((K, len(regions)))
    for d in range(K):
        xt, mask = units.quantize_simulated(x, gamma, beta, bits, rounding, stream.stream_key(seed, d, 0))
        assert np.array_equal(mask, (x * gamma[:, None]) + beta[:, None] > 0)
        per_draw[d] = [(xt - x)[sel].mean() for sel in regions.values()]
    return {name: (per_draw[:, i].mean(), per_draw[:, i].std(ddof=1) / np.sqrt(K)) for i, name in enumerate(regions)}


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 4096)) * 1.3          # tails well beyond ±2.5
    return x, np.array([1.0, 1.0]), np.array([0.0, 0.0])   # t = 0


@pytest.mark.parametrize("rounding", ["stochastic", "dither"])
def test_unbiased_in_every_region(data, rounding):
    """Seed 0 (keys stream_key(0, d, 0), d < 400). Tolerance: |mean error| < 4 standard errors
    in each of the 5 regions (a false alarm about 1e-4 per region: t with 399 degrees of freedom).
    Measured over seeds 0-29 with 200 draws each: per region, the z-scores' mean −0.11 to 0.09
    and spread 0.96-1.12 for the dithered code, −0.11 to 0.10 and 0.92-1.14 for the stochastic
    one (as for unbiased codes: mean 0, spread 1)."""
    for name, (mean, se) in region_bias(*data, 2, rounding).items():
        assert abs(mean) < 4 * se, (name, mean, se)


def test_the_window_code_fails_the_same_test(data):
    """The same statistics for the fixed-window stochastic code: biased by many standard errors in
    the threshold half-bins (open up, closed down) and beyond the window (clipped inward)."""
    r = region_bias(*data, 2, "stochastic-window")
    assert r["half-bin open"][0] > 10 * r["half-bin open"][1]
    assert r["half-bin closed"][0] < -10 * r["half-bin closed"][1]
    assert r["beyond open"][0] < -10 * r["beyond open"][1]
    assert r["beyond closed"][0] > 10 * r["beyond closed"][1]


@pytest.mark.parametrize("variant", ["offset without its half", "offset from r at 6 bits"])
def test_a_biased_dither_fails_the_same_test(data, monkeypatch, variant):
    """The same statistics (seed 0, 400 draws, 4 standard errors) catch a decoder whose offsets
    are biased, in every region: d = −r (the 1/2 forgotten: −step/2; measured z −790 to −2,190),
    and d = 1/2 − r with r cut to 6 bits (a decoder that keeps fewer of the draw's bits than the
    encoder: +step/128 on average; z 12.7 to 34.0)."""
    plain = unbiased.dither_piece

    def biased(*args, **kw):
        d = plain(*args, **kw)
        if variant == "offset without its half":
            return d - 0.5
        r = 0.5 - d
        return 0.5 - np.floor(r * 64) / 64
    monkeypatch.setattr(unbiased, "dither_piece", biased)
    r = region_bias(*data, 2, "dither")
    flagged = [name for name, (mean, se) in r.items() if abs(mean) >= 4 * se]
    assert flagged == list(r), r            # every region


CASES = {   # name: (gamma, beta) of one channel; x drawn standard normal (some channels replaced)
    "gamma>0 t inside": (1.3, 0.4), "gamma<0 t inside": (-0.8, 0.3), "gamma=0 beta>0": (0.0, 0.5),
    "gamma=0 beta<=0": (0.0, -0.2), "t below the data": (1.0, 9.0), "t above the data": (1.0, -9.0),
    "gamma<0 t beyond": (-2.0, -30.0), "tiny gamma": (1e-30, 0.5),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dither", [False, True])
def test_mask_exact_on_every_draw_and_conv_input(dtype, bits, dither):
    rng = np.random.default_rng(3)
    C = len(CASES) + 2
    M = 700                                          # groups of 256, 256 and 188
    x = rng.standard_normal((C, M)).astype(dtype)
    x[-2] = 0                                        # an all-zero channel
    x[-1] = dtype(0.75)                              # a constant one
    gamma = np.array([g for g, _ in CASES.values()] + [1.0, -1.0], dtype)
    beta = np.array([b for _, b in CASES.values()] + [0.0, 1.0], dtype)
    mask = (x * gamma[:, None]) + beta[:, None] > 0
    slot = np.zeros(unbiased.slot_nbytes(C, M, bits, dither), np.uint8)
    xt, u = np.empty_like(x), np.empty_like(x)
    for d in range(8):
        key = stream.stream_key(4, d, 1)
        unbiased.quantize_pack(slot, x, gamma, beta, bits, key, dither)
        got = {}
        unbiased.decode_each_chunk(xt, slot, gamma, beta, bits, dither=dither,
                                   extra=lambda ob, op, r0, r1, c0, c1: got.setdefault((r0, c0), op.copy()))
        decoded = np.zeros_like(mask)
        for (r0, c0), op in got.items():
            decoded[r0:r0 + op.shape[0], c0:c0 + op.shape[1]] = op
        assert np.array_equal(decoded, mask)
        sim, smask = unbiased.quantize_simulated(x, gamma, beta, bits, key, draws="dither" if dither else None)
        assert np.array_equal(xt, sim) and np.array_equal(smask, mask)
        unbiased.decode_each_chunk(u, slot, gamma, beta, bits, relu=True, dither=dither)
        assert (u[~mask] == 0).all() and np.isfinite(u).all()
        if dither:      # the open elements' conv input is γ·x̃ + β itself, negative where the dither takes it below t
            rebuilt = xt * gamma[:, None] + beta[:, None]
            assert np.allclose(u[mask], rebuilt[mask], rtol=1e-5, atol=1e-5 * (1 + np.abs(beta).max()))
        else:
            assert (u >= 0).all()
            assert (xt * gamma[:, None] + beta[:, None] >= -1e-5 * np.abs(beta[:, None]) - 1e-6)[mask].all()
    # constant and zero channels decode exactly
    np.testing.assert_array_equal(xt[-2], 0)
    np.testing.assert_array_equal(xt[-1], x[-1])


def test_lowest_open_level_rebuilds_exactly_zero():
    """An open element just above t, drawn to its lowest level (code k): conv input exactly 0."""
    # p = 0.05/2 for the element at 0.05: over 50 copies and 20 draws both levels all but surely
    x = np.array([[0.05, 0.3, 1.0, -0.5, -1.5, 2.0] * 50], np.float32)
    gamma, beta = np.array([1.0], np.float32), np.array([0.0], np.float32)
    seen = set()
    slot = np.zeros(unbiased.slot_nbytes(1, x.shape[1], 2), np.uint8)
    u = np.empty_like(x)
    for d in range(20):
        unbiased.quantize_pack(slot, x, gamma, beta, 2, d)
        unbiased.decode_each_chunk(u, slot, gamma, beta, 2, relu=True)
        seen.update(u[0, ::6].tolist())              # the element at 0.05: 0 or the top level
    assert 0.0 in seen and len(seen) == 2


@pytest.mark.parametrize("M", [1000, 701])          # rows on code bytes (grouped blocks), or not (pieces)
@pytest.mark.parametrize("chunk", [8, 64, 264, 1 << 16])
@pytest.mark.parametrize("dither", [False, True])
def test_packed_equals_simulated_for_any_chunking(chunk, M, dither, monkeypatch):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, M)).astype(np.float32)
    gamma, beta = np.array([0.7, -1.1, 0.0], np.float32), np.array([0.1, 0.4, 0.3], np.float32)
    want, mask = unbiased.quantize_simulated(x, gamma, beta, 2, 99, draws="dither" if dither else None)
    relu_want = np.empty_like(x)
    monkeypatch.setattr(packing, "CHUNK", 1 << 16)
    slot = np.zeros(unbiased.slot_nbytes(3, M, 2, dither), np.uint8)
    unbiased.quantize_pack(slot, x, gamma, beta, 2, 99, dither)
    unbiased.decode_each_chunk(relu_want, slot, gamma, beta, 2, relu=True, dither=dither)
    monkeypatch.setattr(packing, "CHUNK", chunk)
    again = np.zeros_like(slot)
    unbiased.quantize_pack(again, x, gamma, beta, 2, 99, dither)
    np.testing.assert_array_equal(again, slot)
    got, relu, seen = np.empty_like(x), np.empty_like(x), np.zeros(x.shape, bool)

    def check_mask(ob, open_, r0, r1, c0, c1):
        np.testing.assert_array_equal(open_, mask[r0:r1, c0:c1])
        seen[r0:r1, c0:c1] = True
    unbiased.decode_each_chunk(got, slot, gamma, beta, 2, extra=check_mask, dither=dither)
    unbiased.decode_each_chunk(relu, slot, gamma, beta, 2, relu=True, dither=dither)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(relu, relu_want)
    assert seen.all()


def test_a_shard_draws_what_the_whole_batch_draws_there():
    """Rows of 2 shards of 512 elements (whole groups): each shard, keyed by its global place,
    gets bit for bit the codes the whole batch gets for those elements."""
    rng = np.random.default_rng(6)
    C, M = 3, 1024
    x = rng.standard_normal((C, M))
    gamma, beta = rng.standard_normal(C), rng.standard_normal(C) * 0.3
    key = stream.stream_key(1, 7, 2)
    for bits, draws in ((2, None), (4, None), (2, "dither")):     # systematic, each element's own, dithered
        whole, _ = unbiased.quantize_simulated(x, gamma, beta, bits, key, draws=draws)
        for r in range(2):
            part = np.ascontiguousarray(x[:, r * 512:(r + 1) * 512])
            got, _ = unbiased.quantize_simulated(part, gamma, beta, bits, Stream(key, start=r * 512, row=M),
                                                 draws=draws)
            if r == 0:
                assert not np.array_equal(got, whole[:, 512:])
            np.testing.assert_array_equal(got, whole[:, r * 512:(r + 1) * 512])
    # the window code too, for any split
    whole, _ = window.quantize_simulated(x, gamma, beta, 2, "stochastic-window", key)
    part = np.ascontiguousarray(x[:, 300:])
    got, _ = window.quantize_simulated(part, gamma, beta, 2, "stochastic-window", Stream(key, 300, M))
    np.testing.assert_array_equal(got, whole[:, 300:])
    with pytest.raises(ValueError, match="does not fit in a global row"):
        window.quantize_simulated(part, gamma, beta, 2, "stochastic-window", Stream(key, 400, M))


def _levels_and_p(x, gamma, beta, bits):
    """(Levels, p, mask) of x (C, M): p = (u − base)/step on each element's side."""
    C, M = x.shape
    ends = np.empty((C, unbiased.groups(M), 2), np.uint16)
    unbiased.metadata(ends, x, gamma)
    lv = unbiased.Levels(ends, gamma, beta, bits)
    mask = (x * gamma[:, None]) + beta[:, None] > 0
    bo, so, bc, sc = lv.piece(0, C, 0, M)
    base, step = np.where(mask, bo, bc), np.where(mask, so, sc)
    p = np.where(step > 0, (x * lv.s[:, None] - base) / np.where(step > 0, step, 1), 0)
    return lv, p, mask


@pytest.mark.parametrize("M", [1000, 768])            # a longer last group (488), or none
def test_systematic_draws_keep_each_lane_and_sides_count(M):
    """Along each lane (a group's elements l, l + 4, l + 8, ...) of each side the number of
    elements rounded up stays within one of Σ f, f the fractions of p: on every draw, for any
    data (independent draws miss it by up to 8 here)."""
    rng = np.random.default_rng(3)
    C = 3
    x = rng.standard_normal((C, M)) * np.array([[1.0], [2.0], [0.5]])
    gamma, beta = np.array([1.0, -0.7, 1.3]), np.array([0.2, 0.1, -0.5])
    lv, p, mask = _levels_and_p(x, gamma, beta, 2)
    worst = {"systematic": 0.0, "independent": 0.0}
    for draws in worst:
        for d in range(5):
            code = unbiased._encode_piece(x, lv, 0, C, 0, M, unbiased.resolve(stream.stream_key(2, d, 0), M),
                                          draws=draws)
            up = code - np.where(mask, lv.k[:, None], 0) - np.floor(p)
            assert set(np.unique(up)) <= {0.0, 1.0}
            f = p - np.floor(p)
            for gi in range(unbiased.groups(M)):
                g0 = gi * unbiased.GROUP
                for lane in range(unbiased.LANES):
                    cols = np.arange(g0 + lane, unbiased.group_end(g0, M), unbiased.LANES)
                    for side in (True, False):
                        sel = mask[:, cols] == side
                        gap = np.abs((up[:, cols] * sel).sum(axis=1) - (f[:, cols] * sel).sum(axis=1))
                        worst[draws] = max(worst[draws], gap.max())
    assert worst["systematic"] <= 1 + 1e-6
    assert worst["independent"] > 2


def test_only_the_2_bit_code_draws_systematically():
    """The packed code's draws: systematic at 2 bits (unbiased.SYSTEMATIC_BITS), each element's
    own from 3 bits up (the codes those widths had before the walk)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 700))
    gamma, beta = np.array([1.0, -1.5]), np.array([0.1, 0.4])
    key = stream.stream_key(8, 1, 0)
    for bits in (2, 4, 8):
        packed, _ = unbiased.quantize_simulated(x, gamma, beta, bits, key)
        want = unbiased.default_draws(bits)
        assert want == ("systematic" if bits == 2 else "independent")
        other = {"systematic": "independent", "independent": "systematic"}[want]
        np.testing.assert_array_equal(packed, unbiased.quantize_simulated(x, gamma, beta, bits, key, draws=want)[0])
        assert not np.array_equal(packed, unbiased.quantize_simulated(x, gamma, beta, bits, key, draws=other)[0])


def test_systematic_draws_cancel_the_group_sums_error():
    """Fixed seed: over 200 draws, the error of each group's sum of x̃ (open and closed apart)
    has under a quarter of the variance independent draws give (measured: 0.026 of it),
    while each element's mean stays x̂ (test_unbiased_in_every_region)."""
    rng = np.random.default_rng(11)
    C, M = 2, 1024
    x = rng.standard_normal((C, M))
    gamma, beta = np.array([1.0, 0.8]), np.array([0.0, 0.3])
    mask = (x * gamma[:, None]) + beta[:, None] > 0
    var = {}
    for draws in ("systematic", "independent"):
        sums = []
        for d in range(200):
            xt, _ = unbiased.quantize_simulated(x, gamma, beta, 2, stream.stream_key(5, d, 1), draws=draws)
            e = (xt - x).reshape(C, -1, unbiased.GROUP)
            m = mask.reshape(C, -1, unbiased.GROUP)
            sums.append(np.stack([(e * m).sum(axis=2), (e * ~m).sum(axis=2)]))
        var[draws] = np.var(np.stack(sums), axis=0).mean()
    assert var["systematic"] < 0.25 * var["independent"], var
    with pytest.raises(ValueError, match="draws must be one of"):
        unbiased.quantize_simulated(x, gamma, beta, 2, 0, draws="antithetic")


@pytest.mark.parametrize("M", [64, 256, 600, 6272, 25088])
def test_a_rows_last_group_takes_the_remainder(M):
    """floor(M/256) groups a row (at least 1), the last running to the row's end: its ends hold
    the remainder's elements too, and the group ends cost at most 32 bits per 256 elements in a
    row of 256 or more (6,272, a 7x7 map at batch 128: 24 groups, 2.1224 bits per element at 2
    bits where 25 groups of at most 256 would be 2.1276)."""
    G = unbiased.groups(M)
    assert G == max(1, M // 256)
    assert unbiased.group_end((G - 1) * 256, M) == M and unbiased.group_start(M - 1, M) == (G - 1) * 256
    C = 3
    ends_bits = (unbiased.slot_nbytes(C, M, 2) - unbiased._code_bytes(C, M, 2)) * 8 / (C * M)
    assert ends_bits == 32 * G / M
    if M >= 256:
        assert ends_bits <= 32 / 256
    rng = np.random.default_rng(9)
    x = rng.standard_normal((C, M))
    x[:, -1] = 40.0                                 # the row's last element: in the last group
    gamma, beta = np.array([1.0, -1.0, 0.5]), np.array([0.2, 0.1, -0.3])
    xt, mask = unbiased.quantize_simulated(x, gamma, beta, 2, 5, draws="dither")
    ends = np.empty((C, G, 2), np.uint16)
    unbiased.metadata(ends, x, gamma)
    hi = unbiased.bf16_value(ends[:, -1, 0], np.float64) * np.where(gamma < 0, -1, 1)
    lo = unbiased.bf16_value(ends[:, -1, 1], np.float64) * np.where(gamma < 0, -1, 1)
    np.testing.assert_array_equal(np.maximum(np.abs(hi), np.abs(lo)) >= 40.0, True)
    assert np.abs(xt[:, -1] - 40.0).max() < 40.0                  # coded within its group's range


def test_group_ends_are_bf16_rounded_outward():
    rng = np.random.default_rng(8)
    for dtype in (np.float32, np.float64):
        v = (rng.standard_normal(2000) * 3).astype(dtype)
        up, down = unbiased.bf16_value(unbiased.bf16_up(v), dtype), unbiased.bf16_value(unbiased.bf16_down(v), dtype)
        assert (up >= v).all() and (down <= v).all()
        assert (up - down <= np.abs(v) * 2 ** -7 + 1e-38).all()          # one bf16 step at most
        exact = unbiased.bf16_value(unbiased.bf16_up(up), dtype)          # bf16 values stay put
        np.testing.assert_array_equal(exact, up)
    C, M = 2, 600                     # groups [0, 256) and [256, 600): the last takes the rest
    x = rng.standard_normal((C, M)).astype(np.float32)
    gamma, beta = np.array([1.0, -1.0], np.float32), np.array([0.2, 0.1], np.float32)
    ends = np.empty((C, 2, 2), np.uint16)
    unbiased.metadata(ends, x, gamma)
    u = x * np.where(gamma < 0, -1, 1)[:, None]
    for g, sl in enumerate((slice(0, 256), slice(256, M))):
        hi, lo = (unbiased.bf16_value(ends[:, g, i], np.float32) for i in (0, 1))
        assert (hi >= u[:, sl].max(axis=1)).all() and (lo <= u[:, sl].min(axis=1)).all()
        assert (hi - u[:, sl].max(axis=1) <= np.abs(hi) * 2 ** -7).all()     # within one bf16 step
    np.testing.assert_array_equal(unbiased.split(gamma, beta, 2), [2, 2])


def test_slot_bytes_and_bad_input():
    # 2 bits: 2 + 4*8/256 = 2.125 bits per element
    C, M = 16, 4096
    assert unbiased.slot_nbytes(C, M, 2) == C * M // 4 + 4 * C * M // 256
    assert 8 * unbiased.slot_nbytes(C, M, 2) / (C * M) == 2.125
    assert unbiased.metadata_nbytes(C, M, 2) == unbiased.slot_nbytes(C, M, 2) - C * M // 4
    assert unbiased.slot_nbytes(C, M, 2, dither=True) == unbiased.slot_nbytes(C, M, 2) + 24     # its stream
    x = np.zeros((C, M), np.float32)
    g = np.ones(C, np.float32)
    with pytest.raises(ValueError, match="needs bits >= 2"):
        unbiased.quantize_simulated(x, g, g, 1, 5)
    with pytest.raises(ValueError, match="rounding='stochastic' needs a key"):
        unbiased.quantize_simulated(x, g, g, 2, None)
    with pytest.raises(ValueError, match="slot must be uint8 of at least"):
        unbiased.quantize_pack(np.zeros(10, np.uint8), x, g, g, 2, 5)


# ---- through the engine -------------------------------------------------------

@pytest.mark.parametrize("use_fast", [False, None])
@pytest.mark.parametrize("rounding", ["stochastic", "dither"])
def test_engine_unbiased_codes_are_the_slot_of_quantize_pack(use_fast, rounding):
    """Engine(rounding="stochastic"): the forward is exact mode's bit for bit; every unit's slot is
    unbiased.quantize_pack's with the key stream_key(seed, step, unit index), on the reference and
    the fused (numba forward) sets alike; the plan counts the group ends and the summary shows
    the bits per element with them; a training step runs."""
    import copy
    from lowmem.core.engine import Engine
    from lowmem.models import preact_resnet_cifar
    from lowmem.train.optim import SGD
    net = preact_resnet_cifar(8)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 3, 16, 16)).astype(np.float32), rng.integers(0, 10, 4)
    exact = Engine(copy.deepcopy(net), 4, (3, 16, 16), "exact", use_fast=use_fast)
    eng = Engine(copy.deepcopy(net), 4, (3, 16, 16), "approx", 2, rounding=rounding, seed=3,
                 use_fast=use_fast)
    dither = rounding == "dither"
    assert eng.fused == exact.fused
    eng.step = 2
    assert exact.forward(x, y)[0] == eng.forward(x, y)[0]
    for i, u in enumerate(eng.unit_bits):
        xhat = exact.arrays[exact.saved_slots[u][0]]
        g, b = (exact.net.params[n].data for n in (u + ".weight", u + ".bias"))
        slot = eng.arrays[eng.saved_slots[u][0]]
        want = np.zeros_like(slot)
        unbiased.quantize_pack(want, np.ascontiguousarray(xhat), g, b, 2, stream.stream_key(3, 2, i), dither)
        assert np.array_equal(slot, want), u
        c, h, w = eng.in_shape[u]
        assert slot.nbytes == unbiased.slot_nbytes(c, 4 * h * w, 2, dither)
    assert ("unbiased dithered rounding" if dither else "unbiased stochastic rounding") in eng.summary()
    assert "bits/elem" in eng.summary()
    assert 2.125 <= eng.bits_per_element() < 2.2
    assert "bits/elem" in str(eng.schedule)
    eng.backward()
    grads = [p.grad.copy() for p in eng.net.parameters()]
    assert all(np.isfinite(g).all() for g in grads) and any(np.abs(g).max() > 0 for g in grads)
    SGD(eng.net.parameters(), lr=0.1).step()


def mean_gradient_distance(rounding, draws, seed=0):
    """Pre-act ResNet-8 in float64 on one batch: the gradient averaged over `draws` training steps'
    codes (no update in between: the same weights and batch, new draws each step), its distance from
    the exact gradient in units of its own standard error sqrt(sum_i var_i / draws)."""
    import copy
    from lowmem.core.engine import Engine
    from lowmem.models import preact_resnet_cifar
    net = preact_resnet_cifar(8, seed=1)
    rng = np.random.default_rng(seed)
    N, shape = 16, (3, 8, 8)
    x, y = rng.standard_normal((N,) + shape), rng.integers(0, 10, N)
    exact = Engine(copy.deepcopy(net), N, shape, "exact", dtype="float64")
    exact.forward(x, y)
    exact.backward()
    g0 = np.concatenate([p.grad.ravel() for p in exact.net.parameters()])
    eng = Engine(copy.deepcopy(net), N, shape, "approx", 2, dtype="float64", rounding=rounding, seed=seed)
    gs = []
    for _ in range(draws):
        eng.forward(x, y)
        eng.backward()
        gs.append(np.concatenate([p.grad.ravel() for p in eng.net.parameters()]))
    gs = np.array(gs)
    se = np.sqrt(gs.var(axis=0, ddof=1).sum() / draws)
    return np.linalg.norm(gs.mean(axis=0) - g0) / se


def test_gradients_averaged_over_draws_converge_to_the_exact_gradient():
    """Seed 0, 40 draws. For an unbiased code the squared distance of the mean from the exact
    gradient is about the sum of the draws' variances over the draws, i.e. the ratio is ~1
    (measured 1.10; seed 1: 1.05); tolerance: below 2. The fixed-window stochastic code is about
    5x outside (measured 5.38 and 5.27) and must be above 3.5."""
    unbiased_ratio = mean_gradient_distance("stochastic", 40)
    dither_ratio = mean_gradient_distance("dither", 40)
    window_ratio = mean_gradient_distance("stochastic-window", 40)
    assert unbiased_ratio < 2, unbiased_ratio
    assert dither_ratio < 2, dither_ratio
    assert window_ratio > 3.5, window_ratio


def test_the_engine_keys_each_rank_by_its_global_place_and_refuses_a_split_dependent_resume():
    """Rank r of R draws from Stream(stream_key(seed, step, unit), r*n*H*W, R*n*H*W); a resume on
    another world size is refused when a unit's per-rank rows are not whole groups of 256."""
    import copy
    from lowmem.core.engine import Engine
    from lowmem.models import preact_resnet_cifar
    from lowmem.system import distributed
    from lowmem.train import trainstate

    class Rank1(distributed.Communicator):
        rank, size = 1, 2

        def allreduce(self, a):            # stands in for rank 0 sending the same values
            a *= 2

    net = preact_resnet_cifar(8)
    eng = Engine(copy.deepcopy(net), 4, (3, 8, 8), "approx", 2, rounding="stochastic", seed=9, comm=Rank1())
    rng = np.random.default_rng(0)
    eng.forward(rng.standard_normal((4, 3, 8, 8)).astype(np.float32), rng.integers(0, 10, 4))
    for i, u in enumerate(eng.unit_bits):
        c, h, w = eng.in_shape[u]
        assert eng.run.keys[u] == Stream(stream.stream_key(9, 0, i), 4 * h * w, 8 * h * w)
    assert eng.split_dependent_units(64) == [] and "bn_final" in eng.split_dependent_units(4)

    class Config:
        rounding, mode, batch = "stochastic", "approx", 8
    meta = {"world_size": 2}
    trainstate.check_world_size(meta, Config, 2, eng.split_dependent_units, "run/c.ckpt")   # same world: fine
    with pytest.raises(trainstate.ResumeError, match=r"cannot resume from run/c.ckpt on 1 rank\(s\): it was "
                                                     r"saved on 2 with rounding='stochastic'.*not whole groups"):
        trainstate.check_world_size(meta, Config, 1, eng.split_dependent_units, "run/c.ckpt")
    Config.batch = 256                                  # whole groups on 1 and on 2 ranks: fine
    trainstate.check_world_size(meta, Config, 1, eng.split_dependent_units, "run/c.ckpt")
    Config.rounding, Config.batch = "stochastic-window", 8     # the window code never depends on the split
    windowed = Engine(copy.deepcopy(net), 4, (3, 8, 8), "approx", 2, rounding="stochastic-window", comm=Rank1(),
                    allocate=False)
    assert windowed.split_dependent_units(4) == []
    trainstate.check_world_size(meta, Config, 1, windowed.split_dependent_units, "run/c.ckpt")


def test_the_allocator_prices_bias_and_variance_apart():
    """measure_sensitivity(rounding="stochastic") takes two draws per batch: the unbiased widths'
    error is mostly variance, 1 bit (no unbiased code exists) is all bias; nearest has no
    variance. The objective weighs bias² 19 times variance, both against the SGD noise², and the
    allocation's budget counts the group ends (uniform 2-bit unbiased fits exactly)."""
    from lowmem.bits.allocate import allocate
    from lowmem.bits.sensitivity import measure_sensitivity
    from lowmem.models import preact_resnet_cifar
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((8, 3, 16, 16)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(2)]
    net = preact_resnet_cifar(8)
    sens = measure_sensitivity(net, batches, rounding="stochastic")
    near = measure_sensitivity(net, batches)
    for u in sens.units:
        assert sens.variance2(u, 1) == 0 and sens.bias2(u, 1) == sens.error2(u, 1) > 0
        assert near.variance2(u, 2) == 0
        assert sens.variance2(u, 2) > 0.5 * sens.error2(u, 2)           # the unbiased code: mostly noise
        # the unbiased widths by their variance (bias 0 by construction), 1 bit by its bias, 19x
        assert sens.objective(u, 4) == pytest.approx(sens.variance2(u, 4) / sens.noise_norm ** 2)
        assert sens.objective(u, 1) == pytest.approx(19 * sens.bias2(u, 1) / sens.noise_norm ** 2)
        assert near.objective(u, 2) == pytest.approx(19 * near.error2(u, 2) / near.noise_norm ** 2)
    a = allocate(sens, 8, avg_bits=2)
    assert a.uniform_bytes[2] == sum(unbiased.slot_nbytes(s[0], 8 * s[1] * s[2], 2) for s in sens.shapes.values())
    assert a.total_bytes <= a.uniform_bytes[2] == a.budget


@pytest.mark.parametrize("M", [776, 4872, 4196, 200, 12])
@pytest.mark.parametrize("naive", [False, True])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dither", [False, True])
def test_numba_forward_writes_the_reference_slot(bits, naive, M, dither):
    """units/unbiased_cpu.py: the same slot bytes as unbiased.quantize_pack (float32, shards keyed
    by their global place, γ of both signs and 0, t outside the data, a constant channel, a
    row's last group longer than the others; rows of one block and of two, window_cpu.BLOCK = 4096,
    one whose last block takes the 100 elements after 4096, one shorter than a group, one shorter
    than the 2-bit draw's 16-element reach), and
    out = relu(y) as the exact forward, or naive's decoded conv input."""
    from lowmem.units import unbiased_cpu
    from lowmem.ops import bn_normalize
    if not unbiased_cpu.AVAILABLE:
        pytest.skip("numba not installed")
    rng = np.random.default_rng(12)
    C = 6                                           # groups of 256 ..., 256, 264 (M = 776)
    x = (rng.standard_normal((C, M)) * 2 + 0.3).astype(np.float32)
    x[5] = 1.5
    gamma = np.array([1.2, -0.7, 0.0, 0.9, -1.1, 1.0], np.float32)
    beta = np.array([0.1, 0.3, 0.4, 9.0, -8.0, 0.2], np.float32)
    mean, rstd = x.mean(axis=1).astype(np.float32), (1 / (x.std(axis=1) + 1e-3)).astype(np.float32)
    xhat = np.empty_like(x)
    bn_normalize(xhat, x, mean, rstd)
    key = Stream(stream.stream_key(3, 1, 4), start=1024, row=max(4096, M + 2048))
    want = np.zeros(unbiased.slot_nbytes(C, M, bits, dither), np.uint8)
    unbiased.quantize_pack(want, xhat, gamma, beta, bits, key, dither)
    got, out = np.zeros_like(want), np.empty_like(x)
    unbiased_cpu.unit_forward(out, got, x, mean, rstd, gamma, beta, bits, naive, key, dither)
    np.testing.assert_array_equal(got, want)
    ref = np.empty_like(x)
    if naive:
        unbiased.decode_each_chunk(ref, want, gamma, beta, bits, relu=True, dither=dither)
    else:
        ref = np.maximum(xhat * gamma[:, None] + beta[:, None], 0)
    np.testing.assert_array_equal(out, ref)
    inplace = x.copy()                              # out may alias x
    unbiased_cpu.unit_forward(inplace, got, inplace, mean, rstd, gamma, beta, bits, naive, key, dither)
    np.testing.assert_array_equal(inplace, out)


def test_plan_prints_bits_per_element_with_the_group_ends(capsys):
    from lowmem.tools import cli
    assert cli.main(["plan", "--depth", "8", "--batch", "64", "--bits", "2", "--rounding", "stochastic",
                     "--rows", "3"]) == 0
    out = capsys.readouterr().out
    assert "saved codes: 2.125 bits/elem, metadata included (rounding stochastic)" in out
    assert "(278,592 B, 2-bit, 2.125 bits/elem)" in out           # the schedule's saved slots
    assert cli.main(["plan", "--depth", "8", "--batch", "64", "--bits", "2", "--rows", "3"]) == 0
    assert "bits/elem" not in capsys.readouterr().out              # the window code: K bits exactly


@pytest.mark.parametrize("M", [776, 4872, 4196, 200])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dither", [False, True])
def test_numba_decode_is_the_reference_decode(bits, M, dither):
    from lowmem.units import unbiased_cpu
    if not unbiased_cpu.AVAILABLE:
        pytest.skip("numba not installed")
    rng = np.random.default_rng(13)
    C = 6
    x = (rng.standard_normal((C, M)) * 2).astype(np.float32)
    x[5] = 0
    gamma = np.array([1.2, -0.7, 0.0, 0.9, -1.1, 1.0], np.float32)
    beta = np.array([0.1, 0.3, -0.4, 9.0, -8.0, 0.2], np.float32)
    slot = np.zeros(unbiased.slot_nbytes(C, M, bits, dither), np.uint8)
    unbiased.quantize_pack(slot, x, gamma, beta, bits, Stream(77, 512, max(2 * M, M + 512)), dither)
    mask = (x * gamma[:, None]) + beta[:, None] > 0
    for relu in (False, True):
        want, got = np.empty_like(x), np.empty_like(x)
        unbiased.decode_each_chunk(want, slot, gamma, beta, bits, relu=relu, dither=dither)
        unbiased_cpu.decode(got, slot, gamma, beta, bits, relu=relu, dither=dither)
        np.testing.assert_array_equal(got, want)
    dr = rng.standard_normal((C, M)).astype(np.float32)
    masked = dr.copy()
    unbiased_cpu.decode(np.empty_like(x), slot, gamma, beta, bits, dr=masked, dither=dither)
    np.testing.assert_array_equal(masked, dr * mask)


def test_fused_and_reference_engines_train_alike():
    """The numba set (forward and decodes) and the reference set draw the same codes: the
    gradients agree to within a few flipped codes (other draws would differ by O(1)). The batch
    statistics and convolutions of the two engines round differently, so x-hat differs in its
    last bits, and through the systematic walk such a difference shifts the later draws of its
    group by a few 2**-24: the rare element whose p + r lies that close to a level boundary
    takes the neighbouring level (one element by one level: about 1e-4 of the gradient here).
    On one x-hat the codes are byte-identical (the tests above)."""
    import copy
    from lowmem.core.engine import Engine
    from lowmem.models import preact_resnet_cifar
    from lowmem.units import unbiased_cpu
    if not unbiased_cpu.AVAILABLE:
        pytest.skip("numba not installed")
    net = preact_resnet_cifar(8)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((8, 3, 8, 8)).astype(np.float32), rng.integers(0, 10, 8)
    grads = []
    for fast in (True, False):
        eng = Engine(copy.deepcopy(net), 8, (3, 8, 8), "approx", {"*": 2, "layer2.0.bn1": 4},
                     rounding="stochastic", seed=4, use_fast=fast)
        assert eng.fused is fast
        for _ in range(2):
            eng.forward(x, y)
            eng.backward()
        grads.append([p.grad.copy() for p in eng.net.parameters()])
    for a, b in zip(*grads):
        assert np.linalg.norm(a - b) <= 2e-3 * np.linalg.norm(b) + 1e-7


# ---- the dithered draw ----------------------------------------------------------

def test_dithered_error_is_uniform_whatever_x():
    """rounding="dither": for elements at a few fixed places between two levels, the error over
    400 draws has mean ~0 and variance step²/12 at every place (stochastic rounding's is
    f(1−f)·step², f the place's fraction: 1/4 at the middle, small next to a level). Open side of
    t = 0, levels 0 and the group's top 3 (step 3); tolerance 4 standard errors for the means,
    15% for the variances (400 draws: their standard error is about 7%)."""
    places = np.array([0.03, 0.3, 1.5, 2.7, 3.0])                 # fractions 0.01, 0.1, 0.5, 0.9, 1
    x = np.tile(places, 64)[None, :].astype(np.float64)            # 320 elements: groups of 256 and 64
    x[0, 255], x[0, -1] = 3.0, 3.0                                 # each group's top exactly 3
    gamma, beta = np.array([1.0]), np.array([0.0])
    K = 400
    err = np.stack([unbiased.quantize_simulated(x, gamma, beta, 2, stream.stream_key(8, d, 0), draws="dither")[0] - x
                    for d in range(K)])                            # (K, 1, 320)
    step = 3.0
    for i, p in enumerate(places[:-1]):                            # the top itself is a level: its error is its own
        e = err[:, 0, i::5][:, :-1].ravel()                        # one place, every copy and draw
        assert abs(e.mean()) < 4 * e.std() / np.sqrt(e.size) + 1e-12, (p, e.mean())
        assert abs(e.var() / (step ** 2 / 12) - 1) < 0.15, (p, e.var() / step ** 2)
    sr = np.stack([unbiased.quantize_simulated(x, gamma, beta, 2, stream.stream_key(8, d, 0))[0] - x
                   for d in range(K)])
    assert sr[:, 0, 2::5].var() > 2.5 * err[:, 0, 2::5].var()      # at the middle: 1/4 against 1/12


def draw_spread(rounding, draws=12):
    """Pre-act ResNet-8, float64, one batch of 32 (8x8): the gradient's spread over `draws`
    training steps' codes (same weights and batch), sqrt(sum of the variances)."""
    import copy
    from lowmem.core.engine import Engine
    from lowmem.models import preact_resnet_cifar
    net = preact_resnet_cifar(8, seed=2)
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((32, 3, 8, 8)), rng.integers(0, 10, 32)
    eng = Engine(copy.deepcopy(net), 32, (3, 8, 8), "approx", 2, dtype="float64", rounding=rounding, seed=5)
    gs = []
    for _ in range(draws):
        eng.forward(x, y)
        eng.backward()
        gs.append(np.concatenate([p.grad.ravel() for p in eng.net.parameters()]))
    return np.sqrt(np.array(gs).var(axis=0, ddof=1).sum())


def test_the_dithered_draw_has_less_gradient_noise():
    """Through the engine at 2 bits: the dithered code's gradient spread over draws against the
    stochastic code's: measured 0.746 on this case (0.747 over 30 draws); the bound 0.85 leaves
    room for the 12 draws' sampling error."""
    ratio = draw_spread("dither") / draw_spread("stochastic")
    assert ratio < 0.85, ratio
