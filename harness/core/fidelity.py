"""Paired fidelity per sample (`task.fidelity_tokens` = K > 0): how far a setting's next-token
distributions lie from the full cache's on the same sample, a finer signal than a greedy answer's
pass/fail.

For every sample of a generating task:
  * the reference continuation: the full cache's greedy continuation of the same prompt and query,
    its first K tokens (up to and including a stop token; the task's stop ids and
    `min_new_tokens`);
  * those tokens teacher-forced through the setting's cache from its state after the prompt and
    query: per token KL(full || setting) of the next-token distributions (float64 log-softmax of
    the float32 logits) and whether the two distributions' top tokens agree;
  * where the sample has a gold answer (the task's `gold` token ids, its first K tokens), the mean
    log-probability per token of those tokens under the setting and under the full cache, each
    teacher-forced from the state after the prompt and query.
A token stream (streaming perplexity) is compared token by token with a full-cache pass on the
same stream, stepped alongside it.

None of this is a sample of the setting: it runs after the task's answers, through an engine of
its own (the setting's method, runner settings and model: `quiet_engine`), whose time, tokens and
KV figures are never the setting's; its forwards are timed there, as `fidelity_ms`. In a sweep
it runs in the answers' pass, prompt by prompt: each setting's fidelity request starts from the
prompt state its answer started from (its group's shared prefill, harness.sweep.execute), so the
prompt's forward runs once per sample for the answers and the fidelity of all settings;
`fidelity_ms` then counts what ran on the setting's fidelity engine, without that shared
forward, and the sweep's process-wide memory figure includes the fidelity requests. The full
cache's reference is computed once per sample and model and kept for the run (a sweep's settings
share it): its K logit rows (K x vocabulary float32) per sample.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from harness.core import batch as batching
from harness.core.progress import progress
from tasks.engine_api import FidelityItem

# Per model: (sample key) -> Reference. Weak: a model's references go with it.
_REFERENCES: "weakref.WeakKeyDictionary[Any, dict[tuple, Reference]]" = weakref.WeakKeyDictionary()
KL_DIGITS = 8  # per-token KL kept in samples.jsonl to this many decimals


@dataclass
class Reference:
    """The full cache on one sample."""
    tokens: list[int]  # its greedy continuation, first K tokens
    logits: torch.Tensor  # (len(tokens), V) float32: the distribution before each token
    gold_logprob: float | None  # mean log-probability per gold token


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """(N, V) float64 log-softmax."""
    return torch.log_softmax(logits.double(), dim=-1)


def kl(full_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """(N,) KL(full || setting) in nats from (N, V) logit rows of each."""
    full, other = log_probs(full_logits), log_probs(logits.to(full_logits.device))
    return (full.exp() * (full - other)).sum(dim=-1).clamp(min=0)


def top_agree(full_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """(N,) bool: the two distributions' most likely tokens are the same."""
    return full_logits.argmax(dim=-1) == logits.to(full_logits.device).argmax(dim=-1)


def quiet_engine(engine):
    """An engine with `engine`'s model, method and runner settings whose accounting is its own
    (nothing it runs is a sample of `engine`); one per engine, made once."""
    made = engine.fidelity_quiet
    if made is None:  # (harness.core.engine.Engine, by the engine's type: engine imports this module)
        # one request at a time: no batch, no admission under a device limit (where a batch's
        # requests wait), no diagnostics shadow; what a layer computes is the setting's own
        settings = dataclasses.replace(engine.settings, diagnostics_every=0, batch_size=1,
                                       kv_device_limit_mib=None, kv_admission="request")
        made = type(engine)(engine.model, engine.tokenizer, engine.method, engine.info, settings)
        engine.fidelity_quiet = made
    return made


def full_engine(engine):
    """The full cache on `engine`'s model (dense prefill in the same chunks), one per engine."""
    from methods import build_method

    made = engine.fidelity_full
    if made is None:  # the engine's settings class at its defaults (contiguous, no offload)
        settings = type(engine.settings)(
            prefill_chunk_tokens=engine.settings.prefill_chunk_tokens, check_budget=False)
        made = type(engine)(engine.model, engine.tokenizer, build_method("full"), engine.info,
                            settings)
        engine.fidelity_full = made
    return made


