"""The CPU emulation of lowmem's CUDA kernels, for the tests of every *_gpu.py module.

Each program's CUDA text (lowmem.system.cuda.PROGRAMS) is compiled for the CPU with g++ against
a small emulation header (threadIdx/blockIdx, CUDA threads as coroutines that switch at
__syncthreads, the _rn intrinsics as plain IEEE operations, no contraction) and launched
through the modules' own Python launchers with NumPy arrays. Each launch checks every argument
against the kernel's C signature (array dtype per pointer, int32/int64/real per scalar): CuPy's
RawKernel checks none.

    build(tmp_path_factory)      {(program, dtype): the compiled library} of every registered program
    emulate(monkeypatch, libs)   lowmem/system/cuda.py's `build` swapped for these libraries
    gpu()                        CuPy when it sees a GPU (else the test is skipped)
    Device                       where a kernel test runs: put() / get() move NumPy arrays

tests/conftest.py makes the fixtures `emulator` (the libraries, once per session) and `dev`
(each kernel test on "emu" and on "gpu").
"""
import ctypes
import shutil
import subprocess
import re

import numpy as np
import pytest

from lowmem.system import cuda as cuda_helper


def kernel_signatures(program):
    """{kernel name: [C type of each parameter]} parsed from a program's source."""
    out = {}
    for name, params in re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', program.source):
        out[name] = [" ".join(p.split()[:-1]).replace("const ", "") for p in params.split(",")]
    return out


EMULATION = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <ucontext.h>
#include <utility>
#include <vector>
struct uint3_ { unsigned x, y, z; };
static uint3_ threadIdx, blockIdx, blockDim, gridDim;
// Kernels with __syncthreads run their CUDA threads as coroutines on one OS thread: each runs
// until its next __syncthreads (or its end), then the next one; every thread reaching the
// barrier before any passes it is exactly CUDA's rule.
static ucontext_t scheduler;
static std::vector<ucontext_t> fibers;
static bool in_fiber = false;
static void __syncthreads() {
    if (!in_fiber) { std::fprintf(stderr, "__syncthreads in a kernel launched without fibers\n"); std::abort(); }
    swapcontext(&fibers[threadIdx.x], &scheduler);
}
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return std::sqrt(a); }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline double __dsqrt_rn(double a) { return std::sqrt(a); }
static inline double __drcp_rn(double a) { return 1.0 / a; }
static inline unsigned __float_as_uint(float f) { unsigned u; __builtin_memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; __builtin_memcpy(&f, &u, 4); return f; }
"""

LAUNCHER = r"""
template <typename... A, std::size_t... I>
static void call_(void (*f)(A...), void** args, std::index_sequence<I...>) { f(*static_cast<A*>(args[I])...); }

static std::function<void()> fiber_body;
static std::vector<char> done;
static void fiber_main() { fiber_body(); done[threadIdx.x] = 1; }   // returns to `scheduler`

