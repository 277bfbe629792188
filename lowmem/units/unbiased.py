"""The unbiased group-range code of x̂ (rounding="stochastic"): E[x̃ | x̂] = x̂ for every element.

Per channel c work on u = s·x̂ (s = sign(γ), +1 for γ = 0), so the exact ReLU mask
(x̂·γ) + β > 0 means "u above t = −β/|γ|". The K-bit codes (L = 2**K, K ≥ 2) split at k, the
window code's split (window.quant_params, from γ and β alone) clipped to [2, L−2]: codes k..L−1
are open (the mask is `code >= k`, as in units/window.py), 0..k−1 closed. A group is 256
consecutive elements of a channel's row of N·H·W (`GROUP`), except a row's last group, which
also takes the M mod 256 elements after it (so it holds 256 to 511, or a whole row shorter than
256: `groups`); it stores its range [lo, hi] of u, rounded outward to bfloat16 (4 bytes). Its
levels, evenly spaced on each side:

    open   (L−k levels): from max(t, lo) up to hi
    closed (k levels):   from lo up to min(t, hi)

so in a group with elements on both sides t is a level of both (the lowest open level
rebuilds a conv input of exactly 0), and a group on one side only (t outside its data, γ = 0,
an all-zero or constant channel) spends its side's levels on its own range. Every element lies
within its side's levels: nothing is clipped. Encoding (stochastic rounding between the two
levels of the element's own side that enclose it):

    p = (u − base)/step,  j = min(max(floor(p + r), 0), n − 1),  code = code0 + j

with r uniform in [0, 1) on the 2**−24 grid, so E[j] = p and E[x̃] = x̂ up to float rounding
and that grid; a side whose levels coincide (step 0) decodes to its base. From 3 bits up each
element draws its own r from the counter stream (units/stream.py, keyed by its global index).
At 2 bits (SYSTEMATIC_BITS), where each side has two levels and a draw's error is as wide as
the group's range, the draws are systematic (systematic_uniforms): one counter draw per
group (its first element's), and along each lane of the group (elements l, l + 4, l + 8, ...)
and side each element's r continues from the fractions of p before it, so every r is still
uniform but neighbours' rounding errors cancel: the count of round-ups in a lane and side
stays within one of its expectation. Decode: x̃ = s·(base + j·step);
the conv input of an open element |γ|·((base − t) + j·step) (β where γ = 0): ≥ 0, and 0 at t.
Every decision is the group's own or comes from γ and β, so a data-parallel shard whose rows
are whole groups (n_local·H·W a multiple of 256) codes exactly what the whole batch codes there.

The saved slot (one uint8 array, `slot_nbytes`): the packed codes (units/packing.py's layout,
padded to 8 bytes), then (C, G, 2) uint16 group ends (hi, lo): at 2 bits
2 + 32·floor(M/256)/M bits per element, 2.125 when M is a multiple of 256 and below it for any
other M >= 256 (a row shorter than 256 pays 32/M). Scratch: (C, G) arrays of the group ends and
levels, and per packing.CHUNK-sized piece a few piece-sized temporaries.

The dithered code (rounding="dither"; `dither=True` / draws="dither" below) keeps these levels
and metadata and changes the draw and the decode. Element i of a group (its index in the group)
draws r_i = R_i·2**−24 with R_i = (u0 + i·WEYL) mod 2**24 (u0 the group's one counter draw, as
the systematic draws' start: a Weyl sequence along the group, every r_i uniform), codes j =
floor(p + r) as above, and the decoder subtracts the dither:

    x̃ = s·(base + (j + d)·step),   d = 1/2 − r = (2**23 − R)·2**−24   (exact in float)

E[j] = p and E[d] = 0, so E[x̃] = x̂ as before; but the error (j + d − p)·step =
(1/2 − frac(p + r))·step is uniform on ±step/2 whatever x̂ (variance step²/12, where stochastic
rounding's is f(1−f)·step² with f the fraction of p: larger for the many open elements near
t), and along the Weyl sequence neighbours' errors cancel. The decoder regenerates R from the
stream, which the slot therefore carries: (mix64(key), start, row) as three uint64 right after
the codes (STREAM_NBYTES), so a decode reads nothing but the slot, γ and β. The conv input of an
open element, |γ|·((base − t) + (j + d)·step), may be negative: it is not clamped at 0 (a clamp
would bias it).

1 bit cannot be unbiased with an exact mask (one level per side): units/reference.py then
uses the window code with nearest rounding. The measured cheaper variant (`variant="open"`:
one end per group, the lower end the channel's) is reachable through `quantize_simulated`
only, for docs/quantizer.md's comparison.
"""
import functools

