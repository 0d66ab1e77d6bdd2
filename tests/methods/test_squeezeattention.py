"""SqueezeAttention: the clustering and allocation by hand, the similarity seam against the model's
own hidden states, per-layer budgets end to end, capabilities and bad configs."""

import pytest
import torch
import torch.nn.functional as F

from harness.core import hf_adapter
from harness.config.runner import protocol_reasons
from kvcore.errors import ConfigError
from methods import build_method
from methods.protocol import Protocol
from methods.squeezeattention import budget_factors, kmeans_1d
from tasks import build_task
from tests.conftest import make_engine
from tests.methods.contract.rules import kept_after_crafted_compression
from tests.models import family_config


def test_allocation_by_hand():
    """By hand: L = 6, ini = 0.4, p = 0.2 (low_group_ratio 0.5), c = [.20 .50 .52 .90 .92
    .95] -> clusters {0} {1,2} {3,4,5}; a = (2.4 - 0.6)/3 = 0.6; n = 1000 -> caps [600 x3,
    200 x3]."""
    c = [0.20, 0.50, 0.52, 0.90, 0.92, 0.95]
    centres = kmeans_1d(c, 3)
    assert centres[0] == 0.20 and centres[1] == centres[2] == pytest.approx(0.51)
    assert centres[3] == centres[4] == centres[5] == pytest.approx(0.9233333)
    method = build_method("squeezeattention", budget_ratio=0.4, low_group_ratio=0.5)
    caps = [method.layer_tokens(f, 1000) for f in budget_factors(c, 0.5)]
    assert caps == [600, 600, 600, 200, 200, 200]
    tokens = build_method("squeezeattention", budget_tokens=40, low_group_ratio=0.25)
    assert [tokens.layer_tokens(f, 1000) for f in budget_factors(c, 0.25)] == [70] * 3 + [10] * 3
    assert budget_factors([0.7, 0.7, 0.7, 0.7], 0.5) == [1.0] * 4  # one centre: uniform
    assert budget_factors([0.1, 0.9], 0.5) == [1.5, 0.5]  # fewer layers than clusters


def test_kmeans_is_the_least_squares_optimum():
    torch.manual_seed(0)
    values = torch.rand(9).tolist()
    centres = kmeans_1d(values, 3)
    best = sum((v - c) ** 2 for v, c in zip(values, centres))
    ordered = sorted(values)
    for i in range(1, 8):  # every split of the sorted values into 3 runs
        for j in range(i + 1, 9):
            parts = [ordered[:i], ordered[i:j], ordered[j:]]
            sse = sum(sum((v - sum(p) / len(p)) ** 2 for v in p) for p in parts)
            assert best <= sse + 1e-12


def test_similarity_seam_matches_the_models_hidden_states(stories, monkeypatch):
    """c_l = mean cos(x_in, x_mid), x_mid the residual stream after attention, read here
    independently as the input of each layer's pre-MLP norm (Llama), reaches the clustering."""
    from methods import squeezeattention

    model, tok = stories
    ids = torch.tensor(tok("Once upon a time there was a little dog. " * 8)["input_ids"][:64])
    seen, clustered = {}, []

    def keep(key):
        def hook(module, args, kwargs):
            seen[key] = kwargs.get("hidden_states", args[0] if args else None)
        return hook

    pre_hooks = sum(len(d._forward_pre_hooks) for d in hf_adapter.decoder_layers(model))
    hooks = []
    for i, decoder in enumerate(hf_adapter.decoder_layers(model)):
        hooks.append(decoder.register_forward_pre_hook(keep(("in", i)), with_kwargs=True))
        hooks.append(decoder.post_attention_layernorm.register_forward_pre_hook(
            keep(("mid", i)), with_kwargs=True))
    original = squeezeattention.budget_factors
    monkeypatch.setattr(squeezeattention, "budget_factors",
                        lambda c, low: clustered.append(c) or original(c, low))
    engine = make_engine(model, build_method("squeezeattention", budget_tokens=16), tok, chunk=64)
    try:
        with engine.request() as req:
            req.prefill(ids)
    finally:
        for h in hooks:
            h.remove()
    layers = len(hf_adapter.decoder_layers(model))
    expected = [float(F.cosine_similarity(seen["in", i].float(), seen["mid", i].float(),
                                          dim=-1).mean()) for i in range(layers)]
    assert len(clustered) == 1 and clustered[0] == pytest.approx(expected, abs=1e-5)
    assert sum(len(d._forward_pre_hooks) for d in hf_adapter.decoder_layers(model)) == pre_hooks


def test_layers_keep_their_squeezed_budget(stories):
    model, tok = stories
    ids = torch.tensor(tok("Once upon a time there was a little dog. " * 20)["input_ids"][:200])
    method = build_method("squeezeattention", budget_ratio=0.2, low_group_ratio=0.5)
    engine = make_engine(model, method, tok, chunk=64)
    with engine.request() as req:
        req.prefill(ids[:150])
        layers = req.cache.kv_layers
        factors = [x.budget_factor for x in layers]
        assert sorted(set(factors)) != [1.0] and 0.5 in factors  # really squeezed
        assert sum(factors) == pytest.approx(len(layers))  # the same total
        assert [x.kept_tokens() for x in layers] == [int(f * 0.2 * 150) for f in factors]
        for t in ids[150:160]:
            req.step(t.view(1))
        # the budget basis is the prompt's length (runner.budget_basis=final): H2O inside holds it
        assert [x.kept_tokens() for x in layers] == [int(f * 0.2 * 150) for f in factors]


