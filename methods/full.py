"""Full cache: every token's K/V kept, attention unchanged. The baseline every method is judged by.

Its logits equal a plain transformers forward to fp32 rounding (tests/methods/test_full.py:
decode steps attend over the stored rows in place, `methods.layer.FullLayer`); it has no
hyperparameters and no budget. Under LayerKV admission (runner.kv_admission=layerkv) the serving
scheduler may place some of a request's layers whole on the host tier: those layers are
full_offload's (stored on the host, fetched whole every step), with the same outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kvcore.storage import KV_LAYOUTS
from methods.base import KVMethod
from methods.capabilities import Capabilities
from methods.full_offload import FullOffload, FullOffloadLayer
from methods.kernels import ragged_attention
from methods.layer import KVLayer
from methods.model import ModelInfo, PrepareContext
from methods.protocol import PREFILL_MODES


@dataclass(kw_only=True)
class Full(KVMethod):
    """Keep everything (no compression). Any batch size."""

    name: ClassVar[str] = "full"
    provenance: ClassVar[str] = "reference"
    family: ClassVar[str] = "reference"
    summary: ClassVar[str] = "every token's K/V kept, attention unchanged (the baseline)"
    paper_url: ClassVar[str | None] = None
    code_url: ClassVar[str | None] = None
    operating_point: ClassVar[str] = ("the full cache: every token kept, transformers' attention "
                                      "(decode rows read in place, to fp32 rounding)")
    axis_keys: ClassVar[tuple[str, ...]] = ()  # a reference: no size knob
    # its `prepare` records which decode-attention kernel the run uses.
    capabilities: ClassVar[Capabilities] = Capabilities(
        prefill_modes=PREFILL_MODES, compresses=False, kv_layouts=KV_LAYOUTS)

    def prepare(self, ctx: PrepareContext) -> dict[str, Any]:
        """Records which decode-attention implementation the run uses (its speed depends on it)."""
        return {"decode_attention": ragged_attention.decode_kernel_name(ctx.device)}

    def make_host_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return FullOffloadLayer(layer_idx, info, FullOffload(prefetch=True))
