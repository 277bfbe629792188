"""lowmem/system/threads.py: the split of work over lowmem's threads, and its configuration."""
import threading

import numpy

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


def test_spin_returns_the_new_value_or_gives_up_after_its_reads():
    spinner = threads._spinner()
    if spinner is None:
        pytest.skip("numba is not installed: the pool uses its locks alone")
    spin, publish_and_spin = spinner
    flag = numpy.array([5], numpy.int64)
    assert spin(flag, 4, 1 << 30) == 5            # already differs: at once
    assert spin(flag, 5, 1000) == 5               # never changes: `seen` after 1,000 reads
    later = threading.Timer(0.05, lambda: flag.__setitem__(0, 6))
    later.start()
    assert spin(flag, 5, 1 << 40) == 6            # another thread's store is seen (not hoisted)
    later.join()
    out = numpy.zeros(1, numpy.int64)             # the store first, then the spin
    assert publish_and_spin(out, 9, flag, 6, 1000) == 6 and out[0] == 9
    seen = []                                     # another thread spinning on `out` sees the store
    watcher = threading.Thread(target=lambda: seen.append(spin(out, 9, 1 << 40)))
    watcher.start()
    assert publish_and_spin(out, 10, flag, 5, 1 << 30) == 6
    watcher.join()
    assert seen == [10]


@pytest.mark.parametrize("spinning", [True, False])
def test_the_pool_with_and_without_the_spin(monkeypatch, spinning):
    """Every item once over many calls in a row, errors after every range, and a resize that
    stops the old workers, whether the workers spin (numba) or only block on their locks."""
    if not spinning:
        monkeypatch.setattr(threads, "_spinner", lambda: None)
    before = threads.threads()
    threads.configure(1)
    try:
        assert threads.configure(3) == 3
        workers = list(threads._pool)
        assert len(workers) == 2
        assert all((w.spin is None) == (not spinning or threads._spinner() is None) for w in workers)
        out = numpy.zeros(64, numpy.int64)

        def body(lo, hi):
            out[lo:hi] += 1
        for _ in range(200):
            threads.parallel_for(body, 64)
        assert (out == 200).all()
        def fails(lo, hi):
            if lo:                                       # the two workers' ranges fail
                raise ValueError(f"range {lo // 4}")
        with pytest.raises(ValueError, match="range 1"):   # the first, after both
            threads.parallel_for(fails, 12)
        threads.configure(2)
        assert not any(w.thread.is_alive() for w in workers) and len(threads._pool) == 1
        threads.parallel_for(body, 64)
        assert (out == 201).all()
    finally:
        threads.configure(before)


def test_two_callers_at_once_each_cover_their_range(two_threads):
    """A call made while another thread's call has the workers runs serially: both complete."""
    results = {}

    def caller(name):
        seen = []
        lock = threading.Lock()

        def body(lo, hi):
            with lock:
                seen.extend(range(lo, hi))
        for _ in range(100):
            threads.parallel_for(body, 50)
        results[name] = sorted(seen)
    ts = [threading.Thread(target=caller, args=(k,)) for k in "ab"]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert results["a"] == results["b"] == sorted(list(range(50)) * 100)


def test_a_wait_cut_short_leaves_the_pool_usable(two_threads):
    """An exception (Ctrl-C) while the caller waits for a worker's range: the next call lets that
    range end first and then runs as usual (nothing hangs, nothing runs twice at once)."""
    w = threads._pool[0]
    started, release = threading.Event(), threading.Event()
    w.start(lambda lo, hi: (started.set(), release.wait(5)), 0, 1)
    started.wait(5)
    threading.Timer(0.05, release.set).start()         # the cut-short wait never took `done`
    out = numpy.zeros(8, numpy.int64)

    def body(lo, hi):
        out[lo:hi] += 1

    def calls():
        threads.parallel_for(body, 8)
        assert (out == 1).all() and release.is_set()
        for _ in range(50):
            threads.parallel_for(body, 8)
    t = threading.Thread(target=calls, daemon=True)      # a pool that hangs fails here, not forever
    t.start()
    t.join(30)
    assert not t.is_alive(), "the pool hung after a wait cut short"
    assert (out == 51).all()
