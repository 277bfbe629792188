"""The fixed-window code: the K-bit quantizer of a unit's normalised activation x̂ (the paper's).

Each BN->ReLU unit keeps one packed K-bit code of `x̂` (K in {8, 4, 2, 1}):
K/8 bytes per element (1, 0.5, 0.25, 0.125) plus a few per-channel numbers,
against 4 bytes for float32. From the code the backward sweep recovers an
approximate `x̃` (for BN backward and, via `relu(γ·x̃ + β)`, the conv weight
gradient) and the *exact* ReLU mask `y > 0`. docs/quantizer.md states the contract.

The grid, per channel c (all in units of x̂, i.e. of the batch std):

* L = 2**K bins of width w = 2·W/L: the window covers about ±W, with a
  half-width W = WINDOWS[K] chosen per bit width from measured gradient
  errors (docs/quantizer.md §1b; the paper uses W = 3 for every K).
* Work on u = s·x̂ with s = sign(γ), so y = |γ|·u + β and the mask is
  u > t with t = −β/|γ|: flipping the axis for γ < 0 makes "positive" always
  mean "high codes".
* A bin edge sits exactly on t: lo = t − k·w, code k is the first code of
  the positive side. Then *which side of the threshold* an element lies on is
  carried by its code, and `mask = code >= k` costs no extra bit. k is chosen
  as round((t + W)/w), so the window stays centred near x̂ = 0 (lo within
  half a bin of −W), and clamped to [1, L−1] so both sides keep a code.
* If t lies outside the window (k clamped), lo stays at −W ± w/2 (the
  nearer end) instead of following t out: the window keeps covering
  x̂ ≈ 0, one end bin becomes the "beyond the threshold" bin, and the mask
  stays exact. Consequence: for every channel, every γ and β,
  |x̂| ≤ W − w/2  ⇒  |x̃ − x̂| ≤ w/2, and |x̃| ≤ W always (saturation).
* Floating-point rounding can put an element within an ulp of t into the
  wrong bin, so every code is finally clamped into the range its *exact*
  mask allows (mask: code ≥ k, else code ≤ k − 1). The exact mask is the
  engine's own expression `(x̂ * γ) + β > 0` in x̂'s dtype, bit for bit.
* γ = 0: the mask is the constant β > 0, x̂ sits on the plain centred grid
  lo = −W, and k = 0 (β > 0: every code means "positive") or k = L (none
  does), so the same `code >= k` decodes it with no special case.
* Decode: x̃ = s · (lo + (code + 0.5)·w), the bin midpoint. Every W is a
  multiple of 1/4 and w = m·2**e with an odd integer m < 64, so (code + 0.5)·w,
  k·w and w/2 are exact in float32 and float64: the one rounding of the
  decode is the `+ lo`. `half_width` rejects a W breaking this.

The grid needs only γ and β: no min/max pass over the data, deterministic.

Rounding (`rounding=`): "nearest" (the default) takes code = floor((u − lo)/w).
"stochastic-window" takes floor((u − lo)/w + d), d uniform in [−1/2, 1/2) from the
counter stream (units/stream.py), then the same two clamps (window, the exact mask's
side): the mask stays exact on every draw, the decode is the midpoint. Unbiased only
between the midpoints of its side's lowest and highest code; within half a bin of the
threshold and at or beyond the window's ends the clamp biases it (docs/quantizer.md §6).
"stochastic" is the unbiased group-range code of units/unbiased.py (same packing, same
mask rule); which code a unit keeps is units/widths.py's rule, and
`lowmem.units.quantize_simulated` takes any rounding. Packing: units/packing.py.

Memory: quantize_pack, unpack_decode and decode_relu walk the array in chunks of
packing.CHUNK flat elements (a multiple of 8: every chunk starts on a byte boundary) with
chunk-sized scratch only, about 20 bytes per CHUNK element (36 with the stream).
`quantize_simulated` is the whole-array reference the packed path matches bit for bit.

Not here: choosing K, storing rstd, the backward maths (batchnorm/relu ops), the other codes.

Dimension legend: C channels, M = N·H·W elements per channel; activations
are channels-major, so a unit's x̂ is a C-contiguous (C, M) array.
"""
import fractions
import math
import numbers

import numpy

