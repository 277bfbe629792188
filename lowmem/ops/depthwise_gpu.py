"""Depthwise convolution on the GPU: one CUDA launch per forward, input gradient and weight gradient.

Dimensions and layout as ops/depthwise_cpu.py (its CPU twin): x, dx (Cin, N, H, W), w, dw
(Cout, 1, kh, kw), out, dout (Cout, N, Ho, Wo), Cout = m*Cin, output channel o reading input
channel o // m; every array C-contiguous.

ops/conv_groups.py's slice additions (m = 1) and per-group GEMMs (m > 1) are the reference, on
CuPy dozens of launches per conv. Here the forward and the input gradient take one thread per
element they write, which adds its terms from 0 (or from dx, accumulating) in the kernel
offsets' (i, j) order with round-to-nearest operations: the slice additions' results bit for
bit for m = 1. The weight gradient takes one block per (kernel offset, output channel), sums
its products in float64 over the whole batch and adds the block's total (fixed tree order) to
dw: to tolerance, as the reference's blocked sums. Compiled through lowmem/system/cuda.py
(program "depthwise"); tested on the CPU emulation of this text and with nvcc
(tests/units/test_units_gpu.py).
"""
import numpy

from ..system import cuda
from ..system.cuda import i32, i64

SOURCE = r"""
// out (Cout, N, Ho, Wo) <- the depthwise conv of x (Cin, N, H, W) with w (Cout, 1, kh, kw), one
// thread per output element: its terms from 0 in (i, j) order (ops/conv_groups.py's slice order).
extern "C" __global__ void depthwise_forward(real* out, const real* x, const real* w, int m, int N, int H,
                                             int W, int Ho, int Wo, int kh, int kw, int stride, int pad,
                                             long long total)
{
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const int ow = (int)(e % Wo), oh = (int)(e / Wo % Ho), n = (int)(e / Wo / Ho % N);
        const int o = (int)(e / Wo / Ho / N);
        const real* xp = x + ((long long)(o / m) * N + n) * H * W;
        const real* wp = w + (long long)o * kh * kw;
        real acc = (real)0;
        for (int i = 0; i < kh; ++i) {
            const int ih = oh * stride + i - pad;
            if (ih < 0 || ih >= H) continue;
            for (int j = 0; j < kw; ++j) {
                const int iw = ow * stride + j - pad;
                if (iw < 0 || iw >= W) continue;
                acc = rn_add(acc, rn_mul(xp[ih * W + iw], wp[i * kw + j]));
            }
        }
        out[e] = acc;
    }
}

// dx (Cin, N, H, W) = (or += with accumulate) the input gradient, one thread per dx element: its
// terms in (output channel, i, j) order, the slice additions' order for m = 1.
extern "C" __global__ void depthwise_backward_input(real* dx, const real* dout, const real* w, int m, int N,
                                                    int H, int W, int Ho, int Wo, int kh, int kw, int stride,
                                                    int pad, int accumulate, long long total)
{
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const int iw = (int)(e % W), ih = (int)(e / W % H), n = (int)(e / W / H % N);
        const int c = (int)(e / W / H / N);
        real acc = accumulate ? dx[e] : (real)0;
        for (int o = c * m; o < (c + 1) * m; ++o) {
            const real* gp = dout + ((long long)o * N + n) * Ho * Wo;
            const real* wp = w + (long long)o * kh * kw;
            for (int i = 0; i < kh; ++i) {
                const int r = ih + pad - i;
                if (r < 0 || r % stride || r / stride >= Ho) continue;
                for (int j = 0; j < kw; ++j) {
                    const int s = iw + pad - j;
                    if (s < 0 || s % stride || s / stride >= Wo) continue;
                    acc = rn_add(acc, rn_mul(gp[(r / stride) * Wo + s / stride], wp[i * kw + j]));
                }
            }
        }
        dx[e] = acc;
    }
}

// dw (Cout, 1, kh, kw) += dout correlated with x: one block per (offset k = i*kw + j, channel o) =
// (blockIdx.x, blockIdx.y), float64 products summed over N*Ho*Wo, the block's total in tree order.
// x is read (bits 0) or decoded where it is read from an affine code in groups of `group`
// elements (packed, scale, zero: the range code of units/rangecode.py, range_decode's values).
__device__ void weight_gradient(real* dw, const real* x, const unsigned char* packed, const float* scale,
                                const unsigned char* zero, int bits, int group, const real* dout, int m, int N,
                                int H, int W, int Ho, int Wo, int kh, int kw, int stride, int pad)
{
    __shared__ double sa[BLOCK], sb[BLOCK];
    const int k = blockIdx.x, o = blockIdx.y, i = k / kw, j = k % kw;
    const long long plane = (long long)Ho * Wo, count = N * plane;
    const int per = bits ? 8 / bits : 1, top = (1 << bits) - 1;
    double a = 0.0;
    for (long long e = threadIdx.x; e < count; e += BLOCK) {
        const int ow = (int)(e % Wo), oh = (int)(e / Wo % Ho), n = (int)(e / plane);
        const int ih = oh * stride + i - pad, iw = ow * stride + j - pad;
        if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
        const long long at = (((long long)(o / m) * N + n) * H + ih) * W + iw;
        real v;
        if (bits) {
            const int code = (packed[at / per] >> ((int)(at % per) * bits)) & top;
            const long long g = at / group;
            v = rn_mul(rn_sub((real)code, (real)zero[g]), (real)scale[g]);
        } else {
            v = x[at];
        }
        a += (double)dout[((long long)o * N + n) * plane + e % plane] * (double)v;
    }
    block_sum2(a, 0.0, sa, sb);
    if (threadIdx.x == 0)
        dw[(long long)o * kh * kw + k] = rn_add(dw[(long long)o * kh * kw + k], (real)sa[0]);
}

extern "C" __global__ void depthwise_backward_weight(real* dw, const real* x, const real* dout, int m, int N,
                                                     int H, int W, int Ho, int Wo, int kh, int kw, int stride,
                                                     int pad)
{
    weight_gradient(dw, x, 0, 0, 0, 0, 1, dout, m, N, H, W, Ho, Wo, kh, kw, stride, pad);
}

extern "C" __global__ void depthwise_backward_weight_coded(real* dw, const unsigned char* packed,
                                                           const float* scale, const unsigned char* zero,
                                                           int bits, int group, const real* dout, int m, int N,
                                                           int H, int W, int Ho, int Wo, int kh, int kw,
                                                           int stride, int pad)
{
    weight_gradient(dw, 0, packed, scale, zero, bits, group, dout, m, N, H, W, Ho, Wo, kh, kw, stride, pad);
}
"""

