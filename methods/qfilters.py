"""Q-Filters (Godey et al., arXiv 2503.02812): evict the keys whose projection on a per-head filter
direction, the queries' dominant direction, is smallest in attention terms.

Queries of a head share one dominant direction (the first right singular vector of their matrix),
and a key's attention is well predicted by its projection on it. At `prepare`, one forward per
calibration sequence captures every layer's post-RoPE queries; per layer, `svd_samples` of their
rows (one seeded random draw per layer, the same rows for every head) go into an SVD per query
head; the filter is the first right singular vector, its sign set so that most queries project
positively on it, negated; the filters of a KV head's query heads are averaged. A key's score
is then -(filter . key) (post-RoPE keys, as cached): keep the top. Per layer and KV head, the
template keeps the budget: the prompt is compressed once at its end (runner.prefill=dense), then
one token is evicted per decode step (the official generation cache), the `window_tokens` most
recent tokens kept whatever their score. No attention is computed (SDPA/flash compatible).
Paper: 99 % needle accuracy at x32 compression; up to 65 % less generation-perplexity drop than
StreamingLLM (abstract).

Provenance: official code (NathanGodey/qfilters `make_filters.py`: post-RoPE queries of 2048-token
sequences, 3000 rows sampled per layer, SVD, the sign rule and the group mean as here;
`QFiltersCache`: keep the top of -(key . filter) plus a recent window at every update) and
kvpress's `QFilterPress` (the same score, prefill only, no window). Differences:
  * calibration text: `calibration_path` (default PG-19's first book, 2048 tokens) instead of 19
    fineweb sequences; published filters (the authors' hub repos `nthngdy/<model>_qfilt`, a
    `model.safetensors` holding `q_filters (L, H_kv, D)`) load by path (`filters_path`);
  * evicting after the forward (the template), the official cache evicts before attending.

Hyperparameters (the one budget rule, methods/budget.py):
    budget_ratio / budget_tokens: keys kept per layer and KV head (the window included).
    window_tokens: most recent tokens kept whatever their score (kvpress: 0; the official
        generation example: 64 of 128).
    calibration_path / calibration_tokens: the SVD's text and how many of its tokens (sequences
        of at most 2048 tokens, the official length, or the model's positions).
    svd_samples: query rows per layer in the SVD (official: 3000).
    filters_path: published filters (a `.safetensors` file or the folder holding
        `model.safetensors`); replaces the calibration.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from kvcore.errors import ConfigError
from kvcore.storage import KV_LAYOUTS
from methods import _sidefiles as sidefiles
from methods.base import KVMethod
from methods.budget import BudgetedMethod
from methods.capabilities import Capabilities, ServingNeeds
from methods.eviction import EvictionLayer
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.protocol import PREFILL_MODES

log = logging.getLogger(__name__)
SEQUENCE_TOKENS = 2048  # the official calibration sequences' length (make_filters.py)


@dataclass(kw_only=True)
class QFilters(BudgetedMethod):
    name: ClassVar[str] = "qfilters"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "eviction"
    summary: ClassVar[str] = ("keep the keys projecting most on the queries' dominant direction "
                              "per head (filters from an SVD of calibration queries)")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2503.02812"
    code_url: ClassVar[str | None] = "https://github.com/NathanGodey/qfilters"
    operating_point: ClassVar[str] = (
        "NathanGodey/qfilters: Llama-3.1-8B/70B, Qwen-2.5, DeepSeek-R1-Distill; filters from "
        "19 x 2048 fineweb tokens (3000 query rows); x2..x32 compression; needle, RULER, "
        "streaming generation with a 64-token window"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        prefill_modes=PREFILL_MODES, selects_tokens=True, kv_layouts=KV_LAYOUTS)
    serving_needs: ClassVar[ServingNeeds] = ServingNeeds(needs_calibration=True)
    variant_keys: ClassVar[tuple[str, ...]] = ("window_tokens", "filters_path")
    prepare_knobs: ClassVar[tuple[str, ...]] = ("calibration_path", "calibration_tokens",
                                                "svd_samples", "filters_path")
    window_tokens: int = 0
    calibration_path: str | None = None
    calibration_tokens: int = 2048
    svd_samples: int = 3000
    filters_path: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._filters: torch.Tensor | None = None  # (L, H_kv, D) fp32

    def check_hyperparameters(self) -> list[str]:
        reasons = super().check_hyperparameters()
        for key in ("calibration_tokens", "svd_samples"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 2:
                reasons.append(f"method.{key}={value!r} must be an integer >= 2")
        if not isinstance(self.window_tokens, int) or self.window_tokens < 0:
            reasons.append(f"method.window_tokens={self.window_tokens!r} must be an integer >= 0")
        for key in ("calibration_path", "filters_path"):
            value = getattr(self, key)
            if value is not None and not Path(value).exists():
                reasons.append(f"method.{key}={value}: no such file")
        return reasons

    def validate(self, info: ModelInfo, runner: dict) -> list[str]:
        reasons = super().validate(info, runner)
        if self.filters_path:
            try:
                load_filters(self.filters_path, info)
            except ConfigError as exc:
                reasons.append(str(exc))
        return reasons

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict:
        return {"budget_tokens": max(4, seq_tokens // 6), "window_tokens": 2}

    artefact_names = ("_filters",)  # what `prepare` sets

    def prepare(self, ctx) -> dict:
        t0 = time.time()
        if self.filters_path:
            self._filters = load_filters(self.filters_path, ctx.info).to(ctx.device)
            return {"qfilters_source": str(self.filters_path)}
        ids, source = self._calibration_ids(ctx)
        self._filters = svd_filters(ctx, ids, self.svd_samples).to(ctx.device)
        return {"qfilters_source": source, "calibration_tokens": int(ids.numel()),
                "prepare_s": round(time.time() - t0, 3)}

    def _calibration_ids(self, ctx) -> tuple[torch.Tensor, str]:
        want = self.calibration_tokens
        if ctx.calibration_ids is not None:
            return torch.as_tensor(ctx.calibration_ids).flatten()[:want], "ctx.calibration_ids"
        if ctx.tokenizer is None:  # models built in code (tests)
            log.warning("qfilters: no tokenizer, calibrating on %d seeded random token ids", want)
            seeded = torch.Generator().manual_seed(0)
            return torch.randint(3, ctx.vocab_size, (want,), generator=seeded), "seeded random ids"
        path = sidefiles.calibration_path(self.calibration_path, ctx.data_dir, "Q-Filters' SVD text")
        text = sidefiles.read_text("method.calibration_path", path)
        ids = torch.tensor(ctx.tokenizer(text, verbose=False)["input_ids"])
        if ids.numel() < want:
            raise ConfigError(f"method.calibration_tokens={want} but method.calibration_path="
                              f"{path} has only {ids.numel()} tokens")
        return ids[:want], str(path)

    def filters(self) -> torch.Tensor:
        if self._filters is None:
            raise RuntimeError("qfilters: call prepare first (it computes or loads the filters)")
        return self._filters

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return QFiltersLayer(layer_idx, info, self)


class QFiltersLayer(EvictionLayer):
    def protected(self, budget: int) -> tuple[int, int]:
        return 0, min(self.method.window_tokens, budget)

    def score(self) -> torch.Tensor:
        q_filter = self.method.filters()[self.layer_idx]  # (H_kv, D)
        return -(self.keys.float() * q_filter[None, :, None].float()).sum(-1)


def filters_from_queries(queries: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Per-KV-head filters `(H_kv, D)` from one layer's sampled post-RoPE queries `(H_q, N, D)`:
    the first right singular vector per query head, negated when most rows project positively
    on it (so the dominant query direction scores keys negatively), averaged over the group."""
    u, _, vh = torch.linalg.svd(queries.float(), full_matrices=False)
    sign = ((u[..., 0] > 0).float().mean(-1) > 0.5).float() * 2 - 1  # (H_q,)
    per_query_head = -sign[:, None] * vh[:, 0, :]
    return per_query_head.reshape(num_kv_heads, -1, queries.shape[-1]).mean(1)


