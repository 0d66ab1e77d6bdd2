"""Scissorhands: the token most often below uniform attention over the history goes first."""

import pytest
import torch

from kvcore.errors import ConfigError
from methods import build_method
from methods.model import ModelInfo
from methods.scissorhands import ScissorhandsLayer, low_attention
from tests.conftest import make_engine


@pytest.mark.kept_set
def test_hand_example():
    """By hand: T = 5 > B = 4, w = 3, r = 1, tau = 1/5; counts of a < 0.2 over the three
    rows: [0, 3, 2, 1, 3 (protected)] -> token 1 is evicted."""
    rows = torch.tensor([[0.5, 0.1, 0.1, 0.2, 0.1], [0.4, 0.1, 0.3, 0.1, 0.1],
                         [0.6, 0.05, 0.05, 0.2, 0.1]]).view(1, 1, 3, 5)
    counts = low_attention(rows[:, :, -1:].expand(1, 1, 1, 5), 1)  # one row: it sees all 5
    assert counts[0, 0, 0].tolist() == [0, 1, 1, 0, 1]
    info = ModelInfo(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, max_positions=16)
    layer = build_method("scissorhands", budget_tokens=4, history_tokens=3,
                         recent_tokens=1).make_layer(0, info)
    layer.update(torch.randn(1, 1, 5, 2), torch.randn(1, 1, 5, 2), None)
    for i in range(3):  # three decode-like rows, each seeing the 5 tokens
        layer.state("history")[0, 0, :, i] = low_attention(rows[:, :, i:i + 1], 1)[0, 0, 0]
    assert layer.state("history")[0, 0].sum(-1).tolist() == [0, 3, 2, 1, 3]
    layer.after_forward()
    assert sorted(layer.positions[0, 0].tolist()) == [0, 2, 3, 4]


def test_gqa_counts_sum_over_the_group_and_causal_rows():
    head0 = torch.tensor([[0.7, 0.3, 0.0], [0.2, 0.3, 0.5]])  # rows see 2 and 3 keys
    head1 = torch.tensor([[0.4, 0.6, 0.0], [0.1, 0.1, 0.8]])
    counts = low_attention(torch.stack([head0, head1])[None], 1)  # 2 query heads, 1 KV head
    # row 0 (tau 1/2): head 0 low on key 1, head 1 on key 0, key 2 is in the future;
    # row 1 (tau 1/3): key 0 low for both heads, key 1 for both too (0.3 < 1/3, 0.1)
    assert counts[0, 0].tolist() == [[1, 1, 0], [2, 2, 0]]


def test_decode_holds_budget_and_drops_the_most_often_low(tiny_model, monkeypatch):
    checks = []
    original = ScissorhandsLayer.after_forward

    def spy(self):
        before, counts = self.positions.clone(), self.state("history").sum(-1, dtype=torch.int32)
        seen = self.seen_tokens
        original(self)
        if len(before[0, 0]) > self.kept_tokens():
            for h in range(before.shape[1]):
                gone = set(before[0, h].tolist()) - set(self.positions[0, h].tolist())
                older = [(int(c), p) for c, p in zip(counts[0, h].tolist(), before[0, h].tolist())
                         if p < seen - 3]
                worst = max(c for c, _ in older)
                checks.append(gone == {min(p for c, p in older if c == worst)})

    monkeypatch.setattr(ScissorhandsLayer, "after_forward", spy)
    engine = make_engine(tiny_model, build_method("scissorhands", budget_tokens=10,
                                                  history_tokens=6, recent_tokens=3))
    with engine.request() as req:
        for t in torch.randint(3, 250, (30,), generator=torch.Generator().manual_seed(0)):
            req.step(t.view(1))
        assert [kv.kept_tokens() for kv in req.cache.kv_layers] == [10, 10]
    assert len(checks) == 2 * 2 * 20 and all(checks)


def test_scissorhands_recent_window_larger_than_the_budget_is_refused():
    with pytest.raises(ConfigError, match="method.recent_tokens=20 is more than "
                                          "method.budget_tokens=8"):
        build_method("scissorhands", budget_tokens=8, recent_tokens=20)
    build_method("scissorhands", budget_tokens=8, recent_tokens=8)
