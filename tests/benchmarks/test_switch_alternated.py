"""benchmarks/switch_alternated.py: a setting is a lowmem module's existing name and a literal
(anything else is the parser's error); a run alternates the two sides on one engine, prints both
and their ratio, and leaves the setting as it was. Nothing is timed: the figures are not checked."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))


@pytest.mark.parametrize("argv, message", [
    (["--set", "SIDE_BY_SIDE"], "MODULE.NAME=VALUE"),
    (["--set", "numpy.pi=3"], "a setting of lowmem's"),
    (["--set", "lowmem.ops.nothing.X=1"], "no module"),
    (["--set", "lowmem.ops.conv.NOPE=1"], "has no setting"),
    (["--set", "lowmem.ops.conv.SIDE_BY_SIDE=maybe"], "Python literal"),
    (["--set", "lowmem.ops.conv.SIDE_BY_SIDE=False", "--rounds", "0"], "at least 1"),
])
def test_bad_input_is_the_parsers_error(capsys, argv, message):
    import switch_alternated
    with pytest.raises(SystemExit):
        switch_alternated.main(argv)
    assert message in capsys.readouterr().err


def test_a_run_alternates_the_setting_and_restores_it(capsys, monkeypatch):
    import switch_alternated
    from lowmem.ops import conv
    seen = []
    real = conv.conv2d_backward

    def spy(*args, **kwargs):
        seen.append(conv.SIDE_BY_SIDE)
        return real(*args, **kwargs)
    monkeypatch.setattr("lowmem.core.optable.conv.conv2d_backward", spy)
    assert switch_alternated.main(["--set", "lowmem.ops.conv.SIDE_BY_SIDE=False", "--depth", "8", "--batch", "4",
                                   "--config", "exact", "--rounds", "2", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "as is (True)" in out and "set (lowmem.ops.conv.SIDE_BY_SIDE=False)" in out and "over 2 rounds" in out
    assert conv.SIDE_BY_SIDE is True and set(seen) == {True, False}
