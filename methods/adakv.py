"""Ada-KV (Feng et al., arXiv 2407.11550, NeurIPS 2025): SnapKV's selection with the layer's budget
split across KV heads by a flattened top-k.

At the end of every prompt, per layer: SnapKV's scores (methods/snapkv.py: pooled votes of the
last `window_tokens` prompt queries; the window itself always kept) of every KV head's prefix
compete in one top-k over all heads of the layer, of size H_kv x (B - w) (B the layer's budget per
head, window included): a head whose votes are dispersed wins many slots, a concentrated one few.
A head's share is then mixed with the safeguard floor, so that no head falls below
`floor_alpha x (B - w)`:

    budget_h = w + floor + wins_h x (B - w - floor) / (B - w),   floor = int(floor_alpha x (B - w))

and each head keeps the window plus its own top `budget_h - w` votes. Decoding then appends one
token to every head (SnapKV's protocol). The counts sum to H_kv x B: the layer holds exactly the
uniform method's tokens (the template stores the heads ragged, methods/eviction.py; no padding
held), so `kv_tokens` (the mean over heads) equals SnapKV's at the same budget.

Official-code facts followed (FFY0/AdaKV, adaptive_snapkv/monkeypatch/snapkv_utils.py,
`AdaptiveSnapKVCluster.update_kv`): the flattened top-k over the heads' sorted prefix scores of
H x base_capacity (base = budget - window), counts per head by `index // length`, then
`round(count x (1 - floor_alpha) + int(base x floor_alpha))`; the window appended to every head.
Their GQA scripts (experiments/LongBench/GQA_eval_longbench.sh) set `--floor_alpha 0.2` ("we
suggest setting floor_alpha to 0.2 while using gqa"); kvpress's AdaKVPress `alpha_safeguard`
default is 0.20 too (its floor: each head's top n_safe forced in, then one flattened top-k).
`normalize` is off in every released script (a store_true flag they do not pass): not offered.
Deviations, each to keep the one budget rule exact: (1) the adaptive part is scaled by
(base - floor) / base instead of (1 - floor_alpha) and rounded by largest remainder instead of
per-head `round`, so the counts sum to exactly H x B (the official total drifts with the floor's
`int()` and the rounding: 26 of 28 tokens at B = 7, w = 4, 4 heads); identical to the official
counts when floor_alpha x base is an integer and no rounding ties (tests/methods/test_adakv.py). (2) One allocation per KV head (the GQA branch, `test_gqa_support`: votes
averaged over the group, as our SnapKV); the main branch allocates per query head.

Hyperparameters: SnapKV's (budget: tokens per KV head on average, window included; window 32,
kernel 7, max pooling: the official configs `c*_w32_k7_maxpool.json`), plus
    floor_alpha: the safeguard's share of every head's uniform budget, in [0, 1] (official 0.2;
        1 = uniform = SnapKV).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from methods.capabilities import ServingNeeds
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.snapkv import SnapKV, SnapKVLayer


@dataclass(kw_only=True)
class AdaKV(SnapKV):
    name: ClassVar[str] = "adakv"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "prompt compression"
    summary: ClassVar[str] = (
        "SnapKV's votes with the layer's budget split across KV heads by one flattened top-k")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2407.11550"
    code_url: ClassVar[str | None] = "https://github.com/FFY0/AdaKV"
    operating_point: ClassVar[str] = (
        "FFY0/AdaKV: Mistral-7B-Instruct-v0.2, LWM-Text-Chat-1M; 128..1024 tokens per head on "
        "average, window 32, kernel 7 max-pool, floor_alpha 0.2 (GQA scripts); LongBench, RULER"
    )
    serving_needs: ClassVar[ServingNeeds] = ServingNeeds(ragged_heads=True)
    variant_keys: ClassVar[tuple[str, ...]] = ("window_tokens", "kernel_tokens", "pooling",
                                               "floor_alpha")
    floor_alpha: float = 0.2

    def check_hyperparameters(self) -> list[str]:
        reasons = super().check_hyperparameters()
        if (isinstance(self.floor_alpha, bool) or not isinstance(self.floor_alpha, (int, float))
                or not 0 <= self.floor_alpha <= 1):
            reasons.append(f"method.floor_alpha={self.floor_alpha!r} must be a number in [0, 1]")
        return reasons

    def head_budgets(self, scores: torch.Tensor, budget: int, layer_idx: int) -> torch.Tensor:
        return adaptive_budgets(scores, budget, self.floor_alpha)

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return AdaKVLayer(layer_idx, info, self)


class AdaKVLayer(SnapKVLayer):
    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        # SnapKV's (the window queries are recorded), each head over its own tokens
        return super().attend(module, query, keys, values, attention_mask,
                              self.over_heads(base), **kwargs)


def adaptive_budgets(scores: torch.Tensor, budget: int, floor_alpha: float) -> torch.Tensor:
    """Tokens per KV head `(B, H)` int64 from guarded scores `(B, H, T)` (protected +inf, slots
    not held -inf): the protected tokens, the floor, and the flattened top-k's wins scaled to the
    rest of H x `budget` (module docstring); the counts sum to H x `budget` per batch row."""
    b, h, t = scores.shape
    protected = torch.isposinf(scores).sum(-1)  # (B, H): the window
    won = torch.zeros_like(protected).scatter_add_(  # slots each head wins in the flattened top-k
        -1, scores.reshape(b, h * t).topk(h * budget, dim=-1).indices // t,
        torch.ones(b, h * budget, dtype=protected.dtype, device=scores.device))
    base = (budget - protected).clamp(min=0)  # (B, H) the prefix budget per head
    floor = (base * floor_alpha).floor().to(torch.int64)
    wins = (won - protected).clamp(min=0).double()
    share = (wins * (base - floor) / base.clamp(min=1)).nan_to_num()  # (B, H) adaptive part
    counts = protected + floor + share.floor().to(torch.int64)
    short = h * budget - counts.sum(-1, keepdim=True)  # the rounding's leftover, < H per row
    rank = (share.floor() - share).argsort(dim=-1, stable=True).argsort(dim=-1)  # largest first
    return counts + (rank < short).to(torch.int64)
