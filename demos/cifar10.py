"""The paper's CIFAR-10 setup: pre-activation ResNet-164, batch 128, 4-bit approximate activations.

    python demos/cifar10.py --data ~/data                      # approx, 4 bits (the method)
    python demos/cifar10.py --data ~/data --mode exact         # the full-precision baseline
    python demos/cifar10.py --data ~/data --mode naive --bits 4    # the paper's naive baseline
    python demos/cifar10.py --data ~/data --resume             # continue after a stop

Recipe (He et al. 2016, "Identity Mappings"; Chakrabarti & Moseley 2019 train
the same way): SGD with momentum 0.9 and weight decay 1e-4, batch 128,
lr 0.01 for the first 400 iterations, then 0.1, divided by 10 at 50% and 75%
of training (32k and 48k of 64k iterations = 164 epochs of 390 steps),
random crop from the 4-px padded image + horizontal flip. The paper reports
test accuracy within ~0.5% of exact training at 4 bits.

A thin script over lowmem.train.trainer; `lowmem train` takes the same settings.
CIFAR-10 is read from --data (the python release, `cifar-10-python.tar.gz`
or its extracted folder) or downloaded; see docs/training.md for offline
machines.
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
    p.add_argument("--depth", type=int, default=164, help="164 (bottleneck, the paper), 1001, 20, 56, 110, ...")
    p.add_argument("--epochs", type=int, default=164, help="164 epochs = 64k iterations at batch 128")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--data", default=None, metavar="DIR", help="directory holding CIFAR-10")
    p.add_argument("--out", default=None, metavar="RUN_DIR", help="default: runs/cifar10-r<depth>-<mode>")
    p.add_argument("--resume", action="store_true", help="continue the run in RUN_DIR")
    p.add_argument("--overwrite", action="store_true", help="start again in RUN_DIR (replaces lowmem's files)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS")
    p.add_argument("--limit-train", type=int, default=None, metavar="N", help="first N images (a quick try)")
    a = p.parse_args(argv)
    out = a.out or f"runs/cifar10-r{a.depth}-{a.mode}" + (f"{a.bits}" if a.mode != "exact" else "")
    config = TrainConfig(dataset="cifar10", data_dir=a.data, model="preact-cifar", depth=a.depth,
                         mode=a.mode, bits=a.bits, batch=a.batch, epochs=a.epochs,
                         lr=0.1, schedule="step", warmup_iters=400, momentum=0.9, weight_decay=1e-4,
                         seed=a.seed, out=out, time_limit=a.time_limit, limit_train=a.limit_train)
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
