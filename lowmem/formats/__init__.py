"""Files in and out that sit below the public face: the one error for a file or network that
cannot be written or read (common.py) and the ONNX reader (onnx_import.py, onnx_nodes.py), which
nn.from_onnx and the command line call. It builds through the builder it is handed (lowmem.nn's
Graph), so it imports nothing above core/. The writers (safetensors, ONNX out) are tools/export.py."""
