"""Data-parallel training over processes: one small communicator interface, three engines.

    comm = lm.distributed.get_communicator()     # from the launcher and the backend
    eng = lm.Engine(net, batch_size=64, input_shape=(3, 32, 32), comm=comm)   # per-rank batch
    loss = eng.train_step(x_shard, y_shard, opt)  # gradients summed over ranks, then averaged

Every rank holds a full replica of the network and runs the same schedule on
its shard of the global batch. After backward, the engine sums the one flat
gradient buffer of its plan over the ranks (a single allreduce) and divides
by the number of ranks, so every rank takes the same SGD step. Batch norm
uses per-replica statistics by default (the paper's multi-GPU code, PyTorch
DDP); its running statistics are averaged over the ranks with the gradients,
so they too are equal everywhere. With `sync_bn=True` the statistics are
those of the global batch (units/sync.py).

Communicators (ChainerMN's shape: the same calls whatever carries them):

  SingleProcess   one process: every call is a no-op
  MPI             mpi4py (`pip install lowmem[mpi]`); NumPy arrays in place, CuPy arrays
                  staged through host memory (the MPICH wheel is not CUDA-aware)
  NCCL            CuPy's NCCL bindings for GPU arrays, bootstrapped over MPI

`get_communicator()` chooses: one process unless a launcher (mpiexec, srun,
Open MPI's mpirun) started several; then NCCL when the backend is CuPy, MPI
otherwise. `--batch` in `lowmem train` stays the global batch.

What it does not do: no model parallelism, no overlap of the allreduce with
the backward sweep (one allreduce per step, measured in docs/distributed.md),
no elastic membership. At start-up the ranks check they were given the same
settings (`check_same_settings`) and refuse together (`together`: every rank
raises the same StartupError, so no rank waits in a collective for one that
has gone). Later, a failing rank ends the job: under mpiexec an
exception reaching the top calls MPI_Abort (lowmem's CLI does it; for your
own script run it as `python -m mpi4py script.py`).
"""
import os

import numpy

_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_NTASKS", "MPI_LOCALNRANKS")


def launched_size():
    """How many processes the launcher started (1 when not launched by one)."""
    for var in _SIZE_VARIABLES:
        value = os.environ.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


class Communicator:
    """The interface: rank, size, allreduce (sum, in place), bcast, barrier, abort."""
    rank, size, name = 0, 1, "single process"

    def allreduce(self, a):
        """Sum `a` over all ranks, in place; every rank gets the same bits."""

    def bcast(self, a, root=0):
        """Overwrite `a` with root's `a`, in place."""

    def allgather_object(self, obj):
        """[rank 0's obj, rank 1's obj, ...] on every rank (small picklable objects: settings, errors)."""
        return [obj]

    def barrier(self):
        pass

    def abort(self, code=1):
        raise SystemExit(code)

    def describe(self):
        return f"world {self.size} rank{'s' if self.size != 1 else ''}, {self.name}"


class SingleProcess(Communicator):
    pass


class MPI(Communicator):
    """mpi4py's COMM_WORLD. CuPy arrays go through a host copy (the wheel is not CUDA-aware)."""

    def __init__(self):
        try:
            from mpi4py import MPI as mpi
        except ImportError as e:                       # pragma: no cover - depends on the extra
            raise RuntimeError(f"{launched_size()} processes were launched but mpi4py is missing: "
                               f"pip install lowmem[mpi]") from e
        self._mpi, self._comm = mpi, mpi.COMM_WORLD
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()
        version = mpi.Get_library_version().splitlines()[0].strip()
        self.name = "MPI (" + " ".join(version.replace("Version:", "").split()[:2]) + ")"

    def allreduce(self, a):
        if self.size == 1:
            return
        if isinstance(a, numpy.ndarray):
            self._comm.Allreduce(self._mpi.IN_PLACE, a, op=self._mpi.SUM)
        else:                                          # CuPy: stage through the host
            host = a.get()
            self._comm.Allreduce(self._mpi.IN_PLACE, host, op=self._mpi.SUM)
            a.set(host)

    def bcast(self, a, root=0):
        if self.size == 1:
            return
        if isinstance(a, numpy.ndarray):
            self._comm.Bcast(a, root=root)
        else:
            host = a.get()
            self._comm.Bcast(host, root=root)
            a.set(host)

    def allgather_object(self, obj):
        return self._comm.allgather(obj)

    def barrier(self):
        self._comm.Barrier()

    def abort(self, code=1):
        self._comm.Abort(code)


