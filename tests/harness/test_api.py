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
    from harness import hf_adapter

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
