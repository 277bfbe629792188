"""Every lowmem module imports first, in a fresh interpreter: no import cycle at package level
works only because of import order (issue 19)."""
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "lowmem"
MODULES = sorted("lowmem." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts).replace(".__init__", "")
                 for p in PACKAGE.rglob("*.py") if p.name != "__main__.py")


def test_modules_found():
    assert {"lowmem.core.optable", "lowmem.core.schedule", "lowmem.core.engine", "lowmem.ops.conv"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_first(module):
    r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


LAYERS = {   # a module -> lowmem packages it must not import, even indirectly
    "lowmem.ops": ("lowmem.units", "lowmem.core.engine", "lowmem.core.optable", "lowmem.core.schedule"),
    "lowmem.system.cuda": ("lowmem.units", "lowmem.ops", "lowmem.train.optim"),
}


@pytest.mark.parametrize("module,forbidden", sorted(LAYERS.items()))
def test_lower_layers_import_no_upper_ones(module, forbidden):
    """ops/ is the bottom layer (no ops -> kernels import), and the CUDA helper imports none of its
    callers. A fresh interpreter loads the module without running lowmem/__init__.py (which
    imports everything) and lists the lowmem modules that came with it."""
    code = (f"import sys, types; pkg = types.ModuleType('lowmem'); pkg.__path__ = [{str(PACKAGE)!r}]; "
            f"sys.modules['lowmem'] = pkg; import {module}; "
            f"print(' '.join(sorted(m for m in sys.modules if m.startswith('lowmem.'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = r.stdout.split()
    assert module in loaded
    assert not [m for m in loaded if m.startswith(forbidden)], loaded
