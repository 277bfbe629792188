"""The op table: everything lowmem knows about each op, in one entry per op.

    OPS[op].out_shape(L, (c, h, w)) -> (c, h, w)   per-sample output shape
    OPS[op].check(L, shape, walk)                  its rules on the layer record (raise NetworkError)
    OPS[op].route(L, walk)                         backward: which buffer receives its input gradient
    OPS[op].plan(L, N, in_shape, out_shape, units, dtype, budget) -> [(name, kind, shape, dtype)]
                                                   what it keeps for backward ("saved") and its
                                                   scratch ("workspace") in the memory plan
    OPS[op].slots(step, saved)                     the saved slots a step fills or reads (printed)
    OPS[op].forward(run, step), .backward(run, step)    the handlers
    OPS[op].onnx(L, helper, read, write) -> [nodes]     its inference form (lowmem/tools/export.py)
    flags: unit (a BN-ReLU unit: own kernel set, own bit width), reads_input (may read the
           network input), in_place (may write the buffer it reads), reads_dst (dst += src),
           accumulates (its input gradient can add to one already there: the input may have
           other consumers)

The walk (schedule.walk) visits the layers once forward (checks, shapes) and
once backward (gradient buffers), calling these; the engine (lowmem/core/engine.py)
builds its plan from `plan` and runs the handlers; nn.check is that same walk;
lowmem/tools/export.py writes `onnx`. Nothing outside this file switches on an op name.

Handlers receive the step (schedule.Step: buffers, shapes, slot and parameter
names, accumulate / scratch) and a runstate.RunState: the arrays, parameters,
statistics, the units' kernel sets, the batch n and the flags, never the engine.

Gradient semantics (lowmem/ops): activation gradients overwrite their buffer
unless `step.accumulate` (a tensor with a second consumer); parameter
gradients accumulate (the engine zeroes them once per backward).

Adding an op: its functions in lowmem/ops, one class here (and its key in
OPS), a builder method in lowmem/core/network.py and lowmem/nn.py (docs/engine.md
walks through the k x k average pool, added that way).
"""
import math

from ..units import quant
from ..system import threads
from ..system.backend import array_module
from .network import NetworkError
from ..ops import (conv2d_forward, conv2d_backward_input, conv2d_backward_weight, conv_out_size,
                  bn_eval_relu_forward, update_running_stats, maxpool_forward, maxpool_backward,
                  avgpool_forward, avgpool_backward, avgpool2d_forward, avgpool2d_backward,
                  linear_forward, linear_backward, softmax_xent_forward, softmax_xent_backward,
                  add_forward)
from ..ops.batchnorm import BN_EPS, ROW_BLOCK
from ..ops import pool, winograd

BN_MOMENTUM = 0.1
MAX_POOL_WINDOW = 16                  # the max-pool argmax is saved as a 4-bit index


class BatchStatisticsError(FloatingPointError):
    """A batch whose statistics are not finite (an input too large for the dtype)."""


class Op:
    """Defaults: a layer that keeps nothing, reads a shared buffer, writes another.

    The flags, read by the walk (schedule.py) and the builder (nn.Graph):
      unit         a BN->ReLU unit: its own kernel set and bit width; a conv may read its output
      reads_input  may read the network input (which sits in its own planned slot)
      in_place     may write the buffer it reads: the builder gives its output its input's
                   buffer when the input dies there (and does not count that read as a conflict)
      reads_dst    dst += src, the residual add: its result stays in the buffer it adds into
                   (res), so that operand (the skip) is consumed in place, and both operands
                   share the output's gradient (so the other, the branch, may feed only it)
      accumulates  its backward can add its input gradient to one already there, so its input
                   may also feed other layers; without it (a pool), the input gradient is
                   written over a free buffer (`Op.route`) and the input may feed other layers
                   only before this one"""
    unit = reads_input = in_place = reads_dst = accumulates = False
    builder = ""            # its nn.Graph method, where the name differs from the op
    @staticmethod
    def check(L, shape, walk):
        pass

    @staticmethod
    def plan(L, N, in_shape, out_shape, units, dtype, budget):
        return []

    @staticmethod
    def temporary(L, out_shape, itemsize):
        """(what, bytes): a bound on the NumPy temporaries one call allocates beyond the plan
        (the engine states the largest per `what` in the plan), or None."""
        return None

    @staticmethod
    def slots(step, saved):
        return saved.get(step.name, ())

    @staticmethod
    def route(L, walk):
        """An op whose input gradient overwrites a free buffer (a pool: it cannot accumulate)."""
        dout, t = walk.output_grad(L), walk.tin[L.name]
        walk.no_sum_into_shared(L, t)
        if t in walk.live:
            raise NetworkError(f"{L.op} {L.name!r}: its input also feeds a later layer; a {L.op}'s "
                               f"backward writes its input gradient, so that gradient would be lost")
        dx = walk.live[t] = walk.free(L, dout)
        walk.step(L, dout=dout, dx=dx)


