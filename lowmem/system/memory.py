"""How much memory is free, and how bytes print (`fmt_bytes`, used by every report).

Free memory is checked before a large allocation, so a plan that cannot fit ends in a
clear error instead of NumPy's MemoryError (or the kernel's OOM killer).

    require(plan.total_bytes + x.nbytes, "training 2 steps at batch 128")     # NotEnoughMemory if not

Host memory is what Linux calls MemAvailable (/proc/meminfo: free memory plus
the caches it can drop), else os.sysconf's SC_AVPHYS_PAGES (free pages only);
on the CuPy backend it is the device's free memory plus the blocks CuPy's pool
holds free. None when the system tells neither; then nothing is refused.

What it does not do: reserve anything (another process may take the memory
between the check and the allocation), or count swap (a training step that
swaps is not a plan worth running).
"""
import os

import numpy


def fmt_bytes(n):
    """n bytes in binary units for people: "512 B", "1.50 KiB", "3.20 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


class NotEnoughMemory(ValueError):
    """The request is larger than the memory this machine (or GPU) has free."""


def _meminfo_available(path="/proc/meminfo"):
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024          # the file counts kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_bytes(xp=numpy):
    """Free bytes where `xp` (numpy or cupy) allocates; None when unknown."""
    if xp is not numpy:
        if getattr(getattr(xp, "cuda", None), "runtime", None) is None:    # not CuPy (a test's emulation)
            return None
        free, _ = xp.cuda.runtime.memGetInfo()
        return int(free) + int(xp.get_default_memory_pool().free_bytes())
    n = _meminfo_available()
    if n is None:
        try:
            n = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):      # not on this system
            return None
    return n


def require(nbytes, what, xp=numpy):
    """Raise NotEnoughMemory when `what` (a phrase: "padding 10,000 images to 1000x1000")
    needs more than the `nbytes` free where `xp` allocates."""
    free = available_bytes(xp)
    if free is not None and nbytes > free:
        where = "GPU" if xp is not numpy else "host"
        raise NotEnoughMemory(f"{what} needs {fmt_bytes(nbytes)} ({nbytes:,} B), but only "
                              f"{fmt_bytes(free)} of {where} memory is available")
