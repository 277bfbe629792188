"""Accuracy of an imported network: torchvision's post-activation ResNet-18, written in PyTorch, exported
to ONNX and trained by `lowmem train --model r18.onnx` on Fashion-MNIST, exact against approx 4-bit.

    python benchmarks/accuracy_imported.py --out benchmarks/results/accuracy_imported

Per seed s, the model (tests/torchvision_layout.py: torchvision's ResNet-18 with one input channel,
its ImageNet stem unchanged) is built under torch.manual_seed(s) and exported with

    torch.onnx.export(model, x, path, training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)

so the file's initializers are seed s's initial weights. Each mode then trains from that file with
`lowmem train --model PATH --seed s` (the same weights, batch order and data for both modes of a
seed: the modes differ only in what the backward pass keeps), and the final test accuracy is read
from the run's metrics.jsonl. The report gives each mode's accuracy per seed and the paired
difference approx - exact per seed, with its mean.

Resumable: results.json under --out is rewritten atomically after every finished run; rerunning the
same command skips runs already recorded with the same settings (and `lowmem train --resume`
continues an interrupted run).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))           # torchvision_layout.py


def export(path, seed, size):
    import torch
    import torchvision_layout as tv
    torch.manual_seed(seed)
    model = tv.resnet(18, 10, in_channels=1).train()
    tmp = path + ".tmp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, torch.randn(2, 1, size, size), tmp, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, dynamo=False)
    os.replace(tmp, path)


def final_accuracy(run_dir):
    acc = None
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            for key in ("test_acc", "test_accuracy", "val_acc"):
                if rec.get(key) is not None:
                    acc = float(rec[key])
    if acc is None:
        raise SystemExit(f"{run_dir}/metrics.jsonl: no test accuracy recorded")
    return acc


def save(path, results):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/accuracy_imported")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--modes", default="exact,approx4", help="exact, approxK")
    p.add_argument("--limit-train", type=int, default=6000)
    p.add_argument("--limit-test", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--schedule", default="step", help="lowmem train --schedule: step, cosine, constant")
    p.add_argument("--pad-to", type=int, default=32, help="zero-pad 28x28 to this (the ONNX input size)")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    settings = {k: getattr(a, k) for k in ("limit_train", "limit_test", "epochs", "batch", "lr", "pad_to")}
    if a.schedule != "step":                                    # results recorded before the option match
        settings["schedule"] = a.schedule
    rpath = os.path.join(a.out, "results.json")
    results = {"settings": settings, "runs": {}}
    if os.path.exists(rpath):
        with open(rpath) as f:
            old = json.load(f)
        if old.get("settings") == settings:
            results = old
    seeds = [int(s) for s in a.seeds.split(",")]
    modes = a.modes.split(",")
    for seed in seeds:
        onnx_path = os.path.join(a.out, f"resnet18_seed{seed}.onnx")
        if not os.path.exists(onnx_path):
            export(onnx_path, seed, a.pad_to)
        for mode in modes:
            key = f"{mode}:seed{seed}"
            if key in results["runs"]:
                continue
            run_dir = os.path.join(a.out, "runs", key.replace(":", "_"))
            m, bits = ("exact", "4") if mode == "exact" else ("approx", mode[len("approx"):])
            cmd = [sys.executable, "-m", "lowmem", "train", "--model", onnx_path, "--dataset", "fashion-mnist",
                   "--pad-to", str(a.pad_to), "--limit-train", str(a.limit_train), "--limit-test", str(a.limit_test),
                   "--epochs", str(a.epochs), "--batch", str(a.batch), "--lr", str(a.lr), "--schedule", a.schedule, "--no-augment",
                   "--mode", m, "--bits", bits, "--seed", str(seed), "--out", run_dir, "--no-progress"]
            if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
                cmd.append("--resume")
            print(" ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
            results["runs"][key] = final_accuracy(run_dir)
            save(rpath, results)
            print(f"{key}: test accuracy {results['runs'][key]:.4f}", flush=True)
    runs = results["runs"]
    print(f"{'seed':>4} " + " ".join(f"{m:>8}" for m in modes))
    for seed in seeds:
        print(f"{seed:>4} " + " ".join(f"{100 * runs[f'{m}:seed{seed}']:>7.2f}%" for m in modes))
    for m in modes[1:]:
        diffs = [100 * (runs[f"{m}:seed{s}"] - runs[f"{modes[0]}:seed{s}"]) for s in seeds]
        results[f"paired_{m}_minus_{modes[0]}_pp"] = diffs
        print(f"{m} - {modes[0]}, paired per seed: " + ", ".join(f"{d:+.2f}" for d in diffs)
              + f" pp; mean {statistics.mean(diffs):+.2f} pp")
    save(rpath, results)


if __name__ == "__main__":
    main()
