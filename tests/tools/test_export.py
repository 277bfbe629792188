"""`lowmem export` (lowmem/tools/commands/export.py) on a real (tiny) training run folder:
both formats written with what travels with the weights, clear errors with the documented exit
codes, a missing extra named, unsupported opsets refused on the command line."""
import argparse
import os

import numpy as np
import pytest

from lowmem import models
from lowmem.core.engine import Engine
from lowmem.formats import onnx_export, weights
from lowmem.tools.commands import export as export_command

# --------------------------------------------------------- `lowmem export` pair

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real tiny training run (synthetic data, ResNet-8, one epoch) with its checkpoint."""
    from lowmem.train.config import TrainConfig
    from lowmem.train.trainer import Trainer
    out = tmp_path_factory.mktemp("run")
    cfg = TrainConfig(dataset="synthetic", model="preact-cifar", depth=8, batch=16, epochs=1,
                      limit_train=32, limit_test=16, out=str(out), progress=False)
    Trainer(cfg, log=lambda *a: None).fit()
    return out


def parse(*argv):
    return export_command.add_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_export_command_writes_both_formats(run_dir, tmp_path, capsys):
    pytest.importorskip("safetensors")
    ort = pytest.importorskip("onnxruntime")
    from lowmem.train.trainer import load_model_state
    net = models.preact_resnet_cifar(8)
    load_model_state(os.path.join(run_dir, "checkpoint.ckpt"), net)
    assert export_command.run(parse(str(run_dir), str(tmp_path / "m.safetensors"))) == 0
    assert "preact-resnet8-cifar" in capsys.readouterr().out
    assert set(weights.read_safetensors(tmp_path / "m.safetensors")) == set(net.state_dict())
    assert export_command.run(parse(str(run_dir / "checkpoint.ckpt"), str(tmp_path / "m.onnx"), "--input", "3x32x32")) == 0
    assert "opset 17" in capsys.readouterr().out
    x = np.random.default_rng(1).standard_normal((4, 3, 32, 32)).astype(np.float32)
    out = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    ref = Engine(net, 4, (3, 32, 32)).predict(x)
    assert float(np.abs(out - ref).max()) <= 1e-5 * float(np.abs(ref).max())


def test_export_command_errors(run_dir, tmp_path, capsys):
    assert export_command.run(parse(str(run_dir), str(tmp_path / "m.pt"))) == 2      # a bad command line
    assert "must end in .safetensors or .onnx" in capsys.readouterr().err
    assert export_command.run(parse(str(tmp_path), str(tmp_path / "m.onnx"))) == 1
    assert "no checkpoint here" in capsys.readouterr().err
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes(b"garbage")
    assert export_command.run(parse(str(broken), str(tmp_path / "m.onnx"))) == 1
    assert "broken.ckpt" in capsys.readouterr().err
    assert not (tmp_path / "m.onnx").exists()


def test_a_missing_extra_names_the_pip_install(run_dir, tmp_path, monkeypatch, capsys):
    import sys
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(ImportError, match=r"pip install 'lowmem\[safetensors\]'"):
        weights.export_safetensors(models.preact_resnet_cifar(8), tmp_path / "m.safetensors")
    assert export_command.run(parse(str(run_dir), str(tmp_path / "m.onnx"))) == 2
    assert "lowmem[onnx]" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


# ------------------------------------------------- bad opsets, configs and names

@pytest.mark.parametrize("opset", ["5", "-1", "99", "6", "seven"])
def test_unsupported_opsets_are_refused_on_the_command_line(run_dir, tmp_path, capsys, opset):
    from lowmem.tools.cli import main
    pytest.importorskip("onnx")
    rc = main(["export", str(run_dir), str(tmp_path / "m.onnx"), "--opset", opset])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("lowmem export: error: argument --opset")
    assert opset == "seven" or f"expected {onnx_export.MIN_OPSET}..{onnx_export.max_opset()}" in last
    assert not (tmp_path / "m.onnx").exists()


def test_command_line_errors_carry_the_prefix_and_the_documented_code(run_dir, tmp_path, capsys):
    from lowmem.tools.cli import main
    assert main(["export", str(run_dir), str(tmp_path / "m.pt")]) == 2
    assert capsys.readouterr().err.strip() == (f"lowmem export: error: {tmp_path / 'm.pt'}: unknown format; "
                                               f"the output must end in .safetensors or .onnx")
    assert main(["export", str(tmp_path), str(tmp_path / "m.onnx")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("lowmem export: error: ") and "no checkpoint here" in err and "\n" not in err


def test_a_checkpoint_without_a_depth_is_a_clear_error(run_dir, tmp_path, capsys):
    from lowmem.train.checkpoint import load_checkpoint, save_checkpoint
    arrays, meta = load_checkpoint(os.path.join(run_dir, "checkpoint.ckpt"))
    del meta["config"]["depth"]
    save_checkpoint(tmp_path / "nodepth.ckpt", arrays, meta)
    assert export_command.run(parse(str(tmp_path / "nodepth.ckpt"), str(tmp_path / "m.safetensors"))) == 1
    err = capsys.readouterr().err
    assert "has no depth for model 'preact-cifar'" in err and "Traceback" not in err and "KeyError" not in err


def test_an_output_under_a_file_is_named_not_a_temporary(run_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for out in ("m.onnx", "m.safetensors"):
        code = export_command.run(parse(str(run_dir), str(tmp_path / "file" / out)))
        err = capsys.readouterr().err
        assert code == 1 and f"{tmp_path / 'file' / out}" in err and ".tmp-" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["file"]
