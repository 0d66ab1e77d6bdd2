"""KVMerger, "Model Tells You Where to Merge" (Wang, Jin, Yu, Zhang; arXiv 2407.08454): merge runs
of similar adjacent keys instead of evicting them.

Within one sequence the keys of neighbouring tokens are very similar, so at the end of every prompt
(the engine's `on_prefill_end`, whatever the chunking), per layer, the prompt is cut into
contiguous *merging sets* of tokens whose adjacent keys are similar, and each set becomes one KV
pair: the Gaussian-kernel-weighted mean of its members, centred on its most attended ("pivotal")
token. Decoding then appends without merging. Paper: on Llama-2-7B/13B-chat, LongBench and
ZeroScrolls at 50 % and 35 % KV budgets, better than H2O and CaM (abstract).

No official code was released (KVCache-Factory's `merge_kv` is only "inspired by" it), and the
paper's text could not be read here (only its abstract, an OpenReview summary and reviews, and
third-party notes): the rule below is the paper's as those secondary sources describe it
("[reported]"), each part labelled with what backs it. Provenance: reconstruction.
  * Merging sets by a fixed threshold (`similarity_threshold` 0.75; [reported]): adjacent tokens
    i, i+1 join a set when cos(k_i, k_{i+1}) >= the threshold (post-RoPE keys as cached, text
    order); a set is a maximal such run. The kept size is therefore an *outcome*, not a budget:
    the paper's 50 % / 35 % figures are what its threshold yields, and "KV cache sparsity from the
    similarity perspective is persistent at the model level" (abstract). It is reported as the
    run's `kv.tokens_per_layer` / `kv.held_ratio`.
  * Never merged: the last `recent_ratio` (17 %) of the prompt and the `heavy_ratio` (12 %) of the
    other tokens with the highest aggregated attention ([reported]; an OpenReview reviewer: "the
    method also retains anything with a top-k attention score").
  * Pivot and heavy hitters by the aggregated attention every prompt query gives a token (H2O's
    accumulated column sums, averaged over the query heads of a KV head) [our reading of
    "aggregated attention"].
  * Weights g_i = exp(-|k_p - k_i|^2 / (2 sigma^2)) with a fixed `sigma` (5; [reported]),
    normalised over the set; merged K and V are the weighted sums, stored at the pivot's position
    (merged keys keep a mixed RoPE phase; never re-rotated). A singleton set is its token, exact.
  * The last `unmerged_last_layers` (1) layers are never merged ([reported]; a third-party summary:
    the first two and the last layer attend too uniformly to merge; the first two are the
    protocol's `runner.dense_layers=[0,1]` here).
Our choices where the paper is silent or our cache needs one shape per layer:
  * one set structure per layer, shared by its KV heads (the K/V tensors are rectangular): a pair
    joins only when it is similar in every KV head (min of the heads' cosines), and the heavy
    hitters are the tokens with the most attention summed over the heads; pivots and weights are
    per KV head;
  * a later prompt (multi-turn) merges what the layer holds then, a merged pair counting as one
    token.
A merged pair stands for several tokens but receives the attention mass of one: the information
loss that merging trades against eviction (no log-count compensation, which KVMerger lacks).

Budget: none. KVMerger has no `budget_ratio` / `budget_tokens` knob (a sweep setting one skips it
with a one-line reason): the threshold decides the kept size; move along the size axis with
`similarity_threshold` (a lower threshold merges more). What a layer may hold after a prompt is the
size its threshold left plus one token per decode step (`allowed_tokens`).

Hyperparameters:
    similarity_threshold: adjacent-key cosine at or above which tokens merge (0.75).
    recent_ratio: share of the prompt's last tokens never merged (0.17).
    heavy_ratio: share of the prompt's most attended tokens never merged (0.12).
    sigma: the Gaussian kernel's width (5.0).
    unmerged_last_layers: last layers left unmerged (1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvcore.storage import KV_LAYOUTS
from methods.base import KVMethod
from methods.capabilities import Capabilities
from methods.eviction import EvictionLayer, keep_tokens
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.scoring import attention_with_probs, gather_tokens, group_column_sums


@dataclass(kw_only=True)
class KVMerger(KVMethod):
    name: ClassVar[str] = "kvmerger"
    provenance: ClassVar[str] = "reconstruction"
    family: ClassVar[str] = "merging"
    summary: ClassVar[str] = (
        "once per prompt, merge runs of similar adjacent keys around their most attended token")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2407.08454"
    code_url: ClassVar[str | None] = None
    operating_point: ClassVar[str] = (
        "paper only (arXiv 2407.08454, no code): Llama-2-7B/13B-chat; threshold 0.75, 17 % "
        "recent + 12 % most attended never merged, sigma 5, last layer unmerged (secondary "
        "descriptions, unverified here); 50 % / 35 % KV; LongBench, ZeroScrolls"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        needs_attn_scores=True, eager_prompt_attention=True, acts_during_decode=False,
        prefill_modes=("dense",), selects_tokens=True, kv_layouts=KV_LAYOUTS)
    axis_keys: ClassVar[tuple[str, ...]] = ("similarity_threshold",)
    variant_keys: ClassVar[tuple[str, ...]] = ("recent_ratio", "heavy_ratio", "sigma")
    similarity_threshold: float = 0.75
    recent_ratio: float = 0.17
    heavy_ratio: float = 0.12
    sigma: float = 5.0
    unmerged_last_layers: int = 1

    def check_hyperparameters(self) -> list[str]:
        reasons = []
        if not isinstance(self.similarity_threshold, (int, float)) or not \
                -1 <= self.similarity_threshold <= 1:
            reasons.append(f"method.similarity_threshold={self.similarity_threshold!r} must be "
                           "in [-1, 1] (a cosine)")
        for key in ("recent_ratio", "heavy_ratio"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not 0 <= value <= 1:
                reasons.append(f"method.{key}={value!r} must be in [0, 1]")
        if not isinstance(self.sigma, (int, float)) or self.sigma <= 0:
            reasons.append(f"method.sigma={self.sigma!r} must be positive")
        if not isinstance(self.unmerged_last_layers, int) or self.unmerged_last_layers < 0:
            reasons.append(f"method.unmerged_last_layers={self.unmerged_last_layers!r} must be an "
                           "integer >= 0")
        return reasons

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict:
        return {"recent_ratio": 1.0}  # every token protected: nothing merges

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict:
        # a random tiny model's adjacent keys are far less alike than a trained one's: a low
        # threshold so that sets form, every layer merged
        return {"similarity_threshold": 0.0, "recent_ratio": 0.1, "heavy_ratio": 0.1,
                "unmerged_last_layers": 0}

    def layer_budget(self, layer_idx: int, num_layers: int, basis: int) -> int:
        raise NotImplementedError("kvmerger has no budget rule: its threshold decides the size")

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return KVMergerLayer(layer_idx, info, self)


class KVMergerLayer(EvictionLayer):
    """The scored-eviction template's storage, prompt-end timing and decode appends; the prompt
    is merged by the threshold rule instead of cut to a budget."""

    state_fields = ("merged_size",)

    selects_top_scores: ClassVar[bool] = False  # merged sets, not the top scores (its own test)

    def __init__(self, layer_idx: int, info: ModelInfo, method: KVMerger):
        super().__init__(layer_idx, info, method)
        self.merged_size: int | None = None  # tokens kept after the last prompt (the outcome)

    def new_state(self, b, h, q, device):
        return {"attention": torch.zeros(b, h, q, device=device)}  # accumulated, H2O's

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        if not self.holding_prompt():  # decode: nothing to accumulate (no merging in decode)
            return base(module, query, keys, values, attention_mask, **kwargs)
        out, probs = attention_with_probs(query, keys, values, attention_mask, kwargs["scaling"])
        self.state("attention").add_(group_column_sums(probs, keys.shape[1]))
        return out, None

    def score(self) -> torch.Tensor:
        return self.state("attention")

    def budget(self) -> int:
        """Not a budget: the size the threshold left at the last prompt's end (the held tokens
        before any prompt ended)."""
        return self.kept_tokens() if self.merged_size is None else self.merged_size

    def on_prefill_end(self) -> None:
        if self.layer_idx < self.info.num_layers - self.method.unmerged_last_layers:
            self.merge()
        self.merged_size = self.kept_tokens()
        self.granted = (self.merged_size, self.seen_tokens)

    def merge(self) -> None:
        n = self.kept_tokens()
        if n < 2:
            return
        order = self.positions.argsort(dim=-1)  # (B, H_kv, T) slots in text order
        keys = gather_tokens(self.keys, order).float()  # (B, H_kv, T, D)
        values = gather_tokens(self.values, order).float()
        scores = self.score().float().gather(-1, order)
        protect = protected_tokens(scores, self.method.recent_ratio, self.method.heavy_ratio)
        set_id, sets = merging_sets(keys, protect, self.method.similarity_threshold)
        if sets == n:
            return  # nothing merges
        pivot = pivots(scores, set_id, sets)
        merged_keys, merged_values = gaussian_merge(keys, values, set_id, pivot, sets,
                                                    self.method.sigma)
        self.kept_count = keep_tokens(self._token_rows(), order.gather(-1, pivot))
        for name, merged in (("keys", merged_keys), ("values", merged_values)):
            rows = self.kv_rows(name)
            rows.write_at(0, merged.to(rows.view().dtype))
        self._views()


def protected_tokens(scores: torch.Tensor, recent_ratio: float,
                     heavy_ratio: float) -> torch.Tensor:
    """Tokens never merged, `(B, T)` bool over the text-ordered tokens of a layer: the last
    int(recent_ratio * T) and, among the others, the int(heavy_ratio * T) with the most attention
    summed over the KV heads (scores `(B, H_kv, T)`, text order)."""
    b, _, t = scores.shape
    recent = (torch.arange(t, device=scores.device) >= t - int(recent_ratio * t)).expand(b, t)
    heavy = min(int(heavy_ratio * t), int((~recent).sum(-1).min()))
    total = scores.sum(1).masked_fill(recent, float("-inf"))
    top = torch.zeros_like(recent)
    if heavy:
        top.scatter_(-1, total.topk(heavy, dim=-1).indices, True)
    return recent | top


def merging_sets(keys: torch.Tensor, protect: torch.Tensor,
                 threshold: float) -> tuple[torch.Tensor, int]:
    """Set of each token of `keys (B, H, T, D)` (text order), `(B, H, T)` ids 0..S-1, and S: a
    token joins its predecessor's set when their keys' cosine is >= `threshold` in every KV head
    (and batch row) and neither is protected (`protect (B, T)`); every set is a contiguous run."""
    similarity = F.cosine_similarity(keys[:, :, 1:], keys[:, :, :-1], dim=-1)  # (B, H, T-1)
    joined = similarity.amin(dim=(0, 1)) >= threshold  # (T-1,)
    free = ~protect.any(0)  # (T,)
    joined &= free[1:] & free[:-1]
    starts = torch.cat([joined.new_ones(1), ~joined])
    set_id = starts.long().cumsum(0) - 1
    return set_id.expand(*keys.shape[:3]), int(starts.sum())


def pivots(scores: torch.Tensor, set_id: torch.Tensor, sets: int) -> torch.Tensor:
    """Index of each set's highest-scored member (the first on ties), `(B, H, sets)`."""
    best = scores.new_full((*scores.shape[:2], sets), float("-inf"))
    best = best.scatter_reduce(-1, set_id, scores, "amax")
    members = torch.arange(scores.shape[-1], device=scores.device).expand_as(set_id)
    candidates = members.masked_fill(scores < best.gather(-1, set_id), scores.shape[-1])
    first = torch.full_like(best, scores.shape[-1], dtype=torch.long)
    return first.scatter_reduce(-1, set_id, candidates, "amin")


def gaussian_merge(keys: torch.Tensor, values: torch.Tensor, set_id: torch.Tensor,
                   pivot: torch.Tensor, sets: int, sigma: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian-kernel-weighted K and V of each set, `(B, H, sets, D)` fp32, centred on its
    pivot: g_i = exp(-|k_p - k_i|^2 / (2 sigma^2)), normalised over the set."""
    def per_set(x: torch.Tensor) -> torch.Tensor:  # (B, H, T) -> sums per set (B, H, sets)
        return x.new_zeros((*x.shape[:2], sets)).scatter_add_(-1, set_id, x)

    centre = gather_tokens(gather_tokens(keys, pivot), set_id)  # each token's pivot key
    dist = (keys - centre).pow(2).sum(dim=-1)  # (B, H, T)
    weight = torch.exp(-dist / (2 * sigma ** 2))
    weight = (weight / per_set(weight).gather(-1, set_id))[..., None]  # (B, H, T, 1)

    def merge(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros((*x.shape[:2], sets, x.shape[-1]))
        return out.scatter_add_(2, set_id[..., None].expand_as(x), weight * x)

    return merge(keys), merge(values)
