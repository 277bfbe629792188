"""Fused GPU kernels for the BN-ReLU units (CuPy RawModule), the GPU twin of lowmem/units/window_cpu.py.

Used by the engine when the backend is CuPy (`LOWMEM_BACKEND=cupy`,
`pip install lowmem[gpu]`); the pure-array ops of lowmem/ops and
lowmem/units/window.py run on CuPy too and stay the reference (tests/units/test_units_gpu.py).

What each kernel fuses (layout (C, M) rows, M = N*H*W, as everywhere):

  unit_forward_exact             x-hat = (x - mean)*rstd saved, out = relu(γ·x-hat + β)
  unit_forward_code              BN apply + ReLU + quantize + pack in one pass; one
                                 thread per code byte; naive mode writes the decoded
                                 relu(γ·x-tilde + β) instead; nearest or stochastic
                                 rounding (stream.random_offsets's stream, in uint64)
  conv_input_exact / _code       the conv's input relu(γ·x-tilde + β) under the exact
                                 decoded mask (backward's weight gradient)
  unit_backward_partial_* + _apply_*
                                 BN-ReLU backward: unpack + decode + mask inline,
                                 Σdy and Σdy·x-hat per channel, then dx; no decode buffer

The batch statistics (bn_stats) and the backward's middle pass (the per-channel finalize)
are units/gpu_base.py's, shared with the unbiased code's set (units/unbiased_gpu.py).

(The other CUDA kernels sit beside what they speed up: the conv's im2col /
col2im in lowmem/ops/columns_gpu.py, the SGD update in lowmem/train/optim_gpu.py.)

The quantization grid (s, lo, k of window.quant_params) is derived in-kernel
from γ and β, operation for operation, so the engine launches no per-unit
CuPy ops for it.

Arithmetic: every float operation whose result must equal NumPy's is an
explicit round-to-nearest helper (rn_mul, rn_add, ...: lowmem/system/cuda.py, never
contracted to an FMA) in the data's dtype, in NumPy's order, and the program
is also compiled with --fmad=false. Hence, for the same x-hat (the same mean
and rstd), the packed codes equal window.quantize_pack's byte for byte, the
decoded x-tilde and mask equal window.unpack_decode's, and the forward pass of
approx mode is bit-identical to exact mode's. Reductions accumulate in
float64 (compare to tolerance). float32 and float64 both compile.

Memory: kernels allocate nothing. The reductions need (C, S) partial sums
and three per-channel coefficients: the `bn.partials` workspace of the
memory plan (units/gpu_base.py's partials_size(C) float64s).

Built lazily through lowmem/system/cuda.py (program "units"): compiled once per
dtype at first use (NVRTC, through CuPy), so importing this module needs no
GPU and no CuPy; `PROGRAM.sources()` returns the exact text compiled.
"""
import numpy

from ..system import cuda
from . import packing, window
from .widths import check_bits
from .gpu_base import bn_stats, partials_size, rows as _rows, segments as _segments, supports  # noqa: F401 (the API)
from .gpu_base import backward_finalize, workspace as _workspace
from ..system.cuda import blocks as _blocks, i32 as _i32, i64 as _i64

