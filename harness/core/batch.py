"""Batched ragged requests: several sequences prefilled and decoded together, each with its own cache.

Layout. Every sequence owns a complete `MethodCache` (its own `KVLayer` per decoder layer), exactly
the one a batch-1 request would build, so a method keeps per-sequence state with no code of its own
and kept sets may differ in length and content between sequences. The model runs the batch once per
forward (projections, MLPs and the LM head see `(B, T, hidden)`: that is where batching pays); at
each attention layer a `FanOutLayer` routes batch row r to its sequence's `KVLayer`:

* `update`: row r's new K/V `(1, H_kv, n_r, D)` — only its n_r valid rows, never a padding row —
  go to that sequence's layer, which returns what it attends (kept + new), whatever its length;
* `attend`: row r's queries `(1, H_q, n_r, D)` attend over that, with the causal (or sliding)
  mask built for that layer's own sizes, and the method's own `attend` (scores, selection, kernels);
  padding rows' outputs are zeros and nothing downstream reads them.

Prompts are right-padded per chunk; positions are per sequence, so RoPE and masks are those of the
sequence alone and every sequence equals its own batch-1 run (up to float reassociation in the
batched matmuls). A sequence that has finished (stop token, length) leaves the batch: its layers
keep their state but get no more rows.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Callable

import torch

from harness.core import forward
from harness.core import hf_adapter
from harness.core.profiling import Timer
from harness.core.progress import progress
from harness.core.prompting import close_prompt, open_prompt

if TYPE_CHECKING:
    from harness.core.engine import Engine, Request


class Routing:
    """Which sequence each batch row belongs to, and how many of its rows are real, this forward."""

    def __init__(self, caches: list[hf_adapter.MethodCache]):
        self.caches = caches
        self.seqs: list[int] = []  # batch row -> sequence index
        self.valid: list[int] = []  # batch row -> real (non-padding) rows this forward

    def set(self, seqs: list[int], valid: list[int]) -> None:
        self.seqs, self.valid = list(seqs), list(valid)

    def rows(self, layer_idx: int):
        """(batch row, that sequence's KVLayer at `layer_idx`, real rows) for rows with tokens."""
        for r, (s, n) in enumerate(zip(self.seqs, self.valid)):
            if n:
                yield r, self.caches[s].kv_layers[layer_idx], n


class FanOutLayer:
    """Layer `layer_idx` of a batch, presented to the model as one cache layer + attention seam."""

    def __init__(self, layer_idx: int, routing: Routing, mask_for: Callable):
        self.layer_idx, self.routing, self.mask_for = layer_idx, routing, mask_for
        self.next_layer: FanOutLayer | None = None
        self._pending: list[tuple] = []  # per row: (row, layer, n, K, V, kv_length, kv_offset, q_offset)

    # --- cache seam (what `hf_adapter`'s bridge calls) --------------------------------------
    # The model builds one batch mask from these before attention; `attend` never reads it (each
    # row gets its own sequence's mask), so they describe the cheapest one: a plain causal mask
    # over the chunk, which sdpa skips and eager builds as (B, 1, q, q), not (B, 1, q, kv).
    seen_tokens = 0

    def mask_sizes(self, q_len: int) -> tuple[int, int]:
        return q_len, 0

    def update(self, keys: torch.Tensor, values: torch.Tensor, position_ids: torch.Tensor | None):
        """keys/values `(B, H_kv, T, D)`: each row's real rows go to its own sequence's layer."""
        self._pending = []
        for r, kv, n in self.routing.rows(self.layer_idx):
            kv_length, kv_offset = kv.mask_sizes(n)  # before update, as the contract says
            q_offset = kv.seen_tokens
            pos = None if position_ids is None else position_ids[r:r + 1, :n]
            k, v = kv.update(keys[r:r + 1, :, :n], values[r:r + 1, :, :n], pos)
            self._pending.append((r, kv, n, k, v, kv_length, kv_offset, q_offset))
        return keys, values  # attention reads the per-row K/V kept above, not these

    def prefetch(self, hidden: torch.Tensor, position_ids: torch.Tensor | None, ahead: bool) -> None:
        for r, kv, n in self.routing.rows(self.layer_idx):
            pos = None if position_ids is None else position_ids[r:r + 1, :n]
            kv.prefetch(hidden[r:r + 1, :n], pos, ahead)

    def observe_token_ids(self, ids: torch.Tensor) -> None:
        """(B, T): row r's real ids to its sequence's layer (padding never seen)."""
        for r, kv, n in self.routing.rows(self.layer_idx):
            kv.observe_token_ids(ids[r:r + 1, :n])

    def observe_attention_block(self, residual: torch.Tensor, output: torch.Tensor) -> None:
        """(B, T, hidden) each: row r's real rows to its sequence's layer."""
        for r, kv, n in self.routing.rows(self.layer_idx):
            kv.observe_attention_block(residual[r:r + 1, :n], output[r:r + 1, :n])

    # --- attention seam ---------------------------------------------------------------------
    def attend(self, module, query: torch.Tensor, keys, values, attention_mask, base, **kwargs):
        """query `(B, H_q, T, D)` -> output `(B, T, H_q, D)`; row r attends its own sequence only."""
        b, h, t, d = query.shape
        out = query.new_zeros(b, t, h, d)
        for r, kv, n, k, v, kv_length, kv_offset, q_offset in self._pending:
            mask = self.mask_for(base, self.layer_idx, n, kv_length, q_offset, kv_offset, query)
            row_kwargs = {name: _row(value, r, n, b) for name, value in kwargs.items()}
            o, _ = kv.attend(module, query[r:r + 1, :, :n], k, v, mask, base=base, **row_kwargs)
            out[r, :n] = o[0]
        self._pending = []
        return out, None


def _row(value, r: int, n: int, batch: int):
    """Row r's share of a per-row tensor kwarg (e.g. position_ids `(B, T)`); others unchanged."""
    if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] == batch:
        return value[r:r + 1, :n]
    return value


