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


def test_a_tensor_whose_gradient_is_zero_in_exact_arithmetic_is_named_not_the_worst():
    """A conv's bias before a batch norm has a gradient of exactly 0 (the batch norm takes the mean
    out): what is measured is rounding noise, and its error/noise ratio noise over zero. The
    summary leaves it out of the medians and the worst and names it."""
    from lowmem import nn
    g = nn.Graph("biased", (3, 8, 8), 4, seed=2)
    x = g.bn_relu(g.conv(g.input, 8, 3, bias=True, name="stem"), name="stem_bn")
    net = g.head(g.bn_relu(g.conv(x, 8, 3, name="c1"), name="b1"))
    batches = gradient_error.synthetic_batches(3, 8, (3, 8, 8), 4, 0, "float32")
    d = gradient_error.gradient_errors(net, batches, bits=2)
    s = d.summary()
    assert s["no_gradient"] == ["stem.bias"]
    assert s["approx"]["worst_tensor"] not in (None, "stem.bias") and s["approx"]["worst_ratio"] < 10
    assert "no gradient (zero in exact arithmetic" in d.summary_text() and "stem.bias" in d.summary_text()
