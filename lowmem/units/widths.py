"""The unit's vocabulary, defined here once and imported everywhere else.

BITS   the code widths K a BN-ReLU unit may save its x-hat at, narrowest first
       (2^K levels; lowmem/units/quant.py)
FLOAT  the width of a unit that saves x-hat in float instead (as every unit in exact mode)
MODES  how an engine's units save and use x-hat: exact (float), approx (K-bit codes read
       only by backward: the method), naive (the forward itself continues from the codes)
"""
BITS = (1, 2, 4, 8)
FLOAT = "float"
MODES = ("exact", "approx", "naive")
