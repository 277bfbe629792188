"""An inference-only engine: eval-mode logits with no saved slots, gradients or optimizer state.

    eng = InferenceEngine(net, batch_size=32, input_shape=(3, 224, 224))
    print(eng.plan.report())          # params, stats, shared buffers, input, workspace
    logits = eng.predict(x)           # any batch n <= batch_size; BN running statistics

It runs the same forward steps as `Engine.predict` (the schedule of an exact-mode
Engine built with allocate=False, its forward phase without the loss) on a plan
that keeps only what an eval forward touches: the parameters and running statistics,
the three shared buffers, the head's buffers, the input slot, the workspaces (conv
columns, max-pool window indices) and the slot the global pool writes for the
classifier. Nothing a training step keeps for backward (x-hat slots, argmax codes,
probabilities), no gradients, no optimizer state: memory is that of `batch_size`
samples whatever the number of images predicted (lowmem predict runs fixed chunks).

The network's weights are copied into the plan; the network itself is not changed
(it may still belong to a training Engine).
"""
import numpy

from ..system import backend, threads
from . import checks
from .engine import DEFAULT_WORKSPACE_BYTES, Engine
from .network import Parameter
from .optable import OPS
from .plan import Plan
from .runstate import RunState
from ..ops.codes import codes_for
from ..ops.conv import columns_for

DROPPED = ("grads", "optimizer")            # kinds an eval forward never touches
TRAINING_ONLY = ("labels", "dlogits", "dfeat")


class InferenceEngine:
    def __init__(self, net, batch_size, input_shape, dtype="float32", workspace_bytes=DEFAULT_WORKSPACE_BYTES,
                 use_fast=None):
        full = Engine(net, batch_size, input_shape, "exact", 4, dtype, workspace_bytes, allocate=False,
                      use_fast=use_fast)
        self.net, self.N, self.dtype, self.input_shape = net, full.N, full.dtype, full.input_shape
        self.xp = backend.xp
        self.steps = [s for s in full.schedule if s.phase == "fwd" and s.op not in ("loss", "average")]
        read = {n for s in self.steps for n in (s.src, s.dst)}
        self.plan = Plan()
        for e in full.plan.entries:
            if e.kind in DROPPED or e.name in TRAINING_ONLY or (e.kind == "saved" and e.name not in read):
                continue
            self.plan.add(e.name, "buffers" if e.kind == "saved" else e.kind, e.shape, e.dtype)
        threads.configure()
        self.arrays = self.plan.allocate(self.xp)
        params = {}
        for p in net.parameters():
            a = self.arrays[p.name]
            a[...] = self.xp.asarray(backend.to_numpy(p.data))
            params[p.name] = Parameter(p.name, a, decay=p.decay)
        stats, flat, at = {}, self.arrays["bn.running"], 0
        for name, s in net.stats.items():
            n = int(numpy.prod(s.shape))
            stats[name] = flat[at:at + n].reshape(s.shape)
            stats[name][...] = self.xp.asarray(backend.to_numpy(s))
            at += n
        self.run = RunState(self.arrays, params, stats, None, {}, columns_for(self.xp, full.fused),
                            codes=codes_for(self.xp, use_fast))

    def predict(self, x):
        """Eval-mode logits (n, K), a copy, for x (n, C, H, W) with 1 <= n <= batch_size."""
        checks.batch(x, self.xp, self.dtype, self.input_shape, self.N, "predict")
        run = self.run
        run.n, run.training = x.shape[0], False
        self.xp.copyto(run.act("input", self.input_shape), x.transpose(1, 0, 2, 3))
        for step in self.steps:
            OPS[step.op].forward(run, step)
        return run.batch("logits").copy()
