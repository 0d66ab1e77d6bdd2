"""Knorm (Devoto et al., EMNLP 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression", arXiv 2406.11430): keep the keys with the lowest L2 norm.

Keys with a low L2 norm tend to receive high attention at decoding time, so a key's importance is
its negative norm and no attention is needed (it runs on the model's own SDPA attention). Once per
prompt (the engine's `on_prefill_end`, whatever the chunking), per layer and KV head, the
`budget - window_tokens` lowest-norm keys are kept together with the `window_tokens` most recent
ones; decoding then appends without eviction (or, with `runner.decode_interval_tokens`, is cut
back to the budget by the same norms every that many tokens). Keys are scored as cached, post-RoPE, in fp32.
Paper: the KV cache reduced by 50 % on language modelling and needle-in-a-haystack and by 90 %
on passkey retrieval without losing accuracy (abstract).

Provenance: official code (alessiodevoto/l2compress `cache.py:l2_compress`: keys sorted by
`torch.norm(keys, p=2, dim=-1)`, the lowest kept; its needle and passkey scripts compress once
after the prompt, then generate on the compressed cache) and kvpress's `KnormPress` (the same
score, at prefill only). Differences, each a choice the two references already disagree on:
  * kept count: int(ratio x prompt tokens) (the harness's one budget rule, = kvpress's
    int(T x (1 - compression_ratio))); the official code rounds up (ceil);
  * the official `prune_after` (compress only prompts of at least N tokens) is not a knob: every
    prompt longer than its budget is compressed, as with every method here;
  * layers left uncompressed (the official scripts' `skip_layers`, 0 or 0,1; kvpress: none) are
    the protocol's `runner.dense_layers`, shared by every method;
  * `window_tokens`: the recent tokens kept whatever their norm; 0 (default) as in both
    references; set it to protect the tail of the prompt (the question, in a query-aware prompt).
The official language-modelling script also prunes at every decoded token; that per-step variant
is not offered (it would be a decode-time method; this one compresses the prompt).

Hyperparameters (the one budget rule, methods/budget.py):
    budget_ratio / budget_tokens: keys kept per layer and KV head at the end of a prompt, the
        window included (paper: 10 %-90 % eviction); a ratio is of the prompt's tokens.
    window_tokens: most recent tokens always kept (0: none, as the official code).
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


@dataclass(kw_only=True)
class Knorm(BudgetedMethod):
    name: ClassVar[str] = "knorm"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "prompt compression"
    summary: ClassVar[str] = "once per prompt, keep the keys with the lowest L2 norm per KV head"
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2406.11430"
    code_url: ClassVar[str | None] = "https://github.com/alessiodevoto/l2compress"
    operating_point: ClassVar[str] = (
        "alessiodevoto/l2compress: Llama-2-7B (LongLoRA 32K, 80K), Llama-3-8B; keep ratio "
        "0.1..0.9 of the prompt, layers 0 (or 0, 1) uncompressed; needle, passkey"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        acts_during_decode=False, prefill_modes=("dense",),
        selects_tokens=True, recompresses_during_decode=True, kv_layouts=KV_LAYOUTS)
    variant_keys: ClassVar[tuple[str, ...]] = ("window_tokens",)
    window_tokens: int = 0

    def check_hyperparameters(self) -> list[str]:
        reasons = super().check_hyperparameters()
        if not isinstance(self.window_tokens, int) or self.window_tokens < 0:
            reasons.append(f"method.window_tokens={self.window_tokens!r} must be an integer >= 0")
        return reasons

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return KnormLayer(layer_idx, info, self)


class KnormLayer(EvictionLayer):
    def protected(self, budget: int) -> tuple[int, int]:
        return 0, min(self.method.window_tokens, budget)

    def score(self) -> torch.Tensor:
        return -key_norms(self.keys)


def key_norms(keys: torch.Tensor) -> torch.Tensor:
    """L2 norm of each key `(B, H_kv, T, D)` -> `(B, H_kv, T)`, accumulated in fp32 (a half-precision
    norm would tie distinct keys and hand the choice to top-k's tie-breaking)."""
    return torch.linalg.vector_norm(keys, dim=-1, dtype=torch.float32)
