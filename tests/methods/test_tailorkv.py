"""TailorKV: the layer split from the density probe by hand, 1-bit packed quantized layers, the
sparse layers' channel scoring and top-k fetch by hand (bytes in the transfer ledger), the budget at
every decode step of a model run, and one-line config errors."""

import pytest
import torch

from kvcore.errors import BudgetViolation, ConfigError
from kvcore.offload import Tier, TransferLedger
from methods import build_method
from methods.kernels import kivi_quant as kq
from methods.kivi import KIVILayer
from methods.model import ModelInfo, PrepareContext
from methods.scoring import attention_with_probs
from methods.tailorkv import TopKOffloadLayer, outside_top_mass
from tests.conftest import make_engine
from tests.methods.contract.step_checker import StepChecker


def eager(module, query, keys, values, mask, **kwargs):
    """The model's attention as a plain function: (B, q, H_q, D), no weights."""
    out, _ = attention_with_probs(query, keys, values, mask, kwargs["scaling"])
    return out, None


def info_of(layers=2, h_kv=1, groups=1, d=8):
    return ModelInfo(num_layers=layers, num_heads=h_kv * groups, num_kv_heads=h_kv, head_dim=d,
                     max_positions=4096)


def context(info, capture=None):
    return PrepareContext(info=info, tokenizer=None, device=torch.device("cpu"), fingerprint="t",
                          rope_inv_freq=None, project_query=None, capture=capture, vocab_size=50)


# --- offline identification ------------------------------------------------------------------
def test_dense_score_is_the_mass_outside_the_top_keys():
    # T = 40 keys, top 5 % -> k = 2 per row
    peaked = torch.zeros(40)
    peaked[3], peaked[7], peaked[9] = 0.7, 0.2, 0.1  # outside the top 2: 0.1
    flat = torch.full((40,), 1 / 40)  # outside the top 2: 38 / 40
    probs = torch.stack([peaked, flat])[None, None]  # (1, 1, 2 rows, 40)
    assert outside_top_mass(probs, 0.05) == pytest.approx((0.1 + 38 / 40) / 2)


def test_probe_splits_layers_as_computed_by_hand():
    """Layer 0: zero queries attend uniformly (dense); layer 1: every query points at key 0
    (sparse). Scores recomputed by hand: as the official probe, each of the last rows attends
    over every key of the text (no causal mask)."""
    t, n_q, d = 40, 4, 8
    info = info_of(layers=2, d=d)
    keys = torch.randn(1, 1, t, d, generator=torch.Generator().manual_seed(0))
    keys[0, 0, 0] = 0
    keys[0, 0, 0, 0] = 1.0
    queries = [torch.zeros(1, 1, t, d), torch.zeros(1, 1, t, d)]
    queries[1][..., 0] = 1e3  # logit 1e3 * scaling on key 0, far above the others

    def capture(method, ids):
        layers = [method.make_layer(i, info) for i in range(2)]
        for layer, q in zip(layers, queries):
            layer.attend(None, q, keys, keys, None, eager, scaling=d ** -0.5)
        return layers

    method = build_method("tailorkv", probe_queries=n_q)
    facts = method.prepare(context(info, capture))
    k = int(0.05 * t)  # 2 keys per row; every row sees all t keys uniformly (causal: fewer)
    assert facts["dense_scores"][0] == pytest.approx(1 - k / t, abs=1e-6)
    assert facts["dense_scores"][1] < 1e-6
    assert facts["layer_split"] == "probe" and facts["quant_layers"] == [0]
    assert facts["sparse_layers"] == [1] and "> 0.2 -> quantized" in facts["criterion"]
    assert isinstance(method.make_layer(0, info), KIVILayer)
    assert isinstance(method.make_layer(1, info), TopKOffloadLayer)


