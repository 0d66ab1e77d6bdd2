"""DuoAttention: retrieval heads keep the full KV cache, streaming heads sinks + a recent window.

Xiao, Tang, Zuo, Guo, Yang, Tang, Fu, Han, "DuoAttention: Efficient Long-Context LLM Inference with
Retrieval and Streaming Heads", ICLR 2025, arXiv 2410.10819 (official code
github.com/mit-han-lab/duo-attention).

Spec. One gate alpha per (layer, KV head), learned offline (distillation on synthetic passkey data,
L1 penalty) and binarised at deployment: `threshold = quantile(alpha + U(0, 1e-6), sparsity)`,
alpha >= threshold -> retrieval head, with sparsity = 1 - retrieval_head_ratio. Retrieval heads
keep every token; streaming heads keep the first `sink_tokens` and the last `window_tokens`. After
each forward (a prefill chunk or a decode step: every head attends its cache + the new tokens
causally) the streaming heads are cut back to sinks + window. A one-shot prefill therefore lets
streaming heads see the whole prompt (official behaviour: accuracy is optimistic, which is why the
official LongBench `pred.py` feeds the last 50 prompt tokens as decode steps). Under the default
`runner.prefill=dense` every head holds the prompt whole until it ends, whatever the chunk size
(its chunks are then attended by the model's attention, as the full cache's); feed it with
`runner.prefill=chunked` or `sparse` to make streaming heads stream. Keys stay post-RoPE at their
text positions.
Head identification (recorded in `prepare`'s facts as `head_identification`):
  * `learned_gates`: `pattern_path` given: the official pattern as `duo_attn/utils.py`
    `load_attn_pattern` reads it, a folder with `full_attention_heads.tsv` (np.savetxt of the
    gates: L rows of H_kv tab-separated values, `%.18e`, slightly negative ones included, clipped
    to [0, 1]) and `config.json` (`sink_size`, `recent_size` of training; recorded, our knobs
    decide deployment as the official `--sink_size 64 --recent_size 256` do), or the .tsv itself;
    the run's provenance is then the official code's;
  * `proxy heads`: no pattern is shipped for SmolLM2/Qwen2/stories, so by default the heads are
    ranked by RazorAttention's echo/induction probe (Huawei's tool: 2500 random tokens x 4 + BOS,
    methods/_head_probe.py) and the top `retrieval_head_ratio` of all (layer, KV head) pairs become
    retrieval heads (1 % of all heads from the echo ranking, the rest from the induction
    ranking). This is NOT DuoAttention's learned gates: the provenance label says "proxy heads"
    in metrics.json and the report.

Defaults, the official operating point: `retrieval_head_ratio` null = 0.5 on GQA models and 0.25 on
MHA ones (the NIAH scripts: sparsity 0.5 for Llama-3-8B (GQA), 0.75 for Llama-2-7B-32K (MHA));
`sink_tokens` 64 and `window_tokens` 256 fixed (`scripts/niah.sh`, `scripts/longbench.sh`;
training used 128/256); `budget_ratio` null. The KV held is then an outcome (reported): about
f + (1 - f) * 320 / n of the cache at n tokens. `budget_ratio` (shared knob, not the official
setting): the fraction of the full cache held over all KV heads of the model; the streaming window
then scales with the sequence (see _headwise.py) and the retrieval-head share must be below it.

Paper's numbers: memory down up to 2.55x (MHA) / 1.67x (GQA), decoding up to 2.18x / 1.50x faster,
NIAH comparable to full attention at a 25 % (MHA) / 50 % (GQA) retrieval-head ratio.

Deliberate deviations: the streaming heads are not permuted in the projection weights (both head
classes live in one ragged store per layer, each head with its own length, and attention reads
each head over its own tokens through the ragged kernels: the eviction template's head-wise
path, methods/_headwise.py); the official block-sparse/streaming kernels are not reproduced, so
their speed-up is not either, only the memory held. Sink/window are not rounded to 128-token blocks (the block-sparse training kernel's
granularity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pathlib import Path

import torch

from kvcore.errors import ConfigError, UnsupportedReason
from kvcore.storage import KV_LAYOUTS
from methods import _sidefiles as sidefiles
from methods._head_probe import check_probe_knobs, probe_scores, select_retrieval
from methods._headwise import (HeadwiseLayer, HeadwiseMethod, check_headwise_knobs,
                               stream_budget_slots)
from methods.capabilities import Capabilities, ServingNeeds
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.protocol import PREFILL_MODES

PROXY_ECHO_HEAD_RATIO = 0.01  # razor_probe proxy: share of all heads taken from the echo ranking


@dataclass(kw_only=True)
class DuoAttention(HeadwiseMethod):
    name: ClassVar[str] = "duo_attention"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "head-wise"
    summary: ClassVar[str] = (
        "retrieval heads keep everything, streaming heads keep sinks plus a recent window")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2410.10819"
    code_url: ClassVar[str | None] = "https://github.com/mit-han-lab/duo-attention"
    operating_point: ClassVar[str] = (
        "mit-han-lab/duo-attention: Llama-2-7B-32K, Llama-3-8B-1048K, Mistral-7B; learned "
        "gates (attn_patterns/), 25 % (MHA) / 50 % (GQA) retrieval heads, 64 sinks + 256 "
        "recent; NIAH, LongBench"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        prefill_modes=PREFILL_MODES, selects_tokens=True, kv_layouts=KV_LAYOUTS)
    serving_needs: ClassVar[ServingNeeds] = ServingNeeds(
        granularity="head", ragged_heads=True, needs_calibration=True)
    axis_keys: ClassVar[tuple[str, ...]] = ("budget_ratio", "retrieval_head_ratio")
    compensate: ClassVar[bool] = False  # streaming heads drop evicted tokens (Razor folds them)

    retrieval_head_ratio: float | None = None
    sink_tokens: int = 64
    window_tokens: int = 256
    pattern_path: str | None = None

    def check_hyperparameters(self) -> list[str]:
        r = check_headwise_knobs(self)
        if not isinstance(self.window_tokens, int) or self.window_tokens < 1:
            r.append(f"method.window_tokens={self.window_tokens!r} must be a positive integer")
        return r + check_probe_knobs(self)

    def provenance_label(self) -> str:
        if self.pattern_path:
            return self.provenance  # the authors' learned gates
        return "reconstruction (proxy heads: an echo/induction probe, not the learned gates)"

    def head_ratio(self, info: ModelInfo) -> float:
        """The retrieval-head share: the knob, else the official NIAH setting (GQA 0.5, MHA
        0.25)."""
        if self.retrieval_head_ratio is not None:
            return self.retrieval_head_ratio
        return 0.5 if info.group_size > 1 else 0.25

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict[str, Any]:
        # The head-wise budget is a ratio of the whole cache (budget_tokens is refused).
        return {"sink_tokens": 4, "window_tokens": max(4, seq_tokens // 8),
                "retrieval_head_ratio": 0.5}

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict[str, Any]:
        return {"sink_tokens": 4, "window_tokens": seq_tokens}

    def validate(self, info: ModelInfo, runner: dict[str, Any]) -> list[str]:
        reasons = super().validate(info, runner)
        ratio, b = self.head_ratio(info), self.budget_ratio
        if self.retrieval_head_ratio is None and b is not None and ratio >= b and b < 1:
            reasons.append(UnsupportedReason(
                f"method.budget_ratio={b}: DuoAttention's retrieval heads alone hold {ratio:g} "
                f"of the cache on this model (official share for "
                f"{'GQA' if info.group_size > 1 else 'MHA'}); set method.retrieval_head_ratio "
                "below the budget"))
        if self.pattern_path:
            try:
                load_duo_pattern(self.pattern_path, info)
            except ConfigError as exc:
                reasons.append(str(exc))
        return reasons

    def stream_slots(self, seen: int) -> int:
        if self.budget_ratio is not None:
            return stream_budget_slots(seen, self.budget_ratio, self._retrieval_fraction,
                                       1)
        return self.sink_tokens + self.window_tokens

    artefact_names = ("_retrieval", "_retrieval_fraction")  # what `prepare` sets

    def prepare(self, ctx) -> dict:
        info = ctx.info
        n_heads = info.num_layers * info.num_kv_heads
        if self.pattern_path:
            gates, pattern_config = load_duo_pattern(self.pattern_path, info)
            self._retrieval = sparsify_gates(gates, 1 - self.head_ratio(info))
            facts = {"head_identification": "learned_gates", "pattern_path": str(self.pattern_path),
                     "pattern_training_config": pattern_config}
        else:
            echo, induction, facts = probe_scores(ctx, self.probe_period_tokens,
                                                  self.probe_repeats, self.probe_seed,
                                                  self.cache_dir)
            self._retrieval = select_retrieval(echo, induction,
                                               round(self.head_ratio(info) * n_heads),
                                               round(PROXY_ECHO_HEAD_RATIO * n_heads))
            facts = {"head_identification": "proxy heads (RazorAttention echo/induction probe)",
                     **facts}
        self._retrieval_fraction = float(self._retrieval.float().mean())
        if self.budget_ratio is not None and self._retrieval_fraction >= self.budget_ratio < 1:
            raise ConfigError(f"method.budget_ratio={self.budget_ratio}: the realised retrieval-"
                              f"head fraction {self._retrieval_fraction:.3f} already exceeds it")
        return {**facts, "retrieval_head_ratio": self.head_ratio(info),
                "retrieval_heads": int(self._retrieval.sum()),
                "retrieval_head_fraction": round(self._retrieval_fraction, 6),
                "retrieval_heads_per_layer": self._retrieval.sum(1).tolist()}

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        if self._retrieval is None:
            raise RuntimeError(f"{self.name}: call prepare(ctx) first (it identifies the heads)")
        return HeadwiseLayer(layer_idx, info, self, self._retrieval[layer_idx])


def sparsify_gates(gates: torch.Tensor, sparsity: float, seed: int = 42) -> torch.Tensor:
    """DuoAttention's deployment rule (`sparsify_attention_heads` with `sparsity`): add U(0, 1e-6)
    tie-break noise (seeded, as `pred.py` seeds 42), threshold at the `sparsity` quantile; heads
    with gate >= threshold are retrieval heads. sparsity >= 1: none; <= 0: all."""
    if sparsity >= 1:
        return torch.zeros(gates.shape, dtype=torch.bool)
    if sparsity <= 0:
        return torch.ones(gates.shape, dtype=torch.bool)
    noise = torch.rand(gates.shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64) * 1e-6
    noisy = gates.double() + noise
    threshold = torch.quantile(noisy.flatten(), sparsity)
    return noisy >= threshold


# The official pattern files hold slightly negative gates, which its loader clips to [0, 1]; a
# gate further out is no gate of a trained pattern.
GATE_SLACK = 0.1


def load_duo_pattern(path: str | Path, info: ModelInfo) -> tuple[torch.Tensor, dict]:
    """The official DuoAttention pattern: a folder holding `full_attention_heads.tsv` (one row per
    layer, one tab-separated gate alpha in [0, 1] per KV head) and `config.json` (`sink_size`,
    `recent_size` used in training), or the .tsv file itself. Returns (gates (L, H_kv) fp64, config)."""
    key, path = "method.pattern_path", Path(path)
    tsv = path / "full_attention_heads.tsv" if path.is_dir() else path
    if not tsv.is_file() and sidefiles.kind_of(tsv) is None:  # (a FIFO or device: named there)
        raise ConfigError(f"{key}={path}: no full_attention_heads.tsv there (the "
                          "official DuoAttention pattern folder or its .tsv file)")
    text = sidefiles.read_text(key, tsv)
    try:
        rows = [[float(v) for v in line.split("\t")] for line in text.splitlines() if line.strip()]
        gates = torch.tensor(rows, dtype=torch.float64)
    except ValueError as exc:
        raise ConfigError(f"{key}={tsv}: not a tab-separated matrix of gate values "
                          f"({exc})") from exc
    if tuple(gates.shape) != (info.num_layers, info.num_kv_heads):
        raise ConfigError(f"{key}={tsv}: gates of shape {tuple(gates.shape)}, but "
                          f"this model has {info.num_layers} layers x {info.num_kv_heads} KV heads")
    heads = info.num_kv_heads
    sidefiles.check_numbers(key, tsv, gates.flatten().tolist(),
                            lambda i: f"the gate of layer {i // heads} KV head {i % heads}",
                            -GATE_SLACK, 1 + GATE_SLACK,
                            f"finite gates in [0, 1] (within {GATE_SLACK:g}, which the official "
                            "loader clips)")
    config = {}
    cfg = (path if path.is_dir() else path.parent) / "config.json"
    if cfg.is_file():
        raw = sidefiles.parse_json(key, cfg, sidefiles.read_text(key, cfg), dict,
                                   'an object such as {"sink_size": 64, "recent_size": 256}')
        config = {k: raw[k] for k in ("sink_size", "recent_size") if k in raw}
        for k, v in config.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"{key}={cfg}: {k}={v!r}; allowed: an integer >= 0 (tokens)")
    return gates.clamp(0, 1), config