def hold_peak(engine) -> None:
    """Record `engine`'s peak memory before its first fidelity forward: metrics.json's `memory`
    is the task's own (`task_peak_memory`), not the fidelity pass's."""
    from harness.core.profiling import peak_memory

    if not engine.fidelity_peak_held:
        engine.fidelity_peak, engine.fidelity_peak_held = peak_memory(engine.device), True


def task_peak_memory(engine) -> dict[str, Any] | None:
    """The peak memory `hold_peak` recorded (None: no fidelity pass ran on `engine`)."""
    return engine.fidelity_peak


def fidelity_ms(engine) -> float:
    """Milliseconds the fidelity forwards of `engine`'s setting took (its own and the references
    it computed)."""
    total = 0.0
    for made in (engine.fidelity_quiet, engine.fidelity_full):
        if made is not None:
            total += sum(made.timer.values("prefill")) + sum(made.timer.values("decode"))
    return total


def prompt_state(req, item: FidelityItem) -> torch.Tensor:
    """Feed the prompt (its end compresses it) and the query; the last logits `(1, 1, V)`."""
    logits = req.prefill(item.prompt)
    if item.query:
        logits = req.prefill(item.query, prompt_ends=False)
    return logits


# How a fidelity request gets its prompt state: (open request, item) -> the last logits
# (1, 1, V) after the prompt (compressed at its end) and the query. A run feeds the prompt
# (`prompt_state`); a sweep hands each setting its group's shared prompt state, as its answers
# got it (harness.sweep.execute).
Start = Callable[[Any, FidelityItem], torch.Tensor]


