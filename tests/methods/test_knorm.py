"""Knorm: once per prompt, the lowest-norm keys per KV head (+ an optional recent window)."""

import pytest
import torch

from kvcore.errors import ConfigError
from methods import build_method
from methods.knorm import key_norms
from methods.model import ModelInfo
from tests.conftest import make_engine

INFO = ModelInfo(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2, max_positions=16)


def prompt_layer(keys: torch.Tensor, chunks: list[tuple[int, int]], **knobs):
    """A knorm layer fed `keys (1, H_kv, T, D)` in prompt chunks, then the prompt's end."""
    layer = build_method("knorm", **knobs).make_layer(0, INFO)
    for start, stop in chunks:
        layer.update(keys[:, :, start:stop], keys[:, :, start:stop], None)
        layer.after_forward()
        assert layer.kept_tokens() == stop and layer.allowed_tokens() is None  # held in full
    layer.on_prefill_end()
    return layer


@pytest.mark.kept_set
def test_hand_example_lowest_norms_kept():
    """Norms of (3,4), (1,0), (0,2), (6,8), (0.6,0.8), (2,0) = 5, 1, 2, 10, 1, 2: a budget of 4
    keeps the four lowest, positions {1, 2, 4, 5}, whatever the prompt's chunking."""
    keys = torch.tensor([[3.0, 4], [1, 0], [0, 2], [6, 8], [0.6, 0.8], [2, 0]]).view(1, 1, 6, 2)
    assert torch.allclose(key_norms(keys)[0, 0], torch.tensor([5.0, 1, 2, 10, 1, 2]))
    layer = prompt_layer(keys, [(0, 4), (4, 6)], budget_tokens=4)
    assert sorted(layer.positions[0, 0].tolist()) == [1, 2, 4, 5]
    # the kept K/V are the tokens' own rows
    assert torch.equal(layer.keys[0, 0], keys[0, 0, layer.positions[0, 0]])


def test_window_keeps_the_newest_whatever_their_norm():
    keys = torch.tensor([[3.0, 4], [1, 0], [0, 2], [6, 8], [0.6, 0.8], [9, 9]]).view(1, 1, 6, 2)
    plain = prompt_layer(keys, [(0, 6)], budget_tokens=3)
    assert sorted(plain.positions[0, 0].tolist()) == [1, 2, 4]
    windowed = prompt_layer(keys, [(0, 6)], budget_tokens=3, window_tokens=2)
    assert sorted(windowed.positions[0, 0].tolist()) == [1, 4, 5]  # 4, 5 recent + lowest (pos 1)


def test_ratio_budget_per_head_and_decode_appends():
    """int(0.5 x 10) = 5 per KV head, each head its own set; then decode grows without eviction."""
    torch.manual_seed(0)
    info = ModelInfo(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, max_positions=64)
    keys = torch.randn(1, 2, 10, 8) * torch.linspace(0.1, 3, 10).view(1, 1, 10, 1).flip(-2)
    layer = build_method("knorm", budget_ratio=0.5).make_layer(0, info)
    layer.final_tokens = 10  # the budget basis, as the engine sets it when the prompt is fed
    layer.update(keys, keys, None)
    layer.after_forward()
    layer.on_prefill_end()
    for h in range(2):
        expected = key_norms(keys)[0, h].topk(5, largest=False).indices.sort().values
        assert layer.positions[0, h].sort().values.tolist() == expected.tolist()
    for _ in range(3):
        layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), None)
        layer.after_forward()
    assert layer.kept_tokens() == 8 == layer.allowed_tokens()


def test_bad_window_refused():
    with pytest.raises(ConfigError, match="method.window_tokens"):
        build_method("knorm", window_tokens=-1)


def test_engine_chunking_does_not_matter(tiny_model):
    """Through the engine: the prompt is compressed once at its end, so 7-token chunks and one
    chunk keep the same sets; decoding appends."""
    ids = torch.arange(3, 63)
    kept = []
    for chunk in (7, 512):
        engine = make_engine(tiny_model, build_method("knorm", budget_tokens=12), chunk=chunk)
        with engine.request() as req:
            req.prefill(ids)
            layers = req.cache.kv_layers
            assert [kv.kept_tokens() for kv in layers] == [12, 12]
            kept.append([kv.positions.sort(dim=-1).values.tolist() for kv in layers])
            req.step(ids[:1])
            assert [kv.kept_tokens() for kv in layers] == [13, 13]
    assert kept[0] == kept[1]
