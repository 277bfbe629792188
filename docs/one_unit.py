"""One BN -> ReLU -> conv unit on one array: keep a K-bit code of x̂ (K = 4), rebuild, compare with exact.

Read with docs/one_unit.md.  Run:  python docs/one_unit.py   (NumPy and lowmem's quantizer; < 1 s)
"""
import numpy as np
from lowmem.units import packing, window

K = 4                                             # bits per kept value: 8, 4, 2 or 1
rng = np.random.default_rng(0)
C, M, C_out = 16, 4096, 32                        # channels; M = N·H·W values per channel; conv outputs
x = rng.standard_normal((C, M)) * 2 + 1           # the unit's input, one row per channel
gamma, beta = rng.uniform(0.5, 1.5, C), rng.uniform(-0.5, 0.5, C)
theta = rng.standard_normal((C_out, C)) / 4       # a 1x1 conv: its output is θ·r
dout = rng.standard_normal((C_out, M))            # the loss's gradient w.r.t. the conv's output

# forward, exact: batch norm, ReLU (the conv reads the exact r); the unit keeps a code of x̂ and rstd
rstd = 1 / np.sqrt(x.var(axis=1, keepdims=True) + 1e-5)
xhat = (x - x.mean(axis=1, keepdims=True)) * rstd
qp = window.quant_params(gamma, beta, bits=K)
code = np.empty(packing.packed_nbytes(xhat.size, K), np.uint8)
window.quantize_pack(code, xhat, qp)               # C·M·K/8 bytes


def backward(xh, mask):
    """-> (dx, dθ) from a saved x̂ (or x̃) and the ReLU mask, as the unit's backward step."""
    r = mask * (xh * gamma[:, None] + beta[:, None])       # the conv's input, rebuilt
    dtheta = dout @ r.T                                     # the conv's weight gradient needs r
    dy = (theta.T @ dout) * mask                            # conv input gradient (weights only), ReLU
    mean = lambda a: a.mean(axis=1, keepdims=True)          # noqa: E731
    return gamma[:, None] * rstd * (dy - mean(dy) - xh * mean(dy * xh)), dtheta


xt, mask = np.empty_like(xhat), np.empty(xhat.shape, bool)
window.unpack_decode(xt, code, qp, mask)           # x̃ (bin midpoints) and the mask, from the code
exact_mask = xhat * gamma[:, None] + beta[:, None] > 0
(dx, dtheta), (dx_t, dtheta_t) = backward(xhat, exact_mask), backward(xt, mask)
rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)  # noqa: E731
print(f"kept: {code.nbytes:,} bytes of code (float32 x̂: {xhat.size * 4:,}); x̃ vs x̂ rel. error {rel(xt, xhat):.4f}")
print(f"ReLU mask entries that differ: {int((mask != exact_mask).sum())} of {mask.size:,}")
print(f"dx, rel. error: {rel(dx_t, dx):.4f}")
print(f"dθ, rel. error: {rel(dtheta_t, dtheta):.4f}")
