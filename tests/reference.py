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


def conv_offsets_ref(x, w, stride, pad):
    """float64, fast enough for real layer shapes (conv_ref's loops are not): the sum over kernel offsets of a channel contraction of shifted input slices."""
    Cin, N, H, W = x.shape
    Cout, _, kh, kw = w.shape
    xp = np.zeros((Cin, N, H + 2 * pad, W + 2 * pad))
    xp[:, :, pad:pad + H, pad:pad + W] = x
    Ho, Wo = (H + 2 * pad - kh) // stride + 1, (W + 2 * pad - kw) // stride + 1
    out = np.zeros((Cout, N, Ho, Wo))
    for a in range(kh):
        for b in range(kw):
            out += np.einsum("oc,cnhw->onhw", w[:, :, a, b],
                             xp[:, :, a:a + stride * Ho:stride, b:b + stride * Wo:stride])
    return out


def conv_offsets_backward_ref(x, w, g, stride, pad):
    """float64 (dx, dw) of sum(out * g): the adjoint of conv_offsets_ref, offset by offset."""
    Cin, N, H, W = x.shape
    Cout, _, kh, kw = w.shape
    Ho, Wo = g.shape[2:]
    xp = np.zeros((Cin, N, H + 2 * pad, W + 2 * pad))
    xp[:, :, pad:pad + H, pad:pad + W] = x
    dxp = np.zeros_like(xp)
    dw = np.zeros(w.shape)
    for a in range(kh):
        for b in range(kw):
            win = (slice(None), slice(None), slice(a, a + stride * Ho, stride), slice(b, b + stride * Wo, stride))
            dxp[win] += np.einsum("oc,onhw->cnhw", w[:, :, a, b], g)
            dw[:, :, a, b] = np.einsum("onhw,cnhw->oc", g, xp[win])
    return dxp[:, :, pad:pad + H, pad:pad + W], dw


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


def randomize_units(net, rng):
    """Non-trivial gamma (some negative), beta and running statistics, in place; returns net."""
    for p in net.parameters():
        if ".bn" in "." + p.name:                      # bn1, layer1.0.bn2, bn_final, ...
            if p.name.endswith(".weight"):
                sign = rng.choice([-1.0, 1.0], size=p.shape, p=[0.2, 0.8])
                p.data[...] = sign * rng.uniform(0.5, 1.5, p.shape)
            else:
                p.data[...] = rng.normal(0, 0.3, p.shape)
    for name, a in net.stats.items():
        a[...] = rng.normal(0, 0.5, a.shape) if name.endswith("mean") else rng.uniform(0.5, 2, a.shape)
    return net


# ---- hand-built graphs of the newer ops (post-activation, dense, inverted residual, biased, classifier) ----

def postact_graph():
    """conv-bn-relu stem, one post-activation block (bn -> add -> relu), a max-pool."""
    from lowmem import nn
    g = nn.Graph("postact", (3, 8, 8), 4)
    x = g.bn_relu(g.conv(g.input, 6, 3, name="conv1"), name="bn1")
    h = g.bn_relu(g.conv(x, 6, 3, name="layer1.0.conv1"), name="layer1.0.bn1")
    h = g.bn(g.conv(h, 6, 3, name="layer1.0.conv2"), name="layer1.0.bn2")
    x = g.relu(g.add(h, x, name="layer1.0.add"), name="layer1.0.relu2")
    return g.head(g.max_pool(x, 2, name="pool1"))


def dense_graph():
    """Two DenseNet-BC layers (bn_relu -> 1x1 -> bn_relu -> 3x3, concatenated) and a transition."""
    from lowmem import nn
    g = nn.Graph("dense", (3, 8, 8), 4)
    x = g.conv(g.input, 6, 3, name="conv0")
    for i in range(2):
        new = g.conv(g.bn_relu(g.conv(g.bn_relu(x, name=f"b.{i}.norm1"), 8, 1, name=f"b.{i}.conv1"),
                               name=f"b.{i}.norm2"), 4, 3, name=f"b.{i}.conv2")
        x = g.concat(x, new, name=f"b.{i}.cat")
    x = g.avg_pool(g.conv(g.bn_relu(x, name="t.norm"), 7, 1, name="t.conv"), 2, name="t.pool")
    return g.head(g.bn_relu(x, name="norm5"))


