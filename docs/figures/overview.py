"""The method on one picture: docs/overview.png.

    python docs/figures/overview.py [--out docs/overview.png]

A schematic (no measurement): three pre-activation units in a row, the first
two one residual block (its skip path adds the block input, held in `res`, to
the block's output). Forward, left to right, runs exactly through the three
shared buffers (`res`, `act0`, `act1`, named as in lowmem's schedule); each
unit leaves behind only a K-bit code of x̂ and one rstd per channel, and the
input batch is kept exactly in its own slot. Backward, right to left, decodes each
code into the exact ReLU mask and an approximate x̃ and rebuilds the conv
input as mask·(γ·x̃ + β). Needs matplotlib (the optional extra lowmem[plot]).
"""
import argparse
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def box(ax, x, y, w, h, text, fc, ec="k", fs=8.5, lw=1.0):
    from matplotlib.patches import FancyBboxPatch
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                fc=fc, ec=ec, lw=lw))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fs)


def arrow(ax, x0, y0, x1, y1, color="k", ls="-", text=None, fs=7.5, dy=0.12):
    ax.annotate("", (x1, y1), (x0, y0), arrowprops=dict(arrowstyle="-|>", color=color, lw=1.2, ls=ls))
    if text:
        ax.text((x0 + x1) / 2, (y0 + y1) / 2 + dy, text, ha="center", va="bottom", fontsize=fs, color=color)


def draw(path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(12, 6.6), dpi=110)
    ax.set_xlim(0, 12)
    ax.set_ylim(-0.1, 6.7)
    ax.axis("off")
    exact, approx, saved = "#d9ead3", "#fce5cd", "#cfe2f3"
    xs = [1.5, 4.7, 7.9]
    # forward row
    ax.text(0.1, 6.35, "forward, exact (left to right)", fontsize=10, weight="bold")
    box(ax, 0.1, 4.75, 1.1, 0.8, "input batch\n→ stem conv", exact)
    for i, x in enumerate(xs):
        box(ax, x, 4.75, 2.6, 0.8, f"unit {i + 1}:  BN → ReLU → conv\n"
            r"$\hat x$ = (x − μ)·rstd,  r = relu(γ·$\hat x$ + β)", exact)
    box(ax, 11.0, 4.75, 0.9, 0.8, "head,\nloss", exact)
    for i, x in enumerate([1.2] + [xs[0] + 2.6, xs[1] + 2.6]):
        arrow(ax, x, 5.15, xs[i], 5.15)
    ax.text(3.3, 6.37, "activations live only in three shared float buffers (res, act0, act1), "
            "overwritten as the sweep moves on", fontsize=8, color="0.25")
    arrow(ax, xs[2] + 2.6, 5.15, 11.0, 5.15)
    ax.annotate("", (xs[1] + 2.55, 5.55), (xs[0] - 0.05, 5.55),
                arrowprops=dict(arrowstyle="-|>", color="0.3", lw=1.1, connectionstyle="arc3,rad=-0.12"))
    ax.text(xs[1], 6.02, "residual add: the block input waits in res, "
            "then res += the block's output", ha="center", fontsize=7.5, color="0.3")
    # saved row
    ax.text(0.1, 2.72, "kept between the passes", fontsize=10, weight="bold")
    for i, x in enumerate(xs):
        box(ax, x + 0.3, 3.05, 2.0, 0.6, r"K-bit code of $\hat x$" + "\n+ rstd (one per channel)", saved, fs=8)
        arrow(ax, x + 1.3, 4.75, x + 1.3, 3.65, color="tab:blue")
    box(ax, 11.0, 3.05, 0.9, 0.6, "FC input\n(exact)", saved, fs=7.5)
    box(ax, 0.1, 3.05, 1.1, 0.6, "input batch\n(exact)", saved, fs=7.5)
    arrow(ax, 0.65, 4.75, 0.65, 3.65, color="tab:blue")
    # backward row
    ax.text(0.1, 2.4, "backward (right to left): rebuild from the code", fontsize=10, weight="bold")
    for i, x in enumerate(xs):
        box(ax, x, 0.75, 2.6, 1.45,
            "decode: mask = code ≥ k  (exact)\n"
            r"         $\tilde x$ ≈ $\hat x$ (bin midpoint)" + "\n"
            r"conv dW from mask·(γ·$\tilde x$ + β)" + "\n"
            r"dy = dr·mask,  $d\gamma$ = Σ dy·$\tilde x$,  $d\beta$ = Σ dy" + "\n"
            r"dx = $\gamma$·rstd·(dy − mean dy − $\tilde x$·mean(dy·$\tilde x$))", approx, fs=7.6)
        arrow(ax, x + 1.3, 3.05, x + 1.3, 2.2, color="tab:blue")
    box(ax, 11.0, 0.95, 0.9, 1.0, "dlogits\n(exact)", exact)
    arrow(ax, 11.0, 1.45, xs[2] + 2.62, 1.45)
    for i in (2, 1):
        arrow(ax, xs[i], 1.45, xs[i - 1] + 2.6, 1.45)
    arrow(ax, xs[0], 1.45, 1.2, 1.45)
    ax.text(0.65, 1.0, "stem dθ\nfrom the\nexact input", ha="center", va="center", fontsize=7.5)
    ax.text(6.0, 0.3, "green: exact, bit for bit as lowmem's exact mode;   orange: reads "
            r"$\tilde x$, so carries a small error that adds up downwards but never enters the forward pass",
            ha="center", fontsize=8)
    ax.text(6.0, 0.05, "k: the first code above the ReLU threshold t, so the mask code ≥ k is exact "
            "(quantizer.md);  dθ (dW): a conv's weight gradient", ha="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "overview.png"))
    draw(p.parse_args().out)


if __name__ == "__main__":
    main()
