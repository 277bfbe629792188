"""lowmem.train.stop: signals, the time limit, requests, and the agreement of ranks on one stop."""
import os
import signal

import numpy as np
import pytest

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


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_while_measuring_bits_auto_ends_in_one_line_and_leaves_no_folder(tmp_path, capsys,
                                                                                 monkeypatch, sig, code):
    from lowmem.bits import auto
    from lowmem.tools import cli
    real = auto.measure_sensitivity

    def measuring(*a, **k):                         # the signal arrives during the measurement
        os.kill(os.getpid(), sig)
        return real(*a, **k)
    monkeypatch.setattr(auto, "measure_sensitivity", measuring)
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    out = tmp_path / "run"
    rc = cli.main(["train", "--dataset", "synthetic", "--limit-train", "32", "--limit-test", "16", "--depth", "8",
                   "--batch", "16", "--no-progress", "--bits", "auto", "--avg-bits", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == code
    assert err.strip() == (f"lowmem train: error: stopped by {signal.Signals(sig).name} while preparing the run "
                           f"(loading data, measuring --bits auto); nothing was trained and no checkpoint written")
    assert not out.exists()                          # the folder made for the run goes again
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
