"""Quest: query-aware page selection over the full cache (Tang et al., ICML 2024, arXiv 2406.10774).

Spec (reference/methods.md §5, methods-2.md §13.2; official code mit-han-lab/Quest@01c1623bf939,
`evaluation/quest_attention.py` for accuracy, `quest/utils/controller.py` for the kernels path):

* The cache is split into pages of `page_size` tokens (default 16, the paper's). Per page, KV head
  and channel the elementwise min m and max M of the (post-RoPE, as cached) keys are kept and
  updated as tokens arrive. Nothing is evicted: all K/V stay on the device; Quest saves reads.
* At a decode step the criticality of a page is the upper bound U = sum_d max(q_d M_d, q_d m_d)
  (methods/kernels/quest_pages.py: Triton kernel + torch reference). The current (last, possibly
  partial) page is always attended — the official kernels path keeps "the last page" outside the
  top-k (`kv_indices_without_last`) — and the top pages among the others fill the budget.
  Attention is exact softmax over the selected pages' tokens only.
* GQA (`group_reduce`, default `max`): the official accuracy path scores pages after repeat_kv,
  so each query head picks its own pages (a KV head then reads the union, up to g times the
  budget); the official kernels are MHA only. Here one page set per KV head serves its group,
  chosen by the max over the group's query heads of their bounds: a page that is the best for
  any query head of the group ranks as high as for that head, which is the closest one-set
  analogue of the per-query-head selection. `sum` (a bound on the group's summed logit) is the
  alternative. With g = 1 both equal the MHA rule.
* Prefill chunks (q_len > 1) attend densely, as in the paper. Under the run protocol
  `prefill=sparse` the engine feeds the prompt one token at a time and every row is a Quest step.
* Dense layers: the paper keeps layers 0 and 1 dense (`dense_layers`, default [0, 1], keyed on the
  real layer index — the official accuracy code's layer counter starts at 32 and counts down, so
  it leaves no layer dense on models that do not have 32 layers: a quirk not reproduced).

Budget (the shared knobs, oracle_topk's semantics): B = `budget_tokens`, else
int(`budget_ratio` * tokens seen), is the most tokens each KV head attends at a decode step, the
current token included. With the current page holding p tokens, the step attends that page plus
the m = (B - p) // page_size highest-scoring other (full) pages: p + page_size * m <= B, and a
budget covering the sequence attends every page (equal to the full cache). If B < p (a budget
below one page) only the last B tokens of the current page are attended. Deviation: the official
code takes K = max(3, B // page_size) pages (at least 3, so it can exceed small budgets, and it
counts the partial page as a full one); here the page count is derived so the engine's per-step
check `selected_tokens <= allowed_tokens()` always holds. The paper's budgets are token counts
(512-4096); `budget_tokens` reproduces them.

Hyperparameters:
    budget_ratio / budget_tokens: tokens attended per KV head and decode step (see above).
    page_size: tokens per page (paper 16).
    dense_layers: layers attended in full (paper [0, 1]).
    group_reduce: max | sum (GQA: query-head bounds -> one score per KV head).

Paper's number: up to 7.03x self-attention speedup and 2.23x end-to-end latency (README; the
arXiv v1 abstract swaps the two), with negligible accuracy loss at 4K-token budgets on LongBench.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvcore.storage import KV_LAYOUTS
from methods.base import Capabilities, KVLayer, KVMethod, ModelInfo, budget_for, check_budget
from methods.kernels import quest_pages, sparse_attention
from methods.scoring import gather_tokens


@dataclass(kw_only=True)
class Quest(KVMethod):
    name: ClassVar[str] = "quest"
    provenance: ClassVar[str] = "official code"
    operating_point: ClassVar[str] = (
        "mit-han-lab/Quest: LongChat-7B-v1.5-32K, Yarn-Llama-2-7B-128K; page 16, "
        "256..4096-token budget; PG19, passkey, LongBench"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(selects_tokens=True, kv_layouts=KV_LAYOUTS)
    variant_keys: ClassVar[tuple[str, ...]] = ("page_size", "group_reduce")
    budget_ratio: float | None = 0.2
    budget_tokens: int | None = None
    page_size: int = 16
    dense_layers: list[int] = field(default_factory=lambda: [0, 1])
    group_reduce: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.dense_layers = list(self.dense_layers)

    def check_hyperparameters(self) -> list[str]:
        reasons = check_budget(self.budget_ratio, self.budget_tokens)
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or self.page_size < 1:
            reasons.append(f"method.page_size={self.page_size!r} must be a positive integer")
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
        return reasons

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict:
        return {"budget_tokens": seq_tokens, "dense_layers": []}

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


class QuestLayer(KVLayer):
    def __init__(self, layer_idx: int, info: ModelInfo, method: Quest):
        super().__init__(layer_idx, info)
        self.m = method
        self.page_min: torch.Tensor | None = None  # (B, H_kv, P, D)
        self.page_max: torch.Tensor | None = None  # (B, H_kv, P, D)
        self.slots: torch.Tensor | None = None  # (B, H_kv, n) attended at the last decode step
        self._attended = 0
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

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        t = keys.shape[2]
        if query.shape[2] > 1:  # a prefill chunk: dense, as in the paper
            self.slots, self._step_budget, self._attended = None, None, t
            return base(module, query, keys, values, attention_mask, **kwargs)
        budget = budget_for(self.basis_tokens(), self.m.budget_ratio, self.m.budget_tokens)
        scores = quest_pages.page_scores(query[:, :, 0], self.page_min, self.page_max,
                                         self.m.group_reduce)  # (B, H_kv, P)
        self.slots = select_pages(scores, t, self.m.page_size, budget)
        self._step_budget, self._attended = budget, self.slots.shape[2]
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
        return self.slots if self.slots is not None else super().kept_positions()

    def stats(self) -> dict[str, int]:
        out = super().stats()
        if self.page_min is not None:  # the page bounds are held too (2 / page_size of K)
            out["kv_bytes"] += int(self.page_min.nbytes + self.page_max.nbytes)
        if self._step_budget is not None:
            out["selected_tokens"] = self._attended
        return out
