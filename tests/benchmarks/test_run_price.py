"""benchmarks/run_price.py: prices a study's trained allocations along its exact runs' checkpoints
and sets the order of the prices beside the study's measured accuracy costs. Nothing is timed."""
import json
import os
import shutil
import sys

import pytest

from lowmem.train.config import TrainConfig
from lowmem.train.trainer import Trainer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import run_price                                                 # noqa: E402


def test_kendall_counts_concordant_and_discordant_pairs():
    assert run_price.kendall([1, 2, 3], [10, 20, 30]) == (1.0, [])
    assert run_price.kendall([1, 2, 3], [30, 20, 10])[0] == -1.0
    tau, bad = run_price.kendall([1, 2, 3, 4], [1, 3, 2, 4])
    assert tau == pytest.approx(4 / 6) and bad == [(1, 2)]


def test_a_study_is_priced_and_its_orders_compared(tmp_path, capsys):
    study = tmp_path / "study"
    run = study / "runs" / "exact-seed0"
    kept = []

    def keep(trainer, record):
        kept.append(run / f"epoch{record['epoch']}.ckpt")
        shutil.copy(trainer.ckpt_path, kept[-1])
    cfg = TrainConfig(dataset="synthetic", limit_train=64, limit_test=16, depth=8, batch=16, epochs=2,
                      schedule="cosine", progress=False, out=str(run))
    Trainer(cfg, dataset=None, log=lambda *_: None, on_epoch=keep).fit()
    acc = {"exact": 0.90, "approx 2-bit unbiased": 0.85, "approx 2-bit dithered": 0.87,
           "approx 4-bit unbiased": 0.895, "approx 4-bit dithered": 0.899}
    results = {"settings": {"dataset": "synthetic", "pad_to": 0, "batch": 16},
               "runs": {f"{k}|0": {"final_test_acc": v} for k, v in acc.items()}}
    (study / "results.json").write_text(json.dumps(results))
    out = tmp_path / "price.json"
    run_price.main(["--study", str(study), "--seeds", "0", "--batches", "2", "--limit-train", "64",
                    "--out", str(out)])
    got = json.loads(out.read_text())
    seed = got["seeds"]["0"]
    assert seed["iterations"] == [0, 4, 8]
    for rounding in ("stochastic", "dither"):
        r = seed[rounding]
        assert sum(r["weights"]) == pytest.approx(1)
        assert 0 < r["uniform"]["4"]["run"] < r["uniform"]["2"]["run"]
        assert r["uniform"]["2"]["run"] == pytest.approx(sum(w * p for w, p in zip(r["weights"], r["uniform"]["2"]["along"])))
        assert r["chosen_run"]["run"] <= r["uniform"]["2"]["run"] + 1e-12      # the allocator's least price
    rows = {row["allocation"]: row for row in got["rows"]}
    assert rows["approx 2-bit unbiased"]["measured_cost"] == pytest.approx(0.05)
    assert set(rows) == set(run_price.TRAINED)
    assert -1 <= got["kendall_run"]["tau"] <= 1
    assert "Kendall tau, run price vs measured cost" in capsys.readouterr().out
