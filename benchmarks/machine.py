"""What the benchmarks record of the machine they ran on (their figures mean nothing without it)."""
import os
import platform


def cpu():
    """The CPU model (/proc/cpuinfo's model name, else platform.processor()) and the core count."""
    name = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} CPUs"
