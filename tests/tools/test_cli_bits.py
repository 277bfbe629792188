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
    (["plan", "--bits", "four"], "argument --bits: expected 1, 2, 4, 8, auto, unit=K pairs"),
    (["plan", "--bits", "4", "--avg-bits", "2"], "--budget and --avg-bits choose the widths of --bits auto"),
    (["plan", "--mode", "exact", "--bits", "auto", "--avg-bits", "2"], "mode exact saves every x-hat in float"),
    (["plan", "--bits", "auto", "--avg-bits", "0"], "argument --avg-bits: expected a number of bits in (0, 32]"),
    (["plan", "--depth", "8", "--input", "3x8x8", "--batch", "8", "--bits", "auto", "--budget", "1KiB",
      "--measure-batches", "2"], "--budget 1.00 KiB is below the smallest plan at batch 8, 1.28 MiB"),
    (["maxbatch", "--budget", "1GiB", "--bits", "auto"], "--bits auto needs --avg-bits"),
    (["train", "--dataset", "synthetic", "--limit-train", "32", "--depth", "8", "--batch", "16", "--bits", "auto",
      "--out", "OUT"], "--avg-bits is missing: expected a number of bits in (0, 32] (--bits auto fits"),
    (["train", "--dataset", "synthetic", "--limit-train", "32", "--depth", "8", "--batch", "16", "--avg-bits", "2",
      "--out", "OUT"], "--avg-bits 2.0: expected only with --bits auto"),
    (["train", "--dataset", "synthetic", "--limit-train", "32", "--depth", "8", "--batch", "16", "--mode", "exact",
      "--rounding", "stochastic", "--out", "OUT"], "--rounding stochastic: expected nearest in mode exact"),
    (["train", "--dataset", "synthetic", "--limit-train", "32", "--depth", "8", "--batch", "16", "--mode", "exact",
      "--bits", "auto", "--avg-bits", "2", "--out", "OUT"], "--bits auto: expected a width per unit only in mode"),
    (["train", "--dataset", "synthetic", "--limit-train", "32", "--depth", "8", "--batch", "16",
      "--bits", "layer1.0.bn1=4,nosuch=2,*=2", "--out", "OUT"], "bits names 'nosuch', not a BN-ReLU unit"),
    (["plan", "--depth", "8", "--bits", "layer9.bn1=4"], "bits names 'layer9.bn1', not a BN-ReLU unit"),
    (["train", "--dataset", "synthetic", "--limit-train", "32", "--depth", "8", "--batch", "16", "--bits", "auto",
      "--avg-bits", "0.5", "--out", "OUT"], "--avg-bits 0.5 allows 72.00 KiB of saved x-hat at batch 16, below "
                                             "the 144.00 KiB of every unit 1-bit; --avg-bits must be at least 1"),
    (["plan", "--depth", "8", "--batch", "16", "--bits", "auto", "--avg-bits", "0.25"],
     "--avg-bits 0.25 allows"),
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


TRAIN_AUTO = ["train", "--dataset", "synthetic", "--limit-train", "32", "--limit-test", "16", "--depth", "8",
              "--batch", "16", "--no-progress", "--bits", "auto"]


