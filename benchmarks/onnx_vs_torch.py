"""Full-size torchvision architectures through ONNX against PyTorch autograd, in float64.

    python benchmarks/onnx_vs_torch.py                              # ResNet-18, -50, DenseNet-121, MobileNetV2
    python benchmarks/onnx_vs_torch.py --models resnet50 --input 3x224x224 --batch 2
    python benchmarks/onnx_vs_torch.py --plans                      # saved bytes, exact vs 4-bit, 3x224x224 b32

Each model (tests/torchvision_layout.py: torchvision's modules and names, written again) gets
random batch-norm parameters and statistics, is exported with

    torch.onnx.export(model, x, path, training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False, dynamo=False)

read by lowmem.nn.from_onnx, and both run one training-mode batch in float64 (the file's weights
in both). Printed per model: parameters, whether the names equal torch's named_parameters(),
the loss's relative error (names: the same set; lowmem lists them in forward order), and the worst parameter gradient's ||a - b|| / ||b|| (the norm floored
at 1e-8 of the largest gradient's: a batch-norm bias whose every path runs into another batch
norm has an exactly-zero gradient, which both sides compute as ~1e-17 noise). MobileNetV2's
classifier dropout is exported at p = 0 (lowmem's head is the pool and the linear layer).

Batch norm over very few values is ill-conditioned (at 32x32 inputs with batch 2 the last stages
normalise 2 values per channel): rounding differences of 1e-16 then grow to ~1e-6, in either
implementation; the default input 3x64x64 at batch 4 keeps at least 8 values per channel.
"""
import argparse
import os
import sys
import tempfile
import time
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))        # torchvision_layout.py


def models():
    import torchvision_layout as tv
    return {"resnet18": lambda k: tv.resnet(18, k), "resnet50": lambda k: tv.resnet(50, k),
            "densenet121": lambda k: tv.densenet(121, k), "mobilenet_v2": lambda k: tv.mobilenet_v2(k, dropout=0.0)}


def randomized(model, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.3)
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.2)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
    return model


def compare(name, make, shape, batch, classes, folder):
    import torch
    from torch.nn import functional as F
    from lowmem import nn
    from lowmem.core.engine import Engine
    torch.manual_seed(0)
    model = randomized(make(classes), 1).train()
    path = os.path.join(folder, name + ".onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, torch.randn((2,) + shape), path, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, dynamo=False)
    net = nn.from_onnx(path)
    state = {k: torch.from_numpy(v.astype(np.float64)) for k, v in net.state_dict().items()}
    model.double().load_state_dict(state, strict=False)
    rng = np.random.default_rng(2)
    x, labels = rng.standard_normal((batch,) + shape), rng.integers(0, classes, batch)
    eng = Engine(net, batch, shape, mode="exact", dtype="float64")
    loss, _ = eng.forward(x, labels)
    eng.backward()
    tloss = F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(labels))
    model.zero_grad(set_to_none=True)
    tloss.backward()
    floor = 1e-8 * max(float(np.linalg.norm(p.grad.numpy())) for p in model.parameters())
    errors = {n: float(np.linalg.norm(net.params[n].grad - p.grad.numpy()) / max(np.linalg.norm(p.grad.numpy()), floor))
              for n, p in model.named_parameters()}
    worst = max(errors, key=errors.get)
    same = {p.name for p in net.parameters()} == {n for n, _ in model.named_parameters()}
    return dict(params=len(errors), numel=sum(p.numel() for p in model.parameters()), same=same,
                loss=abs(loss - tloss.item()) / abs(tloss.item()), worst=errors[worst], worst_name=worst)


def plans(names, shape, batch, classes, folder):
    """The imported networks' plans (no arrays): saved-for-backward and total bytes, exact vs approx 4-bit."""
    import torch
    from lowmem import nn
    from lowmem.core.engine import Engine
    table = models()
    print(f"plans at input {'x'.join(map(str, shape))}, batch {batch}, float32 (MiB)")
    print(f"{'model':<13} {'saved exact':>11} {'saved 4-bit':>11} {'ratio':>6} {'total exact':>11} {'total 4-bit':>11}")
    for name in names:
        path = os.path.join(folder, name + ".onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(table[name](classes).train(), torch.randn((1,) + shape), path,
                              training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, dynamo=False)
        net = nn.from_onnx(path)
        ex = Engine(net, batch, shape, mode="exact", allocate=False).plan
        ap = Engine(net, batch, shape, mode="approx", bits=4, allocate=False).plan
        se, sa = ex.bytes_by_kind()["saved"], ap.bytes_by_kind()["saved"]
        print(f"{name:<13} {se / 2**20:>11.1f} {sa / 2**20:>11.1f} {se / sa:>5.2f}x {ex.total_bytes / 2**20:>11.1f} "
              f"{ap.total_bytes / 2**20:>11.1f}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="resnet18,resnet50,densenet121,mobilenet_v2")
    p.add_argument("--input", default="3x64x64", help="CxHxW (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--plans", action="store_true",
                   help="print the plans instead (default input 3x224x224, batch 32, 1000 classes)")
    args = p.parse_args(argv)
    if args.plans:
        with tempfile.TemporaryDirectory() as folder:
            shape = (3, 224, 224) if args.input == "3x64x64" else tuple(int(v) for v in args.input.split("x"))
            plans(args.models.split(","), shape, 32 if args.batch == 4 else args.batch,
                  1000 if args.classes == 10 else args.classes, folder)
        return
    shape = tuple(int(v) for v in args.input.split("x"))
    table = models()
    print(f"input {args.input}, batch {args.batch}, float64, exact mode; relative errors against autograd")
    print(f"{'model':<13} {'tensors':>7} {'parameters':>11} {'names':>6} {'loss':>9} {'worst grad':>10}  (which)")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            t = time.monotonic()
            r = compare(name, table[name], shape, args.batch, args.classes, folder)
            print(f"{name:<13} {r['params']:>7} {r['numel']:>11,} {'same' if r['same'] else 'DIFF':>6} "
                  f"{r['loss']:>9.1e} {r['worst']:>10.1e}  ({r['worst_name']}; {time.monotonic() - t:.0f} s)",
                  flush=True)


if __name__ == "__main__":
    main()
