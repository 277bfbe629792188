"""The reference unit kernels: NumPy (or CuPy) array ops from lowmem/ops and the codes (units/window.py, units/unbiased.py).

Readable and backend-neutral (every call takes its array module from its
arguments); the fused sets of lowmem/units/fused.py are tested against
these. Two sets, both with the interface of lowmem/units/__init__.py:

  ExactUnits          the saved slot is x-hat itself, float (C, M_planned)
  CodeUnits(bits)     the saved slot is x-hat's packed K-bit window code (approx);
                      naive=True: the forward continues from the decoded value;
                      rounding="stochastic-window": forward(..., key=) rounds with key's stream
  UnbiasedCodeUnits   the saved slot is the unbiased group-range code (rounding="stochastic",
                      units/unbiased.py): codes, then the group ends and the split

Scratch: only the row-block and quantizer-chunk temporaries their ops
document (bounded, never activation-sized). The code backward decodes x-tilde
into the free buffer the schedule names (`scratch`) and applies the exact
mask to the output gradient chunk by chunk, so no mask array is needed.
"""
from . import packing, unbiased, window
from .widths import check_bits
from ..system.backend import array_module
from ..ops import bn_normalize, bn_relu_apply_forward, bn_relu_backward, bn_stats
from ..ops.batchnorm import BN_EPS


class ExactUnits:
    """x-hat saved in float: the gradients of standard backprop."""
    fused = False
    saved_suffix = "xhat"
    decodes = False         # its backward may decode into a scratch buffer (the schedule gives one)

    def saved_entry(self, C, M, dtype):
        """(shape, dtype) of one unit's saved slot for C channels of M planned elements."""
        return (C, M), dtype

    def saved_view(self, slot, C, M):
        """The slot's part for the current batch: (C, M) rows (strided when M < planned)."""
        return slot[:, :M]

    def count(self, M):
        """Elements per channel the batch statistics are over (units/sync.py: all ranks')."""
        return M

    def depends_on_split(self, M):
        """Whether the codes of a rank's rows of M elements depend on how the global batch is
        split over ranks: not for x-hat itself, nor for a code whose every element is coded
        alone (its draws follow the element's global index)."""
        return False

    def stats(self, mean, var, rstd, x):
        bn_stats(mean, var, rstd, x, BN_EPS)

    def forward(self, out, saved, x, mean, rstd, gamma, beta, key=None):
        """saved <- x-hat = (x - mean)*rstd; out = relu(gamma*x-hat + beta). out may alias x.
        key: stochastic rounding's stream key (CodeUnits); nothing is rounded here, ignored."""
        bn_normalize(saved, x, mean, rstd)
        bn_relu_apply_forward(out, saved, gamma, beta)

    def conv_input(self, u, saved, gamma, beta):
        """u = relu(gamma*x-hat + beta): the following conv's input, rebuilt."""
        bn_relu_apply_forward(u, saved, gamma, beta)

    def backward(self, dx, dgamma, dbeta, dr, saved, rstd, gamma, beta, accumulate, scratch):
        # saved: x-hat (C, M) exact float and rstd (C,) exact; the mask is recomputed exactly
        bn_relu_backward(dx, dgamma, dbeta, dr, saved, gamma, beta, rstd, accumulate=accumulate)


class CodeUnits(ExactUnits):
    """x-hat saved as a packed K-bit window code (window.py); x-tilde decoded where it is needed."""

    decodes = True

    def __init__(self, bits, naive=False, rounding="nearest"):
        self.bits, self.naive = check_bits(bits), bool(naive)
        self.rounding = window.check_window_rounding(rounding, "CodeUnits (the window code's set)")
        self.saved_suffix = "code"

    def metadata_nbytes(self, C, M):
        """Bytes of the saved slot beyond the packed codes: none for the window codes."""
        return 0

    def saved_entry(self, C, M, dtype):
        return (packing.packed_nbytes(C * M, self.bits),), "uint8"

    def saved_view(self, slot, C, M):
        return slot[:packing.packed_nbytes(C * M, self.bits)]

    def forward(self, out, saved, x, mean, rstd, gamma, beta, key=None):
        """saved <- code(x-hat); out = relu(gamma*x-hat + beta) (approx: exact, as ExactUnits)
        or relu(gamma*x-tilde + beta) under the exact mask (naive). x-hat passes through out.
        key: the unit's stream key for this step (stream.stream_key), required when
        self.rounding == "stochastic-window", ignored when "nearest"."""
        bn_normalize(out, x, mean, rstd)
        qp = window.quant_params(gamma, beta, self.bits)
        window.quantize_pack(saved, out, qp, self.rounding, key)
        if self.naive:
            window.decode_relu(out, saved, qp, gamma, beta)
        else:
            bn_relu_apply_forward(out, out, gamma, beta)

    def conv_input(self, u, saved, gamma, beta):
        window.decode_relu(u, saved, window.quant_params(gamma, beta, self.bits), gamma, beta)

    def backward(self, dx, dgamma, dbeta, dr, saved, rstd, gamma, beta, accumulate, scratch):
        # saved: the K-bit code of x-hat (approximate x-tilde, exact mask) and rstd (C,) exact
        self.decode_masking(scratch, dr, saved, gamma, beta)
        bn_relu_backward(dx, dgamma, dbeta, dr, scratch, gamma, beta, rstd, dr_already_masked=True,
                         accumulate=accumulate)

    def decode_masking(self, xtilde, dr, saved, gamma, beta):
        """xtilde <- x-tilde decoded from the slot; dr *= the exact mask (units/sync.py's backward)."""
        decode_masking(xtilde, dr, saved, window.quant_params(gamma, beta, self.bits))


