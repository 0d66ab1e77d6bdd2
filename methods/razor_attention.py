"""RazorAttention: echo/induction retrieval heads keep everything; the other heads keep sinks, a
recent buffer and one compensation token for all they dropped.

Tang, Lin, Lin, Han, Ke, Hong, Yao, Wang, "RazorAttention: Efficient KV Cache Compression Through
Retrieval Heads", ICLR 2025, arXiv 2407.15891 (no official code; spec: reference/methods-2.md §8).

Spec.
  * Identification, training-free, once per model (`prepare`, cached): a sequence of random tokens
    repeated twice; per query head, echo score = mean attention from a token of the repeat to its
    earlier occurrence, induction score = mean attention to the token after it. KV head = max over
    its query group. Retrieval heads = the best `echo_head_ratio` of all (layer, KV head) pairs by
    echo ∪ the best by induction, up to `retrieval_head_ratio` in all (methods/_headwise.py).
  * Non-retrieval heads with N tokens keep the first `sink_tokens` (N0) and the last
    L_h = max(S0, N / C) tokens (`min_window_tokens` S0, `compression_ratio` C); every other token
    is folded into a compensation token k^ = mean k_j, v^ = mean v_j over the dropped set D
    (post-RoPE keys, as cached), attended with weight |D| (eq. 5):
        out = (sum_keep e^{s_j} v_j + |D| e^{s^} v^) / (sum_keep e^{s_j} + |D| e^{s^}),
    i.e. one extra key whose logit gets + log|D| (an additive mask, so SDPA runs it).
  * Decode: a token leaving the recent buffer is folded into the compensation token incrementally
    (k^ <- (|D| k^ + k) / (|D| + 1)); the paper's decode behaviour is not recovered (spec [sugg]).

Defaults. The paper's C, S0, N0 and head fractions were not recovered (spec: unverified
recollection ~15 % of heads, ~1 % echo, N0 = 4); here N0 = 4, C = 5, S0 = 256 (spec [sugg] is
min(512, n/4)), 15 % retrieval, 1 % echo. A streaming head's slot count N0 + L_h + 1 includes the
compensation token (methods-2.md §14.2). `budget_ratio` (shared knob) instead fixes the fraction
of the whole cache held (the streaming slots scale with the sequence; see _headwise.py).

Paper's number: KV cache reduced by over 70 % "without noticeable impacts on performance"
(abstract): kept fraction ~ f + (1 - f) / C = 0.15 + 0.85 / 5 = 0.32.

Deliberate deviations: as DuoAttention here (separate head-class tensors + a masked padded view for
the model's own attention; the compensation token sits right after the sinks in that view).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kvcore.errors import ConfigError
from methods._headwise import (HeadwiseLayer, HeadwiseMethod, probe_scores, select_retrieval,
                               stream_budget_slots)
from methods.base import Capabilities, KVLayer, ModelInfo, PREFILL_MODES
from methods.duo_attention import check_headwise_knobs


@dataclass(kw_only=True)
class RazorAttention(HeadwiseMethod):
    name: ClassVar[str] = "razor_attention"
    provenance: ClassVar[str] = "paper"
    operating_point: ClassVar[str] = (
        "arXiv 2407.15891 (no public code): Qwen1.5-7B..72B, Llama-3-8B; 15 % retrieval "
        "heads (14 % induction + 1 % echo), >70 % KV reduction; LongBench, NIAH"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        prefill_modes=PREFILL_MODES, needs_prepare=True, selects_tokens=True)
    axis_keys: ClassVar[tuple[str, ...]] = ("budget_ratio", "compression_ratio")
    compensate: ClassVar[bool] = True

    retrieval_head_ratio: float = 0.15
    echo_head_ratio: float = 0.01
    sink_tokens: int = 4
    compression_ratio: float = 5.0
    min_window_tokens: int = 256

    def check_hyperparameters(self) -> list[str]:
        r = check_headwise_knobs(self)
        e = self.echo_head_ratio
        if not isinstance(e, (int, float)) or not 0 <= e <= 1:
            r.append(f"method.echo_head_ratio={e!r} must be in [0, 1]")
        elif isinstance(self.retrieval_head_ratio, (int, float)) and e > self.retrieval_head_ratio:
            r.append(f"method.echo_head_ratio={e} must not exceed "
                     f"method.retrieval_head_ratio={self.retrieval_head_ratio} (echo heads are "
                     "part of the retrieval heads)")
        if not isinstance(self.compression_ratio, (int, float)) or self.compression_ratio < 1:
            r.append(f"method.compression_ratio={self.compression_ratio!r} must be >= 1")
        if not isinstance(self.min_window_tokens, int) or self.min_window_tokens < 1:
            r.append(f"method.min_window_tokens={self.min_window_tokens!r} must be a positive "
                     "integer")
        if not isinstance(self.probe_period_tokens, int) or self.probe_period_tokens < 2:
            r.append(f"method.probe_period_tokens={self.probe_period_tokens!r} must be >= 2")
        return r

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict[str, Any]:
        # The head-wise budget is a ratio of the whole cache (budget_tokens is refused).
        # several retrieval heads, one of them by echo, so that both probe scores pick heads
        return {"sink_tokens": 4, "min_window_tokens": max(4, seq_tokens // 8),
                "retrieval_head_ratio": 0.5, "echo_head_ratio": 0.17}

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict[str, Any]:
        return {"min_window_tokens": seq_tokens}

    def stream_slots(self, seen: int) -> int:
        """N0 + L_h + 1 (the compensation token), or the share under `budget_ratio`."""
        if self.budget_ratio is not None:
            return stream_budget_slots(seen, self.budget_ratio, self._retrieval_fraction,
                                       2)
        window = max(self.min_window_tokens, int(seen / self.compression_ratio))
        return self.sink_tokens + window + 1

    def prepare(self, ctx) -> dict:
        info = ctx.info
        n_heads = info.num_layers * info.num_kv_heads
        echo, induction, facts = probe_scores(ctx, self.probe_period_tokens, self.probe_seed,
                                              self.cache_dir)
        self._retrieval = select_retrieval(echo, induction,
                                           round(self.retrieval_head_ratio * n_heads),
                                           round(self.echo_head_ratio * n_heads))
        self._retrieval_fraction = float(self._retrieval.float().mean())
        if self.budget_ratio is not None and self._retrieval_fraction >= self.budget_ratio < 1:
            raise ConfigError(f"method.budget_ratio={self.budget_ratio}: the realised retrieval-"
                              f"head fraction {self._retrieval_fraction:.3f} already exceeds it")
        return {"head_identification": "razor_probe", **facts,
                "retrieval_heads": int(self._retrieval.sum()),
                "retrieval_head_fraction": round(self._retrieval_fraction, 6),
                "retrieval_heads_per_layer": self._retrieval.sum(1).tolist()}

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        if self._retrieval is None:
            raise RuntimeError(f"{self.name}: call prepare(ctx) first (it identifies the heads)")
        return HeadwiseLayer(layer_idx, info, self, self._retrieval[layer_idx])
