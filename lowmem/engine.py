"""The engine: a network -> an explicit schedule -> a memory plan -> a training step.

    eng = Engine(net, batch_size=128, input_shape=(3, 32, 32), mode="approx", bits=4)
    print(eng.schedule)          # every forward and backward step, with buffers and saved slots
    print(eng.plan.report())     # every allocation, totals by kind
    loss, logits = eng.forward(x, labels); eng.backward(); opt.step()

Forward is exact and runs through three shared buffers (act0, act1 ping-pong,
res for the residual stream). Each BN->ReLU unit keeps one copy of its
normalised input x-hat — float in mode "exact", a packed K-bit code in
"approx" and "naive" — plus its per-channel rstd. Backward walks the layers in
reverse through the same three buffers, now holding gradients; a unit's
x-hat (and the conv input relu(gamma*x-hat + beta)) is decoded into whichever
buffer is free at that step. The buffer each step uses is decided once, here,
by `_plan_backward`, and printed in the schedule.

Modes (DESIGN.md §3):
  exact   x-hat saved in float: gradients equal standard backprop.
  approx  x-hat saved as K-bit codes; forward, loss and logits bit-identical to exact.
  naive   the forward itself continues from the decoded relu(gamma*x-tilde + beta)
          (the paper's baseline: errors compound).
"""
from dataclasses import dataclass

import numpy

from . import backend, quant, threads
from .kernels import cpu as fast, gpu as cuda
from .ops import (conv2d_forward, conv2d_backward_input, conv2d_backward_weight, conv_out_size,
                  bn_normalize_forward, bn_relu_apply_forward, bn_eval_relu_forward,
                  bn_relu_backward, update_running_stats, maxpool_forward, maxpool_backward,
                  avgpool_forward, avgpool_backward, linear_forward, linear_backward,
                  softmax_xent_forward, softmax_xent_backward)
from .optim import SGD
from .plan import Plan, fmt_bytes

MODES = ("exact", "approx", "naive")
DTYPES = ("float32", "float64")
BUFFERS = ("act0", "act1", "res")
BN_EPS = 1e-5
BN_MOMENTUM = 0.1
DEFAULT_WORKSPACE_BYTES = 16 << 20


@dataclass
class Step:
    """One line of the schedule. Backward steps also carry the buffers they use."""
    index: int
    phase: str              # "fwd" | "bwd"
    op: str
    layer: object           # network.Layer (None for the loss)
    reads: str
    writes: str
    saved: str = ""         # the saved slot this step fills (fwd) or reads (bwd)
    saved_bytes: int = 0
    dout: str = ""          # bwd: buffer holding the gradient of the layer's output
    dest: str = ""          # bwd: buffer receiving the gradient of the layer's input
    accumulate: bool = False
    scratch: str = ""       # bwd: free buffer the saved x-hat / conv input is decoded into

    def __str__(self):
        name = self.layer.name if self.layer is not None else "loss"
        saved = f"{self.saved} ({self.saved_bytes:,} B)" if self.saved_bytes else self.saved
        return (f"{self.index:>5} {self.phase:<4} {self.op:<8} {name:<24} "
                f"{self.reads:<22} {self.writes:<16} {saved}")


class Schedule(list):
    """The list of Steps; str() prints it (summarised when long)."""

    def __str__(self, max_rows=60):
        head = f"{'step':>5} {'dir':<4} {'op':<8} {'layer':<24} {'reads':<22} {'writes':<16} saved slot"
        rows = [str(s) for s in self]
        if len(rows) > max_rows:
            k = max_rows // 2
            rows = rows[:k] + [f"  ... {len(rows) - 2 * k} steps ..."] + rows[-k:]
        return "\n".join([head] + rows)


