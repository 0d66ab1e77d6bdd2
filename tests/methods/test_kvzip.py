"""KVzip: scores from the model reconstructing the prompt, max attention of the repeat queries."""

import pytest
import torch

from methods import build_method
from methods.base import ModelInfo
from methods.kvzip import chunk_scores
from tests.conftest import make_engine


def hand_scores(query, keys, start, end, sinks):
    """The official rule with loops: each reconstruction query row i (head h) attends over the
    sinks, the chunk and the reconstruction keys up to itself (softmax, 1/sqrt(d)); a chunk
    token's score is its largest attention over rows and the heads of its KV head."""
    h_q, m, d = query.shape
    n = keys.shape[1] - m
    g = h_q // keys.shape[0]
    out = torch.zeros(keys.shape[0], end - start)
    for kv in range(keys.shape[0]):
        for h in range(kv * g, (kv + 1) * g):
            for i in range(m):
                cols = list(range(sinks)) + list(range(start, end)) + list(range(n, n + i + 1))
                p = torch.softmax(keys[kv, cols] @ query[h, i] / d ** 0.5, 0)
                out[kv] = torch.maximum(out[kv], p[sinks:sinks + end - start])
    return out


def test_chunk_scores_equal_a_hand_computation():
    torch.manual_seed(0)
    n, m, d = 12, 5, 4
    query, keys = torch.randn(4, m, d), torch.randn(2, n + m, d)
    for start, end, sinks in [(0, 6, 0), (6, 12, 2)]:
        got = chunk_scores(query[None], keys[None], start, end, sinks)[0]
        assert torch.allclose(got, hand_scores(query, keys, start, end, sinks), atol=1e-6)


def full_forward_queries(model, ids):
    """Every layer's queries and keys of the last forward of a full-cache request fed `ids`."""
    engine = make_engine(model, build_method("full"))
    seen = {}
    with engine.request() as req:
        for kv in req.cache.kv_layers:
            def spy(module, query, keys, values, mask, base, kv=kv, attend=kv.attend, **kw):
                seen[kv.layer_idx] = query.clone(), keys.clone()
                return attend(module, query, keys, values, mask, base, **kw)
            kv.attend = spy
        req.prefill(ids)
    return seen


def test_reconstruction_forward_equals_prompt_then_repeat(tiny_model):
    """The reconstruction forward over the held prompt gives each layer the queries a plain
    forward of prompt + instruction + answer prefix + prompt would give (same positions, same
    causal mask), so the scores equal chunk_scores of those; the cache is left untouched."""
    ids = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(1))
    method = build_method("kvzip", budget_tokens=10, chunk_tokens=100)
    engine = make_engine(tiny_model, method)
    first, _, answer, _ = method._prompts
    repeat = torch.cat([first, answer, ids])
    with engine.request() as req:
        req.prefill(ids, prompt_ends=False)  # held whole, not yet compressed
        layers = req.cache.kv_layers
        before = [kv.keys.clone() for kv in layers]
        method.reconstruct(layers[0])
        assert all(torch.equal(kv.keys, k) for kv, k in zip(layers, before))
        assert layers[0].facts() == {"reconstruction_tokens": float(repeat.numel()),
                                     "reconstruction_ms": layers[0].facts()["reconstruction_ms"]}
        got = [kv.kvzip_scores.clone() for kv in layers]
    reference = full_forward_queries(tiny_model, torch.cat([ids, repeat]))
    m = repeat.numel()
    for i, scores in enumerate(got):
        query, keys = reference[i]
        expected = chunk_scores(query[:, :, -m:], keys, 0, 40, 0)
        assert torch.allclose(scores, expected, atol=1e-5), i


