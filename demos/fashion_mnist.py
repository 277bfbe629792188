"""Fashion-MNIST with a small pre-activation ResNet and 4-bit approximate activations.

    python demos/fashion_mnist.py                      # ResNet-8, approx 4-bit, 5 epochs
    python demos/fashion_mnist.py --mode exact         # the same in full precision
    python demos/fashion_mnist.py --bits 2 --depth 20

Reads the IDX files of the Debian package dataset-fashion-mnist
(/usr/share/datasets/fashion-mnist/; `apt-get install dataset-fashion-mnist`)
or --data DIR. The 28x28 images go in unpadded (the CIFAR network adapts:
28 -> 14 -> 7); random crop + flip; SGD momentum 0.9, weight decay 5e-4,
lr 0.1 with a short warm-up and cosine decay. A thin script over
lowmem.train.trainer; `lowmem train --dataset fashion-mnist --pad-to 0 ...` is the same.
"""
import argparse
import sys

from lowmem.train.config import TrainConfig
from lowmem.train.trainer import Trainer, TrainingDiverged
from lowmem.units.widths import BITS


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="approx", choices=("exact", "approx", "naive"))
    p.add_argument("--bits", type=int, default=4, choices=BITS)
    p.add_argument("--depth", type=int, default=8, help="6n+2: 8, 14, 20, ...")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--data", default=None, metavar="DIR", help="directory holding the IDX files")
    p.add_argument("--out", default=None, metavar="RUN_DIR", help="default: runs/fashion-r<depth>-<mode>")
    p.add_argument("--resume", action="store_true", help="continue the run in RUN_DIR")
    p.add_argument("--overwrite", action="store_true", help="start again in RUN_DIR (replaces lowmem's files)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit-train", type=int, default=None, metavar="N", help="first N images (a quick try)")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS")
    a = p.parse_args(argv)
    out = a.out or f"runs/fashion-r{a.depth}-{a.mode}" + (f"{a.bits}" if a.mode != "exact" else "")
    config = TrainConfig(dataset="fashion-mnist", data_dir=a.data, pad_to=0, depth=a.depth, mode=a.mode,
                         bits=a.bits, batch=a.batch, epochs=a.epochs, lr=a.lr, schedule="cosine",
                         weight_decay=5e-4, seed=a.seed, out=out, limit_train=a.limit_train,
                         time_limit=a.time_limit)
    try:
        trainer = Trainer(config, resume=a.resume, overwrite=a.overwrite)
        print(trainer.describe(), flush=True)
        result = trainer.fit()
    except (ValueError, OSError, TrainingDiverged) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    acc = "n/a" if result.test_acc is None else f"{result.test_acc:.4f}"
    print(f"{result.status} after {result.epoch:.2f} epochs: test accuracy {acc}; run directory {out}")
    return 0 if result.status == "finished" else 2


if __name__ == "__main__":
    sys.exit(main())
