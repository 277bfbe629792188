"""The head's entries (global average pool, the linear classifier), the loss, and data
parallelism's averages: the steps around the body of the network."""
from ...ops import (avgpool_forward, avgpool_backward, linear_forward, linear_backward,
                    softmax_xent_forward, softmax_xent_backward)
from .base import Op


class GlobalAvgPool(Op):
    """The head's global average pool, into the linear layer's saved input slot (N, C)."""

    @staticmethod
    def out_shape(L, shape):
        return shape[0], 1, 1

    @staticmethod
    def slots(step, saved):
        return (step.dst,) if step.phase == "fwd" else ()      # fills the linear layer's slot

    @staticmethod
    def route(L, walk):
        dx = walk.live[walk.tin[L.name][0]] = walk.free(L)
        walk.step(L, dout="dfeat", dx=dx)

    @staticmethod
    def forward(run, step):
        avgpool_forward(run.batch(step.dst), run.act(step.src, step.in_shape))

    @staticmethod
    def backward(run, step):
        # saved: nothing
        avgpool_backward(run.act(step.dx, step.in_shape), run.batch(step.dout))

    @staticmethod
    def onnx(L, helper, read, write, opset):
        return [helper.make_node("GlobalAveragePool", [read(L.src)], ["pool.out"], name="pool"),
                helper.make_node("Flatten", ["pool.out"], ["feat"], name="flatten", axis=1)]


class Linear(Op):
    """The classifier: reads its input slot (N, C), writes the logits (N, classes)."""

    @staticmethod
    def out_shape(L, shape):
        return L.cout, 1, 1

    @staticmethod
    def plan(step, N, units, dtype, budget):
        L = step.layer
        return [(f"{L.name}.input", "saved", (N, L.cin), dtype)]      # filled by the pool

    @staticmethod
    def slots(step, saved):
        return (step.src,) if step.phase == "bwd" else ()      # the pool filled it

    @staticmethod
    def route(L, walk):
        walk.step(L, dout="dlogits", dx="dfeat")

    @staticmethod
    def forward(run, step):
        w, b = (run.params[n].data for n in step.params)
        linear_forward(run.batch(step.dst), run.batch(step.src), w, b)

    @staticmethod
    def backward(run, step):
        # saved: the FC input (N, C), exact
        w, b = (run.params[n] for n in step.params)
        linear_backward(run.batch(step.dx), w.grad, b.grad, run.batch(step.dout), run.batch(step.src), w.data)

    @staticmethod
    def onnx(L, helper, read, write, opset):
        return [helper.make_node("Gemm", ["feat", L.name + ".weight", L.name + ".bias"], ["logits"],
                                 name=L.name, transB=1)]


class Loss(Op):
    """Softmax cross-entropy of the logits against the labels: the last forward step, the first
    backward one. Keeps the probabilities (N, classes)."""

    @staticmethod
    def slots(step, saved):
        return ("loss.probs",)

    @staticmethod
    def forward(run, step):
        if run.training:                    # eval (predict) has no labels
            run.loss = softmax_xent_forward(run.batch("loss.probs"), run.batch(step.src), run.batch("labels"))

    @staticmethod
    def backward(run, step):
        # saved: the probabilities, exact
        softmax_xent_backward(run.batch(step.dx), run.batch("loss.probs"), run.batch("labels"))


class Average(Op):
    """Data parallel: replace a flat plan array (step.src: "bn.running" after forward, "grads"
    after backward) by its mean over the ranks, in one allreduce (lowmem/system/distributed.py)."""

    @staticmethod
    def slots(step, saved):
        return ()

    @staticmethod
    def _mean(run, name):
        run.comm.allreduce(run.arrays[name])
        run.arrays[name] /= run.comm.size

    @staticmethod
    def forward(run, step):
        if run.training:                    # per-replica running statistics: keep their average
            Average._mean(run, step.src)

    @staticmethod
    def backward(run, step):
        Average._mean(run, step.src)
