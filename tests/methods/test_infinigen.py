"""InfiniGen: skewing, speculation math, system == simulate, pool eviction, artefact cache."""

import errno
import logging
from pathlib import Path

import pytest
import torch

from harness.core import hf_adapter
from harness.core.engine import Engine, EngineSettings
from kvcore.errors import ConfigError
from kvcore.storage import ContiguousRows
from methods import build_method
from methods._infinigen_prep import column_choice, skewing_from
from methods.infinigen import InfiniGenLayer
from tests.conftest import make_engine


def run(model, method, ids, prefill, chunk=16, tok=None):
    engine = make_engine(model, method, tok, chunk=chunk)
    with engine.request(final_tokens=ids.shape[1]) as req:  # the budget basis: all of ids
        out = [req.prefill(ids[:, :prefill], all_logits=True)]
        out += [req.step(ids[:, t]) for t in range(prefill, ids.shape[1])]
    return torch.cat(out, 1), engine


@pytest.fixture
def tiny4():
    from harness.core import models

    return models.tiny_llama(num_layers=4, max_positions=4096)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_skewing_is_orthogonal_and_keeps_qk():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(96, 16, generator=g) * torch.linspace(0.1, 3, 16)
    k = torch.randn(48, 16, generator=g)
    a = skewing_from(q, k)
    assert torch.allclose(a @ a.T, torch.eye(16), atol=1e-5)
    assert torch.allclose((q @ a) @ (k @ a).T, q @ k.T, atol=1e-4)
    # energy is concentrated: the top 20 % of skewed columns carry more of |Q| than unskewed ones
    top = lambda m: m.abs().sum(0).topk(3).values.sum() / m.abs().sum()  # noqa: E731
    assert top(q @ a) > top(q)


@pytest.mark.parametrize("which", ["tiny", "stories"])
def test_system_equals_simulate(which, tiny4, stories, cache_dir):
    model, tok = (tiny4, None) if which == "tiny" else stories
    ids = torch.randint(3, 250, (1, 120), generator=torch.Generator().manual_seed(1))
    sim, _ = run(model, build_method("infinigen", mode="simulate"), ids, 48, tok=tok)
    sys_, engine = run(model, build_method("infinigen", mode="system"), ids, 48, tok=tok)
    assert torch.equal(sim.argmax(-1), sys_.argmax(-1))
    assert (sim - sys_).abs().max().item() < 1e-4
    assert engine.transfers.bytes_h2d > 0  # system mode really moved rows


def test_large_alpha_full_budget_equals_full_in_system_mode(tiny4, cache_dir):
    ids = torch.randint(3, 250, (1, 70), generator=torch.Generator().manual_seed(2))
    full, _ = run(tiny4, build_method("full"), ids, 30)
    got, _ = run(tiny4, build_method("infinigen", alpha=1e9, budget_ratio=1.0), ids, 30)
    assert (got - full).abs().max().item() < 1e-5


@pytest.mark.parametrize("select_per", ["query_head", "kv_head"])
def test_speculation_with_own_input_and_all_columns_is_exact(tiny4, cache_dir, select_per):
    """With partial_ratio=1 the skewed partial score is q_i . k_i / sqrt(d) exactly (A is
    orthogonal), so feeding layer i's own input selects the true top tokens by logit: per query
    head (the official code's GQA expansion), or per KV head by the group's max (ours)."""
    method = build_method("infinigen", partial_ratio=1.0, alpha=1e9, budget_ratio=0.25,
                          select_per=select_per)
    engine = make_engine(tiny4, method)
    ids = torch.randint(3, 250, (1, 41), generator=torch.Generator().manual_seed(3))
    captured = {}
    attn = tiny4.model.layers[2].self_attn

    def grab(module, args, kwargs):
        captured["x"] = kwargs["hidden_states"]
        captured["pos"] = kwargs["position_ids"]
    handle = attn.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with engine.request() as req:
            req.prefill(ids[:, :40])
            req.step(ids[:, 40])
            layer = req.cache.kv_layers[2]
            slots, counts = layer.speculate(captured["x"], captured["pos"])  # layer 2's own input
            chosen = slots[..., : int(counts.max())].sort(-1).values
            keys = layer.host.all_rows()[0]  # 41 stored tokens (the step's token included)
    finally:
        handle.remove()
    x = captured["x"]
    info = hf_adapter.model_info(tiny4.config)
    with torch.inference_mode():
        q = attn.q_proj(x).view(1, 1, info.num_heads, info.head_dim).transpose(1, 2)
    from methods.rope import rotate

    with torch.inference_mode():
        q = rotate(q, captured["pos"].view(1, 1, 1), hf_adapter.rope_inv_freq(tiny4))
    logits = (q @ keys.repeat_interleave(2, dim=1).transpose(2, 3))[:, :, 0] / info.head_dim ** 0.5
    heads = logits if select_per == "query_head" else logits.view(1, 2, 2, 41).amax(2)
    expected = heads.topk(int(0.25 * 41), dim=-1).indices.sort(-1).values
    assert torch.equal(chosen, expected)


