"""TOVA, Token Omission Via Attention (Oren et al., EMNLP 2024, arXiv 2401.06104).

A decoder as a bounded multi-state RNN: after every forward, while a layer holds more than its
budget, drop the tokens with the lowest attention from the *current* (last) query, averaged over
all query heads of the layer: one index set per layer, shared by every KV head. No accumulated
history, no window, no sinks; the token just added may itself be dropped. Paper: nearly on par
with the full model on long-range tasks using in some cases 1/8 of the cache, 4.8x higher
throughput (abstract).

Faithful to the official `TOVACache.reduce` (github.com/schwartz-lab-NLP/TOVA): the last row of
each forward's attention (eager softmax in the official code; here that one row is computed in fp32
next to the model's own attention, so no eager attention is needed), keys post-RoPE at their
original positions. Protocol: with `runner.prefill=dense` a prompt chunk is pruned by its last row
(with one chunk: the official one-shot prefill); `runner.prefill=sparse` feeds the prompt token by
token (per-step TOVA).

Hyperparameters (the one budget rule, methods/budget.py):
    budget_ratio / budget_tokens: the cache size K per layer (README example K = 512).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcore.storage import KV_LAYOUTS
from methods.budget import BudgetedMethod
from methods.capabilities import Capabilities
from methods.eviction import EvictionLayer
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.protocol import PREFILL_MODES


@dataclass(kw_only=True)
class TOVA(BudgetedMethod):
    name: ClassVar[str] = "tova"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "eviction"
    summary: ClassVar[str] = (
        "at every step, drop the token the current query attends least (heads averaged)")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2401.06104"
    code_url: ClassVar[str | None] = "https://github.com/schwartz-lab-NLP/TOVA"
    operating_point: ClassVar[str] = (
        "schwartz-lab-NLP/TOVA: LLaMA-2-7B; a 512-token cache (1/8 of 4K), pruned once by "
        "the prompt's last row, then per step"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        prefill_modes=PREFILL_MODES, needs_attn_scores=True,
        selects_tokens=True, kv_layouts=KV_LAYOUTS)

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return TOVALayer(layer_idx, info, self)


class TOVALayer(EvictionLayer):
    state_fields = ("last_row",)

    last_row: torch.Tensor  # (B, 1, T) this forward's last-query attention, mean over all heads

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        self.last_row = last_query_probs(query, keys, kwargs["scaling"]).mean(dim=1, keepdim=True)
        return base(module, query, keys, values, attention_mask, **kwargs)

    def score(self) -> torch.Tensor:
        return self.last_row.expand_as(self.positions)  # one index set for every KV head


def last_query_probs(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention probabilities of each head's last query over every key, `(B, H_q, T)` fp32 (the
    last query of a forward is its newest token: every key is in its causal past)."""
    b, h_q, _, d = query.shape
    h_kv = keys.shape[1]
    rows = query[:, :, -1].float().reshape(b, h_kv, h_q // h_kv, d)
    return torch.softmax(torch.matmul(rows, keys.float().transpose(2, 3)) * scaling, dim=-1
                         ).reshape(b, h_q, -1)
