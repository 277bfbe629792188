"""The run folder of `lowmem train`: what it holds, when lowmem writes into it, and its lock.

    run = claim("runs/c10", resume=False, overwrite=False)   # RunDirError / ResumeError if it may not
    run.start(fresh=True)        # at the first write: the marker; with overwrite, lowmem's old files go
    ...                          # train: config.json, plan.txt, metrics.jsonl, checkpoint.ckpt
    run.release()                # or let the process end: the kernel drops the lock

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
writes its pid into the file so that a refused second run can name it. The
lock file itself stays (deleting it would let two runs lock two different
files); a folder holding only MARKER and LOCK counts as empty.

Not handled: network file systems where flock is not shared between machines;
Windows (no fcntl: the lock file is written but not locked).
"""
import json
import os
import time

try:
    import fcntl
except ImportError:         # Windows: no flock; runs there are not locked
    fcntl = None

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
        self._lock.close()              # closing the file releases the flock
        self._lock = None


def _lock(path):
    """Open and exclusively flock path/LOCK (non-blocking); write our pid into it."""
    f = open(os.path.join(path, LOCK), "a+")
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
