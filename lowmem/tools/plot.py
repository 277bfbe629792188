"""Pictures of a memory plan and of training runs (matplotlib: the optional extra lowmem[plot]).

    plan_figure(engine, "plan.png")                   # lowmem plan ... --figure plan.png
    plan_figure(engine, "plan.svg", compare=exact)    # ... --compare: both plans on one scale
    curves_figure(["runs/a", "runs/b"], "curves.png") # lowmem plot runs/a runs/b --out curves.png

The plan figure, from the plan and the schedule alone (lowmem/tools/timeline.py): the
buffer timeline (each row a planned buffer with its bytes; the steps along x, forward then
backward, grouped by stage, with one block drawn step by step when the schedule is long:
what each buffer holds and which step writes, reads or adds into it), the saved bytes of
each step that keeps something for backward (a bar per layer, coloured by what it keeps:
a unit's code and its width, a range code (a standalone batch norm's x-hat, a conv's input)
and its width, float x-hat, region code, index, mask, exact), and the plan's totals by kind. The curves
figure (lowmem/tools/runcurves.py): loss, accuracy, learning rate and img/s against the
iteration, every run on the same axes, each run's planned memory in its legend entry.

Figures are drawn on the Agg canvas, never on a window; the format follows the file's
suffix (.png or .svg). Without matplotlib each entry raises PlotUnavailable, one line
naming the extra. Each returns the matplotlib Figure it saved (its artists carry gids:
"row:<buffer>", "saved:<label>:<layer>", "total:<label>:<kind>", "curve:<run>:<quantity>").
"""
import io
import os

from ..core.checks import bits_label
from ..core.plan import KINDS
from ..system.atomic import atomic_write
from ..system.memory import fmt_bytes
from . import runcurves
from .timeline import buffer_timeline, group_of, saved_by_step, short

FORMATS = (".png", ".svg")
MISSING = "figures need matplotlib, the optional extra: pip install lowmem[plot]"
MIB = float(1 << 20)
LONG = 28                   # a schedule longer than this gets one block drawn step by step
PHASE = {"fwd": ("#c6dbef", "#6baed6", "#2171b5"), "bwd": ("#fdd0a2", "#fd8d3c", "#d94801")}  # held, read, write
EVENT = {"acc": "#cb181d", "shared": "#6a51a3", "scratch": "#41ab5d"}
SAVED = {"1-bit code": "#fee391", "2-bit code": "#fec44f", "4-bit code": "#fe9929", "8-bit code": "#cc4c02",
         "code": "#fe9929", "1-bit range code": "#fcc5c0", "2-bit range code": "#fa9fb5",
         "4-bit range code": "#f768a1", "8-bit range code": "#ae017e", "range code": "#f768a1",
         "float x-hat": "#2171b5", "region code": "#c994c7", "index": "#41ab5d", "mask": "#807dba",
         "exact": "#737373"}
KIND_COLOR = dict(zip(KINDS, ("#1f77b4", "#aec7e8", "#ff7f0e", "#c7c7c7", "#98df8a", "#2ca02c", "#d62728",
                              "#9467bd")))


class PlotUnavailable(ImportError, ValueError):
    """matplotlib is not installed (a ValueError too: the command line's one-line error)."""


def require():
    """PlotUnavailable unless matplotlib imports (a command checks before its other work)."""
    _matplotlib()


def _matplotlib():
    try:        # optional dependency (lowmem[plot]): imported only when a figure is drawn
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable(MISSING) from None
    return Figure, FigureCanvasAgg


def _figure(*size):
    """A matplotlib Figure on the Agg canvas."""
    Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=size, dpi=100)
    FigureCanvasAgg(fig)
    return fig


def check_path(path):
    """The figure's file name, refused (ValueError) unless it ends .png or .svg and could be
    written: not a folder, in a folder that exists (a command checks before its other work)."""
    path = os.fspath(path)
    if not path.lower().endswith(FORMATS):
        raise ValueError(f"figure file {path!r}: expected a name ending {' or '.join(FORMATS)}")
    folder = os.path.dirname(path) or "."
    if os.path.isdir(path):
        raise ValueError(f"figure file {path!r} is a folder")
    if not os.path.isdir(folder):
        raise ValueError(f"figure file {path!r}: " + (f"{folder!r} is not a folder" if os.path.exists(folder)
                                                      else f"no such folder {folder!r}"))
    return path


