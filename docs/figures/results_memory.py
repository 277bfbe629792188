"""Planned memory of one training step by depth, exact against approx 4-bit: docs/results_memory.png.

    python docs/figures/results_memory.py [--batch 128] [--out docs/results_memory.png]

Plans only (Engine(..., allocate=False)): deterministic, the same on every
machine, and equal to what lowmem allocates (tests/core/test_plan.py measures it).
Pre-activation CIFAR ResNets, float32, 3x32x32, 10 classes, with the models'
default blocks: basic up to ResNet-110, bottleneck from ResNet-164 on (the plot
marks the switch, which is where the totals jump). Prints the table it plots.
Needs matplotlib for the PNG.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import lowmem as lm   # noqa: E402

DEPTHS = (20, 56, 110, 164, 272, 1001)


def totals(batch):
    rows = []
    for d in DEPTHS:
        plans = {m: lm.Engine(lm.models.preact_resnet_cifar(d), batch, (3, 32, 32), m, 4, allocate=False).plan
                 for m in ("exact", "approx")}
        saved = {m: sum(e.nbytes for e in p.entries if e.kind == "saved") for m, p in plans.items()}
        rows.append((d, plans["exact"].total_bytes, plans["approx"].total_bytes, saved["exact"], saved["approx"]))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results_memory.png"))
    a = p.parse_args()
    rows = totals(a.batch)
    mib = 2 ** 20
    print(f"batch {a.batch}, float32: planned MiB per training step")
    print(f"{'depth':>6} {'exact':>10} {'approx-4':>10} {'ratio':>7} {'saved exact':>12} {'saved approx-4':>15}")
    for d, te, ta, se, sa in rows:
        print(f"{d:>6} {te / mib:>10.1f} {ta / mib:>10.1f} {te / ta:>7.2f} {se / mib:>12.1f} {sa / mib:>15.1f}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ds = [r[0] for r in rows]
    ax.plot(ds, [r[1] / mib for r in rows], "o-", color="k", label="exact: total")
    ax.plot(ds, [r[2] / mib for r in rows], "o-", color="C1", label="approx 4-bit: total")
    ax.plot(ds, [r[3] / mib for r in rows], "x--", color="k", alpha=0.6, label="exact: saved for backward")
    ax.plot(ds, [r[4] / mib for r in rows], "x--", color="C1", alpha=0.6, label="approx 4-bit: saved for backward")
    for d, te, ta, _, _ in rows:
        ax.annotate(f"{te / ta:.2f}x", (d, ta / mib), textcoords="offset points", xytext=(4, -12), fontsize=7)
    ax.axvspan(ds[0] * 0.85, 135, color="0.5", alpha=0.08, lw=0)
    ax.axvline(135, color="0.4", lw=0.8, ls=":")
    ax.text(128, ax.get_ylim()[1] * 0.6, "basic blocks ", ha="right", va="top", fontsize=7.5, color="0.3")
    ax.text(142, ax.get_ylim()[1] * 0.6, " bottleneck blocks", ha="left", va="top", fontsize=7.5, color="0.3")
    ax.set(xscale="log", yscale="log", xlabel="depth (pre-act CIFAR ResNet, the models' default block)",
           ylabel="MiB (plan)",
           title=f"planned memory of a training step, batch {a.batch}, float32")
    ax.set_xticks(ds)
    ax.set_xticklabels([str(d) for d in ds])
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
