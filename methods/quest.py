"""Quest: query-aware page selection over the full cache (Tang et al., ICML 2024, arXiv 2406.10774).

Spec (reference/methods.md §5, methods-2.md §13.2; official code mit-han-lab/Quest@01c1623bf939,
`evaluation/quest_attention.py` for accuracy, `quest/utils/controller.py` for the kernels path):

* The cache is split into pages of `page_size` tokens (default 16, the paper's). Per page, KV head
  and channel the elementwise min m and max M of the (post-RoPE, as cached) keys are kept and
  updated as tokens arrive. Nothing is evicted: all K/V stay on the device; Quest saves reads.
* At a decode step the criticality of a page is the upper bound U = sum_d max(q_d M_d, q_d m_d)
  (methods/kernels/quest_pages.py: Triton kernel + torch reference), the partial current page
  bounded by the tokens it holds. Attention is exact softmax over the selected pages' tokens.
* Selection, the default = the official accuracy path (`evaluation/quest_attention.py`,
  `local_heavy_hitter_mask`), labelled `select_per=query_head, current_page=scored`:
  - pages are scored after `repeat_kv`, so each query head picks its own pages and attends only
    them; a KV head serves (reads) the union of its g heads' page sets;
  - K = min(max(`min_pages` = 3, min(T, B) // page_size), P) pages per query head: at least 3
    pages (so a small budget is exceeded by design; `allowed_tokens` is that rule's bound), the
    partial current page counted as one page and competing with the others (never forced);
    with B >= T the official rule still drops one page when T is not a multiple of the page.
  Ours, named variants: `select_per=kv_head` (one page set per KV head serves its group, chosen
  by `group_reduce` over the group's bounds: `max`, a page that is the best for any query head
  ranks as high as for that head, or `sum`, a bound on the group's summed logit) and
  `current_page=forced` (the current page always attended, as the official kernels path keeps
  "the last page" outside its top-k, plus the m = (B - p) // page_size best full pages, so that
  p + page_size * m <= B: the token budget is never exceeded; below one page, the last B
  tokens). The published 64.4 (issue 26) was `kv_head` + `forced`; README has both.
* Prefill chunks (q_len > 1) attend densely, as in the paper. Under the run protocol
  `prefill=sparse` the engine feeds the prompt one token at a time and every row is a Quest step.
* Dense layers: the paper keeps layers 0 and 1 dense (`dense_layers`, default [0, 1], keyed on the
  real layer index). The official accuracy code's layer counter starts at 32 and counts down, so
  it leaves no layer dense on models that do not have 32 layers (SmolLM2's 30: none): not
  reproduced by default; `dense_layers=[]` (and `runner.dense_layers=[]`) reproduces it on a
  30-layer model.

Budget (the shared knobs, oracle_topk's semantics): B = `budget_tokens`, else
int(`budget_ratio` * the protocol's basis: the final length by default, or the tokens seen,
`runner.budget_basis`), per head and decode step. The official rule uses it as is (`min(T, B)`,
its perplexity script's fixed token budget), so it is not dense before B is reached. The paper's
budgets are token counts (512-4096); `budget_tokens` reproduces them.

Hyperparameters:
    budget_ratio / budget_tokens: tokens attended per head and decode step (see above).
    page_size: tokens per page (paper 16).
    dense_layers: layers attended in full (paper [0, 1]).
    select_per: query_head (official) | kv_head (ours: one page set per KV head).
    current_page: scored (official: the partial page competes, at least min_pages) | forced (ours).
    min_pages: the official minimum of pages per head (3), with current_page=scored.
    group_reduce: max | sum (select_per=kv_head: query-head bounds -> one score per KV head).

Paper's number: up to 7.03x self-attention speedup and 2.23x end-to-end latency (README; the
arXiv v1 abstract swaps the two), with negligible accuracy loss at 4K-token budgets on LongBench.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvcore.guards import size_reason
from kvcore.storage import KV_LAYOUTS
from methods.base import Capabilities, KVLayer, KVMethod, ModelInfo, budget_for, check_budget
from methods.kernels import quest_pages, sparse_attention
from methods.scoring import attention_with_probs, expand_kv, gather_tokens

HEAD_FORMS = ("query_head", "kv_head")  # select_per: the official accuracy path's, or ours
CURRENT_PAGE = ("scored", "forced")  # the official accuracy path's, or ours (its kernels path's)


@dataclass(kw_only=True)
class Quest(KVMethod):
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
    capabilities: ClassVar[Capabilities] = Capabilities(
        selects_tokens=True, kv_layouts=KV_LAYOUTS, evicts_during_decode=False, granularity="page")
    variant_keys: ClassVar[tuple[str, ...]] = ("page_size", "select_per", "current_page",
                                               "min_pages", "group_reduce")
    budget_ratio: float | None = 0.2
    budget_tokens: int | None = None
    page_size: int = 16
    dense_layers: list[int] = field(default_factory=lambda: [0, 1])
    select_per: str = "query_head"
    current_page: str = "scored"
    min_pages: int = 3
    group_reduce: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.dense_layers = list(self.dense_layers)

    def check_hyperparameters(self) -> list[str]:
        reasons = check_budget(self.budget_ratio, self.budget_tokens)
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or self.page_size < 1:
            reasons.append(f"method.page_size={self.page_size!r} must be a positive integer")
        for key, allowed in (("select_per", HEAD_FORMS), ("current_page", CURRENT_PAGE)):
            if getattr(self, key) not in allowed:
                reasons.append(f"method.{key}={getattr(self, key)!r}; allowed: {', '.join(allowed)}")
        if not isinstance(self.min_pages, int) or isinstance(self.min_pages, bool) or self.min_pages < 1:
            reasons.append(f"method.min_pages={self.min_pages!r} must be a positive integer")
        if self.group_reduce in quest_pages.REDUCTIONS and self.group_reduce != "max" \
                and self.select_per == "query_head":
            reasons.append(f"method.group_reduce={self.group_reduce} acts only when a KV head "
                           "selects for its group: set method.select_per=kv_head")
        if self.min_pages != 3 and self.current_page == "forced":
            reasons.append(f"method.min_pages={self.min_pages} acts only with "
                           "method.current_page=scored (the official page count)")
        if self.group_reduce not in quest_pages.REDUCTIONS:
            reasons.append(f"method.group_reduce={self.group_reduce!r}; allowed: "
                           f"{', '.join(quest_pages.REDUCTIONS)}")
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


def select_pages(scores: torch.Tensor, num_tokens: int, page_size: int, budget: int) -> torch.Tensor:
    """Token slots `(B, H_kv, n)` (sorted) to attend, from page scores `(B, H_kv, P)`.

    The current page (the last, p tokens) is always kept; the m = (B - p) // page_size best of the
    other pages are added, so n = p + page_size * m <= budget. Below one page: the last B tokens.
    """
    b, h, pages = scores.shape
    device = scores.device
    current = num_tokens - (pages - 1) * page_size  # tokens in the current page, 1..page_size
    if budget < current:
        slots = torch.arange(num_tokens - budget, num_tokens, device=device)
        return slots.expand(b, h, budget)
    m = min(pages - 1, (budget - current) // page_size)
    tail = torch.arange((pages - 1) * page_size, num_tokens, device=device).expand(b, h, current)
    if m == 0:
        return tail
    top = scores[..., :-1].topk(m, dim=-1).indices.sort(-1).values  # (B, H_kv, m)
    slots = top[..., None] * page_size + torch.arange(page_size, device=device)
    return torch.cat([slots.reshape(b, h, m * page_size), tail], dim=2)


def scored_pages(scores: torch.Tensor, num_tokens: int, page_size: int, budget: int,
                 min_pages: int) -> torch.Tensor:
    """Which tokens each head attends `(B, H, T)` bool, from page scores `(B, H, P)`: the official
    accuracy path (`local_heavy_hitter_mask`): the K = min(max(min_pages, min(T, B) // page_size),
    P) best pages, the partial current page competing as one page (it is counted, and it is not
    forced), every token of a chosen page attended."""
    b, h, pages = scores.shape
    k = min(max(min_pages, min(num_tokens, budget) // page_size), pages)
    top = scores.topk(k, dim=-1).indices  # (B, H, K)
    chosen = torch.zeros(b, h, pages, dtype=torch.bool, device=scores.device).scatter_(2, top, True)
    return chosen.repeat_interleave(page_size, dim=2)[..., :num_tokens]


def scored_allowance(num_tokens: int, page_size: int, budget: int, min_pages: int) -> int:
    """Most tokens a head attends under `scored_pages`: K pages of page_size tokens, K as there
    (at least `min_pages` pages, so a budget below them is exceeded by design)."""
    pages = -(-num_tokens // page_size)
    k = min(max(min_pages, min(num_tokens, budget) // page_size), pages)
    return min(num_tokens, k * page_size)


class QuestLayer(KVLayer):
    def __init__(self, layer_idx: int, info: ModelInfo, method: Quest):
        super().__init__(layer_idx, info)
        self.m = method
        self.page_min: torch.Tensor | None = None  # (B, H_kv, P, D)
        self.page_max: torch.Tensor | None = None  # (B, H_kv, P, D)
        self.slots: torch.Tensor | None = None  # (B, H_kv, n) attended at the last decode step
        self.keep: torch.Tensor | None = None  # (B, H_sel, T) attended (keep-mask forms)
        self._attended: float = 0  # mean tokens per selecting head at the last step
        self._selected = 0  # the most tokens one head attended at the last decode step
        self._step_budget: int | None = None  # B of the last Quest step; None after a dense chunk

    def update(self, keys, values, position_ids):
        before = self.kept_tokens()
        out = super().update(keys, values, position_ids)
        self._refresh_pages(before)
        return out

    def _refresh_pages(self, before: int) -> None:
        """Recompute the bounds of the pages the new tokens touched (the old partial page on)."""
        ps = self.m.page_size
        first = before // ps
        low, high = page_bounds(self.keys[:, :, first * ps:], ps)
        if self.page_min is None or first == 0:
            self.page_min, self.page_max = low, high
        else:
            self.page_min = torch.cat([self.page_min[:, :, :first], low], 2)
            self.page_max = torch.cat([self.page_max[:, :, :first], high], 2)

    def step_budget(self) -> int:
        """B: tokens per head at this decode step (the shared rule, methods/base.py)."""
        return budget_for(self.basis_tokens(), self.m.budget_ratio, self.m.budget_tokens)

    def per_query_head(self) -> bool:
        return self.m.select_per == "query_head" and self.info.group_size > 1

    def page_scores(self, query: torch.Tensor) -> torch.Tensor:
        """(B, H_sel, P): per query head (the official accuracy path scores after repeat_kv; the
        page bounds are repeated for the g heads), or one per KV head by `group_reduce`."""
        low, high = self.page_min, self.page_max
        if self.per_query_head():
            low, high = expand_kv(low, self.info.group_size), expand_kv(high, self.info.group_size)
        return quest_pages.page_scores(query[:, :, 0], low, high, self.m.group_reduce)

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        t = keys.shape[2]
        self.slots = self.keep = None
        if query.shape[2] > 1 or self.holding_prompt():  # a prompt row: dense, as in the paper
            self._step_budget, self._attended = None, t
            return base(module, query, keys, values, attention_mask, **kwargs)
        m = self.m
        budget = self.step_budget()
        scores = self.page_scores(query)  # (B, H_sel, P)
        if m.current_page == "scored":  # the official accuracy path
            self.keep = scored_pages(scores, t, m.page_size, budget, m.min_pages)
            self._step_budget = scored_allowance(t, m.page_size, budget, m.min_pages)
        elif self.per_query_head():  # ours, each query head its own set
            slots = select_pages(scores, t, m.page_size, budget)
            self.keep = torch.zeros(scores.shape[:2] + (t,), dtype=torch.bool,
                                    device=scores.device).scatter_(2, slots, True)
            self._step_budget = budget
        if self.keep is not None:  # (B, H_sel, T): attention restricted per head
            counts = self.keep.sum(-1)
            self._attended = float(counts.float().mean())
            self._selected = int(counts.max())
            keep = expand_kv(self.keep[..., None], query.shape[1] // self.keep.shape[1])
            out, _ = attention_with_probs(query, keys, values, None, kwargs["scaling"],
                                          keep=keep[..., 0][:, :, None])
            return out, None
        self.slots = select_pages(scores, t, m.page_size, budget)  # ours: per KV head, forced
        self._step_budget, self._attended = budget, self.slots.shape[2]
        self._selected = self._attended
        if query.is_cuda and sparse_attention.use_triton(query):  # gather inside the kernel
            out = sparse_attention.sparse_decode_attention(query[:, :, 0], keys, values,
                                                           self.slots, kwargs["scaling"])
            return out[:, None], None  # (B, 1, H_q, D)
        chosen_k, chosen_v = gather_tokens(keys, self.slots), gather_tokens(values, self.slots)
        return base(module, query, chosen_k, chosen_v, None, **kwargs)

    # --- accounting --------------------------------------------------------------------------
    def attended_tokens(self) -> int:
        return self._attended

    def allowed_tokens(self) -> int | None:
        return self._step_budget

    def kept_positions(self) -> torch.Tensor:
        """Positions attended at the last step, `(B, H_sel, n)`: per query head (H_q rows) when
        selection is per query head. With the keep-mask forms heads may attend different
        numbers of tokens; narrower rows are padded to the widest with distinct positions they
        did not attend (a mass recall over them is then an upper bound)."""
        if self.keep is not None:
            order = torch.sort(self.keep.to(torch.uint8), dim=-1, descending=True, stable=True)
            return order.indices[..., : int(self.keep.sum(-1).max())]
        return self.slots if self.slots is not None else super().kept_positions()

    def stats(self) -> dict[str, int]:
        out = super().stats()
        if self.page_min is not None:  # the page bounds are held too (2 / page_size of K)
            out["kv_bytes"] += int(self.page_min.nbytes + self.page_max.nbytes)
        if self._step_budget is not None:
            out["selected_tokens"] = self._selected
        return out