def _save(fig, path):
    buf = io.BytesIO()
    fig.savefig(buf, format=path.lower().rsplit(".", 1)[-1], dpi=100)
    atomic_write(path, buf.getvalue(), what="figure")        # a failed write leaves no torn file
    return fig


def _code_bits(engine):
    """The width of the engine's range codes (its keeper's; None in exact mode)."""
    return getattr(getattr(engine, "keeper", None), "bits", None)


def engine_label(engine):
    """'exact', 'approx 4-bit', 'approx 2-bit x16, 4-bit x3' (the engine's mode and widths)."""
    if engine.mode == "exact" or not engine.unit_bits:
        return engine.mode
    return f"{engine.mode} {bits_label(engine.mode, engine.unit_bits)}"


# ---------------------------------------------------------------- the plan figure

def plan_figure(engine, path, compare=None, block=None):
    """Draw engine's plan (and beside it, on one scale, the plan of `compare`, another Engine
    of the same network) into `path` (.png or .svg); returns the Figure. block: the block drawn
    step by step under a long schedule (a layer-name prefix such as "layer1.1"; default: the
    first residual block)."""
    path = check_path(path)
    engines = [engine] + ([compare] if compare is not None else [])
    t = buffer_timeline(engine.plan, engine.schedule)
    if block is not None and not _block_steps(t, block):
        raise ValueError(f"block {block!r}: no layer of {engine.net.name} is named {block}.<layer>")
    block = (block or _zoom_block(t)) if len(t.steps) > LONG else None
    # panels and the space under each (inches): tick labels, legends and notes sit in that space
    panels = [("timeline", 0.4 * len(t.rows) + 0.5, 0.9 if block else 1.75)]
    if block:
        panels.append(("block", 0.4 * sum(any(t.state[e.name][i] for i in _block_steps(t, block))
                                          for e in t.rows) + 0.3, 1.25))
    panels += [("saved", 2.4, 0.65), ("totals", 0.45 * len(engines) + 0.2, 0.5)]
    head = 0.85
    fig = _figure(14, head + sum(h + gap for _, h, gap in panels))
    ratios = [x for _, h, gap in panels for x in (h, gap)]
    grid = fig.add_gridspec(len(ratios), len(engines), height_ratios=ratios, hspace=0, wspace=0.08,
                            left=0.125, right=0.98, top=1 - head / fig.get_figheight(), bottom=0)
    at = {name: 2 * k for k, (name, _, _) in enumerate(panels)}
    net, shape = engine.net, "x".join(map(str, engine.input_shape))
    fig.suptitle(f"{net.name}: memory plan at batch {engine.N}, input {shape}, "
                 + " vs ".join(f"{engine_label(e)}: {fmt_bytes(e.plan.total_bytes)}" for e in engines),
                 fontsize=12, x=0.01, y=1 - 0.2 / fig.get_figheight(), ha="left", va="top")
    _timeline(fig.add_subplot(grid[at["timeline"], :]), t, cells=block is None,
              title=f"buffers along the schedule ({engine_label(engine)}, {len(t.steps)} steps)")
    if block:
        _timeline(fig.add_subplot(grid[at["block"], :]), t, cells=True, only=block,
                  title=f"one block step by step: {block} (the same buffers, forward then backward)")
    top = max(sum(b for _, b in parts) for e in engines
              for _, parts in saved_by_step(e.plan, e.schedule, e.unit_bits, _code_bits(e)) or [(None, [("", 1)])]) / MIB
    for k, e in enumerate(engines):        # one scale: the same y limits
        _saved(fig.add_subplot(grid[at["saved"], k]), e, left=k == 0, max_saved_mib=top)
    _totals(fig.add_subplot(grid[at["totals"], :]), engines)
    return _save(fig, path)


