"""The k x k pools' entries: max-pool (keeps a 4-bit window index per output, exact) and
average pool (keeps nothing). Their backward writes the input gradient (Op.route)."""
from ...ops import avgpool2d_forward, avgpool2d_backward
from ...ops import pool
from ...ops.bitpack import packed_nbytes
from ..network import NetworkError
from .base import MAX_POOL_WINDOW, Op, window_shape


class MaxPool(Op):
    """Max over k x k windows; keeps the 4-bit window index of each maximum (exact)."""
    builder = "max_pool"
    out_shape = staticmethod(window_shape)

    @staticmethod
    def check(L, shape, walk):
        if L.k * L.k > MAX_POOL_WINDOW:
            raise NetworkError(f"maxpool {L.name!r}: k*k = {L.k * L.k} > {MAX_POOL_WINDOW} "
                               f"(the argmax is saved as a 4-bit index)")

    @staticmethod
    def plan(step, N, units, dtype, budget):
        L, (co, ho, wo) = step.layer, step.out_shape
        return [(f"{L.name}.argmax", "saved", (packed_nbytes(co * N * ho * wo, 4),), "uint8"),
                (f"{L.name}.index", "workspace", (co, N, ho, wo), "uint8")]

    @staticmethod
    def temporary(L, out_shape, itemsize):
        return "a max-pool block", pool.scratch_bytes(itemsize, out_shape[1] * out_shape[2])

    @staticmethod
    def _index(run, step):
        """The window-index workspace as a contiguous (C, n, Ho, Wo) view at its start (not
        [:, :n], which is strided when n < N: unpacking into a copy would fill nothing)."""
        co, ho, wo = step.out_shape
        return run.arrays[step.name + ".index"].reshape(-1)[:co * run.n * ho * wo].reshape(co, run.n, ho, wo)

    @staticmethod
    def _argmax(run, step):
        co, ho, wo = step.out_shape
        return run.arrays[step.saved[0]][:packed_nbytes(co * run.n * ho * wo, 4)]

    @staticmethod
    def forward(run, step):
        # the index workspace: where the reference writes one index per output before packing
        L, code = step.layer, MaxPool._argmax(run, step) if run.training else None
        run.codes.maxpool_forward(run.act(step.dst, step.out_shape), code, MaxPool._index(run, step),
                                  run.act(step.src, step.in_shape), L.k, L.stride, L.pad)

    @staticmethod
    def backward(run, step):
        # saved: argmax, exact (a 4-bit window index per output)
        L = step.layer
        run.codes.maxpool_backward(run.act(step.dx, step.in_shape), run.act(step.dout, step.out_shape),
                                   MaxPool._argmax(run, step), MaxPool._index(run, step), L.k, L.stride, L.pad)

    @staticmethod
    def onnx(L, helper, read, write, opset):
        return [helper.make_node("MaxPool", [read(L.src)], [write(L.dst, L.name)], name=L.name,
                                 kernel_shape=[L.k, L.k], strides=[L.stride] * 2, pads=[L.pad] * 4)]


class AvgPool2d(Op):
    """Mean over k x k windows (zero padding counted, as PyTorch's default). Keeps nothing:
    its backward needs only the shapes."""
    builder = "avg_pool"
    out_shape = staticmethod(window_shape)

    @staticmethod
    def forward(run, step):
        L = step.layer
        avgpool2d_forward(run.act(step.dst, step.out_shape), run.act(step.src, step.in_shape),
                          L.k, L.stride, L.pad)

    @staticmethod
    def backward(run, step):
        # saved: nothing
        L = step.layer
        avgpool2d_backward(run.act(step.dx, step.in_shape), run.act(step.dout, step.out_shape),
                           L.k, L.stride, L.pad)

    @staticmethod
    def onnx(L, helper, read, write, opset):
        return [helper.make_node("AveragePool", [read(L.src)], [write(L.dst, L.name)], name=L.name,
                                 kernel_shape=[L.k, L.k], strides=[L.stride] * 2, pads=[L.pad] * 4,
                                 count_include_pad=1)]
