"""runner.kv_layout=paged (kvcore.paged) for every method that declares it: the same logits as the
contiguous layout (fp32), alone and in a batch of ragged sequences drawing from one pool per layer;
the blocks go back to the pools when requests end; methods that cannot page are refused before
weights load, with the key named."""

import json

import pytest
import torch

from harness.core import hf_adapter
from harness.run import run
from kvcore.errors import ConfigError
from kvcore.paged import PagedRows
from methods import available_methods, build_method, method_class
from methods.capabilities import Capabilities
from tests.conftest import STORIES, make_engine, need_shared
from tests.helpers.runs import cfg_for
from tests.methods.contract.paged import BLOCK_TOKENS, assert_paged, decode, paged_engine

PAGED = [n for n in available_methods() if "paged" in method_class(n).capabilities.kv_layouts]
PROMPT_TOKENS, DECODE_STEPS = 44, 12


def test_the_methods_on_the_shared_storage_declare_paged():
    """The default layer's, the eviction template's and the host store's users page; methods
    with storage of their own do not."""
    for name in ("full", "h2o", "streaming_llm", "tova", "snapkv", "quest", "infinigen",
                 "full_offload", "duo_attention", "razor_attention"):
        assert name in PAGED, name
    for name in ("kivi", "kvquant", "shadowkv"):
        assert name not in PAGED, name
    with pytest.raises(ValueError, match="a model's cache format is ModelInfo.cache_format"):
        Capabilities(kv_layouts=("heads",))  # the old meaning of the name is caught at import


def cases():
    """(method, mode, kv_offload): every paged method in each of its modes, and on the host tier
    too where it can offload (runner.kv_offload=cpu)."""
    out = []
    for name in PAGED:
        cls = method_class(name)
        modes = cls.capabilities.modes if "mode" in cls.hyperparameter_names() else (None,)
        offloads = ("none", "cpu") if cls.capabilities.offloads_kv else ("none",)
        out += [(name, mode, offload) for mode in modes for offload in offloads
                if not (mode == "system" and offload == "cpu")]  # system mode is on the host
    return out


def compressing(name, mode, seq_tokens):
    settings = method_class(name).compressing_hyperparameters(seq_tokens)
    return build_method(name, **settings, **({"mode": mode} if mode else {}))


@pytest.fixture
def model(family_models, monkeypatch, tmp_path):
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))  # prepared artefacts stay in the test
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    return family_models("llama", 3)  # InfiniGen leaves layers 0 and 1 dense


@pytest.mark.parametrize("name, mode, offload", cases())
def test_paged_equals_contiguous(name, mode, offload, model):
    method = compressing(name, mode, PROMPT_TOKENS + DECODE_STEPS)
    prompt = torch.randint(3, 250, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(4))
    contiguous_engine = paged_engine(model, method, offload, layout="contiguous")
    reference, _ = decode(contiguous_engine, prompt.tolist(), DECODE_STEPS)
    engine = paged_engine(model, method, offload)
    got, layers = decode(engine, prompt.tolist(), DECODE_STEPS)
    assert torch.equal(got, reference), (name, (got - reference).abs().max().item())
    assert_paged(layers, name)
    pools = engine.tier.paged.summary()
    assert pools["blocks_held_now"] == 0 and pools["blocks_held_peak"] > 0  # released at the end
    kv = engine.ledger.summary()
    assert kv["tokens_per_layer"] == contiguous_engine.ledger.summary()["tokens_per_layer"]
    if any(kv_layer._kv for kv_layer in layers):  # K/V on the device tier: waste figures
        assert kv["storage_waste_ratio"] is not None and kv["storage_layers_accounted"] > 0
        # blocks of 8: fewer than 8 unused slots per layer and tensor
        slack = 2 * kv["storage_layers_accounted"] * (BLOCK_TOKENS - 1) * per_token_bytes(model)
        assert (kv["storage_bytes_used"] <= kv["storage_bytes_allocated"]
                <= kv["storage_bytes_used"] + slack)


def per_token_bytes(model):
    info = hf_adapter.model_info(model.config)
    return info.num_kv_heads * info.head_dim * 4