def _zoom_block(t):
    """The block drawn step by step: the first two-part name group whose forward has an add
    (a residual block), else the first two-part group of at least 3 steps; None if none."""
    blocks = [g for g in t.groups(level=2) if g[3] == "fwd" and "." in g[0] and g[2] - g[1] >= 3]
    with_add = [g for g in blocks if any(s.op == "add" for s in t.steps[g[1]:g[2]])]
    chosen = (with_add or blocks or [None])[0]
    return chosen[0] if chosen else None


def _block_steps(t, block):
    return [s.index for s in t.steps if s.layer is not None and group_of(s.name, 2) == block]


def _color(state, phase):
    held, read, write = PHASE[phase]
    return {"held": held, "read": read, "write": write}.get(state) or EVENT.get(state)


def _timeline(ax, t, cells, title, only=None):
    """Rows = t.rows; one column per step (only: just the steps of that block, both phases)."""
    cols = t.steps if only is None else [t.steps[i] for i in _block_steps(t, only)]
    x = {s.index: j for j, s in enumerate(cols)}
    rows = [e for e in t.rows if only is None or any(t.state[e.name][s.index] for s in cols)]
    for r, e in enumerate(rows):
        y = len(rows) - 1 - r
        spans = {}                              # colour -> [(x, width)], runs of equal colour
        for s in cols:
            c = _color(t.state[e.name][s.index], s.phase)
            if c:
                runs = spans.setdefault(c, [])
                if runs and runs[-1][0] + runs[-1][1] == x[s.index]:
                    runs[-1] = (runs[-1][0], runs[-1][1] + 1)
                else:
                    runs.append((x[s.index], 1))
            if cells and (t.state[e.name][s.index] or only is not None):
                ax.text(x[s.index] + 0.5, y + 0.5, t.text[e.name][s.index], ha="center", va="center",
                        fontsize=6.5, clip_on=True,
                        color="black" if t.state[e.name][s.index] else "0.6")
        thin = len(cols) / 700                  # a one-step run stays visible on a long schedule
        for c, runs in spans.items():
            runs = runs if cells else [(x0, max(w, thin)) for x0, w in runs]
            ax.broken_barh(runs, (y + 0.08, 0.84), facecolors=c, edgecolor="white" if cells else "none",
                           linewidth=0.8, gid=f"row:{e.name}")
    ax.set_yticks([len(rows) - 0.5 - r for r in range(len(rows))],
                  [f"{e.name}  {fmt_bytes(e.nbytes)}" for e in rows], fontsize=8, family="monospace")
    ax.set_ylim(0, len(rows) + (1.1 if only is None else 0.05))
    ax.set_xlim(0, len(cols))
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    first_bwd = next((j for j, s in enumerate(cols) if s.phase == "bwd"), len(cols))
    ax.axvline(first_bwd, color="black", lw=1.2)
    if only is None:
        top = len(rows) + 0.75
        ax.text(first_bwd - 0.5, top, "forward →  ", ha="right", va="center", fontsize=8, weight="bold")
        ax.text(first_bwd + 0.5, top, "  ← backward", ha="left", va="center", fontsize=8, weight="bold")
    if not cells:
        _stage_axis(ax, t)
    else:
        ax.set_xticks([j + 0.5 for j in range(len(cols))],
                      [f"{s.index} {s.phase}\n{s.op}\n{short(s.name)}" for s in cols], fontsize=6.5)
        ax.tick_params(axis="x", length=0)
    ax.set_title(title, fontsize=10, loc="left")
    if only is None:                # under the tick labels: a fixed distance in points
        from matplotlib.transforms import offset_copy
        under = offset_copy(ax.transAxes, ax.figure, y=-(18 if not cells else 40), units="points")
        ax.legend(handles=_state_handles(), fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, 0),
                  bbox_transform=under, frameon=False)
    if cells:
        ax.annotate("cell text, the tensor a buffer holds after the step: bn1 that layer's output, ∂bn1 its "
                    "gradient, Σ∂bn1 a gradient two consumers add into,\n∂add also both of the add's operands' "
                    "gradient, x the network input, bn1~ rebuilt from bn1's saved slot; grey: left over, not read again",
                    (0, 0), xytext=(0, -40 if only else -80), xycoords="axes fraction", textcoords="offset points",
                    fontsize=7, va="top")


