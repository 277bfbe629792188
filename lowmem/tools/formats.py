"""What the weight files share, out (lowmem/tools/export.py) and in (lowmem/tools/onnx_import.py):
the one error for a network or file that cannot be written or read, and the check that names
the extra to install when an optional library (safetensors, onnx) is missing."""


class ExportError(ValueError):
    """A network or file that cannot be exported or read back; the message names it."""


def require(module, extra):
    """The optional library `module`, or an ImportError naming the pip extra that installs it."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise ImportError(f"{module} is not installed: pip install 'lowmem[{extra}]'") from None
