"""benchmarks/accuracy.py: the study trains what a user trains, survives being stopped, and
writes only its own section of a shared page. Nothing is timed."""
import argparse
import dataclasses
import json
import os
import sys

import pytest

from lowmem.tools.commands import train as train_command
from lowmem.train.trainer import Trainer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import accuracy                                                  # noqa: E402

USER = ("--dataset fashion-mnist --pad-to 0 --depth 20 --batch 128 --epochs 5 --schedule cosine "
        "--seed {seed} --out {out}")
FLAGS = {"exact": "--mode exact", "approx2u": "--mode approx --bits 2 --rounding stochastic",
         "approx4u": "--mode approx --bits 4 --rounding stochastic",
         "approx2d": "--mode approx --bits 2 --rounding dither", "approx4d": "--mode approx --bits 4 --rounding dither"}


@pytest.mark.parametrize("mode", sorted(FLAGS))
def test_the_default_study_is_the_users_command(mode):
    args = accuracy.parse_args([])
    assert (args.limit_train, args.limit_test, args.seeds) == (None, None, "0,1,2")     # the whole data, 3 seeds
    # per seed exact, 2-bit unbiased, 2-bit dithered, 4-bit unbiased; then 4-bit dithered for every seed
    assert [p.split(",") for p in args.modes.split("/")] == [["exact", "approx2u", "approx2d", "approx4u"], ["approx4d"]]
    p = argparse.ArgumentParser()
    train_command.add_arguments(p)
    for seed in (0, 2):
        user = train_command.config_from_args(p.parse_args((USER.format(seed=seed, out="r") + " "
                                                            + FLAGS[mode]).split()))
        ours = accuracy.config_for(args, accuracy.parse_mode(mode), seed, out="r")
        differ = {f.name for f in dataclasses.fields(user) if getattr(user, f.name) != getattr(ours, f.name)}
        # only where the data are read from and what is shown while training
        assert differ <= {"download", "progress"}, {k: (getattr(user, k), getattr(ours, k)) for k in differ}


def faked(monkeypatch, accuracies):
    """accuracy.train_run replaced by a record of one epoch at accuracies[(label, seed)] (else
    0.9); returns the list of the (label, seed) trained."""
    trained = []

    def fake_run(args, data, spec, seed, **kw):
        trained.append((accuracy.label(spec), seed))
        acc = accuracies.get((accuracy.label(spec), seed), 0.9)
        return {"final_test_acc": acc, "seconds": 1.0,
                "history": [{"epoch": 1, "iteration": 4, "train_loss": 1.0, "train_acc": 0.5, "test_loss": 1.0,
                             "test_acc": acc, "train_time_s": 0.5, "eval_time_s": 0.5}]}
    monkeypatch.setattr(accuracy, "train_run", fake_run)
    return trained


def test_the_study_runs_phase_by_phase_and_never_repeats_a_finished_run(tmp_path, monkeypatch):
    """Each phase seed by seed, a later phase after every seed of the earlier ones; a run already in
    results.json is not trained again, whatever the order it was finished in."""
    trained = faked(monkeypatch, {})
    argv = ["--depth", "8", "--limit-train", "64", "--limit-test", "32", "--batch", "32", "--epochs", "1",
            "--seeds", "0,1", "--modes", "exact,approx2u,approx4u/approx2d", "--checkpoints", "0",
            "--out", str(tmp_path / "r"), "--doc", str(tmp_path / "page.md")]
    assert accuracy.main(argv) == 0
    assert trained == [("exact", 0), ("approx 2-bit unbiased", 0), ("approx 4-bit unbiased", 0),
                       ("exact", 1), ("approx 2-bit unbiased", 1), ("approx 4-bit unbiased", 1),
                       ("approx 2-bit dithered", 0), ("approx 2-bit dithered", 1)]
    done = json.loads((tmp_path / "r" / "results.json").read_text())
    # a results file that lacks a middle run and a later phase's: only those are trained
    del done["runs"]["approx 2-bit unbiased|1"], done["runs"]["approx 2-bit dithered|0"]
    (tmp_path / "r" / "results.json").write_text(json.dumps(done))
    trained.clear()
    assert accuracy.main(argv) == 0
    assert trained == [("approx 2-bit unbiased", 1), ("approx 2-bit dithered", 0)]
    trained.clear()
    assert accuracy.main(argv) == 0 and trained == []


