"""The vLLM engine against a real vLLM (make test-vllm; skipped elsewhere, saying why): one
worker started for the module, checked against our engine's full cache on SmolLM2, then one run
through the CLI's path written as a run folder that pairs with ours. Few on purpose: each vLLM
start-up takes 1-5 min on 2 cores."""

import json
from pathlib import Path

import pytest
import torch

from harness.core import models
from harness.engines.vllm_engine import VllmEngine, VllmKnobs, model_folder, run, started
from tests.conftest import make_engine
from tests.vllm.conftest import vllm_python

pytestmark = pytest.mark.needs_vllm
TEXT = ("The quick brown fox jumps over the lazy dog. Paul Graham wrote essays about startups, "
        "programming languages and the way that cities shape ambition.")


@pytest.fixture(scope="module")
def folder():
    return model_folder(models.resolve_model({"name": "smollm2_135m", "device": "cpu"}))


@pytest.fixture(scope="module")
def worker(folder, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    knobs = VllmKnobs(python=str(vllm_python()), kv_space_gib=1, max_num_seqs=4)
    with started(knobs, folder, "float32", 1024, 0, log) as (w, facts):
        yield w, facts


def ours(smollm2):
    from methods import build_method as build

    model, tokenizer = smollm2
    return make_engine(model, build("full"), tokenizer)


def test_the_worker_reports_its_versions(worker):
    _, facts = worker
    assert facts["vllm"] == "0.32.0" and facts["kv_cache_dtype"] == "auto"
    assert facts["transformers"].startswith("5.19") and facts["start_s"] > 0


def test_prompt_logprobs_equal_our_full_cache_nll(worker, smollm2):
    w, _ = worker
    engine = ours(smollm2)
    ids = torch.tensor(engine.encode(TEXT))
    from tasks.perplexity import token_nll

    our_nll = engine.stream_scores(ids, 0, token_nll)
    vllm = VllmEngine(w, smollm2[1], engine.info, engine.method, "")
    their_nll = vllm.stream_scores(ids, 0)
    assert their_nll.shape == our_nll.shape
    # fp32, two attention kernels: sums in another order, far below a real difference (~0.1)
    assert (their_nll - our_nll).abs().max() < 2e-3


def test_greedy_tokens_equal_ours(worker, smollm2):
    w, _ = worker
    engine = ours(smollm2)
    prompt = engine.encode(TEXT)
    mine = next(engine.generate_many([prompt], 16, set()))
    vllm = VllmEngine(w, smollm2[1], engine.info, engine.method, "")
    theirs = next(vllm.generate_many([prompt], 16, set()))
    assert theirs == mine
    assert vllm.speed()["generated_tokens"] == 16


def test_a_run_folder_pairs_with_ours(tmp_path):
    from harness.stats.uncertainty import compare
    from tests.helpers.runs import cfg_for
    from harness.run import run as run_ours

    common = ["model=smollm2_135m", "task=ruler", "task.lengths=[512]", "task.limit=2",
              "task.subtasks=[niah_single]"]
    theirs = run([*common, "vllm.kv_cache_dtype=fp8_e5m2", "vllm.kv_space_gib=1",
                  f"vllm.python={vllm_python()}", f"runner.results_root={tmp_path / 'v'}"])
    mine = run_ours(cfg_for(*common, "method=full", f"runner.results_root={tmp_path / 'o'}"))
    metrics = json.loads((Path(theirs) / "metrics.json").read_text())
    assert metrics["method"] == {**metrics["method"], "name": "vllm",
                                 "hyperparameters": {"kv_cache_dtype": "fp8_e5m2"}}
    assert metrics["engine"]["vllm"] == "0.32.0"
    assert metrics["engine"]["kv_cache_dtype"] == "fp8_e5m2" and metrics["kv"]["held_ratio"] == 0.25
    rows = [[json.loads(line) for line in (Path(f) / "samples.jsonl").read_text().splitlines()]
            for f in (mine, theirs)]
    assert [r["sample_id"] for r in rows[0]] == [r["sample_id"] for r in rows[1]]
    paired = compare("ruler", rows[0], rows[1], 200)
    assert paired["n"] == 2
    assert (Path(theirs) / "vllm.log").stat().st_size > 0


def test_a_conversation_gets_our_answers(worker, smollm2):
    """Multi-turn through vLLM (each turn one request of the whole history, prefix cache on)
    answers every turn as our engine's full cache does, feeding the same positions."""
    from tasks import build_task

    w, _ = worker
    engine = ours(smollm2)
    vllm = VllmEngine(w, smollm2[1], engine.info, engine.method, "")
    task = build_task("multiturn", context_tokens=600, turns=3, samples=2, max_new_tokens=16)
    mine, theirs = task.evaluate(engine).samples, task.evaluate(vllm).samples
    assert [s["positions_fed"] for s in theirs] == [s["positions_fed"] for s in mine]
    assert [[t["prediction"] for t in s["turns"]] for s in theirs] == \
        [[t["prediction"] for t in s["turns"]] for s in mine]
