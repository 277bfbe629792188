"""The convolution's columns on the GPU: im2col and col2im_add in one CUDA launch each.

ops/conv.py's `im2col` / `col2im_add` are Python loops of kernel-offset slice
copies: about 45 launches per 3x3 conv on CuPy. These two kernels do the same
in one launch each, with the same results bit for bit (tests/units/test_units_gpu.py,
on a real GPU and on the CPU emulator). ops/conv.py's `columns_for` picks them
for CuPy arrays; they are compiled through lowmem/system/cuda.py (program "columns").

Layout: x, dx (Cin, n, H, W), any strides; cols (Cin, kh, kw, n, Ho, Wo),
C-contiguous.
"""
from ..system import cuda
from ..system.cuda import i32

SOURCE = r"""
// cols (Cin, kh, kw, n, Ho, Wo) <- patches of x (Cin, n, H, W) with element strides sx*;
// zero outside the image. One block per (ci, i, j, nn) plane; threads over Ho*Wo.
extern "C" __global__ void im2col(real* cols, const real* x, int n, int H, int W,
                                  long long sxc, long long sxn, long long sxh, long long sxw,
                                  int kh, int kw, int stride, int pad, int Ho, int Wo)
{
    const int p = blockIdx.x;
    const int nn = p % n, j = (p / n) % kw, i = (p / n / kw) % kh, ci = p / n / kw / kh;
    const real* xp = x + ci * sxc + nn * sxn;
    real* out = cols + (long long)p * Ho * Wo;
    for (int e = threadIdx.x; e < Ho * Wo; e += blockDim.x) {
        const int h = (e / Wo) * stride - pad + i, ww = (e % Wo) * stride - pad + j;
        out[e] = (h >= 0 && h < H && ww >= 0 && ww < W) ? xp[h * sxh + ww * sxw] : (real)0;
    }
}

// dx (Cin, n, H, W) += the scatter of cols (im2col's adjoint), as a gather: each element adds
// its contributions in (i, j) order, the order of ops/conv.col2im_add's slice additions.
// One block per (ci, nn) plane; threads over H*W.
extern "C" __global__ void col2im_add(real* dx, const real* cols, int n, int H, int W,
                                      long long sdc, long long sdn, long long sdh, long long sdw,
                                      int kh, int kw, int stride, int pad, int Ho, int Wo)
{
    const int nn = blockIdx.x % n, ci = blockIdx.x / n;
    real* dp = dx + ci * sdc + nn * sdn;
    for (int e = threadIdx.x; e < H * W; e += blockDim.x) {
        const int h = e / W, ww = e % W;
        real acc = dp[h * sdh + ww * sdw];
        for (int i = 0; i < kh; ++i) {
            const int hh = h + pad - i;
            if (hh < 0 || hh % stride || hh / stride >= Ho) continue;
            for (int j = 0; j < kw; ++j) {
                const int wj = ww + pad - j;
                if (wj < 0 || wj % stride || wj / stride >= Wo) continue;
                const long long plane = (((long long)ci * kh + i) * kw + j) * n + nn;
                acc = rn_add(acc, cols[plane * Ho * Wo + (hh / stride) * Wo + wj / stride]);
            }
        }
        dp[h * sdh + ww * sdw] = acc;
    }
}
"""

PROGRAM = cuda.Program("columns", SOURCE)


def _check(cols, a, kh, kw):
    Cin, n = a.shape[:2]
    Ho, Wo = cols.shape[4:]
    if cols.shape[:4] != (Cin, kh, kw, n) or not cols.flags.c_contiguous or cols.dtype != a.dtype:
        raise ValueError(f"cols must be C-contiguous {(Cin, kh, kw, n, Ho, Wo)} {a.dtype}, "
                         f"got {cols.shape} {cols.dtype}")


def im2col(cols, x, kh, kw, stride, pad):
    """ops.conv.im2col in one launch: cols (Cin, kh, kw, n, Ho, Wo) <- patches of x (Cin, n, H, W);
    x may be any strided view, cols must be C-contiguous."""
    _check(cols, x, kh, kw)
    Cin, n, H, W = x.shape
    Ho, Wo = cols.shape[4:]
    PROGRAM.launch("im2col", x.dtype, (Cin * kh * kw * n,),
                   (cols, x, i32(n), i32(H), i32(W), *cuda.elem_strides(x), i32(kh), i32(kw),
                    i32(stride), i32(pad), i32(Ho), i32(Wo)))


def col2im_add(dx, cols, kh, kw, stride, pad):
    """ops.conv.col2im_add in one launch: dx (Cin, n, H, W) += scatter of cols; dx may be strided."""
    _check(cols, dx, kh, kw)
    Cin, n, H, W = dx.shape
    Ho, Wo = cols.shape[4:]
    PROGRAM.launch("col2im_add", dx.dtype, (Cin * n,),
                   (dx, cols, i32(n), i32(H), i32(W), *cuda.elem_strides(dx), i32(kh), i32(kw),
                    i32(stride), i32(pad), i32(Ho), i32(Wo)))
