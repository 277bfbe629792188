"""lowmem.tools.plot / timeline / runcurves: the plan figure and the curves of runs, checked
through the figures' artists (no pixel comparisons) and the timeline's states."""
import dataclasses
import importlib.util
import json
import sys

import pytest

import lowmem as lm
from lowmem.core.plan import Plan
from lowmem.system.memory import fmt_bytes
from lowmem.tools import plot, runcurves
from lowmem.tools.timeline import buffer_timeline, saved_by_step, saved_class
from reference import tiny_graph

needs_mpl = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                               reason="matplotlib (the plot extra) is not installed")
MIB = float(1 << 20)


def tiny_resnet(mode="approx", bits=4):
    net = lm.models.preact_resnet_cifar(11, block="bottleneck", num_classes=3)
    return lm.Engine(net, 2, (3, 8, 8), mode, bits, allocate=False)


def gids(fig, prefix):
    return [a.get_gid() for ax in fig.axes for a in ax.get_children() if (a.get_gid() or "").startswith(prefix)]


def expected_rows(eng):
    """Every planned buffer, and the other entries a step reads or writes (input, head slots)."""
    named = {getattr(s, f) for s in eng.schedule for f in ("src", "dst", "dout", "dx", "scratch")}
    return {e.name for e in eng.plan.entries if e.kind == "buffers" or (e.name in named and e.kind != "stats")}


@needs_mpl
def test_plan_figure_of_a_registry_model_has_a_row_per_planned_buffer(tmp_path):
    eng = tiny_resnet()
    fig = plot.plan_figure(eng, tmp_path / "plan.png")
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = expected_rows(eng)
    assert {"act0", "act1", "res", "logits", "dlogits", "dfeat", "input", "loss.probs"} <= rows
    timeline = fig.axes[0]
    drawn = {a.get_gid()[4:] for a in timeline.get_children() if (a.get_gid() or "").startswith("row:")}
    assert drawn <= rows and {"act0", "act1", "res", "input"} <= drawn
    labels = [t.get_text().split()[0] for t in timeline.get_yticklabels()]
    assert sorted(labels) == sorted(rows)                       # one row per planned buffer, each once
    sizes = {e.name: fmt_bytes(e.nbytes) for e in eng.plan.entries}
    assert all(t.get_text().endswith(sizes[t.get_text().split()[0]]) for t in timeline.get_yticklabels())
    assert len(eng.schedule) > plot.LONG and "layer1.0" in fig.axes[1].get_title(loc="left")   # a block step by step


@needs_mpl
def test_compare_draws_both_plans_on_one_scale(tmp_path):
    approx, exact = tiny_resnet("approx", 2), tiny_resnet("exact")
    fig = plot.plan_figure(approx, tmp_path / "plan.png", compare=exact)
    bars = {lab: [] for lab in ("approx 2-bit", "exact")}
    for ax in fig.axes:
        for a in ax.patches:
            gid = a.get_gid() or ""
            if gid.startswith("saved:"):
                bars[gid.split(":")[1]].append(a.get_height())
    for lab, eng in (("approx 2-bit", approx), ("exact", exact)):
        assert sum(bars[lab]) * MIB == pytest.approx(eng.plan.bytes_by_kind()["saved"], rel=1e-9)
        widths = {k: 0.0 for k in eng.plan.bytes_by_kind()}
        for ax in fig.axes:
            for a in ax.patches:
                gid = a.get_gid() or ""
                if gid.startswith(f"total:{lab}:"):
                    widths[gid.split(":")[2]] += a.get_width()
        assert {k: w * MIB for k, w in widths.items()} == pytest.approx(eng.plan.bytes_by_kind(), rel=1e-9)
    saved_axes = [ax for ax in fig.axes if "saved for backward" in ax.get_title(loc="left")]
    assert len(saved_axes) == 2 and saved_axes[0].get_ylim() == saved_axes[1].get_ylim()
    assert max(bars["exact"]) <= saved_axes[0].get_ylim()[1]


@needs_mpl
def test_plan_figure_of_a_builder_network_as_svg(tmp_path):
    net = tiny_graph("max")
    eng = lm.Engine(net, 2, (3, 8, 8), "approx", 1, allocate=False)
    fig = plot.plan_figure(eng, tmp_path / "plan.svg")
    assert "<svg" in (tmp_path / "plan.svg").read_text()
    kept = {what for _, parts in saved_by_step(eng.plan, eng.schedule, eng.unit_bits) for what, _ in parts}
    assert kept == {"1-bit code", "index", "exact"}            # units, the max-pool, rstd / head
    assert len(eng.schedule) <= plot.LONG                       # short: drawn step by step at once
    assert len(fig.axes[0].get_xticklabels()) == len(eng.schedule)


