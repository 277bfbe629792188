"""lowmem.train.stop: signals, the time limit, requests, and the agreement of ranks on one stop."""
import os
import signal

import numpy as np

from lowmem.system import distributed
from lowmem.train.stop import Stop


def test_the_first_reason_wins_and_the_time_limit_counts_from_the_start():
    stop = Stop(distributed.SingleProcess(), time_limit=1e-9)
    assert stop.reason is None
    stop.check_time()
    stop.request("stopped")
    assert stop.reason == "time-limit"
    assert Stop(distributed.SingleProcess(), time_limit=None).reason is None


def test_a_signal_requests_a_stop_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    stop = Stop(distributed.SingleProcess())
    with stop.signals():
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.reason == "signal" and stop.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


class Ranks(distributed.Communicator):
    """Rank 0 of a pretend 2-rank world whose other rank saw `other` (SIGINT, SIGTERM, time, request)."""
    size = 2

    def __init__(self, other):
        self.other = np.array(other, np.float64)

    def allreduce(self, a):
        a += self.other


def test_ranks_agree_on_the_stop_and_keep_the_signal_one_of_them_saw():
    stop = Stop(Ranks([1, 0, 0, 0]))          # Ctrl-C on the other rank
    stop.agree()
    assert stop.reason == "signal" and stop.signum == signal.SIGINT        # not SIGTERM: exit 130
    stop = Stop(Ranks([0, 1, 0, 0]))
    stop.agree()
    assert stop.signum == signal.SIGTERM
    stop = Stop(Ranks([0, 0, 1, 0]))
    stop.agree()
    assert stop.reason == "time-limit" and stop.signum is None
    stop = Stop(Ranks([0, 0, 0, 0]))
    stop.agree()
    assert stop.reason is None
