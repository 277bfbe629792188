"""Winograd F(2x2, 3x3): the stride-1, pad-1 3x3 convolutions without im2col (CPU, numba);
and the drivers that run it or F(4x4, 3x3) (ops/winograd4.py's transforms), whichever
`scheme(N, H, W)` picks for the conv (a `Scheme`: tile size, planes, transforms).

Dimensions as in ops/conv.py:  x (Cin, N, H, W), w (Cout, Cin, 3, 3), out (Cout, N, H, W).
Tiles: the output is cut into 2x2 tiles, th = ceil(H/2) by tw = ceil(W/2) per sample; tile t
of a chunk of n samples is t = (s*th + a)*tw + b. Each reads a 4x4 input patch (rows 2a-1..2a+2).

The algorithm (Lavin & Gray 2016), per tile, with the 4x4 input patch d, the 3x3 filter g:

    y (2x2) = A^T [ (G g G^T) * (B^T d B) ] A          (* element-wise, 16 products)

    B^T = [[1, 0,-1, 0],     G = [[ 1,   0,   0 ],     A^T = [[1, 1, 1, 0],
           [0, 1, 1, 0],          [1/2, 1/2, 1/2],            [0, 1,-1,-1]]
           [0,-1, 1, 0],          [1/2,-1/2, 1/2],
           [0, 1, 0,-1]]          [ 0,   0,   1 ]]

Summed over input channels, the 16 element-wise products of each tile become 16 GEMMs over
all tiles at once: M[p] (Cout, T) = U[p] (Cout, Cin) @ V[p] (Cin, T), p = 0..15, with
U = G g G^T (the filter, once per call) and V = B^T d B (the input tiles). That is 16 products
per 4 outputs against im2col's 9 per output: 2.25x fewer multiplies, and the transformed
tiles take 4x the input instead of 9x. The three products of training:

    forward          V from x,        M = U @ V,            out <- A^T M A
    input gradient   the same conv of dout with w turned 180 degrees and Cin/Cout swapped
                     (stride 1, pad 1), so the same three steps; `accumulate` adds into dx
    weight gradient  V from x,  Mg = A dy A^T from each 2x2 output-gradient tile,
                     dU[p] = Mg[p] @ V[p]^T (summed over tiles),  dw = G^T dU G

Memory: V and M for `n` samples take 16*(Cin + Cout)*th*tw*n elements of the conv
workspace (the weight gradient also keeps two 16*Cout*Cin sums per range there, or where
those do not fit, the whole batch's V and dU's rows in blocks of output channels) (under
im2col's 9*Cin*H*W*n when Cin = Cout); chunks are capped at CACHE_BYTES so
V and M stay in the core's cache between the transform and the GEMM. Where the room is there,
the planes of V, M and Mg lie PLANE_GAP elements further apart (16 more per plane; `_planes`),
so that the 16 streams _output_tiles reads, and the 16 planes a tile transform writes at
once, are not a multiple of 4 KiB apart. Threads as in
ops/conv.py (ops/chunks.py): batch ranges, each with its own part of the workspace and at
least WORK_GRAIN GEMM multiply-adds (a smaller conv runs on one thread); except where a
range's GEMMs would be too thin (wide channels on few tiles, `_split_planes`) or the
workspace holds fewer weight-gradient ranges than threads (each keeps its own dU,
`_weight_planes`): there the threads cut the tile transforms by channel rows and the GEMMs
by plane, over the batch's tiles at once (or in chunks the workspace holds).

Accuracy: the transforms' constants are 0, +-1 and +-1/2, so float32 Winograd stays close to
im2col; tests/ops/test_winograd.py checks every 3x3 conv shape of ResNet-164 against float64.
When it applies: `applies()` (numba present, NumPy float32 C-contiguous arrays, 3x3,
stride 1, pad 1, at least MIN_CHANNELS channels in and out, one sample fits the workspace);
else ops/conv.py's im2col path runs. ENABLED = False (or LOWMEM_WINOGRAD=0 in the environment)
turns it off.
"""
import os
from typing import Callable, NamedTuple

import numpy

from . import winograd4
from .chunks import batch_ranges, over_batch
from ..system import threads
from ..system.backend import numba_available

ENABLED = os.environ.get("LOWMEM_WINOGRAD", "1").strip() not in ("0", "false", "no")   # the switch
AVAILABLE = numba_available()          # its tile transforms are numba loops
MIN_CHANNELS = 16           # below this the 16 GEMMs are too thin to beat one im2col GEMM (the stem's Cin = 3)
CACHE_BYTES = 1 << 20       # bytes of transformed tiles (V and M) per chunk
FILTER_GRAIN = 1 << 12      # filters per thread below which a filter transform is not split
FILTER_BLOCK = 64           # filters (input channels) the filter transforms vectorise over
PLANE_GAP = 16              # float32 elements (one 64-byte line) between M's planes where they would alias
SET_BYTES = 2048            # planes this many bytes apart (or a multiple) share L1 sets 8 or 16 to a set
                            # (64 sets of 8 lines): the F(2x2) tile kernels then write 4 planes at a time
SPLIT_PLANES = True         # off: batch ranges only, whatever the shape (benchmarks/conv_paths.py)
PLANE_TILES = 512           # tiles per thread below which a wide conv splits its planes between threads, not its batch
PLANE_CHANNELS = 1 << 18    # and Cin*Cout from which it does (512 x 512)
MIN_BLOCK = 64              # output channels per block, at least, where a weight gradient's dU is cut in blocks
ROW_GRAIN = 8               # channel rows per thread below which a tile transform is not split
WORK_GRAIN = 1 << 22        # GEMM multiply-adds per thread below which a conv's batch is not split



def tiles(H, W):
    """(th, tw): 2x2 output tiles per sample."""
    return (H + 1) // 2, (W + 1) // 2


