"""PyramidKV: the official pyramid schedule, and SnapKV's selection under each layer's budget."""

import pytest
import torch

from methods import build_method
from methods.pyramidkv import pyramid_budget
from tests.conftest import make_engine
from tests.methods.contract.rules import kept_after_crafted_compression


@pytest.mark.parametrize("seen, caps", [
    (60, [72, 72, 72, 72]),  # n < C: nothing compressed
    (100, [72, 72, 72, 72]),  # C <= n < 2(C - w): plain SnapKV
    (1000, [125 + 8, 85 + 8, 45 + 8, 5 + 8]),  # the pyramid
    (130, [122 + 8, 84 + 8, 46 + 8, 8 + 8]),  # the clamp branch
])
def test_schedule_by_hand(seen, caps):
    """By hand: L = 4, C = 72, w = 8, beta = 20."""
    assert [pyramid_budget(72, 8, 20, layer, 4, seen) for layer in range(4)] == caps


def test_schedule_32_layers():
    caps = [pyramid_budget(2048, 8, 20, layer, 32, 8000) - 8 for layer in range(32)]
    assert caps[0] == 3978 and caps[31] == 103 and sum(caps) / 32 == 2040.5


def test_layers_keep_their_pyramid_budget(stories):
    model, tok = stories
    ids = torch.tensor(tok("Once upon a time there was a little dog. " * 20)["input_ids"][:200])
    method = build_method("pyramidkv", budget_tokens=40, window_tokens=8, kernel_tokens=7)
    engine = make_engine(model, method, tok, chunk=64)
    layers = model.config.num_hidden_layers
    expected = [pyramid_budget(40, 8, 20, i, layers, 200) for i in range(layers)]
    assert expected[0] > 40 > expected[-1]  # a real pyramid at this length
    with engine.request() as req:
        req.prefill(ids)
        assert [kv.kept_tokens() for kv in req.cache.kv_layers] == expected
        req.step(ids[:1])
        assert [kv.kept_tokens() for kv in req.cache.kv_layers] == [e + 1 for e in expected]
    assert engine.ledger.samples[-1]["budget_per_layer"] == [e + 1 for e in expected]


@pytest.mark.kept_set
def test_kept_set_by_hand():
    """20 tokens scored 7p mod 20 (distinct), budget 8, window 2, beta 20, 3 layers: prefix
    budget 6, min 6 // 20 = 0, max 12, step 6, so layers keep 14, 8 and 2 tokens: the window
    (18, 19) and the top 12, 6 and 0 of positions 0..17 (scores 19, 18, 17, ... at positions
    17, 14, 11, 8, 5, 2, 16, 13, 10, 7, 4, 1)."""
    scores = (torch.arange(20.0) * 7 % 20)[None, None]
    method = build_method("pyramidkv", budget_tokens=8, window_tokens=2, beta=20)
    kept = [kept_after_crafted_compression(method, scores, layer_idx=i, num_layers=3)[0]
            for i in range(3)]
    assert kept == [[1, 2, 4, 5, 7, 8, 10, 11, 13, 14, 16, 17, 18, 19],
                    [2, 5, 8, 11, 14, 17, 18, 19], [18, 19]]
