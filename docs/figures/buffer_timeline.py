"""The three-buffer timeline of a bottleneck block, forward and backward, from the real schedule.

    python docs/figures/buffer_timeline.py [--out docs/buffer_timeline.png]

Builds the schedule of a pre-activation ResNet-20 with bottleneck blocks (two per
stage) in 4-bit mode, allocates nothing, and draws, for the identity block
layer1.1 and the projection block layer1.0, what act0, act1 and res hold after
every step. Only Step fields are used (src, dst; dout, dest, accumulate,
scratch), and every label is derived from them (the add's operands from what
the buffers held when it ran), so the picture is the schedule's. Orange:
written by the step; blue: read; red: accumulated into (+=, the forward add and
a second consumer's gradient); purple: one gradient buffer shared by both
operands of an add (backward: nothing is written); grey: what a buffer still
holds from before.
Needs matplotlib (the optional extra lowmem[plot]).
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import lowmem as lm                 # noqa: E402
from lowmem.core.schedule import BUFFERS  # noqa: E402

SHORT = {"bn1": "r1", "bn2": "r2", "bn3": "r3", "conv1": "h1", "conv2": "h2", "conv3": "h3",
         "shortcut": "p", "add": "x'"}


def label(name):
    """Short name of a layer's output: r1 = relu(bn1(x)), h1 = conv1(r1), ..., x' = the block's output."""
    return SHORT.get(name.rsplit(".", 1)[-1], name)


def timelines(block):
    """(forward columns, backward columns) for one block; a column is (title, {buf: (text, how)})."""
    eng = lm.Engine(lm.models.preact_resnet_cifar(20, block="bottleneck"), 8, (3, 32, 32), "approx", 4,
                    allocate=False)
    held = {b: ("", "old") for b in BUFFERS}
    held["res"] = ("x", "old")
    producer_of = {}                 # forward tensor label -> where it was read from
    add_operands = None              # (skip label, branch label) of the block's add
    fwd, bwd = [], []
    for s in eng.schedule:
        inside = s.layer is not None and s.name.startswith(block + ".")
        if s.phase == "fwd":
            if not inside:
                continue
            cells = {b: (t, "old") for b, (t, _) in held.items()}
            src = cells[s.src][0]
            out = label(s.name)
            cells[s.src] = (cells[s.src][0], "read")
            if s.op == "add":                        # dst += src: an accumulation, not a write
                add_operands = (held[s.dst][0], src)
                cells[s.dst] = (f"x' = {held[s.dst][0]}\n+ {src}", "acc")
            else:
                cells[s.dst] = (out, "write")
            producer_of[label(s.name)] = src
            held = {b: (t, "old") for b, (t, _) in cells.items()}
            fwd.append((f"{s.index}\n{s.op} {s.name.rsplit('.', 1)[-1]}", cells))
    held = {b: ("", "old") for b in BUFFERS}
    first = True
    for s in eng.schedule:
        inside = s.layer is not None and s.name.startswith(block + ".")
        if s.phase != "bwd" or not inside:
            continue
        if first:                    # the gradient of the block's output arrives in dout
            held[s.dout] = ("∂x'", "old")
            first = False
        cells = {b: (t, "old") for b, (t, _) in held.items()}
        cells[s.dout] = (cells[s.dout][0], "read")
        short = s.name.rsplit(".", 1)[-1]
        if s.op == "add":                            # both operands' gradient is ∂x': shared storage
            skip, branch = add_operands
            cells[s.dest] = (f"∂x' = ∂{branch}\n= ∂{skip}", "shared")
        else:
            read_from = producer_of.get(label(s.name), "?")
            if s.scratch:
                cells[s.scratch] = ("r1~" if read_from == "r1" else (read_from + "~") if s.op == "conv"
                                    else "x̃ (ref.)", "write")
            grad = "∂" + read_from
            if s.accumulate:
                cells[s.dest] = (cells[s.dest][0] + "\n+= " + grad + f" via {short}", "acc")
            elif s.dest:
                cells[s.dest] = (grad, "write")
        bwd.append((f"{s.index}\n{s.op} {short}", cells))
        held = {b: (t, "old") for b, (t, _) in cells.items()}
    return fwd, bwd


def draw(ax, columns, title):
    from matplotlib.patches import Rectangle
    colors = {"write": "#fdb462", "read": "#9ecae1", "acc": "#fb8072", "shared": "#bcbddc", "old": "#f2f2f2"}
    for j, (head, cells) in enumerate(columns):
        ax.text(j + 0.5, 3.08, head, ha="center", va="bottom", fontsize=7)
        for i, b in enumerate(BUFFERS):
            text, how = cells[b]
            y = 2 - i
            ax.add_patch(Rectangle((j, y), 1, 1, facecolor=colors[how], edgecolor="white", lw=2))
            ax.text(j + 0.5, y + 0.5, text, ha="center", va="center", fontsize=7,
                    color="0.55" if how == "old" else "black")
    for i, b in enumerate(BUFFERS):
        ax.text(-0.1, 2 - i + 0.5, b, ha="right", va="center", fontsize=9, family="monospace")
    ax.set_xlim(-1.1, len(columns))
    ax.set_ylim(0, 3.7)
    ax.axis("off")
    ax.set_title(title, fontsize=9, loc="left")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "buffer_timeline.png"))
    a = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(4, 1, figsize=(10, 10), dpi=110)
    for k, (block, kind) in enumerate((("layer1.1", "identity block"), ("layer1.0", "projection block"))):
        fwd, bwd = timelines(block)
        draw(axes[2 * k], fwd, f"{block} ({kind}), forward: res holds the block input x until the add")
        draw(axes[2 * k + 1], bwd, f"{block} ({kind}), backward: the same buffers hold gradients "
                                   f"(∂ = gradient of; r~ = conv input rebuilt from a unit's code)")
    fig.text(0.01, 0.005, "orange: written   blue: read   red: accumulated (+=)   purple: shared by both add "
             "operands (nothing written)   grey: still held.\nx̃ (ref.): the reference kernels decode x̃ there; "
             "the fused ones leave it unused.",
             fontsize=7.5)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
