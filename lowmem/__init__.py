"""lowmem: train deep CNNs in a fraction of the memory.

Backprop with Approximate Activations (Chakrabarti & Moseley, NeurIPS 2019):
an exact forward pass through a few shared buffers, a packed K-bit copy of
each unit's normalised activation for the backward sweep.

    import lowmem as lm
    net = lm.models.preact_resnet_cifar(depth=164)
    eng = lm.Engine(net, batch_size=128, input_shape=(3, 32, 32), mode="approx", bits=4)
    opt = lm.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    loss = eng.train_step(x, labels, opt)

    # a width per unit, chosen from measured error to fit a budget (docs/bits.md)
    alloc = lm.allocate_bits(net, batches, batch_size=128, avg_bits=2)   # batches: a few (x, labels)
    eng = lm.Engine(net, 128, (3, 32, 32), mode="approx", bits=alloc.bits)
"""
from .system import backend, distributed
from . import models, nn
from .bits.allocate import allocate_bits
from .system.backend import set_backend, get_backend
from .core.engine import Engine
from .core.network import Network, Parameter
from .train.optim import SGD
from .core.plan import Plan
from ._version import __version__

__all__ = ["backend", "distributed", "models", "nn", "set_backend", "get_backend", "Engine", "Network",
           "Parameter", "SGD", "Plan", "allocate_bits"]
