"""Whole-model comparison with an independent PyTorch implementation.

The same pre-activation ResNet (tests/torch_reference.py, plain nn modules and
autograd) is loaded with lowmem's weights and run on the same batch in
training mode. Compared, per tensor, as relative error ||a - b|| / ||b||:
loss and logits, every parameter gradient, d loss / d input, BN running
statistics after a training forward, momentum buffers and parameters after
two SGD steps (weight decay on conv/linear weights only), and eval-mode
logits. mode="approx" must give the same forward (its forward is exact).

Tolerances: float32 1e-4 (1e-5 for running statistics), where the measured
errors are ~1e-7..3e-5 (summation order differs); float64 1e-9, measured
~1e-14, so any real difference in the maths shows. Before each step the BN
betas of both are shifted identically (|shift| <= 0.02) so that no pre-ReLU
value lies within ~1e-4 of ReLU's kink: otherwise one element rounding to
the other side in one implementation moves whole gradients by ~1e-3 (see
torch_reference.dodge_relu_kinks). Float32 runs use the engine's default
kernels (numba's lowmem/units/window_cpu.py when installed) and, once, the NumPy ops.

Skipped when torch is not installed (pip install -e .[compare]).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from lowmem import models  # noqa: E402
from lowmem.core.engine import Engine                             # noqa: E402
from lowmem.train.optim import SGD                                 # noqa: E402
from reference import rel                                    # noqa: E402
from torch_reference import dodge_relu_kinks, load_lowmem_state, sgd_param_groups   # noqa: E402
import torch_reference as ref                                # noqa: E402

torch.set_num_threads(2)

N, K = 8, 10
LR, MOMENTUM, WD = 0.1, 0.9, 5e-4
# float32: reduction order differs between NumPy and torch; float64 shows real bugs at 1e-9
TOL = {"float32": 1e-4, "float64": 1e-9}
STATS_TOL = {"float32": 1e-5, "float64": 1e-12}

# name -> (lowmem net, torch model, input shape)
CASES = {
    "resnet20": (lambda: models.preact_resnet_cifar(20, num_classes=K),
                 lambda: ref.preact_resnet_cifar(20, num_classes=K), (3, 32, 32)),
    "bottleneck29": (lambda: models.preact_resnet_cifar(29, num_classes=K, block="bottleneck"),
                     lambda: ref.preact_resnet_cifar(29, num_classes=K, block="bottleneck"), (3, 32, 32)),
    "imagenet18": (lambda: models.preact_resnet_imagenet(18, num_classes=K),
                   lambda: ref.preact_resnet_imagenet(18, num_classes=K), (3, 64, 64)),
}
# (case, dtype, use_fast): None = the engine's default (lowmem/units/window_cpu.py's numba kernels for
# float32 when numba is installed); False = the pure-NumPy ops (always used for float64)
RUNS = [("resnet20", "float32", None), ("bottleneck29", "float32", None), ("imagenet18", "float32", None),
        ("resnet20", "float32", False), ("resnet20", "float64", None)]
RUN_IDS = [f"{c}-{d}" + ("-numpy" if f is False else "") for c, d, f in RUNS]


def worst(errors):
    """'name: error' of the largest errors, for assertion messages."""
    top = sorted(errors.items(), key=lambda kv: -kv[1])[:5]
    return ", ".join(f"{k}: {v:.2e}" for k, v in top)


def batch(seed, shape, dtype):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((N,) + shape).astype(dtype), rng.integers(0, K, N)


def torch_step(model, x, labels):
    xt = torch.from_numpy(x).requires_grad_(True)
    logits = model(xt)
    loss = F.cross_entropy(logits, torch.from_numpy(labels))
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss.item(), logits.detach().numpy(), xt.grad.numpy()


def tensors(model):
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module", params=RUNS, ids=RUN_IDS)
def run(request):
    return train_both(*request.param)


def train_both(case, dtype, use_fast=None):
    """Both implementations through two training steps, then predict.

    Each step: move BN betas so no pre-ReLU value is near 0 (same shift in
    both), forward, backward, SGD step; everything compared is recorded."""
    make_net, make_model, shape = CASES[case]
    net = make_net()
    eng = Engine(net, N, shape, mode="exact", dtype=dtype, use_fast=use_fast)
    model = load_lowmem_state(make_model(), net.state_dict())
    model.to(getattr(torch, dtype)).train()
    opt = SGD(net.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    topt = torch.optim.SGD(sgd_param_groups(model, WD), lr=LR, momentum=MOMENTUM)
    r = {"case": case, "dtype": dtype, "shape": shape, "steps": []}
    for i in range(2):
        x, labels = batch(i + 1, shape, dtype)
        deltas, margin = dodge_relu_kinks(model, x)
        assert margin > 1e-5, f"could not move pre-ReLU values away from 0 (margin {margin:.1e})"
        with torch.no_grad():
            for name, d in deltas.items():
                net.params[name].data += d.astype(dtype)
                model.get_parameter(name).add_(torch.from_numpy(d.astype(dtype)))
        loss, logits = eng.forward(x, labels)
        stats = {k: v for k, v in net.state_dict().items() if k.endswith(("running_mean", "running_var"))}
        dx = eng.backward(input_grad=True)
        grads = {p.name: np.array(p.grad) for p in net.parameters()}
        opt.step()
        tloss, tlogits, tdx = torch_step(model, x, labels)
        tstats = {k: v for k, v in tensors(model).items() if k.endswith(("running_mean", "running_var"))}
        tgrads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
        topt.step()
        r["steps"].append(dict(x=x, labels=labels, loss=(loss, tloss), logits=(logits, tlogits),
                               dx=(dx, tdx), stats=(stats, tstats), grads=(grads, tgrads),
                               after=(net.state_dict(), tensors(model)),
                               momentum=({q.name: np.array(q.state["momentum"]) for q in net.parameters()},
                                         {n: topt.state[q]["momentum_buffer"].numpy().copy()
                                          for n, q in model.named_parameters()})))
    model.eval()
    with torch.no_grad():
        r["predict"] = (eng.predict(r["steps"][0]["x"]), model(torch.from_numpy(r["steps"][0]["x"])).numpy())
    return r


def test_names_match(run):
    s = run["steps"][0]
    assert set(s["grads"][0]) == set(s["grads"][1])
    assert set(s["stats"][0]) == set(s["stats"][1])


def test_forward_loss_and_logits(run):
    tol = TOL[run["dtype"]]
    for i, s in enumerate(run["steps"]):
        assert rel(*s["loss"]) <= tol, f"step {i}: loss {s['loss']}"
        assert rel(*s["logits"]) <= tol, f"step {i}: logits rel err {rel(*s['logits']):.2e}"


def test_every_parameter_gradient(run):
    tol = TOL[run["dtype"]]
    for i, s in enumerate(run["steps"]):
        g, tg = s["grads"]
        errors = {n: rel(g[n], tg[n]) for n in tg}
        assert max(errors.values()) <= tol, f"step {i}: worst gradients {worst(errors)}"


def test_input_gradient(run):
    for s in run["steps"]:
        assert rel(*s["dx"]) <= TOL[run["dtype"]]


def test_bn_running_statistics(run):
    tol = STATS_TOL[run["dtype"]]
    for i, s in enumerate(run["steps"]):
        st, tst = s["stats"]
        errors = {n: rel(st[n], tst[n]) for n in tst}
        assert errors and max(errors.values()) <= tol, f"step {i}: worst statistics {worst(errors)}"


def test_sgd_steps(run):
    """Momentum buffers (v = g + wd*w, then momentum*v + that) and parameters after each step.

    Buffers rather than parameter differences: w_new - w_old cancels in float32."""
    tol = TOL[run["dtype"]]
    for i, s in enumerate(run["steps"]):
        (v, tv), (p, tp) = s["momentum"], s["after"]
        errors = {n: rel(v[n], tv[n]) for n in tv}
        assert max(errors.values()) <= tol, f"step {i}: worst momentum buffers {worst(errors)}"
        errors = {n: rel(p[n], tp[n]) for n in tv}
        assert max(errors.values()) <= tol, f"step {i}: worst parameters {worst(errors)}"


def test_predict_eval_mode(run):
    assert rel(*run["predict"]) <= TOL[run["dtype"]]


@pytest.mark.parametrize("case", ["resnet20", "bottleneck29"])
def test_approx_forward_is_exact(case):
    """mode="approx", 8 bits: loss and logits equal torch's (and lowmem exact mode's, bit for bit)."""
    make_net, make_model, shape = CASES[case]
    x, labels = batch(1, shape, "float32")
    model = load_lowmem_state(make_model(), make_net().state_dict()).train()
    tloss, tlogits, _ = torch_step(model, x, labels)
    exact = Engine(make_net(), N, shape, mode="exact", dtype="float32").forward(x, labels)
    loss, logits = Engine(make_net(), N, shape, mode="approx", bits=8, dtype="float32").forward(x, labels)
    assert rel(loss, tloss) <= TOL["float32"] and rel(logits, tlogits) <= TOL["float32"]
    assert loss == exact[0] and np.array_equal(logits, exact[1])
