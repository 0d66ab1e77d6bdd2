"""Full offload (FlexGen-style baseline): every token's K/V on the host, the whole layer fetched
to the compute device at every decode step.

Sheng et al., "FlexGen", ICML 2023, arXiv 2303.06865; InfiniGen's speed baseline (Fig. 14,
`--percent 100 0 0 100 100 0`: weights on the GPU, KV cache on the CPU, attention on the GPU).
The fetch of layer i is issued at layer i-1's attention input and runs on a side stream while
layer i-1 computes (FlexGen's overlap); `prefetch=false` fetches each layer only when it is
reached, which is InfiniGen's paper setting for this baseline (`--overlap false`). Attention is
exact: its logits equal the full cache's. Bytes moved per decode step = the whole KV.

Hyperparameters:
    prefetch: overlap the next layer's fetch with the current layer's compute (default true).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvcore.storage import KV_LAYOUTS
from methods.base import KVMethod
from methods.capabilities import Capabilities, ServingNeeds
from methods.layer import KVLayer, exact_attention
from methods.model import ModelInfo
from methods.protocol import PREFILL_MODES


@dataclass(kw_only=True)
class FullOffload(KVMethod):
    name: ClassVar[str] = "full_offload"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "offload"
    summary: ClassVar[str] = (
        "the whole cache on the host tier, each layer fetched one layer ahead at every decode step")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2303.06865"
    code_url: ClassVar[str | None] = "https://github.com/FMInference/FlexGen"
    operating_point: ClassVar[str] = (
        "FlexGen (FMInference/FlexLLMGen): OPT-30B..175B, all KV on the host, fetched one "
        "layer ahead"
    )
    axis_keys: ClassVar[tuple[str, ...]] = ()  # a reference: no size knob
    inert_knobs: ClassVar[dict[str, str]] = {
        "prefetch": "fetching one layer ahead changes when bytes move, never the outputs"}
    capabilities: ClassVar[Capabilities] = Capabilities(
        prefill_modes=PREFILL_MODES, offloads_kv=True, lookahead=True,
        compresses=False, kv_layouts=KV_LAYOUTS)
    serving_needs: ClassVar[ServingNeeds] = ServingNeeds(needs_host_tier=True)
    prefetch: bool = True

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return FullOffloadLayer(layer_idx, info, self)


class FullOffloadLayer(KVLayer):
    """Every token's K/V in the layer's host store (`KVLayer.host_kv`), all of it fetched at
    every decode step (one layer ahead with `prefetch`)."""
    unforkable = "its K/V are on the host tier (a host store, transfers in flight)"

    def __init__(self, layer_idx: int, info: ModelInfo, method: FullOffload):
        super().__init__(layer_idx, info)
        self.method = method

    def prefetch(self, hidden_states, position_ids, ahead: bool) -> None:
        if hidden_states.shape[1] != 1 or self.host is None:
            return
        if ahead and not self.method.prefetch:
            return
        self.host.prefetch()

    def update(self, keys, values, position_ids):
        self.seen_tokens += keys.shape[-2]
        return self.host_kv().past_and_new(keys, values)

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        # the full cache's own attention arithmetic: the logits equal full's bit for bit
        return exact_attention(module, query, keys, values, attention_mask, base, **kwargs)

    def kept_tokens(self) -> int:
        return 0 if self.host is None else self.host.length

    def stats(self) -> dict[str, int]:
        return {"kv_tokens": self.kept_tokens(),
                "kv_bytes": 0 if self.host is None else self.host.nbytes(),
                "kv_bytes_device": 0}  # fetched copies are transient (freed after the step)
