"""What a running step may touch: the one object the op handlers (lowmem/core/optable/) receive.

The engine (lowmem/core/engine.py) builds one RunState when it allocates its plan and
sets the per-call fields (`n`, `training`, `input_grad`, `units`) at the start of
each forward or backward. A handler reads its `schedule.Step` and this, nothing else:

    arrays      {plan entry name: array} (lowmem/core/plan.py): buffers, slots, workspaces
    params      {name: network.Parameter}: .data and .grad (views into the plan)
    stats       {name: BN running statistic} (views into the plan's "bn.running")
    units       {BN-ReLU unit name: its kernel set} for the current batch (lowmem/units)
    columns     the conv's im2col / col2im functions (ops.conv.Columns), chosen once
    comm        the data-parallel communicator (lowmem/system/distributed.py)
    n           the current batch size (<= the planned N)
    training    a training forward (batch statistics, saved state) or eval (running statistics)
    input_grad  backward also computes the gradient of the network input
    loss        the mean loss of the last training forward (the loss step writes it)
    keys        {unit or dropout layer: its stream key} for the current training forward
    keeper      how a conv keeps an input no unit rebuilds (lowmem/units/rangecode.py), chosen once
    norms       the kernels of a batch norm with no ReLU after it (lowmem/units/norm.py), chosen once
    codes       the ops that keep a packed code: ReLU, ReLU6, dropout, max-pool (lowmem/ops/codes.py), chosen once
"""
from dataclasses import dataclass, field


@dataclass
class RunState:
    arrays: dict
    params: dict
    stats: dict
    comm: object
    units: dict = field(default_factory=dict)
    columns: object = None
    n: int = 0
    training: bool = False
    input_grad: bool = False
    loss: float = None
    keys: dict = field(default_factory=dict)
    keeper: object = None
    norms: object = None
    codes: object = None

    def act(self, buf, shape):
        """(C, n, H, W) view at the start of a flat buffer (or the input slot), shape = (C, H, W)."""
        c, h, w = shape
        return self.arrays[buf][:c * self.n * h * w].reshape(c, self.n, h, w)

    def rows(self, buf, shape):
        """The same as (C, n*H*W) rows."""
        c, h, w = shape
        return self.arrays[buf][:c * self.n * h * w].reshape(c, self.n * h * w)

    def batch(self, name):
        """A per-sample array ("logits", "labels", "<fc>.input", ...) for the current batch: [:n]."""
        return self.arrays[name][:self.n]