def renamed(eng, names):
    """eng's plan and schedule with its buffers renamed (as an engine assigning them otherwise)."""
    plan = Plan()
    for e in eng.plan.entries:
        plan.add(names.get(e.name, e.name), e.kind, e.shape, e.dtype)
    fields = ("src", "dst", "dout", "dx", "scratch")

    def step(s):
        kw = {f: names.get(getattr(s, f), getattr(s, f)) for f in fields}
        kw["dxs"] = tuple((names.get(b, b), acc) for b, acc in s.dxs)
        if s.layer is not None:            # an op with several inputs names them in its layer
            L = s.layer
            kw["layer"] = dataclasses.replace(L, src=names.get(L.src, L.src), dst=names.get(L.dst, L.dst),
                                              inputs=tuple(names.get(b, b) for b in L.inputs))
        return dataclasses.replace(s, **kw)
    return plan, [step(s) for s in eng.schedule]


@needs_mpl
def test_the_figure_reads_buffers_from_the_plan_not_their_names(tmp_path):
    eng = tiny_resnet()
    names = {"act0": "buf.a", "act1": "buf.b", "res": "buf.c"}
    plan, steps = renamed(eng, names)
    fake = dataclasses.make_dataclass("E", ["plan", "schedule", "unit_bits", "mode", "N", "net", "input_shape"])(
        plan, steps, eng.unit_bits, eng.mode, eng.N, eng.net, eng.input_shape)
    fig = plot.plan_figure(fake, tmp_path / "plan.png")
    labels = {t.get_text().split()[0] for t in fig.axes[0].get_yticklabels()}
    assert {"buf.a", "buf.b", "buf.c"} <= labels and not labels & set(names)
    a, b = buffer_timeline(eng.plan, eng.schedule), buffer_timeline(plan, steps)
    assert [b.state[names.get(r, r)] for r in a.names] == [a.state[r] for r in a.names]


def test_timeline_states_follow_the_step_fields():
    eng = lm.Engine(tiny_graph("avg"), 2, (3, 8, 8), "approx", 4, allocate=False)
    t = buffer_timeline(eng.plan, eng.schedule)
    for s in t.steps:
        if s.phase == "fwd" and s.dst in t.state:
            assert t.state[s.dst][s.index] == ("acc" if s.op == "add" else "write")
            assert t.state[s.src][s.index] in ("read", "write")          # in place: read, then written
        if s.phase == "bwd" and s.dx:
            want = "shared" if s.op == "add" else "acc" if s.accumulate else "write"
            assert t.state[s.dx][s.index] == want
        if s.phase == "bwd" and s.scratch and s.scratch not in (s.dx, s.dout):
            assert t.state[s.scratch][s.index] == "scratch" and t.text[s.scratch][s.index].endswith("~")
    # the kept input: written before step 0, read by the stem conv forward and backward, held between
    stem = [s.index for s in t.steps if s.src == "input"]
    assert t.state["input"][stem[0]] == t.state["input"][stem[-1]] == "read"
    assert set(t.state["input"][stem[0] + 1:stem[-1]]) == {"held"}
    # a buffer is "held" only up to a step that reads it
    for name, states in t.state.items():
        for i, st in enumerate(states):
            if st == "held":
                nxt = next(x for x in states[i + 1:] if x != "held")
                assert nxt in ("read", "acc", "shared"), (name, i)
    adds = [s for s in t.steps if s.op == "add" and s.phase == "bwd"]
    assert t.text[adds[0].dx][adds[0].index] == "∂" + adds[0].name


def test_saved_class_names_what_a_slot_keeps():
    entries = {e.name: e for e in tiny_resnet("approx", 8).plan.entries}
    assert saved_class(entries["layer1.0.bn1.code"], {"layer1.0.bn1": 8}) == "8-bit code"
    assert saved_class(entries["layer1.0.bn1.rstd"], {}) == "exact"
    assert saved_class(entries["loss.probs"], {}) == "exact"
    exact = {e.name: e for e in tiny_resnet("exact").plan.entries}
    assert saved_class(exact["layer1.0.bn1.xhat"], {}) == "float x-hat"


