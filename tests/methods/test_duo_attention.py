"""DuoAttention: the official gate thresholding, the pattern file, per-head kept sets, the budget,
and the head-wise attention against a hand computation (shared with RazorAttention)."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from harness.core import hf_adapter
from harness.sweep.run import run_sweep
from kvcore.errors import ConfigError, UnsupportedReason
from methods import build_method
from methods._head_probe import select_retrieval
from methods._headwise import HeadwiseLayer
from methods.duo_attention import load_duo_pattern, sparsify_gates
from methods.model import ModelInfo
from tests.conftest import PROJECT, STORIES, make_engine, need_shared
from tests.helpers.validation import one_reason
from tests.methods.headwise_reference import masked_full_gap, streaming_positions

INFO = ModelInfo(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, max_positions=512)


def test_gate_threshold_hand_case():
    """By hand: alpha [[0.9, 0.1], [0.5, 0.2]], sparsity 0.5 -> quantile 0.35,
    retrieval heads (0, 0) and (1, 0)."""
    got = sparsify_gates(torch.tensor([[0.9, 0.1], [0.5, 0.2]]), 0.5)
    assert got.tolist() == [[True, False], [True, False]]
    assert sparsify_gates(torch.rand(3, 2), 1.0).sum() == 0
    assert sparsify_gates(torch.rand(3, 2), 0.0).all()


def test_union_rule_hand_case():
    echo = torch.tensor([[0.9, 0.0], [0.1, 0.2]])
    induction = torch.tensor([[0.0, 0.3], [0.8, 0.1]])
    # one echo head (0, 0), then the best induction heads (1, 0), (0, 1)
    assert select_retrieval(echo, induction, 3, 1).tolist() == [[True, True], [True, False]]
    assert select_retrieval(echo, induction, 1, 0).tolist() == [[False, False], [True, False]]


PATTERN = Path(__file__).parent / "data" / "duo_pattern"


def test_pattern_file_official_format(tmp_path):
    """A 2-layer x 2-KV-head pattern written as the official `save_full_attention_heads` writes
    them (np.savetxt: '%.18e', tabs, slightly negative gates) with the official config.json:
    read as `load_attn_pattern` reads it (clipped to [0, 1])."""
    info = ModelInfo(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_positions=64)
    gates, config = load_duo_pattern(PATTERN, info)
    assert gates.tolist() == [[0.859375, 0.0], [0.0, 1.0]]  # -9.25e-05 and -2.2e-05 clipped to 0
    assert config == {"sink_size": 128, "recent_size": 256}
    same, _ = load_duo_pattern(PATTERN / "full_attention_heads.tsv", info)  # or the .tsv itself
    assert torch.equal(same, gates)
    (tmp_path / "bad.tsv").write_text("0.9\t0.1\t0.3\n")
    with pytest.raises(ConfigError, match="method.pattern_path=.*3 layers|shape"):
        load_duo_pattern(tmp_path / "bad.tsv", info)


def test_official_defaults_half_the_heads_on_gqa_a_quarter_on_mha(tiny_model, tmp_path):
    """The NIAH operating point: sparsity 0.5 on GQA models (Llama-3-8B), 0.75 on MHA ones
    (Llama-2-7B-32K); 64 sinks + 256 recent, no budget; the probe's heads labelled proxy."""
    method = build_method("duo_attention")
    gqa = ModelInfo(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_positions=64)
    mha = ModelInfo(num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8, max_positions=64)
    assert method.head_ratio(gqa) == 0.5 and method.head_ratio(mha) == 0.25
    assert (method.sink_tokens, method.window_tokens, method.budget_ratio) == (64, 256, None)
    assert method.stream_slots(10_000) == 320
    assert method.provenance_label().startswith("reconstruction (proxy heads")
    assert build_method("duo_attention", pattern_path=str(PATTERN)).provenance_label() == \
        "official code"
    facts = hf_adapter.prepare(build_method("duo_attention", cache_dir=str(tmp_path)), tiny_model,
                               None)
    assert facts["head_identification"].startswith("proxy heads")
    assert facts["retrieval_head_ratio"] == 0.5 and facts["retrieval_heads"] == 2  # of 2 x 2
    # a budget below the official share is refused before weights load, with the reason
    reasons = build_method("duo_attention", budget_ratio=0.2).validate(gqa, {})
    assert any("retrieval heads alone hold 0.5" in r for r in reasons)
    # ... as a combination this model cannot take (a sweep skips it), not a bad input
    share = [r for r in reasons if "retrieval heads alone" in r]
    assert share and all(isinstance(r, UnsupportedReason) for r in share)
    assert not any("retrieval heads alone" in r
                   for r in build_method("duo_attention", budget_ratio=0.6).validate(gqa, {}))


