"""--bits auto on the command line: lowmem plan, train and maxbatch print the allocation table and
fit their budgets; bad combinations end in one line and exit 2."""
import json
import re

import pytest

from lowmem import Engine
from lowmem.tools import cli
from lowmem.tools.maxbatch import parse_bytes
from lowmem.models import preact_resnet_cifar

SMALL = ["--depth", "8", "--batch", "8", "--input", "3x8x8", "--measure-batch", "8", "--measure-batches", "2"]


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def table_rows(out):
    """{unit: (K, bytes)} from the allocation table."""
    rows = re.findall(r"^(\S+)\s+\((\d+), (\d+), (\d+)\)\s+(\S+)\s+([\d,]+)\s+\S+$", out, re.M)
    return {r[0]: (r[4], int(r[5].replace(",", ""))) for r in rows}


def saved_code_bytes(out):
    return int(re.search(r"^total\s+\S+\s+([\d,]+)", out, re.M).group(1).replace(",", ""))


def test_plan_auto_avg_bits_saves_no_more_than_uniform(capsys):
    rc, out, err = run(capsys, "plan", *SMALL, "--bits", "auto", "--avg-bits", "2", "--no-schedule")
    assert rc == 0, err
    rows = table_rows(out)
    units = [L.name for L in preact_resnet_cifar(8).layers if L.op == "bnrelu"]
    assert list(rows) == units
    uniform = Engine(preact_resnet_cifar(8), 8, (3, 8, 8), "approx", 2, allocate=False)
    assert saved_code_bytes(out) <= sum(uniform.nbytes[uniform.saved_slots[u][0]] for u in units)
    assert "error/noise" in out and "sensitivity: 2 synthetic batches of 8" in out
    assert re.search(r"mode approx (\d-bit|float) x\d+", out)


def test_plan_auto_budget_fits_the_whole_plan(capsys):
    budget = Engine(preact_resnet_cifar(8), 8, (3, 8, 8), "approx", 2, allocate=False).plan.total_bytes
    rc, out, err = run(capsys, "plan", *SMALL, "--bits", "auto", "--budget", str(budget), "--no-schedule")
    assert rc == 0, err
    total = int(re.search(r"^total\s+\d+\s+([\d,]+)", out, re.M).group(1).replace(",", ""))
    assert total <= budget


def test_maxbatch_auto_prints_the_allocation_at_the_batch_found(capsys):
    rc, out, err = run(capsys, "maxbatch", "--depth", "8", "--input", "3x8x8", "--budget", "4MiB", "--bits", "auto",
                       "--avg-bits", "2", "--batch", "8", "--measure-batches", "2")
    assert rc == 0, err
    n = int(re.search(r"largest batch (\d+)", out).group(1))
    assert f"allocation (batch {n}):" in out and len(table_rows(out)) == 7
    total = int(re.search(r"^  total\s+([\d,]+)", out, re.M).group(1).replace(",", ""))
    assert total <= parse_bytes("4MiB")


def test_train_auto_keeps_its_widths_in_the_config(capsys, tmp_path):
    out_dir = tmp_path / "run"
    rc, out, err = run(capsys, "train", "--dataset", "synthetic", "--limit-train", "64", "--limit-test", "16",
                       "--depth", "8", "--batch", "16", "--epochs", "1", "--no-progress", "--bits", "auto",
                       "--avg-bits", "2", "--out", str(out_dir))
    assert rc == 0, err
    assert "bits auto (2 bits on average), measured on 3 training batches" in out
    rows = table_rows(out)
    config = json.loads((out_dir / "config.json").read_text())
    assert config["bits"] == {u: (k if k == "float" else int(k)) for u, (k, _) in rows.items()}
    assert config["avg_bits"] == 2
    # resuming takes the widths from the run, without measuring again
    rc, out, err = run(capsys, "train", "--out", str(out_dir), "--resume", "--epochs", "2")
    assert rc == 0, err
    assert "bits auto" not in out and json.loads((out_dir / "config.json").read_text())["bits"] == config["bits"]


@pytest.mark.parametrize("argv, words", [
    (["plan", "--bits", "auto"], "--bits auto needs one of --budget (the whole plan) and --avg-bits"),
    (["plan", "--bits", "auto", "--avg-bits", "2", "--budget", "1GiB"], "--bits auto needs one of --budget"),
    (["plan", "--bits", "3"], "argument --bits: invalid choice: 3"),
    (["plan", "--bits", "four"], "argument --bits: expected 1, 2, 4, 8 or auto, got 'four'"),
    (["plan", "--bits", "4", "--avg-bits", "2"], "--budget and --avg-bits choose the widths of --bits auto"),
    (["plan", "--mode", "exact", "--bits", "auto", "--avg-bits", "2"], "mode exact saves every x-hat in float"),
    (["plan", "--bits", "auto", "--avg-bits", "0"], "argument --avg-bits: expected a number of bits in (0, 32]"),
    (["plan", "--depth", "8", "--input", "3x8x8", "--batch", "8", "--bits", "auto", "--budget", "1KiB",
      "--measure-batches", "2"], "does not cover what the plan needs besides the saved x-hat slots"),
    (["maxbatch", "--budget", "1GiB", "--bits", "auto"], "--bits auto needs --avg-bits"),
    (["train", "--dataset", "synthetic", "--limit-train", "32", "--depth", "8", "--batch", "16", "--bits", "auto",
      "--out", "OUT"], "avg_bits=None: expected a number of bits in (0, 32]"),
])
def test_bad_auto_command_lines_exit_2(capsys, tmp_path, argv, words):
    argv = [str(tmp_path / "run") if a == "OUT" else a for a in argv]
    rc, out, err = run(capsys, *argv)
    assert rc == 2, (out, err)
    assert words in err.strip().splitlines()[-1], err
    assert "Traceback" not in err


def test_train_rounding_is_kept_with_the_run(capsys, tmp_path):
    out_dir = tmp_path / "run"
    rc, out, err = run(capsys, "train", "--dataset", "synthetic", "--limit-train", "32", "--limit-test", "16",
                       "--depth", "8", "--batch", "16", "--epochs", "1", "--no-progress", "--bits", "2",
                       "--rounding", "stochastic", "--out", str(out_dir))
    assert rc == 0, err
    assert "(2-bit, unbiased stochastic rounding, 2.1" in out
    assert json.loads((out_dir / "config.json").read_text())["rounding"] == "stochastic"
    rc, out, err = run(capsys, "train", "--out", str(out_dir), "--resume", "--rounding", "nearest")
    assert rc == 1 and "rounding (checkpoint 'stochastic', this run 'nearest')" in err