def inverted_graph():
    """MobileNetV2-style: 1x1 expand-bn-relu6, depthwise 3x3-bn-relu6, 1x1 project-bn, + x."""
    from lowmem import nn
    g = nn.Graph("inverted", (3, 8, 8), 4)
    x = g.relu6(g.bn(g.conv(g.input, 4, 3, name="stem.0"), name="stem.1"), name="stem.2")
    h = g.relu6(g.bn(g.conv(x, 12, 1, name="b.0"), name="b.1"), name="b.2")
    h = g.relu6(g.bn(g.conv(h, 12, 3, groups=12, name="b.3"), name="b.4"), name="b.5")
    x = g.add(x, g.bn(g.conv(h, 4, 1, name="b.6"), name="b.7"), name="b.add")
    return g.head(x)


def bias_graph():
    from lowmem import nn
    g = nn.Graph("biased", (3, 8, 8), 4)
    x = g.relu(g.conv(g.input, 5, 3, bias=True, name="conv1"), name="relu1")
    x = g.relu(g.conv(x, 6, 3, stride=2, bias=True, groups=1, name="conv2"), name="relu2")
    return g.head(x)


def classifier_graph():
    """VGG-style: convs, a pool, then flatten + linear layers with ReLUs and dropout before the head
    (the export writes each dropout as an ONNX Dropout with its ratio: it reads back as dropout)."""
    from lowmem import nn
    g = nn.Graph("classifier", (3, 8, 8), 4)
    x = g.max_pool(g.bn_relu(g.conv(g.input, 4, 3, name="features.0"), name="features.1"), 2, name="features.3")
    x = g.dropout(g.relu(g.linear(x, 12, name="classifier.0"), name="classifier.1"), 0.25, name="classifier.2")
    x = g.relu(g.linear(x, 10, bias=False, name="classifier.3"), name="classifier.4")
    x = g.dropout(x, 0.3, name="classifier.5")
    return g.head(x, name="classifier.6")


GRAPHS = {"postact": postact_graph, "dense": dense_graph, "inverted": inverted_graph, "bias": bias_graph,
          "classifier": classifier_graph}


def random_graph(which, rng):
    """GRAPHS[which] with its units randomised (reference.randomize_units) and the biases of every
    kind (conv, linear, bn) non-zero."""
    net = randomize_units(GRAPHS[which](), rng)
    for p in net.parameters():
        if p.name.endswith(".bias"):
            p.data[...] = rng.normal(0, 0.3, p.shape)
    return net


def units_randomized(net, rng):
    """Give every BN unit gammas of both signs and spread betas, so ReLUs cut somewhere."""
    for p in net.parameters():
        if p.data.ndim == 1 and p.name.endswith(".weight") and "fc" not in p.name:
            p.data[...] = rng.choice([-1.0, 1.0], p.shape) * rng.uniform(0.5, 1.5, p.shape)
        elif p.data.ndim == 1 and p.name.endswith(".bias") and "fc" not in p.name:
            p.data[...] = rng.normal(0, 0.5, p.shape)
    return net


# ---- BN-ReLU units: batch statistics, the ReLU mask, unit data ---------------------------------

def bn_normalize_forward(xhat, mean, var, rstd, x, eps):
    """xhat (C, M), mean/var/rstd (C,) <- batch statistics of x (C, M) in plain NumPy, in the
    operations and order of lowmem.ops.batchnorm (sum/M, mean of squared deviations, 1/sqrt),
    so x-hat = (x - mean)*rstd is what a kernel given the same mean and rstd must produce."""
    M = x.shape[1]
    mean[...] = x.sum(axis=1) / M
    var[...] = np.square(x - mean[:, None]).sum(axis=1) / M
    rstd[...] = 1 / np.sqrt(var + eps)
    xhat[...] = (x - mean[:, None]) * rstd[:, None]


def relu_mask(xhat, gamma, beta):
    """bool (C, M): where the forward's ReLU passes, (xhat*gamma) + beta > 0, multiply then add."""
    return (xhat * gamma[:, None]) + beta[:, None] > 0


def beyond_window_channels(C):
    """The channels of unit_case whose threshold lies beyond the quantizer window's top."""
    return (C - 2, C - 1) if C >= 5 else ()


