"""Admission under a device KV limit (harness.core.serving): request-level waves vs LayerKV's layer-wise
placement. The limit is enforced by the device pools; LayerKV is lossless; refusals before
weights."""

import dataclasses

import pytest
import torch

from harness.core import hf_adapter
from harness.core import serving
from harness.config.runner import RunnerSettings, protocol_reasons
from harness.run import run
from kvcore.errors import ConfigError
from kvcore.paged import BlockPool, DeviceBudget, DeviceMemoryExceeded
from methods import build_method
from methods.full_offload import FullOffloadLayer
from methods.protocol import Protocol
from tasks import build_task
from tests.conftest import make_engine
from tests.helpers.generation import prompts_of


def limited(engine, limit_mib: float, admission: str, batch: int = 8, block: int = 4):
    engine.settings = dataclasses.replace(engine.settings, kv_layout="paged", kv_block_tokens=block,
                                          kv_device_limit_mib=limit_mib, kv_admission=admission,
                                          batch_size=batch)
    # rebuild the tier's pools with the limit, as the runner would from the start
    fresh = type(engine)(engine.model, engine.tokenizer, engine.method, engine.info,
                         engine.settings)
    return fresh


def per_request_bytes(model, tokens: int, block: int) -> int:
    info = hf_adapter.model_info(model.config)
    return info.num_layers * serving.layer_bytes(info, tokens, block, 4)


def test_plan_request_level_waits_for_whole_requests_and_layerkv_splits_layers(tiny_model):
    info = hf_adapter.model_info(tiny_model.config)  # 2 layers
    one_layer = serving.layer_bytes(info, 20, 4, 4)
    limit = 5 * one_layer  # two whole requests and half of a third
    plan = lambda adm: serving.plan_wave([0, 1, 2, 3], [20] * 4, info, limit, 4, 4, adm, 8)  # noqa: E731
    assert plan("request").seqs == [0, 1]
    wave = plan("layerkv")
    assert wave.seqs == [0, 1, 2, 3]
    assert wave.host_layers == [frozenset(), frozenset(), frozenset({1}), frozenset({0, 1})]
    with pytest.raises(ConfigError, match="runner.kv_admission=layerkv"):
        serving.plan_wave([0], [20], info, one_layer, 4, 4, "request", 8)  # one layer fits, not all


def test_device_budget_is_enforced_by_the_pools():
    budget = DeviceBudget(limit_bytes=3 * 2 * 4 * 8 * 4)  # three blocks of (H=2, bt=4, D=8) fp32
    pool = BlockPool(4, budget=budget)
    like = torch.zeros(1, 2, 1, 8)
    ids = pool.allocate(3, like)
    with pytest.raises(DeviceMemoryExceeded, match="kv_device_limit_mib"):
        pool.allocate(1, like)
    pool.release(ids[:1])
    pool.allocate(1, like)  # freed bytes are reusable
    assert budget.peak_bytes == budget.limit_bytes


def test_layerkv_equals_request_level_and_admits_everything_at_once(tiny_model):
    """Same greedy outputs as the unlimited batch-1 reference under both admissions; request-level
    runs in waves (later requests wait), LayerKV in one wave with host layers fetched every step;
    neither ever holds more device blocks than the limit."""
    prompts = prompts_of([21, 9, 30, 17, 12], seed=5)
    limits = [6] * len(prompts)
    reference = list(make_engine(tiny_model, build_method("full"), chunk=8)
                     .generate_many(prompts, limits, stop_ids=set()))
    limit_mib = 2.2 * per_request_bytes(tiny_model, 36, 4) / 2**20  # two of the longest
    runs = {}
    for admission in serving.ADMISSIONS:
        engine = limited(make_engine(tiny_model, build_method("full"), chunk=8), limit_mib,
                         admission)
        assert list(engine.generate_many(prompts, limits, stop_ids=set())) == reference
        pools = engine.tier.paged.summary()
        assert 0 < pools["device_bytes_held_peak"] <= pools["device_limit_bytes"]
        runs[admission] = engine
    request, layerkv = runs["request"], runs["layerkv"]
    assert len(request.ttft_ms) == len(layerkv.ttft_ms) == len(prompts)
    assert request.transfers.summary()["bytes_h2d"] == 0  # everything on the device, in waves
    assert layerkv.transfers.summary()["bytes_h2d"] > 0  # host layers fetched at decode
    # request-level: a later wave's first tokens come after the earlier wave's whole decode
    assert max(request.ttft_ms) > 2 * min(request.ttft_ms)
    assert len(set(layerkv.ttft_ms)) == 1  # one wave: every first token at the same moment
    speed = layerkv.speed().as_dict()
    assert speed["ttft_ms_max"] >= speed["ttft_ms_mean"] > 0


