"""Scissorhands (Liu et al., NeurIPS 2023, arXiv 2305.17118): persistence of importance.

Tokens that were pivotal at one step stay pivotal later. Each layer holds a fixed budget; when it
holds more, it drops the tokens that were *unimportant most often* over the last `history_tokens`
queries (attention below the uniform weight 1/T of that query's T visible keys), except the
`recent_tokens` most recent, which have had little chance to prove themselves. Paper: up to 5x
less KV memory without compromising model quality, 20x with 4-bit quantization (abstract).

Provenance: reconstruction. The only released code (lzcemma/Scissorhands@8c7c6425e9c2,
`Decentralized_FM_alpha/modules/hf_opt_dropkv.py`, run by `run_infer_opt_66b_sparse_c4.sh`) is a
perplexity *mask simulation* on OPT-66B, not the method with a budget:
  * it acts inside one full prompt forward (no decode, no cache kept or freed), in layers 5-35 of
    64 and for query rows i >= 100 only;
  * per row the threshold is the value at index int(0.9 * n) of the sorted softmax row, zeros of
    the masked future included (a 90th percentile; 0 when fewer than 10 % of the row is visible,
    so every visible key is then "important");
  * key j stays visible to row i if it exceeded its row's threshold in at least one of the
    previous `LRU_WINDOW` = 100 rows, or if it is among the last `POSITION_WINDOW` = 10
    positions; the other logits are masked and the row renormalised. The kept fraction is only
    logged: there is no budget, and nothing is evicted.
Ours instead is the paper's algorithm with the code's windows, a real eviction under the shared
budget:
  * "important" = attention at or above the uniform weight 1/T of the query's T visible keys (the
    paper's "below average"), not the 90th percentile;
  * a fixed budget per layer and KV head: when a layer holds more, it drops the tokens that were
    unimportant *most often* over the last `history_tokens` (100) queries, except the
    `recent_tokens` (10) most recent (the code's keep rule is "important at least once", without a
    size); in every layer (the code's 5-35 of 64 has no meaning for other depths);
  * counts are per query head and summed over the g query heads of a KV head (a token unimportant
    for every head of its group goes first); one kept set per KV head;
  * drop amount m = 1 per step in decode (the size stays exactly the budget, comparable to H2O);
    a prompt is compressed once at its end under `runner.prefill=dense` (its last
    `history_tokens` rows are the history, as SnapKV's observation window), after every prefill
    chunk under `runner.prefill=chunked`;
  * ties (counts are integers) evict the older token;
  * the history costs `history_tokens` bytes per token per KV head, metadata not counted in the
    KV bytes (as H2O's scores are not).

Hyperparameters (the one budget rule, methods/budget.py):
    budget_ratio / budget_tokens: kept per layer and KV head (paper: 2x-5x compression).
    history_tokens: the history window of queries w (code: 100).
    recent_tokens: the protected recent window r (code: 10).
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
from methods.scoring import attention_with_probs


@dataclass(kw_only=True)
class Scissorhands(BudgetedMethod):
    name: ClassVar[str] = "scissorhands"
    provenance: ClassVar[str] = "reconstruction"
    family: ClassVar[str] = "eviction"
    summary: ClassVar[str] = (
        "drop the tokens most often below uniform attention over a history window")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2305.17118"
    code_url: ClassVar[str | None] = None
    operating_point: ClassVar[str] = (
        "no released method code (only an OPT mask simulation: 90th-percentile threshold, "
        "no budget); paper: OPT-6.7B..66B, 2-5x compression, history 100, recent 10"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        prefill_modes=PREFILL_MODES, needs_attn_scores=True, eager_prompt_attention=True,
        selects_tokens=True, kv_layouts=KV_LAYOUTS)
    variant_keys: ClassVar[tuple[str, ...]] = ("history_tokens", "recent_tokens")
    history_tokens: int = 100
    recent_tokens: int = 10

    def check_hyperparameters(self) -> list[str]:
        reasons = super().check_hyperparameters()
        for key in ("history_tokens", "recent_tokens"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < (key == "history_tokens"):
                reasons.append(f"method.{key}={value!r} must be an integer >= "
                               f"{int(key == 'history_tokens')}")
        if isinstance(self.budget_tokens, int) and isinstance(self.recent_tokens, int) \
                and self.recent_tokens > self.budget_tokens:
            reasons.append(f"method.recent_tokens={self.recent_tokens} is more than "
                           f"method.budget_tokens={self.budget_tokens}: the protected window "
                           f"cannot fit the budget; allowed: 0..{self.budget_tokens}")
        return reasons

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict:
        # a recent window and history below the budget, so that the counts choose
        return {"budget_tokens": max(8, seq_tokens // 6), "recent_tokens": 2, "history_tokens": 8}

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return ScissorhandsLayer(layer_idx, info, self)


class ScissorhandsLayer(EvictionLayer):
    state_fields = ("rows_seen",)

    def __init__(self, layer_idx: int, info: ModelInfo, method: Scissorhands):
        super().__init__(layer_idx, info, method)
        self.rows_seen = 0  # queries so far (the ring position of the history)

    def new_state(self, b, h, q, device):
        # per history row: how many query heads of the group found the token unimportant
        return {"history": torch.zeros(b, h, q, self.method.history_tokens, dtype=torch.uint8,
                                       device=device)}

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        out, probs = attention_with_probs(query, keys, values, attention_mask, kwargs["scaling"])
        rows = min(query.shape[2], self.method.history_tokens)
        counts = low_attention(probs[:, :, -rows:], keys.shape[1])  # (B, H_kv, rows, T)
        first = self.rows_seen + query.shape[2] - rows
        ring = (first + torch.arange(rows, device=keys.device)) % self.method.history_tokens
        self.state("history")[..., ring] = counts.transpose(2, 3).to(torch.uint8)
        self.rows_seen += query.shape[2]
        return out, None

    def score(self) -> torch.Tensor:
        counts = self.state("history").sum(dim=-1, dtype=torch.int32).float()
        return -counts + self.positions / (self.seen_tokens + 1)  # ties: the older token goes

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, min(self.method.recent_tokens, budget)


def low_attention(probs: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Rows `(B, H_q, rows, T)` of a forward's attention (the last rows; the cache's last keys are
    the forward's own tokens) -> per KV head, the number of its query heads for which each key
    got less than 1/T_visible, `(B, H_kv, rows, T)`; keys a row cannot see count as not low."""
    b, h_q, rows, t = probs.shape
    visible = t - rows + 1 + torch.arange(rows, device=probs.device)  # keys each row sees
    allowed = torch.arange(t, device=probs.device)[None, :] < visible[:, None]  # (rows, T)
    low = (probs < 1.0 / visible[:, None]) & allowed
    return low.view(b, num_kv_heads, h_q // num_kv_heads, rows, t).sum(dim=2)