def test_ledger_bytes_equal_the_formula(tiny4, cache_dir):
    """bytes h2d per decode step = dense layers x all rows + sparse layers x selected rows (per
    KV head selection: each KV head moves exactly its selection)."""
    ids = torch.randint(3, 250, (1, 60), generator=torch.Generator().manual_seed(4))
    _, engine = run(tiny4, build_method("infinigen", alpha=1e9, budget_ratio=0.25,
                                        select_per="kv_head"), ids, 40)
    cfg = tiny4.config
    row = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4  # K+V
    expected = []
    for t in range(40, 60):  # T stored tokens before step t; 0.25 of the final 60 tokens
        sparse = max(1, min(t, int(0.25 * 60)))
        expected.append(2 * t * row + 2 * sparse * row)
    assert engine.transfers.step_h2d == expected
    full_steps = [4 * t * row for t in range(40, 60)]
    _, full_engine = run(tiny4, build_method("full_offload"), ids, 40)
    assert full_engine.transfers.step_h2d == full_steps


def _layer_with(policy: str, counters, last_used):
    method = build_method("infinigen", eviction=policy, pool_capacity=0.5, mode="simulate")
    layer = InfiniGenLayer.__new__(InfiniGenLayer)
    layer.m, layer.system, layer._pk = method, False, None
    layer._kv, layer.tier = {}, None  # KVLayer.__init__ skipped: its (contiguous) K/V storage
    layer.meta = {name: ContiguousRows() for name in ("positions", "counter", "last_used")}
    t = len(counters)
    layer.positions = torch.arange(t).view(1, 1, t)
    layer.counter = torch.tensor(counters, dtype=torch.float).view(1, 1, t)
    layer.last_used = torch.tensor(last_used, dtype=torch.float).view(1, 1, t)
    layer.keys = torch.arange(t, dtype=torch.float).view(1, 1, t, 1)
    layer.values = layer.keys.clone()
    return layer


@pytest.mark.parametrize("policy, evicted", [
    ("fifo", [0, 1]),  # the two oldest
    ("counter", [1, 3]),  # fewest selections among the older half [0..3]
    ("lru", [0, 2]),  # least recently selected among the older half
])
def test_pool_eviction_policies(policy, evicted):
    counters = [5, 0, 2, 1, 0, 0, 9, 0]
    last_used = [1, 7, 2, 6, 8, 8, 8, 8]
    layer = _layer_with(policy, counters, last_used)
    layer._evict(2)
    kept = layer.positions[0, 0].tolist()
    assert sorted(set(range(8)) - set(kept)) == evicted
    assert layer.keys[0, 0, :, 0].tolist() == [float(p) for p in kept]


def test_pool_capacity_bounds_the_host_pool(tiny4, cache_dir):
    ids = torch.randint(3, 250, (1, 60), generator=torch.Generator().manual_seed(5))
    _, engine = run(tiny4, build_method("infinigen", pool_capacity=0.5), ids, 40)
    # dense layers 0 and 1 never evict (official: only speculating layers have a pool limit)
    assert engine.ledger.samples[-1]["tokens_per_layer"] == [60, 60, 30, 30]


def test_artefacts_round_trip_and_corrupt_cache_is_rebuilt(tiny4, cache_dir, caplog):
    first = build_method("infinigen")
    with caplog.at_level(logging.INFO, logger="methods._artefacts"):
        facts1 = hf_adapter.prepare(first, tiny4, None)
        second = build_method("infinigen")
        facts2 = hf_adapter.prepare(second, tiny4, None)
    assert ["loaded from the cache" in r.message for r in caplog.records
            if r.name == "methods._artefacts"] == [False, True]
    assert facts1["skewing_artefacts"] == facts2["skewing_artefacts"]  # cold = warm
    assert torch.equal(first._art.skew, second._art.skew)
    assert torch.equal(first._art.q_energy, second._art.q_energy)
    assert torch.equal(first._art.k_energy, second._art.k_energy)
    path = facts1["skewing_artefacts"]["path"]
    with open(path, "r+b") as f:
        f.seek(200)
        f.write(b"\x00" * 64)
    third = build_method("infinigen")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        facts3 = hf_adapter.prepare(third, tiny4, None)
    assert "infinigen skewing computed" in caplog.text
    assert facts3["skewing_artefacts"] == facts1["skewing_artefacts"]
    assert "rebuilding" in caplog.text
    assert torch.equal(third._art.skew, first._art.skew)


def test_no_skewing_ablation_uses_identity(tiny4, cache_dir):
    method = build_method("infinigen", skewing=False)
    hf_adapter.prepare(method, tiny4, None)
    assert torch.equal(method._art.skew[0, 0], torch.eye(16))


