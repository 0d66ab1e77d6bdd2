"""KV-cache methods: one file per method, `methods/<name>.py` <-> `conf/method/<name>.yaml`.

`build_method(name, **hyperparameters)` finds the class by its `name` without any registry to edit:
adding a method means adding its file, its YAML and its test.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from kvcore.errors import ConfigError, UnsupportedCombination
from kvcore.typecheck import check_types
from methods.base import KVMethod
from methods.capabilities import Capabilities
from methods.layer import KVLayer

__all__ = ["Capabilities", "KVLayer", "KVMethod", "available_methods", "build_method", "method_class"]

SHARED_KNOBS = ("budget_ratio", "budget_tokens")  # declared for every method (conf/method/_shared.yaml)
# helper modules, not methods
_NOT_METHODS = {"base", "budget", "capabilities", "eviction", "kernels", "layer", "model", "protocol",
                "rope", "scoring", "selection"}


def available_methods() -> list[str]:
    """Names of every method module in this package (== conf/method/*.yaml)."""
    here = Path(__file__).parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)]) if m.name not in _NOT_METHODS
                  and not m.name.startswith("_"))


def method_class(name: str) -> type[KVMethod]:
    if name not in available_methods():
        raise ConfigError(f"method={name!r} is unknown; allowed: {', '.join(available_methods())}")
    module = importlib.import_module(f"methods.{name}")
    for obj in vars(module).values():
        if isinstance(obj, type) and issubclass(obj, KVMethod) and getattr(obj, "name", None) == name:
            return obj
    raise ConfigError(f"methods/{name}.py defines no KVMethod subclass with name = {name!r}")


def build_method(name: str, **hyperparameters) -> KVMethod:
    """Instantiate a method; unknown, mistyped or invalid hyperparameters raise ConfigError
    naming the key."""
    cls = method_class(name)
    allowed = cls.hyperparameter_names()
    # Shared sweep knobs (conf/method/_shared.yaml) arrive as null for methods without them.
    hyperparameters = {k: v for k, v in hyperparameters.items() if k in allowed or v is not None}
    unknown = sorted(set(hyperparameters) - set(allowed))
    if unknown and unknown[0] in SHARED_KNOBS:
        raise UnsupportedCombination(
            f"method={name} does not take method.{unknown[0]} (it has no such knob)")
    if unknown:
        raise ConfigError(
            f"method.{unknown[0]} is not a hyperparameter of method={name}; "
            f"allowed: {', '.join(allowed) or '(none)'}"
        )
    # Types first, for every method alike (from the dataclass annotations), so that a knob of the
    # wrong type is refused here instead of being recorded as if it had been used.
    check_types(cls, hyperparameters, "method")
    return cls(**hyperparameters)
