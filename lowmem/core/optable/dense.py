"""The flatten + linear entry: a fully connected layer inside the network (VGG's classifier,
before the head), reading a (C, H, W) activation as C*H*W features and writing a (K, 1, 1)
activation that ReLUs, dropout, more linear layers and the head read.

It is a conv whose kernel covers the whole plane (lowmem/ops/linear.py), and it finds its
input for the weight gradient the conv's way (optable/conv.py's keep_input, layer_input: a
unit's output rebuilt from its code, any other tensor kept once, float or a range code).
Its input gradient needs only the weights."""
from ...ops.linear import flatten_linear_backward, flatten_linear_forward
from ..network import NetworkError
from .base import Op, onnx_constant
from .conv import Conv, keep_input, layer_input


class FlattenLinear(Op):
    builder = "linear"
    route = staticmethod(Conv.route)
    slots = staticmethod(Conv.slots)

    @staticmethod
    def out_shape(L, shape):
        return L.cout, 1, 1

    @staticmethod
    def check(L, shape, walk):
        c, h, w = shape
        if c * h * w != L.cin:
            raise NetworkError(f"linear {L.name!r}: expects {L.cin} input features, {L.src} holds "
                               f"{shape} = {c * h * w}")
        keep_input(L, walk)

    @staticmethod
    def plan(step, N, units, dtype, budget):
        # im2col columns of the plane-sized kernel (F = C*H*W a sample), shared with the convs
        (c, h, w), F = step.in_shape, step.layer.cin
        out = [("conv.cols", "workspace", (F * min(N, max(1, budget // F)),), dtype)]
        if step.keep:
            out += units.entries(step.keep, c * N * h * w, dtype)
        return out

    @staticmethod
    def _out(run, buf, step):
        return run.arrays[buf][:step.layer.cout * run.n].reshape(step.layer.cout, run.n)

    @staticmethod
    def forward(run, step):
        L = step.layer
        x = run.act(step.src, step.in_shape)
        if step.keep and run.training:
            run.keeper.keep([run.arrays[n] for n in step.saved], x.reshape(-1))
        b = run.params[step.params[1]].data if L.bias else None
        flatten_linear_forward(FlattenLinear._out(run, step.dst, step), x, run.params[step.params[0]].data, b,
                               run.arrays["conv.cols"], run.columns)

    @staticmethod
    def backward(run, step):
        # saved: the input, exact or approximate (as a conv's: layer_input)
        L, w = step.layer, run.params[step.params[0]]
        x = layer_input(run, step)
        dx = run.act(step.dx, step.in_shape) if step.dx and (run.input_grad or not step.optional) else None
        flatten_linear_backward(dx, w.grad, run.params[step.params[1]].grad if L.bias else None,
                                FlattenLinear._out(run, step.dout, step), x, w.data, run.arrays["conv.cols"],
                                step.accumulate, run.columns)

    @staticmethod
    def onnx(L, helper, read, write, opset):
        flat, gemm, shape = L.name + ".flatten", L.name + ".gemm", L.name + ".shape"
        inputs = [flat, L.name + ".weight"] + ([L.name + ".bias"] if L.bias else [])
        return [helper.make_node("Flatten", [read(L.src)], [flat], name=flat, axis=1),
                helper.make_node("Gemm", inputs, [gemm], name=gemm, transB=1),
                onnx_constant(helper, shape, [4], [0, -1, 1, 1], int64=True),
                helper.make_node("Reshape", [gemm, shape], [write(L.dst, L.name)], name=L.name)]