@pytest.mark.parametrize("kw, key", [
    ({"alpha": 0}, "method.alpha=0 must be > 0"),
    ({"alpha": -1}, "method.alpha=-1"),
    ({"partial_ratio": 0}, "method.partial_ratio=0 must be in (0, 1]"),
    ({"partial_ratio": 1.5}, "method.partial_ratio=1.5"),
    ({"budget_ratio": 1.5}, "method.budget_ratio=1.5"),
    ({"eviction": "random"}, "method.eviction='random'; allowed: counter, lru, fifo"),
    ({"mode": "fast"}, "method.mode='fast'; allowed: system, simulate"),
    ({"pool_capacity": 0}, "method.pool_capacity=0"),
])
def test_bad_hyperparameters(kw, key):
    with pytest.raises(ConfigError) as err:
        build_method("infinigen", **kw)
    assert key in str(err.value)


def test_simulate_through_the_triton_kernel_equals_system(tiny4, cache_dir, monkeypatch):
    """Force the sparse-attention kernel (Triton interpreter on CPU) into simulate mode."""
    import methods.infinigen as ig
    from methods.kernels import sparse_attention

    monkeypatch.setattr(ig, "_use_kernel", sparse_attention.use_triton)
    ids = torch.randint(3, 250, (1, 44), generator=torch.Generator().manual_seed(6))
    sim, _ = run(tiny4, build_method("infinigen", mode="simulate"), ids, 40)
    sys_, _ = run(tiny4, build_method("infinigen", mode="system"), ids, 40)
    assert (sim - sys_).abs().max().item() < 1e-4


# --- fidelity fixes ---------------------------------------------------------------------------

def test_dense_layers_never_evict_and_keep_the_sink(tiny4, cache_dir):
    """Counters stay zero in dense layers, so counter eviction there was arbitrary (it could
    drop the sink token): only the speculating layers have a pool limit (official simulation)."""
    ids = torch.randint(3, 250, (1, 60), generator=torch.Generator().manual_seed(5))
    engine = make_engine(tiny4, build_method("infinigen", pool_capacity=0.5, mode="simulate"))
    with engine.request() as req:
        req.prefill(ids[:, :40])
        for t in range(40, 60):
            req.step(ids[:, t])
        layers = req.cache.kv_layers
        for dense in layers[:2]:
            assert dense.positions[0, 0].tolist() == list(range(60))
        for sparse in layers[2:]:
            assert sparse.stored() == 30


def test_qk_union_column_choice():
    from methods._infinigen_prep import column_choice

    q_e = torch.tensor([[9.0, 8, 7, 0, 0, 0, 0, 0], [9.0, 8, 7, 0, 0, 0, 0, 0]])
    k_e = torch.tensor([[0.0, 0, 0, 0, 0, 9, 8, 7], [7.0, 9, 0, 0, 0, 0, 0, 8]])
    cols, weight = column_choice(q_e, k_e, 3, "qk_union")
    assert cols.shape == (2, 6)
    assert sorted(cols[0].tolist()) == [0, 1, 2, 5, 6, 7] and weight[0].tolist() == [1.0] * 6
    assert sorted(set(cols[1][weight[1].bool()].tolist())) == [0, 1, 2, 7]
    assert weight[1].tolist() == [1, 1, 1, 1, 0, 0]  # the narrower head is padded with zeros
    q_only, w = column_choice(q_e, k_e, 3, "q")
    assert q_only.tolist() == [[0, 1, 2]] * 2 and w.tolist() == [[1.0] * 3] * 2


def _own_input_step(model, method, prefill=40):
    """Prefill, one step, and layer 2's speculation from its own input; returns what the test
    needs to recompute the scores by hand."""
    engine = make_engine(model, method)
    ids = torch.randint(3, 250, (1, prefill + 1), generator=torch.Generator().manual_seed(3))
    captured = {}
    attn = model.model.layers[2].self_attn
    handle = attn.register_forward_pre_hook(
        lambda m, a, kw: captured.update(x=kw["hidden_states"], pos=kw["position_ids"]),
        with_kwargs=True)
    try:
        with engine.request() as req:
            req.prefill(ids[:, :prefill])
            req.step(ids[:, prefill])
            layer = req.cache.kv_layers[2]
            slots, counts = layer.speculate(captured["x"], captured["pos"])
            keys = layer.host.all_rows()[0] if layer.system else layer.keys
    finally:
        handle.remove()
    from methods.rope import rotate

    info = hf_adapter.model_info(model.config)
    with torch.inference_mode():
        q = attn.q_proj(captured["x"]).view(1, 1, info.num_heads, info.head_dim).transpose(1, 2)
        q = rotate(q, captured["pos"].view(1, 1, 1), hf_adapter.rope_inv_freq(model))
    return slots[..., : int(counts.max())].sort(-1).values, q, keys, layer, info


def test_qk_union_speculates_over_the_union_columns(tiny4, cache_dir):
    method = build_method("infinigen", column_score="qk_union", partial_ratio=0.25, alpha=1e9,
                          budget_ratio=0.25, skew_per="kv_head", select_per="kv_head")
    chosen, q, keys, layer, info = _own_input_step(tiny4, method)
    art = method._art
    cols, weight = art.columns(2), art.partial_map(2).abs().sum(1) > 0  # (H_kv, k_u)
    skew = art.skew[2]  # (H_kv, d, d)
    g = info.group_size
    expected = []
    for h in range(info.num_kv_heads):
        union = sorted(set(cols[h][weight[h]].tolist()))
        assert info.head_dim // 4 <= len(union) <= 2 * (info.head_dim // 4)
        a = skew[h][:, union]
        qh = q[0, h * g:(h + 1) * g, 0].float() @ a  # (g, |U|)
        kh = keys[0, h].float() @ a  # (T, |U|)
        expected.append((qh @ kh.T).amax(0))
    scores = torch.stack(expected)[None]
    want = scores.topk(int(0.25 * scores.shape[-1]), dim=-1).indices.sort(-1).values
    assert torch.equal(chosen, want)


