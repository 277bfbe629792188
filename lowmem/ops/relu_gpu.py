"""ReLU and ReLU6 / clip with their codes written in the op's own pass: CUDA (CuPy RawModule),
the GPU twin of ops/relu.py (the reference) and ops/relu_cpu.py, with the same signatures.

One thread per code byte forward (it reads that byte's 8 or 4 elements, writes their outputs
and the byte), one thread per element backward (it reads its code where it needs it). The
reference runs a compare, a cast, the pack's shifts and the op itself as separate CuPy kernels.

Arithmetic: NumPy's rules (ops/relu_cpu.py says them) with round-to-nearest multiplies and adds
(lowmem/system/cuda.py), so outputs, gradients and codes equal the reference's bit for bit
(tests/ops/test_relu_gpu.py, on a GPU and on the CPU emulation of this text). out may be x itself
and dx dout itself (without accumulate). Built through lowmem/system/cuda.py (program "relu").
"""
import numpy

from . import relu as reference
from .bitpack import check_packed, flat
from ..system import cuda
from ..system.cuda import i64, partial_overlap as _partial_overlap, supports

SOURCE = r"""
// forward: one thread per code byte (8 / bits elements); relu: bits 1, clip: bits 2
extern "C" __global__ void relu_forward(real* out, unsigned char* mask, const real* x, long long n)
{
    const long long t = (long long)blockIdx.x * BLOCK + threadIdx.x;
    if (t * 8 >= n) return;
    unsigned int byte = 0;
    for (int q = 0; q < 8 && t * 8 + q < n; ++q) {
        const long long i = t * 8 + q;
        const real v = x[i];
        const bool on = v > (real)0;
        byte |= (unsigned int)on << q;
        out[i] = (on || v != v) ? v : (real)0;          // numpy.maximum(x, 0): NaN passes, -0 -> +0
    }
    mask[t] = (unsigned char)byte;
}

extern "C" __global__ void clip_forward(real* out, unsigned char* code, const real* x, long long n, real lo, real hi)
{
    const long long t = (long long)blockIdx.x * BLOCK + threadIdx.x;
    if (t * 4 >= n) return;
    unsigned int byte = 0;
    for (int q = 0; q < 4 && t * 4 + q < n; ++q) {
        const long long i = t * 4 + q;
        real v = x[i];
        byte |= (unsigned int)((v > lo) + (v >= hi)) << (2 * q);    // 0 below, 1 inside, 2 above
        v = v < lo ? lo : v;                                          // numpy.clip: NaN and -0 pass
        out[i] = v > hi ? hi : v;
    }
    code[t] = (unsigned char)byte;
}

// backward: dx = (or +=) dout * [code == passes], one thread per element
extern "C" __global__ void gate_backward(real* dx, const real* dout, const unsigned char* packed, long long n,
                                         int bits, int passes, int accumulate)
{
    const long long i = (long long)blockIdx.x * BLOCK + threadIdx.x;
    if (i >= n) return;
    const int per = 8 / bits;
    const int c = (packed[i / per] >> ((int)(i % per) * bits)) & ((1 << bits) - 1);
    const real d = rn_mul(dout[i], c == passes ? (real)1 : (real)0);
    dx[i] = accumulate ? rn_add(dx[i], d) : d;
}
"""

PROGRAM = cuda.Program("relu", SOURCE)


def relu_forward(out, mask, x):
    """ops.relu.relu_forward in one launch: out = max(x, 0) (may be x); mask <- [x > 0] packed."""
    if not supports(out, x):
        return reference.relu_forward(out, mask, x)
    o, s = flat(out, "out"), flat(x, "x")
    check_packed(mask, s.size, 1, "mask")
    if _partial_overlap(o, s):
        raise ValueError("the output overlaps the input without being it")
    if s.size:
        PROGRAM.launch("relu_forward", s.dtype, (cuda.blocks(mask.size),), (o, mask, s, i64(s.size)))


def clip_forward(out, code, x, lo=0.0, hi=6.0):
    """ops.relu.clip_forward in one launch: out = clip(x, lo, hi) (may be x); code <- the region."""
    reference._check_range(lo, hi)
    if not supports(out, x):
        return reference.clip_forward(out, code, x, lo, hi)
    o, s = flat(out, "out"), flat(x, "x")
    check_packed(code, s.size, 2, "code")
    if _partial_overlap(o, s):
        raise ValueError("the output overlaps the input without being it")
    if s.size:
        dt = s.dtype.type
        PROGRAM.launch("clip_forward", s.dtype, (cuda.blocks(code.size),), (o, code, s, i64(s.size), dt(lo), dt(hi)))


def _backward(dx, dout, packed, bits, passes, accumulate, fallback):
    if not supports(dx, dout):
        return fallback(dx, dout, packed, accumulate)
    d, g = flat(dx, "dx"), flat(dout, "dout")
    check_packed(packed, g.size, bits, "mask" if bits == 1 else "code")
    if _partial_overlap(d, g):
        raise ValueError("dx overlaps dout without being it")
    if g.size:
        PROGRAM.launch("gate_backward", g.dtype, (cuda.blocks(g.size),),
                       (d, g, packed, i64(g.size), numpy.int32(bits), numpy.int32(passes),
                        numpy.int32(bool(accumulate))))


def relu_backward(dx, dout, mask, accumulate=False):
    """ops.relu.relu_backward in one launch: dx = (or +=) dout * [x > 0].

    # saved: mask, the 1-bit [x > 0] of the forward's input (exact)."""
    _backward(dx, dout, mask, 1, 1, accumulate, reference.relu_backward)


def clip_backward(dx, dout, code, accumulate=False):
    """ops.relu.clip_backward in one launch: dx = (or +=) dout * [lo < x < hi].

    # saved: code, the 2-bit region of the forward's input (exact)."""
    _backward(dx, dout, code, 2, reference.INSIDE, accumulate, reference.clip_backward)


def relu6_forward(out, code, x):
    """ReLU6: clip_forward with lo = 0, hi = 6."""
    clip_forward(out, code, x, 0.0, 6.0)


relu6_backward = clip_backward