template <typename... A>
static void launch_(void (*f)(A...), const unsigned* g, unsigned bx, void** args, int fibered) {
    gridDim = {g[0], g[1], g[2]};
    blockDim = {bx, 1, 1};
    static std::vector<char> stacks;           // 16 KiB per fiber, kept between launches
    if (fibered && stacks.size() < bx * 16384) stacks.resize(bx * 16384);
    fiber_body = [=] { call_(f, args, std::index_sequence_for<A...>{}); };
    for (unsigned z = 0; z < g[2]; ++z) for (unsigned y = 0; y < g[1]; ++y) for (unsigned x = 0; x < g[0]; ++x) {
        blockIdx = {x, y, z};
        if (!fibered) {                       // no __syncthreads: threads one after another
            for (unsigned t = 0; t < bx; ++t) { threadIdx = {t, 0, 0}; fiber_body(); }
            continue;
        }
        fibers.assign(bx, ucontext_t{});
        done.assign(bx, 0);
        for (unsigned t = 0; t < bx; ++t) {
            getcontext(&fibers[t]);
            fibers[t].uc_stack.ss_sp = &stacks[t * 16384];
            fibers[t].uc_stack.ss_size = 16384;
            fibers[t].uc_link = &scheduler;
            makecontext(&fibers[t], fiber_main, 0);
        }
        in_fiber = true;
        for (bool running = true; running;) {  // round robin: one barrier interval per round
            running = false;
            for (unsigned t = 0; t < bx; ++t)
                if (!done[t]) { threadIdx = {t, 0, 0}; swapcontext(&scheduler, &fibers[t]); running = true; }
        }
        in_fiber = false;
    }
}
"""


class Emulated:
    """Stands in for cupy.RawModule: the same source compiled for the CPU (see the module doc)."""

    def __init__(self, path, dtype, program):
        self.lib = ctypes.CDLL(str(path))
        self.dtype = np.dtype(dtype)
        self.program = program
        self.signatures = kernel_signatures(program)

    def _ctype(self, t):
        return {"real*": self.dtype, "double*": np.dtype(np.float64), "float*": np.dtype(np.float32),
                "unsigned char*": np.dtype(np.uint8),
                "unsigned short*": np.dtype(np.uint16), "int*": np.dtype(np.int32),
                "unsigned long long*": np.dtype(np.uint64),
                "real": self.dtype.type, "double": np.float64, "int": np.int32, "long long": np.int64,
                "unsigned long long": np.uint64}[t]

    def get_function(self, name):
        fn, sig = getattr(self.lib, "launch_" + name), self.signatures[name]

        def launch(grid, block, args):
            assert len(args) == len(sig), f"{name}: {len(args)} arguments for {len(sig)} parameters"
            keep, ptrs = [], (ctypes.c_void_p * len(args))()
            for i, (a, t) in enumerate(zip(args, sig)):
                want = self._ctype(t)
                if t.endswith("*"):
                    assert isinstance(a, np.ndarray) and a.dtype == want, f"{name} arg {i}: {t} <- {a!r:.60}"
                    v = ctypes.c_void_p(a.ctypes.data)
                else:
                    assert type(a) is want, f"{name} arg {i}: {t} <- {type(a).__name__}"
                    v = ctypes.create_string_buffer(a.tobytes(), a.nbytes)
                keep.append(v)
                ptrs[i] = ctypes.addressof(v)
            assert len(grid) <= 3 and block[0] == cuda_helper.BLOCK, (grid, block)
            g = (ctypes.c_uint * 3)(*(tuple(grid) + (1, 1))[:3])
            fn(g, ctypes.c_uint(block[0]), ptrs, ctypes.c_int(name in self.program.block_sync))   # fibers
        return launch


def build(tmp_path_factory):
    """{(program name, dtype name): path of its emulation library} for every registered program."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found (the CPU emulation of the CUDA kernels needs it)")
    out = {}
    for program in cuda_helper.PROGRAMS.values():
        for dtype, text in program.sources().items():
            d = tmp_path_factory.mktemp(f"emu_{program.name}_{dtype}")
            wrappers = "".join(f'extern "C" void launch_{n}(const unsigned* g, unsigned b, void** a, int t) '
                               f'{{ launch_({n}, g, b, a, t); }}\n' for n in kernel_signatures(program))
            (d / "k.cpp").write_text(EMULATION + text + LAUNCHER + wrappers)
            r = subprocess.run([gxx, "-std=c++17", "-O1", "-ffp-contract=off", "-fno-fast-math", "-fPIC",
                                "-shared", "-o", str(d / "k.so"), str(d / "k.cpp")], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            out[program.name, dtype] = d / "k.so"
    return out


def emulate(monkeypatch, libs):
    """Every program builds for the CPU emulator (lowmem/system/cuda.py's `build` swapped)."""
    cuda_helper.reset()
    monkeypatch.setattr(cuda_helper, "build", lambda program, dtype: Emulated(
        libs[program.name, np.dtype(dtype).name], dtype, program))


def gpu():
    """CuPy, when it sees a GPU; else the test is skipped."""
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
    except Exception as e:                                  # no driver, no device
        pytest.skip(f"CuPy sees no GPU ({e})")
    return cupy


class Device:
    """Where the kernels run: put() / get() move NumPy arrays there and back."""

    def __init__(self, name, put, get, xp):
        self.name, self.put, self.get, self.xp = name, put, get, xp
