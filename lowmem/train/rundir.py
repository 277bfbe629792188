"""The run folder of `lowmem train`: what it holds, when lowmem writes into it, its lock, and
its record of the run (config.json, plan.txt, metrics.jsonl).

    log = RunLog.claim("runs/c10", resume=False, overwrite=False)   # RunDirError / ResumeError if it may not
    log.start(config, engine, fresh=True, iteration=0)      # marker, config.json, plan.txt
    log.append({"event": "epoch", "epoch": 1, ...})          # one line of metrics.jsonl
    log.release()                # or let the process end: the kernel drops the lock
    read_metrics("runs/c10")     # the records, as a list of dicts

Two layers: `claim` / `RunDir` are the folder and its lock; `RunLog` writes the run's
files into a claimed folder (the checkpoint itself is lowmem/train/trainstate.py's).

Which folders a run may use (checked while holding the lock, so two runs
cannot both pass the check):

* a fresh run: a folder that does not exist (it is created) or is empty;
  any other folder only with overwrite=True, which replaces lowmem's own files
  (OWN_FILES) and leaves every other file alone. A folder that holds a
  checkpoint is refused with a hint to resume it.
* a resumed run: a folder holding a checkpoint (a folder lowmem made carries
  MARKER; folders of versions before the marker are recognised by their
  checkpoint, which the trainer then verifies).

The lock: an exclusive `fcntl.flock` on LOCK, held for as long as the run
lives. The kernel releases it when the process ends, however it ends (even
kill -9), so a lock never goes stale and needs no cleaning up. The holder
writes its pid into the file so that a refused second run can name it. A run
that ends removes the file while still holding the lock; a run that opened
that file just before takes its lock, sees the name no longer points to it,
and locks the new file instead (`_lock`), so two runs never hold two
different lock files. After a kill -9 the file stays (with the dead pid) and
the next run takes it over; a folder holding only MARKER and LOCK counts as
empty.

The record: metrics.jsonl holds one strict JSON object per line (a non-finite
number is written as null), each with the "time" it was written: a "step"
record every `log_every` iterations (lowmem/train/steplog.py: they wait in memory
and are appended with the next record), an "epoch" record after every epoch, a
"stop" record whenever the process stops. Every write replaces the whole file
through lowmem.system.atomic.atomic_write, so a crash or a full disk leaves the
file as it was before that write, never a torn line (the file is small: a line
per epoch and per `log_every` steps, written about once an epoch); the lines already there are
kept byte for byte, even those no reader can use (read_metrics skips them). A resumed run
first drops the epoch and step records past its checkpoint: the run writes them
again. Only one process
writes a run folder (rank 0 under MPI): RunLog.claim is called there alone, and
`RunLog.none()` stands in elsewhere (every call a no-op), so the trainer never
asks which rank it is before logging.

Not handled: network file systems where flock is not shared between machines;
Windows (no fcntl: the lock file is written but not locked).
"""
import json
import math
import os
import time

try:
    import fcntl
except ImportError:         # Windows: no flock; runs there are not locked
    fcntl = None

from ..system.atomic import atomic_write

CHECKPOINT, METRICS, CONFIG, PLAN = "checkpoint.ckpt", "metrics.jsonl", "config.json", "plan.txt"
MARKER, LOCK = "lowmem-run.json", "lowmem-run.lock"
MARKER_FORMAT = "lowmem-run/1"
OWN_FILES = (CHECKPOINT, METRICS, CONFIG, PLAN)      # what overwrite=True replaces
_TEMP_PREFIXES = tuple(name + ".tmp" for name in OWN_FILES)    # left by a write killed half-way (lowmem.system.atomic)


class RunDirError(ValueError):
    """A run folder lowmem must not or cannot use as asked (not its own, in use, a file)."""


class ResumeError(RunDirError):
    """A run folder or checkpoint that cannot continue this run (none there, another
    architecture, other data or settings)."""


def _is_own(name):
    return name in OWN_FILES or name in (MARKER, LOCK) or name.startswith(_TEMP_PREFIXES)


def _listing(names, limit=5):
    names = sorted(names)
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


