"""harness.config.config_check: keys added with `+` checked against the config schema (with the closest
allowed name in Hydra's own hint too), finite numbers, and no "quote it" hint for a null."""

import pytest

from tests.helpers.runs import ST, cfg_for, refused


@pytest.mark.usefixtures("shared_folder")
@pytest.mark.parametrize("override, expect", [
    ("+runner.foo=1", "runner.foo is not a key of runner=default"),
    ("+runner.foo=null", "runner.foo is not a key of runner=default"),
    ("++runner.foo=1", "runner.foo is not a key of runner=default"),
    ("++runner.batchsize=2", "the closest allowed name is runner.batch_size"),
    ("+model.foo=1", "model.foo is not a key of model=stories260k"),
    ("+model.pth=/x", "the closest allowed name is model.path"),
    ("+foo=1", "foo is not a config group"),
    ("+hardware.foo=1", "hardware.foo is not a key of hardware=none"),
    ("+logger.foo=1", "logger.foo is not a key of logger=none"),
    ("+method.foo=null", "method.foo is not a hyperparameter of method=full"),
])
def test_added_keys_are_checked_against_the_schema(override, expect, tmp_path, no_weight_loading):
    assert expect in refused(tmp_path, *ST, override)


def test_hydras_struct_hint_names_the_closest_key_not_plus():
    from harness.__main__ import one_line

    with pytest.raises(Exception) as err:
        cfg_for("runner.batchsize=2")
    line = one_line(err.value)
    assert "the closest allowed name is runner.batch_size" in line and "+runner" not in line


@pytest.mark.usefixtures("shared_folder")
@pytest.mark.parametrize("overrides, expect", [
    (["method=infinigen", "method.alpha=nan"], "method.alpha=nan must be a finite number"),
    (["method=infinigen", "method.alpha=inf"], "method.alpha=inf must be a finite number"),
    (["method=razor_attention", "method.compression_ratio=inf"], "method.compression_ratio=inf"),
    (["runner.kv_layout=paged", "runner.kv_device_limit_mib=nan"],
     "runner.kv_device_limit_mib=nan must be a finite number"),
    (["task=ruler", "runner.kv_layout=paged", "runner.kv_device_limit_mib=inf"],
     "runner.kv_device_limit_mib=inf must be a finite number"),
    (["hardware=h200_sxm", "hardware.link_gb_per_s=nan"], "hardware.link_gb_per_s=nan"),
    (["hardware=h200_sxm", "hardware.link_gb_per_s=-1"], "hardware.link_gb_per_s=-1 must be > 0"),
    (["hardware=pcie4_a100", "hardware.device_memory_gib=0"], "device_memory_gib=0 must be > 0"),
])
def test_non_finite_numbers_are_refused(overrides, expect, tmp_path, no_weight_loading):
    base = ST if "task=ruler" not in overrides else ["model=stories260k"]
    assert expect in refused(tmp_path, *base, *overrides)


def test_null_for_a_text_key_of_a_yaml_group_is_not_told_to_quote(tmp_path, no_weight_loading):
    message = refused(tmp_path, *ST, "runner.attn_impl=null")
    assert "quote it" not in message