def test_layerkv_places_the_layers_that_do_not_fit_on_the_host(tiny_model):
    engine = limited(make_engine(tiny_model, build_method("full"), chunk=8), 1e-9, "layerkv")
    with engine.batch(2, [frozenset({1}), frozenset({0, 1})]) as batch:
        kinds = [[type(kv) is FullOffloadLayer for kv in cache.kv_layers] for cache in batch.caches]
    assert kinds == [[False, True], [True, True]]


def test_refusals_before_weights(tiny_model):
    info = hf_adapter.model_info(tiny_model.config)
    runner = {"batch_size": 4, "kv_layout": "paged", "kv_device_limit_mib": 64,
              "kv_admission": "layerkv"}
    reasons = build_method("h2o", budget_tokens=8).validate(info, runner)
    assert any("runner.kv_admission=layerkv" in r and "make_host_layer" in r for r in reasons)
    assert build_method("full").validate(info, runner) == []
    reasons = protocol_reasons(build_method("full"), build_task("perplexity"), info, Protocol(),
                               RunnerSettings(kv_layout="paged", kv_device_limit_mib=64))
    assert any("runner.kv_device_limit_mib=64" in r and "task=perplexity" in r for r in reasons)
    base = {"prefill_chunk_tokens": 8, "batch_size": 1, "attn_impl": "sdpa", "seed": 0}
    for bad, key in (({"kv_device_limit_mib": 64}, "kv_layout=paged"),
                     ({"kv_device_limit_mib": -1, "kv_layout": "paged"}, "positive number"),
                     ({"kv_admission": "layerkv"}, "needs a device limit"),
                     ({"kv_admission": "vllm"}, "allowed: request, layerkv")):
        with pytest.raises(ConfigError, match=key):
            RunnerSettings.of({**base, **bad})


def test_runner_end_to_end_under_layerkv_gives_the_same_answers(tmp_path):
    """task=ruler through the runner, 3 samples at once under a device limit that holds one of
    them whole: request-level (three waves) and LayerKV (one wave) predict exactly what an
    unlimited batch-1 run predicts, and metrics.json says how requests were admitted."""
    import json

    from tests.conftest import STORIES, need_shared
    from tests.helpers.runs import cfg_for

    need_shared(STORIES)
    common = ["model=stories260k", "task=ruler", "task.lengths=[480]", "task.depths=[0,50,100]",
              "task.subtasks=[niah_single]", "task.max_new_tokens=4",
              f"runner.results_root={tmp_path}"]
    limited_runs = [f"runner.batch_size=3 runner.kv_layout=paged runner.kv_device_limit_mib=0.6 "
                    f"runner.kv_admission={a}" for a in serving.ADMISSIONS]
    outs = [run(cfg_for(*common, *extra.split(), f"runner.output_dir={tmp_path}/r{i}"))
            for i, extra in enumerate(["runner.batch_size=1", *limited_runs])]
    preds = [[json.loads(line)["prediction"] for line in (o / "samples.jsonl").read_text().splitlines()]
             for o in outs]
    assert preds[1] == preds[0] and preds[2] == preds[0]
    for out, admission in zip(outs[1:], serving.ADMISSIONS):
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["kv"]["kv_admission"] == admission
        pools = metrics["kv"]["paged_pools"]
        assert pools["device_bytes_held_peak"] <= pools["device_limit_bytes"]
        assert metrics["speed"]["ttft_ms_max"] > 0
    metrics = [json.loads((o / "metrics.json").read_text()) for o in outs[1:]]
    assert metrics[0]["transfer"]["bytes_h2d"] == 0 < metrics[1]["transfer"]["bytes_h2d"]
    request, layerkv = (m["speed"] for m in metrics)
    assert request["ttft_ms_max"] > request["ttft_ms_mean"]  # later waves waited
    assert layerkv["ttft_ms_max"] == layerkv["ttft_ms_mean"]  # one wave
