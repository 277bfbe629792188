"""Memory of one training step: PyTorch plain, with gradient checkpointing, with saved_tensors_hooks, and lowmem.

    python benchmarks/torch_saved_memory.py [--depth 20] [--batch 128]

The same pre-activation CIFAR ResNet (basic blocks, 1x1 projection shortcuts,
float32, 3x32x32 inputs) is trained for one step in each configuration, each
in its own process, and the peak resident memory of the step above the
process's memory just before it is reported (ru_maxrss; the model, the input
batch and PyTorch's own libraries are already loaded, so the difference is
what the step allocates: activations kept for backward, gradients, temporaries):

  torch plain        ordinary autograd: every tensor the ops save stays until backward
  torch checkpoint   torch.utils.checkpoint per residual block (use_reentrant=False): only
                     block inputs are kept; each block's forward is recomputed in backward
  torch hooks-8bit   torch.autograd.graph.saved_tensors_hooks that store each saved float
                     tensor as uint8 with a per-tensor min and scale (a plain 8-bit
                     compressor, the mechanism ActNN/GACT build on); forward stays exact
  lowmem exact / approx 4-bit   lowmem.tools.peak_memory.measure_peak (tracemalloc of NumPy's
                     allocations during real steps) next to the plan total

Memory only; no timings are reported (the machine may be shared).
"""
import argparse
import json
import os
import resource
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def torch_model(depth, torch):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            self.bn1, self.bn2 = nn.BatchNorm2d(cin), nn.BatchNorm2d(width)
            self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
            self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
            self.shortcut = nn.Conv2d(cin, width, 1, stride, bias=False) if stride != 1 or cin != width else None

        def forward(self, x):
            a = F.relu(self.bn1(x))
            skip = self.shortcut(a) if self.shortcut is not None else x
            return self.conv2(F.relu(self.bn2(self.conv1(a)))) + skip

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            n, c, blocks = (depth - 2) // 6, 16, []
            self.stem = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
            for s, width in enumerate((16, 32, 64)):
                for b in range(n):
                    blocks.append(Block(c, width, 2 if (b == 0 and s > 0) else 1))
                    c = width
            self.blocks = nn.ModuleList(blocks)
            self.bn, self.fc = nn.BatchNorm2d(c), nn.Linear(c, 10)
            self.checkpoint = False

        def forward(self, x):
            h = self.stem(x)
            for blk in self.blocks:
                if self.checkpoint:
                    h = torch.utils.checkpoint.checkpoint(blk, h, use_reentrant=False)
                else:
                    h = blk(h)
            return self.fc(F.relu(self.bn(h)).mean(dim=(2, 3)))
    return Net()


def pack8(torch, kept):
    def pack(t):
        if not t.is_floating_point() or t.numel() < 4096 or isinstance(t, torch.nn.Parameter):
            return ("raw", t)
        lo, hi = t.min(), t.max()
        scale = (hi - lo).clamp_min(1e-12) / 255
        q = ((t - lo) / scale).round_().to(torch.uint8)
        kept[id(q)] = q.nbytes
        return ("q", q, lo, scale, t.dtype)

    def unpack(p):
        if p[0] == "raw":
            return p[1]
        _, q, lo, scale, dtype = p
        return (q.to(dtype) * scale + lo)
    return pack, unpack


def run_torch(mode, depth, batch):
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch_model(depth, torch)
    model.checkpoint = mode == "checkpoint"
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kept = {}                       # bytes the saved activations hold at the end of the forward pass

    def count(t):                   # identity hook: what plain autograd keeps (one entry per storage)
        if t.is_floating_point() and not isinstance(t, torch.nn.Parameter):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    if mode == "hooks-8bit":
        with torch.autograd.graph.saved_tensors_hooks(*pack8(torch, kept)):
            loss = torch.nn.functional.cross_entropy(model(x), y)
    elif mode == "plain":
        with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
            loss = torch.nn.functional.cross_entropy(model(x), y)
    else:
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"step_peak_MiB": (peak - base) / 1024}
    if kept:
        out["saved_MiB"] = sum(kept.values()) / 2**20
    return out


def run_lowmem(mode, depth, batch):
    from lowmem.tools import peak_memory
    from lowmem.models import preact_resnet_cifar
    net = preact_resnet_cifar(depth)
    m, bits = ("approx", 4) if mode == "approx-4" else ("exact", 4)
    r = peak_memory.measure_peak(net, batch, (3, 32, 32), mode=m, bits=bits, steps=2)
    return {"measured_MiB": r.peak_bytes / 2**20, "plan_MiB": r.plan_bytes / 2**20}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depth", type=int, default=20)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        kind, mode = a.one.split(":")
        fn = run_torch if kind == "torch" else run_lowmem
        print(json.dumps(fn(mode, a.depth, a.batch)))
        return
    print(f"pre-act ResNet-{a.depth}, batch {a.batch}, float32, 3x32x32; one training step per process")
    for one in ("torch:plain", "torch:checkpoint", "torch:hooks-8bit", "lowmem:exact", "lowmem:approx-4"):
        out = subprocess.run([sys.executable, __file__, "--depth", str(a.depth), "--batch", str(a.batch),
                              "--one", one], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{one:20s} " + ", ".join(f"{k} {v:,.1f}" for k, v in r.items()))


if __name__ == "__main__":
    main()
