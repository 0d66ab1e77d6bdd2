"""Fidelity diagnostics: recall 1 / KL 0 for the full cache, less for lossy methods."""

import json

import torch

from methods import build_method
from harness.core.engine import Engine, EngineSettings
from harness.core import hf_adapter


def diag_run(model, method, ids, every=4):
    info = hf_adapter.model_info(model.config)
    hf_adapter.prepare(method, model, None)
    engine = Engine(model, None, method, info, EngineSettings(diagnostics_every=every))
    with engine.request() as req:
        req.prefill(ids[:20])
        for t in range(20, ids.numel()):
            req.step(ids[t:t + 1])
    return engine.diagnostics.summary(), engine


def test_full_cache_has_perfect_recall_and_zero_kl(tiny_model):
    ids = torch.randint(3, 250, (60,), generator=torch.Generator().manual_seed(0))
    summary, _ = diag_run(tiny_model, build_method("full"), ids)
    assert summary["steps_sampled"] == 10
    assert abs(summary["attention_recall_mean"] - 1) < 1e-5 and summary["kl_max"] < 1e-6


def test_lossy_methods_lose_mass_and_oracle_keeps_most(stories):
    model, tok = stories
    ids = torch.tensor(tok("Once upon a time there was a little girl. She liked to play. " * 8)
                       ["input_ids"][:120])
    oracle, _ = diag_run(model, build_method("oracle_topk", budget_tokens=16), ids)
    h2o, _ = diag_run(model, build_method("h2o", budget_tokens=16), ids)
    window, engine = diag_run(model, build_method("streaming_llm", sink_tokens=0, window_tokens=16), ids)
    for s in (oracle, h2o, window):
        assert 0 < s["attention_recall_mean"] < 1 and s["kl_mean"] > 0
    # the exact top-k is the best possible selection at a budget: most mass, per step
    assert oracle["attention_recall_mean"] > h2o["attention_recall_mean"]
    assert oracle["attention_recall_mean"] > window["attention_recall_mean"]
    arrays = engine.diagnostics.arrays()
    assert len(arrays["attention_recall_per_layer_head"]) == 5  # layers
    assert len(arrays["attention_recall_per_layer_head"][0]) == 8  # query heads
    json.dumps(arrays)


def test_recall_skips_a_ragged_heads_padding():
    """kept_positions of ragged heads pads with -1: no mass is counted for it."""
    from harness.core.diagnostics import _recall

    probs = torch.tensor([0.1, 0.2, 0.3, 0.4]).view(1, 1, 1, 4).expand(1, 2, 1, 4)
    positions = torch.tensor([[[3, 1, -1], [0, 2, 3]]])  # head 0 holds 2 tokens, head 1 three
    assert torch.allclose(_recall(probs, positions), torch.tensor([0.6, 0.8]))
