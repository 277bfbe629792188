"""The README's main job (`make demo`): a short, real training run in 4-bit mode.

1. Finds real data: CIFAR-10 when it is on this machine or can be downloaded
   (lowmem.data.files: it looks in --data, $LOWMEM_DATA, ~/.cache/lowmem); otherwise
   Fashion-MNIST from the Debian package dataset-fashion-mnist, which it
   installs with apt-get when it runs as root and the files are missing.
2. Trains a small pre-activation ResNet with 4-bit approximate activations
   for about two minutes on 2 CPU cores (a fixed number of steps, so the
   learning-rate schedule completes), then evaluates on the test split.
3. Prints the test accuracy and the exact-vs-4-bit memory table, for the
   network it trained and for the paper's ResNet-164 at batch 128.

    python demos/main_job.py [--data DIR] [--steps N] [--out RUN_DIR]
"""
import argparse
import os
import shutil
import subprocess
import sys
import time

from lowmem import models
from lowmem.tools.commands.plan import compare_table
from lowmem.data.cifar import load_cifar
from lowmem.data.datasets import FASHION_MNIST_DEBIAN_DIR
from lowmem.data.files import DataError
from lowmem.core.engine import Engine
from lowmem.train.config import TrainConfig
from lowmem.train.trainer import Trainer, TrainingDiverged


def find_data(data_dir):
    """('cifar10', dir) when CIFAR-10 is available, else ('fashion-mnist', dir)."""
    try:
        load_cifar("cifar10", data_dir=data_dir, download=True)
        print("data: CIFAR-10")
        return "cifar10"
    except DataError as e:
        print(f"data: CIFAR-10 not available ({str(e).splitlines()[0]})")
    if data_dir is None and not FASHION_MNIST_DEBIAN_DIR.is_dir():
        if os.geteuid() == 0 and shutil.which("apt-get"):
            print("data: installing the Debian package dataset-fashion-mnist (apt-get) ...", flush=True)
            subprocess.run(["apt-get", "update", "-qq"], check=True)
            subprocess.run(["apt-get", "install", "-y", "-qq", "dataset-fashion-mnist"], check=True,
                           env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        else:
            sys.exit("no data: put cifar-10-python.tar.gz in ~/.cache/lowmem, or install the Debian "
                     "package dataset-fashion-mnist (as root: apt-get install dataset-fashion-mnist)")
    print("data: Fashion-MNIST")
    return "fashion-mnist"


def memory_tables(depth, batch, shape, classes):
    for d, b, s in ((depth, batch, shape), (164, 128, (3, 32, 32))):
        net = models.preact_resnet_cifar(d, num_classes=classes, in_channels=s[0])
        plans = {m: Engine(net, b, s, m, 4, allocate=False).plan for m in ("exact", "approx")}
        print(f"\nmemory plan, {net.name} ({net.num_params():,} parameters), batch {b}, "
              f"input {'x'.join(map(str, s))}:")
        print(compare_table({"exact": plans["exact"], "approx 4-bit": plans["approx"]}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=None, metavar="DIR")
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=300, help="training steps (default: %(default)s)")
    p.add_argument("--out", default="runs/demo", metavar="RUN_DIR")
    a = p.parse_args(argv)

    dataset = find_data(a.data)
    pad = 32 if dataset == "cifar10" else 0
    config = TrainConfig(dataset=dataset, data_dir=a.data, pad_to=pad, depth=a.depth, mode="approx",
                         bits=4, batch=a.batch, epochs=1, limit_train=a.steps * a.batch, lr=0.1,
                         schedule="cosine", warmup_iters=50, out=a.out, time_limit=600)
    start = time.time()
    try:
        trainer = Trainer(config, overwrite=True)          # the demo always starts fresh (lowmem's files only)
        print(trainer.describe(), flush=True)
        result = trainer.fit()
    except (ValueError, OSError, TrainingDiverged) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    acc = "n/a" if result.test_acc is None else f"{100 * result.test_acc:.2f}%"
    shape = trainer.engine.input_shape
    steps = len(trainer.data.x_train) // a.batch
    print(f"\n{dataset}: pre-act ResNet-{a.depth}, approx 4-bit, {steps} steps of batch {a.batch} "
          f"in {time.time() - start:.0f} s: test accuracy {acc} ({result.status}); run directory {a.out}")
    memory_tables(a.depth, a.batch, shape, trainer.engine.net.num_classes)
    return 0 if result.status == "finished" else 2


if __name__ == "__main__":
    sys.exit(main())
