"""lowmem.tools.argtypes: each argparse value type accepts what it documents and refuses the rest with
argparse.ArgumentTypeError naming the bad value (argparse prints it as `argument --x: <message>`)."""
import argparse
import json
import math
import re

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


# ---- --bits: a width, auto, or per-unit widths (pairs or a JSON file) ----------------------------

def test_bits_takes_unit_pairs_and_json_files(tmp_path):
    assert argtypes.bits("layer1.0.bn1=4,*=2") == {"layer1.0.bn1": 4, "*": 2}
    assert argtypes.bits(" a = float , b=8 ") == {"a": "float", "b": 8}
    f = tmp_path / "w.json"
    f.write_text('{"*": 2, "layer1.0.bn2": "float"}')
    assert argtypes.bits(str(f)) == {"*": 2, "layer1.0.bn2": "float"}
    run = tmp_path / "config.json"                      # a run's config.json: its "bits"
    run.write_text('{"bits": {"*": 1}, "avg_bits": 1.0}')
    assert argtypes.bits(str(run)) == {"*": 1}
    assert argtypes.bits("auto") == "auto" and argtypes.bits("4") == 4
    for value in ({"a": 2}, 8, "auto"):
        assert value in argtypes.BITS_CHOICES
    assert 3 not in argtypes.BITS_CHOICES


@pytest.mark.parametrize("text,words", [
    ("a=3", "unit 'a': width must be 1, 2, 4, 8 or float, got 3"),
    ("a=half", "unit 'a': width must be 1, 2, 4, 8 or float, got 'half'"),
    ("a=4,a=2", "unit 'a' is given twice"),
    ("a=4,,b=2", "expected unit=K pairs"),
    ("=4", "expected unit=K pairs"),
    ("four", "expected 1, 2, 4, 8, auto, unit=K pairs"),
    ("missing.json", "cannot read missing.json"),
])
def test_bad_bits_name_the_problem(text, words):
    with pytest.raises(argparse.ArgumentTypeError, match=words.replace("(", r"\(").replace(")", r"\)")):
        argtypes.bits(text)


@pytest.mark.parametrize("content,words", [("{not json", "is not JSON"), ("[4]", "expected a JSON object"),
                                           ('{"a": 16}', "unit 'a': width must be"), ("{}", "expected a JSON object")])
def test_bad_width_files_name_the_problem(tmp_path, content, words):
    f = tmp_path / "w.json"
    f.write_text(content)
    with pytest.raises(argparse.ArgumentTypeError, match=words):
        argtypes.bits(str(f))


@pytest.mark.parametrize("content,words", [
    ('{"*": 8.9, "layer1.0.bn1": 1.5}', "unit '*': width must be 1, 2, 4, 8 or float, got 8.9"),
    ('{"*": 2.0}', "unit '*': width must be 1, 2, 4, 8 or float, got 2.0"),      # as *=2.0 is refused
    ('{"*": true}', "unit '*': width must be 1, 2, 4, 8 or float, got True"),
])
def test_a_width_file_holds_whole_widths_not_truncated_ones(tmp_path, content, words):
    f = tmp_path / "w.json"
    f.write_text(content)
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(words)):
        argtypes.bits(str(f))
    with pytest.raises(argparse.ArgumentTypeError, match="got '2.0'"):
        argtypes.bits("*=2.0")


def test_a_run_config_with_uniform_bits_is_those_bits(tmp_path):
    """A run's config.json stores uniform bits as an int: --bits config.json is {"*": K}."""
    run = tmp_path / "config.json"
    run.write_text(json.dumps({"dataset": "synthetic", "model": "preact-cifar", "mode": "approx", "bits": 2,
                               "avg_bits": None, "rounding": "nearest"}))
    assert argtypes.bits(str(run)) == {"*": 2}
    run.write_text(json.dumps({"mode": "approx", "bits": "auto"}))
    with pytest.raises(argparse.ArgumentTypeError, match="its bits are 'auto'"):
        argtypes.bits(str(run))


def test_a_width_file_whose_path_holds_an_equals_sign_is_read_as_a_file(tmp_path):
    folder = tmp_path / "lr=0.1"
    folder.mkdir()
    f = folder / "widths.json"
    f.write_text('{"*": 4, "layer1.0.bn1": 2}')
    assert argtypes.bits(str(f)) == {"*": 4, "layer1.0.bn1": 2}
    with pytest.raises(argparse.ArgumentTypeError, match="cannot read"):
        argtypes.bits(str(folder / "missing.json"))
