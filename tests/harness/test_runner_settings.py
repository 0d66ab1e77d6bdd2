"""harness.config.runner.RunnerSettings: the runner's settings as one typed, frozen dataclass, built and
checked once from the config before weights load. Its fields are conf/runner's keys (in their
order, with their defaults), its choice knobs the values the code allows, and `as_dict()` the
mapping the composed config holds, so what is recorded or grouped from it does not change."""

import dataclasses
import json
import typing

import pytest

from harness.config.config_check import group_options, yaml_defaults
from harness.config.runner import RunnerSettings, plain
from harness.core.serving import ADMISSIONS
from harness.session import compose
from kvcore.errors import ConfigError
from kvcore.storage import KV_LAYOUTS
from kvcore.typecheck import field_types
from methods.protocol import BUDGET_BASES, PREFILL_MODES
from tests.conftest import STORIES, need_shared
from tests.helpers.runs import ST, cfg_for, refused

FIELDS = [f.name for f in dataclasses.fields(RunnerSettings)]


@pytest.mark.parametrize("choice", group_options("runner"))
def test_every_runner_key_has_a_field_and_every_field_a_key(choice):
    declared = yaml_defaults("runner", choice)
    assert list(declared) == FIELDS  # the same keys, in the YAML's order (as_dict's order)
    defaults = RunnerSettings().as_dict()
    assert {k: defaults[k] for k in declared} == declared  # each default the YAML's


def test_the_choice_knobs_allow_what_their_modules_check():
    literal = {k: typing.get_args(tp) for k, tp in field_types(RunnerSettings).items()
               if typing.get_origin(tp) is typing.Literal}
    assert literal == {"attn_impl": ("sdpa", "eager"), "kv_offload": ("none", "cpu"),
                       "kv_layout": KV_LAYOUTS, "kv_admission": ADMISSIONS,
                       "prefill": PREFILL_MODES, "budget_basis": BUDGET_BASES}


def test_the_settings_are_frozen():
    runner = RunnerSettings.of({"dense_layers": [0, 1]})
    with pytest.raises(dataclasses.FrozenInstanceError):
        runner.batch_size = 2  # type: ignore[misc]
    assert runner.dense_layers == (0, 1)  # a tuple: nothing inside changes either
    assert hash(runner) == hash(RunnerSettings(dense_layers=(0, 1)))


def test_an_unknown_key_is_one_line_naming_it_and_the_allowed_keys():
    with pytest.raises(ConfigError) as err:
        RunnerSettings.of({"batch_size": 2, "chunk_tokens": 64})
    message = str(err.value)
    assert "\n" not in message
    assert message == ("runner.chunk_tokens is not a runner key; the closest allowed name is "
                       f"runner.prefill_chunk_tokens; allowed: {', '.join(FIELDS)}")


@pytest.mark.parametrize("knobs, message", [
    ({"attn_impl": "flash"}, "runner.attn_impl='flash'; allowed: sdpa, eager"),
    ({"prefill": "half"}, "runner.prefill='half'; allowed: dense, chunked, sparse"),
    ({"kv_layout": 1}, "runner.kv_layout=1; allowed: contiguous, paged"),
    ({"batch_size": "2"}, "runner.batch_size='2' must be an integer (got a string)"),
    ({"debug": "yes"}, "runner.debug='yes' must be a boolean (true or false)"),
    ({"threads": 1.5}, "runner.threads=1.5 must be an integer or null (got a float; write it "
                       "without a decimal point)"),
    ({"dense_layers": [0, "1"]}, "runner.dense_layers=[0, '1'] must be a list of integers"),
    ({"results_root": None}, "runner.results_root=None must be a string (null is not one of "
                             "its values)"),
    ({"prefill_chunk_tokens": 0}, "runner.prefill_chunk_tokens=0 must be a positive integer"),
    ({"seed": 2**32}, "runner.seed=4294967296 must be an integer in [0, 2**32 - 1]"),
    ({"dense_layers": [-1]}, "runner.dense_layers=[-1] must be a list of layer indices >= 0 "
                             "(e.g. [0,1]) or []"),
    ({"kv_block_tokens": 8}, "runner.kv_block_tokens=8 applies to runner.kv_layout=paged only"),
    ({"batch_size": 2, "diagnostics": True}, "runner.batch_size=2 with runner.diagnostics"),
])
def test_a_bad_value_is_one_line_naming_the_key_and_what_is_allowed(knobs, message):
    with pytest.raises(ConfigError) as err:
        RunnerSettings.of(knobs)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(message), str(err.value)


def test_a_replaced_value_is_checked_too():
    with pytest.raises(ConfigError, match="runner.shards=0 must be a positive integer"):
        dataclasses.replace(RunnerSettings(), shards=0)


@pytest.mark.usefixtures("no_weight_loading")
def test_a_bad_runner_value_is_refused_before_weights_load(tmp_path):
    need_shared(STORIES)
    message = refused(tmp_path, *ST, "runner.kv_admission=vllm")
    assert message == "runner.kv_admission='vllm'; allowed: request, layerkv"


@pytest.mark.parametrize("overrides", [
    [], ["runner.dense_layers=[0,1]", "runner.kv_layout=paged", "runner.kv_device_limit_mib=64",
         "runner.kv_admission=layerkv", "runner.threads=1", "runner.decode_interval_tokens=8"],
])
def test_as_dict_is_the_composed_runner_byte_for_byte(overrides):
    """What records or groups the runner (the sweep's keys, vllm's check) reads `as_dict()`:
    the composed config's runner section exactly, key order and value types included."""
    cfg = cfg_for(*ST, *overrides)
    setting = compose(cfg)
    assert isinstance(setting.runner, RunnerSettings)
    composed = plain(cfg.runner)
    assert json.dumps(setting.runner.as_dict()) == json.dumps(composed)
    assert RunnerSettings.of(composed) == setting.runner
