"""Every task (tasks.available_tasks()) is checked as every method is: its YAML composes into
its options, bad options are refused before any weights load, it evaluates on stories260K with
tiny options, and it declares the main metric a leaderboard ranks it by (and that metric is in
what it returns). A new task without an entry in TINY fails here until it gets one."""

import math

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from harness.run import run
from harness.stats.uncertainty import cell_uncertainty
from kvcore.errors import ConfigError
from methods import build_method
from tasks import available_tasks, build_task, task_class
from tasks.engine_api import answer
from tests.conftest import DATA, PROJECT, STORIES, make_engine, need_shared
from tests.helpers.validation import HUGE_MODEL

# Options that make each task take seconds on stories260K (512 positions).
TINY = {
    "perplexity": {"dataset": "pg19", "max_tokens": 64},
    "ruler": {"lengths": [256], "subtasks": ["niah_single"], "depths": [50],
              "max_new_tokens": 8},
    "multiturn": {"turns": 2, "samples": 1, "context_tokens": 192, "max_new_tokens": 4},
    "longbench": {"datasets": ["multi_news"], "limit": 1, "max_length_tokens": 256,
                  "max_new_tokens": 4},
    "xsum": {"limit": 1, "max_new_tokens": 4},
    "lm_eval": {"names": ["copa"], "limit": 2, "num_fewshot": 0},
}
TASKS = available_tasks()


def compose_task(name: str, *overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"task={name}", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def test_every_task_has_tiny_options():
    assert sorted(TINY) == TASKS, "add the new task's tiny options to TINY"


@pytest.mark.parametrize("name", TASKS)
def test_yaml_composes_into_the_task_options(name):
    options = compose_task(name)["task"]
    assert options.pop("name") == name
    build_task(name, **options)  # every key is an option, every value of the right type
    assert sorted(options) == sorted(task_class(name).option_names())


@pytest.mark.parametrize("name", TASKS)
def test_main_metric_is_declared(name):
    cls = task_class(name)
    assert isinstance(cls.main_metric, str) and cls.main_metric
    assert isinstance(cls.higher_is_better, bool)


@pytest.mark.parametrize("name", TASKS)
@pytest.mark.parametrize("override, message", [("task.limit=0", "task.limit=0"),
                                               ("+task.nosuch_tokens=3", "task.nosuch_tokens")])
def test_bad_options_are_refused_before_weights(name, override, message, no_weight_loading,
                                                tmp_path):
    need_shared(STORIES)
    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"task={name}", "model=stories260k",
                                                       override,
                                                       f"runner.results_root={tmp_path}"])
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        run(cfg)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", TASKS)
def test_evaluates_on_a_tiny_model_and_returns_its_main_metric(name, stories, monkeypatch,
                                                                 tmp_path):
    need_shared(DATA)
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path / "cache"))
    model, tok = stories
    task = build_task(name, **TINY[name])
    task.check_data()
    result = task.evaluate(make_engine(model, build_method("full"), tok))
    value = result.metrics.get(task.main_metric)
    assert isinstance(value, (int, float)) and math.isfinite(value), result.metrics
    # every sample is identified by its content, and the main metric gets its interval from them
    assert result.samples and all(len(s["sample_id"]) == 16 for s in result.samples)
    cell = cell_uncertainty(name, result.metrics, result.samples, resamples=500)
    assert cell["metric"] == task.main_metric and cell["n"] >= 1
    assert cell["estimate"] == pytest.approx(value, abs=0.01, rel=1e-4)  # the official average
    if cell["ci95"] is not None:
        assert cell["ci95"][0] <= value + 0.01 and value - 0.01 <= cell["ci95"][1]


def request_fields(request) -> list:
    """A request as comparable data (a stream's tensor as a list)."""
    return [v.tolist() if isinstance(v, torch.Tensor) else v
            for v in vars(request).values() if not callable(v)]


@pytest.mark.parametrize("name", [n for n in TASKS if task_class(n).needs_live_engine is not True])
def test_requests_depend_on_the_model_not_the_method(name, stories, monkeypatch, tmp_path):
    """A sweep builds a task's requests once, from its first setting's engine, and answers them
    for every setting (harness.sweep.execute): they must not depend on the method. Scoring the
    answers of those requests is the task's evaluate."""
    need_shared(DATA)
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path / "cache"))
    model, tok = stories
    task = build_task(name, **TINY[name])
    task.check_data()
    if task.needs_live_engine:
        pytest.skip(f"task={name} with these options needs a live engine: it builds no requests")
    full, evicting = (make_engine(model, build_method(m, **k), tok)
                      for m, k in (("full", {}), ("streaming_llm", {"budget_tokens": 16})))
    work, other = task.requests(full), task.requests(evicting)
    assert [request_fields(r) for r in work.requests] == \
        [request_fields(r) for r in other.requests]
    answers = [answer(full, r) for r in work.requests]
    assert task.score(full, work, answers).metrics == task.evaluate(full).metrics


@pytest.mark.parametrize("task, options, expect", [
    ("ruler", {"lengths": [100_000_000]}, "task.lengths=[100000000]: the KV cache of the longest "
                                          "sample would need 119.21 GiB but 8.00 GiB"),
    ("ruler", {"samples_per_cell": 1_000_000_000}, "task.samples_per_cell=1000000000: "
                                                   "10000000000 prompts built would need"),
    ("multiturn", {"context_tokens": 100_000_000}, "task.context_tokens=100000000: the "
                                                    "conversation's KV cache and its text"),
])
def test_task_sizes_are_estimated_not_bounded_by_max_positions(task, options, expect, eight_gib):
    from tasks import build_task

    reasons = build_task(task, **options).validate(HUGE_MODEL, build_method("full"))
    assert any(expect in r for r in reasons), reasons
