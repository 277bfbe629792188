"""Kernel sets for the BN->ReLU units, chosen once per engine.

The folder is a grid: each code a unit may keep, in each backend, and what the codes share.

    code                        reference (array ops)   numba (CPU)       CUDA (CuPy)
    window (the paper's)        window.py               window_cpu.py     window_gpu.py
    unbiased (group ranges)     unbiased.py             unbiased_cpu.py   unbiased_gpu.py
    range (conv inputs)         rangecode.py            rangecode_cpu.py  rangecode_gpu.py
    what the codes share        packing.py, stream.py   cpu_base.py       gpu_base.py
    kernel sets                 reference.py            fused.py (numba or CUDA)
    any set over ranks          sync.py
    a batch norm with no ReLU   norm.py                 norm_cpu.py       norm_gpu.py

widths.py holds the vocabulary (bit widths, "float", modes, roundings) and the one rule for
which code a unit keeps (code_for(rounding, K)); this module chooses the kernel set from it.

A unit kernel set does everything mode-, bit- and backend-specific about a
BN->ReLU unit; the engine calls it and never asks which one it has:

    units.saved_entry(C, M, dtype) -> (shape, dtype)   the unit's saved slot in the plan
    units.saved_view(slot, C, M)                       that slot for the current batch
    units.count(M)                                     elements the statistics are over
    units.depends_on_split(M)                          whether a rank's rows of M code differently
                                                       than the whole batch there (unbiased: not
                                                       whole groups)
    units.stats(mean, var, rstd, x)                    batch statistics of x (C, M)
    units.forward(out, saved, x, mean, rstd, gamma, beta)
        saved <- x-hat (exact) or its K-bit code; out = relu(gamma*x-hat + beta)
        (naive: relu(gamma*x-tilde + beta)); out may alias x
    units.conv_input(u, saved, gamma, beta)            u = the following conv's input, rebuilt
    units.backward(dx, dgamma, dbeta, dr, saved, rstd, gamma, beta, accumulate, scratch)
        dgamma, dbeta += ; dx = (or +=) the input gradient; scratch: a free (C, M)
        buffer the set may decode x-tilde into

The sets:
    units/reference.py  ExactUnits, CodeUnits(bits, naive, rounding), UnbiasedCodeUnits(bits, naive)
                        array ops (NumPy or CuPy)
    units/fused.py      the same over the numba or the CUDA files of the grid
    units/sync.py       SyncUnits(set, comm): any set with batch statistics over all ranks;
                        SyncNorms(norms, comm): the same for the batch norms with no ReLU after them
    units/norm.py       the same for a batch norm with no ReLU after it (select_norms)

`select` picks one; `reference` is the array-op twin of any set, used by the
engine for a batch the fused kernels cannot take (a unit whose N*H*W is not
a multiple of 8), in every mode alike. `slot_nbytes` is a slot's size as the sets plan it.
"""
import math

import numpy

from . import fused, gpu_base, rangecode, rangecode_cpu, rangecode_gpu, unbiased, window
from .widths import FLOAT, FLOAT_CODE, check_bits, code_for
from .reference import CodeUnits, ExactUnits, UnbiasedCodeUnits
from .sync import SyncNorms, SyncUnits
from .norm import select_norms


def keeper(xp, bits, use_fast=None):
    """How a layer keeps an input no unit rebuilds (a conv's, a linear layer's, a BN's x-hat
    alone): float for bits None (exact mode), else the K-bit range code (units/rangecode.py) on
    the one-pass kernels (rangecode_cpu.py with numba, rangecode_gpu.py on CuPy) unless
    use_fast is False or numba is missing; the codes are the same bytes either way."""
    fast = None
    if use_fast is not False:
        fast = rangecode_gpu if xp is not numpy else (rangecode_cpu if rangecode_cpu.AVAILABLE else None)
    return rangecode.keeper(bits, fast)


def reference(mode, bits, rounding="nearest"):
    """The array-op set for a mode, bit width and rounding: the set of the code a unit keeps
    (widths.code_for: "stochastic" the unbiased code, "nearest" and "stochastic-window" the
    window code); x-hat in float in exact mode."""
    code = FLOAT_CODE if mode == "exact" else code_for(rounding, bits)
    if code.name == FLOAT:
        return ExactUnits()
    if code.unbiased:
        return UnbiasedCodeUnits(code.bits, naive=(mode == "naive"), dither=code.dither)
    return CodeUnits(code.bits, naive=(mode == "naive"), rounding=code.rounding)


