"""Full cache: every token's K/V kept, attention unchanged. The baseline every method is judged by.

Its logits equal a plain transformers forward (tests/methods/test_full.py); it has no
hyperparameters and no budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvcore.storage import KV_LAYOUTS
from methods.base import Capabilities, KVMethod


@dataclass(kw_only=True)
class Full(KVMethod):
    """Keep everything (no compression). Any batch size."""

    name: ClassVar[str] = "full"
    axis_keys: ClassVar[tuple[str, ...]] = ()  # a reference: no size knob
    capabilities: ClassVar[Capabilities] = Capabilities(compresses=False, kv_layouts=KV_LAYOUTS)
