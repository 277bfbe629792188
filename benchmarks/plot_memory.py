"""Memory vs depth: lowmem's plans (exact, 8-, 4-, 2-bit) against PyTorch's measured peaks.

    python benchmarks/plot_memory.py --json runs/*.json [--batch 128] [--out docs/memory_vs_depth.png]

lowmem's curves come from plans (Engine(..., allocate=False): no memory is used);
PyTorch's points (and any measured lowmem points) come from the JSON files that
benchmarks/compare_torch.py --json writes: peak resident memory above the
process baseline. Pre-act CIFAR ResNets with bottleneck blocks (depth 9n+2).
Prints the numbers as a Markdown table; draws the PNG when matplotlib is installed
(the optional extra lowmem[plot]).
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from lowmem.tools.maxbatch import planned_engine          # noqa: E402
from lowmem.models import preact_resnet_cifar       # noqa: E402

DEPTHS = (29, 56, 110, 164, 272, 542, 1001)
PLANS = (("lowmem exact", "exact", 8), ("lowmem 8-bit", "approx", 8), ("lowmem 4-bit", "approx", 4),
         ("lowmem 2-bit", "approx", 2))
MEASURED = {"torch-exact": "PyTorch exact (measured)", "torch-ckpt": "PyTorch checkpointed (measured)",
            "lowmem-approx4": "lowmem 4-bit (measured RSS)"}
GiB = 1 << 30


def planned(depths, batch):
    out = {}
    for label, mode, bits in PLANS:
        out[label] = {d: planned_engine(lambda d=d: preact_resnet_cifar(d, block="bottleneck"), batch, (3, 32, 32),
                                        mode, bits).plan.total_bytes for d in depths}
    return out


def measured(paths, batch):
    """{label: {depth: bytes}} from compare_torch JSON files (status ok, this batch)."""
    out = {label: {} for label in MEASURED.values()}
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        for r in data.get("runs", []):
            block = r.get("block", data.get("args", {}).get("block"))
            if r.get("status") == "ok" and r.get("batch") == batch and r["config"] in MEASURED \
                    and block == "bottleneck":
                out[MEASURED[r["config"]]][r["depth"]] = r["peak_above_base"]
    return {k: v for k, v in out.items() if v}


def markdown(plans, meas, depths):
    cols = list(plans) + list(meas)
    lines = ["| depth | " + " | ".join(cols) + " |", "|" + "---:|" * (len(cols) + 1)]
    for d in depths:
        cells = [plans[c][d] if c in plans else meas[c].get(d) for c in cols]
        lines.append(f"| {d} | " + " | ".join("-" if b is None else f"{b / GiB:.2f}" for b in cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", nargs="*", default=[], help="compare_torch.py --json outputs")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--depths", default=",".join(map(str, DEPTHS)))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "docs", "memory_vs_depth.png"))
    args = ap.parse_args(argv)
    depths = [int(d) for d in args.depths.split(",")]
    plans, meas = planned(depths, args.batch), measured(args.json, args.batch)
    print(f"memory (GiB) at batch {args.batch}: lowmem plan totals; measured = peak RSS above the "
          f"process baseline")
    print(markdown(plans, meas, depths))
    try:
        import matplotlib
        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install lowmem[plot]): table only", file=sys.stderr)
        return 0
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in plans.items():
        ax.plot(depths, [pts[d] / GiB for d in depths], marker=".", label=label + " (plan)")
    for (label, pts), m in zip(meas.items(), "osx"):
        ds = sorted(pts)
        ax.plot(ds, [pts[d] / GiB for d in ds], marker=m, linestyle="--", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(depths)
    ax.set_xticklabels([str(d) for d in depths])
    ax.set_xlabel("depth (pre-act ResNet, bottleneck blocks, CIFAR 32x32)")
    ax.set_ylabel(f"GiB at batch {args.batch}")
    ax.set_title("Training memory vs depth")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
