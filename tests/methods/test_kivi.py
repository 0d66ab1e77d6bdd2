"""KIVI: the quantizer's error bound and packing, Triton == torch, the residual bookkeeping, real
bytes, exactness when nothing is quantized, and measured quality on stories260K.

Triton runs in the CPU interpreter here (tests/conftest.py sets TRITON_INTERPRET=1): kernels are
checked on a handful of small calls; model-level tests switch to plain CPU dispatch by removing the
variable (quantizer: torch reference; decode attention: the C kernel, torch without a compiler).
"""

import pytest
import torch
from hydra import compose, initialize_config_dir

from harness.core import models
from kvcore.errors import ConfigError
from harness.run import run
from methods import build_method
from methods.model import ModelInfo
from methods.kernels import kivi_attention as ka  # imported here, under the interpreter (conftest)
from methods.kernels import kivi_quant as kq
from tests.conftest import PROJECT, STORIES, make_engine, need_shared
from tests.methods.kivi_cases import dense_reference, keys_and_values, packed_cache


def error_bound(quant, bits, group_size):
    """Per element: half a step, plus fp16 rounding of the stored scale and zero point."""
    levels = (1 << bits) - 1
    scale, zero = (t.float().repeat_interleave(group_size, -1) for t in (quant.scale, quant.zero))
    return scale / 2 + 2.0 ** -10 * (zero.abs() + levels * scale) + 1e-6


# --- the quantizer --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["keys", "values"])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_reconstruction_error_is_within_half_a_step(impl, bits, mode, monkeypatch):
    if impl == "torch":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kq.use_triton(torch.zeros(1)) == (impl == "triton")
    k, v = keys_and_values(64, d=32)
    # keys: per channel, groups of 32 tokens; values: per token, groups of 16 channels
    x, group = (k.transpose(-1, -2), 32) if mode == "keys" else (v, 16)
    quant = kq.quantize_pack(x, bits, group)
    x_hat = kq.dequantize(quant, bits, group, torch.float32)
    assert x_hat.shape == x.shape and x_hat.dtype == torch.float32
    err = (x - x_hat).abs()
    assert (err <= error_bound(quant, bits, group)).all()
    # and the bound is not slack: some element is off by nearly half a step
    assert (err / quant.scale.float().repeat_interleave(group, -1)).max() > 0.45


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_packed_sizes_and_grouping_axes(bits):
    k, v = keys_and_values(64, b=2, h=3, d=32)
    kquant = kq.quantize_pack(k.transpose(-1, -2), bits, 32)
    assert kquant.codes.dtype == torch.uint8
    assert kquant.scale.dtype == kquant.zero.dtype == torch.float16
    assert kquant.codes.numel() == k.numel() * bits // 8  # a 2-bit code takes 2 bits
    assert kquant.scale.shape == kquant.zero.shape == (2, 3, 32, 2)  # (B, H, D, T / G)
    assert kquant.nbytes == k.numel() * bits // 8 + 2 * 2 * (k.numel() // 32)
    # keys: min/max per channel over each group of 32 tokens
    groups = k.reshape(2, 3, 2, 32, 32)  # (B, H, T/G, G tokens, D)
    levels = (1 << bits) - 1
    want_scale = ((groups.amax(3) - groups.amin(3)) / levels).half().transpose(-1, -2)
    assert torch.equal(kquant.scale, want_scale)
    assert torch.equal(kquant.zero, groups.amin(3).half().transpose(-1, -2))
    # values: min/max per token over each group of 16 channels
    vquant = kq.quantize_pack(v, bits, 16)
    assert vquant.scale.shape == (2, 3, 64, 2)  # (B, H, T, D / G)
    assert torch.equal(vquant.zero, v.reshape(2, 3, 64, 2, 16).amin(-1).half())