class NCCL(Communicator):
    """cupy.cuda.nccl for CuPy arrays; the unique id travels over MPI (or nowhere for 1 rank)."""

    def __init__(self, mpi=None):
        from cupy.cuda import nccl
        self._nccl, self._mpi = nccl, mpi
        self.rank, self.size = (mpi.rank, mpi.size) if mpi else (0, 1)
        uid = nccl.get_unique_id() if self.rank == 0 else None
        if mpi is not None and mpi.size > 1:
            uid = mpi._comm.bcast(uid, root=0)
        self._comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        self.name = f"NCCL {nccl.get_version()}"

    def _dtype(self, a):
        n = self._nccl
        return {"float32": n.NCCL_FLOAT32, "float64": n.NCCL_FLOAT64}[a.dtype.name]

    def allreduce(self, a):
        import cupy
        self._comm.allReduce(a.data.ptr, a.data.ptr, a.size, self._dtype(a), self._nccl.NCCL_SUM,
                             cupy.cuda.get_current_stream().ptr)

    def bcast(self, a, root=0):
        import cupy
        self._comm.bcast(a.data.ptr, a.size, self._dtype(a), root, cupy.cuda.get_current_stream().ptr)

    def allgather_object(self, obj):
        return self._mpi.allgather_object(obj) if self._mpi is not None else [obj]

    def barrier(self):
        if self._mpi is not None:
            self._mpi.barrier()

    def abort(self, code=1):
        if self._mpi is not None:
            self._mpi.abort(code)
        raise SystemExit(code)


def get_communicator(kind="auto", xp=numpy):
    """kind: "auto" (launcher and backend decide), "single", "mpi" or "nccl"."""
    if kind not in ("auto", "single", "mpi", "nccl"):
        raise ValueError(f"unknown communicator {kind!r}: expected auto, single, mpi or nccl")
    if kind == "single" or (kind == "auto" and launched_size() == 1):
        return SingleProcess()
    mpi = MPI()
    if kind == "nccl" or (kind == "auto" and xp is not numpy):
        return NCCL(mpi)
    return mpi


def shard(n_global, comm):
    """The slice of a global batch of n_global samples this rank takes; refuses an uneven split."""
    if n_global % comm.size:
        raise ValueError(f"batch {n_global} does not split evenly over {comm.size} ranks "
                         f"(use a multiple of {comm.size})")
    per = n_global // comm.size
    return slice(comm.rank * per, (comm.rank + 1) * per)


def sum_counts(comm, sums):
    """A copy of the dict `sums` with "loss", "correct" and "seen" summed over the ranks (float64
    allreduce; the counts come back as ints); other keys as they are. One process: `sums` itself."""
    if comm.size == 1:
        return sums
    a = numpy.array([sums["loss"], sums["correct"], sums["seen"]], numpy.float64)
    comm.allreduce(a)
    return dict(sums, loss=float(a[0]), correct=int(a[1]), seen=int(a[2]))


# ---------------------------------------------------------------- start-up agreement

class StartupError(ValueError):
    """A data-parallel run refused at start-up on some rank; raised on every rank alike, so all exit
    with the same code and no rank is left waiting in a collective. exit_code: 2 for settings
    (ConfigError, NotEnoughMemory, ranks that disagree), 1 for files and folders."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


def together(comm, fn, usage=()):
    """fn() on every rank; if it raised a ValueError or OSError on any rank, raise on every rank.

    One process: fn's own exception. Several: a StartupError carrying the message of the lowest
    failing rank ("rank 1: ..." when rank 0 did not fail itself) and exit_code 2 if that error
    is an instance of `usage`, else 1. Anything else (a bug) propagates on its rank alone
    (the command line then ends the job with MPI_Abort)."""
    error = None
    try:
        result = fn()
    except (ValueError, OSError) as e:
        if comm.size == 1:
            raise
        error = e
    if comm.size == 1:
        return result
    mine = None if error is None else (str(error), 2 if isinstance(error, usage) else 1)
    failed = [(r, o) for r, o in enumerate(comm.allgather_object(mine)) if o is not None]
    if not failed:
        return result
    rank, (message, code) = failed[0]
    raise StartupError(message if rank == 0 else f"rank {rank}: {message}", code) from error


def check_same_settings(comm, settings, ignore=()):
    """Every rank must run with rank 0's settings (a dict): StartupError (exit code 2) on every rank
    naming the first field that differs, e.g. "ranks disagree on their configuration: depth is 8
    on rank 0, 14 on rank 1". Ranks started with different options would otherwise fail later with
    an MPI error (different network sizes) or train silently apart (different seeds)."""
    if comm.size == 1:
        return
    every = comm.allgather_object({k: v for k, v in settings.items() if k not in ignore})
    for key in sorted(set().union(*every)):
        values = [s.get(key) for s in every]
        if any(v != values[0] for v in values):
            where = ", ".join(f"{v!r} on rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}"
                              for v, r in _group(values))
            raise StartupError(f"ranks disagree on their configuration: {key} is {where}; start every "
                               f"rank with the same options", 2)


def _group(values):
    """[(value, [ranks holding it])] in the order of first appearance."""
    out = []
    for rank, v in enumerate(values):
        for seen, ranks in out:
            if seen == v:
                ranks.append(rank)
                break
        else:
            out.append((v, [rank]))
    return out