def per_sample(Cin, Cout, H, W):
    """Workspace elements one sample needs (its V and M)."""
    th, tw = tiles(H, W)
    return 16 * (Cin + Cout) * th * tw


class Scheme(NamedTuple):
    """One tile size: its transforms (numba kernels, as this module's F(2x2) ones), which the
    drivers below run. F2 here; F4, ops/winograd4.py's F(4x4, 3x3)."""
    name: str
    planes: int                     # transformed values per tile, (output tile side + 2)**2
    filter_tiles: Callable          # (U, w, o0, o1): U (planes, Cout, Cin) = G g G^T
    filter_gradient_add: Callable   # (dw, dU, o0, o1): dw += G^T dU G
    input_tiles: Callable           # (V, x, n0): V (planes, C, T) = B^T d B
    gradient_tiles: Callable        # (Mg, dout, n0): Mg (planes, Co, T) = A dy A^T
    output_tiles: Callable          # (out, M, n0, accumulate): out (+)= A^T m A
    tiles: Callable                 # (H, W): output tiles per sample, (th, tw)
    per_sample: Callable            # (Cin, Cout, H, W): workspace elements of one sample


def scheme(N, H, W):
    """The tile size a stride-1 3x3 conv on N planes of H x W runs: F(4x4, 3x3) where it has the
    tiles to pay for its transforms (winograd4.takes), else F(2x2, 3x3)."""
    return F4 if winograd4.takes(N, H, W) else F2


def applies(x, w, out, stride, pad, ws, weight=False):
    """Whether the Winograd path runs this conv (see the module docstring); weight: for the
    weight gradient, which also keeps two (planes, Cout, Cin) sums in the workspace, or else
    the whole batch's input tiles and dU for blocks of at least MIN_BLOCK output channels."""
    if not (ENABLED and AVAILABLE):
        return False
    Cout, Cin, kh, kw = w.shape
    if (kh, kw, stride, pad) != (3, 3, 1, 1) or min(Cin, Cout) < MIN_CHANNELS:
        return False
    arrays = (x, w, out, ws)
    if not all(type(a) is numpy.ndarray and a.dtype == numpy.float32 for a in arrays):
        return False
    if not (x.flags.c_contiguous and out.flags.c_contiguous):
        return False
    H, W = x.shape[2:]
    if out.shape[2:] != (H, W):
        return False
    N = x.shape[1]
    s = scheme(N, H, W)
    per = s.per_sample(Cin, Cout, H, W)
    if weight and ws.size < per + 2 * s.planes * Cin * Cout:        # no room for a whole dU and its term:
        return _weight_block(N, Cin, Cout, H, W, s, ws) >= min(Cout, MIN_BLOCK)   # blocks of dU's rows
    return ws.size >= per                                  # the batch split gives each range at least this


def temporary_bytes(convs, dtype):
    """Bound on the NumPy temporaries this path adds to a step (for the engine's plan):
    convs, (k, stride, pad, Cin, Cout, H, W) per conv. The forward and input gradient allocate
    the transformed filters U (planes*Cout*Cin float32: 36 planes where F(4x4) may run, whatever
    the batch); the weight gradient works in the workspace."""
    sizes = [ci * co * (winograd4.PLANES if winograd4.may_take(h, w) else 16)
             for k, s, p, ci, co, h, w in convs if (k, s, p) == (3, 1, 1) and min(ci, co) >= MIN_CHANNELS]
    if not (sizes and ENABLED and AVAILABLE and numpy.dtype(dtype) == numpy.float32):
        return 0
    return max(sizes) * 4


def filter_transform(w, s=None):
    """U (planes, Cout, Cin) float32 = G g G^T per filter (w (Cout, Cin, 3, 3), any strides) of
    scheme s (default F(2x2)), each computed in float64 and rounded once, threads splitting Cout;
    the only allocation is U."""
    s = s or F2
    U = numpy.empty((s.planes,) + w.shape[:2], numpy.float32)
    threads.parallel_for(lambda o0, o1: s.filter_tiles(U, w, o0, o1), w.shape[0], _filter_grain(w))
    return U


def filter_gradient_add(dw, dU, s=None):
    """dw (Cout, Cin, 3, 3) += G^T dU G per filter, dU (planes, Cout, Cin) the gradient of U, in
    float64 (the adjoint of filter_transform), threads splitting Cout."""
    s = s or F2
    threads.parallel_for(lambda o0, o1: s.filter_gradient_add(dw, dU, o0, o1), dw.shape[0], _filter_grain(dw))


