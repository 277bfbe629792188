"""benchmarks/unit_kernels.py: --shape picks the units timed (handed to the worker as given, the
default ResNet-164's without it), --split-work reaches the worker, which sets the split's
threshold from it; a shape the kernels cannot take, or a threshold under 1, is the parser's error.
Nothing is timed: the supervised worker is replaced by a recorder."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import unit_kernels  # noqa: E402


@pytest.fixture
def commands(monkeypatch):
    seen = []

    def run_supervised(cmd, *args, **kwargs):
        seen.append(cmd)
        return {"status": "recorded"}
    monkeypatch.setattr(unit_kernels.harness, "run_supervised", run_supervised)
    return seen


def test_shapes_reach_the_worker(commands, capsys):
    assert unit_kernels.main(["--shape", "1024,64", "--shape", "128,4096", "--threads", "1"]) == 1   # no table
    cmd = commands[-1]
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--shape"] == ["1024,64", "128,4096"]
    unit_kernels.main(["--threads", "1"])
    assert "--shape" not in commands[-1] and "--split-work" not in commands[-1]   # ResNet-164's shapes, lowmem's split
    assert "kernel table: recorded" in capsys.readouterr().out
    unit_kernels.main(["--threads", "2", "--split-work", "1"])
    cmd = commands[-1]
    assert cmd[cmd.index("--split-work") + 1] == "1"


def test_the_worker_takes_the_split_threshold(monkeypatch):
    from lowmem.units import cpu_base, window_cpu
    monkeypatch.setattr(cpu_base, "SPLIT_WORK", cpu_base.SPLIT_WORK)     # restored after
    monkeypatch.setattr(window_cpu, "AVAILABLE", False)                  # the worker stops after the settings
    monkeypatch.setattr(unit_kernels.harness, "result_line", lambda r: None)
    args = unit_kernels.argparse.Namespace(threads=1, split_work=7, shape=None, bits=4, rounding="nearest")
    assert unit_kernels.worker(args) == 0
    assert cpu_base.SPLIT_WORK == 7


@pytest.mark.parametrize("argv,message", [(["--shape", "64"], "a unit shape is C,M"),
                                          (["--shape", "0,64"], "must be positive"),
                                          (["--shape", "8,3", "--bits", "4"], "M*bits must be a multiple of 8"),
                                          (["--split-work", "0"], "--split-work must be at least 1")])
def test_bad_shapes_are_the_parsers_error(commands, capsys, argv, message):
    with pytest.raises(SystemExit):
        unit_kernels.main(argv)
    assert message in capsys.readouterr().err and not commands
