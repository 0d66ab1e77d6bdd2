"""KVzip (Kim et al., arXiv 2505.23416): query-agnostic KV eviction by context reconstruction.

At the end of a prompt (the engine's `on_prefill_end`), the model is asked to repeat the prompt:
per chunk of `chunk_tokens` prompt tokens, one extra forward of "\\n\\nRepeat the previous context
exactly." (later chunks: "...the part of the previous context exactly, starting with " and the
previous chunk's last 8 tokens), the template's answer prefix, then the chunk itself, at the
positions after the prompt, over the prompt's full cache (the forward writes nothing to it). In
every layer, the reconstruction queries' attention is taken over the sinks (the first
`sink_tokens`, from the second chunk on; or the system prompt, below), the chunk's keys and the reconstruction tokens (causal),
softmax in fp32 with 1/sqrt(d); a prompt token's score is its maximum attention over the
reconstruction queries and the query heads of its KV head. The tokens kept are the top scores, the
sinks always; decoding then appends without eviction. The scores do not depend on any question:
one compressed cache serves every later query.

`level` (the official `--level`): `pair` (default) = the layer's H_kv x budget tokens go to its
top scores over all its KV heads (non-uniform head budgets, ragged rows); `pair-uniform` = every
KV head keeps its own top `budget`; `head` = context-independent head-level eviction: no
reconstruction per prompt; each (layer, KV head) has one static score, the maximum over a
calibration context of its pair scores (the official `--save_head_score`: `amax` over the
context of one reconstruction's scores; several files: their maximum), computed at `prepare`
from `calibration_path` (default PG-19's first book; the official: SCBench En.QA's first
context) or loaded from `head_scores_path` (the official `utils/head_score/*.pt`, (L, H_kv); a
folder: the maximum over its `.pt` files). A kept head holds its whole context, an evicted head
only the sinks (the system prompt); the question and generated tokens are appended to every
head. Which heads: the official threshold over the scores spread over every context token
(`_threshold`, sorted, index int(L H T r) - 1, kept = strictly above): the top ceil(r L H) - 1
heads of the model (exact for any context of more than 1 / frac(r L H) tokens); `budget_ratio`
r is that share of (layer, KV head) pairs (official recommendation 0.6), so each layer's budget
is its own (its kept heads' tokens plus the others' sinks, per-head mean): the layers are
non-uniform, as the official global threshold makes them.

Cost: the reconstruction forwards read about as many tokens as the prompt again (plus ~15 per
chunk), the official "about 2x prefill": recorded per request in metrics.json
`kv.method_facts` (`reconstruction_tokens`, `reconstruction_ms`).

Provenance: official code (snu-mllab/KVzip `model/wrapper.py:self_task` and `scoring`,
`attention/score.py:_get_score`, `kvcache.py:prune`) and kvpress's `KVzipPress` (the same scores).
Differences:
  * the official `pair` level sets one threshold over all layers (non-uniform layer budgets); the
    harness's budget is per layer (the one budget rule), so `pair` splits each layer's budget
    over its heads (= kvpress's `layerwise=True`);
  * the official system prompt (kept whole, the softmax's sinks, not reconstructed) is the
    chat template's text before a user message when the prompt starts with it (kvpress's split
    of the template); a prompt without it gets kvpress's sinks: its first `sink_tokens` (kvpress
    keeps only those of a system prompt too, and scores the rest of it 0);
  * head level without the authors' files (published for three models): the scores come from
    one reconstruction of `calibration_tokens` tokens of the calibration text, in this harness;
  * the answer prefix: the tokenizer's chat-template assistant turn (kvpress's split of a dummy
    message), "\\n" without a template.
A request's first prompt is scored (the cache holds it whole, in text order); a later prompt in
the same request is refused with a clear error.

Hyperparameters (the one budget rule, methods/budget.py):
    budget_ratio / budget_tokens: tokens kept per layer and KV head (per-head mean for `pair`),
        sinks included; a ratio is of the prompt's tokens.
    level: pair | pair-uniform | head (budget_ratio only: the share of heads kept).
    head_scores_path: level=head: the official head-score file or folder (else computed).
    calibration_path / calibration_tokens: level=head: the text whose reconstruction gives the
        head scores, and how many of its tokens.
    chunk_tokens: prompt tokens reconstructed per forward (official: 2000; kvpress: 2048).
    sink_tokens: first tokens always kept (kvpress: 4).
    system_prompt: keep (official: a chat system prompt opening the prompt is kept whole and is
        the softmax's sinks) | sinks (kvpress: only its first `sink_tokens` are kept and are the
        sinks; the rest of it, never reconstructed, scores 0).
"""

