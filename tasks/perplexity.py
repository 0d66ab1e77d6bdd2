"""Perplexity over a text, in two protocols.

* `chunked` (GPTQ / InfiniGen recipe): tokenize once with the tokenizer's defaults, keep the first
  `max_tokens`, cut into non-overlapping windows of `window_tokens`, score each window
  independently with its first token as context only. Each window is a fresh request prefilled
  in `runner.prefill_chunk_tokens` chunks, so a method acts at chunk boundaries only.
* `streaming` (StreamingLLM's eval_long_ppl): feed tokens one at a time through the engine and the
  method, scoring each next token. This is the mode in which eviction methods act on every step.
  Also reports the NLL per `block_tokens` block (a curve).
  With `prefill_tokens=P` the first P tokens are one prompt instead (prefilled, then the prompt
  ends, so methods that compress a prompt once act there) and tokens P.. stream after it; only
  the tokens after the prompt are scored (the first from the prompt's last logit), so a
  prefill-only compressor (SnapKV, ShadowKV, ...) is measured where its compressed cache is read.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from harness.core.progress import progress

from methods.base import KVMethod
from methods.model import ModelInfo
from tasks.base import Task, TaskResult, content_id
from tasks.engine_api import Answer, ScoreStreamRequest, Work
from tasks.text_sources import TEXT_DATASETS, load_text

MODES = ("chunked", "streaming")
DEFAULT_MAX_TOKENS = 1024
# Options read in one mode only (key -> (mode, why)): set in the other they would be ignored.
MODE_ONLY = {
    "window_tokens": ("chunked", "streaming scores one stream, it has no windows"),
    "limit": ("chunked", "a limit on the windows; streaming scores one stream"),
    "block_tokens": ("streaming", "the NLL curve's points; chunked reports per window"),
    "prefill_tokens": ("streaming", "chunked windows are prompts already"),
}


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per position: logits `(T, V)`, targets `(T,)` -> `(T,)` (fp32)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return -logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@dataclass(kw_only=True)
class Perplexity(Task):
    name: ClassVar[str] = "perplexity"
    fidelity: ClassVar[bool] = True
    main_metric: ClassVar[str] = "ppl"
    higher_is_better: ClassVar[bool] = False
    prompt_option: ClassVar[str | None] = "task.prefill_tokens"
    dataset: str = "essays"  # wikitext2 | essays | pg19 | text_file
    path: str | None = None  # a local text file (required for text_file; overrides the default copy)
    data_dir: str | None = None  # folder with local copies (default: ../shared/data)
    mode: str = "streaming"  # chunked | streaming
    max_tokens: int | None = None  # tokens used from the text's start (None: min(1024, max positions))
    window_tokens: int | None = None  # chunked: tokens per window (None: min(1024, max positions))
    block_tokens: int = 256  # streaming mode: tokens per point of the NLL curve
    prefill_tokens: int | None = None  # streaming: the first P tokens as one prompt (None: none)

    @property
    def needs_live_engine(self) -> bool:
        """Chunked windows are each a request of their own, prefilled with every logit; a
        stream is a `ScoreStreamRequest`."""
        return self.mode == "chunked"

    def check_options(self) -> list[str]:
        reasons = []
        if self.dataset not in TEXT_DATASETS:
            reasons.append(f"task.dataset={self.dataset!r}; allowed: {', '.join(TEXT_DATASETS)}")
        if self.mode not in MODES:
            reasons.append(f"task.mode={self.mode!r}; allowed: {', '.join(MODES)}")
        if self.fidelity_tokens and self.mode == "chunked":
            reasons.append(f"task.fidelity_tokens={self.fidelity_tokens} compares a stream token "
                           "by token (task.mode=streaming); task.mode=chunked records none: set "
                           "task.fidelity_tokens=0")
        if self.dataset == "text_file" and not self.path:
            reasons.append("task.dataset=text_file needs task.path=<a UTF-8 text file>")
        for key in ("max_tokens", "window_tokens", "block_tokens"):
            value = getattr(self, key)
            if key in ("max_tokens", "window_tokens") and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 2:
                reasons.append(f"task.{key}={value!r} must be an integer >= 2")
        if self.prefill_tokens is not None:
            if not isinstance(self.prefill_tokens, int) or isinstance(self.prefill_tokens, bool) \
                    or self.prefill_tokens < 1:
                reasons.append(f"task.prefill_tokens={self.prefill_tokens!r} must be an integer "
                               ">= 1 or null")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for key, (mode, why) in MODE_ONLY.items():
            value = getattr(self, key)
            if self.mode in MODES and self.mode != mode and value != defaults[key]:
                reasons.append(f"task.{key}={value!r} applies to task.mode={mode} only ({why}); "
                               f"drop it or set task.mode={mode}")
        if self.path and self.dataset != "text_file" and self.dataset in TEXT_DATASETS:
            reasons.append(f"task.path={self.path} reads a text of your own: use it with "
                           f"task.dataset=text_file (recorded as such); task.dataset="
                           f"{self.dataset} reads its own copy (task.data_dir=<folder> for one "
                           "elsewhere)")
        return reasons

    def validate(self, info: ModelInfo, method: KVMethod) -> list[str]:
        default = min(DEFAULT_MAX_TOKENS, info.max_positions or DEFAULT_MAX_TOKENS)
        self.max_tokens = self.max_tokens or default
        self.window_tokens = self.window_tokens or default
        span = self.window_tokens if self.mode == "chunked" else self.max_tokens
        key = "task.window_tokens" if self.mode == "chunked" else "task.max_tokens"
        bounded = method.bounds_positions() and self.mode == "streaming"
        if span < 2:
            return [f"{key}={span} (from the model's max positions, {info.max_positions}): a "
                    "text of fewer than 2 tokens leaves nothing to score"]
        if info.max_positions and span > info.max_positions and not bounded:
            return [f"{key}={span} is longer than the model's max positions "
                    f"({info.max_positions}); lower it (the text is not truncated for you)"]
        if self.prefill_tokens is not None and self.prefill_tokens >= self.max_tokens - 1:
            return [f"task.prefill_tokens={self.prefill_tokens} leaves nothing to stream: it must "
                    f"be below task.max_tokens - 1 = {self.max_tokens - 1}"]
        return []

    def phases(self) -> frozenset[str]:
        # streaming feeds every token as a decode step (after a prompt of prefill_tokens, if set);
        # chunked prefills each window with all logits
        if self.mode == "chunked":
            return frozenset({"prefill"})
        return frozenset({"decode"} if self.prefill_tokens is None else {"prefill", "decode"})

    def longest_prompt_tokens(self) -> int | None:
        return self.window_tokens if self.mode == "chunked" else None

    def check_data(self) -> None:
        self._text = load_text(self.dataset, self.path, self.data_dir)

    def _tokens(self, engine) -> torch.Tensor:
        text = getattr(self, "_text", None) or load_text(self.dataset, self.path, self.data_dir)
        ids = engine.encode(text)[: self.max_tokens or DEFAULT_MAX_TOKENS]
        needed = (self.prefill_tokens or 0) + 2  # a prompt (or one token), then >= 1 to score
        if len(ids) < needed:
            after = f" after task.prefill_tokens={self.prefill_tokens}" if self.prefill_tokens else ""
            raise ValueError(f"task.dataset={self.dataset}: {len(ids)} tokens, fewer than the "
                             f"{needed} needed to score{after}")
        return torch.tensor(ids, dtype=torch.long)

    def evaluate(self, engine) -> TaskResult:
        if self.mode == "chunked":  # a live engine: each window a request of its own
            ids = self._tokens(engine)
            return self._result(engine, ids, *self._chunked(engine, ids))
        return super().evaluate(engine)

    def requests(self, engine) -> Work:
        """Streaming: the text one `ScoreStreamRequest` (its first `prefill_tokens` a prompt)."""
        ids = self._tokens(engine)
        return Work([ScoreStreamRequest(ids, self.prefill_tokens or 0, token_nll,
                                        fidelity=bool(self.fidelity_tokens))])

    def score(self, engine, work: Work, answers: list[Answer]) -> TaskResult:
        request, answered = work.requests[0], answers[0]
        ids, nll = request.ids, answered.scores
        sample = {"id": 0, **_scored(ids.tolist(), max(request.prompt_tokens, 1), nll)}
        if answered.fidelity is not None:  # every scored token against a full-cache pass
            sample["fidelity"] = answered.fidelity
        return self._result(engine, ids, nll, [sample])

    def _result(self, engine, ids: torch.Tensor, nll: torch.Tensor,
                samples: list[dict]) -> TaskResult:
        mean = float(nll.mean())
        metrics = {"ppl": math.exp(mean), "nll_mean": mean, "tokens_scored": int(nll.numel()),
                   "tokens_used": int(ids.numel())}
        if self.mode == "streaming":
            blocks = nll.split(self.block_tokens)
            metrics["nll_per_block"] = [round(float(b.mean()), 5) for b in blocks]
            metrics["block_tokens"] = self.block_tokens
        protocol = {"mode": self.mode, "dataset": self.dataset, "max_tokens": self.max_tokens,
                    "window_tokens": self.window_tokens if self.mode == "chunked" else None,
                    **({"variant": f"prompt of {self.prefill_tokens} tokens, then streamed"}
                       if self.prefill_tokens else {}),
                    "prefill_tokens": self.prefill_tokens,
                    "bos": bool(engine.tokenizer is not None and
                                getattr(engine.tokenizer, "bos_token_id", None) == int(ids[0]))}
        return TaskResult(metrics=metrics, samples=samples, protocol=protocol)

    def _chunked(self, engine, ids: torch.Tensor) -> tuple[torch.Tensor, list[dict]]:
        windows = [w for w in ids.split(self.window_tokens or DEFAULT_MAX_TOKENS) if w.numel() >= 2]
        if self.limit:
            windows = windows[: self.limit]
        nlls, samples = [], []
        for i, window in enumerate(progress(windows, "perplexity windows", "win")):
            with engine.request() as req:
                logits = req.prefill(window, all_logits=True)[0]
            nll = token_nll(logits[:-1], window[1:].to(logits.device)).cpu()
            nlls.append(nll)
            samples.append({"id": i, **_scored(window.tolist(), 1, nll)})
        return torch.cat(nlls), samples


def _scored(ids: list[int], first: int, nll: torch.Tensor) -> dict:
    """A sample record: its content id (the tokens, from which one scoring starts) and the NLL of
    every scored token, so intervals resample contiguous blocks of them."""
    return {"sample_id": content_id(ids, {"scored_from": first}), "tokens": len(ids),
            "nll_mean": float(nll.mean()), "ppl": math.exp(float(nll.mean())),
            "token_nll": [round(float(x), 6) for x in nll]}