def test_resuming_an_auto_run_keeps_its_record_true_and_its_rerun_command_continues(capsys, tmp_path):
    out_dir = tmp_path / "run"
    rc, out, err = run(capsys, *TRAIN_AUTO, "--avg-bits", "1.5", "--epochs", "1", "--out", str(out_dir))
    assert rc == 0, err
    config = json.loads((out_dir / "config.json").read_text())
    ckpt = (out_dir / "checkpoint.ckpt").read_bytes()
    # another average on resume: refused, nothing written (the stored widths were chosen for 1.5)
    for extra in (["--avg-bits", "3"], ["--bits", "auto", "--avg-bits", "2"]):
        rc, out, err = run(capsys, "train", "--out", str(out_dir), "--resume", "--epochs", "2", *extra)
        assert rc == 1, (out, err)
        assert "it differs in avg_bits (checkpoint 1.5, this run " in err and "\n" not in err.strip()
        assert json.loads((out_dir / "config.json").read_text()) == config
        assert (out_dir / "checkpoint.ckpt").read_bytes() == ckpt
    # a fixed width on resume names bits, briefly
    rc, out, err = run(capsys, "train", "--out", str(out_dir), "--resume", "--epochs", "2", "--bits", "2")
    assert rc == 1 and "it differs in bits (checkpoint 7 per-unit widths, this run 2)" in err, err
    stored = config["bits"]["bn_final"]
    other = 1 if stored != 1 else 2
    rc, out, err = run(capsys, "train", "--out", str(out_dir), "--resume", "--epochs", "2", "--bits",
                       ",".join(f"{u}={other if u == 'bn_final' else k}" for u, k in config["bits"].items()))
    assert rc == 1 and f"it differs in bits (unit 'bn_final': checkpoint {stored!r}, this run {other})" in err, err
    # the job script's command rerun with --resume: continues with the stored widths, measures nothing
    rc, out, err = run(capsys, *TRAIN_AUTO, "--avg-bits", "1.5", "--epochs", "2", "--out", str(out_dir), "--resume")
    assert rc == 0, err
    assert "continuing with the checkpoint's 7 per-unit widths, chosen for avg_bits 1.5" in out
    assert "measured on" not in out and "sensitivity" not in out
    after = json.loads((out_dir / "config.json").read_text())
    assert after["bits"] == config["bits"] and after["avg_bits"] == 1.5 and after["epochs"] == 2


def test_train_and_plan_take_per_unit_widths(capsys, tmp_path):
    out_dir = tmp_path / "run"
    rc, out, err = run(capsys, "train", "--dataset", "synthetic", "--limit-train", "32", "--limit-test", "16",
                       "--depth", "8", "--batch", "16", "--epochs", "1", "--no-progress",
                       "--bits", "layer1.0.bn1=4,layer3.0.bn2=float,*=2", "--out", str(out_dir))
    assert rc == 0, err
    assert "(4-bit x1, 2-bit x5, float x1)" in out
    config = json.loads((out_dir / "config.json").read_text())
    assert config["bits"] == {"layer1.0.bn1": 4, "layer3.0.bn2": "float", "*": 2}
    # the run's config.json is itself a widths file
    rc, out, err = run(capsys, "plan", "--depth", "8", "--batch", "4", "--no-schedule", "--bits",
                       str(out_dir / "config.json"))
    assert rc == 0, err
    assert "mode approx 4-bit x1, 2-bit x5, float x1" in out, out.splitlines()[0]


DIAG = ["diagnose", "--depth", "8", "--batch", "8", "--input", "3x8x8", "--no-table"]


def test_diagnose_takes_bits_auto_rounding_and_per_unit_widths(capsys):
    rc, out, err = run(capsys, *DIAG, "--bits", "auto", "--avg-bits", "2")
    assert rc == 0, err
    assert "allocation (batch 8, measured on the same batches):" in out and len(table_rows(out)) == 7
    m = re.search(r"predicted ([\d.e+-]+) \(the allocation\), measured ([\d.e+-]+)", out)
    predicted, measured = float(m.group(1)), float(m.group(2))
    assert 0.5 < predicted / measured < 2.0          # the estimate's documented accuracy (docs/bits.md)
    rc, out, err = run(capsys, *DIAG, "--bits", "2", "--rounding", "stochastic")
    assert rc == 0, err
    assert "(2-bit, unbiased stochastic rounding) vs exact" in out
    assert "2-bit, unbiased stochastic rounding, 25 parameter" in out
    rc, out, err = run(capsys, *DIAG, "--bits", "layer1.0.bn1=8,*=2")
    assert rc == 0, err
    assert "per-unit 8-bit x1, 2-bit x6, 25 parameter tensors" in out
    for argv, words in ((["--bits", "auto"], "--bits auto needs --avg-bits"),
                        (["--avg-bits", "2"], "--avg-bits chooses the widths of --bits auto"),
                        (["--bits", "x=2"], "bits names 'x', not a BN-ReLU unit")):
        rc, out, err = run(capsys, *DIAG, *argv)
        assert rc == 2 and words in err and "Traceback" not in err, err


def test_a_budget_no_allocation_fits_is_refused_before_measuring(capsys):
    for budget in ("--budget", "1KiB"), ("--avg-bits", "0.25"):
        rc, out, err = run(capsys, "plan", *SMALL, "--bits", "auto", *budget, "--no-schedule")
        assert rc == 2 and budget[0] + " " in err
        assert "sensitivity:" not in out                  # nothing was measured
