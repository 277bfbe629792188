"""Grouped 2-D convolution (depthwise included) and the conv bias, on top of ops/conv.py.

Dimensions:  Cin, Cout channels;  G groups;  Cin_g = Cin/G, Cout_g = Cout/G per group;
             N batch;  H, W input;  Ho, Wo output;  kh, kw kernel.
Layout: x (Cin, N, H, W), w (Cout, Cin_g, kh, kw) (PyTorch's grouped layout), b (Cout,),
out (Cout, N, Ho, Wo). Output channels of group g read input channels g*Cin_g .. (g+1)*Cin_g - 1.

Channels-major, so a group's input, weights and output are contiguous channel slices: the
reference runs ops/conv.py's im2col conv once per group on those slices, with the workspace
sized for one group (workspace_per_sample: Cin_g*kh*kw*Ho*Wo elements a sample). The fast
column sets (`Columns.batched`) run the groups together instead: the im2col columns of a tile of
groups and samples, (g, Cin_g*kh*kw, n*Ho*Wo), and one batched GEMM with the weights viewed
(G, Cout_g, Cin_g*kh*kw) writing the output channels viewed (g, Cout_g, n*Ho*Wo); a tile holds
every group for as many samples as the same workspace fits, else as many groups as fit for one
sample (a 1x1 conv on contiguous arrays: no columns, the batched GEMM over column ranges).
The same products in another blocking: to rounding. G = 1 is ops/conv.py itself, bit for bit.

Depthwise (Cin_g = Cout_g = 1, MobileNet's 3x3) would be G tiny GEMMs; its reference runs instead
as a sum over kernel offsets of per-channel scaled, shifted slices (no workspace, no GEMM):
    out[c, :, oh, ow] += w[c, 0, i, j] * x[c, :, ih, iw]      for each offset (i, j)
in blocks of whole channels, or of samples of one channel (DEPTHWISE_BLOCK elements, at least
one sample's plane), the one temporary a block-sized product, threads splitting the channels.
The fast kernel sets (`Columns.depthwise` of ops/conv.py: ops/depthwise_cpu.py's numba loops,
ops/depthwise_gpu.py's CUDA launches) run every conv with one input channel a group (Cin_g = 1,
any multiplier Cout_g) directly, bit for bit the slices' forward and input gradient at Cout_g = 1.
"""
from ..system import threads
from ..system.backend import array_module
from .chunks import over_batch, over_columns
from .conv import (conv2d_backward_input, conv2d_backward_weight, conv2d_forward, columns_for, window_slices,
                   _is_pointwise)

DEPTHWISE_BLOCK = 1 << 16   # output elements per channel block of the depthwise path (tests vary it)


