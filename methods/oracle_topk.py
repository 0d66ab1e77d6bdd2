"""Top-k oracle: each query attends only to the true top-k keys by exact attention score.

An upper bound for every budgeted selection method: at a given budget, no method that attends to
k tokens per KV head can choose better tokens (by the attention mass it keeps) than the exact
top-k of the current query's own scores. Nothing is evicted: the full K/V stays in the cache and
the budget applies to the tokens attended per step (checked through `selected_tokens`), so memory
is the full cache's — this is a selection bound, not a memory method.

GQA: a KV head's score is the mean probability over its g query heads; the top-k set is chosen
per KV head (as H2O and InfiniGen choose per KV head), then every query head of the group
attends to that set, with the softmax renormalised over it.

Prefill follows the run protocol (`runner.prefill`): "dense" = prompt rows attend every causal
key (as every evicting method's prompt does); "sparse" = each prompt row selects its own top-k
among its causal keys, inside multi-token chunks (per-row masks; k from the tokens seen at chunk
end), so the engine need not feed the prompt one token at a time.

Hyperparameters (the one budget rule, methods/budget.py):
    budget_ratio: tokens attended per KV head as a fraction of tokens seen (default 0.2).
    budget_tokens: a fixed number instead; takes precedence over budget_ratio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcore.storage import KV_LAYOUTS
from methods.budget import BudgetedMethod
from methods.capabilities import Capabilities, ServingNeeds
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.scoring import additive_mask, expand_kv, group_mean
from methods.selection import SelectionLayer


@dataclass(kw_only=True)
class OracleTopK(BudgetedMethod):
    name: ClassVar[str] = "oracle_topk"
    provenance: ClassVar[str] = "reference"
    family: ClassVar[str] = "reference"
    summary: ClassVar[str] = "upper bound: each query attends to its exact top-k keys"
    paper_url: ClassVar[str | None] = None
    code_url: ClassVar[str | None] = None
    operating_point: ClassVar[str] = "an upper bound at any budget: each query's exact top-k keys"
    capabilities: ClassVar[Capabilities] = Capabilities(needs_attn_scores=True,
                                                        sparse_prefill_chunked=True,
                                                        selects_tokens=True, kv_layouts=KV_LAYOUTS)
    serving_needs: ClassVar[ServingNeeds] = ServingNeeds(evicts_during_decode=False)

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return OracleTopKLayer(layer_idx, info, self)


class OracleTopKLayer(SelectionLayer):
    def selection_scores(self, query, keys, attention_mask, scaling) -> torch.Tensor:
        """The exact attention probabilities, averaged over each KV head's query heads:
        `(B, H_kv, q, T)` (non-causal keys 0)."""
        h_kv, t = keys.shape[1], keys.shape[2]
        q_len, groups = query.shape[2], query.shape[1] // h_kv
        scores = torch.matmul(query.float(), expand_kv(keys, groups).float().transpose(2, 3))
        scores = scores * scaling + additive_mask(attention_mask, q_len, t, query.device)
        return group_mean(torch.softmax(scores, dim=-1), h_kv)
