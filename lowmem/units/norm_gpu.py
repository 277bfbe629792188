"""Batch norm on its own (no ReLU after it) in CUDA: the GPU twin of units/norm_cpu.py (same
functions, same arithmetic), beside the BN-ReLU unit's kernels; the statistics and the backward's
finalize are units/gpu_base.py's (program "bn").

    forward      one thread per element: x-hat = (x - mean)*rstd into the slot, out = x-hat*gamma + beta
    forward_add_relu   a batch norm, an add and a ReLU (a ResNet block's end): one thread per byte of
                 the ReLU's mask
    normalize    out = x-hat;  apply: out = out*gamma + beta (in place)
    backward     per (segment, channel) block the float64 sums of dy and dy*x-hat into the plan's
                 `bn.partials` workspace, gpu_base's finalize (dgamma, dbeta and the three
                 coefficients), then one thread per element for dx

Arithmetic: lowmem/system/cuda.py's round-to-nearest operations in ops/batchnorm.py's order, so
x-hat and out equal bn_normalize's and bn_apply_forward's bit for bit; the sums in float64 (to
tolerance). Program "norm", compiled through lowmem/system/cuda.py; tested on the CPU emulation
of this text and with nvcc (tests/units/test_units_gpu.py).
"""
from ..system import cuda
from ..system.cuda import blocks, i32, i64
from . import gpu_base

SOURCE = r"""
// grid (ceil(M / BLOCK), C); rows of x, out: M apart; of xhat: ldx apart. out may alias x.
// keep: write x-hat to xhat; apply: out = x-hat*gamma + beta, else out = x-hat.
extern "C" __global__ void bn_forward(real* out, real* xhat, const real* x, const real* mean, const real* rstd,
                                      const real* gamma, const real* beta, long long M, long long ldx, int keep,
                                      int apply)
{
    const int c = blockIdx.y;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= M) return;
    const long long e = (long long)c * M + i;
    const real xh = rn_mul(rn_sub(x[e], mean[c]), rstd[c]);
    if (keep) xhat[(long long)c * ldx + i] = xh;
    out[e] = apply ? rn_add(rn_mul(xh, gamma[c]), beta[c]) : xh;
}

extern "C" __global__ void bn_apply(real* out, const real* gamma, const real* beta, long long M)
{
    const int c = blockIdx.y;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= M) return;
    const long long e = (long long)c * M + i;
    out[e] = rn_add(rn_mul(out[e], gamma[c]), beta[c]);
}

// grid (S, C): part[(c*S + s)*2 + {0, 1}] = sum(dy), sum(dy * x-hat) over segment s of row c
extern "C" __global__ void bn_backward_partial(double* part, const real* dy, const real* xhat, long long M,
                                               long long ldx)
{
    __shared__ double sa[BLOCK], sb[BLOCK];
    const int c = blockIdx.y;
    long long lo, hi;
    segment(M, &lo, &hi);
    double a = 0, s2 = 0;
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const double d = (double)dy[(long long)c * M + i];
        a += d;
        s2 += d * (double)xhat[(long long)c * ldx + i];
    }
    block_sum2(a, s2, sa, sb);
    if (threadIdx.x == 0) {
        const long long p = ((long long)c * gridDim.x + blockIdx.x) * 2;
        part[p] = sa[0];
        part[p + 1] = sb[0];
    }
}

// dx = (dy - (x-hat*mean(dy*x-hat) + mean(dy))) * gamma*rstd, written or added; dx may alias dy
extern "C" __global__ void bn_backward_apply(real* dx, const real* dy, const real* xhat, const double* coef,
                                             long long M, long long ldx, int accumulate)
{
    const int c = blockIdx.y;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= M) return;
    const real a = (real)coef[c * 3], mdy = (real)coef[c * 3 + 1], mdyx = (real)coef[c * 3 + 2];
    const long long e = (long long)c * M + i;
    const real v = rn_mul(rn_sub(dy[e], rn_add(rn_mul(xhat[(long long)c * ldx + i], mdyx), mdy)), a);
    dx[e] = accumulate ? rn_add(dx[e], v) : v;
}

// A batch norm, an add and a ReLU (a post-activation block's end) in one pass: one thread per byte
// of the mask (8 flat elements e of the (C, M) rows, c = e / M). x-hat = (src - mean)*rstd, or src
// itself (normalized); kept in xhat (keep); out = relu(x-hat*gamma + beta + other) with
// numpy.maximum's rules (NaN passes, -0 and below give +0); mask bit [x-hat*gamma + beta + other > 0].
// out may alias src or other (each thread reads its elements before writing them).
extern "C" __global__ void bn_add_relu(real* out, unsigned char* mask, real* xhat, const real* src,
                                       const real* other, const real* mean, const real* rstd,
                                       const real* gamma, const real* beta, long long M, long long n,
                                       int keep, int normalized)
{
    const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j * 8 >= n) return;
    unsigned int byte = 0;
    for (int q = 0; q < 8 && j * 8 + q < n; ++q) {
        const long long e = j * 8 + q;
        const int c = (int)(e / M);
        const real h = normalized ? src[e] : rn_mul(rn_sub(src[e], mean[c]), rstd[c]);
        const real z = rn_add(rn_add(rn_mul(h, gamma[c]), beta[c]), other[e]);
        if (keep) xhat[e] = h;
        out[e] = (z > (real)0 || z != z) ? z : (real)0;
        byte |= (unsigned int)(z > (real)0) << q;
    }
    mask[j] = (unsigned char)byte;
}
"""

