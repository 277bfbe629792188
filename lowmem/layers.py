"""The op table: for each layer op, its shape rule, its saved slots and its two handlers.

    OPS[op].out_shape(L, (c, h, w)) -> (c, h, w)        per-sample output shape
    OPS[op].saved(L, N, in_shape, out_shape, units, dtype) -> [(slot, shape, dtype)]
    OPS[op].forward(run, step)                          one forward step
    OPS[op].backward(run, step)                         its backward step, just below it
    OPS[op].grad                                        how backward routes gradients (schedule.py):
        "same"    the input gradient overwrites the output gradient's buffer (BN-ReLU)
        "other"   the input gradient goes to another free buffer (conv, pools)
        "shared"  both inputs of a residual add share the output gradient's storage

Handlers read only their `step` (schedule.Step: buffers, shapes, slot and
parameter names, accumulate / scratch) and the running engine `run`:
`run.act(buf, shape)` a (C, n, H, W) view, `run.rows(...)` its (C, n*H*W)
rows, `run.slot(name)` a saved slot for the current batch, `run.param(name)`,
`run.units` the BN-ReLU kernel set, `run.n` the batch, `run.training`.
Adding an op: its functions in lowmem/ops, one entry here, a Network method.

Gradient semantics (lowmem/ops): activation gradients overwrite their buffer
unless `step.accumulate` (a tensor with a second consumer); parameter
gradients accumulate (the engine zeroes them once per backward).
"""
from . import quant
from .ops import (conv2d_forward, conv2d_backward_input, conv2d_backward_weight, conv_out_size,
                  bn_eval_relu_forward, update_running_stats, maxpool_forward, maxpool_backward,
                  avgpool_forward, avgpool_backward, linear_forward, linear_backward)
from .kernels import BN_EPS
from .ops.batchnorm import ROW_BLOCK

BN_MOMENTUM = 0.1


class BatchStatisticsError(FloatingPointError):
    """A batch whose statistics are not finite (an input too large for the dtype)."""


class Conv:
    grad = "other"

    @staticmethod
    def out_shape(L, shape):
        c, h, w = shape
        return L.cout, conv_out_size(h, L.k, L.stride, L.pad), conv_out_size(w, L.k, L.stride, L.pad)

    @staticmethod
    def saved(L, N, in_shape, out_shape, units, dtype):
        return []       # its input is rebuilt from the producing unit's saved slot

    @staticmethod
    def forward(run, step):
        L = step.layer
        conv2d_forward(run.act(step.dst, step.out_shape), run.act(step.src, step.in_shape),
                       run.param(step.params[0]).data, L.stride, L.pad, run.arrays["conv.cols"])

    @staticmethod
    def backward(run, step):
        # saved: the input, rebuilt exactly (exact mode) or approximately from the unit's code
        L, p = step.layer, run.param(step.params[0])
        dout = run.act(step.dout, step.out_shape)
        ws = run.arrays["conv.cols"]
        if step.unit:                                    # relu(gamma*x-hat + beta) into scratch
            g, b = (run.param(n).data for n in step.unit_params)
            run.units[step.unit].conv_input(run.rows(step.scratch, step.in_shape), run.slot(step.unit_saved), g, b)
            x = run.act(step.scratch, step.in_shape)
        else:
            x = run.act(step.src, step.in_shape)         # the planned input slot
        conv2d_backward_weight(p.grad, x, dout, L.stride, L.pad, ws)
        if step.dest and (run.input_grad or not step.optional):
            conv2d_backward_input(run.act(step.dest, step.in_shape), dout, p.data, L.stride, L.pad,
                                  ws, accumulate=step.accumulate)


class BNReLU:
    grad = "same"

    @staticmethod
    def out_shape(L, shape):
        return shape

    @staticmethod
    def saved(L, N, in_shape, out_shape, units, dtype):
        c, h, w = in_shape
        shape, dt = units.saved_entry(c, N * h * w, dtype)
        return [(f"{L.name}.{units.saved_suffix}", shape, dt), (f"{L.name}.rstd", (c,), dtype)]

    @staticmethod
    def forward(run, step):
        g, b = (run.param(n).data for n in step.params)
        x, out = run.rows(step.src, step.in_shape), run.rows(step.dst, step.out_shape)
        mean_name, var_name = step.layer.name + ".running_mean", step.layer.name + ".running_var"
        running_mean, running_var = run.stats[mean_name], run.stats[var_name]
        if not run.training:
            bn_eval_relu_forward(out, x, running_mean, running_var, g, b, BN_EPS)
            return
        c, M = x.shape
        mean, var = run.arrays["bn.batch_mean"][:c], run.arrays["bn.batch_var"][:c]
        rstd = run.arrays[step.saved[1]]
        units = run.units[step.layer.name]
        units.stats(mean, var, rstd, x)
        if not bool(run.xp.isfinite(var).all() & run.xp.isfinite(mean).all()):   # (C,): cheap
            raise BatchStatisticsError(
                f"{step.layer.name}: non-finite batch statistics (the input has values too "
                f"large for {x.dtype}?); the step was refused, running statistics unchanged")
        units.forward(out, run.slot(step.saved[0]), x, mean, rstd, g, b)
        update_running_stats(running_mean, running_var, mean, var, units.count(M), BN_MOMENTUM)

    @staticmethod
    def backward(run, step):
        # saved: x-hat or its code (run.units decides), rstd exact
        g, b = (run.param(n) for n in step.params)
        run.units[step.layer.name].backward(run.rows(step.dest, step.in_shape), g.grad, b.grad,
                           run.rows(step.dout, step.out_shape), run.slot(step.saved[0]),
                           run.arrays[step.saved[1]], g.data, b.data, step.accumulate,
                           run.rows(step.scratch, step.in_shape) if step.scratch else None)


