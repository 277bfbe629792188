"""Per unit of a real network: how much 4-bit error is stored, and how much is passed on.

    python benchmarks/unit_errors.py [--depth 20] [--bits 4] [--batch 32] [--batches 2]
                                     [--train-steps 300] [--data DIR] [--full]

For every BN->ReLU unit of a pre-activation CIFAR ResNet (basic blocks) on
Fashion-MNIST (padded to 32x32), at initialisation and after `--train-steps`
exact SGD steps of lowmem (lr 0.05, momentum 0.9, weight decay 5e-4, batch
`--batch`), this prints the unit's *local* relative errors: the error its own
K-bit code makes in its own backward step, given the exact gradient arriving
from above (so nothing accumulated from other units):

    xhat   ||x̃ − x̂|| / ||x̂||                         the stored tensor
    dx     ||dx̃ − dx|| / ||dx||                       the gradient it passes down
    dgamma ||dγ̃ − dγ|| / ||dγ||                       its BN weight's gradient
    dW     ||dW̃ − dW|| / ||dW||                       the weight gradient of the conv it
                                                      feeds, from the rebuilt input
                                                      mask·(γ·x̃ + β) (the first conv;
                                                      bn_final feeds the FC through an
                                                      exact saved input: "-")

each as rms over `--batches` mini-batches of the norm of the difference,
divided by the rms of the exact norm. With the same incoming dy = dr·mask
(exact: the mask is exact), the local dx error is
dx̃ − dx = −γ·rstd·(x̃·mean(dy·x̃) − x̂·mean(dy·x̂)): x̃ enters only through
this projection term, which is why the dx column is far below the xhat one
(docs/batchnorm.md §3b).

Then, for comparison, `total dW`: the relative error of the same conv weight's
gradient in lowmem's approx mode against its exact mode (float32 engines, the
same weights and batches): local errors of every unit above plus this one's.

The local analysis runs in float64 with an independent PyTorch forward (autograd
gives each unit's exact dy and each conv's exact output gradient); x̃ comes from
lowmem's own quantizer (`window.quantize_simulated`), so the grid is lowmem's.
Needs PyTorch (the test extra).
"""
import argparse
import copy
import os
import sys
import time

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from lowmem.tools import gradient_error as D  # noqa: E402
from lowmem.units import widths, window  # noqa: E402
from lowmem.data.datasets import channel_mean_std, load_fashion_mnist           # noqa: E402
from lowmem.data.transforms import normalize                                    # noqa: E402
from lowmem.models import preact_resnet_cifar       # noqa: E402

EPS = 1e-5


def fashion_batches(count, batch, offset, data_dir=None):
    """`count` normalised Fashion-MNIST training batches (float32, N x 1 x 32 x 32)."""
    x, y, _, _ = load_fashion_mnist(data_dir, pad_to=32, limit_train=offset + count * batch, limit_test=1)
    mean, std = channel_mean_std(x)
    out = []
    for b in range(count):
        sl = slice(offset + b * batch, offset + (b + 1) * batch)
        xb = normalize(numpy.empty(x[sl].shape, numpy.float32), x[sl], mean, std)
        out.append((xb, y[sl].copy()))
    return out


