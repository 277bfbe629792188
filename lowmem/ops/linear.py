"""Fully connected layer (the classifier head).

Dimensions: N batch, C in features, K out features.
Layout: x (N, C), w (K, C) as PyTorch's nn.Linear, b (K,), out (N, K).
"""
from ..system.backend import array_module


def linear_forward(out, x, w, b):
    """out (N, K) = x @ w.T + b."""
    xp = array_module(out)
    xp.matmul(x, w.T, out=out)
    out += b


def linear_backward(dx, dw, db, dout, x, w):
    """dx (N, C) = dout @ w;  dw += dout.T @ x;  db += sum_n dout.

    # saved: x, the FC input (N, C), exact (it is tiny)."""
    xp = array_module(dout)
    dw += dout.T @ x
    db += dout.sum(axis=0)
    if dx is not None:
        xp.matmul(dout, w, out=dx)
