"""The batch norms' entries: the BN->ReLU unit (batch norm, affine, batch statistics in
training, running statistics in eval, then ReLU; its kernel set, run.units[name] in
lowmem/units, decides what its slot holds: x-hat in float, or its packed K-bit code) and a
batch norm with no ReLU after it (x-hat in float in exact mode, else a K-bit range code).
rstd is kept exactly by both."""
from ...system.backend import array_module
from ...ops import bn_eval_relu_forward, update_running_stats, bn_eval_forward
from ...ops.batchnorm import BN_EPS
from .base import BN_MOMENTUM, BatchStatisticsError, Op, channels, same_shape


class BNReLU(Op):
    """The BN->ReLU unit: its kernel set (run.units[name]) decides what its slot holds."""
    unit = in_place = norm = True
    out_shape = staticmethod(same_shape)

    @staticmethod
    def check(L, shape, walk):
        channels(L, shape)

    @staticmethod
    def plan(step, N, units, dtype, budget):
        L, (c, h, w) = step.layer, step.in_shape
        shape, dt = units.saved_entry(c, N * h * w, dtype)
        return [(f"{L.name}.{units.saved_suffix}", "saved", shape, dt), (f"{L.name}.rstd", "saved", (c,), dtype)]

    @staticmethod
    def route(L, walk):
        # the unit masks its output gradient in place (a copy of it, when another tensor's
        # gradient shares that buffer); the input gradient overwrites it, unless the input has
        # a gradient already (then it adds to it)
        dout, t = walk.consumable(L, walk.output_grad(L)), walk.tin[L.name][0]
        dx, acc = walk.grad_for(L, t, dout, in_place=dout, reading=(dout,))
        scratch = walk.free(L, dout, dx)    # to decode x-tilde into (units whose slot is a code)
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
    def onnx(L, helper, read, write, opset):
        bn = L.name + ".bn"
        stats = [L.name + s for s in (".weight", ".bias", ".running_mean", ".running_var")]
        return [helper.make_node("BatchNormalization", [read(L.src)] + stats, [bn], name=bn, epsilon=BN_EPS),
                helper.make_node("Relu", [bn], [write(L.dst, L.name)], name=L.name)]


class BN(Op):
    """Batch norm with no ReLU after it (affine, batch statistics in training, running
    statistics in eval): keeps x-hat the way convs keep their inputs (the engine's keeper: float
    in exact mode, else a K-bit range code, lowmem/units/rangecode.py; no mask to split) and
    rstd, exactly. Its kernels: run.norms (lowmem/units/norm.py), chosen once per engine."""
    in_place = norm = True
    out_shape = staticmethod(same_shape)

    @staticmethod
    def check(L, shape, walk):
        channels(L, shape)

    @staticmethod
    def plan(step, N, units, dtype, budget):
        L, (c, h, w) = step.layer, step.in_shape
        return units.entries(f"{L.name}.xhat", c * N * h * w, dtype) + [(f"{L.name}.rstd", "saved", (c,), dtype)]

    @staticmethod
    def route(L, walk):
        # its backward reads the output gradient only: the input gradient may overwrite it
        dout, t = walk.output_grad(L), walk.tin[L.name][0]
        dx, acc = walk.grad_for(L, t, dout, in_place=dout, reading=(dout,))
        scratch = walk.free(L, dout, dx) if walk.keep_codes else ""    # x-hat decoded there
        walk.step(L, dout=dout, dx=dx, accumulate=acc, scratch=scratch)

    @staticmethod
    def forward(run, step):
        g, b = (run.params[n].data for n in step.params)
        x, out = run.rows(step.src, step.in_shape), run.rows(step.dst, step.out_shape)
        running_mean = run.stats[step.layer.name + ".running_mean"]
        running_var = run.stats[step.layer.name + ".running_var"]
        if not run.training:
            bn_eval_forward(out, x, running_mean, running_var, g, b, BN_EPS)
            return
        c, M = x.shape
        mean, var = run.arrays["bn.batch_mean"][:c], run.arrays["bn.batch_var"][:c]
        rstd, slots = run.arrays[step.saved[-1]], [run.arrays[n] for n in step.saved[:-1]]
        run.norms.stats(mean, var, rstd, x)
        _check_statistics(step, x, mean, var)
        run.norms.forward(out, slots, x, mean, rstd, g, b)     # x-hat kept, out = g*x-hat + b (may alias x)
        update_running_stats(running_mean, running_var, mean, var, run.norms.count(M), BN_MOMENTUM)

    @staticmethod
    def forward_add_relu(run, bn, add, relu):
        """The steps bn, add, relu of a post-activation block's end (a ResNet's BN -> + identity ->
        ReLU, optable.forward_groups found them: the BN's output read by the add alone, the add's
        by the ReLU alone) in one pass in training: what the three forwards leave (the BN's and
        the ReLU's saved slots, relu(gamma*x-hat + beta + identity) in the ReLU's buffer), bit for
        bit, without writing the two tensors between them. Training only (eval runs the three)."""
        g, b = (run.params[n].data for n in bn.params)
        x = run.rows(bn.src, bn.in_shape)
        other = run.rows(next(r for r in add.layer.reads if r != bn.dst), add.in_shape)
        out = run.rows(relu.dst, relu.out_shape)
        running_mean = run.stats[bn.layer.name + ".running_mean"]
        running_var = run.stats[bn.layer.name + ".running_var"]
        c, M = x.shape
        mean, var = run.arrays["bn.batch_mean"][:c], run.arrays["bn.batch_var"][:c]
        rstd, slots = run.arrays[bn.saved[-1]], [run.arrays[n] for n in bn.saved[:-1]]
        run.norms.stats(mean, var, rstd, x)
        _check_statistics(bn, x, mean, var)
        mask = run.arrays[relu.saved[0]][:(c * M + 7) // 8]
        run.norms.forward_add_relu(out, mask, slots, x, other, mean, rstd, g, b, run.rows(bn.dst, bn.out_shape))
        update_running_stats(running_mean, running_var, mean, var, run.norms.count(M), BN_MOMENTUM)

    @staticmethod
    def backward(run, step):
        # saved: x-hat, exact (float) or approximate (its range code), and rstd exact
        g, b = (run.params[n] for n in step.params)
        run.norms.backward(run.rows(step.dx, step.in_shape), g.grad, b.grad, run.rows(step.dout, step.out_shape),
                           [run.arrays[n] for n in step.saved[:-1]], run.arrays[step.saved[-1]], g.data,
                           step.accumulate, run.rows(step.scratch, step.in_shape) if step.scratch else None)

    @staticmethod
    def onnx(L, helper, read, write, opset):
        stats = [L.name + s for s in (".weight", ".bias", ".running_mean", ".running_var")]
        return [helper.make_node("BatchNormalization", [read(L.src)] + stats, [write(L.dst, L.name)],
                                 name=L.name, epsilon=BN_EPS)]


def _check_statistics(step, x, mean, var):
    """Refuse the step (nothing written yet) when a batch statistic is not finite."""
    xp = array_module(var)
    if not bool(xp.isfinite(var).all() & xp.isfinite(mean).all()):   # (C,): cheap
        raise BatchStatisticsError(
            f"{step.name}: non-finite batch statistics (the input has values too "
            f"large for {x.dtype}?); the step was refused, running statistics unchanged")

