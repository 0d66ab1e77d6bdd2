"""Query-agnostic protocol (task.query=agnostic): the context is compressed before the question is
fed. Lossless for full; a prompt-end compressor really chooses without the question; the batched
path equals batch 1; the split keeps the prompt's tokens exactly."""

import dataclasses

import pytest

from kvcore.errors import ConfigError
from methods import build_method
from tasks import build_task
from tasks.ruler import PromptFormat, query_start
from tests.conftest import make_engine
from tests.helpers.generation import prompts_of


def test_full_is_unchanged_by_feeding_the_question_after_the_prompt(tiny_model):
    prompt, query = prompts_of([40, 7], seed=3)
    engine = make_engine(tiny_model, build_method("full"), chunk=16)
    with engine.request() as req:
        whole = req.generate(prompt + query, 6, stop_ids=set())
    with engine.request() as req:
        split = req.generate(prompt, 6, stop_ids=set(), query=query)
    assert split == whole


def test_snapkv_compresses_the_context_without_the_question(tiny_model):
    """Aware: the observation window holds the question and SnapKV keeps budget tokens of
    prompt + question; agnostic: it compresses the context alone at the prompt end, and the
    question's tokens are then stored in full next to the kept ones."""
    prompt, query = prompts_of([60, 9], seed=4)
    method = build_method("snapkv", budget_tokens=16, window_tokens=4)
    engine = make_engine(tiny_model, method, chunk=16)
    with engine.request() as req:
        req.prefill(prompt + query)
        aware = [kv.kept_tokens() for kv in req.cache.kv_layers]
    with engine.request() as req:
        req.prefill(prompt)
        at_prompt_end = [kv.kept_tokens() for kv in req.cache.kv_layers]
        req.prefill(query, prompt_ends=False)
        agnostic = [kv.kept_tokens() for kv in req.cache.kv_layers]
    assert aware == at_prompt_end == [16] * len(aware)
    assert agnostic == [16 + len(query)] * len(aware)


def test_batched_query_agnostic_equals_batch_one(tiny_model):
    prompts, queries = prompts_of([30, 45, 12], seed=6), prompts_of([5, 3, 8], seed=7)
    method = build_method("h2o", budget_tokens=12)
    one = make_engine(tiny_model, method, chunk=8)
    reference = list(one.generate_many(prompts, 5, stop_ids=set(), queries=queries))
    batched = make_engine(tiny_model, method, chunk=8)
    batched.settings = dataclasses.replace(batched.settings, batch_size=3)
    assert list(batched.generate_many(prompts, 5, stop_ids=set(), queries=queries)) == reference
    aware = list(one.generate_many([p + q for p, q in zip(prompts, queries)], 5, stop_ids=set()))
    assert aware != reference  # H2O's kept set differs when the question arrives after the end


def test_the_question_starts_right_after_the_haystack(smollm2):
    model, tok = smollm2
    task = build_task("ruler", subtasks=["niah_single"], lengths=[512], depths=[50])
    fmt = PromptFormat(tok, "auto")
    sample = task.build_samples(tok)[0]
    cut = query_start(sample, fmt)
    question = tok.decode(sample.input_ids[cut:])
    assert "What is the special magic number" in question
    assert sample.context[-30:].strip() in tok.decode(sample.input_ids[:cut])
    assert len(sample.input_ids) - cut < 60  # the question, chat markers and answer prefix


def test_unknown_query_mode_is_refused():
    with pytest.raises(ConfigError, match="task.query='both'; allowed: aware, agnostic"):
        build_task("ruler", query="both")
