"""Where a lowmem training step spends its time, by op kind: cProfile's own time of every
function, each function's time charged to the op kind that called it.

    stats = profile(step, steps=2)                 # cProfile over `steps` calls of step()
    kinds, functions = by_kind(stats)              # {kind: seconds}, {kind: {function: seconds}}
    print(kind_table({"lowmem-approx4": kinds}, steps=2))

How a function's own time finds its kind. cProfile records, for every function, its own time
and, per caller, the time spent in it from that caller. A numba kernel or a NumPy ufunc has no
Python frame of its own in lowmem's code: its time is the own time of a builtin (numpy.matmul,
ufunc.reduce) or of the Python function that called the compiled kernel. So each function's own
time walks up its callers (split in proportion to the time each caller spent in it) until it
reaches a function that names a kind:

  * a module that is one kind wherever it is called from (MODULE_KINDS): the range code (how a
    conv keeps an input that is no BN-ReLU unit's output: its K-bit range code, or in exact mode a
    float copy), the bit packers, depthwise/grouped convolution, pooling, the optimizer;
  * the dense convolution modules (ops/conv, ops/winograd, ops/columns): time below them is
    "conv GEMMs" when it is numpy.matmul's, else "conv columns, transforms" (im2col, col2im,
    Winograd's tiles, copies) -- unless a depthwise kernel above them claims it;
  * an op's handler in lowmem/core/optable/ (OP_KINDS, by the class that holds the method):
    the BN-ReLU unit, a standalone BN, ReLU/ReLU6/dropout, pools, add/concat, the head;
  * anything else (the engine's Python loop, the step's own code) is "other".

Everything else (lowmem/system/threads.py, the units' kernel sets, ops/batchnorm's functions that
both BN kinds call, NumPy's Python wrappers) passes its time on to its callers. The kinds' sums
add up to the profile's total own time (by_kind checks it).

One exception to "its callers": cProfile keeps one caller table per function, not per call path,
so the thread pool's dispatcher (threads.parallel_for, which every kernel set, pool and conv calls)
would mix every kernel's time with every other's (a batch norm's kernel charged in part to the
convs). A function the dispatcher calls is a lambda or closure handed to it by the function it
is written in; that enclosing function is taken as its caller instead.

cProfile sees the thread that calls it: run the profiled step with one lowmem thread
(threads.configure(1)) for the whole step's work. With more threads the time a pool thread
works is not seen, and the calling thread's wait for it is charged to the op that waits.
cProfile's own overhead per call inflates Python-heavy kinds ("other" most): read shares, and
compare them between configurations profiled the same way.
"""
import ast
import cProfile
import os
import pstats
import re

KINDS = ("conv GEMMs", "conv columns, transforms", "depthwise/grouped conv", "range code, kept inputs",
         "ReLU/ReLU6/dropout, masks, packing", "BN-ReLU unit", "standalone BN", "pools", "add, concat",
         "linear, loss", "SGD update", "other")

# lowmem modules (paths below lowmem/, as a regular expression's start) that are one kind wherever called
MODULE_KINDS = ((r"units/rangecode", "range code, kept inputs"),
                (r"units/pack|ops/bitpack|ops/pack", "ReLU/ReLU6/dropout, masks, packing"),
                (r"ops/conv_groups|ops/depthwise|ops/grouped", "depthwise/grouped conv"),
                (r"ops/pool", "pools"),
                (r"train/optim", "SGD update"))
# the kinds both sides of compare_torch.py can name (benchmarks/torch_profile.py: PyTorch's), and
# lowmem's kinds folded into them: PyTorch runs batch norm and ReLU as two ops where lowmem fuses
# them, and has no range code (it keeps its activations by reference)
COARSE = ("dense convolutions", "depthwise/grouped conv", "batch norm, ReLU (units, masks)",
          "range code, kept inputs", "pools", "add, concat", "linear, loss", "SGD update", "other")
COARSE_OF = {"conv GEMMs": COARSE[0], "conv columns, transforms": COARSE[0], "depthwise/grouped conv": COARSE[1],
             "range code, kept inputs": COARSE[3], "ReLU/ReLU6/dropout, masks, packing": COARSE[2],
             "BN-ReLU unit": COARSE[2], "standalone BN": COARSE[2], "pools": COARSE[4], "add, concat": COARSE[5],
             "linear, loss": COARSE[6], "SGD update": COARSE[7], "other": COARSE[8]}
