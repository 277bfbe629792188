"""What the model-file tools share at the bottom: their error, and the optional extras' import.

ExportError is a ValueError naming the file and the problem, raised by the writers
(tools/export.py) and the ONNX reader (tools/onnx_import.py) alike; `require(module, extra)`
imports an optional dependency or says which `pip install 'lowmem[extra]'` brings it. A module
of its own, importing nothing of lowmem's, so the reader needs neither the exporter nor the
registry (lowmem.models) that the exporter imports.
"""


class ExportError(ValueError):
    """A network or file that cannot be exported or read back; the message names it."""


def require(module, extra):
    """The imported `module`; ImportError naming the extra that installs it otherwise."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise ImportError(f"{module} is not installed: pip install 'lowmem[{extra}]'") from None
