"""argparse value types shared by the `lowmem` subcommands (clear errors for bad values)."""
import argparse
import math
import os

from .. import models
from ..units.widths import BITS, FLOAT
from .maxbatch import parse_bytes


def shape(text):
    """'3x224x224' -> (3, 224, 224)."""
    try:
        shape = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected CxHxW with positive integers, e.g. 3x32x32, got {text!r}")
    return shape


def positive(text):
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def count(text):
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return n


def seed(text):
    """A seed: an integer in [0, 2**64) (the counter stream's keys are 64-bit)."""
    n = count(text)
    if n >= 2 ** 64:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64), got {text!r}")
    return n


def classes(text):
    """A number of classes: an integer >= 2 (with one class the loss is 0 and nothing trains)."""
    n = positive(text)
    if n < 2:
        raise argparse.ArgumentTypeError(f"expected at least 2 classes (with one the loss is always 0 "
                                         f"and nothing trains), got {text!r}")
    return n


def _finite(text):
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return x


def positive_number(text):
    """A finite number > 0 (a learning rate, seconds)."""
    x = _finite(text)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return x


def nonnegative_number(text):
    """A finite number >= 0 (weight decay)."""
    x = _finite(text)
    if x < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return x


def momentum(text):
    """A momentum in [0, 1): at 1 or more the velocity never decays."""
    x = _finite(text)
    if not 0 <= x < 1:
        raise argparse.ArgumentTypeError(f"expected a momentum in [0, 1), got {text!r}")
    return x


def folder(text):
    """A non-empty path."""
    if not text:
        raise argparse.ArgumentTypeError("expected a folder name, got an empty string")
    return text


def model_help():
    """The --model help: the registry's families (lowmem.models.MODELS), wrn-K for any K."""
    families = sorted(n for n in models.MODELS if not n.startswith("wrn-"))
    return " | ".join(families + ["wrn-K (K: the widening factor, any positive integer)",
                                  "PATH.onnx (a CNN exported to ONNX, e.g. by PyTorch in training mode)"])


def model(text):
    """A model family name (lowmem.models.model_spec: a registry name, wrn-K or a .onnx path)."""
    try:
        models.model_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


class _BitsChoices(tuple):
    """argparse's choices for --bits: 8, 4, 2, 1, auto, or per-unit widths (a dict `bits` parsed
    and checked already; the engine checks its unit names against the network)."""

    def __contains__(self, value):
        return isinstance(value, dict) or tuple.__contains__(self, value)


BITS_CHOICES = _BitsChoices(BITS[::-1] + ("auto",))      # as --help lists them: 8, 4, 2, 1, auto
UNIT_WIDTHS = (FLOAT,) + BITS


def bits(text):
    """--bits: an integer, 'auto' (a width per unit, chosen to fit a budget), per-unit widths as
    `unit=K` pairs ("layer1.0.bn1=4,*=2"; K in 1, 2, 4, 8 or float; "*" the default for units not
    named), or a JSON file of such a mapping. argparse's choices=BITS_CHOICES then refuses any
    other integer ("invalid choice: 3")."""
    t = str(text).strip()
    if t.lower() == "auto":
        return "auto"
    try:
        return int(t)
    except ValueError:
        pass
    if t.lower().endswith(".json") or os.path.isfile(t):     # before pairs: a path may hold "=" (lr=0.1/)
        return _widths_file(t)
    if "=" in t:
        widths = {}
        for pair in t.split(","):
            name, eq, k = (s.strip() for s in pair.partition("="))
            if not (name and eq and k):
                raise argparse.ArgumentTypeError(f"expected unit=K pairs separated by commas "
                                                 f"(e.g. layer1.0.bn1=4,*=2), got {pair.strip()!r}")
            if name in widths:
                raise argparse.ArgumentTypeError(f"unit {name!r} is given twice")
            widths[name] = _unit_width(name, k)
        return widths
    raise argparse.ArgumentTypeError(f"expected 1, 2, 4, 8, auto, unit=K pairs (layer1.0.bn1=4,*=2) "
                                     f"or a JSON file of them, got {text!r}")


def _unit_width(name, k):
    """K of `unit=K` or of a JSON file: an int, its digits, or "float"; a number with a fraction
    (8.9, and 2.0 as on the command line) is refused, never truncated."""
    k = k.strip().lower() if isinstance(k, str) else k
    if isinstance(k, str) and k != FLOAT:
        try:
            k = int(k)
        except ValueError:
            pass
    if not (k == FLOAT or isinstance(k, int) and not isinstance(k, bool)) or k not in UNIT_WIDTHS:
        raise argparse.ArgumentTypeError(f"unit {name!r}: width must be 1, 2, 4, 8 or float, got {k!r}")
    return k


RUN_KEYS = {"mode", "model", "dataset", "avg_bits", "rounding"}      # what tells a run's config.json


def _widths_file(path):
    import json
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{path} is not JSON ({e})") from None
    if isinstance(data, dict) and "bits" in data and (isinstance(data["bits"], dict) or RUN_KEYS & set(data)):
        bits = data["bits"]                      # a run's config.json: its widths, or its uniform width
        if isinstance(bits, int) and not isinstance(bits, bool):
            bits = {"*": bits}
        if not isinstance(bits, dict):
            raise argparse.ArgumentTypeError(f"{path}: a run's configuration, but its bits are {bits!r}, not "
                                             f"a width or per-unit widths")
        data = bits
    if not (isinstance(data, dict) and data and all(isinstance(k, str) and k for k in data)):
        raise argparse.ArgumentTypeError(f"{path}: expected a JSON object {{\"unit\": K, ...}} of per-unit "
                                         f"widths (K in 1, 2, 4, 8 or \"float\")")
    return {name: _unit_width(name, k) for name, k in data.items()}


def average_bits(text):
    """Average bits per saved x-hat element for --bits auto: a number in (0, 32]."""
    x = _finite(text)
    if not 0 < x <= 32:
        raise argparse.ArgumentTypeError(f"expected a number of bits in (0, 32], got {text!r}")
    return x


def budget(text):
    """A number of bytes: '2GiB', '512MiB', '1.5GB' or '1000000' (maxbatch.parse_bytes)."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def reserve(text):
    """A number of bytes as `budget`, or 0."""
    return 0 if str(text).strip() == "0" else budget(text)
