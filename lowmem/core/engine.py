"""The engine: a network -> a schedule and a memory plan -> a training step.

    eng = Engine(net, batch_size=128, input_shape=(3, 32, 32), mode="approx", bits=4)
    print(eng.schedule)          # every step of a training step, with buffers and saved slots
    print(eng.plan.report())     # every allocation, totals by kind
    loss = eng.train_step(x, labels, opt)      # forward, backward, opt.step()

Built once (__init__): `schedule.walk` checks the network (the rules of nn.check,
raising NetworkError), infers every shape and plans the backward buffers; each
BN->ReLU unit gets its kernel set for its own bit width (`units.select_units`),
the convs their im2col / col2im functions (`ops.conv.columns_for`);
`plan.training_plan` sizes every array from shapes alone (the op table,
lowmem/core/optable/, says what each layer keeps); everything is allocated from
the plan at once, and the handlers' view of it is one runstate.RunState.

One training step, in the order the code runs it:
  1. `forward` checks the batch, copies it (and the labels) into the planned
     "input" / "labels" slots, then runs every forward step of the schedule,
     `OPS[step.op].forward(run, step)`: the layers, exact, through the
     shared buffers the walk planned (a pre-activation ResNet: act0, act1
     ping-pong, res for the residual stream), each
     BN->ReLU unit keeping what its kernel set saves (x-hat in float, or its
     packed K-bit code, plus rstd); under data parallelism the average of the
     running statistics over ranks; then the loss.
  2. `backward` zeroes the gradients and runs every backward step: the loss,
     then the layers, last first, through the same buffers, now holding
     gradients (which buffer holds which was decided by the walk); under data
     parallelism, the average of the gradients over ranks.
  3. `opt.step()` (optim.SGD) updates the parameters in place.

Modes:
  exact   x-hat saved in float: gradients equal standard backprop.
  approx  x-hat saved as K-bit codes; forward, loss and logits bit-identical to exact.
  naive   the forward itself continues from the decoded relu(gamma*x-tilde + beta)
          (the paper's baseline: errors compound).

The mode, each unit's bit width and the backend are fixed here, once, in the units'
kernel sets and the conv columns; nothing that runs a step branches on them.
"""
import math

import numpy

from ..system import backend, distributed, threads
from . import checks
from .. import units as kernels
from ..units import stream
from ..units.widths import check_rounding
from ..ops import dropout
from ..ops.codes import codes_for
from ..ops.conv import columns_for
from .optable import OPS, BatchStatisticsError, forward_groups
from .plan import bind_parameters, code_bits, training_plan
from ..system.memory import fmt_bytes
from .runstate import RunState
from .schedule import walk

DTYPES = checks.DTYPES
DEFAULT_WORKSPACE_BYTES = 16 << 20

__all__ = ["Engine", "DTYPES", "DEFAULT_WORKSPACE_BYTES", "BatchStatisticsError"]


