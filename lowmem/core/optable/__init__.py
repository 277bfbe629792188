"""The op table: everything lowmem knows about each op, in one entry per op.

    OPS[op].out_shape(L, (c, h, w), ...) -> (c, h, w)   per-sample output shape (one shape per input)
    OPS[op].check(L, shape, walk)                  its rules on the layer record (raise NetworkError)
    OPS[op].route(L, walk)                         backward: which buffer receives its input gradient
    OPS[op].plan(step, N, units, dtype, budget) -> [(name, kind, shape, dtype)]
                                                   what it keeps for backward ("saved") and its
                                                   scratch ("workspace") in the memory plan
    OPS[op].slots(step, saved)                     the saved slots a step fills or reads (printed)
    OPS[op].forward(run, step), .backward(run, step)    the handlers
    OPS[op].onnx(L, helper, read, write, opset) -> [nodes]     its inference form at that ONNX opset
                                                        (lowmem/formats/onnx_export.py)
    flags: unit (a BN-ReLU unit: own kernel set, own bit width), in_place (may write a buffer
           it reads), several (reads Layer.inputs, not one src)

The entries, by family: base.py (the defaults), conv.py, dense.py (flatten + linear), norm.py (the BN->ReLU unit, batch
norm alone), activations.py (ReLU, ReLU6, dropout), pools.py, graph.py (add, concat; the
backward-only copy and addgrad steps), head.py (global pool, linear, loss, data-parallel
averages).

The walk (schedule.walk) visits the layers once forward (checks, shapes) and
once backward (gradient buffers), calling these; the engine (lowmem/core/engine.py)
builds its plan from `plan` and runs the handlers; nn.check is that same walk;
lowmem/formats/onnx_export.py writes `onnx`. Nothing outside this package switches on an op name.

Handlers receive the step (schedule.Step: buffers, shapes, slot and parameter
names, accumulate / scratch) and a runstate.RunState: the arrays, parameters,
statistics, the units' kernel sets, the batch n and the flags, never the engine.

Gradient semantics (lowmem/ops): activation gradients overwrite their buffer
unless `step.accumulate` (a tensor with a second consumer); parameter
gradients accumulate (the engine zeroes them once per backward).

Adding an op: its functions in lowmem/ops, one class in the family's module here (and
its key in OPS), a builder method in lowmem/core/network.py and lowmem/nn.py
(docs/engine_appendix.md lists the files the k x k average pool touched; docs/new_op.md adds
an op that keeps a mask, from outside the package).
"""
import math

from ...units import norm_cpu, packing
from ...system import threads
from ...ops.batchnorm import ROW_BLOCK
from .base import BN_MOMENTUM, MAX_POOL_WINDOW, BatchStatisticsError, Op
from .conv import Conv
from .dense import FlattenLinear
from .activations import Dropout, ReLU, ReLU6
from .graph import Add, AddGrad, Concat, Copy
from .head import Average, GlobalAvgPool, Linear, Loss
from .norm import BN, BNReLU
from .pools import AvgPool2d, MaxPool

__all__ = ["OPS", "HEAD", "STEP_ONLY", "BN_MOMENTUM", "MAX_POOL_WINDOW", "BatchStatisticsError", "Op",
           "step_temporaries", "forward_groups"]

OPS = {"conv": Conv, "flatten_linear": FlattenLinear, "bnrelu": BNReLU, "bn": BN, "relu": ReLU, "relu6": ReLU6, "dropout": Dropout,
       "add": Add, "concat": Concat, "maxpool": MaxPool, "avgpool2d": AvgPool2d,
       "avgpool": GlobalAvgPool, "linear": Linear, "loss": Loss, "average": Average,
       "copy": Copy, "addgrad": AddGrad}
HEAD = ("avgpool", "linear")            # every network ends with these two (Network.head)
STEP_ONLY = ("loss", "average", "copy", "addgrad")   # ops of the schedule, never of a network's layers


