"""lowmem.train.trainstate: what a checkpoint holds, restored exactly; what it refuses."""
import numpy as np
import pytest

from lowmem.train import trainstate
from lowmem.train.checkpoint import load_checkpoint
from lowmem.data.batches import BatchIterator
from lowmem.models import preact_resnet_cifar
from lowmem.train.optim import SGD
from lowmem.train.rundir import ResumeError
from lowmem.train.config import TrainConfig

INFO = {"classes": ["a", "b"], "input_shape": [3, 8, 8], "image_size": 8, "resize": 9, "mean": [0.5] * 3,
        "std": [0.25] * 3, "dataset": "folder"}


def state(seed):
    net = preact_resnet_cifar(8, num_classes=2, seed=seed)
    opt = SGD(net.parameters(), lr=0.1, momentum=0.9)
    x = np.zeros((10, 3, 8, 8), np.uint8)
    s = trainstate.TrainState(net, opt, BatchIterator(x, np.zeros(10), 4, shuffle=True, seed=0, drop_last=True),
                          np.random.default_rng([0, 1]), steps_per_epoch=2)
    for p in net.parameters():
        p.state["momentum"] = np.full(p.shape, seed, p.data.dtype)
    return s


def test_save_then_restore_gives_back_every_part(tmp_path):
    a = state(1)
    a.batches.set_epoch(3, 1)
    a.iteration, a.sums, a.last_eval = 7, dict(trainstate.zero_sums(), seen=4), {"test_acc": 0.5}
    a.rng.random(5)
    path = tmp_path / "c.ckpt"
    trainstate.save(path, a, TrainConfig(), INFO)
    b = state(2)
    arrays, meta = load_checkpoint(path)
    assert meta["data"] == INFO                       # what travels with the weights
    trainstate.restore(b, arrays, meta, path)
    for name, p in a.net.params.items():
        np.testing.assert_array_equal(b.net.params[name].data, p.data)
        np.testing.assert_array_equal(b.net.params[name].state["momentum"], p.state["momentum"])
    assert (b.iteration, b.sums, b.last_eval) == (7, a.sums, a.last_eval)
    assert (b.batches.epoch, b.batches.batch) == (3, 1) and b.rng.random() == a.rng.random()


def test_a_state_that_is_not_finite_is_never_saved(tmp_path):
    s = state(1)
    s.net.params["fc.weight"].data[0, 0] = np.nan
    with pytest.raises(trainstate.TrainingDiverged, match="non-finite values in fc.weight after iteration 0"):
        trainstate.save(tmp_path / "c.ckpt", s, TrainConfig(), INFO)
    assert not (tmp_path / "c.ckpt").exists()


@pytest.mark.parametrize("saved,now,words", [
    (["a", "b"], ["a", "b"], None),
    (["a", "b"], ["b", "z"], "train/a renamed to train/z"),
    (["a", "b", "c"], ["a"], "train/b is gone; train/c is gone"),
    (["a"], ["a", "d"], "train/d is new")])
def test_class_difference_names_what_changed(saved, now, words):
    assert trainstate.class_difference(saved, now) == words


def test_a_resume_with_other_class_folders_is_refused(tmp_path):
    path = tmp_path / "c.ckpt"
    trainstate.save(path, state(1), TrainConfig(), INFO)
    meta = load_checkpoint(path)[1]
    trainstate.check_resumable(meta, TrainConfig(), INFO, path, log=print)
    with pytest.raises(ResumeError, match=r"class folders changed since it was saved \(train/a renamed to train/z\)"):
        trainstate.check_resumable(meta, TrainConfig(), dict(INFO, classes=["z", "b"]), path, log=print)
