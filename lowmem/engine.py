"""The engine: a network -> a memory plan and a schedule -> a training step.

    eng = Engine(net, batch_size=128, input_shape=(3, 32, 32), mode="approx", bits=4)
    print(eng.schedule)          # every forward and backward step, with buffers and saved slots
    print(eng.plan.report())     # every allocation, totals by kind
    loss = eng.train_step(x, labels, opt)      # forward, backward, opt.step()

One training step, in the order the code runs it:
  1. `forward` checks the batch, copies it (and the labels) into the planned
     "input" / "labels" slots, then runs every forward step of the schedule:
     `layers.OPS[step.op].forward(self, step)`. Forward is exact; it runs
     through three shared buffers (act0, act1 ping-pong, res for the residual
     stream). A BN->ReLU unit keeps what its kernel set (lowmem/kernels)
     saves: x-hat in float ("exact") or its packed K-bit code ("approx",
     "naive"), plus rstd. Then the loss.
  2. `backward` zeroes the gradients and runs every backward step, last layer
     first, through the same three buffers, now holding gradients; which
     buffer holds which gradient was decided once, by schedule.plan_backward.
  3. `opt.step()` (optim.SGD) updates the parameters in place.

Modes:
  exact   x-hat saved in float: gradients equal standard backprop.
  approx  x-hat saved as K-bit codes; forward, loss and logits bit-identical to exact.
  naive   the forward itself continues from the decoded relu(gamma*x-tilde + beta)
          (the paper's baseline: errors compound).

The mode, the bit width and the backend are fixed once, in `kernels.select`;
nothing below branches on them.
"""
import math

import numpy

from . import backend, checks, distributed, kernels, layers, quant, threads
from .layers import OPS, BatchStatisticsError
from .ops import softmax_xent_forward, softmax_xent_backward
from .plan import Plan, fmt_bytes
from .schedule import BUFFERS, Schedule, forward_steps, plan_backward, resolve

MODES, DTYPES = checks.MODES, checks.DTYPES
DEFAULT_WORKSPACE_BYTES = 16 << 20

__all__ = ["Engine", "MODES", "DTYPES", "DEFAULT_WORKSPACE_BYTES", "BatchStatisticsError"]


