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