class Add:
    grad = "shared"

    @staticmethod
    def out_shape(L, shape):
        return shape

    @staticmethod
    def saved(L, N, in_shape, out_shape, units, dtype):
        return []

    @staticmethod
    def forward(run, step):
        res = run.act(step.dst, step.out_shape)          # dst is the residual stream
        res += run.act(step.src, step.in_shape)

    @staticmethod
    def backward(run, step):
        pass    # both inputs share the output's gradient storage (schedule.plan_backward)


class MaxPool:
    grad = "other"

    @staticmethod
    def out_shape(L, shape):
        c, h, w = shape
        return c, conv_out_size(h, L.k, L.stride, L.pad), conv_out_size(w, L.k, L.stride, L.pad)

    @staticmethod
    def saved(L, N, in_shape, out_shape, units, dtype):
        co, ho, wo = out_shape
        return [(f"{L.name}.argmax", (quant.packed_nbytes(co * N * ho * wo, 4),), "uint8")]

    @staticmethod
    def _index(run, step):
        """The window-index workspace as a contiguous (C, n, Ho, Wo) view at its start (not
        [:, :n], which is strided when n < N: unpacking into a copy would fill nothing)."""
        co, ho, wo = step.out_shape
        return run.arrays[step.layer.name + ".index"].reshape(-1)[:co * run.n * ho * wo].reshape(co, run.n, ho, wo)

    @staticmethod
    def forward(run, step):
        L, idx = step.layer, MaxPool._index(run, step)
        maxpool_forward(run.act(step.dst, step.out_shape), idx, run.act(step.src, step.in_shape),
                        L.k, L.stride, L.pad)
        if run.training:
            quant.pack_codes(run.slot(step.saved[0]), idx.reshape(-1), 4)

    @staticmethod
    def backward(run, step):
        # saved: argmax, exact (a 4-bit window index per output)
        L, idx = step.layer, MaxPool._index(run, step)
        quant.unpack_codes(idx.reshape(-1), run.slot(step.saved[0]), 4)
        maxpool_backward(run.act(step.dest, step.in_shape), run.act(step.dout, step.out_shape), idx,
                         L.k, L.stride, L.pad)


class AvgPool:
    """Global average pool into the head's input slot (N, C)."""
    grad = "other"

    @staticmethod
    def out_shape(L, shape):
        return shape[0], 1, 1

    @staticmethod
    def saved(L, N, in_shape, out_shape, units, dtype):
        return []       # writes the linear head's saved input

    @staticmethod
    def forward(run, step):
        avgpool_forward(run.slot(step.dst), run.act(step.src, step.in_shape))

    @staticmethod
    def backward(run, step):
        # saved: nothing
        avgpool_backward(run.act(step.dest, step.in_shape), run.slot(step.dout))


class Linear:
    """The classifier: reads the head's input slot, writes the logits."""
    grad = "fixed"

    @staticmethod
    def out_shape(L, shape):
        return L.cout, 1, 1

    @staticmethod
    def saved(L, N, in_shape, out_shape, units, dtype):
        return [(f"{L.name}.input", (N, L.cin), dtype)]

    @staticmethod
    def forward(run, step):
        w, b = (run.param(n).data for n in step.params)
        linear_forward(run.slot(step.dst), run.slot(step.src), w, b)

    @staticmethod
    def backward(run, step):
        # saved: the FC input (N, C), exact
        w, b = (run.param(n) for n in step.params)
        linear_backward(run.slot(step.dest), w.grad, b.grad, run.slot(step.dout), run.slot(step.saved[0]),
                        w.data)


OPS = {"conv": Conv, "bnrelu": BNReLU, "add": Add, "maxpool": MaxPool, "avgpool": AvgPool,
       "linear": Linear}
