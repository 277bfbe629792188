"""Concatenation on the channel axis (DenseNet's dense blocks).

Dimensions: C_i channels of input i, C = sum C_i; N batch; H, W.
Layout: x_i (C_i, N, H, W), out (C, N, H, W). Channels-major, so input i is the contiguous
channel slice out[c_i : c_i + C_i] (concat_slices): forward copies each input into its slice;
backward is those slices of dout (a caller may use them as views and copy nothing). Keeps nothing.
"""
from ..system.backend import array_module


def concat_slices(channels):
    """[slice(c_i, c_i + C_i)] of the output for inputs of `channels` = [C_0, C_1, ...]."""
    out, c = [], 0
    for ci in channels:
        out.append(slice(c, c + ci))
        c += ci
    return out


def _check(out, xs, what):
    if sum(x.shape[0] for x in xs) != out.shape[0] or any(x.shape[1:] != out.shape[1:] for x in xs):
        raise ValueError(f"concat {what}: inputs {[tuple(x.shape) for x in xs]} do not stack on the channel "
                         f"axis into {tuple(out.shape)}")


def concat_forward(out, xs):
    """out (C, N, H, W) <- the inputs xs [(C_i, N, H, W)] stacked on the channel axis, in order."""
    xp = array_module(out)
    _check(out, xs, "forward")
    for s, x in zip(concat_slices([x.shape[0] for x in xs]), xs):
        xp.copyto(out[s], x)


def concat_backward(dxs, dout, accumulate=False):
    """dx_i = (or +=) dout[c_i : c_i + C_i] for each dx_i (C_i, N, H, W) of dxs.

    accumulate: one bool for every input, or one per input (an input that also feeds
    another layer adds its slice to the gradient already there).
    # saved: nothing (the channel offsets are the shapes')."""
    xp = array_module(dout)
    _check(dout, dxs, "backward")
    acc = [accumulate] * len(dxs) if isinstance(accumulate, bool) else list(accumulate)
    if len(acc) != len(dxs):
        raise ValueError(f"concat backward: {len(acc)} accumulate flags for {len(dxs)} inputs")
    for s, d, a in zip(concat_slices([d.shape[0] for d in dxs]), dxs, acc):
        if a:
            d += dout[s]
        else:
            xp.copyto(d, dout[s])