DENSE_CONV = r"ops/(conv|winograd|columns)"          # "conv GEMMs" below numpy.matmul, else "conv columns, transforms"
# op handlers in lowmem/core/optable/, by the class their method belongs to
OP_KINDS = {"BNReLU": "BN-ReLU unit", "BN": "standalone BN",
            "_Elementwise": "ReLU/ReLU6/dropout, masks, packing", "ReLU": "ReLU/ReLU6/dropout, masks, packing",
            "ReLU6": "ReLU/ReLU6/dropout, masks, packing", "Dropout": "ReLU/ReLU6/dropout, masks, packing",
            "MaxPool": "pools", "AvgPool2d": "pools", "GlobalAvgPool": "pools",
            "Add": "add, concat", "AddGrad": "add, concat", "Copy": "add, concat", "Concat": "add, concat",
            "Linear": "linear, loss", "FlattenLinear": "linear, loss", "Loss": "linear, loss",
            "Average": "linear, loss", "Conv": "conv columns, transforms"}
GEMM_NAMES = ("matmul",)                             # functions whose time below a dense conv is its GEMMs


def profile(step, steps):
    """pstats.Stats of `steps` calls of step() under one cProfile. numpy.matmul is a ufunc, which
    cProfile does not see: while profiling it is wrapped in a Python function (`matmul`, what
    ops/conv.py and ops/winograd.py reach through the module attribute) so that the GEMMs' time is
    that function's own time instead of their caller's."""
    import numpy
    real = numpy.matmul

    def matmul(*args, **kwargs):
        return real(*args, **kwargs)
    prof = cProfile.Profile()
    numpy.matmul = matmul
    try:
        prof.enable()
        for _ in range(steps):
            step()
        prof.disable()
    finally:
        numpy.matmul = real
    return pstats.Stats(prof)


def _lowmem_path(filename):
    """The path below the lowmem package ('ops/conv.py'), or None outside lowmem."""
    parts = filename.replace("\\", "/").split("/lowmem/")
    return parts[-1] if len(parts) > 1 and not filename.startswith("~") else None


def _spans(filename, kinds):
    """[(first line, decorators included; last line; name)] of the nodes of `kinds` in a file's
    syntax tree (a lambda is named "<lambda>"); none for a file that cannot be read or parsed."""
    try:
        with open(filename) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return []
    return [(min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", ())]), n.end_lineno,
             getattr(n, "name", "<lambda>")) for n in ast.walk(tree) if isinstance(n, kinds)]


class _Classes:
    """(file, line) -> the optable class whose body holds that line, from each file's syntax tree."""

    def __init__(self):
        self.spans = {}

    def at(self, filename, line):
        if filename not in self.spans:
            self.spans[filename] = _spans(filename, ast.ClassDef)
        inside = [s for s in self.spans[filename] if s[0] <= line <= s[1]]
        return min(inside, key=lambda s: s[1] - s[0])[2] if inside else None


