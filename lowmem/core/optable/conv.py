"""The conv's entry: k x k convolution, optionally grouped (depthwise when every group has one
channel) and with a bias.

Its weight gradient needs the conv's input, which it gets one of three ways (decided by the
walk, printed in the schedule): the network input's own planned slot; a BN->ReLU unit's
output, rebuilt as relu(gamma*x-hat + beta) from that unit's saved x-hat (nothing kept by
the conv); any other tensor (a pool, an add, a ReLU alone, another conv), kept once, in a
saved slot named after the layer that made it ("<layer>.out", shared by every conv reading
that tensor): exactly in float in exact mode, else as a K-bit range code with 0 an exact
level (lowmem/units/rangecode.py, the engine's `keeper`), decoded into a free buffer for
backward, except where a depthwise conv's kernels decode the code themselves (`coded_input`).
Its input gradient needs only the weights. `keep_input` and `layer_input` say the
same for the linear layers (optable/dense.py)."""
from ...ops import (conv2d_forward, conv2d_backward, conv2d_backward_weight, grouped_conv2d_forward,
                    grouped_conv2d_backward_input, grouped_conv2d_backward_weight, conv_bias_forward,
                    conv_bias_backward)
from ...ops import conv_groups, winograd
from ...ops.conv_groups import workspace_per_sample
from ...units import rangecode
from ...system import threads
from ..network import NetworkError
from .base import Op, channels, window_shape

INPUT = ("input", 0)        # the network input, as a (buffer, version) tensor


def keep_input(L, walk):
    """Where the backward of L (a conv or a linear layer) finds its input (walk.extra): the input
    slot; nothing to say for a unit's output (rebuilt from its code); else a slot named after
    the input's producer, filled by the first layer reading it (keep) and read by every one."""
    t = walk.tin[L.name][0]
    made_by = walk.producer.get(t)
    if t == INPUT:
        walk.extra[L.name] = dict(input_slot="input")
    elif made_by is not None and not walk.is_unit(made_by):
        slot = walk.kept.get(t)
        if slot is None:                         # the first layer to read it keeps it
            slot = walk.kept[t] = f"{made_by.name}.out"
            walk.extra[L.name] = dict(keep=slot, input_slot=slot)
        else:
            walk.extra[L.name] = dict(input_slot=slot)


def layer_input(run, step):
    """The (C, n, H, W) input of a conv's or linear layer's backward step: rebuilt from a
    unit's code into scratch, decoded from a kept range code into scratch, or read where it
    sits (the input slot, a kept float copy)."""
    if step.unit:                                    # relu(gamma*x-hat + beta) into scratch
        g, b = (run.params[n].data for n in step.unit_params)
        units = run.units[step.unit]
        c, h, w = step.in_shape
        units.conv_input(run.rows(step.scratch, step.in_shape),
                         units.saved_view(run.arrays[step.unit_saved], c, run.n * h * w), g, b)
        return run.act(step.scratch, step.in_shape)
    if step.scratch:                                 # a kept range code, decoded
        x = run.act(step.scratch, step.in_shape)
        run.keeper.restore(x.reshape(-1), [run.arrays[n] for n in step.saved])
        return x
    return run.act(step.saved[0] if step.saved else step.input_slot, step.in_shape)   # input, float copy


def coded_input(run, step, dout, w):
    """(kernels, code) where a depthwise conv's weight gradient reads its input's kept range code
    itself (ops/depthwise_cpu.py, depthwise_gpu.py: decoded block by block into the kernel's own
    scratch, or where each product reads it), so nothing decodes it into a buffer first; None
    otherwise (the input is decoded, rebuilt or read where it sits: layer_input)."""
    L = step.layer
    code = getattr(run.keeper, "code", None)
    if not step.scratch or step.unit or code is None or not (L.groups > 1 and L.groups == L.cin == L.cout):
        return None
    kernels = run.columns.depthwise if run.columns is not None else None
    if kernels is None or not hasattr(kernels, "backward_weight_coded"):
        return None
    c, h, wd = step.in_shape
    kept = code([run.arrays[n] for n in step.saved], c * run.n * h * wd)
    return (kernels, kept) if kernels.applies_coded(dout, w, kept) else None


