"""SGD with momentum (PyTorch's formulation), optional Nesterov and weight decay.

    g = grad + wd * w          (wd only where the parameter decays)
    v = momentum * v + g
    w -= lr * (g + momentum * v   if nesterov else   v)

Weight decay applies to conv and linear weights by default; BN gamma/beta and
biases are exempt unless decay_bn / decay_bias say otherwise. `lr` may be
changed between steps (opt.lr = ...). Momentum buffers are the engine's
planned "optimizer" arrays when present (p.state["momentum"]), so the plan
counts them. On CuPy arrays `step` runs optim_gpu.py's fused update (one
kernel per tensor, the same arithmetic); on NumPy arrays with numba present
optim_cpu.py's (one pass per tensor); else the array ops below, the reference.

Hyperparameters are checked where they are set (constructor, opt.lr = ...,
load_state_dict): finite real numbers, lr and weight_decay >= 0, momentum in
[0, 1) (at 1 or more the velocity never decays and training diverges). A NaN
would otherwise surface steps later as a misleading "diverged".
"""
import math
import numbers

import numpy

from ..system.backend import array_module
from . import optim_cpu, optim_gpu


def _hyper(name, value, upper=None):
    """`value` as a float if it is a finite real number in [0, upper); ValueError / TypeError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"SGD {name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (upper is not None and value >= upper):
        want = f"in [0, {upper:g})" if upper is not None else ">= 0"
        raise ValueError(f"SGD {name} must be a finite number {want}, got {value!r}")
    return value


class SGD:
    def __init__(self, params, lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=False,
                 decay_bn=False, decay_bias=False):
        params = list(params)
        if not params:
            raise ValueError("SGD got an empty parameter list")
        momentum, weight_decay = _hyper("momentum", momentum, upper=1), _hyper("weight_decay", weight_decay)
        if nesterov and momentum <= 0:
            raise ValueError("nesterov=True needs momentum > 0")
        self.params, self.lr, self.momentum = params, lr, momentum      # self.lr: checked by its setter
        self.weight_decay, self.nesterov = weight_decay, nesterov
        self.decay = [p.decay or (decay_bn and _is_bn(p)) or (decay_bias and _is_bias(p) and not _is_bn(p))
                      for p in params]
        for p in params:
            if "momentum" not in p.state:
                p.state["momentum"] = array_module(p.data).zeros_like(p.data)
        self._started = False

    def step(self):
        """One update of every parameter from its .grad (which it may modify)."""
        if array_module(self.params[0].data) is not numpy:
            optim_gpu.sgd_step(self)            # CuPy arrays: one fused kernel per tensor
        elif optim_cpu.supports(self.params):
            self.each_tensor(optim_cpu.sgd_update)  # numba: one pass per tensor, the same arithmetic
        else:
            self._step_arrays()
        self._started = True

    def each_tensor(self, update):
        """update(w, grad, v, lr, momentum, weight_decay, nesterov, started) for every parameter,
        weight_decay 0 where it does not decay: how a fused update (optim_cpu's, optim_gpu's
        sgd_update) runs this step."""
        for p, decays in zip(self.params, self.decay):
            update(p.data, p.grad, p.state["momentum"], self.lr, self.momentum,
                   self.weight_decay if decays else 0.0, self.nesterov, self._started)

    def _step_arrays(self):
        """The update as array ops (NumPy), in the order the CUDA kernel repeats."""
        for p, decays in zip(self.params, self.decay):
            v, g = p.state["momentum"], p.grad
            if decays and self.weight_decay:
                g += self.weight_decay * p.data        # p.grad is ours to modify: backward refills it
            if self.momentum:
                if self._started:
                    v *= self.momentum
                    v += g
                else:                                  # PyTorch: the first step sets v = g
                    v[...] = g
                if self.nesterov:
                    g += self.momentum * v
                else:
                    g = v
            p.data -= self.lr * g

    @property
    def lr(self):
        """The learning rate of the next step (a finite number >= 0; checked when set)."""
        return self._lr

    @lr.setter
    def lr(self, value):
        self._lr = _hyper("lr", value)

    def state_dict(self):
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                "nesterov": self.nesterov, "started": self._started}

    def load_state_dict(self, d):
        """Restore lr and whether the first step was taken (momentum, weight decay and nesterov
        come from the constructor). ValueError naming the problem for a malformed `d`."""
        if not isinstance(d, dict) or not {"lr", "started"} <= d.keys():
            raise ValueError(f"SGD state must be a dict with 'lr' and 'started' (as state_dict() "
                             f"returns), got {d!r:.200}")
        if not isinstance(d["started"], bool):
            raise ValueError(f"SGD state 'started' must be true or false, got {d['started']!r}")
        try:
            self.lr = d["lr"]
        except TypeError as e:
            raise ValueError(str(e)) from None
        self._started = d["started"]


def _is_bn(p):
    return p.name.rsplit(".", 2)[-2].startswith("bn") if "." in p.name else False


def _is_bias(p):
    return p.name.endswith(".bias")
