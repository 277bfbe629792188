"""The entries that join and split the graph: the add and the channel concat (keep nothing), and two steps of the
backward sweep only, which the walk inserts where gradients meet: `copy` (a gradient that
two tensors shared until now gets a buffer of its own before one of them changes) and
`addgrad` (a gradient an op wrote into a free buffer is summed into the one its input has)."""
from ...ops import add_forward, concat_forward, concat_backward
from ..network import NetworkError
from .base import Op, same_shape


class Add(Op):
    """dst = a + b (Layer.inputs = (a, b), the same shape): the residual add. In place when
    dst is one of them. Backward: an input with no gradient yet shares the output's gradient
    storage (no copy); one that has a gradient gets the output gradient added to it."""
    in_place = several = True
    out_shape = staticmethod(same_shape)

    @staticmethod
    def check(L, shape, walk):
        if len(L.reads) != 2:
            raise NetworkError(f"add {L.name!r}: adds exactly two inputs, the record names {len(L.reads)}")
        a, b = (walk.shape[buf] for buf in L.reads)
        if a != b:
            raise NetworkError(f"add {L.name!r}: adds {L.reads[1]} of shape {b} to {L.reads[0]} of "
                               f"shape {a}; a residual add needs equal shapes")

    @staticmethod
    def route(L, walk):
        dout = walk.output_grad(L)
        dxs = []
        for t in walk.tin[L.name]:
            if t in walk.live:              # a gradient already: add the output gradient to it
                dxs.append((walk.own(L, t, reading=(dout,), busy=(dout,)), True))
            else:                           # the same storage as the output gradient
                walk.live[t] = dout
                dxs.append((dout, False))
        walk.step(L, dout=dout, dx=dxs[0][0], dxs=tuple(dxs))

    @staticmethod
    def forward(run, step):
        out = run.act(step.dst, step.out_shape)
        a, b = step.layer.reads
        if step.dst == b:
            a, b = b, a
        if step.dst != a:                   # out = a + b into a third buffer
            out[...] = run.act(a, step.in_shape)
        add_forward(out, run.act(b, step.in_shape))

    @staticmethod
    def backward(run, step):
        # saved: nothing (an input gradient is the output gradient)
        dout = run.act(step.dout, step.out_shape)
        for buf, acc in step.dxs:
            if acc:
                add_forward(run.act(buf, step.in_shape), dout)

    @staticmethod
    def onnx(L, helper, read, write, opset):
        a, b = (read(buf) for buf in L.reads)
        return [helper.make_node("Add", [a, b], [write(L.dst, L.name)], name=L.name)]


class Copy(Op):
    """Backward only: dx <- src, a shared gradient split off before one of its tensors changes."""

    @staticmethod
    def slots(step, saved):
        return ()

    @staticmethod
    def backward(run, step):
        run.act(step.dx, step.in_shape)[...] = run.act(step.src, step.in_shape)


class AddGrad(Op):
    """Backward only: dx += src, a gradient written into a free buffer summed into its tensor's."""

    @staticmethod
    def slots(step, saved):
        return ()

    @staticmethod
    def backward(run, step):
        add_forward(run.act(step.dx, step.in_shape), run.act(step.src, step.in_shape))


class Concat(Op):
    """dst = the inputs (Layer.inputs, equal H and W) stacked on the channel axis, in order.
    Keeps nothing; backward gives each input its channel slice of the output gradient (added
    to the gradient it has, when it has one)."""
    several = True

    @staticmethod
    def out_shape(L, *shapes):
        return (sum(s[0] for s in shapes),) + tuple(shapes[0][1:])

    @staticmethod
    def check(L, shape, walk):
        shapes = [walk.shape[b] for b in L.reads]
        if any(s[1:] != shapes[0][1:] for s in shapes):
            raise NetworkError(f"concat {L.name!r}: its inputs {', '.join(map(str, shapes))} differ in "
                               f"H, W; a channel concat needs equal spatial sizes")
        if L.cout and sum(s[0] for s in shapes) != L.cout:
            raise NetworkError(f"concat {L.name!r}: expects {L.cout} channels in all, its inputs hold "
                               f"{sum(s[0] for s in shapes)}")

    @staticmethod
    def route(L, walk):
        dout = walk.output_grad(L)
        dxs = [walk.grad_for(L, t, dout, reading=(dout,)) for t in walk.tin[L.name]]
        walk.step(L, dout=dout, dx=dxs[0][0], accumulate=dxs[0][1], dxs=tuple(dxs))

    @staticmethod
    def forward(run, step):
        concat_forward(run.act(step.dst, step.out_shape),
                       [run.act(b, s) for b, s in zip(step.layer.reads, step.in_shapes)])

    @staticmethod
    def backward(run, step):
        # saved: nothing (the channel offsets are the shapes')
        concat_backward([run.act(b, s) for (b, _), s in zip(step.dxs, step.in_shapes)],
                        run.act(step.dout, step.out_shape), [acc for _, acc in step.dxs])

    @staticmethod
    def onnx(L, helper, read, write, opset):
        return [helper.make_node("Concat", [read(b) for b in L.reads], [write(L.dst, L.name)], name=L.name,
                                 axis=1)]
