"""`lowmem predict` as a user meets it: fixed-size chunks on an inference-only plan, every stored
value checked, every backend's logits checked, class lists that do not match the outputs, runs
without class names (and their export) refused or warned about in one line."""
import json
import os

import numpy as np
import pytest

from lowmem import models
from lowmem.core import plan as plan_module
from lowmem.formats import common, onnx_export, weights
from lowmem.tools import cli, predict

SHAPE = (3, 16, 16)
CLASSES = ["ant", "bee", "cat"]


def info(**over):
    d = {"classes": CLASSES, "input_shape": list(SHAPE), "image_size": 16, "resize": 16,
         "mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3], "model": "preact-cifar", "depth": 8}
    d.update(over)
    return {k: json.dumps(v) for k, v in d.items()}


def network(seed=0):
    net = models.preact_resnet_cifar(8, num_classes=3, seed=seed)
    rng = np.random.default_rng(seed)
    for name, a in net.stats.items():              # non-trivial running statistics
        a[...] = rng.uniform(0.5, 2, a.shape) if name.endswith("var") else rng.normal(0, 0.3, a.shape)
    return net


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    from PIL import Image
    d = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    paths = []
    for i in range(7):
        p = str(d / f"{i:03d}.png")
        Image.fromarray(rng.integers(0, 256, (20, 18, 3), dtype=np.uint8)).save(p)
        paths.append(p)
    return paths


def saved(tmp_path, suffix, net=None, **over):
    path = str(tmp_path / ("m" + suffix))
    if suffix == ".onnx":
        pytest.importorskip("onnxruntime")
        onnx_export.export_onnx(net or network(), path, metadata=info(**over))
    else:
        pytest.importorskip("safetensors")
        weights.export_safetensors(net or network(), path, metadata=info(**over))
    return path


def test_predict_runs_fixed_chunks_on_an_inference_plan(tmp_path, photos, monkeypatch):
    model = saved(tmp_path, ".safetensors")
    allocated = []
    real = plan_module.Plan.allocate
    monkeypatch.setattr(plan_module.Plan, "allocate", lambda self, xp: allocated.append(self) or real(self, xp))
    whole = predict.predict_files(model, photos, batch_size=32)
    plans = list(allocated)
    allocated.clear()
    chunked = predict.predict_files(model, photos, batch_size=3)
    assert [r[:2] for r in chunked] == [r[:2] for r in whole]
    assert [r[2] for r in chunked] == pytest.approx([r[2] for r in whole], rel=1e-5)
    for p in plans + allocated:                       # nothing a training step keeps
        by = p.bytes_by_kind()
        assert by["saved"] == by["grads"] == by["optimizer"] == 0
    # the chunked run plans 3 samples, whatever the number of files
    assert len(allocated) == 1 and allocated[0].entries[[e.name for e in allocated[0].entries].index("input")].shape[0] \
        == 3 * int(np.prod(SHAPE))
    # the same answers as the training engine's eval forward on all images at once
    from lowmem.core.engine import Engine
    net = weights.load_safetensors(network(), model)
    x = predict.preprocess(photos, json_info())
    ref = Engine(net, len(photos), SHAPE, "exact").predict(x).argmax(1)
    assert [r[1] for r in chunked] == [CLASSES[k] for k in ref]


def json_info(**over):
    return {k: json.loads(v) for k, v in info(**over).items()}


def test_many_images_get_a_progress_bar(tmp_path, photos, capsys):
    model = saved(tmp_path, ".safetensors")
    assert cli.main(["predict", model, "--batch", "2"] + photos) == 0
    out = capsys.readouterr()
    assert len(out.out.splitlines()) == len(photos) and "predict" not in out.err     # not a terminal
    predict.predict_files(model, photos, batch_size=2, progress=True)
    assert f"{len(photos)}/{len(photos)}" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".onnx", ".safetensors"])
@pytest.mark.parametrize("over, message", [
    ({"std": [0.2, 0.0, 0.3]}, r"std is \[0.2, 0.0, 0.3\]: every channel's must be > 0"),
    ({"std": [0.2, -1.0, 0.3]}, "every channel's must be > 0"),
    ({"mean": [0.5, float("nan"), 0.3]}, r"mean is \[0.5, nan, 0.3\], not 3 finite numbers"),
    ({"mean": [0.5, 0.4]}, "mean is .*, not 3 finite numbers"),
    ({"std": "0.2"}, "std is '0.2', not 3 finite numbers"),
    ({"classes": ["ant", "bee"]}, "2 class names stored for 3 outputs"),
    ({"classes": ["ant", "bee", "cat", "dog"]}, "4 class names stored for 3 outputs"),
    ({"classes": []}, r"classes is \[\], not a list of names"),
    ({"image_size": 0}, "image_size is 0, not a positive integer"),
    ({"input_shape": [3, 16]}, r"input_shape is \[3, 16\], not \[C, H, W\]"),
])
def test_unusable_metadata_is_refused_in_one_line(tmp_path, photos, capsys, suffix, over, message):
    import re
    model = saved(tmp_path, suffix, **over)
    assert cli.main(["predict", model] + photos[:2]) == 1
    out = capsys.readouterr()
    assert out.out == "" and re.search(message, out.err), out.err
    assert len(out.err.strip().splitlines()) == 1 and out.err.startswith("lowmem predict: error: ")


