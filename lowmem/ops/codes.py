"""Which implementation of the ops that keep a packed code runs (ReLU, ReLU6, dropout, max-pool):
the NumPy / CuPy references (ops/relu.py, dropout.py, pool.py) or their one-pass twins (numba:
relu_cpu.py, dropout_cpu.py, pool_cpu.py; CUDA: relu_gpu.py, dropout_gpu.py, pool_gpu.py), which
give the same bytes and bits. The engine picks a set once (`codes_for`), as it picks the conv's
columns; the op handlers call it and never ask which one they have:

    relu_forward(out, mask, x)                       relu_backward(dx, dout, mask, accumulate)
    relu6_forward(out, code, x)                      relu6_backward(dx, dout, code, accumulate)
    dropout_forward(out, mask, x, p, key)            dropout_backward(dx, dout, mask, p, accumulate)
    maxpool_forward(out, argmax, index, x, k, stride, pad)
    maxpool_backward(dx, dout, argmax, index, k, stride, pad)

Max-pool's `argmax` is the packed 4-bit code (None: eval, nothing kept); `index` is the plan's
uint8 workspace where the reference writes one index per output before packing it (the one-pass
kernels pack straight from the window and leave it unused). A fast set hands arrays its kernels
do not take (float16, strided) to the reference.
"""
from typing import Callable, NamedTuple

from . import bitpack, dropout, pool, relu
from . import dropout_cpu, dropout_gpu, pool_cpu, pool_gpu, relu_cpu, relu_gpu


class Codes(NamedTuple):
    name: str
    relu_forward: Callable
    relu_backward: Callable
    relu6_forward: Callable
    relu6_backward: Callable
    dropout_forward: Callable
    dropout_backward: Callable
    maxpool_forward: Callable
    maxpool_backward: Callable


def _maxpool_forward_ref(out, argmax, index, x, k, stride, pad):
    pool.maxpool_forward(out, index, x, k, stride, pad)
    if argmax is not None:
        bitpack.pack_codes(argmax, index, 4)


def _maxpool_backward_ref(dx, dout, argmax, index, k, stride, pad):
    bitpack.unpack_codes(index, argmax, 4)
    pool.maxpool_backward(dx, dout, index, k, stride, pad)


def _maxpool(module):
    def forward(out, argmax, index, x, k, stride, pad):
        if module.supports(out, x):
            module.maxpool_forward(out, argmax, x, k, stride, pad)
        else:
            _maxpool_forward_ref(out, argmax, index, x, k, stride, pad)

    def backward(dx, dout, argmax, index, k, stride, pad):
        if module.supports(dx, dout):
            module.maxpool_backward(dx, dout, argmax, k, stride, pad)
        else:
            _maxpool_backward_ref(dx, dout, argmax, index, k, stride, pad)
    return forward, backward


REFERENCE = Codes("arrays", relu.relu_forward, relu.relu_backward, relu.relu6_forward, relu.relu6_backward,
                  dropout.dropout_forward, dropout.dropout_backward, _maxpool_forward_ref, _maxpool_backward_ref)


def _fast(name, relu_module, dropout_module, pool_module):
    return Codes(name, relu_module.relu_forward, relu_module.relu_backward, relu_module.relu6_forward,
                 relu_module.relu6_backward, dropout_module.dropout_forward, dropout_module.dropout_backward,
                 *_maxpool(pool_module))


NUMBA = _fast("numba", relu_cpu, dropout_cpu, pool_cpu)
CUDA = _fast("cuda", relu_gpu, dropout_gpu, pool_gpu)


def codes_for(xp, fast=True):
    """The set for arrays of module xp: the one-pass kernels when `fast` (the engine's use_fast;
    None counts as True) and they exist here (numba on NumPy, CUDA on CuPy), else the references."""
    if fast is False:
        return REFERENCE
    if xp.__name__.split(".")[0] == "cupy":
        return CUDA
    return NUMBA if relu_cpu.AVAILABLE else REFERENCE