def _window_shape(L, shape):
    c, h, w = shape
    return c, conv_out_size(h, L.k, L.stride, L.pad), conv_out_size(w, L.k, L.stride, L.pad)


def _channels(L, shape):
    if shape[0] != L.cin:
        raise NetworkError(f"layer {L.name!r}: expects {L.cin} input channels, {L.src} holds {shape[0]}")


class Conv(Op):
    reads_input = accumulates = True

    @staticmethod
    def out_shape(L, shape):
        return (L.cout,) + _window_shape(L, shape)[1:]

    @staticmethod
    def check(L, shape, walk):
        _channels(L, shape)
        made_by = walk.producer.get(walk.tin[L.name])
        if made_by is not None and not OPS[made_by.op].unit:
            raise NetworkError(f"conv {L.name!r} reads {L.src} as written by {made_by.op} "
                               f"{made_by.name!r}; a conv must read the input or a BN->ReLU output "
                               f"(backward rebuilds its input from that unit's saved x-hat)")

    @staticmethod
    def plan(L, N, in_shape, out_shape, units, dtype, budget):
        # im2col columns for as many samples as the workspace budget allows (one at least);
        # every conv shares the one "conv.cols" workspace (the plan keeps the largest)
        per_sample = L.cin * L.k * L.k * out_shape[1] * out_shape[2]
        return [("conv.cols", "workspace", (per_sample * min(N, max(1, budget // per_sample)),), dtype)]

    @staticmethod
    def temporary(L, out_shape, itemsize):
        nbytes = winograd.temporary_bytes([(L.k, L.stride, L.pad, L.cin, L.cout)], f"f{itemsize}")
        return ("Winograd filter tiles", nbytes) if nbytes else None

    @staticmethod
    def route(L, walk):
        dout, t = walk.output_grad(L), walk.tin[L.name]
        walk.no_sum_into_shared(L, t)
        acc = t in walk.live
        if L.src == "input":                # the stem: the input gradient only on request
            dx = walk.live[t] if acc else walk.free(L, dout)
            walk.live[t] = dx
            walk.step(L, dout=dout, dx=dx, accumulate=acc, optional=True)
            return
        unit = walk.producer[t]
        scratch = walk.free(L, dout)        # the rebuilt input, dead once dW is done
        dx = walk.live[t] = walk.live[t] if acc else scratch
        walk.step(L, dout=dout, dx=dx, accumulate=acc, scratch=scratch, unit=unit.name,
                  unit_params=walk.params(unit))

    @staticmethod
    def forward(run, step):
        L = step.layer
        conv2d_forward(run.act(step.dst, step.out_shape), run.act(step.src, step.in_shape),
                       run.params[step.params[0]].data, L.stride, L.pad, run.arrays["conv.cols"], run.columns)

    @staticmethod
    def backward(run, step):
        # saved: the input, rebuilt exactly (x-hat saved in float) or approximately from the code
        L, p = step.layer, run.params[step.params[0]]
        dout = run.act(step.dout, step.out_shape)
        ws = run.arrays["conv.cols"]
        if step.unit:                                    # relu(gamma*x-hat + beta) into scratch
            g, b = (run.params[n].data for n in step.unit_params)
            units = run.units[step.unit]
            c, h, w = step.in_shape
            units.conv_input(run.rows(step.scratch, step.in_shape),
                             units.saved_view(run.arrays[step.unit_saved], c, run.n * h * w), g, b)
            x = run.act(step.scratch, step.in_shape)
        else:
            x = run.act(step.src, step.in_shape)         # the planned input slot
        conv2d_backward_weight(p.grad, x, dout, L.stride, L.pad, ws, run.columns)
        if step.dx and (run.input_grad or not step.optional):
            conv2d_backward_input(run.act(step.dx, step.in_shape), dout, p.data, L.stride, L.pad,
                                  ws, step.accumulate, run.columns)

    @staticmethod
    def onnx(L, helper, read, write):
        return [helper.make_node("Conv", [read(L.src), L.name + ".weight"], [write(L.dst, L.name)],
                                 name=L.name, kernel_shape=[L.k, L.k], strides=[L.stride] * 2,
                                 pads=[L.pad] * 4)]


class BNReLU(Op):
    """The BN->ReLU unit: its kernel set (run.units[name]) decides what its slot holds."""
    unit = in_place = accumulates = True

    @staticmethod
    def out_shape(L, shape):
        return shape

    @staticmethod
    def check(L, shape, walk):
        _channels(L, shape)

    @staticmethod
    def plan(L, N, in_shape, out_shape, units, dtype, budget):
        c, h, w = in_shape
        shape, dt = units.saved_entry(c, N * h * w, dtype)
        return [(f"{L.name}.{units.saved_suffix}", "saved", shape, dt), (f"{L.name}.rstd", "saved", (c,), dtype)]

    @staticmethod
    def route(L, walk):
        dout, t = walk.output_grad(L), walk.tin[L.name]
        if walk.sharing(dout, None):
            raise NetworkError(f"bnrelu {L.name!r} feeds add {walk.shared_by[dout]!r} whose other operand "
                               f"is still open in backward: the unit writes its input gradient in place "
                               f"over a gradient buffer the two operands share. End the branch with a "
                               f"conv, or compute the skip before the branch")
        walk.no_sum_into_shared(L, t)
        scratch = walk.free(L, dout)        # to decode x-tilde into (units whose slot is a code)
        acc = t in walk.live
        dx = walk.live[t] = walk.live[t] if acc else dout     # in place, unless already a gradient
        walk.step(L, dout=dout, dx=dx, accumulate=acc, scratch=scratch if walk.decodes(L) else "")

    @staticmethod
    def forward(run, step):
        g, b = (run.params[n].data for n in step.params)
        x, out = run.rows(step.src, step.in_shape), run.rows(step.dst, step.out_shape)
        running_mean = run.stats[step.layer.name + ".running_mean"]
        running_var = run.stats[step.layer.name + ".running_var"]
        if not run.training:
            bn_eval_relu_forward(out, x, running_mean, running_var, g, b, BN_EPS)
            return
        units = run.units[step.name]
        c, M = x.shape
        mean, var = run.arrays["bn.batch_mean"][:c], run.arrays["bn.batch_var"][:c]
        rstd = run.arrays[step.saved[1]]
        units.stats(mean, var, rstd, x)
        xp = array_module(var)
        if not bool(xp.isfinite(var).all() & xp.isfinite(mean).all()):   # (C,): cheap
            raise BatchStatisticsError(
                f"{step.name}: non-finite batch statistics (the input has values too "
                f"large for {x.dtype}?); the step was refused, running statistics unchanged")
        units.forward(out, units.saved_view(run.arrays[step.saved[0]], c, M), x, mean, rstd, g, b,
                      key=run.keys.get(step.name))
        update_running_stats(running_mean, running_var, mean, var, units.count(M), BN_MOMENTUM)

    @staticmethod
    def backward(run, step):
        # saved: x-hat or its code (the unit's kernel set decides), rstd exact
        g, b = (run.params[n] for n in step.params)
        units = run.units[step.name]
        dr = run.rows(step.dout, step.out_shape)
        units.backward(run.rows(step.dx, step.in_shape), g.grad, b.grad, dr,
                       units.saved_view(run.arrays[step.saved[0]], *dr.shape), run.arrays[step.saved[1]],
                       g.data, b.data, step.accumulate,
                       run.rows(step.scratch, step.in_shape) if step.scratch else None)

    @staticmethod
    def onnx(L, helper, read, write):
        bn = L.name + ".bn"
        stats = [L.name + s for s in (".weight", ".bias", ".running_mean", ".running_var")]
        return [helper.make_node("BatchNormalization", [read(L.src)] + stats, [bn], name=bn, epsilon=BN_EPS),
                helper.make_node("Relu", [bn], [write(L.dst, L.name)], name=L.name)]


class Add(Op):
    """res += src: the residual add. Both inputs share the output's gradient storage."""
    in_place = reads_dst = True

    @staticmethod
    def out_shape(L, shape):
        return shape

    @staticmethod
    def check(L, shape, walk):
        if L.src == "res":
            raise NetworkError(f"add {L.name!r}: res += res is not a residual add; add another buffer into res")
        if walk.version["res"] == 0:
            raise NetworkError(f"add {L.name!r} adds into res before any layer wrote res")
        if walk.shape["res"] != shape:
            raise NetworkError(f"add {L.name!r}: adds {L.src} of shape {shape} to res of "
                               f"shape {walk.shape['res']}; a residual add needs equal shapes")
        walk.skip_of[L.name] = ("res", walk.version["res"])

    @staticmethod
    def route(L, walk):
        dout, t = walk.output_grad(L), walk.tin[L.name]
        if t in walk.live:
            raise NetworkError(f"add {L.name!r}: {L.src} also feeds a layer after the add; the add's "
                               f"operands share one gradient buffer, so that gradient would be lost")
        walk.live[t] = walk.live[walk.skip_of[L.name]] = dout     # branch and skip: the same storage
        walk.shared_by[dout] = L.name
        walk.step(L, dout=dout, dx=dout)

    @staticmethod
    def forward(run, step):
        res = run.act(step.dst, step.out_shape)          # dst is the residual stream
        add_forward(res, run.act(step.src, step.in_shape))

    @staticmethod
    def backward(run, step):
        pass    # both inputs share the output's gradient storage (route)

    @staticmethod
    def onnx(L, helper, read, write):
        a, b = read("res"), read(L.src)
        return [helper.make_node("Add", [a, b], [write("res", L.name)], name=L.name)]


class MaxPool(Op):
    """Max over k x k windows; keeps the 4-bit window index of each maximum (exact)."""
    builder = "max_pool"
    out_shape = staticmethod(_window_shape)

    @staticmethod
    def check(L, shape, walk):
        if L.k * L.k > MAX_POOL_WINDOW:
            raise NetworkError(f"maxpool {L.name!r}: k*k = {L.k * L.k} > {MAX_POOL_WINDOW} "
                               f"(the argmax is saved as a 4-bit index)")

    @staticmethod
    def plan(L, N, in_shape, out_shape, units, dtype, budget):
        co, ho, wo = out_shape
        return [(f"{L.name}.argmax", "saved", (quant.packed_nbytes(co * N * ho * wo, 4),), "uint8"),
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
        return run.arrays[step.saved[0]][:quant.packed_nbytes(co * run.n * ho * wo, 4)]

    @staticmethod
    def forward(run, step):
        L, idx = step.layer, MaxPool._index(run, step)
        maxpool_forward(run.act(step.dst, step.out_shape), idx, run.act(step.src, step.in_shape),
                        L.k, L.stride, L.pad)
        if run.training:
            quant.pack_codes(MaxPool._argmax(run, step), idx.reshape(-1), 4)

    @staticmethod
    def backward(run, step):
        # saved: argmax, exact (a 4-bit window index per output)
        L, idx = step.layer, MaxPool._index(run, step)
        quant.unpack_codes(idx.reshape(-1), MaxPool._argmax(run, step), 4)
        maxpool_backward(run.act(step.dx, step.in_shape), run.act(step.dout, step.out_shape), idx,
                         L.k, L.stride, L.pad)

    @staticmethod
    def onnx(L, helper, read, write):
        return [helper.make_node("MaxPool", [read(L.src)], [write(L.dst, L.name)], name=L.name,
                                 kernel_shape=[L.k, L.k], strides=[L.stride] * 2, pads=[L.pad] * 4)]


class AvgPool2d(Op):
    """Mean over k x k windows (zero padding counted, as PyTorch's default). Keeps nothing:
    its backward needs only the shapes."""
    builder = "avg_pool"
    out_shape = staticmethod(_window_shape)

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
    def onnx(L, helper, read, write):
        return [helper.make_node("AveragePool", [read(L.src)], [write(L.dst, L.name)], name=L.name,
                                 kernel_shape=[L.k, L.k], strides=[L.stride] * 2, pads=[L.pad] * 4,
                                 count_include_pad=1)]


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
        dx = walk.live[walk.tin[L.name]] = walk.free(L)
        walk.step(L, dout="dfeat", dx=dx)

    @staticmethod
    def forward(run, step):
        avgpool_forward(run.batch(step.dst), run.act(step.src, step.in_shape))

    @staticmethod
    def backward(run, step):
        # saved: nothing
        avgpool_backward(run.act(step.dx, step.in_shape), run.batch(step.dout))

    @staticmethod
    def onnx(L, helper, read, write):
        return [helper.make_node("GlobalAveragePool", [read(L.src)], ["pool.out"], name="pool"),
                helper.make_node("Flatten", ["pool.out"], ["feat"], name="flatten", axis=1)]


class Linear(Op):
    """The classifier: reads its input slot (N, C), writes the logits (N, classes)."""

    @staticmethod
    def out_shape(L, shape):
        return L.cout, 1, 1

    @staticmethod
    def plan(L, N, in_shape, out_shape, units, dtype, budget):
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
    def onnx(L, helper, read, write):
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


OPS = {"conv": Conv, "bnrelu": BNReLU, "add": Add, "maxpool": MaxPool, "avgpool2d": AvgPool2d,
       "avgpool": GlobalAvgPool, "linear": Linear, "loss": Loss, "average": Average}
HEAD = ("avgpool", "linear")            # every network ends with these two (Network.head)
STEP_ONLY = ("loss", "average")         # ops of the schedule, never of a network's layers


def step_temporaries(net, out_shape, unit_sizes, N, itemsize, decodes):
    """[(what, bytes)]: bounds on the NumPy temporaries one step allocates beyond the plan
    (lowmem/ops, lowmem/units/quant), which the plan states but does not hold. out_shape: {layer:
    per-sample output shape}; unit_sizes: {unit: its input (C, H, W)}; decodes: some unit's
    kernel set decodes codes through quantizer chunks."""
    weights = [int(math.prod(shape)) for _, shape, _ in net.param_shapes()]
    per = threads.threads() + 1         # conv2d_backward_weight: a partial per thread + the GEMM result
    out = [(f"weight-sized GEMM results (x{per})", per * max(weights) * itemsize)]
    rows = [N * h * w for (_, h, w) in unit_sizes.values()] or [0]
    units = [c * N * h * w for (c, h, w) in unit_sizes.values()] or [0]
    out.append(("a BN row block (x2)", 2 * min(max(units), max(ROW_BLOCK, max(rows))) * itemsize))
    if decodes:
        out.append(("quantizer chunks", (2 * itemsize + 4) * min(quant.CHUNK, max(units))))
    per_op = {}                         # the ops' own bounds (each entry's `temporary`)
    for L in net.layers:
        what, nbytes = OPS[L.op].temporary(L, out_shape[L.name], itemsize) or ("", 0)
        if what:
            per_op[what] = max(per_op.get(what, 0), nbytes)
    return out + list(per_op.items())
