"""The convolution's columns on the CPU: col2im_add as one numba loop (optional: lowmem[fast]).

ops/conv.py's `col2im_add` (kernel-offset slice additions) is the reference;
this loop gives the same sums bit for bit (every dx element receives its terms
in the same (i, j) order: tests/units/test_window_cpu.py) and runs faster (the
figure: docs/performance.md): one (channel, sample) plane of dx stays in L1 while its column rows
stream by. ops/conv.py's `columns_for` picks it for NumPy arrays when numba is
installed (and LOWMEM_FAST is not 0); `supports` says which arrays it takes.

im2col itself stays NumPy's: its nine strided slice copies beat every numba loop
tried, which spend their time on per-row set-up for rows of 8-32 elements.

Layout: dx (Cin, N, H, W) C-contiguous (the whole array: the loop indexes it
flat); cols (Cin, kh, kw, n, Ho, Wo) for samples n0 .. n0+n.
"""
import numpy

from ..system.backend import numba_available

AVAILABLE = numba_available()

if AVAILABLE:
    from numba import njit
    _opts = dict(cache=True, nogil=True)      # no fastmath: each addition rounds as NumPy's does

    @njit(**_opts)
    def _valid(k_off, size, out_size, stride, pad):
        """Output range [lo, hi) whose input index o*stride + k_off - pad lies in [0, size)."""
        lo = max(0, -((k_off - pad) // stride))
        hi = min(out_size, (size - 1 - k_off + pad) // stride + 1)
        return lo, max(lo, hi)

    @njit(**_opts)
    def _col2im_add(dx, n0, cols, kh, kw, stride, pad):
        """dx[:, n0:n0+n] += the scatter of cols, each element's terms in (i, j) order."""
        Cin, N, H, W = dx.shape
        n, Ho, Wo = cols.shape[3], cols.shape[4], cols.shape[5]
        cf = cols.reshape(-1)
        df = dx.reshape(-1)
        for c in range(Cin):
            for s in range(n):
                xb = (c * N + n0 + s) * H * W
                for i in range(kh):
                    h0, h1 = _valid(i, H, Ho, stride, pad)
                    for j in range(kw):
                        w0, w1 = _valid(j, W, Wo, stride, pad)
                        cb = (((c * kh + i) * kw + j) * n + s) * Ho * Wo
                        for oh in range(h0, h1):
                            o = cb + oh * Wo
                            xi = xb + (oh * stride + i - pad) * W + j - pad
                            d = df[xi + w0 * stride:xi + w1 * stride:stride]
                            d += cf[o + w0:o + w1]


def col2im_add(dx, cols, kh, kw, stride, pad, n0=0):
    """numba twin of ops.conv.col2im_add, bit-identical: dx[:, n0:n0+n] += the scatter of
    cols (Cin, kh, kw, n, Ho, Wo). dx (Cin, N, H, W) is the whole C-contiguous array (see
    `supports`), so the kernel can index it flat."""
    _col2im_add(dx, n0, cols, kh, kw, stride, pad)


def supports(dx, cols):
    """Whether col2im_add above applies: numba, C-contiguous NumPy float32/float64 arrays."""
    return (AVAILABLE and all(type(a) is numpy.ndarray and a.flags.c_contiguous for a in (dx, cols))
            and dx.dtype == cols.dtype and dx.dtype in (numpy.float32, numpy.float64))
