"""InfiniGen: skewing, speculation math, system == simulate, pool eviction, artefact cache."""

import logging

import pytest
import torch

from harness import hf_adapter
from kvcore.errors import ConfigError
from methods import build_method
from methods._infinigen_prep import skewing_from
from methods.infinigen import InfiniGenLayer
from tests.conftest import make_engine


def run(model, method, ids, prefill, chunk=16, tok=None):
    engine = make_engine(model, method, tok, chunk=chunk)
    with engine.request() as req:
        out = [req.prefill(ids[:, :prefill], all_logits=True)]
        out += [req.step(ids[:, t]) for t in range(prefill, ids.shape[1])]
    return torch.cat(out, 1), engine


@pytest.fixture
def tiny4():
    from harness import models

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


def test_speculation_with_own_input_and_all_columns_is_exact(tiny4, cache_dir, monkeypatch):
    """With partial_ratio=1 the skewed partial score is q_i . k_i / sqrt(d) exactly (A is
    orthogonal), so feeding layer i's own input selects the true top tokens by logit."""
    method = build_method("infinigen", partial_ratio=1.0, alpha=1e9, budget_ratio=0.25)
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
            keys = layer.store.all_rows()[0]  # 41 stored tokens (the step's token included)
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
    per_kv = logits.view(1, 2, 2, 41).amax(2)
    expected = per_kv.topk(int(0.25 * 41), dim=-1).indices.sort(-1).values
    assert torch.equal(chosen, expected)


def test_ledger_bytes_equal_the_formula(tiny4, cache_dir):
    """bytes h2d per decode step = dense layers x all rows + sparse layers x selected rows."""
    ids = torch.randint(3, 250, (1, 60), generator=torch.Generator().manual_seed(4))
    _, engine = run(tiny4, build_method("infinigen", alpha=1e9, budget_ratio=0.25), ids, 40)
    cfg = tiny4.config
    row = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4  # K+V
    expected = []
    for t in range(40, 60):  # T stored tokens before step t
        sparse = max(1, min(t, int(0.25 * t)))
        expected.append(2 * t * row + 2 * sparse * row)
    assert engine.transfers.step_h2d == expected
    full_steps = [4 * t * row for t in range(40, 60)]
    _, full_engine = run(tiny4, build_method("full_offload"), ids, 40)
    assert full_engine.transfers.step_h2d == full_steps


def _layer_with(policy: str, counters, last_used):
    method = build_method("infinigen", eviction=policy, pool_capacity=0.5, mode="simulate")
    layer = InfiniGenLayer.__new__(InfiniGenLayer)
    layer.m, layer.system, layer._pk = method, False, None
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
    facts1 = hf_adapter.prepare(first, tiny4, None)
    second = build_method("infinigen")
    facts2 = hf_adapter.prepare(second, tiny4, None)
    assert (facts1["skewing_artefacts"], facts2["skewing_artefacts"]) == ("computed", "loaded")
    assert torch.equal(first._art.skew, second._art.skew)
    assert torch.equal(first._art.q_energy, second._art.q_energy)
    assert torch.equal(first._art.k_energy, second._art.k_energy)
    path = facts1["artefact_path"]
    with open(path, "r+b") as f:
        f.seek(200)
        f.write(b"\x00" * 64)
    third = build_method("infinigen")
    with caplog.at_level(logging.WARNING):
        facts3 = hf_adapter.prepare(third, tiny4, None)
    assert facts3["skewing_artefacts"] == "computed"
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
