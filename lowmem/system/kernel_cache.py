"""numba's on-disk cache for lowmem's kernels, kept fresh across the whole package.

numba (cache=True) stores each compiled kernel beside its source (`__pycache__/*.nbi`, `*.nbc`)
and reuses it while that one source file is unchanged. But a kernel here is compiled together
with what it calls and reads from other files: the packer's loops (ops/bitpack_cpu.py) inside
the ReLU's, the units' and the range code's kernels, the block size (units/cpu_base.py) and the
range code's group (units/rangecode.py) frozen in as constants. Keyed on its own file alone, a
kernel whose helper changed (a pull into an editable install, an edit while studying a kernel)
would keep running the old helper without a word.

`install()` puts a locator in front of numba's own for the files of this package: the same
cache directory numba would pick (NUMBA_CACHE_DIR when set, else the source's `__pycache__`,
else the user-wide one), and as a kernel's source stamp numba's stamp of its own file together
with one digest of every `.py` file of the package. A change to any of them makes every
kernel's cache entry stale: each kernel compiles again the first time it runs, once, and is
cached again. Nothing outside lowmem is touched; NUMBA_CACHE_LOCATOR_CLASSES, where a user
sets it, still decides alone (numba reads it before the default list).
"""
import hashlib
import os

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))    # lowmem/

_digest = None


def package_digest():
    """sha256 (hex) of every `.py` file under the package, their paths relative to it and
    their bytes, in sorted order: computed once per process (about a thousandth of a second)."""
    global _digest
    if _digest is None:
        h = hashlib.sha256()
        files = []
        for root, dirs, names in os.walk(PACKAGE):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            files += [os.path.join(root, n) for n in names if n.endswith(".py")]
        for path in sorted(files):
            h.update(os.path.relpath(path, PACKAGE).replace(os.sep, "/").encode())
            h.update(b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
            h.update(b"\0")
        _digest = h.hexdigest()
    return _digest


def in_package(py_file):
    """Whether a kernel's source file lies inside this package."""
    try:
        return os.path.commonpath([PACKAGE, os.path.abspath(py_file)]) == PACKAGE
    except ValueError:                    # another drive (Windows), a placeholder name
        return False


_installed = False


def install():
    """Put the package-wide locators first in numba's list (once; a no-op without numba).
    Must run before the first kernel is decorated: numba picks a kernel's locator then
    (system/backend.numba_available calls it, which every kernel module asks first)."""
    global _installed
    if _installed:
        return
    from numba.core import caching
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")

    def package_wide(base):
        class Locator(base):
            """numba's `base` locator for lowmem's files, its stamp widened to the package."""

            def get_source_stamp(self):
                return (super().get_source_stamp(), package_digest())

            @classmethod
            def from_function(cls, py_func, py_file):
                if not in_package(py_file):
                    return None
                return super().from_function(py_func, py_file)
        Locator.__name__ = Locator.__qualname__ = "Package" + base.__name__.lstrip("_")
        return Locator

    bases = [getattr(caching, n, None) or getattr(caching, "_" + n)
             for n in ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")]
    impl._locator_classes = [package_wide(b) for b in bases] + list(impl._locator_classes)
    _installed = True
