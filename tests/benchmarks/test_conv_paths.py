"""benchmarks/conv_paths.py: each path sets what it names and puts the modules back; a run prints
every path of every shape; bad input is the parser's error. Nothing is timed."""
import os
import sys

import numpy as np
import pytest

from lowmem.ops import winograd, winograd4
from lowmem.system import threads

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))

pytestmark = pytest.mark.skipif(not winograd.AVAILABLE, reason="the paths are numba's")


def test_each_path_sets_its_switches_and_restores_them():
    import conv_paths
    before = (winograd.ENABLED, winograd.SPLIT_PLANES, winograd.MIN_BLOCK, winograd.WORK_GRAIN, winograd.PLANE_CHANNELS,
              winograd4.ENABLED, winograd4.MIN_OUTPUTS, winograd4.MIN_SIDE)
    with conv_paths.path("batch-split"):
        assert winograd.SPLIT_PLANES is False and winograd.MIN_BLOCK > 1 << 30
        assert not winograd._split_planes(16, 4, 512 * 512, winograd.numpy.empty(1 << 20), 1)
    with conv_paths.path("split-planes"):
        assert winograd.PLANE_CHANNELS == 1                 # any channels: DenseNet's 128 -> 32 convs too
    with conv_paths.path("im2col"):
        assert winograd.ENABLED is False
    from lowmem.ops import conv
    flip = conv.FLIP_COLUMNS
    with conv_paths.path("im2col-unflipped"):
        assert winograd.ENABLED is False and conv.FLIP_COLUMNS > 1 << 40
        g, c = np.zeros((4, 1 << 12), np.float32), np.zeros((64, 1 << 12), np.float32)
        assert conv.weight_operands(np, g, c)[2] is False
    assert conv.FLIP_COLUMNS == flip and conv.weight_operands(np, g, c)[2] is True
    with conv_paths.path("f4"):
        assert winograd.scheme(1, 4, 4) is winograd.F4
    with conv_paths.path("f2"):
        assert winograd.scheme(64, 64, 64) is winograd.F2
    assert (winograd.ENABLED, winograd.SPLIT_PLANES, winograd.MIN_BLOCK, winograd.WORK_GRAIN, winograd.PLANE_CHANNELS,
            winograd4.ENABLED, winograd4.MIN_OUTPUTS, winograd4.MIN_SIDE) == before


def test_a_run_prints_every_path_of_every_shape(capsys):
    pytest.importorskip("threadpoolctl")
    import conv_paths
    before = threads.threads()
    try:
        conv_paths.main(["--shape", "16,16,4,2", "--shape", "16,24,5,1", "--shape", "32,16,2,2,1", "--rounds", "3",
                         "--threads", "1"])
    finally:
        threads.configure(before)
    out = capsys.readouterr().out
    assert out.count("Cin 16, Cout 16, 3x3 on 4x4, batch 2") == 1 and out.count("Cin 16, Cout 24, 3x3 on 5x5, batch 1") == 1
    assert out.count("Cin 32, Cout 16, 1x1 on 2x2, batch 2") == 1
    for name in conv_paths.PATHS:
        assert out.count(f"  {name} ") == 3
    assert out.count("   both ") == 3 * len(conv_paths.PATHS)


def test_the_apart_path_runs_both_gradients_one_after_the_other():
    import conv_paths
    from lowmem.ops import conv
    with conv_paths.path("apart"):
        assert conv.SIDE_BY_SIDE is False
    assert conv.SIDE_BY_SIDE is True


@pytest.mark.parametrize("argv, message", [
    (["--shape", "16,16,4"], "Cin,Cout,H,N"),
    (["--shape", "16,16,4,2,5"], "kernel k is 1 or 3"),
    (["--shape", "16,0,4,2"], "positive"),
    (["--shape", "16,16,4,2", "--paths", "engine,f8"], "unknown path"),
    (["--shape", "16,16,4,2", "--rounds", "2"], "at least 3"),
])
def test_bad_input_is_the_parsers_error(capsys, argv, message):
    import conv_paths
    with pytest.raises(SystemExit):
        conv_paths.main(argv)
    assert message in capsys.readouterr().err
