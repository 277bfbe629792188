"""The unbiased code's fused numba BN-ReLU backward (lowmem/units/unbiased_cpu.py unit_backward,
used by units/fused.py's FusedUnbiasedCodeUnits on the CPU):

* against the reference set's backward (UnbiasedCodeUnits: decode, then ops.bn_relu_backward) on
  the same slot, assigning and accumulating, with dx a separate array or dr itself;
* against the formulas written out in float64 on the reference decode's x-tilde;
* through synchronized batch norm (units/sync.py) over the fused set.

Tolerance: float32 rounding. dgamma, dbeta: 1e-5 relative to the sum of |terms|; dx: 1e-5 of
the largest |dx| (dx = a*(dy - mean dy - x-tilde*mean(dy*x-tilde)) cancels).
"""
import numpy as np
import pytest

from lowmem.ops import bn_normalize
from lowmem.units import fused, unbiased, unbiased_cpu, window, window_cpu
from lowmem.units.reference import UnbiasedCodeUnits
from lowmem.units.stream import Stream
from lowmem.units.sync import SyncUnits

pytestmark = pytest.mark.skipif(not unbiased_cpu.AVAILABLE, reason="numba not installed")
TOL = 1e-5


def case(bits, seed=21, M=776, dither=False):
    """A unit (C=6; M=776: groups 256, 256, 264, the row's last taking the rest; M=4872: a block
    of 4096, then those; M=4196: one block, its last group 356; M=200: one group) with γ
    of both signs and 0, t outside the data on both sides, a constant channel; its slot drawn
    by the reference set's forward."""
    rng = np.random.default_rng(seed)
    C = 6
    x = (rng.standard_normal((C, M)) * 2 + 0.3).astype(np.float32)
    x[5] = 1.5
    gamma = np.array([1.2, -0.7, 0.0, 0.9, -1.1, 1.0], np.float32)
    beta = np.array([0.1, 0.3, 0.4, 9.0, -8.0, 0.2], np.float32)
    mean, rstd = x.mean(axis=1).astype(np.float32), (1 / (x.std(axis=1) + 1e-3)).astype(np.float32)
    slot = np.zeros(unbiased.slot_nbytes(C, M, bits, dither), np.uint8)
    UnbiasedCodeUnits(bits, dither=dither).forward(np.empty_like(x), slot, x, mean, rstd, gamma, beta,
                                                   key=Stream(7, start=0, row=M))
    dr = rng.standard_normal((C, M)).astype(np.float32)
    return x, mean, rstd, gamma, beta, slot, dr


def close(got, want, scale):
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= TOL * scale)


def reference_backward(bits, x, rstd, gamma, beta, slot, dr, dx0, accumulate, dither=False):
    C, M = dr.shape
    dx, dg, db = dx0.copy(), np.full(C, 0.5, np.float32), np.full(C, -0.25, np.float32)
    UnbiasedCodeUnits(bits, dither=dither).backward(dx, dg, db, dr.copy(), slot, rstd, gamma, beta, accumulate,
                                     np.empty_like(dr))
    return dx, dg, db


@pytest.mark.parametrize("bits,M", [(2, 776), (4, 776), (8, 776), (2, 4872), (2, 4196), (4, 200)])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dither", [False, True])
def test_fused_backward_is_the_reference_backward(bits, M, accumulate, inplace, dither):
    x, mean, rstd, gamma, beta, slot, dr = case(bits, M=M, dither=dither)
    dx0 = np.random.default_rng(2).standard_normal(dr.shape).astype(np.float32)
    want = reference_backward(bits, x, rstd, gamma, beta, slot, dr, dr if inplace else dx0, accumulate, dither)
    units = fused.FusedUnbiasedCodeUnits(window_cpu, bits, dither=dither)
    C = dr.shape[0]
    g, b = np.full(C, 0.5, np.float32), np.full(C, -0.25, np.float32)
    d = dr.copy()
    dx = d if inplace else dx0.copy()
    units.backward(dx, g, b, d, slot, rstd, gamma, beta, accumulate, None)     # no decode buffer
    if not inplace:
        np.testing.assert_array_equal(d, dr)                                 # dr is read only
    terms = np.abs(dr).sum(axis=1) * max(1.0, np.abs(x).max())
    close(g, want[1], terms + 0.5)
    close(b, want[2], terms + 0.25)
    close(dx, want[0], np.abs(want[0]).max())


