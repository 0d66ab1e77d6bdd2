"""The selection template: what every method that keeps every token and attends a chosen subset at
each step shares, so a method writes only its selection scores.

A method on this template (oracle_topk, Quest) writes, on its layer:
  * `selection_scores(query, keys, attention_mask, scaling)`: `(B, H_sel, q, U)` fp32, one score
    per selecting head, query row and unit (higher = attend; -inf = never chosen). H_sel is H_q
    when each query head selects its own set, H_kv when a KV head selects for its group; a unit is
    `unit_tokens` consecutive tokens (1: tokens; Quest: pages, the last one possibly partial);
  * optionally `selection_size(budget, t)` (units chosen per row; default: the budget left after
    the protections, one token per unit), `protected(budget, t)` (the first and last tokens
    attended whatever their score), `step_allowance(budget, t)` (the most tokens a head may
    attend; default the budget), `attends_densely(query)` (default: a prompt held under
    runner.prefill=dense, attended in full) and `fetch(keys, values, slots)` (the K/V rows of
    chosen positions; default: gathered from the stored K/V, every token on the device; a layer
    keeping part of them on the host tier, TailorKV's, fetches those from there).

The template does the rest at every forward:
  * budget: the shared rule (`BudgetedMethod.layer_budget` over the protocol's basis);
  * select: per row, the protected tokens and every token of the top `selection_size` units;
  * fetch: at a decode step, per KV head the union of the sets of the heads it serves (per query
    head: its g heads' sets; per KV head: its own set), gathered from the stored K/V: the rows a
    serving engine reads (on CUDA, a uniform per-KV-head set is gathered inside the sparse kernel);
  * attend: each query head over its own set, exact softmax renormalised over it (prompt chunks,
    several rows: a per-row mask over the whole cache, so chunking changes nothing);
  * accounting: `selected_tokens` (the most one head attended at the last step, checked against
    `allowed_tokens`), `attended_tokens` (the mean over the selecting heads), `kept_positions`.

By default every token stays in the layer's default storage (runner.kv_layout: contiguous or
paged); nothing is evicted. The last query row's scores and choice stay readable (`selection`),
so the shared contract recomputes, at every step, the set a method must attend from its scores.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, ClassVar

import torch

from methods.base import KVMethod
from methods.kernels import sparse_attention
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.scoring import attention_with_probs, gather_tokens


@dataclass(frozen=True)
class Selection:
    """What a layer chose from and chose at its last forward."""

    # (B, H_sel, q, U) fp32, as `selection_scores` returned them; or a function computing them
    # when read (a layer choosing in a fused kernel that never materialises them): `score_rows`
    scores: torch.Tensor | Callable[[], torch.Tensor]
    keep: torch.Tensor  # (B, H_sel, q, T) bool: the tokens each row attended (kept: the last row)
    size: int | torch.Tensor  # units chosen per row from the scores (or per row: (B, H_sel))
    protected: tuple[int, int]  # (first, last) tokens attended whatever their score
    # (B, H_kv, n) text positions of the K/V rows `attend` got, when a layer fetched them before
    # (from the host tier); None: every stored token, in text order
    kv_rows: torch.Tensor | None = None
    # the layer whose query (over its own keys) the scores came from: None, this layer's own; a
    # cross-layer selector's reuse layer names its selecting layer (TidalDecode), and the
    # shared contract then holds the scores and the attended mass to that layer's attention
    source_layer: int | None = None

    def score_rows(self) -> torch.Tensor:
        return self.scores() if callable(self.scores) else self.scores


def kv_union(keep: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """The tokens each KV head serves `(B, H_kv, T)`: the union of its selecting heads' sets,
    `keep (B, H_sel, T)` (H_sel a multiple of H_kv)."""
    b, h_sel, t = keep.shape
    return keep.view(b, num_kv_heads, h_sel // num_kv_heads, t).any(2)


def serving_rows(keep: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows each KV head serves `(B, H_kv, n)`, the union of its selecting heads' sets
    `keep (B, H_sel, T)` in slot order (padded to the widest union with other slots), and which
    of them each selecting head attends `(B, H_sel, n)`. Reads the widest union (a host sync)."""
    union = kv_union(keep, num_kv_heads)  # (B, H_kv, T)
    slots = first_true(union, int(union.sum(-1).max()))
    return slots, keep.gather(2, slots.repeat_interleave(keep.shape[1] // num_kv_heads, dim=1))


def first_true(mask: torch.Tensor, n: int) -> torch.Tensor:
    """Slots `(..., n)`: the True positions of `mask (..., T)` in text order, then (a row holding
    fewer) its first False ones."""
    return torch.sort(mask.to(torch.uint8), dim=-1, descending=True, stable=True).indices[..., :n]


class SelectionLayer(KVLayer):
    """Per-request, per-layer state of a selecting method (see the module docstring)."""

    state_fields = ("selection", "_allowed", "_attended", "_selected")

    unit_tokens = 1
    # a row selecting for one query head scores each unit at least that head's largest q.k
    # (unscaled) over the unit's tokens: an upper bound (Quest's criticality); the shared
    # contract holds the scores to it
    scores_bound_logits: ClassVar[bool] = False
    # the scores are the exact attention probabilities of the source layer's query (per query
    # head, or the group's mean per KV head): the shared contract recomputes them itself
    scores_are_attention: ClassVar[bool] = False
    # the layer whose query scores this layer's tokens (None: its own); set by a cross-layer
    # selector and recorded in each `Selection`
    source_layer: int | None = None

    def __init__(self, layer_idx: int, info: ModelInfo, method: KVMethod):
        super().__init__(layer_idx, info)
        self.method = method
        self.selection: Selection | None = None  # the last forward's; None after a dense one
        self._allowed: int | None = None  # the most tokens a head may attend at the last step
        self._attended: float = 0  # tokens per selecting head at the last step (mean)
        self._selected = 0  # the most tokens one head attended at the last step

    # --- what a method writes ---------------------------------------------------------------
    def selection_scores(self, query, keys, attention_mask, scaling) -> torch.Tensor:
        """`(B, H_sel, q, U)` fp32 (see the module docstring)."""
        raise NotImplementedError

    def protected(self, budget: int, t: int) -> tuple[int, int]:
        """(first, last) tokens attended whatever their score."""
        return 0, 0

    def selection_size(self, budget: int, t: int) -> int:
        """Units chosen per row from the scores."""
        first, last = self.protected(budget, t)
        return max(0, budget - first - last) // self.unit_tokens

    def step_allowance(self, budget: int, t: int) -> int:
        """The most tokens one head may attend at this step (the budget, unless the method's own
        rule exceeds it by design)."""
        return budget

    def attends_densely(self, query: torch.Tensor) -> bool:
        return self.holding_prompt()

    def step_budget(self) -> int:
        """The shared rule's budget for this layer now (methods.budget.BudgetedMethod; a method
        with a rule of its own overrides this)."""
        return self.method.layer_budget(self.layer_idx, self.info.num_layers, self.basis_tokens())

    def fetch(self, keys, values, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `(B, H_kv, n, D)` at text positions `slots (B, H_kv, n)` (ascending), from
        what `update` returned (here: every token)."""
        return gather_tokens(keys, slots), gather_tokens(values, slots)

    # --- select, fetch, attend --------------------------------------------------------------
    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        if self.attends_densely(query):
            self.selection, self._allowed, self._attended = None, None, keys.shape[2]
            return base(module, query, keys, values, attention_mask, **kwargs)
        t = self.seen_tokens
        scaling = kwargs.get("scaling")
        scaling = module.scaling if scaling is None else scaling
        budget = self.step_budget()
        scores = self.selection_scores(query, keys, attention_mask, scaling)
        chosen = self.choose(scores, budget, t)
        self._allowed = self.step_allowance(budget, t)
        counts = chosen.keep[:, :, -1].sum(-1)  # (B, H_sel): the last row's
        self._attended, self._selected = float(counts.float().mean()), int(counts.max())
        if query.shape[2] == 1:
            self.selection = chosen
            return self.fetch_and_attend(module, query, keys, values, chosen.keep[:, :, 0], base,
                                         scaling, kwargs)
        # a chunk: only its last row is kept (every layer holding q x T scores would add up)
        self.selection = replace(chosen, scores=chosen.scores[:, :, -1:].clone(),
                                 keep=chosen.keep[:, :, -1:].clone())
        groups = query.shape[1] // chosen.keep.shape[1]
        out, _ = attention_with_probs(query, keys, values, attention_mask, scaling,
                                      keep=chosen.keep.repeat_interleave(groups, dim=1))
        return out, None

    def choose(self, scores: torch.Tensor, budget: int, t: int) -> Selection:
        """Per row: the protected tokens and every token of the top `selection_size` units."""
        first, last = self.protected(budget, t)
        size = min(self.selection_size(budget, t), scores.shape[-1])
        top = scores.topk(size, dim=-1).indices
        keep = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        keep.scatter_(-1, top, True)
        if self.unit_tokens > 1:
            keep = keep.repeat_interleave(self.unit_tokens, dim=-1)[..., :t]
        keep[..., :first] = True
        keep[..., t - last:] = True  # (last = 0: an empty slice)
        return Selection(scores, keep, size, (first, last), source_layer=self.source_layer)

    def fetch_and_attend(self, module, query, keys, values, keep, base, scaling, kwargs):
        """One decode row: each KV head's union of sets fetched, each query head attending its
        own set of it. `keep (B, H_sel, T)`."""
        slots, own = serving_rows(keep, keys.shape[1])  # (B, H_kv, n), (B, H_sel, n)
        every_token = keys.shape[2] == self.seen_tokens  # all on the device: the kernel gathers
        if every_token and self.sparse_kernel(query) and bool(own.all()):
            out = sparse_attention.sparse_decode_attention(query[:, :, 0], keys, values, slots,
                                                           scaling)
            return out[:, None], None  # (B, 1, H_q, D): gathered inside the kernel
        return self.attend_rows(module, query, *self.fetch(keys, values, slots), own, base,
                                scaling, kwargs)

    def attend_rows(self, module, query, keys, values, own, base, scaling, kwargs):
        """One decode row over K/V rows already fetched `(B, H_kv, n, D)`, each query head over
        its own of them, `own (B, H_sel, n)`."""
        if bool(own.all()):  # every head attends all its KV head fetched: the model's attention
            return base(module, query, keys, values, None, **kwargs)
        own = own.repeat_interleave(query.shape[1] // own.shape[1], dim=1)  # (B, H_q, n)
        out, _ = attention_with_probs(query, keys, values, None, scaling, keep=own[:, :, None])
        return out, None

    def sparse_kernel(self, query: torch.Tensor) -> bool:
        """Whether the sparse attention kernel serves a decode row (Triton, on CUDA)."""
        return query.is_cuda and sparse_attention.use_triton(query)

    # --- accounting -------------------------------------------------------------------------
    def attended_tokens(self) -> float:
        return float(self._attended)  # a layer may keep it on the device until read

    def allowed_tokens(self) -> int | None:
        return self._allowed

    def kept_positions(self) -> torch.Tensor:
        """Positions attended at the last step's last row, `(B, H_sel, n)` (H_q rows when each
        query head selects). Rows attending fewer than the widest are padded with distinct
        positions they did not attend (a mass recall over them is then an upper bound)."""
        if self.selection is None:
            return super().kept_positions()
        return first_true(self.selection.keep[:, :, -1], self._selected)

    def selection_stats(self) -> dict[str, int]:
        """`selected_tokens` after a selecting step (for a layer writing its own `stats`)."""
        return {} if self.selection is None else {"selected_tokens": self._selected}

    def stats(self) -> dict[str, int]:
        return {**super().stats(), **self.selection_stats()}
