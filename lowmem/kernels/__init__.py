"""Kernel sets for the BN-ReLU units: the NumPy reference, numba (cpu.py), CUDA (gpu.py)."""
