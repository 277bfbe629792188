"""Max-pool with its 4-bit window index written and read in the op's own pass: CUDA (CuPy
RawModule), the GPU twin of ops/pool.py's max-pool (the reference) and ops/pool_cpu.py, with the
same signatures and the same arithmetic (ops/pool_cpu.py states it): one thread per index byte
(two outputs) forward, one thread per input element backward, gathering from the outputs whose
window holds it in the reference's offset order. Bit for bit the reference's outputs, packed
indices and input gradients (tests/ops/test_pool_gpu.py, on a GPU and on the CPU emulation).
Program "pool".
"""
import numpy

from .bitpack import check_packed
from ..system import cuda
from ..system.backend import array_module
from ..system.cuda import i32, i64, supports  # noqa: F401 (ops/codes.py asks each module)

SOURCE = r"""
// out (P, Ho, Wo) = window maxima of x (P, H, W); argmax (packed 4-bit) <- first maximum's i*k + j.
// One thread per index byte: outputs 2t and 2t + 1 of the flat (P*Ho*Wo,) outputs.
extern "C" __global__ void maxpool_forward(real* out, unsigned char* argmax, const real* x, long long n,
                                           int H, int W, int Ho, int Wo, int k, int stride, int pad, int keep,
                                           real neg)
{
    const long long t = (long long)blockIdx.x * BLOCK + threadIdx.x;
    if (2 * t >= n) return;
    unsigned int byte = 0;
    for (int q = 0; q < 2 && 2 * t + q < n; ++q) {
        const long long e = 2 * t + q;
        const long long p = e / ((long long)Ho * Wo);
        const int r = (int)(e % ((long long)Ho * Wo)), oh = r / Wo, ow = r % Wo;
        const real* plane = x + p * H * W;
        real best = neg;                               // -inf
        int arg = 0;
        for (int i = 0; i < k; ++i) {
            const int ih = oh * stride - pad + i;
            if (ih < 0 || ih >= H) continue;
            for (int j = 0; j < k; ++j) {
                const int iw = ow * stride - pad + j;
                if (iw < 0 || iw >= W) continue;
                const real v = plane[ih * W + iw];
                if (v > best) { best = v; arg = i * k + j; }
            }
        }
        out[e] = best;
        byte |= (unsigned int)arg << (4 * q);
    }
    if (keep) argmax[t] = (unsigned char)byte;
}

// dx (P, H, W): each input's sum over window offsets (i, j) in order of dout where the index names
// (i, j), +0 where not. One thread per input element.
extern "C" __global__ void maxpool_backward(real* dx, const real* dout, const unsigned char* argmax, long long n,
                                            int H, int W, int Ho, int Wo, int k, int stride, int pad)
{
    const long long e = (long long)blockIdx.x * BLOCK + threadIdx.x;
    if (e >= n) return;
    const long long p = e / ((long long)H * W);
    const int r = (int)(e % ((long long)H * W)), h = r / W, w = r % W;
    real acc = (real)0;
    for (int i = 0; i < k; ++i) {
        const int a = h + pad - i;
        if (a < 0 || a % stride || a / stride >= Ho) continue;
        for (int j = 0; j < k; ++j) {
            const int b = w + pad - j;
            if (b < 0 || b % stride || b / stride >= Wo) continue;
            const long long o = (p * Ho + a / stride) * Wo + b / stride;
            const int code = (argmax[o >> 1] >> ((int)(o & 1) * 4)) & 15;
            acc = rn_add(acc, code == i * k + j ? dout[o] : (real)0);
        }
    }
    dx[e] = acc;
}
"""

PROGRAM = cuda.Program("pool", SOURCE)


def maxpool_forward(out, argmax, x, k=3, stride=2, pad=1):
    """ops/pool_cpu.maxpool_forward in one launch (argmax None: eval, no index written)."""
    C, N, H, W = x.shape
    Ho, Wo = out.shape[2:]
    n = C * N * Ho * Wo
    keep = argmax is not None
    if keep:
        check_packed(argmax, n, 4, "argmax")
    code = argmax if keep else array_module(out).empty(1, numpy.uint8)     # unused without keep
    if n:
        PROGRAM.launch("maxpool_forward", x.dtype, (cuda.blocks((n + 1) // 2),),
                       (out, code, x, i64(n), i32(H), i32(W), i32(Ho), i32(Wo), i32(k), i32(stride), i32(pad),
                        i32(keep), x.dtype.type(-numpy.inf)))


def maxpool_backward(dx, dout, argmax, k=3, stride=2, pad=1):
    """ops/pool_cpu.maxpool_backward in one launch: every dx element written (no fill).

    # saved: argmax (exact window index per output, 4 bits)."""
    C, N, H, W = dx.shape
    Ho, Wo = dout.shape[2:]
    check_packed(argmax, C * N * Ho * Wo, 4, "argmax")
    n = C * N * H * W
    if n:
        PROGRAM.launch("maxpool_backward", dx.dtype, (cuda.blocks(n),),
                       (dx, dout, argmax, i64(n), i32(H), i32(W), i32(Ho), i32(Wo), i32(k), i32(stride), i32(pad)))
