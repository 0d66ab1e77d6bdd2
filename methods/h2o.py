"""H2O, the heavy-hitter oracle (Zhang et al., NeurIPS 2023, arXiv 2306.14048).

Keeps the tokens with the largest accumulated attention ("heavy hitters") plus the most recent
ones. The score of a cached token is the sum of the softmax attention it received from every
query while it was in the cache (causal: only preceding queries), per KV head. After every forward
(each decode step, each prefill chunk) the cache is cut to the budget: the last
`recent_ratio * budget` tokens, plus the top-scored tokens among the rest. Evicted K/V never return.

Follows the paper's Alg. 1 and the real-drop cache, with these deliberate choices:
  * scores are computed here, so no eager attention or `output_attentions` is needed from the
    model: a plain decode step on CPU runs one fused kernel (attention + the scores added in
    place, methods/kernels/colsum_attention_cpu.c; metrics.json `method.prepare.decode_attention`
    says whether it ran), anything else `methods.scoring.attention_with_probs`;
  * GQA: a KV head's score is the mean probability over its g query heads, one kept set per KV
    head (the official real-drop code assumes MHA and batch 1 and sums over the batch);
  * a ratio budget is a fraction of the tokens seen so far (the stream's current length), so a
    long prefill drops many tokens at once and decoding evicts as the budget allows; the paper's
    "20 %" = 10 % heavy + 10 % recent is `budget_ratio=0.2, recent_ratio=0.5`;
  * the "global statistics" mask variant of the official lm-eval code (which sums attention from
    future rows, a non-causal oracle) is never used;
  * on the scored-eviction template (methods/eviction.py): the recent tokens are the protected
    ones; in the steady state of decoding the one evicted token per KV head is the argmin of the
    scores outside the recent window (the same set as a top-k), replaced in place by the new one;
  * with `runner.kv_offload=cpu` the kept K/V live on the host tier and the whole kept set is
    fetched every decode step, one layer ahead (the FlexGen+H2O baseline of InfiniGen's Fig. 14);
    scores and positions stay on the compute device, eviction compacts the host store.

Hyperparameters:
    budget_ratio: kept tokens per layer and KV head as a fraction of tokens seen (default 0.2).
    budget_tokens: a fixed number of kept tokens instead; takes precedence over budget_ratio
        (the one budget rule, methods/budget.py).
    recent_ratio: share of the budget given to the most recent tokens (paper: 0.5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvcore.storage import KV_LAYOUTS
from methods.budget import BudgetedMethod
from methods.capabilities import Capabilities
from methods.eviction import EvictionLayer
from methods.kernels import colsum_attention_cpu
from methods.layer import KVLayer
from methods.model import ModelInfo, PrepareContext
from methods.protocol import PREFILL_MODES
from methods.scoring import attention_with_probs, group_column_sums, plain_decode_row


@dataclass(kw_only=True)
class H2O(BudgetedMethod):
    name: ClassVar[str] = "h2o"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "eviction"
    summary: ClassVar[str] = "heavy hitters by accumulated attention plus the most recent tokens"
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2306.14048"
    code_url: ClassVar[str | None] = "https://github.com/FMInference/H2O"
    operating_point: ClassVar[str] = (
        "FMInference/H2O: OPT-6.7B..30B, LLaMA-7B; 20 % of the sequence (10 % heavy + 10 "
        "% recent); lm-eval, XSUM"
    )
    # its `prepare` records which decode-attention kernel the run uses.
    capabilities: ClassVar[Capabilities] = Capabilities(
        prefill_modes=PREFILL_MODES, needs_attn_scores=True, eager_prompt_attention=True,
        offloads_kv=True, selects_tokens=True, kv_layouts=KV_LAYOUTS)
    min_budget_tokens: ClassVar[int] = 2  # one heavy hitter + one recent token
    variant_keys: ClassVar[tuple[str, ...]] = ("recent_ratio",)
    recent_ratio: float = 0.5

    def check_hyperparameters(self) -> list[str]:
        reasons = super().check_hyperparameters()
        if not isinstance(self.recent_ratio, (int, float)) or not 0 <= self.recent_ratio <= 1:
            reasons.append(f"method.recent_ratio={self.recent_ratio!r} must be in [0, 1]")
        return reasons

    def prepare(self, ctx: PrepareContext) -> dict[str, Any]:
        """Records which decode-attention implementation the run uses (its speed depends on it)."""
        return {"decode_attention": colsum_attention_cpu.kernel_name(ctx.device)}

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return H2OLayer(layer_idx, info, self)


class H2OLayer(EvictionLayer):
    accumulates_attention: ClassVar[bool] = True

    def new_state(self, b, h, q, device):
        return {"scores": torch.zeros(b, h, q, device=device)}  # accumulated attention, fp32

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        scores = self.state("scores")  # (B, H_kv, T) fp32, accumulated in place
        if (plain_decode_row(query, attention_mask, kwargs)
                and colsum_attention_cpu.applies(query, keys, values, scores)):
            plan = self.one_token_eviction()  # steady state: the kernel also picks the victim
            evict = None if plan is None else (self.positions, plan[1], plan[2])
            out, slot = colsum_attention_cpu.decode_attention(query, keys, values,
                                                              kwargs["scaling"], scores, evict)
            if plan is not None:
                self.picked = (self.seen_tokens, plan[0], slot)
            return out, None
        out, probs = attention_with_probs(query, keys, values, attention_mask, kwargs["scaling"])
        scores.add_(group_column_sums(probs, keys.shape[1]))
        return out, None

    def score(self) -> torch.Tensor:
        return self.state("scores")

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, min(budget, int(round(self.method.recent_ratio * budget)))