class Engine:
    """Built once (plan, schedule, kernel sets, arrays), then runs training steps and predictions."""

    def __init__(self, net, batch_size, input_shape, mode="exact", bits=4, dtype="float32",
                 workspace_bytes=DEFAULT_WORKSPACE_BYTES, allocate=True, use_fast=None,
                 comm=None, sync_bn=False, rounding="nearest", seed=0):
        """bits: K in {1, 2, 4, 8} for every BN-ReLU unit, or a dict {"*": K, "<unit>": K or
        "float"} giving each unit its own width ("*": the default for units not named; "float":
        that unit saves x-hat exactly, as in exact mode; the range codes of conv inputs no unit
        rebuilds take "*", or without it the widest K named). `engine.unit_bits` is {unit: K, or
        None for float}; each unit's kernel set (`engine.selected[unit]`) is chosen here, once.
        Ignored in exact mode (where a dict may only say "float").

        allocate=False builds only the plan and the schedule (no arrays, no weights drawn):
        for printing what a configuration would cost. Such an engine cannot train.

        use_fast: the fused BN-ReLU kernels (numba on NumPy, CUDA on CuPy; lowmem/units).
        None: whenever they apply; False: the reference array ops.

        comm: a lowmem.system.distributed communicator for data-parallel training (batch_size is then
        the per-rank batch; gradients are averaged over ranks after backward). sync_bn: batch
        statistics over all ranks' batches (units/sync.py) instead of per replica.

        rounding: how x-hat becomes a code (docs/quantizer.md): "nearest" (the default, the
        fixed-window code), "stochastic" (the unbiased group-range code: E[x-tilde] = x-hat
        everywhere, the ReLU mask exact), "dither" (the same code with a subtractive dither: its
        decoder removes each element's draw, about half the draw variance) or "stochastic-window" (the
        fixed window with stochastic rounding, unbiased only inside it). Stochastic codes are
        drawn from stream.stream_key(seed, step, unit index) at each element's index in the
        GLOBAL batch (stream.Stream: this rank's shard starts at rank*batch_size), so the draws
        do not depend on how the batch is split over ranks: `engine.step` counts the training
        forwards (set it to resume a run's stream; the Trainer sets it every step)."""
        self.mode, self.bits, self.dtype = checks.engine_args(net, batch_size, mode, bits, dtype)
        self.net, self.N = net, int(batch_size)      # N: the planned batch (a call's batch n <= N)
        self.comm = comm if comm is not None else distributed.SingleProcess()
        self.sync_bn = bool(sync_bn)
        self.input_shape = checks.input_shape(input_shape, net.in_channels)
        self.xp = backend.xp
        self.rounding, self.seed, self.step = check_rounding(rounding), stream.check_key(seed, "seed"), 0
        threads.configure()                       # how lowmem uses the cores (lowmem/system/threads.py), once
        unit_names = [L.name for L in net.layers if getattr(OPS.get(L.op), "unit", False)]
        self.unit_bits = checks.unit_bits(self.bits, self.mode, unit_names)
        ranks = self.comm.size > 1
        # how a conv keeps an input no unit rebuilds: float in exact mode, else a range code
        self.keeper = kernels.keeper(self.xp, checks.code_bits(self.bits, self.mode), use_fast)
        self.schedule = walk(net, self.input_shape, {u for u, K in self.unit_bits.items() if K is not None},
                             average_stats=ranks and not self.sync_bn, average_grads=ranks,
                             keep_codes=self.keeper.decodes)
        self.in_shape, self.out_shape = self.schedule.in_shape, self.schedule.out_shape
        self._unit_sizes = {u: self.in_shape[u] for u in unit_names}
        # every batch norm (units and standalone): the batch-statistics scratch and the batch check
        self._norm_sizes = {L.name: self.in_shape[L.name] for L in net.layers if OPS[L.op].norm}
        self._keyed = [L.name for L in net.layers if OPS[L.op].keyed]      # dropout: its mask's stream
        self.rank_keyed_layers = tuple(self._keyed)     # their draws follow the rank's shard (a resume checks)
        checks.batch_norm(self._norm_sizes, self.N, "batch_size")
        sizes = self._sizes(self.N)
        self.fused = kernels.fused_applies(self.xp, self.dtype, sizes) if use_fast is None else bool(use_fast)
        self.selected = self._select_units(sizes)
        self.plan, self.saved_slots = training_plan(
            net, self.schedule, self.N, self.dtype, self.input_shape, self.selected, self.keeper, self._norm_sizes,
            workspace_bytes, lambda C: kernels.partials_size(self.xp, C, self.fused), self.sync_bn)
        self.nbytes = {e.name: e.nbytes for e in self.plan.entries}
        self.unit_code_bits = code_bits(self.plan, self.saved_slots, self.unit_bits, self._unit_sizes, self.N)
        self.schedule.fill_slots(self.saved_slots, self.nbytes,
                                 checks.width_labels(self.mode, self.unit_bits, self.unit_code_bits))
        self.arrays = self.run = None
        if allocate:
            self.arrays = self.plan.allocate(self.xp)
            bind_parameters(self.arrays, net, self.xp)
            self.selected = self._select_units(sizes, self.arrays)   # with the CUDA set's workspace
            self.run = RunState(self.arrays, dict(net.params), dict(net.stats), self.comm, self.selected,
                                columns_for(self.xp, self.fused), keeper=self.keeper,
                                norms=self._select_norms(), codes=codes_for(self.xp, use_fast))
        self.reference_units = self._select_units(sizes, self.arrays, reference=True)
        self._forward_groups = forward_groups(self.schedule, self.run is not None and self.run.norms.fused)
        self._ready = False                       # saved state holds a training forward
        self._input_grad_buffer = self.schedule.input_grad

    def _select_norms(self):
        """The kernel set of the batch norms with no ReLU after them (kernels.select_norms: fused as
        the units are), synchronized over ranks with sync_bn."""
        norms = kernels.select_norms(self.xp, self.fused, self.keeper, self.arrays.get("bn.partials"))
        return kernels.synchronized_norms(norms, self.comm, self.arrays["sync.bn"]) if self.sync_bn else norms

    @property
    def use_fast(self):
        """Whether the units run on the fused kernels (the public name of `fused`)."""
        return self.fused

    @property
    def units(self):
        """{unit: kernel set} the current (or last) batch runs on."""
        return self.run.units if self.run is not None else self.selected

    # ------------------------------------------------------------ units
    def _sizes(self, n):
        return [n * h * w for (_, h, w) in self._unit_sizes.values()]

    def _select_units(self, sizes, arrays=None, reference=False):
        """{unit: kernel set} for each unit's width: fused or reference (units.select_units),
        synchronized over ranks with sync_bn."""
        if reference:
            units = kernels.reference_units(self.mode, self.unit_bits, self.rounding)
        else:
            partials = arrays.get("bn.partials") if arrays is not None else None
            units = kernels.select_units(self.xp, self.mode, self.unit_bits, self.dtype, sizes, self.fused,
                                         partials=partials, rounding=self.rounding)
        if self.sync_bn:
            buf = arrays["sync.bn"] if arrays is not None else None
            wrapped = {id(u): kernels.synchronized(u, self.comm, buf) for u in units.values()}
            units = {name: wrapped[id(u)] for name, u in units.items()}
        return units

    def split_dependent_units(self, per_rank_batch=None):
        """Coded units whose codes would depend on how a global batch is split over ranks at this
        per-rank batch (default: the planned one): each unit's kernel set says (the unbiased
        code's, when a rank's row n*H*W is not whole groups)."""
        n = self.N if per_rank_batch is None else int(per_rank_batch)
        return [u for u, units in self.selected.items()
                if units.depends_on_split(n * self._unit_sizes[u][1] * self._unit_sizes[u][2])]

    def bits_per_element(self):
        """Bits per element of all coded units' saved slots together, metadata included (None
        when no unit is coded)."""
        if not self.unit_code_bits:
            return None
        elems = {u: math.prod(self._unit_sizes[u]) * self.N for u in self.unit_code_bits}
        return sum(self.unit_code_bits[u] * elems[u] for u in elems) / sum(elems.values())

    def forward(self, x, labels):
        """Training-mode forward of x (N, C, H, W): returns (mean loss, logits (N, K) copy).

        x and labels are copied into the plan: the caller may reuse them at once."""
        self._check_ownership()
        checks.batch(x, self.xp, self.dtype, self.input_shape, self.N, "forward")
        checks.labels(labels, self.xp, x.shape[0], self.net.num_classes)
        checks.batch_norm(self._norm_sizes, x.shape[0], "forward: batch of")
        self._ready = False
        self._start(x, training=True)
        self.run.batch("labels")[...] = labels
        self._sweep("fwd")
        self.step += 1                            # the next training forward draws new streams
        self._ready = True
        return self.run.loss, self.run.batch("logits").copy()

    def predict(self, x):
        """Eval-mode logits (N, K) for any batch N <= batch_size (BN running statistics)."""
        self._check_ownership()
        checks.batch(x, self.xp, self.dtype, self.input_shape, self.N, "predict")
        self._ready = False                       # the saved state is overwritten
        self._start(x, training=False)
        self._sweep("fwd")
        return self.run.batch("logits").copy()

    def _start(self, x, training):
        run = self.run
        run.n, run.training = x.shape[0], training
        # a batch whose units are not whole code bytes runs on the reference kernels, in every
        # mode alike (so exact and approx still compute the same forward)
        aligned = kernels.fused_applies(self.xp, self.dtype, self._sizes(run.n))
        run.units = self.selected if aligned or not self.fused else self.reference_units
        # stochastic rounding: each coded unit's stream key for this training step
        run.keys = {}
        if training and self.rounding != "nearest":
            # keyed by the element's index in the global batch: every rank's shard is run.n samples
            # (distributed.shard splits evenly), rank r's starting at sample r*run.n
            R, r, n = self.comm.size, self.comm.rank, run.n
            run.keys = {u: stream.Stream(stream.stream_key(self.seed, self.step, i),
                                        start=r * n * h * w, row=R * n * h * w)
                        for i, (u, K) in enumerate(self.unit_bits.items()) if K is not None
                        for (_, h, w) in [self._unit_sizes[u]]}
        if training:                              # dropout: each layer's mask stream for this step
            run.keys.update({name: dropout.stream_key(self.seed, self.step, i, self.comm.rank)
                             for i, name in enumerate(self._keyed)})
        self.xp.copyto(run.act("input", self.input_shape), x.transpose(1, 0, 2, 3))

    def _sweep(self, phase, before=None):
        if phase == "fwd":                        # a post-activation block's end may run as one handler
            for handler, steps in self._forward_groups:
                handler(self.run, *steps)
            return
        for step in self.schedule:
            if step.phase == phase:
                if before is not None:
                    before(step)
                OPS[step.op].backward(self.run, step)

    def backward(self, input_grad=False, units=None, before=None, keep=False):
        """Fill p.grad of every parameter (overwriting) for the last forward().

        With input_grad=True also returns d loss / d x as an (N, C, H, W) array.

        For measurements (lowmem/bits/sensitivity.py), the one backward sweep takes three more:
        units: {unit: kernel set} run instead of the sets that wrote the saved state, for this
          sweep only (e.g. x-tilde simulated from an exact engine's float x-hat);
        before(step): called before each backward step runs (the loss first, then the layers,
          last first), when the step's incoming gradient is in its buffer;
        keep=True: the forward's saved state may be swept again (exact mode only: its backward
          reads the float x-hat slots and overwrites none of them)."""
        if not self._ready:
            raise RuntimeError("backward() needs a training forward() first "
                               "(predict() and a previous backward() consume the saved state)")
        self._check_ownership()
        if keep and self.mode != "exact":
            raise ValueError(f"backward(keep=True) sweeps the saved state again, which only exact "
                             f"mode leaves intact; this engine's mode is {self.mode}")
        unknown = sorted(set(units or ()) - set(self.run.units))
        if unknown:
            raise ValueError(f"backward(units=...): unknown unit(s) {', '.join(map(repr, unknown))}; "
                             f"the units are {', '.join(self.run.units)}")
        self._ready = bool(keep)
        self.arrays["grads"].fill(0)
        self.run.input_grad = bool(input_grad)
        wrote = self.run.units                     # the sets that wrote the saved state
        self.run.units = {**wrote, **units} if units else wrote
        try:
            self._sweep("bwd", before)
        finally:
            self.run.units = wrote
        if input_grad:
            return self.run.act(self._input_grad_buffer, self.input_shape).transpose(1, 0, 2, 3).copy()
        return None

    def train_step(self, x, labels, opt, return_logits=False):
        """forward + backward + opt.step(); returns the loss (with return_logits: the loss and the
        logits (n, K) copy forward returned). A non-finite loss raises FloatingPointError before
        any parameter changes."""
        if not callable(getattr(opt, "step", None)):
            raise TypeError(f"train_step needs an optimizer with a step() method (lowmem.SGD), "
                            f"got {type(opt).__name__}")
        loss, logits = self.forward(x, labels)
        if not numpy.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss} (learning rate too high?)")
        self.backward()
        opt.step()
        return (loss, logits) if return_logits else loss

    # ------------------------------------------------------------ checks, summary
    def _check_ownership(self):
        checks.owns(self.arrays, self.run and self.run.params, self.net.name)

    def summary(self):
        """One line: the network, batch, mode and widths, dtype and the planned bytes."""
        by = self.plan.bytes_by_kind()
        metadata = any(b > self.unit_bits[u] * 1.001 for u, b in self.unit_code_bits.items())   # group ends
        return (f"{self.net.name}: {self.net.num_params():,} params, batch {self.N}, "
                f"input {self.input_shape}, mode {self.mode}"
                + (f" ({checks.bits_label(self.mode, self.unit_bits)}"
                   + checks.rounding_label(self.rounding, self.unit_bits.values())
                   + (f", {self.bits_per_element():.4g} bits/elem" if metadata else "") + ")"
                   if self.mode != "exact" and self.unit_bits else "")
                + f", {self.dtype}; planned {fmt_bytes(self.plan.total_bytes)} "
                  f"(saved {fmt_bytes(by['saved'])}, buffers {fmt_bytes(by['buffers'])})")

