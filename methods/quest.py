"""Quest: query-aware page selection over the full cache (Tang et al., ICML 2024,
https://arxiv.org/abs/2406.10774; official code https://github.com/mit-han-lab/Quest@01c1623bf939:
`evaluation/quest_attention.py` for accuracy, `quest/utils/controller.py` for the kernels path).

Official behaviour, reproduced:
* The cache is split into pages of `page_size` tokens (paper 16); per page, KV head and channel
  the min m and max M of the (post-RoPE, as cached) keys are kept as tokens arrive. Nothing is
  evicted: Quest saves reads, not memory.
* At a decode step a page's criticality is the upper bound U = sum_d max(q_d M_d, q_d m_d)
  (methods/kernels/quest_pages.py), the partial current page bounded by the tokens it holds;
  attention is exact softmax over the selected pages' tokens (methods/selection.py).
* The default selection is the accuracy path's (`local_heavy_hitter_mask`, after `repeat_kv`):
  each query head picks its own K = min(max(`min_pages` = 3, min(T, B) // page_size), P) pages
  and attends only them (its KV head reads the union); the partial current page competes as
  one page, never forced. So a budget below 3 pages is exceeded by design (`allowed_tokens` is
  that bound), and with B >= T the rule still drops one page when T is not a page multiple.
* Prompt chunks attend densely, as in the paper (under runner.prefill=sparse the engine feeds
  the prompt one token at a time, each row a Quest step). The paper keeps layers 0 and 1 dense
  (`dense_layers`, on the real layer index).

Ours, named variants: `select_per=kv_head` (one page set per KV head, its group's bounds reduced
by `group_reduce`: `max`, a page best for any of its query heads ranks as for that head, or `sum`,
a bound on the group's summed logit) and `current_page=forced` (the current page always attended,
as the kernels path keeps "the last page" outside its top-k, plus the (B - p) // page_size best
full pages, so the budget is never exceeded; below one page, the last B tokens).

Deviation: the accuracy code's layer counter starts at 32 and counts down, so on a model without
32 layers (SmolLM2's 30) it leaves no layer dense; `dense_layers=[]` reproduces that.

Budget: B from the shared rule (`budget_tokens`, else `budget_ratio` x the protocol's basis), per
head and decode step; the official rule uses it as is (`min(T, B)`), so it is not dense before B
is reached. The paper's budgets are token counts (512-4096): `budget_tokens` reproduces them.

Hyperparameters:
    budget_ratio / budget_tokens: tokens attended per head and decode step (see above).
    page_size: tokens per page (paper 16).
    dense_layers: layers attended in full (paper [0, 1]).
    select_per: query_head (official) | kv_head (ours: one page set per KV head).
    current_page: scored (official) | forced (ours).
    min_pages: the official minimum of pages per head (3), with current_page=scored.
    group_reduce: max | sum (select_per=kv_head: query-head bounds -> one score per KV head).

Paper's number: up to 7.03x self-attention speedup and 2.23x end-to-end latency, with negligible
accuracy loss at 4K-token budgets on LongBench.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from kvcore.guards import size_reason
from kvcore.storage import KV_LAYOUTS
from methods.budget import BudgetedMethod
from methods.capabilities import Capabilities, ServingNeeds
from methods.kernels import quest_pages
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.scoring import expand_kv
from methods.selection import SelectionLayer

HeadForm = Literal["query_head", "kv_head"]  # select_per: the official accuracy path's, or ours
# current_page: the official accuracy path's, or ours (its kernels path's)
CurrentPage = Literal["scored", "forced"]


@dataclass(kw_only=True)
class Quest(BudgetedMethod):
    name: ClassVar[str] = "quest"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "selection"
    summary: ClassVar[str] = "per-page key min/max bounds pick the pages each query reads"
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2406.10774"
    code_url: ClassVar[str | None] = "https://github.com/mit-han-lab/Quest"
    operating_point: ClassVar[str] = (
        "mit-han-lab/Quest: LongChat-7B-v1.5-32K, Yarn-Llama-2-7B-128K; page 16, "
        "256..4096-token budget; PG19, passkey, LongBench"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(selects_tokens=True, kv_layouts=KV_LAYOUTS)
    serving_needs: ClassVar[ServingNeeds] = ServingNeeds(evicts_during_decode=False,
                                                         granularity="page")
    variant_keys: ClassVar[tuple[str, ...]] = ("page_size", "select_per", "current_page",
                                               "min_pages", "group_reduce")
    page_size: int = 16
    dense_layers: list[int] = field(default_factory=lambda: [0, 1])
    select_per: HeadForm = "query_head"
    current_page: CurrentPage = "scored"
    min_pages: int = 3
    group_reduce: quest_pages.Reduction = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.dense_layers = list(self.dense_layers)

    def check_hyperparameters(self) -> list[str]:
        reasons = super().check_hyperparameters()
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or self.page_size < 1:
            reasons.append(f"method.page_size={self.page_size!r} must be a positive integer")
        if not isinstance(self.min_pages, int) or isinstance(self.min_pages, bool) or self.min_pages < 1:
            reasons.append(f"method.min_pages={self.min_pages!r} must be a positive integer")
        if self.group_reduce != "max" and self.select_per == "query_head":
            reasons.append(f"method.group_reduce={self.group_reduce} acts only when a KV head "
                           "selects for its group: set method.select_per=kv_head")
        if self.min_pages != 3 and self.current_page == "forced":
            reasons.append(f"method.min_pages={self.min_pages} acts only with "
                           "method.current_page=scored (the official page count)")
        if not all(isinstance(i, int) and i >= 0 for i in self.dense_layers):
            reasons.append(f"method.dense_layers={self.dense_layers!r} must be layer indices >= 0")
        return reasons

    def validate(self, info: ModelInfo, runner) -> list[str]:
        reasons = super().validate(info, runner)
        if any(i >= info.num_layers for i in self.dense_layers):
            reasons.append(f"method.dense_layers={self.dense_layers} names a layer >= the model's "
                           f"{info.num_layers} layers")
        page = 2 * self.page_size * info.num_kv_heads * info.head_dim * 4  # page_bounds: (H, P, D)
        reasons += filter(None, [size_reason(f"method.page_size={self.page_size}", page,
                                             "one padded page of keys per layer (page bounds)")])
        return reasons

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict:
        # the official page count min(T, B) // page_size drops the partial page even when B >= T:
        # a page minimum covering every page makes the budget lossless
        return {"budget_tokens": seq_tokens, "dense_layers": [], "min_pages": seq_tokens}

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict:
        # several pages to choose among, so the page scores (and their group reduction) decide
        return {"budget_tokens": max(8, seq_tokens // 3), "page_size": 4}

    def own_dense_layers(self, info: ModelInfo) -> tuple[int, ...]:
        return tuple(sorted(set(self.dense_layers)))

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return QuestLayer(layer_idx, info, self)


def page_bounds(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page channel min and max `(B, H, ceil(T / page_size), D)` of keys `(B, H, T, D)`;
    a partial last page is bounded by the tokens it holds."""
    b, h, t, d = keys.shape
    pad = -t % page_size
    pages = (t + pad) // page_size
    if pad:
        fill = keys.new_full((b, h, pad, d), float("inf"))
        low = torch.cat([keys, fill], 2).view(b, h, pages, page_size, d).amin(3)
        high = torch.cat([keys, -fill], 2).view(b, h, pages, page_size, d).amax(3)
        return low, high
    paged = keys.view(b, h, pages, page_size, d)
    return paged.amin(3), paged.amax(3)


