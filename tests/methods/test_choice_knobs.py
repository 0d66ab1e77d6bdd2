"""Choice knobs (a value out of a few strings or numbers) are typed `Literal[...]` in the method
dataclasses (switches `bool`) and refused by the shared type checker (kvcore.typecheck), for every
method alike, with no check of their own in a method: a value outside the choices, planted
through a composed run as a user's override arrives, is one line naming `method.<key>` and the
allowed values, before any weights load."""

import typing

import pytest

from kvcore.errors import ConfigError
from kvcore.typecheck import field_types
from methods import available_methods, build_method, method_class
from tests.conftest import STORIES, need_shared
from tests.helpers.runs import ST, refused


def choice_knobs() -> list[tuple[str, str, tuple]]:
    """(method, knob, allowed values) for every Literal-typed knob of every method."""
    found = []
    for name in available_methods():
        for key, tp in field_types(method_class(name)).items():
            if typing.get_origin(tp) is typing.Literal:
                found.append((name, key, typing.get_args(tp)))
    return found


CHOICES = choice_knobs()


def test_the_choice_knobs_are_typed():
    """The knobs that were checked by hand in each method's check_hyperparameters."""
    typed = {(name, key) for name, key, _ in CHOICES}
    expected = {("infinigen", k) for k in (
        "eviction", "mode", "partial_index", "column_score", "group_reduce", "speculation_input",
        "skew_per", "select_per", "current_token", "zero_count")}
    expected |= {("kivi", "k_bits"), ("kivi", "v_bits"), ("kvquant", "k_bits"),
                 ("kvquant", "v_bits"), ("tailorkv", "k_bits"), ("tailorkv", "v_bits"),
                 ("kvzip", "level"), ("kvzip", "system_prompt"), ("quest", "select_per"),
                 ("quest", "current_page"), ("quest", "group_reduce"), ("snapkv", "pooling"),
                 ("squeezeattention", "scorer"), ("turboquant", "k_quantizer")}
    assert expected <= typed, sorted(expected - typed)


def _outside(allowed: tuple) -> object:
    """A value of the same kind that is none of the choices."""
    if all(isinstance(a, str) for a in allowed):
        return "nosuch"
    return max(allowed) + 1


@pytest.mark.usefixtures("no_weight_loading")
@pytest.mark.parametrize("name, key, allowed", CHOICES, ids=[f"{n}.{k}" for n, k, _ in CHOICES])
def test_a_value_outside_the_choices_is_one_line_listing_them(name, key, allowed, tmp_path):
    need_shared(STORIES)
    bad = _outside(allowed)
    assert bad not in allowed
    message = refused(tmp_path, *ST, f"method={name}", f"method.{key}={bad}")
    listed = ", ".join(map(str, allowed))
    assert message == f"method.{key}={bad!r}; allowed: {listed}"


@pytest.mark.parametrize("name, hyper, message", [
    ("kivi", {"k_bits": 3}, "method.k_bits=3; allowed: 2, 4, 8"),
    ("kvquant", {"v_bits": 8}, "method.v_bits=8; allowed: 2, 3, 4"),
    ("tailorkv", {"k_bits": 3}, "method.k_bits=3; allowed: 1, 2, 4, 8"),
    ("infinigen", {"mode": "fast"}, "method.mode='fast'; allowed: system, simulate"),
    ("kvzip", {"level": "token"}, "method.level='token'; allowed: pair, pair-uniform, head"),
    ("snapkv", {"pooling": "min"}, "method.pooling='min'; allowed: max, avg"),
    # the same type too: a float or a boolean equal to a choice is not that choice
    ("kivi", {"k_bits": 4.0},
     "method.k_bits=4.0 (got a float; write it without a decimal point); allowed: 2, 4, 8"),
    ("tailorkv", {"v_bits": True}, "method.v_bits=True (got a boolean); allowed: 1, 2, 4, 8"),
    ("quest", {"group_reduce": None},
     "method.group_reduce=None (null is not one of its values); allowed: max, sum"),
    ("turboquant", {"k_quantizer": ["prod"]},
     "method.k_quantizer=['prod'] (got a list; give one value); allowed: prod, mse"),
    # switches: the same checker, from their `bool` annotation
    ("full_offload", {"prefetch": "yes"}, "method.prefetch='yes' must be a boolean (true or false)"),
    ("infinigen", {"skewing": 1}, "method.skewing=1 must be a boolean (true or false)"),
])
def test_the_refusal_names_the_key_and_the_choices(name, hyper, message):
    with pytest.raises(ConfigError) as err:
        build_method(name, **hyper)
    assert str(err.value) == message


def test_every_choice_is_accepted():
    for name, key, allowed in CHOICES:
        for value in allowed:
            try:
                build_method(name, **{key: value})
            except ConfigError as exc:  # another knob's rule may tie this value to others
                assert not str(exc).startswith(f"method.{key}={value!r};"), exc
