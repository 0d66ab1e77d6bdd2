"""Expected Attention: kvpress's expected attention of Gaussian future queries, x ||v||."""

import math

import pytest
import torch

from methods import build_method
from methods.model import ModelInfo
from tests.conftest import make_engine

D, THETA = 4, 10.0
INV_FREQ = 1.0 / THETA ** (torch.arange(0, D, 2).float() / D)  # (D/2,)


def no_attention(module, query, keys, values, mask, **kwargs):
    return None, None


def rotation(p: float) -> torch.Tensor:
    """R_p as a D x D matrix built pair by pair: dims (i, i + D/2) turn by p * inv_freq[i]."""
    r = torch.zeros(D, D, dtype=torch.float64)
    for i, f in enumerate(INV_FREQ.tolist()):
        a = p * f
        j = i + D // 2
        r[i, i], r[i, j], r[j, i], r[j, j] = math.cos(a), -math.sin(a), math.sin(a), math.cos(a)
    return r


def hand_kept(pre_queries, keys, values, sinks, future, budget):
    """kvpress's rule with loops: mu, population covariance of the queries past the sinks, one
    averaged rotation over the next `future` positions, the Gaussian logit, softmax over the
    non-sink keys per query head, group mean, x ||v||; the sinks and the top scores kept."""
    h_q, n, _ = pre_queries.shape
    g = h_q // keys.shape[0]
    r = sum(rotation(p) for p in range(n, n + future)) / future
    kept = []
    for kv in range(keys.shape[0]):
        score = torch.zeros(n - sinks, dtype=torch.float64)
        for h in range(kv * g, (kv + 1) * g):
            q = pre_queries[h, sinks:].double()
            mu = q.mean(0)
            cov = sum(torch.outer(x - mu, x - mu) for x in q) / q.shape[0]
            mu, cov = r @ mu, r @ cov @ r.T
            logits = torch.tensor([float(k @ mu) / math.sqrt(D) + float(k @ cov @ k) / (2 * D)
                                   for k in keys[kv, sinks:].double()])
            score += torch.softmax(logits, 0) / g
        score = score * values[kv, sinks:].double().norm(dim=-1)
        top = (score.topk(budget - sinks).indices + sinks).tolist()
        kept.append(sorted(list(range(sinks)) + top))
    return kept


@pytest.mark.kept_set
def test_kept_set_equals_a_hand_computation():
    torch.manual_seed(0)
    n, sinks, future, budget = 16, 2, 5, 7
    info = ModelInfo(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=D, max_positions=64,
                     rope_theta=THETA)
    method = build_method("expected_attention", budget_tokens=budget, sink_tokens=sinks,
                          future_tokens=future)
    method._inv_freq = INV_FREQ  # what prepare takes from the model
    layer = method.make_layer(0, info)
    pre_q, keys, values = torch.randn(4, n, D), torch.randn(2, n, D), torch.randn(2, n, D)
    post_q = torch.stack([torch.stack([rotation(p).float() @ pre_q[h, p] for p in range(n)])
                          for h in range(4)])
    layer.prompt_open = True
    for start, stop in [(0, 1), (1, 9), (9, 16)]:  # the chunking must not matter
        k, v = layer.update(keys[None, :, start:stop], values[None, :, start:stop], None)
        layer.attend(None, post_q[None, :, start:stop], k, v, None, no_attention, scaling=0.5)
        layer.after_forward()
    layer.prompt_open = False
    layer.on_prefill_end()
    assert [sorted(p.tolist()) for p in layer.positions[0]] == hand_kept(pre_q, keys, values,
                                                                         sinks, future, budget)
    assert torch.equal(layer.values[0, 1], values[1, layer.positions[0, 1]])


def test_value_norm_term():
    """kvpress's use_vnorm: without it a key's score is its expected attention alone; with it,
    (that + 0) x ||v||, so a twin key with a doubled value scores twice as much."""
    torch.manual_seed(1)
    info = ModelInfo(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=D, max_positions=64,
                     rope_theta=THETA)
    q, k, v = torch.randn(1, 2, 12, D), torch.randn(1, 1, 12, D), torch.randn(1, 1, 12, D)
    v[0, 0, 7] = v[0, 0, 6] * 2
    k[0, 0, 7] = k[0, 0, 6]
    scores = {}
    for flag in (True, False):
        method = build_method("expected_attention", budget_tokens=4, value_norm=flag)
        method._inv_freq = INV_FREQ
        layer = method.make_layer(0, info)
        layer.prompt_open = True
        layer.update(k, v, None)
        layer.attend(None, q, k, v, None, no_attention)
        scores[flag] = layer.score()[0, 0]
    assert torch.allclose(scores[True][7], 2 * scores[True][6])
    assert torch.allclose(scores[False][7], scores[False][6])
    assert torch.allclose(scores[True][4:], scores[False][4:] * v[0, 0, 4:].norm(dim=-1))


def test_engine_compresses_each_prompt_once(tiny_model):
    ids = torch.randint(3, 250, (90,), generator=torch.Generator().manual_seed(2))
    kept = []
    for chunk in (7, 512):
        engine = make_engine(tiny_model, build_method("expected_attention", budget_tokens=20),
                             chunk=chunk)
        with engine.request() as req:
            req.prefill(ids[:80])
            layers = req.cache.kv_layers
            assert [kv.kept_tokens() for kv in layers] == [20] * len(layers)
            assert all(set(range(4)) <= set(p) for kv in layers for p in kv.positions[0].tolist())
            kept.append([kv.positions[0].sort(-1).values.tolist() for kv in layers])
            for t in ids[80:]:
                req.step(t.view(1))
            assert [kv.kept_tokens() for kv in layers] == [30] * len(layers)
    assert kept[0] == kept[1]
