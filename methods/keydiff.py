"""KeyDiff (Park et al., Qualcomm AI Research, arXiv 2504.15364): evict the least distinctive keys.

Keys that point away from the average key direction tend to receive high attention, so the
score of a key is its negative cosine similarity to the anchor (the mean of the normalized keys
of its KV head, over the tokens in the cache), and a layer keeps its top-N keys per KV head
whenever it holds more than N: after each prefill chunk (the paper's block-wise prompt processing
under a hard memory cap, run for real here: each chunk attends the pruned cache, unlike kvpress's
BlockPress which attends the whole prompt and replays the pruning) and at each decode step. No
attention scores are needed, so it runs on the model's own (SDPA) attention. No sinks are
protected (the paper protects none). Keys are scored as cached, post-RoPE (as kvpress). Paper:
LongBench within 0.04 % of the non-evicting baseline at an 8K budget on Llama-3.1-8B and
Llama-3.2-3B (abstract).

Hyperparameters (the one budget rule, methods/budget.py):
    budget_ratio / budget_tokens: N, the keys kept per layer and KV head (paper: about 8K tokens).
The block size of block-wise prefill is the runner's `prefill_chunk_tokens` (kvpress: 128).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcore.storage import KV_LAYOUTS
from methods.budget import BudgetedMethod
from methods.capabilities import Capabilities
from methods.eviction import EvictionLayer
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.protocol import PREFILL_MODES


@dataclass(kw_only=True)
class KeyDiff(BudgetedMethod):
    name: ClassVar[str] = "keydiff"
    provenance: ClassVar[str] = "paper"
    family: ClassVar[str] = "eviction"
    summary: ClassVar[str] = (
        "drop the keys most similar to the mean key direction (no attention needed)")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2504.15364"
    code_url: ClassVar[str | None] = None
    operating_point: ClassVar[str] = (
        "arXiv 2504.15364 (no official code): Llama-3.1-8B, Llama-3.2-3B; an 8K-token "
        "budget, block-wise prefill; LongBench"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        prefill_modes=PREFILL_MODES, selects_tokens=True, kv_layouts=KV_LAYOUTS)

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return KeyDiffLayer(layer_idx, info, self)


class KeyDiffLayer(EvictionLayer):
    def score(self) -> torch.Tensor:
        return -anchor_cosine(self.keys)


def anchor_cosine(keys: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Cosine of each key `(B, H_kv, T, D)` to its head's mean normalized key, `(B, H_kv, T)` fp32
    (a zero key scores 0; invariant to scaling any key)."""
    unit = keys.float() / keys.float().norm(dim=-1, keepdim=True).clamp_min(eps)
    anchor = unit.mean(dim=2, keepdim=True)  # (B, H_kv, 1, D)
    return (unit * anchor).sum(-1) / anchor.norm(dim=-1).clamp_min(eps)
