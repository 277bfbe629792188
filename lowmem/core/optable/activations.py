"""The elementwise entries that keep a packed code: ReLU on its own (a 1-bit mask of x > 0),
ReLU6 (a 2-bit region code) and dropout (its 1-bit keep mask, drawn from the engine's counter
stream: run.keys[layer], so a resumed run and every rank draw the same masks). Each may run
in place; each backward reads its output gradient only, so the input gradient may overwrite it.

Dimensions: n = C*N*H*W elements of the layer's (C, H, W) input at batch N, taken flat."""
from ...ops import dropout as _dropout, relu as _relu
from ...ops.bitpack import packed_nbytes
from ...system.backend import array_module
from .base import Op, onnx_constant, same_shape


def _elems(run, step):
    c, h, w = step.in_shape
    return c * run.n * h * w


def _code(run, step, bits):
    return run.arrays[step.saved[0]][:packed_nbytes(_elems(run, step), bits)]


def _flat(run, buf, step):
    return run.arrays[buf][:_elems(run, step)]


class _Elementwise(Op):
    in_place = True
    out_shape = staticmethod(same_shape)
    bits, suffix = 1, "mask"

    @classmethod
    def plan(cls, step, N, units, dtype, budget):
        c, h, w = step.in_shape
        return [(f"{step.layer.name}.{cls.suffix}", "saved", (packed_nbytes(c * N * h * w, cls.bits),), "uint8")]

    scratch = staticmethod(_relu.scratch_bytes)     # what one call allocates (ops/relu.py, ops/dropout.py)

    @classmethod
    def temporary(cls, L, out_shape, itemsize):
        return "a mask / code block", cls.scratch(None, itemsize)

    @staticmethod
    def route(L, walk):
        dout, t = walk.output_grad(L), walk.tin[L.name][0]
        dx, acc = walk.grad_for(L, t, dout, in_place=dout, reading=(dout,))
        walk.step(L, dout=dout, dx=dx, accumulate=acc)


class ReLU(_Elementwise):
    """max(x, 0), not after a batch norm (after an add, say): keeps the 1-bit mask [x > 0]."""

    @staticmethod
    def forward(run, step):
        out, x = _flat(run, step.dst, step), _flat(run, step.src, step)
        if run.training:
            run.codes.relu_forward(out, _code(run, step, 1), x)
        else:
            array_module(x).maximum(x, 0, out=out)

    @staticmethod
    def backward(run, step):
        # saved: the 1-bit mask [x > 0], exact
        run.codes.relu_backward(_flat(run, step.dx, step), _flat(run, step.dout, step), _code(run, step, 1),
                                step.accumulate)

    @staticmethod
    def onnx(L, helper, read, write, opset):
        return [helper.make_node("Relu", [read(L.src)], [write(L.dst, L.name)], name=L.name)]


class ReLU6(_Elementwise):
    """min(max(x, 0), 6): keeps a 2-bit region code (below, inside, above)."""
    bits, suffix = 2, "region"

    @staticmethod
    def forward(run, step):
        out, x = _flat(run, step.dst, step), _flat(run, step.src, step)
        if run.training:
            run.codes.relu6_forward(out, _code(run, step, 2), x)
        else:
            array_module(x).clip(x, 0, 6, out=out)

    @staticmethod
    def backward(run, step):
        # saved: the 2-bit region code of x, exact
        run.codes.relu6_backward(_flat(run, step.dx, step), _flat(run, step.dout, step), _code(run, step, 2),
                                 step.accumulate)

    @staticmethod
    def onnx(L, helper, read, write, opset):
        if opset < 11:                                   # Clip-6: the bounds are attributes
            return [helper.make_node("Clip", [read(L.src)], [write(L.dst, L.name)], name=L.name, min=0.0, max=6.0)]
        bounds = [onnx_constant(helper, f"{L.name}.{end}", [], [v]) for end, v in (("min", 0.0), ("max", 6.0))]
        return bounds + [helper.make_node("Clip", [read(L.src), L.name + ".min", L.name + ".max"],
                                          [write(L.dst, L.name)], name=L.name)]


class Dropout(_Elementwise):
    """Inverted dropout with probability L.p (training; the identity in eval): keeps its 1-bit
    keep mask, drawn from run.keys[layer] (the engine's counter stream)."""
    keyed = True
    scratch = staticmethod(_dropout.scratch_bytes)

    @staticmethod
    def forward(run, step):
        out, x = _flat(run, step.dst, step), _flat(run, step.src, step)
        if run.training:
            run.codes.dropout_forward(out, _code(run, step, 1), x, step.layer.p, run.keys[step.name])
        elif step.dst != step.src:
            out[...] = x

    @staticmethod
    def backward(run, step):
        # saved: the 1-bit keep mask, exact
        run.codes.dropout_backward(_flat(run, step.dx, step), _flat(run, step.dout, step), _code(run, step, 1),
                                   step.layer.p, step.accumulate)

    @staticmethod
    def onnx(L, helper, read, write, opset):
        # an ONNX Dropout: the identity in inference (training_mode absent), and it carries its
        # ratio, so nn.from_onnx reads the layer back as this dropout
        if opset < 12:                                   # Dropout-7..11: the ratio is an attribute
            return [helper.make_node("Dropout", [read(L.src)], [write(L.dst, L.name)], name=L.name,
                                     ratio=float(L.p))]
        ratio = onnx_constant(helper, f"{L.name}.ratio", [], [float(L.p)])
        return [ratio, helper.make_node("Dropout", [read(L.src), f"{L.name}.ratio"], [write(L.dst, L.name)],
                                        name=L.name)]
