"""StreamingLLM invariants: sinks + window kept, keys at in-cache positions, the sink finding."""

import math

import pytest
import torch

from harness.core import hf_adapter
from kvcore.errors import ConfigError
from methods import build_method
from methods.rope import rotate
from tasks.perplexity import token_nll
from tests.conftest import make_engine


def stream(engine, ids, prefill=0):
    """Prefill `prefill` tokens, then one token per step; returns per-token NLL and the request."""
    nll = []
    with engine.request() as req:
        if prefill:
            req.prefill(ids[:prefill])
        for t in range(prefill, ids.numel() - 1):
            logits = req.step(ids[t:t + 1])[0, -1]
            nll.append(float(token_nll(logits[None], ids[t + 1:t + 2])[0]))
            layer = req.cache.kv_layers[0]
            seen, kept = layer.seen_tokens, layer.kept_tokens()
            assert kept == min(seen, 2 + 6)
            expected = list(range(min(2, seen))) + list(range(max(2, seen - 6), seen))
            assert sorted(layer.positions[0, 0].tolist()) == expected
        return nll, req


@pytest.mark.kept_set
@pytest.mark.parametrize("rerotate", [True, False])
def test_sinks_and_window_always_present(tiny_model, rerotate):
    method = build_method("streaming_llm", sink_tokens=2, window_tokens=6, rerotate=rerotate)
    engine = make_engine(tiny_model, method, chunk=5)
    torch.manual_seed(0)
    stream(engine, torch.randint(3, 250, (40,)), prefill=11)
    assert engine.ledger.samples[-1]["tokens_per_layer"] == [8, 8]
    assert engine.ledger.samples[-1]["budget_per_layer"] == [8, 8]


def layer0_keys_at(model, ids, positions):
    """Layer-0 keys depend on the token alone: compute them directly, rotated at `positions`."""
    attn = model.model.layers[0].self_attn
    hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    keys = attn.k_proj(hidden).view(1, ids.numel(), -1, attn.head_dim).transpose(1, 2)
    inv_freq = hf_adapter.rope_inv_freq(model)
    return rotate(keys, positions.float(), inv_freq)  # rotation from 0 == RoPE at `positions`


@pytest.mark.parametrize("rerotate", [True, False])
def test_kept_keys_equal_keys_computed_at_their_positions(tiny_model, rerotate):
    torch.manual_seed(1)
    ids = torch.randint(3, 250, (30,))
    engine = make_engine(tiny_model, build_method("streaming_llm", sink_tokens=2, window_tokens=6,
                                                  rerotate=rerotate), chunk=7)
    with torch.no_grad(), engine.request() as req:
        req.prefill(ids[:13])
        for t in range(13, 30):
            req.step(ids[t:t + 1])
        layer = req.cache.kv_layers[0]
        pos = layer.positions[0, 0]
        kept_tokens = ids[pos]
        # the attention frame: window keys at their text positions, sinks shifted by the tokens
        # before the last forward (rotated when a forward begins), so every distance to the
        # query (at its text position) is the in-cache distance; the window is never rotated
        evicted = (layer.seen_tokens - 1) - layer.kept_tokens()
        frame = torch.where(pos < 2, pos + evicted, pos) if rerotate else pos
        expected = layer0_keys_at(tiny_model, kept_tokens[None], frame)
        assert (layer.keys[0] - expected[0]).abs().max().item() < 1e-4
    # and the model's own RoPE agrees with our rotation (text positions, nothing evicted)
    with torch.no_grad():
        inner = tiny_model.model
        cos, sin = inner.rotary_emb(torch.zeros(1), torch.arange(5)[None])
        attn = inner.layers[0].self_attn
        h = inner.layers[0].input_layernorm(inner.embed_tokens(ids[None, :5]))
        k = attn.k_proj(h).view(1, 5, -1, attn.head_dim).transpose(1, 2)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        _, k_hf = apply_rotary_pos_emb(k, k, cos, sin)
        assert (k_hf - layer0_keys_at(tiny_model, ids[None, :5], torch.arange(5))).abs().max() < 1e-5


def test_attention_sinks_help_smollm2(smollm2):
    """The StreamingLLM finding, measured: SmolLM2 streaming PPL over 96 PG-19 tokens with a
    16-token cache (scored from token 24, once it is full): 4 sinks + 12 window = 232.4 vs a
    16-token window without sinks = 3634 (15.6x; at 160 tokens 160.9 vs 1515.9, at 400 tokens
    and a 32-token cache 59.0 vs 197.0: 3.3x).
    stories260K shows no such effect (window-only is *better* there: 34.5 vs 38.7 at window 16
    over 1500 tokens; it has no strong sink), so the finding is asserted on SmolLM2, with a 1.5x
    margin."""
    model, tok = smollm2
    from tests.conftest import DATA, need_shared

    need_shared(DATA)
    text = (DATA / "pg19" / "pg19_firstbook.txt").read_text()
    ids = torch.tensor(tok(text)["input_ids"][:96])

    def ppl(**kw):
        engine = make_engine(model, build_method("streaming_llm", **kw), tok)
        nll = []
        with engine.request() as req:
            for t in range(ids.numel() - 1):
                logits = req.step(ids[t:t + 1])[0, -1]
                nll.append(float(token_nll(logits[None], ids[t + 1:t + 2])[0]))
        return math.exp(sum(nll[24:]) / len(nll[24:]))  # once the cache is full

    with_sinks = ppl(sink_tokens=4, window_tokens=12)
    window_only = ppl(sink_tokens=0, window_tokens=16)
    print(f"streaming PPL with sinks {with_sinks:.2f}, window only {window_only:.2f}")
    assert window_only > 1.5 * with_sinks, (with_sinks, window_only)