def decode_masking(xtilde, dr, packed, qp):
    """xtilde (C, M) <- x-tilde decoded from the code; dr (C, M) *= the exact mask (code >= k),
    one quantizer chunk at a time, so no mask array is needed (CodeUnits, units/sync.py)."""
    xp = array_module(dr)

    def mask_gradient(ob, cb, r0, r1, c0, c1):
        block = dr[r0:r1, c0:c1]
        xp.multiply(block, cb >= qp.k[r0:r1, None], out=block)

    window.decode_each_chunk(xtilde, packed, qp, mask_gradient)


class UnbiasedCodeUnits(CodeUnits):
    """x-hat saved as the unbiased group-range code (units/unbiased.py; bits >= 2): the slot
    holds the packed codes, the bf16 group ends and the per-channel split. dither: the dithered
    code (rounding "dither": its decoder subtracts each element's draw; the slot also holds the
    stream it was drawn from)."""

    def __init__(self, bits, naive=False, dither=False):
        super().__init__(bits, naive, "nearest")
        self.bits = unbiased.check_bits(bits)
        self.dither = bool(dither)
        self.rounding = "dither" if self.dither else "stochastic"

    def saved_entry(self, C, M, dtype):
        return (unbiased.slot_nbytes(C, M, self.bits, self.dither),), "uint8"

    def saved_view(self, slot, C, M):
        return slot[:unbiased.slot_nbytes(C, M, self.bits, self.dither)]

    def metadata_nbytes(self, C, M):
        return unbiased.metadata_nbytes(C, M, self.bits, self.dither)

    def depends_on_split(self, M):
        """A rank's rows code what the whole batch codes there only when they are whole groups."""
        return M % unbiased.GROUP != 0

    def forward(self, out, saved, x, mean, rstd, gamma, beta, key=None):
        """saved <- the unbiased code of x-hat drawn from `key` (required: an integer or a
        stream.Stream); out as CodeUnits.forward."""
        bn_normalize(out, x, mean, rstd)
        unbiased.quantize_pack(saved, out, gamma, beta, self.bits, key, self.dither)
        if self.naive:
            unbiased.decode_each_chunk(out, saved, gamma, beta, self.bits, relu=True, dither=self.dither)
        else:
            bn_relu_apply_forward(out, out, gamma, beta)

    def conv_input(self, u, saved, gamma, beta):
        unbiased.decode_each_chunk(u, saved, gamma, beta, self.bits, relu=True, dither=self.dither)

    def backward(self, dx, dgamma, dbeta, dr, saved, rstd, gamma, beta, accumulate, scratch):
        # saved: the unbiased code (x-tilde with E = x-hat, exact mask) and rstd (C,) exact
        self.decode_masking(scratch, dr, saved, gamma, beta)
        bn_relu_backward(dx, dgamma, dbeta, dr, scratch, gamma, beta, rstd, dr_already_masked=True,
                         accumulate=accumulate)

    def decode_masking(self, xtilde, dr, saved, gamma, beta):
        """xtilde <- x-tilde decoded from the slot; dr *= the exact mask (units/sync.py's backward)."""
        decode_masking_unbiased(xtilde, dr, saved, gamma, beta, self.bits, self.dither)


def decode_masking_unbiased(xtilde, dr, slot, gamma, beta, bits, dither=False):
    """decode_masking for the unbiased code: xtilde <- x-tilde, dr *= the exact mask."""
    xp = array_module(dr)

    def mask_gradient(ob, open_, r0, r1, c0, c1):
        block = dr[r0:r1, c0:c1]
        xp.multiply(block, open_, out=block)

    unbiased.decode_each_chunk(xtilde, slot, gamma, beta, bits, extra=mask_gradient, dither=dither)
