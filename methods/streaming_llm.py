"""StreamingLLM: attention sinks + a recent window (Xiao et al., ICLR 2024, arXiv 2309.17453).

Keeps the first `sink_tokens` tokens and the most recent `window_tokens`; everything in between is
evicted after each forward (every decode step, and after each chunk of a long prefill: the chunk
itself is attended in full, then the cache is cut back to sinks + window).

Positions, as in the paper (§3.2), are positions *within the cache*: with `rerotate=true` every
kept key is rotated to its cache slot. HF hands the cache post-RoPE keys at text positions, so
instead of storing pre-RoPE keys we rotate back and forth (rotations compose): a new key at text
position p entering slot s is rotated by s - p; when `e` tokens are evicted the window's keys move
down e slots and are rotated by -e; the query (rotated by the model at its text position) is
rotated by (slot - text position) inside attention. The engine keeps passing text positions.
With `rerotate=false` keys keep their text positions: plain "sinks + window" (what kvpress's
StreamingLLMPress does without its KeyRerotationPress).

Hyperparameters:
    sink_tokens: tokens kept from the start (paper: 4).
    window_tokens: most recent tokens kept (the paper's cache sizes are 4 + {508, 1020, ...}).
    budget_ratio: if set, the total kept is this fraction of the tokens seen so far (window =
        budget - sinks); it takes precedence over window_tokens (for sweeps across methods).
    rerotate: re-rotate keys to in-cache positions (paper) or keep text positions.
GQA needs no change: selection is positional, shared by all heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcore.errors import ConfigError
from methods.base import Capabilities, KVLayer, KVMethod, ModelInfo
from methods.rope import rotate


@dataclass(kw_only=True)
class StreamingLLM(KVMethod):
    name: ClassVar[str] = "streaming_llm"
    capabilities: ClassVar[Capabilities] = Capabilities(needs_rope=True, bounds_positions=True,
                                                        selects_tokens=True)
    sink_tokens: int = 4
    window_tokens: int | None = 508
    budget_ratio: float | None = None
    rerotate: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self._inv_freq: torch.Tensor | None = None

    def check_hyperparameters(self) -> list[str]:
        reasons = []
        if not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            reasons.append(f"method.sink_tokens={self.sink_tokens!r} must be an integer >= 0")
        if self.budget_ratio is not None:
            if not isinstance(self.budget_ratio, (int, float)) or not 0 < self.budget_ratio <= 1:
                reasons.append(f"method.budget_ratio={self.budget_ratio!r} must be in (0, 1]")
        elif self.window_tokens is None:
            reasons.append("method.window_tokens or method.budget_ratio must be set")
        elif not isinstance(self.window_tokens, int) or self.window_tokens <= 0:
            reasons.append(f"method.window_tokens={self.window_tokens!r} must be a positive integer")
        elif isinstance(self.sink_tokens, int) and self.sink_tokens > self.window_tokens:
            reasons.append(f"method.sink_tokens={self.sink_tokens} is larger than "
                           f"method.window_tokens={self.window_tokens}; sinks are a few tokens")
        if not isinstance(self.rerotate, bool):
            reasons.append(f"method.rerotate={self.rerotate!r}; allowed: true, false")
        return reasons

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict:
        return {"sink_tokens": 4, "window_tokens": seq_tokens}

    def needs_rope(self) -> bool:
        return self.rerotate

    def bounds_positions(self) -> bool:
        return self.rerotate

    def prepare(self, ctx) -> dict:
        if self.rerotate and ctx.rope_inv_freq is None:
            raise ConfigError("method=streaming_llm with method.rerotate=true needs plain RoPE "
                              "(this model has none or a scaled variant); use method.rerotate=false")
        self._inv_freq = ctx.rope_inv_freq if self.rerotate else None
        return {}

    def total_tokens(self, seen: int) -> int:
        """Tokens kept after `seen` tokens: sinks + window."""
        if self.budget_ratio is not None:
            return max(self.sink_tokens + 1, int(self.budget_ratio * seen))
        return self.sink_tokens + self.window_tokens

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        if self.rerotate and self._inv_freq is None:
            raise RuntimeError("streaming_llm with rerotate=true: call prepare(model, ...) first")
        return StreamingLLMLayer(layer_idx, info, self)


class StreamingLLMLayer(KVLayer):
    def __init__(self, layer_idx: int, info: ModelInfo, method: StreamingLLM):
        super().__init__(layer_idx, info)
        self.method = method
        self.positions = torch.empty(0, dtype=torch.long)  # (T,) text positions of kept tokens

    def update(self, keys, values, position_ids):
        q_len = keys.shape[-2]
        text_pos = torch.arange(self.seen_tokens, self.seen_tokens + q_len)
        if self.method.rerotate:
            slots = torch.arange(self.kept_tokens(), self.kept_tokens() + q_len)
            keys = rotate(keys, (slots - text_pos).to(keys.device), self.method._inv_freq)
        self.positions = torch.cat([self.positions, text_pos])
        return super().update(keys, values, position_ids)

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        if self.method.rerotate:
            # the chunk's queries sit in the last q slots; the model rotated them at text positions
            shift = keys.shape[-2] - self.seen_tokens
            if shift:
                query = rotate(query, torch.tensor(float(shift), device=query.device),
                               self.method._inv_freq)
        return base(module, query, keys, values, attention_mask, **kwargs)

    def budget_tokens(self) -> int:
        return self.method.total_tokens(self.seen_tokens)

    def after_forward(self) -> None:
        kept, budget = self.kept_tokens(), self.budget_tokens()
        if kept <= budget:
            return
        sinks = min(self.method.sink_tokens, budget)
        window = budget - sinks
        evicted = kept - budget
        win_keys = self.keys[:, :, kept - window:]
        if self.method.rerotate and window:
            shift = torch.tensor(float(-evicted), device=win_keys.device)
            win_keys = rotate(win_keys, shift, self.method._inv_freq)
        self.keys = torch.cat([self.keys[:, :, :sinks], win_keys], dim=2)
        self.values = torch.cat([self.values[:, :, :sinks], self.values[:, :, kept - window:]], dim=2)
        self.positions = torch.cat([self.positions[:sinks], self.positions[kept - window:]])

    def kept_positions(self) -> torch.Tensor:
        return self.positions