class RunDir:
    """A run folder this process holds the lock of (from `claim`)."""

    def __init__(self, path, lock_file, overwrite, created):
        self.path, self._lock, self.overwrite, self.created = path, lock_file, overwrite, created

    @property
    def held(self):
        return self._lock is not None

    def start(self, fresh):
        """Before the run's first write: a fresh run with overwrite removes lowmem's old files;
        every run writes the marker if it is missing."""
        if fresh and self.overwrite:
            for name in os.listdir(self.path):
                if name in OWN_FILES or name.startswith(_TEMP_PREFIXES):
                    os.remove(os.path.join(self.path, name))
        marker = os.path.join(self.path, MARKER)
        if not os.path.exists(marker):
            with open(marker, "w") as f:
                json.dump({"format": MARKER_FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "note": "a lowmem training run; lowmem train --out <this folder> --resume "
                                   "continues it"}, f, indent=2)
                f.write("\n")

    def release(self, discard=False):
        """Drop the lock (idempotent). discard=True (a run that failed before writing anything):
        also remove the folder if `claim` created it and it holds nothing but the lock file."""
        if self._lock is None:
            return
        if discard and self.created and os.listdir(self.path) == [LOCK]:
            os.remove(os.path.join(self.path, LOCK))        # while still holding the lock
            self._lock.close()
            self._lock = None
            try:
                os.rmdir(self.path)
            except OSError:             # someone put something there meanwhile: leave it
                pass
            return
        try:
            os.remove(os.path.join(self.path, LOCK))        # while still holding it (_lock's check)
        except OSError:
            pass
        self._lock.close()              # closing the file releases the flock
        self._lock = None


def _lock(path):
    """Open and exclusively flock path/LOCK (non-blocking); write our pid into it.

    A holder removes the file while it still holds the lock (release): a run that opened the old
    file just before finds, once it has the flock, that path/LOCK is no longer the file it holds,
    and tries again on the new one, so two runs never hold locks on two different files."""
    name = os.path.join(path, LOCK)
    while True:
        f = open(name, "a+")
        if fcntl is None:
            return f
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            pid = f.read().strip() or "unknown"
            f.close()
            raise RunDirError(f"run folder {path} is in use by another lowmem run (pid {pid}); wait for it "
                              f"to end or stop it, or choose another --out") from None
        except BaseException:
            f.close()
            raise
        try:
            current = os.stat(name).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        f.close()                       # the file we locked was removed meanwhile: lock the new one
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def claim(path, resume=False, overwrite=False):
    """Lock the run folder `path` (created if missing) and check this run may use it -> RunDir.

    RunDirError: path is a file, the folder is locked by another run, or it holds
    files and neither resume nor overwrite allows using it. ResumeError: a fresh
    run into a folder with a checkpoint, or a resume without one."""
    path = os.fspath(path)
    if not path:
        raise RunDirError("the run folder must be named (an empty path was given)")
    if resume and overwrite:
        raise RunDirError("resume and overwrite exclude each other: resume continues the run in "
                          f"{path}, overwrite starts it again")
    if os.path.exists(path) and not os.path.isdir(path):
        raise RunDirError(f"{path} exists and is not a folder")
    created = not os.path.exists(path)
    os.makedirs(path, exist_ok=True)
    run = RunDir(path, _lock(path), overwrite, created)
    try:
        _check(path, resume, overwrite)
    except BaseException:
        run.release(discard=True)
        raise
    return run


def _check(path, resume, overwrite):
    names = set(os.listdir(path)) - {LOCK}
    ckpt = os.path.join(path, CHECKPOINT)
    if resume:
        if CHECKPOINT not in names:
            raise ResumeError(f"nothing to resume: {ckpt} does not exist")
        return
    if overwrite:
        return
    if CHECKPOINT in names:
        raise ResumeError(f"{ckpt} already exists: pass --resume (resume=True) to continue that run, "
                          f"--overwrite to start it again, or choose another --out")
    rest = names - {MARKER}
    if not rest:
        return                                              # new or empty
    if MARKER in names:
        raise RunDirError(f"{path} holds a lowmem run that has no checkpoint yet ({_listing(rest)}); "
                          f"pass --overwrite (overwrite=True) to start it again, or choose another --out")
    foreign = [n for n in rest if not _is_own(n)]
    raise RunDirError(f"{path} is not empty and is not a lowmem run folder (it holds {_listing(rest)}); "
                      f"choose a new or empty folder, or pass --overwrite (overwrite=True) to write the "
                      f"run there anyway" + (f" (it replaces only {', '.join(OWN_FILES)}; "
                                             f"and leaves {_listing(foreign)} alone)" if foreign else ""))


