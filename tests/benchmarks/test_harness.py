"""benchmarks/harness.py: a worker's result comes back with what the parent saw; a disturbed run is
rerun and its attempts kept; a worker over the memory limit is killed and says so; a failing
one names its error; the peak memory of a step is what it allocated; rounds rotate; the machine
is named. Nothing is timed."""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import harness                                                   # noqa: E402

WORKER = "import json; print('noise'); print('RESULT ' + json.dumps({'step_s': [0.5], 'x': 1}))"


def quiet(**kw):
    """No waiting for a quiet machine and, unless asked, no reruns (the machine may be shared)."""
    return harness.Supervision(**dict(dict(max_wait=0, max_others=float("inf")), **kw))


def test_a_workers_result_comes_back_with_what_the_parent_saw():
    r = harness.run_supervised([sys.executable, "-c", WORKER], quiet(), print)
    assert r["status"] == "ok" and r["x"] == 1 and r["step_s"] == [0.5]
    for key in ("load_before", "load_after", "watched_max_rss", "cpus_busy_during", "other_cpus_during", "wall_s"):
        assert key in r, key
    assert "disturbed_attempts" not in r


def test_a_disturbed_run_is_rerun_and_its_attempts_kept():
    # max_others below zero: every run counts as disturbed, so each retry happens
    logged = []
    r = harness.run_supervised([sys.executable, "-c", WORKER], quiet(max_others=-1, retries=2), logged.append,
                               label="probe")
    assert r["status"] == "ok" and len(r["disturbed_attempts"]) == 2
    assert all(a["x"] == 1 for a in r["disturbed_attempts"])
    assert len(logged) == 2 and all(m.startswith("  probe: other processes used") for m in logged)
    once = harness.run_supervised([sys.executable, "-c", WORKER], quiet(max_others=-1, retries=2), print, timed=False)
    assert "disturbed_attempts" not in once                      # memory-only runs are not repeated


def test_a_failing_or_killed_worker_says_why():
    r = harness.run_supervised([sys.executable, "-c", "raise SystemExit('no such model: foo')"], quiet(), print)
    assert r["status"] == "failed (exit 1): no such model: foo"
    hog = "import time; a = bytearray(400 << 20); time.sleep(30)"
    r = harness.run_supervised([sys.executable, "-c", hog], quiet(mem_limit=100 << 20), print)
    assert r["status"].startswith("killed (RSS limit) at RSS") and r["watched_max_rss"] > 100 << 20
    r = harness.run_supervised([sys.executable, "-c", "import time; time.sleep(30)"], quiet(timeout=0.5), print)
    assert r["status"].startswith("killed (timeout)")
    done = harness.run_supervised([sys.executable, "-c", WORKER], quiet(), print, done=lambda res: "kinds" in res)
    assert done["status"].startswith("failed (exit 0)")           # finished, but not with what was asked


def test_the_peak_of_a_step_is_what_it_allocated():
    if not harness.reset_peak():
        pytest.skip("this kernel does not let a process reset its peak resident size")
    base = harness.rss_now()
    harness.reset_peak()
    assert harness.rss_peak() - base < 8 << 20
    a = bytearray(64 << 20)
    a[::4096] = b"\x01" * (16 << 10)                            # every page written: resident (a calloc'd
                                                                  # block may be untouched zero pages)
    del a
    assert 60 << 20 < harness.rss_peak() - base < 80 << 20
    assert harness.rss_now() - base < 8 << 20                     # freed, yet the peak stays


def test_rounds_rotate_and_the_figure_is_the_median_of_the_rounds_medians():
    names = ["a", "b", "c"]
    assert [harness.rotated(names, r) for r in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                             ["a", "b", "c"]]
    assert harness.median_of_medians([{"step_median": v} for v in (3.0, 1.0, 2.0, 10.0)]) == 2.5


def test_the_machine_is_named():
    info = harness.machine_info()
    line = harness.machine_line(info)
    assert info["isa"] in ("AVX-512", "AVX2", "AVX", "SSE") and info["isa"] in line
    assert f"({os.cpu_count()} CPUs)" in line and info["cpu"] in line
    assert (info["isa"] == "AVX-512") == info["avx512f"]
    if info["cores"]:
        assert f"{info['cores']} cores" in line
    assert harness.isa({"avx2", "fma"}) == "AVX2" and harness.isa({"avx512f", "avx2"}) == "AVX-512"
    assert harness.cpu().endswith(f", {os.cpu_count()} CPUs")
