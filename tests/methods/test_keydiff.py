"""KeyDiff: the keys most aligned with the mean key direction go first."""

import pytest
import torch

from methods import build_method
from methods.keydiff import anchor_cosine
from methods.model import ModelInfo
from methods.protocol import Protocol
from tests.conftest import make_engine


@pytest.mark.kept_set
def test_hand_example():
    """By hand: k = (1,0), (.9,.1), (.6,.8), (0,1): cos to the anchor = [.805 .866 .958
    .593]; with N = 2 tokens 3 and 0 are kept."""
    keys = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.6, 0.8], [0.0, 1.0]]).view(1, 1, 4, 2)
    cos = anchor_cosine(keys)[0, 0]
    assert torch.allclose(cos, torch.tensor([0.805, 0.866, 0.958, 0.593]), atol=2e-3)
    assert torch.allclose(anchor_cosine(keys * torch.tensor([3.0, 1, 7, 0.5]).view(1, 1, 4, 1)),
                          anchor_cosine(keys))  # invariant to scaling any key
    info = ModelInfo(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, max_positions=16)
    layer = build_method("keydiff", budget_tokens=2).make_layer(0, info)
    layer.update(keys, keys, None)
    layer.after_forward()
    assert sorted(layer.positions[0, 0].tolist()) == [0, 3]
    assert layer.keys[0, 0].tolist() in ([[1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [1.0, 0.0]])


@pytest.mark.parametrize("prefill", ["dense", "chunked"])
def test_block_wise_prefill_and_decode_hold_n(prefill, tiny_model, monkeypatch):
    """The prompt and decode steps both prune to N; at a decode step the token dropped is the
    one most aligned with the anchor of the N + 1 keys held. runner.prefill=dense: the prompt is
    pruned once at its end, whatever the chunk size; runner.prefill=chunked (the paper's
    block-wise deployment): whole-prompt blocks differ from smaller blocks (each block attends
    the pruned cache)."""
    from methods.keydiff import KeyDiffLayer

    dropped = []
    original = KeyDiffLayer.after_forward

    def spy(self):
        keys, before = self.keys.clone(), self.positions[0, 0].tolist()
        original(self)
        if self.seen_tokens > 60 and self.layer_idx == 1:
            gone = set(before) - set(self.positions[0, 0].tolist())
            dropped.append(gone == {before[int(anchor_cosine(keys)[0, 0].argmax())]})

    ids = torch.arange(3, 63)
    monkeypatch.setattr(KeyDiffLayer, "after_forward", spy)
    kept = []
    for chunk in (64, 16):
        engine = make_engine(tiny_model, build_method("keydiff", budget_tokens=12), chunk=chunk,
                             protocol=Protocol(prefill=prefill))
        with engine.request() as req:
            req.prefill(ids)
            assert [kv.kept_tokens() for kv in req.cache.kv_layers] == [12, 12]
            kept.append(sorted(req.cache.kv_layers[1].positions[0, 0].tolist()))
            for t in ids[:5]:
                req.step(t.view(1))
            assert [kv.kept_tokens() for kv in req.cache.kv_layers] == [12, 12]
    assert len(dropped) == 10 and all(dropped)
    assert (kept[0] != kept[1]) == (prefill == "chunked")
