"""optim.SGD's update on the CPU in numba (optional: lowmem[fast]): one pass per tensor over the
weights, the gradient and the momentum instead of NumPy's 5-7 array passes, split over lowmem's
threads (lowmem/system/threads.py) where a tensor is large.

`sgd_update` is what optim.SGD.step runs on each tensor when numba is present and every
parameter is a C-contiguous float32 or float64 NumPy array (`supports`): the operations of
SGD._step_arrays in its order and its dtype (decay, momentum with PyTorch's first step v = g,
Nesterov, the step; each constant rounded to the array's dtype first, as NumPy rounds a Python
float beside an array), so the updated weights, momenta and gradients equal the NumPy path's bit
for bit (tests/train/test_optim.py). The CUDA twin is optim_gpu.py.

Why: the update reads and writes every parameter several times; ResNet-50's 25.6 M parameters
took 0.047 s of a 1.7 s one-thread step in NumPy.
"""
import numpy

from ..system import threads
from ..system.backend import numba_available

AVAILABLE = numba_available()
GRAIN = 1 << 18         # elements per thread below which a tensor's update is not split (set when a hand-over cost ~60 us)

if AVAILABLE:
    from numba import njit

    @njit(cache=True, nogil=True)
    def _update(w, grad, v, lr, momentum, wd, decay, use_momentum, started, nesterov):
        """One tensor (flat views of one range) in one pass; grad keeps g (+ momentum*v with Nesterov)."""
        for i in range(w.size):
            g = grad[i]
            if decay:
                g = g + wd * w[i]                           # g += wd * w
            step = g
            if use_momentum:
                vv = v[i] * momentum + g if started else g  # v = m*v + g; the first step v = g
                v[i] = vv
                if nesterov:
                    g = g + momentum * vv                   # g += m*v
                    step = g
                else:
                    step = vv
            grad[i] = g
            w[i] = w[i] - lr * step                         # w -= lr * step


def supports(params):
    """Whether sgd_update takes these parameters: numba present; data, grad and momentum C-contiguous
    NumPy arrays of one float dtype (float32 or float64)."""
    if not AVAILABLE:
        return False
    for p in params:
        arrays = (p.data, p.grad, p.state.get("momentum"))
        if not all(type(a) is numpy.ndarray and a.flags.c_contiguous and a.dtype == p.data.dtype for a in arrays):
            return False
        if p.data.dtype not in (numpy.float32, numpy.float64) or not (p.data.size == p.grad.size == arrays[2].size):
            return False
    return True


def sgd_update(w, grad, v, lr, momentum, weight_decay, nesterov, started):
    """One optim.SGD step of one tensor (weight_decay 0: no decay). Like SGD.step, leaves grad +
    decay (+ momentum*v with Nesterov) in grad. started: a previous step set v."""
    w, grad, v = w.reshape(-1), grad.reshape(-1), v.reshape(-1)
    real = w.dtype.type
    lr, momentum, wd = real(lr), real(momentum), real(weight_decay)
    flags = (bool(weight_decay), bool(momentum), bool(started), bool(nesterov))
    threads.parallel_for(lambda a, b: _update(w[a:b], grad[a:b], v[a:b], lr, momentum, wd, *flags), w.size,
                         grain=GRAIN)
