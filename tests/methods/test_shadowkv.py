"""ShadowKV: exact un-rotation and low-rank factors, outliers and landmark selection by hand, the
budget at every decode step, values really fetched from the host tier (bytes in the ledger), and a
model-level decode step recomputed by hand from the prompt's keys."""

import pytest
import torch

from harness.core import hf_adapter
from harness.config.runner import protocol_reasons
from kvcore.errors import ConfigError
from kvcore.offload import Tier, TransferLedger
from methods import build_method
from methods.model import ModelInfo, PrepareContext
from methods.protocol import Protocol
from methods.rope import rotate
from methods.shadowkv import ShadowKVLayer, chunk_rows
from tests.conftest import make_engine
from tests.helpers.runs import ST, refused
from tests.helpers.validation import one_reason


def bare_layer(method, h_kv=1, d=8, heads=None):
    """A ShadowKV layer outside a model: CPU tier, RoPE frequencies of theta 10^4."""
    info = ModelInfo(num_layers=1, num_heads=heads or h_kv, num_kv_heads=h_kv, head_dim=d,
                     max_positions=4096, rope_theta=1e4)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d))
    method.prepare(PrepareContext(info=info, tokenizer=None, device=torch.device("cpu"),
                                  fingerprint="test", rope_inv_freq=inv_freq, project_query=None,
                                  capture=None, vocab_size=1))
    layer = method.make_layer(0, info)
    layer.tier = Tier(torch.device("cpu"), TransferLedger(1), offload=True)
    return layer, inv_freq


