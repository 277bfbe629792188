"""lowmem.data.batches.EpochOrder: the seeded order and resumable position that BatchIterator and ImageLoader share."""
import numpy as np
import pytest

from lowmem.data.batches import BatchIterator, EpochOrder, EpochOrderError
from lowmem.data.files import DataError


def test_the_order_is_a_seeded_permutation_per_epoch():
    a, b = EpochOrder(10, 3, shuffle=True, seed=4), EpochOrder(10, 3, shuffle=True, seed=4)
    assert sorted(a.order(0)) == list(range(10))
    np.testing.assert_array_equal(a.order(2), b.order(2))                 # (seed, epoch) decide it
    assert not np.array_equal(a.order(0), a.order(1))
    assert not np.array_equal(a.order(0), EpochOrder(10, 3, shuffle=True, seed=5).order(0))
    np.testing.assert_array_equal(EpochOrder(10, 3).order(7), np.arange(10))   # no shuffle


@pytest.mark.parametrize("drop_last,batches,last", [(True, 3, (6, 9)), (False, 4, (9, 10))])
def test_drop_last_decides_the_batches_and_the_last_span(drop_last, batches, last):
    pos = EpochOrder(10, 3, drop_last=drop_last)
    assert len(pos) == batches and pos.span(batches - 1) == last


def test_the_position_moves_and_resumes_from_its_state():
    pos = EpochOrder(10, 3, shuffle=True, seed=1, drop_last=True)
    pos.set_epoch(2, 1)
    state = pos.state_dict(size=8)
    assert state == {"epoch": 2, "batch": 1, "seed": 1, "num_samples": 10, "batch_size": 3, "shuffle": True,
                     "drop_last": True, "size": 8}
    again = EpochOrder(10, 3, shuffle=True, seed=1, drop_last=True)
    again.load_state_dict(state, size=8)
    assert (again.epoch, again.batch) == (2, 1)
    again.next_epoch()
    assert (again.epoch, again.batch) == (3, 0)


@pytest.mark.parametrize("change,words", [(dict(seed=2), "seed=1"), (dict(num_samples=11), "num_samples=10"),
                                          (dict(batch_size=4), "batch_size=3")])
def test_a_state_of_other_settings_is_refused(change, words):
    state = EpochOrder(10, 3, shuffle=True, seed=1).state_dict()
    args = {**dict(num_samples=10, batch_size=3, shuffle=True, seed=1), **change}
    with pytest.raises(EpochOrderError, match=f"saved state has {words}.*cannot resume the same order"):
        EpochOrder(**args).load_state_dict(state)
    with pytest.raises(EpochOrderError, match="saved state has size=8, this order has 9"):
        EpochOrder(10, 3, shuffle=True, seed=1).load_state_dict(dict(state, size=8), size=9)


def test_bad_settings_and_positions_name_the_owner():
    with pytest.raises(DataError, match="BatchIterator: batch_size must be a positive integer"):
        BatchIterator(np.zeros(4), np.zeros(4), 0)
    with pytest.raises(EpochOrderError, match="EpochOrder: batch 5 outside 0..4"):
        EpochOrder(10, 3).set_epoch(0, 5)


def test_batch_iterator_is_the_order_applied_to_arrays():
    x = np.arange(10)
    it = BatchIterator(x, x, 3, shuffle=True, seed=3, drop_last=True)
    want = EpochOrder(10, 3, shuffle=True, seed=3).order(0)
    assert np.concatenate([xb for xb, _ in it]).tolist() == want[:9].tolist()
    assert (it.epoch, it.batch) == (1, 0)
