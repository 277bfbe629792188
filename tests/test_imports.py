"""The package's layering, checked: every lowmem module imports first in a fresh interpreter,
each folder imports only the folders below it, and the package's import graph has no cycle."""
import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "lowmem"


def module_name(path):
    parts = ("lowmem",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__main__.py"}
MODULES = sorted(FILES)


def test_modules_found():
    assert {"lowmem.core.optable", "lowmem.core.schedule", "lowmem.core.engine", "lowmem.ops.conv"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_first(module):
    r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


# The folders from the bottom up, and what each must not import, even indirectly: a folder
# imports only the ones below it (docs/engine.md's folder map). data/ and bits/ sit side by
# side above core/ (bits/auto.py normalises training batches); nn.py and models.py are the
# public face over core/ and formats/ (the ONNX reader, handed the builder).
ABOVE_CORE = ("lowmem.formats", "lowmem.bits", "lowmem.train", "lowmem.data", "lowmem.tools", "lowmem.nn",
              "lowmem.models")
LAYERS = {
    "lowmem.system": ("lowmem.ops", "lowmem.units", "lowmem.core") + ABOVE_CORE,
    "lowmem.ops": ("lowmem.units", "lowmem.core") + ABOVE_CORE,
    "lowmem.units": ("lowmem.core",) + ABOVE_CORE,
    "lowmem.core": ABOVE_CORE,
    "lowmem.formats": ABOVE_CORE[1:],           # the ONNX reader: under nn, which hands it the builder
    "lowmem.bits": ("lowmem.train", "lowmem.tools"),
    "lowmem.data": ("lowmem.train", "lowmem.tools"),
    "lowmem.train": ("lowmem.tools",),
}


def test_every_folder_has_a_layer():
    folders = {"lowmem." + p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders == set(LAYERS) | {"lowmem.tools"}


@pytest.mark.parametrize("folder,forbidden", sorted(LAYERS.items()))
def test_lower_layers_import_no_upper_ones(folder, forbidden):
    """A fresh interpreter loads every module of the folder without running lowmem/__init__.py
    (which imports everything) and lists the lowmem modules that came with them."""
    modules = [m for m in MODULES if m == folder or m.startswith(folder + ".")]
    code = (f"import sys, types; pkg = types.ModuleType('lowmem'); pkg.__path__ = [{str(PACKAGE)!r}]; "
            f"sys.modules['lowmem'] = pkg; " + "".join(f"import {m}; " for m in modules)
            + "print(' '.join(sorted(m for m in sys.modules if m.startswith('lowmem.'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = r.stdout.split()
    assert set(modules) <= set(loaded)
    assert not [m for m in loaded if m.startswith(forbidden)], loaded


def imports_of(module):
    """The lowmem modules `module` imports, anywhere in its file (module or function level):
    `from .x import name` counts as x, or as x.name when that is a module."""
    path = FILES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "lowmem"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "lowmem":
                target = node.module
            else:
                continue
            found |= {f"{target}.{a.name}" if f"{target}.{a.name}" in FILES else target for a in node.names}
    return found & set(FILES) - {module}


def cycles(graph):
    """Every cycle a depth-first walk of {node: successors} meets, as lists of nodes."""
    state, path, found = {}, [], []

    def visit(u):
        state[u] = "open"
        path.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                found.append(path[path.index(v):] + [v])
            elif v not in state:
                visit(v)
        path.pop()
        state[u] = "done"
    for u in sorted(graph):
        if u not in state:
            visit(u)
    return found


def test_the_import_graph_has_no_cycle():
    graph = {m: imports_of(m) for m in MODULES}
    assert graph["lowmem.ops.winograd"] >= {"lowmem.ops.chunks"} and "lowmem.core.plan" in graph["lowmem.core.engine"]
    assert not cycles(graph), "import cycles: " + "; ".join(" -> ".join(c) for c in cycles(graph))


def test_the_cycle_finder():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