def _state_handles():
    from matplotlib.patches import Patch
    return [Patch(color=PHASE["fwd"][0], label="holds an activation still to be read"),
            Patch(color=PHASE["fwd"][2], label="written (forward)"),
            Patch(color=PHASE["bwd"][0], label="holds a gradient still to be read"),
            Patch(color=PHASE["bwd"][2], label="written (backward)"),
            Patch(color=PHASE["fwd"][1], label="read"),
            Patch(color=EVENT["acc"], label="added into (+=)"),
            Patch(color=EVENT["shared"], label="one gradient for both add operands"),
            Patch(color=EVENT["scratch"], label="rebuilt conv input / decoded x-hat (name~)")]


def _stage_axis(ax, t):
    """Stage names under their runs of steps (level-1 groups; too narrow ones unlabelled), light
    bands behind alternate stages, small ticks at each block's first step."""
    n = len(t.steps)
    ticks, labels = [], []
    for k, (label, a, b, phase) in enumerate(t.groups(level=1)):
        if k % 2:
            ax.axvspan(a, b, color="0.94", zorder=0, lw=0)
        if (b - a) / n > 0.025:
            ticks.append((a + b) / 2)
            labels.append(label)
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set_xticks([a for _, a, _, _ in t.groups(level=2)], minor=True)
    ax.tick_params(axis="x", which="major", length=0)
    ax.tick_params(axis="x", which="minor", length=3, color="0.5")


def _saved(ax, engine, left, max_saved_mib):
    """A bar per forward step that keeps something for backward, stacked by what it keeps; the
    y axis to max_saved_mib (the largest bar of the engines drawn side by side)."""
    from matplotlib.patches import Patch
    label = engine_label(engine)
    rows = saved_by_step(engine.plan, engine.schedule, engine.unit_bits, _code_bits(engine))
    seen = {}
    for j, (s, parts) in enumerate(rows):
        bottom = 0.0
        for what, nbytes in parts:
            ax.bar(j, nbytes / MIB, bottom=bottom, width=0.85, color=SAVED.get(what, "#737373"), lw=0,
                   gid=f"saved:{label}:{s.name}")
            bottom += nbytes / MIB
            seen[what] = seen.get(what, 0) + nbytes
    ticks, names, start = [], [], 0
    for j in range(len(rows) + 1):
        if j == len(rows) or (j and group_of(rows[j][0].name) != group_of(rows[start][0].name)):
            if (j - start) / max(len(rows), 1) > 0.04 or len(rows) <= 30:
                ticks.append((start + j - 1) / 2)
                names.append(group_of(rows[start][0].name))
            start = j
    ax.set_xticks(ticks, names, fontsize=7)
    ax.set_xlim(-0.7, len(rows) - 0.3)
    ax.set_ylim(0, 1.08 * max_saved_mib)
    total = engine.plan.bytes_by_kind()["saved"]
    ax.set_title(f"{label}: saved for backward {fmt_bytes(total)} "
                 f"({total / engine.N / 1e6:.3f} MB per sample), a bar per layer", fontsize=9, loc="left")
    if left:
        ax.set_ylabel("MiB saved", fontsize=8)
    else:
        ax.tick_params(axis="y", labelleft=False)
    ax.legend(handles=[Patch(color=SAVED.get(w, "#737373"), label=f"{w} {fmt_bytes(b)}") for w, b in seen.items()],
              fontsize=7, loc="upper right", frameon=False)
    ax.tick_params(axis="both", labelsize=7)


