"""Compiling and launching lowmem's CUDA kernels (CuPy RawModule): one helper for every module that has some.

Five modules keep CUDA C++ beside the Python they speed up, each as one `Program`:

    lowmem/units/gpu_base.py         "bn"       the BN reductions both unit codes share
    lowmem/units/window_gpu.py       "units"    the fused BN-ReLU unit kernels of the window code
    lowmem/units/unbiased_gpu.py     "unbiased" the unbiased code's
    lowmem/ops/columns_gpu.py   "columns"  the convolution's im2col / col2im
    lowmem/train/optim_gpu.py         "sgd"      optim.SGD's update

This module gives them what they share and imports none of them: the text put
before every program (the `real` type, BLOCK, the round-to-nearest
arithmetic and the counter stream's bits), the compile options, and a launcher that compiles a program once
per dtype at its first launch (NVRTC, through CuPy). Importing it needs no GPU
and no CuPy; `Program.sources()` returns the exact text compiled, for the nvcc
compile test, and tests/units/test_units_gpu.py swaps `build` for a CPU emulator.

Arithmetic: every float operation whose result must equal NumPy's is an
explicit round-to-nearest intrinsic (__fmul_rn, __fadd_rn, ...: never
contracted to an FMA) in the data's dtype, in NumPy's order, and every
program is also compiled with --fmad=false.
"""
import numpy

BLOCK = 256                       # threads per block (the unit reductions assume this power of two)
OPTIONS = ("--fmad=false",)
REAL = {"float32": "float", "float64": "double"}

PRELUDE = r"""
// Round-to-nearest arithmetic, never contracted into FMAs: NumPy's results, bit for bit.
__device__ __forceinline__ float  rn_mul(float a, float b)   { return __fmul_rn(a, b); }
__device__ __forceinline__ double rn_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float  rn_add(float a, float b)   { return __fadd_rn(a, b); }
__device__ __forceinline__ double rn_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float  rn_sub(float a, float b)   { return __fsub_rn(a, b); }
__device__ __forceinline__ double rn_sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float  rn_div(float a, float b)   { return __fdiv_rn(a, b); }
__device__ __forceinline__ double rn_div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float  rn_rsqrt(float v)  { return __frcp_rn(__fsqrt_rn(v)); }
__device__ __forceinline__ double rn_rsqrt(double v) { return __drcp_rn(__dsqrt_rn(v)); }

// The counter stream (lowmem/units/stream.py): the top 24 bits of SplitMix64's finaliser of
// counter base + (i + 1)*phi, base = mix64(key), i an element's index in the global rows
__device__ __forceinline__ unsigned int counter_bits(unsigned long long base, long long i)
{
    unsigned long long z = base + (unsigned long long)(i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (unsigned int)(z >> 40);
}

// The BN reductions (units/gpu_base.py, units/window_gpu.py, units/unbiased_gpu.py).
// Block-wide sums of a and b (BLOCK threads, fixed tree order); totals land in sa[0], sb[0].
__device__ void block_sum2(double a, double b, double* sa, double* sb)
{
    sa[threadIdx.x] = a;
    sb[threadIdx.x] = b;
    __syncthreads();
    for (int h = BLOCK / 2; h > 0; h >>= 1) {
        if (threadIdx.x < h) {
            sa[threadIdx.x] += sa[threadIdx.x + h];
            sb[threadIdx.x] += sb[threadIdx.x + h];
        }
        __syncthreads();
    }
}

// Segment s = blockIdx.x of the S = gridDim.x segments of row c = blockIdx.y: [*lo, *hi).
__device__ __forceinline__ void segment(long long n, long long* lo, long long* hi)
{
    const long long seg = (n + gridDim.x - 1) / gridDim.x;
    *lo = seg * blockIdx.x;
    *hi = *lo + seg < n ? *lo + seg : n;
}
"""

PROGRAMS = {}                     # name -> Program, filled as the modules that define them are imported
_compiled = {}                    # (program name, dtype name) -> built module
_functions = {}                   # (program name, dtype name, kernel name) -> its function


class Program:
    """One CUDA source text, compiled per dtype at first use.

    block_sync: its kernels that call __syncthreads (the CPU emulator runs their threads as
    coroutines; the others one after another)."""

    def __init__(self, name, source, block_sync=()):
        self.name, self.source, self.block_sync = name, source, tuple(block_sync)
        PROGRAMS[name] = self

    def sources(self):
        """{dtype name: the CUDA C++ text compiled for it}."""
        return {dt: f"typedef {c} real;\n#define BLOCK {BLOCK}\n" + PRELUDE + self.source
                for dt, c in REAL.items()}

    def launch(self, kernel, dtype, grid, args):
        """Run `kernel` on a grid of BLOCK-thread blocks; args: arrays and NumPy scalars, in
        the kernel's parameter order and types (CuPy checks none of them)."""
        dt = numpy.dtype(dtype).name
        fn = _functions.get((self.name, dt, kernel))
        if fn is None:
            mod = _compiled.get((self.name, dt))
            if mod is None:
                mod = _compiled[self.name, dt] = build(self, dt)
            fn = _functions[self.name, dt, kernel] = mod.get_function(kernel)
        fn(tuple(int(g) for g in grid), (BLOCK,), tuple(args))


def build(program, dtype):
    """The compiled module of `program` for one dtype (tests swap in a CPU emulator here)."""
    import cupy
    return cupy.RawModule(code=program.sources()[numpy.dtype(dtype).name], options=OPTIONS)


def reset():
    """Forget every compiled module (tests, after swapping `build`)."""
    _compiled.clear()
    _functions.clear()


def blocks(n):
    """Blocks of BLOCK threads that cover n elements (at least one)."""
    return max(1, -(-int(n) // BLOCK))


def i32(v):
    return numpy.int32(v)


def i64(v):
    return numpy.int64(v)


def address(a):
    """Where array a's data starts: a CuPy array's device pointer (a NumPy array's, for the tests'
    CPU emulation)."""
    return a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data


def supports(*arrays):
    """Whether the elementwise kernels take these device arrays: C-contiguous, float32 or float64
    of one dtype."""
    return (all(a.flags.c_contiguous for a in arrays) and arrays[0].dtype.name in REAL
            and all(a.dtype == arrays[0].dtype for a in arrays))


def partial_overlap(a, b):
    """Whether two arrays share memory without being the same array (a kernel that may write its
    input in place cannot take that)."""
    pa, pb = address(a), address(b)
    return pa != pb and pa < pb + b.nbytes and pb < pa + a.nbytes


def elem_strides(a):
    """a's strides in elements, as int64 kernel arguments."""
    return tuple(i64(s // a.itemsize) for s in a.strides)
