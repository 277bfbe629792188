"""`lowmem predict MODEL IMAGE...`: class names for image files, from a run or an exported model.

    lowmem predict runs/photos cat.jpg dog.png          # a run folder (its checkpoint)
    lowmem predict model.safetensors cat.jpg            # or model.onnx (needs onnxruntime)

    from lowmem.tools import predict
    for path, name, p in predict.predict_files("model.onnx", ["cat.jpg"]):
        print(path, name, p)

What travels with the weights (lowmem/formats/metadata.py, a checkpoint's
meta["data"]) makes this work without the training data: the class names in
label order, the input size and the eval transform (resize the shorter side
to `resize`, centre crop `image_size`, as lowmem.data.images' evaluation), and the
normalisation mean/std. A safetensors file also names its model and depth (a run from an
ONNX file: the network's own layer records, the file no longer needed),
so the network is rebuilt and run by lowmem.core.inference.InferenceEngine (eval
mode, no training state); an ONNX file is run by onnxruntime, handed the file's bytes after the
reader's checks (lowmem.formats.onnx_import.load_checked: no tensor in another file). Images are read and
run CHUNK (--batch) at a time, so memory does not grow with their number; every
stored value and every backend's logits are checked (check_info, predict_files).
Output: one line per image, `PATH: CLASS (probability)`.

Models trained on in-memory datasets (CIFAR, Fashion-MNIST, synthetic)
store resize = image size: a photo is resized to the input, not padded
(Fashion-MNIST's 28 -> 32 padding is not redone).
"""
import math
import numbers
import os
import sys

import numpy as np

from ..core.inference import InferenceEngine
from ..core.network import network_from_records
from ..data.files import DataError
from ..data.decode import decode
from ..data.transforms import normalize
from ..formats.onnx_import import load_checked
from ..formats.common import ExportError
from ..formats.metadata import read_metadata
from ..formats.weights import read_safetensors
from ..models import MODELS, build_model, is_onnx_path, model_spec
from ..system.backend import to_numpy
from ..train.checkpoint import load_checkpoint
from ..train.rundir import CHECKPOINT
from ..train.trainstate import kept_network, load_model_state

REQUIRED = ("classes", "input_shape", "image_size", "resize", "mean", "std")
CHUNK = 32              # images per forward: the memory predict needs does not grow with their number


def load(model_path, batch_size=CHUNK):
    """(logits function: float32 (n, C, H, W), n <= batch_size -> (n, K), metadata dict) of a run
    folder, a training checkpoint, a .safetensors or an .onnx file. ExportError when the file lacks
    what predict needs, or what it stores is unusable (the message says which)."""
    path = os.fspath(model_path)
    suffix = os.path.splitext(path)[1].lower()
    if os.path.isdir(path) or suffix not in (".safetensors", ".onnx"):
        ckpt = os.path.join(path, CHECKPOINT) if os.path.isdir(path) else path
        if not os.path.exists(ckpt):
            raise ExportError(f"{path}: no model here (a run folder, checkpoint, .safetensors or .onnx)")
        net, meta = network_from_checkpoint(ckpt)
        info = check_info(dict(meta.get("data") or {}), path, run=True)
        _check_outputs(path, info, net.num_classes)
        if info["input_shape"][0] != net.in_channels:
            raise ExportError(f"{path}: input_shape {info['input_shape']} stored for a network of "
                              f"{net.in_channels} input channels")
        return _engine_logits(net, batch_size), info
    info = check_info(read_metadata(path), path)
    if suffix == ".onnx":
        return _onnx_logits(path, info), info
    records = info.get("architecture")                    # a run from an ONNX file: its own network
    onnx_model = records is None and is_onnx_path(info.get("model"))    # exported before runs kept it
    if records is None and not onnx_model and (info.get("model") not in MODELS
                                               or not isinstance(info.get("depth"), int)):
        raise ExportError(f"{path}: its metadata does not name a lowmem model and depth (exported by an "
                          f"older lowmem?); export the run again")
    state = read_safetensors(path)
    if records is not None:
        try:
            net = network_from_records(records)
        except ValueError as e:
            raise ExportError(f"{path}: {e}") from None
        if net.in_channels != info["input_shape"][0]:
            raise ExportError(f"{path}: input_shape {info['input_shape']} stored for a network of "
                              f"{net.in_channels} input channels")
        _check_outputs(path, info, net.num_classes)
    elif onnx_model:                                         # the .onnx file it names has the architecture
        net = build_model(info["model"], None, in_channels=info["input_shape"][0],
                          input_shape=tuple(info["input_shape"]))
        _check_outputs(path, info, net.num_classes)
    else:
        fc = state.get("fc.weight")
        if fc is None or fc.ndim != 2:
            raise ExportError(f"{path}: no classifier weights (fc.weight) in this file")
        _check_outputs(path, info, fc.shape[0])
        net = MODELS[info["model"]].build(info["depth"], num_classes=int(fc.shape[0]),
                                          in_channels=info["input_shape"][0])
    try:
        net.load_state_dict(state)
    except ValueError as e:
        raise ExportError(f"{path}: {e}") from None
    return _engine_logits(net, batch_size), info


