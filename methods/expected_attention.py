"""Expected Attention (Devoto et al., arXiv 2510.00636, the kvpress paper): keep the keys that
future queries are expected to attend to, weighted by their value norms.

Once per prompt (the engine's `on_prefill_end`, whatever the chunking), per layer: the prompt's
pre-RoPE queries (every row but the first `sink_tokens`) give a mean mu and a covariance Sigma per
query head; both are moved by the RoPE rotation averaged over the next `future_tokens` positions,
R = mean_p R_p (mu' = R mu, Sigma' = R Sigma R^T); a key k (post-RoPE, as cached) then gets the
expected attention logit of a Gaussian query, k.mu'/sqrt(d) + k^T Sigma' k / (2d), softmax over
the non-sink keys per query head, averaged over the query heads of its KV head, and the score is
(that + epsilon) x ||v||. The first `sink_tokens` are kept whatever their score. Decoding then
appends without eviction. Paper: training-free, for the prefill and the decoding caches alike;
kvpress's default press.

Provenance: official code (NVIDIA/kvpress `expected_attention_press.py`, `ExpectedAttentionPress`),
followed step for step: population covariance of the centred queries, one averaged R applied to mu
and Sigma (not the average of rotated statistics), 1/sqrt(d) and 1/(2d) as written there, softmax
before the group mean, epsilon added before the value norm. Differences:
  * the pre-RoPE queries are the model's own queries un-rotated at their positions (kvpress
    recomputes q_proj of the hidden states; identical up to rounding, q_norm and bias included);
  * the statistics are accumulated over the prompt's prefill chunks (kvpress sees the prompt in
    one forward); the future positions start at the tokens seen (kvpress: the forward's length,
    the same for a prompt fed at once);
  * kept count int(ratio x prompt) (the harness's one budget rule = kvpress's).
The decoding-phase use (kvpress's DecodingPress wrapper) is the harness's decode protocol
(`runner.decode_interval_tokens`): the statistics are then those of the queries decoded since the
last compression, as DecodingPress scores from its buffer of recent hidden states.

Hyperparameters (the one budget rule, methods/budget.py):
    budget_ratio / budget_tokens: tokens kept per layer and KV head at the end of a prompt,
        sinks included; a ratio is of the prompt's tokens.
    future_tokens: future positions the RoPE rotation is averaged over (kvpress: 512).
    sink_tokens: first tokens kept and left out of the statistics (kvpress: 4).
    covariance: add the covariance term (kvpress: true).
    value_norm: multiply by ||v|| (kvpress: true).
    epsilon: added to the expected attention before the value norm (kvpress: 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcore.errors import ConfigError
from kvcore.storage import KV_LAYOUTS
from methods.budget import BudgetedMethod
from methods.capabilities import Capabilities
from methods.eviction import EvictionLayer
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.rope import rotate, rotate_half
from methods.scoring import expand_kv


@dataclass(kw_only=True)
class ExpectedAttention(BudgetedMethod):
    name: ClassVar[str] = "expected_attention"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "prompt compression"
    summary: ClassVar[str] = ("once per prompt, keep the keys future queries are expected to attend "
                              "(RoPE-averaged query statistics), weighted by their value norms")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2510.00636"
    code_url: ClassVar[str | None] = "https://github.com/NVIDIA/kvpress"
    operating_point: ClassVar[str] = (
        "NVIDIA/kvpress ExpectedAttentionPress: Llama-3.1-8B, Qwen3-8B, Gemma-3-12B; prompt "
        "compressed once at compression ratios 0.1..0.9, 512 future positions, 4 sinks, "
        "covariance and value norms on; RULER 4K, LongBench, needle"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        acts_during_decode=False, prefill_modes=("dense",),
        selects_tokens=True, recompresses_during_decode=True, needs_rope=True,
        kv_layouts=KV_LAYOUTS)
    variant_keys: ClassVar[tuple[str, ...]] = ("future_tokens", "covariance", "value_norm")
    future_tokens: int = 512
    sink_tokens: int = 4
    covariance: bool = True
    value_norm: bool = True
    epsilon: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self._inv_freq: torch.Tensor | None = None  # (D/2,) the model's RoPE frequencies

    def check_hyperparameters(self) -> list[str]:
        reasons = super().check_hyperparameters()
        if not isinstance(self.future_tokens, int) or self.future_tokens <= 0:
            reasons.append(f"method.future_tokens={self.future_tokens!r} must be a positive integer")
        if not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            reasons.append(f"method.sink_tokens={self.sink_tokens!r} must be an integer >= 0")
        if isinstance(self.sink_tokens, int) and isinstance(self.budget_tokens, int) and \
                self.sink_tokens > self.budget_tokens > 0:
            reasons.append(f"method.sink_tokens={self.sink_tokens} must be at most "
                           f"method.budget_tokens={self.budget_tokens}: the sinks are kept within "
                           "the budget")
        if not isinstance(self.epsilon, (int, float)) or self.epsilon < 0:
            reasons.append(f"method.epsilon={self.epsilon!r} must be a number >= 0")
        return reasons

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict:
        return {"budget_tokens": max(8, seq_tokens // 6)}

    artefact_names = ("_inv_freq",)  # what `prepare` sets

    def prepare(self, ctx) -> dict:
        if ctx.rope_inv_freq is None:
            raise ConfigError("method=expected_attention averages RoPE rotations: this model has "
                              "no plain RoPE (none or a scaled variant)")
        self._inv_freq = ctx.rope_inv_freq.to(ctx.device)
        return {}

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return ExpectedAttentionLayer(layer_idx, info, self)

    def inv_freq(self) -> torch.Tensor:
        if self._inv_freq is None:
            raise RuntimeError("expected_attention: call prepare first (it needs the RoPE "
                               "frequencies)")
        return self._inv_freq


class ExpectedAttentionLayer(EvictionLayer):
    state_fields = ("moments",)

    def __init__(self, layer_idx: int, info: ModelInfo, method: ExpectedAttention):
        super().__init__(layer_idx, info, method)
        self.moments = QueryMoments()

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        # the prompt's queries, pre-RoPE, past the sinks; with runner.decode_interval_tokens also
        # the queries decoded since the last compression (kvpress DecodingPress's buffer)
        if self.holding_prompt() or self.recording_decode():
            q = query.shape[2]
            positions = torch.arange(self.seen_tokens - q, self.seen_tokens, device=query.device)
            rows = positions >= self.method.sink_tokens
            if bool(rows.any()):
                pre = rotate(query[:, :, rows], -positions[rows], self.method.inv_freq())
                self.moments.add(pre)
        return base(module, query, keys, values, attention_mask, **kwargs)

    def protected(self, budget: int) -> tuple[int, int]:
        return self.method.sink_tokens, 0

    def recording_decode(self) -> bool:
        return self.protocol.decode_interval_tokens is not None and self.granted is not None

    def on_prefill_end(self) -> None:
        super().on_prefill_end()
        self.moments = QueryMoments()  # the next prompt has statistics of its own

    def on_decode_compression(self) -> None:
        self.moments = QueryMoments()  # the next interval has statistics of its own

    def score(self) -> torch.Tensor:
        m = self.method
        if self.moments.count == 0:  # the prompt is all sinks: no query to take statistics of
            raise ConfigError(f"method.sink_tokens={m.sink_tokens} covers the whole prompt of "
                              f"{self.seen_tokens} tokens: Expected Attention needs prompt queries "
                              "past the sinks; use sink_tokens below the shortest prompt")
        mean, cov = self.moments.mean_and_covariance(m.covariance)
        rotation = averaged_rope(self.seen_tokens, m.future_tokens, m.inv_freq())
        mean, cov = mean @ rotation.T, None if cov is None else rotation @ cov @ rotation.T
        return expected_attention(self.keys, self.values, mean, cov, self.positions >= m.sink_tokens,
                                  m.value_norm, m.epsilon)


class QueryMoments:
    """Running sums of a prompt's queries `(B, H_q, n, D)` over its chunks: count, sum and sum of
    outer products (fp64, so the chunking changes the statistics only at rounding)."""

    def __init__(self):
        self.count = 0
        self.total: torch.Tensor | None = None  # (B, H_q, D)
        self.outer: torch.Tensor | None = None  # (B, H_q, D, D)

    def add(self, queries: torch.Tensor) -> None:
        q = queries.double()
        total, outer = q.sum(2), torch.einsum("bhni,bhnj->bhij", q, q)
        self.count += q.shape[2]
        self.total = total if self.total is None else self.total + total
        self.outer = outer if self.outer is None else self.outer + outer

    def mean_and_covariance(self, covariance: bool
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """mu `(B, H_q, D)` and the population covariance `(B, H_q, D, D)` (or None), fp64."""
        if self.count == 0:
            raise RuntimeError("expected_attention: no prompt query past the sinks was seen")
        mean = self.total / self.count
        if not covariance:
            return mean, None
        return mean, self.outer / self.count - mean[..., :, None] * mean[..., None, :]


def averaged_rope(start: int, count: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """The RoPE rotation averaged over positions start..start+count-1, `(D, D)` fp64, in the
    rotate-half layout: R_p = diag(cos) + diag(sin) P with P x = rotate_half(x)."""
    positions = torch.arange(start, start + count, device=inv_freq.device, dtype=torch.float32)
    angles = positions[:, None] * inv_freq.float()  # fp32, as the model computes them
    angles = torch.cat((angles, angles), dim=-1)  # (count, D)
    cos, sin = angles.cos().double().mean(0), angles.sin().double().mean(0)
    d = cos.shape[0]
    turn = rotate_half(torch.eye(d, dtype=torch.float64, device=cos.device)).T  # P: turn @ x
    return torch.diag(cos) + sin[:, None] * turn


def expected_attention(keys: torch.Tensor, values: torch.Tensor, mean: torch.Tensor,
                       cov: torch.Tensor | None, scored: torch.Tensor, value_norm: bool,
                       epsilon: float) -> torch.Tensor:
    """Scores `(B, H_kv, T)` fp32 of keys/values `(B, H_kv, T, D)` under Gaussian queries of mean
    `(B, H_q, D)` and covariance `(B, H_q, D, D)` (None: the mean alone); the softmax runs over
    the `scored (B, H_kv, T)` keys only (the others score 0)."""
    h_kv, d = keys.shape[1], keys.shape[-1]
    groups = mean.shape[1] // h_kv
    k = expand_kv(keys.double(), groups)  # (B, H_q, T, D)
    logits = (k @ mean[..., None]).squeeze(-1) / d ** 0.5
    if cov is not None:
        logits += torch.einsum("bhti,bhij,bhtj->bht", k, cov, k) / d / 2
    logits = logits.masked_fill(~expand_kv(scored[..., None], groups)[..., 0], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    b, _, t = probs.shape
    scores = probs.view(b, h_kv, groups, t).mean(dim=2)
    if value_norm:
        scores = (scores + epsilon) * values.double().norm(dim=-1)
    return scores.float()
