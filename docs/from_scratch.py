"""Backprop with approximate activations, from scratch: NumPy only, no lowmem.

A pre-activation ResNet-8 (stem conv, three blocks, BN-ReLU, average pool,
FC) trained on Fashion-MNIST while each BN->ReLU unit keeps only a 4-bit code
of its normalised input x̂ (plus one rstd per channel) for the backward pass.
The forward pass is exact; the backward rebuilds what it needs from the codes.
Read with docs/from_scratch.md.  Run:  python docs/from_scratch.py [STEPS [DATA_DIR]]
STEPS defaults to 100; DATA_DIR (or $FASHION_MNIST) is a folder holding the four Fashion-MNIST
files train-/t10k-images-idx3-ubyte.gz and train-/t10k-labels-idx1-ubyte.gz, by default
/usr/share/datasets/fashion-mnist (Debian's package dataset-fashion-mnist; the same files are at
github.com/zalandoresearch/fashion-mnist).
"""
import gzip
import os
import sys

import numpy as np

BITS, W = 4, 3.5                 # K = 4 bits: L = 16 bins over about ±W_K (in batch std)
EPS = 1e-5                       # BN's epsilon
BLOCKS = [("layer1.0", 1, False), ("layer2.0", 2, True), ("layer3.0", 2, True)]  # name, stride, projection


# ---- convolution (zero padding (ksize-1)/2) through im2col ------------------------------------
def im2col(x, ksize, stride):
    """x (N, C, H, W) -> columns (N·Ho·Wo, C·ksize·ksize), ksize the kernel size."""
    p = (ksize - 1) // 2
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
    n, c, height, width = x.shape
    ho, wo = (height + 2 * p - ksize) // stride + 1, (width + 2 * p - ksize) // stride + 1
    cols = np.empty((n, c, ksize, ksize, ho, wo), x.dtype)
    for i in range(ksize):
        for j in range(ksize):
            cols[:, :, i, j] = xp[:, :, i:i + stride * ho:stride, j:j + stride * wo:stride]
    return cols.transpose(0, 4, 5, 1, 2, 3).reshape(n * ho * wo, -1), (n, c, height, width, ho, wo)


def conv(x, wt, stride=1):
    cols, (n, _, _, _, ho, wo) = im2col(x, wt.shape[-1], stride)
    return (cols @ wt.reshape(len(wt), -1).T).reshape(n, ho, wo, -1).transpose(0, 3, 1, 2)


def conv_backward(dout, x, wt, stride=1):
    """-> (dx, dW): the input gradient needs only the weights, dW needs the input x."""
    ksize, p = wt.shape[-1], (wt.shape[-1] - 1) // 2
    cols, (n, c, height, width, ho, wo) = im2col(x, ksize, stride)
    d = dout.transpose(0, 2, 3, 1).reshape(n * ho * wo, -1)
    dw = (d.T @ cols).reshape(wt.shape)
    dcols = (d @ wt.reshape(len(wt), -1)).reshape(n, ho, wo, c, ksize, ksize)
    dxp = np.zeros((n, c, height + 2 * p, width + 2 * p), x.dtype)
    for i in range(ksize):
        for j in range(ksize):
            dxp[:, :, i:i + stride * ho:stride, j:j + stride * wo:stride] += dcols[:, :, :, :, i, j].transpose(0, 3, 1, 2)
    return dxp[:, :, p:p + height, p:p + width], dw


# ---- the quantizer: a K-bit code of x̂ whose bins put an edge on the ReLU threshold ----------
def grid(gamma, beta):
    """Per channel: axis sign s, lower edge lo, first open code k (all from γ, β alone)."""
    L, w = 2 ** BITS, 2 * W / 2 ** BITS
    zero = gamma == 0
    s = np.where(gamma < 0, -1.0, 1.0)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        t = -beta / np.where(zero, 1, np.abs(gamma))        # threshold: ReLU open where s·x̂ > t
        k = np.clip(np.rint((t + W) / w), 1, L - 1)         # edge between codes k-1 and k on t ...
        lo = np.clip(t - k * w, -W - w / 2, -W + w / 2)     # ... unless t is outside the window
    lo = np.where(zero, -W, lo)
    k = np.where(zero, np.where(beta > 0, 0, L), k)          # γ = 0: every code open (k=0) or none (k=L)
    return s, lo, k, w