def test_qk_sum_is_one_top_k_over_both_magnitudes():
    """The paper's §4.3 criterion: |QA| + |KA| summed per column, one top-k (the query energy
    averaged over the g stacked query heads, so it weighs like one MHA head's)."""
    q_e = torch.tensor([[9.0, 0.0, 0.0, 3.0, 0.0, 0.0]]) * 3  # 3 query heads stacked
    k_e = torch.tensor([[0.0, 8.0, 0.0, 0.0, 2.0, 0.0]])
    cols, weight = column_choice(q_e, k_e, 2, "qk_sum", query_rows=3)
    assert cols.tolist() == [[0, 1]] and weight.tolist() == [[1.0, 1.0]]
    cols, weight = column_choice(q_e, k_e, 2, "qk_union")  # the official code: 2 + 2 columns
    assert sorted(cols[0][weight[0].bool()].tolist()) == [0, 1, 3, 4]
    assert column_choice(q_e, k_e, 2, "q")[0].tolist() == [[0, 3]]


def test_prob_mean_selects_by_the_oracles_criterion(tiny4, cache_dir):
    """With every column and layer i's own input, `group_reduce=prob_mean` ranks tokens by the
    group mean of attention probabilities, exactly as oracle_topk does."""
    method = build_method("infinigen", group_reduce="prob_mean", partial_ratio=1.0, alpha=1e9,
                          budget_ratio=0.25, select_per="kv_head")
    chosen, q, keys, layer, info = _own_input_step(tiny4, method)
    logits = (q.float() @ keys.float().repeat_interleave(info.group_size, 1).transpose(2, 3))
    probs = torch.softmax(logits[:, :, 0] / info.head_dim ** 0.5, -1)  # (1, H_q, T)
    kv_probs = probs.view(1, info.num_kv_heads, info.group_size, -1).mean(2)
    want = kv_probs.topk(int(0.25 * kv_probs.shape[-1]), dim=-1).indices.sort(-1).values
    assert torch.equal(chosen, want)
    max_method = build_method("infinigen", partial_ratio=1.0, alpha=1e9, budget_ratio=0.25,
                              select_per="kv_head")
    assert not torch.equal(_own_input_step(tiny4, max_method)[0], want)  # the criteria differ


def test_per_head_count(tiny4, cache_dir):
    """`shared_count=false`: each KV head fetches its own count; system == simulate."""
    ids = torch.randint(3, 250, (1, 90), generator=torch.Generator().manual_seed(8))
    kw = dict(shared_count=False, alpha=0.003, budget_ratio=1.0)  # a random model: flat logits
    sim, _ = run(tiny4, build_method("infinigen", mode="simulate", **kw), ids, 48)
    sys_, engine = run(tiny4, build_method("infinigen", mode="system", **kw), ids, 48)
    assert (sim - sys_).abs().max().item() < 1e-4
    method = build_method("infinigen", mode="simulate", **kw)
    engine = make_engine(tiny4, method)
    counts = []
    with engine.request() as req:
        req.prefill(ids[:, :48])
        for t in range(48, 90):
            req.step(ids[:, t])
            counts.append(req.cache.kv_layers[3]._last_counts[0].tolist())
    assert any(c[0] != c[1] for c in counts)  # heads differ at some step


@pytest.mark.parametrize("kw", [{"column_score": "q"}, {"column_score": "qk_sum"},
                                {"group_reduce": "prob_mean", "select_per": "kv_head"},
                                {"select_per": "kv_head", "skew_per": "kv_head"},
                                {"select_per": "query_head", "skew_per": "kv_head"},
                                {"head0_threshold": False}, {"current_token": "added"},
                                {"partial_index": "calibration"},
                                {"shared_count": False, "alpha": 0.003},
                                {"speculation_input": "own"}, {"partial_index": "prefill"},
                                {"skew_per": "query_head"},
                                {"skew_per": "query_head", "partial_index": "prefill",
                                 "pool_capacity": 0.7}])
def test_system_equals_simulate_for_each_option(tiny4, cache_dir, kw):
    ids = torch.randint(3, 250, (1, 100), generator=torch.Generator().manual_seed(9))
    sim, _ = run(tiny4, build_method("infinigen", mode="simulate", **kw), ids, 48)
    sys_, _ = run(tiny4, build_method("infinigen", mode="system", **kw), ids, 48)
    assert (sim - sys_).abs().max().item() < 1e-4


