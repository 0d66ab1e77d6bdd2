"""Fidelity diagnostics (`runner.diagnostics=true`): how much a method's cache loses, per step.

A shadow request with the full cache is fed the same tokens as the method's request. At sampled
decode steps (every `every_steps`):
  * attention-mass recall, per layer and query head: the share of the *full* attention probability
    mass (from the shadow) that falls on the tokens the method attended at that step (its kept
    or selected positions, read before it evicts);
  * KL(full || method) of the next-token distributions on the same prefix.
The shadow doubles the compute, which is why this is optional.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from harness.core import hf_adapter
from methods.base import KVMethod
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.scoring import attention_with_probs


class _ProbeLayer(KVLayer):
    """A full-cache layer that records its attention probabilities when asked."""

    def __init__(self, layer_idx: int, info: ModelInfo):
        super().__init__(layer_idx, info)
        self.record = False
        self.probs: torch.Tensor | None = None  # (B, H_q, 1, T)

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        if not self.record:
            return base(module, query, keys, values, attention_mask, **kwargs)
        out, self.probs = attention_with_probs(query, keys, values, attention_mask, kwargs["scaling"])
        return out, None


@dataclass(kw_only=True)
class _Reference(KVMethod):
    """The full cache with probes (internal to diagnostics; not a selectable method)."""

    name: ClassVar[str] = "reference"

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return _ProbeLayer(layer_idx, info)


def _recall(probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Mass of `probs (B, H_q, 1, T)` on `positions` ((T',) or (B, H_kv, T'); -1: a ragged
    head's padding, not a token) -> (H_q,)."""
    b, h_q, _, t = probs.shape
    if positions.dim() == 1:
        positions = positions.view(1, 1, -1).expand(b, 1, -1)
    groups = h_q // positions.shape[1]
    pos = positions.repeat_interleave(groups, dim=1).clamp(max=t - 1).to(probs.device)
    mass = probs[:, :, 0].gather(-1, pos.clamp(min=0))
    return mass.masked_fill(pos < 0, 0).sum(-1).mean(0)


@dataclass
class Diagnostics:
    every_steps: int
    recall: list[list[list[float]]] = field(default_factory=list)  # [step][layer][head]
    kl: list[float] = field(default_factory=list)

    def shadow(self, info: ModelInfo) -> hf_adapter.MethodCache:
        return hf_adapter.MethodCache(_Reference(), info)

    def sampled(self, decode_step: int) -> bool:
        return decode_step % self.every_steps == 0

    def observe(self, method_logits: torch.Tensor, positions: list[torch.Tensor],
                shadow: hf_adapter.MethodCache, full_logits: torch.Tensor) -> None:
        """One sampled step: per-layer positions the method attended, the shadow's probes."""
        self.recall.append([_recall(kv.probs, pos).tolist()
                            for kv, pos in zip(shadow.kv_layers, positions)])
        p = torch.log_softmax(full_logits.float()[0, -1], -1)
        q = torch.log_softmax(method_logits.float()[0, -1], -1)
        self.kl.append(float((p.exp() * (p - q)).sum()))

    def summary(self) -> dict:
        if not self.kl:
            return {"steps_sampled": 0, "every_steps": self.every_steps}
        per_layer = torch.tensor(self.recall).mean(0)  # (L, H_q)
        return {
            "steps_sampled": len(self.kl),
            "every_steps": self.every_steps,
            "attention_recall_mean": round(float(per_layer.mean()), 6),
            "attention_recall_min_layer": round(float(per_layer.mean(1).min()), 6),
            "kl_mean": round(statistics.mean(self.kl), 6),
            "kl_median": round(statistics.median(self.kl), 6),
            "kl_max": round(max(self.kl), 6),
        }

    def arrays(self) -> dict:
        """Per-layer detail for the side file."""
        per_layer = torch.tensor(self.recall).mean(0) if self.recall else torch.empty(0)
        return {"attention_recall_per_layer_head": per_layer.tolist(), "kl_per_step": self.kl}
