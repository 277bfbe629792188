"""lowmem.train.rundir.RunLog: the run folder's config, plan and metrics; metrics rewritten atomically."""
import json
import math
import os

import pytest

from lowmem.system import atomic
from lowmem.train.rundir import RunLog, json_line, read_metrics


class Config:
    def to_dict(self):
        return {"depth": 8}


class Engine:
    class plan:
        @staticmethod
        def report(max_rows):
            return "the plan"
    schedule = "the schedule"

    def summary(self):
        return "summary"


def test_start_writes_config_and_plan_and_append_adds_strict_lines(tmp_path):
    log = RunLog.claim(tmp_path / "run")
    log.start(Config(), Engine(), fresh=True, iteration=0)
    log.append({"event": "epoch", "epoch": 1, "iteration": 4, "test_loss": math.inf})
    log.append({"event": "stop", "reason": "finished"})
    run = tmp_path / "run"
    assert json.loads((run / "config.json").read_text()) == {"depth": 8}
    assert "the plan" in (run / "plan.txt").read_text()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["epoch", "stop"]
    assert json.loads(lines[0])["test_loss"] is None and "time" in json.loads(lines[0])    # strict JSON
    log.release()


def test_a_crash_while_appending_keeps_every_earlier_record(tmp_path, monkeypatch):
    log = RunLog.claim(tmp_path)
    log.start(Config(), Engine(), fresh=True, iteration=0)
    log.append({"event": "epoch", "epoch": 1})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError, match="cannot write metrics .*metrics.jsonl'"):
        log.append({"event": "epoch", "epoch": 2})
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]
    log.release()


def test_a_resumed_start_drops_the_epochs_and_steps_past_the_checkpoint(tmp_path):
    atomic.atomic_write(tmp_path / "metrics.jsonl", "".join(json_line(r) for r in (
        {"event": "step", "iteration": 2}, {"event": "epoch", "iteration": 4}, {"event": "step", "iteration": 6},
        {"event": "epoch", "iteration": 8}, {"event": "stop", "iteration": 9})))
    log = RunLog(None)
    log.start(Config(), Engine(), fresh=False, iteration=4)          # RunLog.none(): writes nothing
    assert len(read_metrics(tmp_path)) == 5
    log = RunLog.claim(tmp_path, overwrite=True)
    log.start(Config(), Engine(), fresh=False, iteration=4)
    assert [r["iteration"] for r in read_metrics(tmp_path)] == [2, 4, 9]
    log.release()


def test_append_writes_several_records_at_once_each_keeping_its_own_time(tmp_path):
    log = RunLog.claim(tmp_path)
    log.start(Config(), Engine(), fresh=True, iteration=0)
    log.append({"event": "step", "iteration": 2, "time": 5.0}, {"event": "epoch", "iteration": 4})
    log.append()                                                       # nothing: no rewrite
    recs = read_metrics(tmp_path)
    assert [r["event"] for r in recs] == ["step", "epoch"] and recs[0]["time"] == 5.0 and recs[1]["time"] > 5
    log.release()


def test_none_writes_nothing(tmp_path):
    log = RunLog.none()
    log.append({"event": "epoch"})
    assert log.records() == [] and not log.held and os.listdir(tmp_path) == []


def test_lines_that_are_no_records_are_skipped_by_readers_and_kept_by_writes(tmp_path):
    """A line a person or a tool appended (not JSON, not an object, bytes that are not UTF-8, an
    epoch record whose iteration is no number) is no record: readers skip it, and the run log's
    rewrites (append; a resumed start, which drops the records past its checkpoint) keep it as
    it was, byte for byte."""
    log = RunLog.claim(tmp_path)
    log.start(Config(), Engine(), fresh=True, iteration=0)
    log.append({"event": "epoch", "epoch": 1, "iteration": 4}, {"event": "step", "iteration": 6})
    junk = [b"5\n", b"null\n", b'{"event": "step", "iteration": "40"}\n', b"\xff\xfe\n", b'{"event": "epoch"}\n']
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(b"".join(junk))
    assert [r["iteration"] for r in read_metrics(tmp_path)] == [4, 6]
    log.append({"event": "epoch", "epoch": 2, "iteration": 8})
    log.release()
    log = RunLog.claim(tmp_path, overwrite=True)
    log.start(Config(), Engine(), fresh=False, iteration=4)          # resumed from iteration 4
    raw = (tmp_path / "metrics.jsonl").read_bytes()
    assert all(j in raw for j in junk), raw
    assert [r["iteration"] for r in read_metrics(tmp_path)] == [4]
    log.release()
