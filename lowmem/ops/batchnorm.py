"""Batch-norm -> ReLU, the pre-activation unit's first half.

Dimensions: C channels; M = N*H*W elements per channel.
Layout: every array here is a (C, M) view, one contiguous row per channel.

Training forward, per channel c (biased batch variance, as PyTorch):
    mean = sum(x)/M,  var = sum((x-mean)^2)/M,  rstd = 1/sqrt(var + eps)
    xhat = (x - mean) * rstd          <- the one tensor backward needs
    r    = relu(gamma*xhat + beta)    <- the conv's input
The ReLU mask is `(xhat*gamma) + beta > 0`, multiply then add, in xhat's
dtype; the quantizer recomputes it with the same expression so the mask a
K-bit code carries is bit-identical to the one the forward pass used.

Row blocks: work that needs a temporary (squares, masks, products) runs over
blocks of whole channel rows of at most ROW_BLOCK elements, so temporaries
are bounded and never activation-sized.
"""
from ..system.backend import array_module

ROW_BLOCK = 1 << 16
BN_EPS = 1e-5           # added to the variance (PyTorch's default)


def row_blocks(C, M, max_elems=None):
    """Slices of channel rows, each at most max(M, max_elems) elements."""
    rows = max(1, (max_elems or ROW_BLOCK) // max(M, 1))
    for c0 in range(0, C, rows):
        yield slice(c0, min(C, c0 + rows))


def bn_stats(mean, var, rstd, x, eps):
    """mean, var (biased), rstd = 1/sqrt(var + eps), each (C,), of x (C, M).

    Two passes per row block; the squares are a bounded temporary (one row block)."""
    xp = array_module(x)
    C, M = x.shape
    xp.sum(x, axis=1, out=mean)
    mean /= M
    for r in row_blocks(C, M):
        t = xp.subtract(x[r], mean[r, None])    # bounded temporary (one row block)
        xp.square(t, out=t)
        xp.sum(t, axis=1, out=var[r])
    var /= M
    xp.add(var, eps, out=rstd)
    xp.sqrt(rstd, out=rstd)
    xp.reciprocal(rstd, out=rstd)


def bn_normalize(xhat, x, mean, rstd):
    """xhat (C, M) = (x - mean) * rstd: subtract, then multiply. xhat may alias x."""
    xp = array_module(x)
    xp.subtract(x, mean[:, None], out=xhat)
    xhat *= rstd[:, None]


def update_running_stats(running_mean, running_var, mean, var, M, momentum):
    """PyTorch's rule: running = (1-m)*running + m*batch, with the UNBIASED batch variance."""
    running_mean *= 1 - momentum
    running_mean += momentum * mean
    running_var *= 1 - momentum
    running_var += (momentum * M / max(M - 1, 1)) * var


def bn_relu_apply_forward(out, xhat, gamma, beta):
    """out (C, M) = relu(gamma*xhat + beta); out may alias xhat."""
    xp = array_module(out)
    xp.multiply(xhat, gamma[:, None], out=out)
    xp.add(out, beta[:, None], out=out)
    xp.maximum(out, 0, out=out)


def bn_eval_relu_forward(out, x, running_mean, running_var, gamma, beta, eps):
    """Eval mode: out = relu(gamma*(x - running_mean)/sqrt(running_var + eps) + beta)."""
    xp = array_module(out)
    scale = gamma / xp.sqrt(running_var + eps)
    xp.subtract(x, running_mean[:, None], out=out)
    out *= scale[:, None]
    out += beta[:, None]
    xp.maximum(out, 0, out=out)


def bn_relu_backward(dx, dgamma, dbeta, dr, xhat, gamma, beta, rstd, relu_mask=None, accumulate=False,
                     dr_already_masked=False):
    """Backward through r = relu(gamma*xhat + beta), xhat = batch-normalised x.

    # saved: xhat (C, M) — exact float, or decoded from a K-bit code — and rstd (C,) exact.
    dr (C, M) is the gradient w.r.t. r and is used as scratch; dx (C, M) may alias dr.
    relu_mask: bool (C, M), where the ReLU passed; None recomputes it exactly from xhat, gamma,
        beta (the forward's expression). dr_already_masked=True: the caller has applied the exact
        mask to dr already (dr is dy), so no mask is applied here.
    accumulate: dx += instead of dx = (a tensor whose gradient already has another contribution).
        dy = dr * mask
        dgamma += sum(dy * xhat),  dbeta += sum(dy)
        dx = gamma*rstd * (dy - mean(dy) - xhat * mean(dy*xhat))
    Two passes (sums, then dx), so synchronized batch norm can sum the sums over ranks between
    them (units/sync.py).
    """
    sum_dy, sum_dyx = bn_relu_backward_sums(dr, xhat, gamma, beta, relu_mask, dr_already_masked)
    dgamma += sum_dyx
    dbeta += sum_dy
    bn_relu_backward_apply(dx, dr, xhat, sum_dy, sum_dyx, dr.shape[1], gamma, rstd, accumulate)


def bn_relu_backward_sums(dr, xhat, gamma, beta, relu_mask=None, dr_already_masked=False):
    """Mask dr (C, M) in place (dy = dr * mask, as bn_relu_backward) and return the (C,)
    sums (sum(dy), sum(dy * xhat)) in dr's dtype."""
    xp = array_module(dr)
    C, M = dr.shape
    sum_dy, sum_dyx = xp.empty(C, dr.dtype), xp.empty(C, dr.dtype)
    for r in row_blocks(C, M):
        dy = dr[r]
        t = xp.multiply(xhat[r], gamma[r, None])            # bounded temporary
        if dr_already_masked:
            pass
        elif relu_mask is None:
            t += beta[r, None]                              # the forward's exact expression
            xp.multiply(dy, t > 0, out=dy)
        else:
            xp.multiply(dy, relu_mask[r], out=dy)
        dy.sum(axis=1, out=sum_dy[r])
        xp.multiply(dy, xhat[r], out=t)
        t.sum(axis=1, out=sum_dyx[r])
    return sum_dy, sum_dyx


def bn_relu_backward_apply(dx, dy, xhat, sum_dy, sum_dyx, M, gamma, rstd, accumulate=False):
    """dx (C, m) = (or +=) gamma*rstd * (dy - sum_dy/M - xhat*sum_dyx/M), dy already masked;
    M: the batch-norm count (the global one under synchronized batch norm). dx may alias dy."""
    xp = array_module(dy)
    C, m = dy.shape
    for r in row_blocks(C, m):
        t = xp.multiply(xhat[r], (sum_dyx[r] / M)[:, None])  # bounded temporary
        t += (sum_dy[r] / M)[:, None]
        a = (gamma[r] * rstd[r])[:, None]
        if accumulate:
            xp.subtract(dy[r], t, out=t)
            t *= a
            dx[r] += t
        else:
            xp.subtract(dy[r], t, out=dx[r])
            dx[r] *= a


# ---- batch norm on its own (no ReLU after it) ------------------------------------------------

def bn_apply_forward(out, xhat, gamma, beta):
    """out (C, M) = gamma*xhat + beta (multiply, then add, as the unit's expression); out may alias xhat."""
    xp = array_module(out)
    xp.multiply(xhat, gamma[:, None], out=out)
    xp.add(out, beta[:, None], out=out)


def bn_eval_forward(out, x, running_mean, running_var, gamma, beta, eps):
    """Eval mode: out (C, M) = gamma*(x - running_mean)/sqrt(running_var + eps) + beta."""
    xp = array_module(out)
    scale = gamma / xp.sqrt(running_var + eps)
    xp.subtract(x, running_mean[:, None], out=out)
    out *= scale[:, None]
    out += beta[:, None]


def bn_backward(dx, dgamma, dbeta, dy, xhat, gamma, rstd, accumulate=False):
    """Backward through y = gamma*xhat + beta, xhat = batch-normalised x (no ReLU):
        dgamma += sum(dy * xhat),  dbeta += sum(dy)
        dx = (or += with accumulate) gamma*rstd * (dy - mean(dy) - xhat * mean(dy*xhat))

    # saved: xhat (C, M) — exact float, or decoded from a K-bit code — and rstd (C,) exact.
    dy (C, M) is read only; dx may alias dy (without accumulate). The two passes of
    bn_relu_backward with the mask left out (bn_relu_backward_sums, bn_relu_backward_apply)."""
    sum_dy, sum_dyx = bn_relu_backward_sums(dy, xhat, gamma, None, dr_already_masked=True)
    dgamma += sum_dyx
    dbeta += sum_dy
    bn_relu_backward_apply(dx, dy, xhat, sum_dy, sum_dyx, dy.shape[1], gamma, rstd, accumulate)