class Engine:
    def __init__(self, net, batch_size, input_shape, mode="exact", bits=4, dtype="float32",
                 workspace_bytes=DEFAULT_WORKSPACE_BYTES, allocate=True, use_fast=None,
                 comm=None, sync_bn=False):
        """bits: K in {1, 2, 4, 8} for every BN-ReLU unit, or a dict {"*": K, "<unit>": K or
        "float"} giving each unit its own width ("*": the default for units not named; "float":
        that unit saves x-hat exactly, as in exact mode). `engine.unit_bits` is {unit: K, or
        None for float}; each unit's kernel set (`engine.selected[unit]`) is chosen here, once.
        Ignored in exact mode (where a dict may only say "float").

        allocate=False builds only the plan and the schedule (no arrays, no weights drawn):
        for printing what a configuration would cost. Such an engine cannot train.

        use_fast: the fused BN-ReLU kernels (numba on NumPy, CUDA on CuPy; see
        lowmem/kernels). None: whenever they apply; False: the reference array ops.

        comm: a lowmem.distributed communicator for data-parallel training (batch_size is then
        the per-rank batch; gradients are averaged over ranks after backward). sync_bn: batch
        statistics over all ranks' batches (kernels/sync.py) instead of per replica."""
        self.mode, self.bits, self.dtype = checks.engine_args(net, batch_size, mode, bits, dtype)
        self.net, self.N = net, int(batch_size)
        self.comm = comm if comm is not None else distributed.SingleProcess()
        self.sync_bn = bool(sync_bn)
        self.input_shape = checks.input_shape(input_shape, net.in_channels)
        self.xp = backend.xp
        threads.configure()                       # how lowmem uses the cores (lowmem/threads.py), once
        self.in_shape, self.out_shape = self._infer_shapes()
        self._unit_sizes = {L.name: self.in_shape[L.name] for L in net.layers if L.op == "bnrelu"}
        self._check_batch_norm(self.N, "batch_size")
        self.unit_bits = checks.unit_bits(self.bits, self.mode, list(self._unit_sizes))
        sizes = self._sizes(self.N)
        self.use_fast = kernels.fused_applies(self.xp, self.dtype, sizes) if use_fast is None else bool(use_fast)
        # each unit's kernel set, for its own bit width (kernels.select_units), chosen here once
        self.selected = kernels.select_units(self.xp, mode, self.unit_bits, self.dtype, sizes, self.use_fast)
        self.units = self.selected                # the sets the current batch runs on (see _start)
        self.plan, self._slot_views = self._make_plan(workspace_bytes)
        self.nbytes = {e.name: e.nbytes for e in self.plan.entries}
        self.arrays = None
        if allocate:
            self.arrays = self.plan.allocate(self.xp)
            self._bind_parameters()
            if "bn.partials" in self.arrays:      # the CUDA set's reductions use this workspace
                self.selected = self.units = kernels.select_units(
                    self.xp, mode, self.unit_bits, self.dtype, sizes, True, partials=self.arrays["bn.partials"])
        self.reference_units = kernels.reference_units(mode, self.unit_bits)
        if self.sync_bn:
            buf = self.arrays["sync.bn"] if allocate else None
            self.selected = self.units = _synchronized(self.selected, self.comm, buf)
            self.reference_units = _synchronized(self.reference_units, self.comm, buf)
        self.schedule = self._make_schedule()
        self.n, self.training, self.input_grad = 0, False, False
        self._ready = False                       # saved state holds a training forward
        self._input_grad_buffer = self._find_input_grad()

    # ------------------------------------------------------------ shapes, plan, schedule
    def _infer_shapes(self):
        """Per layer: (C, H, W) of its input and output, per sample (layers.OPS shape rules)."""
        shape, ins, outs = {"input": self.input_shape}, {}, {}
        for L in self.net.layers:
            if L.op not in OPS:
                raise ValueError(f"layer {L.name}: unknown op {L.op!r}; expected one of {sorted(OPS)}")
            if L.src not in shape:
                raise ValueError(f"layer {L.name} reads buffer {L.src!r} before any layer writes it")
            c, h, w = shape[L.src] if L.op != "linear" else (L.cin, 1, 1)
            if L.op in ("conv", "bnrelu") and c != L.cin:
                raise ValueError(f"layer {L.name}: expects {L.cin} input channels, gets {c}")
            if L.op == "add" and shape.get(L.dst) != (c, h, w):
                raise ValueError(f"layer {L.name}: adds {(c, h, w)} to {L.dst} of shape {shape.get(L.dst)}")
            out = OPS[L.op].out_shape(L, (c, h, w))
            if min(out) < 1:
                raise ValueError(f"input_shape {self.input_shape} is too small: layer {L.name} "
                                 f"would produce shape {out}")
            ins[L.name], outs[L.name] = (c, h, w), out
            shape[L.dst] = out
        if not any(L.op == "linear" for L in self.net.layers):
            raise ValueError(f"network {self.net.name!r} has no classifier head (Network.head)")
        return ins, outs

    def _sizes(self, n):
        return [n * h * w for (_, h, w) in self._unit_sizes.values()]

    def _check_batch_norm(self, n, what):
        for name, (c, h, w) in self._unit_sizes.items():
            if n * h * w < 2:
                raise ValueError(f"{what} {n}: batch norm {name} would normalise one value per channel "
                                 f"(input {(c, h, w)} per sample, N*H*W = {n * h * w}); its output "
                                 f"would not depend on the input. Use a batch of at least 2")

    def _make_plan(self, workspace_bytes):
        """The memory plan, from shapes alone, and how each saved slot is viewed for a batch n."""
        N, dt, plan, views = self.N, self.dtype, Plan(), {}
        specs = self.net.param_shapes()
        for kind, suffix in (("params", ""), ("optimizer", ".momentum")):
            for name, shape, _ in specs:
                plan.add(name + suffix, kind, shape, dt)
        # one flat buffer each for the gradients and the running statistics: p.grad and the
        # statistics are views into them, and a data-parallel step sums each in one allreduce
        plan.add("grads", "grads", (sum(int(math.prod(sh)) for _, sh, _ in specs),), dt)
        plan.add("bn.running", "stats", (sum(int(math.prod(sh)) for _, sh in self.net.stat_shapes()),), dt)
        max_c = max((c for (c, _, _) in self._unit_sizes.values()), default=1)
        plan.add("bn.batch_mean", "stats", (max_c,), dt)
        plan.add("bn.batch_var", "stats", (max_c,), dt)
        partials = kernels.partials_size(self.xp, max_c, self.use_fast)
        if partials:
            plan.add("bn.partials", "workspace", (partials,), "float64")
        if self.sync_bn:                          # the 2C sums each unit exchanges
            plan.add("sync.bn", "workspace", (2 * max_c,), "float64")

        # the three shared buffers: each holds the largest activation of the network
        acts = [math.prod(self.out_shape[L.name]) for L in self.net.layers if L.op in ("conv", "bnrelu", "maxpool")]
        acts.append(math.prod(self.input_shape))
        for b in BUFFERS:
            plan.add(b, "buffers", (int(max(acts)) * N,), dt)
        head = [L for L in self.net.layers if L.op == "linear"][-1]
        plan.add("logits", "buffers", (N, head.cout), dt)
        plan.add("dlogits", "buffers", (N, head.cout), dt)
        plan.add("dfeat", "buffers", (N, head.cin), dt)

        # what backward needs: the batch itself, then what each layer keeps (layers.OPS)
        plan.add("input", "input", (int(math.prod(self.input_shape)) * N,), dt)
        plan.add("labels", "input", (N,), "int64")
        self.saved_slots, conv_ws = {}, 0
        budget = max(1, workspace_bytes // dt.itemsize)
        for L in self.net.layers:
            (c, h, w), (co, ho, wo) = self.in_shape[L.name], self.out_shape[L.name]
            entries = OPS[L.op].saved(L, N, (c, h, w), (co, ho, wo), self.selected.get(L.name), dt)
            for name, shape, dtype in entries:
                plan.add(name, "saved", shape, dtype)
            self.saved_slots[L.name] = [e[0] for e in entries]
            if L.op == "bnrelu":
                # the view is the same for the unit's fused and reference sets (same slot layout)
                views[entries[0][0]] = lambda a, n, c=c, m=h * w, u=self.selected[L.name]: u.saved_view(a, c, n * m)
            elif L.op == "maxpool":
                plan.add(L.name + ".index", "workspace", (co, N, ho, wo), "uint8")
                views[entries[0][0]] = lambda a, n, m=co * ho * wo: a[:(n * m * 4 + 7) // 8]
            elif L.op == "conv":
                per_sample = L.cin * L.k * L.k * ho * wo
                conv_ws = max(conv_ws, per_sample * min(N, max(1, budget // per_sample)))
        plan.add("loss.probs", "saved", (N, head.cout), dt)
        plan.add("conv.cols", "workspace", (conv_ws,), dt)
        self._plan_temporaries(plan)
        return plan, views

    def _plan_temporaries(self, plan):
        """Bounds on the NumPy temporaries a step allocates (see lowmem/ops, lowmem/quant)."""
        it = self.dtype.itemsize
        weights = [int(math.prod(shape)) for _, shape, _ in self.net.param_shapes()]
        plan.add_temporary("a weight-sized GEMM result", max(weights) * it)
        units = [c * self.N * h * w for (c, h, w) in self._unit_sizes.values()] or [0]
        row_block = min(max(units), max(layers.ROW_BLOCK, max(self.N * h * w for (_, h, w) in
                                                               self._unit_sizes.values())))
        plan.add_temporary("a BN row block (x2)", 2 * row_block * it)
        if any(u.decodes for u in self.selected.values()):
            plan.add_temporary("quantizer chunks", (2 * it + 4) * min(quant.CHUNK, max(units)))

    def _make_schedule(self):
        io = resolve(self.net)
        args = (self.net, io, self.in_shape, self.out_shape, self.saved_slots, self.nbytes)
        fwd = forward_steps(*args)
        decodes = {name for name, u in self.selected.items() if u.decodes}
        steps = Schedule(fwd + plan_backward(*args, decodes=decodes, start=len(fwd)))
        for s in steps:
            if s.op == "bnrelu":
                s.width = self.width_label(s.layer.name)
        return steps

    def width_label(self, unit):
        """'4-bit' (the unit's saved x-hat code), 'float' (x-hat saved exact), or '' (exact mode)."""
        if self.mode == "exact":
            return ""
        K = self.unit_bits[unit]
        return "float" if K is None else f"{K}-bit"

    def bits_label(self):
        """'4-bit' when every unit has one width, else e.g. '4-bit x10, 8-bit x2, float x1'."""
        labels = [self.width_label(u) for u in self.unit_bits]
        counts = {w: labels.count(w) for w in dict.fromkeys(labels)}
        return ", ".join(w if len(counts) == 1 else f"{w} x{c}" for w, c in counts.items())

    def _find_input_grad(self):
        stems = [s for s in self.schedule if s.phase == "bwd" and s.optional]
        return stems[-1].dest if stems else None

    def _bind_parameters(self):
        """Move parameter values and BN statistics into the plan's arrays (the engine owns them);
        each p.grad and each running statistic is a view into its flat buffer."""
        a, xp = self.arrays, self.xp
        grads, running = _views(a["grads"]), _views(a["bn.running"])
        for p in self.net.parameters():
            a[p.name][...] = xp.asarray(backend.to_numpy(p.data) if xp is not numpy else p.data)
            p.data, p.grad = a[p.name], grads(p.shape)
            p.state["momentum"] = a[p.name + ".momentum"]
        for name, s in self.net.stats.items():
            view = running(s.shape)
            view[...] = xp.asarray(backend.to_numpy(s) if xp is not numpy else s)
            self.net.stats[name] = view
        self.stats = self.net.stats

    # ------------------------------------------------------------ views (for the handlers)
    def act(self, buf, shape):
        """(C, n, H, W) view at the start of a flat buffer (or the input slot) for batch n."""
        c, h, w = shape
        return self.arrays[buf][:c * self.n * h * w].reshape(c, self.n, h, w)

    def rows(self, buf, shape):
        """The same as (C, n*H*W) rows."""
        c, h, w = shape
        return self.arrays[buf][:c * self.n * h * w].reshape(c, self.n * h * w)

    def slot(self, name):
        """A saved slot (or head buffer) for the current batch."""
        view = self._slot_views.get(name)
        return view(self.arrays[name], self.n) if view else self.arrays[name][:self.n]

    def param(self, name):
        return self.net.params[name]

    # ------------------------------------------------------------ forward
    def forward(self, x, labels):
        """Training-mode forward of x (N, C, H, W): returns (mean loss, logits (N, K) copy).

        x and labels are copied into the plan: the caller may reuse them at once."""
        self._check_ownership()
        checks.batch(x, self.xp, self.dtype, self.input_shape, self.N, "forward")
        checks.labels(labels, self.xp, x.shape[0], self.net.num_classes)
        self._check_batch_norm(x.shape[0], "forward: batch of")
        self._ready = False
        self._start(x, training=True)
        self.arrays["labels"][:self.n] = labels
        self._sweep("fwd")
        if self.comm.size > 1 and not self.sync_bn:   # per-replica statistics: keep their average
            self.comm.allreduce(self.arrays["bn.running"])
            self.arrays["bn.running"] /= self.comm.size
        loss = softmax_xent_forward(self.slot("loss.probs"), self.slot("logits"), self.slot("labels"))
        self._ready = True
        return loss, self.slot("logits").copy()

    def predict(self, x):
        """Eval-mode logits (N, K) for any batch N <= batch_size (BN running statistics)."""
        self._check_ownership()
        checks.batch(x, self.xp, self.dtype, self.input_shape, self.N, "predict")
        self._ready = False                       # the saved state is overwritten
        self._start(x, training=False)
        self._sweep("fwd")
        return self.slot("logits").copy()

    def _start(self, x, training):
        self.n, self.training = x.shape[0], training
        # a batch whose units are not whole code bytes runs on the reference kernels, in every
        # mode alike (so exact and approx still compute the same forward)
        aligned = kernels.fused_applies(self.xp, self.dtype, self._sizes(self.n))
        self.units = self.selected if aligned or not self.use_fast else self.reference_units
        self.xp.copyto(self.act("input", self.input_shape), x.transpose(1, 0, 2, 3))

    def _sweep(self, phase):
        for step in self.schedule:
            if step.phase == phase and step.op != "loss":
                getattr(OPS[step.op], "forward" if phase == "fwd" else "backward")(self, step)

    # ------------------------------------------------------------ backward
    def backward(self, input_grad=False):
        """Fill p.grad of every parameter (overwriting) for the last forward().

        With input_grad=True also returns d loss / d x as an (N, C, H, W) array."""
        if not self._ready:
            raise RuntimeError("backward() needs a training forward() first "
                               "(predict() and a previous backward() consume the saved state)")
        self._check_ownership()
        self._ready = False
        self.arrays["grads"].fill(0)
        self.input_grad = bool(input_grad)
        softmax_xent_backward(self.slot("dlogits"), self.slot("loss.probs"), self.slot("labels"))
        self._sweep("bwd")                         # self.units: the set that wrote the saved state
        if self.comm.size > 1:                     # data parallel: the mean over ranks, one allreduce
            self.comm.allreduce(self.arrays["grads"])
            self.arrays["grads"] /= self.comm.size
        if input_grad:
            return self.act(self._input_grad_buffer, self.input_shape).transpose(1, 0, 2, 3).copy()
        return None

    # ------------------------------------------------------------ train
    def train_step(self, x, labels, opt):
        """forward + backward + opt.step(); returns the loss. A non-finite loss raises
        FloatingPointError before any parameter changes."""
        if not callable(getattr(opt, "step", None)):
            raise TypeError(f"train_step needs an optimizer with a step() method (lowmem.SGD), "
                            f"got {type(opt).__name__}")
        loss, _ = self.forward(x, labels)
        if not numpy.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss} (learning rate too high?)")
        self.backward()
        opt.step()
        return loss

    # ------------------------------------------------------------ checks, summary
    def _check_ownership(self):
        if self.arrays is None:
            raise RuntimeError("this Engine was built with allocate=False: it has a plan and a "
                               "schedule but no arrays; build it with allocate=True to run it")
        for p in self.net.parameters():
            if p.data is not self.arrays[p.name]:
                raise RuntimeError(f"the parameters of {self.net.name} now belong to another Engine "
                                   f"(parameter {p.name} was rebound); build one Engine per network, "
                                   f"e.g. Engine(copy.deepcopy(net), ...) for a second one")

    def plan_bytes(self, name):
        return self.nbytes[name]

    def summary(self):
        by = self.plan.bytes_by_kind()
        return (f"{self.net.name}: {self.net.num_params():,} params, batch {self.N}, "
                f"input {self.input_shape}, mode {self.mode}"
                + (f" ({self.bits_label()})" if self.mode != "exact" and self.unit_bits else "")
                + f", {self.dtype}; planned {fmt_bytes(self.plan.total_bytes)} "
                  f"(saved {fmt_bytes(by['saved'])}, buffers {fmt_bytes(by['buffers'])})")


def _synchronized(units, comm, buf):
    """{unit: set} with each distinct set wrapped once for synchronized batch norm."""
    wrapped = {id(u): kernels.synchronized(u, comm, buf) for u in units.values()}
    return {name: wrapped[id(u)] for name, u in units.items()}


def _views(flat):
    """shape -> the next view of that shape into the flat array, in call order."""
    offset = [0]

    def take(shape):
        n = int(math.prod(shape))
        view = flat[offset[0]:offset[0] + n].reshape(shape)
        offset[0] += n
        return view
    return take