@pytest.mark.parametrize("kw, key", [
    ({"sink_tokens": 10, "window_tokens": 4}, "method.sink_tokens=10 is larger than"),
    ({"window_tokens": 0}, "method.window_tokens=0"),
    ({"sink_tokens": -1}, "method.sink_tokens=-1"),
    ({"budget_ratio": 1.5}, "method.budget_ratio=1.5 must be in (0, 1]"),
    ({"window_tokens": None}, "method.window_tokens, method.budget_tokens or method.budget_ratio"),
    ({"budget_tokens": 4, "sink_tokens": 4}, "method.budget_tokens=4 must exceed"),
    ({"rerotate": "yes"}, "method.rerotate"),
])
def test_bad_hyperparameters(kw, key):
    with pytest.raises(ConfigError) as err:
        build_method("streaming_llm", **kw)
    assert key in str(err.value)


def test_budget_ratio_sets_the_window(tiny_model):
    engine = make_engine(tiny_model, build_method("streaming_llm", budget_ratio=0.25))
    with engine.request() as req:
        req.prefill(torch.arange(3, 103))
        assert req.cache.kv_layers[0].kept_tokens() == 25


def test_no_drift_in_bf16_after_4096_steps():
    """No drift: the keys attention sees after 4,096 decode steps in bf16 equal one fp32
    rotation of each token's un-rotated key to its in-frame position, within bf16 rounding (the
    former in-place re-rotation every step drifted by 23 % after 500 steps), and the query-key
    distances are the in-cache ones of the paper."""
    from methods.model import ModelInfo
    from methods.streaming_llm import StreamingLLM

    torch.manual_seed(0)
    d, sinks, window, steps = 16, 4, 28, 4096
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    method = StreamingLLM(sink_tokens=sinks, window_tokens=window)
    method._inv_freq = inv_freq
    info = ModelInfo(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=d, max_positions=64,
                     dtype=torch.bfloat16, rope_theta=10000.0)
    layer = method.make_layer(0, info)
    raw = torch.randn(steps, d)  # un-rotated keys, fp32
    for p in range(steps):  # the model hands keys rotated at their text position, in bf16
        key = rotate(raw[p].view(1, 1, 1, d), torch.tensor(float(p)), inv_freq).bfloat16()
        keys, _ = layer.update(key, key, None)
        if p < steps - 1:
            layer.after_forward()
    pos = layer.positions[0, 0]
    assert keys.shape[2] == sinks + window + 1 and sorted(pos.tolist())[:sinks] == list(range(sinks))
    offset = steps - 1 - (sinks + window)  # evicted before the last forward
    frame = torch.where(pos < sinks, pos + offset, pos)
    expected = rotate(raw[pos].view(1, 1, -1, d), frame.float(), inv_freq)  # one rotation, fp32
    rel = (keys.float() - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert rel.max() < 2 ** -6, rel.max()  # two bf16 roundings at most
    # distances: sink s sits at slot s, window token at slot (its text position - offset)
    slots = torch.where(pos < sinks, pos, pos - offset)
    query_raw = torch.randn(d)
    q = rotate(query_raw.view(1, 1, 1, d), torch.tensor(float(steps - 1)), inv_freq)
    q_slot = rotate(query_raw.view(1, 1, 1, d), slots.max().float(), inv_freq)
    k_slot = rotate(raw[pos].view(1, 1, -1, d), slots.float(), inv_freq)
    assert torch.allclose(q @ keys.float().transpose(2, 3), q_slot @ k_slot.transpose(2, 3),
                          atol=0.05 * d ** 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_by_an_integer_equals_rotate(dtype):
    """The per-step sink rotation (angles shared by all layers of a step) is exactly `rotate`."""
    from methods.rope import rotate_by

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    x = torch.randn(2, 3, 4, 16).to(dtype)
    for delta in (0, 1, 7, 4093, 65000):
        expected = rotate(x, torch.tensor(float(delta)), inv_freq)
        assert torch.equal(rotate_by(x, delta, inv_freq), expected)
        assert torch.equal(rotate_by(x, delta, inv_freq), expected)  # the memoised angles
