"""The CUDA kernels against the NumPy reference ops and quantizer: the unit kernels
(lowmem/units/window_gpu.py, unbiased_gpu.py, gpu_base.py), the conv columns (lowmem/ops/columns_gpu.py) and the SGD update
(lowmem/train/optim_gpu.py), all built through lowmem/system/cuda.py.

Three levels, each skipped where its tool is missing:

* compile: every program's CUDA sources (lowmem.system.cuda.PROGRAMS) are compiled with `nvcc`
  for sm_80 and sm_90 (--Werror all-warnings); with --fmad=false the PTX has
  no FMA at all, and the float32 module has no float32 FMA even without the
  flag (the kernels' round-to-nearest intrinsics alone keep NumPy's rounding).
* device "emu": the same CUDA text compiled for the CPU with g++ against a
  small emulation header (tests/cuda_emulation.py, the `emulator` and `dev` fixtures of conftest.py: (threadIdx/blockIdx, CUDA threads as coroutines that
  switch at __syncthreads, the _rn intrinsics as plain IEEE operations, no
  contraction)) and launched through the modules' own Python launchers with NumPy
  arrays. Each launch checks every argument against the kernel's C signature
  (array dtype per pointer, int32/int64/real per scalar): CuPy's RawKernel
  checks none. The engine's CuPy path also runs end to end on these kernels.
* device "gpu": CuPy and a GPU; the same kernel tests, then whole-engine tests
  (float64 against the NumPy engine, float32 approx-vs-exact forward, the
  memory pool's peak against the plan).

The kernel tests compare with window.quantize_pack / unpack_decode /
decode_relu and ops.bn_relu_backward / conv.im2col / conv.col2im_add /
optim.SGD run by NumPy on the same inputs (the same mean and rstd): packed
codes, forward outputs, conv inputs, im2col/col2im and SGD updates must be
bit-identical; reductions (BN statistics, dgamma/dbeta, dx) to tolerance.
"""
import copy
import os
import re
import shutil
import subprocess
import types

import numpy as np
import pytest

import lowmem
from lowmem.system import cuda as cuda_helper
from lowmem.train import optim, optim_gpu
from lowmem.units import packing, stream, widths, window
from lowmem.units import window_gpu as cuda
from lowmem.units import gpu_base, rangecode, rangecode_gpu, unbiased_gpu, unbiased
from lowmem.units.stream import Stream
from lowmem.core.network import Parameter
from lowmem.ops import bn_relu_apply_forward, bn_relu_backward
from lowmem.ops import columns_gpu, conv_groups, depthwise_gpu, dropout_gpu, pool_gpu, relu_gpu
from lowmem.units import norm_gpu
from lowmem.ops import batchnorm as bn_ops
from lowmem.ops import conv as conv_ops
from lowmem.train.optim import SGD
from cuda_emulation import emulate, gpu, kernel_signatures
from reference import beyond_window_channels, bn_normalize_forward, random_graph, unit_case

DTYPES = ["float32", "float64"]
EPS = 1e-5


# ---------------------------------------------------------------- compile (nvcc)

NVCC = shutil.which("nvcc")


PROGRAMS = cuda_helper.PROGRAMS       # every program, now that the modules are imported


