"""Type checks of user-given options against a dataclass's annotations (methods' hyperparameters,
tasks' options): one line naming `<prefix>.<key>`, the value and the expected type.

Values arrive from Hydra's override grammar (`128.0` is a float, `true` a bool, `abc` a string),
from YAML or from lm-eval's `--model_args`. The rules are strict where a lenient reading would
record a knob that was not used: a bool is never an int, a float is never an int (even `128.0`),
a string is never a number; an int is accepted where a float is expected; a float is finite
(NaN and infinity are refused for every float knob). A choice knob (`Literal[...]`) takes one of
its values, of the same type (`4.0` is not the choice `4`), and a refusal lists them
(`method.k_bits=3; allowed: 2, 4, 8`).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Union

from kvcore.errors import ConfigError


def _args(tp: Any) -> tuple[Any, ...]:
    return typing.get_args(tp)


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def matches(value: Any, tp: Any) -> bool:
    """Whether `value` is acceptable for the annotation `tp` (see the module rules)."""
    if tp is Any or tp is object:
        return True
    if tp is type(None) or tp is None:
        return value is None
    if _is_union(tp):
        return any(matches(value, t) for t in _args(tp))
    origin = typing.get_origin(tp)
    if origin is typing.Literal:  # the same type too: 4.0 or True is not the choice 4 or 1
        return any(value == a and type(value) is type(a) for a in _args(tp))
    if origin in (list, tuple, typing.Sequence, set, frozenset):
        if not isinstance(value, (list, tuple)):
            return False
        inner = _args(tp)
        if origin is tuple and len(inner) == 2 and inner[1] is Ellipsis:
            inner = inner[:1]
        elif origin is tuple and inner:  # fixed-length tuple
            return len(value) == len(inner) and all(matches(v, t) for v, t in zip(value, inner))
        return not inner or all(matches(v, inner[0]) for v in value)
    if origin is dict:
        if not isinstance(value, dict):
            return False
        kt, vt = _args(tp) or (Any, Any)
        return all(matches(k, kt) and matches(v, vt) for k, v in value.items())
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:  # finite: NaN or infinity as a knob runs and reports a meaningless result
        return isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True  # an annotation we cannot check (a forward reference): not ours to refuse


def describe(tp: Any) -> str:
    """Plain words for an annotation: 'an integer or null', 'a list of integers'."""
    if _is_union(tp):
        parts = [t for t in _args(tp) if t is not type(None)]
        text = " or ".join(describe(t) for t in parts)
        return text + (" or null" if len(parts) < len(_args(tp)) else "")
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in _args(tp))
    if origin in (list, tuple, typing.Sequence, set, frozenset):
        inner = [a for a in _args(tp) if a is not Ellipsis]
        return "a list" + (f" of {_plural(inner[0])}" if inner and inner[0] is not Any else "")
    if origin is dict:
        return "a mapping"
    return {bool: "a boolean (true or false)", int: "an integer", float: "a number",
            str: "a string"}.get(tp, f"a {getattr(tp, '__name__', tp)}")


def _plural(tp: Any) -> str:
    return {bool: "booleans", int: "integers", float: "numbers", str: "strings"}.get(
        tp, describe(tp))


def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of a dataclass's (init) fields."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}


def check_types(cls: type, values: dict[str, Any], prefix: str) -> None:
    """Raise ConfigError for the first value that does not match its field's annotation."""
    types_ = field_types(cls)
    for key, value in values.items():
        tp = types_.get(key)
        if tp is None or matches(value, tp):
            continue
        choices = _choices(tp)
        if choices:
            raise ConfigError(f"{prefix}.{key}={value!r}{_choice_hint(value)}; allowed: "
                              + ", ".join(choices))
        hint = ""
        if isinstance(value, float) and not math.isfinite(value) and _wants(tp, float):
            raise ConfigError(f"{prefix}.{key}={value!r} must be a finite number")
        if isinstance(value, str) and _wants_number(tp):
            hint = " (got a string)"
        elif isinstance(value, bool):
            hint = " (got a boolean)"
        elif isinstance(value, float) and _wants(tp, int):
            hint = " (got a float; write it without a decimal point)"
        elif value is None and _wants(tp, str):
            hint = f" (null is not one of its values){_allowed(cls, values, key, prefix)}"
        elif isinstance(value, (list, tuple, dict)) and _wants(tp, str):
            kind = "list" if isinstance(value, (list, tuple)) else "mapping"
            hint = f" (got a {kind}; give one value){_allowed(cls, values, key, prefix)}"
        elif not isinstance(value, str) and _wants(tp, str):
            hint = f" (quote it: {prefix}.{key}='{value}')"
        raise ConfigError(f"{prefix}.{key}={value!r} must be {describe(tp)}{hint}")


def _choices(tp: Any) -> list[str]:
    """The values a `Literal` annotation allows, as a user writes them (null too where the
    annotation also allows None); empty for any other annotation."""
    parts = _args(tp) if _is_union(tp) else (tp,)
    literals = [a for t in parts if typing.get_origin(t) is typing.Literal for a in _args(t)]
    if not literals:
        return []
    return [str(a) for a in literals] + (["null"] if type(None) in parts else [])


def _choice_hint(value: Any) -> str:
    """Why a value of the wrong kind is none of a choice knob's values."""
    if value is None:
        return " (null is not one of its values)"
    if isinstance(value, (list, tuple, dict)):
        return f" (got a {'mapping' if isinstance(value, dict) else 'list'}; give one value)"
    if isinstance(value, bool):
        return " (got a boolean)"
    if isinstance(value, float) and value.is_integer():
        return " (got a float; write it without a decimal point)"
    return ""


def _allowed(cls: type, values: dict[str, Any], key: str, prefix: str) -> str:
    """'; allowed: ...' as the class's own check lists it for a text knob (its refusal of a
    value it cannot take), or ''."""
    try:
        cls(**{**values, key: "\x00?"})
    except ConfigError as exc:
        text = str(exc)
        if text.startswith(f"{prefix}.{key}=") and "allowed: " in text:
            return "; allowed: " + text.split("allowed: ", 1)[1]
    except Exception:  # noqa: BLE001 - another knob's trouble: no hint
        pass
    return ""


def _wants(tp: Any, base: type) -> bool:
    return tp is base or (_is_union(tp) and any(_wants(t, base) for t in _args(tp)))


def _wants_number(tp: Any) -> bool:
    return _wants(tp, int) or _wants(tp, float)
