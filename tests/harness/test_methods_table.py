"""The README method table and docs/methods/ are the methods' declarations, and the serving
requirements they show are what the methods do: a method said to drop only at a prompt's end (or
never) holds one more token per layer after every decode step; one said to evict while decoding
holds fewer at some step."""

import pytest
import torch

from harness import api
from harness.report import methods_table
from harness.report.methods_table import serving_requirements
from methods import available_methods, method_class
from tests.conftest import STORIES, need_shared
from tests.helpers.generation import PROMPT, knobs_for

DECODE_STEPS = 10


def test_readme_table_and_pages_equal_the_generated_ones():
    assert methods_table.main(["--check"]) == 0, "run: python -m harness.report.methods_table"


def test_every_method_has_one_table_line_with_its_serving_columns():
    lines = methods_table.table().splitlines()[2:]
    assert [line.split("`")[1] for line in lines] == available_methods()
    for line in lines:
        assert len(line.split(" | ")) == 9


@pytest.fixture(scope="module")
def stories():
    need_shared(STORIES)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    return model, tokenizer


def held_tokens(cache) -> list[int]:
    return [kv.stats()["kv_tokens"] for kv in cache.kv_layers]


CHECKED = [n for n in available_methods()
           if serving_requirements(method_class(n))["cache"] != "own storage"]


@pytest.mark.parametrize("name", CHECKED)
def test_cache_column_is_what_decoding_does(stories, name):
    model, tokenizer = stories
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    needs = serving_requirements(method_class(name))
    with api.cache(model, tokenizer, name, **knobs_for(name, ids.shape[1])) as cache:
        token = model(input_ids=ids, cache=cache).logits[:, -1:].argmax(-1)
        growth = []
        for _ in range(DECODE_STEPS):
            before = held_tokens(cache)
            token = model(input_ids=token, cache=cache).logits[:, -1:].argmax(-1)
            growth.append([a - b for a, b in zip(held_tokens(cache), before)])
        moved = cache.report()["transfer"]["bytes_h2d"]
    if needs["cache"] == "evicts while decoding":
        assert any(g < 1 for step in growth for g in step), growth
    else:  # append-only, drops at prompt end, selective reads: every stored token stays
        assert all(g == 1 for step in growth for g in step), growth
    assert (moved > 0) == needs["host tier"]
