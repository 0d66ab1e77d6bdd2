"""kvcore.typecheck: a method's knobs checked from their dataclass annotations: non-finite floats
refused for every method, a text knob's refusal listing its allowed values."""

import pytest

from kvcore.errors import ConfigError
from methods import build_method


def test_every_float_knob_of_every_method_refuses_nan_and_inf():
    """From the dataclass annotations, for every method alike (lm-eval's model_args too)."""
    from kvcore.typecheck import _wants, field_types
    from methods import available_methods, build_method, method_class

    checked = 0
    for name in available_methods():
        for key, tp in field_types(method_class(name)).items():
            if not _wants(tp, float):
                continue
            for value in (float("nan"), float("inf"), float("-inf")):
                with pytest.raises(ConfigError, match=f"method.{key}=.* must be a finite number"):
                    build_method(name, **{key: value})
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize("value, got", [(None, "null is not one of its values"),
                                        (["max"], "got a list; give one value")])
def test_null_or_a_list_for_a_text_knob_lists_the_allowed_values(value, got):
    with pytest.raises(ConfigError) as err:
        build_method("quest", budget_tokens=64, group_reduce=value)
    assert got in str(err.value) and "allowed: max, sum" in str(err.value)
    assert "quote it" not in str(err.value)


def test_a_value_not_allowed_is_named_before_what_it_would_need():
    with pytest.raises(ConfigError, match=r"method.group_reduce='mean'; allowed: max, sum"):
        build_method("quest", budget_tokens=64, group_reduce="mean")