def slot_nbytes(bits, rounding, C, M, dtype):
    """Bytes of one unit's saved slot for C channels of M elements at width `bits` (K, or None /
    FLOAT: x-hat in float, in dtype) under `rounding`: what its kernel set plans (saved_entry),
    the code's metadata included. Every set of a code plans the same slot."""
    shape, dt = reference("approx", bits, rounding).saved_entry(int(C), int(M), numpy.dtype(dtype))
    return math.prod(shape) * numpy.dtype(dt).itemsize


def fused_applies(xp, dtype, sizes):
    """Whether the fused kernels can run units of these M = N*H*W sizes on xp in dtype (every
    rounding has fused kernels: the window codes' in units/window_cpu.py, window_gpu.py, the unbiased code's
    in units/unbiased_cpu.py, unbiased_gpu.py)."""
    return fused.applies(xp, dtype, sizes)


def synchronized(units, comm, buf):
    """`units` with batch norm over the global batch of all of comm's ranks (units/sync.py)."""
    return SyncUnits(units, comm, buf)


def synchronized_norms(norms, comm, buf):
    """A norm kernel set (units/norm.py) with statistics over the global batch (units/sync.py)."""
    return SyncNorms(norms, comm, buf)


def select(xp, mode, bits, dtype, sizes, use_fast=None, partials=None, rounding="nearest"):
    """The kernel set for an engine: fused when use_fast (None: whenever they apply), else reference.

    sizes: every unit's M at the planned batch. partials: the plan's `bn.partials` workspace
    (the CUDA set's reductions; None on the CPU, or when only planning)."""
    ok = fused.applies(xp, dtype, sizes)
    if use_fast is None:
        use_fast = ok
    if use_fast and not ok:
        raise ValueError("use_fast=True needs numba (pip install lowmem[fast]) and float32 on the "
                         "NumPy backend, or the CuPy backend, and N*H*W a multiple of 8 in every unit")
    if not use_fast:
        return reference(mode, bits, rounding)
    module = fused.module_for(xp)
    code = FLOAT_CODE if mode == "exact" else code_for(rounding, bits)
    if code.name == FLOAT:
        return fused.FusedExactUnits(module, partials)
    if code.unbiased:
        return fused.FusedUnbiasedCodeUnits(module, code.bits, naive=(mode == "naive"), partials=partials,
                                            dither=code.dither)
    return fused.FusedCodeUnits(module, code.bits, naive=(mode == "naive"), partials=partials, rounding=code.rounding)


def select_units(xp, mode, unit_bits, dtype, sizes, use_fast=None, partials=None, rounding="nearest"):
    """{unit name: kernel set}, each unit's own: `mode` at the unit's bit width, or the exact
    set for a unit whose width is None (x-hat saved in float). unit_bits: {unit: K or None}.

    Fused or reference is decided for all units together (from every unit's size, never from
    the bits), so engines that differ only in bits run the same forward kernels. Units with
    the same width share one set object."""
    made = {}
    for K in set(unit_bits.values()):
        made[K] = select(xp, mode if K is not None else "exact", K, dtype, sizes, use_fast, partials, rounding)
    return {name: made[K] for name, K in unit_bits.items()}


def reference_units(mode, unit_bits, rounding="nearest"):
    """{unit name: the array-op set} for the same widths as `select_units`."""
    made = {K: reference(mode if K is not None else "exact", K, rounding) for K in set(unit_bits.values())}
    return {name: made[K] for name, K in unit_bits.items()}


def partials_size(xp, max_channels, use_fused):
    """float64 elements of `bn.partials` the CUDA set needs (0 elsewhere)."""
    if use_fused and xp is not numpy:
        return gpu_base.partials_size(max_channels)
    return 0


def quantize_simulated(xhat, gamma, beta, bits, rounding="nearest", key=None):
    """(x̃, mask), both (C, M), of the code a unit of width `bits` keeps under `rounding`
    (widths.code_for), on the reference path: window.quantize_simulated or
    unbiased.quantize_simulated."""
    code = code_for(rounding, bits)
    if code.name == FLOAT:
        check_bits(bits)                          # a code width, not "float": its ValueError
    if code.unbiased:
        return unbiased.quantize_simulated(xhat, gamma, beta, code.bits, key,
                                           draws="dither" if code.dither else None)
    return window.quantize_simulated(xhat, gamma, beta, code.bits, code.rounding, key)


__all__ = ["keeper", "reference", "select", "select_units", "reference_units", "synchronized", "fused_applies",
           "partials_size", "slot_nbytes", "quantize_simulated", "select_norms", "synchronized_norms"]
