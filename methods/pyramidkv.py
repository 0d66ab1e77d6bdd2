"""PyramidKV (Cai et al., arXiv 2406.02069): SnapKV's selection with layer-wise pyramid budgets.

Attention funnels from wide in low layers to a few tokens in high layers, so lower layers keep
more and higher layers less, on an arithmetic schedule with the same mean as a uniform budget.
Inside a layer the tokens are chosen exactly as in SnapKV (methods/snapkv.py): pooled votes of
the last `window_tokens` prompt queries, top-k per KV head + the window, once at the end of each
prompt; decoding appends. Paper: matches the full cache on LongBench keeping 12 % of the KV, and
Llama-3-70B reaches 100.0 on Needle-in-a-Haystack with 128 entries (abstract).

Schedule, as the official `PyramidKVCluster.update_kv` (github.com/Zefan-Cai/KVCache-Factory,
formerly PyramidKV), with C = the nominal per-layer
budget (window included), n = prompt tokens seen, L layers, base = C - w:
    n < C: keep everything; C <= n < 2*base: every layer keeps C (plain SnapKV);
    else min = base // beta, max = 2*base - min, clamped to max <= n - w (then min = 2*base - max),
    layer l keeps w + max - l * ((max - min) // (L - 1)).
Floor divisions make the total drift slightly from L*C, as in the official code.

Hyperparameters: SnapKV's (budget, window, kernel, pooling), with SnapKV's defaults: window 32,
kernel 7, max pooling. One observation window for the family is the official protocol:
KVCache-Factory's LongBench/RULER scripts set the same window for SnapKV and PyramidKV (they force
8 for both; its `init_pyramidkv` default is 32); SnapKV's own repository uses 32, which we keep for
both (`method.window_tokens=8` reproduces the script). Plus
    beta: ratio of the bottom to the top layer's prefix budget scale (paper and code: 20).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from methods.budget import require_basis
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.snapkv import SnapKV, SnapKVLayer


@dataclass(kw_only=True)
class PyramidKV(SnapKV):
    name: ClassVar[str] = "pyramidkv"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "prompt compression"
    summary: ClassVar[str] = "SnapKV's selection with pyramid-shaped per-layer budgets (same mean)"
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2406.02069"
    code_url: ClassVar[str | None] = "https://github.com/Zefan-Cai/KVCache-Factory"
    operating_point: ClassVar[str] = (
        "Zefan-Cai/KVCache-Factory: Llama-3-8B-Instruct, Mistral-7B; 64..2048 tokens per "
        "layer on average, beta 20; LongBench (window shared with snapkv)"
    )
    variant_keys: ClassVar[tuple[str, ...]] = ("window_tokens", "beta", "kernel_tokens", "pooling")
    window_tokens: int = 32  # SnapKV's: one observation window for the family (see the docstring)
    beta: int = 20

    def check_hyperparameters(self) -> list[str]:
        reasons = super().check_hyperparameters()
        if not isinstance(self.beta, int) or self.beta < 1:
            reasons.append(f"method.beta={self.beta!r} must be an integer >= 1")
        return reasons

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict:
        # a prefix budget large enough that beta's bottom layer share (base // beta) is not 0
        return {"budget_tokens": max(16, seq_tokens // 4), "window_tokens": 4}

    def layer_budget(self, layer_idx: int, num_layers: int, basis: int) -> int:
        # the official schedule's sequence length is the prompt's: the basis at its end
        return pyramid_budget(self.total_tokens(basis), self.window_tokens, self.beta, layer_idx,
                              num_layers, require_basis(basis))

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return SnapKVLayer(layer_idx, info, self)


def pyramid_budget(capacity: int, window: int, beta: int, layer: int, layers: int, seen: int) -> int:
    """Tokens layer `layer` keeps (window included) under the official pyramid schedule."""
    base = capacity - window
    if seen < capacity or base <= 0:
        return capacity
    if seen < 2 * base or layers == 1:
        return capacity
    min_num = base // beta
    max_num = 2 * base - min_num
    if max_num >= seen - window:
        max_num = seen - window
        min_num = 2 * base - max_num
    steps = (max_num - min_num) // (layers - 1)
    return window + max_num - layer * steps
