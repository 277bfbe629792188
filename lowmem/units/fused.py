"""The fused unit kernels: numba on the CPU (units/window_cpu.py), CUDA on the GPU (units/window_gpu.py).

Both modules export the same functions (bn_stats, unit_forward_exact,
unit_forward_code, conv_input, unit_backward), each one pass (or two) over a
unit's (C, M) rows instead of a dozen array ops. These classes give them the
interface of lowmem/units/__init__.py, with the mode and bit width fixed
when the set is made. What differs between the two modules is written here
once:

  * the quantization grid: numba's kernels take window.QuantParams (computed
    per unit by window_cpu.quant_params, one small kernel); the CUDA kernels derive
    it from gamma and beta in-kernel and take only the bit width (no per-unit launches);
  * CUDA's reductions need the plan's `bn.partials` workspace (float64).

The code kernels read and write one channel's codes as whole bytes, so they
apply only when M * bits is a multiple of 8 (`applies`).
"""
import numpy

from . import window, window_cpu, window_gpu
from ..ops.batchnorm import BN_EPS
from .reference import CodeUnits, ExactUnits, UnbiasedCodeUnits


class FusedExactUnits(ExactUnits):
    """x-hat saved in float, through one fused kernel per step."""
    fused = True

    def __init__(self, module, partials=None):
        self.module, self.partials = module, partials
        self._extra = {} if partials is None else {"partials": partials}

    def stats(self, mean, var, rstd, x):
        self.module.bn_stats(mean, var, rstd, x, BN_EPS, **self._extra)

    def forward(self, out, saved, x, mean, rstd, gamma, beta, key=None):
        self.module.unit_forward_exact(out, saved, x, mean, rstd, gamma, beta)

    def conv_input(self, u, saved, gamma, beta):
        self.module.conv_input(u, saved, None, None, gamma, beta)

    def backward(self, dx, dgamma, dbeta, dr, saved, rstd, gamma, beta, accumulate, scratch):
        # saved: x-hat exact; decoded nowhere, so `scratch` stays unused
        self.module.unit_backward(dx, dgamma, dbeta, dr, saved, None, None, gamma, beta, rstd,
                             accumulate, **self._extra)


class FusedCodeUnits(CodeUnits):
    """x-hat saved as a K-bit code; the kernels decode it inline (no decode buffer)."""
    fused = True

    def __init__(self, module, bits, naive=False, partials=None, rounding="nearest"):
        super().__init__(bits, naive, rounding)
        self.module, self.partials = module, partials
        self._extra = {} if partials is None else {"partials": partials}
        self._grids = {}            # (id(γ), id(β)) -> (γ's bytes, β's bytes, grid)

    GRIDS = 4096       # grids remembered per set (one per unit it runs); past it the memo starts afresh

    def grid(self, gamma, beta):
        """What the module takes for the grid: QuantParams (numba, from window_cpu.quant_params: the
        reference's grid in one kernel call) or the bit width (CUDA). A unit asks three times a
        step (forward, conv input, backward) with γ and β unchanged in between, so the grid is
        remembered per pair of parameter arrays (by id) and given again while their bytes and
        dtype are the ones it was made from (a bytes comparison, a tenth of the kernel call's
        cost); any change to γ or β (the optimizer's step, a load) makes it anew, so it is always
        quant_params' grid."""
        if self.module is window_gpu:
            return self.bits
        key = (id(gamma), id(beta))
        made = self._grids.get(key)
        g, b = gamma.tobytes(), beta.tobytes()
        if made is not None and made[0] == g and made[1] == b and made[2].dtype == gamma.dtype:
            return made[2]
        qp = self.module.quant_params(gamma, beta, self.bits)
        if len(self._grids) >= self.GRIDS:
            self._grids.clear()
        self._grids[key] = (g, b, qp)
        return qp

    stats = FusedExactUnits.stats

    def forward(self, out, saved, x, mean, rstd, gamma, beta, key=None):
        self.module.unit_forward_code(out, saved, x, mean, rstd, gamma, beta, self.grid(gamma, beta), self.naive,
                                 self.rounding, key)

    def conv_input(self, u, saved, gamma, beta):
        self.module.conv_input(u, None, saved, self.grid(gamma, beta), gamma, beta)

    def backward(self, dx, dgamma, dbeta, dr, saved, rstd, gamma, beta, accumulate, scratch):
        # saved: the K-bit code (approximate x-tilde, exact mask), decoded inline; rstd exact
        self.module.unit_backward(dx, dgamma, dbeta, dr, None, saved, self.grid(gamma, beta), gamma, beta,
                             rstd, accumulate, **self._extra)


class FusedUnbiasedCodeUnits(UnbiasedCodeUnits):
    """The unbiased code on the fused kernels: numba (units/unbiased_cpu.py) or CUDA
    (units/unbiased_gpu.py). The forward (normalise, group ranges, draws, pack, relu) in one
    pass, the conv input's decode in one. The backward: two passes over the codes with x-tilde
    decoded inline and no decode buffer (`scratch` unused): on numba one kernel
    (unbiased_cpu.unit_backward, block by block in L1), on CUDA the per-segment sums, the
    finalize and dx (unbiased_gpu.unit_backward, in the `bn.partials` workspace)."""
    fused = True

    def __init__(self, module, bits, naive=False, partials=None, dither=False):
        super().__init__(bits, naive, dither)
        from . import unbiased_cpu, unbiased_gpu
        self.module, self.partials = module, partials
        self._extra = {} if partials is None else {"partials": partials}
        self.kernels = unbiased_gpu if module is window_gpu else unbiased_cpu

    stats = FusedExactUnits.stats

    def forward(self, out, saved, x, mean, rstd, gamma, beta, key=None):
        self.kernels.unit_forward(out, saved, x, mean, rstd, gamma, beta, self.bits, self.naive, key, self.dither)

    def conv_input(self, u, saved, gamma, beta):
        self.kernels.decode(u, saved, gamma, beta, self.bits, relu=True, dither=self.dither)

    def backward(self, dx, dgamma, dbeta, dr, saved, rstd, gamma, beta, accumulate, scratch):
        # saved: the unbiased code (x-tilde with E = x-hat, exact mask); rstd exact
        self.kernels.unit_backward(dx, dgamma, dbeta, dr, saved, gamma, beta, rstd, self.bits, accumulate,
                                   dither=self.dither, **(self._extra if self.module is window_gpu else {}))

    def decode_masking(self, xtilde, dr, saved, gamma, beta):
        """xtilde <- x-tilde, dr *= the exact mask, in one kernel pass (units/sync.py's backward)."""
        self.kernels.decode(xtilde, saved, gamma, beta, self.bits, dr=dr, dither=self.dither)


def module_for(xp):
    """The fused module for array module xp (units/window_gpu.py for CuPy, units/window_cpu.py for NumPy)."""
    return window_gpu if xp is not numpy else window_cpu


def applies(xp, dtype, sizes):
    """Whether the fused kernels can run every unit: their module supports xp and dtype, and
    every unit's M is a multiple of 8 (whole code bytes at every bit width, so exact and
    approx engines of one shape choose the same kernels and compute the same forward)."""
    return all(module_for(xp).supports(xp, dtype, M, 8) and M % 8 == 0 for M in sizes)