def selected_chunks(layer):
    """`(H, k)`: per KV head the context chunks the last step chose (its attended context rows'
    chunks, the outliers out)."""
    c, n_ctx = layer.unit_tokens, layer.ctx_positions.numel()
    chosen = []
    for row, outliers in zip(layer.kept_positions()[0].tolist(), layer.outlier_chunk_ids()[0]):
        chosen.append(sorted({p // c for p in row if p < n_ctx} - set(outliers.tolist())))
    return torch.tensor(chosen)


def chunks_for(layer, q, k, scaling):
    """`(B, H, k)` sorted: the k best-scored chunks for decode queries `q (B, H_q, D)`."""
    scores = layer.selection_scores(q[:, :, None], None, None, scaling)[:, :, 0]
    return scores.topk(k, dim=-1).indices.sort(-1).values


def feed_prompt(layer, post_keys, values):
    layer.update(post_keys, values, torch.arange(post_keys.shape[2])[None])
    layer.on_prefill_end()


def test_outlier_is_the_chunk_with_an_orthogonal_key_and_factors_are_exact_at_full_rank():
    torch.manual_seed(0)
    c, chunks, d = 8, 6, 8
    base = torch.randn(d)
    pre = base + 0.05 * torch.randn(1, 1, (chunks + 4) * c, d)  # all keys close to one direction
    odd = torch.zeros(d)
    odd[0], odd[1] = -base[1], base[0]  # orthogonal to base
    pre[0, 0, 3 * c + 5] = odd * 3  # chunk 3 holds one orthogonal key
    method = build_method("shadowkv", budget_tokens=100, rank_ratio=1.0, outlier_ratio=0.08,
                          compress_above_tokens=0)
    layer, inv_freq = bare_layer(method)
    post = rotate(pre, torch.arange(pre.shape[2]).float(), inv_freq)
    values = torch.randn_like(post)
    feed_prompt(layer, post, values)
    # outliers: floor(0.08 * 100) // 8 = 1 chunk, the one with the orthogonal key
    assert layer.outlier_rows.tolist() == [[list(range(3 * c, 4 * c))]]
    assert sorted(layer.landmark_chunks[0, 0].tolist()) == [0, 1, 2, 4, 5]
    # exact inverse rotation + full-rank SVD: the rebuilt keys are the original post-RoPE keys
    rows = chunk_rows(torch.tensor([[[0, 5]]]), c)
    keys, vals = layer._reconstruct(rows)
    assert torch.allclose(keys, post[:, :, rows[0, 0]], atol=1e-5)
    assert torch.equal(vals, values[:, :, rows[0, 0]])
    # the chunked region's values live on the host tier; the local window (4 chunks) on the device
    assert layer.host.all_rows()[0].shape == (1, 1, chunks * c, d)
    assert layer.keys.shape[2] == 4 * c and layer.kept_tokens() == (chunks + 4) * c


def test_low_rank_factors_are_the_truncated_svd_of_the_pre_rope_keys():
    torch.manual_seed(1)
    method = build_method("shadowkv", budget_tokens=64, rank=3, compress_above_tokens=0)
    layer, inv_freq = bare_layer(method, h_kv=2)
    pre = torch.randn(1, 2, 48, 8)
    feed_prompt(layer, rotate(pre, torch.arange(48).float(), inv_freq), torch.randn(1, 2, 48, 8))
    flat = pre.transpose(1, 2).reshape(48, 16)
    u, s, vh = torch.linalg.svd(flat, full_matrices=False)
    best3 = (u[:, :3] * s[:3]) @ vh[:3]  # (48, 16): the rank-3 approximation
    rebuilt = torch.einsum("nr,hrd->hnd", layer.u[0], layer.sv[0])  # (H, n_ctx, D)
    n_ctx = layer.u.shape[1]
    assert n_ctx == 48 - 4 * 8
    assert torch.allclose(rebuilt, best3[:n_ctx].view(n_ctx, 2, 8).transpose(0, 1), atol=1e-5)


def test_a_query_on_a_landmark_selects_its_chunk_and_gqa_takes_the_max():
    torch.manual_seed(2)
    method = build_method("shadowkv", budget_tokens=200, outlier_ratio=0.0, compress_above_tokens=0)
    layer, _ = bare_layer(method, h_kv=1, heads=2)
    feed_prompt(layer, torch.randn(1, 1, 12 * 8, 8), torch.randn(1, 1, 96, 8))
    assert layer.landmarks.shape == (1, 1, 8, 8)
    lm = layer.landmarks[0, 0]
    q = torch.stack([lm[5] * 50, torch.zeros(8)])[None]  # head 0 points at chunk 5, head 1 at none
    assert chunks_for(layer, q, 1, 8 ** -0.5).tolist() == [[[5]]]
    q = torch.stack([torch.zeros(8), lm[2] * 50])[None]  # the other query head of the group
    assert chunks_for(layer, q, 1, 8 ** -0.5).tolist() == [[[2]]]
    # by hand: softmax per query head at the model's scaling, max over the group
    q = torch.randn(1, 2, 8)
    for scaling in (8 ** -0.5, 1 / 8, 2.0):
        probs = torch.softmax(q[0] @ lm.T * scaling, -1).amax(0)
        assert chunks_for(layer, q, 3, scaling)[0, 0].tolist() == sorted(
            probs.topk(3).indices.tolist())


@pytest.mark.kept_set
def test_model_decode_steps_match_a_hand_computation_and_respect_the_budget(tiny_model, monkeypatch):
    """Sparse budget 16 on a 64-token prompt of the tiny GQA Llama: per layer and step, rebuild from
    the full-cache prompt keys the landmarks, outliers, chunk choice, low-rank keys and the
    attention output (over outliers + 2 chunks + the whole local window), and check the grant and
    the bytes fetched from the host."""
    torch.manual_seed(7)
    ids = torch.randint(3, 250, (1, 72))
    full = make_engine(tiny_model, build_method("full"))
    with full.request() as req:
        req.prefill(ids[:, :64])
        prompt = [(kv.keys.clone(), kv.values.clone()) for kv in req.cache.kv_layers]

    steps = []
    original = ShadowKVLayer.attend

    def spy(self, module, query, keys, values, mask, base, **kw):
        out = original(self, module, query, keys, values, mask, base, **kw)
        if query.shape[2] == 1:
            steps.append(dict(layer=self.layer_idx, q=query[0, :, 0], out=out[0][0, 0],
                              local_k=self.keys[0].clone(), local_v=self.values[0].clone(),
                              chunks=selected_chunks(self), scaling=kw["scaling"]))
        return out

    monkeypatch.setattr(ShadowKVLayer, "attend", spy)
    method = build_method("shadowkv", budget_tokens=16, rank=12, outlier_ratio=0.5,
                          compress_above_tokens=0)
    engine = make_engine(tiny_model, method, chunk=16)
    c, n_ctx = 8, 64 - 4 * 8  # 4 chunks of context, 32 local tokens
    with engine.request() as req:
        req.prefill(ids[:, :64])
        for t in range(64, 72):
            req.step(ids[:, t])
            for kv in req.cache.kv_layers:  # 1 outlier + 2 chunks + the local window
                assert kv.stats()["selected_tokens"] == kv.allowed_tokens() == 24 + t + 1 - n_ctx
    inv_freq = method._inv_freq
    assert int(0.5 * 16) // c == 1  # one outlier chunk per KV head
    assert len(steps) == 2 * 8  # both layers, every decode step
    for s in steps:
        keys, values = prompt[s["layer"]]
        keys, values = keys[0], values[0]  # (H, 64, D)
        h_kv, _, d = keys.shape
        ctx = keys[:, :n_ctx].view(h_kv, 4, c, d)
        means = ctx.mean(2)
        bad = torch.nn.functional.cosine_similarity(means[:, :, None], ctx, dim=-1).amin(-1)
        pre = rotate(keys, -torch.arange(64).float(), inv_freq).transpose(0, 1).reshape(64, h_kv * d)
        u, sv_s, vh = torch.linalg.svd(pre, full_matrices=False)
        low = ((u[:, :12] * sv_s[:12]) @ vh[:12]).view(64, h_kv, d).transpose(0, 1)  # (H, 64, D)
        low = rotate(low, torch.arange(64).float(), inv_freq)
        groups = s["q"].shape[0] // h_kv
        k = 16 // c  # the sparse budget's chunks; the local window is on top, whole
        for h in range(h_kv):
            outlier = int(bad[h].argmin())
            rest = [j for j in range(4) if j != outlier]
            q = s["q"][h * groups:(h + 1) * groups]
            probs = torch.softmax(q @ means[h, rest].T / d ** 0.5, -1).amax(0)
            want = sorted(rest[i] for i in probs.topk(k).indices.tolist())
            assert s["chunks"][h].tolist() == want
            rows = [j * c + i for j in want for i in range(c)]
            out_rows = list(range(outlier * c, (outlier + 1) * c))
            kk = torch.cat([keys[h, out_rows], low[h, rows], s["local_k"][h]])
            vv = torch.cat([values[h, out_rows], values[h, rows], s["local_v"][h]])
            for j in range(h * groups, (h + 1) * groups):
                w = torch.softmax(kk @ s["q"][j] * s["scaling"], -1)
                assert torch.allclose(s["out"][j], w @ vv, atol=1e-4)
    # values moved host -> device per decode step: k chunks * 8 rows * H_kv * D * 4 bytes per layer
    per_step = engine.transfers.summary()["bytes_per_decode_step"]
    ks = [s["chunks"].shape[1] for s in steps]
    assert per_step == sum(k * c * 2 * 16 * 4 for k in ks) / 8


def plain_attention(module, query, keys, values, mask, **kwargs):
    """Softmax attention `(B, q, H_q, D)` over `keys (B, H_kv, T, D)` (GQA), no mask."""
    groups = query.shape[1] // keys.shape[1]
    k, v = (x.repeat_interleave(groups, 1) for x in (keys, values))
    w = torch.softmax(query @ k.transpose(2, 3) * kwargs["scaling"], -1)
    return (w @ v).transpose(1, 2), None


def test_sparse_budget_counts_only_the_selected_chunks_and_the_local_window_grows():
    """The official counting (models/kv_cache.py): a sparse budget of 2 chunks selects 2 chunks at
    every decode step, however many tokens were generated; the outlier chunks, the prompt's local
    window and every generated token are attended on top (the window taken out of the budget
    would leave no chunk after a few steps)."""
    torch.manual_seed(3)
    c, d = 8, 8
    method = build_method("shadowkv", budget_tokens=16, outlier_ratio=0.5, compress_above_tokens=0)
    layer, _ = bare_layer(method, h_kv=1, heads=2, d=d)
    prompt = 10 * c + 3  # 6 context chunks (1 outlier), 4 local chunks + 3 remainder tokens
    feed_prompt(layer, torch.randn(1, 1, prompt, d), torch.randn(1, 1, prompt, d))
    assert layer.ctx_positions.numel() == 6 * c and layer.outlier_rows.shape[2] == c
    for step in range(60):
        seen = prompt + step
        keys, values = layer.update(torch.randn(1, 1, 1, d), torch.randn(1, 1, 1, d),
                                    torch.tensor([[seen]]))
        layer.attend(None, torch.randn(1, 2, 1, d), keys, values, None, plain_attention,
                     scaling=d ** -0.5)
        local = 4 * c + 3 + step + 1  # the prompt's local window + every generated token
        assert selected_chunks(layer).shape[-1] == 2, step
        assert layer.attended_tokens() == c + 2 * c + local == layer.allowed_tokens()
        positions = layer.kept_positions()[0, 0].tolist()
        assert positions[-local:] == list(range(6 * c, seen + 1))  # the whole window, in order


def test_only_prompts_above_the_official_threshold_are_compressed():
    """Official: the compressing prefill runs for q_len > 4096 only; the knob moves it."""
    d = 8
    for tokens, threshold, compressed in ((4096, 4096, False), (4097, 4096, True),
                                          (200, 4096, False), (200, 199, True)):
        method = build_method("shadowkv", budget_tokens=16, compress_above_tokens=threshold)
        layer, _ = bare_layer(method, d=d)
        feed_prompt(layer, torch.randn(1, 1, tokens, d), torch.randn(1, 1, tokens, d))
        assert layer.compressed == compressed, (tokens, threshold)
    assert build_method("shadowkv").provenance_label() == "official code"
    assert "compress_above_tokens=0" in build_method(
        "shadowkv", compress_above_tokens=0).provenance_label()
    # the official sparse budget when no shared budget knob is set
    assert build_method("shadowkv").sparse_budget(None) == 2048
    assert build_method("shadowkv", budget_ratio=0.2).sparse_budget(1000) == 200


def test_prompt_too_short_or_no_prompt_stays_dense(tiny_model):
    method = build_method("shadowkv", budget_tokens=8, compress_above_tokens=0)
    engine = make_engine(tiny_model, method)
    with engine.request() as req:
        for t in range(40):  # streaming: no prompt, so nothing to decompose
            req.step(torch.tensor([5 + t]))
        layer = req.cache.kv_layers[1]
        assert not layer.compressed and layer.allowed_tokens() is None
        assert layer.attended_tokens() == 40
    with engine.request() as req:
        req.prefill(torch.arange(3, 35))  # 32 tokens = the local window only
        assert not req.cache.kv_layers[0].compressed


def test_capabilities_refuse_sparse_prefill_and_check_keys(tiny_model):
    method = build_method("shadowkv")
    info = hf_adapter.model_info(tiny_model.config)

    class Task:
        name = "t"

        def phases(self):
            return frozenset({"prefill", "decode"})

    reasons = protocol_reasons(method, Task(), info, Protocol(prefill="sparse"))
    assert any("runner.prefill=sparse" in r for r in reasons)
    assert method.capabilities.offloads_kv and method.capabilities.needs_rope
    with pytest.raises(ConfigError, match="method.rank_ratio"):
        build_method("shadowkv", rank_ratio=0)
    with pytest.raises(ConfigError, match="method.chunk_size"):
        build_method("shadowkv", chunk_size=0)
    no_rope = ModelInfo(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, max_positions=64)
    assert any("RoPE" in r for r in method.validate(no_rope, {}))
    assert method.rank_of(info) == round(0.15625 * 2 * 16)


@pytest.mark.gpu
def test_host_tier_on_cuda_gives_the_cpu_result():
    """On CUDA the values sit in pinned host memory and the selected rows come back on the side
    stream; the rebuilt keys and fetched values equal the CPU layer's."""
    torch.manual_seed(4)
    pre, values = torch.randn(1, 2, 80, 16), torch.randn(1, 2, 80, 16)
    out = []
    for device in ("cpu", "cuda"):
        method = build_method("shadowkv", budget_tokens=64, rank=8, compress_above_tokens=0)
        layer, inv_freq = bare_layer(method, h_kv=2, d=16)
        layer.tier = Tier(torch.device(device), TransferLedger(1), offload=True)
        post = rotate(pre, torch.arange(80).float(), inv_freq).to(device)
        feed_prompt(layer, post, values.to(device))
        (held,) = layer.host.all_rows()  # (B, H_kv, n_ctx, D) views of the host buffer
        assert held.device.type == "cpu"
        assert held.is_pinned() == (device == "cuda")
        rows = chunk_rows(torch.tensor([[[1, 4], [0, 2]]], device=device), 8)
        out.append([t.cpu() for t in layer._reconstruct(rows)])
    assert torch.allclose(out[0][0], out[1][0], atol=1e-4)
    assert torch.equal(out[0][1], out[1][1])


STORIES_INFO = ModelInfo(num_layers=5, num_heads=8, num_kv_heads=4, head_dim=8, max_positions=512,
                         rope_theta=10000.0)


def test_shadowkv_threshold_beyond_the_models_positions_is_named(tmp_path, no_weight_loading):
    message = refused(tmp_path, *ST, "task.prefill_tokens=16", "method=shadowkv",
                      "method.budget_tokens=8")
    assert ("method.compress_above_tokens=4096: ShadowKV compresses only prompts longer than "
            "that, but this model has 512 max positions") in message


def test_shadowkv_rank_beyond_the_key_width_is_refused():
    reason = one_reason(build_method("shadowkv", compress_above_tokens=0, rank=64), STORIES_INFO)
    assert "method.rank=64 is larger than the keys' width on this model (H_kv x head_dim = 32)" \
        in reason
    assert not build_method("shadowkv", compress_above_tokens=0, rank=32).validate(
        STORIES_INFO, {"batch_size": 1})


def test_shadowkv_rank_and_rank_ratio_both_set_is_refused():
    with pytest.raises(ConfigError, match="the rank would win and the ratio be ignored"):
        build_method("shadowkv", rank=8, rank_ratio=0.5)
    build_method("shadowkv", rank=8)
    build_method("shadowkv", rank_ratio=0.5)