PROGRAM = cuda.Program("depthwise", SOURCE,
                       block_sync=("depthwise_backward_weight", "depthwise_backward_weight_coded"))


def applies(a, b, w):
    """Whether the kernels take these arrays: C-contiguous, one float dtype, w (Cout, 1, kh, kw)."""
    return (all(v.flags.c_contiguous for v in (a, b, w)) and a.dtype == b.dtype == w.dtype
            and a.dtype.name in cuda.REAL and w.shape[1] == 1)


def _args(x, out, w, stride, pad):
    Cin, N, H, W = x.shape
    Cout, _, kh, kw = w.shape
    return (i32(Cout // Cin), i32(N), i32(H), i32(W), i32(out.shape[2]), i32(out.shape[3]), i32(kh), i32(kw),
            i32(stride), i32(pad))


def forward(out, x, w, stride, pad):
    """out (Cout, N, Ho, Wo) = the depthwise conv of x (Cin, N, H, W) with w (Cout, 1, kh, kw)."""
    PROGRAM.launch("depthwise_forward", x.dtype, (cuda.blocks(out.size),),
                   (out, x, w) + _args(x, out, w, stride, pad) + (i64(out.size),))


def backward_input(dx, dout, w, stride, pad, accumulate=False):
    """dx (Cin, N, H, W) = (or += with accumulate) the input gradient from dout (Cout, N, Ho, Wo)."""
    PROGRAM.launch("depthwise_backward_input", dx.dtype, (cuda.blocks(dx.size),),
                   (dx, dout, w) + _args(dx, dout, w, stride, pad) + (i32(bool(accumulate)), i64(dx.size)))


def backward_weight(dw, x, dout, stride, pad):
    """dw (Cout, 1, kh, kw) += dout (Cout, N, Ho, Wo) correlated with x (Cin, N, H, W)."""
    kh, kw = dw.shape[2:]
    PROGRAM.launch("depthwise_backward_weight", x.dtype, (kh * kw, dw.shape[0]),
                   (dw, x, dout) + _args(x, dout, dw, stride, pad))


def applies_coded(dout, w, code):
    """Whether backward_weight_coded takes these: `applies` for dout and w, the code's arrays
    C-contiguous (packed and zero uint8, scale float32)."""
    arrays = (code.packed, code.scale, code.zero)
    return (applies(dout, dout, w) and all(a.flags.c_contiguous for a in arrays)
            and code.packed.dtype == code.zero.dtype == numpy.uint8 and code.scale.dtype == numpy.float32)


def backward_weight_coded(dw, code, x_shape, dout, stride, pad, group):
    """backward_weight with x (x_shape) kept as an affine code (code: packed, scale, zero, bits; in
    groups of `group` elements: the range code), decoded where each product reads it: the
    decoded x's result bit for bit, without x."""
    kh, kw = dw.shape[2:]
    Cin, N, H, W = x_shape
    PROGRAM.launch("depthwise_backward_weight_coded", dout.dtype, (kh * kw, dw.shape[0]),
                   (dw, code.packed, code.scale, code.zero, i32(code.bits), i32(group), dout,
                    i32(dw.shape[0] // Cin), i32(N), i32(H), i32(W), i32(dout.shape[2]), i32(dout.shape[3]),
                    i32(kh), i32(kw), i32(stride), i32(pad)))