def test_range_codes_are_labelled_codes_of_their_width_not_float_or_exact():
    """A post-activation ResNet at 4 bits keeps each standalone batch norm's x-hat (uint8) and the
    max-pool's output read by a conv as 4-bit range codes with their per-group scale and zero;
    "float x-hat" and "exact" are only what is kept in float."""
    net = lm.models.build_model("resnet", 18, num_classes=10)
    for mode, bits in (("approx", 4), ("approx", 2), ("exact", 4)):
        eng = lm.Engine(net, 2, (3, 32, 32), mode, bits, allocate=False)
        kept = {}
        for _, parts in saved_by_step(eng.plan, eng.schedule, eng.unit_bits, eng.keeper.bits):
            for what, b in parts:
                kept[what] = kept.get(what, 0) + b
        entries = {e.name: e for e in eng.plan.entries}
        floats = sum(e.nbytes for e in eng.plan.entries if e.kind == "saved" and e.dtype.startswith("float")
                     and not e.name.endswith("_scale"))
        assert kept.get("float x-hat", 0) + kept.get("exact", 0) == floats, (mode, bits, kept)
        if mode == "approx":
            assert saved_class(entries["layer1.0.bn2.xhat"], eng.unit_bits, eng.keeper.bits) == f"{bits}-bit range code"
            assert saved_class(entries["maxpool.out_scale"], eng.unit_bits, eng.keeper.bits) == f"{bits}-bit range code"
            assert "float x-hat" not in kept and kept[f"{bits}-bit range code"] > 0
        else:
            assert saved_class(entries["layer1.0.bn2.xhat"], eng.unit_bits, eng.keeper.bits) == "float x-hat"
            assert saved_class(entries["maxpool.out"], eng.unit_bits, eng.keeper.bits) == "exact"
    mobile = lm.Engine(lm.models.build_model("mobilenet", 2, num_classes=10), 2, (3, 32, 32), "approx", 4,
                       allocate=False)
    kept = {w for _, parts in saved_by_step(mobile.plan, mobile.schedule, mobile.unit_bits, mobile.keeper.bits)
            for w, _ in parts}
    assert "region code" in kept and "float x-hat" not in kept


@needs_mpl
def test_every_text_of_the_plan_figure_lies_inside_it(tmp_path):
    """The totals written after the bars ("128.71 MiB (1.00x less than exact)") and the titles
    stay inside the figure, with and without --compare."""
    net = lm.models.build_model("resnet", 18, num_classes=10)
    for compare in (None, lm.Engine(net, 2, (3, 32, 32), "exact", 4, allocate=False)):
        fig = plot.plan_figure(lm.Engine(net, 2, (3, 32, 32), "approx", 4, allocate=False),
                               tmp_path / "plan.png", compare=compare)
        renderer = fig.canvas.get_renderer()
        texts = [fig._suptitle] + [t for ax in fig.axes for t in ax.texts + [ax.title, ax._left_title]]
        for t in texts:
            if t.get_text():
                box = t.get_window_extent(renderer)
                assert -0.5 <= box.x0 and box.x1 <= fig.bbox.width + 0.5, (t.get_text(), box.x1, fig.bbox.width)


def test_a_figure_name_without_png_or_svg_is_refused(tmp_path):
    with pytest.raises(ValueError, match="expected a name ending .png or .svg"):
        plot.plan_figure(tiny_resnet(), tmp_path / "plan.pdf")
    assert not list(tmp_path.iterdir())


def test_missing_matplotlib_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)          # `import matplotlib...` raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for draw in (lambda: plot.plan_figure(tiny_resnet(), tmp_path / "a.png"),
                 lambda: plot.curves_figure([write_run(tmp_path / "r", steps=False)], tmp_path / "b.png")):
        with pytest.raises(plot.PlotUnavailable) as e:
            draw()
        assert str(e.value) == plot.MISSING and "pip install lowmem[plot]" in str(e.value)
        assert isinstance(e.value, ImportError) and isinstance(e.value, ValueError)
    assert not (tmp_path / "a.png").exists() and not (tmp_path / "b.png").exists()


# ---------------------------------------------------------------- curves

