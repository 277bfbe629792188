"""lowmem.system.memory: free memory, checked before a large allocation."""
import numpy as np
import pytest

from lowmem.system import memory as sysmem


def test_meminfo_is_read(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   2048 kB\n")
    assert sysmem._meminfo_available(str(f)) == 2048 * 1024
    f.write_text("MemTotal: 1 kB\n")                    # an old kernel: no MemAvailable
    assert sysmem._meminfo_available(str(f)) is None
    assert sysmem._meminfo_available(str(tmp_path / "absent")) is None


def test_available_bytes_is_plausible():
    n = sysmem.available_bytes(np)
    assert n is None or 0 < n < 1 << 50


def test_require(monkeypatch):
    monkeypatch.setattr(sysmem, "available_bytes", lambda xp=np: 1 << 20)
    sysmem.require(1 << 20, "exactly what is free")
    with pytest.raises(sysmem.NotEnoughMemory, match=r"^a big thing needs 2.00 MiB \(2,097,152 B\), but only "
                                                     r"1.00 MiB of host memory is available$"):
        sysmem.require(2 << 20, "a big thing")
    assert issubclass(sysmem.NotEnoughMemory, ValueError)
    monkeypatch.setattr(sysmem, "available_bytes", lambda xp=np: None)      # unknown: nothing refused
    sysmem.require(1 << 60, "anything")
