"""Run by tests/system/test_distributed.py under `mpiexec -n N python -m mpi4py tests/system/mpi_worker.py ...`.

Trains pre-act ResNet-8 for a few steps on a fixed global batch sequence, each rank on its
shard, and writes every rank's final parameters and running statistics to OUT.rank<r>.npz.
ACTION "raise" / "kill": rank 1 raises or SIGKILLs itself at the second step (failure tests).
Optional ROUNDING and GLOBAL_BATCH (stochastic rounding across world sizes), and MODEL: "preact"
(the default) or "standalone" (batch norms with no ReLU after them: a post-activation block, a
depthwise conv's batch norm before ReLU6).
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


def standalone_bn_net():
    g = lm.nn.Graph("standalone", SHAPE, 10, seed=1)
    x = g.bn_relu(g.conv(g.input, 8, 3, name="c1"), name="b1")
    x = g.relu(g.add(x, g.bn(g.conv(x, 8, 3, name="c2"), name="b2"), name="add"), name="r")
    return g.head(g.relu6(g.bn(g.conv(x, 8, 3, groups=8, name="dw"), name="b3"), name="r6"))


def train(comm, mode, sync_bn, dtype, action="train", rounding="nearest", global_batch=GLOBAL_BATCH,
          model="preact"):
    net = lm.models.preact_resnet_cifar(8, seed=1) if model == "preact" else standalone_bn_net()
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
    model = sys.argv[8] if len(sys.argv) > 8 else "preact"
    comm = distributed.get_communicator()
    state = train(comm, mode, sync_bn, dtype, action, rounding, global_batch, model)
    np.savez(f"{out}.rank{comm.rank}.npz", **state)
    if comm.rank == 0:
        print(comm.describe())