def test_triton_equals_torch_reference():
    x = torch.randn(2, 3, 8, 96) * 5
    x[0, 0, 0, :32] = 1.5  # a constant group (scale 0)
    for bits, group in [(2, 32), (4, 8), (8, 16), (2, 12)]:  # 12: not a power of two (masked lanes)
        tri, ref = kq.quantize_pack(x, bits, group), kq.quantize_pack_ref(x, bits, group)
        for a, b in zip(tri, ref):
            assert torch.equal(a, b)  # codes, scales and zero points bit for bit
        for dtype in (torch.float32, torch.float16):
            y_tri = kq.dequantize(tri, bits, group, dtype)
            y_ref = kq.dequantize_ref(ref, bits, group, dtype)
            assert y_tri.dtype == dtype
            torch.testing.assert_close(y_tri, y_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_constant_groups_and_non_contiguous_inputs(impl, monkeypatch):
    if impl == "torch":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(1, 2, 32, 8)
    x[0, 1] = -3.25  # constant (fp16-representable) group: no division by zero, exact round trip
    x_t = x.transpose(-1, -2)  # keys mode: a non-contiguous view
    quant = kq.quantize_pack(x_t, 2, 32)
    assert (quant.scale[0, 1] == 0).all() and (quant.codes[0, 1] == 0).all()
    x_hat = kq.dequantize(quant, 2, 32, torch.float32)
    assert torch.equal(x_hat[0, 1], x_t[0, 1])
    assert all(torch.equal(a, b) for a, b in zip(quant, kq.quantize_pack(x_t.contiguous(), 2, 32)))
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        kq.quantize_pack(torch.zeros(1, 33), 2, 32)  # ragged groups are the caller's bug


def test_cpu_without_interpreter_takes_the_torch_path(monkeypatch):
    calls = []
    real = kq.quantize_pack_ref
    monkeypatch.setattr(kq, "quantize_pack_ref", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(4, 32)
    kq.quantize_pack(x, 4, 32)
    assert calls == []  # TRITON_INTERPRET=1 (conftest): the kernel ran in the interpreter
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not kq.use_triton(x)
    kq.quantize_pack(x, 4, 32)
    assert calls == [1]


# --- the cache layer ------------------------------------------------------------------------------
def kivi_layer(head_dim=16, **hyper):
    info = ModelInfo(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=head_dim,
                     max_positions=4096)
    return build_method("kivi", **hyper).make_layer(0, info)


def sizes(layer):
    return (layer.quantized_key_tokens(), layer._tokens(layer.k_residual),
            layer.quantized_value_tokens(), layer._tokens(layer.v_residual))


def test_residual_bookkeeping(torch_path):
    R = 32
    layer = kivi_layer(k_bits=2, v_bits=2, group_size=8, residual_tokens=R)
    k, v = keys_and_values(200)
    layer.update(k[..., :75, :], v[..., :75, :], None)  # prefill: floor(n/R)*R keys quantized
    assert sizes(layer) == (64, 11, 43, 32)
    n = 75
    for t in range(75, 140):  # decode: K_r grows to R, then flushes; V_r is a FIFO of R
        assert layer.mask_sizes(1) == (n + 1, 0)
        tail_k, _ = layer.update(k[..., t:t + 1, :], v[..., t:t + 1, :], None)
        assert torch.equal(tail_k[..., -1:, :], k[..., t:t + 1, :])  # returned: the exact tail
        out_k, out_v = layer.dequantized_kv()
        n += 1
        assert out_k.shape[-2] == out_v.shape[-2] == n  # every token attended (nothing evicted)
        assert torch.equal(out_k[..., -1:, :], k[..., t:t + 1, :])  # the new token exactly
        assert sizes(layer) == (n // R * R, n % R, n - R, R)
        assert layer.seen_tokens == layer.kept_tokens() == layer.stats()["kv_tokens"] == n
    assert layer.allowed_tokens() is None


def test_quantized_values_grow_in_place_and_storage_is_counted(torch_path):
    """Decode appends one quantized value per step into token-major storage with amortised
    growth: no reallocation (copy of everything held) per step; used <= allocated bytes."""
    layer = kivi_layer(k_bits=2, v_bits=2, group_size=8, residual_tokens=32)
    k, v = keys_and_values(700)
    layer.update(k[..., :75, :], v[..., :75, :], None)
    buffers = []
    for t in range(75, 700):
        layer.update(k[..., t:t + 1, :], v[..., t:t + 1, :], None)
        buffers.append(layer.v_store[0].buffer.data_ptr())
        stats = layer.stats()
        assert stats["kv_bytes"] == stats["kv_bytes_used"] <= stats["kv_bytes_allocated"]
    # 43 -> 668 quantized values: room for 512 rows at first, one growth past them
    assert len(set(buffers)) == 2
    assert layer.v_quant.codes.shape == (1, 2, 700 - 32, 16 * 2 // 8)
    _, out_v = layer.dequantized_kv()  # as the last step saw it: 667 quantized, then exact
    quantized = kq.quantize_pack_ref(v[..., :667, :], 2, 8)
    torch.testing.assert_close(out_v[..., :667, :], kq.dequantize_ref(quantized, 2, 8,
                                                                      torch.float32))
    assert torch.equal(out_v[..., 667:, :], v[..., 667:, :])


def test_prefill_sees_exact_kv_and_later_chunks_see_the_stored_cache(torch_path):
    layer = kivi_layer(k_bits=2, v_bits=2, group_size=8, residual_tokens=16)
    k, v = keys_and_values(60)
    layer.update(k[..., :40, :], v[..., :40, :], None)
    out_k, out_v = layer.dequantized_kv()
    assert torch.equal(out_k, k[..., :40, :]) and torch.equal(out_v, v[..., :40, :])
    layer.update(k[..., 40:, :], v[..., 40:, :], None)  # chunk over a stored cache
    out_k, out_v = layer.dequantized_kv()
    assert torch.equal(out_k[..., 32:, :], k[..., 32:, :])  # K_r (8 exact) + the new chunk
    assert torch.equal(out_v[..., 24:, :], v[..., 24:, :])  # V_r (16 exact) + the new chunk
    stored_k = kq.dequantize_ref(kq.quantize_pack_ref(k[..., :32, :].transpose(-1, -2), 2, 8), 2, 8,
                                 torch.float32).transpose(-1, -2)
    assert torch.equal(out_k[..., :32, :], stored_k)  # quantized per channel, dequantized
    err = (out_v[..., :24, :] - v[..., :24, :]).abs()
    assert 0 < err.max() < 1.5  # 2-bit values: lossy, but bounded


def test_layer_on_triton_equals_layer_on_torch(monkeypatch):
    k, v = keys_and_values(24)
    steps = [(0, 13), (13, 14), (14, 15), (15, 24)]
    outs = {}
    for impl in ("triton", "torch"):
        if impl == "torch":
            monkeypatch.delenv("TRITON_INTERPRET")
        layer = kivi_layer(k_bits=4, v_bits=2, group_size=4, residual_tokens=8)
        outs[impl] = [layer.update(k[..., a:b, :], v[..., a:b, :], None) and layer.dequantized_kv()
                      for a, b in steps]
    for (tk, tv), (rk, rv) in zip(outs["triton"], outs["torch"]):
        torch.testing.assert_close(tk, rk, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(tv, rv, rtol=1e-6, atol=1e-6)


def test_stats_count_real_bytes(tiny_model, torch_path):
    cfg = tiny_model.config
    heads, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads  # 2, 16
    engine = make_engine(tiny_model, build_method("kivi", residual_tokens=32), chunk=40)
    with engine.request() as req:
        req.prefill(torch.arange(3, 93))
        for t in range(10):
            req.step(t + 5)
    n = 100
    k_q, k_r, v_q, v_r = n // 32 * 32, n % 32, n - 32, 32  # 96, 4, 68, 32
    v_group = min(32, d)  # head_dim 16 < group_size: one value group per token and head
    per_head = (k_q * d * 2 // 8 + 2 * 2 * (k_q // 32) * d  # key codes + fp16 scale/zero per group
                + v_q * d * 2 // 8 + 2 * 2 * v_q * (d // v_group)  # value codes + metadata
                + (k_r + v_r) * d * 4)  # fp32 residuals
    sample = engine.ledger.samples[-1]
    assert sample["tokens_per_layer"] == [n] * cfg.num_hidden_layers
    assert sample["bytes_per_layer"] == [heads * per_head] * cfg.num_hidden_layers
    assert sample["budget_per_layer"] == [None] * cfg.num_hidden_layers


# --- against the full cache -----------------------------------------------------------------------
def stream_logits(model, method, ids, prefill_tokens=1, chunk=512):
    engine = make_engine(model, method, chunk=chunk)
    with engine.request() as req:
        out = [req.prefill(ids[:prefill_tokens], all_logits=True)]
        out += [req.step(t) for t in ids[prefill_tokens:]]
    return torch.cat(out, 1)[0]


def test_nothing_quantized_equals_full_cache(tiny_model, torch_path):
    ids = torch.randint(3, 250, (120,), generator=torch.Generator().manual_seed(0)).tolist()
    full = stream_logits(tiny_model, build_method("full"), ids, prefill_tokens=70, chunk=32)
    kivi = build_method("kivi", k_bits=8, v_bits=8, group_size=32, residual_tokens=128)
    assert torch.equal(stream_logits(tiny_model, kivi, ids, prefill_tokens=70, chunk=32), full)
    # the prompt attends its exact K/V even when the stored cache is quantized (one prefill chunk)
    kivi2 = build_method("kivi", k_bits=2, v_bits=2, group_size=32, residual_tokens=32)
    lossy = stream_logits(tiny_model, kivi2, ids, prefill_tokens=70)
    full = stream_logits(tiny_model, build_method("full"), ids, prefill_tokens=70)
    assert torch.equal(lossy[:70], full[:70])
    assert (lossy[70:] - full[70:]).abs().max() > 1e-3  # decode sees the 2-bit cache


@pytest.fixture(scope="module")
def stories_text(stories):
    """300 tokens the model samples from BOS (seeded): in-distribution text, no data files."""
    model, _ = stories
    engine, g, ids = make_engine(model, build_method("full")), torch.Generator().manual_seed(0), [1]
    with engine.request() as req:
        logits = req.prefill(ids)
        while len(ids) < 300:
            ids.append(int(torch.multinomial(torch.softmax(logits[0, -1], -1), 1, generator=g)))
            logits = req.step(ids[-1])
    return ids


def test_kivi4_is_close_to_full_and_kivi2_is_worse(stories, stories_text, torch_path):
    """Measured (seeds 0/1, R=128, G=32): mean |dlogit| 8b 0.0014, 4b 0.024, 2b 0.29; argmax
    agreement 4b 0.99-0.997, 2b 0.89-0.94; NLL 4b -0.0005, 2b +0.08-0.10 vs full."""
    model, _ = stories
    ids = stories_text
    target = torch.tensor(ids[1:])
    full = stream_logits(model, build_method("full"), ids)
    nll = {"full": torch.nn.functional.cross_entropy(full[:-1], target).item()}
    diff, agree = {}, {}
    for bits in (4, 2):
        logits = stream_logits(model, build_method("kivi", k_bits=bits, v_bits=bits), ids)
        diff[bits] = (logits - full).abs().mean().item()
        agree[bits] = (logits.argmax(-1) == full.argmax(-1)).float().mean().item()
        nll[bits] = torch.nn.functional.cross_entropy(logits[:-1], target).item()
    assert diff[4] < 0.05 and agree[4] >= 0.97 and abs(nll[4] - nll["full"]) < 0.01
    assert diff[2] > 4 * diff[4] and agree[2] < agree[4] and nll[2] > nll[4] + 0.02


# --- configuration --------------------------------------------------------------------------------
@pytest.mark.parametrize("hyper, message", [
    ({"k_bits": 3}, "method.k_bits=3; allowed: 2, 4, 8"),
    ({"v_bits": 16}, "method.v_bits=16; allowed: 2, 4, 8"),
    ({"group_size": 0}, "method.group_size=0 must be a positive integer"),
    ({"group_size": 6}, "method.group_size=6: a group of 2-bit codes must fill whole bytes"),
    ({"residual_tokens": 0}, "method.residual_tokens=0 must be a positive integer"),
    ({"residual_tokens": 100},
     "method.residual_tokens=100 must be a multiple of method.group_size=32"),
])
def test_hyperparameter_errors_name_the_key(hyper, message):
    with pytest.raises(ConfigError, match=message):
        build_method("kivi", **hyper)


def test_head_dim_grouping_is_validated_and_clamped():
    def info(head_dim):
        return ModelInfo(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=head_dim,
                         max_positions=64)

    method = build_method("kivi")
    assert method.validate(info(64), {}) == [] and method.validate(info(8), {}) == []
    assert kivi_layer(head_dim=8).value_group_channels == 8  # stories260K: clamped to head_dim
    reasons = method.validate(info(48), {})  # 48 % 32 != 0
    assert len(reasons) == 1 and "method.group_size=32 does not divide head_dim=48" in reasons[0]


def test_runner_rejects_bad_bits_before_loading(monkeypatch):
    need_shared(STORIES)

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the config error was found")

    monkeypatch.setattr(models, "load_model", refuse)
    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config",
                      overrides=["model=stories260k", "method=kivi", "method.k_bits=3"])
    with pytest.raises(ConfigError, match=r"^method.k_bits=3; allowed: 2, 4, 8$"):
        run(cfg)


def test_metrics_record_the_decode_attention_kernel(tmp_path, torch_path):
    import json

    need_shared(STORIES)
    need_c_kernel()
    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config",
                      overrides=["model=stories260k", "method=kivi", "task.dataset=pg19",
                                 "task.max_tokens=64", f"runner.output_dir={tmp_path}"])
    metrics = json.loads((run(cfg) / "metrics.json").read_text())
    assert metrics["method"]["prepare"] == {"decode_attention": "c"}


def test_offloaded_kivi_equals_resident_and_moves_the_packed_bytes(tiny_model, torch_path):
    """runner.kv_offload=cpu (FlexGen+INT4): same logits; each decode step fetches exactly the
    quantized part (codes + fp16 scales/zeros), not fp K/V."""
    from harness.core import hf_adapter
    from harness.core.engine import Engine, EngineSettings
    from methods import build_method

    ids = torch.randint(3, 250, (1, 110), generator=torch.Generator().manual_seed(5))
    info = hf_adapter.model_info(tiny_model.config)
    runs = {}
    for offload in ("none", "cpu"):
        method = build_method("kivi", k_bits=4, v_bits=4, group_size=32, residual_tokens=32)
        engine = Engine(tiny_model, None, method, info,
                        EngineSettings(prefill_chunk_tokens=64, kv_offload=offload))
        with engine.request() as req:
            logits = [req.prefill(ids[:, :70], all_logits=True)]
            logits += [req.step(ids[:, t]) for t in range(70, 110)]
            quantized = sum((kv.k_quant.nbytes if kv.k_quant else 0) +
                            (kv.v_quant.nbytes if kv.v_quant else 0) for kv in req.cache.kv_layers)
        runs[offload] = (torch.cat(logits, 1), engine, quantized)
    assert torch.equal(runs["none"][0], runs["cpu"][0])
    ledger = runs["cpu"][1].transfers
    assert runs["none"][1].transfers.bytes_h2d == 0
    assert len(ledger.step_h2d) == 40 and all(b > 0 for b in ledger.step_h2d)
    # the last step fetched what was quantized before it (at most the final quantized size)
    assert 0 < ledger.step_h2d[-1] <= runs["cpu"][2]


# --- decode attention from the packed cache (methods/kernels/kivi_attention.py) -------------------
@pytest.mark.parametrize("segments", [(64, 10, 42), (96, 0, 80), (0, 20, 0), (32, 40, 72)])
def test_torch_decode_path_is_exact_and_blockwise(segments, monkeypatch, torch_path):

    cache = packed_cache(*segments)
    query = torch.randn(1, 6, 1, 16, generator=torch.Generator().manual_seed(1))
    blocks = []
    real = ka._dequant_block
    monkeypatch.setattr(ka, "_dequant_block", lambda *a: blocks.append(a[4] - a[3]) or real(*a))
    got = ka.decode_attention_torch(query, cache, 0.3)
    torch.testing.assert_close(got, dense_reference(query, cache, 0.3), rtol=1e-5, atol=1e-6)
    blocks.clear()
    got_small = ka.decode_attention_torch(query, cache, 0.3, block_tokens=32)
    torch.testing.assert_close(got_small, got, rtol=1e-5, atol=1e-6)
    # scratch is bounded by the block, never the whole quantized cache
    assert max(blocks, default=0) <= 32
    assert len(blocks) == -(-segments[0] // 32) + -(-segments[2] // 32)


def need_c_kernel():
    from methods.kernels import cpu_build, kivi_cpu

    if not cpu_build.compiler_available():
        pytest.skip("no C compiler here: KIVI's CPU kernel cannot be built (torch path instead)")
    assert kivi_cpu.library() is not None, kivi_cpu.build_error()


@pytest.mark.parametrize("bits,k_group,v_group", [(2, 32, 16), (4, 32, 8), (1, 16, 16),
                                                  (8, 8, 4)])
@pytest.mark.parametrize("segments", [(64, 10, 42), (96, 0, 80), (0, 20, 0), (32, 40, 72)])
def test_c_kernel_equals_dense_reference(bits, k_group, v_group, segments, torch_path):
    """The CPU kernel (bits 1/2/4/8, GQA g=3, both quantized segments and the fp residual) against
    dequantize-then-SDPA; the dispatcher picks it on CPU without the interpreter."""
    need_c_kernel()
    cache = packed_cache(*segments, k_bits=bits, v_bits=bits, k_group=k_group, v_group=v_group)
    query = torch.randn(1, 6, 1, 16, generator=torch.Generator().manual_seed(4))
    assert ka.decode_kernel(query.device) == "c"
    got = ka.decode_attention(query, cache, 0.3)
    torch.testing.assert_close(got, dense_reference(query, cache, 0.3), rtol=1e-5, atol=1e-6)


def test_c_kernel_reads_strided_views_and_ignores_the_thread_count(torch_path):
    """Token-major value storage (as the layer keeps it) is read in place, and the result does not
    depend on the number of threads (a fixed split of the token sum)."""
    need_c_kernel()
    cache = packed_cache(64, 30, 1500, b=2, h=3, d=32, v_group=32)
    token_major = kq.Quantized(*(t.movedim(2, 0).contiguous().movedim(0, 2)
                                 for t in cache.v_quant))
    assert not token_major.codes.is_contiguous()
    strided = cache._replace(v_quant=token_major)
    query = torch.randn(2, 6, 1, 32, generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ka.decode_attention_cpu(query, strided, 0.2)
        torch.set_num_threads(2)
        two = ka.decode_attention_cpu(query, strided, 0.2)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    torch.testing.assert_close(one, dense_reference(query, cache, 0.2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("segments,splits", [((64, 10, 42), 3), ((32, 40, 72), 1), ((0, 20, 0), 2)])
def test_fused_kernel_equals_torch_path(segments, splits):
    """Triton kernel in the interpreter (small shapes): both quantized segments, the fp residual,
    GQA g=3 (not a power of two), split-K partials merged."""

    cache = packed_cache(*segments, k_bits=2, v_bits=4, v_group=8)
    query = torch.randn(1, 6, 1, 16, generator=torch.Generator().manual_seed(2))
    got = ka.decode_attention_triton(query, cache, 0.25, splits=splits, block_t=16)
    want = ka.decode_attention_torch(query, cache, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert ka.use_triton(query)  # TRITON_INTERPRET=1 (conftest): the dispatcher picks the kernel


def test_layer_decode_uses_the_packed_path_and_matches_dequantize_then_attend(tiny_model,
                                                                              torch_path,
                                                                              monkeypatch):
    from methods import kivi

    ids = torch.randint(3, 250, (110,), generator=torch.Generator().manual_seed(3)).tolist()
    method = build_method("kivi", k_bits=2, v_bits=2, group_size=16, residual_tokens=32)
    calls = []
    real = kivi.decode_attention
    monkeypatch.setattr(kivi, "decode_attention", lambda *a: calls.append(1) or real(*a))
    fused = stream_logits(tiny_model, method, ids, prefill_tokens=80, chunk=32)
    assert len(calls) == 30 * tiny_model.config.num_hidden_layers  # every decode step, every layer
    monkeypatch.setattr(kivi, "plain_decode_row", lambda *a: False)
    dense = stream_logits(tiny_model, method, ids, prefill_tokens=80, chunk=32)
    torch.testing.assert_close(fused, dense, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_kernel_on_cuda_at_long_context(dtype):
    """Llama-3-8B-like KV heads (8, g=4, D=128) over 32K tokens: compiled kernel == torch path."""

    cache = packed_cache(32640, 100, 32612, b=1, h=8, d=128, k_group=32, v_group=32, dtype=dtype)
    cache = ka.KIVICache(*(kq.Quantized(*(t.cuda() for t in x)) if isinstance(x, kq.Quantized)
                           else x.cuda() if isinstance(x, torch.Tensor) else x for x in cache))
    query = torch.randn(1, 32, 1, 128, device="cuda", dtype=dtype)
    got = ka.decode_attention(query, cache, 128 ** -0.5)
    want = ka.decode_attention_torch(query, cache, 128 ** -0.5)
    assert got.is_cuda and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
