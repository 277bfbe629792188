"""What the CUDA kernel sets of units/window_gpu.py and units/unbiased_gpu.py share (program "bn"),
the GPU twin of units/cpu_base.py: the batch statistics, the middle pass of every BN-ReLU
backward, the checks of a unit's rows, and the `bn.partials` workspace both reduce into.

    bn_stats_partial + bn_stats_finalize   BN batch statistics: one read of x, per-channel sums in
                                           float64 over S row segments, then mean, var, rstd
    unit_backward_finalize                 the backward's pass 2, one thread per channel: dgamma,
                                           dbeta and the coefficients of dx from the pass-1 sums
                                           (each code's own kernels do passes 1 and 3)

The reductions' order is fixed by (C, M) (`segments`), so results are deterministic; they
accumulate in float64 (compare to tolerance). Kernels allocate nothing: the partial sums and
the three per-channel coefficients live in `bn.partials`, partials_size(C) float64s of the plan.
Built lazily through lowmem/system/cuda.py, as every program: importing this module needs no GPU.
"""
import numpy

from ..system import cuda
from ..system.cuda import REAL, blocks, i32, i64

MAX_SEGMENTS = 32       # row segments (blocks) per channel in a reduction
TARGET_BLOCKS = 1024    # aim for about this many blocks per reduction (~8 per SM on an H200)

SOURCE = r"""
// the BN reductions both unit codes share; lowmem/system/cuda.py puts `real`, BLOCK, the rn_* helpers,
// block_sum2 and segment before this text

// ---- BN statistics ------------------------------------------------------------------
// grid (S, C): part[(c*S + s)*2 + {0, 1}] = sum(x - K), sum((x - K)^2) over segment s of
// row c, shifted by K = x[c, 0] so the variance does not cancel catastrophically.
extern "C" __global__ void bn_stats_partial(double* part, const real* x, long long M)
{
    __shared__ double sa[BLOCK], sb[BLOCK];
    const int c = blockIdx.y;
    const real* row = x + (long long)c * M;
    const double K = (double)row[0];
    long long lo, hi;
    segment(M, &lo, &hi);
    double a = 0, b = 0;
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const double d = (double)row[i] - K;
        a += d;
        b += d * d;
    }
    block_sum2(a, b, sa, sb);
    if (threadIdx.x == 0) {
        const long long p = ((long long)c * gridDim.x + blockIdx.x) * 2;
        part[p] = sa[0];
        part[p + 1] = sb[0];
    }
}

// one thread per channel: mean, biased var, rstd = 1/sqrt(var + eps) (NumPy's rounding)
extern "C" __global__ void bn_stats_finalize(real* mean, real* var, real* rstd, const double* part,
                                             const real* x, long long M, int S, int C, real eps)
{
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    double a = 0, b = 0;
    for (int s = 0; s < S; ++s) {
        a += part[((long long)c * S + s) * 2];
        b += part[((long long)c * S + s) * 2 + 1];
    }
    const double m1 = a / (double)M;
    double v = (b - a * m1) / (double)M;
    if (v < 0) v = 0;
    const real vr = (real)v;
    mean[c] = (real)((double)x[(long long)c * M] + m1);
    var[c] = vr;
    rstd[c] = rn_rsqrt(rn_add(vr, eps));
}

// Pass 2, one thread per channel: dgamma += sum(dy*x-hat), dbeta += sum(dy); coef[c*3 + ...] =
// gamma*rstd, sum(dy)/M, sum(dy*x-hat)/M in the data's dtype (ops.bn_relu_backward's rounding).
extern "C" __global__ void unit_backward_finalize(double* coef, real* dgamma, real* dbeta,
                                                  const double* part, const real* gamma,
                                                  const real* rstd, long long M, int S, int C)
{
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    double a = 0, s2 = 0;
    for (int s = 0; s < S; ++s) {
        a += part[((long long)c * S + s) * 2];
        s2 += part[((long long)c * S + s) * 2 + 1];
    }
    const real sum_dy = (real)a, sum_dyx = (real)s2;
    dgamma[c] = rn_add(dgamma[c], sum_dyx);
    dbeta[c] = rn_add(dbeta[c], sum_dy);
    coef[c * 3] = (double)rn_mul(gamma[c], rstd[c]);
    coef[c * 3 + 1] = (double)rn_div(sum_dy, (real)M);
    coef[c * 3 + 2] = (double)rn_div(sum_dyx, (real)M);
}
"""