def svd_filters(ctx, ids: torch.Tensor, samples: int) -> torch.Tensor:
    """Filters `(L, H_kv, D)` from the post-RoPE queries of `ids` (sequences of at most 2048)."""
    info = ctx.info
    length = min(SEQUENCE_TOKENS, info.max_positions or SEQUENCE_TOKENS)
    per_layer: list[list[torch.Tensor]] = [[] for _ in range(info.num_layers)]
    for start in range(0, ids.numel(), length):
        for i, layer in enumerate(ctx.capture(_CaptureMethod(), ids[start:start + length])):
            per_layer[i].append(layer.query)
    draw = torch.Generator().manual_seed(0)
    filters = []
    for chunks in per_layer:
        rows = torch.cat(chunks, dim=1)  # (H_q, N, D)
        pick = torch.randperm(rows.shape[1], generator=draw)[:samples]
        filters.append(filters_from_queries(rows[:, pick], info.num_kv_heads))
    return torch.stack(filters)


def load_filters(path: str, info: ModelInfo) -> torch.Tensor:
    """Published filters `(L, H_kv, D)` from a `.safetensors` file or a folder holding
    `model.safetensors` (the authors' hub format, key `q_filters`)."""
    from safetensors.torch import load

    file = Path(path)
    file = file / "model.safetensors" if file.is_dir() else file
    content = sidefiles.read_bytes("method.filters_path", file)  # checked, recorded, read once
    try:
        filters = load(content)["q_filters"].float()
    except Exception as exc:  # unreadable or a different format: one clear line
        raise ConfigError(f"method.filters_path={path}: not a Q-Filters safetensors file with "
                          f"a 'q_filters' tensor ({exc})") from None
    want = (info.num_layers, info.num_kv_heads, info.head_dim)
    if tuple(filters.shape) != want:
        raise ConfigError(f"method.filters_path={path}: q_filters has shape "
                          f"{tuple(filters.shape)}, this model needs (layers, KV heads, head dim) "
                          f"= {want}")
    return filters


class _Capture(KVLayer):
    def __init__(self, layer_idx: int, info: ModelInfo):
        super().__init__(layer_idx, info)
        self.query: torch.Tensor | None = None  # (H_q, n, D) post-RoPE, batch element 0

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        self.query = query[0].float().cpu()
        return base(module, query, keys, values, attention_mask, **kwargs)


@dataclass(kw_only=True)
class _CaptureMethod(KVMethod):
    name = "qfilters_capture"
    provenance = "reference"
    operating_point = "the calibration forward of Q-Filters (captures post-RoPE queries)"

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return _Capture(layer_idx, info)
