"""The scored-eviction template's storage and protection (methods/eviction.py)."""

import torch

from methods.base import ModelInfo
from methods.eviction import (BudgetedMethod, EvictionLayer, append_tokens, drop_one_token,
                              keep_tokens)


def test_storage_append_drop_keep():
    buffers = {}
    n = append_tokens(buffers, 0, {"x": torch.arange(6.).view(1, 2, 3)})  # (B, H, q)
    n = append_tokens(buffers, n, {"x": torch.arange(6., 10.).view(1, 2, 2)})
    assert n == 5 and buffers["x"][:, :, :n].tolist() == [[[0, 1, 2, 6, 7], [3, 4, 5, 8, 9]]]
    capacity = buffers["x"].shape[2]
    n = drop_one_token(buffers, n, torch.tensor([[1, 4]]))  # head 0 drops slot 1, head 1 the last
    assert n == 4 and buffers["x"][:, :, :n].tolist() == [[[0, 7, 2, 6], [3, 4, 5, 8]]]
    assert buffers["x"].shape[2] == capacity  # in place: no new buffer
    n = keep_tokens(buffers, n, torch.tensor([[[0, 2], [1, 3]]]))
    assert n == 2 and buffers["x"][:, :, :n].tolist() == [[[0, 2], [4, 8]]]


class Latest(EvictionLayer):
    def score(self):
        return -self.positions.float()  # prefers the oldest: only protection keeps recent ones

    def protected(self, budget):
        return 1, 2


def test_protected_sinks_and_recent_survive_any_score():
    method = BudgetedMethod(budget_tokens=4)
    info = ModelInfo(num_layers=1, num_heads=2, num_kv_heads=2, head_dim=4, max_positions=64)
    layer = Latest(0, info, method)
    keys = torch.randn(1, 2, 9, 4)
    layer.update(keys, keys, None)
    layer.after_forward()
    # sink 0 and recent 7, 8 protected; the top score among the rest is position 1
    assert [sorted(p.tolist()) for p in layer.positions[0]] == [[0, 1, 7, 8]] * 2
    assert torch.equal(layer.keys[0, 1], keys[0, 1, [0, 1, 7, 8]])
    assert layer.allowed_tokens() == 4 and layer.stats()["kv_tokens"] == 4
