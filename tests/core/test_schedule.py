"""lowmem/core/schedule.py: the steps carry every buffer, shape, slot and parameter their handlers use."""
import numpy as np

from lowmem.core.engine import Engine
from lowmem.models import preact_resnet_cifar, preact_resnet_imagenet
from lowmem.core.schedule import BUFFERS

HEAD_BUFFERS = {"fc.input", "logits", "dlogits", "dfeat", "loss.probs"}


def engines():
    yield Engine(preact_resnet_cifar(20), 4, (3, 8, 8), "approx", 4, allocate=False)
    yield Engine(preact_resnet_cifar(11), 4, (3, 8, 8), "exact", allocate=False)       # bottlenecks
    yield Engine(preact_resnet_imagenet(18, num_classes=5), 2, (3, 32, 32), "naive", 2, allocate=False)


def test_every_buffer_and_slot_a_step_names_is_in_the_plan():
    for eng in engines():
        names = {e.name for e in eng.plan.entries}
        for s in eng.schedule:
            for buf in (s.src, s.dst, s.dout, s.dx, s.scratch, s.unit_saved, *s.saved, *s.params):
                assert not buf or buf in names, (eng.net.name, str(s), buf)
            assert "feat" not in (s.src, s.dst), str(s)       # one name per buffer: "fc.input"


def test_backward_buffers_never_collide():
    """A step's output gradient, its destination and its scratch are distinct buffers (except
    a BN-ReLU in place, and a residual add that shares storage by design)."""
    for eng in engines():
        for s in eng.schedule:
            if s.phase != "bwd" or s.op in ("loss", "linear", "avgpool"):
                continue
            assert s.dout in BUFFERS and (s.dx in BUFFERS or s.dx == "")
            if s.scratch:
                assert s.scratch not in (s.dout,) and (s.op != "conv" or s.accumulate or s.dx == s.scratch)
            if s.op == "conv" and s.accumulate:
                assert len({s.dout, s.dx, s.scratch}) == 3, str(s)


def test_conv_backward_names_the_unit_that_rebuilds_its_input():
    eng = next(engines())
    convs = [s for s in eng.schedule if s.phase == "bwd" and s.op == "conv"]
    for s in convs:
        if s.src == "input":
            assert s.optional and not s.unit
        else:
            assert s.unit_saved == s.unit + ".code" and s.unit_params == (s.unit + ".weight", s.unit + ".bias")


def test_printing_shows_every_step_and_format_summarises():
    eng = Engine(preact_resnet_cifar(56), 2, (3, 8, 8), "approx", 4, allocate=False)
    assert len(eng.schedule) > 60
    assert len(str(eng.schedule).splitlines()) == len(eng.schedule) + 1
    short = eng.schedule.format(max_rows=10).splitlines()
    assert len(short) == 12 and f"... {len(eng.schedule) - 10} steps ..." in short[6]


def test_the_residual_add_shares_gradient_storage():
    eng = Engine(preact_resnet_cifar(8), 2, (3, 8, 8), "exact", allocate=False)
    adds = [s for s in eng.schedule if s.phase == "bwd" and s.op == "add"]
    assert adds and all(s.dx == s.dout and "(shared)" in s.writes() for s in adds)
    # the skip path's second contribution accumulates: the first block's bn1 adds into res
    accum = [s for s in eng.schedule if s.phase == "bwd" and s.accumulate]
    assert accum and np.all([s.op in ("conv", "bnrelu") for s in accum])
