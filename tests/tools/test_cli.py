"""The `lowmem` command line, run in-process: main([...]) returns the exit
status and prints to stdout/stderr (captured with capsys); `python -m lowmem`
and the console script in subprocesses."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lowmem.tools import cli
from lowmem import models

SMALL = ["--depth", "8", "--batch", "4", "--input", "3x16x16"]


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_prints_schedule_plan_and_totals(capsys):
    rc, out, err = run(capsys, "plan", *SMALL, "--mode", "approx", "--bits", "2")
    assert rc == 0, err
    assert "preact-resnet8-cifar" in out and "mode approx 2-bit" in out
    assert "step dir  op" in out and "bwd  bnrelu" in out            # the schedule
    assert "memory plan:" in out and ".code" in out and "uint8" in out
    for kind in ("params", "grads", "buffers", "saved", "workspace", "total"):
        assert re.search(rf"^{kind}\s+\d+\s+[\d,]+", out, re.M), kind  # totals by kind
    assert "MB per sample" in out


def test_plan_summarises_a_long_schedule(capsys):
    rc, out, _ = run(capsys, "plan", "--depth", "164", "--batch", "128", "--rows", "5")
    assert rc == 0
    assert re.search(r"\.\.\. \d+ steps \.\.\.", out)
    assert "smaller entries not shown" in out
    assert len(out.splitlines()) < 120


def compare_row(out, kind):
    m = re.search(rf"^{kind}\s+\S+ \S+\s+\S+ \S+\s+([\d.]+)", out, re.M)
    assert m, f"no {kind} row in:\n{out}"
    return float(m.group(1))


def test_plan_compare(capsys):
    rc, out, _ = run(capsys, "plan", *SMALL, "--compare", "--no-schedule")
    assert rc == 0
    assert "approx 4-bit/exact" in out
    saved, total = compare_row(out, "saved"), compare_row(out, "total")
    assert 0.12 < saved < 0.135 and saved < total < 1          # codes: 1/8 of float32
    assert compare_row(out, "params") == 1.0
    assert "saved per sample, exact:" in out and "saved per sample, approx 4-bit:" in out


def test_plan_compare_from_exact_compares_with_approx(capsys):
    rc, out, _ = run(capsys, "plan", *SMALL, "--mode", "exact", "--bits", "8", "--compare", "--no-schedule")
    assert rc == 0
    assert "approx 8-bit/exact" in out
    assert 0.24 < compare_row(out, "saved") < 0.26


def test_plan_imagenet_model(capsys):
    rc, out, _ = run(capsys, "plan", "--model", "preact-imagenet", "--depth", "18", "--input", "3x64x64",
                     "--classes", "5", "--batch", "2", "--no-schedule", "--rows", "1000")
    assert rc == 0
    assert "preact-resnet18-imagenet" in out and "input 3x64x64" in out
    assert re.search(r"^maxpool\.argmax\s+saved\s+\(\d+,\)\s+uint8", out, re.M)
    assert re.search(r"^fc\.weight\s+params\s+\(5, 512\)", out, re.M)


def test_plan_measure(capsys):
    rc, out, _ = run(capsys, "plan", *SMALL, "--no-schedule", "--measure")
    assert rc == 0
    assert "measured (tracemalloc, 2 training steps" in out
    ratio = float(re.search(r"steady-state peak / plan = ([\d.]+)", out).group(1))
    assert 0.95 < ratio < 1.5        # a tiny net: fixed-size scratch weighs more than at real sizes


def test_diagnose_tiny(capsys):
    rc, out, err = run(capsys, "diagnose", "--depth", "8", "--batch", "4", "--input", "3x8x8",
                       "--batches", "2", "--warmup", "1", "--bits", "2", "--seed", "3")
    assert rc == 0, err
    assert "warm-up: 1 exact SGD steps" in out
    assert re.search(r"^layer1\.0\.conv1\.weight\s+\(8, 16, 3, 3\)|^layer1\.0\.conv1\.weight", out, re.M)
    assert "2-bit, " in out
    for mode in ("approx", "naive"):
        assert re.search(rf"^{mode}\s+relative error: median [\d.e+-]+.*error/noise: median", out, re.M), mode


def test_diagnose_summary_only(capsys):
    rc, out, _ = run(capsys, "diagnose", "--depth", "8", "--batch", "2", "--input", "3x8x8",
                     "--batches", "2", "--no-table")
    assert rc == 0
    assert not re.search(r"^parameter\s+shape", out, re.M) and "error/noise" in out


@pytest.mark.parametrize("argv, words", [
    (["plan", "--bits", "3"], "invalid choice: 3"),
    (["plan", "--mode", "fast"], "invalid choice: 'fast'"),
    (["plan", "--model", "vgg"], "unknown model 'vgg'"),
    (["plan", "--dtype", "float16"], "invalid choice: 'float16'"),
    (["plan", "--input", "3x32"], "expected CxHxW"),
    (["plan", "--batch", "0"], "expected a positive integer"),
    (["plan", "--depth", "21"], "unsupported depth 21"),
    (["plan", "--model", "preact-imagenet", "--depth", "20", "--no-schedule"], "unsupported depth 20"),
    (["plan", "--input", "3x0x8"], "expected CxHxW"),
    (["plan", "--input", "1x32x32", "--depth", "8", "--classes", "0"], "expected a positive integer"),
    (["diagnose", "--batches", "1"], "--batches must be at least 2"),
    (["diagnose", "--warmup", "-1"], "non-negative"),
    (["diagnose", "--bits", "16"], "invalid choice: 16"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_bad_arguments_are_usage_errors(capsys, argv, words):
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    assert words in err, err


def test_no_command_prints_help(capsys):
    rc, out, _ = run(capsys)
    assert rc == 2 and "plan" in out and "diagnose" in out


def test_help_exits_zero(capsys):
    rc, out, _ = run(capsys, "plan", "--help")
    assert rc == 0 and "--compare" in out and "--measure" in out


def test_version_is_printed(capsys):
    from lowmem import __version__
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and out.strip() == f"lowmem {__version__}"


def test_a_reader_that_stops_early_ends_the_command_quietly():
    """`lowmem plan | head -1`: the reader took what it wanted; exit 0, nothing on stderr."""
    p = subprocess.Popen([sys.executable, "-m", "lowmem", "plan", "--depth", "164", "--rows", "500"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=120) == 0 and err == b"", err


def test_registry():
    assert {"plan", "diagnose"} <= set(cli.COMMANDS)
    with pytest.raises(ValueError, match="registered twice"):
        cli.register("plan", "again", lambda p: None, lambda a: 0)


def test_module_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "lowmem.tools.cli", "plan", *SMALL, "--no-schedule", "--rows", "3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "memory plan:" in r.stdout


def console_script():
    """The installed `lowmem` script beside this interpreter (or on PATH)."""
    here = Path(sys.executable).with_name("lowmem")
    return str(here) if here.exists() else shutil.which("lowmem")


@pytest.mark.skipif(console_script() is None, reason="the lowmem console script is not installed")
@pytest.mark.parametrize("argv, code, words", [
    (["plan", *SMALL, "--no-schedule", "--rows", "3"], 0, "memory plan:"),
    (["plan", "--bits", "3"], 2, "invalid choice: 3"),                  # a usage error
    ([], 2, "usage: lowmem"),                                          # no command: the help
])
def test_python_m_lowmem_is_the_lowmem_script(argv, code, words):
    env = dict(os.environ, COLUMNS="100")
    module, script = (subprocess.run(cmd + argv, capture_output=True, text=True, timeout=120, env=env)
                      for cmd in ([sys.executable, "-m", "lowmem"], [console_script()]))
    assert module.returncode == script.returncode == code, module.stderr
    assert module.stdout == script.stdout and module.stderr == script.stderr
    assert words in module.stdout + module.stderr


# ---- one model registry, used by every command ------------------------------------------

@pytest.mark.parametrize("command", ["plan", "diagnose", "train", "maxbatch"])
def test_every_command_offers_the_registry_models(capsys, command):
    rc, out, _ = run(capsys, command, "--help")
    assert rc == 0
    text = " ".join(out[out.index("--model MODEL"):].split())          # the --model help, unwrapped
    for name in models.MODELS:                                          # every family, wrn-K for wrn-*
        assert (("wrn-K" if name.startswith("wrn-") else name) + " |") in text or (
            name.startswith("wrn-") and "wrn-K (K: the widening factor" in text), name


def test_train_builds_its_model_from_the_registry(capsys, tmp_path):
    # the trainer knew only preact-cifar; an ImageNet depth rule now reaches it
    rc, _, err = run(capsys, "train", "--model", "preact-imagenet", "--depth", "20", "--dataset", "synthetic",
                     "--limit-train", "32", "--batch", "16", "--out", str(tmp_path / "run"), "--no-progress")
    assert rc == 2 and "unsupported depth 20 for preact_resnet_imagenet" in err
    assert not (tmp_path / "run").exists()                      # refused before anything was written


# ---- every bad command line: one line, exit 2 ---------------------------------------------

TRAIN = ["train", "--dataset", "synthetic", "--limit-train", "32", "--limit-test", "8", "--depth", "8",
         "--batch", "16", "--epochs", "1", "--no-progress"]


@pytest.mark.parametrize("argv, words", [
    (["diagnose", "--classes", "1", "--depth", "8", "--batch", "4", "--input", "3x8x8", "--batches", "2"],
     "expected at least 2 classes"),
    (["diagnose", "--lr", "nan", "--warmup", "1", "--depth", "8", "--batch", "4", "--input", "3x8x8"],
     "argument --lr: expected a finite number, got 'nan'"),
    (["plan", "--input", "3x65536x65536", "--measure", "--no-schedule", "--rows", "1"],
     "of host memory is available"),
    (["maxbatch", "--budget", "100TiB", "--verify"], "of host memory is available"),
    (["plan", "--classes", "1"], "expected at least 2 classes"),
    (TRAIN + ["--momentum", "nan"], "argument --momentum: expected a finite number"),
    (TRAIN + ["--momentum", "1"], "expected a momentum in [0, 1)"),
    (TRAIN + ["--lr", "inf"], "argument --lr: expected a finite number"),
    (TRAIN + ["--lr", "0"], "argument --lr: expected a positive number"),
    (TRAIN + ["--weight-decay", "-1"], "expected a number >= 0"),
    (TRAIN + ["--batch", "0"], "argument --batch: expected a positive integer"),
    (TRAIN + ["--epochs", "-2"], "argument --epochs: expected a positive integer"),
    (TRAIN + ["--time-limit", "nan"], "argument --time-limit: expected a finite number"),
    (TRAIN + ["--out", ""], "argument --out: expected a folder name"),
    (TRAIN, "the following arguments are required: --out"),
    (TRAIN + ["--out", "OUT", "--resume", "--overwrite"], "not allowed with argument"),
    (TRAIN + ["--out", "OUT", "--depth", "21"], "unsupported depth 21"),
    (TRAIN + ["--out", "OUT", "--batch", "64"], "--limit-train 32: expected at least --batch 64 images"),
    (TRAIN + ["--out", "OUT", "--seed", "99999999999999999999999"],
     "argument --seed: expected an integer in [0, 2**64), got '99999999999999999999999'"),
    (["diagnose", "--seed", str(2 ** 64)], "argument --seed: expected an integer in [0, 2**64)"),
    (["maxbatch", "--budget", "-1MiB"], "argument --budget: '-1MiB': the budget must be at least 1 byte"),
    (["plan", "--bits", "auto", "--budget", "-2GiB"], "argument --budget: '-2GiB': the budget must be"),
    (["plan", "--depth", "-3"], "argument --depth: expected a positive integer, got '-3'"),
])
def test_bad_command_lines_end_in_one_line_and_exit_2(capsys, tmp_path, argv, words):
    argv = [str(tmp_path / "run") if a == "OUT" else a for a in argv]
    rc, out, err = run(capsys, *argv)
    assert rc == 2, (out, err)
    assert words in err.strip().splitlines()[-1], err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()                      # nothing was written


def test_fashion_mnist_pad_to_with_a_small_limit_is_refused_before_loading(capsys, tmp_path, monkeypatch):
    # the limit is checked before any image is padded (it padded all 60,000 to 1000x1000 first)
    from lowmem.data import datasets as data
    monkeypatch.setattr(data, "load_fashion_mnist", lambda *a, **k: pytest.fail("data were loaded"))
    rc, _, err = run(capsys, "train", "--dataset", "fashion-mnist", "--pad-to", "1000", "--limit-train", "16",
                     "--out", str(tmp_path / "run"))
    assert rc == 2 and "--limit-train 16: expected at least --batch 128" in err


def test_maxbatch_says_when_the_search_cap_bound_the_batch(capsys):
    rc, out, _ = run(capsys, "maxbatch", "--depth", "8", "--input", "3x8x8", "--budget", "10TiB")
    assert rc == 0
    assert "largest batch searched 16,777,216 = 2^24, the search's cap, not the budget" in out
    assert "would plan" not in out
    rc, out, _ = run(capsys, "maxbatch", "--depth", "8", "--input", "3x8x8", "--budget", "2MiB")
    assert rc == 0 and "cap" not in out and re.search(r"largest batch \d+ \(batch \d+ would plan", out)


def test_ctrl_c_in_any_command_exits_130_with_a_message(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setitem(cli.COMMANDS, "plan", cli.COMMANDS["plan"][:2] + (interrupted,))
    rc, _, err = run(capsys, "plan")
    assert rc == 130 and err.strip() == "lowmem plan: error: interrupted"


# ---- --model wrn-K for any positive K ----------------------------------------------------

def test_model_wrn_k_takes_any_positive_widening_factor(capsys):
    from lowmem import models
    from lowmem.train.config import TrainConfig
    rc, out, err = run(capsys, "plan", "--model", "wrn-3", "--depth", "10", "--input", "3x8x8", "--batch", "2",
                       "--no-schedule")
    assert rc == 0, err
    assert "wrn-10-3" in out
    assert models.build_model("wrn-3", 10).num_params() == models.wide_resnet(10, 3).num_params()
    TrainConfig(model="wrn-6", depth=10, dataset="synthetic")                       # accepted
    for bad in ("wrn-0", "wrn--1", "wrn-x", "wrn-", "wrn-03", "resnetx"):
        rc, out, err = run(capsys, "plan", "--model", bad, "--depth", "10")
        assert rc == 2 and "Traceback" not in err, bad
        last = err.strip().splitlines()[-1]
        assert f"unknown model {bad!r}" in last and "wrn-K with K a positive integer" in last, last


def test_train_flags_are_named_from_the_config_fields():
    """`lowmem train`'s flag of a TrainConfig field is commands.train.flag_of(field), for every field, and a
    refusal in field words reads in flag words in any process: the table is not filled in by
    add_arguments (a fresh process that built no parser translated only a few fields)."""
    import argparse
    import dataclasses
    from lowmem.tools.commands import train
    from lowmem.train.config import TrainConfig
    code = ("from lowmem.tools.commands import train; "
            "print(train.in_flags(\"warmup_iters='x': expected an integer >= 0 or None\"))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "--warmup-iters x: expected an integer >= 0 or None", r
    before = dict(train.FLAG_OF)
    text = train.add_arguments(argparse.ArgumentParser()).format_help()
    assert train.FLAG_OF == before
    for field in (f.name for f in dataclasses.fields(TrainConfig)):
        assert re.search(rf"(?<![\w-]){re.escape(train.flag_of(field))}\b", text), field