def network_from_checkpoint(path):
    """(network with the checkpoint's weights, meta) of a lowmem training checkpoint.

    The architecture is the checkpoint's own (a run from an ONNX file keeps its layer records),
    else rebuilt from the run's configuration (model, depth, seed) with the class and channel
    counts read off the stored weights: what `lowmem export
    RUN_DIR OUT` (lowmem/tools/commands/export.py) writes out, and what predict runs."""
    arrays, meta = load_checkpoint(path)
    config = meta.get("config") or {}
    model = config.get("model")
    try:
        model_spec(model)
    except (ValueError, TypeError):
        raise ExportError(f"{path}: unknown model {model!r} in the checkpoint's configuration "
                          f"(this lowmem knows {', '.join(sorted(MODELS))} and .onnx files)") from None
    kept = kept_network(meta, path, config.get("seed", 0))   # a run from an ONNX file: its own network
    if kept is not None:
        load_model_state(path, kept)
        return kept, meta
    shape = (meta.get("data") or {}).get("input_shape")      # an ONNX model's sizes (where symbolic)
    if is_onnx_path(model):                                  # a checkpoint from before runs kept it: the file
        net = build_model(model, None, seed=config.get("seed", 0), input_shape=tuple(shape) if shape else None)
        load_model_state(path, net)
        return net, meta
    fc, first = arrays.get("net/fc.weight"), next((a for k, a in arrays.items()
                                                   if k.startswith("net/") and a.ndim == 4), None)
    if fc is None or first is None:
        raise ExportError(f"{path}: no network weights (net/fc.weight, a conv) in this checkpoint")
    if config.get("depth") is None:
        raise ExportError(f"{path}: the checkpoint's configuration has no depth for model {model!r}, "
                          f"so the network cannot be rebuilt (was it written by lowmem train?)")
    net = build_model(model, config["depth"], num_classes=int(fc.shape[0]), in_channels=int(first.shape[1]),
                      seed=config.get("seed", 0))
    load_model_state(path, net)
    return net, meta


def _check_outputs(path, info, outputs):
    if len(info["classes"]) != outputs:
        raise ExportError(f"{path}: {len(info['classes'])} class names stored for {outputs} outputs")


def _is_int(v, low=1):
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _is_real(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_info(info, path, run=False):
    """`info` if it holds everything predict reads, each of a usable value; else ExportError in
    one line. run: it came from a run folder or checkpoint (not an exported file)."""
    missing = [k for k in REQUIRED if k not in info]
    if missing:
        if run:
            raise ExportError(f"{path}: its checkpoint stores no {', '.join(missing)} (a run of a lowmem "
                              f"from before they were stored): lowmem predict cannot use this run; its "
                              f"weights still export (lowmem export)")
        raise ExportError(f"{path}: no {', '.join(missing)} stored with the weights: lowmem predict cannot "
                          f"use this file (exported from a run that lacks them, or by another tool)")
    shape, classes = info["input_shape"], info["classes"]
    problems = []
    if not (isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes)):
        problems.append(f"classes is {classes!r}, not a list of names")
    if not (isinstance(shape, list) and len(shape) == 3 and all(_is_int(v) for v in shape)):
        problems.append(f"input_shape is {shape!r}, not [C, H, W]")
    for k in ("image_size", "resize"):
        if not _is_int(info[k]):
            problems.append(f"{k} is {info[k]!r}, not a positive integer")
    c = shape[0] if isinstance(shape, list) and shape and _is_int(shape[0]) else None
    for k in ("mean", "std"):
        v = info[k]
        if not (isinstance(v, list) and (c is None or len(v) == c) and all(_is_real(a) for a in v)):
            problems.append(f"{k} is {v!r}, not {c if c else 'C'} finite numbers")
        elif k == "std" and not all(a > 0 for a in v):
            problems.append(f"std is {v!r}: every channel's must be > 0")
    if problems:
        raise ExportError(f"{path}: unusable metadata: " + "; ".join(problems))
    return info