from ..system.backend import array_module
from .packing import check_packed, chunk_size, chunks, pack_block, packed_nbytes, unpack_block
from .stream import OFFSET_BITS, draw_bits, resolve
from .widths import check_bits, check_rounding
# Half-width W of the window per bit width K, in x̂ units: the grid covers
# about ±W. Chosen from measured gradient errors (benchmarks/window_sweep.py,
# docs/quantizer.md §1b); the paper's ±3 for every K saturates too much at 8 bits.
WINDOWS = {8: 5.5, 4: 3.5, 2: 2.5, 1: 2.0}
MAX_ODD = 64        # w = m·2**e with odd m < MAX_ODD keeps (code + 0.5)·w exact in float32
ROUNDINGS = ("nearest", "stochastic-window")     # how this code's codes may be drawn (widths.ROUNDINGS)

# (bits, W) -> float(W) of each checked window (quant_params runs per unit per step; keyed by value)
_CHECKED = {}


def half_width(bits):
    """W, the half-width of the quantization window for `bits`, in x̂ units; checked exact: w =
    2·W/2**bits is m·2**e with odd m < MAX_ODD, so (code + 0.5)·w, k·w, w/2 are exact in float32."""
    bits = check_bits(bits)
    W = WINDOWS[bits]
    try:
        return _CHECKED[bits, W]
    except (KeyError, TypeError):                       # first call for this W (or W unhashable)
        pass
    if not (isinstance(W, numbers.Real) and math.isfinite(W) and W > 0):
        raise ValueError(f"window.WINDOWS[{bits}] must be a positive finite number, got {W!r}")
    num = fractions.Fraction(float(W)).numerator      # w = 2W/L has the same odd part
    while num % 2 == 0:
        num //= 2
    if num >= MAX_ODD:
        raise ValueError(f"window.WINDOWS[{bits}] = {W!r} gives a bin width whose odd part "
                         f"{num} is not below {MAX_ODD}: (code + 0.5)*w would round "
                         f"(use a multiple of 1/4 such as 2.75 or 4.5)")
    _CHECKED[bits, W] = float(W)
    return float(W)


def bin_width(bits):
    """w = 2·W/2**bits, the bin width for `bits` in x̂ units (exact: see `half_width`)."""
    return 2 * half_width(bits) / (1 << check_bits(bits))


def check_window_rounding(rounding, where="the window code"):
    """Return `rounding` if this code draws with it (ROUNDINGS); else ValueError naming `where`."""
    if check_rounding(rounding) not in ROUNDINGS:
        raise ValueError(f"{where} draws its codes with {' or '.join(map(repr, ROUNDINGS))}, got {rounding!r}: "
                         f"the unbiased code (units/unbiased.py) is rounding='stochastic' (units/widths.py's code_for)")
    return rounding


def stream_base(rounding, key, M):
    """resolve()'s (base, start, row) of the stream for rows of M local elements (units/stream.py);
    None for nearest (which ignores key). Stochastic rounding without a key is a ValueError."""
    if check_window_rounding(rounding) == "nearest":
        return None
    return resolve(key, M, what=rounding)


class QuantParams:
    """Per-channel quantization grid of one unit (all tiny, (C,) arrays on xp).

    bits, levels (L = 2**bits), window (W = half_width(bits)), w (bin width
    2·W/L, a Python float: exact in any float dtype, see `half_width`), dtype
    (of γ, β and x̂).
    s     (C,) dtype   +1 or −1: the axis flip, u = s·x̂ (+1 where γ == 0)
    lo    (C,) dtype   lower edge of code 0, in u; always within w/2 of −W
    k     (C,) int32   first code meaning "ReLU passes" (mask = code >= k);
                       1..L−1 where γ != 0, 0 or L where γ == 0
    gamma (C,) dtype   copies of γ and β, for the exact mask at quantize time
    beta  (C,) dtype
    """

    def __init__(self, bits, s, lo, k, gamma, beta):
        self.bits = bits
        self.levels = 1 << bits
        self.window = half_width(bits)
        self.w = bin_width(bits)
        self.s, self.lo, self.k = s, lo, k
        self.gamma, self.beta = gamma, beta
        self.dtype = gamma.dtype
        self.channels = gamma.shape[0]

    @property
    def nbytes(self):
        """Bytes held by the per-channel arrays."""
        return sum(a.nbytes for a in (self.s, self.lo, self.k, self.gamma, self.beta))

    def __repr__(self):
        return (f"QuantParams(bits={self.bits}, channels={self.channels}, "
                f"dtype={numpy.dtype(self.dtype).name})")