@pytest.mark.parametrize("bits,M", [(2, 776), (4, 4872), (2, 4196), (2, 200)])
@pytest.mark.parametrize("dither", [False, True])
def test_fused_backward_is_the_formula_in_float64(bits, M, dither):
    """dy = dr·mask (mask: the forward's exact (x̂·γ) + β > 0), sums and dx written out in float64
    on the reference decode's x̃; a channel of zero gradient gives dγ = dβ = 0 and dx = 0."""
    x, mean, rstd, gamma, beta, slot, dr = case(bits, seed=5, M=M, dither=dither)
    dr[1] = 0
    C, M = dr.shape
    xhat = np.empty_like(x)
    bn_normalize(xhat, x, mean, rstd)
    mask = (xhat * gamma[:, None]) + beta[:, None] > 0
    xt = np.empty_like(x)
    unbiased.decode_each_chunk(xt, slot, gamma, beta, bits, dither=dither)
    dy = dr.astype(np.float64) * mask
    xt = xt.astype(np.float64)
    sdy, sdyx = dy.sum(axis=1), (dy * xt).sum(axis=1)
    a = gamma.astype(np.float64) * rstd
    want_dx = a[:, None] * (dy - sdy[:, None] / M - xt * (sdyx / M)[:, None])
    dx, g, b = np.empty_like(dr), np.zeros(C, np.float32), np.zeros(C, np.float32)
    unbiased_cpu.unit_backward(dx, g, b, dr, slot, gamma, beta, rstd, bits, False, dither)
    terms = np.abs(dy).sum(axis=1) * np.abs(xt).max(axis=1)
    close(g, sdyx, terms)
    close(b, sdy, np.abs(dy).sum(axis=1))
    close(dx, want_dx, np.abs(want_dx).max())
    assert g[1] == 0 and b[1] == 0 and not dx[1].any()


@pytest.mark.parametrize("threads_", [1, 2])
@pytest.mark.parametrize("bits,C,M", [(2, 150, 64), (4, 150, 64), (2, 1100, 8), (8, 70, 200)])
@pytest.mark.parametrize("dither", [False, True])
def test_short_rows_packed_together_across_threads(threads_, bits, C, M, dither, monkeypatch):
    """Rows short enough that the kernels pack and unpack a block's worth of them at a time, in a
    number that leaves a partial last batch, over one or two threads (a range may start inside a
    batch): the forward's slot is the reference's byte for byte, the decodes its values bit for
    bit, the backward the reference backward's to float32 rounding."""
    from lowmem.system import threads
    from lowmem.units import cpu_base
    before = threads.threads()
    threads.configure(threads_)
    monkeypatch.setattr(cpu_base, "SPLIT_WORK", 64)        # these small calls split too
    try:
        rng = np.random.default_rng(C + M + bits)
        x = (rng.standard_normal((C, M)) * 2 + 0.3).astype(np.float32)
        gamma = rng.standard_normal(C).astype(np.float32)
        gamma[::17] = 0
        beta = rng.standard_normal(C).astype(np.float32)
        mean, rstd = x.mean(axis=1).astype(np.float32), (1 / (x.std(axis=1) + 1e-3)).astype(np.float32)
        xhat = np.empty_like(x)
        bn_normalize(xhat, x, mean, rstd)
        key = Stream(11, start=0, row=M)
        want = np.zeros(unbiased.slot_nbytes(C, M, bits, dither), np.uint8)
        unbiased.quantize_pack(want, xhat, gamma, beta, bits, key, dither)
        got, out = np.zeros_like(want), np.empty_like(x)
        unbiased_cpu.unit_forward(out, got, x, mean, rstd, gamma, beta, bits, False, key, dither)
        np.testing.assert_array_equal(got, want)
        for relu in (False, True):
            ref, dec = np.empty_like(x), np.empty_like(x)
            unbiased.decode_each_chunk(ref, want, gamma, beta, bits, relu=relu, dither=dither)
            unbiased_cpu.decode(dec, got, gamma, beta, bits, relu=relu, dither=dither)
            np.testing.assert_array_equal(dec, ref)
        dr = rng.standard_normal((C, M)).astype(np.float32)
        want_b = reference_backward(bits, x, rstd, gamma, beta, want, dr, dr, False, dither)
        d = dr.copy()
        g, b = np.full(C, 0.5, np.float32), np.full(C, -0.25, np.float32)
        unbiased_cpu.unit_backward(d, g, b, d, got, gamma, beta, rstd, bits, False, dither)
        terms = np.abs(dr).sum(axis=1) * max(1.0, np.abs(x).max())
        close(g, want_b[1], terms + 0.5)
        close(b, want_b[2], terms + 0.25)
        close(d, want_b[0], np.abs(want_b[0]).max())
    finally:
        threads.configure(before)


class Twins:
    """A communicator of two ranks holding the same shard: allreduce doubles."""
    size = 2

    def allreduce(self, a):
        a *= 2


def test_synchronized_batch_norm_over_the_fused_set():
    """SyncUnits over FusedUnbiasedCodeUnits: two ranks with the same shard (count 2M, sums
    doubled) give the one-rank dx and the local dγ, dβ; its decode is the numba one."""
    bits = 2
    x, mean, rstd, gamma, beta, slot, dr = case(bits, seed=9)
    C, M = dr.shape
    inner = fused.FusedUnbiasedCodeUnits(window_cpu, bits)
    want = np.empty_like(dr), np.zeros(C, np.float32), np.zeros(C, np.float32)
    inner.backward(want[0], want[1], want[2], dr.copy(), slot, rstd, gamma, beta, False, None)
    sync = SyncUnits(inner, Twins(), np.empty(2 * C, np.float64))
    got = np.empty_like(dr), np.zeros(C, np.float32), np.zeros(C, np.float32)
    sync.backward(got[0], got[1], got[2], dr.copy(), slot, rstd, gamma, beta, False, np.empty_like(dr))
    terms = np.abs(dr).sum(axis=1) * max(1.0, np.abs(x).max())
    close(got[1], want[1], terms)
    close(got[2], want[2], terms)
    close(got[0], want[0], np.abs(want[0]).max())


