"""SnapKV (Li et al., NeurIPS 2024, arXiv 2404.14469): compress the prompt once, by the votes of its
last queries.

At the end of every prompt (the engine's `on_prefill_end`, whatever the chunking), per layer and
KV head: the last `window_tokens` prompt queries (the observation window) attend over the prompt
(fp32 softmax, causal inside the window); each earlier token's vote is the sum of the attention it
receives from the window rows, averaged over the query heads of its KV head; votes are pooled
along the text (`pooling` over `kernel_tokens`, stride 1, "same" padding, so a kept token keeps
its neighbours: the paper's clustering); the top votes fill the budget minus the window, and the
window itself is always kept. Decoding then appends without eviction (the cache grows by one per
step), unless `runner.decode_interval_tokens` is set: then every that many tokens the last
`window_tokens` queries (decoded ones) vote again and the cache is cut back to the budget.
Positions stay the original ones. Paper: at 16K input, 3.6x faster generation and 8.2x better
memory efficiency than the full cache with comparable LongBench scores; Needle-in-a-Haystack up
to 380K context on one A100-80GB with a negligible drop (abstract).

Official-code facts followed (github.com/FasterDecoding/SnapKV, `SnapKVCluster.update_kv`):
compression only when the prompt exceeds the budget; budget (`max_capacity_prompt`) includes the
window; the paper's LongBench configs are window 32, kernel 7, max pooling. GQA fix (the official
code repeats K/V first, https://github.com/FasterDecoding/SnapKV/issues/16): votes are averaged
over the group *before* pooling, one index set per KV head (KVCache-Factory's kv_head mode; kvpress
averages after pooling — identical for average pooling). Query-aware by design: a question at the
end of the prompt is in the window.

Hyperparameters (the one budget rule, methods/budget.py):
    budget_ratio / budget_tokens: tokens kept per layer and KV head at the end of a prompt,
        window included (paper: 1024, 2048 or 4096 tokens); a ratio is of the prompt's tokens seen.
    window_tokens: observation window (paper configs: 32).
    kernel_tokens: pooling kernel, odd (paper configs: 7).
    pooling: max (paper configs) | avg (the official init default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from kvcore.storage import KV_LAYOUTS
from methods.budget import BudgetedMethod
from methods.capabilities import Capabilities
from methods.eviction import EvictionLayer
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.scoring import causal_allowed, group_column_sums

Pooling = Literal["max", "avg"]


@dataclass(kw_only=True)
class SnapKV(BudgetedMethod):
    name: ClassVar[str] = "snapkv"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "prompt compression"
    summary: ClassVar[str] = (
        "once per prompt, top-k by the pooled votes of the last prompt queries plus that window")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2404.14469"
    code_url: ClassVar[str | None] = "https://github.com/FasterDecoding/SnapKV"
    operating_point: ClassVar[str] = (
        "FasterDecoding/SnapKV: Mistral-7B-Instruct-32K, LWM-7B; 1024..4096-token prompt "
        "budget, window 32, kernel 7 max-pool; LongBench"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        needs_attn_scores=True, acts_during_decode=False, prefill_modes=("dense",),
        selects_tokens=True, recompresses_during_decode=True, kv_layouts=KV_LAYOUTS)
    variant_keys: ClassVar[tuple[str, ...]] = ("window_tokens", "kernel_tokens", "pooling")
    window_tokens: int = 32
    kernel_tokens: int = 7
    pooling: Pooling = "max"

    def check_hyperparameters(self) -> list[str]:
        reasons = super().check_hyperparameters()
        if not isinstance(self.window_tokens, int) or self.window_tokens <= 0:
            reasons.append(f"method.window_tokens={self.window_tokens!r} must be a positive integer")
        if not isinstance(self.kernel_tokens, int) or self.kernel_tokens <= 0 or not self.kernel_tokens % 2:
            reasons.append(f"method.kernel_tokens={self.kernel_tokens!r} must be a positive odd integer")
        return reasons

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict:
        # a window well below the budget, so that the votes choose most of the kept tokens
        return {"budget_tokens": max(8, seq_tokens // 6), "window_tokens": 4}

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return SnapKVLayer(layer_idx, info, self)


class SnapKVLayer(EvictionLayer):
    state_fields = ("window_queries", "scaling")

    def __init__(self, layer_idx: int, info: ModelInfo, method: SnapKV):
        super().__init__(layer_idx, info, method)
        self.window_queries: torch.Tensor | None = None  # (B, H_q, <=w, D) the last queries seen
        self.scaling = 1.0

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        w = self.method.window_tokens
        past = self.window_queries
        recent = query if past is None else torch.cat([past, query], dim=2)
        self.window_queries, self.scaling = recent[:, :, -w:], kwargs["scaling"]
        # the harness sizes each layer's mask from its own mask_sizes (per-layer budgets too)
        return base(module, query, keys, values, attention_mask, **kwargs)

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, min(self.method.window_tokens, budget)

    def score(self) -> torch.Tensor:
        queries = self.window_queries  # at text positions seen - w .. seen - 1
        w = queries.shape[2]
        votes = window_votes(queries, self.keys, self.positions, self.seen_tokens - w, self.scaling)
        prefix = self.positions < self.seen_tokens - w  # the window is protected, never pooled
        return pool_along_text(votes, self.positions, prefix, self.method.kernel_tokens,
                               self.method.pooling)


def window_votes(queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                 first_query_pos: int, scaling: float) -> torch.Tensor:
    """Attention each kept token receives from the window rows, `(B, H_kv, T)` fp32.

    queries (B, H_q, w, D) at text positions first_query_pos + i; keys (B, H_kv, T, D) at
    `positions (B, H_kv, T)`; causal by position; the group mean is taken before the row sum.
    """
    b, h_q, w, d = queries.shape
    h_kv = keys.shape[1]
    rows = queries.float().reshape(b, h_kv, (h_q // h_kv) * w, d)
    scores = torch.matmul(rows, keys.float().transpose(2, 3)) * scaling  # (B, H_kv, g*w, T)
    scores = scores.view(b, h_kv, h_q // h_kv, w, -1)
    query_pos = first_query_pos + torch.arange(w, device=keys.device)
    future = positions[:, :, None, None, :] > query_pos[:, None]  # (B, H_kv, 1, w, T)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return group_column_sums(probs.flatten(1, 2), h_kv)


def pool_along_text(votes: torch.Tensor, positions: torch.Tensor, prefix: torch.Tensor,
                    kernel: int, pooling: str) -> torch.Tensor:
    """Pool `votes (B, H_kv, T)` over neighbours in text order (the cache need not be in text
    order) among the `prefix` tokens only: others count as padding (-inf for max, 0 for avg, as
    the official pooling pads the prefix's ends); their own pooled value is meaningless."""
    order = positions.argsort(dim=-1)
    fill = float("-inf") if pooling == "max" else 0.0
    ordered = votes.masked_fill(~prefix, fill).gather(-1, order)
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    pooled = pool(ordered.flatten(0, 1)[:, None], kernel, stride=1, padding=kernel // 2)
    return torch.empty_like(votes).scatter_(-1, order, pooled.view_as(votes))
