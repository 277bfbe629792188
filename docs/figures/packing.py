"""The bit layout of packed codes, 4-bit and 2-bit: which bits of which byte hold element i.

    python docs/figures/packing.py [--out docs/packing.png]

Packs the eight x-hat values of docs/worked_examples.md (channel 0: gamma 1.5,
beta 0.4) with lowmem.units.window.quantize_pack at 4 and 2 bits and draws the bytes it
wrote, bit 7 on the left: element i lives at bits (i mod 8/K)*K of byte
i div (8/K), the first element in the lowest bits. Needs matplotlib (lowmem[plot]).
"""
import argparse
import os
import sys

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from lowmem.units import packing, window  # noqa: E402

XHAT = numpy.array([[-3.5, -1.0, -0.3, -0.25, 0.0, 0.7, 1.9, 4.0]], numpy.float32)
GAMMA, BETA = numpy.array([1.5], numpy.float32), numpy.array([0.4], numpy.float32)
COLORS = ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5"]


def packed(bits):
    """(codes (8,), packed bytes) as lowmem.units.window writes them."""
    qp = window.quant_params(GAMMA, BETA, bits)
    out = numpy.empty(packing.packed_nbytes(XHAT.size, bits), numpy.uint8)
    window.quantize_pack(out, XHAT, qp)
    codes = numpy.empty(XHAT.size, numpy.uint8)
    packing.unpack_codes(codes, out, bits)
    return codes, out


def draw(ax, bits, y0):
    from matplotlib.patches import Rectangle
    codes, out = packed(bits)
    per = 8 // bits
    ax.text(-0.3, y0 + 1.5, f"K = {bits}: {per} codes per byte, {len(out)} bytes for 8 elements; "
            f"codes {list(map(int, codes))}", fontsize=9, va="bottom")
    for byte, value in enumerate(out):
        x0 = byte * 9
        for bit in range(8):                       # bit 7 drawn first (left)
            b = 7 - bit
            elem = byte * per + b // bits
            ax.add_patch(Rectangle((x0 + bit, y0), 1, 1, facecolor=COLORS[elem], edgecolor="0.3", lw=0.6))
            ax.text(x0 + bit + 0.5, y0 + 0.5, str((int(value) >> b) & 1), ha="center", va="center", fontsize=9)
            ax.text(x0 + bit + 0.5, y0 - 0.25, str(b), ha="center", va="center", fontsize=6, color="0.4")
        for j in range(per):                       # element labels under their bits
            b0 = j * bits
            left = x0 + (7 - (b0 + bits - 1))
            ax.text(left + bits / 2, y0 - 0.75, f"x̂[{byte * per + j}]\n= {XHAT[0, byte * per + j]:g}\ncode {codes[byte * per + j]}",
                    ha="center", va="top", fontsize=6.5)
        ax.text(x0 + 4, y0 + 1.15, f"byte {byte} = 0x{int(value):02x}", ha="center", fontsize=8)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "packing.png"))
    a = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.2), dpi=120)
    draw(ax, 4, 4.2)
    draw(ax, 2, 0)
    ax.set_xlim(-0.5, 36)
    ax.set_ylim(-2.6, 6.2)
    ax.axis("off")
    ax.set_title("packed codes: element i at bits (i mod 8/K)·K of byte i div (8/K) — the first element "
                 "in the low bits (small digits: bit numbers)", fontsize=9)
    fig.tight_layout()
    fig.savefig(a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
