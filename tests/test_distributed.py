"""Data-parallel training over MPI: 2 processes on this machine, one BLAS thread each.

* with synchronized batch norm, 2 ranks at per-rank batch 4 reach the parameters of 1 rank at
  batch 8 (the same global batches), in exact and approx modes;
* without it, every rank ends with bitwise the same parameters and running statistics;
* a rank that raises, or is killed, ends the whole job quickly with a non-zero exit.
Skipped when mpi4py (lowmem[mpi]) or an mpiexec beside the interpreter is missing."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lowmem import distributed

pytest.importorskip("mpi4py")
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install lowmem[mpi])")
WORKER = Path(__file__).with_name("mpi_worker.py")
sys.path.insert(0, str(WORKER.parent))
import mpi_worker  # noqa: E402


def launch(tmp_path, mode, sync_bn, dtype, action="train", n=2, timeout=120):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    out = tmp_path / "state"
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", str(WORKER), mode,
           "1" if sync_bn else "0", dtype, str(out), action]
    t = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                       cwd=str(WORKER.parent.parent))
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
    r, states, took = launch(tmp_path, "approx", False, "float32", action, timeout=60)
    assert r.returncode != 0 and not states
    assert words in r.stdout + r.stderr
    assert took < 30, took


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
