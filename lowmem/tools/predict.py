"""`lowmem predict MODEL IMAGE...`: class names for image files, from a run or an exported model.

    lowmem predict runs/photos cat.jpg dog.png          # a run folder (its checkpoint)
    lowmem predict model.safetensors cat.jpg            # or model.onnx (needs onnxruntime)

    from lowmem import predict
    for path, name, p in predict.predict_files("model.onnx", ["cat.jpg"]):
        print(path, name, p)

What travels with the weights (lowmem/tools/export.py's metadata, a checkpoint's
meta["data"]) makes this work without the training data: the class names in
label order, the input size and the eval transform (resize the shorter side
to `resize`, centre crop `image_size`, as lowmem.data.images' evaluation), and the
normalisation mean/std. A safetensors file also names its model and depth,
so the network is rebuilt and run by the Engine (eval mode); an ONNX file is
run by onnxruntime. Output: one line per image, `PATH: CLASS (probability)`.

Models trained on in-memory datasets (CIFAR, Fashion-MNIST, synthetic)
store resize = image size: a photo is resized to the input, not padded
(Fashion-MNIST's 28 -> 32 padding is not redone).
"""
import os

import numpy as np

from .export import ExportError, load_safetensors, network_from_checkpoint, read_metadata

REQUIRED = ("classes", "input_shape", "image_size", "resize", "mean", "std")


def load(model_path):
    """(logits function: float32 (N, C, H, W) -> (N, K), metadata dict) of a run folder, a training
    checkpoint, a .safetensors or an .onnx file. ExportError when the file lacks what predict needs."""
    from ..train.rundir import CHECKPOINT
    path = os.fspath(model_path)
    suffix = os.path.splitext(path)[1].lower()
    if os.path.isdir(path) or suffix not in (".safetensors", ".onnx"):
        ckpt = os.path.join(path, CHECKPOINT) if os.path.isdir(path) else path
        if not os.path.exists(ckpt):
            raise ExportError(f"{path}: no model here (a run folder, checkpoint, .safetensors or .onnx)")
        net, meta = network_from_checkpoint(ckpt)
        info = dict(meta.get("data") or {})
        return _engine_logits(net), _complete(info, path)
    info = _complete(read_metadata(path), path)
    if suffix == ".onnx":
        try:
            import onnxruntime
        except ImportError:
            raise ImportError("onnxruntime is not installed: pip install 'lowmem[onnx]'") from None
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        return (lambda x: session.run(["logits"], {"input": x.astype(np.float32)})[0]), info
    from ..models import MODELS
    if info.get("model") not in MODELS or not isinstance(info.get("depth"), int):
        raise ExportError(f"{path}: its metadata does not name a lowmem model and depth (exported by an "
                          f"older lowmem?); export the run again")
    net = MODELS[info["model"]].build(info["depth"], num_classes=len(info["classes"]),
                                      in_channels=info["input_shape"][0])
    return _engine_logits(load_safetensors(net, path)), info


def _complete(info, path):
    missing = [k for k in REQUIRED if k not in info]
    if missing:
        raise ExportError(f"{path}: no {', '.join(missing)} stored with the weights (a model from before "
                          f"lowmem stored them); export it again from its run folder")
    return info


def _engine_logits(net):
    def logits(x):
        from ..core.engine import Engine
        engine = Engine(net, max(2, len(x)), x.shape[1:], mode="exact", dtype="float32")
        from ..system.backend import to_numpy
        return to_numpy(engine.predict(engine.xp.asarray(x)))
    return logits


def preprocess(paths, info):
    """float32 (N, C, H, W): each image through the eval transform and the stored normalisation."""
    from ..data.transforms import normalize
    from ..data.images import decode
    c, size = int(info["input_shape"][0]), int(info["image_size"])
    x = np.empty((len(paths), c, size, size), np.uint8)
    for i, p in enumerate(paths):
        try:
            decode(x[i], p, size, False, None, "RGB" if c == 3 else "L", int(info["resize"]))
        except Exception as e:
            from ..data.datasets import DataError
            raise DataError(f"unreadable image {p}: {e}") from None
    return normalize(np.empty(x.shape, np.float32), x, info["mean"], info["std"])


def predict_files(model_path, image_paths):
    """[(path, class name, probability)] of the most likely class of each image."""
    logits_of, info = load(model_path)
    logits = np.asarray(logits_of(preprocess(list(image_paths), info)), np.float64)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    best = p.argmax(axis=1)
    return [(path, info["classes"][k], float(p[i, k])) for i, (path, k) in enumerate(zip(image_paths, best))]