@pytest.mark.parametrize("name", PAGED)
def test_a_ragged_batch_shares_one_pool_per_layer(name, model):
    """Three ragged sequences decoded together through engine.batch(3), paged: the same logits as
    the same batch stored contiguously, every sequence's blocks drawn from the one pool of each
    layer, all returned when the batch ends."""
    lengths = (40, 17, 29)
    method = compressing(name, None, max(lengths) + 6)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]

    def batched(engine):
        with engine.batch(3) as batch:
            logits = [batch.prefill(prompts)]
            for _ in range(6):
                logits.append(batch.step([0, 1, 2], logits[-1].argmax(-1).tolist()))
            rows = [[kv._kv.get("keys") for kv in cache.kv_layers] for cache in batch.caches]
            held = engine.tier.paged.summary()["blocks_held_now"] if engine.tier.paged else None
        return torch.stack(logits, 1), rows, held

    reference, _, _ = batched(make_engine(model, method, chunk=16))
    engine = paged_engine(model, method)
    got, rows, held = batched(engine)
    assert torch.equal(got, reference), (name, (got - reference).abs().max().item())
    paged = engine.tier.paged
    for layer in range(len(rows[0])):
        stored = [seq[layer] for seq in rows]
        if all(r is None for r in stored):  # K/V on the host tier (full_offload)
            continue
        assert all(isinstance(r, PagedRows) for r in stored), (name, layer)
        assert {id(r.pool) for r in stored} == {id(paged.pool(layer, "keys"))}
    assert held > 0 and paged.summary()["blocks_held_now"] == 0
    assert len(engine.ledger.samples) == 3


def test_methods_that_cannot_page_are_refused(model):
    info = hf_adapter.model_info(model.config)
    paged = {"kv_layout": "paged", "batch_size": 1}
    for name in available_methods():
        reasons = build_method(name).validate(info, paged)
        refused = [r for r in reasons if "runner.kv_layout" in r]
        assert bool(refused) == (name not in PAGED), (name, reasons)
    assert build_method("kivi").validate(info, paged) == [
        "runner.kv_layout=paged but method=kivi keeps its K/V in storage of its own (allowed: "
        "contiguous)"]
    assert not build_method("h2o").validate(info, {**paged, "kv_offload": "cpu"})
    with pytest.raises(ConfigError, match="runner.kv_layout=paged but method=kivi"):
        paged_engine(model, build_method("kivi"))


@pytest.mark.parametrize("overrides, message", [
    (["runner.kv_layout=blocks"], "runner.kv_layout='blocks'; allowed: contiguous, paged"),
    (["runner.kv_layout=paged", "runner.kv_block_tokens=0"],
     "runner.kv_block_tokens=0 must be a positive integer"),
    (["runner.kv_layout=paged", "method=kivi"], "runner.kv_layout=paged but method=kivi"),
])
def test_runner_refuses_before_weights(overrides, message, no_weight_loading,  # noqa: F811
                                       tmp_path):
    with pytest.raises(ConfigError) as err:
        run(cfg_for(*overrides, f"runner.results_root={tmp_path}"))
    assert message in str(err.value)
    assert not any(tmp_path.iterdir())


def test_snapshot_restore_forks_blocks(model):
    """A paged request rewinds like a contiguous one (Request.snapshot copies its blocks); the
    snapshot's blocks go back to the pool once it is dropped."""
    ids = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(0))
    engine = paged_engine(model, build_method("h2o", budget_tokens=12))
    pools = engine.tier.paged
    with engine.request() as req:
        req.prefill(ids[:30])
        held = pools.summary()["blocks_held_now"]
        snap = req.snapshot()
        assert snap is not None and pools.summary()["blocks_held_now"] == 2 * held
        first = [req.step(t) for t in ids[30:36]]
        req.restore(snap)
        again = [req.step(t) for t in ids[30:36]]
        del snap
        assert pools.summary()["blocks_held_now"] == held  # the replaced state's blocks freed
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert pools.summary()["blocks_held_now"] == 0


def test_runner_records_the_layout_and_its_waste(tmp_path):
    """End to end on stories260K (perplexity): the same scores in both layouts; metrics.json
    carries the layout, the storage waste of each and the paged pools' figures."""
    need_shared(STORIES)
    kv = {}
    for layout in ("contiguous", "paged"):
        out = run(cfg_for("model=stories260k", "task.max_tokens=200", "task.dataset=pg19",
                          "method=h2o", "method.budget_tokens=64", f"runner.kv_layout={layout}",
                          f"runner.output_dir={tmp_path / layout}"))
        metrics = json.loads((out / "metrics.json").read_text())
        kv[layout] = (metrics["kv"], metrics["accuracy"])
    (contiguous, contiguous_acc), (paged, paged_acc) = kv["contiguous"], kv["paged"]
    assert paged_acc["ppl"] == contiguous_acc["ppl"] and paged_acc["tokens_scored"] == 199
    assert contiguous["kv_layout"] == "contiguous" and contiguous["paged_pools"] is None
    assert paged["kv_layout"] == "paged" and paged["paged_pools"]["block_tokens"] == 16
    assert paged["storage_bytes_used"] == contiguous["storage_bytes_used"] > 0
    assert 0 <= paged["storage_waste_ratio"] < 15 / (64 + 15)  # under one block per layer
    assert paged["storage_bytes_allocated"] <= contiguous["storage_bytes_allocated"]
