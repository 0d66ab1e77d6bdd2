"""KVMerger, "Model Tells You Where to Merge" (Wang, Jin, Yu, Zhang; arXiv 2407.08454): merge runs
of similar adjacent keys instead of evicting them.

Within one sequence the keys of neighbouring tokens are very similar, so at the end of every prompt
(the engine's `on_prefill_end`, whatever the chunking), per layer and KV head, the prompt outside
the recent window is cut into contiguous *merging sets* and each set becomes one KV pair, the
Gaussian-kernel-weighted mean of its members centred on its most attended ("pivotal") token. The
last `window_tokens` tokens stay untouched. Decoding then appends without merging (as SnapKV).
Paper: on Llama-2-7B/13B-chat, LongBench and ZeroScrolls at 50 % and 35 % KV budgets, better than
H2O and CaM (abstract).

No official code was found (methods-2.md §6); this is the reconstructed, deterministic variant
of the reference (`kvmerger_r` there), exact under the budget:
  * similarity: cos(k_i, k_{i+1}) of adjacent post-RoPE keys as cached, in text order;
  * sets: the prefix's P tokens joined at their P - S most similar adjacent pairs, which leaves
    exactly S = budget - window contiguous sets per KV head (the paper's fixed-threshold
    clustering gives a data-dependent size, which a budget cannot hold);
  * pivot: the member with the most votes of the last `window_tokens` queries (SnapKV's window
    votes, mean over the query heads of the KV head; ties: the first member);
  * weights: g_i = exp(-|k_p - k_i|^2 / (2 sigma^2)), sigma^2 = the set's mean |k_p - k_i|^2
    (1 when that is 0), normalised over the set; merged K and V are the weighted sums, stored at
    the pivot's position (merged keys keep a mixed RoPE phase; they are never re-rotated);
  * a budget smaller than the window keeps the last `budget` tokens only (no set to merge into).
  * a later prompt (multi-turn) merges what the layer holds then, a merged pair counting as one
    token.
A merged pair stands for several tokens but receives the attention mass of one: the information
loss that merging trades against eviction (no log-count compensation, which KVMerger lacks).

Hyperparameters (the one budget rule, methods/base.py):
    budget_ratio / budget_tokens: KV pairs kept per layer and KV head at the end of a prompt,
        window included (paper: 50 % and 35 % of the prompt).
    window_tokens: recent tokens kept unmerged; their queries vote for the pivots (32, as SnapKV).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvcore.storage import KV_LAYOUTS
from methods.base import Capabilities, KVLayer, ModelInfo
from methods.eviction import BudgetedMethod, keep_tokens
from methods.scoring import gather_tokens
from methods.snapkv import SnapKVLayer, window_votes


@dataclass(kw_only=True)
class KVMerger(BudgetedMethod):
    name: ClassVar[str] = "kvmerger"
    provenance: ClassVar[str] = "reconstruction"
    operating_point: ClassVar[str] = (
        "paper only (arXiv 2407.08454, no code): Llama-2-7B/13B-chat; 50 % and 35 % of "
        "the prompt KV; LongBench, ZeroScrolls"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        needs_attn_scores=True, acts_during_decode=False, needs_prefill=True,
        prefill_modes=("dense",), selects_tokens=True, kv_layouts=KV_LAYOUTS)
    variant_keys: ClassVar[tuple[str, ...]] = ("window_tokens",)
    budget_ratio: float | None = 0.5
    window_tokens: int = 32

    def check_hyperparameters(self) -> list[str]:
        reasons = super().check_hyperparameters()
        if not isinstance(self.window_tokens, int) or self.window_tokens <= 0:
            reasons.append(f"method.window_tokens={self.window_tokens!r} must be a positive "
                           "integer")
        return reasons

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict:
        # a window below the budget, so that sets are really merged
        return {"budget_tokens": max(4, seq_tokens // 6), "window_tokens": 2}

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return KVMergerLayer(layer_idx, info, self)


class KVMergerLayer(SnapKVLayer):
    selects_top_scores: ClassVar[bool] = False  # merged sets, not the top votes (its own test)
    """SnapKV's window capture and prompt-end timing; the prefix is merged instead of selected."""

    def score(self) -> torch.Tensor:
        queries = self.window_queries  # at text positions seen - w .. seen - 1
        return window_votes(queries, self.keys, self.positions, self.seen_tokens - queries.shape[2],
                            self.scaling)

    def compress_to(self, budget: int) -> None:
        kept = self.kept_tokens()
        if kept <= budget:
            return
        recent = min(self.method.window_tokens, budget)
        sets = budget - recent
        order = self.positions.argsort(dim=-1)  # (B, H_kv, T) slots in text order
        prefix = order[..., : kept - recent]
        index = order[..., kept - recent:]
        if sets:
            keys = gather_tokens(self.keys, prefix).float()  # (B, H_kv, P, D)
            values = gather_tokens(self.values, prefix).float()
            set_id = merging_sets(keys, sets)
            pivot = pivots(self.score().gather(-1, prefix), set_id, sets)
            merged_keys, merged_values = gaussian_merge(keys, values, set_id, pivot, sets)
            index = torch.cat([prefix.gather(-1, pivot), index], dim=-1)
        self.kept_count = keep_tokens(self._token_rows(), index)
        if sets:  # the pivots' slots come first, in text order: they take the merged pairs
            for name, merged in (("keys", merged_keys), ("values", merged_values)):
                rows = self.kv_rows(name)
                rows.write_at(0, merged.to(rows.view().dtype))
        self._views()


