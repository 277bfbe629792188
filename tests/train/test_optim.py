"""SGD's hyperparameter checks (the update itself is tested in test_engine.py against a reference)."""
import math

import numpy as np
import pytest

from lowmem.train.optim import SGD


@pytest.fixture
def params(make_param):
    return [make_param("fc.weight", np.ones(3), True)]


@pytest.mark.parametrize("kw, words", [
    ({"lr": math.nan}, "SGD lr must be a finite number >= 0, got nan"),
    ({"lr": math.inf}, "SGD lr must be a finite number >= 0, got inf"),
    ({"lr": -0.1}, "SGD lr must be a finite number >= 0"),
    ({"momentum": math.nan}, r"SGD momentum must be a finite number in \[0, 1\), got nan"),
    ({"momentum": 1.0}, r"SGD momentum must be a finite number in \[0, 1\), got 1.0"),
    ({"momentum": 1.5}, r"in \[0, 1\)"),
    ({"momentum": -0.5}, r"in \[0, 1\)"),
    ({"weight_decay": math.nan}, "SGD weight_decay must be a finite number >= 0, got nan"),
    ({"weight_decay": -math.inf}, "SGD weight_decay must be a finite number >= 0"),
])
def test_bad_hyperparameters_are_refused(params, kw, words):
    with pytest.raises(ValueError, match=words):
        SGD(params, **kw)


@pytest.mark.parametrize("lr", ["0.1", None, True, [0.1]])
def test_non_numbers_are_type_errors(params, lr):
    with pytest.raises(TypeError, match="SGD lr must be a real number"):
        SGD(params, lr=lr)


def test_lr_is_checked_when_set_later(params):
    opt = SGD(params, lr=0.1, momentum=np.float32(0.9), weight_decay=0)
    opt.lr = np.float64(0.05)
    assert opt.lr == 0.05 and opt.momentum == pytest.approx(0.9)
    with pytest.raises(ValueError, match="SGD lr must be a finite number >= 0, got nan"):
        opt.lr = float("nan")
    assert opt.lr == 0.05                                   # a refused value changes nothing
    opt.lr = 0                                              # a zero step is legal
    assert opt.state_dict()["lr"] == 0.0


@pytest.mark.parametrize("state, words", [
    (None, "SGD state must be a dict with 'lr' and 'started'"),
    ({"lr": 0.1}, "SGD state must be a dict with 'lr' and 'started'"),
    ({"lr": float("inf"), "started": True}, "SGD lr must be a finite number"),
    ({"lr": "fast", "started": True}, "SGD lr must be a real number"),
    ({"lr": 0.1, "started": "yes"}, "'started' must be true or false"),
])
def test_load_state_dict_refuses_malformed_state(params, state, words):
    opt = SGD(params, lr=0.1)
    with pytest.raises(ValueError, match=words):
        opt.load_state_dict(state)
    assert opt.lr == 0.1 and not opt._started


def test_state_round_trip(params):
    a = SGD(params, lr=0.3)
    a.lr, a._started = 0.02, True
    b = SGD(params, lr=0.1)
    b.load_state_dict(a.state_dict())
    assert b.lr == 0.02 and b._started


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("momentum, nesterov", [(0.0, False), (0.9, False), (0.9, True)])
@pytest.mark.parametrize("weight_decay", [0.0, 5e-4])
def test_the_numba_update_is_the_array_ops(monkeypatch, dtype, momentum, nesterov, weight_decay):
    """optim_cpu's one-pass update: weights, momenta and gradients bit for bit SGD._step_arrays',
    over three steps (the first sets v = g), a decaying and an exempt tensor, one large enough to
    split over two threads (GRAIN lowered), lr changed between steps."""
    from lowmem.core.network import Parameter
    from lowmem.system import threads
    from lowmem.train import optim_cpu
    if not optim_cpu.AVAILABLE:
        pytest.skip("numba not installed")
    monkeypatch.setattr(optim_cpu, "GRAIN", 64)
    rng = np.random.default_rng(0)
    shapes = [((7, 5, 3, 3), True), ((7,), False), ((301,), True)]
    runs = {}
    before = threads.threads()
    try:
        threads.configure(2)
        for fused in (False, True):
            r = np.random.default_rng(1)
            ps = [Parameter(f"p{i}", r.standard_normal(s).astype(dtype), np.zeros(s, dtype), decay=d)
                  for i, (s, d) in enumerate(shapes)]
            opt = SGD(ps, lr=0.1, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
            monkeypatch.setattr(optim_cpu, "supports", lambda params, f=fused: f)
            for step in range(3):
                for p in ps:
                    p.grad[...] = rng.standard_normal(p.grad.shape).astype(dtype) * 10.0 ** -step
                opt.lr = 0.1 / (step + 1)
                opt.step()
            runs[fused] = [(p.data.copy(), p.grad.copy(), p.state["momentum"].copy()) for p in ps]
            rng = np.random.default_rng(0)
    finally:
        threads.configure(before)
    for want, got in zip(runs[False], runs[True]):
        for a, b in zip(want, got):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_which_parameters_the_numba_update_takes(make_param):
    from lowmem.train import optim_cpu
    if not optim_cpu.AVAILABLE:
        pytest.skip("numba not installed")
    p = make_param("w", np.ones((4, 3)), True)
    SGD([p])
    assert optim_cpu.supports([p])
    p.grad = np.ones((3, 4)).T                                # not C-contiguous
    assert not optim_cpu.supports([p])
    q = make_param("v", np.ones(3), True)
    q.data, q.grad = q.data.astype(np.float16), q.grad.astype(np.float16)
    SGD([q])
    assert not optim_cpu.supports([q])
