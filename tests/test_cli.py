"""The `lowmem` command line, run in-process: main([...]) returns the exit
status and prints to stdout/stderr (captured with capsys)."""
import re
import subprocess
import sys

import pytest

from lowmem import cli

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
    (["plan", "--model", "vgg"], "invalid choice: 'vgg'"),
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


def test_registry():
    assert {"plan", "diagnose"} <= set(cli.COMMANDS)
    with pytest.raises(ValueError, match="registered twice"):
        cli.register("plan", "again", lambda p: None, lambda a: 0)


def test_module_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "lowmem.cli", "plan", *SMALL, "--no-schedule", "--rows", "3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "memory plan:" in r.stdout