def _totals(ax, engines):
    """A horizontal bar per engine, stacked by plan kind, on one scale."""
    from matplotlib.patches import Patch
    kinds = [k for k in KINDS if any(e.plan.bytes_by_kind()[k] for e in engines)]
    labels = [engine_label(e) for e in engines]
    for r, (e, label) in enumerate(zip(engines, labels)):
        y, left, by = len(engines) - 1 - r, 0.0, e.plan.bytes_by_kind()
        for k in kinds:
            w = by[k] / MIB
            ax.barh(y, w, left=left, height=0.6, color=KIND_COLOR[k], gid=f"total:{label}:{k}")
            if w > 0.045 * max(x.plan.total_bytes for x in engines) / MIB:
                ax.text(left + w / 2, y, f"{k}\n{fmt_bytes(by[k])}", ha="center", va="center", fontsize=6.5)
            left += w
        most = max(engines, key=lambda x: x.plan.total_bytes)
        less = (f" ({most.plan.total_bytes / e.plan.total_bytes:.2f}x less than {engine_label(most)})"
                if e is not most and e.plan.total_bytes else "")
        ax.text(left, y, f"  {fmt_bytes(e.plan.total_bytes)}{less}", va="center", fontsize=8, weight="bold")
    ax.set_yticks(range(len(engines)), [lab.replace(", ", ",\n") if len(lab) > 16 else lab
                                        for lab in labels[::-1]], fontsize=8)
    # room on the right for the totals written after the bars: a text starting at data x0 and w
    # pixels wide ends inside an axes p pixels wide when the x limit is at least x0 / (1 - w / p)
    renderer, p = ax.figure.canvas.get_renderer(), ax.get_window_extent().width
    room = [t.get_position()[0] / (1 - t.get_window_extent(renderer).width / p) for t in ax.texts
            if t.get_text().startswith("  ") and t.get_window_extent(renderer).width < 0.9 * p]
    ax.set_xlim(0, max([1.12 * max(e.plan.total_bytes for e in engines) / MIB] + [1.01 * x for x in room]))
    ax.set_xlabel("MiB planned", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title("the whole plan by kind", fontsize=9, loc="left")
    ax.legend(handles=[Patch(color=KIND_COLOR[k], label=k) for k in kinds], fontsize=7, ncol=len(kinds),
              loc="lower right", bbox_to_anchor=(1, 1), frameon=False, borderaxespad=0.2)


# ---------------------------------------------------------------- the curves of runs

QUANTITIES = (("loss", "train_loss", "test_loss", "loss", False), ("accuracy", "train_acc", "test_acc", "accuracy", False),
              ("learning rate", "lr", None, "lr", True), ("images per second", "images_per_s", None, "img/s", False))


def curves_figure(run_dirs, path):
    """Draw the curves of the run folders `run_dirs` into `path` (.png or .svg); returns the
    Figure. runcurves.RunError (a ValueError) names a folder that holds no run."""
    path = check_path(path)
    runs = [runcurves.read_run(d) for d in run_dirs]
    fig = _figure(13, 8.4)
    axes = fig.subplots(2, 2, sharex=True).ravel()
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
    for ax, (title, train, test, ylabel, log) in zip(axes, QUANTITIES):
        for k, run in enumerate(runs):
            c = colors[k % len(colors)]
            it, v = run.series(train)
            ax.plot(it, v, color=c, lw=1.2, marker="." if len(it) < 30 else None, gid=f"curve:{run.name}:{train}")
            if test:
                it, v = run.series(test)
                ax.plot(it, v, color=c, lw=1.6, ls="--", marker="o", ms=4, gid=f"curve:{run.name}:{test}")
        ax.set_title(title + (" (solid: train, dashed: test after each epoch)" if test else ""), fontsize=9,
                     loc="left")
        ax.set_ylabel(ylabel, fontsize=8)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    for ax in axes[2:]:
        ax.set_xlabel("iteration", fontsize=8)
    spe = {r.steps_per_epoch for r in runs}
    if len(spe) == 1 and None not in spe:        # every run has the same epochs: mark them on top
        (k,) = spe
        for ax in axes[:2]:
            top = ax.secondary_xaxis("top", functions=(lambda i: i / k, lambda e: e * k))
            top.set_xlabel("epoch", fontsize=8)
            top.tick_params(labelsize=7)
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=colors[k % len(colors)], lw=2, label=r.label) for k, r in enumerate(runs)]
    fig.legend(handles=handles, loc="upper center", ncol=min(len(runs), 2), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.995))
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.07, hspace=0.25, wspace=0.18,
                        top=0.93 - 0.035 * ((len(runs) + 1) // 2))
    return _save(fig, path)
