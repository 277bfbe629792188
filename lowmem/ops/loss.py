"""Softmax cross-entropy, mean over the batch.

Dimensions: N batch, K classes. logits (N, K), labels (N,) int in [0, K).
"""
from ..system.backend import array_module


def softmax_xent_forward(probs, logits, labels):
    """probs (N, K) <- softmax(logits); returns the mean loss -log p[n, label_n] (Python float)."""
    xp = array_module(logits)
    N = logits.shape[0]
    xp.subtract(logits, logits.max(axis=1, keepdims=True), out=probs)   # stable
    xp.exp(probs, out=probs)
    total = probs.sum(axis=1, keepdims=True)
    probs /= total
    # log p = shifted logit - log(total); take it at the labels only
    shifted = logits[xp.arange(N), labels] - logits.max(axis=1)
    return float(xp.mean(xp.log(total[:, 0]) - shifted))


def softmax_xent_backward(dlogits, probs, labels):
    """dlogits (N, K) = (probs - onehot(labels)) / N.

    # saved: probs (N, K), exact."""
    xp = array_module(dlogits)
    N = probs.shape[0]
    xp.copyto(dlogits, probs)
    dlogits[xp.arange(N), labels] -= 1
    dlogits /= N
