"""RazorAttention: echo/induction retrieval heads keep everything; the other heads keep sinks, a
recent buffer and one compensation token for all they dropped.

Tang, Lin, Lin, Han, Ke, Hong, Yao, Wang, "RazorAttention: Efficient KV Cache Compression Through
Retrieval Heads", ICLR 2025, arXiv 2407.15891. No code from the authors' paper release; Huawei's
MindSpore Golden Stick ships the head search (`mindspore_gs ... razor_attention`, `RAConfig`):
read for the probe and the selection.

Spec.
  * Identification, training-free, once per model (`prepare`, cached), as Huawei's tool: 2500
    random token ids repeated 4 times with the model's BOS first (methods/_head_probe.py: P capped
    to the model's positions, 2047 on SmolLM2); per query head the echo score (attention from each
    token of a repetition to its earlier occurrences) and the induction score (to the token after
    each); KV head = max over its query group. Retrieval heads = the best `echo_head_ratio` (1 %)
    of all (layer, KV head) pairs by echo united with the best `induction_head_ratio` (14 %) by
    induction (`RAConfig` defaults; an overlap leaves fewer than 15 %).
  * Non-retrieval heads with N tokens keep the first `sink_tokens` (N0, `RAConfig.sink_size` 4) and
    the last L_h = max(S0, N / C) tokens (`min_window_tokens` S0, `RAConfig.local_capacity` 256;
    `compression_ratio` C); every other token is folded into a compensation token k^ = mean k_j,
    v^ = mean v_j over the dropped set D (post-RoPE keys, as cached; `use_virtual_token`),
    attended with weight |D| (eq. 5):
        out = (sum_keep e^{s_j} v_j + |D| e^{s^} v^) / (sum_keep e^{s_j} + |D| e^{s^}),
    i.e. one extra key whose logit gets + log|D| (an additive mask, so SDPA runs it).
  * Decode: a token leaving the recent buffer is folded into the compensation token incrementally
    (k^ <- (|D| k^ + k) / (|D| + 1)); the paper's decode behaviour is not recovered (our choice).

Provenance: paper (the method) + Huawei's public tool (the probe and the head selection). Not
reproduced from the tool: its unseeded ids (seeded here); its index quirk counting the BOS as an
earlier occurrence for rows at multiples of P; its merge of echo into induction heads, which
returns after the first layer holding echo heads (`_get_retrieval_heads`), so echo heads of later
layers are dropped there and kept here (the paper's union). C = 5 is ours (the tool's deployment
kernel, which sets the window, is not public). A streaming head's slot count N0 + L_h + 1 includes
the compensation token (the paper's count). `budget_ratio` (shared knob) instead fixes the
fraction of the whole cache held (the streaming slots scale with the sequence; see _headwise.py).

Paper's number: KV cache reduced by over 70 % "without noticeable impacts on performance"
(abstract): kept fraction ~ f + (1 - f) / C = 0.15 + 0.85 / 5 = 0.32.

Deliberate deviations: as DuoAttention here (one ragged store for both head classes); the
compensation token is one slot of each streaming head in that store, and once it exists the
model's attention runs over the padded rows with a per-head mask carrying its +log|D|.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kvcore.errors import ConfigError
from kvcore.storage import KV_LAYOUTS
from methods._head_probe import check_probe_knobs, probe_scores, select_union
from methods._headwise import (HeadwiseLayer, HeadwiseMethod, check_headwise_knobs,
                               stream_budget_slots)
from methods.capabilities import Capabilities, ServingNeeds
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.protocol import PREFILL_MODES


@dataclass(kw_only=True)
class RazorAttention(HeadwiseMethod):
    name: ClassVar[str] = "razor_attention"
    provenance: ClassVar[str] = "paper"
    family: ClassVar[str] = "head-wise"
    summary: ClassVar[str] = (
        "echo/induction heads keep everything, the others sinks, a window and one compensation token")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2407.15891"
    code_url: ClassVar[str | None] = None
    operating_point: ClassVar[str] = (
        "arXiv 2407.15891 + Huawei's head search (MindSpore Golden Stick): Qwen1.5-7B..72B, "
        "Llama-3-8B; probe 2500 tokens x 4 + BOS, 14 % induction + 1 % echo heads, 4 sinks, "
        "256 local; >70 % KV reduction; LongBench, NIAH"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        prefill_modes=PREFILL_MODES, selects_tokens=True, kv_layouts=KV_LAYOUTS)
    serving_needs: ClassVar[ServingNeeds] = ServingNeeds(
        granularity="head", ragged_heads=True, needs_calibration=True)
    axis_keys: ClassVar[tuple[str, ...]] = ("budget_ratio", "compression_ratio")
    compensate: ClassVar[bool] = True

    induction_head_ratio: float = 0.14
    echo_head_ratio: float = 0.01
    sink_tokens: int = 4
    compression_ratio: float = 5.0
    min_window_tokens: int = 256

    def check_hyperparameters(self) -> list[str]:
        r = check_headwise_knobs(self)
        for key in ("induction_head_ratio", "echo_head_ratio"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not 0 <= value <= 1:
                r.append(f"method.{key}={value!r} must be in [0, 1]")
        b = self.budget_ratio
        heads = self.induction_head_ratio + self.echo_head_ratio if not r else 0
        if isinstance(b, (int, float)) and b < 1 and heads >= b and not r:
            r.append(f"method.induction_head_ratio + method.echo_head_ratio = {heads:g} must be "
                     f"below method.budget_ratio={b} (retrieval heads alone could hold that "
                     "share of the cache)")
        if not isinstance(self.compression_ratio, (int, float)) or self.compression_ratio < 1:
            r.append(f"method.compression_ratio={self.compression_ratio!r} must be >= 1")
        if not isinstance(self.min_window_tokens, int) or self.min_window_tokens < 1:
            r.append(f"method.min_window_tokens={self.min_window_tokens!r} must be a positive "
                     "integer")
        return r + check_probe_knobs(self)

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict[str, Any]:
        # The head-wise budget is a ratio of the whole cache (budget_tokens is refused).
        # several retrieval heads, one of them by echo, so that both probe scores pick heads
        return {"sink_tokens": 4, "min_window_tokens": max(4, seq_tokens // 8),
                "induction_head_ratio": 0.34, "echo_head_ratio": 0.17}

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

    artefact_names = ("_retrieval", "_retrieval_fraction")  # what `prepare` sets

    def prepare(self, ctx) -> dict:
        info = ctx.info
        n_heads = info.num_layers * info.num_kv_heads
        echo, induction, facts = probe_scores(ctx, self.probe_period_tokens, self.probe_repeats,
                                              self.probe_seed, self.cache_dir)
        self._retrieval = select_union(echo, induction, round(self.echo_head_ratio * n_heads),
                                       round(self.induction_head_ratio * n_heads))
        self._retrieval_fraction = float(self._retrieval.float().mean())
        if self.budget_ratio is not None and self._retrieval_fraction >= self.budget_ratio < 1:
            raise ConfigError(f"method.budget_ratio={self.budget_ratio}: the realised retrieval-"
                              f"head fraction {self._retrieval_fraction:.3f} already exceeds it")
        return {"head_identification": "echo/induction probe (Huawei's tool)", **facts,
                "retrieval_heads": int(self._retrieval.sum()),
                "retrieval_head_fraction": round(self._retrieval_fraction, 6),
                "retrieval_heads_per_layer": self._retrieval.sum(1).tolist()}

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        if self._retrieval is None:
            raise RuntimeError(f"{self.name}: call prepare(ctx) first (it identifies the heads)")
        return HeadwiseLayer(layer_idx, info, self, self._retrieval[layer_idx])
