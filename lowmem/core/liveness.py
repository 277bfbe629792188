"""Buffers from liveness: interval colouring of a network's forward tensors over the forward
order, the way a register allocator colours its values.

A tensor is alive from the layer that makes it to its last reader (the head reads the last
one). A tensor takes a buffer whose tensor is dead; an op that may run in place (optable
`in_place`: the units, batch norm, ReLUs, dropout, the add) takes the buffer of an input that
dies there. `colourings` returns two candidates that differ in the preference between free
buffers: first the paper's layout (the residual stream, an add's first operand and its
result, in "res"; other tensors ping-pong between "act0" and "act1" and use "res" only when
no stream tensor needs it during their life), which reproduces the hand-written
pre-activation ResNets of lowmem/models.py; then plain first-fit over act0, act1, res (a
post-activation block, whose stream tensor is not the block input, fits three buffers that
way). A graph with more tensors alive at once gets "act2", "act3", ... The caller
(lowmem.nn.Graph.head) keeps the candidate whose planned buffers hold least: the engine sizes
each buffer to the largest tensor, gradient or scratch it holds (schedule.walk). What an op
needs comes from its optable flags, never its name.
"""
from .network import BUFFERS
from .optable import OPS


def colourings(nodes, n_tensors, head_input):
    """[{tensor index: buffer name}, ...] for nodes [(op, input tensor indices, output index)]
    in forward order over tensors 0..n_tensors-1 (0: the network input, in "input"), the head
    reading tensor head_input."""
    last = dict.fromkeys(range(n_tensors), -1)
    for i, (_, inputs, _) in enumerate(nodes):
        for t in inputs:
            last[t] = i
    last[head_input] = len(nodes)
    stream = set()                                       # residual-stream tensors: "res" first
    for op, inputs, out in nodes:
        if OPS[op].several and OPS[op].in_place:         # the add: skip + branch
            stream.update((inputs[0], out))
    return [_colour(nodes, last, stream), _colour(nodes, last, set())]


def _colour(nodes, last, stream):
    """One greedy colouring; stream: the tensors that prefer "res" (none: plain first-fit over
    act0, act1, res, act2, ...)."""
    buf, holder, order = {0: "input"}, {}, list(BUFFERS)

    def free(b, i):
        t = holder.get(b)
        return t is None or last[t] < i

    for i, (op, inputs, t) in enumerate(nodes):
        dst = None
        if OPS[op].in_place:                             # on an input that dies here
            for j in inputs:
                b = buf[j]
                if (b != "input" and last[j] == i and (b != "res" or t in stream or not stream)
                        and all(last[k] == i for k in inputs if buf[k] == b)):
                    dst = b
                    break
        if dst is None and t in stream and free("res", i):
            dst = "res"
        if dst is None:
            cands = [b for b in ("act0", "act1") if free(b, i)]
            if free("res", i) and not any(out in stream for _, _, out in nodes[i + 1:last[t] + 1]):
                cands.append("res")
            cands += [b for b in order[len(BUFFERS):] if free(b, i)]
            if not cands:
                order.append(f"act{len(order) - 1}")
                cands = order[-1:]
            dst = cands[0]
        buf[t], holder[dst] = dst, t
    return buf
