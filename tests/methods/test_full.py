"""The full cache equals transformers itself: prefill and every decode step."""

import pytest
import torch

from harness.core import hf_adapter
from methods import build_method
from tests.conftest import make_engine
from tests.helpers.reference import engine_logits, hf_incremental


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("which", ["tiny", "stories"])
def test_full_equals_transformers(which, attn, request):
    model = request.getfixturevalue("tiny_model" if which == "tiny" else "stories")
    model = model if which == "tiny" else model[0]
    hf_adapter.set_attention(model, attn)
    try:
        torch.manual_seed(1)
        ids = torch.randint(3, min(model.config.vocab_size, 500), (1, 96))
        # chunked prefill (37-token chunks over a growing cache), then 16 decode steps
        got = engine_logits(model, ids, prefill_end=80, chunk=37)
        ref = hf_incremental(model, ids, splits=[37, 74, 80] + list(range(81, 96)))
        assert (got - ref).abs().max().item() <= 1e-5
        # against one cache-less forward of the whole sequence: fp32 summation-order noise only
        with torch.no_grad():
            whole = model(input_ids=ids).logits
        scale = whole.abs().max().item()
        assert (got - whole).abs().max().item() <= 2e-6 * max(scale, 1.0) + 1e-5
    finally:
        hf_adapter.set_attention(model, "sdpa")


def test_full_has_no_budget_and_counts_bytes(tiny_model):
    engine = make_engine(tiny_model, build_method("full"))
    with engine.request() as req:
        req.prefill(torch.arange(3, 53))
    sample = engine.ledger.samples[-1]
    cfg = tiny_model.config
    per_layer = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 50 * 4
    assert sample["tokens_per_layer"] == [50] * cfg.num_hidden_layers
    assert sample["bytes_per_layer"] == [per_layer] * cfg.num_hidden_layers
    assert sample["budget_per_layer"] == [None] * cfg.num_hidden_layers
    assert engine.ledger.summary()["held_ratio"] == 1.0


def test_unknown_hyperparameter_is_rejected():
    from kvcore.errors import ConfigError, UnsupportedCombination

    with pytest.raises(ConfigError, match="method.window_tokens is not a hyperparameter"):
        build_method("full", window_tokens=3)
    # a shared sweep knob (conf/method/_shared.yaml): refused as a combination, not a typo
    with pytest.raises(UnsupportedCombination, match="method=full does not take method.budget_tokens"):
        build_method("full", budget_tokens=3)
    assert build_method("full", budget_tokens=None).name == "full"  # null = not set
