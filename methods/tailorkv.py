"""TailorKV: quantize the layers whose attention is dense, offload the sparse ones and fetch top-k.

Yao, Shen, Lin, Liu, Luan, Wang, Wang, "TailorKV: A Hybrid Framework for Long-Context Inference via
Tailored KV Cache Optimization", arXiv 2505.19586; official code ydyhello/TailorKV@4e9fc81f12fb
(`search_pattern.py` + `models/modeling_llama_search.py` for the layer identification,
`models/cache_utils.py` `TailorKVCache` for the runtime). Spec: reference/methods-2.md §11.

Offline layer identification (`prepare`). One forward over a calibration text (`ctx.capture`); per
layer, for the last `probe_queries` (n_q = 32) queries and every query head, the attention mass
outside the row's top `probe_top_ratio` (alpha = 5 %) of keys; the layer's *dense score* P is the
mean over rows and heads. P > `dense_threshold` (beta = 0.2) -> quantization-friendly (attention
spread over many tokens: keep them all, coarsely), else sparsity-friendly (a few dominant tokens:
keep them exact, fetch only those). `quant_layers` given in the config replaces the probe; the
facts record which was used (`layer_split: probe | config`), the scores and the criterion.
The paper stores the result per model: Llama-3.1-8B and Mistral-7B -> [0]; Llama-2-7B-32K,
Yi-6B/9B-200K -> [0, 1] (config/model2quantlayer.json).

Quantized layers: KIVI's scheme and code (methods/kivi.py `KIVILayer`): keys per channel, values per
token, groups of `group_size` (64), a full-precision residual of `residual_tokens` (128), **1 bit**
for keys and values (`k_bits`, `v_bits`), held on the device (on the host tier with
runner.kv_offload=cpu, as KIVI).

Sparse layers: every token's exact K/V on the host tier (kvcore.offload.HostKVStore); on the device
only the first `sink_tokens` (8) and the last `recent_tokens` (56) tokens, exact, and the running
per-channel max |K| (B, H_kv, D). A decode step with budget B (below) attends, per KV head:
the s sinks, the r most recent tokens (the current one included) and the top k = B - s - r of the
tokens between them, chosen in two fetches from the host:
  1. q_bar = the mean query of the KV head's group; channel score |q_bar_c| * max_t |K[t, c]|; the
     top c = round(`channel_ratio` * head_dim) channels (paper: 8 of 128 = 0.0625; 4 at head_dim
     64) of every stored key are fetched (`HostKVStore.fetch_channels`);
  2. tokens scored by q_bar . K[t, channels]; the top k rows of K and V are fetched
     (`HostKVStore.fetch`, a sparse row gather), and attention is exact softmax over sinks +
     fetched + recent. Both fetches go through the tier's transfer ledger.
Prefill chunks (q_len > 1) attend densely over everything (the paper's prefill is dense); under
`runner.prefill=sparse` every prompt row is a decode step.

Budget (the shared knobs, as quest/shadowkv): B = `budget_tokens`, else int(`budget_ratio` * tokens
seen), capped at the tokens seen, is the most tokens a KV head of a sparse layer attends per
decode step, everything included: s = min(sink_tokens, B - 1), r = min(recent_tokens, B - s),
k = B - s - r. The paper's setting is `budget_tokens=192` (8 sinks + 56 recent + 128 top-k).
Quantized layers compress bytes, not tokens (no token budget, as KIVI).

Defaults (paper / `scripts/long_test.sh`): k_bits = v_bits = 1, group_size 64, residual_tokens 128,
sink 8, recent 56, 8 channels of 128, probe alpha 5 %, beta 0.2, n_q 32. Paper's number:
Llama-3.1-8B at 128K context on one RTX 3090 at 82 ms/token, near-lossless on LongBench,
InfiniteBench and RULER.

Deliberate deviations:
  * No speculative channel prefetch: the paper picks the channels for layer l from a query computed
    at layer l-1 (q_proj of l on l-1's input, RoPE'd) and prefetches those K^T rows on a thread;
    here the channels are chosen from layer l's true query (more accurate, no overlap; `lookahead`
    is not declared). The scoring and the bytes moved are the paper's.
  * Generated tokens are treated like prompt tokens: they join the host store and, once out of the
    recent window, compete for the top-k (the paper keeps every generated token exact on the device,
    outside its budget). Streaming perplexity, which has no prompt, is thereby compressed too, and
    the budget bounds every step. The per-channel max |K| covers every token seen (paper: prompt).
  * The paper keeps a transposed copy of K on the host for contiguous channel rows; here the
    channels are gathered from the token-major store into a staging buffer (same bytes moved).
  * The probe masks causally (the official probe's last 32 rows see up to 31 later keys) and runs on
    a calibration text (default: PG-19's first book in ../shared/data, as InfiniGen/KVQuant; the
    official prompt is 50 GSM8K training Q/A pairs, not available offline); models without a
    tokenizer (tests) use seeded random ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from kvcore.errors import ConfigError
from kvcore.offload import HostKVStore
from methods.base import (PREFILL_MODES, Capabilities, KVLayer, KVMethod, ModelInfo, budget_for,
                          check_budget)
from methods.kernels import kivi_quant as kq
from methods.kernels.kivi_attention import decode_kernel
from methods.kivi import KIVI, KIVILayer, quantization_reasons, value_group_reasons
from methods.scoring import attention_with_probs


@dataclass(kw_only=True)
class TailorKV(KVMethod):
    name: ClassVar[str] = "tailorkv"
    provenance: ClassVar[str] = "official code"
    operating_point: ClassVar[str] = (
        "ydyhello/TailorKV: Llama-3.1-8B-Instruct; 192 tokens (8 sink + 56 recent + 128 "
        "top-k), 1-bit dense layers; LongBench, InfiniteBench"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        prefill_modes=PREFILL_MODES, needs_prepare=True, offloads_kv=True, selects_tokens=True)
    variant_keys: ClassVar[tuple[str, ...]] = ("k_bits", "v_bits", "quant_layers",
                                               "dense_threshold")
    inert_knobs: ClassVar[dict[str, str]] = {
        key: "the layer probe's knob: inert when method.quant_layers names the layers (the "
             "contract's compressing case does)"
        for key in ("dense_threshold", "probe_top_ratio", "probe_queries", "calibration_tokens")}
    budget_ratio: float | None = 0.2
    budget_tokens: int | None = None
    sink_tokens: int = 8
    recent_tokens: int = 56
    channel_ratio: float = 0.0625
    k_bits: int = 1
    v_bits: int = 1
    group_size: int = 64
    residual_tokens: int = 128
    quant_layers: list[int] | None = None
    dense_threshold: float = 0.2
    probe_top_ratio: float = 0.05
    probe_queries: int = 32
    calibration_path: str | None = None
    calibration_tokens: int = 2048

    value_group_channels = KIVI.value_group_channels  # the quantized layers are KIVI's

    def __post_init__(self) -> None:
        super().__post_init__()
        self._quant: frozenset[int] | None = None  # the quantized layers, set by prepare

    def check_hyperparameters(self) -> list[str]:
        r = check_budget(self.budget_ratio, self.budget_tokens)
        r += quantization_reasons(self, kq.PACKABLE_BITS)
        if self.sink_tokens < 0:
            r.append(f"method.sink_tokens={self.sink_tokens} must be an integer >= 0")
        if self.recent_tokens < 1:
            r.append(f"method.recent_tokens={self.recent_tokens} must be an integer >= 1 (the "
                     "window holds the current token)")
        for key in ("channel_ratio", "probe_top_ratio"):
            if not 0 < getattr(self, key) <= 1:
                r.append(f"method.{key}={getattr(self, key)} must be in (0, 1]")
        if not 0 <= self.dense_threshold <= 1:
            r.append(f"method.dense_threshold={self.dense_threshold} must be in [0, 1] (a share "
                     "of attention mass)")
        for key in ("probe_queries", "calibration_tokens"):
            if getattr(self, key) < 1:
                r.append(f"method.{key}={getattr(self, key)} must be a positive integer")
        if self.quant_layers is not None and any(i < 0 for i in self.quant_layers):
            r.append(f"method.quant_layers={self.quant_layers} must be layer indices >= 0 "
                     "(or null: found by the probe)")
        return r

    def validate(self, info: ModelInfo, runner: dict[str, Any]) -> list[str]:
        reasons = super().validate(info, runner) + value_group_reasons(self, info)
        if self.quant_layers is not None and any(i >= info.num_layers for i in self.quant_layers):
            reasons.append(f"method.quant_layers={self.quant_layers} names a layer >= the "
                           f"model's {info.num_layers} layers")
        if self.calibration_path and not Path(self.calibration_path).is_file():
            reasons.append(f"method.calibration_path={self.calibration_path}: no such file")
        return reasons

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict[str, Any]:
        """Sparse layers attend everything, quantized layers' residual covers the sequence."""
        group = cls.group_size
        return {"budget_tokens": seq_tokens,
                "residual_tokens": max(1, -(-seq_tokens // group)) * group}

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict[str, Any]:
        """Both layer kinds on a short sequence: layer 0 quantized in small groups, the others
        sparse under a budget of a quarter of the sequence."""
        return {"budget_tokens": max(4, seq_tokens // 4), "sink_tokens": 2, "recent_tokens": 4,
                "group_size": 8, "residual_tokens": 8, "quant_layers": [0]}

    def channels(self, head_dim: int) -> int:
        """Key channels fetched to score the tokens of a sparse layer."""
        return min(head_dim, max(1, round(self.channel_ratio * head_dim)))

    # --- offline identification ------------------------------------------------------------
    def prepare(self, ctx) -> dict:
        info = ctx.info
        if self.quant_layers is not None:
            self._quant = frozenset(self.quant_layers)
            facts = {"layer_split": "config"}
        else:
            ids, source = self._calibration_ids(ctx)
            probe = _DensityProbe(top_ratio=self.probe_top_ratio, queries=self.probe_queries)
            scores = [layer.dense_score for layer in ctx.capture(probe, ids)]
            self._quant = frozenset(i for i, p in enumerate(scores) if p > self.dense_threshold)
            facts = {"layer_split": "probe", "dense_scores": [round(p, 6) for p in scores],
                     "criterion": (f"mean over the last {min(self.probe_queries, ids.numel())} "
                                   "queries and every query head of the attention mass outside "
                                   f"the top {self.probe_top_ratio:g} of keys > "
                                   f"{self.dense_threshold:g} -> quantized"),
                     "calibration_source": source, "calibration_tokens": int(ids.numel())}
        quant = sorted(self._quant)
        return {**facts, "quant_layers": quant,
                "sparse_layers": [i for i in range(info.num_layers) if i not in self._quant],
                "channels_per_kv_head": self.channels(info.head_dim),
                # its quantized layers decode through KIVI's kernels: which one ran, as KIVI says
                "decode_attention": decode_kernel(ctx.device)}

    def _calibration_ids(self, ctx) -> tuple[torch.Tensor, str]:
        want = min(self.calibration_tokens, ctx.info.max_positions or self.calibration_tokens)
        if ctx.calibration_ids is not None:
            return torch.as_tensor(ctx.calibration_ids).flatten()[:want], "ctx.calibration_ids"
        if ctx.tokenizer is None:  # models built in code (tests)
            seeded = torch.Generator().manual_seed(0)
            ids = torch.randint(3, ctx.vocab_size, (want,), generator=seeded)
            return ids, "seeded random token ids (no tokenizer)"
        default = ctx.data_dir and Path(ctx.data_dir) / "pg19" / "pg19_firstbook.txt"
        path = Path(self.calibration_path) if self.calibration_path else default
        if path is None or not path.is_file():
            raise ConfigError(f"method.calibration_path={path}: no such file (TailorKV's layer "
                              "probe text; default: PG-19's first book in ../shared/data)")
        text = path.read_text(encoding="utf-8")
        ids = torch.tensor(ctx.tokenizer(text, verbose=False)["input_ids"])
        return ids[:want], str(path)

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        if self._quant is None:
            raise RuntimeError("tailorkv: call prepare(ctx) first (it splits the layers)")
        if layer_idx in self._quant:
            return KIVILayer(layer_idx, info, self)
        return TopKOffloadLayer(layer_idx, info, self)


def outside_top_mass(probs: torch.Tensor, top_ratio: float) -> float:
    """The dense score: mean over rows (and heads) of the probability mass outside each row's top
    `top_ratio` of keys, probs `(..., q, T)`; k = max(1, int(top_ratio * T)), as the official
    probe."""
    k = max(1, int(top_ratio * probs.shape[-1]))
    return float((1 - probs.topk(k, dim=-1).values.sum(-1)).mean())


class _ProbeLayer(KVLayer):
    def __init__(self, layer_idx: int, info: ModelInfo, method: "_DensityProbe"):
        super().__init__(layer_idx, info)
        self.method = method
        self.dense_score: float | None = None

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        last = query[:, :, -self.method.queries:]  # (B, H_q, n_q, D), causal over all keys
        scaling = kwargs.get("scaling") or module.scaling
        _, probs = attention_with_probs(last, keys, values, None, scaling)
        self.dense_score = outside_top_mass(probs, self.method.top_ratio)
        return base(module, query, keys, values, attention_mask, **kwargs)


@dataclass(kw_only=True)
class _DensityProbe(KVMethod):
    name = "tailorkv_probe"
    top_ratio: float = 0.05
    queries: int = 32

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return _ProbeLayer(layer_idx, info, self)


class TopKOffloadLayer(KVLayer):
    """A sparsity-friendly layer: all K/V on the host tier, sinks + recent window + per-channel
    max |K| on the device, top-k rows fetched per decode step."""

    def __init__(self, layer_idx: int, info: ModelInfo, method: TailorKV):
        super().__init__(layer_idx, info)
        self.m = method
        self.store: HostKVStore | None = None  # every token, exact
        self.sink_k = self.sink_v = None  # (B, H_kv, <= sink_tokens, D) the first tokens
        self.recent_k = self.recent_v = None  # (B, H_kv, <= recent_tokens, D) the last tokens
        self.key_absmax: torch.Tensor | None = None  # (B, H_kv, D) max |K| per channel
        self.positions: torch.Tensor | None = None  # (B, H_kv, n) attended at the last decode step
        self._attended = 0
        self._step_budget: int | None = None  # B of the last decode step; None after a dense chunk

    def split(self, seen: int) -> tuple[int, int, int]:
        """(sinks s, recent r, top-k k) attended at a decode step after `seen` tokens."""
        budget = min(seen, budget_for(self.basis_tokens(seen), self.m.budget_ratio,
                                      self.m.budget_tokens))
        s = min(self.m.sink_tokens, budget - 1)  # the current token is always attended
        r = min(self.m.recent_tokens, budget - s)
        return s, r, budget - s - r

    # --- cache seam --------------------------------------------------------------------------
    def mask_sizes(self, q_len: int) -> tuple[int, int]:
        if q_len > 1:
            return self.seen_tokens + q_len, 0
        s, r, _ = self.split(self.seen_tokens + 1)
        return s + r, self.seen_tokens + 1 - s - r

    def update(self, keys, values, position_ids):
        """Dense chunk: every stored token (fetched) + the new ones. Decode step: the device rows
        (sinks, recent window with the new token); attend() adds the fetched top-k."""
        if self.store is None:
            self.store = HostKVStore(self.tier, self.layer_idx)
        q_len = keys.shape[-2]
        out = self.store.past_and_new(None, keys, values) if q_len > 1 else None
        if q_len == 1:
            self.store.append(keys, values)
        self._keep_on_device(keys, values)
        self.seen_tokens += q_len
        if out is not None:
            return out
        s, r, _ = self.split(self.seen_tokens)
        return (torch.cat([self.sink_k[:, :, :s], self.recent_k[:, :, -r:]], 2),
                torch.cat([self.sink_v[:, :, :s], self.recent_v[:, :, -r:]], 2))

    def _keep_on_device(self, keys, values) -> None:
        room = self.m.sink_tokens - (0 if self.sink_k is None else self.sink_k.shape[2])
        if self.sink_k is None or room > 0:
            self.sink_k = _append(self.sink_k, keys[:, :, :max(room, 0)])
            self.sink_v = _append(self.sink_v, values[:, :, :max(room, 0)])
        keep = self.m.recent_tokens  # a compact copy: a view would pin the old buffer
        self.recent_k = _append(self.recent_k, keys)[:, :, -keep:].clone()
        self.recent_v = _append(self.recent_v, values)[:, :, -keep:].clone()
        absmax = keys.abs().amax(2)  # (B, H_kv, D)
        held = self.key_absmax
        self.key_absmax = absmax if held is None else torch.maximum(held, absmax)

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        if query.shape[2] > 1:  # a prefill chunk: dense, as in the paper
            self._step_budget, self.positions, self._attended = None, None, keys.shape[2]
            return base(module, query, keys, values, attention_mask, **kwargs)
        n = self.seen_tokens
        s, r, k = self.split(n)
        b, h_kv = keys.shape[:2]
        if k in (0, n - s - r):  # nothing to choose: no middle token, or all of them
            rows = torch.arange(s, s + k).expand(b, h_kv, k)
        else:
            rows = self.select(query[:, :, 0], s, n - r, k)
        if k:
            fetched_k, fetched_v = (t.wait() for t in self.store.fetch(rows))
            keys, values = torch.cat([fetched_k, keys], 2), torch.cat([fetched_v, values], 2)
        sinks = torch.arange(s).expand(b, h_kv, s)
        recent = torch.arange(n - r, n).expand(b, h_kv, r)
        self.positions = torch.cat([sinks, rows.cpu(), recent], 2)
        self._step_budget, self._attended = s + r + k, s + r + k
        return base(module, query, keys, values, None, **kwargs)

    def select(self, query: torch.Tensor, lo: int, hi: int, k: int) -> torch.Tensor:
        """Token rows `(B, H_kv, k)` (sorted) in [lo, hi) with the highest approximate scores
        q_bar . K[t, C] over the top channels C of |q_bar| * max |K|; query `(B, H_q, D)`."""
        b, h_q, d = query.shape
        h_kv = self.key_absmax.shape[1]
        q_bar = query.float().view(b, h_kv, h_q // h_kv, d).mean(2)  # (B, H_kv, D)
        top_c = (q_bar.abs() * self.key_absmax.float()).topk(self.m.channels(d), -1).indices
        partial = self.store.fetch_channels(top_c).wait()[:, :, lo:hi]  # (B, H_kv, hi - lo, c)
        scores = (partial.float() * q_bar.gather(-1, top_c)[:, :, None]).sum(-1)
        return scores.topk(k, dim=-1).indices.sort(-1).values + lo

    # --- accounting --------------------------------------------------------------------------
    def kept_tokens(self) -> int:
        return self.seen_tokens  # all held (on the host)

    def attended_tokens(self) -> int:
        return self._attended

    def allowed_tokens(self) -> int | None:
        return self._step_budget

    def kept_positions(self) -> torch.Tensor:
        return self.positions if self.positions is not None else torch.arange(self.seen_tokens)

    def stats(self) -> dict[str, int]:
        device = [self.sink_k, self.sink_v, self.recent_k, self.recent_v, self.key_absmax]
        device_bytes = int(sum(t.nbytes for t in device if t is not None))
        host_bytes = 0 if self.store is None else int(self.store.nbytes())
        out = {"kv_tokens": self.seen_tokens, "kv_bytes": host_bytes + device_bytes,
               "kv_bytes_device": device_bytes}
        if self._step_budget is not None:
            out["selected_tokens"] = self._attended
        return out


def _append(held: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if held is None else torch.cat([held, new], dim=2)
