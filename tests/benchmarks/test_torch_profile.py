"""benchmarks/torch_profile.py: PyTorch's profiled step shared out by op kind adds up to the
events' total; an op's time goes to the outermost kind above it; a convolution with groups is
depthwise/grouped wherever its shapes were recorded; each kind a network has shows up, the range
code never. Nothing is timed: only which kinds hold time and that nothing is lost."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import op_profile  # noqa: E402
import torch_profile as T  # noqa: E402


def event(name, us, parent=None, shapes=None):
    return SimpleNamespace(name=name, self_cpu_time_total=us, cpu_parent=parent, input_shapes=shapes or [])


def test_an_ops_time_goes_to_the_outermost_kind_above_it():
    step = event("Optimizer.step#SGD.step", 5)
    conv = event("aten::conv2d", 1, shapes=[[2, 8, 4, 4], [8, 8, 3, 3], [], [], [], [], []])
    dw_node = event("autograd::engine::evaluate_function: ConvolutionBackward0", 2)
    relu = event("aten::relu_", 1)
    events = [
        step, event("aten::add_", 7, step),                                  # the optimizer's add: SGD's
        conv, event("aten::mkldnn_convolution", 30, conv),
        dw_node, event("aten::convolution_backward", 40, dw_node,            # groups 8: depthwise
                       [[2, 8, 4, 4], [2, 8, 4, 4], [8, 1, 3, 3], [], [], []]),
        relu, event("aten::clamp_min_", 3, relu),
        event("aten::add", 4),                                               # a residual add
        event("autograd::engine::evaluate_function: CatBackward0", 6),
        event("aten::addmm", 8), event("aten::max_pool2d_with_indices", 9),
        event("aten::empty", 10), event("aten::zero_", 0)]
    kinds, functions = T.by_kind(events)
    assert set(kinds) == set(op_profile.COARSE)
    assert sum(kinds.values()) == pytest.approx(T.total_seconds(events)) == pytest.approx(126e-6)
    assert kinds["SGD update"] == pytest.approx(12e-6) and functions["SGD update"]["aten::add_"] == pytest.approx(7e-6)
    # the autograd node's own 2 us have no shapes at or above them: dense; its op below has them
    assert kinds["dense convolutions"] == pytest.approx(33e-6)
    assert kinds["depthwise/grouped conv"] == pytest.approx(40e-6)
    assert kinds["batch norm, ReLU (units, masks)"] == pytest.approx(4e-6)
    assert kinds["add, concat"] == pytest.approx(10e-6)
    assert kinds["linear, loss"] == pytest.approx(8e-6) and kinds["pools"] == pytest.approx(9e-6)
    assert kinds["other"] == pytest.approx(10e-6) and kinds["range code, kept inputs"] == 0


def test_a_networks_kinds_in_a_real_profile():
    torch = pytest.importorskip("torch")
    from torch import nn
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(8)
            self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
            self.bn2 = nn.BatchNorm2d(8)
            self.fc = nn.Linear(16, 5)

        def forward(self, x):
            a = torch.relu(self.bn(self.conv(x)))
            b = nn.functional.relu6(self.bn2(self.dw(a)))
            c = torch.cat([nn.functional.max_pool2d(a + b, 2), nn.functional.max_pool2d(b, 2)], 1)
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(c, 1), 1))

    net = Net().train()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([1, 3])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def step():
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    try:
        step()
        events = T.profile(step, 1)
    finally:
        torch.set_num_threads(threads)
    kinds, functions = T.by_kind(events)
    assert sum(kinds.values()) == pytest.approx(T.total_seconds(events), rel=1e-9)          # nothing lost
    for k in op_profile.COARSE:
        assert sum(functions[k].values()) == pytest.approx(kinds[k], rel=1e-9, abs=1e-12)
    seen = {k for k, v in kinds.items() if v > 0}
    must = {"dense convolutions", "depthwise/grouped conv", "batch norm, ReLU (units, masks)", "pools",
            "add, concat", "linear, loss", "SGD update"}
    assert must <= seen, must - seen
    assert kinds["range code, kept inputs"] == 0


def test_lowmems_kinds_fold_into_the_coarse_ones():
    kinds = {k: float(i + 1) for i, k in enumerate(op_profile.KINDS)}
    folded = op_profile.coarse(kinds)
    assert set(folded) == set(op_profile.COARSE) and sum(folded.values()) == pytest.approx(sum(kinds.values()))
    assert folded["dense convolutions"] == kinds["conv GEMMs"] + kinds["conv columns, transforms"]
    assert folded["batch norm, ReLU (units, masks)"] == (kinds["BN-ReLU unit"] + kinds["standalone BN"]
                                                        + kinds["ReLU/ReLU6/dropout, masks, packing"])
    table = op_profile.kind_table({"lowmem-approx4": folded, "torch-exact": dict.fromkeys(op_profile.COARSE, 1.0)}, 2,
                                  kinds=op_profile.COARSE)
    lines = table.splitlines()
    assert "lowmem-approx4" in lines[0] and "torch-exact" in lines[0]
    assert [ln[:36].strip() for ln in lines[2:]] == list(op_profile.COARSE) + ["profiled step"]
