"""SGD with momentum (PyTorch's formulation), optional Nesterov and weight decay.

    g = grad + wd * w          (wd only where the parameter decays)
    v = momentum * v + g
    w -= lr * (g + momentum * v   if nesterov else   v)

Weight decay applies to conv and linear weights by default; BN gamma/beta and
biases are exempt unless decay_bn / decay_bias say otherwise. `lr` may be
changed between steps (opt.lr = ...). Momentum buffers are the engine's
planned "optimizer" arrays when present (p.state["momentum"]), so the plan
counts them. On CuPy arrays `step` runs kernels/gpu.py's fused update (one
kernel per tensor, the same arithmetic); on NumPy the array ops below.
"""
import numpy

from .backend import array_module


class SGD:
    def __init__(self, params, lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=False,
                 decay_bn=False, decay_bias=False):
        params = list(params)
        if not params:
            raise ValueError("SGD got an empty parameter list")
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"lr, momentum and weight_decay must be >= 0, got {lr}, {momentum}, {weight_decay}")
        if nesterov and momentum <= 0:
            raise ValueError("nesterov=True needs momentum > 0")
        self.params, self.lr, self.momentum = params, lr, momentum
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
            from .kernels import gpu           # CuPy arrays: one fused kernel per tensor
            gpu.sgd_step(self)
            return
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
        self._started = True

    def state_dict(self):
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                "nesterov": self.nesterov, "started": self._started}

    def load_state_dict(self, d):
        self.lr, self._started = d["lr"], d["started"]


def _is_bn(p):
    return p.name.rsplit(".", 2)[-2].startswith("bn") if "." in p.name else False


def _is_bias(p):
    return p.name.endswith(".bias")
