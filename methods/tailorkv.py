"""TailorKV: quantize the layers whose attention is dense, offload the sparse ones and fetch top-k.

Yao, Shen, Lin, Liu, Luan, Wang, Wang, "TailorKV: A Hybrid Framework for Long-Context Inference via
Tailored KV Cache Optimization", arXiv 2505.19586; official code ydyhello/TailorKV@4e9fc81f12fb
(`search_pattern.py` + `models/modeling_llama_search.py` for the layer identification,
`models/cache_utils.py` `TailorKVCache` for the runtime, `scripts/long_test.sh` for the settings).

Which layers are quantized (`prepare`, recorded in the facts as `layer_split`):
  * `config`: `quant_layers` names them;
  * `official list`: the authors' stored per-model lists (`config/model2quantlayer.json`, keyed by
    hub id; matched here on the model's name, any organisation): Meta-Llama-3.1-8B/70B-Instruct
    (and their AWQ-INT4 copies) and Mistral-7B-Instruct-v0.3 -> [0]; Llama-2-7B-32K-Instruct,
    Yi-6B/9B-200K -> [0, 1];
  * `probe` (any other model, e.g. SmolLM2): the official probe. One forward over a calibration
    text (`ctx.capture`); per layer, the last `probe_queries` (32) queries attend over *every*
    key of the text, later ones included (the official probe applies no causal mask), at the
    model's scaling; per row and query head the attention mass outside the row's top
    int(`probe_top_ratio` * T) keys (alpha 5 %); the layer's dense score P is the mean over rows
    and heads, and P > `dense_threshold` (beta 0.2, strictly, no margin: the official rule) ->
    quantization-friendly. The official code prints the split and its authors stored the lists
    by hand; the facts record every score, so a layer within a hair of beta is visible.

Quantized layers: KIVI's scheme and code (methods/kivi.py `KIVILayer`): keys per channel, values per
token, groups of `group_size` (64), a full-precision residual of `residual_tokens` (128), **1 bit**
for keys and values (`k_bits`, `v_bits`), held on the device (on the host tier with
runner.kv_offload=cpu, as KIVI).

Sparse layers, as the official `TailorKVCache`: every prompt token's exact K/V on the host tier
(the layer's host store: kvcore.offload.HostKVStore); on the device the first `sink_tokens` (8)
and the last `recent_tokens` (56) *prompt* tokens, exact, the per-channel max |K| over the prompt
(B, H_kv, D), and every token after the prompt (generated tokens, exact, never evicted). Prompt
chunks attend densely (the official prefill is dense). At each decode step, per KV head, attention
runs over the sinks, the recent prompt tokens, every generated token and the top k prompt tokens
between sinks and recent window, chosen in two fetches from the host:
  1. q_bar = the mean query of the KV head's group; channel score |q_bar_c| * max_t |K[t, c]|; the
     top `key_channels` channels (official `num_channel` 8, whatever head_dim is) of every stored
     prompt key are fetched (`HostKVStore.fetch_channels`);
  2. tokens scored by q_bar . K[t, channels]; the top k rows of K and V are fetched
     (`HostKVStore.fetch`, a sparse row gather), and attention is exact softmax over the set.
     Both fetches go through the tier's transfer ledger.

Budget (official `budget`): the prompt tokens a sparse layer's KV head attends per decode step,
B = s + r + k, capped at the prompt's length; generated tokens come on top. B =
`budget_tokens`, else int(`budget_ratio` * the budget basis) (the shared knobs; the final length
by default), else, when both are null, the official fixed budget `sink_tokens` +
`recent_tokens` + `topk_tokens` = 8 + 56 + 128 = 192 (`scripts/long_test.sh`). s =
min(sink_tokens, B), r = min(recent_tokens, B - s), k = B - s - r. Quantized layers compress
bytes, not tokens (no token budget, as KIVI).

Defaults (official `scripts/long_test.sh`): k_bits = v_bits = 1, group_size 64, residual 128,
budget 192 (start 8, recent 56), num_channel 8; probe alpha 5 %, beta 0.2, last 32 queries.
Paper's number: Llama-3.1-8B at 128K context on one RTX 3090 at 82 ms/token, near-lossless on
LongBench, InfiniteBench and RULER.

Deliberate deviations:
  * No speculative channel prefetch: the official code picks the channels for layer l from a
    query computed at layer l-1 (q_proj of l on l-1's input) and prefetches those K^T rows on a
    thread; here the channels are chosen from layer l's true query (no overlap; `lookahead` is
    not declared). The scoring and the bytes moved are the official ones.
  * The official code keeps a transposed copy of K on the host for contiguous channel rows; here
    the channels are gathered from the token-major store into a staging buffer (same bytes).
  * Only the first prompt of a request is split into sinks / top-k / recent; tokens of a later
    prompt join the exact generated tokens (the official code handles one prefill).
  * The probe runs on a calibration text (default: PG-19's first book in ../shared/data, as
    InfiniGen/KVQuant; the official prompt, 50 GSM8K training Q/A pairs, is not available
    offline), in the model's dtype with fp32 probabilities (the official: fp16); models without
    a tokenizer (tests) use seeded random ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from kvcore.storage import ContiguousRows
from methods import _sidefiles as sidefiles
from methods.base import KVMethod
from methods.budget import budget_for, check_budget
from methods.capabilities import Capabilities, ServingNeeds
from methods.kernels import kivi_quant as kq
from methods.kernels.kivi_attention import decode_kernel
from methods.kivi import KIVI, KIVILayer, quantization_reasons, value_group_reasons
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.scoring import expand_kv
from methods.selection import SelectionLayer


# config/model2quantlayer.json of the official code: quantized layers per model (hub id)
OFFICIAL_QUANT_LAYERS = {
    "NousResearch/Meta-Llama-3.1-8B-Instruct": [0],
    "togethercomputer/Llama-2-7B-32K-Instruct": [0, 1],
    "01-ai/Yi-9B-200K": [0, 1],
    "01-ai/Yi-6B-200K": [0, 1],
    "mistralai/Mistral-7B-Instruct-v0.3": [0],
    "hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4": [0],
    "hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4": [0],
}


def official_quant_layers(model_id: str | None) -> tuple[str, list[int]] | None:
    """(official key, layers) when the model is one the authors stored a list for: matched on
    the model's name (the hub id's last part, or a hub cache folder's `models--org--name`),
    case-insensitively, whatever the organisation; None otherwise."""
    if not model_id:
        return None
    parts = str(model_id).replace("\\", "/").rstrip("/").split("/")
    names = {parts[-1].lower()}
    names |= {p.split("--")[-1].lower() for p in parts if p.startswith("models--")}
    for key, layers in OFFICIAL_QUANT_LAYERS.items():
        if key.split("/")[-1].lower() in names:
            return key, list(layers)
    return None


@dataclass(kw_only=True)
class TailorKV(KVMethod):
    name: ClassVar[str] = "tailorkv"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "hybrid"
    summary: ClassVar[str] = (
        "dense-attention layers quantized to 1 bit, sparse ones offloaded with top-k fetched per step")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2505.19586"
    code_url: ClassVar[str | None] = "https://github.com/ydyhello/TailorKV"
    operating_point: ClassVar[str] = (
        "ydyhello/TailorKV: Llama-3.1-8B-Instruct (layer 0 1-bit); 192 prompt tokens (8 sink + "
        "56 recent + 128 top-k on 8 key channels) + every generated token; LongBench, "
        "InfiniteBench"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        prefill_modes=("dense",), offloads_kv=True, selects_tokens=True)
    serving_needs: ClassVar[ServingNeeds] = ServingNeeds(
        granularity="layer", needs_host_tier=True, needs_calibration=True)
    variant_keys: ClassVar[tuple[str, ...]] = ("k_bits", "v_bits", "quant_layers",
                                               "dense_threshold")
    inert_knobs: ClassVar[dict[str, str]] = {
        **{key: "the layer probe's knob: inert when method.quant_layers names the layers (the "
                "contract's compressing case does)"
           for key in ("dense_threshold", "probe_top_ratio", "probe_queries",
                       "calibration_tokens")},
        "topk_tokens": "applies only when budget_ratio and budget_tokens are both null (the "
                       "shared budget takes precedence; the compressing case sets one)"}
    prepare_knobs: ClassVar[tuple[str, ...]] = (
        "quant_layers", "dense_threshold", "probe_top_ratio", "probe_queries", "calibration_path",
        "calibration_tokens", "key_channels")
    # the top-k budget is read at decode steps only: a dense prompt is offloaded whole
    prompt_end_knobs: ClassVar[tuple[str, ...]] = ("budget_ratio", "budget_tokens", "topk_tokens")
    budget_ratio: float | None = None
    budget_tokens: int | None = None
    sink_tokens: int = 8
    recent_tokens: int = 56
    topk_tokens: int = 128
    key_channels: int = 8
    k_bits: kq.PackableBits = 1
    v_bits: kq.PackableBits = 1
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
        r = []
        if self.budget_ratio is not None or self.budget_tokens is not None:
            r += check_budget(self.budget_ratio, self.budget_tokens)
        r += quantization_reasons(self)
        if self.sink_tokens < 0:
            r.append(f"method.sink_tokens={self.sink_tokens} must be an integer >= 0")
        for key in ("recent_tokens", "key_channels", "probe_queries", "calibration_tokens"):
            if getattr(self, key) < 1:
                r.append(f"method.{key}={getattr(self, key)} must be a positive integer")
        if self.topk_tokens < 0:
            r.append(f"method.topk_tokens={self.topk_tokens} must be an integer >= 0")
        if not 0 < self.probe_top_ratio <= 1:
            r.append(f"method.probe_top_ratio={self.probe_top_ratio} must be in (0, 1]")
        if not 0 <= self.dense_threshold <= 1:
            r.append(f"method.dense_threshold={self.dense_threshold} must be in [0, 1] (a share "
                     "of attention mass)")
        if self.quant_layers is not None and any(i < 0 for i in self.quant_layers):
            r.append(f"method.quant_layers={self.quant_layers} must be layer indices >= 0 "
                     "(or null: the official list for the model, else the probe)")
        return r

    def validate(self, info: ModelInfo, runner: dict[str, Any]) -> list[str]:
        reasons = super().validate(info, runner) + value_group_reasons(self, info)
        if self.quant_layers is not None and any(i >= info.num_layers for i in self.quant_layers):
            reasons.append(f"method.quant_layers={self.quant_layers} names a layer >= the "
                           f"model's {info.num_layers} layers")
        if self.key_channels > info.head_dim:
            reasons.append(f"method.key_channels={self.key_channels} exceeds the model's "
                           f"head_dim {info.head_dim}")
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
        sparse under a budget of a quarter of the sequence, scored on 2 channels."""
        return {"budget_tokens": max(4, seq_tokens // 4), "sink_tokens": 2, "recent_tokens": 4,
                "key_channels": 2, "group_size": 8, "residual_tokens": 8, "quant_layers": [0]}

    def prompt_budget(self, basis_tokens: int | None) -> int:
        """B: prompt tokens a sparse layer's KV head attends per decode step (before the cap at
        the prompt's length)."""
        if self.budget_ratio is None and self.budget_tokens is None:
            return self.sink_tokens + self.recent_tokens + self.topk_tokens  # official 192
        return budget_for(basis_tokens, self.budget_ratio, self.budget_tokens)

    # --- offline identification ------------------------------------------------------------
    artefact_names = ("_quant",)  # what `prepare` sets

    def prepare(self, ctx) -> dict:
        info = ctx.info
        official = official_quant_layers(getattr(ctx, "model_id", None))
        if self.quant_layers is not None:
            self._quant = frozenset(self.quant_layers)
            facts = {"layer_split": "config"}
        elif official is not None:
            self._quant = frozenset(official[1])
            facts = {"layer_split": "official list",
                     "official_list": f"config/model2quantlayer.json: {official[0]}"}
        else:
            ids, source = self._calibration_ids(ctx)
            probe = _DensityProbe(top_ratio=self.probe_top_ratio, queries=self.probe_queries)
            scores = [layer.dense_score for layer in ctx.capture(probe, ids)]
            self._quant = frozenset(i for i, p in enumerate(scores) if p > self.dense_threshold)
            facts = {"layer_split": "probe", "dense_scores": [round(p, 6) for p in scores],
                     "criterion": (f"mean over the last {min(self.probe_queries, ids.numel())} "
                                   "queries (over every key, no causal mask, as the official "
                                   "probe) and every query head of the attention mass outside "
                                   f"the top {self.probe_top_ratio:g} of keys > "
                                   f"{self.dense_threshold:g} -> quantized"),
                     "calibration_source": source, "calibration_tokens": int(ids.numel())}
        quant = sorted(self._quant)
        return {**facts, "quant_layers": quant,
                "sparse_layers": [i for i in range(info.num_layers) if i not in self._quant],
                "channels_per_kv_head": self.key_channels,
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
        path = sidefiles.calibration_path(self.calibration_path, ctx.data_dir,
                                          "TailorKV's layer probe text")
        text = sidefiles.read_text("method.calibration_path", path)  # checked and recorded
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
        last = query[:, :, -self.method.queries:]  # (B, H_q, n_q, D)
        scaling = kwargs.get("scaling") or module.scaling
        # the official probe: softmax over every key of the text, later ones included (no mask)
        groups = query.shape[1] // keys.shape[1]
        logits = (last.float() * scaling) @ expand_kv(keys.float(), groups).transpose(2, 3)
        self.dense_score = outside_top_mass(torch.softmax(logits, -1), self.method.top_ratio)
        return base(module, query, keys, values, attention_mask, **kwargs)


@dataclass(kw_only=True)
class _DensityProbe(KVMethod):
    name = "tailorkv_probe"
    top_ratio: float = 0.05
    queries: int = 32

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return _ProbeLayer(layer_idx, info, self)


class TopKOffloadLayer(SelectionLayer):
    """A sparsity-friendly layer: the prompt's K/V on the host tier; on the device its sinks,
    its recent window, the per-channel max |K| and every later token; top-k prompt rows fetched
    per decode step (methods/selection.py: one set per KV head, the sinks, the recent window and
    the generated tokens protected, the rest of the grant chosen among the prompt rows between)."""

    unforkable = "its prompt's K/V are on the host tier (a host store, transfers in flight)"

    def __init__(self, layer_idx: int, info: ModelInfo, method: TailorKV):
        super().__init__(layer_idx, info, method)
        # every prompt token, exact: the layer's host store (`host_kv`, made at the first update)
        self.sink_k = self.sink_v = None  # (B, H_kv, <= sink_tokens, D) the first tokens
        self.recent_k = self.recent_v = None  # (B, H_kv, <= recent_tokens, D) the last prompt ones
        # every token after the prompt, exact, on the device: appended in place (amortised
        # growth), not concatenated to the whole of it at every step
        self.generated = {"keys": ContiguousRows(), "values": ContiguousRows()}
        self.key_absmax: torch.Tensor | None = None  # (B, H_kv, D) max |K| per channel (prompt)
        self.prompt_tokens: int | None = None  # set when the (first) prompt ends
        self.grant: tuple[int, int, int] = (0, 0, 0)  # (s, r, k) from the rule at the prompt end

    @property
    def gen_k(self) -> torch.Tensor | None:
        """The generated tokens' keys `(B, H_kv, g, D)` (None before the first)."""
        return self.generated["keys"].view()

    @property
    def gen_v(self) -> torch.Tensor | None:
        """The generated tokens' values `(B, H_kv, g, D)` (None before the first)."""
        return self.generated["values"].view()

    def _gen_len(self) -> int:
        return self.generated["keys"].length

    def on_prefill_end(self) -> None:
        """The first prompt is over: fix the sinks, the recent window and the split (s, r, k)."""
        if self.prompt_tokens is not None or self.host is None:
            return
        n = self.prompt_tokens = self.seen_tokens
        budget = min(n, self.method.prompt_budget(self.basis_tokens(n)))
        s = min(self.method.sink_tokens, budget)
        r = min(self.method.recent_tokens, budget - s)
        self.grant = (s, r, budget - s - r)
        self.sink_k, self.sink_v = self.sink_k[:, :, :s], self.sink_v[:, :, :s]
        keep = self.recent_k.shape[2] - r
        self.recent_k, self.recent_v = self.recent_k[:, :, keep:], self.recent_v[:, :, keep:]

    # --- cache seam --------------------------------------------------------------------------
    def mask_sizes(self, q_len: int) -> tuple[int, int]:
        if q_len > 1 or self.prompt_tokens is None:
            return self.seen_tokens + q_len, 0
        s, r, _ = self.grant
        rows = s + r + self._gen_len() + 1
        return rows, self.seen_tokens + 1 - rows

    def update(self, keys, values, position_ids):
        """Before the prompt ends: every stored token (fetched) + the new ones, which are
        stored. After: new tokens stay exact on the device; a decode step returns the device
        rows (sinks, recent prompt tokens, generated ones), `fetch` adds the chosen prompt rows;
        a later prompt chunk attends everything."""
        host = self.host_kv()
        q_len = keys.shape[-2]
        self.seen_tokens += q_len
        if self.prompt_tokens is None:
            out = host.past_and_new(keys, values)
            self._keep_prompt_rows(keys, values)
            return out
        self.generated["keys"].append(keys)
        self.generated["values"].append(values)
        if q_len > 1:
            past_k, past_v = (t.wait() for t in host.fetch())
            return torch.cat([past_k, self.gen_k], 2), torch.cat([past_v, self.gen_v], 2)
        return (torch.cat([self.sink_k, self.recent_k, self.gen_k], 2),
                torch.cat([self.sink_v, self.recent_v, self.gen_v], 2))

    def _keep_prompt_rows(self, keys, values) -> None:
        room = self.method.sink_tokens - (0 if self.sink_k is None else self.sink_k.shape[2])
        if self.sink_k is None or room > 0:
            self.sink_k = _append(self.sink_k, keys[:, :, :max(room, 0)])
            self.sink_v = _append(self.sink_v, values[:, :, :max(room, 0)])
        keep = self.method.recent_tokens  # a compact copy: a view would pin the old buffer
        self.recent_k = _append(self.recent_k, keys)[:, :, -keep:].clone()
        self.recent_v = _append(self.recent_v, values)[:, :, -keep:].clone()
        absmax = keys.abs().amax(2)  # (B, H_kv, D)
        held = self.key_absmax
        self.key_absmax = absmax if held is None else torch.maximum(held, absmax)

    # --- selection (methods/selection.py) ----------------------------------------------------
    def attends_densely(self, query: torch.Tensor) -> bool:
        return query.shape[2] > 1 or self.prompt_tokens is None  # a prompt chunk: dense

    def step_budget(self) -> int:
        """The grant fixed at the prompt's end, plus the tokens generated since."""
        s, r, k = self.grant
        return s + r + k + self.seen_tokens - self.prompt_tokens

    def protected(self, budget: int, t: int) -> tuple[int, int]:
        s, r, _ = self.grant
        return s, t - (self.prompt_tokens - r)  # the recent prompt tokens and every later one

    def selection_size(self, budget: int, t: int) -> int:
        return self.grant[2]

    def selection_scores(self, query, keys, attention_mask, scaling) -> torch.Tensor:
        """`(B, H_kv, 1, T)`: the approximate scores q_bar . K[t, C] of the prompt rows between
        the sinks and the recent window, over the top channels C of |q_bar| * max |K| (q_bar: the
        group's mean query); -inf elsewhere."""
        n, (s, r, k) = self.prompt_tokens, self.grant
        b, h_q, _, d = query.shape
        h_kv = self.key_absmax.shape[1]
        scores = torch.full((b, h_kv, 1, self.seen_tokens), float("-inf"), device=query.device)
        if k in (0, n - s - r):  # nothing to choose (no middle row, or all of them): no fetch
            scores[..., s:n - r] = 0
            return scores
        q_bar = query[:, :, 0].float().view(b, h_kv, h_q // h_kv, d).mean(2)  # (B, H_kv, D)
        top_c = (q_bar.abs() * self.key_absmax.float()).topk(self.method.key_channels, -1).indices
        partial = self.host.fetch_channels(top_c).wait()[:, :, s:n - r]  # (B, H_kv, n-r-s, c)
        scores[:, :, 0, s:n - r] = (partial.float() * q_bar.gather(-1, top_c)[:, :, None]).sum(-1)
        return scores

    def fetch(self, keys, values, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sinks, the chosen prompt rows fetched from the host, then the device rows after
        them (`keys`/`values`: what `update` returned, the device rows)."""
        s, _, k = self.grant
        if not k:
            return keys, values
        fetched_k, fetched_v = (t.wait() for t in self.host.fetch(slots[:, :, s:s + k]))
        return (torch.cat([keys[:, :, :s], fetched_k, keys[:, :, s:]], 2),
                torch.cat([values[:, :, :s], fetched_v, values[:, :, s:]], 2))

    # --- accounting --------------------------------------------------------------------------
    def release(self) -> None:
        super().release()
        for rows in self.generated.values():
            rows.release()

    def kept_tokens(self) -> int:
        return self.seen_tokens  # all held (the prompt on the host, later tokens on the device)

    def stats(self) -> dict[str, int]:
        device = [self.sink_k, self.sink_v, self.recent_k, self.recent_v, self.gen_k, self.gen_v,
                  self.key_absmax]
        device_bytes = int(sum(t.nbytes for t in device if t is not None))
        host_bytes = 0 if self.host is None else int(self.host.nbytes())
        return {"kv_tokens": self.seen_tokens, "kv_bytes": host_bytes + device_bytes,
                "kv_bytes_device": device_bytes, **self.selection_stats()}


def _append(held: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if held is None else torch.cat([held, new], dim=2)
