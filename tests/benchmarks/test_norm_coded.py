"""benchmarks/norm_coded.py: both ways of each pass write the same bytes on its arrays; a run
prints every pass of every shape; bad input is the parser's error. Nothing is timed."""
import os
import sys

import numpy as np
import pytest

from lowmem.system import threads
from lowmem.units import norm_cpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))

pytestmark = pytest.mark.skipif(not norm_cpu.AVAILABLE, reason="the coded passes are numba's")


def test_the_two_ways_write_the_same_bytes():
    import norm_coded
    for name, (separate, coded, written) in norm_coded.passes(3, 700, 4, np.random.default_rng(1)).items():
        got = []
        for way in (separate, coded):
            for a in written:
                a[...] = 0                      # the backward adds into dgamma and dbeta: from 0 each way
            way()
            got.append([a.copy() for a in written])
        for a, w in zip(*got):
            np.testing.assert_array_equal(a, w, err_msg=name)


def test_a_run_prints_every_pass_of_every_shape(capsys):
    import norm_coded
    before = threads.threads()
    try:
        norm_coded.main(["--shape", "2,300", "--shape", "3,4100", "--rounds", "3", "--threads", "1"])
    finally:
        threads.configure(before)
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if "coded / separate" in line]
    assert len(rows) == 6
    assert {r.split()[0] for r in rows} == {"2x300", "3x4100"}


@pytest.mark.parametrize("argv", [["--shape", "3"], ["--shape", "0,5"], ["--shape", "2,3", "--rounds", "2"]])
def test_bad_input_is_the_parsers_error(argv):
    import norm_coded
    with pytest.raises(SystemExit):
        norm_coded.main(argv)