def step_temporaries(net, out_shape, unit_sizes, N, itemsize, decodes):
    """[(what, bytes)]: bounds on the NumPy temporaries one step allocates beyond the plan
    (lowmem/ops, lowmem/units/window.py), which the plan states but does not hold. out_shape: {layer:
    per-sample output shape}; unit_sizes: {batch norm: its input (C, H, W)}; decodes: some unit's
    kernel set decodes codes through quantizer chunks."""
    weights = [int(math.prod(shape)) for _, shape, _ in net.param_shapes()]
    per = threads.threads() + 1         # conv2d_backward_weight: a partial per thread + the GEMM result
    out = [(f"weight-sized GEMM results (x{per})", per * max(weights) * itemsize)]
    rows = [N * h * w for (_, h, w) in unit_sizes.values()] or [0]
    units = [c * N * h * w for (c, h, w) in unit_sizes.values()] or [0]
    out.append(("a BN row block (x2)", 2 * min(max(units), max(ROW_BLOCK, max(rows))) * itemsize))
    if decodes:
        out.append(("quantizer chunks", (2 * itemsize + 4) * min(packing.CHUNK, max(units))))
    bn_rows = [N * h * w * itemsize for L in net.layers if L.op == "bn" for (_, h, w) in [out_shape[L.name]]]
    bn_rows = [r for r in bn_rows if r <= norm_cpu.ROW_BYTES]
    if bn_rows and norm_cpu.AVAILABLE:  # a batch norm alone's coded backward: a decoded row per thread
        out.append((f"a batch norm's decoded x-hat row (x{threads.threads()})", threads.threads() * max(bn_rows)))
    per_op = {}                         # the ops' own bounds (each entry's `temporary`)
    for L in net.layers:
        what, nbytes = OPS[L.op].temporary(L, out_shape[L.name], itemsize) or ("", 0)
        if what:
            per_op[what] = max(per_op.get(what, 0), nbytes)
    return out + list(per_op.items())


def _reads(step):
    """The buffers a forward step reads."""
    return set(step.layer.reads) if OPS[step.op].several else {step.src}


def _dead_after(steps, j, buf):
    """Whether no forward step after steps[j] reads buf before one writes it (its tensor then has
    no reader left; backward reads no forward buffer)."""
    for later in steps[j + 1:]:
        if buf in _reads(later):
            return False
        if later.dst == buf:
            return True
    return True


def _block_end(run, bn, add, relu):
    """A post-activation block's end: one pass in training (BN.forward_add_relu), its three
    forwards in eval."""
    if run.training:
        BN.forward_add_relu(run, bn, add, relu)
        return
    for s in (bn, add, relu):
        OPS[s.op].forward(run, s)


def forward_groups(schedule, fused):
    """[(handler, steps)]: the forward sweep, each step's own handler, except that with the fused
    batch-norm kernels (`fused`: the engine's norms set has them) a batch norm whose output only
    the next step, an add, reads, and whose add's output only the step after, a ReLU, reads,
    runs as one handler for the three (_block_end: a post-activation block's end)."""
    steps = [s for s in schedule if s.phase == "fwd"]
    groups, i = [], 0
    while i < len(steps):
        s = steps[i]
        if fused and s.op == "bn" and i + 2 < len(steps):
            add, relu = steps[i + 1], steps[i + 2]
            if (add.op == "add" and relu.op == "relu" and s.dst in add.layer.reads and relu.src == add.dst
                    and list(add.layer.reads).count(s.dst) == 1
                    and (add.dst == s.dst or _dead_after(steps, i + 1, s.dst))
                    and (relu.dst == add.dst or _dead_after(steps, i + 2, add.dst))):
                groups.append((_block_end, (s, add, relu)))
                i += 3
                continue
        groups.append((OPS[s.op].forward, (s,)))
        i += 1
    return groups
