"""Files in and out, below the public face: a network's weights as safetensors (weights.py),
its inference graph as ONNX (onnx_export.py) and back in (onnx_import.py, with onnx_nodes.py),
what travels with the weights in both (metadata.py), and what they all share (common.py: the one
error for a file or network that cannot be written or read, the optional-library check). The ONNX
reader builds through the builder it is handed (lowmem.nn's Graph), so nothing here imports above
core/; rebuilding a training run's network from its checkpoint is the command line's
(lowmem/tools/predict.py)."""
