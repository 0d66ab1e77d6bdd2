"""Compression during decoding (`runner.decode_interval_tokens`, methods.protocol.Protocol): every N
tokens after the prompt a once-per-prompt compressor is brought back to its budget by its own
scorer. Checked for every method declaring `Capabilities.recompresses_during_decode`: the cache
never holds more than the budget plus N at any decode step (and does act), the result does not
depend on the prefill chunk size, and the option is refused before weights for the others."""

import dataclasses
import json

import pytest
import torch

from harness.config.runner import RunnerSettings, decode_interval_reasons
from kvcore.errors import ConfigError
from methods import available_methods, build_method, method_class
from methods.protocol import Protocol
from tests.conftest import STORIES, make_engine, need_shared
from tests.helpers.sweeps import TASK, assert_equal_to_single_runs
from tests.methods.contract.common import get_model, skip_if_refused

PROMPT_TOKENS, DECODE_STEPS, INTERVAL = 96, 23, 5
DECODING = [n for n in available_methods()
            if method_class(n).capabilities.recompresses_during_decode]


def decode(model, name, interval, chunk=512):
    """Greedy logits `(1 + DECODE_STEPS, V)` after a prompt, and per decode step the largest
    (held - budget) over the compressing layers."""
    method = build_method(name, **method_class(name).compressing_hyperparameters(PROMPT_TOKENS))
    engine = make_engine(model, method, chunk=chunk,
                         protocol=Protocol(decode_interval_tokens=interval))
    prompt = torch.randint(3, 250, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(5))
    over = []
    with engine.request() as req:
        logits = [req.prefill(prompt.tolist())[0, -1]]
        layers = [kv for kv in req.cache.kv_layers if hasattr(kv, "budget")]
        for _ in range(DECODE_STEPS):
            logits.append(req.step(int(logits[-1].argmax()))[0, -1])
            over.append(max(kv.kept_tokens() - kv.budget() for kv in layers))
    return torch.stack(logits), over


@pytest.mark.parametrize("name", DECODING)
def test_the_cache_never_exceeds_budget_plus_interval(name, request, tmp_path, monkeypatch):
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    model = get_model("llama", request, layers=3)
    skip_if_refused(build_method(name), model)
    _, over = decode(model, name, INTERVAL)
    assert max(over) <= INTERVAL, over
    assert min(over) <= 0, over  # brought back to the budget, not merely bounded
    _, kept_all = decode(model, name, None)  # without it every generated token stays
    assert kept_all[-1] == DECODE_STEPS, kept_all


@pytest.mark.parametrize("name", DECODING)
def test_decode_compression_does_not_depend_on_the_prefill_chunk(name, request, tmp_path,
                                                                 monkeypatch):
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    model = get_model("llama", request, layers=3)
    skip_if_refused(build_method(name), model)
    whole, _ = decode(model, name, INTERVAL, chunk=512)
    for chunk in (1, 16, 40):
        torch.testing.assert_close(decode(model, name, INTERVAL, chunk=chunk)[0], whole,
                                   atol=1e-4, rtol=0)
    assert not torch.allclose(decode(model, name, None)[0], whole, atol=1e-4, rtol=0)


class _Task:
    name = "t"

    def __init__(self, phases):
        self._phases = frozenset(phases)

    def phases(self):
        return self._phases


def test_refused_for_methods_that_do_not_declare_it_and_tasks_without_decode():
    interval = Protocol(decode_interval_tokens=8)
    for name, why in (("h2o", "compresses while decoding by its own rule"),
                      ("rkv", "compresses while decoding by its own rule"),
                      ("full", "does not compress again"), ("kvzip", "does not compress again")):
        (reason,) = decode_interval_reasons(build_method(name), _Task({"prefill", "decode"}),
                                            interval)
        assert f"method={name} {why}" in reason, reason
    (reason,) = decode_interval_reasons(build_method("snapkv"), _Task({"prefill"}), interval)
    assert "feeds no token after a prompt" in reason
    assert decode_interval_reasons(build_method("h2o"), _Task({"decode"}), Protocol()) == []
    runner = {"prefill_chunk_tokens": 512, "batch_size": 1, "attn_impl": "sdpa", "seed": 0}
    for bad in (0, -3, "8", True):
        with pytest.raises(ConfigError, match="runner.decode_interval_tokens="):
            RunnerSettings.of({**runner, "decode_interval_tokens": bad})
    RunnerSettings.of({**runner, "decode_interval_tokens": None})


def test_settings_differing_only_in_the_interval_share_a_prefill(tmp_path):
    """A knob read after the prompt only: one prefill, each setting its own protocol after the
    hand-over (a restored layer keeps its engine's protocol), each equal to its single run."""
    need_shared(STORIES)
    settings = [[*TASK, "method=snapkv", "method.budget_tokens=24", "method.window_tokens=4",
                 f"runner.decode_interval_tokens={n}"] for n in ("null", 3)]
    swept = assert_equal_to_single_runs(settings, tmp_path)
    metrics = [json.loads((f / "metrics.json").read_text()) for f in swept]
    assert [m["run"]["sweep"]["prefill_shared_with"] for m in metrics] == [1, 1]
    assert [m["protocol"]["decode_interval_tokens"] for m in metrics] == [None, 3]
    assert metrics[0]["run"]["config_hash"] != metrics[1]["run"]["config_hash"]
    assert metrics[0]["kv"] != metrics[1]["kv"]
