"""lowmem/system/kernel_cache.py: numba's on-disk cache of a kernel goes stale when any file of the
package changes, not only the kernel's own (a helper compiled into it from another file)."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("numba")

from lowmem.system import kernel_cache  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RUN = textwrap.dedent("""
    import sys
    sys.path.insert(0, {pkg!r})
    from lowmem.system import kernel_cache          # lowmem's import installs the locators
    kernel_cache.PACKAGE, kernel_cache._digest = {pkg!r}, None     # this folder as the package
    import kernel
    print(kernel.kernel(), type(kernel.kernel._cache._impl.locator).__name__)
""")


def run(pkg):
    """kernel.kernel() and its locator's class, in a fresh process (so only the disk cache carries over)."""
    out = subprocess.run([sys.executable, "-c", RUN.format(pkg=str(pkg))], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def write_helper(pkg, value):
    (pkg / "helper.py").write_text(f"from numba import njit\n\n\n@njit(cache=True)\ndef helper():\n"
                                   f"    return {value}\n")


def test_a_kernel_compiles_again_when_a_helper_in_another_file_changes(tmp_path):
    """kernel.py's cached kernel calls helper.py's helper (compiled into it). After helper.py
    changes, the next process runs the new helper: the kernel's cache entry is stale (numba
    alone keys it on kernel.py, which did not change, and runs the old helper)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    write_helper(pkg, 1)
    (pkg / "kernel.py").write_text("from numba import njit\n\nfrom helper import helper\n\n\n"
                                   "@njit(cache=True)\ndef kernel():\n    return helper() + 10\n")
    assert run(pkg) == ["11", "PackageInTreeCacheLocator"]
    assert any(n.startswith("kernel.kernel") and n.endswith(".nbi") for n in os.listdir(pkg / "__pycache__"))
    assert run(pkg)[0] == "11"                                  # loaded from the cache
    write_helper(pkg, 2)
    assert run(pkg)[0] == "12"


def test_the_digest_covers_every_file_and_nothing_outside(tmp_path, monkeypatch):
    """The digest changes with any .py file's bytes and with a file added; caches (__pycache__)
    and other files do not count; a source outside the package is not the package's."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    monkeypatch.setattr(kernel_cache, "PACKAGE", str(pkg))

    def digest():
        monkeypatch.setattr(kernel_cache, "_digest", None)
        return kernel_cache.package_digest()
    first = digest()
    assert digest() == first
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "c.py").write_text("z = 3\n")
    (pkg / "notes.txt").write_text("not source\n")
    assert digest() == first
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    second = digest()
    assert second != first
    (pkg / "sub" / "new.py").write_text("")
    assert digest() not in (first, second)
    assert kernel_cache.in_package(str(pkg / "sub" / "b.py"))
    assert not kernel_cache.in_package(str(tmp_path / "other.py"))
    assert not kernel_cache.in_package(str(tmp_path / "pkg2" / "a.py"))


def test_lowmem_kernels_take_the_package_locator():
    """The locators are installed with lowmem's kernels: a kernel of the package is cached where
    numba would cache it, under the package-wide stamp."""
    from lowmem.ops import bitpack_cpu
    if not bitpack_cpu.AVAILABLE:
        pytest.skip("numba kernels turned off (LOWMEM_FAST=0)")
    locator = bitpack_cpu.pack_bytes._cache._impl.locator
    assert type(locator).__name__.startswith("Package")
    assert locator.get_source_stamp()[1] == kernel_cache.package_digest()
    if not os.environ.get("NUMBA_CACHE_DIR"):
        in_tree = os.path.join(os.path.dirname(os.path.abspath(bitpack_cpu.__file__)), "__pycache__")
        if os.access(os.path.dirname(in_tree), os.W_OK):
            assert bitpack_cpu.pack_bytes._cache.cache_path == in_tree