# kernels with __syncthreads (the CPU emulator in tests/units/test_units_gpu.py runs their threads as coroutines)
PROGRAM = cuda.Program("bn", SOURCE, block_sync=("bn_stats_partial",))


def supports(xp, dtype, M, bits):
    """Whether the fused kernels apply: CuPy arrays, float32/float64, byte-aligned code rows."""
    return (getattr(xp, "__name__", "") == "cupy" and numpy.dtype(dtype).name in REAL
            and (M * bits) % 8 == 0)


def partials_size(C):
    """float64 elements of the `bn.partials` workspace for units of up to C channels."""
    return C * (2 * MAX_SEGMENTS + 3)


def rows(a, name, like=None):
    """A C-contiguous (C, M) float array, checked (with `like`: of its shape and dtype)."""
    if a.ndim != 2 or not a.flags.c_contiguous:
        raise ValueError(f"{name} must be a C-contiguous (C, M) array, got shape {a.shape}")
    if like is not None and a.shape != like.shape:
        raise ValueError(f"{name} must have shape {like.shape}, got {a.shape}")
    if like is not None and a.dtype != like.dtype:
        raise ValueError(f"{name} must have dtype {like.dtype.name}, got {a.dtype}")
    if a.dtype.name not in REAL:
        raise ValueError(f"{name}: dtype {a.dtype} is not float32 or float64")
    return a


def segments(C, M):
    """Blocks per channel in a reduction: enough for the whole GPU, at most MAX_SEGMENTS,
    never more than one per BLOCK elements. Fixed by (C, M): results are deterministic."""
    return max(1, min(MAX_SEGMENTS, -(-TARGET_BLOCKS // C), -(-M // cuda.BLOCK)))


def workspace(partials, C, like):
    """(part, coef) views of the bn.partials workspace (allocated here only when None)."""
    need = partials_size(C)
    if partials is None:
        partials = _array_module(like).empty(need, numpy.float64)
    if partials.dtype != numpy.float64 or partials.ndim != 1 or partials.size < need:
        raise ValueError(f"partials must be float64 of at least {need} elements, "
                         f"got {partials.dtype} {partials.shape}")
    return partials[:2 * C * MAX_SEGMENTS], partials[2 * C * MAX_SEGMENTS:need]


def _array_module(a):
    if isinstance(a, numpy.ndarray):
        return numpy
    import cupy
    return cupy


def bn_stats(mean, var, rstd, x, eps, partials=None):
    """mean, var (biased), rstd (C,) of x (C, M)."""
    rows(x, "x")
    C, M = x.shape
    S = segments(C, M)
    part, _ = workspace(partials, C, x)
    PROGRAM.launch("bn_stats_partial", x.dtype, (S, C), (part, x, i64(M)))
    PROGRAM.launch("bn_stats_finalize", x.dtype, (blocks(C),),
                   (mean, var, rstd, part, x, i64(M), i32(S), i32(C), x.dtype.type(eps)))


def backward_finalize(coef, dgamma, dbeta, part, gamma, rstd, M, S):
    """The backward's pass 2: dgamma += sum(dy*x-hat), dbeta += sum(dy) from the S segments' sums
    in `part`; coef <- gamma*rstd, sum(dy)/M, sum(dy*x-hat)/M per channel."""
    C = gamma.shape[0]
    PROGRAM.launch("unit_backward_finalize", gamma.dtype, (blocks(C),),
                   (coef, dgamma, dbeta, part, gamma, rstd, i64(M), i32(S), i32(C)))
