"""harness.api: a method's cache inside transformers' own `generate` gives the runner's tokens.

The runner's side is `run()` on a composed config (task=xsum over a one-item file: greedy
decoding of one prompt, the prediction decoded into samples.jsonl), the API's side a plain
`AutoModelForCausalLM` loaded the way a user loads it, `model.generate(..., cache=cache)`.
"""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from harness import api
from harness.run import run
from kvcore.errors import ConfigError
from methods import available_methods, method_class
from tests.conftest import PROJECT, STORIES, need_shared
from tests.helpers.generation import PROMPT, knobs_for

NEW_TOKENS = 12
# A few steps already cover KVQuant's prefill, compression and decoding.
NEW_TOKENS_FOR = {"kvquant": 3}
# Methods that serve a plain generate loop: every method today (the generator of this list is
# the method package itself, so a method added later is held to the same equality).
METHODS = available_methods()


@pytest.fixture(scope="module")
def stories():
    need_shared(STORIES)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    return model, tokenizer


def runner_prediction(tmp_path, name: str, knobs: dict, new_tokens: int, runner=()) -> dict:
    item = {"article": PROMPT, "summary_gt": "unused", "max_tokens": new_tokens, "stop": []}
    path = tmp_path / "prompt.jsonl"
    path.write_text(json.dumps(item) + "\n")
    overrides = ["model=stories260k", "model.device=cpu", "task=xsum", f"task.path={path}",
                 "task.limit=1", f"method={name}", f"runner.results_root={tmp_path / 'runs'}",
                 *(f"method.{k}={json.dumps(v)}" for k, v in knobs.items()), *runner]
    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    folder = run(cfg)
    return json.loads((folder / "samples.jsonl").read_text().splitlines()[0])


@pytest.mark.usefixtures("torch_path")  # as a CPU user runs: the quantizers' kernels are
@pytest.mark.parametrize("name", METHODS)  # tested under Triton's interpreter on their own
def test_generate_through_the_api_equals_the_runner(stories, tmp_path, name):
    model, tokenizer = stories
    inputs = tokenizer(PROMPT, return_tensors="pt")
    knobs = knobs_for(name, inputs.input_ids.shape[1])
    new_tokens = NEW_TOKENS_FOR.get(name, NEW_TOKENS)
    expected = runner_prediction(tmp_path, name, knobs, new_tokens)
    with api.cache(model, tokenizer, name, **knobs) as cache:
        out = model.generate(**inputs, cache=cache, max_new_tokens=new_tokens, do_sample=False)
        report = cache.report()
    new = out[0, inputs.input_ids.shape[1]:].tolist()
    assert len(new) == expected["new_tokens"]
    assert tokenizer.decode(new, skip_special_tokens=True) == expected["prediction"]
    assert report["tokens_seen"] == inputs.input_ids.shape[1] + len(new) - 1
    if method_class(name).capabilities.compresses and name != "full_offload":
        assert report["kv"]["method_active"], report["kv"]["inactive_reason"]


def test_decode_interval_through_the_api_equals_the_runner(stories, tmp_path):
    """runner.decode_interval_tokens reaches a generate loop: the same tokens as the runner's,
    and not those of the same method without it."""
    model, tokenizer = stories
    inputs = tokenizer(PROMPT, return_tensors="pt")
    knobs = {"budget_tokens": 12, "window_tokens": 2}
    expected = runner_prediction(tmp_path, "snapkv", knobs, 24,
                                 ["runner.decode_interval_tokens=3"])
    with api.cache(model, tokenizer, "snapkv", decode_interval_tokens=3, **knobs) as cache:
        out = model.generate(**inputs, cache=cache, max_new_tokens=24, do_sample=False)
        report = cache.report()
    new = out[0, inputs.input_ids.shape[1]:].tolist()
    assert tokenizer.decode(new, skip_special_tokens=True) == expected["prediction"]
    assert max(report["kv"]["tokens_per_layer"]) <= 12 + 3
    (tmp_path / "once").mkdir()
    without = runner_prediction(tmp_path / "once", "snapkv", knobs, 24)
    assert without["prediction"] != expected["prediction"]


@pytest.mark.parametrize("name, knobs, message", [
    ("snapkv", {"budget_ratio": 2.0}, "method.budget_ratio=2.0 must be in (0, 1]"),
    ("snapkv", {"window": 4}, "method.window is not a hyperparameter of method=snapkv"),
    ("kivi", {"budget_ratio": 0.2}, "method=kivi does not take method.budget_ratio"),
    ("snapkv", {"dense_layers": [7]}, "runner.dense_layers=[7] names layer(s) [7] but the model "
                                      "has 5 layers"),
    ("snapkv", {"kv_offload": "cpu"}, "runner.kv_offload=cpu but method=snapkv cannot keep its "
                                      "KV on the host tier"),
    ("h2o", {"budget_basis": "all"}, "runner.budget_basis='all'; allowed: final, seen"),
    ("h2o", {"decode_interval_tokens": 16}, "runner.decode_interval_tokens=16 but method=h2o "
                                            "compresses while decoding by its own rule"),
])
def test_refusals_are_the_runners_and_come_before_anything_runs(stories, monkeypatch, name,
                                                                 knobs, message):
    from harness.core import hf_adapter

    model, tokenizer = stories
    monkeypatch.setattr(hf_adapter, "prepare", lambda *a, **k: pytest.fail("prepared"))
    with pytest.raises(ConfigError) as err:
        api.cache(model, tokenizer, name, **knobs)
    assert message in str(err.value)
    assert model.config._attn_implementation == "sdpa"  # the model untouched


