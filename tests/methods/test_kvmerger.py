"""KVMerger: merging sets, pivots and Gaussian weights by hand; the budget held end to end."""

import math

import pytest
import torch

from kvcore.errors import ConfigError
from methods import build_method
from methods.base import ModelInfo
from methods.kvmerger import gaussian_merge, merging_sets
from tests.conftest import make_engine


def no_attention(module, query, keys, values, mask, **kwargs):
    return None, None


def test_merging_sets_by_hand():
    """methods-2.md §6: adjacent cosines [.99, .20, .97, .98], 2 sets wanted -> {0,1} {2,3,4}."""
    angles = torch.tensor([0.0, math.acos(0.99), math.acos(0.2), math.acos(0.97), math.acos(0.98)])
    angles = angles.cumsum(0)
    keys = torch.stack([angles.cos(), angles.sin()], dim=-1).view(1, 1, 5, 2) * 3.0
    assert merging_sets(keys, 2)[0, 0].tolist() == [0, 0, 1, 1, 1]
    assert merging_sets(keys, 5)[0, 0].tolist() == [0, 1, 2, 3, 4]  # nothing joined
    assert merging_sets(keys, 1)[0, 0].tolist() == [0] * 5


def test_gaussian_weights_by_hand():
    """Pivot at distance 0, the two others at distance 1: sigma^2 = 2/3, weights e, 1, e over
    1 + 2e with e = exp(-3/4); identical members merge to themselves."""
    keys = torch.tensor([[1.0, 0.0], [0.0, 0.0], [-1.0, 0.0]]).view(1, 1, 3, 2)
    values = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]).view(1, 1, 3, 2)
    set_id, pivot = torch.zeros(1, 1, 3, dtype=torch.long), torch.tensor([[[1]]])
    merged_k, merged_v = gaussian_merge(keys, values, set_id, pivot, 1)
    e = math.exp(-0.75)
    assert torch.allclose(merged_v[0, 0, 0], torch.tensor([e, 1.0]) / (1 + 2 * e))
    assert torch.allclose(merged_k[0, 0, 0], torch.zeros(2), atol=1e-7)  # symmetric members
    same = torch.ones(1, 1, 3, 2)
    assert torch.allclose(gaussian_merge(same, same * 2, set_id, pivot, 1)[1], same[:, :, :1] * 2)


def test_prompt_is_merged_as_computed_by_hand():
    """8 tokens, window 2, budget 4: prefix {0,1,2} {3,4,5} (a sharp turn between 2 and 3); the
    window queries (3, 2) score k1 and k5 highest in their sets, so they are the pivots."""
    keys = torch.tensor([[1, 0], [1, .1], [.9, .2], [0, 1], [.1, 1], [.2, 1.1], [-1, 0], [0, -1]])
    values = torch.stack([torch.arange(8.0), torch.ones(8)], dim=-1)
    info = ModelInfo(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, max_positions=64)
    layer = build_method("kvmerger", budget_tokens=4, window_tokens=2).make_layer(0, info)
    query = torch.tensor([3.0, 2.0]).expand(8, 2)
    for start, stop in [(0, 5), (5, 8)]:
        k, v = layer.update(keys[None, None, start:stop], values[None, None, start:stop], None)
        layer.attend(None, query[None, None, start:stop], k, v, None, no_attention, scaling=1.0)
        layer.after_forward()
        assert layer.kept_tokens() == stop  # the prompt is held in full until it is over
    layer.on_prefill_end()
    assert layer.positions[0, 0].tolist() == [1, 5, 6, 7]
    # set {0,1,2}, pivot k1: squared distances .01, 0, .02, sigma^2 = .01
    w0 = torch.tensor([math.exp(-0.5), 1.0, math.exp(-1.0)])
    # set {3,4,5}, pivot k5: squared distances .05, .02, 0, sigma^2 = .07 / 3
    w1 = torch.tensor([math.exp(-0.05 * 3 / 0.14), math.exp(-0.02 * 3 / 0.14), 1.0])
    w0, w1 = w0 / w0.sum(), w1 / w1.sum()
    expected_k = torch.stack([w0 @ keys[0:3], w1 @ keys[3:6], keys[6], keys[7]])
    expected_v = torch.stack([w0 @ values[0:3], w1 @ values[3:6], values[6], values[7]])
    assert torch.allclose(layer.keys[0, 0], expected_k, atol=1e-6)
    assert torch.allclose(layer.values[0, 0], expected_v, atol=1e-6)
    k, v = layer.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), None)  # decode appends
    layer.after_forward()
    assert layer.kept_tokens() == 5 == layer.allowed_tokens()
    assert layer.positions[0, 0].tolist() == [1, 5, 6, 7, 8]


def test_every_layer_keeps_its_budget_end_to_end(tiny_model):
    ids = torch.arange(3, 63)
    engine = make_engine(tiny_model, build_method("kvmerger", budget_ratio=0.5, window_tokens=8),
                         chunk=16)
    with engine.request() as req:
        req.prefill(ids)
        assert [kv.kept_tokens() for kv in req.cache.kv_layers] == [30, 30]
        positions = req.cache.kv_layers[1].positions
        assert (positions[..., -8:] == torch.arange(52, 60)).all()  # the window, untouched
        assert (positions[..., :22] < 52).all()  # one pivot per set
        for t in ids[:3]:
            req.step(t.view(1))
        assert [kv.kept_tokens() for kv in req.cache.kv_layers] == [33, 33]


@pytest.mark.parametrize("key, value", [("window_tokens", 0), ("budget_ratio", 1.5),
                                        ("budget_tokens", -3)])
def test_bad_config_names_the_key(key, value):
    with pytest.raises(ConfigError, match=f"method.{key}="):
        build_method("kvmerger", **{key: value})


def test_refused_where_no_prompt_ends():
    from harness.run import protocol_reasons
    from methods.base import Protocol
    from tasks import build_task

    info = ModelInfo(num_layers=4, num_heads=2, num_kv_heads=2, head_dim=8, max_positions=64)
    reasons = protocol_reasons(build_method("kvmerger"), build_task("perplexity", mode="streaming"),
                               info, Protocol())
    assert any("compresses only over a prefilled prompt" in r for r in reasons)
