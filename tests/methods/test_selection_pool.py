"""The selecting layers' bounded pool (methods/_selection_pool.py): per held token its selections
and last selection step, counted by hand, and the tokens `fit_pool` evicts by them."""

import pytest
import torch

from methods._selection_pool import PooledLayer


class Pool(PooledLayer):
    """A pool of one sequence and KV head whose stores are a list of text positions."""

    def __init__(self, tokens: int, policy: str):
        self.eviction_policy, self.seen_tokens = policy, tokens
        self.init_pool()
        self.pool_append(torch.zeros(1, 1, tokens, 2), tokens)
        self.rows = list(range(tokens))

    def keep_rows(self, index):
        self.rows = [self.rows[i] for i in index[0, 0].tolist()]


def used(*tokens, t=8):
    mask = torch.zeros(1, 1, t, dtype=torch.bool)
    mask[0, 0, list(tokens)] = True
    return mask


def test_selections_are_counted_and_stamped_by_hand():
    pool = Pool(8, "counter")
    for step in ([0, 2], [2, 5], [2, 0], [7]):  # steps 1..4
        pool.touch_pool(used(*step))
    assert pool.counter[0, 0].tolist() == [2, 0, 3, 0, 0, 1, 0, 1]
    assert pool.last_used[0, 0].tolist() == [3, 0, 3, 0, 0, 2, 0, 4]


@pytest.mark.parametrize("policy, evicted", [
    ("counter", [1, 3]),  # selected once each, among the older half [0..3] (counts 3, 1, 3, 1)
    ("lru", [0, 1]),  # last selected at steps 3 and 4 (stamps 3, 4, 6, 5)
    ("fifo", [0, 1]),  # the two oldest, whatever their use
])
def test_fit_pool_evicts_by_the_policy_past_its_capacity(policy, evicted):
    pool = Pool(8, policy)
    for step in ([0], [0], [0], [1, 2], [2, 3], [2]):  # steps 1..6
        pool.touch_pool(used(*step))
    pool.fit_pool(0.75)  # 6 of the 8 tokens seen
    assert pool.stored() == 6
    assert sorted(set(range(8)) - set(pool.positions[0, 0].long().tolist())) == evicted
    assert pool.rows == pool.positions[0, 0].long().tolist()  # the stores dropped the same rows
    assert pool.at_positions(pool.counter, -1.0)[0, 0, evicted].tolist() == [-1.0, -1.0]
