"""benchmarks/: every script imports and prints its --help; every private name of the lowmem package
a benchmark uses is listed here and exists; the kernel-variant benchmark (which rebuilds a kernel
from its source text) runs. Nothing is timed: the figures a benchmark prints are not checked.

A private name is a name with one leading underscore that a benchmark reaches in lowmem: imported
from a lowmem module, an attribute of a lowmem module, a string naming a private attribute of a
lowmem module the script uses (getattr, a kernel's globals) or written as `module._name` inside a
string (source text compiled by the script), or a private method or attribute of a lowmem class
the script subclasses. PRIVATE lists them all: a benchmark that reaches another one adds it here,
where this test checks that it exists.
"""
import ast
import importlib
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lowmem

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(BENCH.glob("*.py"))
PYTHON = sys.executable

# (script, lowmem module, private name)
PRIVATE = {
    ("pool_handover.py", "lowmem.system.threads", "_in_range"),
    ("pool_handover.py", "lowmem.system.threads", "_local"),
    ("conv_parts.py", "lowmem.ops.winograd", "_planes"),
    ("gemm_floor.py", "lowmem.ops.conv", "_flat"),
    ("gemm_floor.py", "lowmem.ops.conv", "_is_pointwise"),
    ("gemm_floor.py", "lowmem.ops.winograd", "_chunk"),
    ("gemm_floor.py", "lowmem.ops.winograd", "_most"),
    ("gemm_floor.py", "lowmem.ops.winograd", "_pair"),
    ("gemm_floor.py", "lowmem.ops.winograd", "_split_planes"),
    ("gemm_floor.py", "lowmem.ops.winograd", "_weight_block"),
    ("gemm_floor.py", "lowmem.ops.winograd", "_weight_planes"),
    ("draw_noise.py", "lowmem.bits.simulate", "SimulatedCodeUnits._kept"),
    ("draw_noise.py", "lowmem.bits.simulate", "SimulatedCodeUnits._quantize"),
    ("draw_noise.py", "lowmem.bits.simulate", "_units"),
    ("unbiased_bias.py", "lowmem.bits.simulate", "SimulatedCodeUnits._kept"),
    ("unbiased_bias.py", "lowmem.bits.simulate", "SimulatedCodeUnits._quantize"),
    ("unbiased_draw_cost.py", "lowmem.units.cpu_base", "_counter_bits"),
    ("unbiased_draw_cost.py", "lowmem.units.unbiased_cpu", "_draw_each"),
    ("unbiased_draw_cost.py", "lowmem.units.unbiased_cpu", "_forward_rows"),
} | {("unit_kernels.py", "lowmem.units.window_cpu", name) for name in (
    "_quantize_block", "_pack", "_unpack", "_decode_relu_block", "_decode_sums", "_decode_dx_block",
    "_forward_exact", "_exact_sums", "_exact_dx_block", "_stats")} | {
    ("unit_kernels.py", "lowmem.units.unbiased_cpu", name) for name in (
        "_forward_rows", "_range", "_draw_each", "_draw_dither", "_draw_systematic", "_decode_rows", "_conv_input",
        "_backward_rows", "_sums", "_dx")} | {
    ("unit_kernels.py", "lowmem.units.cpu_base", name) for name in ("_pack", "_unpack")}  # the packer's loops, named in ASM_KERNELS


def private(name):
    return name.startswith("_") and not name.startswith("__")


def lowmem_modules():
    """{module basename: [dotted names]} of every lowmem module (for `cpu_base._x` in source text)."""
    out = {}
    for m in pkgutil.walk_packages(lowmem.__path__, "lowmem."):
        out.setdefault(m.name.rsplit(".", 1)[1], []).append(m.name)
    return out


def module_or_none(dotted):
    try:
        return importlib.import_module(dotted)
    except ImportError:
        return None


def private_names(path, by_basename):
    """{(script, module, name)} of the lowmem private names a benchmark's source reaches (module docstring)."""
    tree = ast.parse(path.read_text())
    script, found, aliases = path.name, set(), {}          # aliases: local name -> lowmem module or class
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "lowmem":
                    aliases[a.asname or "lowmem"] = a.name if a.asname else "lowmem"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lowmem":
            for a in node.names:
                if module_or_none(f"{node.module}.{a.name}") is not None:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                elif private(a.name):
                    found.add((script, node.module, a.name))

    def resolve(expr):
        """The lowmem module (or `module.Class`) an expression names, else None."""
        if isinstance(expr, ast.Name):
            return aliases.get(expr.id)
        if isinstance(expr, ast.Attribute):
            base = resolve(expr.value)
            if base and module_or_none(f"{base}.{expr.attr}") is not None:
                return f"{base}.{expr.attr}"
            if base and inspect.isclass(getattr(module_or_none(base), expr.attr, None)):
                return f"{base}.{expr.attr}"
        return None

    used = [m for m in set(aliases.values()) if module_or_none(m) is not None]
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            owner = resolve(node.value)
            if owner and module_or_none(owner) is not None:
                found.add((script, owner, node.attr))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if private(node.value) and node.value.isidentifier():
                found |= {(script, m, node.value) for m in used if hasattr(module_or_none(m), node.value)}
            for mod, name in re.findall(r"\b(\w+)\.(_[A-Za-z]\w*)", node.value):
                found |= {(script, m, name) for m in by_basename.get(mod, ()) if hasattr(module_or_none(m), name)}
        elif isinstance(node, ast.ClassDef):
            for base in node.bases:
                owner = resolve(base)
                if owner is None or module_or_none(owner) is not None:
                    continue
                module, cls = owner.rsplit(".", 1)
                source = inspect.getsource(getattr(module_or_none(module), cls))
                names = {n.name for n in node.body if isinstance(n, ast.FunctionDef) and private(n.name)}
                names |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and private(n.attr)
                          and isinstance(n.value, ast.Name) and n.value.id == "self"
                          and re.search(rf"\bself\.{n.attr}\b|\bdef {n.attr}\b", source)}
                found |= {(script, module, f"{cls}.{n}") for n in names}
    return found