SOURCE = r"""
// lowmem's unit kernels; lowmem/system/cuda.py puts `real` (float or double), BLOCK and the rn_* helpers
// (round-to-nearest arithmetic) before this text.

__device__ __forceinline__ float  floor_(float a)  { return floorf(a); }
__device__ __forceinline__ double floor_(double a) { return floor(a); }
__device__ __forceinline__ float  rint_(float a)   { return rintf(a); }
__device__ __forceinline__ double rint_(double a)  { return rint(a); }
__device__ __forceinline__ float  abs_(float a)    { return fabsf(a); }
__device__ __forceinline__ double abs_(double a)   { return fabs(a); }

// ---- the quantization grid of one channel: window.quant_params, operation for operation
struct Grid { real s, lo; int k; };

__device__ Grid unit_grid(real g, real b, int bits, real w, real window)
{
    const int L = 1 << bits;
    Grid q;
    if (g == (real)0) {                         // constant mask b > 0, plain centred grid
        q.s = (real)1; q.lo = -window; q.k = b > (real)0 ? 0 : L;
        return q;
    }
    const real t = rn_div(-b, abs_(g));         // threshold in x-hat units (may be +-inf)
    real k = rint_(rn_div(rn_add(t, window), w));
    k = k < (real)1 ? (real)1 : (k > (real)(L - 1) ? (real)(L - 1) : k);
    const real half = rn_mul(w, (real)0.5);
    const real lo_min = rn_sub(-window, half), lo_max = rn_add(-window, half);
    real lo = rn_sub(t, rn_mul(k, w));
    lo = lo < lo_min ? lo_min : (lo > lo_max ? lo_max : lo);
    q.s = g < (real)0 ? (real)-1 : (real)1;
    q.lo = lo;
    q.k = (int)k;
    return q;
}

// stochastic rounding's offset d in [-1/2, 1/2) of element i (stream.random_offsets): SplitMix64
// seeded with base = mix64(key), element i's counter base + (i + 1)*phi; 24 bits, exact in float
__device__ __forceinline__ real offset(unsigned long long base, long long i)
{
    return rn_mul(rn_sub((real)(int)counter_bits(base, i), (real)8388608), (real)5.9604644775390625e-08);
}

// code of one x-hat, clamped into the range its exact mask allows (window.quantize_pack);
// stochastic: + d before the floor
__device__ __forceinline__ int encode(real xh, bool on, Grid q, real w, int L, bool stochastic, real d)
{
    const real p = rn_div(rn_sub(rn_mul(xh, q.s), q.lo), w);
    real v = floor_(stochastic ? rn_add(p, d) : p);
    const real lower = on ? (real)q.k : (real)0;
    const real upper = on ? (real)(L - 1) : (real)(q.k - 1);
    v = v < lower ? lower : v;
    v = v > upper ? upper : v;
    return (int)v;
}

// x-tilde of a code: the bin midpoint, flipped back (window.decode_each_chunk's order)
__device__ __forceinline__ real decode(int code, Grid q, real w)
{
    return rn_mul(rn_add(rn_mul(rn_add((real)code, (real)0.5), w), q.lo), q.s);
}

// the conv input of one code: relu(gamma*x-tilde + beta) under the decoded mask (window.decode_relu):
// 0 for a closed code, and 0 for an open one whose bin lies below the threshold (t beyond the window)
__device__ __forceinline__ real open_relu(int code, Grid q, real w, real g, real b)
{
    if (code < q.k) return (real)0;
    const real y = rn_add(rn_mul(decode(code, q, w), g), b);
    return y > (real)0 ? y : (real)0;
}

// ---- forward ------------------------------------------------------------------------
// grid (ceil(M / BLOCK), C). xhat rows are ldx apart (a batch smaller than planned).
// out may alias x.
extern "C" __global__ void unit_forward_exact(real* out, real* xhat, const real* x, const real* mean,
                                              const real* rstd, const real* gamma, const real* beta,
                                              long long M, long long ldx)
{
    const int c = blockIdx.y;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= M) return;
    const long long e = (long long)c * M + i;
    const real xh = rn_mul(rn_sub(x[e], mean[c]), rstd[c]);
    const real y = rn_add(rn_mul(xh, gamma[c]), beta[c]);
    xhat[(long long)c * ldx + i] = xh;
    out[e] = y > (real)0 ? y : (real)0;
}

// grid (ceil(rowbytes / BLOCK), C), one thread per code byte (8/bits elements).
// out may alias x. naive: out = the decoded relu(gamma*x-tilde + beta) instead of relu(y).
// stochastic: round with the stream starting at base (global counter c*row + start + i).
extern "C" __global__ void unit_forward_code(real* out, unsigned char* packed, const real* x,
                                             const real* mean, const real* rstd, const real* gamma,
                                             const real* beta, long long M, int bits, real w,
                                             real window, int naive, int stochastic,
                                             unsigned long long base, long long row, long long start)
{
    const int c = blockIdx.y, per = 8 / bits, L = 1 << bits;
    const long long rowbytes = M / per;
    const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= rowbytes) return;
    const real m = mean[c], r = rstd[c], g = gamma[c], b = beta[c];
    const Grid q = unit_grid(g, b, bits, w, window);
    const long long e0 = (long long)c * M + j * per;
    unsigned int byte = 0;
    for (int e = 0; e < per; ++e) {
        const real xh = rn_mul(rn_sub(x[e0 + e], m), r);
        const real y = rn_add(rn_mul(xh, g), b);      // the exact mask's expression
        const bool on = y > (real)0;
        const real d = stochastic ? offset(base, (long long)c * row + start + j * per + e) : (real)0;
        const int code = encode(xh, on, q, w, L, stochastic != 0, d);
        byte |= (unsigned int)code << (e * bits);
        if (naive)
            out[e0 + e] = open_relu(code, q, w, g, b);
        else
            out[e0 + e] = on ? y : (real)0;
    }
    packed[(long long)c * rowbytes + j] = (unsigned char)byte;
}

// ---- the conv input relu(gamma*x-hat + beta), rebuilt for the weight gradient ----------
extern "C" __global__ void conv_input_exact(real* u, const real* xhat, const real* gamma,
                                            const real* beta, long long M, long long ldx)
{
    const int c = blockIdx.y;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= M) return;
    const real y = rn_add(rn_mul(xhat[(long long)c * ldx + i], gamma[c]), beta[c]);
    u[(long long)c * M + i] = y > (real)0 ? y : (real)0;
}

extern "C" __global__ void conv_input_code(real* u, const unsigned char* packed, const real* gamma,
                                           const real* beta, long long M, int bits, real w, real window)
{
    const int c = blockIdx.y, per = 8 / bits, top = (1 << bits) - 1;
    const long long rowbytes = M / per;
    const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= rowbytes) return;
    const real g = gamma[c], b = beta[c];
    const Grid q = unit_grid(g, b, bits, w, window);
    const unsigned int byte = packed[(long long)c * rowbytes + j];
    const long long e0 = (long long)c * M + j * per;
    for (int e = 0; e < per; ++e) {
        const int code = (byte >> (e * bits)) & top;
        u[e0 + e] = open_relu(code, q, w, g, b);
    }
}

// ---- BN-ReLU backward ---------------------------------------------------------------
// Pass 1, grid (S, C): part[(c*S + s)*2 + {0, 1}] = sum(dy), sum(dy * x-hat) over segment s,
// dy = dr where the ReLU passed, else 0.
extern "C" __global__ void unit_backward_partial_exact(double* part, const real* dr, const real* xhat,
                                                       const real* gamma, const real* beta,
                                                       long long M, long long ldx)
{
    __shared__ double sa[BLOCK], sb[BLOCK];
    const int c = blockIdx.y;
    const real g = gamma[c], b = beta[c];
    long long lo, hi;
    segment(M, &lo, &hi);
    double a = 0, s2 = 0;
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const real xh = xhat[(long long)c * ldx + i];
        if (rn_add(rn_mul(xh, g), b) > (real)0) {
            const double dy = (double)dr[(long long)c * M + i];
            a += dy;
            s2 += dy * (double)xh;
        }
    }
    block_sum2(a, s2, sa, sb);
    if (threadIdx.x == 0) {
        const long long p = ((long long)c * gridDim.x + blockIdx.x) * 2;
        part[p] = sa[0];
        part[p + 1] = sb[0];
    }
}

extern "C" __global__ void unit_backward_partial_code(double* part, const real* dr,
                                                      const unsigned char* packed, const real* gamma,
                                                      const real* beta, long long M, int bits, real w,
                                                      real window)
{
    __shared__ double sa[BLOCK], sb[BLOCK];
    const int c = blockIdx.y, per = 8 / bits, top = (1 << bits) - 1;
    const long long rowbytes = M / per;
    const Grid q = unit_grid(gamma[c], beta[c], bits, w, window);
    long long lo, hi;
    segment(rowbytes, &lo, &hi);
    double a = 0, s2 = 0;
    for (long long j = lo + threadIdx.x; j < hi; j += blockDim.x) {
        const unsigned int byte = packed[(long long)c * rowbytes + j];
        for (int e = 0; e < per; ++e) {
            const int code = (byte >> (e * bits)) & top;
            if (code >= q.k) {
                const double dy = (double)dr[(long long)c * M + j * per + e];
                a += dy;
                s2 += dy * (double)decode(code, q, w);
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

// Pass 2: units/gpu_base.py's unit_backward_finalize.

// Pass 3: dx = (dy - (x-hat*mean(dy*x-hat) + mean(dy))) * gamma*rstd, written or added.
// dx may alias dr.
extern "C" __global__ void unit_backward_apply_exact(real* dx, const real* dr, const real* xhat,
                                                     const double* coef, const real* gamma,
                                                     const real* beta, long long M, long long ldx,
                                                     int accumulate)
{
    const int c = blockIdx.y;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= M) return;
    const real a = (real)coef[c * 3], mdy = (real)coef[c * 3 + 1], mdyx = (real)coef[c * 3 + 2];
    const long long e = (long long)c * M + i;
    const real xh = xhat[(long long)c * ldx + i];
    const real dy = rn_add(rn_mul(xh, gamma[c]), beta[c]) > (real)0 ? dr[e] : (real)0;
    const real v = rn_mul(rn_sub(dy, rn_add(rn_mul(xh, mdyx), mdy)), a);
    dx[e] = accumulate ? rn_add(dx[e], v) : v;
}

extern "C" __global__ void unit_backward_apply_code(real* dx, const real* dr, const unsigned char* packed,
                                                    const double* coef, const real* gamma,
                                                    const real* beta, long long M, int bits, real w,
                                                    real window, int accumulate)
{
    const int c = blockIdx.y, per = 8 / bits, top = (1 << bits) - 1;
    const long long rowbytes = M / per;
    const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= rowbytes) return;
    const Grid q = unit_grid(gamma[c], beta[c], bits, w, window);
    const real a = (real)coef[c * 3], mdy = (real)coef[c * 3 + 1], mdyx = (real)coef[c * 3 + 2];
    const unsigned int byte = packed[(long long)c * rowbytes + j];
    const long long e0 = (long long)c * M + j * per;
    for (int e = 0; e < per; ++e) {
        const int code = (byte >> (e * bits)) & top;
        const real xt = decode(code, q, w);
        const real dy = code >= q.k ? dr[e0 + e] : (real)0;
        const real v = rn_mul(rn_sub(dy, rn_add(rn_mul(xt, mdyx), mdy)), a);
        dx[e0 + e] = accumulate ? rn_add(dx[e0 + e], v) : v;
    }
}

"""

