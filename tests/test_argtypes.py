"""lowmem.tools.argtypes: each argparse value type accepts what it documents and refuses the rest with
argparse.ArgumentTypeError naming the bad value (argparse prints it as `argument --x: <message>`)."""
import argparse
import math

import pytest

from lowmem.tools import argtypes


@pytest.mark.parametrize("fn,text,want", [
    (argtypes.shape, "3x224x224", (3, 224, 224)), (argtypes.shape, "1X28X28", (1, 28, 28)),
    (argtypes.positive, "1", 1), (argtypes.positive, "128", 128),
    (argtypes.count, "0", 0), (argtypes.count, "7", 7),
    (argtypes.classes, "2", 2), (argtypes.classes, "1000", 1000),
    (argtypes.positive_number, "0.1", 0.1), (argtypes.positive_number, "1e-3", 1e-3),
    (argtypes.nonnegative_number, "0", 0.0), (argtypes.nonnegative_number, "5e-4", 5e-4),
    (argtypes.momentum, "0", 0.0), (argtypes.momentum, "0.9", 0.9),
    (argtypes.folder, "runs/a", "runs/a"),
])
def test_good_values_are_parsed(fn, text, want):
    got = fn(text)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("fn,text,words", [
    (argtypes.shape, "3x32", "CxHxW"), (argtypes.shape, "3x0x32", "positive"),
    (argtypes.shape, "axbxc", "CxHxW"), (argtypes.shape, "3x32x32x1", "CxHxW"),
    (argtypes.positive, "0", "positive integer"), (argtypes.positive, "-3", "positive integer"),
    (argtypes.positive, "2.5", "positive integer"), (argtypes.positive, "ten", "positive integer"),
    (argtypes.count, "-1", "non-negative integer"), (argtypes.count, "x", "non-negative integer"),
    (argtypes.classes, "1", "at least 2 classes"), (argtypes.classes, "0", "positive integer"),
    (argtypes.positive_number, "0", "positive number"), (argtypes.positive_number, "-1", "positive number"),
    (argtypes.positive_number, "nan", "finite"), (argtypes.positive_number, "inf", "finite"),
    (argtypes.positive_number, "fast", "a number"),
    (argtypes.nonnegative_number, "-1e-4", ">= 0"), (argtypes.nonnegative_number, "-inf", "finite"),
    (argtypes.momentum, "1", "[0, 1)"), (argtypes.momentum, "-0.1", "[0, 1)"),
    (argtypes.momentum, "nan", "finite"),
    (argtypes.folder, "", "folder name"),
])
def test_bad_values_name_the_problem(fn, text, words):
    with pytest.raises(argparse.ArgumentTypeError) as e:
        fn(text)
    assert words in str(e.value)
    assert repr(text) in str(e.value) or fn is argtypes.folder


def test_argparse_reports_the_message_for_the_option(capsys):
    """Wired into a parser, a bad value exits 2 with the type's message on stderr."""
    parser = argparse.ArgumentParser(prog="lowmem")
    parser.add_argument("--lr", type=argtypes.positive_number)
    assert math.isclose(parser.parse_args(["--lr", "0.05"]).lr, 0.05)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--lr", "-1"])
    assert e.value.code == 2
    assert "argument --lr: expected a positive number, got '-1'" in capsys.readouterr().err