def scored_page_count(num_tokens: int, page_size: int, budget: int, min_pages: int) -> int:
    """The official accuracy path's pages per head: K = min(max(min_pages, min(T, B) //
    page_size), P)."""
    pages = -(-num_tokens // page_size)
    return min(max(min_pages, min(num_tokens, budget) // page_size), pages)


def scored_allowance(num_tokens: int, page_size: int, budget: int, min_pages: int) -> int:
    """Most tokens a head attends under the official rule: K pages of page_size tokens (at least
    `min_pages` pages, so a budget below them is exceeded by design)."""
    return min(num_tokens, scored_page_count(num_tokens, page_size, budget, min_pages) * page_size)


class QuestLayer(SelectionLayer):
    state_fields = ("page_min", "page_max")

    def __init__(self, layer_idx: int, info: ModelInfo, method: Quest):
        super().__init__(layer_idx, info, method)
        self.unit_tokens = method.page_size  # the template chooses pages
        self.scores_bound_logits = True  # page scores bound q.k from above (the criticality)
        self.page_min = self.page_max = None  # (B, H_kv, P, D) each

    def update(self, keys, values, position_ids):
        before = self.kept_tokens()
        out = super().update(keys, values, position_ids)
        self._refresh_pages(before)
        return out

    def _refresh_pages(self, before: int) -> None:
        """Recompute the bounds of the pages the new tokens touched (the old partial page on)."""
        ps = self.method.page_size
        first = before // ps
        low, high = page_bounds(self.keys[:, :, first * ps:], ps)
        if self.page_min is None or first == 0:
            self.page_min, self.page_max = low, high
        else:
            self.page_min = torch.cat([self.page_min[:, :, :first], low], 2)
            self.page_max = torch.cat([self.page_max[:, :, :first], high], 2)

    def forced(self) -> bool:
        return self.method.current_page == "forced"

    def attends_densely(self, query: torch.Tensor) -> bool:
        return query.shape[2] > 1 or self.holding_prompt()  # a prompt row: dense, as in the paper

    def page_scores(self, query: torch.Tensor) -> torch.Tensor:
        """(B, H_sel, P): per query head (the official accuracy path scores after repeat_kv; the
        page bounds are repeated for the g heads), or one per KV head by `group_reduce`."""
        low, high = self.page_min, self.page_max
        if self.method.select_per == "query_head" and self.info.group_size > 1:
            low, high = expand_kv(low, self.info.group_size), expand_kv(high, self.info.group_size)
        return quest_pages.page_scores(query[:, :, 0], low, high, self.method.group_reduce)

    def selection_scores(self, query, keys, attention_mask, scaling) -> torch.Tensor:
        scores = self.page_scores(query)
        if self.forced():  # the current page is attended by `protected`, never chosen
            scores[..., -1] = float("-inf")
        return scores[:, :, None]  # (B, H_sel, 1, P)

    def current_tokens(self, t: int) -> int:
        """Tokens in the current (last) page, 1..page_size."""
        return t - (-(-t // self.unit_tokens) - 1) * self.unit_tokens

    def protected(self, budget: int, t: int) -> tuple[int, int]:
        return (0, min(self.current_tokens(t), budget)) if self.forced() else (0, 0)

    def selection_size(self, budget: int, t: int) -> int:
        if not self.forced():
            return scored_page_count(t, self.unit_tokens, budget, self.method.min_pages)
        current = self.current_tokens(t)
        full_pages = -(-t // self.unit_tokens) - 1
        return 0 if budget < current else min(full_pages, (budget - current) // self.unit_tokens)

    def step_allowance(self, budget: int, t: int) -> int:
        if self.forced():
            return budget
        return scored_allowance(t, self.unit_tokens, budget, self.method.min_pages)

    def stats(self) -> dict[str, int]:
        out = super().stats()
        if self.page_min is not None:  # the page bounds are held too (2 / page_size of K)
            out["kv_bytes"] += int(self.page_min.nbytes + self.page_max.nbytes)
        return out
