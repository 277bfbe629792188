"""lowmem: train deep CNNs in a fraction of the memory.

Backprop with Approximate Activations (Chakrabarti & Moseley, NeurIPS 2019):
an exact forward pass through a few shared buffers, a packed K-bit copy of
each unit's normalised activation for the backward sweep.
"""
from . import backend
from .backend import set_backend, get_backend

__version__ = "0.1.0"