# kernels with __syncthreads (the CPU emulator in tests/units/test_units_gpu.py runs their threads as coroutines)
PROGRAM = cuda.Program("units", SOURCE, block_sync=("unit_backward_partial_exact", "unit_backward_partial_code"))


# ---- launching ----------------------------------------------------------------------------

def _launch(name, dtype, grid, args):
    PROGRAM.launch(name, dtype, grid, args)


def _saved_rows(xhat, shape, dtype):
    """The saved x-hat slot: (C, M) rows that may be farther apart than M (a smaller batch
    than planned reads the start of each row). Returns its row stride in elements."""
    if xhat.shape != shape or xhat.dtype != dtype or xhat.strides[1] != xhat.itemsize:
        raise ValueError(f"xhat must be (C, M) = {shape} {numpy.dtype(dtype).name} with "
                         f"contiguous rows, got {xhat.shape} {xhat.dtype} strides {xhat.strides}")
    return _i64(xhat.strides[0] // xhat.itemsize)


def _bits(qp):
    """The bit width from a window.QuantParams or an int (the kernels derive s, lo and k from
    gamma and beta themselves: the engine hands them only the width)."""
    return check_bits(getattr(qp, "bits", qp))


def _grid_args(bits, dtype):
    """The kernels' (bits, w, window) scalars: int32, then the data's float type.
    The window's half-width W is chosen per bit width (window.half_width); w = 2·W/2**bits
    is exact in either float type, so the in-kernel grid equals window.quant_params'."""
    real = numpy.dtype(dtype).type
    return _i32(bits), real(window.bin_width(bits)), real(window.half_width(bits))


def _check_code(packed, C, M, bits):
    if (M * bits) % 8:
        raise ValueError(f"rows of {M} elements at {bits} bits are not whole bytes "
                         f"(use the NumPy path: window.quantize_pack)")
    packing.check_packed(packed, C * M, bits)


# ---- the unit functions (units/window_cpu.py's signatures; units/fused.py wraps both) ------

def unit_forward_exact(out, xhat, x, mean, rstd, gamma, beta):
    """xhat = (x - mean)*rstd (saved); out = relu(xhat*gamma + beta). out may alias x."""
    _rows(x, "x")
    _rows(out, "out", x)
    C, M = x.shape
    ldx = _saved_rows(xhat, x.shape, x.dtype)
    _launch("unit_forward_exact", x.dtype, (_blocks(M), C),
            (out, xhat, x, mean, rstd, gamma, beta, _i64(M), ldx))


def unit_forward_code(out, packed, x, mean, rstd, gamma, beta, qp, naive, rounding="nearest", key=None):
    """Normalise, quantize and pack x-hat into packed; out = relu(y) (approx) or the decoded
    relu(x-tilde*gamma + beta) (naive). qp: window.QuantParams or the bit width. rounding:
    "nearest", or "stochastic-window" with the stream of `key` (window.quantize_pack's codes)."""
    _rows(x, "x")
    _rows(out, "out", x)
    C, M = x.shape
    bits = _bits(qp)
    _check_code(packed, C, M, bits)
    stream = window.stream_base(window.check_window_rounding(rounding, "window_gpu.unit_forward_code"), key, M)
    base, start, row = stream if stream is not None else (0, 0, M)
    _launch("unit_forward_code", x.dtype, (_blocks(M * bits // 8), C),
            (out, packed, x, mean, rstd, gamma, beta, _i64(M), *_grid_args(bits, x.dtype),
             _i32(bool(naive)), _i32(stream is not None), numpy.uint64(base), _i64(row), _i64(start)))


def conv_input(u, xhat, packed, qp, gamma, beta):
    """u = relu(gamma*x-hat + beta) from the float slot (xhat) or the code (packed)."""
    _rows(u, "u")
    C, M = u.shape
    if packed is None:
        ldx = _saved_rows(xhat, u.shape, u.dtype)
        _launch("conv_input_exact", u.dtype, (_blocks(M), C), (u, xhat, gamma, beta, _i64(M), ldx))
        return
    bits = _bits(qp)
    _check_code(packed, C, M, bits)
    _launch("conv_input_code", u.dtype, (_blocks(M * bits // 8), C),
            (u, packed, gamma, beta, _i64(M), *_grid_args(bits, u.dtype)))


def unit_backward(dx, dgamma, dbeta, dr, xhat, packed, qp, gamma, beta, rstd, accumulate,
                  partials=None):
    """BN-ReLU backward (ops.bn_relu_backward) from the float slot (xhat) or the code (packed):
    dgamma += sum(dy*x-hat), dbeta += sum(dy), dx = (or += with accumulate) the input gradient.
    dx may alias dr."""
    _rows(dr, "dr")
    _rows(dx, "dx", dr)
    C, M = dr.shape
    dt, acc = dr.dtype, _i32(bool(accumulate))
    if packed is None:
        ldx = _saved_rows(xhat, dr.shape, dt)
        S = _segments(C, M)
    else:
        bits = _bits(qp)
        _check_code(packed, C, M, bits)
        S = _segments(C, M * bits // 8)                 # segments of code bytes
    part, coef = _workspace(partials, C, dr)
    if packed is None:
        _launch("unit_backward_partial_exact", dt, (S, C), (part, dr, xhat, gamma, beta, _i64(M), ldx))
    else:
        _launch("unit_backward_partial_code", dt, (S, C),
                (part, dr, packed, gamma, beta, _i64(M), *_grid_args(bits, dt)))
    backward_finalize(coef, dgamma, dbeta, part, gamma, rstd, M, S)
    if packed is None:
        _launch("unit_backward_apply_exact", dt, (_blocks(M), C),
                (dx, dr, xhat, coef, gamma, beta, _i64(M), ldx, acc))
    else:
        _launch("unit_backward_apply_code", dt, (_blocks(M * bits // 8), C),
                (dx, dr, packed, coef, gamma, beta, _i64(M), *_grid_args(bits, dt), acc))