def test_bad_input_is_named():
    x, mean, rstd, gamma, beta, slot, dr = case(2)
    C = dr.shape[0]
    g, b = np.zeros(C, np.float32), np.zeros(C, np.float32)
    with pytest.raises(ValueError, match="float32 rows"):
        unbiased_cpu.unit_backward(dr.astype(np.float64), g, b, dr.astype(np.float64), slot, gamma, beta,
                                   rstd, 2, False)
    with pytest.raises(ValueError, match="dx must have dr's shape"):
        unbiased_cpu.unit_backward(dr[:, :8], g, b, dr, slot, gamma, beta, rstd, 2, False)
    with pytest.raises(ValueError, match="slot must be uint8 of at least"):
        unbiased_cpu.unit_backward(np.empty_like(dr), g, b, dr, slot[:100], gamma, beta, rstd, 2, False)
    with pytest.raises(ValueError, match="bits >= 2"):
        unbiased_cpu.unit_backward(np.empty_like(dr), g, b, dr, slot, gamma, beta, rstd, 1, False)


def test_group_range_is_max_and_min_element_by_element():
    """The forward's group ends are max/min taken element by element (as the CUDA kernel's):
    of -0 and +0 the first one seen is kept, where either is a group's max or min."""
    C, M, bits = 2, 512, 2
    rng = np.random.default_rng(3)
    x = -np.abs(rng.standard_normal((C, M))).astype(np.float32)
    x[0, 5], x[0, 9] = -0.0, 0.0                    # group 0 of row 0: max -0 (the first 0)
    x[0, 300], x[0, 301] = 0.0, -0.0                # group 1: max +0
    x[1] = -x[1]                                    # γ < 0: u = -x-hat, so x-hat's zeros flip
    x[1, 7], x[1, 8] = 0.0, -0.0                    # u: -0 first, then +0: max -0
    x[1, 400], x[1, 401] = -0.0, 0.0                # u: +0 first: max +0
    gamma, beta = np.array([1.0, -1.0], np.float32), np.array([0.5, 0.5], np.float32)
    mean, rstd = np.zeros(C, np.float32), np.ones(C, np.float32)
    slot = np.zeros(unbiased.slot_nbytes(C, M, bits), np.uint8)
    unbiased_cpu.unit_forward(np.empty_like(x), slot, x, mean, rstd, gamma, beta, bits, False, 1)
    ends = unbiased.split_slot(slot, C, M, bits)[1]
    for c in range(C):
        s = np.float32(-1 if gamma[c] < 0 else 1)
        for gi in range(M // unbiased.GROUP):
            hi, lo = np.float32(-np.inf), np.float32(np.inf)
            for v in x[c, gi * 256:(gi + 1) * 256]:
                u = ((v - mean[c]) * rstd[c]) * s
                hi, lo = (u if u > hi else hi), (u if u < lo else lo)
            assert ends[c, gi, 0] == unbiased.bf16_up(np.array([hi]))[0]
            assert ends[c, gi, 1] == unbiased.bf16_down(np.array([lo]))[0]
    assert list(ends[:, :, 0].ravel()) == [0x8000, 0x0000, 0x8000, 0x0000]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_kernels_split_is_unbiased_split(bits):
    """The kernels derive the split k per channel from γ and β (no (C,) array ops per call):
    k equals unbiased.split's on random values, at rint's ties (t + W)/w = n + 1/2, beyond the
    window, for tiny and zero γ and both signs of β."""
    rng = np.random.default_rng(bits)
    W, w = np.float32(window.half_width(bits)), np.float32(window.bin_width(bits))
    n = np.arange(-3, (1 << bits) + 3, dtype=np.float32)
    t_ties = (n + np.float32(0.5)) * w - W                      # exact in float32
    gamma = np.concatenate([rng.standard_normal(300), np.ones(n.size), -np.ones(n.size),
                            [1e-30, -1e-30, 0, 0, -0.0, 3e38]]).astype(np.float32)
    beta = np.concatenate([rng.standard_normal(300) * 4, -t_ties, -t_ties,
                           [1.0, -1.0, 0.5, -0.5, 0.0, 1.0]]).astype(np.float32)
    L = 1 << bits
    got = [unbiased_cpu._channel(g, b, L, W, w)[5] for g, b in zip(gamma, beta)]
    np.testing.assert_array_equal(got, unbiased.split(gamma, beta, bits))
