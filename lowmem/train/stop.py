"""When a training run stops early: signals, a time limit, a caller's request, and ranks that agree.

    stop = Stop(comm, time_limit=3600)
    with stop.signals():                  # SIGINT / SIGTERM: stop at the next step boundary
        for step in ...:
            ...
            stop.check_time()             # the time limit, measured from Stop's creation
            stop.agree()                  # MPI: every rank stops at the same step
            if stop.reason: break

`reason` is None while the run goes on, then "signal", "time-limit" or the
reason passed to `request` ("stopped" by default); the first reason wins.
`signum` is the signal that stopped it. A second Ctrl-C while stopping
raises KeyboardInterrupt at once (the last checkpoint stays).

Data parallel: a signal or a time limit may reach one rank only, and every
rank must take the same steps (each step is an allreduce). `agree()` sums
one small vector over the ranks after every step: how many ranks saw
SIGINT, SIGTERM, the time limit, or another request; so all ranks stop at
the same step, for the same reason and the same signal (Ctrl-C on one rank
is reported as SIGINT, exit 130, on every rank).
"""
import contextlib
import signal
import threading
import time

import numpy

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stop:
    """The stop decision of one run (module docstring)."""

    def __init__(self, comm, time_limit=None):
        self.comm, self.time_limit = comm, time_limit
        self.started = time.monotonic()
        self.reason = None
        self.signum = None

    def request(self, reason="stopped"):
        """Stop at the next step boundary (after writing a checkpoint)."""
        self.reason = self.reason or reason

    def check_time(self):
        if self.time_limit and time.monotonic() - self.started >= self.time_limit:
            self.request("time-limit")

    @contextlib.contextmanager
    def signals(self):
        """SIGINT / SIGTERM request a stop while inside; the old handlers come back after.
        Only the main thread can set handlers: elsewhere this does nothing."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self.signum is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.signum = signum           # no printing here: the handler may interrupt a print
            self.request("signal")

        old = {s: signal.signal(s, handler) for s in SIGNALS}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def agree(self):
        """Data parallel: take the stop of any rank (a no-op for one process)."""
        if self.comm.size == 1:
            return
        seen = numpy.array([self.signum == signal.SIGINT, self.signum == signal.SIGTERM,
                            self.reason == "time-limit", self.reason not in (None, "signal", "time-limit")],
                           numpy.float64)
        self.comm.allreduce(seen)
        if seen[0] or seen[1]:
            self.signum = self.signum or (signal.SIGINT if seen[0] else signal.SIGTERM)
            self.request("signal")
        elif seen[2]:
            self.request("time-limit")
        elif seen[3]:
            self.request()


class Interrupted(BaseException):
    """SIGINT or SIGTERM before a run's first step (`preparing`): nothing to save, so the work
    under way (loading data, measuring --bits auto) ends at once. `signum`: the signal."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def preparing():
    """While inside, SIGINT / SIGTERM raise Interrupted (the old handlers come back after); only
    in the main thread (elsewhere this does nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