def quant_params(gamma, beta, bits):
    """The grid for one unit from its BN affine parameters γ, β: (C,) each.

    γ and β must share a float dtype (float32 or float64), which is also the
    dtype x̂ must have. Cost: a handful of (C,) operations, no data pass.
    """
    bits = check_bits(bits)
    xp = array_module(gamma)
    if gamma.ndim != 1 or beta.shape != gamma.shape:
        raise ValueError(f"gamma and beta must be 1-D of equal shape, "
                         f"got {gamma.shape} and {beta.shape}")
    if gamma.dtype != beta.dtype or gamma.dtype not in (numpy.float32, numpy.float64):
        raise ValueError(f"gamma and beta must share dtype float32 or float64, "
                         f"got {gamma.dtype} and {beta.dtype}")
    dt = gamma.dtype
    L = 1 << bits
    W, w = half_width(bits), bin_width(bits)
    zero = gamma == 0
    with numpy.errstate(over="ignore", divide="ignore", invalid="ignore"):
        # t = -β/|γ| may overflow to ±inf for tiny γ; the clips below absorb it.
        t = -beta / xp.where(zero, 1, xp.abs(gamma)).astype(dt)
        # k: the shift putting an edge on t is then at most w/2 from the
        # centred grid (lo = -W); clamped so both mask sides keep >= 1 code
        k = xp.clip(xp.rint((t + W) / w), 1, L - 1)
        # lo = t - k*w puts the edge on t; when k was clamped (t far out) the
        # clip keeps the window at -W ± w/2 instead of following t away
        lo = xp.clip(t - k * w, -W - w / 2, -W + w / 2)
    lo = xp.where(zero, -W, lo).astype(dt)
    k = xp.where(zero, xp.where(beta > 0, 0, L), k).astype(xp.int32)
    s = xp.where(gamma < 0, -1, 1).astype(dt)
    return QuantParams(bits, s, lo, k, gamma.copy(), beta.copy())


def quantize_simulated(xhat, gamma, beta, bits, rounding="nearest", key=None):
    """Reference path: (x̃, mask), both (C, M), as the packed path computes them.

    Whole arrays, plain float maths, no chunking, no packing: the readable
    statement of the rule. Allocates several x̂-sized temporaries.
    rounding="stochastic-window" adds the stream's offsets d to the bin position
    before the floor (key: an integer in [0, 2**64) or a Stream); "nearest" ignores key.
    The unbiased code ("stochastic") is units/unbiased.py's; `lowmem.units.quantize_simulated`
    takes any rounding.
    """
    check_window_rounding(rounding, "window.quantize_simulated")
    xp = array_module(xhat)
    qp = quant_params(gamma, beta, bits)
    L, w = qp.levels, qp.w
    s, lo = qp.s[:, None], qp.lo[:, None]
    k = qp.k.astype(xhat.dtype)[:, None]
    mask = (xhat * gamma[:, None]) + beta[:, None] > 0      # exactly as the engine
    position = (xhat * s - lo) / w                           # u in bins from lo
    stream = stream_base(rounding, key, xhat.shape[1])
    if stream is not None:                                   # + d: floor picks the upper
        d = draw_bits(stream, 0, xhat.shape[0], 0, xhat.shape[1], xp).astype(xhat.dtype)
        position = position + (d - (1 << (OFFSET_BITS - 1))) * 2.0 ** -OFFSET_BITS
    code = xp.clip(xp.floor(position), 0, L - 1)
    code = xp.where(mask, xp.maximum(code, k), xp.minimum(code, k - 1))
    xtilde = s * (lo + (code + 0.5) * w)
    return xtilde, mask


def _rows(a, C, name, dtype=None):
    """`a` viewed as (C, M) without a copy; clear errors otherwise."""
    if a.ndim < 2 or a.shape[0] != C:
        raise ValueError(f"{name} must have shape (C={C}, M), got {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (a copy would be activation-sized)")
    if dtype is not None and a.dtype != dtype:
        raise ValueError(f"{name} must have dtype {numpy.dtype(dtype).name}, got {a.dtype}")
    return a.reshape(C, -1)


