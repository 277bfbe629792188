"""lowmem/system/threads.py: the split of work over lowmem's threads, and its configuration."""
import threading

import pytest

from lowmem.system import threads

threadpoolctl = pytest.importorskip("threadpoolctl")


@pytest.fixture
def two_threads():
    before = threads.threads()
    assert threads.configure(2) == 2
    yield
    threads.configure(before)


def test_bounds_cover_the_range_once():
    for n, parts in [(10, 3), (7, 7), (128, 2), (5, 1)]:
        cut = threads.bounds(n, parts)
        assert cut[0] == 0 and cut[-1] == n and len(cut) == parts + 1
        assert all(b - a in (n // parts, n // parts + 1) for a, b in zip(cut, cut[1:]))


def test_parallel_for_runs_every_item_once_on_two_threads(two_threads):
    seen, who, lock = [], set(), threading.Lock()

    def body(lo, hi):
        with lock:
            seen.extend(range(lo, hi))
            who.add(threading.get_ident())
    threads.parallel_for(body, 1000, grain=10)
    assert sorted(seen) == list(range(1000))
    assert len(who) == 2


def test_parallel_for_small_work_and_nesting_stay_serial(two_threads):
    calls = []
    threads.parallel_for(lambda lo, hi: calls.append((lo, hi)), 15, grain=10)   # one range of >= 10
    assert calls == [(0, 15)]
    inner = []

    def outer(lo, hi):
        threads.parallel_for(lambda a, b: inner.append((a, b)), 100)   # from inside a range: serial
    threads.parallel_for(outer, 2)
    assert sorted(inner) == [(0, 100), (0, 100)]
    threads.parallel_for(lambda lo, hi: calls.append("never"), 0)
    assert "never" not in calls


def test_parallel_for_reraises_after_every_range_finished(two_threads):
    done = []

    def body(lo, hi):
        if lo == 0:
            raise RuntimeError("range 0 failed")
        done.append(lo)
    with pytest.raises(RuntimeError, match="range 0 failed"):
        threads.parallel_for(body, 4)
    assert done == [2]                        # the other range ran to its end before the raise


def test_configure_keeps_an_explicit_choice_and_holds_blas_at_one(two_threads):
    assert threads.configure() == 2           # what the engine calls: keeps the user's choice
    blas = [d for d in threadpoolctl.threadpool_info() if d["user_api"] == "blas"]
    assert blas and all(d["num_threads"] == 1 for d in blas)
    assert threads.configure(1) == 1 and threads.threads() == 1


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True])
def test_configure_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match="threads must be a positive integer"):
        threads.configure(bad)


def test_lowmem_threads_environment_variable(monkeypatch):
    before = threads.threads()
    monkeypatch.setattr(threads, "_configured", False)
    monkeypatch.setenv("LOWMEM_THREADS", "two")
    with pytest.raises(ValueError, match="LOWMEM_THREADS must be a positive integer, got 'two'"):
        threads.configure()
    monkeypatch.setenv("LOWMEM_THREADS", "1")
    assert threads.configure() == 1
    threads.configure(before)
