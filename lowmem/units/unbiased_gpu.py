"""CUDA kernels of the unbiased group-range code (units/unbiased.py), program "unbiased".

    unbiased_forward   one thread per (group, channel): normalise the group's elements, find
                       their range, round it outward to bf16, then draw (at 2 bits one counter per
                       group, systematic sampling along each lane of each side; wider, one
                       per element), pack and write relu(y)
                       (or naive's decoded conv input)
    unbiased_decode    one thread per (group, channel): x-tilde or the conv input from the codes
                       and the stored ends; optionally zero the incoming gradient where the mask
                       is closed (synchronized batch norm's masking)

The dithered code (rounding "dither", `dither` below): the forward draws the Weyl sequence from
each group's draw and writes the stream into the slot (thread (0, 0)); every decode reads it
there, regenerates each element's offset d = (2**23 − R)·2**−24 and decodes level j + d (the
conv input not clamped at 0).
    unbiased_backward_partial + units/gpu_base.py's unit_backward_finalize + unbiased_backward_apply
                       BN-ReLU backward: sum(dy), sum(dy*x-tilde) per channel over segments of
                       groups (float64, a fixed tree order), then dx, x-tilde decoded inline

Arithmetic: every float operation of unbiased.metadata, Levels, _encode_piece and the decode
tables, round-to-nearest (lowmem/system/cuda.py's rn_* helpers, no FMA) in the data's dtype and
in NumPy's order, and the counter stream of units/stream.py in uint64: the slot equals
unbiased.quantize_pack's byte for byte and the decodes unbiased.decode_each_chunk's bit for bit
(tests/units/test_units_gpu.py, on the CPU emulation of this text and on a GPU). The split k comes
from window.quant_params (a few (C,) array ops). The backward equals the reference's (the decode,
then ops.bn_relu_backward) to float rounding: its sums in float64, its dx in the reference's order.
"""
import numpy

from ..system import cuda
from ..system.backend import array_module
from ..system.cuda import BLOCK, i32 as _i32, i64 as _i64
from . import gpu_base, unbiased
from .stream import GOLDEN, resolve