def test_chunks_and_instructions(tiny_model):
    """Later chunks quote the previous chunk's last 8 tokens after their own instruction, each
    chunk is fed at the positions after the prompt; the prompt is compressed to the top scores
    and the sinks (pair level: the layer's budget split over its heads)."""
    ids = torch.randint(3, 250, (50,), generator=torch.Generator().manual_seed(2))
    method = build_method("kvzip", budget_tokens=12, chunk_tokens=20)
    engine = make_engine(tiny_model, method)
    calls = []
    forward = method._forward
    method._forward = lambda m, repeat, start: (calls.append((repeat, start)), forward(m, repeat, start))
    first, later, answer, _ = method._prompts
    with engine.request() as req:
        req.prefill(ids)
        layers = req.cache.kv_layers
        assert [kv.kept_tokens() for kv in layers] == [12] * len(layers)  # the per-head mean
        assert all(set(range(4)) <= set(p) for kv in layers for p in kv.kept_positions()[0].tolist())
    expected = [torch.cat([first, answer, ids[:20]]),
                torch.cat([later, ids[12:20], answer, ids[20:40]]),
                torch.cat([later, ids[32:40], answer, ids[40:50]])]
    assert [start for _, start in calls] == [50, 50, 50]
    assert all(torch.equal(r, e) for (r, _), e in zip(calls, expected))


def test_a_chat_system_prompt_is_kept_whole_and_not_reconstructed(tiny_model):
    """A prompt starting with the template's system prompt (the official evict range starts
    after it): it is kept whole, and the reconstruction repeats only what follows it."""
    ids = torch.randint(3, 250, (50,), generator=torch.Generator().manual_seed(3))
    method = build_method("kvzip", budget_tokens=12, chunk_tokens=100)
    engine = make_engine(tiny_model, method)
    first, later, answer, _ = method._prompts
    method._prompts = first, later, answer, ids[:6]
    calls = []
    forward = method._forward
    method._forward = lambda m, repeat, start: (calls.append(repeat), forward(m, repeat, start))
    with engine.request() as req:
        req.prefill(ids)
        kept = [set(p) for kv in req.cache.kv_layers for p in kv.kept_positions()[0].tolist()]
    assert all(set(range(6)) <= k for k in kept)
    assert len(calls) == 1 and torch.equal(calls[0], torch.cat([first, answer, ids[6:]]))
    # kvpress's treatment: only the first 4 kept whatever; the rest of it (never reconstructed)
    # scores 0, so some of it goes at a budget below the prompt's scored tokens
    method = build_method("kvzip", budget_tokens=12, chunk_tokens=100, system_prompt="sinks")
    engine = make_engine(tiny_model, method)
    method._prompts = first, later, answer, ids[:6]
    with engine.request() as req:
        req.prefill(ids)
        kept = [set(p) for kv in req.cache.kv_layers for p in kv.kept_positions()[0].tolist()]
    assert all(set(range(4)) <= k for k in kept) and not all(set(range(6)) <= k for k in kept)


@pytest.mark.kept_set
@pytest.mark.parametrize("level, kept", [
    # pair: the layer's 2 x 3 slots go to its top scores over both heads: the two sinks, then
    # .9 .8 .7 (head 0) and .6 (head 1): head 0 keeps four tokens, head 1 two
    ("pair", [[0, 1, 3, 4], [0, 5]]),
    # pair-uniform: each head its own top 3, the sink included
    ("pair-uniform", [[0, 1, 3], [0, 5, 7]]),
])
def test_kept_set_by_hand(level, kept):
    info = ModelInfo(num_layers=2, num_heads=2, num_kv_heads=2, head_dim=2, max_positions=16)
    method = build_method("kvzip", budget_tokens=3, sink_tokens=1, level=level)
    layer = method.make_layer(1, info)  # layer 0 would start a reconstruction forward
    keys = torch.randn(1, 2, 8, 2, generator=torch.Generator().manual_seed(0))
    layer.prompt_open = True
    layer.update(keys, keys, None)
    layer.after_forward()
    layer.prompt_open = False
    layer.kvzip_scores = torch.tensor([[[0.0, .9, .1, .8, .7, .05, .3, .01],
                                        [0.0, .15, .2, .02, .03, .6, .04, .5]]])
    layer.on_prefill_end()
    assert [sorted(p for p in row.tolist() if p >= 0) for row in layer.kept_positions()[0]] == kept