def _filter_grain(w):
    """Output channels per thread below which a filter transform is not split."""
    return max(1, FILTER_GRAIN // max(1, w.shape[1]))


def _chunk(wsp, per, n):
    """Samples per chunk in this range's workspace: what fits, at most CACHE_BYTES."""
    return max(1, min(n, wsp.size // per, CACHE_BYTES // (4 * per)))


def _planes(wsp, rows, T, planes=16, room=0):
    """A (planes, rows, T) array at the start of wsp whose planes lie an odd number of 64-byte
    lines apart (PLANE_GAP elements more than rows*T when that is an even number of lines and wsp
    has the room, `room` more elements left after them), else wsp's first planes*rows*T elements
    as they come. The tile transforms write the planes side by side, _output_tiles reads them so:
    at a plane distance that is a multiple of 4 KiB (rows*T a multiple of 1024 float32, as at 64+
    channels on 32x32 tiles, or 128 channels on 8 samples of 8x8) all the streams fall into the
    same L1 sets and evict each other. Only where the planes lie changes, not what is computed."""
    n = rows * T
    step = n + PLANE_GAP if (n % PLANE_GAP == 0 and (n // PLANE_GAP) % 2 == 0
                             and planes * (n + PLANE_GAP) + room <= wsp.size) else n
    out = wsp[:planes * step].reshape(planes, step)[:, :n]
    out.shape = (planes, rows, T)                          # a view, never a copy (raises instead)
    return out


def _pair(wsp, rows1, rows2, T, planes):
    """Two plane stacks (planes, rows1, T) and (planes, rows2, T) from the start of wsp, the
    second after the first, each spaced as _planes spaces them (the first where the second
    keeps its planes*rows2*T elements)."""
    a = _planes(wsp, rows1, T, planes, room=planes * rows2 * T)
    end = planes * (a.strides[0] // a.itemsize)
    return a, _planes(wsp[end:], rows2, T, planes)


def _split_planes(N, tiles_per_sample, channels, ws, need):
    """Whether a forward or input-gradient conv of N samples cuts its GEMMs' planes between the
    threads rather than its batch: at PLANE_CHANNELS (Cin*Cout) and more, where a batch range
    would hold fewer than PLANE_TILES tiles (its GEMMs too thin for BLAS's speed: ResNet-18's
    and -50's 512-channel 4x4 layers), and the workspace holds `need` elements (one sample)."""
    T = threads.threads()
    return (SPLIT_PLANES and T > 1 and channels >= PLANE_CHANNELS and N * tiles_per_sample < PLANE_TILES * T
            and ws.size >= need)


def _most(work):
    """Batch ranges a conv of `work` GEMM multiply-adds is worth: one per WORK_GRAIN."""
    return max(1, work // WORK_GRAIN)


def _rows(fn, n, grain=ROW_GRAIN):
    """fn(r0, r1) over the n channel rows of a transform, split between the threads."""
    threads.parallel_for(fn, n, grain)


def _correlate(out, x, U, ws, accumulate, s):
    """out (Co, N, H, W) (+)= the stride-1 pad-1 3x3 correlation of x (Ci, N, H, W) with the
    filters whose transforms (scheme s) are U (planes, Co, Ci)."""
    P = s.planes
    Co, Ci = U.shape[1:]
    N, H, W = x.shape[1:]
    th, tw = s.tiles(H, W)
    per = s.per_sample(Ci, Co, H, W)
    if _split_planes(N, th * tw, Ci * Co, ws, per):
        nc = min(N, ws.size // per)
        for n0 in range(0, N, nc):                         # the whole batch at once where it fits
            n1 = min(N, n0 + nc)
            T = (n1 - n0) * th * tw
            V, M = _pair(ws, Ci, Co, T, P)
            _rows(lambda c0, c1: s.input_tiles(V[:, c0:c1], x[c0:c1], n0), Ci)
            threads.parallel_for(lambda p0, p1: numpy.matmul(U[p0:p1], V[p0:p1], out=M[p0:p1]), P)
            _rows(lambda c0, c1: s.output_tiles(out[c0:c1], M[:, c0:c1], n0, accumulate), Co)
        return

    def samples(a, b, wsp):
        nc = _chunk(wsp, per, b - a)
        for n0 in range(a, b, nc):
            n1 = min(b, n0 + nc)
            T = (n1 - n0) * th * tw
            V, M = _pair(wsp, Ci, Co, T, P)
            s.input_tiles(V, x, n0)
            numpy.matmul(U, V, out=M)
            s.output_tiles(out, M, n0, accumulate)
    over_batch(N, ws, per, samples, _most(P * Ci * Co * N * th * tw))


def conv3x3_forward(out, x, w, ws):
    """out (Cout, N, H, W) = conv(x (Cin, N, H, W), w (Cout, Cin, 3, 3)), stride 1, pad 1."""
    s = scheme(*x.shape[1:])
    _correlate(out, x, filter_transform(w, s), ws, False, s)


def conv3x3_backward_input(dx, dout, w, ws, accumulate=False):
    """dx (Cin, N, H, W) = (or += ) the input gradient: dout correlated with w turned 180 degrees,
    in and out channels swapped."""
    s = scheme(*dx.shape[1:])
    wb = w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)
    _correlate(dx, dout, filter_transform(wb, s), ws, accumulate, s)


def conv3x3_backward_weight(dw, x, dout, ws):
    """dw (Cout, Cin, 3, 3) += dout (Cout, N, H, W) correlated with x (Cin, N, H, W).

    Each batch range keeps its running dU (planes, Cout, Cin) and one chunk's GEMM result at the
    start of its own part of the workspace (so no temporaries); the ranges' sums are added
    in range order (deterministic for a given thread count), then dw += G^T dU G."""
    Co, Ci = dw.shape[:2]
    N, H, W = x.shape[1:]
    s = scheme(N, H, W)
    P = s.planes
    th, tw = s.tiles(H, W)
    per, u = s.per_sample(Ci, Co, H, W), P * Co * Ci
    if _weight_planes(N, th * tw, Ci * Co, ws, per, u):
        _weight_by_planes(dw, x, dout, ws, s)
        return
    if ws.size < per + 2 * u:                              # applies() found room for blocks of dU
        _weight_by_blocks(dw, x, dout, ws, s)
        return
    sums = {}

    def samples(a, b, wsp):
        acc, term = wsp[:u].reshape(P, Co, Ci), wsp[u:2 * u].reshape(P, Co, Ci)
        tiles_ws = wsp[2 * u:]
        nc = _chunk(tiles_ws, per, b - a)
        for n0 in range(a, b, nc):
            n1 = min(b, n0 + nc)
            T = (n1 - n0) * th * tw
            V, Mg = _pair(tiles_ws, Ci, Co, T, P)
            s.input_tiles(V, x, n0)
            s.gradient_tiles(Mg, dout, n0)
            if n0 == a:
                numpy.matmul(Mg, V.transpose(0, 2, 1), out=acc)
            else:
                acc += numpy.matmul(Mg, V.transpose(0, 2, 1), out=term)
        sums[a] = acc
    over_batch(N, ws, per + 2 * u, samples, _most(u * N * th * tw))   # a range: one sample's tiles, dU, a term
    starts = sorted(sums)
    dU = sums[starts[0]]
    for start in starts[1:]:
        dU += sums[start]
    filter_gradient_add(dw, dU, s)


def conv3x3_backward_both(dw, dx, x, dout, w, ws, accumulate=False):
    """dw += the weight gradient and dx (+)= the input gradient side by side, one per thread, for
    a conv too small for either to split between the threads (each would run as one batch
    range: DenseNet's 3x3 convs on 4x4 and 2x2 planes). The weight gradient's input tiles are
    made first, so x (which may be dx itself: the engine rebuilds a unit's output where dx then
    goes) is read before dx is written; then the weight gradient's GEMMs and filter adjoint on
    one thread and the input gradient on the other, each in its own part of the workspace (the
    weight gradient's: dU, then the whole batch's tiles in one chunk, as its single range would
    hold them, less the term a second chunk would need). Each
    result is what conv3x3_backward_weight and conv3x3_backward_input give. Returns False, doing
    nothing, where this does not apply (fewer than two threads, a gradient that would split
    itself, dx sharing memory with dout, or no room): run the two one after the other then."""
    if threads.threads() < 2 or numpy.may_share_memory(dx, dout):
        return False
    Co, Ci = dw.shape[:2]
    N, H, W = x.shape[1:]
    s = scheme(N, H, W)
    P = s.planes
    th, tw = s.tiles(H, W)
    T = N * th * tw
    per_w, u = s.per_sample(Ci, Co, H, W), P * Co * Ci
    per_x = s.per_sample(Co, Ci, H, W)
    size_w = u + N * per_w + PLANE_GAP * 2 * P              # dU, the batch's tiles (spaced)
    if (ws.size < size_w + per_x or _weight_planes(N, th * tw, Ci * Co, ws, per_w, u)
            or _split_planes(N, th * tw, Ci * Co, ws, per_x)
            or len(batch_ranges(N, ws, per_w + 2 * u, _most(u * T))) > 1
            or len(batch_ranges(N, ws, per_x, _most(P * Ci * Co * T))) > 1
            or _chunk(ws[u:size_w], per_w, N) < N):
        return False
    acc, tiles_ws, rest = ws[:u].reshape(P, Co, Ci), ws[u:size_w], ws[size_w:]
    V, Mg = _pair(tiles_ws, Ci, Co, T, P)
    s.input_tiles(V, x, 0)                                 # x is not read after this
    wb = w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)
    U = filter_transform(wb, s)

    def gradients(i0, i1):
        for i in range(i0, i1):
            if i == 0:
                s.gradient_tiles(Mg, dout, 0)
                numpy.matmul(Mg, V.transpose(0, 2, 1), out=acc)
                filter_gradient_add(dw, acc, s)
            else:
                _correlate(dx, dout, U, rest, accumulate, s)
    threads.parallel_for(gradients, 2)
    return True


def _weight_planes(N, tiles_per_sample, channels, ws, per, u):
    """Whether a weight gradient cuts its GEMMs' planes between the threads: where the batch
    split would run fewer ranges than there are threads (each range keeps its own dU and a
    term, 2u elements: 256 channels' take half of the default 16 MiB workspace), or where
    _split_planes would cut a forward's; and the workspace holds dU, a term and one sample's tiles."""
    T = threads.threads()
    ranges = min(T, N, ws.size // (per + 2 * u))
    return (SPLIT_PLANES and T > 1 and ws.size >= 2 * u + per
            and (ranges < T or _split_planes(N, tiles_per_sample, channels, ws, per)))


def _weight_by_planes(dw, x, dout, ws, s):
    """conv3x3_backward_weight with the planes split between the threads: the batch's tiles
    in chunks as large as the workspace holds (transforms split by channel rows), each chunk's
    GEMMs Mg[p] @ V[p]^T split by plane into one dU (a chunk's term beside it after the first),
    then dw += G^T dU G."""
    Co, Ci = dw.shape[:2]
    N, H, W = x.shape[1:]
    P = s.planes
    th, tw = s.tiles(H, W)
    per, u = s.per_sample(Ci, Co, H, W), P * Co * Ci
    one = N * per + u <= ws.size                           # the whole batch at once: no term
    dU = ws[:u].reshape(P, Co, Ci)
    term = None if one else ws[u:2 * u].reshape(P, Co, Ci)
    tiles_ws = ws[u:] if one else ws[2 * u:]
    nc = min(N, tiles_ws.size // per)
    for n0 in range(0, N, nc):
        n1 = min(N, n0 + nc)
        T = (n1 - n0) * th * tw
        V, Mg = _pair(tiles_ws, Ci, Co, T, P)
        _rows(lambda c0, c1: s.input_tiles(V[:, c0:c1], x[c0:c1], n0), Ci)
        _rows(lambda c0, c1: s.gradient_tiles(Mg[:, c0:c1], dout[c0:c1], n0), Co)

        def planes(p0, p1, first=n0 == 0):
            if first:
                numpy.matmul(Mg[p0:p1], V[p0:p1].transpose(0, 2, 1), out=dU[p0:p1])
            else:
                dU[p0:p1] += numpy.matmul(Mg[p0:p1], V[p0:p1].transpose(0, 2, 1), out=term[p0:p1])
        threads.parallel_for(planes, P)
    filter_gradient_add(dw, dU, s)


def _weight_block(N, Ci, Co, H, W, s, ws):
    """Output channels per block where the weight gradient takes dU in blocks of rows: as many
    as fit in the workspace beside the whole batch's input tiles (each block: its gradient tiles
    and its rows of dU); 0 where not even the input tiles fit."""
    th, tw = s.tiles(H, W)
    T = N * th * tw
    room = ws.size - s.planes * Ci * T
    return max(0, min(Co, room // (s.planes * (T + Ci))))


def _weight_by_blocks(dw, x, dout, ws, s):
    """conv3x3_backward_weight where a whole dU (planes, Cout, Cin) and its term do not fit the
    workspace (512 channels take 16 MiB): the batch's input tiles V once (transforms split by
    channel rows), then per block of output channels its gradient tiles Mg, its rows of dU
    (Mg[p] @ V[p]^T, the planes split between the threads) and dw[block] += G^T dU G. Each
    filter's dw is what one whole dU gives, per element the same sums."""
    Co, Ci = dw.shape[:2]
    N, H, W = x.shape[1:]
    P = s.planes
    th, tw = s.tiles(H, W)
    T = N * th * tw
    ob = _weight_block(N, Ci, Co, H, W, s, ws)
    if ob < 1:
        raise ValueError(f"conv workspace too small for a Winograd weight gradient: {ws.size} elements, "
                         f"the batch's input tiles and one output channel's need "
                         f"{P * Ci * T + P * (T + Ci)} (applies() says where it runs)")
    V = _planes(ws, Ci, T, P, room=P * ob * (T + Ci))      # spaced where the blocks leave the room
    _rows(lambda c0, c1: s.input_tiles(V[:, c0:c1], x[c0:c1], 0), Ci)
    rest = ws[P * (V.strides[0] // V.itemsize):]
    for o0 in range(0, Co, ob):
        o1 = min(Co, o0 + ob)
        b = o1 - o0
        Mg = _planes(rest, b, T, P, room=P * b * Ci)
        end = P * (Mg.strides[0] // Mg.itemsize)
        dU = rest[end:end + P * b * Ci].reshape(P, b, Ci)
        _rows(lambda c0, c1: s.gradient_tiles(Mg[:, c0:c1], dout[o0 + c0:o0 + c1], 0), b)
        threads.parallel_for(lambda p0, p1: numpy.matmul(Mg[p0:p1], V[p0:p1].transpose(0, 2, 1),
                                                         out=dU[p0:p1]), P)
        filter_gradient_add(dw[o0:o1], dU, s)


# ---- the filter and tile transforms in NumPy: the references the numba kernels below match bit
# for bit (the same float64 / float32 operations in the same order; tests/ops/test_winograd.py).
# The tile transforms take ns samples from n0 on; T = ns*th*tw tiles, tile (s, a, b) at column
# (s*th + a)*tw + b.

G = numpy.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])   # float64


def filter_tiles_reference(w):
    """U (16, Cout, Cin) float32 = G g G^T of every filter g = w[o, c] (3x3), in float64: t = G g
    (each entry G[i,0]*g[0,l] + G[i,1]*g[1,l] + G[i,2]*g[2,l], in that order), then t G^T the same way."""
    g = w.astype(numpy.float64)
    t = [G[i, 0] * g[:, :, 0] + G[i, 1] * g[:, :, 1] + G[i, 2] * g[:, :, 2] for i in range(4)]   # (Co, Ci, 3)
    U = numpy.empty((16,) + w.shape[:2], numpy.float32)
    for i in range(4):
        for j in range(4):
            U[4 * i + j] = t[i][..., 0] * G[j, 0] + t[i][..., 1] * G[j, 1] + t[i][..., 2] * G[j, 2]
    return U


def filter_gradient_reference(dw, dU):
    """dw (Cout, Cin, 3, 3) += G^T dU G per filter, in float64: t = G^T dU (each entry
    0 + G[0,p]*dU[j] + G[1,p]*dU[4+j] + ..., in that order), then t G the same way (no leading 0)."""
    d = dU.astype(numpy.float64)
    for p in range(3):
        t = [0.0 + G[0, p] * d[j] + G[1, p] * d[4 + j] + G[2, p] * d[8 + j] + G[3, p] * d[12 + j] for j in range(4)]
        for q in range(3):
            dw[:, :, p, q] += t[0] * G[0, q] + t[1] * G[1, q] + t[2] * G[2, q] + t[3] * G[3, q]


def input_tiles_reference(x, n0, ns):
    """V (16, C, T) float32 = B^T d B of every tile's 4x4 input patch (pad 1, zero outside)."""
    C, N, H, W = x.shape
    th, tw = tiles(H, W)
    P = numpy.zeros((C, ns, 2 * th + 2, 2 * tw + 2), numpy.float32)
    P[:, :, 1:H + 1, 1:W + 1] = x[:, n0:n0 + ns]
    d = [P[:, :, r:r + 2 * th:2] for r in range(4)]                   # row r of every patch
    rows = (d[0] - d[2], d[1] + d[2], d[2] - d[1], d[1] - d[3])      # B^T d
    V = numpy.empty((16, C, ns, th, tw), numpy.float32)
    for i, e in enumerate(rows):
        e = [e[..., q:q + 2 * tw:2] for q in range(4)]               # column q of every patch
        V[4 * i:4 * i + 4] = (e[0] - e[2], e[1] + e[2], e[2] - e[1], e[1] - e[3])   # (.) B
    return V.reshape(16, C, -1)


def gradient_tiles_reference(dout, n0, ns):
    """Mg (16, Co, T) float32 = A dy A^T of every 2x2 tile of dout (zero beyond the image)."""
    Co, N, H, W = dout.shape
    th, tw = tiles(H, W)
    D = numpy.zeros((Co, ns, 2 * th, 2 * tw), numpy.float32)
    D[:, :, :H, :W] = dout[:, n0:n0 + ns]
    g0, g1 = D[:, :, 0::2], D[:, :, 1::2]
    Mg = numpy.empty((16, Co, ns, th, tw), numpy.float32)
    for i, e in enumerate((g0, g0 + g1, g0 - g1, -g1)):              # A dy
        f0, f1 = e[..., 0::2], e[..., 1::2]
        Mg[4 * i:4 * i + 4] = (f0, f0 + f1, f0 - f1, -f1)            # (.) A^T
    return Mg.reshape(16, Co, -1)


def output_tiles_reference(out, M, n0, accumulate):
    """out[:, n0:n0+ns] (=, or += with accumulate) A^T m A of every tile's 16 values in M."""
    Co, N, H, W = out.shape
    th, tw = tiles(H, W)
    ns = M.shape[2] // (th * tw)
    m = M.reshape(16, Co, ns, th, tw)
    u = [m[j] + m[4 + j] + m[8 + j] for j in range(4)]               # A^T m: rows 0+1+2
    v = [m[4 + j] - m[8 + j] - m[12 + j] for j in range(4)]          # and 1-2-3
    Y = numpy.empty((Co, ns, th, 2, tw, 2), numpy.float32)
    Y[:, :, :, 0, :, 0], Y[:, :, :, 0, :, 1] = u[0] + u[1] + u[2], u[1] - u[2] - u[3]
    Y[:, :, :, 1, :, 0], Y[:, :, :, 1, :, 1] = v[0] + v[1] + v[2], v[1] - v[2] - v[3]
    y = Y.reshape(Co, ns, 2 * th, 2 * tw)[:, :, :H, :W]
    if accumulate:
        out[:, n0:n0 + ns] += y
    else:
        out[:, n0:n0 + ns] = y


if AVAILABLE:
    from numba import njit
    from .winograd4 import _gather_filters, _gather_planes
    _opts = dict(cache=True, nogil=True)

    @njit(**_opts)
    def _g_rows(a, b, c):
        """The four rows of G applied to (a, b, c): G[i,0]*a + G[i,1]*b + G[i,2]*c, i = 0..3.
        The zero products stay (no fastmath): the same float64 operations as filter_tiles_reference."""
        return (1.0 * a + 0.0 * b + 0.0 * c, 0.5 * a + 0.5 * b + 0.5 * c,
                0.5 * a + -0.5 * b + 0.5 * c, 0.0 * a + 0.0 * b + 1.0 * c)

    @njit(**_opts)
    def _gt_cols(a, b, c, d):
        """The three columns of G applied to (a, b, c, d): G[0,p]*a + ... + G[3,p]*d, p = 0..2."""
        return (1.0 * a + 0.5 * b + 0.5 * c + 0.0 * d, 0.0 * a + 0.5 * b + -0.5 * c + 0.0 * d,
                0.0 * a + 0.5 * b + 0.5 * c + 1.0 * d)

    @njit(**_opts)
    def _gt_cols0(a, b, c, d):
        """_gt_cols summed from 0.0 (0 + G[0,p]*a + ...): a -0 sum becomes +0, as in the reference."""
        return (0.0 + 1.0 * a + 0.5 * b + 0.5 * c + 0.0 * d, 0.0 + 0.0 * a + 0.5 * b + -0.5 * c + 0.0 * d,
                0.0 + 0.0 * a + 0.5 * b + 0.5 * c + 1.0 * d)

    @njit(**_opts)
    def _filter_tiles(U, w, o0, o1):
        """U[4i+j, o, c] = (G g G^T)[i, j] for each filter g = w[o, c] (3x3) of o0 <= o < o1, in
        float64, bit for bit filter_tiles_reference. The filters taken flat (f = o*Ci + c, U's
        planes being (Cout*Cin) runs), FILTER_BLOCK at a time whatever Cin: their 9 values gathered
        into g, then each step of the transform one loop over the block (t = G g: t[3i+l] row i,
        column l; then t G^T written straight into U's planes, one contiguous run of the block per
        plane), which LLVM vectorises; where blocks were one output channel's filters and the
        planes were written through an L1 block (benchmarks/conv_parts.py --parts filters;
        figures: docs/performance.md)."""
        Ci = w.shape[1]
        Uf = U.reshape(U.shape[0], U.shape[1] * U.shape[2])
        g = numpy.empty((9, FILTER_BLOCK), numpy.float32)
        t = numpy.empty((12, FILTER_BLOCK))
        f1 = o1 * Ci
        for f in range(o0 * Ci, f1, FILTER_BLOCK):
            n = min(FILTER_BLOCK, f1 - f)
            _gather_filters(g, w, f, Ci, n)
            for l in range(3):                              # G g: column l from g's column l
                for k in range(n):
                    r = _g_rows(numpy.float64(g[l, k]), numpy.float64(g[3 + l, k]), numpy.float64(g[6 + l, k]))
                    t[l, k], t[3 + l, k], t[6 + l, k], t[9 + l, k] = r
            for i in range(4):                              # row i of G g, times G^T
                U0, U1 = Uf[4 * i, f:f + n], Uf[4 * i + 1, f:f + n]
                U2, U3 = Uf[4 * i + 2, f:f + n], Uf[4 * i + 3, f:f + n]
                for k in range(n):
                    v = _g_rows(t[3 * i, k], t[3 * i + 1, k], t[3 * i + 2, k])
                    U0[k], U1[k], U2[k], U3[k] = v[0], v[1], v[2], v[3]

    @njit(**_opts)
    def _filter_gradient_add(dw, dU, o0, o1):
        """dw[o, c] += G^T dU G, dU[4i+j, o, c] the gradient of U, for o0 <= o < o1, in float64
        (the adjoint of _filter_tiles), bit for bit filter_gradient_reference; blocked and looped
        over the block as it is: the block's 16 values a filter first copied into d
        (winograd4._gather_planes), then t[4p+j] = (G^T dU)[p, j]."""
        Ci = dw.shape[1]
        d = numpy.empty((16, FILTER_BLOCK))
        t = numpy.empty((12, FILTER_BLOCK))
        g = numpy.empty((9, FILTER_BLOCK))
        for o in range(o0, o1):
            for c0 in range(0, Ci, FILTER_BLOCK):
                n = min(FILTER_BLOCK, Ci - c0)
                _gather_planes(d, dU, o, c0, n)
                for j in range(4):                              # column j of G^T dU
                    for k in range(n):
                        r = _gt_cols0(d[j, k], d[4 + j, k], d[8 + j, k], d[12 + j, k])
                        t[j, k], t[4 + j, k], t[8 + j, k] = r
                for p in range(3):                              # row p of G^T dU, times G
                    for k in range(n):
                        v = _gt_cols(t[4 * p, k], t[4 * p + 1, k], t[4 * p + 2, k], t[4 * p + 3, k])
                        g[3 * p, k], g[3 * p + 1, k], g[3 * p + 2, k] = v
                for k in range(n):
                    for m in range(9):
                        dw[o, c0 + k, m // 3, m % 3] += g[m, k]

    @njit(inline="always")
    def _plane_into(P, at, a, c, n):
        """P[at + h, at + k] <- a[c, n, h, k]: one plane into a tile kernel's zero-bordered scratch."""
        H, W = a.shape[2], a.shape[3]
        for h in range(H):
            for k in range(W):
                P[at + h, at + k] = a[c, n, h, k]

    @njit(inline="always")
    def _bt_row(i, d0, d1, d2, d3):
        """Row i of B^T applied to a patch column (d0, d1, d2, d3): d0 - d2, d1 + d2, d2 - d1, d1 - d3."""
        if i == 0:
            return d0 - d2
        if i == 1:
            return d1 + d2
        if i == 2:
            return d2 - d1
        return d1 - d3

    @njit(**_opts)
    def _input_tiles(V, x, n0):
        """V (16, C, T) <- B^T d B of every 4x4 input patch of samples n0.. of x (C, N, H, W),
        zero outside the image (pad 1; a zero column/row more when H or W is odd).
        Bit for bit input_tiles_reference.

        Per (channel, sample): the plane is copied into P, a zero-bordered scratch of the
        reference's padded size (its border never written), then each tile's 16 values come
        from its 4x4 patch in straight-line code: B^T d per patch column (rows 0-2, 1+2, 2-1,
        1-3), then (.) B along each row, the reference's operations in its order. Every tile
        recomputes the two columns it shares with its neighbour, yet this beats a first pass of
        B^T d over whole tile rows: on small planes (DenseNet's and the ResNets' 2x2 to 8x8)
        that pass's loops run a few iterations each and cost more than the arithmetic
        (benchmarks/conv_parts.py --stage; figures in docs/performance.md).
        A tile writes all 16 planes at once, which needs them in different L1 sets (_planes lays
        them an odd number of cache lines apart); planes a multiple of 2 KiB apart would put 8 or
        16 of them in one set (8 ways) to evict each other, so there the tiles are walked once per
        row of B^T d, 4 planes at a time."""
        C, N, H, W = x.shape
        th, tw = (H + 1) // 2, (W + 1) // 2
        tt = th * tw
        ns = V.shape[2] // tt
        spread = V.strides[0] % SET_BYTES != 0                     # at most 4 planes to an L1 set
        P = numpy.zeros((2 * th + 2, 2 * tw + 2), numpy.float32)   # row/column k + 1: the image's k
        for c in range(C):
            for s in range(ns):
                _plane_into(P, 1, x, c, n0 + s)
                t0 = s * tt
                if not spread:
                    for i in range(4):
                        p = 4 * i
                        for a in range(th):
                            r = 2 * a
                            for b in range(tw):
                                q = 2 * b
                                t = t0 + a * tw + b
                                e0 = _bt_row(i, P[r, q], P[r + 1, q], P[r + 2, q], P[r + 3, q])
                                e1 = _bt_row(i, P[r, q + 1], P[r + 1, q + 1], P[r + 2, q + 1], P[r + 3, q + 1])
                                e2 = _bt_row(i, P[r, q + 2], P[r + 1, q + 2], P[r + 2, q + 2], P[r + 3, q + 2])
                                e3 = _bt_row(i, P[r, q + 3], P[r + 1, q + 3], P[r + 2, q + 3], P[r + 3, q + 3])
                                V[p, c, t], V[p + 1, c, t], V[p + 2, c, t], V[p + 3, c, t] = (e0 - e2, e1 + e2,
                                                                                              e2 - e1, e1 - e3)
                    continue
                for a in range(th):
                    r = 2 * a
                    for b in range(tw):
                        q = 2 * b
                        t = t0 + a * tw + b
                        # B^T d, column j of the patch: e0j = d0 - d2, e1j = d1 + d2, e2j = d2 - d1, e3j = d1 - d3
                        e00, e01 = P[r, q] - P[r + 2, q], P[r, q + 1] - P[r + 2, q + 1]
                        e02, e03 = P[r, q + 2] - P[r + 2, q + 2], P[r, q + 3] - P[r + 2, q + 3]
                        e10, e11 = P[r + 1, q] + P[r + 2, q], P[r + 1, q + 1] + P[r + 2, q + 1]
                        e12, e13 = P[r + 1, q + 2] + P[r + 2, q + 2], P[r + 1, q + 3] + P[r + 2, q + 3]
                        e20, e21 = P[r + 2, q] - P[r + 1, q], P[r + 2, q + 1] - P[r + 1, q + 1]
                        e22, e23 = P[r + 2, q + 2] - P[r + 1, q + 2], P[r + 2, q + 3] - P[r + 1, q + 3]
                        e30, e31 = P[r + 1, q] - P[r + 3, q], P[r + 1, q + 1] - P[r + 3, q + 1]
                        e32, e33 = P[r + 1, q + 2] - P[r + 3, q + 2], P[r + 1, q + 3] - P[r + 3, q + 3]
                        # (.) B along row i: planes 4i .. 4i + 3
                        V[0, c, t], V[1, c, t], V[2, c, t], V[3, c, t] = e00 - e02, e01 + e02, e02 - e01, e01 - e03
                        V[4, c, t], V[5, c, t], V[6, c, t], V[7, c, t] = e10 - e12, e11 + e12, e12 - e11, e11 - e13
                        V[8, c, t], V[9, c, t], V[10, c, t], V[11, c, t] = e20 - e22, e21 + e22, e22 - e21, e21 - e23
                        V[12, c, t], V[13, c, t], V[14, c, t], V[15, c, t] = e30 - e32, e31 + e32, e32 - e31, e31 - e33

    @njit(**_opts)
    def _output_tiles(out, M, n0, accumulate):
        """out[:, n0:n0+n] (=, or += with accumulate) A^T m A of every tile's 16 values in M (16, Co, T)."""
        Co, N, H, W = out.shape
        th, tw = (H + 1) // 2, (W + 1) // 2
        ns = M.shape[2] // (th * tw)
        for c in range(Co):
            for s in range(ns):
                o = out[c, n0 + s]
                for a in range(th):
                    t0 = s * th * tw + a * tw
                    r = 2 * a
                    for b in range(tw):
                        t = t0 + b
                        # A^T m: rows 0+1+2 and 1-2-3, per column j
                        u0 = M[0, c, t] + M[4, c, t] + M[8, c, t]
                        u1 = M[1, c, t] + M[5, c, t] + M[9, c, t]
                        u2 = M[2, c, t] + M[6, c, t] + M[10, c, t]
                        u3 = M[3, c, t] + M[7, c, t] + M[11, c, t]
                        v0 = M[4, c, t] - M[8, c, t] - M[12, c, t]
                        v1 = M[5, c, t] - M[9, c, t] - M[13, c, t]
                        v2 = M[6, c, t] - M[10, c, t] - M[14, c, t]
                        v3 = M[7, c, t] - M[11, c, t] - M[15, c, t]
                        y00, y01 = u0 + u1 + u2, u1 - u2 - u3
                        y10, y11 = v0 + v1 + v2, v1 - v2 - v3
                        q = 2 * b
                        if not accumulate:
                            o[r, q] = y00
                            if q + 1 < W:
                                o[r, q + 1] = y01
                            if r + 1 < H:
                                o[r + 1, q] = y10
                                if q + 1 < W:
                                    o[r + 1, q + 1] = y11
                        else:
                            o[r, q] += y00
                            if q + 1 < W:
                                o[r, q + 1] += y01
                            if r + 1 < H:
                                o[r + 1, q] += y10
                                if q + 1 < W:
                                    o[r + 1, q + 1] += y11

    @njit(inline="always")
    def _a_row(i, g0, g1):
        """Row i of A applied to a tile column (g0, g1): g0, g0 + g1, g0 - g1, -g1."""
        if i == 0:
            return g0
        if i == 1:
            return g0 + g1
        if i == 2:
            return g0 - g1
        return -g1

    @njit(**_opts)
    def _gradient_tiles(Mg, dout, n0):
        """Mg (16, Co, T) <- A dy A^T of every 2x2 tile of dout (Co, N, H, W), samples n0..
        (zero beyond the image when H or W is odd). A = [[1,0],[1,1],[1,-1],[0,-1]].
        Bit for bit gradient_tiles_reference (signed zeros included). Organised as _input_tiles:
        the plane copied into P (its odd row and column zero), then per tile A dy per column
        and (.) A^T along each row in straight-line code (4 planes at a time where Mg's planes
        are a multiple of 2 KiB apart)."""
        Co, N, H, W = dout.shape
        th, tw = (H + 1) // 2, (W + 1) // 2
        tt = th * tw
        ns = Mg.shape[2] // tt
        spread = Mg.strides[0] % SET_BYTES != 0
        P = numpy.zeros((2 * th, 2 * tw), numpy.float32)           # the reference's padded plane
        for c in range(Co):
            for s in range(ns):
                _plane_into(P, 0, dout, c, n0 + s)
                t0 = s * tt
                if not spread:
                    for i in range(4):
                        p = 4 * i
                        for a in range(th):
                            r = 2 * a
                            for b in range(tw):
                                q = 2 * b
                                t = t0 + a * tw + b
                                e0 = _a_row(i, P[r, q], P[r + 1, q])
                                e1 = _a_row(i, P[r, q + 1], P[r + 1, q + 1])
                                Mg[p, c, t], Mg[p + 1, c, t], Mg[p + 2, c, t], Mg[p + 3, c, t] = (e0, e0 + e1,
                                                                                                  e0 - e1, -e1)
                    continue
                for a in range(th):
                    r = 2 * a
                    for b in range(tw):
                        q = 2 * b
                        t = t0 + a * tw + b
                        g00, g01, g10, g11 = P[r, q], P[r, q + 1], P[r + 1, q], P[r + 1, q + 1]
                        e10, e11 = g00 + g10, g01 + g11                      # A dy: rows g0, g0+g1,
                        e20, e21 = g00 - g10, g01 - g11                      # g0-g1, -g1
                        e30, e31 = -g10, -g11
                        Mg[0, c, t], Mg[1, c, t], Mg[2, c, t], Mg[3, c, t] = g00, g00 + g01, g00 - g01, -g01
                        Mg[4, c, t], Mg[5, c, t], Mg[6, c, t], Mg[7, c, t] = e10, e10 + e11, e10 - e11, -e11
                        Mg[8, c, t], Mg[9, c, t], Mg[10, c, t], Mg[11, c, t] = e20, e20 + e21, e20 - e21, -e21
                        Mg[12, c, t], Mg[13, c, t], Mg[14, c, t], Mg[15, c, t] = e30, e30 + e31, e30 - e31, -e31

    F2 = Scheme("F(2x2, 3x3)", 16, _filter_tiles, _filter_gradient_add, _input_tiles, _gradient_tiles,
                _output_tiles, tiles, per_sample)
    F4 = Scheme("F(4x4, 3x3)", winograd4.PLANES, winograd4._filter_tiles,
                winograd4._filter_gradient_add, winograd4._input_tiles, winograd4._gradient_tiles,
                winograd4._output_tiles, winograd4.tiles, winograd4.per_sample)