def test_the_report_pairs_what_has_finished_and_the_headline_waits_for_three_seeds(tmp_path, monkeypatch):
    """Each row over its mode's finished seeds, each difference over the seeds both have; the
    headline page is left alone until a mode has 3 seeds paired with exact, then gets its section
    after its "## Accuracy" heading, the rest of the page kept."""
    acc = {("exact", 0): 0.91, ("exact", 1): 0.92, ("exact", 2): 0.915,
           ("approx 2-bit unbiased", 0): 0.905, ("approx 2-bit unbiased", 1): 0.912,
           ("approx 2-bit unbiased", 2): 0.909, ("approx 2-bit dithered", 0): 0.907,
           ("approx 2-bit dithered", 1): 0.915, ("approx 2-bit dithered", 2): 0.91}
    faked(monkeypatch, acc)
    page, head = tmp_path / "page.md", tmp_path / "results.md"
    head_text = "# Results\n\n## Accuracy\n\nthe older study\n\n## Memory\n\nx\n"
    head.write_text(head_text)
    argv = ["--depth", "8", "--limit-train", "64", "--limit-test", "32", "--batch", "32", "--epochs", "1",
            "--modes", "exact,approx2u/approx2d", "--checkpoints", "0", "--out", str(tmp_path / "r"),
            "--doc", str(page), "--section", "full", "--headline", str(head)]
    assert accuracy.main(argv + ["--seeds", "0,1"]) == 0
    text = page.read_text()
    assert "| approx 2-bit unbiased | 2.1241 | 2 | 90.85% |" in text and "| −0.65 ± 0.15 pp |" not in text
    assert "| -0.65 ± 0.15 pp | [-2.56, +1.26] | 0: 90.50, 1: 91.20 |" in text       # (−0.5, −0.8) pp
    assert "| approx 2-bit dithered − approx 2-bit unbiased | 2 | +0.25 ± 0.05 pp | [-0.39, +0.89] |" in text
    assert head.read_text() == head_text                                        # 2 seeds: not yet
    results = json.loads((tmp_path / "r" / "results.json").read_text())
    del results["runs"]["approx 2-bit dithered|1"]                             # one seed of it lost
    (tmp_path / "r" / "results.json").write_text(json.dumps(results))
    stored, files = (tmp_path / "r" / "results.json").read_bytes(), sorted(os.walk(tmp_path / "r"))
    assert accuracy.main(argv + ["--seeds", "0,1,2", "--report-only"]) == 0
    assert (tmp_path / "r" / "results.json").read_bytes() == stored                # --report-only writes no run
    assert sorted(os.walk(tmp_path / "r")) == files
    text = page.read_text()
    assert "| approx 2-bit dithered | 2.1249 | 1 | 90.70% | — |" in text
    assert "| -0.30 pp (one seed) | — | 0: 90.70 |" in text
    assert "stretch (at least −0.3 pp and the interval's lower end at least −0.8): not resolved (one seed)" in text
    assert "nan" not in text
    assert head.read_text() == head_text                                        # exact 0-1 only: not yet
    assert accuracy.main(argv + ["--seeds", "0,1,2"]) == 0                      # exact, 2u seed 2; 2d seeds 1, 2
    got = head.read_text()
    assert got.startswith("# Results\n\n## Accuracy\n\n<!-- benchmarks/accuracy.py section full-headline: begin")
    assert got.endswith("full-headline: end -->\n\nthe older study\n\n## Memory\n\nx\n")
    assert "| approx 2-bit unbiased | 2.1241 | 3 | 90.87% | -0.63 ± 0.09 pp | [-1.01, -0.25] |" in got
    assert "| approx 2-bit dithered | 2.1249 | 3 | 91.07% | -0.43 ± 0.07 pp | [-0.72, -0.15] |" in got
    assert "| exact | 32 | 3 | 91.50% | — | — |" in got
    assert "32 test images" in got and "whole test split" not in got and "([page.md](page.md) has" in got
    assert "dithered − approx 2-bit unbiased per seed: +0.20 ± 0.06 pp, 95% interval [-0.05, +0.45] (3 seeds)" in got
    assert accuracy.main(argv + ["--seeds", "0,1,2", "--report-only"]) == 0
    assert head.read_text() == got                                               # rewritten in place


def test_a_partial_report_says_so_far_and_dashes_an_undefined_bias(tmp_path, monkeypatch):
    """A target judged on fewer seeds than the study has says "so far"; a checkpoint where ||E g||
    is not resolved (bias ratio nan) shows a dash and why; the page may go into a new folder."""
    faked(monkeypatch, {("exact", 0): 0.91, ("approx 4-bit unbiased", 0): 0.912})
    out, page = tmp_path / "r", tmp_path / "new" / "page.md"
    argv = ["--depth", "8", "--limit-train", "64", "--limit-test", "32", "--batch", "32", "--epochs", "1",
            "--modes", "exact,approx4u", "--checkpoints", "0", "--out", str(out), "--doc", str(page)]
    assert accuracy.main(argv + ["--seeds", "0"]) == 0
    results = json.loads((out / "results.json").read_text())
    mode = {"error_norm": [0.1], "median_ratio": 0.14, "worst_ratio": 0.65, "worst_tensor": "w",
            "median_rel_error": 0.1, "bias_ratio": float("nan"), "draw_noise_ratio": 0.172}
    results["noise"] = [{"names": ["w"], "noise_norm": [1.0], "grad_norm": [1.0], "iteration": 4, "epoch": 1.0,
                         "seconds": 1.0, "modes": {"approx 4-bit unbiased": mode}}]
    (out / "results.json").write_text(json.dumps(results))
    (tmp_path / "new").rename(tmp_path / "gone")
    assert accuracy.main(argv + ["--seeds", "0,1,2", "--report-only"]) == 0
    text = page.read_text()
    assert "* approx 4-bit unbiased: paired mean at least −0.2 pp: met so far (+0.20 pp (one seed), 95% " \
           "interval —, 1 of 3 seeds)" in text
    assert "| 4 | 1.00 | 0.14 / 0.65 / 0.1 / — / 0.172 |" in text and "nan" not in text
    assert "— in the bias column: at that checkpoint ‖E g‖ is not resolved" in text