PROGRAM = cuda.Program("norm", SOURCE, block_sync=("bn_backward_partial",))


def supports(*arrays):
    """Whether the kernels take these arrays: C-contiguous, one float dtype (float32 or float64)."""
    return (all(a.flags.c_contiguous for a in arrays) and arrays[0].dtype.name in cuda.REAL
            and all(a.dtype == arrays[0].dtype for a in arrays))


def _ld(xhat, x):
    return i64(xhat.strides[0] // xhat.itemsize) if xhat.ndim == 2 else i64(x.shape[1])


def forward(out, xhat, x, mean, rstd, gamma, beta):
    """xhat (C, M) <- (x - mean)*rstd, out (C, M) = xhat*gamma + beta; out may alias x."""
    gpu_base.rows(x, "x")
    gpu_base.rows(out, "out", x)
    C, M = x.shape
    PROGRAM.launch("bn_forward", x.dtype, (blocks(M), C),
                   (out, xhat, x, mean, rstd, gamma, beta, i64(M), _ld(xhat, x), i32(1), i32(1)))


def normalize(out, x, mean, rstd):
    """out (C, M) = (x - mean)*rstd; out may alias x."""
    gpu_base.rows(x, "x")
    gpu_base.rows(out, "out", x)
    C, M = x.shape
    PROGRAM.launch("bn_forward", x.dtype, (blocks(M), C),
                   (out, out, x, mean, rstd, mean, mean, i64(M), i64(M), i32(0), i32(0)))


def apply(out, gamma, beta):
    """out (C, M) = out*gamma + beta, in place."""
    gpu_base.rows(out, "out")
    C, M = out.shape
    PROGRAM.launch("bn_apply", out.dtype, (blocks(M), C), (out, gamma, beta, i64(M)))


def backward(dx, dgamma, dbeta, dy, xhat, gamma, rstd, accumulate=False, partials=None):
    """ops.bn_backward: dgamma += sum(dy*xhat), dbeta += sum(dy), dx = (or += with accumulate) the
    input gradient; dy is read only, dx may alias dy. partials: the plan's `bn.partials`."""
    gpu_base.rows(dy, "dy")
    gpu_base.rows(dx, "dx", dy)
    C, M = dy.shape
    S = gpu_base.segments(C, M)
    part, coef = gpu_base.workspace(partials, C, dy)
    ldx = _ld(xhat, dy)
    PROGRAM.launch("bn_backward_partial", dy.dtype, (S, C), (part, dy, xhat, i64(M), ldx))
    gpu_base.backward_finalize(coef, dgamma, dbeta, part, gamma, rstd, M, S)
    PROGRAM.launch("bn_backward_apply", dy.dtype, (blocks(M), C),
                   (dx, dy, xhat, coef, i64(M), ldx, i32(bool(accumulate))))


def forward_add_relu(out, mask, xhat, src, other, mean, rstd, gamma, beta):
    """A batch norm, an add and a ReLU in one pass (units/norm_cpu.py's function, the same bits):
    x-hat kept in xhat (None: src is x-hat already), out = relu(x-hat*gamma + beta + other),
    mask <- [that sum > 0], 1 bit each. out may alias src or other."""
    gpu_base.rows(src, "src")
    gpu_base.rows(out, "out", src)
    gpu_base.rows(other, "other", src)
    C, M = src.shape
    n = C * M
    keep = xhat is not None
    if keep:
        gpu_base.rows(xhat, "xhat", src)
    PROGRAM.launch("bn_add_relu", src.dtype, (blocks(-(-n // 8)),),
                   (out, mask, xhat if keep else out, src, other, mean, rstd, gamma, beta, i64(M), i64(n),
                    i32(keep), i32(not keep)))
