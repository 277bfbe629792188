"""The range code in CUDA (CuPy RawModule), the GPU twin of units/rangecode.py's array ops and of
units/rangecode_cpu.py.

    range_encode   one block per group of GROUP = 256 elements (a thread per element): the
                   group's ends by a block reduction, its step and zero point, every code, and
                   the packed bytes, in one launch
    range_decode   one thread per element: its code unpacked, (q - z) * s

The reference runs a dozen CuPy kernels per chunk (min, max, divide, rint, clip, nan_to_num,
the pack's shifts) and an index array for the decode.

Arithmetic: the reference's operations in its order and dtype, each float operation rounded to
nearest (lowmem/system/cuda.py's rn_* helpers, never an FMA), so codes, steps and zero points
equal rangecode.range_encode's byte for byte and the decode equals range_decode's bit for bit
(tests/units/test_rangecode_gpu.py: on a GPU and on the CPU emulation of this text). The ends
come from the integer bit patterns of the floats (positive floats order as signed integers,
negative ones by magnitude as unsigned integers), so the reduction's order cannot move them and
-0 never becomes an end, as in NumPy's minimum(min(x), 0).

Built through lowmem/system/cuda.py (program "rangecode"), compiled per dtype at first use.
"""
import numpy

from ..system import cuda
from ..system.cuda import BLOCK, REAL, i64, supports  # noqa: F401 (RangeKeep asks it)
from .rangecode import F32_MAX, GROUP

assert GROUP == BLOCK, "one block per group"

