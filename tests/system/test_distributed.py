"""Data-parallel training over MPI: 2 processes on this machine, one BLAS thread each.

* with synchronized batch norm, 2 ranks at per-rank batch 4 reach the parameters of 1 rank at
  batch 8 (the same global batches), in exact and approx modes;
* without it, every rank ends with bitwise the same parameters and running statistics;
* a rank that raises, or is killed, ends the whole job quickly with a non-zero exit.
Skipped when mpi4py (lowmem[mpi]) or an mpiexec beside the interpreter is missing."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lowmem.system import distributed

pytest.importorskip("mpi4py")
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install lowmem[mpi])")
WORKER = Path(__file__).with_name("mpi_worker.py")
sys.path.insert(0, str(WORKER.parent))
ROOT = WORKER.parents[2]                                  # the repository
import mpi_worker  # noqa: E402


def launch(tmp_path, mode, sync_bn, dtype, action="train", n=2, timeout=120, extra=()):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1", LOWMEM_THREADS="1")
    out = tmp_path / "state"
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", str(WORKER), mode,
           "1" if sync_bn else "0", dtype, str(out), action, *map(str, extra)]
    t = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                       cwd=str(ROOT))
    states = [dict(np.load(f"{out}.rank{k}.npz")) for k in range(n) if os.path.exists(f"{out}.rank{k}.npz")]
    return r, states, time.monotonic() - t


@pytest.mark.parametrize("mode,dtype,tol", [("exact", "float64", 1e-9), ("approx", "float64", 1e-6),
                                            ("exact", "float32", 2e-4), ("approx", "float32", 2e-3)])
def test_sync_bn_over_two_ranks_equals_one_rank_at_the_global_batch(tmp_path, mode, dtype, tol):
    r, states, _ = launch(tmp_path, mode, True, dtype)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world 2 ranks, MPI (MPICH" in r.stdout
    one = mpi_worker.train(distributed.SingleProcess(), mode, False, dtype)
    for state in states:
        for name, want in one.items():
            err = np.linalg.norm(state[name] - want) / max(np.linalg.norm(want), 1e-30)
            assert err < tol, (name, err)


@pytest.mark.parametrize("mode,dtype,tol", [("exact", "float64", 1e-9), ("approx", "float64", 1e-6),
                                            ("approx", "float32", 2e-3)])
def test_sync_bn_synchronizes_batch_norms_with_no_relu_after_them(tmp_path, mode, dtype, tol):
    """A post-activation block's batch norm before its add and a depthwise conv's before ReLU6:
    the same two 2C exchanges as a unit's, so 2 ranks reach the parameters and running
    statistics of 1 rank at the global batch."""
    r, states, _ = launch(tmp_path, mode, True, dtype, extra=("nearest", 8, "standalone"))
    assert r.returncode == 0, r.stderr[-3000:]
    one = mpi_worker.train(distributed.SingleProcess(), mode, False, dtype, model="standalone")
    assert len(states) == 2
    for state in states:
        for name, want in one.items():
            err = np.linalg.norm(state[name] - want) / max(np.linalg.norm(want), 1e-30)
            assert err < tol, (name, err)


@pytest.mark.parametrize("rounding,global_batch", [("stochastic-window", 8), ("stochastic", 128)])
def test_stochastic_draws_do_not_depend_on_the_split(tmp_path, rounding, global_batch):
    """With sync_bn, 2 ranks draw the codes 1 rank at the global batch draws (the stream follows the
    element's global index, not the rank): the same parameters within float64 rounding. The
    unbiased code needs each rank's rows to be whole groups of 256 (64 samples of the 2x2 units)."""
    r, states, _ = launch(tmp_path, "approx", True, "float64", extra=(rounding, global_batch))
    assert r.returncode == 0, r.stderr[-3000:]
    one = mpi_worker.train(distributed.SingleProcess(), "approx", False, "float64", rounding=rounding,
                           global_batch=global_batch)
    assert len(states) == 2
    for state in states:
        for name, want in one.items():
            err = np.linalg.norm(state[name] - want) / max(np.linalg.norm(want), 1e-30)
            assert err < 1e-6, (name, err)


@pytest.mark.parametrize("mode", ["exact", "approx"])
def test_without_sync_bn_every_rank_holds_bitwise_the_same_model(tmp_path, mode):
    r, states, _ = launch(tmp_path, mode, False, "float32")
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(states) == 2
    for name in states[0]:
        np.testing.assert_array_equal(states[0][name], states[1][name], err_msg=name)
    one = mpi_worker.train(distributed.SingleProcess(), mode, False, "float32")
    moved = sum(np.abs(states[0][k] - one[k]).max() > 0 for k in one)
    assert moved > 0            # per-replica statistics: not the 1-rank model, but one model


@pytest.mark.parametrize("action,words", [("raise", "rank 1 fails on purpose"), ("kill", "signal 9")])
def test_a_failing_rank_ends_the_job(tmp_path, action, words):
    r, states, _ = launch(tmp_path, "approx", False, "float32", action, timeout=60)  # ends, no hang
    assert r.returncode != 0 and not states
    assert words in r.stdout + r.stderr


def test_shard_refuses_an_uneven_split():
    class Two(distributed.Communicator):
        rank, size = 1, 2
    assert distributed.shard(8, Two()) == slice(4, 8)
    with pytest.raises(ValueError, match="batch 7 does not split evenly over 2 ranks"):
        distributed.shard(7, Two())


def test_one_process_needs_no_mpi(monkeypatch):
    for var in distributed._SIZE_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    comm = distributed.get_communicator()
    assert isinstance(comm, distributed.SingleProcess) and comm.describe() == "world 1 rank, single process"


# ------------------------------------------------------------------ mpiexec -n 2 lowmem train

TRAIN = ["train", "--dataset", "synthetic", "--limit-train", "64", "--limit-test", "24", "--depth", "8",
         "--batch", "16", "--lr", "0.05", "--dtype", "float64", "--no-progress", "--warmup-iters", "0",
         "--schedule", "constant"]     # the lr then does not depend on --epochs (resume below)


def lowmem_cli(args, n=1, timeout=240):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1", LOWMEM_THREADS="1")
    for var in distributed._SIZE_VARIABLES:     # a plain run must not think it was launched
        env.pop(var, None)
    cmd = [sys.executable, "-m", "lowmem"] + args
    if n > 1:
        cmd = [MPIEXEC, "-n", str(n)] + cmd
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=str(ROOT))


