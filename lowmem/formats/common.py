"""What the weight files share, out (onnx_export.py, weights.py) and in (onnx_import.py, weights.py):
the one error for a network or file that cannot be written or read (and the one warning for a
file that reads, but likely not as meant), the check that a path is
a non-empty file, and the check that names the extra to install when an optional library
(safetensors, onnx) is missing."""


class ExportError(ValueError):
    """A network or file that cannot be exported or read back; the message names it."""


class FormatWarning(UserWarning):
    """A file that reads, but likely not as its writer meant (the message names the cause and the
    fix); the command line prints it as one line, `lowmem <command>: warning: ...`."""


def require(module, extra):
    """The optional library `module`, or an ImportError naming the pip extra that installs it."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise ImportError(f"{module} is not installed: pip install 'lowmem[{extra}]'") from None


def check_file(path):
    """ExportError unless path is a non-empty regular file: missing, a directory and an empty
    file each named as such (an empty file parses as an empty ONNX model with no graph)."""
    import os
    if os.path.isdir(path):
        raise ExportError(f"{path}: is a directory, not a model file")
    if not os.path.isfile(path):
        raise ExportError(f"{path}: no such file")
    if os.path.getsize(path) == 0:
        raise ExportError(f"{path}: empty file (0 bytes)")
