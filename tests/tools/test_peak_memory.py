"""lowmem/tools/peak_memory.py: measure_peak refuses before allocating what does not fit. (The
measured peak itself is tested in tests/tools/test_cli.py and tests/core/test_plan.py.)"""
import tracemalloc

import numpy as np
import pytest

from lowmem.models import preact_resnet_cifar
from lowmem.system import memory as sysmem
from lowmem.tools import peak_memory


def test_measure_peak_refuses_before_allocating(monkeypatch):
    monkeypatch.setattr(sysmem, "available_bytes", lambda xp=np: 1 << 20)
    net = preact_resnet_cifar(8)
    tracemalloc.start()
    try:
        with pytest.raises(sysmem.NotEnoughMemory, match=r"measuring 2 training steps at batch 64 \(the plan "
                                                         r".* and the input batch 768.00 KiB\) needs"):
            peak_memory.measure_peak(net, 64, (3, 32, 32), steps=2)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20       # nothing activation-sized was allocated
    finally:
        tracemalloc.stop()
