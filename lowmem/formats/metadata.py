"""What travels with the weights, in both formats: safetensors' header metadata, ONNX's
metadata_props; each value a JSON string.

classes (names in label order), input_shape, image_size, resize (the eval transform: shorter
side to `resize`, centre crop `image_size`), mean and std (per channel, pixel / 255), dataset,
model and depth, and for a run from an ONNX file its network's layer records (`architecture`:
core.network.network_records), so the file is needed nowhere else. `lowmem export` writes them (model_metadata of a training checkpoint's meta),
`lowmem predict` (lowmem/tools/predict.py) reads them (read_metadata).
"""
import json
import os

from .common import ExportError, check_file, require

FORMATS = {".safetensors": "safetensors", ".onnx": "onnx"}
METADATA_KEYS = ("classes", "input_shape", "image_size", "resize", "mean", "std", "dataset", "model", "depth",
                 "architecture")


def model_metadata(meta):
    """The metadata both formats store (each value a JSON string), from a training checkpoint's meta:
    its "data" (class names in label order, input shape, eval resize / crop, mean / std in pixel / 255)
    and the architecture (model, depth) that rebuilds the network from a safetensors file."""
    data, config = meta.get("data") or {}, meta.get("config") or {}
    values = {**data, "model": config.get("model"), "depth": config.get("depth"),
              "architecture": meta.get("architecture")}
    return {k: json.dumps(values[k]) for k in METADATA_KEYS if values.get(k) is not None}


def read_metadata(path):
    """The metadata of an exported .safetensors or .onnx file, values decoded from JSON (as
    `model_metadata` wrote them); keys it lacks are absent. ExportError if it is not such a file."""
    path = os.fspath(path)
    fmt = FORMATS.get(os.path.splitext(path)[1].lower())
    check_file(path)
    if fmt == "safetensors":
        require("safetensors", "safetensors")
        from safetensors import safe_open
        try:
            with safe_open(path, "np") as f:
                raw = f.metadata() or {}
        except Exception as e:
            raise ExportError(f"{path}: not a readable safetensors file ({e})") from None
    elif fmt == "onnx":
        onnx = require("onnx", "onnx")
        try:
            raw = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}
        except Exception as e:
            raise ExportError(f"{path}: not a readable ONNX file ({e})") from None
    else:
        raise ExportError(f"{path}: unknown format; expected {' or '.join(FORMATS)}")
    out = {}
    for k in METADATA_KEYS:
        if k in raw:
            try:
                out[k] = json.loads(raw[k])
            except ValueError:
                raise ExportError(f"{path}: metadata {k!r} is not JSON ({raw[k]!r})") from None
    return out