def test_one_sequence_per_cache_and_the_model_restored_after(stories):
    model, tokenizer = stories
    inputs = tokenizer([PROMPT, PROMPT], return_tensors="pt")
    plain = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    with api.cache(model, tokenizer, "h2o", budget_tokens=16) as cache:
        with pytest.raises(ConfigError, match="serves one sequence"):
            model.generate(**inputs, cache=cache, max_new_tokens=4, do_sample=False)
    assert model.config._attn_implementation == "sdpa"
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert torch.equal(model.generate(**inputs, max_new_tokens=4, do_sample=False), plain)


# --- what the API refuses in its own words (harness/api.py's docstring) -----------------------

def test_a_model_it_cannot_drive_is_named_with_what_it_needs(stories):
    from transformers import GPT2Config, GPT2LMHeadModel

    _, tokenizer = stories
    for model in (None, "stories260K", torch.nn.Linear(2, 2)):
        with pytest.raises(ConfigError, match="api.cache needs a transformers causal LM .*"
                                              "families tested: llama, qwen2"):
            api.cache(model, tokenizer, "h2o", budget_tokens=16)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=64,
                                      n_positions=32))  # its layers are transformer.h
    with pytest.raises(ConfigError, match=r"GPT2LMHeadModel \(gpt2\): no decoder layers at "
                                          r"model.model.layers\[i\].self_attn.*families tested"):
        api.cache(gpt2, tokenizer, "h2o", budget_tokens=16)
    with pytest.raises(ConfigError, match="give a method name"):
        api.cache(stories[0], tokenizer, None)


def test_a_built_method_changed_before_use_is_revalidated(stories):
    from methods import build_method

    model, tokenizer = stories
    method = build_method("snapkv", budget_tokens=16, window_tokens=4)
    method.budget_tokens = -3  # set after construction: never trusted
    with pytest.raises(ConfigError, match=r"method.budget_tokens=-3 must be a positive integer"):
        api.cache(model, tokenizer, method)
    method.budget_tokens, method.window_tokens = 16, "four"
    with pytest.raises(ConfigError, match="method.window_tokens"):
        api.cache(model, tokenizer, method)
    assert model.config._attn_implementation == "sdpa"


def test_a_method_changed_after_the_cache_was_built_is_refused(stories):
    model, tokenizer = stories
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with api.cache(model, tokenizer, "snapkv", budget_tokens=16, window_tokens=4) as cache:
        cache.method.budget_tokens = 10 ** 9
        with pytest.raises(ConfigError, match=r"method.budget_tokens of this snapkv cache changed "
                                              r"after it was built \(budget_tokens=1000000000\)"):
            model.generate(**inputs, cache=cache, max_new_tokens=2, do_sample=False)
        assert cache.pos == 0


def test_a_closed_cache_refuses_every_use(stories):
    model, tokenizer = stories
    inputs = tokenizer(PROMPT, return_tensors="pt")
    cache = api.cache(model, tokenizer, "h2o", budget_tokens=16)
    cache.close()
    with pytest.raises(ConfigError, match="this h2o cache is closed; open a new one"):
        model(**inputs, cache=cache)
    with pytest.raises(ConfigError, match="is closed"):
        model.generate(**inputs, cache=cache, max_new_tokens=2, do_sample=False)
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_one_cache_one_generate(stories):
    model, tokenizer = stories
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with api.cache(model, tokenizer, "h2o", budget_tokens=16) as cache:
        model.generate(**inputs, cache=cache, max_new_tokens=3, do_sample=False)
        seen = cache.pos
        with pytest.raises(ConfigError, match=f"it holds {seen} tokens and this forward feeds a "
                                              "new prompt"):
            model.generate(**inputs, cache=cache, max_new_tokens=3, do_sample=False)
        for call, what in ((cache.reset, "reset"), (lambda: cache.crop(2), "cropped"),
                           (lambda: cache.batch_repeat_interleave(2), "repeated")):
            with pytest.raises(ConfigError, match=f"serves one sequence and cannot be {what}"):
                call()
        assert cache.pos == seen


def test_padding_use_cache_false_and_positions_beyond_the_model_are_refused(stories):
    model, tokenizer = stories
    inputs = tokenizer(PROMPT, return_tensors="pt")
    padded = {"input_ids": inputs.input_ids,
              "attention_mask": torch.cat([torch.zeros(1, 2, dtype=torch.long),
                                           inputs.attention_mask[:, 2:]], dim=1)}
    limit = model.config.max_position_embeddings
    with api.cache(model, tokenizer, "h2o", budget_tokens=16) as cache:
        with pytest.raises(ConfigError, match="attention_mask has zeros"):
            model.generate(**padded, cache=cache, max_new_tokens=2, do_sample=False)
        with pytest.raises(ConfigError, match="use_cache=False"):
            model.generate(**inputs, cache=cache, max_new_tokens=2, do_sample=False,
                           use_cache=False)
        too_long = torch.full((1, limit + 1), 5, dtype=torch.long)
        with pytest.raises(ConfigError, match=f"{limit + 1} tokens are beyond the model's {limit} "
                                              "positions"):
            model(input_ids=too_long, cache=cache)
        assert cache.pos == 0  # nothing ran: the cache still takes its one sequence
        out = model.generate(**inputs, cache=cache, max_new_tokens=2, do_sample=False)
        assert out.shape[1] == inputs.input_ids.shape[1] + 2