def merging_sets(keys: torch.Tensor, sets: int) -> torch.Tensor:
    """Set of each token of `keys (B, H, P, D)` (text order), `(B, H, P)` in 0..sets-1: the
    P - sets most cosine-similar adjacent pairs are joined, so every set is a contiguous run."""
    similarity = F.cosine_similarity(keys[:, :, 1:], keys[:, :, :-1], dim=-1)  # (B, H, P-1)
    joins = keys.shape[2] - sets
    joined = torch.zeros_like(similarity, dtype=torch.bool)
    joined.scatter_(-1, similarity.topk(joins, dim=-1).indices, True)
    starts = torch.cat([torch.ones_like(joined[..., :1]), ~joined], dim=-1)
    return starts.long().cumsum(dim=-1) - 1


def pivots(scores: torch.Tensor, set_id: torch.Tensor, sets: int) -> torch.Tensor:
    """Index of each set's highest-scored member (the first on ties), `(B, H, sets)`."""
    best = scores.new_full((*scores.shape[:2], sets), float("-inf"))
    best = best.scatter_reduce(-1, set_id, scores, "amax")
    members = torch.arange(scores.shape[-1], device=scores.device).expand_as(set_id)
    candidates = members.masked_fill(scores < best.gather(-1, set_id), scores.shape[-1])
    first = torch.full_like(best, scores.shape[-1], dtype=torch.long)
    return first.scatter_reduce(-1, set_id, candidates, "amin")


def gaussian_merge(keys: torch.Tensor, values: torch.Tensor, set_id: torch.Tensor,
                   pivot: torch.Tensor, sets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian-kernel-weighted K and V of each set, `(B, H, sets, D)` fp32, centred on its
    pivot."""
    def per_set(x: torch.Tensor) -> torch.Tensor:  # (B, H, P) -> sums per set (B, H, sets)
        return x.new_zeros((*x.shape[:2], sets)).scatter_add_(-1, set_id, x)

    centre = gather_tokens(gather_tokens(keys, pivot), set_id)  # each token's pivot key
    dist = (keys - centre).pow(2).sum(dim=-1)  # (B, H, P)
    sigma2 = per_set(dist) / per_set(torch.ones_like(dist))
    sigma2 = torch.where(sigma2 > 0, sigma2, torch.ones_like(sigma2)).gather(-1, set_id)
    weight = torch.exp(-dist / (2 * sigma2))
    weight = (weight / per_set(weight).gather(-1, set_id))[..., None]  # (B, H, P, 1)

    def merge(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros((*x.shape[:2], sets, x.shape[-1]))
        return out.scatter_add_(2, set_id[..., None].expand_as(x), weight * x)

    return merge(keys), merge(values)
