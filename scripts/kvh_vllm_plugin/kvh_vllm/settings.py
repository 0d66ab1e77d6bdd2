"""The knobs the worker hands the plugin, read from the environment the engine core inherits:
`KVH_VLLM_METHOD` (unset or empty: the plugin does nothing) and `KVH_VLLM_QUEST` (JSON of Quest's
knobs). No vLLM import: the harness's tests read it too."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

METHOD_ENV = "KVH_VLLM_METHOD"
QUEST_ENV = "KVH_VLLM_QUEST"
METHODS = ("quest",)


@dataclass(frozen=True)
class QuestSettings:
    """What the plugin's Quest implements: the harness's default Quest (select_per=query_head,
    current_page=scored, group_reduce=max), with these knobs free."""

    budget_ratio: float | None = 0.2  # of the prompt's length (runner.budget_basis=final)
    budget_tokens: int | None = None  # takes precedence over budget_ratio
    page_size: int = 16  # tokens per page (a logical span of the request, not a vLLM block)
    min_pages: int = 3  # pages per head at least (the official rule)
    dense_layers: tuple[int, ...] = field(default=(0, 1))  # layers attended in full


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def quest_settings(text: str) -> QuestSettings:
    """`KVH_VLLM_QUEST`'s JSON, checked; ValueError naming the key and what is allowed."""
    given = json.loads(text or "{}")
    allowed = QuestSettings.__dataclass_fields__
    for key in given:
        if key not in allowed:
            raise ValueError(f"{QUEST_ENV}: {key} is not a knob of the plugin's Quest; allowed: "
                             f"{', '.join(allowed)}")
    s = QuestSettings(**{**given, "dense_layers": tuple(given.get("dense_layers", (0, 1)))})
    if s.budget_tokens is not None and not _positive_int(s.budget_tokens):
        raise ValueError(f"{QUEST_ENV}: budget_tokens={s.budget_tokens!r} must be a positive "
                         "integer or null")
    if s.budget_tokens is None and not (isinstance(s.budget_ratio, (int, float))
                                        and not isinstance(s.budget_ratio, bool)
                                        and 0 < s.budget_ratio <= 1):
        raise ValueError(f"{QUEST_ENV}: budget_ratio={s.budget_ratio!r} must be in (0, 1] "
                         "(or set budget_tokens)")
    for key in ("page_size", "min_pages"):
        if not _positive_int(getattr(s, key)):
            raise ValueError(f"{QUEST_ENV}: {key}={getattr(s, key)!r} must be a positive integer")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
               for i in s.dense_layers):
        raise ValueError(f"{QUEST_ENV}: dense_layers={list(s.dense_layers)!r} must be layer "
                         "indices >= 0")
    return s


def requested_method() -> str | None:
    """The method the worker asked for (None: none, vLLM's own attention untouched)."""
    method = os.environ.get(METHOD_ENV, "").strip()
    if not method:
        return None
    if method not in METHODS:
        raise ValueError(f"{METHOD_ENV}={method!r}; allowed: {', '.join(METHODS)} (or unset)")
    return method


def layer_index(layer_name: str) -> int:
    """The decoder layer of an attention module's name (`model.layers.7.self_attn.attn` -> 7)."""
    found = re.findall(r"\.(\d+)\.", f".{layer_name}.")
    if len(found) != 1:
        raise ValueError(f"cannot read one layer index from the attention layer {layer_name!r}")
    return int(found[0])
