"""The unbiased group-range code of x̂ (rounding="stochastic"): E[x̃ | x̂] = x̂ for every element.

Per channel c work on u = s·x̂ (s = sign(γ), +1 for γ = 0), so the exact ReLU mask
(x̂·γ) + β > 0 means "u above t = −β/|γ|". The K-bit codes (L = 2**K, K ≥ 2) split at k:
codes k..L−1 are open (the mask is `code >= k`, as in units/quant.py), 0..k−1 closed. The
levels, per group (256 consecutive elements of a channel's row of N·H·W; `GROUP`):

* a channel with elements on both sides: the open side has L−k levels evenly from t up to
  hi_g, the group's largest open u; the closed side k levels from lo_g, the group's smallest
  closed u, up to t. t is a level on both sides, so the lowest open level rebuilds a conv
  input of exactly 0. k = L/2 at 2 bits; above, k = rint(L·(t − min)/(max − min)) over the
  channel, clipped to [2, L−2] (each side keeps two levels: both its ends);
* a channel on one side only (γ = 0, t outside the data's range, an all-zero or constant
  channel): k = 0 (all open) or L (all closed) and L levels evenly from lo_g (raised to t on
  the open side) to hi_g, the group's range.

hi_g and lo_g are rounded outward to bfloat16 (`bf16_up`, `bf16_down`) and stored, 4 bytes per
group: every element lies inside its side's levels (nothing is clipped), and a decode needs
only the stored bits, so every path decodes the same x̃. Encoding (stochastic rounding
between the two levels of the element's own side that enclose it):

    p = (u − base)/step,  j = min(max(floor(p + r), 0), n − 1),  code = code0 + j

with r uniform in [0, 1) from the counter stream (units/stream.py, keyed by the element's
global index), so E[j] = p and E[x̃] = x̂ up to float rounding and the stream's 2**−24 grid;
a side whose levels coincide (step 0) decodes to its base. Decode: x̃ = s·(base + j·step);
the conv input of an open element |γ|·((base − t) + j·step) (β where γ = 0): ≥ 0, and 0 at t.

The saved slot (one uint8 array, `slot_nbytes`): the packed codes (units/quant.py's packing,
padded to 8 bytes), then (C, G, 2) uint16 group ends (hi, lo), then (C,) uint16 k; at 2 bits
4 + 4·8/256 = 2.125 bits per element when M is a multiple of 256. Scratch: (C, G) arrays of
the group ends and levels, and per quant.CHUNK-sized piece a few piece-sized temporaries.

1 bit cannot be unbiased with an exact mask (one level per side): units/reference.py then
uses the window code with nearest rounding. The measured variant with the group end on the
open side only (`ends="open"`: the closed side's bottom is the channel's) is reachable
through `quantize_simulated` for the study of docs/quantizer.md; the packed slot stores both.
"""
import numpy

from . import quant
from .stream import resolve, uniforms
from ..system.backend import array_module

GROUP = 256
ENDS = ("group", "open")