def encode(xhat, gamma, beta):
    """x̂ (N, C, H, W) -> 4-bit codes packed two per byte, uint8 of N·C·H·W/2 bytes."""
    s, lo, k, w = (a[None, :, None, None] if np.ndim(a) else a for a in grid(gamma, beta))
    mask = xhat * gamma[None, :, None, None] + beta[None, :, None, None] > 0   # the forward's mask
    code = np.clip(np.floor((xhat * s - lo) / w), 0, 2 ** BITS - 1)
    code = np.where(mask, np.maximum(code, k), np.minimum(code, k - 1))       # both sides clamped
    code = code.astype(np.uint8).ravel()
    return code[0::2] | (code[1::2] << 4)


def decode(packed, shape, gamma, beta):
    """-> (x̃, mask): bin midpoints, and the exact ReLU mask code >= k."""
    s, lo, k, w = (a[None, :, None, None] if np.ndim(a) else a for a in grid(gamma, beta))
    code = np.stack([packed & 15, packed >> 4], axis=1).reshape(shape)
    return s * (lo + (code + 0.5) * w), code >= k


# ---- one BN -> ReLU unit: forward saves (code or x̂, rstd); backward rebuilds from it ---------
def unit_forward(x, P, name, saved, approx):
    gamma, beta = P[name + ".weight"], P[name + ".bias"]
    mu = x.mean(axis=(0, 2, 3), keepdims=True)
    rstd = 1 / np.sqrt(((x - mu) ** 2).mean(axis=(0, 2, 3), keepdims=True) + EPS)
    xhat = (x - mu) * rstd
    saved[name] = (encode(xhat, gamma, beta) if approx else xhat, rstd, x.shape)
    return np.maximum(xhat * gamma[None, :, None, None] + beta[None, :, None, None], 0)


def unit_restore(P, name, saved):
    """-> (x̃ or x̂, mask, rstd, r) with r = mask·(γ·x̃ + β), the rebuilt conv input."""
    gamma, beta = P[name + ".weight"][None, :, None, None], P[name + ".bias"][None, :, None, None]
    kept, rstd, shape = saved[name]
    if kept.dtype == np.uint8:
        xt, mask = decode(kept, shape, P[name + ".weight"], P[name + ".bias"])
    else:
        xt, mask = kept, kept * gamma + beta > 0
    return xt, mask, rstd, mask * (xt * gamma + beta)


def unit_backward(dr, P, G, name, saved):
    """dr = dloss/dr -> dx; adds dγ, dβ into G. x̃ appears in dγ and the projection term only."""
    xt, mask, rstd, _ = unit_restore(P, name, saved)
    dy = dr * mask                                           # the mask is exact in both modes
    G[name + ".weight"] = (dy * xt).sum(axis=(0, 2, 3))
    G[name + ".bias"] = dy.sum(axis=(0, 2, 3))
    m = lambda a: a.mean(axis=(0, 2, 3), keepdims=True)     # noqa: E731
    return P[name + ".weight"][None, :, None, None] * rstd * (dy - m(dy) - xt * m(dy * xt))


# ---- the network: forward keeps only `saved`; backward walks it in reverse --------------------
def forward(P, x, labels, approx):
    saved = {"input": x}
    h = conv(x, P["conv1.weight"])
    for name, stride, proj in BLOCKS:
        a = unit_forward(h, P, name + ".bn1", saved, approx)
        skip = conv(a, P[name + ".shortcut.weight"], stride) if proj else h
        h = conv(unit_forward(conv(a, P[name + ".conv1.weight"], stride), P, name + ".bn2", saved, approx),
                 P[name + ".conv2.weight"]) + skip
    saved["pooled"] = unit_forward(h, P, "bn_final", saved, approx).mean(axis=(2, 3))   # (N, C), exact
    logits = saved["logits"] = saved["pooled"] @ P["fc.weight"].T + P["fc.bias"]
    z = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = z / z.sum(axis=1, keepdims=True)
    n = len(labels)
    saved["dlogits"] = (probs - np.eye(probs.shape[1])[labels]) / n
    return -np.log(probs[np.arange(n), labels]).mean(), saved


def backward(P, saved):
    G, dl = {}, saved["dlogits"]
    G["fc.weight"], G["fc.bias"] = dl.T @ saved["pooled"], dl.sum(axis=0)
    shape = saved["bn_final"][2]
    dr = np.broadcast_to((dl @ P["fc.weight"])[:, :, None, None] / (shape[2] * shape[3]), shape)
    dh = unit_backward(dr, P, G, "bn_final", saved)
    for name, stride, proj in reversed(BLOCKS):
        r2 = unit_restore(P, name + ".bn2", saved)[3]
        dr2, G[name + ".conv2.weight"] = conv_backward(dh, r2, P[name + ".conv2.weight"])
        do1 = unit_backward(dr2, P, G, name + ".bn2", saved)
        a = unit_restore(P, name + ".bn1", saved)[3]
        da, G[name + ".conv1.weight"] = conv_backward(do1, a, P[name + ".conv1.weight"], stride)
        if proj:                                             # the shortcut also reads a
            ds, G[name + ".shortcut.weight"] = conv_backward(dh, a, P[name + ".shortcut.weight"], stride)
            dh = unit_backward(da + ds, P, G, name + ".bn1", saved)
        else:                                                # identity skip: dh passes straight down
            dh = unit_backward(da, P, G, name + ".bn1", saved) + dh
    G["conv1.weight"] = conv_backward(dh, saved["input"], P["conv1.weight"])[1]
    return G


