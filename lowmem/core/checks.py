"""The engine's argument and batch checks: each refusal names the problem and the fix.

Run before anything is planned (engine_args, input_shape) or before a batch touches the
engine's arrays (batch, labels), so a bad call changes nothing.
"""
import numbers

import numpy

from ..units.widths import FLOAT, MODES, UNBIASED_ROUNDINGS, check_bits, code_for
from .network import Network

DTYPES = ("float32", "float64")

def engine_args(net, batch_size, mode, bits, dtype):
    if not isinstance(net, Network):
        raise TypeError(f"Engine needs a lowmem Network (e.g. lowmem.models.preact_resnet_cifar(20)), "
                        f"got {type(net).__name__}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: expected one of {MODES}")
    bits = _bits(bits, mode)
    try:
        dt = numpy.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: expected one of {DTYPES}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if net.num_classes < 2:
        raise ValueError(f"network {net.name!r} has num_classes={net.num_classes}: a classifier needs "
                         f"at least 2 classes (with one, the loss is 0 and every gradient vanishes)")
    return mode, bits, dt


def _bits(bits, mode):
    """bits: an int K (every unit) or {"*": K, "<unit>": K or "float", ...}; the dict's keys
    are checked against the network's units by `unit_bits`. Returns the int, or a new dict."""
    if not isinstance(bits, dict):
        return check_bits(bits)
    out = {}
    for name, K in bits.items():
        if not isinstance(name, str):
            raise ValueError(f"bits: keys are unit names or '*' (the default), got {name!r}")
        out[name] = K if isinstance(K, str) and K == FLOAT else _unit_k(name, K)
    if mode == "exact" and any(K != FLOAT for K in out.values()):
        coded = sorted(n for n, K in out.items() if K != FLOAT)
        raise ValueError(f"bits: mode 'exact' saves every x-hat in float, but bits gives "
                         f"{', '.join(map(repr, coded[:5]))} a bit width; use mode 'approx' or 'naive', "
                         f"or 'float' for every unit")
    return out


def _unit_k(name, K):
    try:
        return check_bits(K)
    except ValueError:
        raise ValueError(f"bits[{name!r}] must be one of {{1, 2, 4, 8}} or 'float', got {K!r}") from None


def unit_bits(bits, mode, units):
    """{unit name: K, or None for x-hat saved in float} for the unit names `units` (forward order).

    bits as engine_args returns it. Exact mode: every unit None (an int bits is ignored there,
    as it always was). A dict must name only units of the network, and every unit unless it
    has a "*" default."""
    unknown = [n for n in bits if n != "*" and n not in units] if isinstance(bits, dict) else []
    if unknown:                                   # in every mode: a misspelt name is never ignored
        raise ValueError(f"bits names {', '.join(map(repr, unknown[:5]))}, not a BN-ReLU unit of this "
                         f"network; units: {', '.join(units[:5])}{', ...' if len(units) > 5 else ''}")
    if mode == "exact":
        return dict.fromkeys(units)
    if not isinstance(bits, dict):
        return dict.fromkeys(units, bits)
    missing = [n for n in units if n not in bits and "*" not in bits]
    if missing:
        raise ValueError(f"bits gives no width for unit(s) {', '.join(map(repr, missing[:5]))}"
                         f"{' ...' if len(missing) > 5 else ''}; name every unit or add a default "
                         f"'*': K")
    widths = {n: bits.get(n, bits.get("*")) for n in units}
    return {n: None if K == FLOAT else K for n, K in widths.items()}


def code_bits(bits, mode):
    """The width of the range codes convs keep their non-unit inputs in: None (float) in exact
    mode; else the int bits, or a dict's "*" default (None when that says "float"); a dict
    without "*" (a width named for every unit, as --bits auto gives) the widest width it names,
    so no range code is coarser than a unit's code (None when every unit is "float")."""
    if mode == "exact":
        return None
    if not isinstance(bits, dict):
        return bits
    if "*" in bits:
        return None if bits["*"] == FLOAT else bits["*"]
    widths = [K for n, K in bits.items() if K != FLOAT]
    return max(widths) if widths else None


def width_labels(mode, unit_bits, slot_bits=None):
    """{unit: '4-bit' (x-hat saved as a code), 'float' (saved exact), or '' in exact mode};
    with slot_bits {unit: bits per element of its slot} a code whose slot holds more than K bits
    per element (the unbiased code's group ends) reads e.g. '2-bit, 2.125 bits/elem'."""
    if mode == "exact":
        return dict.fromkeys(unit_bits, "")
    slot_bits = slot_bits or {}

    def label(u, K):
        if K is None:
            return "float"
        b = slot_bits.get(u)
        return f"{K}-bit" + (f", {b:.4g} bits/elem" if b is not None and b > K * 1.001 else "")
    return {u: label(u, K) for u, K in unit_bits.items()}


