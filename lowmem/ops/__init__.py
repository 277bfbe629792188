"""Pure op functions: `<op>_forward` / `<op>_backward`, outputs first.

Layout: activations are channels-major, (C, N, H, W), C-contiguous unless a
docstring says otherwise. One conv is then one GEMM over all N*H*W columns,
and batch-norm's per-channel reductions run over contiguous rows (see
docs/engine.md for the measurement that chose this layout).

Gradient semantics, written once for every op here:
  * activation gradients (dx) OVERWRITE their output buffer, unless the op
    takes `accumulate=True` (residual adds, a tensor with two consumers);
  * parameter gradients (dw, dgamma, dbeta, db) ACCUMULATE (+=).
"""
from .conv import conv2d_forward, conv2d_backward, conv2d_backward_input, conv2d_backward_weight, conv_out_size
from .batchnorm import (bn_stats, bn_normalize, bn_relu_apply_forward,
                        bn_relu_backward, bn_relu_backward_sums, bn_relu_backward_apply,
                        update_running_stats, bn_eval_relu_forward)
from .pool import (maxpool_forward, maxpool_backward, avgpool_forward, avgpool_backward,
                   avgpool2d_forward, avgpool2d_backward)
from .linear import linear_forward, linear_backward
from .add import add_forward
from .loss import softmax_xent_forward, softmax_xent_backward
from .conv_groups import (grouped_conv2d_forward, grouped_conv2d_backward_input, grouped_conv2d_backward_weight,
                          conv_bias_forward, conv_bias_backward)
from .batchnorm import bn_apply_forward, bn_eval_forward, bn_backward
from .relu import relu_forward, relu_backward, clip_forward, clip_backward, relu6_forward, relu6_backward
from .concat import concat_forward, concat_backward, concat_slices
from .dropout import dropout_forward, dropout_backward, dropout_mask
from .linear import flatten_linear_forward, flatten_linear_backward
