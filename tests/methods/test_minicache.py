"""MiniCache: SLERP and retention by hand, the merged store restored in attention, the byte
accounting, and a real model's pairs."""

import math

import pytest
import torch

from kvcore.errors import ConfigError
from methods import build_method
from methods.minicache import slerp_merge
from methods.model import ModelInfo
from tests.conftest import make_engine


def test_slerp_by_hand():
    """By hand: x = (1, 0) (upper), y = (0, 1) (lower), t = 0.6 -> e = (sin .3pi,
    sin .2pi), unit; delta = 1/2; magnitudes kept exactly."""
    upper = torch.tensor([2.0, 0.0]).view(1, 1, 1, 2)
    lower = torch.tensor([0.0, 3.0]).view(1, 1, 1, 2)
    direction, norms, delta = slerp_merge(upper, lower, 0.6)
    assert torch.allclose(direction[0, 0, 0], torch.tensor([math.sin(0.3 * math.pi),
                                                            math.sin(0.2 * math.pi)]))
    assert norms[0, 0, 0].tolist() == [3.0, 2.0] and delta.item() == pytest.approx(0.5)
    same, _, zero = slerp_merge(upper, upper * 5, 0.6)  # parallel: the common direction
    assert torch.allclose(same[0, 0, 0], torch.tensor([1.0, 0.0])) and zero.item() < 1e-3


def test_merging_commutes_with_a_shared_rotation():
    """RoPE rotates a token by the same angle in both layers: merging rotated vectors equals
    rotating the merged direction."""
    torch.manual_seed(0)
    upper, lower = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    angle = torch.tensor(0.7)
    plane = torch.tensor([[angle.cos(), -angle.sin()], [angle.sin(), angle.cos()]])
    rot = torch.block_diag(plane, plane)
    merged, norms, delta = slerp_merge(upper, lower, 0.6)
    rotated, norms_r, delta_r = slerp_merge(upper @ rot.T, lower @ rot.T, 0.6)
    assert torch.allclose(rotated, merged @ rot.T, atol=1e-5)
    assert torch.allclose(norms, norms_r, atol=1e-5) and torch.allclose(delta, delta_r, atol=1e-4)


def pair(retain_ratio=0.25, d=4, heads=1):
    info = ModelInfo(num_layers=2, num_heads=heads, num_kv_heads=heads, head_dim=d,
                     max_positions=64)
    method = build_method("minicache", start_layer_ratio=0.0, retain_ratio=retain_ratio)
    lower, upper = method.make_layer(0, info), method.make_layer(1, info)
    lower.next_layer = upper
    assert (lower.role, upper.role) == ("lower", "upper")
    return lower, upper


def feed(lower, upper, k_lo, v_lo, k_up, v_up):
    seen_lo = lower.update(k_lo, v_lo, None)
    seen_up = upper.update(k_up, v_up, None)
    return seen_lo, seen_up


@pytest.mark.kept_set
def test_prompt_is_merged_and_restored_as_computed_by_hand():
    """8 tokens, gamma = 0.25: the two tokens whose layers disagree most are retained bit-exactly
    in both layers, the others come back as each layer's magnitude x the shared SLERP direction."""
    torch.manual_seed(1)
    k_lo = torch.randn(1, 1, 8, 4)
    k_up = k_lo + 0.05 * torch.randn(1, 1, 8, 4)
    k_up[0, 0, 3] = -k_lo[0, 0, 3]  # opposite: delta = 1
    k_up[0, 0, 6] = torch.tensor([k_lo[0, 0, 6, 1], -k_lo[0, 0, 6, 0], k_lo[0, 0, 6, 3],
                                  -k_lo[0, 0, 6, 2]])  # orthogonal: delta = 1/2
    v_lo, v_up = k_lo * 2, k_up * 2
    lower, upper = pair()
    feed(lower, upper, k_lo[:, :, :5], v_lo[:, :, :5], k_up[:, :, :5], v_up[:, :, :5])
    lower.after_forward(), upper.after_forward()  # before the prompt ends nothing is merged
    feed(lower, upper, k_lo[:, :, 5:], v_lo[:, :, 5:], k_up[:, :, 5:], v_up[:, :, 5:])
    lower.on_prefill_end(), upper.on_prefill_end()
    assert upper.merged_tokens == 8 and lower.kept_tokens() == upper.kept_tokens() == 8
    assert sorted(upper.retained["k_at"].tolist()) == [3, 6]
    for side, exact in ((0, k_lo), (1, k_up)):
        restored = upper.restore("k", side)[0, 0]
        assert torch.equal(restored[[3, 6]], exact[0, 0, [3, 6]])
        for t in (0, 1, 2, 4, 5, 7):
            x, y = k_up[0, 0, t], k_lo[0, 0, t]
            omega = torch.arccos(torch.dot(x / x.norm(), y / y.norm()).clamp(-1, 1))
            e = (torch.sin(0.4 * omega) * y / y.norm() + torch.sin(0.6 * omega) * x / x.norm())
            e = e / torch.sin(omega)
            assert torch.allclose(restored[t], exact[0, 0, t].norm() * e / e.norm(), atol=1e-5)
    # a decode step: attention sees restored past + the new token; a token closer than every
    # merged prompt token is merged, one beyond them retained
    new_lo, new_up = torch.randn(1, 1, 1, 4), None
    new_up = -new_lo
    (k_seen, _), _ = feed(lower, upper, new_lo, new_lo, new_up, new_up)
    assert k_seen.shape[2] == 9 and torch.equal(k_seen[0, 0, 3], k_lo[0, 0, 3])
    lower.after_forward()
    assert upper.merged_tokens == 9 and 8 in upper.retained["k_at"].tolist()
    feed(lower, upper, k_lo[:, :, :1], v_lo[:, :, :1], k_lo[:, :, :1], v_lo[:, :, :1])
    lower.after_forward()
    assert upper.merged_tokens == 10 and 9 not in upper.retained["k_at"].tolist()