def test_a_budget_below_the_head_share_is_skipped_in_a_sweep_not_failed(tmp_path):
    """A sweep over budgets goes on past the ones this model's retrieval heads already exceed
    (a rounds sweep stops on a failed member): the member is skipped with its reason."""
    need_shared(STORIES)
    cfgs = []
    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        for budget in ("0.1", "null"):
            cfgs.append(compose(config_name="config", overrides=[
                "model=stories260k", "task=perplexity", "task.max_tokens=48",
                "method=duo_attention", f"method.budget_ratio={budget}",
                "method.retrieval_head_ratio=null", f"runner.results_root={tmp_path}"]))
    outcomes = run_sweep(cfgs)
    assert [o.status for o in outcomes] == ["skipped", "ok"], outcomes
    assert "retrieval heads alone hold" in outcomes[0].detail


def test_learned_pattern_drives_the_heads(tiny_model, tmp_path):
    """tiny model: 2 layers x 2 KV heads; the pattern decides which heads stream."""
    (tmp_path / "full_attention_heads.tsv").write_text("0.9\t0.1\n0.2\t0.5\n")
    method = build_method("duo_attention", pattern_path=str(tmp_path), retrieval_head_ratio=0.5,
                          sink_tokens=2, window_tokens=4)
    facts = hf_adapter.prepare(method, tiny_model, None)
    assert facts["head_identification"] == "learned_gates"
    assert method._retrieval.tolist() == [[True, False], [False, True]]


def _layer(retrieval, compensate, sinks=2, window=3):
    slots = sinks + window + (1 if compensate else 0)
    method = SimpleNamespace(sink_tokens=sinks, compensate=compensate,
                             stream_slots=lambda seen: slots)
    return HeadwiseLayer(0, INFO, method, torch.tensor(retrieval))


def _reference(q, k_all, v_all, keep_by_head, comp=False, sinks=2):
    """Per query head: softmax over the kept text positions (+ |D|-weighted mean of the rest)."""
    out = []
    for h in range(q.shape[1]):
        kv = h // 2
        keep = keep_by_head[kv]
        k, v = k_all[0, kv, keep], v_all[0, kv, keep]
        s = k @ q[0, h, 0] / math.sqrt(8)
        w = s.exp()
        num = (w[:, None] * v).sum(0)
        den = w.sum()
        dropped = [i for i in range(k_all.shape[2]) if i not in keep]
        if comp and dropped:
            kh, vh = k_all[0, kv, dropped].mean(0), v_all[0, kv, dropped].mean(0)
            e = len(dropped) * (kh @ q[0, h, 0] / math.sqrt(8)).exp()
            num, den = num + e * vh, den + e
        out.append(num / den)
    return torch.stack(out)


@pytest.mark.kept_set
@pytest.mark.parametrize("compensate", [False, True])
def test_per_head_kept_sets_and_attention_by_hand(compensate):
    """KV head 0 retrieval, head 1 streaming (2 sinks + 3 window): after a 10-token prefill and
    each decode step, head 1 holds positions 0, 1 and the last 3 and attention equals a hand
    computation per head (RazorAttention: plus the |D|-weighted mean of the dropped tokens)."""
    torch.manual_seed(0)
    layer = _layer([True, False], compensate)
    module = SimpleNamespace(scaling=8 ** -0.5, num_key_value_groups=2)
    k_all = torch.randn(1, 2, 14, 8, dtype=torch.float64)
    v_all = torch.randn(1, 2, 14, 8, dtype=torch.float64)
    layer.update(k_all[:, :, :10], v_all[:, :, :10], None)
    layer.after_forward()
    window = 3  # slots: 2 sinks + 3 window (+ 1 compensation token)
    for t in range(10, 14):
        assert streaming_positions(layer) == [0, 1] + list(range(t - window, t))
        assert layer.kept_lengths()[0, 0] == t  # the retrieval head: every token
        q = torch.randn(1, 4, 1, 8, dtype=torch.float64)
        keys, values = layer.update(k_all[:, :, t:t + 1], v_all[:, :, t:t + 1], None)
        out, _ = layer.attend(module, q, keys, values, None, base=hf_adapter.eager_attention)
        keep = [list(range(t + 1)), [0, 1] + list(range(t - window, t + 1))]
        expected = _reference(q, k_all[:, :, :t + 1], v_all[:, :, :t + 1], keep, compensate)
        assert (out[0, 0] - expected).abs().max() < 1e-6  # eager softmax runs in fp32
        layer.after_forward()
        assert layer.stats()["kv_tokens"] <= layer.allowed_tokens()
    if compensate:
        assert layer.comp_count == 14 - 2 - window