class _Enclosing:
    """(file, line, name) of a nested function or lambda -> the cProfile key (file, first line,
    name) of the function whose body it is written in, from each file's syntax tree (None at
    module or class level)."""

    def __init__(self):
        self.spans = {}

    def of(self, func):
        filename, line, name = func
        if filename not in self.spans:
            self.spans[filename] = _spans(filename, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        inside = [s for s in self.spans[filename]
                  if s[0] <= line <= s[1] and s[2] != "<lambda>" and (s[0], s[2]) != (line, name)]
        if not inside:
            return None
        first, _end, outer = min(inside, key=lambda s: s[1] - s[0])
        return filename, first, outer


def _dispatcher(func):
    """Whether func is the thread pool's (lowmem/system/threads.py), which runs the functions handed to it."""
    return _lowmem_path(func[0]) == "system/threads.py"


def _callers(table, func, enclosing):
    """{caller: seconds spent in func from it} of a profiled function, the thread pool's
    dispatcher replaced by the function func is written in (module docstring)."""
    callers = table[func][4] if func in table else {}
    outer = enclosing.of(func) if any(_dispatcher(c) for c in callers) else None
    if outer is None or outer not in table:
        return {c: edge[3] for c, edge in callers.items()}
    out = {}
    for caller, edge in callers.items():
        key = outer if _dispatcher(caller) else caller
        out[key] = out.get(key, 0.0) + edge[3]
    return out


def _own_kind(func, classes):
    """(kind, dense) of a profiled function: the kind it names (None: it passes its time on),
    dense: it is a dense convolution's (ops/conv, winograd, columns)."""
    filename, line, name = func
    path = _lowmem_path(filename)
    if path is None:
        return None, False
    for pattern, kind in MODULE_KINDS:
        if re.match(pattern, path):
            return kind, False
    if re.match(DENSE_CONV, path):
        return None, True
    if path.startswith("core/optable/"):
        cls = classes.at(filename, line)
        if cls is not None:
            return OP_KINDS.get(cls, "other"), False
    return None, False


def by_kind(stats):
    """({kind: own seconds}, {kind: {function label: own seconds}}) of a pstats.Stats: every
    function's own time charged to the kinds found by walking up its callers (module docstring).
    The kinds' seconds sum to the profile's total own time."""
    table = stats.stats
    classes, enclosing = _Classes(), _Enclosing()
    own = {f: _own_kind(f, classes) for f in table}
    shares = {}                           # (func, gemm, dense) -> {kind: fraction of func's time}

    def share(func, gemm, dense):
        key = (func, gemm, dense)
        if key in shares:
            return shares[key] or {"other": 1.0}           # None: on the walk now (a cycle)
        shares[key] = None
        kind, is_dense = own.get(func, (None, False))
        dense = dense or is_dense
        callers = _callers(table, func, enclosing)              # time spent in func, per caller
        total = sum(callers.values())
        out = {}
        if kind is None and total > 0:
            for caller, seconds in callers.items():
                for k, f in share(caller, gemm, dense).items():
                    out[k] = out.get(k, 0.0) + f * seconds / total
        else:
            if kind == "conv columns, transforms" or (kind is None and dense):
                kind = "conv GEMMs" if gemm else "conv columns, transforms"
            out[kind or "other"] = 1.0
        shares[key] = out
        return out

    kinds = dict.fromkeys(KINDS, 0.0)
    functions = {k: {} for k in KINDS}
    for func, row in table.items():
        if row[2] <= 0:
            continue
        filename, _line, name = func
        path = _lowmem_path(filename)
        label = name if filename == "~" else f"{path or os.path.basename(filename)}:{name}"
        for kind, f in share(func, name in GEMM_NAMES, False).items():
            kinds[kind] += row[2] * f
            functions[kind][label] = functions[kind].get(label, 0.0) + row[2] * f
    return kinds, functions


def total_seconds(stats):
    """The profile's total own time (what by_kind shares out)."""
    return sum(row[2] for row in stats.stats.values())


def kind_table(per_config, steps, top=None, kinds=KINDS):
    """A table of seconds per step and share of the profiled step, one column per configuration
    ({config: {kind: seconds over `steps` steps}}), a row per kind of `kinds` (KINDS, or COARSE
    for lowmem's folded by coarse() beside PyTorch's from torch_profile); `top` {config: {kind:
    {function: s}}} adds, under the table, each configuration's three largest functions of "other"."""
    configs = list(per_config)
    totals = {c: sum(per_config[c].values()) for c in configs}
    head = f"{'op kind (own time per step)':<36}" + "".join(f"{c:>24}" for c in configs)
    lines = [head, "-" * len(head)]
    for kind in kinds:
        cells = "".join(f"{per_config[c][kind] / steps:>13.3f} s {per_config[c][kind] / max(totals[c], 1e-12):>7.1%}"
                        for c in configs)
        lines.append(f"{kind:<36}{cells}")
    lines.append(f"{'profiled step':<36}" + "".join(f"{totals[c] / steps:>13.3f} s {1:>7.1%}" for c in configs))
    for c in configs if top else ():
        other = sorted(top[c]["other"].items(), key=lambda kv: -kv[1])[:3]
        lines.append(f"  {c}, largest in other: " + ", ".join(f"{f} {s / steps:.3f} s" for f, s in other))
    return "\n".join(lines)


def coarse(kinds):
    """{coarse kind: seconds} of by_kind's {kind: seconds} (COARSE_OF)."""
    out = dict.fromkeys(COARSE, 0.0)
    for kind, seconds in kinds.items():
        out[COARSE_OF[kind]] += seconds
    return out