def test_every_program_is_registered():
    assert set(PROGRAMS) == {"bn", "units", "columns", "sgd", "unbiased", "depthwise", "norm", "rangecode", "relu",
                             "dropout", "pool"}
    assert (PROGRAMS["bn"] is gpu_base.PROGRAM and PROGRAMS["units"] is cuda.PROGRAM
            and PROGRAMS["columns"] is columns_gpu.PROGRAM
            and PROGRAMS["sgd"] is optim_gpu.PROGRAM and PROGRAMS["unbiased"] is unbiased_gpu.PROGRAM
            and PROGRAMS["depthwise"] is depthwise_gpu.PROGRAM and PROGRAMS["norm"] is norm_gpu.PROGRAM
            and PROGRAMS["rangecode"] is rangecode_gpu.PROGRAM and PROGRAMS["relu"] is relu_gpu.PROGRAM
            and PROGRAMS["dropout"] is dropout_gpu.PROGRAM and PROGRAMS["pool"] is pool_gpu.PROGRAM)


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_sources_compile_with_nvcc(tmp_path, arch, dtype, program):
    program = PROGRAMS[program]
    src = tmp_path / f"lowmem_{program.name}_{dtype}.cu"
    src.write_text(program.sources()[dtype])

    def nvcc(*args):
        r = subprocess.run([NVCC, f"-arch={arch}", "--Werror", "all-warnings", *args, str(src)],
                           capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    nvcc("-c", *cuda_helper.OPTIONS, "-o", str(tmp_path / "k.o"))
    nvcc("--ptx", *cuda_helper.OPTIONS, "-o", str(tmp_path / "k.ptx"))
    ptx = (tmp_path / "k.ptx").read_text()
    entries = set(re.findall(r"\.visible \.entry (\w+)\(", ptx))
    assert entries == set(kernel_signatures(program)), entries
    assert "fma" not in ptx
    nvcc("--ptx", "-o", str(tmp_path / "default.ptx"))            # nvcc's default -fmad=true
    assert "fma.rn.f32" not in (tmp_path / "default.ptx").read_text()


# ------------------------------------------------------------------ data

unit = unit_case          # (dtype, C=7, M=1024, seed=0) -> x, gamma, beta: tests/reference.py


def host_stats(x):
    C = x.shape[0]
    mean, var, rstd = (np.empty(C, x.dtype) for _ in range(3))
    xhat = np.empty_like(x)
    bn_normalize_forward(xhat, mean, var, rstd, x, EPS)
    return xhat, mean, var, rstd


# ---------------------------------------------------------------- kernels

@pytest.mark.parametrize("dtype,offset", [("float32", 0), ("float64", 0), ("float64", 1000)])
def test_bn_stats_match_numpy(dev, dtype, offset):
    x, _, _ = unit(dtype, C=5, M=3000)          # M not a multiple of the block: ragged segments
    x += offset                                 # a large mean: the shifted sums must not cancel
    _, mean, var, rstd = host_stats(x)
    out = [dev.put(np.zeros(5, dtype)) for _ in range(3)]
    cuda.bn_stats(*out, dev.put(x), EPS)
    tol = 1e-6 if dtype == "float32" else 1e-11
    for got, want in zip(out, (mean, var, rstd)):
        np.testing.assert_allclose(dev.get(got), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_exact_is_bit_identical(dev, dtype):
    x, g, b = unit(dtype)
    xhat_ref, mean, _, rstd = host_stats(x)
    ref = np.empty_like(x)
    bn_relu_apply_forward(ref, xhat_ref, g, b)
    C, M = x.shape
    slot = dev.put(np.zeros((C, M + 40), dtype))          # rows farther apart: a smaller batch
    xd = dev.put(x)
    cuda.unit_forward_exact(xd, slot[:, :M], xd, *map(dev.put, (mean, rstd, g, b)))   # in place
    assert np.array_equal(dev.get(slot)[:, :M], xhat_ref)
    assert np.array_equal(dev.get(xd), ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", widths.BITS)
@pytest.mark.parametrize("naive", [False, True])
def test_forward_code_packs_bit_identical_codes(dev, dtype, bits, naive):
    x, g, b = unit(dtype, seed=bits)
    xhat, mean, _, rstd = host_stats(x)
    qp = window.quant_params(g, b, bits)
    ref = np.empty(packing.packed_nbytes(x.size, bits), np.uint8)
    window.quantize_pack(ref, xhat, qp)
    ref_out = np.empty_like(x)
    if naive:
        window.decode_relu(ref_out, ref, qp, g, b)
    else:
        bn_relu_apply_forward(ref_out, xhat, g, b)
    packed, xd = dev.put(np.zeros_like(ref)), dev.put(x)
    cuda.unit_forward_code(xd, packed, xd, *map(dev.put, (mean, rstd, g, b)), bits, naive)
    assert np.array_equal(dev.get(packed), ref)
    assert np.array_equal(dev.get(xd), ref_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", widths.BITS)
@pytest.mark.parametrize("naive", [False, True])
def test_stochastic_forward_code_packs_numpys_codes(dev, dtype, bits, naive):
    """rounding="stochastic-window": the CUDA codes (uint64 stream in-kernel) equal window.quantize_pack's
    for the same key bit for bit, and naive's decoded output; the same key gives the same codes,
    another key other ones; the mask stays exact."""
    x, g, b = unit(dtype, seed=40 + bits)
    xhat, mean, _, rstd = host_stats(x)
    qp = window.quant_params(g, b, bits)
    key = stream.stream_key(1, 2, 3)
    ref = np.empty(packing.packed_nbytes(x.size, bits), np.uint8)
    window.quantize_pack(ref, xhat, qp, "stochastic-window", key)
    ref_out = np.empty_like(x)
    if naive:
        window.decode_relu(ref_out, ref, qp, g, b)
    else:
        bn_relu_apply_forward(ref_out, xhat, g, b)
    args = [dev.put(a) for a in (mean, rstd, g, b)]
    packed, xd = dev.put(np.zeros_like(ref)), dev.put(x)
    cuda.unit_forward_code(xd, packed, xd, *args, bits, naive, "stochastic-window", key)
    assert np.array_equal(dev.get(packed), ref)
    assert np.array_equal(dev.get(xd), ref_out)
    xt, mask = np.empty_like(x), np.empty(x.shape, bool)
    window.unpack_decode(xt, ref, qp, mask_out=mask)
    assert np.array_equal(mask, (xhat * g[:, None]) + b[:, None] > 0)
    again, other = dev.put(np.zeros_like(ref)), dev.put(np.zeros_like(ref))
    cuda.unit_forward_code(dev.put(np.empty_like(x)), again, dev.put(x), *args, bits, naive, "stochastic-window", key)
    cuda.unit_forward_code(dev.put(np.empty_like(x)), other, dev.put(x), *args, bits, naive, "stochastic-window",
                           key ^ 1)
    assert np.array_equal(dev.get(again), ref) and not np.array_equal(dev.get(other), ref)
    with pytest.raises(ValueError, match="needs a key"):
        cuda.unit_forward_code(xd, packed, xd, *args, bits, naive, "stochastic-window")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", widths.BITS)
def test_conv_input_is_bit_identical(dev, dtype, bits):
    x, g, b = unit(dtype, seed=10 + bits)
    xhat, mean, _, rstd = host_stats(x)
    qp = window.quant_params(g, b, bits)
    packed = np.empty(packing.packed_nbytes(x.size, bits), np.uint8)
    window.quantize_pack(packed, xhat, qp)
    ref = np.empty_like(x)
    window.decode_relu(ref, packed, qp, g, b)
    u, gd, bd = dev.put(np.zeros_like(x)), dev.put(g), dev.put(b)
    cuda.conv_input(u, None, dev.put(packed), qp, gd, bd)          # a QuantParams is accepted too
    assert np.array_equal(dev.get(u), ref)
    assert not np.signbit(ref).any()            # >= 0, and +0 rather than -0
    # the data reach the beyond-the-window case: open elements whose bin midpoint gives
    # gamma*x-tilde + beta < 0 (gamma > 0 and < 0), rebuilt as 0
    xs, ms = window.quantize_simulated(xhat, g, b, bits)
    for c in beyond_window_channels(x.shape[0]):
        assert (ms[c] & (xs[c] * g[c] + b[c] < 0)).any(), c
    bn_relu_apply_forward(ref, xhat, g, b)
    C, M = x.shape
    slot = np.zeros((C, M + 8), dtype)
    slot[:, :M] = xhat
    cuda.conv_input(u, dev.put(slot)[:, :M], None, None, gd, bd)
    assert np.array_equal(dev.get(u), ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [None, 8, 4, 2, 1])
@pytest.mark.parametrize("accumulate", [False, True])
def test_backward_matches_numpy(dev, dtype, bits, accumulate):
    x, g, b = unit(dtype, seed=20)
    rng = np.random.default_rng(1)
    xhat, mean, _, rstd = host_stats(x)
    dr = rng.standard_normal(x.shape).astype(dtype)
    base = rng.standard_normal(x.shape).astype(dtype)
    C, M = x.shape
    if bits is None:
        packed, xt, mask = None, xhat, None
    else:
        packed = np.empty(packing.packed_nbytes(x.size, bits), np.uint8)
        window.quantize_pack(packed, xhat, window.quant_params(g, b, bits))
        xt, mask = np.empty_like(x), np.empty(x.shape, bool)
        window.unpack_decode(xt, packed, window.quant_params(g, b, bits), mask_out=mask)
    rdx, rdg, rdb = base.copy(), np.full(C, 0.5, dtype), np.full(C, -0.25, dtype)
    bn_relu_backward(rdx, rdg, rdb, dr.copy(), xt, g, b, rstd, relu_mask=mask, accumulate=accumulate)
    dgd, dbd = dev.put(np.full(C, 0.5, dtype)), dev.put(np.full(C, -0.25, dtype))
    drd = dev.put(dr)
    dxd = dev.put(base) if accumulate else drd                       # in place, as the engine does
    slot = None
    if bits is None:
        slot = np.zeros((C, M + 24), dtype)
        slot[:, :M] = xhat
        slot = dev.put(slot)[:, :M]
    cuda.unit_backward(dxd, dgd, dbd, drd, slot, None if packed is None else dev.put(packed), bits,
                       *map(dev.put, (g, b, rstd)), accumulate)
    tol = 1e-4 if dtype == "float32" else 1e-10
    np.testing.assert_allclose(dev.get(dgd), rdg, rtol=tol, atol=tol * 10)
    np.testing.assert_allclose(dev.get(dbd), rdb, rtol=tol, atol=tol * 10)
    np.testing.assert_allclose(dev.get(dxd), rdx, rtol=tol, atol=tol * np.abs(rdx).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("momentum,nesterov,wd", [(0.9, False, 5e-4), (0.9, True, 1e-2),
                                                   (0.0, False, 1e-2), (0.5, False, 0.0)])
def test_sgd_update_is_bit_identical_to_optim_sgd(dev, monkeypatch, dtype, momentum, nesterov, wd):
    """SGD.step on device arrays takes optim_gpu's kernel (forced for the emulator's NumPy arrays
    by making optim see another array module): weights, gradients and momenta bit-identical."""
    rng = np.random.default_rng(3)
    names = [("conv1.weight", True), ("layer1.0.bn1.weight", False), ("fc.weight", True), ("fc.bias", False)]
    shapes = [(4, 3, 3, 3), (4,), (10, 4), (10,)]
    host = [Parameter(n, rng.standard_normal(s).astype(dtype), np.zeros(s, dtype), decay=d)
            for (n, d), s in zip(names, shapes)]
    devp = [Parameter(p.name, dev.put(p.data), dev.put(p.grad), decay=p.decay) for p in host]
    for p in devp:
        p.state["momentum"] = dev.put(np.zeros(p.data.shape, dtype))
    opts = [SGD(ps, lr=0.1, momentum=momentum, weight_decay=wd, nesterov=nesterov) for ps in (host, devp)]
    calls = []
    real_step = optim_gpu.sgd_step
    monkeypatch.setattr(optim_gpu, "sgd_step", lambda opt: (calls.append(opt), real_step(opt)))
    for step in range(3):
        for ph, pd in zip(host, devp):
            ph.grad[...] = rng.standard_normal(ph.grad.shape)
            pd.grad[...] = dev.put(ph.grad)
        opts[0].step()
        with monkeypatch.context() as m:
            m.setattr(optim, "array_module", lambda a: dev.xp if dev.name == "gpu" else NumpyAsCupy("cupy"))
            opts[1].step()
        assert calls == [opts[1]] * (step + 1)
        opts[0].lr = opts[1].lr = 0.1 / (step + 2)
        for ph, pd in zip(host, devp):
            for a, b_ in ((ph.data, pd.data), (ph.grad, pd.grad),
                          (ph.state["momentum"], pd.state["momentum"])):
                assert np.array_equal(dev.get(b_), a), (ph.name, step)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,stride,pad", [(3, 1, 1), (3, 2, 1), (7, 2, 3), (1, 2, 0), (2, 3, 0)])
def test_im2col_and_col2im_are_bit_identical(dev, dtype, k, stride, pad):
    rng = np.random.default_rng(k * 10 + stride)
    Cin, N, H, W = 3, 5, 11, 9
    Ho, Wo = conv_ops.conv_out_size(H, k, stride, pad), conv_ops.conv_out_size(W, k, stride, pad)
    batch = rng.standard_normal((N, Cin, H, W)).astype(dtype)        # caller's NCHW batch
    x = batch.transpose(1, 0, 2, 3)[:, 1:4]                           # strided (Cin, 3, H, W) view
    ref = np.full((Cin, k, k, 3, Ho, Wo), np.nan, dtype)
    conv_ops.im2col(ref, x, k, k, stride, pad)
    cols = dev.put(np.full_like(ref, np.nan))
    columns_gpu.im2col(cols, dev.put(batch).transpose(1, 0, 2, 3)[:, 1:4], k, k, stride, pad)
    assert np.array_equal(dev.get(cols), ref)
    grads = rng.standard_normal(ref.shape).astype(dtype)
    dx = rng.standard_normal((Cin, N, H, W)).astype(dtype)
    dxd = dev.put(dx)
    conv_ops.col2im_add(dx[:, 1:4], grads, k, k, stride, pad)
    columns_gpu.col2im_add(dxd[:, 1:4], dev.put(grads), k, k, stride, pad)
    assert np.array_equal(dev.get(dxd), dx)


def test_bad_arguments_are_rejected(dev):
    x, g, b = unit("float32")
    xd = dev.put(x)
    small = dev.put(np.zeros(7, np.uint8))
    with pytest.raises(ValueError, match="packed"):
        cuda.unit_forward_code(xd, small, xd, *map(dev.put, (g, g, g, b)), 4, False)
    with pytest.raises(ValueError, match="bits"):
        cuda.conv_input(xd, None, small, 3, dev.put(g), dev.put(b))
    with pytest.raises(ValueError, match="whole bytes"):
        cuda.conv_input(dev.put(x[:, :5]), None, small, 2, dev.put(g), dev.put(b))
    with pytest.raises(ValueError, match="C-contiguous"):
        cuda.bn_stats(*(dev.put(np.zeros(7, np.float32)) for _ in range(3)), xd[:, ::2], EPS)
    with pytest.raises(ValueError, match="partials"):
        cuda.bn_stats(*(dev.put(np.zeros(7, np.float32)) for _ in range(3)), xd, EPS,
                      dev.put(np.zeros(10)))
    gd, bd, one = dev.put(g), dev.put(b), dev.put(np.ones(7, np.float32))
    with pytest.raises(ValueError, match="dx must have shape"):
        cuda.unit_backward(dev.put(x[:, :8].copy()), one, one, xd, xd, None, None, gd, bd, one, False)
    slot = dev.put(np.zeros(unbiased.slot_nbytes(*x.shape, 2), np.uint8))
    with pytest.raises(ValueError, match="dx must have shape"):
        unbiased_gpu.unit_backward(dev.put(x[:, :8].copy()), one, one, xd, slot, gd, bd, one, 2, False)


def test_supports():
    FakeCupy = types.SimpleNamespace(__name__="cupy")
    assert cuda.supports(FakeCupy, "float32", 1024, 4) and cuda.supports(FakeCupy, "float64", 3, 8)
    assert not cuda.supports(FakeCupy, "float32", 3, 4)        # 12 bits: rows not byte-aligned
    assert not cuda.supports(np, "float32", 1024, 4)           # NumPy arrays take units/window_cpu.py / the ops


# ------------------------------------------------------- the engine on the GPU

@pytest.fixture
def gpu_backend():
    """CuPy as lowmem's backend for one test (the ops pick their array module from it)."""
    cupy = gpu()
    lowmem.set_backend("cupy")
    try:
        yield cupy
    finally:
        lowmem.set_backend("numpy")


def small_nets():
    from lowmem.core.network import Network
    net = Network("tiny-imagenet-style", in_channels=3, num_classes=5)
    net.conv("conv1", "input", "act0", 3, 8, k=7, stride=2, pad=3)
    net.bnrelu("bn1", "act0", "act0", 8)
    net.maxpool("maxpool", "act0", "res")
    net.bnrelu("layer1.0.bn1", "res", "act0", 8)
    net.conv("layer1.0.shortcut", "act0", "res", 8, 16, k=1, stride=2, pad=0)
    net.conv("layer1.0.conv1", "act0", "act1", 8, 16, k=3, stride=2)
    net.bnrelu("layer1.0.bn2", "act1", "act1", 16)
    net.conv("layer1.0.conv2", "act1", "act0", 16, 16, k=3)
    net.add("layer1.0.add", "act0")
    net.bnrelu("bn_final", "res", "act0", 16)
    net.head("act0", 16)
    return {"cifar11-bottleneck": (lowmem.models.preact_resnet_cifar(11), (3, 16, 16)),
            "tiny-imagenet-style": (net, (3, 16, 16))}


def randomized(net, seed=0):
    """A copy with non-trivial gamma (some negative), beta and running statistics."""
    net = copy.deepcopy(net)
    rng = np.random.default_rng(seed)
    for p in net.parameters():
        if ".bn" in "." + p.name:
            if p.name.endswith(".weight"):
                p.data[...] = rng.choice([-1.0, 1.0], p.shape, p=[0.2, 0.8]) * rng.uniform(0.5, 1.5, p.shape)
            else:
                p.data[...] = rng.normal(0, 0.3, p.shape)
    return net


def run(net, shape, x, y, xp, dtype, steps=0, **kw):
    """(loss, logits, input grad, {param: grad}, {param: value after `steps` SGD steps}) as NumPy."""
    eng = lowmem.Engine(copy.deepcopy(net), batch_size=kw.pop("N", len(x)), input_shape=shape,
                        dtype=dtype, **kw)
    get = lowmem.system.backend.to_numpy
    xd, yd = xp.asarray(x.astype(dtype)), xp.asarray(y)
    loss, logits = eng.forward(xd, yd)
    dx = eng.backward(input_grad=True)
    grads = {p.name: get(p.grad).copy() for p in eng.net.parameters()}
    opt = lowmem.SGD(eng.net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    for _ in range(steps):
        eng.train_step(xd, yd, opt)
    params = {p.name: get(p.data).copy() for p in eng.net.parameters()}
    return loss, get(logits), get(dx), grads, params, eng


def rel(a, b):
    return np.linalg.norm(np.ravel(a) - np.ravel(b)) / max(np.linalg.norm(np.ravel(b)), 1e-30)


class NumpyAsCupy(types.ModuleType):
    """NumPy under another name: an Engine built while this is backend.xp takes its CuPy path
    (kernels/fused.py's CUDA set with its bn.partials workspace) on NumPy arrays, i.e. on the
    emulated kernels, the conv's CUDA columns included. (SGD picks its fused update by the
    arrays' own module: NumPy here; the fused sgd_update is checked on its own above.)"""

    def __getattr__(self, name):
        return getattr(np, name)


def compare(got, ref, tol):
    assert abs(got[0] - ref[0]) <= tol * abs(ref[0])
    assert rel(got[1], ref[1]) < tol and rel(got[2], ref[2]) < 10 * tol
    for name in ref[3]:
        assert rel(got[3][name], ref[3][name]) < 100 * tol, name
        assert rel(got[4][name], ref[4][name]) < 100 * tol, name


@pytest.mark.parametrize("mode,n", [("exact", 4), ("approx", 8), ("naive", 4)])
def test_engine_gpu_path_on_emulated_kernels(emulator, monkeypatch, mode, n):
    """The engine's CuPy wiring run on the CPU, float64: a batch of n in an engine planned for 8
    (n = 4: the saved x-hat rows are strided) equals the NumPy engine's loss, gradients and
    two SGD steps; float32 approx's forward equals exact's bit for bit."""
    emulate(monkeypatch, emulator)
    net, shape = randomized(lowmem.models.preact_resnet_cifar(11), 2), (3, 8, 8)   # bottlenecks, small
    rng = np.random.default_rng(8)
    x, y = rng.standard_normal((n,) + shape), rng.integers(0, net.num_classes, n)
    ref = run(net, shape, x, y, np, "float64", mode=mode, bits=2, N=8, steps=2)
    monkeypatch.setattr(lowmem.system.backend, "xp", NumpyAsCupy("cupy"))
    got = run(net, shape, x, y, np, "float64", mode=mode, bits=2, N=8, steps=2)
    eng = got[5]
    assert eng.use_fast and eng.units and eng.run.columns is conv_ops.CUDA
    assert all(u.module is cuda and u.partials is eng.arrays["bn.partials"] for u in eng.units.values())
    compare(got, ref, 1e-10)
    if mode == "approx":
        e32 = run(net, shape, x, y, np, "float32", mode="exact", N=8)
        a32 = run(net, shape, x, y, np, "float32", mode="approx", N=8)
        assert e32[0] == a32[0] and np.array_equal(e32[1], a32[1])
    cuda_helper.reset()


@pytest.mark.parametrize("rounding", ["stochastic", "dither"])
@pytest.mark.parametrize("mode,n", [("approx", 8), ("naive", 4)])
def test_engine_gpu_path_runs_the_unbiased_code_on_emulated_kernels(emulator, monkeypatch, mode, n, rounding):
    """rounding="stochastic" and "dither" on the CuPy wiring (units/unbiased_gpu.py, emulated),
    float64: the NumPy engine's loss, gradients and two SGD steps (the same draws: they follow
    the element's index, not the kernels)."""
    emulate(monkeypatch, emulator)
    net, shape = randomized(lowmem.models.preact_resnet_cifar(11), 2), (3, 8, 8)
    rng = np.random.default_rng(9)
    x, y = rng.standard_normal((n,) + shape), rng.integers(0, net.num_classes, n)
    kw = dict(mode=mode, bits=2, N=8, steps=2, rounding=rounding, seed=3)
    ref = run(net, shape, x, y, np, "float64", **kw)
    monkeypatch.setattr(lowmem.system.backend, "xp", NumpyAsCupy("cupy"))
    got = run(net, shape, x, y, np, "float64", **kw)
    eng = got[5]
    assert eng.use_fast and all(u.kernels is unbiased_gpu for u in eng.units.values())
    compare(got, ref, 1e-10)
    cuda_helper.reset()


@pytest.mark.parametrize("which", ["cifar11-bottleneck", "tiny-imagenet-style"])
@pytest.mark.parametrize("mode", ["exact", "approx", "naive"])
@pytest.mark.parametrize("use_fast", [True, False])
def test_engine_on_gpu_matches_numpy_float64(gpu_backend, which, mode, use_fast):
    """float64: the GPU engine (fused kernels, or the array ops on CuPy with a workspace small
    enough to chunk every conv) gives the NumPy engine's loss, gradients and SGD steps."""
    net, shape = small_nets()[which]
    net = randomized(net)
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((8,) + shape), rng.integers(0, net.num_classes, 8)
    kw = dict(mode=mode, bits=4, steps=2, workspace_bytes=1 << 14)
    lowmem.set_backend("numpy")
    ref = run(net, shape, x, y, np, "float64", **kw)
    lowmem.set_backend("cupy")
    got = run(net, shape, x, y, gpu_backend, "float64", use_fast=use_fast, **kw)
    assert got[5].use_fast == use_fast
    compare(got, ref, 1e-10)


@pytest.mark.parametrize("N", [16, 8])
def test_gpu_approx_forward_is_bit_identical_to_exact(gpu_backend, N):
    """float32 on the GPU, a full batch and a batch of 8 in an engine planned for 16:
    approx's forward equals exact's bit for bit, naive's differs, and all gradients are close
    to the NumPy engine's."""
    net, shape = small_nets()["cifar11-bottleneck"]
    net = randomized(net, 1)
    rng = np.random.default_rng(6)
    x, y = rng.standard_normal((8,) + shape), rng.integers(0, net.num_classes, 8)
    out = {m: run(net, shape, x, y, gpu_backend, "float32", mode=m, bits=4, N=N)
           for m in ("exact", "approx", "naive")}
    assert out["approx"][0] == out["exact"][0]
    assert np.array_equal(out["approx"][1], out["exact"][1])
    assert not np.array_equal(out["naive"][1], out["exact"][1])
    lowmem.set_backend("numpy")
    ref = run(net, shape, x, y, np, "float32", mode="exact", N=N)
    assert abs(out["exact"][0] - ref[0]) < 1e-5 * abs(ref[0])
    for name, g in ref[3].items():
        assert rel(out["exact"][3][name], g) < 1e-4, name


def test_gpu_step_allocates_nothing_beyond_the_plan(gpu_backend):
    """CuPy's pool, through a MemoryHook: building the engine holds the plan (up to the pool's
    512-byte rounding) and a steady-state step's peak stays within 5% of it. The workspace fits a
    whole-batch im2col, so no GEMM needs a strided-output copy."""
    from lowmem.tools.peak_memory import measure_peak
    net = lowmem.models.preact_resnet_cifar(20)
    m = measure_peak(net, 64, (3, 32, 32), "approx", 4, steps=3, workspace_bytes=64 << 20)
    assert m.how == "cupy pool"
    assert m.plan_bytes <= m.held_bytes <= 1.01 * m.plan_bytes, m.report()
    assert m.peak_bytes <= 1.05 * m.plan_bytes, m.report()


@pytest.mark.skipif(os.environ.get("CUPY_TF32", "0") == "0", reason="only under CUPY_TF32=1")
def test_tf32_forward_stays_close(gpu_backend):
    """With CUPY_TF32=1 float32 GEMMs round their inputs to 10-bit mantissas: logits within ~1e-2."""
    net, shape = small_nets()["cifar11-bottleneck"]
    rng = np.random.default_rng(7)
    x, y = rng.standard_normal((8,) + shape), rng.integers(0, net.num_classes, 8)
    got = run(net, shape, x, y, gpu_backend, "float32", mode="approx")
    lowmem.set_backend("numpy")
    ref = run(net, shape, x, y, np, "float32", mode="approx")
    assert rel(got[1], ref[1]) < 1e-2


@pytest.mark.parametrize("k,stride,pad", [(3, 1, 1), (3, 2, 1), (1, 2, 0)])
def test_the_conv_ops_take_the_one_launch_columns_on_gpu_arrays(dev, k, stride, pad):
    """columns_for(cupy) is ops/columns_gpu.py's pair; passed to the conv ops (here on the
    emulator's NumPy arrays), forward, input and weight gradients equal the slice-copy path
    bit for bit."""
    if dev.name == "gpu":
        pytest.skip("covered by the engine tests on a real GPU")
    assert conv_ops.columns_for(types.SimpleNamespace(__name__="cupy")) is conv_ops.CUDA
    rng = np.random.default_rng(3)
    Cin, Cout, N, H, W = 3, 4, 5, 9, 7
    Ho, Wo = conv_ops.conv_out_size(H, k, stride, pad), conv_ops.conv_out_size(W, k, stride, pad)
    x = rng.standard_normal((Cin, N, H, W))
    w = rng.standard_normal((Cout, Cin, k, k))
    dout = rng.standard_normal((Cout, N, Ho, Wo))
    ws = np.empty(Cin * k * k * 2 * Ho * Wo)                 # two samples per chunk

    def run(columns):
        out, dx, dw = np.zeros((Cout, N, Ho, Wo)), np.zeros_like(x), np.zeros_like(w)
        conv_ops.conv2d_forward(out, x, w, stride, pad, ws, columns)
        conv_ops.conv2d_backward_input(dx, dout, w, stride, pad, ws, columns=columns)
        conv_ops.conv2d_backward_weight(dw, x, dout, stride, pad, ws, columns)
        return out, dx, dw

    want = run(conv_ops.SLICES)
    calls = []
    cuda_pair = conv_ops.CUDA
    counted = cuda_pair._replace(im2col=lambda *a: (calls.append("im2col"), cuda_pair.im2col(*a)),
                                 col2im=lambda *a: (calls.append("col2im"), cuda_pair.col2im(*a)))
    got = run(counted)
    assert "im2col" in calls and ("col2im" in calls or (k, stride) == (1, 2))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


# (C, m, N, H, W, k, stride, pad): MobileNetV2's 3x3 at strides 1 and 2, odd planes, N = 1, 5x5,
# channel multipliers 2 and 3
DEPTHWISE_CASES = [(6, 1, 3, 8, 8, 3, 1, 1), (5, 1, 2, 9, 7, 3, 2, 1), (4, 1, 1, 7, 7, 3, 2, 1),
                   (3, 1, 2, 11, 9, 5, 2, 2), (3, 2, 2, 7, 6, 3, 1, 1), (2, 3, 3, 9, 7, 3, 2, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DEPTHWISE_CASES)
def test_depthwise_kernels_match_the_reference(dev, case, dtype):
    """ops/depthwise_gpu.py, through conv_groups with the CUDA columns: forward and input
    gradient (overwritten, accumulated) bit for bit the slice additions for one output channel
    a group, to rounding for multipliers (the reference: GEMMs per group); the weight gradient,
    a float64 block sum, to rounding."""
    C, m, N, H, W, k, stride, pad = case
    rng = np.random.default_rng(C * 10 + m)
    Ho, Wo = conv_ops.conv_out_size(H, k, stride, pad), conv_ops.conv_out_size(W, k, stride, pad)
    x = rng.standard_normal((C, N, H, W)).astype(dtype)
    w = rng.standard_normal((C * m, 1, k, k)).astype(dtype)
    g = rng.standard_normal((C * m, N, Ho, Wo)).astype(dtype)
    base = rng.standard_normal(x.shape).astype(dtype)
    ws = np.empty(k * k * Ho * Wo * N, dtype)

    def run(columns, put, get):
        out, dx, acc, dw = put(np.full(g.shape, np.nan, dtype)), put(np.full_like(x, np.nan)), put(base), \
            put(np.full_like(w, 0.25))
        xd, wd, gd, wsd = put(x), put(w), put(g), put(ws)
        conv_groups.grouped_conv2d_forward(out, xd, wd, stride, pad, C, wsd, columns=columns)
        conv_groups.grouped_conv2d_backward_input(dx, gd, wd, stride, pad, C, wsd, columns=columns)
        conv_groups.grouped_conv2d_backward_input(acc, gd, wd, stride, pad, C, wsd, accumulate=True,
                                                  columns=columns)
        conv_groups.grouped_conv2d_backward_weight(dw, xd, gd, stride, pad, C, wsd, columns=columns)
        return [get(a) for a in (out, dx, acc, dw)]

    want = run(conv_ops.SLICES, np.array, np.array)
    got = run(conv_ops.CUDA, dev.put, dev.get)
    tol = 1e-5 if dtype == "float32" else 1e-12
    for a, b in zip(got[:3], want[:3]):
        if m == 1:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max())
    np.testing.assert_allclose(got[3], want[3], rtol=tol, atol=tol * np.abs(want[3]).max())


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DEPTHWISE_CASES)
def test_depthwise_weight_gradient_from_the_range_code(dev, case, dtype, bits):
    """depthwise_backward_weight_coded (each product decoding its input from the range code)
    equals range_decode into a buffer, then depthwise_backward_weight, bit for bit."""
    C, m, N, H, W, k, stride, pad = case
    rng = np.random.default_rng(C * 10 + m + bits)
    Ho, Wo = conv_ops.conv_out_size(H, k, stride, pad), conv_ops.conv_out_size(W, k, stride, pad)
    x = np.maximum(rng.standard_normal((C, N, H, W)), 0).astype(dtype)
    w = rng.standard_normal((C * m, 1, k, k)).astype(dtype)
    g = rng.standard_normal((C * m, N, Ho, Wo)).astype(dtype)
    packed = np.zeros(-(-x.size * bits // 8), np.uint8)
    scale, zero = np.zeros(rangecode.groups(x.size), np.float32), np.zeros(rangecode.groups(x.size), np.uint8)
    rangecode.range_encode(packed, scale, zero, x.reshape(-1), bits)
    code = rangecode.RangeCode(dev.put(packed), dev.put(scale), dev.put(zero), bits)
    xd, wd, gd = dev.put(np.empty_like(x)), dev.put(w), dev.put(g)
    rangecode_gpu.range_decode(xd, code.packed, code.scale, code.zero, bits)
    want, got = dev.put(np.full_like(w, 0.25)), dev.put(np.full_like(w, 0.25))
    depthwise_gpu.backward_weight(want, xd, gd, stride, pad)
    assert depthwise_gpu.applies_coded(gd, wd, code)
    depthwise_gpu.backward_weight_coded(got, code, x.shape, gd, stride, pad, rangecode.GROUP)
    np.testing.assert_array_equal(dev.get(got), dev.get(want))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["overwrite", "in place", "accumulate"])
def test_standalone_batch_norm_kernels_match_the_reference(dev, dtype, mode):
    """units/norm_gpu.py: x-hat and out (one pass, or normalize then apply, in place over x) bit for
    bit ops.bn_normalize's and bn_apply_forward's; the backward (float64 sums per segment, the
    units' finalize, dx written, written over dy, or added) to rounding."""
    x, g, b = unit(dtype, C=5, M=3000)
    g[1] = 0
    xhat, mean, _, rstd = host_stats(x)
    want = np.empty_like(x)
    bn_ops.bn_apply_forward(want, xhat, g, b)
    xd, md, rd, gd, bd = map(dev.put, (x, mean, rstd, g, b))
    hd, od = dev.put(np.full_like(x, np.nan)), dev.put(np.full_like(x, np.nan))
    norm_gpu.forward(od, hd, xd, md, rd, gd, bd)
    assert np.array_equal(dev.get(hd), xhat) and np.array_equal(dev.get(od), want)
    norm_gpu.normalize(xd, xd, md, rd)
    assert np.array_equal(dev.get(xd), xhat)
    norm_gpu.apply(xd, gd, bd)
    assert np.array_equal(dev.get(xd), want)
    rng = np.random.default_rng(4)
    dy, base = rng.standard_normal(x.shape).astype(dtype), rng.standard_normal(x.shape).astype(dtype)
    C = x.shape[0]
    acc = mode == "accumulate"
    rdx, rdg, rdb = base.copy() if acc else np.empty_like(x), np.full(C, 0.5, dtype), np.full(C, -1, dtype)
    bn_ops.bn_backward(rdx, rdg, rdb, dy, xhat, g, rstd, acc)
    dyd = dev.put(dy)
    dxd = dyd if mode == "in place" else dev.put(base if acc else np.full_like(x, np.nan))
    dgd, dbd = dev.put(np.full(C, 0.5, dtype)), dev.put(np.full(C, -1, dtype))
    norm_gpu.backward(dxd, dgd, dbd, dyd, dev.put(xhat), gd, rd, acc)
    tol = 1e-5 if dtype == "float32" else 1e-11
    for a, w in zip((dxd, dgd, dbd), (rdx, rdg, rdb)):
        np.testing.assert_allclose(dev.get(a), w, rtol=tol, atol=tol * np.abs(w).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", ["apart", "over other", "from x-hat"])
def test_batch_norm_add_relu_kernel_is_the_three_ops(dev, dtype, where):
    """units/norm_gpu.py's forward_add_relu: x-hat, relu(gamma*x-hat + beta + other) and the ReLU's
    mask bit for bit the three reference ops' (a partial last mask byte; NaN, inf and -0 in other)."""
    from lowmem.ops import add_forward, relu_forward
    x, g, b = unit(dtype, C=5, M=3001)
    g[1] = 0
    xhat, mean, _, rstd = host_stats(x)
    other = np.random.default_rng(6).standard_normal(x.shape).astype(dtype)
    other[0, :3] = [-0.0, np.nan, np.inf]
    want = np.empty_like(x)
    bn_ops.bn_apply_forward(want, xhat, g, b)
    add_forward(want, other)
    want_mask = np.zeros((x.size + 7) // 8, np.uint8)
    relu_forward(want, want_mask, want)
    md, rd, gd, bd, maskd = map(dev.put, (mean, rstd, g, b, np.full_like(want_mask, 0xAA)))
    if where == "apart":
        out, hd = dev.put(np.full_like(x, np.nan)), dev.put(np.full_like(x, np.nan))
        norm_gpu.forward_add_relu(out, maskd, hd, dev.put(x), dev.put(other), md, rd, gd, bd)
        assert np.array_equal(dev.get(hd), xhat)
    elif where == "over other":
        out = dev.put(other)
        norm_gpu.forward_add_relu(out, maskd, dev.put(np.empty_like(x)), dev.put(x), out, md, rd, gd, bd)
    else:
        out = dev.put(xhat)
        norm_gpu.forward_add_relu(out, maskd, None, out, dev.put(other), md, rd, gd, bd)
    got = dev.get(out)
    assert np.array_equal(got, want, equal_nan=True) and np.array_equal(np.signbit(got), np.signbit(want))
    assert np.array_equal(dev.get(maskd), want_mask)


# ---- the unbiased code (lowmem/units/unbiased_gpu.py) ---------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("naive", [False, True])
@pytest.mark.parametrize("dither", [False, True])
@pytest.mark.parametrize("M", [776, 200])
def test_unbiased_forward_and_decode_are_the_reference(dev, dtype, bits, naive, dither, M):
    """The CUDA unbiased code (and its dithered draw): the slot byte for byte
    unbiased.quantize_pack's (a shard keyed by its global place; γ of both signs and 0, t outside
    the data, a row's last group taking the rest (M = 776: 256, 256, 264), a row shorter than a
    group), relu(y) or naive's conv input as the reference, and the decodes (x-tilde, conv
    input, masked gradient) bit for bit unbiased.decode_each_chunk's."""
    x, g, b = unit(dtype, C=7, M=M, seed=bits)
    g[2], b[3], b[4] = 0, 9.0, -9.0
    xhat, mean, _, rstd = host_stats(x)
    key = Stream(stream.stream_key(2, 3, 4), start=M, row=3 * M)
    C, M = x.shape
    want = np.zeros(unbiased.slot_nbytes(C, M, bits, dither), np.uint8)
    unbiased.quantize_pack(want, xhat, g, b, bits, key, dither)
    ref_out = np.empty_like(x)
    if naive:
        unbiased.decode_each_chunk(ref_out, want, g, b, bits, relu=True, dither=dither)
    else:
        bn_relu_apply_forward(ref_out, xhat, g, b)
    slot, xd = dev.put(np.zeros_like(want)), dev.put(x)
    gd, bd = dev.put(g), dev.put(b)
    unbiased_gpu.unit_forward(xd, slot, xd, dev.put(mean), dev.put(rstd), gd, bd, bits, naive, key, dither)  # in place
    assert np.array_equal(dev.get(slot), want)
    assert np.array_equal(dev.get(xd), ref_out)
    for relu in (False, True):
        ref = np.empty_like(x)
        unbiased.decode_each_chunk(ref, want, g, b, bits, relu=relu, dither=dither)
        got = dev.put(np.empty_like(x))
        unbiased_gpu.decode(got, slot, gd, bd, bits, relu=relu, dither=dither)
        assert np.array_equal(dev.get(got), ref)
    dr = np.random.default_rng(1).standard_normal(x.shape).astype(dtype)
    drd = dev.put(dr.copy())
    unbiased_gpu.decode(dev.put(np.empty_like(x)), slot, gd, bd, bits, dr=drd, dither=dither)
    assert np.array_equal(dev.get(drd), dr * ((xhat * g[:, None]) + b[:, None] > 0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("dither", [False, True])
def test_unbiased_backward_matches_the_reference(dev, dtype, bits, accumulate, dither, M=776):
    """The CUDA unbiased BN-ReLU backward (the sums per segment of groups, the finalize, dx with
    x-tilde decoded inline; plain and dithered codes) equals the reference's, the decode and then
    ops.bn_relu_backward under the exact mask (γ of both signs and 0, t outside the data, a short
    last group), dx written in place over dr or added to a gradient already there."""
    x, g, b = unit(dtype, C=7, M=M, seed=30 + bits)
    g[2], g[5], b[3], b[4] = 0, -abs(g[5]), 9.0, -9.0
    xhat, mean, _, rstd = host_stats(x)
    C, M = x.shape
    slot = np.zeros(unbiased.slot_nbytes(C, M, bits, dither), np.uint8)
    unbiased.quantize_pack(slot, xhat, g, b, bits, Stream(stream.stream_key(5, 6, 7)), dither)
    xt, mask = np.empty_like(x), np.empty(x.shape, bool)

    def keep_mask(out_block, open_block, r0, r1, c0, c1):
        mask[r0:r1, c0:c1] = open_block
    unbiased.decode_each_chunk(xt, slot, g, b, bits, extra=keep_mask, dither=dither)
    rng = np.random.default_rng(2)
    dr = rng.standard_normal(x.shape).astype(dtype)
    base = rng.standard_normal(x.shape).astype(dtype)
    rdx, rdg, rdb = base.copy(), np.full(C, 0.5, dtype), np.full(C, -0.25, dtype)
    bn_relu_backward(rdx, rdg, rdb, dr.copy(), xt, g, b, rstd, relu_mask=mask, accumulate=accumulate)
    dgd, dbd = dev.put(np.full(C, 0.5, dtype)), dev.put(np.full(C, -0.25, dtype))
    drd = dev.put(dr.copy())
    dxd = dev.put(base) if accumulate else drd                       # in place, as the engine does
    unbiased_gpu.unit_backward(dxd, dgd, dbd, drd, dev.put(slot), *map(dev.put, (g, b, rstd)), bits, accumulate,
                               dither=dither)
    tol = 1e-4 if dtype == "float32" else 1e-10
    np.testing.assert_allclose(dev.get(dgd), rdg, rtol=tol, atol=tol * 10)
    np.testing.assert_allclose(dev.get(dbd), rdb, rtol=tol, atol=tol * 10)
    np.testing.assert_allclose(dev.get(dxd), rdx, rtol=tol, atol=tol * np.abs(rdx).max())
    if accumulate:
        assert np.array_equal(dev.get(drd), dr)                      # dr is read only


def test_unbiased_backward_sums_over_several_segments(dev):
    """A row of more than BLOCK groups: the sums run over several segments of groups."""
    M = (cuda_helper.BLOCK + 3) * unbiased.GROUP + 40
    assert gpu_base.segments(7, unbiased.groups(M)) > 1
    test_unbiased_backward_matches_the_reference(dev, "float64", 2, False, False, M=M)
    test_unbiased_backward_matches_the_reference(dev, "float64", 2, False, True, M=M)


GRAPH_FAMILIES = ("postact", "dense", "inverted", "bias", "classifier")


def graph_case(which, n, seed):
    """One of the hand-built graphs of the newer ops (tests/reference.py: post-activation
    blocks, dense blocks with concat, inverted residuals with depthwise convs and ReLU6, convs with
    bias, linear layers with dropout), its units and biases randomised, and a batch of n."""
    rng = np.random.default_rng(seed)
    net = random_graph(which, rng)
    shape = (3, 8, 8)
    return net, shape, rng.standard_normal((n,) + shape), rng.integers(0, net.num_classes, n)


@pytest.mark.parametrize("which", GRAPH_FAMILIES)
@pytest.mark.parametrize("mode", ["exact", "approx"])
def test_the_newer_ops_on_the_gpu_wiring_on_emulated_kernels(emulator, monkeypatch, which, mode):
    """The CuPy path of bn, relu, relu6, concat, dropout, grouped and biased convs, linear layers
    and the range codes, run on the CPU (the engine's CuPy wiring on NumPy arrays, the CUDA
    kernels emulated), float64: the NumPy engine's loss, logits, gradients and two SGD steps
    (dropout draws the same masks: they follow the element's index, not the path)."""
    emulate(monkeypatch, emulator)
    net, shape, x, y = graph_case(which, 4, 11)
    kw = dict(mode=mode, bits=4, N=4, steps=2)
    ref = run(net, shape, x, y, np, "float64", **kw)
    monkeypatch.setattr(lowmem.system.backend, "xp", NumpyAsCupy("cupy"))
    got = run(net, shape, x, y, np, "float64", **kw)
    eng = got[5]
    assert eng.use_fast and eng.run.columns is conv_ops.CUDA
    assert all(u.module is cuda for u in eng.units.values())
    compare(got, ref, 1e-10)
    cuda_helper.reset()


@pytest.mark.parametrize("which", GRAPH_FAMILIES)
@pytest.mark.parametrize("use_fast", [True, False])
def test_the_newer_ops_on_gpu_match_numpy_float64(gpu_backend, which, use_fast):
    """On a GPU (CuPy), float64, approx 4-bit: the NumPy engine's loss, gradients and SGD steps
    for each graph of the newer ops, through the fused kernels and through the array ops."""
    net, shape, x, y = graph_case(which, 4, 12)
    kw = dict(mode="approx", bits=4, steps=2)
    lowmem.set_backend("numpy")
    ref = run(net, shape, x, y, np, "float64", **kw)
    lowmem.set_backend("cupy")
    got = run(net, shape, x, y, gpu_backend, "float64", use_fast=use_fast, **kw)
    compare(got, ref, 1e-10)