class Recorder:
    """A functional float64 pre-act ResNet forward that keeps, per unit, x̂, γ, β, rstd and
    its output y (gradient retained), and per conv its input and output."""

    def __init__(self, torch, state):
        self.torch, self.F = torch, torch.nn.functional
        self.p = {k: torch.from_numpy(numpy.asarray(v, numpy.float64)).requires_grad_(True)
                  for k, v in state.items()}
        self.units, self.convs = {}, {}

    def unit(self, x, name):
        t = self.torch
        mu = x.mean(dim=(0, 2, 3), keepdim=True)
        var = ((x - mu) ** 2).mean(dim=(0, 2, 3), keepdim=True)
        rstd = 1 / t.sqrt(var + EPS)
        xhat = (x - mu) * rstd
        g, b = self.p[name + ".weight"], self.p[name + ".bias"]
        y = xhat * g[None, :, None, None] + b[None, :, None, None]
        y.retain_grad()
        self.units[name] = dict(xhat=xhat, y=y, gamma=g, beta=b, rstd=rstd.flatten())
        return self.F.relu(y)

    def conv(self, r, name, unit, stride=1):
        w = self.p[name + ".weight"]
        out = self.F.conv2d(r, w, stride=stride, padding=(w.shape[-1] - 1) // 2)
        out.retain_grad()
        self.convs[name] = dict(r=r, out=out, unit=unit, stride=stride)
        return out

    def forward(self, x, depth):
        n = (depth - 2) // 6
        h = self.F.conv2d(x, self.p["conv1.weight"], padding=1)
        for s in range(3):
            for b in range(n):
                name = f"layer{s + 1}.{b}"
                stride = 2 if (b == 0 and s > 0) else 1
                a = self.unit(h, name + ".bn1")
                skip = (self.conv(a, name + ".shortcut", name + ".bn1", stride)
                        if name + ".shortcut.weight" in self.p else h)
                out = self.conv(a, name + ".conv1", name + ".bn1", stride)
                out = self.conv(self.unit(out, name + ".bn2"), name + ".conv2", name + ".bn2")
                h = out + skip
        a = self.unit(h, "bn_final")
        return a.mean(dim=(2, 3)) @ self.p["fc.weight"].T + self.p["fc.bias"]


def local_errors(torch, state, depth, batches, bits):
    """{unit: {column: (diff², exact²) summed over batches}} and the unit order."""
    sums, order, autograd = {}, None, []
    for x, labels in batches:
        rec = Recorder(torch, state)
        xt = torch.from_numpy(x.astype(numpy.float64)).requires_grad_(False)
        logits = rec.forward(xt, depth)
        torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels)).backward()
        order = list(rec.units)
        autograd.append({k: v.grad.numpy().copy() for k, v in rec.p.items() if v.grad is not None})
        first_conv = {}
        for cname, c in rec.convs.items():
            if not cname.endswith("shortcut"):
                first_conv.setdefault(c["unit"], cname)
        for name, u in rec.units.items():
            xhat = u["xhat"].detach().transpose(0, 1).reshape(u["xhat"].shape[1], -1).numpy()
            g, b = u["gamma"].detach().numpy(), u["beta"].detach().numpy()
            xt_, mask = window.quantize_simulated(numpy.ascontiguousarray(xhat), g, b, bits)
            dy = u["y"].grad.transpose(0, 1).reshape(xhat.shape).numpy()
            scale = (g * u["rstd"].detach().numpy())[:, None]
            proj = lambda v: v * (dy * v).mean(axis=1, keepdims=True)          # noqa: E731
            dx = scale * (dy - dy.mean(axis=1, keepdims=True) - proj(xhat))
            diffs = {"xhat": (xt_ - xhat, xhat),
                     "dx": (-scale * (proj(xt_) - proj(xhat)), dx),
                     "dgamma": ((dy * (xt_ - xhat)).sum(axis=1), (dy * xhat).sum(axis=1))}
            if name in first_conv:
                c = rec.convs[first_conv[name]]
                shape = u["xhat"].shape
                rt = mask * (g[:, None] * xt_ + b[:, None])                   # the rebuilt conv input
                rt = torch.from_numpy(rt.reshape(shape[1], shape[0], *shape[2:]).transpose(1, 0, 2, 3).copy())
                w = state[first_conv[name] + ".weight"]
                grad_w = lambda r: torch.nn.grad.conv2d_weight(                 # noqa: E731
                    r, w.shape, c["out"].grad, stride=c["stride"], padding=(w.shape[-1] - 1) // 2).numpy()
                exact = grad_w(c["r"].detach())
                diffs["dW"] = (grad_w(rt) - exact, exact)
            acc = sums.setdefault(name, {})
            for col, (d, e) in diffs.items():
                s = acc.setdefault(col, [0.0, 0.0])
                s[0] += float((d ** 2).sum())
                s[1] += float((e ** 2).sum())
    return sums, order, autograd


def first_convs(order, state):
    return {u: (u.rsplit(".", 1)[0] + ".conv" + u[-1]) for u in order if u != "bn_final"}


def measure(net, depth, batches, bits, label):
    import torch
    torch.set_num_threads(1)
    state = {k: numpy.asarray(v) for k, v in net.state_dict().items()}
    sums, order, autograd = local_errors(torch, state, depth, batches, bits)
    g_exact = D.parameter_grads(net, batches, "exact", bits)
    g_approx = D.parameter_grads(net, batches, "approx", bits)
    # the independent float64 forward must agree with lowmem's exact mode (float32)
    agree = max(numpy.abs(g_exact[k][b] - g).max() / numpy.abs(g).max()
                for b, grads in enumerate(autograd) for k, g in grads.items())
    print(f"check: PyTorch float64 vs lowmem exact float32 gradients, worst max-abs / max: {agree:.1e}")
    conv_of = first_convs(order, state)
    rows = []
    for u in order:
        r = {c: (numpy.sqrt(d / e) if e > 0 else float("nan")) for c, (d, e) in sums[u].items()}
        cname = conv_of.get(u)
        if cname:
            ge, ga = g_exact[cname + ".weight"], g_approx[cname + ".weight"]
            r["total dW"] = float(numpy.sqrt(((ga - ge) ** 2).sum() / (ge ** 2).sum()))
        rows.append((u, cname, r))
    return rows


COLUMNS = ("xhat", "dx", "dgamma", "dW", "total dW")


def fmt(v):
    return "-" if v is None or v != v else f"{v:.4f}"


def print_table(rows, full):
    if full:
        print(f"{'unit':16s} {'feeds':22s} " + " ".join(f"{c:>9s}" for c in COLUMNS))
        for u, cname, r in rows:
            print(f"{u:16s} {cname or 'fc (exact input)':22s} " + " ".join(f"{fmt(r.get(c)):>9s}" for c in COLUMNS))
    print(f"{'over units':16s} {'':22s} " + " ".join(f"{c:>9s}" for c in COLUMNS))
    for what, f in (("median", numpy.median), ("min", numpy.min), ("max", numpy.max)):
        vals = []
        for c in COLUMNS:
            v = [r[c] for _, _, r in rows if c in r and r[c] == r[c]]
            vals.append(fmt(f(v)) if v else "-")
        print(f"{what:16s} {'':22s} " + " ".join(f"{v:>9s}" for v in vals))
    ratio = [r["dx"] / r["xhat"] for _, _, r in rows]
    print(f"dx / xhat over units: median {numpy.median(ratio):.4f}, max {numpy.max(ratio):.4f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depth", type=int, default=20)
    p.add_argument("--bits", type=int, default=4, choices=widths.BITS[::-1])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="Fashion-MNIST directory (default: lowmem's search)")
    p.add_argument("--full", action="store_true", help="print every unit, not only the summary")
    a = p.parse_args(argv)
    t0 = time.time()
    net = preact_resnet_cifar(a.depth, in_channels=1, seed=a.seed)
    measure_batches = fashion_batches(a.batches, a.batch, 0, a.data)
    print(f"pre-act ResNet-{a.depth}, Fashion-MNIST 32x32, {a.bits}-bit (W = {window.half_width(a.bits)}), "
          f"{a.batches} batches of {a.batch}; local errors in float64, total dW from float32 engines")
    for steps in sorted({0, a.train_steps}):
        if steps:
            train = fashion_batches(steps, a.batch, a.batches * a.batch, a.data)
            net = D.warm_up(net, train, steps, lr=0.05)
        print(f"\n-- after {steps} exact SGD steps (lr 0.05, momentum 0.9, weight decay 5e-4, batch {a.batch})")
        print_table(measure(copy.deepcopy(net), a.depth, measure_batches, a.bits, steps), a.full)
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