def weights(run_dir):
    from lowmem.train.checkpoint import load_checkpoint
    arrays, meta = load_checkpoint(str(run_dir / "checkpoint.ckpt"))
    return {k: v for k, v in arrays.items() if k.startswith(("net/", "momentum/"))}, meta


def close(a, b, tol):
    for k in a:
        err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
        assert err < tol, (k, err)


def test_mpiexec_lowmem_train_is_one_model_and_resumes_with_any_number_of_ranks(tmp_path):
    """--sync-bn over 2 ranks trains the 1-rank model (same global batches and augmentation);
    a 2-rank run resumed by 1 rank ends where an uninterrupted run does."""
    one, two, mixed = tmp_path / "one", tmp_path / "two", tmp_path / "mixed"
    r1 = lowmem_cli(TRAIN + ["--epochs", "2", "--out", str(one)])
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = lowmem_cli(TRAIN + ["--epochs", "2", "--sync-bn", "--out", str(two)], n=2)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "world 2 ranks, MPI (MPICH" in r2.stdout and "per-rank batch 8" in r2.stdout
    assert r2.stdout.count("final test accuracy") == 1                 # rank 0 reports
    (w1, m1), (w2, m2) = weights(one), weights(two)
    assert m1["iteration"] == m2["iteration"] == 8
    close(w2, w1, 1e-9)
    r3 = lowmem_cli(TRAIN + ["--epochs", "1", "--sync-bn", "--out", str(mixed)], n=2)
    assert r3.returncode == 0, r3.stderr[-3000:]
    r4 = lowmem_cli(["train", "--out", str(mixed), "--resume", "--epochs", "2"])
    assert r4.returncode == 0, r4.stderr[-3000:]
    close(weights(mixed)[0], w1, 1e-9)
    epochs = [json.loads(line) for line in (mixed / "metrics.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in epochs if e.get("event") == "epoch"] == [1, 2]


def test_mpiexec_refuses_a_batch_the_ranks_do_not_divide(tmp_path):
    r = lowmem_cli(TRAIN + ["--batch", "15", "--epochs", "1", "--out", str(tmp_path / "r")], n=2, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "batch 15 does not split evenly over 2 ranks" in r.stderr


# ------------------------------------------------------------ ranks agree at start-up

def mpmd(first, second, timeout=120):
    """mpiexec -n 1 lowmem FIRST : -n 1 lowmem SECOND (each rank its own command line)."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1", LOWMEM_THREADS="1")
    for var in distributed._SIZE_VARIABLES:
        env.pop(var, None)
    cmd = [MPIEXEC, "-n", "1", sys.executable, "-m", "lowmem"] + first + [":", "-n", "1", sys.executable,
                                                                          "-m", "lowmem"] + second
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=str(ROOT))


@pytest.mark.parametrize("option,ours,theirs,words", [
    ("--depth", "8", "14", "depth is 8 on rank 0, 14 on rank 1"),
    ("--seed", "0", "1", "seed is 0 on rank 0, 1 on rank 1")])
def test_ranks_started_with_other_settings_refuse_together_with_one_line(tmp_path, option, ours, theirs, words):
    args = TRAIN + ["--epochs", "1", "--out", str(tmp_path / "run")]
    args = [a for a in args if a not in ("--depth", "8")] if option == "--depth" else args
    r = mpmd(args + [option, ours], args + [option, theirs])
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines == [f"lowmem train: error: ranks disagree on their configuration: {words}; start every rank "
                     f"with the same options"], r.stderr[-2000:]
    assert not (tmp_path / "run").exists()                # refused before any folder was made


def test_a_run_refused_on_one_rank_at_start_up_leaves_no_run_folder(tmp_path):
    """Rank 1 cannot read its data (its settings agree; its file system does not): every rank refuses,
    and rank 0 removes the folder it had just made."""
    out = tmp_path / "run"
    args = ["train", "--dataset", "fashion-mnist", "--depth", "8", "--batch", "16", "--no-progress",
            "--out", str(out), "--data", str(tmp_path / "missing")]
    r = lowmem_cli(args, n=2, timeout=60)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert r.stderr.count("Fashion-MNIST not found") == 1 and "MPI_Abort" not in r.stderr
    assert not out.exists()


def rank_pid(tag, rank, timeout=60):
    """The pid of the process of MPI rank `rank` whose environment holds LOWMEM_TEST_TAG=tag."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if f"LOWMEM_TEST_TAG={tag}".encode() in env and f"PMI_RANK={rank}".encode() in env:
                return int(pid)
        time.sleep(0.2)
    raise AssertionError(f"no rank {rank} process found")


def wait_until_caught(pid, signum, timeout=60):
    """Wait until process pid has a handler for signum (its SigCgt mask in /proc): the trainer
    installs its SIGINT/SIGTERM handlers when fit() starts, after rank 0 printed its plan."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("SigCgt:") and int(line.split()[1], 16) >> (signum - 1) & 1:
                return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} installed no handler for signal {signum}")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank's pid in /proc")
def test_ctrl_c_on_one_rank_is_reported_as_sigint_by_every_rank(tmp_path):
    import signal
    out = tmp_path / "run"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1", LOWMEM_THREADS="1",
               LOWMEM_TEST_TAG=str(tmp_path))
    for var in distributed._SIZE_VARIABLES:
        env.pop(var, None)
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "lowmem"] + TRAIN + ["--epochs", "10000", "--out", str(out)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         cwd=str(ROOT))
    try:
        for line in p.stdout:               # rank 0 prints the plan, then trains
            if line.startswith("training:"):
                break
        pid = rank_pid(str(tmp_path), 1)
        wait_until_caught(pid, signal.SIGTERM)      # Python catches SIGINT from start-up; SIGTERM: fit()'s
        os.kill(pid, signal.SIGINT)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, (p.returncode, stderr[-2000:])
    assert "stopped (SIGINT)" in stdout and "SIGTERM" not in stdout + stderr