def _engine_logits(net, batch_size):
    engine = []

    def logits(x):
        if not engine:                               # built at the first chunk: its input shape
            engine.append(InferenceEngine(net, batch_size, x.shape[1:], dtype="float32"))
        with np.errstate(over="ignore", invalid="ignore"):    # non-finite logits: predict_files says so
            return to_numpy(engine[0].predict(engine[0].xp.asarray(x)))
    return logits


def _onnx_logits(path, info):
    try:
        import onnxruntime
    except ImportError:
        raise ImportError("onnxruntime is not installed: pip install 'lowmem[onnx]'") from None
    model = load_checked(path)               # every tensor inside the file: onnxruntime opens nothing else
    try:
        session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as e:                           # onnxruntime's own errors: one line
        raise ExportError(f"{path}: onnxruntime cannot load it ({str(e).splitlines()[0]})") from None

    def logits(x):
        try:
            return session.run(["logits"], {"input": x.astype(np.float32)})[0]
        except Exception as e:
            raise ExportError(f"{path}: onnxruntime cannot run it on inputs of shape {x.shape[1:]} "
                              f"({str(e).splitlines()[0]})") from None
    return logits


def preprocess(paths, info):
    """float32 (N, C, H, W): each image through the eval transform and the stored normalisation."""
    c, size = int(info["input_shape"][0]), int(info["image_size"])
    x = np.empty((len(paths), c, size, size), np.uint8)
    for i, p in enumerate(paths):
        try:
            decode(x[i], p, size, False, None, "RGB" if c == 3 else "L", int(info["resize"]))
        except Exception as e:
            raise DataError(f"unreadable image {p}: {e}") from None
    return normalize(np.empty(x.shape, np.float32), x, info["mean"], info["std"])


def predict_files(model_path, image_paths, batch_size=CHUNK, progress=None):
    """[(path, class name, probability)] of the most likely class of each image, `batch_size`
    images at a time (memory does not depend on how many). progress: a tqdm bar on stderr (None:
    when stderr is a terminal and there is more than one chunk)."""
    from tqdm import tqdm
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    # one path given alone is one image, not a sequence of characters
    paths = [image_paths] if isinstance(image_paths, (str, bytes, os.PathLike)) else list(image_paths)
    if not paths:
        return []
    batch_size = min(int(batch_size), len(paths))
    logits_of, info = load(model_path, batch_size)
    classes = info["classes"]
    if progress is None:
        progress = len(paths) > batch_size and sys.stderr.isatty()
    out = []
    with tqdm(total=len(paths), unit="image", desc="predict", disable=not progress, file=sys.stderr) as bar:
        for i in range(0, len(paths), batch_size):
            chunk = paths[i:i + batch_size]
            logits = np.asarray(logits_of(preprocess(chunk, info)), np.float64)
            if logits.shape != (len(chunk), len(classes)):
                raise ExportError(f"{model_path}: {len(classes)} class names stored for "
                                  f"{logits.shape[-1] if logits.ndim == 2 else '?'} outputs")
            bad = ~np.isfinite(logits).all(axis=1)
            if bad.any():
                raise ExportError(f"{model_path}: the model gives non-finite logits for "
                                  f"{chunk[int(np.argmax(bad))]} (NaN or Inf weights or statistics?)")
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            best = p.argmax(axis=1)
            out += [(path, classes[k], float(p[j, k])) for j, (path, k) in enumerate(zip(chunk, best))]
            bar.update(len(chunk))
    return out

