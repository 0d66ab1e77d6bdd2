"""R-KV (Cai et al., arXiv 2505.24133, "R-KV: Redundancy-aware KV Cache Compression for Reasoning
Models"): compress while generating, keeping tokens that are important and not redundant.

Per layer and KV head, at the prompt's end (the engine's `on_prefill_end`, whatever the chunking)
and then every `buffer_tokens` tokens fed after it (the official decoding-time buffer), once the
cache holds at least its budget:
  * importance: the last `window_tokens` queries (the observation window, prompt or decoded
    rows) attend over the kept tokens outside the window: logits q.k / sqrt(D), the maximum over
    the query heads of the KV head (GQA), fp32 softmax over those tokens, the mean over the
    window rows, then max-pooled along the text over `kernel_tokens` (stride 1);
  * redundancy: the cosine similarity of every pair of kept keys (post-RoPE, as cached; the
    diagonal 0); for each key, its similarity to the most recent other key with similarity above
    `similarity_threshold` is set to 0 (that neighbour is the one copy kept), and a key's
    redundancy is the mean of its column, softmax over the kept tokens;
  * score = mix_lambda x importance - (1 - mix_lambda) x redundancy; the window plus the top
    `budget - window_tokens` scores are kept (the window always).
Between compressions the cache grows by the new tokens, so it never holds more than the budget
plus `buffer_tokens`. Positions stay the original ones. Paper: on DeepSeek-R1-Distill-Llama-8B
and -Qwen-14B, with 10 % (Llama-8B) or 16 % (Qwen-14B) of the KV cache R-KV keeps 100 % of the
full cache's reasoning accuracy, and 105 % at its best (abstract).

Provenance: official code (Zefan-Cai/R-KV `rkv/compression/r1_kv.py` `R1KV.update_kv`,
`rkv/utils.py` `compute_attention_scores` and `cal_similarity`, `rkv/modeling.py` for when it
runs, `run_math.py` for the defaults), followed step for step. Differences:
  * when it compresses after the prompt: every `buffer_tokens` tokens since the last compression
    (kvpress's decoding semantics, the harness's `runner.decode_interval_tokens`); the official
    loop compresses when the total length (prompt included) passes a multiple of 128, so its first
    decode compression can come sooner;
  * neighbours are in text order: the official code pools and finds "the most recent" similar
    key in cache-slot order, which is text order only until the first compression (its top-k
    does not sort the kept slots); a key with no similar one has its similarity to the oldest
    kept key zeroed (the official: slot 0's, the same token at the first compression);
  * every sequence of a batch is scored on its own keys (the official redundancy reads batch
    row 0 only), and the budget is the harness's one rule (`budget_tokens`, or `budget_ratio` of
    the budget basis), window included as in the official `budget`.
`mix_lambda` 0.07 is the default of the official scripts (`run_math.py`); the README's table says
0.1. The official `first_tokens` option is accepted and unused there, so no sinks are kept.

Hyperparameters (the one budget rule, methods/budget.py):
    budget_ratio / budget_tokens: tokens kept per layer and KV head after each compression,
        window included (official scripts: 128 .. 4096 tokens).
    window_tokens: observation window, always kept (official alpha: 8).
    kernel_tokens: max-pooling kernel of the importance, odd (official: 7).
    mix_lambda: weight of importance against redundancy (official scripts: 0.07).
    buffer_tokens: tokens fed between two compressions while decoding (official: 128).
    similarity_threshold: cosine above which two keys are near-duplicates (official: 0.5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcore.storage import KV_LAYOUTS
from methods.budget import BudgetedMethod
from methods.capabilities import Capabilities
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.snapkv import SnapKVLayer, pool_along_text


@dataclass(kw_only=True)
class RKV(BudgetedMethod):
    name: ClassVar[str] = "rkv"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "decoding compression"
    summary: ClassVar[str] = (
        "every 128 decoded tokens, keep the window plus the top of the window's pooled attention "
        "minus key redundancy (cosine similarity)")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2505.24133"
    code_url: ClassVar[str | None] = "https://github.com/Zefan-Cai/R-KV"
    operating_point: ClassVar[str] = (
        "Zefan-Cai/R-KV: DeepSeek-R1-Distill-Llama-8B and -Qwen-14B; 128..4096-token budget, "
        "buffer 128, window 8, kernel 7, lambda 0.07 (scripts; README 0.1); MATH-500, AIME-24 "
        "reasoning traces of up to 16K..32K tokens"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        needs_attn_scores=True, prefill_modes=("dense",), selects_tokens=True,
        kv_layouts=KV_LAYOUTS)
    variant_keys: ClassVar[tuple[str, ...]] = ("window_tokens", "mix_lambda", "buffer_tokens")
    window_tokens: int = 8
    kernel_tokens: int = 7
    mix_lambda: float = 0.07
    buffer_tokens: int = 128
    similarity_threshold: float = 0.5

    def check_hyperparameters(self) -> list[str]:
        reasons = super().check_hyperparameters()
        for knob in ("window_tokens", "buffer_tokens"):
            value = getattr(self, knob)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                reasons.append(f"method.{knob}={value!r} must be a positive integer")
        k = self.kernel_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k <= 0 or not k % 2:
            reasons.append(f"method.kernel_tokens={k!r} must be a positive odd integer")
        for knob in ("mix_lambda", "similarity_threshold"):
            value = getattr(self, knob)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                reasons.append(f"method.{knob}={value!r} must be a number in [0, 1]")
        return reasons

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict:
        # a window well below the budget and a buffer that passes within a short decode
        return {"budget_tokens": max(8, seq_tokens // 6), "window_tokens": 4, "buffer_tokens": 4}

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return RKVLayer(layer_idx, info, self)


class RKVLayer(SnapKVLayer):
    """SnapKV's recorded window queries and prompt-end compression; R-KV's score and buffer."""

    compress_at: ClassVar[str] = "prefill_end"  # then every `buffer_tokens` while decoding

    def decode_interval(self) -> int:
        return self.method.buffer_tokens

    def score(self) -> torch.Tensor:
        m = self.method
        queries = self.window_queries  # (B, H_q, w, D) at text positions seen - w .. seen - 1
        outside = self.positions < self.seen_tokens - queries.shape[2]  # (B, H_kv, T)
        importance = window_importance(queries, self.keys, outside)
        importance = pool_along_text(importance, self.positions, outside, m.kernel_tokens, "max")
        redundancy = key_redundancy(self.keys, self.positions, m.similarity_threshold)
        return m.mix_lambda * importance - (1 - m.mix_lambda) * redundancy


def window_importance(queries: torch.Tensor, keys: torch.Tensor, outside: torch.Tensor
                      ) -> torch.Tensor:
    """Attention of the window rows `(B, H_q, w, D)` over the `outside (B, H_kv, T)` keys
    `(B, H_kv, T, D)`, `(B, H_kv, T)` fp32 (0 elsewhere): logits / sqrt(D), the maximum over the
    KV head's query heads, softmax over the outside keys, the mean over the rows."""
    b, h_q, w, d = queries.shape
    h_kv = keys.shape[1]
    rows = queries.float().view(b, h_kv, h_q // h_kv, w, d)
    logits = (rows @ keys.float()[:, :, None].transpose(-1, -2)) / math.sqrt(d)  # (B,H_kv,g,w,T)
    logits = logits.amax(dim=2).masked_fill(~outside[:, :, None], float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num_(0.0).mean(dim=2)


def key_redundancy(keys: torch.Tensor, positions: torch.Tensor, threshold: float) -> torch.Tensor:
    """Redundancy of every key `(B, H_kv, T, D)` at `positions (B, H_kv, T)`, `(B, H_kv, T)`
    fp32: cosine similarities with the diagonal 0 and, per row, the most recent near-duplicate's
    entry 0 (the oldest key's when there is none); column means, softmax over the keys."""
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    cos = k @ k.transpose(-1, -2)  # (B, H_kv, T, T): row i, column j
    t = cos.shape[-1]
    cos.diagonal(dim1=-2, dim2=-1).zero_()
    later = positions.float()[..., None, :].expand_as(cos)  # column j's position, per row
    similar = torch.where(cos > threshold, later, float("-inf"))
    newest = similar.argmax(dim=-1, keepdim=True)  # (B, H_kv, T, 1)
    oldest = positions.argmin(dim=-1)[..., None, None].expand(*cos.shape[:-1], 1)
    none = torch.isinf(similar.amax(dim=-1, keepdim=True))
    cos.scatter_(-1, torch.where(none, oldest, newest), 0.0)
    return torch.softmax(cos.sum(dim=-2) / t, dim=-1)
