"""SnapKV: once per prompt, window votes pooled along the text, top-k per KV head + the window."""

import pytest
import torch
import torch.nn.functional as F

from harness.core.engine import Engine, EngineSettings
from harness.core import hf_adapter
from harness.config.runner import protocol_reasons
from methods import build_method
from methods.model import ModelInfo
from methods.protocol import Protocol
from methods.snapkv import pool_along_text
from tasks import build_task
from tests.conftest import make_engine


def no_attention(module, query, keys, values, mask, **kwargs):
    return None, None


def hand_kept(queries, keys, budget, window, kernel):
    """The selection written out per KV head with loops: softmax rows of the window (causal),
    group mean, column sums over the prefix, max pooling with -inf padding, top-k + window."""
    h_q, n, d = queries.shape[0], keys.shape[1], keys.shape[2]
    g = h_q // keys.shape[0]
    kept = []
    for kv in range(keys.shape[0]):
        votes = torch.zeros(n - window)
        for h in range(kv * g, (kv + 1) * g):
            for i in range(window):
                row_pos = n - window + i
                p = torch.softmax(keys[kv, :row_pos + 1] @ queries[h, row_pos] * d ** -0.5, -1)
                votes += p[: n - window] / g
        pooled = torch.tensor([votes[max(0, j - kernel // 2): j + kernel // 2 + 1].max()
                               for j in range(n - window)])
        top = pooled.topk(budget - window).indices.tolist()
        kept.append(sorted(top + list(range(n - window, n))))
    return kept


@pytest.mark.kept_set
def test_kept_set_equals_a_hand_computation():
    torch.manual_seed(0)
    n, d, window, budget, kernel = 20, 8, 4, 9, 3
    info = ModelInfo(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=d, max_positions=64)
    method = build_method("snapkv", budget_tokens=budget, window_tokens=window, kernel_tokens=kernel)
    layer = method.make_layer(0, info)
    queries, keys = torch.randn(4, n, d), torch.randn(2, n, d)
    for start, stop in [(0, 7), (7, 18), (18, 19), (19, 20)]:  # chunking must not matter
        k, v = layer.update(keys[None, :, start:stop], keys[None, :, start:stop], None)
        layer.attend(None, queries[None, :, start:stop], k, v, None, no_attention, scaling=d ** -0.5)
        layer.after_forward()
        assert layer.kept_tokens() == stop and layer.allowed_tokens() is None  # prompt held in full
    layer.on_prefill_end()
    assert [sorted(p.tolist()) for p in layer.positions[0]] == hand_kept(queries, keys, budget,
                                                                         window, kernel)
    # kept K/V are the tokens' own rows; decode then appends without eviction
    assert torch.equal(layer.keys[0, 1], keys[1, layer.positions[0, 1]])
    k, v = layer.update(torch.randn(1, 2, 1, d), torch.randn(1, 2, 1, d), None)
    layer.attend(None, torch.randn(1, 4, 1, d), k, v, None, no_attention, scaling=d ** -0.5)
    layer.after_forward()
    assert layer.kept_tokens() == budget + 1 == layer.allowed_tokens()


def test_pooling_follows_text_order_not_cache_order():
    torch.manual_seed(1)
    votes, positions = torch.rand(1, 2, 12), torch.stack([torch.randperm(12), torch.randperm(12)])[None]
    prefix = positions < 9
    pooled = pool_along_text(votes, positions, prefix, 5, "max")
    for h in range(2):
        in_text = torch.full((12,), float("-inf"))
        in_text[positions[0, h]] = votes[0, h]
        in_text[9:] = float("-inf")
        expected = F.max_pool1d(in_text.view(1, 1, 12), 5, 1, 2).view(12)[positions[0, h]]
        assert torch.equal(pooled[0, h][prefix[0, h]], expected[prefix[0, h]])


def test_engine_compresses_once_per_prompt_whatever_the_chunking(stories):
    model, tok = stories
    ids = torch.tensor(tok("Once upon a time there was a little dog. " * 10)["input_ids"][:100])
    kept = []
    for chunk in (7, 512):
        engine = make_engine(model, build_method("snapkv", budget_tokens=30, window_tokens=8), tok,
                             chunk=chunk)
        with engine.request() as req:
            req.prefill(ids[:90])
            layers = req.cache.kv_layers
            assert [kv.kept_tokens() for kv in layers] == [30] * len(layers)
            kept.append([sorted(map(tuple, kv.positions[0].tolist())) for kv in layers])
            for t in ids[90:]:
                req.step(t.view(1))
            assert [kv.kept_tokens() for kv in layers] == [40] * len(layers)
    assert kept[0] == kept[1]
    assert len({tuple(p) for p in kept[0][2]}) > 1  # per-KV-head selection


def test_refused_where_it_cannot_act(tiny_model):
    method = build_method("snapkv")
    info = hf_adapter.model_info(tiny_model.config)
    streaming = build_task("perplexity", mode="streaming")
    assert any("compresses only over a prefilled prompt" in r
               for r in protocol_reasons(method, streaming, info, Protocol()))
    assert any("runner.prefill=sparse" in r
               for r in protocol_reasons(method, build_task("perplexity", mode="chunked"),
                                         info, Protocol(prefill="sparse")))