class Engine:
    def __init__(self, net, batch_size, input_shape, mode="exact", bits=4, dtype="float32",
                 workspace_bytes=DEFAULT_WORKSPACE_BYTES, allocate=True, use_fast=None):
        """allocate=False builds only the plan and the schedule (no arrays, the
        network's parameters stay where they are): for printing what a
        configuration would cost. Such an engine cannot train.

        use_fast: the fused kernels for the BN-ReLU units — numba's lowmem/kernels/cpu.py
        on NumPy, CUDA's lowmem/kernels/gpu.py on CuPy (None: whenever they apply;
        False: the reference array ops of lowmem/ops and lowmem/quant)."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: expected one of {MODES}")
        quant.check_bits(bits)
        if str(dtype) not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}: expected one of {DTYPES}")
        if not isinstance(batch_size, (int, numpy.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        input_shape = tuple(input_shape)
        if len(input_shape) != 3 or input_shape[0] != net.in_channels:
            raise ValueError(f"input_shape must be (C, H, W) with C = {net.in_channels} "
                             f"(the network's in_channels), got {input_shape}")
        self.net, self.mode, self.bits = net, mode, int(bits)
        self.dtype = numpy.dtype(dtype)
        self.N, self.input_shape = int(batch_size), input_shape
        self.xp = backend.xp
        threads.configure()                     # lowmem's use of the cores (lowmem/threads.py), once per process
        self._gpu = self.xp is not numpy        # CuPy: fused kernels from lowmem/kernels/gpu.py
        self._infer_shapes()
        self.use_fast = self._fast_ok(self.N) if use_fast is None else bool(use_fast)
        if self.use_fast and not self._fast_ok(self.N):
            raise ValueError("use_fast=True needs numba (pip install lowmem[fast]) and float32 on the "
                             "NumPy backend, or the CuPy backend, and N*H*W*bits divisible by 8 "
                             "for every unit")
        self.plan = self._make_plan(workspace_bytes)
        self.arrays = None
        if allocate:
            self.arrays = self.plan.allocate(self.xp)
            self._bind_parameters()
        self.kernels = fast                      # the fused BN-ReLU kernels (used when self._fast)
        if self._gpu and allocate and self.use_fast:
            self.kernels = cuda.Kernels(self.arrays["bn.partials"])   # bound to this plan's workspace
        self.schedule = Schedule(self._forward_steps() + self._plan_backward())
        self._x = self._labels = None
        self._n, self._fast = 0, False

    # ------------------------------------------------------------------ shapes
    def _infer_shapes(self):
        """Per layer: (C, H, W) of its input and output, per sample."""
        shape = {"input": self.input_shape}
        self.in_shape, self.out_shape = {}, {}
        for L in self.net.layers:
            c, h, w = shape[L.src] if L.op != "linear" else (L.cin, 1, 1)
            if L.op in ("conv", "bnrelu") and c != L.cin:
                raise ValueError(f"layer {L.name}: expects {L.cin} input channels, gets {c}")
            if L.op == "conv":
                out = (L.cout, conv_out_size(h, L.k, L.stride, L.pad), conv_out_size(w, L.k, L.stride, L.pad))
            elif L.op == "maxpool":
                out = (c, conv_out_size(h, L.k, L.stride, L.pad), conv_out_size(w, L.k, L.stride, L.pad))
            elif L.op == "add":
                if shape["res"] != (c, h, w):
                    raise ValueError(f"layer {L.name}: adds {(c, h, w)} to res of shape {shape['res']}")
                out = (c, h, w)
            elif L.op == "avgpool":
                out = (c, 1, 1)
            elif L.op == "linear":
                out = (L.cout, 1, 1)
            else:
                out = (c, h, w)
            if min(out) < 1:
                raise ValueError(f"input_shape {self.input_shape} is too small: layer {L.name} "
                                 f"would produce shape {out}")
            self.in_shape[L.name], self.out_shape[L.name] = (c, h, w), out
            shape[L.dst] = out

    def _fast_ok(self, n):
        """Whether the fused kernels (lowmem/kernels/cpu.py, lowmem/kernels/gpu.py) apply to every unit at batch n."""
        bits = 8 if self.mode == "exact" else self.bits
        return all((cuda if self._gpu else fast).supports(self.xp, self.dtype, n * h * w, bits)
                   for L in self.net.layers if L.op == "bnrelu"
                   for (_, h, w) in [self.in_shape[L.name]])

    # ------------------------------------------------------------------- plan
    def _slot_name(self, L):
        return f"{L.name}.xhat" if self.mode == "exact" else f"{L.name}.code"

    def _make_plan(self, workspace_bytes):
        N, dt, plan = self.N, self.dtype, Plan()
        for p in self.net.parameters():
            plan.add(p.name, "params", p.shape, dt)
        for p in self.net.parameters():
            plan.add(p.name + ".grad", "grads", p.shape, dt)
        for p in self.net.parameters():
            plan.add(p.name + ".momentum", "optimizer", p.shape, dt)
        for name, a in self.net.stats.items():
            plan.add(name, "stats", a.shape, dt)
        max_c = max((L.cin for L in self.net.layers if L.op == "bnrelu"), default=1)
        plan.add("bn.batch_mean", "stats", (max_c,), dt)
        plan.add("bn.batch_var", "stats", (max_c,), dt)
        if self._gpu and self.use_fast:                 # per-channel partial sums of the CUDA reductions
            plan.add("bn.partials", "workspace", (cuda.partials_size(max_c),), "float64")

        # the three shared buffers: each holds the largest activation of the network
        acts = [numpy.prod(self.out_shape[L.name]) for L in self.net.layers if L.op in ("conv", "bnrelu", "maxpool")]
        acts.append(numpy.prod(self.input_shape))
        self.buf_elems = int(max(acts)) * N
        for b in BUFFERS:
            plan.add(b, "buffers", (self.buf_elems,), dt)
        head = next(L for L in self.net.layers if L.op == "linear")
        plan.add("logits", "buffers", (N, head.cout), dt)
        plan.add("dlogits", "buffers", (N, head.cout), dt)
        plan.add("dfeat", "buffers", (N, head.cin), dt)

        # what each layer keeps for backward
        max_unit, conv_ws = 1, 0
        budget = max(1, workspace_bytes // dt.itemsize)
        for L in self.net.layers:
            c, h, w = self.in_shape[L.name]
            if L.op == "bnrelu":
                n = c * N * h * w
                max_unit = max(max_unit, n)
                if self.mode == "exact":
                    plan.add(self._slot_name(L), "saved", (c, N * h * w), dt)
                else:
                    plan.add(self._slot_name(L), "saved", (quant.packed_nbytes(n, self.bits),), "uint8")
                plan.add(L.name + ".rstd", "saved", (c,), dt)
            elif L.op == "maxpool":
                co, ho, wo = self.out_shape[L.name]
                plan.add(L.name + ".argmax", "saved", (quant.packed_nbytes(co * N * ho * wo, 4),), "uint8")
                plan.add(L.name + ".index", "workspace", (co, N, ho, wo), "uint8")
            elif L.op == "conv":
                co, ho, wo = self.out_shape[L.name]
                per_sample = L.cin * L.k * L.k * ho * wo
                conv_ws = max(conv_ws, per_sample * min(N, max(1, budget // per_sample)))
            elif L.op == "linear":
                plan.add("fc.input", "saved", (N, L.cin), dt)
        plan.add("loss.probs", "saved", (N, head.cout), dt)
        plan.add("conv.cols", "workspace", (conv_ws,), dt)
        if self.mode != "exact" and not self.use_fast:   # fused kernels decode the mask inline
            plan.add("relu.mask", "workspace", (max_unit,), "bool")
        return plan

    def _bind_parameters(self):
        """Move parameter values and BN statistics into the plan's arrays (the engine owns them)."""
        a = self.arrays
        for p in self.net.parameters():
            a[p.name][...] = self.xp.asarray(backend.to_numpy(p.data) if self.xp is not numpy else p.data)
            p.data, p.grad = a[p.name], a[p.name + ".grad"]
            p.state["momentum"] = a[p.name + ".momentum"]
        for name, s in self.net.stats.items():
            a[name][...] = self.xp.asarray(backend.to_numpy(s) if self.xp is not numpy else s)
            self.net.stats[name] = a[name]

    def _check_ownership(self):
        if self.arrays is None:
            raise RuntimeError("this Engine was built with allocate=False: it has a plan and a "
                               "schedule but no arrays; build it with allocate=True to run it")
        for p in self.net.parameters():
            if p.data is not self.arrays[p.name]:
                raise RuntimeError(f"the parameters of {self.net.name} now belong to another Engine "
                                   f"(parameter {p.name} was rebound); build one Engine per network, "
                                   f"e.g. Engine(copy.deepcopy(net), ...) for a second one")

    # ---------------------------------------------------------------- schedule
    def _forward_steps(self):
        steps = []
        for L in self.net.layers:
            saved, nbytes = "", 0
            if L.op == "bnrelu":
                saved = self._slot_name(L)
                nbytes = self.plan_bytes(saved) + self.plan_bytes(L.name + ".rstd")
            elif L.op == "maxpool":
                saved = L.name + ".argmax"
                nbytes = self.plan_bytes(saved)
            elif L.op == "avgpool":
                saved, nbytes = "fc.input", self.plan_bytes("fc.input")
            reads = f"{L.src}+res" if L.op == "add" else L.src
            writes = "fc.input" if L.op == "avgpool" else L.dst
            steps.append(Step(len(steps), "fwd", L.op, L, reads, writes, saved, nbytes))
        steps.append(Step(len(steps), "fwd", "loss", None, "logits", "loss.probs",
                          "loss.probs", self.plan_bytes("loss.probs")))
        return steps

    def plan_bytes(self, name):
        if getattr(self, "_plan_nbytes", None) is None:     # a dict: a linear scan is O(layers^2)
            self._plan_nbytes = {e.name: e.nbytes for e in self.plan.entries}
        return self._plan_nbytes[name]

    def _plan_backward(self):
        """Decide, once, which buffer holds which gradient at every backward step.

        Tensors are (buffer, version) pairs from the forward pass. A gradient lives
        in one of the three buffers; `live` maps tensor -> buffer for gradients that
        exist but whose producing layer has not run backward yet. A residual add
        gives both of its inputs the *same* gradient storage (no copy); the later
        contribution to the skip path then accumulates into it."""
        version = {"input": 0, "act0": 0, "act1": 0, "res": 0, "feat": 0, "logits": 0}
        tin, tout, producer = {}, {}, {}
        for L in self.net.layers:
            tin[L.name] = (L.src, version[L.src])
            if L.op == "add":
                tin[L.name + "/skip"] = ("res", version["res"])
            version[L.dst] += 1
            tout[L.name] = (L.dst, version[L.dst])
            producer[tout[L.name]] = L

        live, self._conv_unit = {}, {}
        steps, i0 = [], len(self.net.layers) + 1

        def free(*busy):
            taken = set(live.values()) | set(busy)
            for b in BUFFERS:
                if b not in taken:
                    return b
            raise AssertionError("backward planning ran out of buffers")

        def add(op, L, reads, writes, **kw):
            steps.append(Step(i0 + len(steps), "bwd", op, L, reads, writes, **kw))

        add("loss", None, "loss.probs", "dlogits", saved="loss.probs", saved_bytes=self.plan_bytes("loss.probs"))
        for L in reversed(self.net.layers):
            if L.op == "linear":
                add("linear", L, "dlogits+fc.input", "dfeat", saved="fc.input",
                    saved_bytes=self.plan_bytes("fc.input"))
                continue
            if L.op == "avgpool":
                dest = free()
                live[tin[L.name]] = dest
                add("avgpool", L, "dfeat", dest, dest=dest)
                continue
            dout = live.pop(tout[L.name])
            t = tin[L.name]
            if L.op == "add":
                live[t] = dout                      # branch gradient = output gradient
                live[tin[L.name + "/skip"]] = dout  # skip gradient: same storage
                add("add", L, dout, f"{dout} (shared)", dout=dout, dest=dout)
            elif L.op == "bnrelu":
                aliases = [k for k, b in live.items() if b == dout]
                assert not aliases, f"{L.name}: output gradient buffer still shared"
                scratch = "" if self.mode == "exact" else free(dout)
                acc = t in live
                dest = live[t] if acc else dout     # in place unless the input already has a gradient
                live[t] = dest
                slot = self._slot_name(L)
                add("bnrelu", L, f"{dout}+{slot.split('.')[-1]}" + (f"->{scratch}" if scratch else ""),
                    dest + (" (+=)" if acc else ""), saved=slot,
                    saved_bytes=self.plan_bytes(slot) + self.plan_bytes(L.name + ".rstd"),
                    dout=dout, dest=dest, accumulate=acc, scratch=scratch)
            elif L.op == "conv":
                if L.src == "input":                # stem: input gradient only on request
                    dest = free(dout)
                    add("conv", L, f"{dout}+input", f"dW, {dest} (dx, optional)", dout=dout, dest=dest)
                    continue
                unit = producer[t]
                assert unit.op == "bnrelu", f"{L.name} must read a BN-ReLU output"
                self._conv_unit[L.name] = unit
                acc = t in live
                scratch = free(dout)
                dest = live[t] if acc else scratch
                live[t] = dest
                slot = self._slot_name(unit)
                add("conv", L, f"{dout}+{slot}->{scratch}", f"dW, {dest}" + (" (+=)" if acc else ""),
                    saved=slot, saved_bytes=0, dout=dout, dest=dest, accumulate=acc, scratch=scratch)
            elif L.op == "maxpool":
                assert t not in live
                dest = free(dout)
                live[t] = dest
                add("maxpool", L, f"{dout}+argmax", dest, saved=L.name + ".argmax",
                    saved_bytes=self.plan_bytes(L.name + ".argmax"), dout=dout, dest=dest)
        return steps

    # ------------------------------------------------------------------ views
    def _view(self, buf, shape):
        """(C, n, H, W) view at the start of a flat buffer, for the current batch n."""
        c, h, w = shape
        if buf == "input":
            return self._x
        return self.arrays[buf][:c * self._n * h * w].reshape(c, self._n, h, w)

    def _rows(self, a):
        return a.reshape(a.shape[0], -1)

    def _unit_params(self, L):
        return self.net.params[L.name + ".weight"], self.net.params[L.name + ".bias"]

    def _saved_xhat(self, L):
        c, h, w = self.in_shape[L.name]
        return self.arrays[self._slot_name(L)][:, :self._n * h * w]

    def _code(self, L):
        c, h, w = self.in_shape[L.name]
        return self.arrays[self._slot_name(L)][:quant.packed_nbytes(c * self._n * h * w, self.bits)]

    # ------------------------------------------------------------ validation
    def _check_input(self, x, what):
        xp = self.xp
        if not isinstance(x, xp.ndarray):
            raise TypeError(f"{what}: expected a {xp.__name__} array of shape (N, {', '.join(map(str, self.input_shape))}), "
                            f"got {type(x).__name__}")
        if x.dtype != self.dtype:
            raise TypeError(f"{what}: input dtype is {x.dtype}, this engine expects {self.dtype} "
                            f"(convert with x.astype('{self.dtype}'))")
        if x.ndim != 4 or tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(f"{what}: input shape is {tuple(x.shape)}, expected (N, "
                             f"{', '.join(map(str, self.input_shape))}) with N <= {self.N}")
        if not 1 <= x.shape[0] <= self.N:
            raise ValueError(f"{what}: batch of {x.shape[0]} is larger than the planned batch_size "
                             f"{self.N} (build the Engine with a larger batch_size)" if x.shape[0] > self.N
                             else f"{what}: empty batch")
        lo, hi = float(x.min()), float(x.max())       # NaN propagates through min/max: no temporary
        if not (numpy.isfinite(lo) and numpy.isfinite(hi)):
            raise ValueError(f"{what}: the input batch contains NaN or Inf")

    def _check_labels(self, labels, n):
        xp = self.xp
        K = self.net.num_classes
        if not isinstance(labels, xp.ndarray) or labels.dtype.kind not in "iu":
            raise TypeError(f"labels must be an integer {xp.__name__} array of shape ({n},), "
                            f"got {getattr(labels, 'dtype', type(labels).__name__)}")
        if labels.shape != (n,):
            raise ValueError(f"labels shape is {labels.shape}, expected ({n},) to match the batch")
        if int(labels.min()) < 0 or int(labels.max()) >= K:
            raise ValueError(f"labels out of range: found [{int(labels.min())}, {int(labels.max())}], "
                             f"expected 0 <= label < {K} (num_classes)")

    # ---------------------------------------------------------------- forward
    def forward(self, x, labels):
        """Training-mode forward of x (N, C, H, W): returns (mean loss, logits (N, K) copy)."""
        self._check_ownership()
        self._check_input(x, "forward")
        self._check_labels(labels, x.shape[0])
        self._n, self._x, self._labels = x.shape[0], x.transpose(1, 0, 2, 3), labels
        self._training = True
        self._fast = self.use_fast and (self._n == self.N or self._fast_ok(self._n))
        if self.use_fast and not self._fast and self.mode != "exact":
            raise ValueError(f"batch of {self._n}: the fused {self.bits}-bit kernels need N*H*W*bits "
                             f"divisible by 8 in every unit; use a batch that is a multiple of 8")
        for step in self.schedule:
            if step.phase == "fwd" and step.op != "loss":
                getattr(self, "_fwd_" + step.op)(step.layer)
        logits = self.arrays["logits"][:self._n]
        loss = softmax_xent_forward(self.arrays["loss.probs"][:self._n], logits, labels)
        self._ready = True
        return loss, logits.copy()

    def predict(self, x):
        """Eval-mode logits (N, K) for any batch N <= batch_size (BN running statistics)."""
        self._check_ownership()
        self._check_input(x, "predict")
        self._n, self._x = x.shape[0], x.transpose(1, 0, 2, 3)
        self._training, self._ready = False, False   # the saved state is overwritten
        for step in self.schedule:
            if step.phase == "fwd" and step.op != "loss":
                getattr(self, "_fwd_" + step.op)(step.layer)
        return self.arrays["logits"][:self._n].copy()

    def _fwd_conv(self, L):
        p = self.net.params[L.name + ".weight"]
        conv2d_forward(self._view(L.dst, self.out_shape[L.name]), self._view(L.src, self.in_shape[L.name]),
                       p.data, L.stride, L.pad, self.arrays["conv.cols"])

    def _fwd_bnrelu(self, L):
        a, xp = self.arrays, self.xp
        g, b = (p.data for p in self._unit_params(L))
        x = self._rows(self._view(L.src, self.in_shape[L.name]))
        out = self._rows(self._view(L.dst, self.out_shape[L.name]))
        c, M = x.shape
        if not self._training:
            bn_eval_relu_forward(out, x, self.net.stats[L.name + ".running_mean"],
                                 self.net.stats[L.name + ".running_var"], g, b, BN_EPS)
            return
        mean, var = a["bn.batch_mean"][:c], a["bn.batch_var"][:c]
        rstd = a[L.name + ".rstd"]
        if self._fast:                                   # one fused pass (lowmem/kernels/cpu.py, lowmem/kernels/gpu.py)
            self.kernels.bn_stats(mean, var, rstd, x, BN_EPS)
            if self.mode == "exact":
                self.kernels.unit_forward_exact(out, self._saved_xhat(L), x, mean, rstd, g, b)
            else:
                self.kernels.unit_forward_code(out, self._code(L), x, mean, rstd, g, b,
                                               self._fused_grid(g, b), self.mode == "naive")
        elif self.mode == "exact":
            xhat = self._saved_xhat(L)                   # normalise straight into the saved slot
            bn_normalize_forward(xhat, mean, var, rstd, x, BN_EPS)
            bn_relu_apply_forward(out, xhat, g, b)
        else:
            bn_normalize_forward(out, mean, var, rstd, x, BN_EPS)   # x-hat in the output buffer
            qp = quant.quant_params(g, b, self.bits)
            quant.quantize_pack(self._code(L), out, qp)
            if self.mode == "approx":
                bn_relu_apply_forward(out, out, g, b)
            else:                                        # naive: continue from the decoded value
                quant.decode_relu(out, self._code(L), qp, g, b)
        update_running_stats(self.net.stats[L.name + ".running_mean"],
                             self.net.stats[L.name + ".running_var"], mean, var, M, BN_MOMENTUM)

    def _fwd_add(self, L):
        res = self._view("res", self.out_shape[L.name])
        res += self._view(L.src, self.in_shape[L.name])

    def _fwd_maxpool(self, L):
        co, ho, wo = self.out_shape[L.name]
        # contiguous (co, n, ho, wo) view at the start of the workspace (not [:, :n], which is
        # strided when n < N: reshape(-1) of it is a copy, so backward's unpack never filled idx)
        idx = self.arrays[L.name + ".index"].reshape(-1)[:co * self._n * ho * wo].reshape(co, self._n, ho, wo)
        maxpool_forward(self._view(L.dst, self.out_shape[L.name]), idx,
                        self._view(L.src, self.in_shape[L.name]), L.k, L.stride, L.pad)
        if self._training:
            quant.pack_codes(self.arrays[L.name + ".argmax"][:quant.packed_nbytes(idx.size, 4)],
                             idx.reshape(-1), 4)

    def _fwd_avgpool(self, L):
        avgpool_forward(self.arrays["fc.input"][:self._n], self._view(L.src, self.in_shape[L.name]))

    def _fwd_linear(self, L):
        linear_forward(self.arrays["logits"][:self._n], self.arrays["fc.input"][:self._n],
                       self.net.params["fc.weight"].data, self.net.params["fc.bias"].data)

    # --------------------------------------------------------------- backward
    def backward(self, input_grad=False):
        """Fill p.grad of every parameter (overwriting) for the last forward().

        With input_grad=True also returns d loss / d x as an (N, C, H, W) array."""
        if not getattr(self, "_ready", False):
            raise RuntimeError("backward() needs a training forward() first "
                               "(predict() and a previous backward() consume the saved state)")
        self._check_ownership()
        for p in self.net.parameters():
            p.grad.fill(0)
        self._input_grad, dx = input_grad, None
        for step in self.schedule:
            if step.phase == "bwd":
                r = getattr(self, "_bwd_" + step.op)(step)
                if r is not None:
                    dx = r
        self._ready = False
        return dx

    def _bwd_loss(self, step):
        softmax_xent_backward(self.arrays["dlogits"][:self._n], self.arrays["loss.probs"][:self._n],
                              self._labels)

    def _bwd_linear(self, step):
        w, b = self.net.params["fc.weight"], self.net.params["fc.bias"]
        linear_backward(self.arrays["dfeat"][:self._n], w.grad, b.grad, self.arrays["dlogits"][:self._n],
                        self.arrays["fc.input"][:self._n], w.data)

    def _bwd_avgpool(self, step):
        avgpool_backward(self._view(step.dest, self.in_shape[step.layer.name]), self.arrays["dfeat"][:self._n])

    def _bwd_add(self, step):
        pass    # both inputs share the output's gradient storage (see _plan_backward)

    def _decode_xhat(self, unit, into):
        """x-hat of a unit as (C, M): the saved float slot, or its code decoded into `into`."""
        if self.mode == "exact":
            return self._saved_xhat(unit), None
        g, b = (p.data for p in self._unit_params(unit))
        xhat = self._rows(self._view(into, self.in_shape[unit.name]))
        mask = self.arrays["relu.mask"][:xhat.size].reshape(xhat.shape)
        quant.unpack_decode(xhat, self._code(unit), quant.quant_params(g, b, self.bits), mask_out=mask)
        return xhat, mask

    def _bwd_bnrelu(self, step):
        L = step.layer
        g, b = self._unit_params(L)
        dr = self._rows(self._view(step.dout, self.out_shape[L.name]))
        dx = self._rows(self._view(step.dest, self.in_shape[L.name]))
        if self._fast:                                   # decodes inline: the scratch buffer stays unused
            exact = self.mode == "exact"
            self.kernels.unit_backward(dx, g.grad, b.grad, dr, self._saved_xhat(L) if exact else None,
                                       None if exact else self._code(L),
                                       None if exact else self._fused_grid(g.data, b.data),
                                       g.data, b.data, self.arrays[L.name + ".rstd"], step.accumulate)
            return
        xhat, mask = self._decode_xhat(L, step.scratch)
        bn_relu_backward(dx, g.grad, b.grad, dr, xhat, g.data, b.data, self.arrays[L.name + ".rstd"],
                         mask=mask, accumulate=step.accumulate)

    def _fused_grid(self, g, b):
        """The quantization grid for a fused kernel: numba's take quant_params; the CUDA ones
        derive it in-kernel from gamma and beta and take only the bit width (no per-unit launches)."""
        return self.bits if self._gpu else quant.quant_params(g, b, self.bits)

    def _conv_input(self, L, into):
        """The conv's input relu(gamma*x-hat + beta), rebuilt from its unit's saved state."""
        unit = self._conv_unit[L.name]
        g, b = (p.data for p in self._unit_params(unit))
        u = self._rows(self._view(into, self.in_shape[L.name]))
        if self._fast:
            exact = self.mode == "exact"
            self.kernels.conv_input(u, self._saved_xhat(unit) if exact else None,
                                    None if exact else self._code(unit),
                                    None if exact else self._fused_grid(g, b), g, b)
        elif self.mode == "exact":
            bn_relu_apply_forward(u, self._saved_xhat(unit), g, b)
        else:
            quant.decode_relu(u, self._code(unit), quant.quant_params(g, b, self.bits), g, b)
        return self._view(into, self.in_shape[L.name])

    def _bwd_conv(self, step):
        L = step.layer
        p = self.net.params[L.name + ".weight"]
        dout = self._view(step.dout, self.out_shape[L.name])
        ws = self.arrays["conv.cols"]
        u = self._x if L.src == "input" else self._conv_input(L, step.scratch)
        conv2d_backward_weight(p.grad, u, dout, L.stride, L.pad, ws)
        if L.src == "input":
            if not self._input_grad:
                return None
            dx = self._view(step.dest, self.in_shape[L.name])
            conv2d_backward_input(dx, dout, p.data, L.stride, L.pad, ws)
            return dx.transpose(1, 0, 2, 3).copy()
        conv2d_backward_input(self._view(step.dest, self.in_shape[L.name]), dout, p.data, L.stride, L.pad,
                              ws, accumulate=step.accumulate)

    def _bwd_maxpool(self, step):
        L = step.layer
        co, ho, wo = self.out_shape[L.name]
        # same contiguous view as _fwd_maxpool, so unpack_codes writes idx itself (n < N too)
        idx = self.arrays[L.name + ".index"].reshape(-1)[:co * self._n * ho * wo].reshape(co, self._n, ho, wo)
        quant.unpack_codes(idx.reshape(-1), self.arrays[L.name + ".argmax"][:quant.packed_nbytes(idx.size, 4)], 4)
        maxpool_backward(self._view(step.dest, self.in_shape[L.name]),
                         self._view(step.dout, self.out_shape[L.name]), idx, L.k, L.stride, L.pad)

    # ------------------------------------------------------------------ train
    def train_step(self, x, labels, opt):
        """forward + backward + opt.step(); returns the loss."""
        loss, _ = self.forward(x, labels)
        if not numpy.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss} (learning rate too high?)")
        self.backward()
        if self._gpu and self.use_fast and type(opt) is SGD:
            cuda.sgd_step(opt)                           # one fused kernel per tensor
        else:
            opt.step()
        return loss

    def summary(self):
        by = self.plan.bytes_by_kind()
        return (f"{self.net.name}: {self.net.num_params():,} params, batch {self.N}, "
                f"input {self.input_shape}, mode {self.mode}"
                + (f" ({self.bits}-bit)" if self.mode != "exact" else "")
                + f", {self.dtype}; planned {fmt_bytes(self.plan.total_bytes)} "
                  f"(saved {fmt_bytes(by['saved'])}, buffers {fmt_bytes(by['buffers'])})")
