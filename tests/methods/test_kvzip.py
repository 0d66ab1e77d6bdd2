"""KVzip: scores from the model reconstructing the prompt, max attention of the repeat queries."""

import pytest
import torch

from methods import build_method
from methods.kvzip import chunk_scores
from methods.model import ModelInfo
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


def official_threshold(scores, ratio, context_tokens):
    """The official `_threshold` over head scores spread over a context (`load_head_score`):
    sort every (layer, head, token) score, threshold at index int(N x ratio) - 1, keep >."""
    spread = scores[:, :, None].expand(-1, -1, context_tokens).double()
    order = torch.sort(spread.reshape(-1), descending=True).values
    threshold = order[max(int(order.numel() * ratio) - 1, 0)]
    return (spread > threshold).all(-1)


@pytest.mark.parametrize("ratio", [0.1, 0.3, 0.5, 0.6, 0.75, 0.9])
def test_head_level_keeps_the_heads_of_the_official_threshold(ratio):
    from methods.kvzip import official_kept_heads

    scores = torch.rand(6, 5, generator=torch.Generator().manual_seed(1))
    for context in (1000, 4096):
        assert torch.equal(official_kept_heads(scores, ratio),
                           official_threshold(scores, ratio, context)), (ratio, context)


@pytest.mark.kept_set
@pytest.mark.parametrize("ratio, kept", [
    # 4 heads, r = 0.75: the official threshold keeps the top ceil(3) - 1 = 2 heads, (0, 0) at
    # .9 and (1, 1) at .7: layer 1's head 0 keeps its sink only, head 1 everything
    (0.75, [[0], list(range(8))]),
    # r = 0.5: the top ceil(2) - 1 = 1 head, (0, 0): layer 1 keeps the sinks only
    (0.5, [[0], [0]]),
])
def test_head_level_kept_set_by_hand(ratio, kept):
    info = ModelInfo(num_layers=2, num_heads=2, num_kv_heads=2, head_dim=2, max_positions=16)
    method = build_method("kvzip", budget_ratio=ratio, sink_tokens=1, level="head")
    method.set_head_scores(torch.tensor([[.9, .1], [.5, .7]]))
    layer = method.make_layer(1, info)
    layer.final_tokens = 8  # the budget basis: the prompt (set by the engine when fed)
    keys = torch.randn(1, 2, 8, 2, generator=torch.Generator().manual_seed(0))
    layer.prompt_open = True
    layer.update(keys, keys, None)
    layer.after_forward()
    layer.prompt_open = False
    layer.kvzip_scores = method._head_scores[1][None, :, None].expand(1, 2, 8).clone()
    layer.on_prefill_end()
    assert [sorted(p for p in row.tolist() if p >= 0) for row in layer.kept_positions()[0]] == kept
    # its budget: the kept heads' tokens plus the others' sinks, per-head mean
    assert layer.kept_tokens() <= layer.budget() == -(-(len(kept[1]) + 1) // 2)


def test_head_level_from_an_official_score_file_runs_without_reconstruction(tiny_model,
                                                                            tmp_path):
    """Head scores from a file (the official format: a (layers, KV heads) tensor; a folder: the
    maximum over its files): no reconstruction forward; kept heads hold the whole prompt,
    evicted heads their sinks, both then every generated token."""
    from harness.core import hf_adapter

    info = hf_adapter.model_info(tiny_model.config)
    shape = (info.num_layers, info.num_kv_heads)
    low = torch.zeros(shape)
    high = torch.zeros(shape)
    high[0, 0] = high[1, 1] = 1.0
    torch.save(low, tmp_path / "a.pt")
    torch.save(high, tmp_path / "b.pt")
    method = build_method("kvzip", budget_ratio=0.75, sink_tokens=2, level="head",
                          head_scores_path=str(tmp_path))
    engine = make_engine(tiny_model, method)
    method._forward = None  # a reconstruction forward would fail
    ids = torch.randint(3, 250, (30,), generator=torch.Generator().manual_seed(4))
    with engine.request() as req:
        req.generate(ids, 4, set())
        lengths = [kv.kept_lengths()[0].tolist() if kv.kept_lengths() is not None
                   else [kv.kept_tokens()] * 2 for kv in req.cache.kv_layers]
    # r L H = 3 -> 2 heads kept: (0, 0) and (1, 1); 30 prompt tokens, 3 decoded rows appended
    assert lengths == [[33, 5], [5, 33]]
    assert engine.ledger.samples[-1]["method_facts"]["reconstruction_tokens"] == 0.0


def test_head_level_refusals(tiny_model, tmp_path):
    from harness.core import hf_adapter
    from kvcore.errors import ConfigError

    info = hf_adapter.model_info(tiny_model.config)
    with pytest.raises(ConfigError, match="budget_tokens=8 with method.level=head"):
        build_method("kvzip", budget_tokens=8, level="head")
    with pytest.raises(ConfigError, match="head_scores_path=.* applies to method.level=head"):
        build_method("kvzip", head_scores_path=str(tmp_path))
    torch.save(torch.zeros(5, 1), tmp_path / "wrong.pt")
    method = build_method("kvzip", level="head", head_scores_path=str(tmp_path / "wrong.pt"))
    reasons = method.validate(info, {})
    assert any("shape (5,)" in r and "(layers x KV heads)" in r for r in reasons), reasons
