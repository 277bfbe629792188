"""Dropout with its mask drawn and packed in the op's own pass: CUDA (CuPy RawModule), the GPU twin
of ops/dropout.py (the reference) and ops/dropout_cpu.py, with the same signatures.

One thread per mask byte forward (it draws its 8 elements' keeps from the counter stream, lowmem/
system/cuda.py's counter_bits, writes their outputs and the byte), one thread per element
backward. Draws, masks, outputs and gradients equal the reference's (the products in its order,
rounded to nearest: tests/ops/test_dropout_gpu.py, on a GPU and on the CPU emulation of this
text). out may be x itself and dx dout itself (without accumulate). Program "dropout".
"""
import numpy

from . import dropout as reference
from .bitpack import check_packed, flat
from ..system import cuda
from ..system.cuda import i64, partial_overlap as _partial_overlap, supports
from ..system.splitmix import mix64

SOURCE = r"""
// out = (x * keep) * scale, keep = counter_bits(base, i) >= threshold; one thread per mask byte
extern "C" __global__ void dropout_forward(real* out, unsigned char* mask, const real* x, long long n,
                                           unsigned long long base, unsigned long long threshold, real scale)
{
    const long long t = (long long)blockIdx.x * BLOCK + threadIdx.x;
    if (t * 8 >= n) return;
    unsigned int byte = 0;
    for (int q = 0; q < 8 && t * 8 + q < n; ++q) {
        const long long i = t * 8 + q;
        const bool keep = counter_bits(base, i) >= threshold;
        byte |= (unsigned int)keep << q;
        out[i] = rn_mul(rn_mul(x[i], keep ? (real)1 : (real)0), scale);
    }
    mask[t] = (unsigned char)byte;
}

// dx = (or +=) (dout * keep) * scale; one thread per element
extern "C" __global__ void dropout_backward(real* dx, const real* dout, const unsigned char* mask, long long n,
                                            real scale, int accumulate)
{
    const long long i = (long long)blockIdx.x * BLOCK + threadIdx.x;
    if (i >= n) return;
    const bool keep = (mask[i >> 3] >> (i & 7)) & 1;
    const real d = rn_mul(rn_mul(dout[i], keep ? (real)1 : (real)0), scale);
    dx[i] = accumulate ? rn_add(dx[i], d) : d;
}
"""

PROGRAM = cuda.Program("dropout", SOURCE)


def dropout_forward(out, mask, x, p, key):
    """ops.dropout.dropout_forward in one launch: out = x * keep / (1 - p) (may be x); mask <- keep."""
    p = reference.check_p(p)
    if not supports(out, x):
        return reference.dropout_forward(out, mask, x, p, key)
    o, s = flat(out, "out"), flat(x, "x")
    check_packed(mask, s.size, 1, "mask")
    if _partial_overlap(o, s):
        raise ValueError("the output overlaps the input without being it")
    if s.size:
        dt = s.dtype.type
        PROGRAM.launch("dropout_forward", s.dtype, (cuda.blocks(mask.size),),
                       (o, mask, s, i64(s.size), numpy.uint64(mix64(int(key))),
                        numpy.uint64(round(p * (1 << reference.DRAW_BITS))), dt(1 / (1 - p))))


def dropout_backward(dx, dout, mask, p, accumulate=False):
    """ops.dropout.dropout_backward in one launch: dx = (or +=) dout * keep / (1 - p).

    # saved: mask, the 1-bit keep of the forward (exact)."""
    p = reference.check_p(p)
    if not supports(dx, dout):
        return reference.dropout_backward(dx, dout, mask, p, accumulate)
    d, g = flat(dx, "dx"), flat(dout, "dout")
    check_packed(mask, g.size, 1, "mask")
    if _partial_overlap(d, g):
        raise ValueError("dx overlaps dout without being it")
    if g.size:
        PROGRAM.launch("dropout_backward", g.dtype, (cuda.blocks(g.size),),
                       (d, g, mask, i64(g.size), g.dtype.type(1 / (1 - p)), numpy.int32(bool(accumulate))))
