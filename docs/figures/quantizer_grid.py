"""The quantizer's grid for one channel: bins, the bin edge on the ReLU threshold, the grid.

    python docs/figures/quantizer_grid.py [--bits 4] [--out docs/quantizer_grid.png]

Two channels of a 4-bit unit, decoded by lowmem.units.window itself (quant_params and
quantize_simulated, which the packed path matches bit for bit): x-tilde as a
function of x-hat (the staircase), every bin edge, the grid [lo, lo + L*w] (notation.md), and
the ReLU threshold t = -beta/|gamma|. Left, gamma = 1.5, beta = 0.4 (the worked
example of docs/worked_examples.md): t lies inside the grid and a bin edge sits
on it. Right, gamma = 1, beta = -4: t = 4 lies beyond the grid, k is clamped to
L-1, lo is clipped, and the two-sided clamp puts every "off" value above the grid
into code L-2, so only values past t decode to the top code. Needs matplotlib
(the optional extra lowmem[plot]).
"""
import argparse
import os
import sys

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from lowmem.units import window  # noqa: E402

CASES = ((1.5, 0.4, "t inside the grid"), (1.0, -4.0, "t beyond the grid (k clamped, lo clipped)"))


def panel(ax, gamma, beta, bits, title):
    g, b = numpy.array([gamma], numpy.float32), numpy.array([beta], numpy.float32)
    qp = window.quant_params(g, b, bits)
    L, w, lo, k = qp.levels, qp.w, float(qp.lo[0]), int(qp.k[0])
    t = -beta / abs(gamma)
    x = numpy.linspace(-5, 5, 4001, dtype=numpy.float32)[None, :]
    xt, mask = window.quantize_simulated(x, g, b, bits)
    ax.axvspan(lo, lo + L * w, color="tab:green", alpha=0.08, label=f"grid [lo, lo + L·w] = [{lo:.3f}, {lo + L * w:.3f}]")
    for e in range(L + 1):
        ax.axvline(lo + e * w, color="0.8", lw=0.6, zorder=0)
    ax.plot(x[0], x[0], color="0.6", lw=0.8, ls="--", label="x̃ = x̂")
    on = mask[0]
    ax.plot(numpy.where(on, numpy.nan, x[0]), xt[0], color="tab:blue", lw=1.6, label="x̃, ReLU off (code < k)")
    ax.plot(numpy.where(on, x[0], numpy.nan), xt[0], color="tab:orange", lw=1.6, label="x̃, ReLU on (code ≥ k)")
    ax.axvline(t, color="tab:red", lw=1.6, label=f"threshold t = −β/|γ| = {t:.4g}")
    for c in range(L):
        mid = lo + (c + 0.5) * w
        if -5 < mid < 5:
            ax.text(mid, -4.7, str(c), ha="center", va="bottom", fontsize=7, color="tab:red" if c == k else "0.3")
    ax.text(-4.9, -4.15, f"codes (k = {k} in red)", fontsize=7, color="0.3")
    ax.set_xlim(-5, 5)
    ax.set_ylim(-5, 5)
    ax.set_xlabel("x̂ (batch-normalised input, in batch std)")
    ax.set_ylabel("decoded x̃")
    ax.set_title(f"γ = {gamma}, β = {beta}: {title}\nK = {bits}, L = {L}, w = {w}, k = {k}, lo = {lo:.4f}",
                 fontsize=9)
    ax.legend(loc="upper left", fontsize=7)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "quantizer_grid.png"))
    a = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 5), dpi=110)
    for ax, (g, b, title) in zip(axes, CASES):
        panel(ax, g, b, a.bits, title)
    fig.tight_layout()
    fig.savefig(a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