def forced(req, logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Teacher-force `tokens` from `logits` (1, 1, V), the distribution before the first:
    returns (len(tokens), V), the distribution before each (the last token is never fed)."""
    rows = [logits[0, -1]]
    for token in tokens[:-1]:
        rows.append(req.step(token)[0, -1])
    return torch.stack(rows).float()


def gold_logprob(rows: torch.Tensor, gold: list[int]) -> float:
    """Mean log-probability per token of `gold` under (len(gold), V) logit rows."""
    picked = log_probs(rows).gather(-1, torch.as_tensor(gold, device=rows.device)[:, None])
    return float(picked.mean())


def sample_key(engine, item: FidelityItem, tokens: int, stop_ids: set[int],
               min_new_tokens: int) -> tuple:
    """One sample's fidelity as asked of `engine`'s model (its reference's key too)."""
    return (engine.settings.prefill_chunk_tokens, tuple(item.prompt), tuple(item.query or ()),
            tuple(item.gold or ()), tokens, tuple(sorted(stop_ids)), min_new_tokens)


def reference(engine, item: FidelityItem, tokens: int, stop_ids: set[int], min_new_tokens: int = 0
              ) -> Reference:
    """The full cache's reference on `item` (computed once per sample and model)."""
    cache = _REFERENCES.setdefault(engine.model, {})
    key = sample_key(engine, item, tokens, stop_ids, min_new_tokens)
    if key not in cache:
        cache[key] = _compute_reference(full_engine(engine), item, tokens, stop_ids,
                                        min_new_tokens)
    return cache[key]


def _compute_reference(full, item: FidelityItem, tokens: int, stop_ids: set[int],
                       min_new_tokens: int) -> Reference:
    with full.request() as req:
        start = prompt_state(req, item)
        snapshot = req.snapshot() if item.gold else None  # the full cache always forks
        logits, out, rows = start, [], []
        while True:
            row = logits[0, -1].float()
            rows.append(row)
            out.append(batching.greedy(row, stop_ids if len(out) < min_new_tokens else ()))
            if out[-1] in stop_ids or len(out) >= tokens:
                break
            logits = req.step(out[-1])
        gold = None
        if item.gold:
            req.restore(snapshot, consume=True)
            gold = gold_logprob(forced(req, start, item.gold), item.gold)
    return Reference(out, torch.stack(rows), gold)


def sample_fidelity(engine, item: FidelityItem, ref: Reference, start: Start = prompt_state
                    ) -> dict[str, Any]:
    """The setting's fidelity on one sample against the full cache's reference `ref`."""
    quiet = quiet_engine(engine)
    with quiet.request() as req:
        start_logits = start(req, item)
        snapshot = req.snapshot() if item.gold else None
        rows = forced(req, start_logits, ref.tokens)
        gold = None
        if item.gold and snapshot is not None:
            req.restore(snapshot, consume=True)
            gold = gold_logprob(forced(req, start_logits, item.gold), item.gold)
    if item.gold and gold is None:  # an unforkable state: the prompt again
        gold = gold_alone(engine, item, start)
    return record(ref, rows, gold)


def gold_alone(engine, item: FidelityItem, start: Start = prompt_state) -> float:
    """The setting's mean gold log-probability on `item` from a prompt state of its own (where
    the state after the reference tokens cannot be rewound)."""
    with quiet_engine(engine).request() as req:
        logits = start(req, item)
        return gold_logprob(forced(req, logits, item.gold), item.gold)


def record(ref: Reference, rows: torch.Tensor, gold: float | None) -> dict[str, Any]:
    """A sample's `fidelity` record from the setting's (n, V) rows on the reference tokens."""
    return measured(kl(ref.logits, rows), top_agree(ref.logits, rows), gold, ref.gold_logprob)


def measured(per_token: torch.Tensor, agree: torch.Tensor, gold: float | None,
             gold_full: float | None) -> dict[str, Any]:
    """A `fidelity` record from per-token KL (n,) and top-token agreement (n,) bool."""
    return {"tokens": int(per_token.numel()), "kl_mean": float(per_token.mean()),
            "kl_max": float(per_token.max()), "top_agree_ratio": float(agree.double().mean()),
            "gold_logprob": gold, "gold_logprob_full": gold_full,
            "kl": [round(float(x), KL_DIGITS) for x in per_token],
            "top_agree": [bool(x) for x in agree]}


def fidelity_many(engine, items: list[FidelityItem], tokens: int, stop_ids: set[int] | None = None,
                  min_new_tokens: int = 0) -> list[dict[str, Any]]:
    """One `fidelity` record per item (Engine.fidelity_many)."""
    hold_peak(engine)
    stop_ids = engine.stop_token_ids() if stop_ids is None else set(stop_ids)
    return [sample_fidelity(engine, item, reference(engine, item, tokens, stop_ids,
                                                    min_new_tokens))
            for item in progress(items, "fidelity", "sample", total=len(items))]


class StreamTally:
    """Per-token KL and agreement of a stream, accumulated as the rows come (a long stream's
    logits are never held)."""

    def __init__(self):
        self.kl: list[torch.Tensor] = []
        self.agree: list[torch.Tensor] = []

    def add(self, full_row: torch.Tensor, row: torch.Tensor) -> None:
        """One position: (V,) logits of the full cache and of the setting."""
        self.kl.append(kl(full_row[None], row[None])[0])
        self.agree.append(top_agree(full_row[None], row[None])[0])

    def record(self) -> dict[str, Any]:
        return measured(torch.stack(self.kl), torch.stack(self.agree), None, None)


def stream_fidelity(engine, ids: torch.Tensor, prompt_tokens: int) -> dict[str, Any]:
    """A token stream `ids` (T,) as `Engine.stream_scores` feeds it, through the setting and a
    full cache stepped alongside: the record of every scored token (T - max(prompt_tokens, 1))."""
    hold_peak(engine)
    quiet, full = quiet_engine(engine), full_engine(engine)
    final = int(ids.numel())
    tally = StreamTally()
    with contextlib.ExitStack() as stack:
        req = stack.enter_context(quiet.request(final_tokens=final))
        ref = stack.enter_context(full.request(final_tokens=final))
        ids = ids.to(engine.device)
        if prompt_tokens:
            tally.add(ref.prefill(ids[:prompt_tokens])[0, -1].float(),
                      req.prefill(ids[:prompt_tokens])[0, -1].float())
        for t in range(prompt_tokens, final - 1):
            tally.add(ref.step(ids[t:t + 1])[0, -1].float(), req.step(ids[t:t + 1])[0, -1])
    return tally.record()
