"""The config's schema: which keys each group declares, and the value checks every group shares.

Checked before anything loads (`check_config`), whatever way a key arrived (`group.key=`, `+`,
`++`, an experiment file):

* **Declared keys.** A method's keys are its dataclass fields (plus the shared sweep knobs and
  `name`), a task's its dataclass fields; `runner`, `model`, `logger` and `hardware` declare theirs
  in their YAML (`conf/<group>/<choice>.yaml`), so a knob added there is known at once. The top
  level holds the config groups only. An unknown key is refused in one line naming the key and
  the closest declared name (Hydra's own "not in struct" message suggests the `+key` form, which
  would add a key nothing reads: `struct_hint` replaces it).
* **Finite numbers.** No value anywhere may be NaN or infinite (a knob that compares, scales or
  sizes with it would run and report a result that means nothing).
* **Hardware profiles** hold rates and sizes: each number > 0.
* **Types from the declared defaults** (YAML groups; methods and tasks are typed from their
  annotations, kvcore.typecheck): a knob declared `true` takes a boolean, `16` an integer, `50.0`
  a number, `results` a string. Knobs declared `null` are checked where they are used.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness import CONF_DIR
from kvcore.errors import ConfigError
from kvcore.typecheck import describe

CONF = CONF_DIR
YAML_GROUPS = ("runner", "model", "logger", "hardware")
CLASS_GROUPS = ("method", "task")
GROUPS = (*CLASS_GROUPS, *YAML_GROUPS)
TOP_LEVEL = (*GROUPS, "hydra")


# Options added after runs were made, at the value that computes exactly what runs made before
# they existed computed: left out of a run's identity at that value (harness.config.multirun.config_hash),
# so a resumed sweep (runner.skip_existing) still finds those runs, and out of the report's
# columns (a run recording `skip_samples=0` and one made before it are one column). Any other
# value is part of the identity.
NEUTRAL = {"runner": {"kv_device_limit_mib": None, "kv_admission": "request",
                      "decode_interval_tokens": None},
           "task": {"query": "aware", "prefill_tokens": None, "skip_samples": 0,
                    "fidelity_tokens": 0}}


def without_neutral(group: str, section: dict[str, Any]) -> dict[str, Any]:
    """`section` (a group's options) less the NEUTRAL options at their neutral value."""
    neutral = NEUTRAL.get(group, {})
    return {k: v for k, v in section.items() if not (k in neutral and v == neutral[k])}


def group_options(group: str, conf=CONF) -> list[str]:
    """The choices of a config group: its YAML files, less the `_`-prefixed fragments."""
    return sorted(p.stem for p in (conf / group).glob("*.yaml") if not p.stem.startswith("_"))


def closest(name: str, allowed: list[str] | tuple[str, ...]) -> str | None:
    """The allowed name nearest to `name` (None when nothing is near)."""
    near = difflib.get_close_matches(name, list(allowed), n=1, cutoff=0.5)
    return near[0] if near else None


def yaml_defaults(group: str, choice: str) -> dict[str, Any]:
    """The keys (and default values) `conf/<group>/<choice>.yaml` declares."""
    path = CONF / group / f"{choice}.yaml"
    if not path.is_file():
        return {}
    node = OmegaConf.load(path)
    plain = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else {}
    plain.pop("defaults", None)
    return plain


def declared_keys(group: str, choice: str | None, name: str | None = None) -> list[str] | None:
    """Every key `group` may hold for this choice; None when the choice is unknown (Hydra or the
    group's builder refuses it with its own message)."""
    if group == "method":
        from methods import SHARED_KNOBS, available_methods, method_class

        if name not in available_methods():
            return None
        return ["name", *method_class(name).hyperparameter_names(),
                *(k for k in SHARED_KNOBS if k not in method_class(name).hyperparameter_names())]
    if group == "task":
        from tasks import available_tasks, task_class

        return ["name", *task_class(name).option_names()] if name in available_tasks() else None
    if choice is None:
        return None
    keys = list(yaml_defaults(group, choice))
    return keys or None


def _choice(group: str, node: dict[str, Any]) -> str | None:
    """The group's chosen YAML: Hydra's record of it, else the one its `name` names, else the
    group's only option."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            choice = HydraConfig.get().runtime.choices.get(group)
            if choice:
                return str(choice)
    except Exception:  # noqa: BLE001 - composed outside the CLI (tests)
        pass
    name = node.get("name")
    if isinstance(name, str) and (CONF / group / f"{name}.yaml").is_file():
        return name
    found = group_options(group)
    return found[0] if len(found) == 1 else None


def unknown_key_message(group: str | None, key: str, allowed: list[str],
                        choice: str | None = None, added: bool = True) -> str:
    """One line: the key, what it is not, the closest declared name and the declared names."""
    near = closest(key, allowed)
    if group is None:
        what = f"{key} is not a config group"
    else:
        kind = {"method": "a hyperparameter", "task": "an option"}.get(group, "a key")
        what = f"{group}.{key} is not {kind} of {group}" + (f"={choice}" if choice else "")
    plus = " (a key added with '+' or '++' is checked like any other)" if added else ""
    hint = f"; the closest allowed name is {group + '.' if group else ''}{near}" if near else ""
    return f"{what}{plus}{hint}; allowed: {', '.join(allowed)}"


def check_keys(plain: dict[str, Any]) -> None:
    """Every top-level key is a config group; every group key is declared (module docstring)."""
    for key in plain:
        if key not in TOP_LEVEL:
            raise ConfigError(unknown_key_message(None, key, list(GROUPS)))
    for group in GROUPS:
        node = plain.get(group)
        if not isinstance(node, dict):
            continue
        name = node.get("name")
        choice = _choice(group, node) if group in YAML_GROUPS else None
        allowed = declared_keys(group, choice, name if isinstance(name, str) else None)
        if allowed is None:
            continue
        label = str(name) if group in CLASS_GROUPS else choice
        for key in node:
            if key not in allowed:
                raise ConfigError(unknown_key_message(group, key, allowed, label))


def check_finite(node: Any, prefix: str) -> None:
    """No NaN or infinity anywhere under `node` (a mapping or list of config values)."""
    if isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"{prefix}={node!r} must be a finite number (NaN and infinity mean "
                          "nothing as a knob)")
    if isinstance(node, dict):
        for key, value in node.items():
            check_finite(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            check_finite(value, f"{prefix}[{i}]")


def _declared_type(default: Any) -> type | None:
    if isinstance(default, bool):
        return bool
    for tp in (int, float, str, list, dict):
        if isinstance(default, tp):
            return tp
    return None  # null: typed where it is used


def check_declared_types(group: str, node: dict[str, Any], choice: str | None) -> None:
    """A YAML group's values have the type of their declared default (module docstring)."""
    if choice is None:
        return
    for key, default in yaml_defaults(group, choice).items():
        tp, value = _declared_type(default), node.get(key)
        if tp is None or value is None and default is None or key not in node:
            continue
        ok = (isinstance(value, bool) if tp is bool else
              isinstance(value, (int, float)) and not isinstance(value, bool) if tp is float else
              isinstance(value, int) and not isinstance(value, bool) if tp is int else
              isinstance(value, tp))
        if not ok:
            quote = (f" (quote it: {group}.{key}='{value}')" if tp is str
                     and isinstance(value, (int, float)) else
                     " (null is not one of its values)" if value is None else "")
            raise ConfigError(f"{group}.{key}={value!r} must be {describe(tp)}{quote}")


def check_config(cfg: DictConfig | dict[str, Any]) -> None:
    """The checks of the module docstring, on the composed config (before anything loads)."""
    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    plain.pop("hydra", None)
    check_keys(plain)
    for group in GROUPS:
        if isinstance(plain.get(group), dict):
            check_finite(plain[group], group)
    for group in YAML_GROUPS:
        node = plain.get(group)
        if isinstance(node, dict):
            check_declared_types(group, node, _choice(group, node))
    for key, value in (plain.get("hardware") or {}).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
            raise ConfigError(f"hardware.{key}={value} must be > 0 (a hardware profile's numbers "
                              "are rates and sizes)")


# --- Hydra's own messages ------------------------------------------------------------------

_STRUCT = re.compile(r"Could not (?:override|append to config) '([\w.]+)'")


def struct_hint(message: str, argv: list[str] | None = None) -> str | None:
    """For Hydra's "Key 'x' is not in struct" (a misspelled `group.key=`), our one line: the key,
    the closest declared name of the group (for the choice on the command line, else over all its
    options) — never Hydra's suggestion to add the key with '+', which nothing would read."""
    found = _STRUCT.search(message)
    if not found or "not in struct" not in message:
        return None
    dotted = found.group(1)
    group, _, key = dotted.partition(".")
    if group not in GROUPS or not key or "." in key:
        return None
    given = _argv_choice(group, argv or [])
    choices = [c for c in (given or "").split(",") if c in group_options(group)]
    for choice in choices:  # the (first) chosen option lacking the key: its own declared keys
        allowed = allowed_any(group, choice)
        if allowed and key not in allowed:
            return unknown_key_message(group, key, allowed, choice, added=False)
    allowed = allowed_any(group, None)
    return unknown_key_message(group, key, allowed, added=False) if allowed else None


def _argv_choice(group: str, argv: list[str]) -> str | None:
    for arg in reversed(argv):
        if arg.startswith(f"{group}="):
            return arg.split("=", 1)[1]
    default = yaml_defaults_list().get(group)
    return default


def yaml_defaults_list() -> dict[str, str]:
    """conf/config.yaml's default choice per group."""
    node = OmegaConf.load(CONF / "config.yaml")
    out = {}
    for item in node.get("defaults", []):
        if isinstance(item, DictConfig):
            for k, v in item.items():
                if isinstance(v, str) and "/" not in str(k) and not str(k).startswith("override"):
                    out[str(k)] = v
    return out


def allowed_any(group: str, choice: str | None) -> list[str]:
    """Declared keys for `choice`, or the union over the group's options."""
    choices = [choice] if choice in group_options(group) else group_options(group)
    keys: list[str] = []
    for c in choices:
        for key in declared_keys(group, c, c) or []:
            if key not in keys:
                keys.append(key)
    return keys
