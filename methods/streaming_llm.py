"""StreamingLLM: attention sinks + a recent window (Xiao et al., ICLR 2024, arXiv 2309.17453).

Keeps the first `sink_tokens` tokens and the most recent ones; everything in between is evicted
after each forward (every decode step, and after each chunk of a long prefill: the chunk itself is
attended in full, then the cache is cut back to sinks + window). Paper: Llama-2-13B on the first
PG-19 book (65K tokens) reaches PPL 5.40 with 4 sinks + 1020 recent vs 5158.07 with a 1024 window
and no sinks (Table 1).

Positions, as in the paper (§3.2), are positions *within the cache*. With RoPE only relative
positions matter, and every window token (all kept non-sink tokens are consecutive text
positions) has the same offset E = text position - cache slot = tokens evicted so far; so does
the query. Keys are kept exactly as the model rotated them at their text positions — never
rotated again — and only the sinks are rotated, once per forward, from their stored original
by E, in fp32: a sink at slot s then sits at s + E, the window and the query at their text
positions, and every query-key distance equals the in-cache distance of the paper. This is the
official code's "fixed reference position, rotate once per step" (it caches pre-RoPE keys and
rotates them to 0..T-1 each step) with a rotation of `sink_tokens` keys per step instead of the
whole cache: no rounding accumulates in bf16/fp16 however long the stream. With `rerotate=false`
sinks keep their text positions: plain "sinks + window" (kvpress's StreamingLLMPress without its
KeyRerotationPress).

Hyperparameters (budget rule of methods/budget.py; window_tokens applies when both budgets are null):
    sink_tokens: tokens kept from the start (paper: 4).
    window_tokens: most recent tokens kept (the paper's cache sizes are 4 + {508, 1020, ...}).
    budget_tokens: total kept (sinks + window) instead; takes precedence over budget_ratio.
    budget_ratio: total kept as a fraction of the tokens seen so far (for sweeps across methods).
    rerotate: in-cache positions (paper) or text positions.
GQA needs no change: selection is positional, shared by all heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcore.errors import ConfigError
from kvcore.storage import KV_LAYOUTS
from methods.budget import BudgetedMethod, check_budget
from methods.capabilities import Capabilities
from methods.eviction import EvictionLayer
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.protocol import PREFILL_MODES
from methods.rope import prepared, rotate_prepared


@dataclass(kw_only=True)
class StreamingLLM(BudgetedMethod):
    name: ClassVar[str] = "streaming_llm"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "eviction"
    summary: ClassVar[str] = "attention sinks plus a recent window, attended at in-cache positions"
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2309.17453"
    code_url: ClassVar[str | None] = "https://github.com/mit-han-lab/streaming-llm"
    operating_point: ClassVar[str] = (
        "mit-han-lab/streaming-llm: Llama-2-7B..70B; 4 sinks + 1020..4092-token window; "
        "PG19 streams"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        prefill_modes=PREFILL_MODES, needs_rope=True, selects_tokens=True,
        kv_layouts=KV_LAYOUTS)
    axis_keys: ClassVar[tuple[str, ...]] = ("window_tokens", "budget_ratio")
    inert_knobs: ClassVar[dict[str, str]] = {
        "window_tokens": "applies only when budget_ratio and budget_tokens are both null (the "
                         "shared budget takes precedence; the compressing case sets one)"}
    variant_keys: ClassVar[tuple[str, ...]] = ("sink_tokens", "rerotate")
    sink_tokens: int = 4
    window_tokens: int | None = 508
    budget_ratio: float | None = None
    rerotate: bool = True
    _inv_freq: ClassVar[torch.Tensor | None] = None  # RoPE's, set per instance by prepare()

    def check_hyperparameters(self) -> list[str]:
        reasons = []
        if not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            reasons.append(f"method.sink_tokens={self.sink_tokens!r} must be an integer >= 0")
        if self.budget_ratio is not None or self.budget_tokens is not None:
            reasons += check_budget(self.budget_ratio, self.budget_tokens)
            if (isinstance(self.budget_tokens, int) and isinstance(self.sink_tokens, int)
                    and not reasons and self.budget_tokens <= self.sink_tokens):
                reasons.append(f"method.budget_tokens={self.budget_tokens} must exceed "
                               f"method.sink_tokens={self.sink_tokens} (sinks + a window)")
        elif self.window_tokens is None:
            reasons.append("method.window_tokens, method.budget_tokens or method.budget_ratio "
                           "must be set")
        elif not isinstance(self.window_tokens, int) or self.window_tokens <= 0:
            reasons.append(f"method.window_tokens={self.window_tokens!r} must be a positive integer")
        elif isinstance(self.sink_tokens, int) and self.sink_tokens > self.window_tokens:
            reasons.append(f"method.sink_tokens={self.sink_tokens} is larger than "
                           f"method.window_tokens={self.window_tokens}; sinks are a few tokens")
        return reasons

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict:
        return {"sink_tokens": 4, "window_tokens": seq_tokens}

    def needs_rope(self) -> bool:
        return self.rerotate

    def bounds_positions(self) -> bool:
        return self.rerotate

    artefact_names = ("_inv_freq",)  # what `prepare` sets

    def prepare(self, ctx) -> dict:
        if self.rerotate and ctx.rope_inv_freq is None:
            raise ConfigError("method=streaming_llm with method.rerotate=true needs plain RoPE "
                              "(this model has none or a scaled variant); use method.rerotate=false")
        self._inv_freq = ctx.rope_inv_freq if self.rerotate else None
        return {}

    def total_tokens(self, basis: int) -> int:
        """Tokens kept when the budget basis is `basis` tokens: sinks + window."""
        if self.budget_tokens is None and self.budget_ratio is None:
            return self.sink_tokens + self.window_tokens
        return max(self.sink_tokens + 1, super().total_tokens(basis))  # never sinks alone

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        if self.rerotate and self._inv_freq is None:
            raise RuntimeError("streaming_llm with rerotate=true: call prepare(ctx) first")
        return StreamingLLMLayer(layer_idx, info, self)


class StreamingLLMLayer(EvictionLayer):
    state_fields = ("sink_keys", "offset")

    def __init__(self, layer_idx: int, info: ModelInfo, method: StreamingLLM):
        super().__init__(layer_idx, info, method)
        # the sinks as the model rotated them (slots 0..S-1 never move), in fp32 with their
        # rotate-half (rope.prepared): (B, H_kv, S, D) each
        self.sink_keys: tuple[torch.Tensor, torch.Tensor] | None = None
        self.offset = 0  # E: the sinks in the buffer are their originals rotated by E

    def update(self, keys, values, position_ids):
        offset = self.seen_tokens - self.kept_tokens()  # E for the whole forward
        keys_out, values_out = super().update(keys, values, position_ids)
        sinks = min(self.method.sink_tokens, self.kept_tokens())
        if self.method.rerotate and sinks:
            if self.sink_keys is None or self.sink_keys[0].shape[2] < sinks:
                self.sink_keys = prepared(self.keys[:, :, :sinks])
            if offset != self.offset:
                xf, xf_half = (x[:, :, :sinks] for x in self.sink_keys)
                rotated = rotate_prepared(xf, xf_half, offset, self.method._inv_freq, keys.dtype)
                self.kv_rows("keys").write_at(0, rotated)
                self.offset = offset
            return self.keys, self.values  # with the sinks as re-rotated now (paged: re-read)
        return keys_out, values_out

    def score(self) -> torch.Tensor:
        return self.positions.float()  # the most recent win

    def protected(self, budget: int) -> tuple[int, int]:
        return min(self.method.sink_tokens, budget), 0

    def lowest_slot(self, budget: int) -> torch.Tensor:
        sinks = min(self.method.sink_tokens, budget)  # the sinks sit in slots 0..S-1, never moved
        return self.positions[:, :, sinks:].argmin(dim=-1) + sinks  # the oldest window token
