"""Run by tests/system/test_distributed.py under `mpiexec -n N python -m mpi4py tests/system/mpi_worker.py ...`.

Trains pre-act ResNet-8 for a few steps on a fixed global batch sequence, each rank on its
shard, and writes every rank's final parameters and running statistics to OUT.rank<r>.npz.
ACTION "raise" / "kill": rank 1 raises or SIGKILLs itself at the second step (failure tests).
Optional ROUNDING and GLOBAL_BATCH (stochastic rounding across world sizes).
"""
import os
import signal
import sys

import numpy as np

import lowmem as lm
from lowmem.system import distributed

GLOBAL_BATCH, SHAPE, STEPS = 8, (3, 8, 8), 3


def batches(dtype, global_batch=GLOBAL_BATCH):
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        yield (rng.standard_normal((global_batch,) + SHAPE).astype(dtype),
               rng.integers(0, 10, global_batch))


def train(comm, mode, sync_bn, dtype, action="train", rounding="nearest", global_batch=GLOBAL_BATCH):
    net = lm.models.preact_resnet_cifar(8, seed=1)
    eng = lm.Engine(net, global_batch // comm.size, SHAPE, mode, bits=4 if rounding == "nearest" else 2,
                    dtype=dtype, comm=comm, sync_bn=sync_bn, rounding=rounding, seed=5)
    opt = lm.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    part = distributed.shard(global_batch, comm)
    for i, (x, y) in enumerate(batches(dtype, global_batch)):
        if i == 1 and comm.rank == 1 and action == "raise":
            raise RuntimeError("rank 1 fails on purpose")
        if i == 1 and comm.rank == 1 and action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        eng.train_step(x[part], y[part], opt)
    return net.state_dict()


if __name__ == "__main__":
    mode, sync_bn, dtype, out, action = sys.argv[1], sys.argv[2] == "1", sys.argv[3], sys.argv[4], sys.argv[5]
    rounding = sys.argv[6] if len(sys.argv) > 6 else "nearest"
    global_batch = int(sys.argv[7]) if len(sys.argv) > 7 else GLOBAL_BATCH
    comm = distributed.get_communicator()
    state = train(comm, mode, sync_bn, dtype, action, rounding, global_batch)
    np.savez(f"{out}.rank{comm.rank}.npz", **state)
    if comm.rank == 0:
        print(comm.describe())
