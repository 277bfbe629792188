"""Test helpers written once, used by the test files (`import reference`): independent naive
references (float64 loops), finite differences, tiny networks.

Nothing here imports lowmem's op implementations it is a reference for.
"""
import numpy as np


def central_difference(f, x, d, eps):
    """(f(x + eps*d) - f(x - eps*d)) / (2*eps), perturbing the array x in place and restoring it."""
    x0 = x.copy()
    try:
        x[...] = x0 + eps * d
        fp = f()
        x[...] = x0 - eps * d
        fm = f()
    finally:
        x[...] = x0
    return (fp - fm) / (2 * eps)


def check_grad(f, x, grad, rng, eps=1e-6, n_dirs=3, n_coords=4, rtol=1e-6, atol=1e-10):
    """Analytic `grad` of scalar f() w.r.t. array x vs central differences (float64):
    random directions, then single coordinates."""
    dirs = [rng.standard_normal(x.shape) for _ in range(n_dirs)]
    for flat in rng.choice(x.size, size=min(n_coords, x.size), replace=False):
        d = np.zeros(x.size)
        d[flat] = 1
        dirs.append(d.reshape(x.shape))
    for d in dirs:
        numeric = central_difference(f, x, d, eps)
        analytic = float(np.sum(grad * d))
        assert abs(numeric - analytic) <= rtol * abs(analytic) + atol, (numeric, analytic)


def conv_ref(x, w, stride, pad):
    """Naive float64 loops: out[o, n, i, j] = sum over (c, a, b) of xpad[c, n, s*i + a, s*j + b] * w[o, c, a, b]."""
    Cin, N, H, W = x.shape
    Cout, _, kh, kw = w.shape
    xpad = np.zeros((Cin, N, H + 2 * pad, W + 2 * pad))
    xpad[:, :, pad:pad + H, pad:pad + W] = x
    Ho, Wo = (H + 2 * pad - kh) // stride + 1, (W + 2 * pad - kw) // stride + 1
    out = np.zeros((Cout, N, Ho, Wo))
    for o in range(Cout):
        for n in range(N):
            for i in range(Ho):
                for j in range(Wo):
                    patch = xpad[:, n, stride * i:stride * i + kh, stride * j:stride * j + kw]
                    out[o, n, i, j] = np.sum(patch * w[o])
    return out


def maxpool_ref(x, k=3, stride=2, pad=1):
    """Naive loops with -inf padding: max and row-major index of the FIRST maximum per window."""
    C, N, H, W = x.shape
    Ho, Wo = (H + 2 * pad - k) // stride + 1, (W + 2 * pad - k) // stride + 1
    xpad = np.full((C, N, H + 2 * pad, W + 2 * pad), -np.inf)
    xpad[:, :, pad:pad + H, pad:pad + W] = x
    out, idx = np.empty((C, N, Ho, Wo)), np.empty((C, N, Ho, Wo), np.uint8)
    for c in range(C):
        for n in range(N):
            for i in range(Ho):
                for j in range(Wo):
                    win = xpad[c, n, stride * i:stride * i + k, stride * j:stride * j + k].ravel()
                    idx[c, n, i, j] = np.argmax(win)           # first occurrence
                    out[c, n, i, j] = win[idx[c, n, i, j]]
    return out, idx


def maxpool_backward_ref(dout, idx, H, W, k=3, stride=2, pad=1):
    C, N, Ho, Wo = dout.shape
    dx = np.zeros((C, N, H, W))
    for c, n, i, j in np.ndindex(C, N, Ho, Wo):
        a, b = divmod(int(idx[c, n, i, j]), k)
        dx[c, n, stride * i + a - pad, stride * j + b - pad] += dout[c, n, i, j]
    return dx


def avgpool_ref(x, k, stride, pad):
    """Naive loops: the mean of each k x k window of the zero-padded x (C, N, H, W)."""
    C, N, H, W = x.shape
    xpad = np.zeros((C, N, H + 2 * pad, W + 2 * pad))
    xpad[:, :, pad:pad + H, pad:pad + W] = x
    Ho, Wo = (H + 2 * pad - k) // stride + 1, (W + 2 * pad - k) // stride + 1
    out = np.zeros((C, N, Ho, Wo))
    for i in range(Ho):
        for j in range(Wo):
            out[:, :, i, j] = xpad[:, :, stride * i:stride * i + k, stride * j:stride * j + k].mean(axis=(2, 3))
    return out


def tiny_graph(pool="max", shape=(3, 8, 8), classes=3, seed=0):
    """A small residual network through the builder, with a max- or average-pool stage."""
    from lowmem import nn
    g = nn.Graph(f"tiny-{pool}", shape, classes, seed=seed)
    x = g.bn_relu(g.conv(g.input, 4, 3))
    x = g.max_pool(x, 2) if pool == "max" else g.avg_pool(x, 2)
    x = g.conv(g.bn_relu(x), 6, 3)
    h = g.conv(g.bn_relu(g.conv(g.bn_relu(x), 6, 3)), 6, 3)
    return g.head(g.bn_relu(g.add(x, h)))


def units_randomized(net, rng):
    """Give every BN unit gammas of both signs and spread betas, so ReLUs cut somewhere."""
    for p in net.parameters():
        if p.data.ndim == 1 and p.name.endswith(".weight") and "fc" not in p.name:
            p.data[...] = rng.choice([-1.0, 1.0], p.shape) * rng.uniform(0.5, 1.5, p.shape)
        elif p.data.ndim == 1 and p.name.endswith(".bias") and "fc" not in p.name:
            p.data[...] = rng.normal(0, 0.5, p.shape)
    return net
