"""Where a PyTorch training step spends its time, by op kind: the twin of benchmarks/op_profile.py
for the other side of benchmarks/compare_torch.py, in the coarser kinds both sides can name.

    events = profile(step, steps=2)              # torch.profiler over `steps` calls of step()
    kinds, functions = by_kind(events)           # {kind: seconds}, {kind: {op: seconds}}

How an op's time finds its kind. torch.profiler records every ATen op and autograd node it runs,
each with its own (self) CPU time and the event it ran inside (its parent). An op's self time
goes to the outermost kind named on its way up through its parents (itself included): so
aten::mean inside aten::adaptive_avg_pool2d is the pool's, aten::add_ inside
Optimizer.step#SGD.step is the SGD update's (not the residual add's), aten::clamp_min_ inside
aten::relu_ is ReLU's, aten::copy_ inside ConvolutionBackward0 is the convolution's. A name
names a kind by the patterns of RULES, tried in order; what nothing names is "other". A
convolution is depthwise/grouped where the nearest convolution op at or above the event
recorded shapes whose input has more channels than its weight's second dimension.

The kinds (op_profile.COARSE) are op_profile's, folded where the two libraries cut the work
differently (op_profile.coarse folds lowmem's the same way): PyTorch runs batch norm and ReLU as two ops
where lowmem fuses them into one unit, and keeps its activations by reference where lowmem keeps
its range code (a kind PyTorch's step does not have). Profile on one thread
(torch.set_num_threads(1)): each op's self time is then all the work it did; on more threads
the time is the calling thread's wall time inside the op. The profiler's own overhead per op is
in its times, as cProfile's is in op_profile's: read the shares.
"""
import re

from op_profile import COARSE           # beside this script: benchmarks/op_profile.py

CONV, DEPTHWISE = COARSE[0], COARSE[1]
# (a pattern on an event's name, lower case; the kind it names), tried in order: ATen ops
# (aten::conv2d, aten::addmm, ...), autograd nodes (ConvolutionBackward0, ...), the optimizer's
RULES = ((r"optimizer\.(step|zero_grad)", "SGD update"),
         (r"conv", CONV),
         (r"batch_?norm|relu|threshold|hardtanh|clamp|dropout|bernoulli", COARSE[2]),
         (r"pool", "pools"),
         (r"::linear$|::addmm$|::mm$|mmbackward|nll_?loss|log_?softmax|cross_entropy", "linear, loss"),
         (r"::add_?$|addbackward|::cat$|catbackward", "add, concat"))


def profile(step, steps):
    """torch.profiler's events (record_shapes on) over `steps` calls of step()."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            step()
    return prof.events()


def _groups(event):
    """A convolution op's groups from its recorded input shapes (the input's channels over the
    weight's second dimension: aten::conv2d (input, weight, ...), aten::convolution_backward
    (grad_output, input, weight, ...)), or None where they are not there to read."""
    four = [sh for sh in (getattr(event, "input_shapes", None) or []) if isinstance(sh, (list, tuple)) and len(sh) == 4]
    backward = "backward" in event.name.lower()
    if len(four) < (3 if backward else 2):
        return None
    x, w = (four[1], four[2]) if backward else (four[0], four[1])
    return x[1] // w[1] if w[1] and x[1] % w[1] == 0 else None


def _own(event):
    """The kind an event's name names, or None."""
    name = event.name.lower()
    return next((kind for pattern, kind in RULES if re.search(pattern, name)), None)


def by_kind(events):
    """({kind: self seconds}, {kind: {op name: self seconds}}) of torch.profiler's events: every
    event's self CPU time charged to the outermost kind named at or above it (module docstring).
    The kinds' seconds sum to the events' total self time."""
    memo = {}

    def walk(event):
        """(the outermost kind named at or above event, the groups of the nearest convolution op
        at or above it that recorded its shapes)."""
        key = id(event)
        if key not in memo:
            parent = getattr(event, "cpu_parent", None)
            outer, groups = walk(parent) if parent is not None else (None, None)
            own = _groups(event) if "conv" in event.name.lower() else None
            memo[key] = (outer or _own(event), own if own is not None else groups)
        return memo[key]

    kinds = dict.fromkeys(COARSE, 0.0)
    functions = {k: {} for k in COARSE}
    for event in events:
        seconds = event.self_cpu_time_total / 1e6
        if seconds <= 0:
            continue
        kind, groups = walk(event)
        kind = DEPTHWISE if kind == CONV and groups and groups > 1 else (kind or "other")
        kinds[kind] += seconds
        functions[kind][event.name] = functions[kind].get(event.name, 0.0) + seconds
    return kinds, functions


def total_seconds(events):
    """The events' total self CPU time (what by_kind shares out)."""
    return sum(max(e.self_cpu_time_total, 0) for e in events) / 1e6