@pytest.mark.parametrize("scorer", ["h2o", "streaming_llm"])
def test_uniform_allocation_equals_the_scorer_alone(tiny_model, scorer):
    """low_group_ratio = 1: every layer keeps the uniform budget, exactly as the scorer with a full
    prefill compressed at its end (the scorer with one prompt chunk acts at the same moment)."""
    ids = torch.arange(3, 60)
    out = []
    for method in (build_method("squeezeattention", budget_tokens=12, low_group_ratio=1.0,
                                scorer=scorer),
                   build_method(scorer, budget_tokens=12)):
        engine = make_engine(tiny_model, method, chunk=64)
        with engine.request() as req:
            logits = [req.prefill(ids[:50])] + [req.step(t.view(1)) for t in ids[50:]]
            out.append((torch.cat(logits, 1), [kv.positions.clone() for kv in req.cache.kv_layers]))
    assert torch.allclose(out[0][0], out[1][0], atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))


def test_capabilities_follow_the_scorer():
    info = hf_adapter.model_info(family_config("llama"))
    h2o = build_method("squeezeattention")
    snap = build_method("squeezeattention", scorer="snapkv", scorer_options={"window_tokens": 8})
    assert h2o.capabilities.acts_during_decode and not snap.capabilities.acts_during_decode
    assert snap.inner.window_tokens == 8
    streaming_llm = build_method("squeezeattention", scorer="streaming_llm")
    assert streaming_llm.needs_rope() and streaming_llm.needs_prepare()
    assert not h2o.needs_rope()  # needs_prepare follows the scorer (H2O records its kernel)
    assert h2o.needs_prepare() == build_method("h2o").needs_prepare()
    streaming = build_task("perplexity", mode="streaming")
    for method in (h2o, snap):  # the allocation needs a prompt
        assert any("compresses only over a prefilled prompt" in r
                   for r in protocol_reasons(method, streaming, info, Protocol()))
        assert any("runner.prefill=sparse" in r for r in protocol_reasons(
            method, build_task("perplexity", mode="chunked"), info, Protocol(prefill="sparse")))


@pytest.mark.parametrize("settings, key", [
    ({"scorer": "quest"}, "method.scorer="),
    ({"low_group_ratio": 0.0}, "method.low_group_ratio="),
    ({"scorer_options": {"recent_ratio": 2.0}}, "method.scorer_options.recent_ratio="),
    ({"scorer_options": {"budget_tokens": 3}}, "method.scorer_options sets a budget"),
])
def test_bad_config_names_the_key(settings, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_method("squeezeattention", **settings)


def test_eager_equals_sdpa_with_per_layer_budgets(stories):
    """Layers hold different numbers of keys: on eager attention each rebuilds its own mask (the
    model's is sized for layer 0), so both attentions give the same logits."""
    model, tok = stories
    ids = torch.tensor(tok("Once upon a time there was a little dog. " * 10)["input_ids"][:90])
    out = []
    for attn in ("sdpa", "eager"):
        hf_adapter.set_attention(model, attn)
        try:
            engine = make_engine(model, build_method("squeezeattention", budget_ratio=0.3), tok,
                                 chunk=32)
            with engine.request() as req:
                logits = [req.prefill(ids[:70])] + [req.step(t.view(1)) for t in ids[70:]]
                assert len({kv.kept_tokens() for kv in req.cache.kv_layers}) > 1
        finally:
            hf_adapter.set_attention(model, "sdpa")
        out.append(torch.cat(logits, 1))
    assert torch.allclose(out[0], out[1], atol=1e-4)


@pytest.mark.kept_set
@pytest.mark.parametrize("factor, expected", [
    (0.5, [14, 17, 18, 19]),  # 4 tokens: H2O's recent half (18, 19) + the top 2 (17, 14)
    (1.5, [2, 5, 8, 10, 11, 13, 14, 15, 16, 17, 18, 19]),  # 12: the recent 6 + the top 6
])
def test_kept_set_by_hand(factor, expected):
    """The H2O scorer inside, uniform budget 8: a layer of factor f keeps int(8 f) tokens, half
    of them the most recent (recent_ratio 0.5), the rest the highest of 20 tokens scored 7p mod
    20 (17, 14, 11, 8, 5, 2, 16, 13, 10 at 19, 18, 17, 16, 15, 14, 12, 11, 10)."""
    scores = (torch.arange(20.0) * 7 % 20)[None, None]
    method = build_method("squeezeattention", budget_tokens=8, scorer="h2o")

    def factored(layer):
        layer.budget_factor = factor
    kept = kept_after_crafted_compression(method, scores, setup=factored)
    assert kept == [expected]
