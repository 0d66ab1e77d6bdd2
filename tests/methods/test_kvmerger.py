"""KVMerger: threshold merging sets, protections, pivots and the fixed-sigma Gaussian weights by
hand; H2O's accumulated attention; no budget (the kept size is the threshold's outcome)."""

import math

import pytest
import torch

from kvcore.errors import ConfigError, UnsupportedCombination
from methods import build_method
from methods.kvmerger import gaussian_merge, merging_sets
from methods.model import ModelInfo
from methods.scoring import attention_with_probs
from tests.conftest import make_engine


def no_attention(module, query, keys, values, mask, **kwargs):
    return None, None


def keys_with_cosines(cosines: list[float]) -> torch.Tensor:
    """2-D keys `(1, 1, n, 2)` whose adjacent cosines are `cosines` (angles accumulate)."""
    angles = torch.tensor([0.0] + [math.acos(c) for c in cosines]).cumsum(0)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).view(1, 1, -1, 2) * 3.0


def test_merging_sets_by_threshold_by_hand():
    """By hand: adjacent cosines [.99, .20, .97, .98] at threshold 0.9 -> {0,1} {2,3,4};
    a protected token is a set of its own; a pair merges only if every KV head finds it similar."""
    keys = keys_with_cosines([0.99, 0.2, 0.97, 0.98])
    none = torch.zeros(1, 5, dtype=torch.bool)
    set_id, sets = merging_sets(keys, none, 0.9)
    assert set_id[0, 0].tolist() == [0, 0, 1, 1, 1] and sets == 2
    assert merging_sets(keys, none, 0.975)[0][0, 0].tolist() == [0, 0, 1, 2, 2]
    assert merging_sets(keys, none, 0.999)[1] == 5  # nothing joined
    protect = torch.tensor([[False, False, False, True, False]])
    assert merging_sets(keys, protect, 0.9)[0][0, 0].tolist() == [0, 0, 1, 2, 3]
    two_heads = torch.cat([keys, keys_with_cosines([0.99, 0.2, 0.5, 0.98])], dim=1)
    assert merging_sets(two_heads, none, 0.9)[0][0, 1].tolist() == [0, 0, 1, 2, 2]


def test_gaussian_weights_with_a_fixed_sigma_by_hand():
    """Pivot at distance 0, the two others at distance 1, sigma 2: weights e, 1, e over 1 + 2e with
    e = exp(-1 / 8) (the set's own spread does not set sigma); identical members merge to
    themselves."""
    keys = torch.tensor([[1.0, 0.0], [0.0, 0.0], [-1.0, 0.0]]).view(1, 1, 3, 2)
    values = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]).view(1, 1, 3, 2)
    set_id, pivot = torch.zeros(1, 1, 3, dtype=torch.long), torch.tensor([[[1]]])
    merged_k, merged_v = gaussian_merge(keys, values, set_id, pivot, 1, sigma=2.0)
    e = math.exp(-1 / 8)
    assert torch.allclose(merged_v[0, 0, 0], torch.tensor([e, 1.0]) / (1 + 2 * e))
    assert torch.allclose(merged_k[0, 0, 0], torch.zeros(2), atol=1e-7)  # symmetric members
    same = torch.ones(1, 1, 3, 2)
    assert torch.allclose(gaussian_merge(same, same * 2, set_id, pivot, 1, 5.0)[1],
                          same[:, :, :1] * 2)


def bare_layer(layer_idx=0, layers=2, **knobs):
    info = ModelInfo(num_layers=layers, num_heads=1, num_kv_heads=1, head_dim=2, max_positions=64)
    return build_method("kvmerger", **knobs).make_layer(layer_idx, info)


KEYS = torch.tensor([[1, 0], [1, .1], [.9, .2], [0, 1], [.1, 1], [.2, 1.1], [1, 1], [-1, 0],
                     [0, -1], [.1, -1]])
VALUES = torch.stack([torch.arange(10.0), torch.ones(10)], dim=-1)
SCORES = torch.tensor([.1, .5, .2, .1, .2, .4, .9, .3, .1, .1])  # aggregated attention


def merged_prompt(layer_idx=0, **knobs):
    layer = bare_layer(layer_idx, **{"recent_ratio": 0.2, "heavy_ratio": 0.1, "sigma": 0.1,
                                     **knobs})
    layer.update(KEYS[None, None], VALUES[None, None], None)
    layer.state("attention").copy_(SCORES.view(1, 1, 10))
    layer.on_prefill_end()
    return layer