def test_speculation_from_own_input_differs_from_lookahead(tiny4, cache_dir):
    ids = torch.randint(3, 250, (1, 100), generator=torch.Generator().manual_seed(10))
    ahead, _ = run(tiny4, build_method("infinigen", mode="simulate", budget_ratio=0.1), ids, 48)
    own, _ = run(tiny4, build_method("infinigen", mode="simulate", budget_ratio=0.1,
                                     speculation_input="own"), ids, 48)
    assert (ahead - own).abs().max().item() > 1e-4


# --- speculation cost ---------------------------------------------------------------------------

class _SyncCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts tensor -> Python scalar conversions (.item(), int(t), bool(t)): host syncs on CUDA."""

    SCALAR_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
                    torch.ops.aten.is_nonzero.default)

    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SCALAR_READS:
            self.syncs.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["system", "simulate"])
def test_speculation_queues_no_host_sync(tiny4, cache_dir, mode):
    method = build_method("infinigen", mode=mode)
    engine = make_engine(tiny4, method)
    ids = torch.randint(3, 250, (1, 41), generator=torch.Generator().manual_seed(3))
    x = torch.randn(1, 1, tiny4.config.hidden_size)
    with engine.request() as req:
        req.prefill(ids[:, :40])
        layer = req.cache.kv_layers[2]
        with _SyncCounter() as counter:
            layer.prefetch(x, torch.tensor([[40]]), ahead=True)  # speculation + counters
        assert counter.syncs == [] and layer.pending is None  # nothing fetched yet
        assert layer.selected.shape[-1] == int(0.2 * 40)


def test_system_gather_starts_after_the_previous_layers_attention(tiny4, cache_dir, monkeypatch):
    from kvcore.offload import HostKVStore

    events = []
    fetch, attend = HostKVStore.fetch, InfiniGenLayer._attend

    def logged_fetch(store, index=None):
        events.append(("fetch", store.layer_idx, index is not None))
        return fetch(store, index)

    def logged_attend(layer, *args, **kwargs):
        events.append(("attend", layer.layer_idx))
        return attend(layer, *args, **kwargs)

    monkeypatch.setattr(HostKVStore, "fetch", logged_fetch)
    monkeypatch.setattr(InfiniGenLayer, "_attend", logged_attend)
    ids = torch.randint(3, 250, (1, 42), generator=torch.Generator().manual_seed(3))
    engine = make_engine(tiny4, build_method("infinigen"))
    with engine.request() as req:
        req.prefill(ids[:, :40])
        events.clear()
        req.step(ids[:, 40])
    for layer in (2, 3):
        gather = events.index(("fetch", layer, True))
        assert events.index(("attend", layer - 1)) < gather < events.index(("attend", layer))


def test_speculation_multiplies_only_the_partial_columns(tiny4, cache_dir):
    method = build_method("infinigen", column_score="q")
    make_engine(tiny4, method)
    info = hf_adapter.model_info(tiny4.config)
    k = int(info.head_dim * 0.2)
    part = method._art.partial_map(2)
    assert part.shape == (info.num_heads, info.head_dim, k)  # one A per query head (default)
    cols = method._art.columns(2)
    picked = method._art.skew[2].gather(2, cols[:, None].expand(-1, info.head_dim, -1))
    assert torch.equal(part, picked)


# --- calibration robustness ---------------------------------------------------------------------

def _info(**kw):
    from methods.model import ModelInfo

    return ModelInfo(**{"num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64,
                        "max_positions": 4096, "rope_theta": 1e4, **kw})


@pytest.mark.parametrize("text, words", [("", "is empty"), ("x", "has 1 bytes")])
def test_empty_or_tiny_calibration_file_is_refused_before_load(tmp_path, cache_dir, text, words):
    path = tmp_path / "calib.txt"
    path.write_text(text)
    reasons = build_method("infinigen", calibration_path=str(path)).validate(_info(), {})
    assert len(reasons) == 1 and words in reasons[0] and "at least 64" in reasons[0]
    assert "method.calibration_path" in reasons[0]


def test_calibration_text_shorter_than_the_count_is_refused(smollm2, tmp_path, cache_dir):
    model, tok = smollm2
    path = tmp_path / "calib.txt"
    path.write_text("word " * 300)  # ~300 tokens: enough for the SVD, fewer than 2048
    method = build_method("infinigen", calibration_path=str(path))
    assert method.validate(hf_adapter.model_info(model.config), {}) == []
    with pytest.raises(ConfigError,
                       match=r"method.calibration_tokens=2048 but .* has only \d+ tokens"):
        hf_adapter.prepare(method, model, tok)


def test_calibration_count_beyond_max_positions_is_reported(tiny4, cache_dir, caplog):
    method = build_method("infinigen", calibration_tokens=8192)
    with caplog.at_level(logging.WARNING):
        facts = hf_adapter.prepare(method, tiny4, None)
    assert (facts["calibration_tokens"], facts["calibration_tokens_requested"]) == (4096, 8192)
    assert "exceeds the model's 4096 positions" in caplog.text


def test_unwritable_cache_dir_is_refused_before_load(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    reasons = build_method("infinigen", cache_dir=str(blocker / "sub")).validate(_info(), {})
    assert len(reasons) == 1 and reasons[0].startswith("method.cache_dir")
    assert "is a file" in reasons[0]
    if Path("/proc/self").is_dir():  # read-only for every user, root included
        reasons = build_method("infinigen", cache_dir="/proc/kvh-cache").validate(_info(), {})
        assert len(reasons) == 1 and "not writable" in reasons[0]


def test_per_query_head_skewing(tiny4, cache_dir):
    """`skew_per=query_head`: one A per query head (its own queries' SVD), partial keys per query
    head; with every column and the layer's own input the scores are the exact logits."""
    method = build_method("infinigen", skew_per="query_head", partial_ratio=1.0, alpha=1e9,
                          budget_ratio=0.25, select_per="kv_head")
    chosen, q, keys, layer, info = _own_input_step(tiny4, method)
    assert method._art.skew.shape[1] == info.num_heads
    assert layer.partial_keys().shape[1] == info.num_heads
    logits = q.float() @ keys.float().repeat_interleave(info.group_size, 1).transpose(2, 3)
    per_kv = logits[:, :, 0].view(1, info.num_kv_heads, info.group_size, -1).amax(2)
    want = per_kv.topk(int(0.25 * per_kv.shape[-1]), dim=-1).indices.sort(-1).values
    assert torch.equal(chosen, want)


@pytest.mark.parametrize("mode", ["system", "simulate"])
def test_cpu_speculation_kernel_equals_the_torch_path(tiny4, cache_dir, monkeypatch, mode):
    """On CPU the speculation runs as one C call (methods/kernels/speculation_cpu.c) at every
    sparse layer's decode step; the torch path fetches the same tokens and gives the same logits
    (the fetched set comes in slot order instead of best first). The kernel serves our variants
    (`current_token=added`, per-head thresholds); the official defaults take the torch path."""
    from methods import infinigen
    from methods.kernels import cpu_build

    if not cpu_build.compiler_available():
        pytest.skip("no C compiler here: InfiniGen speculates in torch (every other test)")
    ids = torch.randint(3, 250, (1, 90), generator=torch.Generator().manual_seed(6))
    method = build_method("infinigen", mode=mode, alpha=2.0, current_token="added",
                          head0_threshold=False)
    facts = hf_adapter.prepare(method, tiny4, None)
    assert facts["speculation"] == "c"
    calls, kept = [], {}
    real = infinigen.speculation_cpu.select
    monkeypatch.setattr(infinigen.speculation_cpu, "select",
                        lambda *a: calls.append(1) or real(*a))
    real_touch = InfiniGenLayer.touch

    def recording_touch(layer, index, counts):
        used = [set(index[0, h, : int(counts[0, h])].tolist()) for h in range(index.shape[1])]
        kept.setdefault(path, []).append(used)
        return real_touch(layer, index, counts)

    monkeypatch.setattr(InfiniGenLayer, "touch", recording_touch)
    path = "c"
    fused, _ = run(tiny4, method, ids, 40)
    sparse = 4 - len({0, 1})  # tiny4: layers 0 and 1 are dense
    assert len(calls) == 50 * sparse
    monkeypatch.setattr(infinigen.speculation_cpu, "applies", lambda *a: False)
    path = "torch"
    eager, _ = run(tiny4, method, ids, 40)
    assert len(calls) == 50 * sparse  # the kernel was not called again
    assert kept["c"] == kept["torch"]  # the same tokens at every step, layer and head
    torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)