SOURCE = r"""
// the unbiased code; lowmem/system/cuda.py puts `real`, BLOCK and the rn_* helpers before this text
#define UB_GROUP 256
#define UB_LANES 4
#define UB_SYSTEMATIC_BITS 2
#define UB_WEYL 10368890u
__device__ __forceinline__ float  ub_floor(float a)  { return floorf(a); }
__device__ __forceinline__ double ub_floor(double a) { return floor(a); }
__device__ __forceinline__ real ub_max(real a, real b) { return a >= b ? a : b; }
__device__ __forceinline__ real ub_min(real a, real b) { return a <= b ? a : b; }

// a row's groups (unbiased.groups: floor(M/256), at least 1) and where group gi of G ends
// (the last one takes the rest of the row)
__device__ __forceinline__ long long ub_groups(long long M) { return M >= UB_GROUP ? M / UB_GROUP : 1; }
__device__ __forceinline__ long long ub_group_end(long long gi, long long G, long long M)
{
    return gi == G - 1 ? M : (gi + 1) * UB_GROUP;
}

// the bf16 value next to v, outward (unbiased._bf16: first outward to float32), and its bits
__device__ real ub_bf16(real v, int up, unsigned short* out)
{
    float f = (float)v;
    if (up && (real)f < v) f = nextafterf(f, INFINITY);
    if (!up && (real)f > v) f = nextafterf(f, -INFINITY);
    unsigned b = __float_as_uint(f) >> 16;
    const float t = __uint_as_float(b << 16);
    if ((up && t < f) || (!up && t > f)) b += 1u;
    *out = (unsigned short)b;
    return (real)__uint_as_float(b << 16);
}

// per channel, from gamma, beta and the split k alone (unbiased.Levels): sign(gamma) (+1 for 0),
// gamma == 0, |gamma|, the threshold t as the open side's floor (-inf where gamma = 0) and the
// closed side's ceiling (+inf there)
struct UbChannel { real s, ag, t_o, t_c, kf; bool zero; int k; };

__device__ UbChannel ub_channel(real g, real b, int k)
{
    UbChannel h;
    h.s = g < (real)0 ? (real)-1 : (real)1;
    h.zero = g == (real)0;
    h.ag = h.zero ? (real)0 : (g < (real)0 ? -g : g);
    const real t = rn_div(-b, h.zero ? (real)1 : h.ag);
    h.t_o = h.zero ? (real)-INFINITY : t;
    h.t_c = h.zero ? (real)INFINITY : t;
    h.k = k;
    h.kf = (real)k;
    return h;
}

struct UbLevels { real bo, so, bc, sc; };

// unbiased.Levels for one group from its (rounded) ends
__device__ UbLevels ub_levels(real hi, real lo, real t_o, real t_c, int k, int L)
{
    UbLevels v;
    v.bo = ub_min(ub_max(t_o, lo), hi);
    const real top_c = ub_max(ub_min(t_c, hi), lo);
    v.bc = lo;
    v.so = rn_div(rn_sub(hi, v.bo), (real)(L - k - 1 > 1 ? L - k - 1 : 1));
    if (!(L - k > 1 && v.so > (real)0 && v.so < (real)INFINITY)) v.so = (real)0;
    v.sc = rn_div(rn_sub(top_c, lo), (real)(k - 1 > 1 ? k - 1 : 1));
    if (!(k > 1 && v.sc > (real)0 && v.sc < (real)INFINITY)) v.sc = (real)0;
    return v;
}

// the conv input of level jj on its side: |gamma|*((base_o - t) + jj*step_o) (beta where gamma = 0),
// at least 0 (dithered: not clamped), on the open side; 0 on the closed one
__device__ real ub_conv_input(bool on, real jj, const UbChannel& h, real b, const UbLevels& v, int dither)
{
    if (!on) return (real)0;
    if (h.zero) return dither ? b : ub_max(b, (real)0);
    const real y = rn_mul(h.ag, rn_add(rn_sub(v.bo, h.t_o), rn_mul(jj, v.so)));
    return dither ? y : ub_max(y, (real)0);
}

// the dithered code: element i of a group draws R = (u0 + i*WEYL) mod 2**24 from the group's draw
// u0 (unbiased.weyl_bits; < 2**32 before the mask), its decoder adds d = (2**23 - R)*2**-24 to j
__device__ __forceinline__ unsigned int ub_weyl(unsigned int u0, long long i)
{
    return (u0 + (unsigned int)i * UB_WEYL) & 0xFFFFFFu;
}

__device__ __forceinline__ real ub_offset(unsigned int u0, long long i)
{
    return rn_mul((real)(0x800000 - (int)ub_weyl(u0, i)), (real)5.9604644775390625e-08);
}

// the group's draw of a decode: from the stream the forward wrote into the slot
__device__ __forceinline__ unsigned int ub_group_draw(const unsigned long long* stream, int c, long long g0)
{
    return counter_bits(stream[0], (long long)c * (long long)stream[2] + (long long)stream[1] + g0);
}

// x-tilde of level jj on its side: s*(base + jj*step) (unbiased.Levels' decode)
__device__ __forceinline__ real ub_xtilde(bool on, real jj, const UbChannel& h, const UbLevels& v)
{
    return rn_mul(h.s, on ? rn_add(v.bo, rn_mul(jj, v.so)) : rn_add(v.bc, rn_mul(jj, v.sc)));
}

// group gi's levels from its stored bf16 ends
__device__ __forceinline__ UbLevels ub_stored_levels(const unsigned short* ends, int c, long long G,
                                                     long long gi, const UbChannel& h, int L)
{
    const unsigned short* e = ends + ((long long)c * G + gi) * 2;
    return ub_levels((real)__uint_as_float((unsigned)e[0] << 16),
                     (real)__uint_as_float((unsigned)e[1] << 16), h.t_o, h.t_c, h.k, L);
}

// element i's code of row c (bits per code, `per` codes per byte)
__device__ __forceinline__ real ub_code(const unsigned char* packed, int c, long long M, int bits,
                                        int per, long long i)
{
    const unsigned byte = packed[(long long)c * (M / per) + i / per];
    return (real)((byte >> ((i % per) * bits)) & ((1u << bits) - 1u));
}

extern "C" __global__ void unbiased_forward(real* out, unsigned char* packed, unsigned short* ends,
                                            const real* x, const real* mean, const real* rstd,
                                            const real* gamma, const real* beta, const int* k,
                                            long long M, int bits, int naive, unsigned long long base,
                                            long long row, long long start, int dither,
                                            unsigned long long* stream)
{
    const int c = blockIdx.y, per = 8 / bits, L = 1 << bits;
    const long long G = ub_groups(M);
    const long long gi = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (gi >= G) return;
    if (dither && c == 0 && gi == 0) {              // the stream the decoders regenerate d from
        stream[0] = base;
        stream[1] = (unsigned long long)start;
        stream[2] = (unsigned long long)row;
    }
    const long long g0 = gi * UB_GROUP, g1 = ub_group_end(gi, G, M);
    const real m = mean[c], r = rstd[c], g = gamma[c], b = beta[c];
    const UbChannel h = ub_channel(g, b, k[c]);
    const real s = h.s, kf = h.kf;
    const real* xr = x + (long long)c * M;
    real hi = (real)-INFINITY, lo = (real)INFINITY;
    for (long long i = g0; i < g1; ++i) {
        const real u = rn_mul(rn_mul(rn_sub(xr[i], m), r), s);
        hi = ub_max(hi, u);
        lo = ub_min(lo, u);
    }
    unsigned short* e = ends + ((long long)c * G + gi) * 2;
    hi = ub_bf16(hi, 1, e);
    lo = ub_bf16(lo, 0, e + 1);
    const UbLevels v = ub_levels(hi, lo, h.t_o, h.t_c, h.k, L);
    // at 2 bits the group's draw (its first element's counter), then systematic sampling along
    // each lane of each side (unbiased.systematic_uniforms); wider codes draw per element
    const unsigned int u0 = counter_bits(base, (long long)c * row + start + g0);
    // each lane's sums so far on each side, from its start (unbiased.lane_starts)
    unsigned int acc_o[UB_LANES], acc_c[UB_LANES];
    for (int l = 0; l < UB_LANES; ++l) {
        acc_o[l] = (u0 + (unsigned int)l * UB_WEYL) & 0xFFFFFFu;
        acc_c[l] = acc_o[l] + 0x800000u;
    }
    for (long long j = g0 / per; j < g1 / per; ++j) {
        unsigned int byte = 0;
        for (int q = 0; q < per; ++q) {
            const long long i = j * per + q;
            const real xh = rn_mul(rn_sub(xr[i], m), r);
            const real y = rn_add(rn_mul(xh, g), b);
            const bool on = y > (real)0;
            const real u = rn_mul(xh, s);
            const real bb = on ? v.bo : v.bc, st = on ? v.so : v.sc;
            const real n = on ? rn_sub((real)L, kf) : kf;
            real p = st > (real)0 ? rn_div(rn_sub(u, bb), st) : (real)0;
            real f = rn_sub(p, ub_floor(p));
            if (!(f >= (real)0 && f < (real)1)) f = (real)0;
            const unsigned int qv = (unsigned int)rn_mul(f, (real)16777216.0);
            unsigned int R;
            if (dither) {                                   // the group's Weyl sequence
                R = ub_weyl(u0, i - g0);
            } else if (bits <= UB_SYSTEMATIC_BITS) {        // the lane's walk
                const int lane = (int)((i - g0) % UB_LANES);
                R = (on ? acc_o[lane] : acc_c[lane]) & 0xFFFFFFu;
                if (on) acc_o[lane] += qv; else acc_c[lane] += qv;
            } else {                                        // the element's own draw
                R = counter_bits(base, (long long)c * row + start + i);
            }
            p = rn_add(p, rn_mul((real)R, (real)5.9604644775390625e-08));
            const real jj = ub_min(ub_max(ub_floor(p), (real)0), rn_sub(n, (real)1));
            const real code = on ? rn_add(kf, jj) : jj;
            byte |= (unsigned int)code << (q * bits);
            out[(long long)c * M + i] = naive ? ub_conv_input(on, dither ? rn_add(jj, ub_offset(u0, i - g0)) : jj,
                                                              h, b, v, dither)
                                              : (on ? y : (real)0);
        }
        packed[(long long)c * (M / per) + j] = (unsigned char)byte;
    }
}

extern "C" __global__ void unbiased_decode(real* out, real* dr, const unsigned char* packed,
                                           const unsigned short* ends, const real* gamma,
                                           const real* beta, const int* k, long long M, int bits,
                                           int relu, int mask_dr, int dither, const unsigned long long* stream)
{
    const int c = blockIdx.y, per = 8 / bits, L = 1 << bits;
    const long long G = ub_groups(M);
    const long long gi = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (gi >= G) return;
    const long long g0 = gi * UB_GROUP, g1 = ub_group_end(gi, G, M);
    const real b = beta[c];
    const UbChannel h = ub_channel(gamma[c], b, k[c]);
    const UbLevels v = ub_stored_levels(ends, c, G, gi, h, L);
    const unsigned int u0 = dither ? ub_group_draw(stream, c, g0) : 0u;
    for (long long i = g0; i < g1; ++i) {
        const real code = ub_code(packed, c, M, bits, per, i);
        const bool on = code >= h.kf;
        real jj = on ? rn_sub(code, h.kf) : code;
        if (dither) jj = rn_add(jj, ub_offset(u0, i - g0));
        out[(long long)c * M + i] = relu ? ub_conv_input(on, jj, h, b, v, dither) : ub_xtilde(on, jj, h, v);
        if (mask_dr && !on)
            dr[(long long)c * M + i] = (real)0;
    }
}

// ---- BN-ReLU backward from the slot (ops.bn_relu_backward on x-tilde under the exact mask) ----
// Pass 1, grid (S, C): part[(c*S + s)*2 + {0, 1}] = sum(dy), sum(dy * x-tilde) over the groups of
// segment s (a thread per group, its levels once), dy = dr where the code is open, else 0. dr is
// read only. Pass 2 is units/gpu_base.py's unit_backward_finalize.
extern "C" __global__ void unbiased_backward_partial(double* part, const real* dr, const unsigned char* packed,
                                                     const unsigned short* ends, const real* gamma,
                                                     const real* beta, const int* k, long long M, int bits,
                                                     int dither, const unsigned long long* stream)
{
    __shared__ double sa[BLOCK], sb[BLOCK];
    const int c = blockIdx.y, per = 8 / bits, L = 1 << bits;
    const long long G = ub_groups(M);
    const UbChannel h = ub_channel(gamma[c], beta[c], k[c]);
    long long lo, hi;
    segment(G, &lo, &hi);
    double a = 0, s2 = 0;
    for (long long gi = lo + threadIdx.x; gi < hi; gi += blockDim.x) {
        const UbLevels v = ub_stored_levels(ends, c, G, gi, h, L);
        const long long g0 = gi * UB_GROUP, g1 = ub_group_end(gi, G, M);
        const unsigned int u0 = dither ? ub_group_draw(stream, c, g0) : 0u;
        for (long long i = g0; i < g1; ++i) {
            const real code = ub_code(packed, c, M, bits, per, i);
            if (code >= h.kf) {
                const double dy = (double)dr[(long long)c * M + i];
                real jj = rn_sub(code, h.kf);
                if (dither) jj = rn_add(jj, ub_offset(u0, i - g0));
                a += dy;
                s2 += dy * (double)ub_xtilde(true, jj, h, v);
            }
        }
    }
    block_sum2(a, s2, sa, sb);
    if (threadIdx.x == 0) {
        const long long p = ((long long)c * gridDim.x + blockIdx.x) * 2;
        part[p] = sa[0];
        part[p + 1] = sb[0];
    }
}

// Pass 3, one thread per (group, channel): dx = (dy - (x-tilde*mean(dy*x-tilde) + mean(dy))) *
// gamma*rstd (coef: unit_backward_finalize's), written or added. dx may alias dr.
extern "C" __global__ void unbiased_backward_apply(real* dx, const real* dr, const unsigned char* packed,
                                                   const unsigned short* ends, const double* coef,
                                                   const real* gamma, const real* beta, const int* k,
                                                   long long M, int bits, int accumulate, int dither,
                                                   const unsigned long long* stream)
{
    const int c = blockIdx.y, per = 8 / bits, L = 1 << bits;
    const long long G = ub_groups(M);
    const long long gi = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (gi >= G) return;
    const long long g0 = gi * UB_GROUP, g1 = ub_group_end(gi, G, M);
    const UbChannel h = ub_channel(gamma[c], beta[c], k[c]);
    const UbLevels v = ub_stored_levels(ends, c, G, gi, h, L);
    const real a = (real)coef[c * 3], mdy = (real)coef[c * 3 + 1], mdyx = (real)coef[c * 3 + 2];
    const unsigned int u0 = dither ? ub_group_draw(stream, c, g0) : 0u;
    for (long long i = g0; i < g1; ++i) {
        const real code = ub_code(packed, c, M, bits, per, i);
        const bool on = code >= h.kf;
        real jj = on ? rn_sub(code, h.kf) : code;
        if (dither) jj = rn_add(jj, ub_offset(u0, i - g0));
        const real xt = ub_xtilde(on, jj, h, v);
        const long long e = (long long)c * M + i;
        const real dy = on ? dr[e] : (real)0;
        const real val = rn_mul(rn_sub(dy, rn_add(rn_mul(xt, mdyx), mdy)), a);
        dx[e] = accumulate ? rn_add(dx[e], val) : val;
    }
}
"""

