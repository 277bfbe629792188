"""lowmem.train.steplog: a step record every N iterations, over the steps since the previous one."""
import pytest

from lowmem.train import steplog
from lowmem.train.steplog import StepLog


def test_a_record_every_n_iterations_over_the_steps_since_the_last():
    log = StepLog(every=4, steps_per_epoch=8)
    for it in range(1, 11):                     # step `it`: loss it per image, 2 of 4 images right
        log.add(it, loss_sum=4.0 * it, correct=2, seen=4, seconds=0.5, lr=0.1 / it)
    recs = log.take()
    assert [r["iteration"] for r in recs] == [4, 8]
    assert recs[0].pop("time") > 0
    assert recs[0] == {"event": "step", "iteration": 4, "epoch": 0.5, "lr": pytest.approx(0.025),
                       "train_loss": pytest.approx((1 + 2 + 3 + 4) / 4), "train_acc": 0.5,
                       "images_per_s": pytest.approx(16 / 2.0)}
    assert recs[1]["train_loss"] == pytest.approx((5 + 6 + 7 + 8) / 4) and recs[1]["epoch"] == 1.0
    assert log.take() == []                     # taken once
    for it in (11, 12):
        log.add(it, 4.0, 4, 4, 0.25, 0.1)
    (r,) = log.take()                           # iterations 9..12: the two steps before the take count too
    assert r["iteration"] == 12 and r["train_loss"] == pytest.approx((36 + 40 + 4 + 4) / 16)
    assert r["train_acc"] == pytest.approx((2 + 2 + 4 + 4) / 16)


def test_a_stop_closes_the_steps_since_the_last_record():
    log = StepLog(every=4, steps_per_epoch=8)
    for it in range(1, 7):
        log.add(it, 1.0 * it, 1, 1, 0.5, 0.1)
    assert [r["iteration"] for r in log.take()] == [4]
    log.add(7, 7.0, 0, 1, 0.5, 0.01)
    (r,) = log.take(close=True)                 # 5, 6, 7
    assert r["iteration"] == 7 and r["train_loss"] == pytest.approx(6.0) and r["lr"] == 0.01
    assert r["train_acc"] == pytest.approx(2 / 3) and r["images_per_s"] == pytest.approx(2.0)
    assert log.take(close=True) == []           # nothing since


def test_every_zero_keeps_no_records():
    log = StepLog(every=0, steps_per_epoch=8)
    for it in range(1, 20):
        log.add(it, 1.0, 1, 1, 0.1, 0.1)
    assert log.take() == [] and not log.stale()


def test_stale_once_records_waited_flush_seconds(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(steplog.time, "monotonic", lambda: now[0])
    log = StepLog(every=1, steps_per_epoch=8)
    assert not log.stale()                      # nothing waits
    log.add(1, 1.0, 1, 1, 0.1, 0.1)
    assert not log.stale()
    now[0] += steplog.FLUSH_S + 1
    assert log.stale()
    log.take()
    log.add(2, 1.0, 1, 1, 0.1, 0.1)
    assert not log.stale()


# ---------------------------------------------------------------- in a run

def tiny_data():
    from lowmem.data.datasets import Dataset, channel_mean_std, synthetic
    x, y, xt, yt = synthetic(64, 16, shape=(3, 8, 8), seed=3)
    return Dataset("synthetic", x, y, xt, yt, 10, *channel_mean_std(x))


def tiny_run(out, resume=False, **kw):
    from lowmem.train.config import TrainConfig
    from lowmem.train.trainer import Trainer
    cfg = TrainConfig(**{"dataset": "synthetic", "depth": 8, "batch": 16, "epochs": 2, "lr": 0.05,
                         "progress": False, "out": str(out), "log_every": 3, **kw})
    return Trainer(cfg, dataset=tiny_data(), resume=resume, log=lambda *a: None)


def test_a_run_writes_a_step_record_every_log_every_iterations_and_a_resume_keeps_them_once(tmp_path):
    from lowmem.train.rundir import read_metrics
    t = tiny_run(tmp_path)
    t.on_step = lambda tr, loss: tr.request_stop() if tr.iteration == 5 else None
    assert t.fit().iteration == 5                               # 4 steps an epoch: stopped mid-epoch 2
    recs = read_metrics(tmp_path)
    assert [r["event"] for r in recs] == ["step", "epoch", "step", "stop"]
    assert [r["iteration"] for r in recs[:3]] == [3, 4, 5]      # 5: the steps since 3, as the run stops
    assert tiny_run(tmp_path, resume=True).fit().status == "finished"
    recs = read_metrics(tmp_path)
    steps = [r for r in recs if r["event"] == "step"]
    assert [r["iteration"] for r in steps] == [3, 5, 6, 8]      # 6: the one step since the resume; 8: the end
    assert [r["event"] for r in recs] == ["step", "epoch", "step", "stop", "step", "epoch", "step", "stop"]
    assert recs[-2]["iteration"] == 8                           # the last steps, as the run ends
    for r in steps:
        assert r["lr"] > 0 and r["train_loss"] > 0 and 0 <= r["train_acc"] <= 1 and r["images_per_s"] > 0
        assert r["epoch"] == r["iteration"] / 4


def test_log_every_zero_writes_epoch_records_only(tmp_path):
    from lowmem.train.rundir import read_metrics
    tiny_run(tmp_path, log_every=0, epochs=1).fit()
    assert [r["event"] for r in read_metrics(tmp_path)] == ["epoch", "stop"]
