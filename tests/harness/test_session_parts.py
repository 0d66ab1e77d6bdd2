"""harness.session from plain parts (lm-eval's model, the benchmarks): every setting checked
before the weights load, a refused one named by its row."""

import pytest

from harness.core import models
from harness.session import of_methods, runner_of
from kvcore.errors import ConfigError
from methods import build_method
from tests.conftest import STORIES, need_shared


@pytest.fixture
def no_weights(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the config error was found")
    monkeypatch.setattr(models, "load_model", refuse)


def test_a_refused_row_is_named_before_the_weights_load(no_weights):
    need_shared(STORIES)
    methods = {"ok": build_method("full"), "far": build_method("h2o", budget_ratio=0.5)}
    with pytest.raises(ConfigError) as err:
        of_methods({"name": "stories260k", "device": "cpu"}, methods,
                   row_knobs={"far": {"dense_layers": [99]}})
    assert str(err.value).startswith("far: runner.dense_layers=[99] names layer(s) [99]")


def test_rows_get_their_own_runner_knobs(no_weights):
    need_shared(STORIES)
    session, settings = of_methods(
        {"name": "stories260k", "device": "cpu"},
        {layout: build_method("full") for layout in ("contiguous", "paged")},
        row_knobs={"paged": {"kv_layout": "paged"}}, prefill_chunk_tokens=64)
    assert [s.runner.kv_layout for s in settings.values()] == ["contiguous", "paged"]
    assert {s.runner.prefill_chunk_tokens for s in settings.values()} == {64}
    assert session.model is None  # validated only


def test_runner_of_names_an_unknown_key():
    with pytest.raises(ConfigError, match="runner.chunk_tokens is not a runner key"):
        runner_of(chunk_tokens=64)
    assert runner_of(batch_size=2)["batch_size"] == 2