@pytest.mark.kept_set
def test_prompt_is_merged_as_computed_by_hand():
    """10 tokens, threshold 0.75: adjacent cosines .995 .993 | .22 | .995 .997 .82 | -.71 | 0 | .995;
    the last 2 tokens (20 %: 8 and 9, which would join) and the most attended other token (10 %:
    token 6, which would join {3,4,5}) are never merged. Sets {0,1,2} {3,4,5} {6} {7} {8} {9}; pivots by attention: 1 and 5."""
    layer = merged_prompt()
    assert layer.positions[0, 0].tolist() == [1, 5, 6, 7, 8, 9]
    # sigma 0.1 (2 sigma^2 = 0.02); set {0,1,2} around k1: squared distances .01, 0, .02
    w0 = torch.tensor([math.exp(-0.5), 1.0, math.exp(-1.0)])
    # set {3,4,5} around k5: squared distances .05, .02, 0
    w1 = torch.tensor([math.exp(-2.5), math.exp(-1.0), 1.0])
    w0, w1 = w0 / w0.sum(), w1 / w1.sum()
    expected_k = torch.cat([torch.stack([w0 @ KEYS[0:3], w1 @ KEYS[3:6]]), KEYS[6:]])
    expected_v = torch.cat([torch.stack([w0 @ VALUES[0:3], w1 @ VALUES[3:6]]), VALUES[6:]])
    assert torch.allclose(layer.keys[0, 0], expected_k, atol=1e-6)
    assert torch.allclose(layer.values[0, 0], expected_v, atol=1e-6)
    # no budget: what remains is the outcome, and decode appends one token per step
    assert layer.allowed_tokens() == 6 == layer.budget()
    layer.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), None)
    layer.after_forward()
    assert layer.kept_tokens() == 7 == layer.allowed_tokens()
    assert layer.positions[0, 0].tolist() == [1, 5, 6, 7, 8, 9, 10]


def test_unprotected_heavy_hitter_joins_and_the_last_layer_stays_unmerged():
    layer = merged_prompt(heavy_ratio=0.0)  # token 6 no longer protected: {3,4,5,6}, pivot 6
    assert layer.positions[0, 0].tolist() == [1, 6, 7, 8, 9]
    last = merged_prompt(layer_idx=1)  # the model's last layer (unmerged_last_layers=1)
    assert last.positions[0, 0].tolist() == list(range(10)) and last.allowed_tokens() == 10
    assert torch.equal(last.keys[0, 0], KEYS)


def test_attention_accumulates_over_every_prompt_query():
    """H2O's aggregated attention: column sums of every prompt row, whatever the chunking."""
    torch.manual_seed(0)
    info = ModelInfo(num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, max_positions=64)
    keys, values, query = torch.randn(1, 1, 12, 4), torch.randn(1, 1, 12, 4), torch.randn(1, 2, 12, 4)
    _, probs = attention_with_probs(query, keys, values, None, 0.5)
    want = probs.sum(2).mean(1, keepdim=True)  # (1, 1, 12): rows summed, group mean
    layer = build_method("kvmerger").make_layer(0, info)
    layer.prompt_open = True  # the engine's open_prompt: a prompt is being fed (runner dense)
    for start, stop in [(0, 5), (5, 12)]:
        k, v = layer.update(keys[:, :, start:stop], values[:, :, start:stop], None)
        layer.attend(None, query[:, :, start:stop], k, v, None, no_attention, scaling=0.5)
    assert torch.allclose(layer.state("attention"), want, atol=1e-6)


def test_kept_size_is_the_threshold_outcome_end_to_end(tiny_model):
    """Every merged layer keeps what its threshold left (reported, granted, then grows by one per
    decode step); a lower threshold merges more; the last layer is never merged."""
    ids = torch.arange(3, 63)
    kept = {}
    for threshold in (0.5, 0.0):
        method = build_method("kvmerger", similarity_threshold=threshold)
        engine = make_engine(tiny_model, method, chunk=16)
        with engine.request() as req:
            req.prefill(ids)
            layers = req.cache.kv_layers
            kept[threshold] = [kv.kept_tokens() for kv in layers]
            assert kept[threshold][-1] == 60  # tiny_model has 2 layers: the last unmerged
            assert [kv.allowed_tokens() for kv in layers] == kept[threshold]
            req.step(ids[:1])
            assert [kv.kept_tokens() for kv in layers] == [n + 1 for n in kept[threshold]]
    assert kept[0.0][0] < kept[0.5][0] <= 60


def test_budget_knobs_are_refused():
    """No budget: a sweep over budget_ratio skips kvmerger (the shared knobs arrive as null)."""
    for knob in ({"budget_ratio": 0.5}, {"budget_tokens": 100}):
        with pytest.raises(UnsupportedCombination, match="has no such knob"):
            build_method("kvmerger", **knob)
    assert build_method("kvmerger", budget_ratio=None).similarity_threshold == 0.75


@pytest.mark.parametrize("key, value", [("similarity_threshold", 1.5), ("recent_ratio", -0.1),
                                        ("sigma", 0.0), ("unmerged_last_layers", -1)])
def test_bad_config_names_the_key(key, value):
    with pytest.raises(ConfigError, match=f"method.{key}="):
        build_method("kvmerger", **{key: value})


def test_refused_where_no_prompt_ends():
    from harness.config.runner import protocol_reasons
    from methods.protocol import Protocol
    from tasks import build_task

    info = ModelInfo(num_layers=4, num_heads=2, num_kv_heads=2, head_dim=8, max_positions=64)
    reasons = protocol_reasons(build_method("kvmerger"), build_task("perplexity", mode="streaming"),
                               info, Protocol())
    assert any("compresses only over a prefilled prompt" in r for r in reasons)
