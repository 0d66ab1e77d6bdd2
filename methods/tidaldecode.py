"""TidalDecode: position-persistent sparse attention (Yang et al., arXiv 2410.05076).

Across layers the tokens a query attends most overlap strongly, so a few token-selection layers
choose for the layers after them: the layers before the first selection layer attend every token;
a selection layer attends every token too and picks each KV head's top-k tokens by its own exact
attention; every following layer, up to the next selection layer (the paper's re-selection layer,
which corrects the drift of the choice), attends only the tokens its selection layer picked, with
no scoring of its own. Nothing is evicted: every layer keeps every token.

Reconstruction: the rule from the paper (selection at layer 2 and re-selection at layer 13 of
Llama-3-8B); the GQA reduction (the top-k of the group's mean probability per KV head, as
oracle_topk and InfiniGen choose) and the prompt (attended in full under runner.prefill=dense)
are ours.

Hyperparameters (the one budget rule, methods/budget.py):
    budget_ratio: tokens attended per KV head in the reusing layers, a fraction of the budget
        basis (default 0.2); budget_tokens: a fixed number instead (takes precedence).
    selection_layers: the layers that select (ascending); the first is the first sparse layer's
        source, each later one re-selects for the layers after it (default [2, 13]).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvcore.storage import KV_LAYOUTS
from methods.budget import BudgetedMethod
from methods.capabilities import Capabilities, ServingNeeds
from methods.layer import FullLayer, KVLayer
from methods.model import ModelInfo
from methods.scoring import attention_with_probs, group_mean
from methods.selection import SelectionLayer


@dataclass(kw_only=True)
class TidalDecode(BudgetedMethod):
    name: ClassVar[str] = "tidaldecode"
    provenance: ClassVar[str] = "reconstruction"
    family: ClassVar[str] = "selection"
    summary: ClassVar[str] = ("a few selection layers pick each KV head's top-k tokens by full "
                              "attention; the layers after them attend only those")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2410.05076"
    code_url: ClassVar[str | None] = None
    operating_point: ClassVar[str] = (
        "the paper's Llama-3-8B setting: selection at layer 2, re-selection at layer 13, "
        "layers 0-1 dense")
    capabilities: ClassVar[Capabilities] = Capabilities(
        needs_attn_scores=True, sparse_prefill_chunked=True, selects_tokens=True,
        kv_layouts=KV_LAYOUTS)
    serving_needs: ClassVar[ServingNeeds] = ServingNeeds(evicts_during_decode=False)

    # the direction test's stories260K has 5 layers: select at 1, the three after it reuse that
    direction_hyperparameters: ClassVar[dict] = {"selection_layers": [1]}
    selection_layers: list[int] = field(default_factory=lambda: [2, 13])

    def __post_init__(self) -> None:
        self.selection_layers = list(self.selection_layers)
        super().__post_init__()

    def check_hyperparameters(self) -> list[str]:
        reasons = super().check_hyperparameters()
        layers = self.selection_layers
        if not layers or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                 for i in layers) or layers != sorted(set(layers)):
            reasons.append(f"method.selection_layers={layers!r} must be ascending distinct layer "
                           "indices >= 0 (at least one)")
        return reasons

    def validate(self, info: ModelInfo, runner) -> list[str]:
        reasons = super().validate(info, runner)
        if max(self.selection_layers) >= info.num_layers:
            reasons.append(f"method.selection_layers={self.selection_layers} names a layer >= "
                           f"the model's {info.num_layers} layers")
        return reasons

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict:
        return {"budget_tokens": seq_tokens, "selection_layers": [0, 1]}  # 2 layers suffice

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict:
        # two selection layers on a 3-layer model: layer 2 must reuse layer 1's pick, not layer 0's
        return {"budget_tokens": max(4, seq_tokens // 6), "selection_layers": [0, 1]}

    def own_dense_layers(self, info: ModelInfo) -> tuple[int, ...]:
        return tuple(range(min(self.selection_layers[0], info.num_layers)))

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        if layer_idx < self.selection_layers[0]:  # dense (own_dense_layers): the full cache
            return FullLayer(layer_idx, info)
        if layer_idx in self.selection_layers:
            return TidalSelectionLayer(layer_idx, info)
        source = max(i for i in self.selection_layers if i < layer_idx)
        return TidalReuseLayer(layer_idx, info, self, source)


class TidalSelectionLayer(KVLayer):
    """Attends every token, and hands its exact attention (the group's mean per KV head) to the
    layers that reuse its choice."""

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        if self.holding_prompt():  # a dense prompt: the reusing layers attend it in full too
            return base(module, query, keys, values, attention_mask, **kwargs)
        scaling = kwargs.get("scaling")
        scaling = module.scaling if scaling is None else scaling
        out, probs = attention_with_probs(query, keys, values, attention_mask, scaling)
        scores = group_mean(probs, keys.shape[1])  # (B, H_kv, q, T)
        layer = self.next_layer
        while layer is not None and not isinstance(layer, TidalSelectionLayer):
            if isinstance(layer, TidalReuseLayer):
                layer.handed = scores
            layer = layer.next_layer
        return out, None


class TidalReuseLayer(SelectionLayer):
    """Attends, per KV head, the top-k tokens of its selection layer's attention."""

    state_fields = ("handed",)  # the selection layer's attention of this forward

    scores_are_attention: ClassVar[bool] = True

    def __init__(self, layer_idx: int, info: ModelInfo, method: TidalDecode, source: int):
        super().__init__(layer_idx, info, method)
        self.source_layer = source
        self.handed: torch.Tensor | None = None  # (B, H_kv, q, T) from the selection layer

    def selection_scores(self, query, keys, attention_mask, scaling) -> torch.Tensor:
        handed = self.handed
        if handed is None or handed.shape[-1] != keys.shape[2] or handed.shape[2] != query.shape[2]:
            raise RuntimeError(f"tidaldecode layer {self.layer_idx}: no scores from selection "
                               f"layer {self.source_layer} for this forward")
        return handed