class BatchRequest:
    """Several sequences at once; `generate` is greedy decoding of all of them together."""

    def __init__(self, engine: "Engine", caches: list[hf_adapter.MethodCache], cache):
        self.engine, self.caches, self.cache = engine, caches, cache
        self.routing: Routing = cache.routing
        # one per sequence: its layers and its position (tokens fed so far)
        self.sequences = [forward.BatchSequence(engine, c.kv_layers) for c in caches]
        self.first_token_at: list[float] = []  # perf_counter when each first token was chosen

    @property
    def pos(self) -> list[int]:
        """Tokens fed so far, per sequence."""
        return [seq.pos for seq in self.sequences]

    def _forward(self, seqs: list[int], pieces: list[list[int]], keep: list[int], decode: bool):
        """One batched forward (harness.core.forward): row r feeds `pieces[r]` to sequence `seqs[r]`
        (right-padded). Returns fp32 logits `(B, len(keep), V)` at the (padded) row indices
        `keep`."""
        def compute() -> torch.Tensor:
            width = max(len(p) for p in pieces)
            device = self.engine.device
            ids = torch.zeros(len(pieces), width, dtype=torch.long, device=device)
            positions = torch.zeros(len(pieces), width, dtype=torch.long, device=device)
            for r, (s, p) in enumerate(zip(seqs, pieces)):
                ids[r, :len(p)] = torch.as_tensor(p, dtype=torch.long)
                # padding rows continue the positions (never stored, never attended)
                start = self.sequences[s].pos
                positions[r] = torch.arange(start, start + width)
            self.routing.set(seqs, [len(p) for p in pieces])
            index = torch.as_tensor(keep, dtype=torch.long, device=device)
            return hf_adapter.forward(self.engine.model, ids, positions, self.cache,
                                      logits_to_keep=index)

        return forward.run(compute, [self.sequences[s] for s in seqs], [len(p) for p in pieces],
                           decode, self.engine.timer)[0]

    def prefill(self, prompts: list[list[int]], all_logits: bool = False, prompt_ends: bool = True):
        """Feed every prompt (ragged; one per sequence, possibly empty) in chunks, then tell the
        layers of each sequence that got tokens that its prompt is over (unless `prompt_ends`
        is False: more prompt follows, as `Request.prefill`). Returns each prompt's
        last-row logits `(B, V)` (an empty prompt's row is NaN), or with `all_logits` a list of
        `(len(prompt), V)` per sequence."""
        chunk = self.engine.prefill_chunk()
        seqs = list(range(len(prompts)))
        for s, (cache, prompt) in enumerate(zip(self.caches, prompts)):
            if prompt and prompt_ends:
                open_prompt(cache.kv_layers, self.pos[s] + len(prompt))
        last = [None] * len(prompts)
        rows: list[list[torch.Tensor]] = [[] for _ in prompts]
        forward.begin_step([self.engine], decode=False)
        for start in range(0, max(len(p) for p in prompts), chunk):
            pieces = [p[start:start + chunk] for p in prompts]
            ends = sorted({len(piece) - 1 for piece, p in zip(pieces, prompts)
                           if piece and start + len(piece) == len(p)})
            keep = list(range(max(len(piece) for piece in pieces))) if all_logits else ends or [0]
            logits = self._forward(seqs, pieces, keep, decode=False)
            for s, (piece, p) in enumerate(zip(pieces, prompts)):
                if all_logits:
                    rows[s].append(logits[s, :len(piece)])
                elif piece and start + len(piece) == len(p):
                    last[s] = logits[s, ends.index(len(piece) - 1)]
        self.engine.prefill_tokens += sum(len(p) for p in prompts)
        for cache, prompt in zip(self.caches, prompts):
            if prompt and prompt_ends:
                close_prompt(self.engine, cache.kv_layers)
        if all_logits:
            return [torch.cat(r) if r else torch.empty(0) for r in rows]
        vocab = next(x for x in last if x is not None).shape[-1]
        nan = torch.full((vocab,), float("nan"), device=self.engine.device)
        return torch.stack([nan if x is None else x for x in last])

    def step(self, seqs: list[int], tokens: list[int]) -> torch.Tensor:
        """One decode step for the sequences `seqs`: logits `(len(seqs), V)`."""
        forward.begin_step([self.engine], decode=True)
        logits = self._forward(seqs, [[t] for t in tokens], [0], decode=True)[:, 0]
        self.engine.decode_tokens += len(seqs)
        return logits

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int],
                 stop_ids: set[int], min_new_tokens: int = 0,
                 finished: Callable[[int, list[int]], bool] | None = None,
                 queries: list[list[int]] | None = None) -> list[list[int]]:
        """Greedy decoding of every prompt together; a sequence leaves the batch after a stop
        token, at its `max_new_tokens`, or when `finished(sequence, its new ids)` says so (e.g. a stop
        string). The first `min_new_tokens` tokens are never stop tokens (stop logits masked).
        `queries[i]`: fed after prompt i is over (and compressed), before generating."""
        logits = self.prefill(prompts)
        if queries is not None:
            if not all(queries):
                raise ValueError("every query of a query-agnostic batch needs at least one token")
            logits = self.prefill(queries, prompt_ends=False)
        outs: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        while active:
            tokens, keep = greedy_rows(logits, active, outs, stop_ids, min_new_tokens,
                                       max_new_tokens, finished)
            if not self.first_token_at:  # greedy() read the logits back: the step is done
                self.first_token_at = [time.perf_counter()] * len(prompts)
            if not keep:
                break
            active = [active[r] for r in keep]
            logits = self.step(active, [tokens[r] for r in keep])
        return outs