def exists(module, name):
    obj = importlib.import_module(module)
    for part in name.split("."):
        if not hasattr(obj, part):
            return part == name.split(".")[-1] and inspect.isclass(obj) and f"self.{part}" in inspect.getsource(obj)
        obj = getattr(obj, part)
    return True


def test_every_private_lowmem_name_a_benchmark_reaches_is_listed_and_exists():
    by_basename = lowmem_modules()
    found = set().union(*(private_names(p, by_basename) for p in SCRIPTS))
    assert found == PRIVATE, (f"not listed in PRIVATE: {sorted(found - PRIVATE)}; "
                              f"listed but no longer used: {sorted(PRIVATE - found)}")
    missing = [f"{s}: {m}.{n}" for s, m, n in sorted(PRIVATE) if not exists(m, n)]
    assert not missing, "benchmarks reach lowmem names that do not exist: " + ", ".join(missing)


def test_the_scan_sees_each_way_of_reaching_a_private_name(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(
        "from lowmem.ops import conv, winograd as W\n"
        "from lowmem.ops.conv import _flat\n"
        "import lowmem.units.window_cpu as fast\n"
        "from lowmem.bits import simulate as S\n"
        "W._chunk\n"
        "lowmem_ops = getattr(fast, '_pack')\n"
        "SRC = 'cpu_base._counter_bits(z)'\n"
        "'a docstring naming winograd._input_tiles is no use of it'\n"
        "class V(S.SimulatedCodeUnits):\n"
        "    def _quantize(self, *a):\n"
        "        return self._kept\n")
    assert private_names(script, lowmem_modules()) == {
        ("probe.py", "lowmem.ops.conv", "_flat"), ("probe.py", "lowmem.ops.winograd", "_chunk"),
        ("probe.py", "lowmem.units.window_cpu", "_pack"), ("probe.py", "lowmem.units.cpu_base", "_counter_bits"),
        ("probe.py", "lowmem.bits.simulate", "SimulatedCodeUnits._quantize"),
        ("probe.py", "lowmem.bits.simulate", "SimulatedCodeUnits._kept")}


HELP = r"""
import contextlib, io, json, runpy, sys
sys.path.insert(0, sys.argv[1])
out = {}
for path in sys.argv[2:]:
    sys.argv[:] = [path, "--help"]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(path, run_name="__main__")
        code = None
    except SystemExit as e:
        code = e.code
    out[path] = [code, buf.getvalue()[:200]]
print("HELP " + json.dumps(out))
"""

IMPORT = r"""
import importlib.util, sys
sys.path.insert(0, sys.argv[1])
for path in sys.argv[2:]:
    spec = importlib.util.spec_from_file_location(path.rsplit("/", 1)[1][:-3], path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
print("imported", len(sys.argv) - 2)
"""


def run(code, *args, timeout=600):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([PYTHON, "-c", code, *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)


def test_every_benchmark_imports_without_running():
    pytest.importorskip("numba")                  # unbiased_draw_cost compiles its draw variants' functions at import
    r = run(IMPORT, BENCH, *SCRIPTS)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["imported", str(len(SCRIPTS))]


def test_every_script_prints_its_help():
    pytest.importorskip("numba")
    scripts = [p for p in SCRIPTS if "__main__" in p.read_text()]
    assert len(scripts) >= 20
    r = run(HELP, BENCH, *scripts)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("HELP "))[5:])
    bad = {Path(p).name: v for p, v in got.items() if v[0] not in (0, None) or "usage:" not in v[1]}
    assert not bad, bad


def test_unbiased_draw_cost_rebuilds_its_variants_from_the_kernel_source():
    # the variants are unbiased_cpu._draw_each's own source with its draw line swapped:
    # if the kernel's draw line changes, the script's assertion names it
    pytest.importorskip("numba")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([PYTHON, str(BENCH / "unbiased_draw_cost.py"), "--channels", "2", "--elements", "256",
                        "--repeats", "1"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.splitlines()[1:]]
    assert [" ".join(row[:-2]) for row in rows] == [
        "4-bit, the code", "4-bit, no hash (prices it)", "4-bit, a hash per pair", "4-bit, 32-bit hash",
        "4-bit, systematic draws", "2-bit, the code"]
    assert all(row[-1] == "ms" and float(row[-2]) > 0 for row in rows)
