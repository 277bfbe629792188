"""lowmem.tools.diagnostics: the gradient-error summary's edge cases, and measure_peak's memory check.
(The gradient error itself is tested in test_engine_approx.py, the measured peak in test_cli.py.)"""
import tracemalloc
import warnings

import numpy as np
import pytest

from lowmem.tools import diagnostics
from lowmem.system import memory as sysmem
from lowmem.models import preact_resnet_cifar


def zero_gradient_diagnosis():
    """What a network whose gradients are all zero gives (e.g. one class: the loss is always 0)."""
    z = np.zeros(2)
    return diagnostics.GradientDiagnosis(["a", "b"], [(3,), (4,)], 4, 2, z, z, z, {"approx": z.copy()},
                                         {"grad_norm": 0.0, "mean_norm": 0.0, "noise_norm": 0.0,
                                          "error_norm": {"approx": 0.0}})


def test_summary_of_zero_gradients_is_nan_not_an_exception():
    d = zero_gradient_diagnosis()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # no RuntimeWarning either
        s = d.summary()
        text = d.summary_text()
    assert np.isnan(s["noise"]["total"]) and np.isnan(s["noise"]["median"])
    assert np.isnan(s["approx"]["worst_ratio"]) and s["approx"]["worst_tensor"] is None
    assert np.isnan(s["approx"]["total_ratio"]) and np.isnan(s["approx"]["total_error"])
    assert "worst nan (no gradient)" in text


def test_measure_peak_refuses_before_allocating(monkeypatch):
    monkeypatch.setattr(sysmem, "available_bytes", lambda xp=np: 1 << 20)
    net = preact_resnet_cifar(8)
    tracemalloc.start()
    try:
        with pytest.raises(sysmem.NotEnoughMemory, match=r"measuring 2 training steps at batch 64 \(the plan "
                                                         r".* and the input batch 768.00 KiB\) needs"):
            diagnostics.measure_peak(net, 64, (3, 32, 32), steps=2)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20       # nothing activation-sized was allocated
    finally:
        tracemalloc.stop()
