"""The unit's vocabulary and the one rule for which code a unit keeps, defined here once and
imported everywhere else.

BITS       the code widths K a BN-ReLU unit may save its x-hat at, narrowest first (2^K levels)
FLOAT      the width of a unit that saves x-hat in float instead (as every unit in exact mode)
MODES      how an engine's units save and use x-hat: exact (float), approx (K-bit codes read
           only by backward: the method), naive (the forward itself continues from the codes)
ROUNDINGS  how x-hat becomes a code: "nearest" (the fixed-window code, deterministic),
           "stochastic" (the unbiased group-range code), "dither" (the unbiased code with a
           subtractive dither: the same levels, a decoder that subtracts each element's draw),
           "stochastic-window" (the fixed window with stochastic rounding)

    code_for(rounding, K) -> Code(name, bits, rounding)
    named(bits) -> the widths a bits value (K, or {unit: K}) names, as a list

is the rule: which code a unit of width K keeps under a rounding. "float" (x-hat itself, K None
or FLOAT), "window" (units/window.py, drawn with its `rounding`) or "unbiased"
(units/unbiased.py). The kernel sets (units/__init__.py) are chosen from it, the bit allocator
prices a width by it, and a unit's slot bytes are its kernel set's (units.slot_nbytes): no
caller re-derives either.
"""
import numbers
from typing import NamedTuple

BITS = (1, 2, 4, 8)
FLOAT = "float"
MODES = ("exact", "approx", "naive")
ROUNDINGS = ("nearest", "stochastic", "dither", "stochastic-window")
UNBIASED_ROUNDINGS = ("stochastic", "dither")      # the unbiased code's two draws (units/unbiased.py)


def check_bits(bits):
    """Return `bits` as an int if it is one of 8, 4, 2, 1; else ValueError."""
    if bits.__class__ is int and bits in BITS:          # the common case, without the ABC checks
        return bits
    ok = (isinstance(bits, numbers.Integral) and not isinstance(bits, bool)
          and int(bits) in BITS)
    if not ok:
        raise ValueError(f"bits must be one of {{1, 2, 4, 8}}, got {bits!r}")
    return int(bits)


def named(bits):
    """The widths a `bits` value names, as a list: a dict's values ({unit: K, "*": K}), else the one
    value (K, "float" or "auto" as given)."""
    return list(bits.values()) if isinstance(bits, dict) else [bits]


def check_rounding(rounding):
    """Return `rounding` if it is one of ROUNDINGS; else ValueError."""
    if not isinstance(rounding, str) or rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(map(repr, ROUNDINGS))}, got {rounding!r}")
    return rounding


class Code(NamedTuple):
    """The code a unit keeps: name "float", "window" or "unbiased"; bits K (None for float);
    rounding, how its codes are drawn (None for float)."""
    name: str
    bits: int = None
    rounding: str = None

    @property
    def unbiased(self):
        """Whether E[x-tilde | x-hat] = x-hat for every element (the unbiased code; float is exact)."""
        return self.name == "unbiased"

    @property
    def dither(self):
        """Whether the unbiased code's decoder subtracts its dither (rounding "dither")."""
        return self.name == "unbiased" and self.rounding == "dither"


FLOAT_CODE = Code(FLOAT)


def code_for(rounding, bits):
    """Which code a unit of width `bits` (K in BITS; None or FLOAT: x-hat in float) keeps under
    `rounding`. "stochastic" and "dither" are the unbiased group-range code (drawn those two ways),
    except at 1 bit, where no code can be unbiased with an exact mask (one level per side): there
    the window code rounded to nearest. "nearest" and "stochastic-window" are the window code
    drawn that way."""
    rounding = check_rounding(rounding)
    if bits is None or bits == FLOAT:
        return FLOAT_CODE
    bits = check_bits(bits)
    if rounding in UNBIASED_ROUNDINGS:
        return Code("unbiased", bits, rounding) if bits > 1 else Code("window", bits, "nearest")
    return Code("window", bits, rounding)