def test_bytes_count_shared_directions_once():
    """Per tensor: T*d shared + 2T magnitudes + 2 x retained * d, fp32, plus int64 indices."""
    d = 16
    lower, upper = pair(retain_ratio=0.25, d=d, heads=2)
    x = torch.randn(1, 2, 8, d)
    feed(lower, upper, x, x, x + 0.1, x + 0.1)
    lower.on_prefill_end()
    retained = 2 * 2  # ceil(.25 * 8) per head, 2 heads
    per_kind = (2 * 8 * d + 2 * 2 * 8 + 2 * retained * d) * 4 + 2 * retained * 8
    total = lower.stats()["kv_bytes"] + upper.stats()["kv_bytes"]
    assert total == 2 * per_kind
    assert total < 2 * 2 * (2 * 8 * d) * 4  # the two layers' full fp32 K and V
    assert lower.stats()["kv_tokens"] == upper.stats()["kv_tokens"] == 8


def test_retaining_everything_is_exact(stories):
    model, tok = stories
    ids = torch.tensor(tok("Once upon a time there was a little dog. " * 8)["input_ids"][:70])
    out = []
    for method in (build_method("full"), build_method("minicache", retain_ratio=1.0),
                   build_method("minicache")):
        engine = make_engine(model, method, tok, chunk=32)
        with engine.request() as req:
            logits = [req.prefill(ids[:60])] + [req.step(t.view(1)) for t in ids[60:]]
            layers = req.cache.kv_layers
            out.append(torch.cat(logits, 1))
            stats = [kv.stats() for kv in layers]  # the request's storage is freed at its end
        assert [s["kv_tokens"] for s in stats] == [70] * len(layers)
    roles = [method.role(i, 5) for i in range(5)]
    assert roles == [None, None, "lower", "upper", None]  # stories260K: 5 layers
    assert torch.equal(out[0], out[1])
    assert not torch.equal(out[0], out[2]) and torch.isfinite(out[2]).all()
    full_pair = 2 * 70 * model.config.num_key_value_heads * (model.config.hidden_size
                                                            // model.config.num_attention_heads) * 4
    merged_pair = stats[2]["kv_bytes"] + stats[3]["kv_bytes"]
    assert 0.5 * 2 * full_pair < merged_pair < 0.7 * 2 * full_pair


@pytest.mark.parametrize("key, value", [("start_layer_ratio", 1.5), ("interpolation_ratio", -0.1),
                                        ("retain_ratio", 2)])
def test_bad_config_names_the_key(key, value):
    with pytest.raises(ConfigError, match=f"method.{key}="):
        build_method("minicache", **{key: value})


def test_refused_where_no_prompt_ends():
    """Merging starts at the end of the first prompt: streaming perplexity (every token a decode
    step) and sparse prefill are refused before weights load."""
    from harness.config.runner import protocol_reasons
    from methods.protocol import Protocol
    from tasks import build_task

    info = ModelInfo(num_layers=4, num_heads=2, num_kv_heads=2, head_dim=8, max_positions=64)
    method = build_method("minicache")
    streaming = build_task("perplexity", mode="streaming")
    assert any("compresses only over a prefilled prompt" in r
               for r in protocol_reasons(method, streaming, info, Protocol()))
    assert any("runner.prefill=sparse" in r for r in protocol_reasons(
        method, build_task("perplexity", mode="chunked"), info, Protocol(prefill="sparse")))
