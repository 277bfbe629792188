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