# ----------------------------------------------------------------------- the run's record

class RunLog:
    """A locked run folder and its files; RunLog.none() writes nothing."""

    def __init__(self, run):
        self._run = run                      # a RunDir, or None: write nothing
        self.path = run.path if run is not None else None

    @classmethod
    def claim(cls, out, resume=False, overwrite=False):
        """Lock `out` and check this run may use it (`claim`: RunDirError / ResumeError)."""
        return cls(claim(out, resume=resume, overwrite=overwrite))

    @classmethod
    def none(cls):
        return cls(None)

    @property
    def held(self):
        return self._run is not None and self._run.held

    def start(self, config, engine, fresh, iteration):
        """Mark the folder as lowmem's (a fresh --overwrite run first removes lowmem's old files);
        write config.json and plan.txt; a run at iteration 0 starts metrics.jsonl anew, a resumed
        one drops the epoch and step records past `iteration`."""
        if self._run is None:
            return
        self._run.start(fresh=fresh)
        atomic_write(self._file(CONFIG), json.dumps(config.to_dict(), indent=2) + "\n", what="config")
        atomic_write(self._file(PLAN), engine.summary() + "\n\n" + engine.plan.report(max_rows=10 ** 6)
                     + "\n\n" + str(engine.schedule) + "\n", what="plan")
        if iteration == 0 and os.path.exists(self._file(METRICS)):
            os.remove(self._file(METRICS))
        elif iteration:                 # every other line stays as it is, byte for byte
            self._rewrite([line for line in self._lines() if not _past(_record(line), iteration)])

    def append(self, *records):
        """Add records, in order, to metrics.jsonl in one rewrite (each with the current time
        unless it carries its own). The lines already there are kept byte for byte, those lowmem
        cannot read included (read_metrics skips them)."""
        if self._run is None or not records:
            return
        now = time.time()
        self._rewrite(self._lines() + [json_line({"time": now, **r}).encode() for r in records])

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

    def _lines(self):
        """metrics.jsonl's lines as bytes, each ending in a newline ([] before the first)."""
        try:
            with open(self._file(METRICS), "rb") as f:
                return [line if line.endswith(b"\n") else line + b"\n" for line in f]
        except FileNotFoundError:
            return []

    def _rewrite(self, lines):
        atomic_write(self._file(METRICS), b"".join(lines), what="metrics")


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


def _record(line):
    """The record of one line of metrics.jsonl (bytes), or None where the line is not one: not
    JSON (a torn last line, which a version before atomic metrics could leave; bytes that are not
    UTF-8), not an object, or an epoch or step record without a numeric iteration."""
    try:
        r = json.loads(line.decode("utf-8", "replace"))
    except ValueError:
        return None
    if not isinstance(r, dict):
        return None
    it = r.get("iteration")
    if r.get("event") in ("epoch", "step") and (isinstance(it, bool) or not isinstance(it, (int, float))
                                                or not math.isfinite(it)):
        return None
    return r


def _past(record, iteration):
    """Whether a record is an epoch or step record past `iteration` (a resumed run writes it again)."""
    return record is not None and record.get("event") in ("epoch", "step") and record["iteration"] > iteration


def read_metrics(run_dir):
    """The records of run_dir/metrics.jsonl as a list of dicts; a line that holds no record
    (_record: not JSON, not an object, an epoch or step record without a numeric iteration) is
    skipped."""
    with open(os.path.join(run_dir, METRICS), "rb") as f:
        return [r for r in map(_record, f) if r is not None]