def test_the_results_page_keeps_its_older_headline_under_a_heading_of_its_own():
    """The full study's headline goes right after docs/results.md's "## Accuracy" heading: the text
    there must open with its own heading, or the new section's heading would claim it."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "results.md")
    lines = open(path).read().split("\n")
    after = [line for line in lines[lines.index(accuracy.HEADLINE_ANCHOR) + 1:] if line.strip()]
    assert after[0].startswith("### ") or after[0].startswith(accuracy.MARK), after[0]


def test_a_section_replaces_only_its_part(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\nintro\n\n## Older study\n\nits text\n")
    accuracy.place_section(str(page), "full", "## New\n\nfirst\n")
    accuracy.place_section(str(page), "other", "## Other\n\nx\n")
    accuracy.place_section(str(page), "full", "## New\n\nsecond\n")
    text = page.read_text()
    assert text.startswith("# Title\n\nintro\n\n<!-- benchmarks/accuracy.py section other: begin")
    assert "second" in text and "first" not in text and text.count("## New") == 1
    assert text.index("## Other") < text.index("## New") < text.index("## Older study")
    assert text.endswith("second\n<!-- benchmarks/accuracy.py section full: end -->\n\n## Older study\n\nits text\n")
    begin, end = accuracy.section_markers("full")
    page.write_text(f"# Title\n\n{begin}\nhalf\n")
    with pytest.raises(SystemExit, match="one marker"):
        accuracy.place_section(str(page), "full", "x\n")


TINY = ("--depth 8 --limit-train 256 --limit-test 128 --batch 64 --epochs 2 --seeds 0 --modes exact,approx2u "
        "--checkpoints 3 --noise-batches 2 --noise-modes approx2u").split()


@pytest.mark.slow
def test_a_stopped_study_continues_to_the_same_numbers(tmp_path, monkeypatch):
    def study(out, *extra):
        return accuracy.main(TINY + ["--out", str(out), "--doc", str(tmp_path / "page.md"), *extra])
    assert study(tmp_path / "a") == 0
    # stop the first run in its first epoch, between two noise checkpoints (as SIGTERM does: a checkpoint)
    plain = accuracy.train_run

    def stopping(args, data, spec, seed, on_step=None, **kw):
        def step(trainer, loss):
            on_step(trainer, loss)
            if trainer.iteration == 3:
                trainer.request_stop()
        return plain(args, data, spec, seed, on_step=step, **kw)
    monkeypatch.setattr(accuracy, "train_run", stopping)
    assert study(tmp_path / "b") == 130
    partial = json.loads((tmp_path / "b" / "results.json").read_text())
    assert partial["runs"] == {} and [r["iteration"] for r in partial["noise_partial"]] == [0]
    monkeypatch.setattr(accuracy, "train_run", plain)
    assert study(tmp_path / "b") == 0
    a, b = (json.loads((tmp_path / d / "results.json").read_text()) for d in "ab")
    assert set(a["runs"]) == set(b["runs"]) == {"exact|0", "approx 2-bit unbiased|0"}
    for key in a["runs"]:
        for ha, hb in zip(a["runs"][key]["history"], b["runs"][key]["history"], strict=True):
            assert (ha["test_acc"], ha["test_loss"], ha["train_loss"]) == (hb["test_acc"], hb["test_loss"], hb["train_loss"])
    assert a["noise"] == [dict(r, seconds=a["noise"][i]["seconds"]) for i, r in enumerate(b["noise"])]
    assert "noise_partial" not in b
    kept = sorted(os.listdir(tmp_path / "b" / "runs" / "exact-seed0"))
    assert {"epoch1.ckpt", "epoch2.ckpt", "checkpoint.ckpt"} <= set(kept)
    # a third call trains nothing and writes the same page
    page = (tmp_path / "page.md").read_text()
    monkeypatch.setattr(Trainer, "fit", lambda self: pytest.fail("a finished run was trained again"))
    assert study(tmp_path / "b", "--report-only") == 0
    assert (tmp_path / "page.md").read_text() == page.replace("--out " + str(tmp_path / "a"), "--out " + str(tmp_path / "b"))
