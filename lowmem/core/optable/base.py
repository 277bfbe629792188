"""The op table's base entry (`Op`: the defaults every op inherits) and the helpers the
entries share: window shapes, channel checks, the constants of the saved forms and the ONNX
Constant node their inference forms write."""
from ..network import NetworkError
from ...ops import conv_out_size

BN_MOMENTUM = 0.1
MAX_POOL_WINDOW = 16                  # the max-pool argmax is saved as a 4-bit index


class BatchStatisticsError(FloatingPointError):
    """A batch whose statistics are not finite (an input too large for the dtype)."""


class Op:
    """Defaults: a layer with one input that keeps nothing and writes another buffer.

    The flags, read by the walk (schedule.py) and the builder (nn.Graph):
      unit      a BN->ReLU unit: its own kernel set and bit width; a conv reading its output
                rebuilds its input from the unit's saved code (keeps nothing of its own)
      in_place  may write a buffer it reads: the builder gives its output an input's buffer
                when that input dies there
      several   takes several inputs (Layer.inputs): add, concat
      norm      a batch norm: batch statistics over N*H*W (the engine's bn.batch_* scratch)
      keyed     draws from the engine's counter stream (dropout: run.keys[layer])"""
    unit = in_place = several = norm = keyed = False
    builder = ""            # its nn.Graph method, where the name differs from the op

    @staticmethod
    def check(L, shape, walk):
        pass

    @staticmethod
    def plan(step, N, units, dtype, budget):
        """[(name, kind, shape, dtype)]: what the layer keeps ("saved") and its scratch
        ("workspace"); step is its forward Step (layer, shapes, the walk's annotations)."""
        return []

    @staticmethod
    def temporary(L, out_shape, itemsize):
        """(what, bytes): a bound on the NumPy temporaries one call allocates beyond the plan
        (the engine states the largest per `what` in the plan), or None."""
        return None

    @staticmethod
    def slots(step, saved):
        return saved.get(step.name, ())

    @staticmethod
    def forward(run, step):
        raise NotImplementedError(f"{step.op} has no forward step")

    @staticmethod
    def backward(run, step):
        raise NotImplementedError(f"{step.op} has no backward step")

    @staticmethod
    def route(L, walk):
        """An op whose backward writes (never adds) its input gradient: into a free buffer,
        then summed into the input's gradient when the input has one already (walk.write)."""
        dout = walk.output_grad(L)
        walk.write(L, walk.tin[L.name][0], dout, dout=dout)


def window_shape(L, shape):
    c, h, w = shape
    return c, conv_out_size(h, L.k, L.stride, L.pad), conv_out_size(w, L.k, L.stride, L.pad)


def channels(L, shape):
    if shape[0] != L.cin:
        raise NetworkError(f"layer {L.name!r}: expects {L.cin} input channels, {L.src} holds {shape[0]}")


def same_shape(L, shape, *others):
    return shape


def onnx_constant(helper, name, dims, values, int64=False):
    """An ONNX Constant node whose output `name` is the float32 (or int64) tensor of shape
    `dims` holding `values` (an op's inference form: Clip's bounds, Dropout's ratio, a shape)."""
    from onnx import TensorProto
    dtype = TensorProto.INT64 if int64 else TensorProto.FLOAT
    return helper.make_node("Constant", [], [name], name=name,
                            value=helper.make_tensor(name, dtype, list(dims), list(values)))
