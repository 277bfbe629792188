"""Approx vs naive gradient error by depth: each conv weight's relative error, output to input.

    python docs/figures/error_by_depth.py [--depth 56] [--batch 32] [--bits 4] [--batches 4]
                                          [--out docs/error_by_depth.png]

Runs lowmem.tools.gradient_error.gradient_errors (the same measurement as `lowmem diagnose`)
on a pre-activation CIFAR ResNet at random initialisation with learnable synthetic
data, and plots, for every conv weight tensor in order from the output (left) to the
input (right), the relative error ||g_m - g_exact|| / ||g_exact|| (rms over the
batches) of approx and naive mode. Prints the numbers as a table. The PNG needs
matplotlib (the optional extra lowmem[plot]).
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from lowmem.tools import gradient_error as D  # noqa: E402
from lowmem.models import preact_resnet_cifar       # noqa: E402


def conv_errors(depth, batch, bits, num_batches, seed=0):
    """[(name, approx error, naive error)] for the conv weights, output first."""
    net = preact_resnet_cifar(depth, seed=seed)
    batches = D.synthetic_batches(num_batches, batch, (3, 32, 32), net.num_classes, seed)
    d = D.gradient_errors(net, batches, bits=bits)
    err = d.error
    rows = [(n, err["approx"][i], err["naive"][i]) for i, n in enumerate(d.names)
            if n.endswith(".weight") and ("conv" in n or "shortcut" in n)]
    return rows[::-1], d


def plot(rows, depth, bits, num_batches, batch, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(9, 4.2), dpi=120)
    ax.plot(x, [r[2] for r in rows], "o-", color="tab:red", ms=3.5, label="naive (quantized forward)")
    ax.plot(x, [r[1] for r in rows], "o-", color="tab:blue", ms=3.5, label="approx (exact forward, the method)")
    for i, r in enumerate(rows):
        if "shortcut" in r[0]:
            ax.axvline(i, color="0.85", lw=0.8, zorder=0)
    ax.set_xticks([0, len(rows) - 1], [rows[0][0].rsplit(".", 1)[0] + "\n(output side)",
                                       rows[-1][0].rsplit(".", 1)[0] + "\n(input side)"])
    ax.set_xlabel("conv weight tensors, from the output to the input (grey lines: projection shortcuts)")
    ax.set_ylabel("relative gradient error")
    ax.set_ylim(0, max(r[2] for r in rows) * 1.1)
    ax.set_title(f"pre-act ResNet-{depth}, {bits}-bit codes: conv weight-gradient error vs exact "
                 f"({num_batches} batches of {batch})", fontsize=10)
    ax.legend(loc="center right")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=56)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "error_by_depth.png"))
    a = p.parse_args(argv)
    rows, d = conv_errors(a.depth, a.batch, a.bits, a.batches)
    print(f"{'conv weight (output first)':<28} {'approx':>8} {'naive':>8}")
    for n, e_a, e_n in rows:
        print(f"{n:<28} {e_a:>8.3f} {e_n:>8.3f}")
    print(d.summary_text())
    try:
        plot(rows, a.depth, a.bits, a.batches, a.batch, a.out)
    except ImportError:
        print("matplotlib is not installed (pip install 'lowmem[plot]'): no PNG written")


if __name__ == "__main__":
    main()
