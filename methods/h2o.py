"""H2O, the heavy-hitter oracle (Zhang et al., NeurIPS 2023, arXiv 2306.14048).

Keeps the tokens with the largest accumulated attention ("heavy hitters") plus the most recent
ones. The score of a cached token is the sum of the softmax attention it received from every
query while it was in the cache (causal: only preceding queries), per KV head. After every forward
(each decode step, each prefill chunk) the cache is cut to the budget: the last
`recent_ratio * budget` tokens, plus the top-scored tokens among the rest. Evicted K/V never return.

Follows the paper's Alg. 1 and the real-drop cache, with these deliberate choices:
  * scores are computed here (`methods.scoring.attention_with_probs`), so no eager attention or
    `output_attentions` is needed from the model; for a decode step this is one q·Kᵀ;
  * GQA: a KV head's score is the mean probability over its g query heads, one kept set per KV
    head (the official real-drop code assumes MHA and batch 1 and sums over the batch);
  * a ratio budget is a fraction of the tokens seen so far (the stream's current length), so a
    long prefill drops many tokens at once and decoding evicts as the budget allows; the paper's
    "20 %" = 10 % heavy + 10 % recent is `budget_ratio=0.2, recent_ratio=0.5`;
  * the "global statistics" mask variant of the official lm-eval code (which sums attention from
    future rows, a non-causal oracle) is never used;
  * with `runner.kv_offload=cpu` the kept K/V live on the host tier and the whole kept set is
    fetched every decode step, one layer ahead (the FlexGen+H2O baseline of InfiniGen's Fig. 14);
    scores and positions stay on the compute device, eviction compacts the host store.

Hyperparameters:
    budget_ratio: kept tokens per layer and KV head as a fraction of tokens seen (default 0.2).
    budget_tokens: a fixed number of kept tokens instead; takes precedence over budget_ratio.
    recent_ratio: share of the budget given to the most recent tokens (paper: 0.5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcore.offload import HostKVStore
from methods.base import Capabilities, KVLayer, KVMethod, ModelInfo, budget_for, check_budget
from methods.scoring import attention_with_probs, gather_tokens, group_mean


@dataclass(kw_only=True)
class H2O(KVMethod):
    name: ClassVar[str] = "h2o"
    capabilities: ClassVar[Capabilities] = Capabilities(needs_attn_scores=True, offloads_kv=True,
                                                        selects_tokens=True)
    budget_ratio: float | None = 0.2
    budget_tokens: int | None = None
    recent_ratio: float = 0.5

    def check_hyperparameters(self) -> list[str]:
        reasons = check_budget(self.budget_ratio, self.budget_tokens)
        if not isinstance(self.recent_ratio, (int, float)) or not 0 <= self.recent_ratio <= 1:
            reasons.append(f"method.recent_ratio={self.recent_ratio!r} must be in [0, 1]")
        return reasons

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict:
        return {"budget_tokens": seq_tokens}

    def total_tokens(self, seen: int) -> int:
        return budget_for(seen, self.budget_ratio, self.budget_tokens, minimum=2)

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return H2OLayer(layer_idx, info, self)


class H2OLayer(KVLayer):
    def __init__(self, layer_idx: int, info: ModelInfo, method: H2O):
        super().__init__(layer_idx, info)
        self.method = method
        self.scores: torch.Tensor | None = None  # (B, H_kv, T) accumulated attention, fp32
        self.positions: torch.Tensor | None = None  # (B, H_kv, T) text positions
        self.store = None  # HostKVStore when the runner offloads the KV
        self.pending = None  # (Transfer, Transfer) prefetched kept set

    def offloaded(self) -> bool:
        return self.tier is not None and self.tier.offload

    def prefetch(self, hidden_states, position_ids, ahead: bool) -> None:
        if (self.offloaded() and hidden_states.shape[1] == 1 and self.store is not None
                and self.store.length and self.pending is None):
            self.pending = self.store.fetch()

    def update(self, keys, values, position_ids):
        b, h, q_len, _ = keys.shape
        text_pos = torch.arange(self.seen_tokens, self.seen_tokens + q_len, device=keys.device)
        new_pos = text_pos.expand(b, h, q_len)
        new_scores = torch.zeros(b, h, q_len, device=keys.device)
        if self.scores is None:
            self.scores, self.positions = new_scores, new_pos
        else:
            self.scores = torch.cat([self.scores, new_scores], dim=2)
            self.positions = torch.cat([self.positions, new_pos], dim=2)
        if not self.offloaded():
            return super().update(keys, values, position_ids)
        self.store = self.store or HostKVStore(self.tier, self.layer_idx)
        pending, self.pending = self.pending, None
        self.seen_tokens += q_len
        return self.store.past_and_new(pending, keys, values)

    def kept_tokens(self) -> int:
        return 0 if self.positions is None else self.positions.shape[-1]

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        out, probs = attention_with_probs(query, keys, values, attention_mask, kwargs["scaling"])
        self.scores += group_mean(probs, keys.shape[1]).sum(dim=2)  # column sums over the rows
        return out, None

    def budget_tokens(self) -> int:
        return self.method.total_tokens(self.seen_tokens)

    def after_forward(self) -> None:
        kept, budget = self.kept_tokens(), self.budget_tokens()
        if kept <= budget:
            return
        recent = min(budget, int(round(self.method.recent_ratio * budget)))
        heavy = budget - recent
        b, h, _ = self.scores.shape
        device = self.scores.device
        recent_idx = torch.arange(kept - recent, kept, device=device).expand(b, h, recent)
        heavy_idx = self.scores[:, :, : kept - recent].topk(heavy, dim=-1).indices.sort(-1).values
        index = torch.cat([heavy_idx, recent_idx], dim=-1)  # (B, H_kv, budget), in cache order
        if self.offloaded():
            self.store.keep(index)
        else:
            self.keys = gather_tokens(self.keys, index)
            self.values = gather_tokens(self.values, index)
        self.scores = gather_tokens(self.scores, index)
        self.positions = gather_tokens(self.positions, index)

    def kept_positions(self) -> torch.Tensor:
        return self.positions

    def stats(self) -> dict[str, int]:
        if not self.offloaded():
            return super().stats()
        held = 0 if self.store is None else self.store.nbytes()
        return {"kv_tokens": self.kept_tokens(), "kv_bytes": held, "kv_bytes_device": 0}
