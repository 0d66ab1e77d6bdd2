"""The one budget rule of every method (README "Budgets"): the config knobs are `budget_tokens`
(tokens per layer and KV head) and `budget_ratio` (a fraction of the protocol's budget basis,
`KVLayer.basis_tokens()`: the sequence's final length by default, or the tokens seen so far);
when `budget_tokens` is set it takes precedence over `budget_ratio`, so a sweep can set either
without nulling the other. A method's own size knobs (StreamingLLM's `window_tokens`) apply only
when both are null. The per-layer figure a layer reports is `KVLayer.allowed_tokens()`.

`BudgetedMethod` is the method with the shared knobs and their rule, and the per-layer and
per-head allocation hooks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from methods.base import KVMethod


def check_budget(budget_ratio, budget_tokens) -> list[str]:
    """Shared budget checks: a positive token count, or a ratio in (0, 1]."""
    if budget_tokens is not None:
        if not isinstance(budget_tokens, int) or isinstance(budget_tokens, bool) or budget_tokens <= 0:
            return [f"method.budget_tokens={budget_tokens!r} must be a positive integer"]
        return []
    if budget_ratio is None:
        return ["method.budget_ratio or method.budget_tokens must be set"]
    if not isinstance(budget_ratio, (int, float)) or not 0 < budget_ratio <= 1:
        return [f"method.budget_ratio={budget_ratio!r} must be in (0, 1]"]
    return []


def budget_for(basis_tokens: int | None, budget_ratio: float | None, budget_tokens: int | None,
               minimum: int = 1) -> int:
    """Tokens allowed when a ratio budget applies to `basis_tokens` (`KVLayer.basis_tokens()`);
    `budget_tokens` takes precedence over the ratio (and needs no basis)."""
    if budget_tokens is not None:
        return budget_tokens
    return max(minimum, int(budget_ratio * require_basis(basis_tokens)))


def require_basis(basis_tokens: int | None) -> int:
    """The budget basis, or a clear error where a ratio budget has none to apply to."""
    if basis_tokens is None:
        raise RuntimeError(
            "a ratio budget under runner.budget_basis=final needs the sequence's final length, "
            "and none was given: a stream of decode steps declares it "
            "(Engine.request(final_tokens=N)); a prompt sets it when it is fed")
    return basis_tokens


@dataclass(kw_only=True)
class BudgetedMethod(KVMethod):
    """The shared budget knobs and their one rule; `layer_budget` is the per-layer allocation hook."""

    budget_ratio: float | None = 0.2
    budget_tokens: int | None = None
    min_budget_tokens: ClassVar[int] = 1  # a ratio budget never goes below this
    # the budget is first applied when a dense prompt is compressed (KVMethod.prompt_end_knobs)
    prompt_end_knobs: ClassVar[tuple[str, ...]] = ("budget_ratio", "budget_tokens")

    def check_hyperparameters(self) -> list[str]:
        return check_budget(self.budget_ratio, self.budget_tokens)

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict:
        return {"budget_tokens": seq_tokens}

    def total_tokens(self, basis: int) -> int:
        """Tokens one layer keeps under a uniform allocation when the budget basis is `basis`
        tokens (`KVLayer.basis_tokens()`: the final length, or the tokens seen)."""
        return budget_for(basis, self.budget_ratio, self.budget_tokens, minimum=self.min_budget_tokens)

    def layer_budget(self, layer_idx: int, num_layers: int, basis: int) -> int:
        """Per-layer allocation hook: tokens layer `layer_idx` of `num_layers` keeps when the
        budget basis is `basis` tokens (uniform by default; PyramidKV's pyramid,
        SqueezeAttention's clusters)."""
        return self.total_tokens(basis)

    def head_budgets(self, scores: torch.Tensor, budget: int, layer_idx: int) -> torch.Tensor:
        """Per-head allocation hook: tokens each KV head keeps, `(B, H_kv)` int64, given the
        layer's guarded scores `(B, H_kv, T)` fp32 (protected tokens +inf, slots a head does not
        hold -inf) and the layer's budget (uniform by default: every head keeps `budget`; AdaKV
        splits H_kv x budget by a flattened top-k; HeadKV by static per-(layer, head) scores, hence
        `layer_idx`)."""
        return torch.full(scores.shape[:2], budget, dtype=torch.int64, device=scores.device)

    @classmethod
    def allocates_per_head(cls) -> bool:
        """Whether `head_budgets` is the method's own (the template then keeps per head)."""
        return cls.head_budgets is not BudgetedMethod.head_budgets