def test_the_official_stored_lists_are_used_for_the_authors_models():
    """config/model2quantlayer.json: matched on the model's name (any organisation, hub cache
    folders too); other models fall back to the probe."""
    def split(model_id, layers=32):
        method = build_method("tailorkv")
        ctx = context(info_of(layers=layers))  # capture=None: the probe would fail
        ctx.model_id = model_id
        return method.prepare(ctx)

    facts = split("NousResearch/Meta-Llama-3.1-8B-Instruct")
    assert facts["layer_split"] == "official list" and facts["quant_layers"] == [0]
    assert split("meta-llama/Meta-Llama-3.1-8B-Instruct")["quant_layers"] == [0]
    hub = "/cache/models--togethercomputer--Llama-2-7B-32K-Instruct/snapshots/abc123"
    assert split(hub)["quant_layers"] == [0, 1]
    assert split("01-ai/Yi-6B-200K")["official_list"].endswith("01-ai/Yi-6B-200K")
    with pytest.raises(TypeError):  # no stored list: the probe runs (and needs ctx.capture)
        split("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_split_from_config_is_labelled_and_skips_the_probe():
    method = build_method("tailorkv", quant_layers=[1])
    facts = method.prepare(context(info_of(layers=3)))  # capture=None: the probe would fail
    assert facts["layer_split"] == "config"
    assert facts["quant_layers"] == [1] and facts["sparse_layers"] == [0, 2]


# --- quantized layers ------------------------------------------------------------------------
def test_quantized_layers_hold_one_bit_codes():
    torch.manual_seed(1)
    info = info_of(h_kv=2, d=8)
    method = build_method("tailorkv", quant_layers=[0], group_size=8, residual_tokens=8)
    method.prepare(context(info))
    layer = method.make_layer(0, info)
    keys, values = torch.randn(1, 2, 36, 8), torch.randn(1, 2, 36, 8)
    layer.update(keys, values, None)
    # keys: 32 quantized (whole blocks of R = 8), 4 residual; values: 28 quantized, 8 residual
    assert layer.k_quant.codes.shape == (1, 2, 8, 32 // 8)  # 1 bit: 8 codes per byte
    assert layer.v_quant.codes.shape == (1, 2, 28, 8 // 8)
    stored = layer.k_quant.nbytes + layer.v_quant.nbytes
    new_k, new_v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    layer.update(new_k, new_v, None)  # this step sees the stored part as stored: quantized
    k_hat, v_hat = layer.dequantized_kv()
    groups = keys[:, :, :32].transpose(2, 3).reshape(1, 2, 8, 4, 8)  # per channel, 8 tokens
    # 1 bit: scale = max - min, zero = min (fp16); code = floor((x - zero) / scale + 1/2)
    zero = groups.amin(-1, keepdim=True).half().float()
    scale = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)).half().float()
    one_bit = torch.floor((groups - zero) / scale + 0.5).clamp(0, 1) * scale + zero
    assert torch.equal(k_hat[:, :, :32].transpose(2, 3).reshape(1, 2, 8, 4, 8), one_bit)
    assert torch.equal(k_hat[:, :, 32:], torch.cat([keys[:, :, 32:], new_k], 2))
    assert torch.equal(v_hat[:, :, 28:], torch.cat([values[:, :, 28:], new_v], 2))
    assert not torch.equal(v_hat[:, :, :28], values[:, :, :28])
    # codes + fp16 scale/zero per group, then fp32 residuals: 5 keys + 8 values, 2 heads, d = 8
    packed = layer.k_quant.nbytes + layer.v_quant.nbytes
    assert packed == stored + 2 * (8 // 8 + 2 * 2)  # one more value token: 1 byte + scale, zero
    assert layer.stats()["kv_bytes"] == packed + 4 * (5 + 8) * 2 * 8 < 2 * 37 * 2 * 8 * 4


def test_one_bit_kernel_matches_the_reference():
    x = torch.randn(3, 5, 64)
    got, ref = kq.quantize_pack(x, 1, 64), kq.quantize_pack_ref(x, 1, 64)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert torch.equal(kq.dequantize(got, 1, 64, torch.float32),
                       kq.dequantize_ref(ref, 1, 64, torch.float32))


def test_one_bit_decode_attention_kernel_equals_dequantize_then_attend():
    """KIVI's fused decode kernel (interpreter) and torch path at 1 bit, as TailorKV uses them."""
    from methods.kernels import kivi_attention as ka
    from tests.methods.kivi_cases import dense_reference, packed_cache

    cache = packed_cache(64, 10, 48, k_bits=1, v_bits=1, k_group=32, v_group=16)
    query = torch.randn(1, 6, 1, 16, generator=torch.Generator().manual_seed(3))
    want = dense_reference(query, cache, 0.25)
    torch.testing.assert_close(ka.decode_attention_torch(query, cache, 0.25), want,
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ka.decode_attention_triton(query, cache, 0.25, splits=2, block_t=16),
                               want, rtol=1e-5, atol=1e-6)


# --- sparse layers ---------------------------------------------------------------------------
def sparse_layer(h_kv=2, groups=2, d=8, **knobs):
    info = info_of(layers=1, h_kv=h_kv, groups=groups, d=d)
    method = build_method("tailorkv", quant_layers=[], **knobs)
    method.prepare(context(info))
    layer = method.make_layer(0, info)
    layer.tier = Tier(torch.device("cpu"), TransferLedger(1), offload=True)
    return layer


@pytest.mark.kept_set
def test_sparse_step_fetches_the_hand_computed_top_k():
    torch.manual_seed(2)
    h_kv, g, d, n = 2, 2, 8, 40
    layer = sparse_layer(h_kv, g, d, budget_tokens=10, sink_tokens=2, recent_tokens=3,
                         key_channels=2)  # k = 10 - 2 - 3 = 5 prompt rows fetched
    keys, values = torch.randn(1, h_kv, n - 1, d), torch.randn(1, h_kv, n - 1, d)
    prompt_q = torch.randn(1, h_kv * g, n - 1, d)
    k_out, v_out = layer.update(keys, values, None)
    assert torch.equal(k_out, keys)  # a prefill chunk attends everything
    layer.attend(None, prompt_q, k_out, v_out, None, eager, scaling=d ** -0.5)
    layer.on_prefill_end()
    new_k, new_v = torch.randn(1, h_kv, 1, d), torch.randn(1, h_kv, 1, d)
    q = torch.randn(1, h_kv * g, 1, d)
    assert layer.mask_sizes(1) == (6, 34)
    dev_k, dev_v = layer.update(new_k, new_v, None)
    assert dev_k.shape[2] == 6  # 2 sinks + 3 recent prompt tokens + the new one, on the device
    ledger = layer.tier.ledger
    before = ledger.bytes_h2d
    out, _ = layer.attend(None, q, dev_k, dev_v, None, eager, scaling=d ** -0.5)
    all_k, all_v = torch.cat([keys, new_k], 2), torch.cat([values, new_v], 2)
    q_bar = q[0, :, 0].view(h_kv, g, d).mean(1)  # (H_kv, D)
    expected = []
    for h in range(h_kv):  # max |K| over the prompt; candidates between sinks and recent window
        chans = (q_bar[h].abs() * keys[0, h].abs().amax(0)).topk(2).indices
        approx = keys[0, h, 2:n - 1 - 3][:, chans] @ q_bar[h, chans]
        expected.append(sorted((approx.topk(5).indices + 2).tolist()))
    rows = layer.kept_positions()[0, :, 2:7].tolist()
    assert rows == expected
    assert layer.kept_positions()[0, 0, :2].tolist() == [0, 1]  # sinks
    assert layer.kept_positions()[0, 0, 7:].tolist() == [36, 37, 38, 39]  # recent prompt, then generated
    keep = torch.zeros(1, h_kv * g, 1, n, dtype=torch.bool)
    for h in range(h_kv):
        keep[0, h * g:(h + 1) * g, 0, layer.kept_positions()[0, h]] = True
    want, _ = attention_with_probs(q, all_k, all_v, None, d ** -0.5, keep=keep)
    assert torch.allclose(out, want, atol=1e-6)
    # channels of every stored prompt key ((n-1) x H_kv x c), then 5 rows of K and V per head
    assert ledger.bytes_h2d - before == 4 * ((n - 1) * h_kv * 2 + 2 * 5 * h_kv * d)
    stats = layer.stats()
    assert stats["selected_tokens"] == 11 == layer.allowed_tokens() and stats["kv_tokens"] == n
    # sinks, recent prompt tokens, the generated one (K and V), max |K|
    assert stats["kv_bytes_device"] == 4 * h_kv * d * (2 * (2 + 3 + 1) + 1)
    assert stats["kv_bytes"] == stats["kv_bytes_device"] + keys.nbytes + values.nbytes


def test_budget_covering_the_tokens_attends_all_of_them():
    layer = sparse_layer(budget_tokens=64, sink_tokens=2, recent_tokens=3)
    keys = torch.randn(1, 2, 12, 8)
    layer.update(keys, keys, None)
    layer.on_prefill_end()
    dev_k, dev_v = layer.update(keys[:, :, :1], keys[:, :, :1], None)
    layer.attend(None, torch.randn(1, 4, 1, 8), dev_k, dev_v, None, eager, scaling=1.0)
    assert layer.kept_positions()[0, 0].tolist() == list(range(13)) and layer.allowed_tokens() == 13


def test_official_192_prompt_tokens_and_every_generated_token_exact(tiny_model, tmp_path,
                                                                   monkeypatch, torch_path):
    """The official operating point: with no shared budget set, a sparse layer attends 8 sinks +
    56 recent + 128 top-k prompt tokens, and every generated token on top, never evicted (a
    generated token competing for the top-k, or the window sliding over generated tokens, would
    drop some). The quantized layer's decode runs its C kernel, not Triton's interpreter (the
    kernels have their own tests)."""
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    method = build_method("tailorkv", quant_layers=[0], key_channels=4)
    engine = make_engine(tiny_model, method, chunk=128)
    ids = torch.randint(3, 250, (1, 300), generator=torch.Generator().manual_seed(8))
    with engine.request() as req:
        req.prefill(ids[:, :260])
        for t in range(260, 300):
            req.step(ids[:, t])
            layer = req.cache.kv_layers[1]
            assert layer.grant == (8, 56, 128)
            assert layer.allowed_tokens() == layer.attended_tokens() == 192 + t + 1 - 260
            row = layer.kept_positions()[0, 0].tolist()
            assert row[:8] == list(range(8)) and row[-(56 + t + 1 - 260):] == list(range(204, t + 1))
            assert all(8 <= p < 204 for p in row[8:136])


@pytest.mark.parametrize("quant_layers", [[], [0]])
def test_budget_holds_at_every_step_of_a_model_run(tiny_model, quant_layers, tmp_path, monkeypatch,
                                                   torch_path):
    """The engine checks every layer's budget after every forward (BudgetViolation otherwise);
    with only sparse layers the whole cache contract holds strictly at every step."""
    from harness.core import hf_adapter

    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    method = build_method("tailorkv", budget_tokens=12, sink_tokens=2, recent_tokens=4,
                          group_size=8, residual_tokens=8, quant_layers=quant_layers)
    info = hf_adapter.model_info(tiny_model.config)
    ids = torch.randint(3, 250, (1, 64), generator=torch.Generator().manual_seed(5))
    hf_adapter.set_attention(tiny_model, "eager")
    try:
        engine = make_engine(tiny_model, method, chunk=16)
        with engine.request() as req:
            checker = StepChecker(method, info, req.cache.kv_layers) if not quant_layers else None
            req.prefill(ids[:, :32])
            for i in range(32, 64):
                logits = req.step(ids[:, i])
    finally:
        hf_adapter.set_attention(tiny_model, "sdpa")
    assert torch.isfinite(logits).all()
    sample = engine.ledger.samples[-1]
    sparse = [i for i in range(info.num_layers) if i not in quant_layers]
    assert all(sample["selected_per_layer"][i] == 12 + 32 == sample["budget_per_layer"][i]
               for i in sparse)  # 12 prompt tokens + the 32 generated ones
    assert all(sample["device_bytes_per_layer"][i] < sample["bytes_per_layer"][i] for i in sparse)
    assert engine.transfers.summary()["bytes_per_decode_step"] > 0
    if checker:
        assert checker.compressed


def test_sparse_prefill_and_prompt_less_streams_are_refused(tiny_model):
    """The official prefill is dense and the budget is the prompt's: runner.prefill=sparse and a
    stream with no prompt are refused before weights load."""
    from harness.core import hf_adapter
    from harness.config.runner import protocol_reasons
    from methods.protocol import Protocol

    method = build_method("tailorkv")
    info = hf_adapter.model_info(tiny_model.config)

    class Task:
        name = "t"

        def phases(self):
            return frozenset({"prefill", "decode"})

    assert any("runner.prefill=sparse" in r for r in protocol_reasons(
        method, Task(), info, Protocol(prefill="sparse")))
    assert method.capabilities.needs_prompt


def test_runner_offload_moves_the_quantized_layers_too_with_the_same_logits(tiny_model,
                                                                           torch_path):
    """runner.kv_offload=cpu: quantized (KIVI) layers keep their codes on the host as well; the
    sparse layers are on the host either way, so the logits do not change."""
    from harness.core import hf_adapter
    from harness.core.engine import Engine, EngineSettings

    ids = torch.randint(3, 250, (1, 60), generator=torch.Generator().manual_seed(6))
    info = hf_adapter.model_info(tiny_model.config)
    runs = {}
    for offload in ("none", "cpu"):
        method = build_method("tailorkv", budget_tokens=10, sink_tokens=2, recent_tokens=3,
                              group_size=8, residual_tokens=8, quant_layers=[0])
        hf_adapter.prepare(method, tiny_model, None, info)
        engine = Engine(tiny_model, None, method, info,
                        EngineSettings(prefill_chunk_tokens=16, kv_offload=offload))
        with engine.request() as req:
            logits = [req.prefill(ids[:, :40])] + [req.step(ids[:, t]) for t in range(40, 60)]
        runs[offload] = (torch.cat(logits, 1), engine.transfers.summary())
    assert torch.equal(runs["none"][0], runs["cpu"][0])
    per_layer = {k: v[1]["bytes_h2d_per_layer"] for k, v in runs.items()}
    assert per_layer["none"][0] == 0 < per_layer["cpu"][0]  # layer 0 quantized: offloaded or not
    assert per_layer["none"][1] == per_layer["cpu"][1] > 0  # layer 1 sparse: always on the host


def test_over_budget_is_caught_by_the_engine(tiny_model, monkeypatch):
    """The per-forward check is live: a layer that attends one token more than it reports is
    refused (the budget check can fail)."""
    method = build_method("tailorkv", budget_tokens=8, sink_tokens=2, recent_tokens=2,
                          quant_layers=[])
    monkeypatch.setattr(TopKOffloadLayer, "allowed_tokens",
                        lambda self: 7 if self.selection is not None else None)
    engine = make_engine(tiny_model, method, chunk=16)
    with pytest.raises(BudgetViolation, match="budget is 7"):
        with engine.request() as req:
            req.prefill(torch.randint(3, 250, (1, 20)))
            req.step(torch.tensor([5]))


# --- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize("hyper, message", [
    ({"k_bits": 3}, "method.k_bits=3; allowed: 1, 2, 4, 8"),
    ({"residual_tokens": 100},
     "method.residual_tokens=100 must be a multiple of method.group_size=64"),
    ({"recent_tokens": 0}, "method.recent_tokens=0 must be a positive integer"),
    ({"key_channels": 0}, "method.key_channels=0 must be a positive integer"),
    ({"dense_threshold": 1.5}, "method.dense_threshold=1.5 must be in [0, 1]"),
    ({"quant_layers": [-1]}, "method.quant_layers=[-1] must be layer indices >= 0"),
    ({"budget_ratio": None, "budget_tokens": 0},
     "method.budget_tokens=0 must be a positive integer"),
])
def test_bad_config_is_one_line_naming_the_key(hyper, message):
    with pytest.raises(ConfigError) as err:
        build_method("tailorkv", **hyper)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_layers_beyond_the_model_are_refused_before_weights_load():
    reasons = build_method("tailorkv", quant_layers=[0, 5]).validate(info_of(layers=4), {})
    assert reasons == ["method.quant_layers=[0, 5] names a layer >= the model's 4 layers"]
    # official num_channel: 8 key channels whatever head_dim (not a share of it)
    assert build_method("tailorkv").key_channels == 8
    assert build_method("tailorkv").validate(info_of(layers=4, d=8), {}) == []
    assert "method.key_channels=8 exceeds the model's head_dim 4" in build_method(
        "tailorkv").validate(info_of(layers=4, d=4), {})