@pytest.mark.parametrize("suffix", [".onnx", ".safetensors"])
def test_non_finite_logits_are_refused_not_printed_as_nan(tmp_path, photos, capsys, suffix):
    # finite weights whose logits overflow float32 (a .safetensors file refuses NaN weights itself)
    net = network()
    net.params["fc.weight"].data[...] = 3e38
    model = saved(tmp_path, suffix, net=net)
    assert cli.main(["predict", model] + photos[:3]) == 1
    out = capsys.readouterr()
    assert out.out == "" and "nan" not in out.out
    assert f"the model gives non-finite logits for {photos[0]}" in out.err


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from lowmem.train.config import TrainConfig
    from lowmem.train.trainer import Trainer
    out = tmp_path_factory.mktemp("run")
    cfg = TrainConfig(dataset="synthetic", model="preact-cifar", depth=8, batch=16, epochs=1,
                      limit_train=32, limit_test=16, out=str(out), progress=False)
    Trainer(cfg, log=lambda *a: None).fit()
    return out


def rewritten(run_dir, tmp_path, change):
    from lowmem.train.checkpoint import load_checkpoint, save_checkpoint
    arrays, meta = load_checkpoint(os.path.join(run_dir, "checkpoint.ckpt"))
    change(meta)
    d = tmp_path / "run"
    d.mkdir()
    save_checkpoint(str(d / "checkpoint.ckpt"), arrays, meta)
    return str(d)


@pytest.fixture
def synthetic_photos(tmp_path):
    from PIL import Image
    rng = np.random.default_rng(1)
    paths = [str(tmp_path / f"s{i}.png") for i in range(2)]
    for p in paths:
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(p)
    return paths


def test_a_checkpoint_whose_classes_are_fewer_than_its_outputs(run_dir, tmp_path, synthetic_photos, capsys):
    run = rewritten(run_dir, tmp_path, lambda m: m["data"].update(classes=m["data"]["classes"][:2]))
    assert cli.main(["predict", run] + synthetic_photos) == 1
    err = capsys.readouterr().err
    assert "2 class names stored for 10 outputs" in err and "Traceback" not in err


def test_a_run_without_class_names_is_said_plainly_and_its_export_warns(run_dir, tmp_path, synthetic_photos,
                                                                       capsys):
    pytest.importorskip("safetensors")
    run = rewritten(run_dir, tmp_path, lambda m: m.pop("data"))
    assert cli.main(["predict", run] + synthetic_photos) == 1
    err = capsys.readouterr().err
    assert "its checkpoint stores no classes" in err and "lowmem predict cannot use this run" in err
    assert "export it again" not in err
    model = str(tmp_path / "m.safetensors")
    assert cli.main(["export", run, model]) == 0                       # the weights still export ...
    err = capsys.readouterr().err
    assert err.startswith("lowmem export: warning: ") and "lowmem predict cannot use it" in err   # ... with a warning
    assert cli.main(["predict", model] + synthetic_photos) == 1
    err = capsys.readouterr().err
    assert "lowmem predict cannot use this file" in err and "export it again" not in err
    # a complete run's export has no warning
    assert cli.main(["export", str(run_dir), str(tmp_path / "ok.safetensors")]) == 0
    assert capsys.readouterr().err == ""


def test_one_path_is_one_image_and_the_chunk_size_is_checked(tmp_path, photos):
    model = saved(tmp_path, ".safetensors")
    one = predict.predict_files(model, photos[0])
    assert [r[0] for r in one] == [photos[0]]
    assert one == predict.predict_files(model, [photos[0]])
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=f"batch_size must be a positive integer, got {bad!r}"):
            predict.predict_files(model, photos, batch_size=bad)


def test_an_onnx_model_reads_no_file_beside_it(tmp_path, photos, monkeypatch, capsys):
    """onnxruntime would resolve an external-data tensor against the model's folder: predict
    refuses the file before onnxruntime sees it (the classes would follow the other file's bytes)."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto
    path = saved(tmp_path, ".onnx")
    model = onnx.load(path)
    bias = next(t for t in model.graph.initializer if t.name == "fc.bias")
    bias.ClearField("raw_data")
    del bias.float_data[:]
    bias.data_location = TensorProto.EXTERNAL
    e = bias.external_data.add()
    e.key, e.value = "location", "secret.bin"
    np.array([0, 0, 50], np.float32).tofile(tmp_path / "secret.bin")
    onnx.save(model, path)
    monkeypatch.chdir(tmp_path.parent)
    with pytest.raises(common.ExportError, match="external data file"):
        predict.predict_files(path, photos)
    assert cli.main(["predict", path, photos[0]]) == 1
    err = capsys.readouterr().err
    assert "external data file" in err and len(err.splitlines()) == 1, err