def batch_cache(caches: list[hf_adapter.MethodCache], info) -> hf_adapter.BatchCache:
    """One cache over the sequences' own caches: a `FanOutLayer` per decoder layer routing each
    batch row to its sequence's layer, with that sequence's own mask."""
    routing = Routing(caches)
    mask_for = functools.partial(hf_adapter.sequence_mask, info)
    fan_out = [FanOutLayer(i, routing, mask_for) for i in range(info.num_layers)]
    return hf_adapter.BatchCache(caches, fan_out, routing)


def greedy_rows(logits, active: list[int], outs: list[list[int]], stop_ids: set[int],
                min_new_tokens: int, limits: list[int],
                finished: Callable[[int, list[int]], bool] | None = None
                ) -> tuple[list[int], list[int]]:
    """One greedy step of the sequences `active` (row r of `logits` is sequence active[r]):
    each gets its token appended to `outs`; returns (the tokens, the rows that go on: no stop
    token, under their limit, not `finished(sequence, its new ids)`)."""
    tokens = [greedy(logits[r], stop_ids if len(outs[s]) < min_new_tokens else ())
              for r, s in enumerate(active)]
    for s, token in zip(active, tokens):
        outs[s].append(token)
    keep = [r for r, s in enumerate(active)
            if outs[s][-1] not in stop_ids and len(outs[s]) < limits[s]
            and not (finished and finished(s, outs[s]))]
    return tokens, keep


