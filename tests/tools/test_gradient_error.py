"""lowmem/tools/gradient_error.py: the gradient-error summary's edge cases. (The gradient error itself
is tested in tests/core/test_engine_approx.py and tests/bits/.)"""
import warnings

import numpy as np

from lowmem.tools import gradient_error


def zero_gradient_diagnosis():
    """What a network whose gradients are all zero gives (e.g. one class: the loss is always 0)."""
    z = np.zeros(2)
    return gradient_error.GradientDiagnosis(["a", "b"], [(3,), (4,)], 4, 2, z, z, z, {"approx": z.copy()},
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
