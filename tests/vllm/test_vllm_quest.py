"""Quest inside vLLM (the project's plugin, scripts/kvh_vllm_plugin): its torch selection against
our methods/quest.py on the same tensors, its prompt-length bookkeeping, the knobs the harness
passes and refuses, the worker's plugin checks (no vLLM needed), then greedy tokens through a
real vLLM equal to our Quest's (make test-vllm)."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from harness.engines import vllm_engine
from harness.engines.vllm_engine import (check_setting, compose_setting, parse_knobs, plugin_engine_knobs,
                                 plugin_knobs)
from kvcore.errors import ConfigError
from methods import build_method
from methods.quest import QuestLayer
from tests.conftest import make_engine

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "scripts" / "kvh_vllm_plugin"
sys.path.insert(0, str(PLUGIN))  # the plugin's vLLM-free modules, as the vLLM venv installs them
from kvh_vllm import quest_math  # noqa: E402
from kvh_vllm.settings import layer_index, quest_settings, requested_method  # noqa: E402
from tests.vllm.conftest import RULER, one_line  # noqa: E402



# --- the selection math against ours ------------------------------------------------------------

def our_decode_steps(tiny_model, monkeypatch, prompt_tokens=30, steps=12, **knobs):
    """Every decode step of our Quest on the tiny model: (q, k, v, out, scaling) per layer."""
    seen = []
    original = QuestLayer.attend

    def spy(self, module, query, keys, values, mask, base, **kw):
        out = original(self, module, query, keys, values, mask, base, **kw)
        if query.shape[2] == 1:
            seen.append(dict(q=query[0, :, 0], k=keys[0], v=values[0], out=out[0][0, 0],
                             scaling=kw["scaling"]))
        return out

    monkeypatch.setattr(QuestLayer, "attend", spy)
    torch.manual_seed(3)
    ids = torch.randint(3, 250, (1, prompt_tokens + steps))
    engine = make_engine(tiny_model, build_method("quest", dense_layers=[], **knobs), chunk=16)
    with engine.request() as req:  # the budget basis: the prompt's length when it ends
        req.prefill(ids[:, :prompt_tokens])
        for t in range(prompt_tokens, prompt_tokens + steps):
            req.step(ids[:, t])
    return seen


@pytest.mark.parametrize("knobs", [
    dict(page_size=4),  # budget_ratio 0.2 of a 30-token prompt: 6 tokens -> the 3-page minimum
    dict(page_size=4, budget_ratio=0.5, min_pages=1),  # 15 tokens: 3 pages, partial page scored
    dict(page_size=2, budget_tokens=9),
])
def test_the_plugins_quest_is_ours_at_every_decode_step(tiny_model, monkeypatch, knobs):
    steps = our_decode_steps(tiny_model, monkeypatch, **knobs)
    method = build_method("quest", **knobs)
    budget = quest_math.step_budget(torch.tensor([30]), method.budget_ratio, method.budget_tokens)
    for s in steps:
        lengths = torch.tensor([s["k"].shape[1]])
        got = quest_math.quest_decode(s["q"][None], s["k"][None], s["v"][None], lengths, budget,
                                      s["scaling"], method.page_size, method.min_pages)[0]
        assert torch.allclose(got, s["out"], atol=1e-5)
    # the same steps as one padded batch of rows of different lengths (a vLLM batch)
    longest = max(s["k"].shape[1] for s in steps)

    def padded(x):
        return torch.nn.functional.pad(x, (0, 0, 0, longest - x.shape[1]), value=7.0)

    q = torch.stack([s["q"] for s in steps])
    keys, values = (torch.stack([padded(s[n]) for s in steps]) for n in ("k", "v"))
    lengths = torch.tensor([s["k"].shape[1] for s in steps])
    got = quest_math.quest_decode(q, keys, values, lengths, budget.expand(len(steps)),
                                  steps[0]["scaling"], method.page_size, method.min_pages)
    assert torch.allclose(got, torch.stack([s["out"] for s in steps]), atol=1e-5)


def test_the_budget_rule_is_the_harness_rule():
    from methods.budget import budget_for

    prompts = torch.tensor([1, 4, 5, 999, 1000, 1001, 1023])
    for ratio in (0.2, 0.1, 0.35):
        want = [budget_for(int(p), ratio, None) for p in prompts]
        assert quest_math.step_budget(prompts, ratio, None).tolist() == want
    assert quest_math.step_budget(prompts, 0.2, 64).tolist() == [64] * 7
    # K = min(max(3, min(t, B) // 16), P): with B >= t the partial page is still dropped
    counts = quest_math.page_counts(torch.tensor([10, 100, 1000, 1000]),
                                    torch.tensor([200, 200, 200, 2000]), 16, 3)
    assert counts.tolist() == [1, 6, 12, 62]


def test_keys_read_through_a_block_table_are_the_requests_keys():
    torch.manual_seed(0)
    blocks, h, bs, d = 9, 3, 32, 8
    cache = torch.randn(blocks, h, bs, d)
    table = torch.tensor([[4, 1, 7, 0], [2, 8, 0, 0]])
    got = quest_math.gather_paged(cache, table, 70)  # (2, H, 70, D)
    want0 = torch.cat([cache[4], cache[1], cache[7]], 1)[:, :70]
    assert torch.equal(got[0], want0)
    assert torch.equal(got[1, :, :64], torch.cat([cache[2], cache[8]], 1))


def test_the_cpu_cache_is_read_in_vllms_layout():
    """vLLM's CPU cache (vec ISA, checked against its cpu_attn_reshape_and_cache by hand): per
    block and KV head, the keys channel-major [D][block], then the values token-major."""
    blocks, h, bs, d = 3, 2, 32, 4
    keys = torch.randn(blocks, h, bs, d)  # token-major, what a request's rows are
    values = torch.randn(blocks, h, bs, d)
    stored = torch.cat([keys.transpose(2, 3).reshape(blocks, h, bs * d),
                        values.reshape(blocks, h, bs * d)], -1).view(blocks, h, bs, 2 * d)
    k, v = quest_math.cpu_cache_views(stored)
    assert torch.equal(k, keys) and torch.equal(v, values)
    assert k.data_ptr() == stored.data_ptr()  # views: nothing copied


def test_prompt_lengths_come_from_the_prefill_rows():
    book = quest_math.PromptLengths()
    # step 1: request A (first block 5) prefills 40 of 100 tokens, B (block 2) a 30-token prompt
    assert book.decode_rows([40, 30], [40, 30], [True, True], [5, 2]) == ([], [])
    # step 2: A's last chunk, B decodes its first generated token
    assert book.decode_rows([60, 1], [100, 31], [True, False], [5, 2]) == ([1], [30])
    # step 3: both decode; a row of an unknown request (no prefill seen) stays vLLM's
    assert book.decode_rows([1, 1, 1], [101, 32, 9], [False] * 3, [5, 2, 6]) == ([0, 1],
                                                                                [100, 30])
    # B ended; its first block, reused by C, is recorded afresh by C's prefill
    book.decode_rows([12], [12], [True], [2])
    assert book.decode_rows([1], [13], [False], [2]) == ([0], [12])


# --- the harness side: which knobs reach the worker, which are refused -------------------------

def test_quest_knobs_are_passed_as_the_plugin_implements_them():
    _, setting = compose_setting([*RULER, "method=quest"])
    check_setting(setting)
    assert plugin_knobs(setting.method) == {"budget_ratio": 0.2, "budget_tokens": None,
                                            "page_size": 16, "min_pages": 3,
                                            "dense_layers": [0, 1]}
    _, setting = compose_setting([*RULER, "method=quest", "method.budget_ratio=0.1",
                                  "method.page_size=32", "method.dense_layers=[1,0,1]"])
    knobs = plugin_knobs(setting.method)
    assert (knobs["budget_ratio"], knobs["page_size"], knobs["dense_layers"]) == (0.1, 32, [0, 1])
    assert quest_settings(json.dumps(knobs)).dense_layers == (0, 1)


def test_the_prefix_cache_is_off_for_quest_unless_asked_on():
    _, setting = compose_setting([*RULER, "method=quest"])
    knobs, _ = parse_knobs(["vllm.python=/bin/sh"])
    assert knobs.prefix_caching and not plugin_engine_knobs(setting, knobs, []).prefix_caching
    args = ["vllm.python=/bin/sh", "vllm.prefix_caching=true"]
    with pytest.raises(ConfigError) as err:
        plugin_engine_knobs(setting, parse_knobs(args)[0], args)
    assert "vllm.prefix_caching=true with method=quest" in one_line(err)
    args = ["vllm.python=/bin/sh", "vllm.kv_cache_dtype=fp8_e4m3"]
    with pytest.raises(ConfigError) as err:
        plugin_engine_knobs(setting, parse_knobs(args)[0], args)
    assert "vllm.kv_cache_dtype=fp8_e4m3 with method=quest" in one_line(err)
    _, full = compose_setting(RULER)
    assert plugin_engine_knobs(full, knobs, []).prefix_caching  # a full run keeps vLLM's default


@pytest.mark.parametrize("overrides, expected", [
    (["method.select_per=kv_head"], "method.select_per=kv_head: the vLLM plugin's Quest runs "
                                    "method.select_per=query_head only"),
    (["method.current_page=forced"], "method.current_page=forced"),
    (["method.select_per=kv_head", "method.group_reduce=sum"], "method.select_per=kv_head"),
])
def test_quest_knobs_the_plugin_does_not_implement_are_refused(overrides, expected):
    _, setting = compose_setting([*RULER, "method=quest", *overrides])
    with pytest.raises(ConfigError) as err:
        check_setting(setting)
    assert expected in one_line(err)


def test_the_cli_refuses_an_unimplemented_knob_before_starting(tmp_path, capsys):
    root = tmp_path / "results"
    code = vllm_engine.main([*RULER, "method=quest", "method.select_per=kv_head",
                             f"runner.results_root={root}", "vllm.python=/bin/sh"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: method.select_per=kv_head") and "\n" not in err
    assert not root.exists()


# --- the plugin's own checks (the worker and the environment it sets) --------------------------

def worker_module():
    spec = importlib.util.spec_from_file_location("kvh_vllm_worker", ROOT / "scripts" /
                                                  "vllm_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_worker_asks_the_plugin_for_quest_only_when_told(monkeypatch, tmp_path):
    worker = worker_module()
    monkeypatch.setenv("KVH_VLLM_METHOD", "quest")  # inherited from a shell: a full run clears it
    assert worker._plugin_method({"method": "full"}) == {}
    assert requested_method() is None
    with pytest.raises(ValueError, match="needs prefix_caching false"):
        worker._plugin_method({"method": "quest"})
    with pytest.raises(ValueError, match="allowed: full, quest"):
        worker._plugin_method({"method": "h2o", "prefix_caching": False})
    # an installed copy of the plugin: used when it is this tree's, refused when it differs
    installed = tmp_path / "kvh_vllm"
    shutil.copytree(PLUGIN / "kvh_vllm", installed)
    found = importlib.machinery.ModuleSpec("kvh_vllm", None, is_package=True)
    found.submodule_search_locations = [str(installed)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: found)
    facts = worker._plugin_method({"method": "quest", "prefix_caching": False,
                                   "method_knobs": {"budget_ratio": 0.1}})
    assert facts["method"] == "quest" and facts["plugin_dir"] == str(installed)
    assert requested_method() == "quest"
    assert quest_settings(worker.os.environ["KVH_VLLM_QUEST"]).budget_ratio == 0.1
    (installed / "quest_math.py").write_text("# an older plugin\n")
    with pytest.raises(ValueError, match="differs from scripts/kvh_vllm_plugin/kvh_vllm/"
                                         "quest_math.py: run make vllm-setup"):
        worker._plugin_method({"method": "quest", "prefix_caching": False})


@pytest.mark.parametrize("text, expected", [
    ('{"select_per": "kv_head"}', "select_per is not a knob of the plugin's Quest"),
    ('{"page_size": 0}', "page_size=0 must be a positive integer"),
    ('{"budget_ratio": 1.5}', "budget_ratio=1.5 must be in (0, 1]"),
    ('{"dense_layers": [-1]}', "dense_layers=[-1] must be layer indices >= 0"),
])
def test_the_plugin_refuses_bad_settings(text, expected):
    with pytest.raises(ValueError) as err:
        quest_settings(text)
    assert expected in str(err.value)


def test_dense_layers_are_found_by_the_attention_layers_name():
    assert layer_index("model.layers.0.self_attn.attn") == 0
    assert layer_index("model.layers.17.self_attn.attn") == 17
    with pytest.raises(ValueError, match="cannot read one layer index"):
        layer_index("model.blocks.2.experts.3.attn")


def test_the_plugin_is_idle_without_a_method(monkeypatch):
    monkeypatch.delenv("KVH_VLLM_METHOD", raising=False)
    assert requested_method() is None
    monkeypatch.setenv("KVH_VLLM_METHOD", "h2o")
    with pytest.raises(ValueError, match="allowed: quest"):
        requested_method()


# --- against a real vLLM (make test-vllm) ------------------------------------------------------

PROMPT = ("Paul Graham wrote essays about startups, programming languages and cities. " * 30
          + "The special magic number is 48213. " + "Cities shape ambition in quiet ways. " * 20
          + "What is the special magic number? Answer: The special magic number is")


@pytest.mark.needs_vllm
def test_greedy_tokens_of_vllm_quest_equal_ours(smollm2, tmp_path):
    from harness.core import models
    from harness.engines.vllm_engine import VllmEngine, VllmKnobs, model_folder, started
    from tests.vllm.conftest import vllm_python

    model, tokenizer = smollm2
    quest = build_method("quest")
    ours = make_engine(model, quest, tokenizer)
    prompts = [ours.encode(PROMPT), ours.encode(PROMPT.replace("48213", "77190")[120:])]
    assert all(len(p) > 300 for p in prompts)  # 0.2 of the prompt: pages to choose among
    mine = list(ours.generate_many(prompts, 12, set()))
    full = make_engine(model, build_method("full"), tokenizer)
    assert list(full.generate_many(prompts, 12, set())) != mine  # Quest changes these answers
    folder = model_folder(models.resolve_model({"name": "smollm2_135m", "device": "cpu"}))
    knobs = VllmKnobs(python=str(vllm_python()), kv_space_gib=1, max_num_seqs=4,
                      prefix_caching=False)
    with started(knobs, folder, "float32", 1024, 0, tmp_path / "vllm.log",
                 pool={"method": "quest", "method_knobs": plugin_knobs(quest)}) as (w, facts):
        assert facts["method"] == "quest" and "QuestCPUBackend" in facts["attention_backend"]
        theirs = list(VllmEngine(w, tokenizer, ours.info, quest, folder).generate_many(
            prompts, 12, set()))
    assert theirs == mine
    log = (tmp_path / "vllm.log").read_text()
    assert "kv-harness Quest" in log  # the engine core ran the plugin's backend


def test_a_plugin_run_is_active_only_when_the_plugin_recomputed_a_decode_row():
    """The worker's log decides: the plugin's first-step line makes the run Quest's; without it
    (a plugin that never registered, or never saw a decode row) vLLM's own attention answered
    and metrics.json says the method did not act, never a normal Quest result."""
    _, setting = compose_setting([*RULER, "method=quest"])
    acted, idle = ({"kv": {}, "protocol": {}} for _ in range(2))
    vllm_engine.plugin_sections(acted, setting, {"vllm": "0.32.0"},
                                f"INFO ...\n{vllm_engine.PLUGIN_ACTED} in process 7 (1 rows)\n")
    vllm_engine.plugin_sections(idle, setting, {"vllm": "0.32.0"}, "INFO ... registered\n")
    assert acted["kv"]["method_active"] is True and "inactive_reason" not in acted["kv"]
    assert idle["kv"]["method_active"] is False
    assert "recomputed no decode row" in idle["kv"]["inactive_reason"]