def rounding_label(rounding, widths):
    """', unbiased stochastic rounding' etc. for a summary (nearest, the default: ''), saying what
    units of `widths` (each K, or None / "float") keep (units.widths.code_for): the unbiased code's
    roundings ("stochastic", "dither") have no 1-bit code, their 1-bit units keep the window code
    rounded to nearest."""
    codes = [code_for(rounding, K) for K in widths if K not in (None, FLOAT)]
    if rounding in UNBIASED_ROUNDINGS and codes and not any(c.unbiased for c in codes):
        return f", nearest rounding ({rounding} has no 1-bit code)"
    label = {"nearest": "", "stochastic": ", unbiased stochastic rounding", "dither": ", unbiased dithered rounding",
             "stochastic-window": ", window stochastic rounding"}[rounding]
    if rounding in UNBIASED_ROUNDINGS and not all(c.unbiased for c in codes):
        label += " (1-bit units: nearest)"
    return label


def bits_label(mode, unit_bits):
    """'4-bit' when every unit has one width, else e.g. '4-bit x10, 8-bit x2, float x1'."""
    labels = list(width_labels(mode, unit_bits).values())
    counts = {w: labels.count(w) for w in dict.fromkeys(labels)}
    return ", ".join(w if len(counts) == 1 else f"{w} x{c}" for w, c in counts.items())


def owns(arrays, params, name):
    """RuntimeError unless an engine holds arrays (allocate=True) and its network's parameters
    `params` {name: Parameter} are still the planned arrays (a second engine rebinds them)."""
    if arrays is None:
        raise RuntimeError("this Engine was built with allocate=False: it has a plan and a "
                           "schedule but no arrays; build it with allocate=True to run it")
    for p in params.values():
        if p.data is not arrays[p.name]:
            raise RuntimeError(f"the parameters of {name} now belong to another Engine "
                               f"(parameter {p.name} was rebound); build one Engine per network, "
                               f"e.g. Engine(copy.deepcopy(net), ...) for a second one")


def batch_norm(unit_sizes, n, what):
    """Refuse a batch n whose unit (C, H, W) would normalise one value per channel."""
    for name, (c, h, w) in unit_sizes.items():
        if n * h * w < 2:
            raise ValueError(f"{what} {n}: batch norm {name} would normalise one value per channel "
                             f"(input {(c, h, w)} per sample, N*H*W = {n * h * w}); its output "
                             f"would not depend on the input. Use a batch of at least 2")


def input_shape(input_shape, in_channels):
    try:
        shape = tuple(input_shape)
    except TypeError:
        shape = None
    if shape is None or len(shape) != 3 or shape[0] != in_channels:
        raise ValueError(f"input_shape must be (C, H, W) with C = {in_channels} "
                         f"(the network's in_channels), got {input_shape}")
    if not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) and s > 0 for s in shape):
        raise ValueError(f"input_shape must be (C, H, W) of positive ints, got {shape}")
    return tuple(int(s) for s in shape)


def batch(x, xp, dtype, input_shape, N, what):
    dims = ", ".join(map(str, input_shape))
    if not isinstance(x, xp.ndarray):
        raise TypeError(f"{what}: expected a {xp.__name__} array of shape (N, {dims}), got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{what}: input dtype is {x.dtype}, this engine expects {dtype} "
                        f"(convert with x.astype('{dtype}'))")
    if x.ndim != 4 or tuple(x.shape[1:]) != input_shape:
        raise ValueError(f"{what}: input shape is {tuple(x.shape)}, expected (N, {dims}) with N <= {N}")
    if not 1 <= x.shape[0] <= N:
        raise ValueError(f"{what}: batch of {x.shape[0]} is larger than the planned batch_size "
                         f"{N} (build the Engine with a larger batch_size)" if x.shape[0] > N
                         else f"{what}: empty batch")
    lo, hi = float(x.min()), float(x.max())       # NaN propagates through min/max: no temporary
    if not (numpy.isfinite(lo) and numpy.isfinite(hi)):
        raise ValueError(f"{what}: the input batch contains NaN or Inf")


def labels(labels, xp, n, K):
    if not isinstance(labels, xp.ndarray) or labels.dtype.kind not in "iu":
        raise TypeError(f"labels must be an integer {xp.__name__} array of shape ({n},), "
                        f"got {getattr(labels, 'dtype', type(labels).__name__)}")
    if labels.shape != (n,):
        raise ValueError(f"labels shape is {labels.shape}, expected ({n},) to match the batch")
    if int(labels.min()) < 0 or int(labels.max()) >= K:
        raise ValueError(f"labels out of range: found [{int(labels.min())}, {int(labels.max())}], "
                         f"expected 0 <= label < {K} (num_classes)")