def check_groups(cin, cout, groups):
    """groups as an int dividing both channel counts; ValueError naming the numbers otherwise."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"conv groups must be an int >= 1, got {groups!r}")
    if cin % groups or cout % groups:
        raise ValueError(f"conv groups={groups} must divide both channel counts (in {cin}, out {cout})")
    return groups


def is_depthwise(w, groups):
    """True when every group has one input and one output channel."""
    return groups > 1 and w.shape[0] == groups and w.shape[1] == 1


def workspace_per_sample(cin, kh, kw, ho, wo, groups=1, cout=None):
    """Workspace elements one sample needs: one group's im2col columns; 0 on the depthwise path."""
    if cout is not None and groups > 1 and cin == cout == groups:
        return 0
    return (cin // groups) * kh * kw * ho * wo


def scratch_bytes(cin, cout, groups, h, w, ho, wo, itemsize, threads_=1, block=None):
    """A bound on what one depthwise call allocates beyond its arguments, whatever the batch:
    per thread, one product of a block (at most max(DEPTHWISE_BLOCK, one sample's plane) elements,
    the plane the larger of H*W and Ho*Wo) and NumPy's buffers for the strided window operands,
    three such blocks (measured in tests/ops/test_ops_graph.py). 0 for other grouped convs: they are
    ops/conv.py's calls on channel slices, whose own bounds (weight-sized GEMM results) apply."""
    if not (groups > 1 and cin == cout == groups):
        return 0
    b = max(DEPTHWISE_BLOCK if block is None else block, h * w, ho * wo)
    return 3 * b * int(itemsize) * max(1, int(threads_))


def _direct(columns, a, b, w, groups):
    """The direct depthwise kernels of `columns` (None: columns_for a's module) when they take
    this conv (one input channel a group, arrays they accept), else None."""
    kernels = (columns or columns_for(array_module(a))).depthwise
    if kernels is not None and groups == a.shape[0] and w.shape[1] == 1 and kernels.applies(a, b, w):
        return kernels
    return None


def _shapes(x_or_dx, w, out_or_dout, groups):
    Cout, cig = w.shape[:2]
    Cin = x_or_dx.shape[0]
    check_groups(Cin, Cout, groups)
    if cig * groups != Cin or out_or_dout.shape[0] != Cout:
        raise ValueError(f"grouped conv: w {tuple(w.shape)} with groups={groups} does not fit "
                         f"{Cin} input and {out_or_dout.shape[0]} output channels "
                         f"(expected w (Cout, Cin/groups, kh, kw))")
    return Cin // groups, Cout // groups


def _blocks(C, N, plane, body, like):
    """body(cs, ns) over (channels, samples) blocks of at most max(DEPTHWISE_BLOCK, plane) elements
    (plane: one sample's, the larger of H*W and Ho*Wo): whole channels when they fit, else samples
    of one channel. Threads split the channels; a channel's blocks run in order on one thread, so
    results are the same bit for bit for any thread count. One host thread for CuPy arrays `like`
    (the GPU runs each block's kernels on one stream)."""
    if N * plane <= DEPTHWISE_BLOCK:
        per = DEPTHWISE_BLOCK // (N * plane)
        work = [[(slice(c, min(C, c + per)), slice(0, N))] for c in range(0, C, per)]
    else:
        nb = max(1, DEPTHWISE_BLOCK // plane)
        work = [[(slice(c, c + 1), slice(n, min(N, n + nb))) for n in range(0, N, nb)] for c in range(C)]

    def run(g0, g1):
        for blocks in work[g0:g1]:
            for cs, ns in blocks:
                body(cs, ns)
    if array_module(like).__name__ == "cupy":
        run(0, len(work))
    else:
        threads.parallel_for(run, len(work))


def _depthwise_forward(out, x, w, stride, pad):
    C, N, H, W = x.shape
    Ho, Wo = out.shape[2:]
    kh, kw = w.shape[2:]

    def block(cs, ns):
        o = out[cs, ns]
        o.fill(0)
        for i, j, oh, ow, ih, iw in window_slices(H, W, Ho, Wo, kh, kw, stride, pad):
            o[:, :, oh, ow] += x[cs, ns, ih, iw] * w[cs, 0, i, j, None, None, None]   # one block
    _blocks(C, N, max(H * W, Ho * Wo), block, out)


def _depthwise_backward_input(dx, dout, w, stride, pad, accumulate):
    C, N, H, W = dx.shape
    Ho, Wo = dout.shape[2:]
    kh, kw = w.shape[2:]

    def block(cs, ns):
        d = dx[cs, ns]
        if not accumulate:
            d.fill(0)
        for i, j, oh, ow, ih, iw in window_slices(H, W, Ho, Wo, kh, kw, stride, pad):
            d[:, :, ih, iw] += dout[cs, ns, oh, ow] * w[cs, 0, i, j, None, None, None]
    _blocks(C, N, max(H * W, Ho * Wo), block, dx)


def _depthwise_backward_weight(dw, x, dout, stride, pad):
    C, N, H, W = x.shape
    Ho, Wo = dout.shape[2:]
    kh, kw = dw.shape[2:]

    def block(cs, ns):
        for i, j, oh, ow, ih, iw in window_slices(H, W, Ho, Wo, kh, kw, stride, pad):
            t = dout[cs, ns, oh, ow] * x[cs, ns, ih, iw]                    # one block
            dw[cs, 0, i, j] += t.reshape(t.shape[0], -1).sum(axis=1)
    _blocks(C, N, max(H * W, Ho * Wo), block, dw)


def _view3(a, g, rows):
    """(g, rows, -1) view of a channel block a (g*rows, ...) whose channels each hold one
    contiguous run; raises instead of silently copying."""
    v = a.view()
    v.shape = (g, rows, -1)
    return v


def _tiles(groups, a, b, fit):
    """(g0, g1, n0, n1) tiles of groups x samples [a, b) of at most `fit` (group, sample) pairs
    (fit >= 1): every group for as many samples as fit, else as many groups as fit, one sample."""
    if fit >= groups:
        nc = min(b - a, fit // groups)
        for n0 in range(a, b, nc):
            yield 0, groups, n0, min(b, n0 + nc)
        return
    for n0 in range(a, b):
        for g0 in range(0, groups, fit):
            yield g0, min(groups, g0 + fit), n0, n0 + 1


def _over_tiles(x_or_dx, ws, groups, cig, kh, kw, P, body):
    """body(a, g0, g1, n0, n1, cols) over the tiles of each thread's batch range [a, b): cols, the
    flat start of the thread's workspace holding the tile's (g*Cin_g, kh, kw, n, Ho, Wo) columns."""
    per = cig * kh * kw * P                            # one group, one sample

    def samples(a, b, wsp):
        for g0, g1, n0, n1 in _tiles(groups, a, b, wsp.size // per):
            body(a, g0, g1, n0, n1, wsp[:(g1 - g0) * (n1 - n0) * per])
    over_batch(x_or_dx.shape[1], ws, per, samples)


def _batched_forward(out, x, w, stride, pad, groups, ws, columns):
    xp = array_module(out)
    Cout, cig, kh, kw = w.shape
    cog, (Ho, Wo) = Cout // groups, out.shape[2:]
    w3 = w.reshape(groups, cog, -1)
    if _is_pointwise(w, stride, pad) and x.flags.c_contiguous and out.flags.c_contiguous:
        x3, o3 = _view3(x, groups, cig), _view3(out, groups, cog)
        over_columns(x3.shape[2], lambda m0, m1: xp.matmul(w3, x3[:, :, m0:m1], out=o3[:, :, m0:m1]), x,
                     Cout * cig)
        return

    def tile(a, g0, g1, n0, n1, cols):
        cols = cols.reshape((g1 - g0) * cig, kh, kw, n1 - n0, Ho, Wo)
        columns.im2col(cols, x[g0 * cig:g1 * cig, n0:n1], kh, kw, stride, pad)
        xp.matmul(w3[g0:g1], cols.reshape(g1 - g0, cig * kh * kw, -1),
                  out=_view3(out[g0 * cog:g1 * cog, n0:n1], g1 - g0, cog))
    _over_tiles(x, ws, groups, cig, kh, kw, Ho * Wo, tile)


def _batched_backward_input(dx, dout, w, stride, pad, groups, ws, accumulate, columns):
    xp = array_module(dx)
    Cout, cig, kh, kw = w.shape
    cog, (Ho, Wo) = Cout // groups, dout.shape[2:]
    w3t = w.reshape(groups, cog, -1).transpose(0, 2, 1)
    if _is_pointwise(w, stride, pad) and not accumulate and dx.flags.c_contiguous and dout.flags.c_contiguous:
        g3, d3 = _view3(dout, groups, cog), _view3(dx, groups, cig)
        over_columns(g3.shape[2], lambda m0, m1: xp.matmul(w3t, g3[:, :, m0:m1], out=d3[:, :, m0:m1]), dout,
                     Cout * cig)
        return
    def tile(a, g0, g1, n0, n1, cols):
        cols = cols.reshape((g1 - g0) * cig, kh, kw, n1 - n0, Ho, Wo)
        if not accumulate:                                  # tiles are disjoint: each zeroes its own dx
            dx[g0 * cig:g1 * cig, n0:n1].fill(0)
        xp.matmul(w3t[g0:g1], _view3(dout[g0 * cog:g1 * cog, n0:n1], g1 - g0, cog),
                  out=cols.reshape(g1 - g0, cig * kh * kw, -1))
        columns.col2im(dx[g0 * cig:g1 * cig], n0, n1, cols, kh, kw, stride, pad)
    _over_tiles(dx, ws, groups, cig, kh, kw, Ho * Wo, tile)


def _batched_backward_weight(dw, x, dout, stride, pad, groups, ws, columns):
    """Allocates a weight-sized partial per thread and one GEMM result per tile (never activation-sized)."""
    xp = array_module(dw)
    Cout, cig, kh, kw = dw.shape
    cog, (Ho, Wo) = Cout // groups, dout.shape[2:]
    dw3 = dw.reshape(groups, cog, -1)
    parts = {}                                         # range start -> its partial sum
    if _is_pointwise(dw, stride, pad) and x.flags.c_contiguous and dout.flags.c_contiguous:
        x3, g3 = _view3(x, groups, cig), _view3(dout, groups, cog)

        def ranges(m0, m1):
            parts[m0] = xp.matmul(g3[:, :, m0:m1], x3[:, :, m0:m1].transpose(0, 2, 1))
        over_columns(x3.shape[2], ranges, x, Cout * cig)
    else:
        def tile(a, g0, g1, n0, n1, cols):
            cols = cols.reshape((g1 - g0) * cig, kh, kw, n1 - n0, Ho, Wo)
            columns.im2col(cols, x[g0 * cig:g1 * cig, n0:n1], kh, kw, stride, pad)
            t = xp.matmul(_view3(dout[g0 * cog:g1 * cog, n0:n1], g1 - g0, cog),
                          cols.reshape(g1 - g0, cig * kh * kw, -1).transpose(0, 2, 1))
            if a not in parts:                              # this thread's range: its partial
                parts[a] = xp.zeros_like(dw3)
            parts[a][g0:g1] += t
        _over_tiles(x, ws, groups, cig, kh, kw, Ho * Wo, tile)
    for start in sorted(parts):                        # a fixed order: deterministic for a given T
        dw3 += parts[start]


def grouped_conv2d_forward(out, x, w, stride, pad, groups, ws, bias=None, columns=None):
    """out (Cout, N, Ho, Wo) = grouped conv of x (Cin, N, H, W) with w (Cout, Cin/groups, kh, kw),
    plus bias (Cout,) when given. ws: the workspace (workspace_per_sample elements a sample at
    least; unused on the depthwise path); columns: as ops/conv.py's."""
    cig, cog = _shapes(x, w, out, groups)
    direct = _direct(columns, x, out, w, groups) if groups > 1 else None
    if groups == 1:
        conv2d_forward(out, x, w, stride, pad, ws, columns)
    elif direct is not None:
        direct.forward(out, x, w, stride, pad)
    elif is_depthwise(w, groups):
        _depthwise_forward(out, x, w, stride, pad)
    elif (columns or columns_for(array_module(out))).batched:
        _batched_forward(out, x, w, stride, pad, groups, ws, columns or columns_for(array_module(out)))
    else:
        for g in range(groups):
            conv2d_forward(out[g * cog:(g + 1) * cog], x[g * cig:(g + 1) * cig], w[g * cog:(g + 1) * cog],
                           stride, pad, ws, columns)
    if bias is not None:
        conv_bias_forward(out, bias)


def grouped_conv2d_backward_input(dx, dout, w, stride, pad, groups, ws, accumulate=False, columns=None):
    """dx (Cin, N, H, W) = (or += with accumulate) the grouped conv's input gradient from dout.

    # saved: nothing but the weights (exact)."""
    cig, cog = _shapes(dx, w, dout, groups)
    direct = _direct(columns, dx, dout, w, groups) if groups > 1 else None
    if groups == 1:
        conv2d_backward_input(dx, dout, w, stride, pad, ws, accumulate, columns)
    elif direct is not None:
        direct.backward_input(dx, dout, w, stride, pad, accumulate)
    elif is_depthwise(w, groups):
        _depthwise_backward_input(dx, dout, w, stride, pad, accumulate)
    elif (columns or columns_for(array_module(dx))).batched:
        _batched_backward_input(dx, dout, w, stride, pad, groups, ws, accumulate,
                                columns or columns_for(array_module(dx)))
    else:
        for g in range(groups):
            conv2d_backward_input(dx[g * cig:(g + 1) * cig], dout[g * cog:(g + 1) * cog], w[g * cog:(g + 1) * cog],
                                  stride, pad, ws, accumulate, columns)


def grouped_conv2d_backward_weight(dw, x, dout, stride, pad, groups, ws, columns=None):
    """dw (Cout, Cin/groups, kh, kw) += dout (Cout, N, Ho, Wo) correlated with x, group by group.

    # saved: the conv input x (exact, or decoded from a code by the caller)."""
    cig, cog = _shapes(x, dw, dout, groups)
    direct = _direct(columns, x, dout, dw, groups) if groups > 1 else None
    if groups == 1:
        conv2d_backward_weight(dw, x, dout, stride, pad, ws, columns)
    elif direct is not None:
        direct.backward_weight(dw, x, dout, stride, pad)
    elif is_depthwise(dw, groups):
        _depthwise_backward_weight(dw, x, dout, stride, pad)
    elif (columns or columns_for(array_module(dw))).batched:
        _batched_backward_weight(dw, x, dout, stride, pad, groups, ws, columns or columns_for(array_module(dw)))
    else:
        for g in range(groups):
            conv2d_backward_weight(dw[g * cog:(g + 1) * cog], x[g * cig:(g + 1) * cig], dout[g * cog:(g + 1) * cog],
                                   stride, pad, ws, columns)


def conv_bias_forward(out, b):
    """out (Cout, N, Ho, Wo) += b (Cout,), per output channel."""
    out += b.reshape((-1,) + (1,) * (out.ndim - 1))        # any view: no copy to lose


def conv_bias_backward(db, dout):
    """db (Cout,) += sum of dout (Cout, N, Ho, Wo) over N, Ho, Wo.

    # saved: nothing."""
    db += dout.sum(axis=tuple(range(1, dout.ndim)))
