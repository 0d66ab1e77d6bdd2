"""LagKV: KV cache compression by lag-relative information (Liang et al., arXiv 2504.04704).

Attention-free, once per prompt: after the sink tokens the prompt is cut into partitions of
`lag_size` tokens, and each partition is scored against the partition after it (its "lag"
reference): per KV head, its keys and values are min-max normalised channel by channel with the
reference partition's minimum and maximum, a token's spread is the standard deviation of its
normalised channels, and its score is the softmax of the spreads within its partition, for the
keys plus for the values (a token that stands out from what follows it carries information the
later tokens do not). The sinks and the tail (the last full partition, which has no reference,
and the incomplete one after it) are kept whatever their score; the rest of the budget goes to
the highest scores over every scored partition. Decoding then appends.

Reconstruction from the paper's description (kvpress ships it as `LagKVPress`; not read here):
one budget over the scored partitions per KV head (the template's top-k), rather than a fixed
share of each partition.

Hyperparameters (the one budget rule, methods/budget.py):
    budget_ratio / budget_tokens: tokens kept per layer and KV head at the end of a prompt,
        sinks and tail included (a ratio is of the prompt's tokens).
    sink_tokens: the first tokens kept whatever their score (default 16).
    lag_size: tokens per partition (default 128); the tail kept is one to two partitions.
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
class LagKV(BudgetedMethod):
    name: ClassVar[str] = "lagkv"
    provenance: ClassVar[str] = "reconstruction"
    family: ClassVar[str] = "prompt compression"
    summary: ClassVar[str] = ("once per prompt, keep the tokens whose keys and values stand out "
                              "from the next partition's range")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2504.04704"
    code_url: ClassVar[str | None] = "https://github.com/NVIDIA/kvpress"
    operating_point: ClassVar[str] = (
        "the paper's setting as we read it: 16 sinks, partitions of 128 tokens, the prompt "
        "compressed once at its end")
    capabilities: ClassVar[Capabilities] = Capabilities(
        acts_during_decode=False, prefill_modes=("dense",), selects_tokens=True,
        kv_layouts=KV_LAYOUTS)
    # the direction test's prompt (300 tokens at 20 %) leaves the scores a choice only with
    # shorter partitions (at 128, the sinks and the tail take the whole budget)
    direction_hyperparameters: ClassVar[dict] = {"sink_tokens": 4, "lag_size": 32}
    sink_tokens: int = 16
    lag_size: int = 128

    def check_hyperparameters(self) -> list[str]:
        reasons = super().check_hyperparameters()
        for knob, least in (("sink_tokens", 0), ("lag_size", 1)):
            value = getattr(self, knob)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                reasons.append(f"method.{knob}={value!r} must be an integer >= {least}")
        return reasons

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict:
        # a 48-token prompt: 2 sinks, 4 scored partitions of 8, a tail of 14: 8 slots chosen
        return {"budget_tokens": 24, "sink_tokens": 2, "lag_size": 8}

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return LagKVLayer(layer_idx, info, self)


class LagKVLayer(EvictionLayer):
    score_reads: ClassVar[tuple[str, ...]] = ("keys", "values")  # held K/V only (the contract)

    def tail_tokens(self) -> int:
        """The last full partition (no reference after it) and the incomplete one."""
        rest = max(0, self.kept_tokens() - self.method.sink_tokens)
        full = rest // self.method.lag_size
        return rest if full == 0 else rest - (full - 1) * self.method.lag_size

    def protected(self, budget: int) -> tuple[int, int]:
        sinks = min(self.method.sink_tokens, budget)
        return sinks, min(self.tail_tokens(), budget - sinks)

    def score(self) -> torch.Tensor:
        order = self.positions.argsort(dim=-1)  # text order (the template's slots need not be)
        keys = self.keys.float().gather(2, order[..., None].expand(*order.shape, self.keys.shape[-1]))
        values = self.values.float().gather(2, order[..., None].expand_as(keys))
        in_order = lag_scores(keys, self.method.sink_tokens, self.method.lag_size) + \
            lag_scores(values, self.method.sink_tokens, self.method.lag_size)
        return torch.empty_like(in_order).scatter_(2, order, in_order)


def lag_scores(x: torch.Tensor, sinks: int, lag: int) -> torch.Tensor:
    """`x (B, H, T, D)` in text order -> `(B, H, T)`: per scored partition (every full one
    but the last, after the sinks) the softmax over its tokens of the standard deviation of
    their channels, min-max normalised by the next partition's range; 0 elsewhere."""
    b, h, t, d = x.shape
    scored = max(0, (t - sinks) // lag - 1)  # partitions with a reference after them
    out = x.new_zeros(b, h, t)
    if scored == 0:
        return out
    parts = x[:, :, sinks:sinks + (scored + 1) * lag].reshape(b, h, scored + 1, lag, d)
    ref = parts[:, :, 1:]
    low, high = ref.amin(3, keepdim=True), ref.amax(3, keepdim=True)  # (B, H, P, 1, D)
    normed = (parts[:, :, :-1] - low) / (high - low).clamp_min(1e-6)
    spread = normed.std(dim=-1).softmax(dim=-1)  # (B, H, P, lag)
    out[:, :, sinks:sinks + scored * lag] = spread.reshape(b, h, scored * lag)
    return out
