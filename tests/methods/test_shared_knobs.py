"""Knobs every method shares by name (methods/base.py: seeds, position-counting knobs) are
checked once for all methods, and the knob classes of a few methods beyond them (KVzip's
calibration context, Expected Attention's sinks): each refused in one line naming the key."""

import dataclasses

import pytest

from kvcore.errors import ConfigError
from methods import available_methods, build_method, method_class
from methods.base import POSITION_KNOBS, SEED_MAX
from methods.model import ModelInfo
from tests.helpers.validation import INFO, one_reason


def knobs_named(test) -> list[tuple[str, str]]:
    return [(name, f.name) for name in available_methods()
            for f in dataclasses.fields(method_class(name)) if test(f.name)]


SEEDS = knobs_named(lambda k: k == "seed" or k.endswith("_seed"))
POSITIONS = knobs_named(lambda k: k in POSITION_KNOBS)


def test_the_shared_knobs_exist():
    """The classes are real: turboquant's seed, the head probes' seeds, sinks and windows."""
    assert ("turboquant", "seed") in SEEDS and ("expected_attention", "future_tokens") in POSITIONS
    assert len(POSITIONS) > 10


@pytest.mark.parametrize("name, knob", SEEDS)
@pytest.mark.parametrize("value", [2 ** 70, SEED_MAX + 1, -1])
def test_a_seed_beyond_64_bits_is_refused_when_built(name, knob, value):
    with pytest.raises(ConfigError) as err:
        build_method(name, **{knob: value})
    assert str(err.value).startswith(f"method.{knob}={value} must be an integer in 0..2**63-1")


@pytest.mark.parametrize("name, knob", SEEDS)
def test_the_largest_seed_is_taken(name, knob):
    assert getattr(build_method(name, **{knob: SEED_MAX}), knob) == SEED_MAX


@pytest.mark.parametrize("name, knob", POSITIONS)
def test_a_position_knob_beyond_the_models_positions_is_refused(name, knob):
    """10**9 future positions (a rotation table of that size), sinks or windows no sequence of
    the model can reach: refused by validate, before weights."""
    small = dataclasses.replace(INFO, max_positions=64)
    try:
        method = build_method(name, **{knob: 10 ** 9})
    except ConfigError as err:  # refused by the method's own checks already, naming the knob
        assert f"method.{knob}" in str(err) or "budget" in str(err)
        return
    assert f"method.{knob}=1000000000 is beyond the model's 64 positions" in one_reason(method,
                                                                                       small)


def test_a_model_without_declared_positions_bounds_nothing():
    method = build_method("expected_attention", future_tokens=4096)
    unbounded = dataclasses.replace(INFO, max_positions=0)
    assert not any("positions" in r for r in method.validate(unbounded, {"batch_size": 1}))


@pytest.mark.parametrize("tokens", [0, 1])
def test_kvzip_head_level_needs_a_calibration_context_it_can_evict_from(tokens):
    with pytest.raises(ConfigError, match=f"method.calibration_tokens={tokens} must be an integer "
                                          ">= 2"):
        build_method("kvzip", level="head", calibration_tokens=tokens)


def test_kvzip_head_level_on_a_model_too_short_to_calibrate_is_refused():
    short = ModelInfo(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_positions=66,
                      rope_theta=10000.0)
    reason = one_reason(build_method("kvzip", level="head", budget_ratio=0.5), short)
    assert "leave room for 1 token(s)" in reason and "head_scores_path" in reason


@pytest.mark.parametrize("sinks, budget", [(9, 8), (100, 8)])
def test_expected_attention_sinks_must_fit_the_budget(sinks, budget):
    with pytest.raises(ConfigError, match=f"method.sink_tokens={sinks} must be at most "
                                          f"method.budget_tokens={budget}"):
        build_method("expected_attention", sink_tokens=sinks, budget_tokens=budget)
    assert build_method("expected_attention", sink_tokens=budget, budget_tokens=budget)


def test_expected_attention_on_a_prompt_of_sinks_only_names_the_knob():
    """A prompt no longer than the sinks leaves no query to take statistics of: one line naming
    method.sink_tokens and the prompt's length (it was a bare RuntimeError)."""
    import torch

    d = 4
    info = ModelInfo(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=d, max_positions=64,
                     rope_theta=10.0)
    method = build_method("expected_attention", budget_tokens=30, sink_tokens=20)
    method._inv_freq = 1.0 / 10.0 ** (torch.arange(0, d, 2).float() / d)
    layer = method.make_layer(0, info)
    layer.prompt_open = True
    q, k, v = torch.randn(1, 2, 12, d), torch.randn(1, 1, 12, d), torch.randn(1, 1, 12, d)
    layer.update(k, v, None)
    layer.attend(None, q, k, v, None, lambda *a, **kw: (None, None))
    with pytest.raises(ConfigError, match="method.sink_tokens=20 covers the whole prompt of 12 "
                                          "tokens"):
        layer.score()