PROGRAM = cuda.Program("unbiased", SOURCE, block_sync=("unbiased_backward_partial",))


def _prepare(slot, C, M, bits, gamma, beta, dither):
    """(bits, codes, ends, k, grid, stream): stream the dithered slot's (3,) uint64 view (the
    kernels read it; a plain slot's kernels get _no_stream's, never read)."""
    bits = unbiased.check_bits(bits)
    if (M * bits) % 8:
        raise ValueError(f"rows of {M} elements at {bits} bits are not whole bytes (use unbiased.quantize_pack)")
    codes, ends = unbiased.split_slot(slot, C, M, bits, dither)
    k = unbiased.split(gamma, beta, bits).astype(numpy.int32)
    grid = (max(1, -(-unbiased.groups(M) // BLOCK)), C)
    stream = unbiased.slot_stream(slot, C, M, bits) if dither else _no_stream(slot)
    return bits, codes, ends, k, grid, stream


_NO_STREAM = {}


def _no_stream(like):
    """A (3,) uint64 array of like's module for the kernels' stream argument of a plain slot
    (never read there), made once per module."""
    xp = array_module(like)
    if xp not in _NO_STREAM:
        _NO_STREAM[xp] = xp.zeros(3, numpy.uint64)
    return _NO_STREAM[xp]


def unit_forward(out, slot, x, mean, rstd, gamma, beta, bits, naive, key, dither=False):
    """As units/unbiased_cpu.py's unit_forward, on the GPU: slot <- the unbiased code of
    x-hat = (x - mean)*rstd drawn from key; out = relu(y) or naive's decoded conv input."""
    C, M = x.shape
    bits, codes, ends, k, grid, stream = _prepare(slot, C, M, bits, gamma, beta, dither)
    base, start, row = resolve(key, M, what="dither" if dither else "stochastic")
    PROGRAM.launch("unbiased_forward", x.dtype, grid,
                   (out, codes, ends, x, mean, rstd, gamma, beta, k, _i64(M), _i32(bits), _i32(bool(naive)),
                    numpy.uint64(base), _i64(row), _i64(start), _i32(bool(dither)), stream))


def decode(out, slot, gamma, beta, bits, relu=False, dr=None, dither=False):
    """As units/unbiased_cpu.py's decode, on the GPU (dr: the gradient to mask, or None)."""
    C, M = out.shape
    bits, codes, ends, k, grid, stream = _prepare(slot, C, M, bits, gamma, beta, dither)
    PROGRAM.launch("unbiased_decode", out.dtype, grid,
                   (out, dr if dr is not None else out, codes, ends, gamma, beta, k, _i64(M), _i32(bits),
                    _i32(bool(relu)), _i32(dr is not None), _i32(bool(dither)), stream))


def unit_backward(dx, dgamma, dbeta, dr, slot, gamma, beta, rstd, bits, accumulate, partials=None, dither=False):
    """As units/unbiased_cpu.py's unit_backward, on the GPU (ops.bn_relu_backward on the slot's
    x-tilde under the exact mask, no decode buffer): the sums per segment of groups, then
    units/gpu_base.py's finalize (dgamma, dbeta and the coefficients, in the `bn.partials`
    workspace), then dx. dr is read only; dx may alias it."""
    gpu_base.rows(dr, "dr")
    gpu_base.rows(dx, "dx", dr)
    C, M = dr.shape
    bits, codes, ends, k, grid, stream = _prepare(slot, C, M, bits, gamma, beta, dither)
    S = gpu_base.segments(C, unbiased.groups(M))               # segments of groups
    part, coef = gpu_base.workspace(partials, C, dr)
    dt = dr.dtype
    PROGRAM.launch("unbiased_backward_partial", dt, (S, C), (part, dr, codes, ends, gamma, beta, k, _i64(M), _i32(bits),
                                                            _i32(bool(dither)), stream))
    gpu_base.backward_finalize(coef, dgamma, dbeta, part, gamma, rstd, M, S)
    PROGRAM.launch("unbiased_backward_apply", dt, grid,
                   (dx, dr, codes, ends, coef, gamma, beta, k, _i64(M), _i32(bits), _i32(bool(accumulate)),
                    _i32(bool(dither)), stream))


assert GOLDEN == 0x9E3779B97F4A7C15           # in the kernel texts (system/cuda.py's counter_bits)
assert (unbiased.GROUP, unbiased.LANES, unbiased.WEYL, unbiased.SYSTEMATIC_BITS) == (256, 4, 10368890, 2)