SOURCE = f"#define RC_F32_MAX {F32_MAX!r}     // rangecode.F32_MAX, the largest step\n" + r"""
// the range code (units/rangecode.py): one block of GROUP = BLOCK threads per group

template <int S> struct Bits;
template <> struct Bits<4> { typedef int s; typedef unsigned int u; };
template <> struct Bits<8> { typedef long long s; typedef unsigned long long u; };
typedef Bits<sizeof(real)>::s sbits;
typedef Bits<sizeof(real)>::u ubits;
union Pun { real f; sbits s; ubits u; };

__device__ __forceinline__ float  rc_rint(float a)   { return rintf(a); }
__device__ __forceinline__ double rc_rint(double a)  { return rint(a); }
template <typename T> struct Limits;                    // the largest finite value (nan_to_num's +inf)
template <> struct Limits<float> { static __device__ float big() { return 3.4028234663852886e38f; } };
template <> struct Limits<double> { static __device__ double big() { return 1.7976931348623157e308; } };

// packed, scale (groups,) float32, zero (groups,) <- the range code of x (n,); grid: one block per group
extern "C" __global__ void range_encode(unsigned char* packed, float* scale, unsigned char* zero, const real* x,
                                        long long n, int bits)
{
    __shared__ sbits top[BLOCK];
    __shared__ ubits bottom[BLOCK];
    __shared__ unsigned char codes[BLOCK];
    const long long a = (long long)blockIdx.x * BLOCK;
    const int m = n - a < BLOCK ? (int)(n - a) : BLOCK;
    const int t = threadIdx.x;
    Pun v, sign;
    sign.u = (ubits)1 << (8 * sizeof(real) - 1);
    v.f = t < m ? x[a + t] : (real)0;
    top[t] = v.s > 0 ? v.s : 0;                            // maximum(max(x), 0)'s bits
    bottom[t] = v.u > sign.u ? v.u : sign.u;               // minimum(min(x), 0)'s, by magnitude
    __syncthreads();
    for (int h = BLOCK / 2; h > 0; h >>= 1) {
        if (t < h) {
            top[t] = top[t] > top[t + h] ? top[t] : top[t + h];
            bottom[t] = bottom[t] > bottom[t + h] ? bottom[t] : bottom[t + h];
        }
        __syncthreads();
    }
    Pun hi, lo, inf;
    hi.s = top[0];
    lo.u = bottom[0];
    if (lo.u == sign.u) lo.f = (real)0;                    // only -0 below: the end is +0
    const real lev = (real)((1 << bits) - 1), big = Limits<real>::big(), fmax = (real)RC_F32_MAX;
    inf.f = rn_mul(big, (real)2);
    if (hi.u > inf.u || lo.u > (inf.u | sign.u)) {         // NaN propagates through min and max
        hi.f = inf.f - inf.f;
        lo.f = hi.f;
    }
    real s = rn_sub(rn_div(hi.f, lev), rn_div(lo.f, lev));
    s = s > fmax ? fmax : s;                               // minimum(s, F32_MAX); NaN stays NaN
    const float s32 = (float)s;
    const real safe = s32 > 0.0f ? (real)s32 : (real)1;
    real z = rc_rint(rn_div(-lo.f, safe));                 // nan_to_num, then clip into [0, lev]
    z = z != z ? (real)0 : (z > big ? big : z);
    z = z < (real)0 ? (real)0 : (z > lev ? lev : z);
    const double s64 = (double)safe;
    double reach = floor(__ddiv_rn(RC_F32_MAX, s64));     // levels whose decode stays finite
    if (__dmul_rn(reach, s64) > RC_F32_MAX) reach = __dsub_rn(reach, 1.0);
    double l = __dsub_rn((double)z, reach), u = __dadd_rn((double)z, reach);
    const real q_lo = (real)(l > 0.0 ? l : 0.0), q_hi = (real)(u < (double)lev ? u : (double)lev);
    if (t < m) {
        real q = rn_add(rc_rint(rn_div(v.f, safe)), z);
        q = q < q_lo ? q_lo : q;
        q = q > q_hi ? q_hi : q;
        codes[t] = q == q ? (unsigned char)(int)q : 0;
    }
    if (t == 0) {
        scale[blockIdx.x] = s32;
        zero[blockIdx.x] = (unsigned char)(int)z;
    }
    __syncthreads();
    const int per = 8 / bits, nbytes = (m * bits + 7) / 8;
    if (t < nbytes) {
        unsigned int byte = 0;
        for (int q = 0; q < per && t * per + q < m; ++q)
            byte |= (unsigned int)codes[t * per + q] << (q * bits);
        packed[a * bits / 8 + t] = (unsigned char)byte;
    }
}

// out (n,) <- (q - z) * s of each element's group; one thread per element
extern "C" __global__ void range_decode(real* out, const unsigned char* packed, const float* scale,
                                        const unsigned char* zero, long long n, int bits)
{
    const long long i = (long long)blockIdx.x * BLOCK + threadIdx.x;
    if (i >= n) return;
    const int per = 8 / bits;
    const int code = (packed[i / per] >> ((int)(i % per) * bits)) & ((1 << bits) - 1);
    const long long g = i / BLOCK;
    out[i] = rn_mul(rn_sub((real)code, (real)zero[g]), (real)scale[g]);
}
"""

PROGRAM = cuda.Program("rangecode", SOURCE, block_sync=("range_encode",))


def _flat(a, name):
    if not a.flags.c_contiguous or a.dtype.name not in REAL:
        raise ValueError(f"{name} must be a C-contiguous float32 or float64 array, got {a.dtype} {a.shape}")
    return a.reshape(-1)


def range_encode(packed, scale, zero, x, bits):
    """rangecode.range_encode's bytes in one launch: packed, scale (float32), zero <- the code of x."""
    x = _flat(x, "x")
    if x.size:
        PROGRAM.launch("range_encode", x.dtype, (cuda.blocks(x.size),),
                       (packed, scale, zero, x, i64(x.size), numpy.int32(bits)))


def range_decode(out, packed, scale, zero, bits):
    """rangecode.range_decode's values in one launch: out (n,) <- (q - z) * s."""
    out = _flat(out, "out")
    if out.size:
        PROGRAM.launch("range_decode", out.dtype, (cuda.blocks(out.size),),
                       (out, packed, scale, zero, i64(out.size), numpy.int32(bits)))

