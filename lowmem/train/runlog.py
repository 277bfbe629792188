"""The run folder's record of a training run: config.json, plan.txt and metrics.jsonl.

    log = RunLog.claim("runs/c10", resume=False, overwrite=False)   # lock the folder (lowmem/train/rundir.py)
    log.start(config, engine, fresh=True, iteration=0)      # marker, config.json, plan.txt
    log.append({"event": "epoch", "epoch": 1, ...})          # one line of metrics.jsonl
    log.release()                                           # or let the process end

metrics.jsonl holds one strict JSON object per line (a non-finite number is
written as null), each with the "time" it was written: an "epoch" record
after every epoch, a "stop" record whenever the process stops. Every write
replaces the whole file through lowmem.system.atomic.atomic_write, so a crash or a
full disk leaves the file as it was before that record, never a torn line
(the file is small: one line per epoch). A resumed run first drops the
epoch records past its checkpoint: the run writes them again.

Only one process writes a run folder (rank 0 under MPI): RunLog.claim is
called there alone, and `RunLog.none()` stands in elsewhere (every call a
no-op), so the trainer never asks which rank it is before logging.
"""
import json
import math
import os
import time

from . import rundir
from ..system.atomic import atomic_write
from .rundir import CONFIG, METRICS, PLAN


class RunLog:
    """A locked run folder and its files; RunLog.none() writes nothing."""

    def __init__(self, run):
        self._run = run                      # a rundir.RunDir, or None: write nothing
        self.path = run.path if run is not None else None

    @classmethod
    def claim(cls, out, resume=False, overwrite=False):
        """Lock `out` and check this run may use it (rundir.claim: RunDirError / ResumeError)."""
        return cls(rundir.claim(out, resume=resume, overwrite=overwrite))

    @classmethod
    def none(cls):
        return cls(None)

    @property
    def held(self):
        return self._run is not None and self._run.held

    def start(self, config, engine, fresh, iteration):
        """Mark the folder as lowmem's (a fresh --overwrite run first removes lowmem's old files);
        write config.json and plan.txt; a run at iteration 0 starts metrics.jsonl anew, a resumed
        one drops the epoch records past `iteration`."""
        if self._run is None:
            return
        self._run.start(fresh=fresh)
        atomic_write(self._file(CONFIG), json.dumps(config.to_dict(), indent=2) + "\n", what="config")
        atomic_write(self._file(PLAN), engine.summary() + "\n\n" + engine.plan.report(max_rows=10 ** 6)
                     + "\n\n" + str(engine.schedule) + "\n", what="plan")
        if iteration == 0 and os.path.exists(self._file(METRICS)):
            os.remove(self._file(METRICS))
        elif iteration:
            self._rewrite([r for r in self.records()
                           if not (r.get("event") == "epoch" and r.get("iteration", 0) > iteration)])

    def append(self, record):
        """Add one record (with the current time) to metrics.jsonl."""
        if self._run is None:
            return
        self._rewrite(self.records() + [{"time": time.time(), **record}])

    def records(self):
        """The records of metrics.jsonl so far ([] before the first)."""
        if self._run is None or not os.path.exists(self._file(METRICS)):
            return []
        return read_metrics(self.path)

    def release(self, discard=False):
        """Drop the folder's lock; discard=True: a folder made by this run and still empty goes again."""
        if self._run is not None:
            self._run.release(discard=discard)

    def _file(self, name):
        return os.path.join(self.path, name)

    def _rewrite(self, records):
        atomic_write(self._file(METRICS), "".join(json_line(r) for r in records), what="metrics")


def _json_safe(value):
    """value with every non-finite float replaced by None (JSON has no NaN or inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def json_line(record):
    """One strict JSON line (non-finite numbers as null) for metrics.jsonl."""
    return json.dumps(_json_safe(record), allow_nan=False) + "\n"


def read_metrics(run_dir):
    """The records of run_dir/metrics.jsonl as a list of dicts (a torn last line, which a
    version before atomic metrics could leave, is skipped)."""
    out = []
    with open(os.path.join(run_dir, METRICS)) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out
