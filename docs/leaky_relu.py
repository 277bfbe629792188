"""Adding an op that keeps something for its backward: LeakyReLU with a 1-bit sign mask.

    out = x where x > 0, SLOPE·x elsewhere;   dx = dout where x > 0, SLOPE·dout elsewhere

Read with docs/new_op.md.  Run:  python docs/leaky_relu.py   (NumPy and lowmem; a few seconds)
"""
import numpy as np

import lowmem as lm
from lowmem.core.network import Layer, Network
from lowmem.core.optable import OPS, Op
from lowmem.ops.bitpack import blocks, check_packed, flat, pack_block, packed_nbytes, unpack_block

SLOPE = 0.1


# ---- 1. the op functions: outputs first, one block of elements at a time --------------------
def leaky_forward(out, mask, x):
    """out = x if x > 0 else SLOPE·x (out may alias x); mask (ceil(n/8),) uint8 <- [x > 0].
    Temporaries: a block (bitpack.BLOCK elements) of booleans."""
    o, s = flat(out, "out"), flat(x, "x")
    check_packed(mask, s.size, 1, "mask")
    for a, b in blocks(s.size):
        pos = s[a:b] > 0                                   # read before out overwrites x
        pack_block(mask[a // 8:(b + 7) // 8], pos.view(np.uint8), 1)
        np.copyto(o[a:b], s[a:b])
        np.multiply(o[a:b], SLOPE, out=o[a:b], where=~pos)


def leaky_backward(dx, dout, mask, accumulate=False):
    """dx = (or += with accumulate) dout where x > 0, SLOPE·dout elsewhere; dx may alias dout.

    # saved: mask, the 1-bit [x > 0] of the forward's input (exact)."""
    d, g = flat(dx, "dx"), flat(dout, "dout")
    check_packed(mask, g.size, 1, "mask")
    for a, b in blocks(g.size):
        neg = unpack_block(np.empty(b - a, np.uint8), mask[a // 8:(b + 7) // 8], 1) == 0
        if accumulate:
            d[a:b] += np.where(neg, SLOPE * g[a:b], g[a:b])    # a block of temporaries
        else:
            np.copyto(d[a:b], g[a:b])
            np.multiply(d[a:b], SLOPE, out=d[a:b], where=neg)


# ---- 2. the op-table entry: every rule of the op in one place ------------------------------
class LeakyReLU(Op):
    """x if x > 0 else SLOPE·x: keeps the 1-bit mask [x > 0] in the saved slot <layer>.mask."""
    in_place = True                                        # may write the buffer it reads

    @staticmethod
    def out_shape(L, shape):
        return shape                                       # (C, H, W) in, the same out

    @staticmethod
    def plan(step, N, units, dtype, budget):
        c, h, w = step.in_shape                            # per sample; N samples in a batch
        return [(f"{step.name}.mask", "saved", (packed_nbytes(c * N * h * w, 1),), "uint8")]

    @staticmethod
    def route(L, walk):
        """Backward reads its output gradient and the mask only, so the input gradient may
        overwrite the output gradient's buffer; it is added instead when another layer has
        already put a gradient for the same input there (walk.grad_for decides)."""
        dout = walk.output_grad(L)
        dx, acc = walk.grad_for(L, walk.tin[L.name][0], dout, in_place=dout, reading=(dout,))
        walk.step(L, dout=dout, dx=dx, accumulate=acc)

    @staticmethod
    def forward(run, step):
        x, out = _flat(run, step.src, step), _flat(run, step.dst, step)
        if run.training:
            leaky_forward(out, run.arrays[step.saved[0]], x)
        else:                                              # eval (predict): keeps nothing
            np.copyto(out, np.where(x > 0, x, SLOPE * x))

    @staticmethod
    def backward(run, step):
        leaky_backward(_flat(run, step.dx, step), _flat(run, step.dout, step),
                       run.arrays[step.saved[0]], step.accumulate)


def _flat(run, buf, step):
    """The layer's (C, N, H, W) tensor in a shared buffer: its first C·N·H·W elements."""
    c, h, w = step.in_shape
    return run.arrays[buf][:c * run.n * h * w]


def register():
    """Add the entry to lowmem's op table (in lowmem itself: one key of OPS in
    lowmem/core/optable/__init__.py)."""
    OPS["leaky"] = LeakyReLU


def leaky(net, name, src, dst):
    """The layer record (in lowmem itself a Network method, as Network.relu)."""
    net.layers.append(Layer("leaky", name, src, dst))


# ---- 3. a small network that uses it --------------------------------------------------------
def small_net(seed=0):
    """conv -> BN -> leaky -> conv (stride 2) -> BN -> leaky -> global pool -> FC, for 1x8x8
    inputs and 4 classes, in two buffers (BN and leaky run in place)."""
    net = Network("leaky-net", 1, 4, seed)
    net.conv("conv1", "input", "act0", 1, 8, 3)
    net.bn("bn1", "act0", "act0", 8)
    leaky(net, "leaky1", "act0", "act0")
    net.conv("conv2", "act0", "act1", 8, 16, 3, stride=2)
    net.bn("bn2", "act1", "act1", 16)
    leaky(net, "leaky2", "act1", "act1")
    net.head("act1", 16)
    return net


def check_gradients(eps=1e-6, seed=0):
    """float64, exact mode: the engine's gradient of its own loss, along a random direction of
    each weight, against central differences at eps and eps/3 (a step may cross a kink)."""
    rng = np.random.default_rng(seed)
    net = small_net()
    eng = lm.Engine(net, 4, (1, 8, 8), "exact", dtype="float64")
    x, labels = rng.standard_normal((4, 1, 8, 8)), rng.integers(0, 4, 4)
    eng.forward(x, labels)
    eng.backward()
    worst = 0.0
    for p in net.parameters():
        d = rng.standard_normal(p.shape)
        analytic = float(np.sum(p.grad * d))
        diffs = []
        for e in (eps, eps / 3):
            w0 = p.data.copy()
            p.data[...] = w0 + e * d
            up = eng.forward(x, labels)[0]
            p.data[...] = w0 - e * d
            down = eng.forward(x, labels)[0]
            p.data[...] = w0
            diffs.append(abs((up - down) / (2 * e) - analytic) / max(abs(analytic), 1e-12))
        worst = max(worst, min(diffs))
    return worst


def stripes_batch(rng, n):
    """A task to learn: 1x8x8 images of stripes, horizontal, vertical or diagonal either way
    (the label), at a random phase under noise of the same size."""
    labels = rng.integers(0, 4, n)
    i, j = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
    lines = np.stack([i, j, i + j, i - j])                 # one coordinate per orientation
    phase = rng.integers(0, 4, n)[:, None, None]
    x = np.cos(np.pi / 2 * (lines[labels] + phase)) + rng.standard_normal((n, 8, 8))
    return x[:, None], labels


def train(steps=60, batch=32, mode="approx", seed=0):
    """SGD on stripes_batch, float64 (so the printed losses are the same on every machine)."""
    rng = np.random.default_rng(seed)
    net = small_net()
    eng = lm.Engine(net, batch, (1, 8, 8), mode, bits=4, dtype="float64")
    opt = lm.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    for step in range(steps):
        loss = eng.train_step(*stripes_batch(rng, batch), opt)
        if step % 20 == 0 or step == steps - 1:
            print(f"step {step:2}  loss {loss:.3f}")
    right = 0
    for _ in range(4):                                     # 4 new batches, eval mode
        x, labels = stripes_batch(rng, batch)
        right += int(np.sum(eng.predict(x).argmax(1) == labels))
    print(f"accuracy on {4 * batch} new images: {right / (4 * batch):.3f}")


if __name__ == "__main__":
    register()
    eng = lm.Engine(small_net(), 32, (1, 8, 8), "approx", bits=4, allocate=False)
    print(eng.schedule)
    print("\n".join(row for row in eng.plan.report().splitlines() if ".mask " in row))
    print(f"finite differences agree to 1e-6 (float64): {check_gradients() < 1e-6}")
    train()
