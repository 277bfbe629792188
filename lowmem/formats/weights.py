"""safetensors files: a network's weights out and back in (optional extra `lowmem[safetensors]`).

    from lowmem.formats import weights
    weights.export_safetensors(net, "model.safetensors")   # names = PyTorch module names
    weights.load_safetensors(net, "model.safetensors")     # and back, names and shapes checked

Every parameter and BN running statistic of `net.state_dict()` under its lowmem name, which is
the PyTorch `state_dict` key of the same network written with torch.nn (`layer1.0.bn1.weight`,
`layer1.0.bn1.running_var`, `fc.bias`; see tests/torch_reference.py), so
`model.load_state_dict(safetensors.torch.load_file(p), strict=True)` works. BN's
`num_batches_tracked` is not stored (lowmem keeps no batch counter); a plain `nn.BatchNorm2d`
needs `strict=False` for just that key. `metadata` (formats/metadata.py) goes into the header.
Written atomically (lowmem.system.atomic.atomic_write), as every file lowmem writes.
"""
import os

import numpy

from .._version import __version__
from ..system.atomic import atomic_write
from .common import ExportError, require


def export_safetensors(net, path, dtype="float32", metadata=None):
    """Write net's parameters and BN running statistics to `path` (safetensors, NumPy API).

    dtype: the stored float type ("float32", PyTorch's default; None keeps the
    network's). Metadata: the network's name and the lowmem version, plus
    `metadata` (a dict of strings, e.g. `model_metadata(meta)`: classes, preprocessing)."""
    st = require("safetensors.numpy", "safetensors")
    state = net.state_dict()                             # host copies
    if dtype is not None:
        state = {k: numpy.ascontiguousarray(v, dtype=dtype) for k, v in state.items()}
    meta = {**(metadata or {}), "format": "pt", "network": net.name, "lowmem_version": __version__}
    atomic_write(path, st.save(state, metadata=meta))
    return path


def read_safetensors(path):
    """name -> NumPy array of a safetensors file; ExportError naming the file if it is not one."""
    st = require("safetensors.numpy", "safetensors")
    if not os.path.isfile(path):
        raise ExportError(f"{path}: no such file")
    try:
        return st.load_file(os.fspath(path))
    except Exception as e:                               # SafetensorError, header errors
        raise ExportError(f"{path}: not a readable safetensors file ({e})") from None


def load_safetensors(net, path):
    """Load a safetensors file into `net` in place (Network.load_state_dict: names and shapes
    must match exactly; values are cast to the network's dtype). Returns net."""
    state = read_safetensors(path)
    try:
        net.load_state_dict(state)
    except ValueError as e:
        raise ExportError(f"{path}: {e}") from None
    return net