# ---- training ---------------------------------------------------------------------------------
def init(in_channels=1, classes=10, seed=0):
    rng, P = np.random.default_rng(seed), {}
    def he(cout, cin, ksize): return rng.normal(0, np.sqrt(2 / (cin * ksize**2)), (cout, cin, ksize, ksize))  # noqa: E704
    P["conv1.weight"], c = he(16, in_channels, 3), 16
    for (name, _, proj), width in zip(BLOCKS, (16, 32, 64)):
        for bn, ch in ((".bn1", c), (".bn2", width)):
            P[name + bn + ".weight"], P[name + bn + ".bias"] = np.ones(ch), np.zeros(ch)
        P[name + ".conv1.weight"], P[name + ".conv2.weight"] = he(width, c, 3), he(width, width, 3)
        if proj:
            P[name + ".shortcut.weight"] = he(width, c, 1)
        c = width
    P["bn_final.weight"], P["bn_final.bias"] = np.ones(c), np.zeros(c)
    P["fc.weight"], P["fc.bias"] = rng.normal(0, np.sqrt(1 / c), (classes, c)), np.zeros(classes)
    return P


DATA = os.environ.get("FASHION_MNIST", "/usr/share/datasets/fashion-mnist")


def fashion_mnist(root=DATA, split="train"):
    files = [f"{split}-images-idx3-ubyte.gz", f"{split}-labels-idx1-ubyte.gz"]
    missing = [f for f in files if not os.path.isfile(os.path.join(root, f))]
    if missing:
        sys.exit(f"from_scratch.py: {', '.join(missing)} not in {root}: install the Debian package "
                 f"dataset-fashion-mnist, or download the files from github.com/zalandoresearch/fashion-mnist "
                 f"and pass their folder as the second argument (or in $FASHION_MNIST)")
    def read(f, skip): return np.frombuffer(gzip.open(os.path.join(root, f)).read(), np.uint8, offset=skip)  # noqa: E704
    x = read(f"{split}-images-idx3-ubyte.gz", 16).reshape(-1, 1, 28, 28) / 255.0
    return (x - 0.286) / 0.353, read(f"{split}-labels-idx1-ubyte.gz", 8).astype(np.int64)


def train(steps=100, batch=32, lr=0.05, approx=True, root=DATA):
    x, y = fashion_mnist(root)
    x = x.astype(np.float32)                                 # float32 for speed (the test uses float64)
    P = {name: v.astype(np.float32) for name, v in init().items()}
    V, rng = {}, np.random.default_rng(1)
    for step in range(steps):
        i = rng.integers(0, len(x), batch)
        loss, saved = forward(P, x[i], y[i], approx)
        if step == 0:
            kept = sum(v[0].nbytes + v[1].nbytes for v in saved.values() if isinstance(v, tuple))
            print(f"bytes the units keep for backward: {kept:,} ({'4-bit' if approx else f'{x.dtype} x̂'})")
        G = backward(P, saved)
        for name, g in G.items():                            # SGD, momentum 0.9, decay on weights
            g = g + 5e-4 * P[name] if name.endswith("weight") and P[name].ndim > 1 else g
            V[name] = 0.9 * V.get(name, 0) + g
            P[name] = P[name] - lr * V[name]
        if step % 25 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss:.3f}")
    xt, yt = fashion_mnist(root, split="t10k")
    xt = xt.astype(np.float32)
    correct = sum((forward(P, xt[j:j + 250], yt[j:j + 250], approx)[1]["logits"].argmax(1) == yt[j:j + 250]).sum()
                  for j in range(0, 1000, 250))        # BN with each test batch's own statistics
    print(f"test accuracy on 1,000 images: {correct / 1000:.3f}")
    return P


if __name__ == "__main__":
    train(int(sys.argv[1]) if len(sys.argv) > 1 else 100, root=sys.argv[2] if len(sys.argv) > 2 else DATA)
