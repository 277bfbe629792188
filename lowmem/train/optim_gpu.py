"""optim.SGD's update on the GPU: one CUDA kernel per tensor instead of 5-7 CuPy array ops.

`sgd_step(opt)` is what optim.SGD.step runs when its parameters are CuPy
arrays: the same operations in the same order (decay, momentum with PyTorch's
first step v = g, Nesterov, the step), each rounded as NumPy rounds it, so the
updated weights, momenta and gradients equal the NumPy path's bit for bit
(tests/units/test_units_gpu.py). Compiled through lowmem/system/cuda.py (program "sgd").
"""
from ..system import cuda
from ..system.cuda import i32, i64

SOURCE = r"""
// w, grad, v: one tensor of n elements. Leaves grad + decay (+ momentum*v with Nesterov) in grad,
// as optim.SGD.step does.
extern "C" __global__ void sgd_update(real* w, real* grad, real* v, long long n, real lr,
                                      real momentum, real wd, int decay, int use_momentum,
                                      int started, int nesterov)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    real g = grad[i];
    if (decay) g = rn_add(g, rn_mul(wd, w[i]));          // g += wd * w
    real step = g;
    if (use_momentum) {
        const real vv = started ? rn_add(rn_mul(v[i], momentum), g) : g;   // v = m*v + g
        v[i] = vv;
        if (nesterov) { g = rn_add(g, rn_mul(momentum, vv)); step = g; }   // g += m*v
        else step = vv;
    }
    grad[i] = g;
    w[i] = rn_sub(w[i], rn_mul(lr, step));                // w -= lr * step
}
"""

PROGRAM = cuda.Program("sgd", SOURCE)


def sgd_update(w, grad, v, lr, momentum, weight_decay, nesterov, started):
    """One optim.SGD step of one tensor in one pass (weight_decay 0: no decay). Like SGD.step,
    leaves grad + decay (+ momentum*v with Nesterov) in grad. started: a previous step set v."""
    if not (w.flags.c_contiguous and grad.flags.c_contiguous and v.flags.c_contiguous):
        raise ValueError("sgd_update needs C-contiguous w, grad and momentum arrays")
    real = w.dtype.type
    PROGRAM.launch("sgd_update", w.dtype, (cuda.blocks(w.size),),
                   (w, grad, v, i64(w.size), real(lr), real(momentum), real(weight_decay),
                    i32(bool(weight_decay)), i32(bool(momentum)), i32(bool(started)), i32(bool(nesterov))))


def sgd_step(opt):
    """The update of every tensor of an optim.SGD whose parameters live on the GPU; returns
    nothing: the caller (SGD.step) records that a step was taken."""
    opt.each_tensor(sgd_update)