# --- the official code's GQA expansion: per query head, the union moved --------------------------

@pytest.mark.kept_set
def test_select_tokens_is_the_official_count_rule_by_hand():
    """Count above max - alpha per head, the floor of the mean shared by all heads, top-count
    best first; `head0_threshold`: head 0's max thresholds every head (the Llama simulation)."""
    from methods.infinigen import select_tokens

    scores = torch.tensor([[[10.0, 9.0, 7.5, 1.0, 0.0],  # head 0: 2 above 10 - 2
                            [3.0, 2.5, 0.0, -1.0, 2.9]]])  # head 1: 3 above 3 - 2
    slots, counts = select_tokens(scores, 4, 2.0, shared_count=True, head0_threshold=False)
    assert counts.tolist() == [[2, 2]]  # floor((2 + 3) / 2)
    assert slots[..., :2].tolist() == [[[0, 1], [0, 4]]]  # each head's own best, best first
    _, counts = select_tokens(scores, 4, 2.0, shared_count=False, head0_threshold=False)
    assert counts.tolist() == [[2, 3]]
    _, counts = select_tokens(scores, 4, 2.0, shared_count=False, head0_threshold=True)
    assert counts.tolist() == [[2, 1]]  # head 1: none above 8, clamped to 1
    _, counts = select_tokens(scores, 4, 2.0, shared_count=True, head0_threshold=True)
    assert counts.tolist() == [[1, 1]]  # floor((2 + 0) / 2)
    _, counts = select_tokens(scores, 1, 2.0, shared_count=False, head0_threshold=False)
    assert counts.tolist() == [[1, 1]]  # the cap