# ---- quantize / decode ----------------------------------------------------

def quantize_pack(packed_out, xhat, qp, rounding="nearest", key=None):
    """Quantize x̂ and pack its codes.

    packed_out (packed_nbytes(C*M, bits),) uint8   written
    xhat       (C, M) C-contiguous, dtype qp.dtype read
    rounding   "nearest" or "stochastic-window"; key: the stream's key, an integer in
               [0, 2**64) or a Stream, required by "stochastic-window" (ignored by "nearest")
    Computes the exact ReLU mask `(x̂·γ) + β > 0` itself. Scratch: about
    (2·itemsize + 2.5)·CHUNK bytes (+ 16·CHUNK stochastic: the piece's counters), independent of the array size.
    """
    xp = array_module(xhat)
    C, L, w, bits = qp.channels, qp.levels, qp.w, qp.bits
    x2 = _rows(xhat, C, "xhat", qp.dtype)
    n, M = x2.size, x2.shape[1]
    check_packed(packed_out, n, bits, "packed_out")
    check_window_rounding(rounding, "window.quantize_pack")
    stream = stream_base(rounding, key, M)
    # the mask clamp as one clip per element: [lower, upper] =
    # mask ? [k, L-1] : [0, k-1], i.e. lower = mask*k, upper = mask*(L-k) + k-1
    kf = qp.k.astype(qp.dtype)
    span = (L - qp.k).astype(qp.dtype)
    km1 = (qp.k - 1).astype(qp.dtype)
    step = chunk_size(n)
    v = xp.empty(step, qp.dtype)        # the code, as a float, while it is built
    bound = xp.empty(step, qp.dtype)    # lower, then upper clamp
    mask = xp.empty(step, bool)
    codes = xp.empty(step, numpy.uint8)
    tmp = xp.empty(step * bits // 8, numpy.uint8)
    for a, b, pieces in chunks(n, M):
        for r0, r1, c0, c1, off in pieces:
            shape, cnt = (r1 - r0, c1 - c0), (r1 - r0) * (c1 - c0)
            x = x2[r0:r1, c0:c1]
            vv = v[:cnt].reshape(shape)
            bb = bound[off:off + cnt].reshape(shape)    # the piece's own part: its offsets
            mm = mask[:cnt].reshape(shape)
            rows = slice(r0, r1)
            if stream is not None:      # this piece's offsets d (the element's global counter)
                xp.copyto(bb, draw_bits(stream, r0, r1, c0, c1, xp), casting="unsafe")   # < 2**24: exact
                xp.subtract(bb, 1 << (OFFSET_BITS - 1), out=bb)
                xp.multiply(bb, 2.0 ** -OFFSET_BITS, out=bb)
            # exact mask, the engine's expression: multiply, then add
            xp.multiply(x, qp.gamma[rows, None], out=vv)
            xp.add(vv, qp.beta[rows, None], out=vv)
            xp.greater(vv, 0, out=mm)
            # raw bin index floor((s*x - lo)/w)
            xp.multiply(x, qp.s[rows, None], out=vv)
            xp.subtract(vv, qp.lo[rows, None], out=vv)
            xp.divide(vv, w, out=vv)
            if stream is not None:
                xp.add(vv, bb, out=vv)                          # + d (stochastic)
            xp.floor(vv, out=vv)
            # clip into [0, L-1] and into what the exact mask allows, in one go
            xp.multiply(mm, kf[rows, None], out=bb)
            xp.maximum(vv, bb, out=vv)
            xp.multiply(mm, span[rows, None], out=bb)
            xp.add(bb, km1[rows, None], out=bb)
            xp.minimum(vv, bb, out=vv)
            xp.copyto(codes[off:off + cnt].reshape(shape), vv, casting="unsafe")
        pack_block(packed_out[a * bits // 8:(b * bits + 7) // 8], codes[:b - a], bits, tmp)


def decode_each_chunk(out, packed, qp, extra=None):
    """The chunked decode loop: unpack one chunk of codes at a time and write
    x̃ = s·(lo + (code + 0.5)·w), the bin midpoint flipped back, into `out`
    block by block; then extra(out_block, code_block, r0, r1, c0, c1) if given
    (unpack_decode and decode_relu below; units/reference.py masks the output
    gradient with it, so the code backward needs no mask array)."""
    xp = array_module(packed)
    C, w, bits = qp.channels, qp.w, qp.bits
    o2 = _rows(out, C, "out")
    if o2.dtype.kind != "f":
        raise ValueError(f"out must be a float array, got {o2.dtype}")
    n, M = o2.size, o2.shape[1]
    check_packed(packed, n, bits)
    codes = xp.empty(chunk_size(n), numpy.uint8)
    for a, b, pieces in chunks(n, M):
        unpack_block(codes[:b - a], packed[a * bits // 8:(b * bits + 7) // 8], bits)
        for r0, r1, c0, c1, off in pieces:
            ob = o2[r0:r1, c0:c1]
            cb = codes[off:off + ob.size].reshape(ob.shape)
            xp.copyto(ob, cb)                       # exact: small integers
            xp.add(ob, 0.5, out=ob)
            xp.multiply(ob, w, out=ob)              # exact: w = m·2**e, m odd < 64 (half_width())
            xp.add(ob, qp.lo[r0:r1, None], out=ob)  # the one rounding
            xp.multiply(ob, qp.s[r0:r1, None], out=ob)
            if extra is not None:
                extra(ob, cb, r0, r1, c0, c1)


def unpack_decode(xhat_out, packed, qp, mask_out=None):
    """Decode x̃ (and optionally the exact ReLU mask) from packed codes.

    xhat_out (C, M) float, C-contiguous   written: x̃, computed in its dtype
    packed   (packed_nbytes(C*M, bits),) uint8
    mask_out (C, M) bool or None          written: the exact mask y > 0
    Bit-identical to `quantize_simulated` when xhat_out has qp's dtype.
    Scratch: CHUNK bytes.
    """
    xp = array_module(packed)
    if mask_out is None:
        decode_each_chunk(xhat_out, packed, qp)
        return
    m2 = _rows(mask_out, qp.channels, "mask_out", numpy.bool_)
    if m2.size != xhat_out.size:
        raise ValueError(f"mask_out shape {mask_out.shape} does not match xhat_out {xhat_out.shape}")

    def write_mask(ob, cb, r0, r1, c0, c1):
        xp.greater_equal(cb, qp.k[r0:r1, None], out=m2[r0:r1, c0:c1])

    decode_each_chunk(xhat_out, packed, qp, write_mask)


def decode_relu(out, packed, qp, gamma, beta):
    """The conv input rebuilt from the code (and the naive mode's forward output):
    relu(γ·x̃ + β) under the exact decoded mask.

    out (C, M) float, C-contiguous   written: (x̃·γ) + β where code >= k and that value
                                     is > 0, else +0
    packed, qp as for unpack_decode; gamma, beta (C,) as given to quant_params.
    Scratch: 2·CHUNK bytes.

    Both conditions are needed. The decoded mask (code >= k) zeroes every closed element,
    whatever x̃ is. The value's own sign matters only for an open element whose bin lies on
    the closed side of the threshold: when t lies beyond the window's top midpoint (k clamped
    to L−1, the `lo` clip), x̃ of the top code is below t and (x̃·γ) + β < 0 while the true
    input is > 0. Such an element gets 0, the nearest value its side allows; every other open
    element already has (x̃·γ) + β > 0 and is unchanged (docs/quantizer.md §3b).
    """
    xp = array_module(packed)
    off_mask = xp.empty(chunk_size(out.size), bool)

    def affine_relu(ob, cb, r0, r1, c0, c1):
        xp.multiply(ob, gamma[r0:r1, None], out=ob)
        xp.add(ob, beta[r0:r1, None], out=ob)
        nm = off_mask[:ob.size].reshape(ob.shape)
        # an open element decoded to the closed side (t beyond the window): 0, not < 0
        xp.less_equal(ob, 0, out=nm)
        xp.copyto(ob, 0, where=nm)
        # zero by the decoded mask, not by the sign of γ·x̃ + β alone: the mask is exact
        xp.less(cb, qp.k[r0:r1, None], out=nm)
        xp.copyto(ob, 0, where=nm)

    decode_each_chunk(out, packed, qp, affine_relu)

