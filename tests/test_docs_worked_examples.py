"""The relations behind docs/worked_examples.md, for every bit width and several networks.

The page prints one case (4 bits, ResNet-164, one ResNet-20 block); these check that
what it teaches holds in general: the threshold is a bin edge, the mask is `code >= k`,
decoding is the bin midpoint, the packed layout puts element i at bits (i mod 8/K)*K
of byte i div (8/K), the per-element sum gives the plan's saved bytes, and the
schedule's only `+=` steps are the ones the page names.
"""
import collections

import numpy
import pytest

import lowmem as lm
from lowmem.units import packing, widths, window

GAMMA = numpy.array([1.5, -0.5], numpy.float32)
BETA = numpy.array([0.4, 0.6], numpy.float32)
XHAT = numpy.array([[-3.5, -1.0, -0.3, -0.25, 0.0, 0.7, 1.9, 4.0]] * 2, numpy.float32)


@pytest.mark.parametrize("bits", widths.BITS)
def test_one_channel_by_hand(bits):
    qp = window.quant_params(GAMMA, BETA, bits)
    L, w = qp.levels, qp.w
    W = L * w / 2
    t = -BETA / numpy.abs(GAMMA)
    k = numpy.clip(numpy.rint((t + W) / w), 1, L - 1)
    assert numpy.array_equal(qp.k, k.astype(numpy.int32))
    assert numpy.array_equal(qp.s, numpy.sign(GAMMA))
    # where k was not clamped, the edge between codes k-1 and k is t (to rounding); at 1 bit the
    # second channel's t = -1.2 sits in the lowest half-bin, k is clamped to 1 and lo stays near -W
    free = (numpy.rint((t + W) / w) >= 1) & (numpy.rint((t + W) / w) <= L - 1)
    assert free.any() or bits == 1
    assert numpy.allclose((qp.lo + qp.k * w)[free], t[free], rtol=0, atol=1e-6)
    assert numpy.all(numpy.abs(qp.lo + W) <= w / 2)

    packed = numpy.empty(packing.packed_nbytes(XHAT.size, bits), numpy.uint8)
    window.quantize_pack(packed, XHAT, qp)
    xt, mask = numpy.empty_like(XHAT), numpy.empty(XHAT.shape, bool)
    window.unpack_decode(xt, packed, qp, mask)
    codes = numpy.empty(XHAT.size, numpy.uint8)
    packing.unpack_codes(codes, packed, bits)
    codes = codes.reshape(XHAT.shape)

    y = XHAT * GAMMA[:, None] + BETA[:, None]
    assert numpy.array_equal(mask, y > 0)
    assert numpy.array_equal(mask, codes >= qp.k[:, None])
    assert numpy.array_equal(xt, qp.s[:, None] * (qp.lo[:, None] + (codes + numpy.float32(0.5)) * w))
    u = XHAT * qp.s[:, None]
    inside = (u >= qp.lo[:, None]) & (u < qp.lo[:, None] + L * w)
    assert numpy.all(numpy.abs(xt - XHAT)[inside] <= w / 2 + 1e-6)
    assert numpy.all(numpy.abs(xt) <= W + w / 2)

    per = 8 // bits                               # element i at bits (i % per)*K of byte i // per
    flat = codes.reshape(-1).astype(numpy.int64)
    want = [sum(int(flat[j * per + i]) << (i * bits) for i in range(per)) for j in range(len(packed))]
    assert packed.tolist() == want


def _by_hand(net, N, mode, bits):
    """Saved bytes per batch of N from the per-element rule of worked_examples.md §3."""
    eng = lm.Engine(net, N, (3, 32, 32), "exact", allocate=False)
    units = collections.Counter(s.in_shape for s in eng.schedule if s.phase == "fwd" and s.op == "bnrelu")
    elems = sum(n * c * h * w for (c, h, w), n in units.items()) * N
    channels = sum(n * c for (c, _, _), n in units.items())
    per_elem = 4 if mode == "exact" else bits / 8
    head = [L for L in net.layers if L.op == "linear"][-1]
    return int(elems * per_elem) + 4 * channels + 4 * N * (head.cin + head.cout)


@pytest.mark.parametrize("depth,N", [(164, 128), (56, 32), (20, 8)])
@pytest.mark.parametrize("mode,bits", [("exact", 8), ("approx", 8), ("approx", 4), ("approx", 2), ("approx", 1)])
def test_saved_bytes_are_the_per_element_sum(depth, N, mode, bits):
    net = lm.models.preact_resnet_cifar(depth)
    plan = lm.Engine(net, N, (3, 32, 32), mode, bits, allocate=False).plan
    assert plan.bytes_by_kind()["saved"] == _by_hand(net, N, mode, bits)


def test_resnet164_per_sample_numbers_on_the_page():
    net = lm.models.preact_resnet_cifar(164)
    assert round(_by_hand(net, 128, "exact", 8) / 128 / 1e6, 3) == 12.601
    assert round(_by_hand(net, 128, "approx", 4) / 128 / 1e6, 3) == 1.576


def test_the_only_accumulating_steps_are_the_skip_and_shortcut_ones():
    """Identity blocks: bn1 adds into the add's gradient; projection blocks: the shortcut
    adds into conv1's input gradient. Nothing else accumulates."""
    net = lm.models.preact_resnet_cifar(20, block="bottleneck")
    sched = lm.Engine(net, 8, (3, 32, 32), "approx", 4, allocate=False).schedule
    bwd = {s.name: s for s in sched if s.phase == "bwd"}
    acc = sorted(s.name for s in bwd.values() if s.accumulate)
    blocks = sorted({n.rsplit(".", 1)[0] for n in bwd if n.startswith("layer")})
    want = []
    for b in blocks:
        if b + ".shortcut" in bwd:
            want.append(b + ".shortcut")
            assert bwd[b + ".shortcut"].dx == bwd[b + ".conv1"].dx
            assert bwd[b + ".shortcut"].dout == bwd[b + ".add"].dx
        else:
            want.append(b + ".bn1")
            assert bwd[b + ".bn1"].dx == bwd[b + ".add"].dx != bwd[b + ".bn1"].dout
    assert acc == sorted(want)
