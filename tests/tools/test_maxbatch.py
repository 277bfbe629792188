"""lowmem.tools.maxbatch: the largest batch whose plan fits a budget, the budget parser; `lowmem maxbatch` (cli.py)."""
import argparse
import re

import pytest

from lowmem import models
from lowmem.tools.commands.maxbatch import add_arguments as maxbatch_arguments, run as maxbatch_command
from lowmem.tools.maxbatch import max_batch, parse_bytes, planned_engine

TINY = (3, 8, 8)


def tiny():
    return models.preact_resnet_cifar(8, num_classes=4)


def total(batch, mode, bits, shape=TINY, net=tiny, dtype="float32"):
    return planned_engine(net, batch, shape, mode, bits, dtype).plan.total_bytes


@pytest.mark.parametrize("mode, bits", [("exact", 8), ("approx", 8), ("approx", 4), ("approx", 2),
                                        ("approx", 1), ("naive", 4)])
@pytest.mark.parametrize("extra", [0, 1, 12345])
def test_batch_fits_and_the_next_does_not(mode, bits, extra):
    budget = total(37, mode, bits) + extra
    n = max_batch(tiny, TINY, budget, mode, bits)
    assert total(n, mode, bits) <= budget < total(n + 1, mode, bits)
    assert n >= 37


def test_conv_workspace_cap_and_model_tuple():
    # a 2 KiB workspace bound caps conv.cols at small batches: the plan is not affine there
    shape = (3, 16, 16)
    for budget in (3 << 20, 50 << 20):
        n = max_batch(("preact-cifar", 8, 4), shape, budget, "approx", 4, workspace_bytes=2048)
        t = [planned_engine(("preact-cifar", 8, 4), b, shape, "approx", 4, workspace_bytes=2048).plan.total_bytes
             for b in (n, n + 1)]
        assert t[0] <= budget < t[1]


def test_imagenet_and_float64():
    net = lambda: models.preact_resnet_imagenet(18, num_classes=5)     # noqa: E731
    shape = (3, 64, 64)
    budget = 300 << 20
    n = max_batch(net, shape, budget, "exact", 8, "float64")
    assert total(n, "exact", 8, shape, net, "float64") <= budget < total(n + 1, "exact", 8, shape, net, "float64")


def test_limit_and_too_small_budget():
    assert max_batch(tiny, TINY, 1 << 40, "approx", 4, limit=64) == 64
    with pytest.raises(ValueError, match="even a batch of 1 needs"):
        max_batch(tiny, TINY, 1000, "exact")
    with pytest.raises(ValueError, match="budget_bytes must be a positive int"):
        max_batch(tiny, TINY, 0, "exact")
    with pytest.raises(ValueError, match="model in"):
        max_batch(("vgg", 16, 10), TINY, 1 << 30, "exact")


@pytest.mark.parametrize("text, n", [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000),
                                     ("1000000", 1_000_000), ("1000000B", 1_000_000), ("64 kib", 65536),
                                     ("0.5TiB", 1 << 39), ("3KB", 3000), (" 7 MB ", 7_000_000)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text, words", [("2G", "ambiguous"), ("lots", "cannot read"), ("", "cannot read"),
                                         ("-1GiB", "at least 1 byte"), ("2 PiB", "unknown unit"),
                                         ("1.5", "whole number"), ("0", "at least 1 byte"),
                                         ("1e9", "cannot read"), ("2GiB3", "cannot read")])
def test_parse_bytes_errors(text, words):
    with pytest.raises(ValueError, match=words):
        parse_bytes(text)


def parser():
    p = argparse.ArgumentParser(prog="lowmem maxbatch")
    maxbatch_arguments(p)
    return p


def test_bad_budget_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(["--budget", "2G"])
    assert e.value.code == 2
    assert "ambiguous" in capsys.readouterr().err


def test_cli_prints_batch_and_plan_by_kind(capsys):
    args = parser().parse_args(["--depth", "8", "--input", "3x8x8", "--classes", "4", "--budget", "2MiB",
                                "--mode", "approx", "--bits", "2"])
    assert maxbatch_command(args) == 0
    out = capsys.readouterr().out
    n = int(re.search(r"largest batch (\d+)", out).group(1))
    assert total(n, "approx", 2) <= 2 << 20 < total(n + 1, "approx", 2)
    for kind in ("params", "buffers", "saved", "workspace", "total"):
        assert re.search(rf"^  {kind}\s+[\d,]+", out, re.M), kind
    assert "measured" not in out


