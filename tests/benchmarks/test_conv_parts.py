"""benchmarks/conv_parts.py: --stage, --parts, --scheme and --filters pick what runs (a line per
stage or filter shape of each part asked for, the tile kernels' sample count as given), the
planes are laid as the conv lays them, and bad input is the parser's error. Nothing is timed."""
import os
import sys

import pytest

from lowmem.ops import winograd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))

pytestmark = pytest.mark.skipif(not winograd.AVAILABLE, reason="the tile kernels are numba's")


def _run(monkeypatch, capsys, *argv):
    import conv_parts
    monkeypatch.setattr(sys, "argv", ["conv_parts.py", *argv])
    conv_parts.main()
    return capsys.readouterr().out


def test_stages_and_parts_pick_what_runs(monkeypatch, capsys):
    out = _run(monkeypatch, capsys, "--parts", "tiles", "--stage", "16,4,3", "--stage", "32,2", "--batch", "2",
               "--repeat", "1")
    lines = [ln for ln in out.splitlines() if ln.startswith("  C ")]
    assert len(lines) == 2
    assert lines[0].startswith("  C  16,  4x4  (3 samples):") and "(2 samples)" in lines[1]   # at most --batch
    assert "3x3 convs" not in out and "1x1 convs" not in out
    out = _run(monkeypatch, capsys, "--parts", "3x3,1x1", "--stage", "16,4", "--batch", "2", "--repeat", "1")
    assert "tile kernels" not in out and "3x3 convs, batch 2" in out and "1x1 convs, batch 2" in out
    out = _run(monkeypatch, capsys, "--parts", "tiles", "--scheme", "f4", "--stage", "16,8,2", "--repeat", "1")
    assert "Winograd F(4x4, 3x3) tile kernels" in out and out.count("  C  16,  8x8  (2 samples):") == 1
    out = _run(monkeypatch, capsys, "--parts", "filters", "--filters", "4,6", "--filters", "3,2", "--repeat", "1")
    lines = [ln for ln in out.splitlines() if " x " in ln and "F(" in ln]
    assert [ln.split(",")[0].strip() for ln in lines] == ["4 x   6"] * 2 + ["3 x   2"] * 2
    assert all(len(ln.split("|")) == 3 for ln in lines)


def test_tile_planes_laid_as_the_conv_lays_them(monkeypatch):
    import conv_parts
    laid = []
    real = winograd._planes
    monkeypatch.setattr(winograd, "_planes", lambda *a, **k: laid.append(real(*a, **k)) or laid[-1])
    conv_parts.tile_kernels([(16, 8, 2)], 2, 1, winograd.F2)
    assert len(laid) == 2 and all(p.strides[0] % 4096 != 0 for p in laid)   # 16*2*16 tiles: spaced
    laid.clear()
    conv_parts.tile_kernels([(16, 16, 4)], 4, 1, winograd.F4)                 # 16*4*16 tiles, 36 planes
    assert len(laid) == 2 and all(p.shape[0] == 36 and p.strides[0] % 4096 != 0 for p in laid)


@pytest.mark.parametrize("argv,message", [(["--parts", "tilez"], "unknown tilez"),
                                          (["--stage", "3"], "want C,H or C,H,N"),
                                          (["--stage", "16,0"], "want C,H or C,H,N"),
                                          (["--filters", "32"], "want Cout,Cin"),
                                          (["--scheme", "f3"], "invalid choice")])
def test_bad_input_is_the_parsers_error(monkeypatch, capsys, argv, message):
    with pytest.raises(SystemExit):
        _run(monkeypatch, capsys, *argv)
    assert message in capsys.readouterr().err
