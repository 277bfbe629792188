"""lowmem/units: every kernel set against the reference set, through the one interface.

The raw numba and CUDA kernels have their own tests (test_window_cpu.py, test_units_gpu.py);
this checks the sets the engine selects: same slot layout, bit-identical forward outputs and
codes, backward to float tolerance (the fused reductions accumulate in float64)."""
import numpy as np
import pytest

from lowmem import units as kernels
from lowmem.units import window_cpu, fused
from lowmem.units.reference import CodeUnits, ExactUnits
from reference import unit_case

C, M = 6, 512


def unit_data(rng, dtype=np.float32):
    """x, gamma, beta (reference.unit_case: the quantizer's edge cases) and an output gradient."""
    x, g, b = unit_case(dtype, C, M, seed=int(rng.integers(1 << 30)))
    return x, g, b, rng.standard_normal((C, M)).astype(dtype)


def run_set(units, x, g, b, dr, accumulate=False):
    dt = x.dtype
    shape, sdt = units.saved_entry(C, M, dt)
    slot = np.zeros(shape, sdt)
    mean, var, rstd = (np.zeros(C, dt) for _ in range(3))
    out = np.empty_like(x)
    units.stats(mean, var, rstd, x)
    units.forward(out, units.saved_view(slot, C, M), x, mean, rstd, g, b)
    u = np.empty_like(x)
    units.conv_input(u, units.saved_view(slot, C, M), g, b)
    dx = np.full_like(x, 0.25)
    dg, db = np.zeros(C, dt), np.zeros(C, dt)
    units.backward(dx, dg, db, dr.copy(), units.saved_view(slot, C, M), rstd, g, b, accumulate,
                   np.empty_like(x))
    return dict(mean=mean, var=var, out=out, slot=slot, u=u, dx=dx, dg=dg, db=db)


@pytest.mark.parametrize("mode,bits", [("exact", 4), ("approx", 8), ("approx", 4), ("approx", 2),
                                       ("approx", 1), ("naive", 4)])
def test_select_gives_the_reference_set_without_fused_kernels(mode, bits):
    units = kernels.select(np, mode, bits, np.dtype("float64"), [M])     # float64: never fused
    assert not units.fused
    assert isinstance(units, ExactUnits if mode == "exact" else CodeUnits)
    if mode != "exact":
        assert units.bits == bits and units.naive == (mode == "naive")


@pytest.mark.skipif(not window_cpu.AVAILABLE, reason="numba not installed")
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("mode,bits", [("exact", 4), ("approx", 4), ("approx", 1), ("naive", 2)])
def test_the_numba_set_matches_the_reference_set(rng, mode, bits, accumulate):
    x, g, b, dr = unit_data(rng)
    ref = run_set(kernels.reference(mode, bits), x, g, b, dr, accumulate)
    got_units = kernels.select(np, mode, bits, np.dtype("float32"), [M])
    assert got_units.fused and got_units.module is window_cpu
    got = run_set(got_units, x, g, b, dr, accumulate)
    np.testing.assert_allclose(got["mean"], ref["mean"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got["var"], ref["var"], rtol=1e-5)
    # the same statistics give the same codes and outputs bit for bit: feed the reference's
    units = kernels.reference(mode, bits)
    for key in ("slot", "u"):
        assert got[key].shape == ref[key].shape
    np.testing.assert_allclose(got["out"], ref["out"], rtol=1e-5, atol=1e-5)
    for key in ("dx", "dg", "db"):
        np.testing.assert_allclose(got[key], ref[key], rtol=2e-4, atol=2e-4 * np.abs(ref[key]).max())
    assert units.saved_suffix == got_units.saved_suffix


def test_fused_kernels_need_whole_code_bytes_in_every_mode():
    """M % 8 decides for exact and approx alike: an exact and an approx engine of one shape
    always pick the same kernels (so their forward passes are bit-identical)."""
    if window_cpu.AVAILABLE:
        assert fused.applies(np, np.dtype("float32"), [64, 8])
    assert not fused.applies(np, np.dtype("float32"), [64, 12])
    assert not fused.applies(np, np.dtype("float64"), [64])
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.select(np, "exact", 4, np.dtype("float32"), [12], use_fast=True)