def unit_case(dtype, C=7, M=1024, seed=0):
    """x (C, M) and gamma, beta (C,) covering the quantizer's cases: gamma = 0 with a closed
    mask (channel 0), a tiny negative gamma (1), a threshold far below the window (2), a negative
    gamma with the threshold inside (3, when C >= 6), and (C >= 5) thresholds t = 6 beyond the
    window's top for both signs of gamma (beyond_window_channels), with x-hat outliers past them
    (about 7.4 sigma): open elements decoded below t."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((C, M)) * 2 + 0.5).astype(dtype)
    gamma = rng.standard_normal(C).astype(dtype)
    gamma[0], gamma[1] = 0, -1e-30
    beta = (rng.standard_normal(C) * 2).astype(dtype)
    beta[0] = -0.5
    beta[2] = 10 * abs(gamma[2])
    if C >= 6:
        gamma[3], beta[3] = -0.7, 0.2
    for c, sign in zip(beyond_window_channels(C), (1, -1)):
        x[c, ::64] += sign * 40
        gamma[c] = sign * abs(gamma[c])
        beta[c] = -6 * abs(gamma[c])
    return x, gamma, beta


# ---- ops of general graphs: grouped convs, flatten + linear ------------------------------------

def grouped_conv_ref(x, w, stride, pad, groups, bias=None):
    """Naive float64 loops, group by group: output channel o of group g = o // (Cout/G) sums
    input channels g*Cin_g .. (g+1)*Cin_g - 1 of the zero-padded x; plus bias[o]."""
    Cin, N, H, W = x.shape
    Cout, cig, kh, kw = w.shape
    cog = Cout // groups
    xpad = np.zeros((Cin, N, H + 2 * pad, W + 2 * pad))
    xpad[:, :, pad:pad + H, pad:pad + W] = x
    Ho, Wo = (H + 2 * pad - kh) // stride + 1, (W + 2 * pad - kw) // stride + 1
    out = np.zeros((Cout, N, Ho, Wo))
    for o in range(Cout):
        g = o // cog
        for n in range(N):
            for i in range(Ho):
                for j in range(Wo):
                    patch = xpad[g * cig:(g + 1) * cig, n, stride * i:stride * i + kh, stride * j:stride * j + kw]
                    out[o, n, i, j] = np.sum(patch * w[o]) + (0 if bias is None else bias[o])
    return out


def flatten_linear_ref(x, w, b):
    """(K, N): nn.Linear on torch.flatten of the NCHW batch, from channels-major x (C, N, H, W)."""
    N = x.shape[1]
    flat = x.transpose(1, 0, 2, 3).reshape(N, -1)       # (N, C*H*W) in (c, h, w) order
    return (flat @ w.T + b).T


def packbits_little(bits_bool):
    """numpy.packbits of a flat bool array, bit j of byte i = element 8*i + j."""
    return np.packbits(np.asarray(bits_bool, bool).reshape(-1), bitorder="little")


# ---------------------------------------------- whole-network checks (shared by test modules)

def batch(rng, net, n, shape, dtype=np.float64):
    x = rng.standard_normal((n,) + tuple(shape)).astype(dtype)
    return x, rng.integers(0, net.num_classes, n)


def close(numeric, analytic, rtol=1e-5, atol=1e-9):
    return abs(numeric - analytic) <= rtol * abs(analytic) + atol


def central_multi(f, arrays, dirs, eps):
    """Central difference of f() along the joint direction `dirs` over several arrays (restored after)."""
    saved = [a.copy() for a in arrays]
    try:
        vals = []
        for sign in (1, -1):
            for a, a0, d in zip(arrays, saved, dirs):
                a[...] = a0 + sign * eps * d
            vals.append(f())
    finally:
        for a, a0 in zip(arrays, saved):
            a[...] = a0
    return (vals[0] - vals[1]) / (2 * eps)


def check_directional(f, arrays, grads, rng, what):
    """Backward's directional derivative along a random direction vs central differences at
    eps = 1e-7 (float64). A BN-ReLU kink crossed inside +-eps spoils one quotient; a second,
    smaller eps then decides."""
    dirs = [rng.standard_normal(a.shape) for a in arrays]
    analytic = sum(float(np.sum(g * d)) for g, d in zip(grads, dirs))
    numeric = central_multi(f, arrays, dirs, 1e-7)
    if not close(numeric, analytic):
        numeric = central_multi(f, arrays, dirs, 3e-8)
    assert close(numeric, analytic), f"{what}: fd {numeric!r} vs backward {analytic!r}"


def rel(a, b):
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    nb = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / nb) if nb else float(np.linalg.norm(a))