def decode_requests(requests: list["Request"], logits: list[torch.Tensor], limits: list[int],
                    stop_ids: set[int], min_new_tokens: int = 0) -> list[list[int]]:
    """Greedy decoding of independent requests, one batched forward per step (a sweep's settings
    decoded together, harness.sweep.execute). Each request keeps its own engine (method, tier,
    budget checks, accounting): its layers, position and figures advance exactly as its own
    `Request.answer` would advance them, except that each step's time is the batched step's,
    counted once by every request in it. `logits[i]`: request i's last logits `(V,)` once its
    prompt (and query) is fed. A request leaves the batch after a stop token or at its limit."""
    steps = Lockstep(requests)
    outs: list[list[int]] = [[] for _ in requests]
    active, rows = list(range(len(requests))), list(logits)
    while True:
        tokens, keep = greedy_rows(rows, active, outs, stop_ids, min_new_tokens, limits)
        if not keep:
            return outs
        active, tokens = [active[r] for r in keep], [tokens[r] for r in keep]
        rows = list(steps.step(active, tokens))


def stream_requests(requests: list["Request"], ids: torch.Tensor, prompt_tokens: int,
                    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`Request.stream_scores` for every request at once: the same token stream `ids` `(T,)`
    teacher-forced through each request's own method and cache, one batched forward per step
    (a sweep's settings scored together on one text). Each request must have been opened with
    `final_tokens=T` and nothing fed; a prompt of `prompt_tokens` tokens is prefilled by each
    request alone (every forward binds its own cache, hf_adapter.forward). Returns
    `(len(requests), T - max(prompt_tokens, 1))` scores."""
    first = max(prompt_tokens, 1)
    out = torch.empty(len(requests), ids.numel() - first)
    device = requests[0].engine.device
    if prompt_tokens:
        target = ids[prompt_tokens:prompt_tokens + 1].to(device)
        for r, req in enumerate(requests):
            out[r, 0] = score(req.prefill(ids[:prompt_tokens].to(device))[0, -1:], target)[0]
    steps = Lockstep(requests)
    everyone = list(range(len(requests)))
    for t in progress(range(prompt_tokens, ids.numel() - 1),
                      f"streaming perplexity, {len(requests)} settings", "tok"):
        rows = steps.step(everyone, [int(ids[t])] * len(requests))
        out[:, t + 1 - first] = score(rows, ids[t + 1:t + 2].to(device).expand(len(requests)))
    return out


class Lockstep:
    """Decode steps of independent open requests as one batched forward: each request's
    position, layers, budget checks and accounting advance as its own `Request.step` would
    advance them; each step's time is the batched step's, counted once by every request in it."""

    def __init__(self, requests: list["Request"]):
        self.requests = requests
        self.lead = requests[0].engine
        self.cache = batch_cache([req.cache for req in requests], self.lead.info)
        self.timer = Timer(self.lead.device)

    def step(self, active: list[int], tokens: list[int]) -> torch.Tensor:
        """Feed `tokens[r]` to request `active[r]`; returns logits `(len(active), V)` (fp32)."""
        device = self.lead.device
        fed = [self.requests[s] for s in active]
        forward.begin_step([req.engine for req in fed], decode=True)
        ids = torch.as_tensor([[t] for t in tokens], dtype=torch.long, device=device)
        positions = torch.as_tensor([[req.pos] for req in fed], dtype=torch.long, device=device)
        self.cache.routing.set(active, [1] * len(active))
        out, _ = forward.run(lambda: hf_adapter.forward(self.lead.model, ids, positions,
                                                        self.cache, logits_to_keep=1),
                             fed, [1] * len(fed), decode=True, timer=self.timer)
        rows = out[:, 0]  # (len(active), V)
        step_ms = self.timer.values("decode")[-1]
        for req in fed:
            req.decode_steps += 1
            req.engine.decode_tokens += 1
            req.engine.timer.add("decode", [step_ms])
        return rows


def greedy(logits: torch.Tensor, banned=()) -> int:
    """argmax of `(V,)` logits, with `banned` ids excluded."""
    if banned:
        logits = logits.clone()
        logits[torch.as_tensor(sorted(banned), dtype=torch.long, device=logits.device)] = float("-inf")
    return int(logits.argmax())
