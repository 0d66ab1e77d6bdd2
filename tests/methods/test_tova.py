"""TOVA: the lowest last-query attention (mean over all heads of the layer) is evicted."""

import math

import pytest
import torch

from methods import build_method
from methods.model import ModelInfo
from methods.tova import TOVALayer
from tests.conftest import make_engine


def no_attention(module, query, keys, values, mask, **kwargs):
    return None, None


@pytest.mark.kept_set
def test_hand_example_evicts_the_lowest_head_mean():
    """By hand: heads A = [.5 .1 .1 .3] and B = [.1 .5 .1 .3] share one KV head; their mean
    [.3 .3 .1 .3] with K = 3 evicts token 2 (one-hot keys make q.k = log p, so softmax = p)."""
    info = ModelInfo(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, max_positions=16)
    layer = build_method("tova", budget_tokens=3).make_layer(0, info)
    keys = torch.eye(4).view(1, 1, 4, 4)
    probs = torch.tensor([[0.5, 0.1, 0.1, 0.3], [0.1, 0.5, 0.1, 0.3]])
    query = probs.log().view(1, 2, 1, 4).expand(1, 2, 4, 4)  # every row equal; the last one counts
    k, v = layer.update(keys, keys, None)
    layer.attend(None, query, k, v, None, no_attention, scaling=1.0)
    layer.after_forward()
    assert sorted(layer.positions[0, 0].tolist()) == [0, 1, 3]
    assert layer.kept_tokens() == 3 == layer.allowed_tokens()


def test_decode_keeps_k_and_drops_each_steps_argmin(tiny_model, monkeypatch):
    """K = 4, tokens fed one at a time: the size stays 4 and each evicted token is the argmin of
    that step's mean last row (the new token included), the same set for every KV head."""
    steps = []
    original = TOVALayer.after_forward

    def spy(self):
        before = self.positions[0, 0].tolist()
        row = self.last_row[0, 0].clone()
        original(self)
        if self.layer_idx == 1 and len(before) > 4:
            evicted = set(before) - set(self.positions[0, 0].tolist())
            steps.append((evicted, {before[int(row.argmin())]}))
        heads = {tuple(sorted(p.tolist())) for p in self.positions[0]}
        assert len(heads) == 1 and self.kept_tokens() == min(4, self.seen_tokens)

    monkeypatch.setattr(TOVALayer, "after_forward", spy)
    engine = make_engine(tiny_model, build_method("tova", budget_tokens=4))
    torch.manual_seed(0)
    with engine.request() as req:
        for t in torch.randint(3, 250, (10,)):
            req.step(t.view(1))
    assert len(steps) == 6 and all(got == want for got, want in steps)


def test_prefill_prunes_by_the_last_row_and_ratio_budget(tiny_model):
    engine = make_engine(tiny_model, build_method("tova", budget_ratio=0.25), chunk=64)
    with engine.request() as req:
        req.prefill(torch.arange(3, 43))
        assert [kv.kept_tokens() for kv in req.cache.kv_layers] == [10, 10]
        req.step(torch.tensor([5]))
        assert [kv.kept_tokens() for kv in req.cache.kv_layers] == [math.floor(0.25 * 41)] * 2