def test_duo_streams_on_a_model_within_budget(tiny_model):
    """budget_ratio: held bytes over the whole model stay at the ratio (checked every step by the
    engine), and the streaming heads really hold sinks + window."""
    method = build_method("duo_attention", retrieval_head_ratio=0.25, budget_ratio=0.5,
                          probe_period_tokens=16)  # 64 sinks > the slots: capped by the ratio
    engine = make_engine(tiny_model, method, chunk=16)
    torch.manual_seed(1)
    ids = torch.randint(3, 250, (80,))
    with torch.no_grad(), engine.request() as req:
        req.prefill(ids[:40])
        for t in range(40, 80):
            req.step(ids[t:t + 1])
        layers = req.cache.kv_layers
        held = sum(lay.stats()["kv_bytes"] for lay in layers)
        full = 80 * engine.info.kv_bytes_per_token()
        assert held <= 0.5 * full + 1e-9
        streaming = [lay for lay in layers if len(lay.streaming_heads)]
        # slots from the budget basis: the 40-token prompt (runner.budget_basis=final)
        assert streaming and all(
            lay.kept_lengths()[0, lay.streaming_heads].tolist()
            == [method.stream_slots(40)] * len(lay.streaming_heads) for lay in streaming)
    assert engine.ledger.samples[-1]["seen_tokens"] == 80


@pytest.mark.parametrize("kw, key", [
    ({"retrieval_head_ratio": 1.5}, "method.retrieval_head_ratio=1.5"),
    ({"retrieval_head_ratio": 0.5, "budget_ratio": 0.2}, "must be below method.budget_ratio"),
    ({"budget_tokens": 100}, "method.budget_tokens"),
    ({"window_tokens": 0}, "method.window_tokens=0"),
    ({"sink_tokens": -1}, "method.sink_tokens=-1"),
])
def test_bad_hyperparameters(kw, key):
    with pytest.raises(ConfigError, match=key.replace("(", r"\(").replace(".", r"\.")):
        build_method("duo_attention", **kw)


def test_sinks_never_take_the_window_when_slots_are_few():
    """A budget leaving fewer slots than sinks + window (64 sinks in 9 slots): the sinks take at
    most half, the rest is the most recent tokens (before: 9 sinks and no recent token at all)."""
    method = SimpleNamespace(sink_tokens=64, compensate=False, stream_slots=lambda seen: 9)
    layer = HeadwiseLayer(0, INFO, method, torch.tensor([False, False]))
    k = torch.randn(1, 2, 30, 8)
    layer.update(k, k, None)
    layer.after_forward()
    assert streaming_positions(layer) == [0, 1, 2, 3] + list(range(25, 30))


def test_sinks_dropped_early_are_never_replaced_by_window_tokens():
    """Slots growing with the stream: a sink dropped while slots were few does not come back, and
    no window token is frozen in its place (the leading rows stay text positions 0, 1, ...)."""
    slots = {"n": 3}
    method = SimpleNamespace(sink_tokens=4, compensate=False, stream_slots=lambda seen: slots["n"])
    layer = HeadwiseLayer(0, INFO, method, torch.tensor([False, False]))
    k = torch.randn(1, 2, 40, 8)
    layer.update(k[:, :, :10], k[:, :, :10], None)
    layer.after_forward()  # 3 slots: 1 sink (half, at least one) + 2 recent
    assert streaming_positions(layer) == [0, 8, 9]
    slots["n"] = 12
    for t in range(10, 40):
        layer.update(k[:, :, t:t + 1], k[:, :, t:t + 1], None)
        layer.after_forward()
    assert streaming_positions(layer) == [0] + list(range(29, 40))