def test_cli_verify_measures_a_real_step(capsys):
    # the plan fills the budget to within one sample; what it does not count (the engine's
    # Python objects, ~0.1 MiB here, and small temporaries) can push the measured peak over,
    # which --verify reports with a suggested --reserve
    argv = ["--depth", "8", "--input", "3x16x16", "--classes", "4", "--budget", "16MiB",
            "--mode", "approx", "--bits", "4", "--verify"]
    rc = maxbatch_command(parser().parse_args(argv))
    out = capsys.readouterr().out
    assert "measured (tracemalloc, 2 training steps" in out
    if rc == 1:
        assert "is OVER the budget" in out
        reserve = re.search(r"rerun with --reserve (\d+MiB)", out).group(1)
    else:
        assert rc == 0 and "is within the budget" in out
        reserve = "1MiB"
    assert maxbatch_command(parser().parse_args(argv + ["--reserve", reserve])) == 0
    out = capsys.readouterr().out
    assert "less a reserve of" in out
    assert re.search(r"verify: measured steady-state peak .* is within the budget", out)


def test_reserve_must_be_below_budget():
    args = parser().parse_args(["--depth", "8", "--input", "3x8x8", "--budget", "1MiB", "--reserve", "1MiB"])
    with pytest.raises(ValueError, match="--reserve .* must be smaller than --budget"):
        maxbatch_command(args)


SMALLEST_DEPTH = {"preact-cifar": 8, "preact-imagenet": 18, "vgg-bn": 11, "resnet": 18, "densenet": 121,
                  "mobilenet": 2}


@pytest.mark.parametrize("model", sorted(models.MODELS))
def test_every_registered_model_gets_its_largest_batch(model):
    """The search starts at the smallest batch batch norm allows (VGG-BN at
    3x32x32 has a 1x1 last stage: batch 1 is refused, so maxbatch always failed)."""
    spec = models.model_spec(model)
    depth = SMALLEST_DEPTH.get(model, 10)
    factory = lambda: models.build_model(model, depth)                # noqa: E731
    shape = spec.input_shape
    first = 2 if model == "vgg-bn" else 1
    plan = lambda n: planned_engine(factory, n, shape).plan.total_bytes   # noqa: E731
    for budget in (plan(first), plan(first) + 1, 3 * plan(first)):
        n = max_batch(factory, shape, budget)
        assert n >= first and plan(n) <= budget < plan(n + 1), (model, budget, n)
    with pytest.raises(ValueError, match=f"even a batch of {first} needs"):
        max_batch(factory, shape, plan(first) - 1)


def test_cli_maxbatch_vgg_bn_at_32x32(capsys):
    args = parser().parse_args(["--model", "vgg-bn", "--depth", "11", "--input", "3x32x32", "--budget", "300MiB"])
    assert maxbatch_command(args) == 0
    n = int(re.search(r"largest batch (\d+)", capsys.readouterr().out).group(1))
    assert n >= 2


def test_verify_names_what_went_over(capsys, monkeypatch):
    """--verify, when over: the step's temporaries beyond the plan's stated bound are named as
    arrays the plan does not count, apart from the engine's Python objects."""
    from lowmem.tools import peak_memory
    from lowmem.tools.peak_memory import MemoryMeasurement
    seen = {}

    def fake(net, n, shape, mode, bits, dtype, steps, workspace_bytes):
        eng = planned_engine(net, n, shape, mode, bits, dtype, workspace_bytes)
        plan, stated = eng.plan.total_bytes, eng.plan.temporary_bytes
        seen.update(plan=plan, stated=stated)
        return MemoryMeasurement(plan, plan + 100_000, [plan + 100_000 + stated + (3 << 20)] * 2, 0, 0,
                                 "tracemalloc")

    monkeypatch.setattr(peak_memory, "measure_peak", fake)
    argv = ["--depth", "8", "--input", "3x16x16", "--classes", "4", "--budget", "16MiB", "--verify"]
    assert maxbatch_command(parser().parse_args(argv)) == 1
    out = capsys.readouterr().out
    assert "is OVER the budget" in out
    assert "3.00 MiB more than the plan's stated bound" in out and "arrays the plan does not count" in out
    assert "the engine's Python objects 97.66 KiB" in out
    assert re.search(r"rerun with --reserve \d+MiB", out)
    assert "Python objects, small temporaries" not in out
