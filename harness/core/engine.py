"""The prefill/decode engine: every task's tokens go through here, and through the KV method.

Read top to bottom: a `Request` owns one fresh method cache bound to the model; `prefill` feeds a
prompt in `prefill_chunk_tokens` chunks with explicit positions, `step` feeds one token (a decode
step), `generate` is greedy decoding with stop tokens. Every region is timed (CUDA events on GPU).
Each forward runs through the one forward driver (`harness.core.forward`): the method evicts after it,
every layer's budget is checked (`harness.core.accounting`), decode steps enter the attended-fraction
accounting; and when a request ends the engine records the KV tokens and bytes each layer really
holds next to its allowance. The run protocol (dense layers, prefill mode) is the same for every
method (`EngineSettings.protocol`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from harness.core import batch as batching
from harness.core import forward
from harness.core import hf_adapter
from harness.core import serving
from harness.core.prompting import close_prompt, open_prompt
from harness.core.accounting import AttendedFraction, KVLedger
from harness.core.diagnostics import Diagnostics
from harness.core.profiling import SpeedSummary, Timer
from harness.core.progress import progress
from kvcore.errors import ConfigError
from kvcore.offload import Tier, TransferLedger
from kvcore.paged import DEFAULT_BLOCK_TOKENS, PagedKV
from methods.base import KVMethod
from methods.layer import LayerState
from methods.model import ModelInfo
from methods.protocol import Protocol
from tasks.engine_api import GenerationRequest, ScoreStreamRequest, TaskEngine, encode_with


@dataclass(frozen=True)
class EngineSettings:
    prefill_chunk_tokens: int = 512  # tokens per prefill forward (chunked prefill)
    batch_size: int = 1
    check_budget: bool = True  # raise BudgetViolation when a layer holds more than its budget
    diagnostics_every: int = 0  # >0: fidelity diagnostics every N decode steps (shadow full cache)
    kv_offload: str = "none"  # none | cpu: the full K/V on the host tier, moved per step
    kv_layout: str = "contiguous"  # contiguous | paged: K/V in block pools (kvcore.paged)
    kv_block_tokens: int = DEFAULT_BLOCK_TOKENS  # tokens per block (paged)
    # device KV limit (paged) and how requests are admitted under it (harness.core.serving)
    kv_device_limit_mib: float | None = None
    kv_admission: str = "request"  # request | layerkv
    protocol: Protocol = Protocol()  # dense layers and prefill mode, the same for every method


class Engine(TaskEngine):
    """Model + tokenizer + KV method + settings. Holds run-level speed and KV accounting. What
    a task asks of it: `TaskEngine` (tasks.engine_api); `request` and `batch` for a task that
    declares `needs_live_engine`, and for callers feeding it themselves."""

    def __init__(self, model, tokenizer, method: KVMethod, info: ModelInfo,
                 settings: EngineSettings | None = None):
        self.model, self.tokenizer, self.method, self.info = model, tokenizer, method, info
        self.settings = settings or EngineSettings()
        self.device = next(model.parameters()).device
        self.timer = Timer(self.device)
        self.prefill_tokens = 0
        self.decode_tokens = 0  # tokens decoded over all sequences (batch rows x steps)
        self.ledger = KVLedger(info)
        every = self.settings.diagnostics_every
        self.diagnostics = Diagnostics(every) if every else None
        self.transfers = TransferLedger(info.num_layers)
        # harness.core.fidelity's state for this setting (task.fidelity_tokens): its engine of
        # its own, the full-cache reference's, the peak memory before the first fidelity forward
        self.fidelity_quiet: Engine | None = None
        self.fidelity_full: Engine | None = None
        self.fidelity_peak: dict | None = None
        self.fidelity_peak_held = False
        reasons = method.layout_reasons({"kv_layout": self.settings.kv_layout,
                                         "kv_offload": self.settings.kv_offload})
        if reasons:
            raise ConfigError("; ".join(reasons))
        limit = self.settings.kv_device_limit_mib
        serving.check_admission({"kv_device_limit_mib": limit, "kv_layout": self.settings.kv_layout,
                                 "kv_admission": self.settings.kv_admission})
        paged = (PagedKV(self.settings.kv_block_tokens,
                         None if limit is None else int(limit * 2**20))
                 if self.settings.kv_layout == "paged" else None)
        self.ttft_ms: list[float] = []  # per request, under a device limit (harness.core.serving)
        self.tier = Tier(self.device, self.transfers, offload=self.settings.kv_offload == "cpu",
                         paged=paged)
        self.dense_layers = method.effective_dense_layers(info, self.settings.protocol)
        self.attended = AttendedFraction(info.num_layers, self.dense_layers)

    @contextlib.contextmanager
    def request(self, final_tokens: int | None = None, account: bool = True
                ) -> Iterator["Request"]:
        """One sample: a fresh cache, bound for the duration, accounted when it ends.
        `final_tokens`: the sequence's final length, the budget basis of a ratio budget
        (Protocol.budget_basis="final"); a stream fed only by decode steps must declare it, a
        prompt sets it to its own length when it is fed (unless declared here). `account=False`:
        a request that only prefills a prompt for others to continue (harness.sweep.execute) is
        not a sample of this engine."""
        cache = hf_adapter.MethodCache(self.method, self.info, self.tier, self.settings.protocol)
        hooks = (hf_adapter.lookahead(self.model)
                 if self.method.capabilities.lookahead or self.tier.offload
                 else contextlib.nullcontext())
        with torch.inference_mode(), hf_adapter.bind(self.model, cache), hooks:
            req = Request(self, cache, final_tokens)
            yield req
        if req.pos > 0 and account:
            self.ledger.record(cache.kv_layers, self.settings.check_budget)
        release(cache.kv_layers)

    @contextlib.contextmanager
    def batch(self, size: int, host_layers: list[frozenset[int]] | None = None
              ) -> Iterator["batching.BatchRequest"]:
        """`size` samples decoded together (harness.core.batch): one fresh cache per sequence, all
        accounted when the batch ends, each exactly as a batch-1 request would be (each prompt
        sets its sequence's budget basis, as `Request.prefill`).
        `host_layers[i]`: layers of sequence i placed whole on the host tier (LayerKV)."""
        if self.diagnostics is not None:
            raise ConfigError("runner.diagnostics follows one sequence (a shadow full cache); "
                              "batches need runner.diagnostics=false")
        host_layers = host_layers or [frozenset()] * size
        caches = [hf_adapter.MethodCache(self.method, self.info, self.tier, self.settings.protocol,
                                         host)
                  for host in host_layers]
        cache = batching.batch_cache(caches, self.info)
        hooks = (hf_adapter.lookahead(self.model)
                 if self.method.capabilities.lookahead or self.tier.offload or any(host_layers)
                 else contextlib.nullcontext())
        with torch.inference_mode(), hf_adapter.bind(self.model, cache), hooks:
            req = batching.BatchRequest(self, caches, cache)
            yield req
        for seq_cache, pos in zip(caches, req.pos):
            if pos > 0:
                self.ledger.record(seq_cache.kv_layers, self.settings.check_budget)
            release(seq_cache.kv_layers)

    def generate_many(self, prompts: list[list[int]], max_new_tokens: int | list[int],
                      stop_ids: set[int] | None = None, min_new_tokens: int = 0,
                      queries: list[list[int]] | None = None) -> Iterator[list[int]]:
        """`generate` with the request's fields as arguments."""
        return self.generate(GenerationRequest(prompts, max_new_tokens, stop_ids, min_new_tokens,
                                               queries))

    def generate(self, request: GenerationRequest) -> Iterator[list[int]]:
        """Greedy continuations of the request's prompts, in order, `settings.batch_size` at a
        time (batch 1: one `Request` each, the reference path). Yields one list of new ids per
        prompt. A query (query-agnostic protocol) is fed after its prompt is over and its
        method has compressed it, before generating."""
        prompts, limits, queries = request.prompts, request.max_new_tokens, request.queries
        min_new_tokens = request.min_new_tokens
        stop_ids = self.stop_token_ids() if request.stop_ids is None else request.stop_ids
        if self.settings.kv_device_limit_mib is not None:
            yield from self._serve(prompts, limits, stop_ids, min_new_tokens, queries)
            return
        size = self.settings.batch_size
        for start in range(0, len(prompts), size):
            group, group_limits = prompts[start:start + size], limits[start:start + size]
            group_queries = None if queries is None else queries[start:start + size]
            # Each request (or batch) is closed, hence accounted, before its outputs are yielded.
            if size == 1:
                with self.request() as req:
                    outs = [req.generate(group[0], group_limits[0], stop_ids, min_new_tokens,
                                         None if group_queries is None else group_queries[0])]
            else:
                with self.batch(len(group)) as req:
                    outs = req.generate(group, group_limits, stop_ids, min_new_tokens,
                                        queries=group_queries)
            yield from outs

    def stream_scores(self, ids: torch.Tensor, prompt_tokens: int,
                      score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`score_stream` with the request's fields as arguments."""
        return self.score_stream(ScoreStreamRequest(ids, prompt_tokens, score))

    def score_stream(self, request: ScoreStreamRequest) -> torch.Tensor:
        """Teacher-forced scores of one token stream `ids` `(T,)` (streaming perplexity): its
        first `prompt_tokens` tokens one prompt (prefilled; its end compresses), then one decode
        step per token; `score` scores each next token from the logits before it. Returns
        `(T - max(prompt_tokens, 1),)`. The budget basis of a ratio budget is the whole
        stream."""
        ids, prompt_tokens, score = request.ids, request.prompt_tokens, request.score
        first = max(prompt_tokens, 1)
        out = torch.empty(ids.numel() - first)
        device = self.device
        with self.request(final_tokens=int(ids.numel())) as req:
            if prompt_tokens:
                logits = req.prefill(ids[:prompt_tokens].to(device))[0, -1:]
                out[0] = score(logits, ids[prompt_tokens:prompt_tokens + 1].to(device))[0]
            for t in progress(range(prompt_tokens, ids.numel() - 1), "streaming perplexity",
                              "tok"):
                logits = req.step(ids[t:t + 1].to(device))[0, -1:]
                out[t + 1 - first] = score(logits, ids[t + 1:t + 2].to(device))[0]
        return out

    def fidelity_many(self, items, tokens: int, stop_ids: set[int] | None = None,
                      min_new_tokens: int = 0) -> list[dict]:
        """Each sample's paired fidelity to the full cache (`task.fidelity_tokens`,
        harness.core.fidelity: `items` are tasks.engine_api.FidelityItem), through an engine of
        its own: no time, token or KV figure of this engine changes."""
        from harness.core import fidelity

        return fidelity.fidelity_many(self, items, tokens, stop_ids, min_new_tokens)

    def stream_fidelity(self, ids: torch.Tensor, prompt_tokens: int) -> dict:
        """`stream_scores`'s stream compared token by token with a full-cache pass on it
        (harness.core.fidelity), outside this engine's accounting."""
        from harness.core import fidelity

        return fidelity.stream_fidelity(self, ids, prompt_tokens)

    def _serve(self, prompts: list[list[int]], limits: list[int], stop_ids: set[int],
               min_new_tokens: int, queries: list[list[int]] | None) -> Iterator[list[int]]:
        """Every prompt arrives now; waves are admitted under the device limit (harness.core.serving)
        and each request's time to first token is recorded from this call."""
        t0 = time.perf_counter()
        extra = [0] * len(prompts) if queries is None else [len(q) for q in queries]
        tokens = [len(p) + q + n for p, q, n in zip(prompts, extra, limits)]
        dtype_bytes = self.info.dtype.itemsize  # the K/V dtype (the model's)
        waiting = list(range(len(prompts)))
        while waiting:
            wave = serving.plan_wave(waiting, tokens, self.info, self.tier.paged.budget.limit_bytes,
                                     self.settings.kv_block_tokens, dtype_bytes,
                                     self.settings.kv_admission, self.settings.batch_size)
            with self.batch(len(wave.seqs), wave.host_layers) as req:
                outs = req.generate([prompts[i] for i in wave.seqs],
                                    [limits[i] for i in wave.seqs], stop_ids, min_new_tokens,
                                    queries=None if queries is None
                                    else [queries[i] for i in wave.seqs])
            self.ttft_ms += [(t - t0) * 1e3 for t in req.first_token_at]
            waiting = waiting[len(wave.seqs):]
            yield from outs

    def prefill_chunk(self) -> int:
        sparse = self.settings.protocol.prefill == "sparse"
        if sparse and not self.method.capabilities.sparse_prefill_chunked:
            return 1
        return self.settings.prefill_chunk_tokens

    def speed(self) -> SpeedSummary:
        return SpeedSummary(
            prefill_ms_total=sum(self.timer.values("prefill")),
            prefill_tokens=self.prefill_tokens,
            decode_steps=len(self.timer.values("decode")),
            decode_ms=self.timer.values("decode"),
            decode_tokens=self.decode_tokens,
            ttft_ms=list(self.ttft_ms),
        )

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids with the tokenizer's own default for special tokens unless told otherwise."""
        return encode_with(self.tokenizer, text, add_special_tokens)

    def stop_token_ids(self) -> set[int]:
        ids = set()
        eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        gen = getattr(self.model, "generation_config", None)
        for value in (eos, getattr(gen, "eos_token_id", None)):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids


def release(layers) -> None:
    """A request is over and accounted: its storage goes back (paged: blocks to the pools)."""
    for kv in layers:
        kv.release()


class Request:
    """One sample's cache and position. Positions are explicit: `pos` = tokens fed so far."""

    def __init__(self, engine: Engine, cache: hf_adapter.MethodCache,
                 final_tokens: int | None = None):
        self.engine, self.cache = engine, cache
        self.declared_final = final_tokens is not None  # a declared basis outlives every prompt
        if final_tokens is not None:
            for kv in cache.kv_layers:
                kv.final_tokens = final_tokens
        self.pos = 0
        self.decode_steps = 0
        diag = engine.diagnostics
        self.shadow = diag.shadow(engine.info) if diag is not None else None

    @property
    def kv_layers(self) -> list:
        return self.cache.kv_layers

    def _forward(self, ids: torch.Tensor, all_logits: bool, sample: bool = False,
                 decode: bool = False):
        """One forward of `ids` `(B, T)` over the method's cache (harness.core.forward: then the
        method evicts and every layer's budget is checked), timed as a prefill or `decode`
        region. Returns fp32 logits and, with `sample`, the positions each layer attended (read
        before eviction). Only `decode` steps enter the attended-fraction accounting."""
        def compute() -> torch.Tensor:
            t = ids.shape[1]
            positions = torch.arange(self.pos, self.pos + t, device=ids.device).unsqueeze(0)
            positions = positions.expand(ids.shape[0], -1)
            return hf_adapter.forward(self.engine.model, ids, positions, self.cache,
                                      logits_to_keep=0 if all_logits else 1)

        logits, attended = forward.run(compute, [self], [ids.shape[1]], decode,
                                       self.engine.timer, sample)
        return logits, attended[0] if sample else None

    def _shadow_forward(self, ids: torch.Tensor, record: bool) -> torch.Tensor:
        """The same tokens through the full-cache shadow (diagnostics only; not timed)."""
        start = self.pos - ids.shape[1]
        positions = torch.arange(start, self.pos, device=ids.device).unsqueeze(0)
        for kv in self.shadow.kv_layers:
            kv.record = record
        with hf_adapter.bind(self.engine.model, self.shadow):
            return hf_adapter.forward(self.engine.model, ids, positions, self.shadow, logits_to_keep=1)

    def _as_ids(self, tokens) -> torch.Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.engine.device)
        return ids.unsqueeze(0) if ids.dim() == 1 else ids

    def prefill(self, tokens, all_logits: bool = False, prompt_ends: bool = True) -> torch.Tensor:
        """Feed a prompt `(B, T)` in chunks, then tell every layer the prompt is over (unless
        `prompt_ends=False`: more of the prompt follows without a prompt end, e.g. the question
        of a query-agnostic protocol). Returns logits `(B, T, V)` or, by default, `(B, 1, V)`.
        A prompt that ends sets the budget basis to the sequence's length at its end (unless the
        request declared `final_tokens`); tokens fed with `prompt_ends=False` are decode-time
        input (harness.core.prompting.close_prompt).

        Protocol `prefill="sparse"`: every prompt row must attend under the method's budget, so
        the prompt goes one token at a time (each row is then exactly a decode step of the method)
        unless the method honours sparse rows inside a chunk itself."""
        logits = self.feed_prompt(tokens, all_logits, prompt_ends)
        if prompt_ends:
            self.close_prompt()
        return logits

    def feed_prompt(self, tokens, all_logits: bool = False, prompt_ends: bool = True
                    ) -> torch.Tensor:
        """`prefill` up to, not including, the prompt's end: the layers hold what they
        recorded while the prompt was fed (a sweep snapshots that state here and hands each
        setting its own copy, harness.sweep.execute); `close_prompt` compresses it."""
        ids = self._as_ids(tokens)
        chunk = self.engine.prefill_chunk()
        outs = []
        if prompt_ends:
            open_prompt(self.cache.kv_layers,
                        None if self.declared_final else self.pos + ids.shape[1])
        forward.begin_step([self.engine], decode=False)
        for start in range(0, ids.shape[1], chunk):
            piece = ids[:, start:start + chunk]
            outs.append(self._forward(piece, all_logits)[0])
            if self.shadow is not None:
                self._shadow_forward(piece, record=False)
        self.engine.prefill_tokens += ids.numel()
        return torch.cat(outs, dim=1) if all_logits else outs[-1][:, -1:]

    def close_prompt(self) -> None:
        """The prompt fed by `feed_prompt` is over: every layer compresses it now."""
        close_prompt(self.engine, self.cache.kv_layers)

    def step(self, token) -> torch.Tensor:
        """One decode step: feed one token per sequence, return logits `(B, 1, V)`."""
        ids = self._as_ids(token).reshape(-1, 1)
        diag = self.engine.diagnostics
        sample = diag is not None and diag.sampled(self.decode_steps)
        forward.begin_step([self.engine], decode=True)
        logits, attended = self._forward(ids, all_logits=False, sample=sample, decode=True)
        self.decode_steps += 1
        self.engine.decode_tokens += ids.shape[0]
        if self.shadow is not None:
            full_logits = self._shadow_forward(ids, record=sample)
            if sample:
                diag.observe(logits, attended, self.shadow, full_logits)
        return logits

    # --- rewinding (several continuations of one prefilled context) -------------------------
    def snapshot(self) -> "RequestSnapshot | None":
        """Fork every layer's per-request state (`KVLayer.fork`) and the position so the request
        can be rewound, or None when a layer's state cannot be forked (the caller then prefills
        again). Never with a diagnostics shadow cache."""
        if self.shadow is not None:
            return None
        states = []
        for kv in self.cache.kv_layers:
            state = kv.fork()
            if state is None:
                return None
            states.append(state)
        return RequestSnapshot(self.pos, self.decode_steps, states)

    def restore(self, snapshot: "RequestSnapshot", consume: bool = False) -> None:
        """Rewind to `snapshot` (`consume=True` hands its tensors over instead of copying them).

        A snapshot taken in another engine's request (a sweep handing one prompt state to each
        setting, harness.sweep.execute) is adopted by this request's layers, position for
        position: each keeps its own method, tier and protocol (`KVLayer.adopt`)."""
        if len(snapshot.states) != len(self.cache.kv_layers):
            raise ValueError("a snapshot restores into a request of the same model only")
        for kv, state in zip(self.cache.kv_layers, snapshot.states):
            kv.adopt(state, consume)
        self.pos, self.decode_steps = snapshot.pos, snapshot.decode_steps

    def generate(self, prompt, max_new_tokens: int, stop_ids: set[int] | None = None,
                 min_new_tokens: int = 0, query=None) -> list[int]:
        """Greedy decoding (batch 1): returns the new token ids, stopping after a stop token; the
        first `min_new_tokens` tokens are never stop tokens (their logits are masked). `query`:
        fed after the prompt is over (and compressed), before generating."""
        stop_ids = self.engine.stop_token_ids() if stop_ids is None else stop_ids
        return self.answer(self.prefill(prompt), max_new_tokens, stop_ids, min_new_tokens, query)

    def answer(self, logits: torch.Tensor, max_new_tokens: int, stop_ids: set[int],
               min_new_tokens: int = 0, query=None) -> list[int]:
        """`generate` once the prompt is over and compressed: its last logits `(1, 1, V)`."""
        if query:
            logits = self.prefill(query, prompt_ends=False)
        out: list[int] = []
        while True:
            banned = stop_ids if len(out) < min_new_tokens else ()
            token = batching.greedy(logits[0, -1], banned)
            out.append(token)
            if token in stop_ids or len(out) >= max_new_tokens:
                return out
            logits = self.step(token)


@dataclass
class RequestSnapshot:
    pos: int
    decode_steps: int
    states: list[LayerState]  # one KVLayer.fork per layer