@pytest.mark.parametrize("compensate", [False, True])
def test_one_shared_ragged_store_holds_both_head_classes(compensate):
    """The move onto kvcore storage: the layer's K/V are one ragged `Rows` pair (no private
    tensors); the retrieval head's length is every token, the streaming head's sinks + window
    (+ the compensation slot), the bytes count exactly those rows, and without a compensation
    slot decode attends through the ragged kernels (the model's attention, `base`, unused)."""
    torch.manual_seed(0)
    layer = _layer([True, False], compensate)
    k = torch.randn(1, 2, 30, 8)
    layer.update(k[:, :, :20], k[:, :, :20], None)
    layer.after_forward()
    module = SimpleNamespace(scaling=8 ** -0.5, num_key_value_groups=2)

    def refuse(*args, **kwargs):
        raise AssertionError("the model's attention was called")
    for t in range(20, 30):
        keys, values = layer.update(k[:, :, t:t + 1], k[:, :, t:t + 1], None)
        q = torch.randn(1, 4, 1, 8)
        base = hf_adapter.eager_attention if compensate else refuse
        layer.attend(module, q, keys, values, None, base=base)
        layer.after_forward()
        lengths = layer._kv["keys"].lengths()
        assert lengths.tolist() == [[t + 1, 2 + 3 + (1 if compensate else 0)]]
        assert torch.equal(layer._kv["values"].lengths(), lengths)
        assert layer.stats()["kv_bytes"] == int(lengths.sum()) * 2 * 8 * 4
        assert layer.kept_lengths().tolist() == [[t + 1, 5]]
    # K/V are (B, H_kv, T, D); the template's `positions` (B, H_kv, T) is a view of its rows
    tensors = [n for n, v in vars(layer).items() if isinstance(v, torch.Tensor) and v.dim() > 3]
    assert not tensors, f"K/V held outside the shared rows: {tensors}"


def test_duo_equals_the_full_cache_masked_to_what_each_head_kept(stories, monkeypatch, tmp_path):
    """tests/methods/headwise_reference.py: the full cache, its decode step and a question fed
    in one chunk masked per KV head to the positions DuoAttention's head kept, gives
    DuoAttention's logits (retrieval heads every token, streaming heads 4 sinks + 16 recent;
    an independent check of the ragged path)."""
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    model, tok = stories
    method = build_method("duo_attention", sink_tokens=4, window_tokens=16,
                          retrieval_head_ratio=0.5, probe_period_tokens=16)
    assert masked_full_gap(model, tok, method, monkeypatch) <= 1e-4


def duo_pattern(folder, gates, config='{"sink_size": 64, "recent_size": 256}'):
    folder.mkdir(exist_ok=True)
    (folder / "full_attention_heads.tsv").write_text(
        "\n".join("\t".join(repr(float(g)) for g in row) for row in gates) + "\n")
    if config is not None:
        (folder / "config.json").write_text(config)
    return folder


@pytest.mark.parametrize("gates, config, expect", [
    ([[0.2, 0.9], [0.1, 0.5]], "{not json", "config.json: not valid JSON"),
    ([[0.2, 0.9], [0.1, 0.5]], "[64, 256]", "config.json: a JSON list, expected an object"),
    ([[0.2, 0.9], [0.1, 0.5]], '{"sink_size": -4}', "sink_size=-4; allowed: an integer >= 0"),
    ([[0.2, float("nan")], [0.1, 0.5]], None, "the gate of layer 0 KV head 1 is nan"),
    ([[0.2, 0.9], [3.0, 0.5]], None, "the gate of layer 1 KV head 0 is 3.0; allowed: finite "
                                     "gates in [0, 1]"),
])
def test_duo_attention_pattern_checked_like_a_knob(gates, config, expect, tmp_path):
    folder = duo_pattern(tmp_path / "pattern", gates, config)
    reason = one_reason(build_method("duo_attention", pattern_path=str(folder)))
    assert expect in reason and "method.pattern_path=" in reason