def write_run(path, steps=True, planned=123456, mode="approx", bits=4, epochs=2, spe=4):
    """A run folder as `lowmem train` writes it: config.json, plan.txt, metrics.jsonl with epoch
    records (and, with steps, a step record every 2 iterations). planned=None: records without
    planned_bytes (the plan.txt total is then the planned memory)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"mode": mode, "bits": bits, "model": "preact-cifar", "depth": 8}))
    (path / "plan.txt").write_text("summary\n\nname kind\n\nkind  entries  bytes\n"
                                   "total        12        654,321   639.00 KiB\n")
    lines = []
    for ep in range(1, epochs + 1):
        if steps:
            for it in range((ep - 1) * spe + 2, ep * spe + 1, 2):
                lines.append({"event": "step", "iteration": it, "train_loss": 2.0 / it, "train_acc": 0.1 * ep,
                              "lr": 0.1, "images_per_s": 100.0 + it, "time": 0.0})
        rec = {"event": "epoch", "epoch": ep, "iteration": ep * spe, "lr": 0.1, "train_loss": 1.0 / ep,
               "train_acc": 0.2 * ep, "test_loss": 1.5 / ep, "test_acc": 0.15 * ep, "images_per_s": 90.0,
               "train_time_s": 1.0, "eval_time_s": 0.1, "time": 0.0}
        if planned is not None:
            rec["planned_bytes"] = planned
        lines.append(rec)
    lines.append({"event": "stop", "reason": "finished", "iteration": epochs * spe, "time": 0.0})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


@needs_mpl
def test_curves_one_line_per_run_and_quantity_with_planned_memory_in_the_legend(tmp_path):
    a = write_run(tmp_path / "a", steps=True, planned=3 << 20)
    b = write_run(tmp_path / "b", steps=False, planned=None, mode="exact")     # epoch lines only
    fig = plot.curves_figure([a, b], tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    lines = gids(fig, "curve:")
    quantities = ("train_loss", "test_loss", "train_acc", "test_acc", "lr", "images_per_s")
    assert sorted(lines) == sorted(f"curve:{run}:{q}" for run in (a, b) for q in quantities)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [f"{a}: approx 4-bit, preact-cifar-8, 3.00 MiB planned",
                      f"{b}: exact, preact-cifar-8, {fmt_bytes(654321)} planned"]          # b: from plan.txt
    line = {ln.get_gid(): ln for ax in fig.axes for ln in ax.get_lines()}
    assert list(line[f"curve:{a}:train_loss"].get_xdata()) == [2, 4, 6, 8]         # the step records
    assert list(line[f"curve:{b}:train_loss"].get_xdata()) == [4, 8]               # one point an epoch
    assert list(line[f"curve:{a}:test_acc"].get_ydata()) == pytest.approx([0.15, 0.30])


def test_a_folder_without_a_run_is_named(tmp_path):
    with pytest.raises(runcurves.RunError, match="no such run folder"):
        runcurves.read_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(runcurves.RunError, match="holds no metrics.jsonl"):
        runcurves.read_run(tmp_path / "empty")
    (tmp_path / "empty" / "metrics.jsonl").write_text(json.dumps({"event": "stop"}) + "\n")
    with pytest.raises(runcurves.RunError, match="no step or epoch records yet"):
        runcurves.read_run(tmp_path / "empty")


@needs_mpl
def test_the_block_drawn_step_by_step_can_be_chosen(tmp_path):
    fig = plot.plan_figure(tiny_resnet(), tmp_path / "plan.png", block="layer2.0")
    assert "layer2.0" in fig.axes[1].get_title(loc="left")
    ticks = [t.get_text() for t in fig.axes[1].get_xticklabels()]
    assert ticks and all(t.endswith(("bn1", "bn2", "bn3", "conv1", "conv2", "conv3", "shortcut", "add")) for t in ticks)
    with pytest.raises(ValueError, match="block 'layer9.0': no layer"):
        plot.plan_figure(tiny_resnet(), tmp_path / "x.png", block="layer9.0")


# ---------------------------------------------------------------- the commands

def run_cli(argv, capsys):
    from lowmem.tools import cli
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


TINY_PLAN = ["plan", "--depth", "11", "--batch", "2", "--input", "3x8x8", "--classes", "3", "--no-schedule"]


@needs_mpl
def test_lowmem_plan_figure_writes_the_picture(tmp_path, capsys):
    code, out, err = run_cli(TINY_PLAN + ["--compare", "--figure", str(tmp_path / "plan.svg")], capsys)
    assert code == 0 and err == "" and f"figure: {tmp_path / 'plan.svg'}" in out
    text = (tmp_path / "plan.svg").read_text()
    assert "<svg" in text and "approx 4-bit" in text and "exact" in text


@needs_mpl
def test_lowmem_plot_draws_old_and_new_run_folders(tmp_path, capsys):
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b", steps=False)
    code, out, err = run_cli(["plot", str(a), str(b), "--out", str(tmp_path / "c.png")], capsys)
    assert code == 0 and err == "" and (tmp_path / "c.png").stat().st_size > 0


def test_lowmem_plot_given_the_metrics_file_names_its_folder(tmp_path, capsys):
    a = write_run(tmp_path / "a")
    code, out, err = run_cli(["plot", str(a / "metrics.jsonl"), "--out", str(tmp_path / "c.png")], capsys)
    assert code == 1 and err == (f"lowmem plot: error: {a / 'metrics.jsonl'} is a file, not a run folder: "
                                 f"give the folder that holds metrics.jsonl ({a})\n")


def test_lowmem_plot_names_a_folder_without_a_run_exit_1(tmp_path, capsys):
    a = write_run(tmp_path / "a")
    code, out, err = run_cli(["plot", str(a), str(tmp_path / "nope"), "--out", str(tmp_path / "c.png")], capsys)
    assert (code, err) == (1, f"lowmem plot: error: {tmp_path / 'nope'}: no such run folder\n")
    assert not (tmp_path / "c.png").exists()


def test_a_figure_name_without_its_format_is_a_usage_error(tmp_path, capsys):
    code, out, err = run_cli(TINY_PLAN + ["--figure", str(tmp_path / "plan.jpg")], capsys)
    assert code == 2 and err.count("\n") == 1 and "expected a name ending .png or .svg" in err and out == ""


def test_commands_without_matplotlib_say_so_in_one_line_exit_2(tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    a = write_run(tmp_path / "a")
    for argv in (TINY_PLAN + ["--figure", str(tmp_path / "p.png")], ["plot", str(a), "--out", str(tmp_path / "c.png")]):
        code, out, err = run_cli(argv, capsys)
        assert (code, err) == (2, f"lowmem {argv[0]}: error: {plot.MISSING}\n") and out == ""
        assert "pip install lowmem[plot]" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_train_log_every_option():
    from lowmem.tools import cli
    from lowmem.tools.commands.train import config_from_args
    argv = ["train", "--dataset", "synthetic", "--out", "runs/x"]
    assert config_from_args(cli.make_parser().parse_args(argv + ["--log-every", "5"])).log_every == 5
    assert config_from_args(cli.make_parser().parse_args(argv)).log_every == 20


@pytest.mark.parametrize("junk", [b"5\n", b"null\n", b'{"event": "step", "iteration": "40"}\n',
                                  b'{"event": "epoch", "iteration": true, "epoch": "x"}\n', b"\xff\n",
                                  b'{"event": "epoch", "epoch": 1, "iteration": 4, "train_loss": "0.1"}\n'])
def test_lines_of_metrics_that_are_no_records_are_skipped(tmp_path, junk):
    a = write_run(tmp_path / "a")
    with open(a / "metrics.jsonl", "ab") as f:
        f.write(junk)
    run = runcurves.read_run(a)
    assert run.series("train_loss")[0] == [2, 4, 6, 8] and run.series("test_acc")[0] == [4, 8]
    assert run.label == f"{a}: approx 4-bit, preact-cifar-8, {fmt_bytes(123456)} planned"


@pytest.mark.parametrize("config", [b"null", b"[1, 2]", b"\xff", b'{"mode": "approx", "bits": {"a": 2}, '
                                                                  b'"avg_bits": "two", "model": 5}'])
def test_a_config_that_is_no_settings_object_labels_what_it_can(tmp_path, config):
    a = write_run(tmp_path / "a")
    (a / "config.json").write_bytes(config)
    run = runcurves.read_run(a)
    assert run.label.startswith(f"{a}: ") and run.label.endswith("planned")


def test_a_run_from_an_onnx_file_is_labelled_by_the_file_not_a_depth(tmp_path):
    a = write_run(tmp_path / "a")
    (a / "config.json").write_text(json.dumps({"mode": "exact", "model": "models/net.onnx", "depth": 20}))
    assert runcurves.read_run(a).label == f"{a}: exact, net.onnx, {fmt_bytes(123456)} planned"


@pytest.mark.parametrize("where", ["a folder", "no folder", "under a file"])
def test_a_figure_path_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys, monkeypatch, where):
    """plan --figure and plot --out check the file's folder first: one line, nothing computed."""
    (tmp_path / "dir.png").mkdir()
    (tmp_path / "file").write_text("x")
    path = {"a folder": tmp_path / "dir.png", "no folder": tmp_path / "missing" / "x.png",
            "under a file": tmp_path / "file" / "x.png"}[where]
    words = {"a folder": "is a folder", "no folder": "no such folder", "under a file": "is not a folder"}[where]
    import lowmem.tools.commands.plan as plan_command
    monkeypatch.setattr(plan_command, "build_network", lambda args: pytest.fail("the plan was computed"))
    code, out, err = run_cli(TINY_PLAN + ["--figure", str(path)], capsys)
    assert code == 2 and err.count("\n") == 1 and words in err and "Traceback" not in err and out == "", err
    run = write_run(tmp_path / "run")
    code, out, err = run_cli(["plot", str(run), "--out", str(path)], capsys)
    assert code == 2 and err.count("\n") == 1 and words in err and ".tmp-" not in err, err