def _union_layer(selected, counts, stored):
    from methods.model import ModelInfo

    layer = InfiniGenLayer.__new__(InfiniGenLayer)
    layer.info = ModelInfo(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                           max_positions=64)
    layer.m = build_method("infinigen")
    layer.meta = {name: ContiguousRows() for name in ("positions", "counter", "last_used")}
    layer.meta["positions"].append(torch.arange(stored).expand(1, 2, stored).float())
    layer.selected, layer.counts = torch.tensor([selected]), torch.tensor([counts])
    return layer


def test_per_query_head_selection_moves_the_union_of_the_group_by_hand():
    """Two KV heads of two query heads each, 6 stored tokens, 2 tokens per query head: KV head 0
    serves heads {1, 4} and {4, 5} -> rows [1, 4, 5]; KV head 1 serves {2, 3} twice -> [2, 3],
    padded to 3 rows with the lowest unselected slot (moved, attended by none)."""
    layer = _union_layer([[1, 4, 0], [4, 5, 1], [2, 3, 5], [3, 2, 0]], [2, 2, 2, 2], 6)
    assert layer.per_query_head()
    rows, keep = layer.union_rows()
    assert rows.tolist() == [[[1, 4, 5], [2, 3, 0]]]
    assert keep.tolist() == [[[True, True, False], [False, True, True],
                              [True, True, False], [True, True, False]]]


def test_per_query_head_ledger_counts_the_union_rows(tiny4, cache_dir, monkeypatch):
    """System mode, the default: each sparse layer's bytes moved at a step are 2 (K, V) x H_kv x
    the widest union of its query heads' selections; every query head's set is inside its KV
    head's rows."""
    seen = []
    launch = InfiniGenLayer.launch_fetch

    def spy(layer):
        pending = layer.pending
        launch(layer)
        if pending is None and layer.pending is not None and layer.fetched is not None:
            sets = layer.query_sets(layer.stored())  # (1, H_q, T)
            seen.append((layer.layer_idx, sets.clone(), layer.fetched.clone()))

    monkeypatch.setattr(InfiniGenLayer, "launch_fetch", spy)
    ids = torch.randint(3, 250, (1, 60), generator=torch.Generator().manual_seed(4))
    _, engine = run(tiny4, build_method("infinigen", alpha=3.0), ids, 40)
    cfg = tiny4.config
    row = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4  # K+V
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    assert len(seen) == 2 * 20  # layers 2 and 3, 20 decode steps
    wider = False
    for step, t in enumerate(range(40, 60)):
        expected = 2 * t * row  # dense layers 0 and 1: every row
        for _, sets, fetched in seen[2 * step: 2 * step + 2]:
            union = sets.view(1, cfg.num_key_value_heads, g, -1).any(2)
            n_max = int(union.sum(-1).max())
            assert fetched.shape[-1] == n_max
            for h in range(cfg.num_key_value_heads):
                assert set(union[0, h].nonzero().flatten().tolist()) <= set(fetched[0, h].tolist())
            wider |= n_max > int(sets.sum(-1).max())
            expected += n_max * row
        assert engine.transfers.step_h2d[step] == expected
    assert wider  # the group's heads chose differently: more rows than one head's set


def test_a_dense_step_from_the_budget_seam_attends_everything(tiny4, cache_dir, monkeypatch):
    """`fetch_cap` returning None (the final-length basis before its budget is reached) makes a
    step dense: every stored token for every head, so the run equals the full cache."""
    monkeypatch.setattr(InfiniGenLayer, "fetch_cap", lambda self, t: None)
    ids = torch.randint(3, 250, (1, 56), generator=torch.Generator().manual_seed(2))
    full, _ = run(tiny4, build_method("full"), ids, 40)
    got, engine = run(tiny4, build_method("infinigen", alpha=0.5), ids, 40)
    assert (got - full).abs().max().item() < 1e-5
    assert engine.attended.summary()["attended_fraction_all_layers"] == 1.0


def test_final_basis_is_dense_until_the_budget_is_reached(tiny4, cache_dir, monkeypatch):
    """runner.budget_basis=final (the default): the cap is budget_ratio x the final length (0.8 x
    60 = 48); steps with fewer stored tokens attend all of them (the official simulation's dense
    first rows), later ones at most 48 speculated tokens."""
    seen = []
    real = InfiniGenLayer.touch
    monkeypatch.setattr(InfiniGenLayer, "touch", lambda layer, index, counts: seen.append(
        (layer.stored(), int(counts.min()), int(counts.max()))) or real(layer, index, counts))
    ids = torch.randint(3, 250, (1, 60), generator=torch.Generator().manual_seed(4))
    run(tiny4, build_method("infinigen", alpha=0.01, budget_ratio=0.8), ids, 40)
    dense = [(t, lo, hi) for t, lo, hi in seen if t < 48]
    assert dense and all(lo == hi == t for t, lo, hi in dense)
    assert all(hi <= 48 for t, _, hi in seen if t >= 48)
    assert any(hi < t for t, _, hi in seen if t >= 48)  # alpha's count decides there