from __future__ import annotations

import io
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Literal

import torch

from kvcore.errors import ConfigError
from kvcore.storage import KV_LAYOUTS
from methods import _sidefiles as sidefiles
from methods.base import KVMethod
from methods.budget import BudgetedMethod, require_basis
from methods.capabilities import Capabilities, ServingNeeds
from methods.eviction import EvictionLayer
from methods.layer import FullLayer, KVLayer
from methods.model import ModelInfo

log = logging.getLogger(__name__)
Level = Literal["pair", "pair-uniform", "head"]
SystemPrompt = Literal["keep", "sinks"]
FIRST_PROMPT = "\n\nRepeat the previous context exactly."
LATER_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with "
OVERLAP_TOKENS = 8  # the previous chunk's tail quoted in a later chunk's instruction (official)
# level=head scores with a one-token budget: a calibration context must be longer to evict at all
CALIBRATION_MIN_TOKENS = 2


@dataclass(kw_only=True)
class KVzip(BudgetedMethod):
    name: ClassVar[str] = "kvzip"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "prompt compression"
    summary: ClassVar[str] = ("once per prompt, keep the tokens the model attends to while it "
                              "reconstructs the prompt (query-agnostic)")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2505.23416"
    code_url: ClassVar[str | None] = "https://github.com/snu-mllab/KVzip"
    operating_point: ClassVar[str] = (
        "snu-mllab/KVzip: Qwen2.5-7B/14B-Instruct-1M, LLaMA3.1-8B; KV ratio 0.1..1 of the "
        "context (0.3 in the README), pair level, 2000-token reconstruction chunks; SQuAD, "
        "needle, SCBench"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        acts_during_decode=False, prefill_modes=("dense",),
        selects_tokens=True, needs_token_ids=True, kv_layouts=KV_LAYOUTS)
    serving_needs: ClassVar[ServingNeeds] = ServingNeeds(ragged_heads=True)
    variant_keys: ClassVar[tuple[str, ...]] = ("level", "chunk_tokens", "system_prompt",
                                               "head_scores_path", "calibration_path",
                                               "calibration_tokens")
    inert_knobs: ClassVar[dict[str, str]] = {
        "system_prompt": "the test models have no chat template, so no prompt opens with a "
                         "system prompt (tests/methods/test_kvzip.py plants one)"}
    level: Level = "pair"
    chunk_tokens: int = 2000
    sink_tokens: int = 4
    system_prompt: SystemPrompt = "keep"
    head_scores_path: str | None = None
    calibration_path: str | None = None
    calibration_tokens: int = 2048

    def __post_init__(self) -> None:
        super().__post_init__()
        self._forward: Callable | None = None  # ctx.capture: one forward through given layers
        # (first instruction, later instruction, answer prefix, system prompt) ids, 1-D each
        self._prompts: tuple[torch.Tensor, ...] | None = None
        self._head_scores: torch.Tensor | None = None  # level=head: (L, H_kv) fp32
        self._kept_heads: torch.Tensor | None = None  # level=head: (L, H_kv) bool, from them

    def check_hyperparameters(self) -> list[str]:
        reasons = super().check_hyperparameters()
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens <= OVERLAP_TOKENS:
            reasons.append(f"method.chunk_tokens={self.chunk_tokens!r} must be an integer > "
                           f"{OVERLAP_TOKENS}")
        if not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            reasons.append(f"method.sink_tokens={self.sink_tokens!r} must be an integer >= 0")
        if self.level == "head" and self.budget_tokens is not None:
            reasons.append(f"method.budget_tokens={self.budget_tokens} with method.level=head: "
                           "head level keeps whole heads, its budget is method.budget_ratio "
                           "(the share of (layer, KV head) pairs kept); drop budget_tokens")
        head_only = {"head_scores_path": None, "calibration_path": None,
                     "calibration_tokens": 2048}
        for key, default in head_only.items():
            if self.level != "head" and getattr(self, key) != default:
                reasons.append(f"method.{key}={getattr(self, key)} applies to method.level=head "
                               f"only (level={self.level} scores every prompt by reconstructing "
                               "it); set level=head or drop it")
        if not isinstance(self.calibration_tokens, int) or isinstance(
                self.calibration_tokens, bool) or self.calibration_tokens < CALIBRATION_MIN_TOKENS:
            reasons.append(f"method.calibration_tokens={self.calibration_tokens!r} must be an "
                           f"integer >= {CALIBRATION_MIN_TOKENS} (the head scores come from "
                           "evicting down to one token: a shorter context evicts nothing)")
        for key in ("head_scores_path", "calibration_path"):
            value = getattr(self, key)
            if value is not None and not Path(value).exists():
                reasons.append(f"method.{key}={value}: no such file or folder")
        return reasons

    def validate(self, info: ModelInfo, runner: dict) -> list[str]:
        reasons = super().validate(info, runner)
        room = calibration_room(info)
        if self.level == "head" and not self.head_scores_path and room < CALIBRATION_MIN_TOKENS:
            reasons.append(f"method.level=head computes its head scores from a calibration "
                           f"context, but the model's {info.max_positions} positions leave room "
                           f"for {room} token(s) of it (at least {CALIBRATION_MIN_TOKENS}); give "
                           "method.head_scores_path")
        if self.level == "head" and self.head_scores_path:
            try:
                load_head_scores(self.head_scores_path, info)
            except ConfigError as exc:
                reasons.append(str(exc))
        return reasons

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict:
        # chunks shorter than the prompt, so that the later-chunk instruction runs too
        return {"budget_tokens": max(8, seq_tokens // 6), "chunk_tokens": 24}

    # what `prepare` sets
    artefact_names = ("_forward", "_prompts", "_head_scores", "_kept_heads")

    def prepare(self, ctx) -> dict:
        self._forward = ctx.capture
        self._prompts = reconstruction_prompts(ctx.tokenizer, ctx.vocab_size)
        facts = {"reconstruction_prompt_tokens": int(self._prompts[0].numel())}
        if self.level == "head":
            if self.head_scores_path:
                self.set_head_scores(load_head_scores(self.head_scores_path, ctx.info))
                facts["head_scores"] = str(self.head_scores_path)
            else:
                ids, source = calibration_ids(ctx, self.calibration_path, self.calibration_tokens)
                self.set_head_scores(self.calibrate(ids))
                facts.update(head_scores=source, calibration_tokens=int(ids.numel()))
        return facts

    def calibrate(self, ids: torch.Tensor) -> torch.Tensor:
        """Head scores `(L, H_kv)` fp32: the maximum over `ids` (one context) of each head's
        pair scores from one reconstruction of it (the official `--save_head_score`)."""
        scorer = KVzip(budget_tokens=1, chunk_tokens=self.chunk_tokens,
                       sink_tokens=self.sink_tokens, system_prompt=self.system_prompt)
        scorer._forward, scorer._prompts = self._forward, self._prompts
        if ids.numel() < CALIBRATION_MIN_TOKENS:
            raise ConfigError(f"method.level=head: the calibration context has {ids.numel()} "
                              f"token(s); its head scores need at least {CALIBRATION_MIN_TOKENS}")
        layers = self._forward(scorer, ids)
        scorer.reconstruct(layers[0])
        return torch.stack([kv.kvzip_scores[0].amax(-1) for kv in layers]).float().cpu()

    def layer_budget(self, layer_idx: int, num_layers: int, basis: int) -> int:
        if self.level != "head":
            return super().layer_budget(layer_idx, num_layers, basis)
        heads, basis = self.kept_heads_of(layer_idx), require_basis(basis)
        kept, h = int(heads.sum()), heads.numel()
        return max(1, -(-(kept * basis + (h - kept) * min(self.protected_bound(), basis)) // h))

    def set_head_scores(self, scores: torch.Tensor) -> None:
        """level=head: the static head scores `(L, H_kv)` and, once, the heads they keep."""
        self._head_scores = scores.float()
        self._kept_heads = official_kept_heads(self._head_scores, self.budget_ratio)

    def kept_heads_of(self, layer_idx: int) -> torch.Tensor:
        """level=head: bool `(H_kv,)`, the heads of the layer that keep their context."""
        if self._kept_heads is None:
            raise RuntimeError("kvzip: call prepare first (level=head reads its head scores)")
        return self._kept_heads[layer_idx]

    def protected_bound(self) -> int:
        """The most tokens an evicted head keeps: the sinks, or a kept system prompt."""
        system = self._prompts[3].numel() if self._prompts is not None else 0
        return max(self.sink_tokens, system if self.system_prompt == "keep" else 0)

    def head_budgets(self, scores: torch.Tensor, budget: int, layer_idx: int) -> torch.Tensor:
        if self.level == "head":  # a kept head all it holds, the others their sinks
            held = (scores > float("-inf")).sum(-1)
            sinks = torch.isposinf(scores).sum(-1)
            kept = self.kept_heads_of(layer_idx).to(scores.device)
            return torch.where(kept, held, sinks)
        if self.level == "pair-uniform":
            return super().head_budgets(scores, budget, layer_idx)
        b, h, t = scores.shape  # the layer's top H x budget over all its heads
        won = scores.reshape(b, h * t).topk(h * budget, dim=-1).indices // t
        return torch.zeros(b, h, dtype=torch.int64, device=scores.device).scatter_add_(
            -1, won, torch.ones_like(won))

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return KVzipLayer(layer_idx, info, self)

    def make_dense_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        # a dense layer 0 still starts the reconstruction (it is the first told the prompt ended)
        return KVzipDenseLayer(layer_idx, info, self)

    def reconstruct(self, first: KVLayer) -> None:
        """Score every KVzip layer of the request whose layer 0 is `first` by reconstructing the
        prompt (module docstring): one forward per chunk through wrappers of the request's
        layers."""
        if self._prompts is None:
            raise RuntimeError("kvzip: call prepare first (it needs the model's forward)")
        layers = []
        layer = first
        while layer is not None:
            layers.append(layer)
            layer = layer.next_layer
        scoring = [kv for kv in layers if isinstance(kv, KVzipLayer)]
        if not any(kv.kept_tokens() > kv.budget() for kv in scoring):
            for kv in scoring:  # nothing to evict: no reconstruction (scores made for a smaller
                kv.kvzip_scores = None  # budget sharing this prompt state are dropped)
            first.reconstruction = {}
            return
        if all(kv.kvzip_scores is not None for kv in scoring):
            return  # scored already (`score_prompt`), for this request or its prompt state
        n = first.seen_tokens
        for kv in scoring:
            if kv.kept_tokens() != n or kv.ragged:
                raise ValueError("method=kvzip scores a request's first prompt (its cache held "
                                 "whole); this request fed another prompt after compressing")
            kv.kvzip_scores = torch.zeros(kv.keys.shape[:3], dtype=torch.float32,
                                          device=kv.keys.device)
        ids = torch.cat(first.ids_seen, dim=-1)[0].cpu()  # (n,) this sequence's tokens
        first_prompt, later_prompt, answer, system = self._prompts
        system = system.numel() if torch.equal(ids[:system.numel()], system) else 0
        for kv in scoring:
            kv.system_tokens = system if self.system_prompt == "keep" else 0
        if self.level == "head":  # static scores, every token of a head alike: no forward
            for kv in scoring:
                kv.kvzip_scores[:] = self._head_scores[kv.layer_idx].to(kv.kvzip_scores)[:, None]
            first.reconstruction = {"reconstruction_tokens": 0.0, "reconstruction_ms": 0.0}
            return
        if self._forward is None:
            raise RuntimeError("kvzip: call prepare first (it needs the model's forward)")
        t0, fed = time.perf_counter(), 0
        for start in range(system, n, self.chunk_tokens):
            end = min(start + self.chunk_tokens, n)
            ask = (first_prompt if start == system else
                   torch.cat([later_prompt, ids[max(system, start - OVERLAP_TOKENS):start]]))
            repeat = torch.cat([ask, answer, ids[start:end]])
            # sinks of the softmax: the system prompt (official), else kvpress's first tokens
            sinks = system if system and self.system_prompt == "keep" else \
                min(self.sink_tokens, start)
            self._forward(_Reconstruction(layers, (start, end), sinks), repeat, n)
            fed += repeat.numel()
        first.reconstruction = {"reconstruction_tokens": float(fed),
                                "reconstruction_ms": (time.perf_counter() - t0) * 1e3}


class _TokenIds:
    """Layer 0 keeps the request's token ids (Capabilities.needs_token_ids) and starts the
    reconstruction when the prompt ends (the engine tells layers in order, layer 0 first)."""

    state_fields = ("ids_seen", "reconstruction")
    method: KVzip
    layer_idx: int

    def observe_token_ids(self, ids: torch.Tensor) -> None:
        if self.layer_idx == 0:
            self.ids_seen.append(ids)

    def score_prompt(self) -> None:
        # the scores depend on the prompt and on no budget: a sweep scores a prompt state once
        # for every budget sharing it (`reconstruct` checks each setting's own need again)
        if self.layer_idx == 0:
            self.method.reconstruct(self)

    def facts(self) -> dict[str, float]:
        return dict(self.reconstruction)


class KVzipLayer(_TokenIds, EvictionLayer):
    state_fields = ("kvzip_scores", "system_tokens")

    def __init__(self, layer_idx: int, info: ModelInfo, method: KVzip):
        super().__init__(layer_idx, info, method)
        self.ids_seen: list[torch.Tensor] = []  # layer 0: this sequence's ids (B=1, q) per forward
        self.reconstruction: dict[str, float] = {}  # layer 0: its cost (metrics kv.method_facts)
        self.kvzip_scores: torch.Tensor | None = None  # (B, H_kv, T) the last reconstruction's
        self.system_tokens = 0  # the prompt's chat-template system prompt, kept whole

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        # ragged rows after a head-wise split: each head over its own tokens
        return self.over_heads(base)(module, query, keys, values, attention_mask, **kwargs)

    def protected(self, budget: int) -> tuple[int, int]:
        return max(self.method.sink_tokens, self.system_tokens), 0

    def on_prefill_end(self) -> None:
        self.score_prompt()  # under this setting's own budget: nothing new when scored for it
        super().on_prefill_end()
        self.kvzip_scores = None

    def score(self) -> torch.Tensor:
        if self.kvzip_scores is None:
            raise RuntimeError("kvzip: no reconstruction scores (the prompt was not scored)")
        return self.kvzip_scores


class KVzipDenseLayer(_TokenIds, FullLayer):
    def __init__(self, layer_idx: int, info: ModelInfo, method: KVzip):
        super().__init__(layer_idx, info)
        self.method = method
        self.ids_seen: list[torch.Tensor] = []
        self.reconstruction: dict[str, float] = {}

    def on_prefill_end(self) -> None:
        self.score_prompt()


class _Reconstruction(KVMethod):
    """The reconstruction forward's layers: each wraps the request's layer (reads its K/V, writes
    nothing) and, for a KVzip layer, scores the chunk [start, end)."""

    name = "kvzip_reconstruction"
    provenance = "official code"
    operating_point = "KVzip's context-reconstruction forward over a request's cache"

    def __init__(self, layers: list[KVLayer], chunk: tuple[int, int], sinks: int):
        self.layers, self.chunk, self.sinks = layers, chunk, sinks

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return _ReconstructionLayer(self.layers[layer_idx], self.chunk, self.sinks)

    def make_dense_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return self.make_layer(layer_idx, info)


class _ReconstructionLayer(KVLayer):
    def __init__(self, target: KVLayer, chunk: tuple[int, int], sinks: int):
        super().__init__(target.layer_idx, target.info)
        self.target, self.chunk, self.sinks = target, chunk, sinks
        self.seen_tokens = target.seen_tokens  # the reconstruction follows the prompt

    def mask_sizes(self, q_len: int) -> tuple[int, int]:
        return self.target.seen_tokens + q_len, 0

    def update(self, keys, values, position_ids):
        self.seen_tokens += keys.shape[-2]
        return (torch.cat([self.target.keys, keys], dim=-2),
                torch.cat([self.target.values, values], dim=-2))

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        if isinstance(self.target, KVzipLayer):
            start, end = self.chunk
            scores = chunk_scores(query, keys, start, end, min(self.sinks, start))
            self.target.kvzip_scores[:, :, start:end] = scores
        return base(module, query, keys, values, attention_mask, **kwargs)


def chunk_scores(query: torch.Tensor, keys: torch.Tensor, start: int, end: int,
                 sinks: int) -> torch.Tensor:
    """KVzip's score of prompt tokens start..end-1, `(B, H_kv, end - start)` fp32: the maximum,
    over the reconstruction queries `(B, H_q, m, D)` and the query heads of a KV head, of their
    attention over [the first `sinks` keys, keys start..end-1, their own m keys (causal)];
    `keys (B, H_kv, n + m, D)` hold the prompt's n then the reconstruction's m."""
    b, h_q, m, d = query.shape
    h_kv = keys.shape[1]
    subset = torch.cat([keys[:, :, :sinks], keys[:, :, start:end], keys[:, :, -m:]], dim=2)
    rows = query.float().reshape(b, h_kv, (h_q // h_kv) * m, d)
    logits = (rows @ subset.float().transpose(2, 3)) / d ** 0.5  # (B, H_kv, g*m, s + c + m)
    logits = logits.view(b, h_kv, h_q // h_kv, m, -1)
    own = torch.ones(m, m, dtype=torch.bool, device=keys.device).triu(1)  # the future
    logits[..., -m:] = logits[..., -m:].masked_fill(own, float("-inf"))
    probs = torch.softmax(logits, dim=-1)[..., sinks:sinks + end - start]
    return probs.amax(dim=(2, 3))


def reconstruction_prompts(tokenizer, vocab_size: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first-chunk instruction, later-chunk instruction, answer prefix, system prompt) as token
    ids (1-D); the system prompt is what the chat template puts before a user message (empty
    without a template)."""
    if tokenizer is None:  # models built in code (tests): fixed ids stand for the words
        log.warning("kvzip: no tokenizer, the reconstruction instruction is fixed token ids")
        span = torch.arange(3, min(vocab_size, 3 + 12))
        return span[:8], span[:12], span[8:9], span[:0]

    def encode(text: str) -> torch.Tensor:
        return torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)

    system, answer = "", "\n"
    if getattr(tokenizer, "chat_template", None):  # around a user message (kvpress's split)
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        turn = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                             add_generation_prompt=True, tokenize=False)
        before, answer = turn.split(separator)
        system = before.split(dummy)[0]
    return encode(FIRST_PROMPT), encode(LATER_PROMPT), encode(answer), encode(system)


def official_kept_heads(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """The official head-level threshold (`_threshold` over the head scores spread over a long
    context): the heads strictly above the (ceil(r N) - 1)-th largest of the N = L x H_kv
    scores, i.e. the top ceil(r N) - 1 (ties at the threshold dropped). bool `(L, H_kv)`."""
    if ratio >= 1:
        return torch.ones(scores.shape, dtype=torch.bool)
    flat = scores.flatten().double()
    n = max(math.ceil(ratio * flat.numel() - 1e-9) - 1, 0)
    threshold = torch.sort(flat, descending=True).values[n]
    return (flat > threshold).view(scores.shape)


def load_head_scores(path, info: ModelInfo) -> torch.Tensor:
    """The official head-score file (`torch.save` of an `(L, H_kv)` tensor), or the maximum over
    a folder's `.pt` files (the official `load_head_score`). `(L, H_kv)` fp32."""
    key = "method.head_scores_path"
    path = Path(path)
    files = sorted(path.glob("*.pt")) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"{key}={path}: a folder without .pt head-score files")
    tables = []
    for file in files:
        content = sidefiles.read_bytes(key, file)
        try:
            table = torch.load(io.BytesIO(content), weights_only=True, map_location="cpu")
        except Exception as exc:  # torch raises many kinds for a file that is not its own
            raise ConfigError(f"{key}={file}: not a torch tensor file ({type(exc).__name__}); "
                              "expected the official (layers x KV heads) head scores") from None
        if not isinstance(table, torch.Tensor):
            raise ConfigError(f"{key}={file}: holds a {type(table).__name__}, expected a tensor "
                              "(layers x KV heads)")
        table = table.squeeze().float()
        want = (info.num_layers, info.num_kv_heads)
        if tuple(table.shape) != want:
            raise ConfigError(f"{key}={file}: shape {tuple(table.shape)}; this model needs "
                              f"{want} (layers x KV heads)")
        if not bool(torch.isfinite(table).all()):
            raise ConfigError(f"{key}={file}: a score is not finite; allowed: finite numbers")
        tables.append(table)
    return torch.stack(tables).amax(0)


def calibration_room(info: ModelInfo) -> int:
    """The calibration tokens the model's positions hold with the reconstruction forward after
    them (the context, then a chunk of it repeated, with the instructions); unbounded when the
    model does not declare its positions."""
    limit = info.max_positions
    return max((limit - 64) // 2, 1) if limit else 2 ** 62


def calibration_ids(ctx, path: str | None, tokens: int) -> tuple[torch.Tensor, str]:
    """The head-score calibration context: `tokens` ids of `path` (default PG-19's first book),
    capped to fit the model's positions with the reconstruction forward after it; seeded
    random ids for models built in code."""
    want = min(tokens, calibration_room(ctx.info))
    if ctx.calibration_ids is not None:
        return torch.as_tensor(ctx.calibration_ids).flatten()[:want], "ctx.calibration_ids"
    if ctx.tokenizer is None:
        log.warning("kvzip: no tokenizer, head scores from %d seeded random token ids", want)
        seeded = torch.Generator().manual_seed(0)
        return torch.randint(3, ctx.vocab_size, (want,), generator=seeded), "seeded random ids"
    file = sidefiles.calibration_path(path, ctx.data_dir, "KVzip's head-score context")
    text = sidefiles.read_text("method.calibration_path", file)
    ids = torch.tensor(ctx.tokenizer(text, verbose=False)["input_ids"])
    return ids[:want], str(file)
