"""Run folders: lowmem writes only into a folder that is new, empty, its own (then only with
resume) or given with overwrite; a run locks its folder, and a second run refuses, naming the pid."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from lowmem.tools import cli
from lowmem.train import rundir
from lowmem.train.rundir import LOCK, MARKER, ResumeError, RunDirError, claim

TRAIN = ["train", "--dataset", "synthetic", "--limit-train", "32", "--limit-test", "8", "--depth", "8",
         "--batch", "16", "--epochs", "1", "--no-progress"]


def train(capsys, out, *extra):
    rc = cli.main(TRAIN + ["--out", str(out), *extra])
    return (rc, *capsys.readouterr())


def snapshot(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def test_a_folder_with_other_files_is_refused_and_left_alone(capsys, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text('{"my": "own settings"}')
    (out / "notes.txt").write_text("keep me")
    before = snapshot(out)
    rc, _, err = train(capsys, out)
    assert rc == 1
    assert "is not empty and is not a lowmem run folder (it holds config.json, notes.txt)" in err
    assert "--overwrite" in err
    assert snapshot(out) == before                                  # nothing added (the lock file went again)
    # --overwrite: the run is written there; files lowmem does not own stay
    rc, _, err = train(capsys, out, "--overwrite")
    assert rc == 0, err
    assert (out / "notes.txt").read_text() == "keep me"
    assert (out / MARKER).exists() and (out / "checkpoint.ckpt").exists()
    assert '"my"' not in (out / "config.json").read_text()


def test_a_new_or_empty_folder_is_used_and_marked(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new" / "nested"):
        rc, _, err = train(capsys, out)
        assert rc == 0, err
        assert sorted(os.listdir(out)) == ["checkpoint.ckpt", "config.json", MARKER, "metrics.jsonl",
                                           "plan.txt"]                 # a finished run leaves no lock file


def test_a_lowmem_run_needs_resume_or_overwrite(capsys, tmp_path):
    out = tmp_path / "run"
    assert train(capsys, out)[0] == 0
    before = snapshot(out)
    rc, _, err = train(capsys, out)                             # a fresh run into it
    assert rc == 1 and "already exists: pass --resume" in err and "--overwrite" in err
    assert snapshot(out) == before
    rc, _, err = train(capsys, out, "--overwrite", "--epochs", "2")
    assert rc == 0, err
    epochs = [line for line in (out / "metrics.jsonl").read_text().splitlines() if '"event": "epoch"' in line]
    assert len(epochs) == 2                                     # the old run's records are gone


def test_a_lowmem_run_without_checkpoint_needs_overwrite(capsys, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / MARKER).write_text("{}")
    (out / "metrics.jsonl").write_text('{"event": "stop", "reason": "diverged"}\n')
    rc, _, err = train(capsys, out)
    assert rc == 1 and "holds a lowmem run that has no checkpoint yet (metrics.jsonl)" in err
    assert (out / "metrics.jsonl").read_text().count("diverged") == 1
    assert train(capsys, out, "--overwrite")[0] == 0


def test_a_file_is_not_a_run_folder(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    rc, _, err = train(capsys, tmp_path / "f")
    assert rc == 1 and "exists and is not a folder" in err


def test_resume_without_a_checkpoint(tmp_path):
    with pytest.raises(ResumeError, match="nothing to resume"):
        claim(tmp_path / "run", resume=True)
    assert not (tmp_path / "run").exists()                      # the folder it made went again


def test_a_second_run_in_this_process_is_refused(capsys, tmp_path):
    held = claim(tmp_path / "run")
    try:
        rc, _, err = train(capsys, tmp_path / "run")
        assert rc == 1 and f"is in use by another lowmem run (pid {os.getpid()})" in err
    finally:
        held.release()
    assert train(capsys, tmp_path / "run")[0] == 0             # released: usable again


HOLDER = textwrap.dedent("""
    import sys, time
    from lowmem.train.rundir import claim
    run = claim(sys.argv[1])
    print("holding", flush=True)
    time.sleep(60)
""")


def test_another_process_holds_the_lock_until_it_dies(capsys, tmp_path):
    out = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "holding"
        rc, _, err = train(capsys, out)
        assert rc == 1 and f"in use by another lowmem run (pid {child.pid})" in err
        assert os.listdir(out) == [LOCK]                        # nothing written
        child.send_signal(signal.SIGKILL)                       # no clean-up: the kernel drops the lock
        child.wait(timeout=30)
        assert (out / LOCK).read_text().strip() == str(child.pid)   # the dead holder's file stays ...
        rc, _, err = train(capsys, out)
        assert rc == 0, err
        assert not (out / LOCK).exists()                        # ... until a run takes it over and ends
    finally:
        child.kill()
        child.wait()


def test_claim_rules(tmp_path):
    with pytest.raises(RunDirError, match="must be named"):
        claim("")
    with pytest.raises(RunDirError, match="exclude each other"):
        claim(tmp_path / "x", resume=True, overwrite=True)
    run = claim(tmp_path / "x")
    assert run.held and run.created
    run.release()
    run.release()                                               # idempotent
    assert not run.held
    assert issubclass(ResumeError, RunDirError) and issubclass(RunDirError, ValueError)
    assert rundir.OWN_FILES == ("checkpoint.ckpt", "metrics.jsonl", "config.json", "plan.txt")


def test_a_lock_file_removed_by_its_holder_is_not_locked_by_a_late_opener(tmp_path, monkeypatch):
    # the race the removal opens: B opens the file, A removes it and releases, B takes the flock on
    # the removed file; B must notice and lock the new file, which C then finds locked
    import lowmem.train.rundir as rd
    out = tmp_path / "run"
    a = claim(str(out))
    real_open = open
    opened = []

    def late_open(name, mode="r", *args, **kw):
        f = real_open(name, mode, *args, **kw)
        if str(name).endswith(LOCK) and not opened:
            opened.append(name)
            a.release()                                # A ends between B's open and B's flock
        return f
    monkeypatch.setattr(rd, "open", late_open, raising=False)
    b = claim(str(out))
    monkeypatch.undo()
    assert (out / LOCK).exists() and (out / LOCK).read_text().strip() == str(os.getpid())
    with pytest.raises(RunDirError, match="in use by another lowmem run"):
        claim(str(out))                                # C: the file B holds
    b.release()
    assert not (out / LOCK).exists()
