"""Kernel sets for a batch norm on its own (no ReLU after it: core/optable/norm.py's BN), chosen
once per engine as the BN-ReLU units' are (units/__init__.py). Every set has

    norms.stats(mean, var, rstd, x)                         batch statistics of x (C, M)
    norms.count(M)                                          the elements per channel they are over
    norms.forward(out, slots, x, mean, rstd, gamma, beta)
        x-hat = (x - mean)*rstd kept in its slots (the engine's keeper: float, or its range code),
        out = gamma*x-hat + beta; out may alias x
    norms.backward(dx, dgamma, dbeta, dy, slots, rstd, gamma, accumulate, scratch)
        dgamma, dbeta +=; dx = (or +=) the input gradient; scratch: a free (C, M) buffer x-hat is
        decoded into when the slots hold a code (None otherwise); dx may alias dy

The sets:
    NormKernels(keeper)          ops/batchnorm.py's array ops (NumPy or CuPy): the reference
    FusedNormKernels(module, keeper)   units/norm_cpu.py (numba) or units/norm_gpu.py (CUDA):
                                 statistics by the units' kernels (window_cpu / gpu_base), x-hat,
                                 its float slot and out in one pass; the backward's sums and dx in two;
                                 and forward_add_relu: a batch norm, an add and a ReLU (a ResNet
                                 block's end) in one pass (core/optable's forward_groups). With the
                                 keeper's numba range code (units/rangecode_cpu.py) the numba passes
                                 make x-hat's code and read it themselves (norm_cpu's *_coded): no
                                 separate normalize, encode, decode or scratch buffer

Both compute the same x-hat and out for the same statistics, bit for bit (so an engine's exact
and approx forwards stay equal); the fused statistics and sums are reductions in another order
(to tolerance).
"""
import numpy

from ..ops import bn_apply_forward, bn_backward, bn_normalize, bn_stats
from ..ops.batchnorm import BN_EPS
from . import gpu_base, norm_cpu, norm_gpu, rangecode_cpu, window_cpu


def _xhat(slots, C, M):
    """The float slot's x-hat for the current batch: its first C*M elements as (C, M) rows."""
    return slots[0][:C * M].reshape(C, M)


class NormKernels:
    """The reference: ops/batchnorm.py's array ops, x-hat kept and restored by the keeper."""
    fused = False

    def __init__(self, keeper):
        self.keeper = keeper

    @staticmethod
    def count(M):
        return M                                         # this batch's (sync.SyncNorms: all ranks')

    def stats(self, mean, var, rstd, x):
        bn_stats(mean, var, rstd, x, BN_EPS)

    def forward(self, out, slots, x, mean, rstd, gamma, beta):
        bn_normalize(out, x, mean, rstd)                 # x-hat through the output (may alias x)
        self.keeper.keep(slots, out.reshape(-1))
        bn_apply_forward(out, out, gamma, beta)

    def backward(self, dx, dgamma, dbeta, dy, slots, rstd, gamma, accumulate, scratch):
        # saved: x-hat, exact (float) or approximate (its range code), and rstd exact
        bn_backward(dx, dgamma, dbeta, dy, self.restore(slots, dy.shape, scratch), gamma, rstd, accumulate)

    def restore(self, slots, shape, scratch):
        """x-hat (C, M) for the backward: the float slot, or decoded from the code into scratch."""
        if scratch is None:
            return _xhat(slots, *shape)
        self.keeper.restore(scratch.reshape(-1), slots)
        return scratch


class FusedNormKernels(NormKernels):
    """units/norm_cpu.py or units/norm_gpu.py: with a float slot (exact mode) x-hat, the slot and out
    in one pass; with a range code x-hat through out, the keeper's code of it, then out in place."""
    fused = True

    def __init__(self, module, keeper, partials=None):
        super().__init__(keeper)
        self.module = module
        self.units = gpu_base if module is norm_gpu else window_cpu
        self._extra = {} if partials is None else {"partials": partials}

    def stats(self, mean, var, rstd, x):
        self.units.bn_stats(mean, var, rstd, x, BN_EPS, **self._extra)

    def _code(self, slots, n, *arrays):
        """x-hat's range code (a rangecode.RangeCode) where the numba kernels make and read it in
        their own passes (the keeper's numba range code, arrays the kernels take), else None."""
        if self.module is norm_cpu and getattr(self.keeper, "kernels", None) is rangecode_cpu and \
                norm_cpu.supports(*arrays) and rangecode_cpu.supports(*arrays):
            return self.keeper.code(slots, n)
        return None

    def forward(self, out, slots, x, mean, rstd, gamma, beta):
        C, M = x.shape
        if not self.keeper.decodes:                      # the float slot: x-hat and out in one pass
            self.module.forward(out, _xhat(slots, C, M), x, mean, rstd, gamma, beta)
            return
        code = self._code(slots, C * M, out, x)
        if code is not None:                             # x-hat, its code and out in one pass
            norm_cpu.forward_coded(out, code, x, mean, rstd, gamma, beta)
            return
        self.module.normalize(out, x, mean, rstd)
        self.keeper.keep(slots, out.reshape(-1))
        self.module.apply(out, gamma, beta)

    def forward_add_relu(self, out, mask, slots, x, other, mean, rstd, gamma, beta, scratch):
        """A post-activation block's end in one pass: x-hat kept in its slots, out =
        relu(gamma*x-hat + beta + other), mask (ceil(C*M/8),) <- [gamma*x-hat + beta + other > 0]
        packed 1 bit each (ops/relu.py's code), as the batch norm, the add and the ReLU would leave
        them, bit for bit. scratch: the batch norm's own (C, M) output buffer, which no one reads:
        with a range code x-hat passes through it to be coded, then the pass reads it back. out
        may alias x, other or scratch."""
        C, M = x.shape
        if not self.keeper.decodes:
            self.module.forward_add_relu(out, mask, _xhat(slots, C, M), x, other, mean, rstd, gamma, beta)
            return
        code = self._code(slots, C * M, out, x, other)
        if code is not None:                             # x-hat coded in the same pass
            norm_cpu.forward_add_relu_coded(out, mask, code, x, other, mean, rstd, gamma, beta)
            return
        self.module.normalize(scratch, x, mean, rstd)
        self.keeper.keep(slots, scratch.reshape(-1))
        self.module.forward_add_relu(out, mask, None, scratch, other, mean, rstd, gamma, beta)

    def backward(self, dx, dgamma, dbeta, dy, slots, rstd, gamma, accumulate, scratch):
        # saved: x-hat, exact (float) or approximate (its range code), and rstd exact
        code = self._code(slots, dy.size, dx, dy)
        if code is not None:                             # decoded block by block in the kernel
            norm_cpu.backward_coded(dx, dgamma, dbeta, dy, code, gamma, rstd, accumulate)
            return
        self.module.backward(dx, dgamma, dbeta, dy, self.restore(slots, dy.shape, scratch), gamma, rstd,
                             accumulate, **self._extra)


def select_norms(xp, fused, keeper, partials=None):
    """The set for an engine: fused (numba on NumPy, CUDA on CuPy) when `fused` (the engine's
    choice for its units), else the reference."""
    if not fused:
        return NormKernels(keeper)
    if xp is numpy:
        return FusedNormKernels(norm_cpu, keeper) if norm_cpu.AVAILABLE else NormKernels(keeper)
    return FusedNormKernels(norm_gpu, keeper, partials)
