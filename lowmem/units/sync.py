"""Synchronized batch norm: any unit kernel set, and a batch norm with no ReLU after it, with
statistics over the global batch.

Every rank holds its shard (M local elements per channel) of the global batch
(size * M). Forward: the set's local mean and variance become global ones
through one 2C allreduce of (M*mean, M*(var + mean^2)) in float64
(var = E[x^2] - mean^2 there; exact to float rounding unless |mean| exceeds
the standard deviation by ~1e4). The inner set then normalises, saves and
quantizes with them unchanged, so approx mode still quantizes exactly the
x-hat the global batch defines.

Backward (ChainerMN's multi-node batch norm): dx needs the global sums
sum(dy) and sum(dy*x-hat) — one 2C allreduce between the two passes of
ops.bn_relu_backward_sums / _apply (in approx mode x-hat is the decoded
x-tilde, under the exact mask). dgamma and dbeta receive the *local* sums:
the engine's gradient allreduce adds the ranks' parts afterwards. These two
passes are array ops on every backend (the fused kernels join them in one
call), so synchronized batch norm runs its backward on the reference path (the unbiased
code's decode excepted: the set's own, numba or CUDA, bit for bit the reference's).

A batch norm with no ReLU after it (optable's "bn", its kernel set units/norm.py) makes the same
two exchanges through SyncNorms, which wraps its set: the 2C allreduce of the moments forward, of
sum(dy) and sum(dy*x-hat) backward (its x-hat exact, or decoded from its range code).

Communication buffer: the plan's `sync.bn` workspace, 2 * C float64.
"""
from ..system.backend import array_module
from ..ops import bn_relu_backward_apply, bn_relu_backward_sums
from ..ops.batchnorm import BN_EPS


def _global_moments(comm, buf, mean, var, rstd, M):
    """mean, var (C,) of this rank's M elements per channel -> those of the global batch, and
    rstd from them: one 2C allreduce of (M*mean, M*(var + mean^2)) in float64."""
    xp = array_module(mean)
    C = mean.shape[0]
    s = buf[:2 * C].reshape(2, C)               # contiguous: one message
    s[0] = mean
    s[0] *= M
    s[1] = var
    s[1] += xp.square(mean.astype(s.dtype))
    s[1] *= M
    comm.allreduce(s)
    s /= M * comm.size
    mean[...] = s[0]
    s[1] -= xp.square(s[0])
    xp.maximum(s[1], 0, out=s[1])
    var[...] = s[1]
    xp.add(var, BN_EPS, out=rstd)
    xp.sqrt(rstd, out=rstd)
    xp.reciprocal(rstd, out=rstd)


def _global_sums(comm, buf, sum_dy, sum_dyx):
    """The (C,) sums of this rank's elements -> the global batch's: one 2C allreduce; returns
    them (views of buf)."""
    C = sum_dy.shape[0]
    s = buf[:2 * C].reshape(2, C)               # contiguous: one message
    s[0], s[1] = sum_dy, sum_dyx
    comm.allreduce(s)
    return s[0], s[1]


class SyncNorms:
    """Wraps a kernel set of batch norms with no ReLU after them (units/norm.py) `inner`: the
    statistics and the backward's sums over the global batch, the units' two exchanges (module
    docstring). The forward is the inner set's; the backward runs on the array ops (x-hat restored
    by the inner set: exact, or decoded from its range code). dgamma and dbeta get the local sums,
    summed with every gradient."""

    def __init__(self, inner, comm, buf):
        self.inner, self.comm, self.buf = inner, comm, buf
        self.fused = inner.fused

    def count(self, M):
        return M * self.comm.size

    def stats(self, mean, var, rstd, x):
        self.inner.stats(mean, var, rstd, x)
        _global_moments(self.comm, self.buf, mean, var, rstd, x.shape[1])

    def forward(self, out, slots, x, mean, rstd, gamma, beta):
        self.inner.forward(out, slots, x, mean, rstd, gamma, beta)

    def forward_add_relu(self, out, mask, slots, x, other, mean, rstd, gamma, beta, scratch):
        # a post-activation block's end (the fused sets only): mean and rstd are global already
        self.inner.forward_add_relu(out, mask, slots, x, other, mean, rstd, gamma, beta, scratch)

    def backward(self, dx, dgamma, dbeta, dy, slots, rstd, gamma, accumulate, scratch):
        # saved: x-hat, exact (float) or approximate (its range code, decoded into scratch), rstd exact
        xhat = self.inner.restore(slots, dy.shape, scratch)
        sum_dy, sum_dyx = bn_relu_backward_sums(dy, xhat, gamma, None, dr_already_masked=True)
        dgamma += sum_dyx                                         # local parts: summed later
        dbeta += sum_dy
        s_dy, s_dyx = _global_sums(self.comm, self.buf, sum_dy, sum_dyx)
        bn_relu_backward_apply(dx, dy, xhat, s_dy.astype(dy.dtype), s_dyx.astype(dy.dtype),
                               self.count(dy.shape[1]), gamma, rstd, accumulate)


class SyncUnits:
    """Wraps a unit kernel set `inner`; `comm` sums over ranks; `buf` is the plan's sync.bn."""

    def __init__(self, inner, comm, buf=None):
        self.inner, self.comm, self.buf = inner, comm, buf
        self.fused = inner.fused
        self.saved_suffix = inner.saved_suffix

    def __getattr__(self, name):                 # saved_entry, saved_view, forward, conv_input, bits
        return getattr(self.inner, name)

    def count(self, M):
        return M * self.comm.size

    def stats(self, mean, var, rstd, x):
        self.inner.stats(mean, var, rstd, x)
        _global_moments(self.comm, self.buf, mean, var, rstd, x.shape[1])

    def backward(self, dx, dgamma, dbeta, dr, saved, rstd, gamma, beta, accumulate, scratch):
        # saved: x-hat (exact) or its code, decoded into scratch; the mask is exact either way
        C, M = dr.shape
        if not self.inner.decodes:                                # exact: the slot is x-hat
            xhat, dr_masked = saved, False
        else:
            self.inner.decode_masking(scratch, dr, saved, gamma, beta)     # the set's own decode
            xhat, dr_masked = scratch, True
        sum_dy, sum_dyx = bn_relu_backward_sums(dr, xhat, gamma, beta, dr_already_masked=dr_masked)
        dgamma += sum_dyx                                         # local parts: summed later
        dbeta += sum_dy
        s_dy, s_dyx = _global_sums(self.comm, self.buf, sum_dy, sum_dyx)
        bn_relu_backward_apply(dx, dr, xhat, s_dy.astype(dr.dtype), s_dyx.astype(dr.dtype), self.count(M),
                               gamma, rstd, accumulate)