import numpy

from . import packing, widths, window
from .stream import OFFSET_BITS, group_bits, resolve, uniforms
from ..system.backend import array_module

GROUP = 256
ENDS = ("group", "open")
STREAM_NBYTES = 24      # the dithered code's slot: (mix64(key), start, row) as uint64, after the codes


def groups(M):
    """Groups per channel row of M elements: floor(M / GROUP), at least 1 (the row's last group
    takes the M mod GROUP elements after it; a row shorter than GROUP is one group)."""
    return max(1, int(M) // GROUP)


def group_start(col, M):
    """The first column of the group that holds column `col` (an int or an integer array) of a
    row of M elements."""
    last = groups(M) - 1
    if isinstance(col, (int, numpy.integer)):
        return min(int(col) // GROUP, last) * GROUP
    return array_module(col).minimum(col // GROUP, last) * GROUP


def group_end(col, M):
    """One past the last column of the group that starts at column `col` (a multiple of GROUP)."""
    return M if col // GROUP >= groups(M) - 1 else col + GROUP


def _code_bytes(C, M, bits):
    return (packing.packed_nbytes(C * M, bits) + 7) // 8 * 8


def slot_nbytes(C, M, bits, dither=False):
    """Bytes of a unit's saved slot: the codes padded to 8 bytes, the stream (dither: 24 bytes),
    then 4 bytes per group."""
    return _code_bytes(C, M, bits) + (STREAM_NBYTES if dither else 0) + 4 * C * groups(M)


def metadata_nbytes(C, M, bits, dither=False):
    """The slot's bytes beyond the packed codes (the group ends, the stream, the padding)."""
    return slot_nbytes(C, M, bits, dither) - packing.packed_nbytes(C * M, bits)


@functools.lru_cache(maxsize=1024)
def _slot_layout(C, M, bits, dither):
    """(codes' bytes, where the ends start, groups a row, the slot's bytes) of a slot: asked by
    every kernel call of every unit, so made once per shape."""
    return (packing.packed_nbytes(C * M, bits), _code_bytes(C, M, bits) + (STREAM_NBYTES if dither else 0),
            groups(M), slot_nbytes(C, M, bits, dither))


def split_slot(slot, C, M, bits, dither=False):
    """(codes (packed_nbytes,) uint8, ends (C, G, 2) uint16 bf16 (hi, lo)): views into slot
    (the dithered code's stream sits between them: slot_stream)."""
    ncodes, n0, G, need = _slot_layout(int(C), int(M), bits, bool(dither))
    if slot.dtype != numpy.uint8 or slot.ndim != 1 or slot.size < need:
        raise ValueError(f"the {'dithered ' if dither else ''}unbiased code's slot must be uint8 of at least "
                         f"{need} bytes for C={C}, M={M} at {bits} bits, got {slot.dtype} {slot.shape}")
    return slot[:ncodes], slot[n0:n0 + 4 * C * G].view(numpy.uint16).reshape(C, G, 2)


def slot_stream(slot, C, M, bits):
    """The dithered code's stream in its slot: a (3,) uint64 view, resolve()'s (base, start, row)."""
    n0 = _code_bytes(C, M, bits)
    return slot[n0:n0 + STREAM_NBYTES].view(numpy.uint64)


def read_stream(slot, C, M, bits):
    """resolve()'s (base, start, row), Python ints, from a dithered slot (a device slot: one copy)."""
    words = slot_stream(slot, C, M, bits)
    return tuple(int(v) for v in (words.get() if hasattr(words, "get") else words))


def split(gamma, beta, bits):
    """k (C,) int32, the first open code: the window code's split (window.quant_params, from γ and
    β alone), clipped to [2, L−2] where γ != 0 so each side keeps two levels; 0 or L where γ = 0."""
    L = 1 << bits
    k = window.quant_params(gamma, beta, bits).k
    xp = array_module(k)
    return xp.where(gamma == 0, k, xp.clip(k, 2, L - 2)).astype(numpy.int32)


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
    base_c + j·step_c (codes j). Built from the stored group ends, γ and β alone:

        open:   from max(t, lo) up to hi          (t where the group has closed elements)
        closed: from lo up to min(t, hi)          (t where the group has open elements)"""

    def __init__(self, ends, gamma, beta, bits):
        xp = array_module(gamma)
        dt = gamma.dtype
        L = 1 << bits
        self.bits, self.levels = bits, L
        self.s = xp.where(gamma < 0, -1, 1).astype(dt)
        zero = gamma == 0
        with numpy.errstate(over="ignore", divide="ignore", invalid="ignore"):
            t = (-beta / xp.where(zero, 1, xp.abs(gamma)).astype(dt)).astype(dt)
        # γ = 0: no threshold; each side's levels span the group's range
        self.t = xp.where(zero, -numpy.inf, t).astype(dt)[:, None]
        t_top = xp.where(zero, numpy.inf, t).astype(dt)[:, None]
        self.ag, self.zero = xp.abs(gamma)[:, None], zero[:, None]
        self.gamma, self.beta = gamma, beta
        hi, lo = bf16_value(ends[..., 0], dt), bf16_value(ends[..., 1], dt)
        self.k = split(gamma, beta, bits)
        kk = self.k[:, None]
        self.base_o = xp.minimum(xp.maximum(self.t, lo), hi).astype(dt)
        self.base_c = lo
        top_c = xp.maximum(xp.minimum(t_top, hi), lo)
        with numpy.errstate(invalid="ignore", over="ignore"):
            step_o = (hi - self.base_o) / xp.maximum(L - kk - 1, 1).astype(dt)
            step_c = (top_c - lo) / xp.maximum(kk - 1, 1).astype(dt)
        ok_o = (L - kk > 1) & xp.isfinite(step_o) & (step_o > 0)
        ok_c = (kk > 1) & xp.isfinite(step_c) & (step_c > 0)
        self.step_o = xp.where(ok_o, step_o, 0).astype(dt)
        self.step_c = xp.where(ok_c, step_c, 0).astype(dt)

    def tables(self, relu):
        """(C, G, L) decode tables, built once per call (K <= 4: L <= 16 entries per group of 256):
        x̃ (relu=False) or the conv input (relu=True) of every code, with the operations of
        _decode_piece, so a lookup equals the formula bit for bit."""
        xp = array_module(self.base_o)
        C, G = self.base_o.shape
        code = xp.broadcast_to(xp.arange(self.levels, dtype=self.base_o.dtype), (C, G, self.levels))
        return _decode_levels(code, self, slice(0, C), tuple(a[:, :, None] for a in
                              (self.base_o, self.step_o, self.base_c, self.step_c)), relu)[0]

    def piece(self, r0, r1, c0, c1):
        """Per element of rows r0:r1, columns c0:c1: (base_o, step_o, base_c, step_c) gathered
        from their groups, each (r1−r0, c1−c0)."""
        xp = array_module(self.base_o)
        g = xp.minimum(xp.arange(c0, c1) // GROUP, self.base_o.shape[1] - 1)
        return tuple(a[r0:r1][:, g] for a in (self.base_o, self.step_o, self.base_c, self.step_c))


# ---- the metadata pass -------------------------------------------------------

def _blocks(C, M):
    """(r0, r1, c0, c1) blocks of whole groups covering (C, M), about packing.CHUNK elements each
    (a row's last block also takes a remainder shorter than a group: its last group's)."""
    step = packing.chunk_size()
    if M <= step:
        rows = max(1, step // M)
        for r0 in range(0, C, rows):
            yield r0, min(C, r0 + rows), 0, M
    else:
        cols = max(GROUP, step // GROUP * GROUP)
        starts = list(range(0, M, cols))
        if M - starts[-1] < GROUP:
            starts.pop()
        for r in range(C):
            for i, c0 in enumerate(starts):
                yield r, r + 1, c0, starts[i + 1] if i + 1 < len(starts) else M


def metadata(ends_out, xhat, gamma, variant="group"):
    """The group ends (C, G, 2) uint16 of x̂ (C, M): bf16 (max of u rounded up, min rounded
    down), u = sign(γ)·x̂; one pass over x̂ in blocks (block-sized temporaries).
    variant="open" (measured, not packed): the lower end is the channel's minimum."""
    xp = array_module(xhat)
    C, M = xhat.shape
    G, dt = groups(M), xhat.dtype
    s = xp.where(gamma < 0, -1, 1).astype(dt)
    hi, lo = xp.empty((C, G), dt), xp.empty((C, G), dt)
    for r0, r1, c0, c1 in _blocks(C, M):
        for s0, s1, size in _segments(r0, r1, c0, c1, M):       # (R, g, size) views: whole groups
            u = xhat[r0:r1, s0:s1].reshape(r1 - r0, (s1 - s0) // size, size) * s[r0:r1, None, None]
            gs = slice(s0 // GROUP, s0 // GROUP + u.shape[1])
            hi[r0:r1, gs] = u.max(axis=2)
            lo[r0:r1, gs] = u.min(axis=2)
    if variant == "open":                     # the cheaper variant: the lower end per channel
        lo = xp.broadcast_to(lo.min(axis=1, keepdims=True), lo.shape)
    elif variant != "group":
        raise ValueError(f"variant must be one of {ENDS}, got {variant!r}")
    ends_out[..., 0] = bf16_up(hi)
    ends_out[..., 1] = bf16_down(lo)


# ---- encode, decode ----------------------------------------------------------

def default_draws(bits):
    """The packed code's draws at `bits`: "systematic" at K <= SYSTEMATIC_BITS, else "independent"."""
    return "systematic" if bits <= SYSTEMATIC_BITS else "independent"


def _encode_segments(xhat, lv, r0, r1, c0, c1, stream, draws, lanes):
    """(s0, s1, codes (r1−r0, s1−s0) floats) of rows r0:r1 over columns c0:c1, whole groups
    (c0 a multiple of GROUP; c1 one too, or M), run by run of equal groups (_segments).
    draws: "systematic" (each group's walk from its draw, stream.group_bits), "independent"
    (each element's own draw) or "dither" (the Weyl sequence from each group's draw)."""
    xp = array_module(xhat)
    u0 = group_bits(stream, r0, r1, c0, c1, GROUP, xp) if draws != "independent" else None
    for s0, s1, size in _segments(r0, r1, c0, c1, xhat.shape[1]):
        shape = (r1 - r0, (s1 - s0) // size, size)
        if u0 is None:
            r = uniforms(stream, r0, r1, s0, s1, xhat.dtype, xp).reshape(shape)
            draw = lambda p, mask, r=r: r                                    # noqa: E731
        elif draws == "dither":
            g0 = (s0 - c0) // GROUP
            r = weyl_uniforms(u0[:, g0:g0 + shape[1]], size, xhat.dtype)
            draw = lambda p, mask, r=r: r                                    # noqa: E731
        else:
            g0 = (s0 - c0) // GROUP
            draw = lambda p, mask, u=u0[:, g0:g0 + shape[1], None]: systematic_uniforms(p, mask, u, lanes)  # noqa: E731
        code = _encode_block(xhat[r0:r1, s0:s1].reshape(shape), lv, slice(r0, r1),
                             _grouped(lv, r0, r1, s0, s1, size), draw)
        yield s0, s1, code.reshape(r1 - r0, s1 - s0)


def _encode_piece(xhat, lv, r0, r1, c0, c1, stream, draws=None, lanes=None):
    """Codes (r1−r0, c1−c0) as floats of x̂ rows r0:r1, columns c0:c1 of the whole (C, M) x̂:
    the piece's groups are coded whole (a group's draws run from its first element) and cut.
    draws: None (the packed code's, default_draws), "systematic", "independent" or "dither"."""
    M = xhat.shape[1]
    draws = default_draws(lv.bits) if draws is None else draws
    a0 = group_start(c0, M)
    a1 = group_end(group_start(c1 - 1, M), M)
    out = array_module(xhat).empty((r1 - r0, a1 - a0), xhat.dtype)
    for s0, s1, code in _encode_segments(xhat, lv, r0, r1, a0, a1, stream, draws, lanes):
        out[:, s0 - a0:s1 - a0] = code
    return out[:, c0 - a0:c1 - a0]


def _decode_piece(code, lv, r0, r1, c0, c1, relu, d=None):
    """x̃ (relu=False) or the conv input (relu=True) of float codes (rows r0:r1, cols c0:c1);
    d: the dithered code's 1/2 − r of each element (dither_piece), added to its level index."""
    xp = array_module(code)
    bo, so, bc, sc = lv.piece(r0, r1, c0, c1)
    k = lv.k[r0:r1, None].astype(code.dtype)
    open_ = code >= k
    j = code - xp.where(open_, k, 0)
    if d is not None:
        j = j + d
    if relu:
        ag, t, zero = lv.ag[r0:r1], lv.t[r0:r1], lv.zero[r0:r1]
        val = xp.where(zero, lv.beta[r0:r1, None], ag * ((bo - xp.where(zero, bo, t)) + j * so))
        return xp.where(open_, xp.maximum(val, 0) if d is None else val, 0)     # dithered: not clamped
    return lv.s[r0:r1, None] * xp.where(open_, bo + j * so, bc + j * sc)


def check_bits(bits):
    bits = widths.check_bits(bits)
    if bits < 2:
        raise ValueError("the unbiased code needs bits >= 2 (one level per side cannot be unbiased)")
    return bits


DRAWS = ("systematic", "independent", "dither")


def quantize_simulated(xhat, gamma, beta, bits, key, variant="group", draws=None, lanes=None):
    """Reference (x̃, mask), both (C, M): the unbiased code's decode of x̂ for stream `key` (an
    integer or a Stream), whole arrays; the packed path (quantize_pack + decode) matches it bit
    for bit. draws="dither": the dithered code (rounding="dither"; quantize_pack(dither=True)).
    The measured variants (never packed): variant="open" (the lower end per channel),
    draws="independent" or "systematic" at a width whose packed code draws the other way
    (default None: default_draws(bits)), lanes (another lane count for the systematic draws)."""
    bits = check_bits(bits)
    if draws is not None and draws not in DRAWS:
        raise ValueError(f"draws must be one of {DRAWS}, got {draws!r}")
    xp = array_module(xhat)
    C, M = xhat.shape
    ends = xp.empty((C, groups(M), 2), numpy.uint16)
    metadata(ends, xhat, gamma, variant)
    lv = Levels(ends, gamma, beta, bits)
    stream = resolve(key, M, what="stochastic")
    code = _encode_piece(xhat, lv, 0, C, 0, M, stream, draws, lanes)
    mask = (xhat * gamma[:, None]) + beta[:, None] > 0
    d = dither_piece(stream, 0, C, 0, M, M, xhat.dtype, xp) if draws == "dither" else None
    return _decode_piece(code, lv, 0, C, 0, M, relu=False, d=d), mask


def _segments(r0, r1, c0, c1, M):
    """A block of whole groups (c0 a multiple of GROUP) as (c0, c1, size) runs of equal groups:
    the groups of GROUP, then the row's last group if the block ends there and it is not of
    GROUP (GROUP + M mod GROUP elements, or a row shorter than GROUP)."""
    n = c1 - c0
    full = n if n % GROUP == 0 or c1 != M else (max(1, n // GROUP) - 1) * GROUP
    out = [(c0, c0 + full, GROUP)] if full else []
    if c0 + full < c1:
        out.append((c0 + full, c1, c1 - c0 - full))
    return out


def _grouped(lv, r0, r1, c0, c1, size):
    """(base_o, step_o, base_c, step_c) of rows r0:r1 for the groups of columns c0:c1, shaped
    (R, g, 1) to broadcast over (R, g, size) views: no per-element gather."""
    gs = slice(c0 // GROUP, c0 // GROUP + (c1 - c0) // size)
    return tuple(a[r0:r1, gs, None] for a in (lv.base_o, lv.step_o, lv.base_c, lv.step_c))


def _encode_block(x3, lv, rows, params, draw):
    """Codes (floats) of the (R, g, size) view x3 of whole groups; draw: (p, mask) -> r
    (_encode_segments)."""
    xp = array_module(x3)
    bo, so, bc, sc = params
    mask = (x3 * lv.gamma[rows, None, None]) + lv.beta[rows, None, None] > 0
    u = x3 * lv.s[rows, None, None]
    k = lv.k[rows, None, None].astype(x3.dtype)
    base, step = xp.where(mask, bo, bc), xp.where(mask, so, sc)
    n = xp.where(mask, lv.levels - k, k)
    with numpy.errstate(divide="ignore", invalid="ignore"):
        p = xp.where(step > 0, (u - base) / xp.where(step > 0, step, 1), 0)
    p = p + draw(p, mask)
    j = xp.minimum(xp.maximum(xp.floor(p), 0), n - 1)
    return xp.where(mask, k + j, j)


SYSTEMATIC_BITS = 2   # widths whose draws are systematic (default_draws); wider ones draw per element
LANES = 4          # systematic sampling: a group's elements l, l + 4, l + 8, ... form lane l
WEYL = 10368890    # round(2**24·(φ − 1)): lane l starts l·WEYL after lane 0 on the 2**24 grid


def lane_starts(u0, lanes=LANES):
    """(.., lanes) int64: each lane's start R on the grid from a group's 24-bit draw u0 (..)."""
    xp = array_module(u0)
    offsets = xp.arange(lanes, dtype=numpy.int64) * WEYL
    return (u0.astype(numpy.int64)[..., None] + offsets) & ((1 << OFFSET_BITS) - 1)


def _exclusive_lanes(q, start):
    """Per group, each element's lane start plus the sum of q (R, g, size) int64 over the
    elements before it in its lane; start (R, g, lanes)."""
    size, lanes = q.shape[-1], start.shape[-1]
    full = -(-size // lanes) * lanes
    xp = array_module(q)
    if full != size:                           # a short last group: zeros after its end
        q = xp.concatenate([q, xp.zeros(q.shape[:-1] + (full - size,), q.dtype)], axis=-1)
    q4 = q.reshape(q.shape[:-1] + (full // lanes, lanes))           # [.., m, l]: element lanes·m + l
    before = xp.cumsum(q4, axis=-2) - q4 + start[..., None, :]
    return before.reshape(q.shape)[..., :size]


def systematic_uniforms(p, mask, u0, lanes=None):
    """r (R, g, size) in [0, 1) (p's dtype) of each element of whole groups: systematic sampling
    along each lane of each side of a group. With f the fraction of p (f = p − floor(p); 0
    where that is not in [0, 1)) and q = floor(f·2**24), element i of lane l, side σ draws

        R_i = (s_l + o_σ + Σ_{j before i in lane l, on side σ} q_j) mod 2**24,   r_i = R_i·2**−24

    (lane l: the group's elements l, l + LANES, l + 2·LANES, ...; s_l = (u0 + l·WEYL) mod 2**24
    from the group's 24-bit draw u0 (u0 (R, g, 1)); o = 0 open, 2**23 closed). R_i is uniform
    on the grid whatever the others' q, so each element rounds up with exactly the probability
    of an independent draw, while along each lane and side the count of round-ups stays within
    one of Σ f: the rounding errors of neighbours in a lane cancel instead of adding up.
    lanes: another lane count (measured only; the packed code is LANES')."""
    xp = array_module(p)
    with numpy.errstate(invalid="ignore"):
        f = p - xp.floor(p)
        f = xp.where((f >= 0) & (f < 1), f, 0)
    q = (f * float(1 << OFFSET_BITS)).astype(numpy.int64)
    q_open = xp.where(mask, q, 0)
    start = lane_starts(u0[..., 0], LANES if lanes is None else lanes)
    before = xp.where(mask, _exclusive_lanes(q_open, start),
                      _exclusive_lanes(q - q_open, start + (1 << (OFFSET_BITS - 1))))
    R = before & ((1 << OFFSET_BITS) - 1)
    r = R.astype(p.dtype)
    r *= 2.0 ** -OFFSET_BITS
    return r


MASK24 = (1 << OFFSET_BITS) - 1


def weyl_bits(u0, size):
    """(.., size) int64: R_i = (u0 + i·WEYL) mod 2**24 of a group's elements i = 0 .. size−1, from
    its 24-bit draw u0 (..): the dithered code's draws (a Weyl sequence along the group)."""
    xp = array_module(u0)
    return (u0.astype(numpy.int64)[..., None] + xp.arange(size, dtype=numpy.int64) * WEYL) & MASK24


def weyl_uniforms(u0, size, dtype):
    """r = R·2**−24 in [0, 1) (dtype) of weyl_bits: what the dithered code adds to p."""
    r = weyl_bits(u0, size).astype(dtype)
    r *= 2.0 ** -OFFSET_BITS
    return r


def dither_offsets(u0, size, dtype):
    """d = 1/2 − r = (2**23 − R)·2**−24 (exact in dtype) of weyl_bits: what the decoder adds to j."""
    d = ((1 << (OFFSET_BITS - 1)) - weyl_bits(u0, size)).astype(dtype)
    d *= 2.0 ** -OFFSET_BITS
    return d


def dither_piece(stream, r0, r1, c0, c1, M, dtype, xp=numpy):
    """dither_offsets of every element of rows r0:r1, columns c0:c1 of rows of M elements (any
    piece: each element's group draw and index in its group gathered), resolve()'s stream."""
    a0 = group_start(c0, M)
    u0 = group_bits(stream, r0, r1, a0, c1, GROUP, xp).astype(numpy.int64)       # (R, groups)
    col = xp.arange(c0, c1, dtype=numpy.int64)
    first = group_start(col, M)
    R = (u0[:, (first - a0) // GROUP] + (col - first) * WEYL) & MASK24
    d = ((1 << (OFFSET_BITS - 1)) - R).astype(dtype)
    d *= 2.0 ** -OFFSET_BITS
    return d


def _decode_levels(code, lv, rows, params, relu, d=None):
    """x̃ or the conv input of (R, g, size) float codes, and their open mask; the same
    operations as _decode_piece (d: the dithered code's offsets, dither_offsets)."""
    xp = array_module(code)
    bo, so, bc, sc = params
    k = lv.k[rows, None, None].astype(code.dtype)
    open_ = code >= k
    j = code - xp.where(open_, k, 0)
    if d is not None:
        j = j + d
    if relu:
        ag, t, zero = (a[rows, :, None] for a in (lv.ag, lv.t, lv.zero))
        val = xp.where(zero, lv.beta[rows, None, None], ag * ((bo - xp.where(zero, bo, t)) + j * so))
        return xp.where(open_, xp.maximum(val, 0) if d is None else val, 0), open_
    return lv.s[rows, None, None] * xp.where(open_, bo + j * so, bc + j * sc), open_


def _aligned(M, bits):
    """Whether every block of whole groups starts on a code byte (the grouped fast path)."""
    return (M * bits) % 8 == 0


def quantize_pack(slot, xhat, gamma, beta, bits, key, dither=False):
    """Encode x̂ (C, M) into the unit's slot (uint8, >= slot_nbytes): metadata, then the codes,
    block by block of whole groups (packing.CHUNK elements; the codes packed by units/packing.py).
    key: integer or Stream (required). dither: the dithered code (its stream into the slot)."""
    bits = check_bits(bits)
    xp = array_module(xhat)
    C, M = xhat.shape
    codes, ends = split_slot(slot, C, M, bits, dither)
    metadata(ends, xhat, gamma)
    lv = Levels(ends, gamma, beta, bits)
    stream = resolve(key, M, what="dither" if dither else "stochastic")
    draws = "dither" if dither else default_draws(bits)
    if dither:
        slot_stream(slot, C, M, bits)[...] = xp.asarray(numpy.array(stream, dtype=numpy.uint64))
    if not _aligned(M, bits):
        return _quantize_pack_pieces(codes, xhat, lv, bits, stream, draws)
    for r0, r1, c0, c1 in _blocks(C, M):
        buf = xp.empty((r1 - r0, c1 - c0), numpy.uint8)
        for s0, s1, code in _encode_segments(xhat, lv, r0, r1, c0, c1, stream, draws, None):
            xp.copyto(buf[:, s0 - c0:s1 - c0], code, casting="unsafe")
        a = r0 * M + c0                           # whole rows, or a part of one: contiguous
        packing.pack_block(codes[a * bits // 8:(a + buf.size) * bits // 8], buf.reshape(-1), bits,
                          xp.empty(buf.size * bits // 8, numpy.uint8))


def _quantize_pack_pieces(codes, xhat, lv, bits, stream, draws):
    """quantize_pack for rows whose blocks do not start on a code byte: packing's flat chunks,
    each element's group parameters gathered (slower)."""
    xp = array_module(xhat)
    C, M = xhat.shape
    n = C * M
    step = packing.chunk_size(n)
    buf = xp.empty(step, numpy.uint8)
    tmp = xp.empty(step * bits // 8, numpy.uint8)
    for a, b, pieces in packing.chunks(n, M):
        for r0, r1, c0, c1, off in pieces:
            code = _encode_piece(xhat, lv, r0, r1, c0, c1, stream, draws)
            xp.copyto(buf[off:off + code.size].reshape(code.shape), code, casting="unsafe")
        packing.pack_block(codes[a * bits // 8:(b * bits + 7) // 8], buf[:b - a], bits, tmp)


def decode_each_chunk(out, slot, gamma, beta, bits, relu=False, extra=None, dither=False):
    """Decode the slot block by block into out (C, M) float: x̃, or the conv input (relu=True);
    then extra(out_block, open_block, r0, r1, c0, c1) (open: the exact mask of the block).
    dither: a dithered slot (each element's offset regenerated from the slot's stream)."""
    xp = array_module(out)
    C, M = out.shape
    codes, ends = split_slot(slot, C, M, bits, dither)
    lv = Levels(ends, gamma, beta, bits)
    stream = read_stream(slot, C, M, bits) if dither else None
    if not _aligned(M, bits):
        return _decode_pieces(out, codes, lv, bits, relu, extra, stream)
    table = lv.tables(relu).astype(out.dtype) if bits <= 4 and not dither else None
    for r0, r1, c0, c1 in _blocks(C, M):
        buf = xp.empty((r1 - r0, c1 - c0), numpy.uint8)
        a = r0 * M + c0
        packing.unpack_block(buf.reshape(-1), codes[a * bits // 8:(a + buf.size) * bits // 8], bits)
        for s0, s1, size in _segments(r0, r1, c0, c1, M):
            shape = (r1 - r0, (s1 - s0) // size, size)
            gs = slice(s0 // GROUP, s0 // GROUP + shape[1])
            codes3 = buf[:, s0 - c0:s1 - c0].reshape(shape)
            if table is not None:           # one lookup per element
                val = xp.take_along_axis(table[r0:r1, gs], codes3.astype(numpy.intp), axis=2)
            else:
                u0 = None if stream is None else group_bits(stream, r0, r1, s0, s1, GROUP, xp)[:, :shape[1]]
                d = None if u0 is None else dither_offsets(u0, size, out.dtype)
                val = _decode_levels(codes3.astype(out.dtype), lv, slice(r0, r1),
                                     _grouped(lv, r0, r1, s0, s1, size), relu, d)[0]
            out[r0:r1, s0:s1] = val.reshape(r1 - r0, s1 - s0)
        if extra is not None:
            extra(out[r0:r1, c0:c1], buf >= lv.k[r0:r1, None].astype(numpy.uint8) if bits < 8
                  else buf.astype(numpy.int32) >= lv.k[r0:r1, None], r0, r1, c0, c1)


def _decode_pieces(out, codes, lv, bits, relu, extra, stream=None):
    """decode_each_chunk through packing's flat chunks (rows not starting on a code byte)."""
    xp = array_module(out)
    C, M = out.shape
    n = C * M
    buf = xp.empty(packing.chunk_size(n), numpy.uint8)
    for a, b, pieces in packing.chunks(n, M):
        packing.unpack_block(buf[:b - a], codes[a * bits // 8:(b * bits + 7) // 8], bits)
        for r0, r1, c0, c1, off in pieces:
            cb = buf[off:off + (r1 - r0) * (c1 - c0)].reshape(r1 - r0, c1 - c0).astype(out.dtype)
            ob = out[r0:r1, c0:c1]
            d = None if stream is None else dither_piece(stream, r0, r1, c0, c1, M, out.dtype, xp)
            ob[...] = _decode_piece(cb, lv, r0, r1, c0, c1, relu, d)
            if extra is not None:
                extra(ob, cb >= lv.k[r0:r1, None], r0, r1, c0, c1)
