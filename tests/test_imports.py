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
    assert {"lowmem.optable", "lowmem.schedule", "lowmem.engine", "lowmem.ops.conv"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_first(module):
    r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
