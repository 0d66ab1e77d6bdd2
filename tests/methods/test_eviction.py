"""The scored-eviction template's storage and protection (methods/eviction.py)."""

import pytest
import torch

from kvcore.paged import BlockPool, PagedRows
from kvcore.storage import ContiguousRows, doubled_capacity
from methods.budget import BudgetedMethod
from methods.eviction import EvictionLayer, append_tokens, drop_one_token, keep_tokens
from methods.model import ModelInfo


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_storage_append_drop_keep(layout):
    pool = BlockPool(block_tokens=2)
    rows = {"x": ContiguousRows(doubled_capacity) if layout == "contiguous" else PagedRows(pool)}
    n = append_tokens(rows.get, {"x": torch.arange(6.).view(1, 2, 3)})  # (B, H, q)
    n = append_tokens(rows.get, {"x": torch.arange(6., 10.).view(1, 2, 2)})
    assert n == 5 and rows["x"].view().tolist() == [[[0, 1, 2, 6, 7], [3, 4, 5, 8, 9]]]
    allocated = rows["x"].allocated_bytes()
    n = drop_one_token(rows, torch.tensor([[1, 4]]))  # head 0 drops slot 1, head 1 the last
    assert n == 4 and rows["x"].view().tolist() == [[[0, 7, 2, 6], [3, 4, 5, 8]]]
    if layout == "contiguous":
        assert rows["x"].allocated_bytes() == allocated  # in place: no new buffer
    else:  # 4 tokens in blocks of 2: the third block emptied and went back to the pool
        assert rows["x"].allocated_bytes() == allocated * 2 // 3 and pool.held == 2
    n = keep_tokens(rows, torch.tensor([[[0, 2], [1, 3]]]))
    assert n == 2 and rows["x"].view().tolist() == [[[0, 2], [4, 8]]]
    if layout == "paged":
        assert pool.held == 1 and len(pool.free) == pool.num_blocks - 1


@pytest.mark.parametrize("layout", ["contiguous", "paged", "token_major"])
def test_dropping_the_held_last_token_equals_copying_it_out(layout):
    """drop_one with the last token as the caller holds it (the steady-state eviction of a
    decode step) leaves the same rows as copying it out of the buffer first."""
    from kvcore.storage import TokenMajorRows

    def fresh():
        if layout == "paged":
            return PagedRows(BlockPool(block_tokens=2))
        return ContiguousRows() if layout == "contiguous" else TokenMajorRows()

    x = torch.randn(2, 3, 7, 4, generator=torch.Generator().manual_seed(0))
    new = torch.randn(2, 3, 1, 4, generator=torch.Generator().manual_seed(1))
    slot = torch.tensor([[0, 7, 3], [6, 2, 5]])  # 7: the new token itself goes
    views = []
    for last in (None, new):
        rows = {"x": fresh()}
        append_tokens(rows.get, {"x": x})
        append_tokens(rows.get, {"x": new})
        drop_one_token(rows, slot, None if last is None else {"x": last})
        views.append(rows["x"].view())
    assert torch.equal(*views) and views[0].shape == (2, 3, 7, 4)


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


def test_a_victim_picked_while_attending_is_used_only_by_its_own_forward():
    """`picked` (a fused kernel's choice) replaces the argmin of that forward's compression only:
    a pick left from another step (other tokens seen) or for another budget is ignored."""
    method = BudgetedMethod(budget_tokens=4)
    info = ModelInfo(num_layers=1, num_heads=2, num_kv_heads=2, head_dim=4, max_positions=64)
    layer = Latest(0, info, method)
    layer.update(torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4), None)
    layer.after_forward()
    layer.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), None)
    plan = layer.one_token_eviction()
    assert plan == (4, 1, 5 - 2)  # budget 4; unprotected: positions 1 <= p < 3
    argmin = layer.guarded_scores(4).argmin(dim=-1)
    chosen = torch.tensor([[2, 1]])
    layer.picked = (layer.seen_tokens - 1, 4, chosen)  # stale: another step's
    assert torch.equal(layer.lowest_slot(4), argmin)
    layer.picked = (layer.seen_tokens, 5, chosen)  # another budget
    assert torch.equal(layer.lowest_slot(4), argmin)
    layer.picked = (layer.seen_tokens, 4, chosen)
    assert torch.equal(layer.lowest_slot(4), chosen) and layer.picked is None  # used once