class Conv(Op):

    @staticmethod
    def out_shape(L, shape):
        return (L.cout,) + window_shape(L, shape)[1:]

    @staticmethod
    def check(L, shape, walk):
        channels(L, shape)
        if not isinstance(L.groups, int) or L.groups < 1 or L.cin % L.groups or L.cout % L.groups:
            raise NetworkError(f"conv {L.name!r}: groups={L.groups!r} must be an int >= 1 dividing its "
                               f"{L.cin} input and {L.cout} output channels")
        keep_input(L, walk)

    @staticmethod
    def plan(step, N, units, dtype, budget):
        # im2col columns for as many samples as the workspace budget allows (one at least);
        # every conv shares the one "conv.cols" workspace (the plan keeps the largest)
        L, (c, h, w), (_, ho, wo) = step.layer, step.in_shape, step.out_shape
        per_sample = workspace_per_sample(L.cin, L.k, L.k, ho, wo, L.groups, L.cout)   # one group's
        out = [("conv.cols", "workspace", (per_sample * min(N, max(1, budget // max(per_sample, 1))),), dtype)]
        if step.keep:                                # its input: float, or a range code (units=keeper)
            out += units.entries(step.keep, c * N * h * w, dtype)
        return out

    @staticmethod
    def slots(step, saved):
        if step.phase == "fwd":
            return tuple(saved.get(step.name, ())) if step.keep else ()
        if step.input_slot in ("", "input"):
            return ()
        return tuple(saved.get(("kept", step.input_slot), (step.input_slot,)))

    @staticmethod
    def temporary(L, out_shape, itemsize):
        if L.groups > 1 and L.groups == L.cin == L.cout:  # the depthwise path: its blocks (ops/conv_groups.py)
            h, w = (o * L.stride + L.k for o in out_shape[1:])    # at least the input's plane
            return "a depthwise conv block", conv_groups.scratch_bytes(
                L.cin, L.cout, L.groups, h, w, out_shape[1], out_shape[2], itemsize, threads.threads())
        g = L.groups
        nbytes = winograd.temporary_bytes([(L.k, L.stride, L.pad, L.cin // g, L.cout // g) + tuple(out_shape[1:])],
                                          f"f{itemsize}")
        return ("Winograd filter tiles", nbytes) if nbytes else None

    @staticmethod
    def route(L, walk):
        dout, t = walk.output_grad(L), walk.tin[L.name][0]
        slot = walk.extra.get(L.name, {}).get("input_slot", "")
        if slot == "input" or (slot and not walk.keep_codes):   # read where it sits (input, float slot)
            dx, acc = walk.grad_for(L, t, dout, reading=(dout,))
            walk.step(L, dout=dout, dx=dx, accumulate=acc, optional=(t == INPUT), input_slot=slot)
            return
        if slot:                            # a range code: decoded into scratch, which dx may reuse
            acc = t in walk.live
            if acc:
                walk.own(L, t, reading=(dout,), busy=(dout,))
            scratch = walk.free(L, dout)
            dx = walk.live[t] = walk.live[t] if acc else scratch
            walk.step(L, dout=dout, dx=dx, accumulate=acc, scratch=scratch, input_slot=slot)
            return
        unit = walk.producer[t]
        acc = t in walk.live
        if acc:
            walk.own(L, t, reading=(dout,), busy=(dout,))
        scratch = walk.free(L, dout)        # the rebuilt input, dead once dW is done
        dx = walk.live[t] = walk.live[t] if acc else scratch
        walk.step(L, dout=dout, dx=dx, accumulate=acc, scratch=scratch, unit=unit.name,
                  unit_params=walk.params(unit))

    @staticmethod
    def forward(run, step):
        L = step.layer
        x = run.act(step.src, step.in_shape)
        if step.keep and run.training:
            run.keeper.keep([run.arrays[n] for n in step.saved], x.reshape(-1))
        out, w = run.act(step.dst, step.out_shape), run.params[step.params[0]].data
        if L.groups == 1:
            conv2d_forward(out, x, w, L.stride, L.pad, run.arrays["conv.cols"], run.columns)
        else:
            grouped_conv2d_forward(out, x, w, L.stride, L.pad, L.groups, run.arrays["conv.cols"],
                                   columns=run.columns)
        if L.bias:
            conv_bias_forward(out, run.params[step.params[1]].data)

    @staticmethod
    def backward(run, step):
        # saved: the input, exact (the input slot, a kept copy, a unit's float x-hat) or
        # approximate (rebuilt from a unit's code)
        L, p = step.layer, run.params[step.params[0]]
        dout = run.act(step.dout, step.out_shape)
        ws = run.arrays["conv.cols"]
        coded = coded_input(run, step, dout, p.data)
        if L.bias:
            conv_bias_backward(run.params[step.params[1]].grad, dout)
        both = step.dx and (run.input_grad or not step.optional)
        if L.groups == 1:                           # both gradients at once: side by side where the conv is small
            x = layer_input(run, step)
            if both:
                conv2d_backward(p.grad, run.act(step.dx, step.in_shape), x, dout, p.data, L.stride, L.pad, ws,
                                step.accumulate, run.columns)
            else:
                conv2d_backward_weight(p.grad, x, dout, L.stride, L.pad, ws, run.columns)
            return
        if coded is not None:                       # the kernel decodes the kept code itself (depthwise)
            kernels, code = coded
            kernels.backward_weight_coded(p.grad, code, (L.cin, run.n) + step.in_shape[1:], dout, L.stride, L.pad,
                                          rangecode.GROUP)
        else:
            grouped_conv2d_backward_weight(p.grad, layer_input(run, step), dout, L.stride, L.pad, L.groups, ws,
                                           run.columns)
        if both:
            grouped_conv2d_backward_input(run.act(step.dx, step.in_shape), dout, p.data, L.stride, L.pad, L.groups,
                                          ws, step.accumulate, run.columns)

    @staticmethod
    def onnx(L, helper, read, write, opset):
        inputs = [read(L.src), L.name + ".weight"] + ([L.name + ".bias"] if L.bias else [])
        return [helper.make_node("Conv", inputs, [write(L.dst, L.name)], name=L.name, kernel_shape=[L.k, L.k],
                                 strides=[L.stride] * 2, pads=[L.pad] * 4, group=L.groups)]