def groups(M):
    """Groups per channel row of M elements: ceil(M / GROUP)."""
    return -(-int(M) // GROUP)


def _code_bytes(C, M, bits):
    return (quant.packed_nbytes(C * M, bits) + 7) // 8 * 8


def slot_nbytes(C, M, bits):
    """Bytes of a unit's saved slot: padded codes, 4 bytes per group, 1 per channel."""
    return _code_bytes(C, M, bits) + 4 * C * groups(M) + 2 * C


def metadata_nbytes(C, M, bits):
    """The slot's bytes beyond the packed codes (the group ends, k, the padding)."""
    return slot_nbytes(C, M, bits) - quant.packed_nbytes(C * M, bits)


def split_slot(slot, C, M, bits):
    """(codes (packed_nbytes,) uint8, ends (C, G, 2) uint16, k (C,) uint16): views into slot."""
    n0 = _code_bytes(C, M, bits)
    G = groups(M)
    if slot.dtype != numpy.uint8 or slot.ndim != 1 or slot.size < slot_nbytes(C, M, bits):
        raise ValueError(f"the unbiased code's slot must be uint8 of at least {slot_nbytes(C, M, bits)} "
                         f"bytes for C={C}, M={M} at {bits} bits, got {slot.dtype} {slot.shape}")
    codes = slot[:quant.packed_nbytes(C * M, bits)]
    ends = slot[n0:n0 + 4 * C * G].view(numpy.uint16).reshape(C, G, 2)
    k = slot[n0 + 4 * C * G:n0 + 4 * C * G + 2 * C].view(numpy.uint16)
    return codes, ends, k


# ---- bfloat16, rounded outward ------------------------------------------------

def _bf16(v, up):
    """uint16 bfloat16 bits of the smallest bf16 >= v (up) or the largest <= v (down)."""
    xp = array_module(v)
    f = v.astype(numpy.float32)
    if v.dtype != numpy.float32:                      # outward to float32 first
        off = (f < v) if up else (f > v)
        f = xp.where(off, xp.nextafter(f, numpy.float32(numpy.inf if up else -numpy.inf)), f)
    b = (f.view(numpy.uint32) >> 16).astype(numpy.uint32)        # toward zero
    t = (b << 16).view(numpy.float32)
    # toward zero is outward for the side v's sign points away from: fix the other one
    bump = (t < f) if up else (t > f)
    return (b + bump).astype(numpy.uint16)


def bf16_up(v):
    return _bf16(v, True)


def bf16_down(v):
    return _bf16(v, False)


def bf16_value(b, dtype):
    """bf16 bits (uint16) -> values in dtype (exact)."""
    return (b.astype(numpy.uint32) << 16).view(numpy.float32).astype(dtype)


# ---- the levels --------------------------------------------------------------

class Levels:
    """Per channel and group, the affine level maps of both sides (all (C, G) or (C,) arrays):
    level j of the open side is base_o + j·step_o (codes k + j), of the closed side
    base_c + j·step_c (codes j). Built from the stored group ends, k, γ and β alone."""

    def __init__(self, ends, k, gamma, beta, bits):
        xp = array_module(gamma)
        dt = gamma.dtype
        L = 1 << bits
        self.bits, self.levels = bits, L
        self.s = xp.where(gamma < 0, -1, 1).astype(dt)
        zero = gamma == 0
        with numpy.errstate(over="ignore", divide="ignore", invalid="ignore"):
            t = -beta / xp.where(zero, 1, xp.abs(gamma)).astype(dt)
        self.t = xp.where(zero, -numpy.inf, t).astype(dt)       # γ = 0: no threshold level
        self.ag = xp.abs(gamma)
        self.gamma, self.beta = gamma, beta
        hi, lo = bf16_value(ends[..., 0], dt), bf16_value(ends[..., 1], dt)
        self.k = k.astype(numpy.int32)
        kk = self.k[:, None]
        two = (kk > 0) & (kk < L)
        t2 = self.t[:, None]
        n_open = xp.maximum(L - kk, 1).astype(dt)
        n_closed = xp.maximum(kk, 1).astype(dt)
        # open side: from t (both sides) or from lo raised to t (all open) up to hi
        self.base_o = xp.where(two, t2, xp.minimum(xp.maximum(lo, t2), hi)).astype(dt)
        # closed side: from lo up to t (both sides), or up to hi (all closed)
        self.base_c = lo.astype(dt)
        top_c = xp.where(two, t2, hi)
        with numpy.errstate(invalid="ignore", over="ignore"):
            self.step_o = xp.where(n_open > 1, (hi - self.base_o) / xp.maximum(n_open - 1, 1), 0).astype(dt)
            self.step_c = xp.where(n_closed > 1, (top_c - lo) / xp.maximum(n_closed - 1, 1), 0).astype(dt)
        self.step_o = xp.where(xp.isfinite(self.step_o) & (self.step_o > 0), self.step_o, 0).astype(dt)
        self.step_c = xp.where(xp.isfinite(self.step_c) & (self.step_c > 0), self.step_c, 0).astype(dt)

    def piece(self, r0, r1, c0, c1):
        """Per element of rows r0:r1, columns c0:c1: (base_o, step_o, base_c, step_c) gathered
        from their groups, each (r1−r0, c1−c0)."""
        xp = array_module(self.base_o)
        g = xp.arange(c0, c1) // GROUP
        return tuple(a[r0:r1][:, g] for a in (self.base_o, self.step_o, self.base_c, self.step_c))


# ---- the metadata pass -------------------------------------------------------

def _blocks(C, M):
    """(r0, r1, c0, c1) blocks of whole groups covering (C, M), about quant.CHUNK elements each."""
    step = quant._chunk()
    if M <= step:
        rows = max(1, step // M)
        for r0 in range(0, C, rows):
            yield r0, min(C, r0 + rows), 0, M
    else:
        cols = max(GROUP, step // GROUP * GROUP)
        for r in range(C):
            for c0 in range(0, M, cols):
                yield r, r + 1, c0, min(M, c0 + cols)


def metadata(ends_out, k_out, xhat, gamma, beta, bits, variant="group"):
    """The group ends (C, G, 2) uint16 (bf16 hi, lo) and the split k (C,) uint16 of x̂ (C, M):
    one pass over x̂ in blocks; scratch (C, G) arrays and block-sized temporaries."""
    xp = array_module(xhat)
    C, M = xhat.shape
    L, G, dt = 1 << bits, groups(M), xhat.dtype
    s = xp.where(gamma < 0, -1, 1).astype(dt)
    big = numpy.finfo(dt).max
    omax, omin = xp.full((C, G), -big, dt), xp.full((C, G), big, dt)
    cmax, cmin = xp.full((C, G), -big, dt), xp.full((C, G), big, dt)
    nopen = xp.zeros((C, G), numpy.int64)
    for r0, r1, c0, c1 in _blocks(C, M):
        x = xhat[r0:r1, c0:c1]
        mask = (x * gamma[r0:r1, None]) + beta[r0:r1, None] > 0     # the engine's expression
        u = x * s[r0:r1, None]
        starts = numpy.arange(0, c1 - c0, GROUP)
        gs = slice(c0 // GROUP, c0 // GROUP + starts.size)
        ix = xp.asarray(starts)
        omax[r0:r1, gs] = xp.maximum.reduceat(xp.where(mask, u, -big), ix, axis=1)
        omin[r0:r1, gs] = xp.minimum.reduceat(xp.where(mask, u, big), ix, axis=1)
        cmax[r0:r1, gs] = xp.maximum.reduceat(xp.where(mask, -big, u), ix, axis=1)
        cmin[r0:r1, gs] = xp.minimum.reduceat(xp.where(mask, big, u), ix, axis=1)
        nopen[r0:r1, gs] = xp.add.reduceat(mask.astype(numpy.int64), ix, axis=1)
    sizes = xp.asarray(numpy.minimum(GROUP, M - GROUP * numpy.arange(G)))
    any_open = (nopen > 0).any(axis=1)
    any_closed = (nopen < sizes[None, :]).any(axis=1)
    two = any_open & any_closed
    lo_all, hi_all = xp.minimum(omin, cmin), xp.maximum(omax, cmax)
    two2 = two[:, None]
    hi = xp.where(two2, omax, hi_all)
    lo = xp.where(two2, cmin, lo_all)
    # a group with nothing on a side: that side's end at t (unused; keeps the levels ordered)
    zero = gamma == 0
    with numpy.errstate(over="ignore", divide="ignore", invalid="ignore"):
        t = (-beta / xp.where(zero, 1, xp.abs(gamma)).astype(dt)).astype(dt)
    t2 = xp.broadcast_to(t[:, None], hi.shape)
    hi = xp.where(two2 & (hi == -big), t2, hi)
    lo = xp.where(two2 & (lo == big), t2, lo)
    hi = xp.where(hi == -big, 0, hi)          # an empty channel row (M = 0 cannot reach here)
    lo = xp.where(lo == big, 0, lo)
    if variant == "open":                     # the cheaper variant: the closed end per channel
        lo = xp.broadcast_to(lo.min(axis=1, keepdims=True), lo.shape)
    elif variant != "group":
        raise ValueError(f"variant must be one of {ENDS}, got {variant!r}")
    ends_out[..., 0] = bf16_up(hi)
    ends_out[..., 1] = bf16_down(lo)
    if L >= 8:
        ch_min, ch_max = lo_all.min(axis=1), hi_all.max(axis=1)
        with numpy.errstate(invalid="ignore", divide="ignore", over="ignore"):
            kt = xp.rint(L * (t - ch_min) / (ch_max - ch_min))
        kt = xp.clip(xp.where(xp.isfinite(kt), kt, L // 2), 2, L - 2)
    else:
        kt = xp.full(C, L // 2, dt)
    k = xp.where(two, kt, xp.where(any_open, 0, L))
    k_out[...] = k.astype(numpy.uint16)


# ---- encode, decode ----------------------------------------------------------

def _encode_piece(x, lv, r0, r1, c0, c1, stream):
    """Codes (r1−r0, c1−c0) as floats of x̂ block x (rows r0:r1, columns c0:c1)."""
    xp = array_module(x)
    L = lv.levels
    mask = (x * lv.gamma[r0:r1, None]) + lv.beta[r0:r1, None] > 0
    u = x * lv.s[r0:r1, None]
    bo, so, bc, sc = lv.piece(r0, r1, c0, c1)
    k = lv.k[r0:r1, None].astype(x.dtype)
    base, step = xp.where(mask, bo, bc), xp.where(mask, so, sc)
    n = xp.where(mask, L - k, k)
    with numpy.errstate(divide="ignore", invalid="ignore"):
        p = xp.where(step > 0, (u - base) / xp.where(step > 0, step, 1), 0)
    p = p + uniforms(stream, r0, r1, c0, c1, x.dtype, xp)
    j = xp.minimum(xp.maximum(xp.floor(p), 0), n - 1)
    return xp.where(mask, k + j, j)


def _decode_piece(code, lv, r0, r1, c0, c1, relu):
    """x̃ (relu=False) or the conv input (relu=True) of float codes (rows r0:r1, cols c0:c1)."""
    xp = array_module(code)
    bo, so, bc, sc = lv.piece(r0, r1, c0, c1)
    k = lv.k[r0:r1, None].astype(code.dtype)
    open_ = code >= k
    j = code - xp.where(open_, k, 0)
    if relu:
        ag, t = lv.ag[r0:r1, None], lv.t[r0:r1, None]
        zero = lv.gamma[r0:r1, None] == 0
        with numpy.errstate(invalid="ignore"):
            val = xp.where(zero, lv.beta[r0:r1, None], ag * ((bo - xp.where(zero, bo, t)) + j * so))
        return xp.where(open_, xp.maximum(val, 0), 0)
    return lv.s[r0:r1, None] * xp.where(open_, bo + j * so, bc + j * sc)


def check_bits(bits):
    bits = quant.check_bits(bits)
    if bits < 2:
        raise ValueError("the unbiased code needs bits >= 2 (one level per side cannot be unbiased)")
    return bits


def quantize_simulated(xhat, gamma, beta, bits, key, variant="group"):
    """Reference (x̃, mask), both (C, M): the unbiased code's decode of x̂ for stream `key` (an
    integer or a Stream), whole arrays; the packed path (quantize_pack + decode) matches it bit
    for bit. variant="open": the measured cheaper variant (not packed)."""
    bits = check_bits(bits)
    xp = array_module(xhat)
    C, M = xhat.shape
    ends = xp.empty((C, groups(M), 2), numpy.uint16)
    k = xp.empty(C, numpy.uint16)
    metadata(ends, k, xhat, gamma, beta, bits, variant)
    lv = Levels(ends, k, gamma, beta, bits)
    stream = resolve(key, M, what="stochastic")
    code = _encode_piece(xhat, lv, 0, C, 0, M, stream)
    mask = (xhat * gamma[:, None]) + beta[:, None] > 0
    return _decode_piece(code, lv, 0, C, 0, M, relu=False), mask


def quantize_pack(slot, xhat, gamma, beta, bits, key):
    """Encode x̂ (C, M) into the unit's slot (uint8, >= slot_nbytes): metadata, then the codes
    packed chunk by chunk (quant's walk and packing). key: integer or Stream (required)."""
    bits = check_bits(bits)
    xp = array_module(xhat)
    C, M = xhat.shape
    codes, ends, k = split_slot(slot, C, M, bits)
    metadata(ends, k, xhat, gamma, beta, bits)
    lv = Levels(ends, k, gamma, beta, bits)
    stream = resolve(key, M, what="stochastic")
    n = C * M
    step = quant._chunk(n)
    buf = xp.empty(step, numpy.uint8)
    tmp = xp.empty(step * bits // 8, numpy.uint8)
    for a, b, pieces in quant._chunks(n, M):
        for r0, r1, c0, c1, off in pieces:
            code = _encode_piece(xhat[r0:r1, c0:c1], lv, r0, r1, c0, c1, stream)
            xp.copyto(buf[off:off + code.size].reshape(code.shape), code, casting="unsafe")
        quant._pack_block(codes[a * bits // 8:(b * bits + 7) // 8], buf[:b - a], bits, tmp)


def decode_each_chunk(out, slot, gamma, beta, bits, relu=False, extra=None):
    """Decode the slot chunk by chunk into out (C, M) float: x̃, or the conv input (relu=True);
    then extra(out_block, open_block, r0, r1, c0, c1) (open: the exact mask of the block)."""
    xp = array_module(out)
    C, M = out.shape
    codes, ends, k = split_slot(slot, C, M, bits)
    lv = Levels(ends, k, gamma, beta, bits)
    n = C * M
    buf = xp.empty(quant._chunk(n), numpy.uint8)
    for a, b, pieces in quant._chunks(n, M):
        quant._unpack_block(buf[:b - a], codes[a * bits // 8:(b * bits + 7) // 8], bits)
        for r0, r1, c0, c1, off in pieces:
            cb = buf[off:off + (r1 - r0) * (c1 - c0)].reshape(r1 - r0, c1 - c0).astype(out.dtype)
            ob = out[r0:r1, c0:c1]
            ob[...] = _decode_piece(cb, lv, r0, r1, c0, c1, relu)
            if extra is not None:
                extra(ob, cb >= lv.k[r0:r1, None], r0, r1, c0, c1)