def test_rank_current_is_the_official_rule_by_hand():
    """current_token=ranked: n' is counted over the stored tokens and the current one, and the
    head takes its top n' of them (the current token only when it ranks there)."""
    from methods.infinigen import rank_current

    stored = torch.tensor([[[3.0, 0.0, 2.5, -4.0]]])
    # above 3 - 1: 3.0, 2.5 and the current 2.8 -> n' = 3; 2.8 ranks second -> 2 stored + it
    n, kept = rank_current(stored, torch.tensor([[2.8]]), 4, 1.0, True, False)
    assert (n.tolist(), kept.tolist()) == ([[2]], [[True]])
    # the current -1.0 is neither counted nor among the best 2 -> 2 stored, not itself
    n, kept = rank_current(stored, torch.tensor([[-1.0]]), 4, 1.0, True, False)
    assert (n.tolist(), kept.tolist()) == ([[2]], [[False]])
    # head 0's current 4.0 raises the shared threshold to 3: head 0 counts 1 (itself), head 1
    # 2 (3.5, 3.2) -> n' = floor(1.5) = 1: head 0 its current token, head 1 its best stored
    two = torch.tensor([[[1.0, 0.5], [3.5, 3.2]]])
    n, kept = rank_current(two, torch.tensor([[4.0, 0.0]]), 2, 1.0, True, True)
    assert (n.tolist(), kept.tolist()) == ([[0, 1]], [[True, False]])
    # head 0's current 9.0 sets the threshold 8 -> counts 1 and 0 -> n' = floor(0.5) = 0: with
    # least=0 (zero_count=all) neither head keeps anything (the caller then attends all)
    n, kept = rank_current(two, torch.tensor([[9.0, 0.0]]), 2, 1.0, True, True, least=0)
    assert (n.tolist(), kept.tolist()) == ([[0, 0]], [[False, False]])
    n, kept = rank_current(two, torch.tensor([[9.0, 0.0]]), 2, 1.0, True, True)
    assert (n.tolist(), kept.tolist()) == ([[0, 1]], [[True, False]])  # least=1: n' = 1


@pytest.mark.parametrize("mode", ["simulate", "system"])
@pytest.mark.parametrize("current", ["ranked", "added"])
def test_equals_the_official_mask_simulation(cache_dir, current, mode):
    """Ours, streamed token by token, gives the logits of the official accuracy path (the whole
    sequence under its mask, re-implemented in benchmarks/infinigen_official.py) with its
    setup-prompt columns and head-0 threshold, rows whose count is 0 left unmasked
    (`zero_count=all`); `current_token=added` those of the same rule with the current token
    added on top and at least one token. The model: 7 query heads per KV head, q and k scaled
    so that its attention is peaked (some rows then count 0 under head 0's threshold)."""
    from benchmarks.infinigen_official import Reference, Rule, column_masks, skewing
    from harness.core import models
    from methods._infinigen_prep import SETUP_PROMPT

    gqa7 = models.tiny_llama(num_layers=4, hidden=112, heads=7, kv_heads=1, max_positions=4096)
    with torch.no_grad():
        for attn in hf_adapter.attention_modules(gqa7):
            attn.q_proj.weight.mul_(6.0)
            attn.k_proj.weight.mul_(6.0)

    calib = torch.randint(3, 250, (256,), generator=torch.Generator().manual_seed(4))
    ids = torch.randint(3, 250, (1, 160), generator=torch.Generator().manual_seed(5))
    ref = Reference(gqa7, hf_adapter.rope_inv_freq(gqa7))
    _, cal_qk, _, _ = ref.forward(calib)
    skew = skewing(cal_qk)
    _, setup_qk, _, _ = ref.forward(torch.tensor(list(SETUP_PROMPT.encode())))
    zero = "dense" if current == "ranked" else "one"
    rule = Rule(skew, column_masks(setup_qk, skew, 0.2), 1.0, 0.2, "head0", current, zero)
    want, _, share, zero_rows = ref.forward(ids[0], rule)

    method = build_method("infinigen", mode=mode, current_token=current, alpha=1.0,
                          calibration_tokens=256)
    info = hf_adapter.model_info(gqa7.config)
    hf_adapter.prepare(method, gqa7, None, info, calibration_ids=calib)
    engine = Engine(gqa7, None, method, info, EngineSettings())
    with engine.request(final_tokens=ids.shape[1]) as req:
        got = torch.cat([req.step(ids[:, t]) for t in range(ids.shape[1])], 1)[0]
    assert 0.1 < share < 0.9  # the mask really selects
    assert zero_rows > 0 or current == "added"  # some rows have a count of 0
    assert (got - want).abs().max().item() < 1e-3


def test_a_cache_on_a_full_disk_costs_the_cache_not_the_run(tmp_path, monkeypatch, caplog):
    from methods import _infinigen_prep

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    t = torch.zeros(2, 2)
    with caplog.at_level(logging.WARNING):
        _infinigen_prep._save(tmp_path / "c" / "art.pt", t, t, t)
    assert "cannot write the cache" in caplog.text and "No space left on device" in caplog.text
    assert list((tmp_path / "c").iterdir()) == []  # no temporary file left behind
